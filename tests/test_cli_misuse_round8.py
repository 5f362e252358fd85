"""An eighth new user's misuse of the ``nasdiag`` CLI and of the batch scripts: what rounds 1-7 (test_cli_errors.py,
test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..7.py) did not cover: a command started with
standard error closed (``2>&-``), an empty ``RANK`` variable, options after ``--``, ``--out -`` for plot and report, a
folder where the checkpoint goes, a refused resume that also warned it extends the run, and the batch scripts' number
and list options (nan, inf, zero, negative, odd --C, a word, an empty list, 1e400, 100000 workers) and ``--plot-only``
without a record. Every mistake is one line on stderr, exit code 2, and leaves the folder as it was (`snapshot`
compares sha256s)."""

from __future__ import annotations

import os
import sys

import pytest

from nasdiag.cli import main
from test_cli_errors import TINY
from test_cli_misuse_round7 import test_a_script_argument_is_refused_in_one_line_before_any_work as script_refused
from test_cli_plot_misuse import rec, refused, snapshot, source  # noqa: F401 (fixtures)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))

WITH_PROGRESS = [t for t in TINY if t != "--no-progress"]  # the bar is what wrote to the closed stream


def _closed(kind: str, tmp_path):
    """What `sys.stderr` is when the command starts with standard error closed: None (CPython, fd 2 closed), or a
    stream on a descriptor that is not open for writing (a launcher's file took number 2: pyenv's shim script)."""
    if kind == "none":
        return None
    (tmp_path / "launcher").write_text("#!/bin/sh\n")
    return open(tmp_path / "launcher")  # read-only: os.write on it is EBADF, as on the shim's descriptor


# -- standard error closed ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["none", "read-only"])
def test_a_search_with_standard_error_closed_runs_to_the_end(kind, tmp_path, monkeypatch, capsys):
    """``nasdiag search ... 2>&-`` failed at the progress bar's first write (AttributeError on None, EBADF on the
    read-only descriptor), then again printing the error line: exit code 1, nothing said, and a record of no rows
    and a checkpoint left behind, so the same command was then refused ("a record already exists")."""
    from nasdiag.record import load

    out = tmp_path / "run.h5"
    stream = _closed(kind, tmp_path)
    monkeypatch.setattr(sys, "stderr", stream)
    try:
        code = main(["search", *WITH_PROGRESS, "--out", str(out)])
    finally:
        if stream is not None:
            stream.close()
    assert code == 0
    assert sys.stderr is stream  # given back as it was
    assert len(load(str(out))["step"]) > 0
    assert "record: " in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["none", "read-only"])
def test_a_mistake_with_standard_error_closed_still_exits_2(kind, tmp_path, monkeypatch):
    """The error line could not be written to the read-only descriptor: OSError out of `main`, exit code 1."""
    stream = _closed(kind, tmp_path)
    monkeypatch.setattr(sys, "stderr", stream)
    before = snapshot(tmp_path)
    try:
        code = main(["search", *TINY, "--out", str(tmp_path / "run.h5"), "--bogus"])
    finally:
        if stream is not None:
            stream.close()
    assert code == 2
    assert snapshot(tmp_path) == before


