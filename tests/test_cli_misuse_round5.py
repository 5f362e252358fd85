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
    if where == "diagnostics":  # resumes as after a failed evaluation (the epoch's last step held back): time saved
        return
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



def test_a_method_built_past_floating_point_is_one_line(tmp_path, capsys):
    """``init_gamma=1e300`` (float32 overflow) and ``reward_bound=1e-300`` (L² underflows to 0 in eq 4's η*) were
    a RuntimeError and a ZeroDivisionError traceback from the method's build; ``reward_bound=1e-320`` still is
    unbuildable (η* past float64)."""
    # a value past the dtype's largest is refused before the build, naming it (runner._check_representable)
    refused(_search(tmp_path / "run.h5", "--method", "bayesnas", "--hp", "init_gamma=1e300"), tmp_path,
            ["hyperparameter init_gamma=1e+300 of method 'bayesnas' is larger than float32 holds"], capsys)
    # since round 10, eq 4's eta* is computed in log space where T L² leaves the float range (1e-300 now builds: the
    # float64 forecasters play eta* ≈ 1e300 times rewards ≈ 1e-300); an eta* past float64 itself is one line
    refused(_search(tmp_path / "run.h5", "--method", "xnas", "--hp", "reward_bound=1e-320"), tmp_path,
            ["eta* = sqrt(2 ln N / (T L^2)) is inf", "L = 1e-320", "rescale the rewards so that L is nearer 1"], capsys)


