"""A fourth new user's misuse of the ``nasdiag`` CLI: what rounds 1-3 (test_cli_errors.py,
test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3.py) did not cover. Every mistake
is one line on stderr, exit code 2, and leaves the folder as it was (`refused` compares sha256s)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from plot_records import write_record
from test_cli_errors import TINY
from test_cli_plot_misuse import refused


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny record (steps 1..4, one cell type), copied into each test's folder."""
    return write_record(tmp_path_factory.mktemp("source") / "run.h5", epochs=1, steps_per_epoch=4, cells=("normal",))


@pytest.fixture
def rec(source, tmp_path) -> Path:
    return Path(shutil.copy(source, tmp_path / "run.h5"))


# -- search --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("diagnostics", ["hessian", "none"])
def test_empty_hessian_mode(diagnostics, tmp_path, capsys):
    """``--hessian-mode ''`` (an unset shell variable) silently ran the default mode diag; without the
    Hessian recorded it was called "hessian_mode '' has no effect"."""
    tiny = [a if a != "none" else diagnostics for a in TINY]
    refused(["search", *tiny, "--out", tmp_path / "run.h5", "--hessian-mode", ""], tmp_path,
            ["--hessian-mode is empty", "leave the option out for the default (diag)"], capsys)


def test_a_supernet_too_large_for_memory(tmp_path, capsys):
    """``--C 2000000`` ended in a RuntimeError traceback from torch's allocator."""
    refused(["search", *TINY, "--out", tmp_path / "run.h5", "--C", "2000000"], tmp_path,
            ["C=2000000", "does not fit in the memory of cpu", "smaller --C"], capsys)


# -- plot and report -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("command,example", [("plot", "figure folder"), ("report", "HTML file")])
def test_empty_out(rec, tmp_path, capsys, monkeypatch, command, example):
    """``plot --out ''`` drew every figure into the current folder (pathlib reads '' as '.'); ``report``
    called it a folder."""
    monkeypatch.chdir(tmp_path)
    refused([command, rec, "--out", ""], tmp_path, ["--out is empty", example], capsys)


def test_at_before_the_first_step(rec, tmp_path, capsys):
    """``--at 0`` (the record starts at step 1) skipped every heatmap, drew the rest and exited 0."""
    refused(["plot", rec, "--out", tmp_path / "figs", "--at", "0"], tmp_path,
            ["--at 0", "starts at step 1", "give steps from 1 to 4"], capsys)


def test_more_threads_than_cpus(tmp_path, capsys):
    """``--threads 100000`` made torch start that many threads: the process ran out of memory (a traceback
    from the next import); one more thread than CPUs is refused alike."""
    import os

    n = (os.cpu_count() or 1) + 1
    refused(["search", *TINY, "--out", tmp_path / "run.h5", "--threads", str(n)], tmp_path,
            [f"threads {n} is more than the {n - 1} CPUs", "leave --threads out"], capsys)


@pytest.mark.parametrize("value", ["", ",", " , "])
def test_diagnostics_naming_nothing(value, tmp_path, capsys):
    """``--diagnostics ''`` silently recorded no diagnostics (as ``none``)."""
    argv = ["search", *TINY, "--out", tmp_path / "run.h5"]
    argv[argv.index("--diagnostics") + 1] = value
    refused(argv, tmp_path, ["names no diagnostic", "or none to record no diagnostics"], capsys)