def test_a_captured_standard_error_is_kept(capsys):
    """A stream without a descriptor (pytest, a notebook) is written to as before, not taken for a closed one."""
    assert main(["search", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# -- the command line ---------------------------------------------------------------------------------------------
def test_options_after_a_double_dash_are_not_named_as_meant(tmp_path, capsys):
    """``nasdiag search -- --epochs 1`` said "did you mean --epochs for --epochs?": after ``--`` argparse reads every
    token as a value, so each option was unknown and its own near miss."""
    line = refused(["search", "--", "--epochs", "1", "--out", tmp_path / "run.h5"], tmp_path,
                   ["unrecognized arguments: -- --epochs 1", "after -- is read as a value", "drop the --"], capsys)
    assert "did you mean" not in line


@pytest.mark.parametrize("command", ["report", "plot"])
def test_out_dash_is_not_standard_output(command, rec, tmp_path, capsys, monkeypatch):
    """``nasdiag report RUN.h5 --out -`` wrote a page named '-' into the current folder (and plot a folder of that
    name); ``nasdiag search --out -`` is refused for the same reason."""
    monkeypatch.chdir(tmp_path)
    refused([command, rec, "--out", "-"], tmp_path, ["--out - is not standard output", "give the"], capsys)


def test_a_resume_refused_for_another_writer_says_only_that(tmp_path, capsys):
    """``--resume --epochs 2`` of a finished 1-epoch run that another process is writing warned that it "extends the
    run from 1 to 2 epochs" and then refused it: two lines, the first about a run that did not happen."""
    import warnings

    from nasdiag.record.lock import WriterLock

    out = tmp_path / "run.h5"
    assert main(["search", *TINY, "--out", str(out)]) == 0
    capsys.readouterr()
    lock = WriterLock(str(out) + ".lock", str(out))
    lock.acquire()
    try:
        with warnings.catch_warnings(record=True) as caught:  # pytest keeps warnings off stderr: catch them here
            warnings.simplefilter("always")
            refused(["search", *TINY, "--out", out, "--resume", "--epochs", "2"], tmp_path,
                    "being written by another writer", capsys)
    finally:
        lock.release()
    assert not [w for w in caught if "extends the run" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("suffix,flag", [(".ckpt", "--force"), (".ckpt.tmp", "--force"), (".ckpt.tmp", "--resume")])
def test_a_folder_where_a_side_file_goes_is_refused_before_the_record_is_touched(suffix, flag, tmp_path, capsys):
    """A folder named like the checkpoint (``run.h5.ckpt/``): ``--force`` replaced the record with an empty one, then
    failed to remove the folder ("Is a directory"): the old run was lost for nothing. The advice after an unreadable
    checkpoint ("start again with --force") led there."""
    out = tmp_path / "run.h5"
    assert main(["search", *TINY, "--out", str(out)]) == 0
    capsys.readouterr()
    if suffix == ".ckpt":
        os.unlink(str(out) + ".ckpt")
    os.mkdir(str(out) + suffix)
    extra = ["--resume", "--epochs", "2"] if flag == "--resume" else [flag]
    refused(["search", *TINY, "--out", out, *extra], tmp_path, [f"run.h5{suffix} is a folder", "move the folder away"],
            capsys)


# -- launcher variables -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_rank_variable_is_one_process(value, tmp_path, monkeypatch, capsys):
    """``RANK=`` (set but empty, as ``export RANK=`` leaves it) passed the runner's check as unset, then the recorder's
    ``int(os.environ['RANK'])`` was a ValueError traceback once the run began (and the CLI's, after it ended)."""
    from nasdiag.record import load

    monkeypatch.setenv("RANK", value)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run.h5"
    assert main(["search", *TINY, "--out", str(out)]) == 0
    assert "record: " in capsys.readouterr().out  # rank 0 says what it wrote
    assert len(load(str(out))["step"]) > 0


# -- the batch scripts ----------------------------------------------------------------------------------------
BAYES = ["--iterations", "1", "--epochs-per-iteration", "1"]  # short, should a mistake run
XNAS = ["--runs", "1", "--steps", "1"]


@pytest.mark.parametrize("script,argv,needle", [  # before: what the mistake did
    ("bayes_compression", ["--lam", "nan", *BAYES], "--lam: must be a finite number in (0, inf), not nan"),  # ran, exit 0
    ("bayes_compression", ["--lr", "inf", *BAYES], "--lr: must be a finite number"),  # ran on NaN weights, exit 0
    ("bayes_compression", ["--lr", "0", *BAYES], "--lr: must be a finite number"),  # trained nothing, exit 0
    ("bayes_compression", ["--lr", "-1", *BAYES], "--lr: must be"),  # torch's ValueError traceback
    ("bayes_compression", ["--prune-ratio", "nan"], "--prune-ratio: must be a finite number in (0, 1), not nan"),
    ("xnas_toys", ["--lr", "nan"], "--lr: must be a finite number"),  # left an empty --out folder
    ("xnas_statistical", ["--sigma", "nan", *XNAS], "--sigma: must be a finite number in [0, inf)"),  # "L must be"
    ("xnas_statistical", ["--sigma-grid", "abc", *XNAS], "--sigma-grid: takes a number, not 'abc'"),  # traceback
    ("xnas_statistical", ["--n-grid", "", *XNAS], "--n-grid: names no value"),  # ran, NumPy warnings, exit 0
    ("xnas_statistical", ["--n-grid", "2,2.5", *XNAS], "--n-grid: takes a whole number, not '2.5' (in '2,2.5')"),
    ("xnas_statistical", ["--lr-multipliers", "1,-1", *XNAS], "--lr-multipliers: must be a finite number"),  # "lr must"
    ("xnas_statistical", ["--plot-only"], "no record at"),  # left an empty --out folder
    ("xnas_toys", ["--plot-only"], "no record at"),
    ("wiring_output_cost", ["--plot-only"], "no record at"),
    ("curvature_accuracy", ["--seeds", "0", "--nets", "tanh_mlp", "--repeats", "1"], "--seeds: must be at least 1"),
    ("curvature_accuracy", ["--repeats", "0", "--nets", "tanh_mlp"], "--repeats: must be at least 1, not 0"),
    ("wiring_cost_heatmaps", ["--C", "3", "--epochs", "1", "--configs", "minimal1"], "--C: must be even"),  # traceback
    ("wiring_variants", ["--C", "0", "--epochs", "1"], "--C: must be at least 2, not 0"),  # the supernet's ValueError
    ("wiring_output_cost", ["--C", "3", "--epochs", "1"], "--C: must be even"),
    ("asmnas_stability", ["--C", "5", "--seeds", "1", "--epochs", "1"], "--C: must be even"),  # left an empty folder
    ("asmnas_stability", ["--layers", "2", "--seeds", "1", "--epochs", "1"], "layers must be >= 3"),  # the same
    ("wiring_evolution", ["--layers", "2", "--epochs", "1"], "layers must be >= 3"),  # the same
    ("sparsenas_digits", ["--lambdas", "1e-4,1e400", "--epochs", "1"], "λ must be > 0 and finite"),  # OverflowError
    ("sparsenas_digits", ["--workers", "100000", "--plot-only"], "--workers 100000 is more than"),  # stalled the box
    ("wiring_cost_heatmaps", ["--configs", " , ", "--epochs", "1"], "--configs ' , ' names no configuration"),  # exit 0
    ("wiring_variants", ["--variants", "", "--epochs", "1"], "--variants '' names no variant"),  # ran nothing, exit 0
    ("make_readme_figures", ["--plot-only", "--runs", "/nonexistent/runs"], "no record at"),  # left an empty --out
])
def test_a_script_number_is_refused_in_one_line_before_any_work(script, argv, needle, tmp_path, capsys):
    script_refused(script, argv, needle, tmp_path, capsys)  # round 7's check: exit 2, one line, the folder as it was


def test_script_number_types_take_what_they_should():
    """The types accept the values the scripts' defaults and docs use (a 0 standard deviation, an empty vs_lr sweep)."""
    from script_args import at_least, number, numbers

    assert number()("3e-4") == 3e-4 and number(0, 1)("0.5") == 0.5 and number(0, low_open=False)("0") == 0.0
    assert numbers(number(), empty=True)("") == "" and numbers(at_least(1))(" 2,4 ,8,") == " 2,4 ,8,"