def test_methods_lists_the_ranges_and_takes_method_names(capsys):
    """``nasdiag methods darts`` was "unrecognized arguments"; a refused value's range was nowhere to be read."""
    assert main(["methods", "asmnas", "bayesnas"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("asmnas:") and "\nbayesnas:" in out and "\ndarts:" not in out
    assert "attention_hidden: int = 16" in out and "(range [1, 1024])" in out
    assert "(range >= 0; at most the run's steps)" in out  # update_every
    assert main(["methods", "darts"]) == 0 and "(range [0, 1))" in capsys.readouterr().out  # alpha_betas


def test_methods_with_a_misspelt_name(tmp_path, capsys):
    refused(["methods", "Darts"], tmp_path, "unknown method 'Darts'; did you mean 'darts'? available: asmnas", capsys)


# -- paths and records ---------------------------------------------------------------------------------------
def test_out_dash_is_not_standard_output(tmp_path, capsys, monkeypatch):
    """``--out -`` wrote a record named '-' into the current folder."""
    monkeypatch.chdir(tmp_path)
    refused(["search", *TINY, "--out", "-"], tmp_path, "--out - would name a record file '-'", capsys)


@pytest.fixture
def foreign_record(tmp_path):
    """A record that a user's own training loop wrote through `nasdiag.record.Recorder`."""
    from nasdiag.record import Recorder

    with Recorder(str(tmp_path / "mine.h5"), meta={"method": "my-loop", "op_names": ["a", "b"]}) as rec:
        for step in (1, 2, 3):
            rec.log(step, {"scalars/train_loss": 1.0 / step})
    return tmp_path / "mine.h5"


@pytest.mark.parametrize("flag", ["--force", "--resume"])
def test_a_record_of_another_program_is_never_replaced(foreign_record, flag, tmp_path, capsys):
    """``--force`` silently replaced a record written by the user's own loop (a nasdiag record, but not of a search);
    ``--resume`` called its (never written) checkpoint missing and suggested --force."""
    refused(_search(foreign_record, flag), tmp_path,
            ["mine.h5 was written by another program", "method 'my-loop'", "not even with --force; choose another --out"],
            capsys)


def test_a_second_interrupt_while_exiting_ends_the_command_at_once(tmp_path, capsys, monkeypatch):
    """A second Ctrl-C while the interrupted command exits printed a traceback from one of torch's exit handlers:
    once the interrupt is handled (record closed, line printed) the command restores the default action."""
    import signal
    import sys

    import nasdiag.search

    def interrupted(config, callbacks=()):
        raise KeyboardInterrupt

    monkeypatch.setattr(nasdiag.search, "run", interrupted)
    monkeypatch.setattr(sys, "argv", ["nasdiag", *_search(tmp_path / "run.h5")])
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert main([*sys.argv[1:]]) == 130 and signal.getsignal(signal.SIGINT) is previous  # a Python caller's stays
        assert main() == 130
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(capsys.readouterr().err.strip().splitlines()) == 2


# -- environment ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("env,needle", [
    ({"RANK": "1"}, "RANK='1' is set but WORLD_SIZE is not above 1: a single process would record nothing"),
    ({"RANK": "abc"}, "RANK='abc' is set but WORLD_SIZE is not above 1"),
    ({"LOCAL_WORLD_SIZE": "abc"}, "LOCAL_WORLD_SIZE='abc' is not an integer"),
])
def test_a_stray_launcher_variable_is_one_line(env, needle, tmp_path, capsys, monkeypatch):
    """A leftover ``RANK=1`` (no torchrun) made the single process think it was not rank 0: the whole search ran,
    recorded nothing and printed nothing, exit 0; ``RANK=abc`` ran the search, then a ValueError traceback;
    ``LOCAL_WORLD_SIZE=abc`` a traceback (it sizes the default --threads)."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = _search(tmp_path / "run.h5")
    del argv[argv.index("--threads"):argv.index("--threads") + 2]  # the default thread count reads LOCAL_WORLD_SIZE
    refused(argv, tmp_path, needle, capsys)


def test_a_full_disk_during_training_says_what_the_record_keeps(tmp_path, capsys, monkeypatch):
    """A disk that filled up at an epoch end said only "cannot write checkpoint ...: disk full", as if the run were
    lost: the record keeps its steps and resumes once there is space, and the line says so with the command."""
    import errno

    from nasdiag.record import load

    saves, save = [], torch.save

    def full_disk(*args, **kwargs):
        saves.append(1)
        if len(saves) == 3:  # the checkpoint of epoch 1 (after the one of step 0 and of epoch 0)
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "run.h5"
    argv = _search(out, "--epochs", "2")
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "disk full" in lines[0], lines
    assert f"the record {out} keeps steps 1 to 4: fix that and continue it with the same settings: nasdiag " in lines[0]
    assert list(load(str(out))["step"]) == [1, 2, 3, 4]
    monkeypatch.undo()
    assert main(shlex.split(lines[0].split(": nasdiag ", 1)[1])) == 0
    capsys.readouterr()
    assert list(load(str(out))["step"]) == [1, 2, 3, 4]


@pytest.mark.parametrize("extra,needle", [
    (["--steps", "1000"], "steps 1000 is too large: a cell of 1000 nodes has 501500 edges of every op; give at most 32"),
    (["--layers", "100000"], "layers 100000 is too large: give at most 512 cells"),
])
def test_a_supernet_shape_that_would_fill_the_memory(extra, needle, tmp_path, capsys):
    """``--steps 1000`` / ``--layers 100000`` built millions of small modules for minutes until the machine's memory
    was full (no single allocation failed, so it was never the one-line "does not fit" of round 4)."""
    refused(_search(tmp_path / "run.h5", *extra), tmp_path, needle, capsys)


def test_an_interrupt_prints_the_command_that_resumes(tmp_path, capsys, monkeypatch):
    """Ctrl-C said "continue with --resume": a user who had passed --force, added --resume to it and was refused
    (they contradict each other); the line now holds the command, without --force, quoted for a shell."""
    import nasdiag.search

    def interrupted(config, callbacks=()):
        with open(config.record, "ab") as record:  # --force replaced it (else: "run the command again", round 9)
            record.write(b" (replaced)")
        raise KeyboardInterrupt

    monkeypatch.setattr(nasdiag.search, "run", interrupted)
    out = tmp_path / "my run's" / "run.h5"
    out.parent.mkdir()
    out.write_bytes(b"stands in for the record of this run")
    assert main(_search(out, "--force")) == 130
    line = capsys.readouterr().err.strip()
    assert "the record holds every completed step: continue it with nasdiag " in line, line
    assert shlex.split(line.split("continue it with nasdiag ", 1)[1]) == _search(out, "--resume")
