"""A fifth new user's misuse of the ``nasdiag`` CLI: what rounds 1-4 (test_cli_errors.py, test_cli_search_misuse.py,
test_cli_plot_misuse.py, test_cli_misuse_round3.py, test_cli_misuse_round4.py) did not cover. Every mistake is one
line on stderr, exit code 2, and leaves the folder as it was (`refused` compares sha256s); a run that fails after it
began recording keeps its record readable and resumable."""

from __future__ import annotations

import shlex

import pytest
import torch

from nasdiag.cli import main
from test_cli_errors import TINY
from test_cli_plot_misuse import refused, snapshot  # noqa: F401 (used below)


def _search(out, *extra):
    return ["search", *TINY, "--out", str(out), *extra]


# -- names: a near miss is named -------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,hint", [
    (["--method", "DARTS"], "unknown method 'DARTS'; did you mean 'darts'?"),
    (["--method", "dart"], "unknown method 'dart'; did you mean 'darts'?"),
    (["--dataset", "Digits"], "did you mean 'digits'?"),
    (["--norm", "Batch"], "did you mean 'batch'?"),
    (["--order", "RELU-conv-bn"], "did you mean 'relu-conv-bn'?"),
    (["--hp", "W_lr=0.1"], "unknown hyperparameter 'W_lr' for method 'darts'; did you mean 'w_lr'?"),
    (["--hp", "w-lr=0.1"], "did you mean 'w_lr'?"),
    (["--diagnostics", "Cost"], "unknown diagnostics 'Cost'; did you mean 'cost'?"),
    (["--device", "CPU"], "unknown device 'CPU'; did you mean 'cpu'?"),
    (["--method", "sparsenas", "--hp", "optimizer=AdamHAPG"], "did you mean 'adamhapg'?"),
    (["--method", "bayesnas", "--hp", "hessian_mode=GGN"], "did you mean 'ggn'?"),
])
def test_a_misspelt_name_names_the_near_miss(extra, hint, tmp_path, capsys):
    """``--method DARTS`` listed the nine methods but not the one meant (``--hessian-mode Exact`` names it)."""
    refused(_search(tmp_path / "run.h5", *extra), tmp_path, hint, capsys)


def test_a_name_with_no_near_miss_only_lists_the_choices(tmp_path, capsys):
    line = refused(_search(tmp_path / "run.h5", "--method", "nope"), tmp_path, "unknown method 'nope'; available:", capsys)
    assert "did you mean" not in line


# -- out of memory during training -----------------------------------------------------------------------------
def _fail_at(monkeypatch, name: str, at: int, error: BaseException):
    """Make the darts method's ``name`` raise ``error`` on its ``at``-th call."""
    from nasdiag.search.registry import get_method

    cls = get_method("darts")
    original, calls = getattr(cls, name), []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise error
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, failing)


@pytest.mark.parametrize("where,at,error,diagnostics,needles,kept", [
    ("step", 3, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), "none",
     ["in the training step at step 3 (epoch 1, batch size 240", "lower --batch-size, --C or --layers"], 2),
    ("evaluate", 1, RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"), "none",
     ["in the search-val evaluation", "lower --C or --layers"], 1),
    ("diagnostics", 2, MemoryError(), "none", ["in the epoch's diagnostics", "a cheaper --hessian-mode"], 3),
])
def test_out_of_memory_during_training_keeps_a_resumable_record(where, at, error, diagnostics, needles, kept, tmp_path,
                                                                 capsys, monkeypatch):
    """Running out of memory in a step, the evaluation or the diagnostics (torch's CUDA error, its CPU allocator's
    RuntimeError, Python's MemoryError; not while building) was a traceback; now one line says where and what to
    lower, and the command that resumes the record, which keeps every step before the failure."""
    from nasdiag.record import load

    out = tmp_path / "my runs" / "run.h5"
    argv = _search(out, "--epochs", "2", "--diagnostics", diagnostics)
    _fail_at(monkeypatch, where, at, error)
    code = main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    for needle in ["ran out of memory on cpu", *needles, f"keeps steps 1 to {kept}", "--resume"]:
        assert needle in lines[0], lines[0]
    assert list(load(str(out))["step"]) == list(range(1, kept + 1))  # readable, nothing half-written
    monkeypatch.undo()
    resume = shlex.split(lines[0].split(": nasdiag ", 1)[1])  # the printed command, through a shell's quoting
    assert resume == [*argv, "--resume"]
    assert main(resume) == 0
    capsys.readouterr()
    assert list(load(str(out))["step"]) == [1, 2, 3, 4]


def test_out_of_memory_of_a_forced_run_resumes_without_force(tmp_path, capsys, monkeypatch):
    """The printed command must not carry --force (with --resume: 'contradict each other'; alone: the record lost)."""
    out = tmp_path / "run.h5"
    _fail_at(monkeypatch, "step", 2, torch.OutOfMemoryError("CUDA out of memory"))
    assert main(_search(out, "--forc")) == 2  # argparse takes the unique prefix
    line = capsys.readouterr().err.strip()
    assert line.endswith(shlex.join(_search(out, "--resume"))), line


# -- hyperparameters past any sensible bound -------------------------------------------------------------------
@pytest.mark.parametrize("extra,needle", [
    (["--method", "asmnas", "--hp", "attention_hidden=1025"], "attention_hidden=1025 is out of range; it must be <= 1024"),
    (["--method", "asmnas", "--hp", "attention_hidden=99999999999999999999999"], "it must be <= 1024"),
    (["--method", "bayesnas", "--hp", "update_every=100000000000000000000000"],
     "update_every=100000000000000000000000 is more than the run's 2 steps (1 epochs × 2 per epoch), so it would never act; "
     "give update_every <= 2"),
    (["--method", "bayesnas", "--hp", "update_every=3"], "give update_every <= 2"),
    (["--method", "bayesnas", "--hp", "hessian_mode=hutchinson:99999999999999999999"],
     "hyperparameter hessian_mode 'hutchinson:99999999999999999999' asks for 99999999999999999999 Hessian-vector products"),
    (["--diagnostics", "hessian", "--hessian-mode", "hutchinson:1025"], "give at most hutchinson:1024, or exact"),
])
def test_hyperparameters_past_their_bound(extra, needle, tmp_path, capsys):
    """``update_every`` past the run's steps silently never updated; ``attention_hidden=10**9`` ran out of memory,
    ``hutchinson:<k>`` past 64 bits trained a whole epoch, then ended in torch's overflow traceback."""
    refused(_search(tmp_path / "run.h5", *extra), tmp_path, needle, capsys)  # a second --diagnostics wins

