"""A fourth new user's misuse of the ``nasdiag`` CLI: what rounds 1-3 (test_cli_errors.py,
test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3.py) did not cover. Every mistake
is one line on stderr, exit code 2, and leaves the folder as it was (`refused` compares sha256s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_cli_errors import TINY
from test_cli_plot_misuse import rec, refused, source  # noqa: F401 (fixtures)


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


@pytest.mark.parametrize("option,extra", [("--figs", []), ("--data-dir", []), ("--data-dir", ["--dataset", "cifar10"])])
def test_empty_folder_options(option, extra, tmp_path, capsys):
    """``--figs ''`` silently drew into the default folder, ``--data-dir ''`` was silently ignored (digits) or
    called missing (cifar10)."""
    tiny = [a for a in TINY if a != "--no-figs"]
    refused(["search", *tiny, "--out", tmp_path / "run.h5", option, "", *extra], tmp_path,
            [f"{option} is empty", f"leave {option} out"], capsys)


def _all_nan_record(path: Path) -> Path:
    import warnings

    from nasdiag.record import Recorder

    meta = {"method": "darts", "op_names": ["a", "b"], "edge_names": {"normal": ["e0"]}, "cell_types": ["normal"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recorder flags each NaN: recorded as is
        with Recorder(str(path), meta=meta) as rec:
            for step in range(1, 4):
                rec.log(step, {"scalars/train_loss": float("nan"), "hessian/normal/top_eigenvalue": float("nan"),
                               "hessian/top_eigenvalue": float("nan")})
    return path


@pytest.mark.parametrize("batch", [False, True])
def test_a_plot_that_draws_nothing_leaves_no_empty_folder(batch, tmp_path, capsys):
    """A record whose every figure is skipped (every value NaN) exits 2, but left its new, empty figure folder
    behind (and, in a batch, one empty folder per record)."""
    from nasdiag.cli import main
    from test_cli_plot_misuse import snapshot

    records = [_all_nan_record(tmp_path / "nan.h5")] + ([_all_nan_record(tmp_path / "nan2.h5")] if batch else [])
    before = snapshot(tmp_path)
    code = main(["plot", *map(str, records), "--out", str(tmp_path / "out" / "figs"), "--dpi", "20", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "".join(err), err
    assert ("none of the 2 records" if batch else "every one was skipped") in err[-1], err
    assert any("NaN in every row" in line for line in err), err  # the NaN is said, not hidden
    assert snapshot(tmp_path) == before


def test_the_plot_command_after_an_interrupt_survives_a_shell(tmp_path, capsys, monkeypatch):
    """Ctrl-C while a finished search draws its figures prints the ``nasdiag plot`` command: with a space in
    the paths (``my runs/``) the printed command split into wrong arguments when pasted into a shell."""
    import shlex

    import nasdiag.plot
    from nasdiag.cli import main

    def interrupted(record, folder, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(nasdiag.plot, "write_figures", interrupted)
    out, figs = tmp_path / "my runs" / "run 1.h5", tmp_path / "it's figs"
    argv = [a for a in TINY if a != "--no-figs"]
    assert main(["search", *argv, "--out", str(out), "--figs", str(figs)]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "the run is complete" in lines[0], lines
    assert shlex.split(lines[0].split("draw them with nasdiag ")[1]) == ["plot", str(out), "--out", str(figs)]


@pytest.mark.parametrize("extra,needle", [
    (["--C", "99999999999999999998"], "the supernet (C=99999999999999999998"),  # past 64 bits: a TypeError of torch
    # asmnas's attention_hidden=2000000000 is now refused by its bound (test_cli_misuse_round5.py)
])
def test_sizes_too_large_for_memory(extra, needle, tmp_path, capsys):
    """A supernet or method sized past the machine's memory was a traceback from torch's allocator."""
    refused(["search", *TINY, "--out", tmp_path / "run.h5", *extra], tmp_path,
            [needle, "does not fit in the memory of cpu"], capsys)


@pytest.mark.parametrize("command,out", [("plot", "figs"), ("report", "r.html")])
@pytest.mark.parametrize("figures,hint", [("hesian", "'hessian' for 'hesian'"), ("scalars,Cost", "'cost' for 'Cost'"),
                                          ("regrt", "'regret' for 'regrt'")])
def test_a_misspelt_figure_names_the_near_miss(rec, tmp_path, capsys, command, out, figures, hint):
    """``--figures hesian`` listed the 22 figure names but not the one meant (``--hessian-mode Exact`` names it)."""
    refused([command, rec, "--out", tmp_path / out, "--figures", figures], tmp_path,
            ["unknown figure(s)", f"did you mean {hint}?"], capsys)
