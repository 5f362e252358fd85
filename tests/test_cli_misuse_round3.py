"""A third new user's misuse of the ``nasdiag`` CLI: what the earlier rounds (test_cli_errors.py,
test_cli_search_misuse.py, test_cli_plot_misuse.py) did not cover. Every mistake is one line on stderr,
exit code 2, and leaves the folder as it was (`refused` compares sha256s before and after); ``--help``
documents every option with its default."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import pytest

from nasdiag.cli import _parser, main
from plot_records import write_record
from test_cli_errors import TINY
from test_cli_plot_misuse import refused


# -- --help: every option says what it does and its default ------------------------------------------------
def _options():
    parser = _parser()
    for command, sub in parser.commands.items():
        for action in sub._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield command, action


@pytest.mark.parametrize("command,action", list(_options()), ids=lambda x: getattr(x, "dest", x))
def test_every_option_is_documented_with_its_default(command, action):
    """``nasdiag <command> --help``: each option has a help text, and one with a default names it (argparse
    prints neither by itself); a flag (``store_true``) and a repeatable option default to nothing."""
    assert action.help and action.help.strip(), f"nasdiag {command} {action.option_strings[0]} has no help"
    if action.required or action.default in (None, False, []):
        return
    default = ",".join(action.default) if isinstance(action.default, (list, tuple)) else str(action.default)
    assert f"default: {default}" in action.help or f"default {default}" in action.help, (command, action.help)


def test_methods_help_says_what_the_command_does(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["methods", "--help"])
    assert exc.value.code == 0
    assert "hyperparameters" in capsys.readouterr().out


# -- search --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [str(2 ** 63), str(2 ** 64)])
def test_seed_too_large_for_the_generators(seed, tmp_path, capsys):
    """torch's generators take 64-bit seeds and the record stores the seed as int64: a larger one was a
    traceback (and left a half-built record behind)."""
    refused(["search", *TINY, "--out", tmp_path / "run.h5", "--seed", seed], tmp_path,
            ["--seed", "at most", seed], capsys)


def test_diagnostics_none_with_others_contradicts(tmp_path, capsys):
    refused(["search", *TINY, "--out", tmp_path / "run.h5", "--diagnostics", "none,cost"], tmp_path,
            ["--diagnostics none,cost", "none", "contradict"], capsys)


def test_data_dir_a_file(tmp_path, capsys):
    """It was reported as a folder that "does not exist"."""
    (tmp_path / "cifar.tar.gz").write_bytes(b"\x1f\x8b an archive, not yet unpacked")
    refused(["search", *TINY, "--out", tmp_path / "run.h5", "--dataset", "cifar10", "--data-dir",
             tmp_path / "cifar.tar.gz"], tmp_path, ["cifar.tar.gz is a file, not a folder", "data_batch_1"], capsys)


@pytest.mark.parametrize("out", ["newfolder/", "runs/newfolder/"])
def test_out_ending_in_a_slash_names_a_folder(out, tmp_path, capsys, monkeypatch):
    """It was refused as "cannot create lock file newfolder/.lock: No such file or directory"."""
    monkeypatch.chdir(tmp_path)
    refused(["search", *TINY, "--out", out], tmp_path, [f"--out {out} ends in /", f"{out}run.h5"], capsys)


def test_out_a_symbolic_link_to_nothing(tmp_path, capsys):
    """A dangling link was reported as another program writing there."""
    (tmp_path / "run.h5").symlink_to(tmp_path / "gone" / "run.h5")
    line = refused(["search", *TINY, "--out", tmp_path / "run.h5"], tmp_path,
                   ["symbolic link", "gone/run.h5", "does not exist"], capsys)
    assert "another program" not in line


@pytest.mark.parametrize("figs", ["run.h5", "run.h5/figs", "run.h5.ckpt"])
def test_figs_where_the_record_goes(figs, tmp_path, capsys):
    """``--figs`` naming the record (or its checkpoint) ran the whole search and then failed on drawing."""
    argv = ["search", *[a for a in TINY if a != "--no-figs"], "--out", tmp_path / "run.h5", "--figs", tmp_path / figs]
    refused(argv, tmp_path, [f"--figs {tmp_path / figs}", "run.h5", "pass another --figs"], capsys)


def test_a_warning_is_one_line_without_library_source(tmp_path):
    """``--engine fast --norm layer`` warns from inside torch's module.py: Python printed that file's path and
    source line under the message. A subprocess, since pytest records warnings instead of printing them."""
    import subprocess
    import sys

    from test_cli_errors import ROOT

    code = ("import sys, warnings; from nasdiag import cli; "
            "cli.COMMANDS['methods'] = lambda args: warnings.warn('engine fast:\\n runs eager', RuntimeWarning) or 0; "
            "sys.exit(cli.main(['methods']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "nasdiag: warning: engine fast: runs eager (RuntimeWarning)\n", proc.stderr


# -- plot and report: what is not a record -----------------------------------------------------------------
@pytest.fixture(scope="module")
def segmented(tmp_path_factory) -> Path:
    """A record continued in a second segment (``run.seg0001.h5``), as a resumed search leaves it."""
    from nasdiag.record import Recorder

    path = write_record(tmp_path_factory.mktemp("segmented") / "run.h5", epochs=1, steps_per_epoch=4, cells=("normal",))
    with Recorder(str(path), resume=True) as rec:
        rec.log(5, {"scalars/train_loss": 0.5})
    assert Path(str(path).replace("run.h5", "run.seg0001.h5")).exists()
    return path


@pytest.fixture
def rec(segmented, tmp_path) -> Path:
    for file in segmented.parent.iterdir():
        shutil.copy(file, tmp_path / file.name)
    return tmp_path / "run.h5"


@pytest.mark.parametrize("command,out", [("plot", "figs"), ("report", "r.html")])
def test_a_continuation_segment_is_named_with_its_record(rec, tmp_path, capsys, command, out):
    """``run.seg0001.h5`` holds only the rows after a resume: drawn alone it looked like a whole run."""
    refused([command, tmp_path / "run.seg0001.h5", "--out", tmp_path / out], tmp_path,
            ["run.seg0001.h5", "continuation segment", f"pass the record {rec}"], capsys)


def test_plot_glob_reads_segments_with_their_record(rec, tmp_path, capsys):
    """``nasdiag plot runs/*.h5`` (the README's form) also matches the segments of a resumed run: they are
    drawn as part of their record, not as runs of their own."""
    other = write_record(tmp_path / "other.h5", epochs=1, steps_per_epoch=4, cells=("normal",))
    records = sorted(str(p) for p in tmp_path.glob("*.h5"))
    assert len(records) == 3
    code = main(["plot", *records, "--out", str(tmp_path / "figs"), "--figures", "scalars", "--dpi", "20",
                 "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["other", "run"]  # scalars: no comparison
    assert "run.seg0001.h5 is read as part of its record" in err and err.count("\n") == 1, err
    assert "2 of 2 records drawn" in out and other.exists()


@pytest.mark.parametrize("content,reason", [
    (b"", "it is empty"),
    (b"just some text\n", "it is not an HDF5 file"),
])
@pytest.mark.parametrize("command,out", [("plot", "figs"), ("report", "r.html")])
def test_a_file_that_is_not_a_record(tmp_path, capsys, command, out, content, reason):
    """Said as such, not as a damaged record whose "0 intact rows stay readable in Python"."""
    (tmp_path / "notes.h5").write_bytes(content)
    line = refused([command, tmp_path / "notes.h5", "--out", tmp_path / out], tmp_path,
                   ["notes.h5 is not a nasdiag record", reason], capsys)
    assert "damaged" not in line and "salvage" not in line


def test_an_hdf5_file_that_is_not_a_record_is_not_to_be_removed(tmp_path, capsys):
    import h5py

    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_dataset("x", data=[1.0])
    line = refused(["plot", tmp_path / "data.h5", "--out", tmp_path / "figs"], tmp_path,
                   ["data.h5 is not a nasdiag record", "without the /step"], capsys)
    assert "remove" not in line


def test_a_record_damaged_before_its_first_row_promises_no_rows(rec, tmp_path, capsys):
    data = rec.read_bytes()
    broken = tmp_path / "broken.h5"
    broken.write_bytes(data[:5000])
    line = refused(["plot", broken, "--out", tmp_path / "figs"], tmp_path, [f"record {broken} is damaged"], capsys)
    assert "0 intact rows" not in line and "salvage" not in line


def test_a_damaged_record_with_intact_rows_points_at_salvage(rec, tmp_path, capsys, monkeypatch):
    from nasdiag.plot import commands
    from nasdiag.record.errors import DamagedRecordError

    def damaged(path):
        raise DamagedRecordError("damaged", str(path), f"{path} row 3", "its digest does not match", 3)

    monkeypatch.setattr(commands, "_load", damaged)
    refused(["plot", rec, "--out", tmp_path / "figs"], tmp_path,
            ["is damaged at", "row 3", "its 3 intact rows before it stay readable", "salvage=True"], capsys)


# -- plot: folders, repeated records, --at -----------------------------------------------------------------
def test_two_runs_with_the_same_folder_and_file_name_get_two_folders(rec, tmp_path, capsys):
    """``a/x/run.h5`` and ``b/x/run.h5`` were both drawn into ``x_run``: the second replaced the first."""
    for run, seed in (("a", 1), ("b", 2)):
        write_record(tmp_path / run / "x" / "run.h5", epochs=1, steps_per_epoch=4, seed=seed, cells=("normal",))
    code = main(["plot", str(tmp_path / "a" / "x" / "run.h5"), str(tmp_path / "b" / "x" / "run.h5"), "--out",
                 str(tmp_path / "figs"), "--figures", "arch", "--dpi", "20", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    folders = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert len(folders) == 3 and "compare" in folders, folders
    assert "2 of 2 records drawn" in out and "comparison figures" in out


def test_a_record_named_compare_does_not_mix_with_the_comparison(rec, tmp_path, capsys):
    shutil.copy(rec, tmp_path / "compare.h5")
    code = main(["plot", str(rec), str(tmp_path / "compare.h5"), "--out", str(tmp_path / "figs"), "--figures",
                 "arch", "--dpi", "20", "--no-progress"])
    capsys.readouterr()
    assert code == 0
    folders = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert len(folders) == 3 and "compare" in folders and "run" in folders, folders


def test_the_same_record_twice(rec, tmp_path, capsys):
    (tmp_path / "same.h5").symlink_to(rec)
    for second in (rec, tmp_path / "." / "run.h5", tmp_path / "same.h5"):
        refused(["plot", rec, second, "--out", tmp_path / "figs"], tmp_path,
                ["is given twice", "pass each record once"], capsys)


@pytest.mark.parametrize("command,out", [("plot", "figs"), ("report", "r.html")])
def test_dpi_too_large_to_render(rec, tmp_path, capsys, command, out):
    """``--dpi 100000`` ended in a MemoryError traceback from matplotlib's renderer (or ran for minutes)."""
    refused([command, rec, "--out", tmp_path / out, "--dpi", "100000"], tmp_path, ["--dpi", "at most 1200"], capsys)


def test_at_naming_a_row_twice(rec, tmp_path, capsys):
    """``--at final,final`` drew each heatmap twice into one file and counted both."""
    refused(["plot", rec, "--out", tmp_path / "figs", "--figures", "cost", "--at", "final,4,final"], tmp_path,
            ["--at final,4,final", "final twice"], capsys)


def test_at_with_no_figure_that_draws_rows(rec, tmp_path, capsys):
    """``--at`` picks heatmap rows; with only line plots chosen it did nothing and still exited 0."""
    refused(["plot", rec, "--out", tmp_path / "figs", "--figures", "scalars", "--at", "2"], tmp_path,
            ["--at 2", "scalars", "drop --at"], capsys)


def test_figures_the_record_does_not_hold(rec, tmp_path, capsys):
    """``--figures regret`` on a record without regret rows drew nothing, said "0 figures" and exited 0;
    in a batch it counted the record as drawn."""
    refused(["plot", rec, "--out", tmp_path / "figs", "--figures", "regret"], tmp_path,
            [f"record {rec} holds nothing that --figures regret draws", "leave --figures out"], capsys)
    other = write_record(tmp_path / "other.h5", epochs=1, steps_per_epoch=4, cells=("normal",))
    code = main(["plot", str(rec), str(other), "--out", str(tmp_path / "figs"), "--figures", "regret,scalars",
                 "--dpi", "20", "--no-progress"])
    capsys.readouterr()
    assert code == 0  # scalars drew for both
    code = main(["plot", str(rec), str(other), "--out", str(tmp_path / "figs2"), "--figures", "regret", "--no-progress"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "none of the 2 records could be drawn" in lines[-1], lines
    assert len(lines) == 3 and all("holds nothing that --figures regret draws" in line for line in lines[:2]), lines


def test_a_record_whose_every_figure_is_skipped_is_not_drawn(rec, tmp_path, capsys, monkeypatch):
    """A record whose chosen figures all had nothing to show (every value NaN) said "0 figures" and exited 0."""
    import nasdiag.plot.registry as registry

    real = registry.draw_record

    def all_skipped(record, folder, *args, **kwargs):
        drawn = real(record, folder, *args, **kwargs)
        drawn.skipped += [f"{Path(f).name}: every value is NaN" for f in drawn.files]
        drawn.files.clear()
        return drawn

    monkeypatch.setattr(registry, "draw_record", all_skipped)
    code = main(["plot", str(rec), "--out", str(tmp_path / "figs"), "--figures", "scalars", "--dpi", "20"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "every one was skipped" in err[-1] and "nothing was drawn" in err[-1], err
    assert err[0].startswith("skipped "), err
