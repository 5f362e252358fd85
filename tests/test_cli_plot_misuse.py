"""``nasdiag plot`` and ``nasdiag report`` misused: each mistake is one line on stderr, exit code 2, no
traceback, and leaves every file as it was (same sha256, nothing new: no stray temporary file); the report
never replaces the record it reads, an HDF5 file, or a file it did not write unless told to (``--force``)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from nasdiag.cli import main
from nasdiag.plot import report as report_module
from plot_records import write_record


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def refused(argv, folder: Path, needles, capsys) -> str:
    """Run ``nasdiag argv``; assert exit 2, one stderr line holding every needle, ``folder`` unchanged."""
    before = snapshot(folder)
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in [needles] if isinstance(needles, str) else needles:
        assert needle in lines[0], lines[0]
    assert snapshot(folder) == before
    return lines[0]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny record (steps 1..4, one cell type), copied into each test's folder."""
    return write_record(tmp_path_factory.mktemp("source") / "run.h5", epochs=1, steps_per_epoch=4, cells=("normal",))


@pytest.fixture
def rec(source, tmp_path) -> Path:
    return Path(shutil.copy(source, tmp_path / "run.h5"))


# 1. report --out never loses a file -------------------------------------------------------------------
def test_report_never_replaces_the_record_it_reads(rec, tmp_path, capsys):
    refused(["report", rec, "--out", rec], tmp_path, "is the record being read", capsys)
    refused(["report", rec, "--out", rec, "--force"], tmp_path, "is the record being read", capsys)
    link = tmp_path / "page.html"
    link.symlink_to(rec)  # the same file under an innocent name
    refused(["report", rec, "--out", link, "--force"], tmp_path, "is the record being read", capsys)


def test_report_never_replaces_an_hdf5_file_even_with_force(rec, tmp_path, capsys):
    other = Path(shutil.copy(rec, tmp_path / "other.h5"))
    disguised = Path(shutil.copy(rec, tmp_path / "other.dat"))  # recognised by its signature, not its name
    for target in (other, disguised):
        refused(["report", rec, "--out", target], tmp_path, "HDF5", capsys)
        line = refused(["report", rec, "--out", target, "--force"], tmp_path, "HDF5", capsys)
        assert "not even with --force" in line


def test_report_replaces_a_foreign_file_only_with_force(rec, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    refused(["report", rec, "--out", notes, "--figures", "scalars"], tmp_path, ["notes.txt", "--force"], capsys)
    assert main(["report", str(rec), "--out", str(notes), "--figures", "scalars", "--dpi", "30", "--force"]) == 0
    assert notes.read_text(encoding="utf-8").startswith(report_module.PAGE_START)


def test_report_replaces_a_previous_report(rec, tmp_path, capsys):
    page = tmp_path / "report.html"
    argv = ["report", str(rec), "--out", str(page), "--figures", "scalars", "--dpi", "30"]
    assert main(argv) == 0
    first = page.read_text(encoding="utf-8")
    assert first.startswith(report_module.PAGE_START)
    page.write_text(first.replace("nasdiag report: run.h5</h1>", "nasdiag report: edited</h1>"), encoding="utf-8")
    assert main(argv) == 0  # ours: replaced without --force
    assert "nasdiag report: run.h5</h1>" in page.read_text(encoding="utf-8")
    # a page written before the generator marker existed also counts as ours
    page.write_text("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>nasdiag report: old</title>")
    assert main(argv) == 0
    assert page.read_text(encoding="utf-8").startswith(report_module.PAGE_START)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "run.h5"]
    capsys.readouterr()


# 2. report --out a folder, and no temporary file on any failure path ----------------------------------
def test_report_into_a_folder_is_refused_up_front(rec, tmp_path, capsys):
    (tmp_path / "adir").mkdir()
    refused(["report", rec, "--out", tmp_path / "adir"], tmp_path, ["is a folder", "adir/report.html"], capsys)
    refused(["report", rec, "--out", f"{tmp_path / 'newdir'}/"], tmp_path, "is a folder", capsys)
    (tmp_path / "afile").write_text("x")
    refused(["report", rec, "--out", tmp_path / "afile" / "r.html"], tmp_path, "is a file, not a folder", capsys)


def test_report_leaves_no_temporary_file_when_writing_fails(rec, tmp_path, capsys, monkeypatch):
    def full_disk(src, dst):
        raise OSError(28, "No space left on device", os.fspath(dst))

    monkeypatch.setattr(report_module.os, "replace", full_disk)
    refused(["report", rec, "--out", tmp_path / "r.html", "--figures", "scalars", "--dpi", "30"], tmp_path,
            "r.html", capsys)


# 3. --dpi ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["plot", "report"])
@pytest.mark.parametrize("dpi", ["0", "-5", "lots"])
def test_non_positive_dpi_is_a_usage_error(rec, tmp_path, capsys, command, dpi):
    out = tmp_path / ("figs" if command == "plot" else "r.html")
    refused([command, rec, "--out", out, "--dpi", dpi], tmp_path, ["--dpi", "e.g. 150"], capsys)


# 4. --figures naming nothing --------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["plot", "report"])
@pytest.mark.parametrize("figures", ["", ",", " , "])
def test_figures_naming_nothing_is_refused_with_the_choices(rec, tmp_path, capsys, command, figures):
    out = tmp_path / ("figs" if command == "plot" else "r.html")
    refused([command, rec, "--out", out, "--figures", figures], tmp_path,
            ["names no figure", "cost", "scalars", "leave --figures out"], capsys)


# 5. --at after the record's last step -----------------------------------------------------------------
def test_at_after_the_last_step_is_refused(rec, tmp_path, capsys):
    refused(["plot", rec, "--out", tmp_path / "figs", "--figures", "cost", "--at", "final,99999"], tmp_path,
            ["--at 99999", "ends at step 4"], capsys)
    # the last step itself draws, named after it
    assert main(["plot", str(rec), "--out", str(tmp_path / "figs"), "--figures", "cost", "--at", "4", "--dpi", "30"]) == 0
    assert [p.name for p in (tmp_path / "figs").iterdir()] == ["cost_normal_heatmap_step4.png"]
    capsys.readouterr()


def test_at_after_the_last_step_skips_that_record_in_a_batch(rec, tmp_path, capsys):
    longer = write_record(tmp_path / "long.h5", epochs=2, steps_per_epoch=4, cells=("normal",))  # ends at step 8
    code = main(["plot", str(rec), str(longer), "--out", str(tmp_path / "figs"), "--figures", "cost", "--at", "6",
                 "--dpi", "30", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert [line for line in err.splitlines() if "skipped" in line and "run.h5" in line and "ends at step 4" in line]
    assert not (tmp_path / "figs" / "run").exists()
    assert [p.name for p in (tmp_path / "figs" / "long").iterdir()] == ["cost_normal_heatmap_step6.png"]


# 6. plot --out an existing file -----------------------------------------------------------------------
def test_plot_into_an_existing_file_says_out_must_be_a_folder(rec, tmp_path, capsys):
    notes = tmp_path / "notes2.txt"
    notes.write_text("mine\n")
    refused(["plot", rec, "--out", notes], tmp_path, ["notes2.txt", "folder", f"--out {tmp_path / 'notes2'}-figs"],
            capsys)
    refused(["plot", rec, "--out", notes / "figs"], tmp_path, ["is a file", "folder"], capsys)
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "compare").write_text("not a folder")
    other = shutil.copy(rec, tmp_path / "b.h5")
    refused(["plot", rec, other, "--out", tmp_path / "figs"], tmp_path, ["compare", "move that file away"], capsys)


# 7. a checkpoint given instead of its record ------------------------------------------------------------
def test_a_checkpoint_is_named_as_such_with_the_record_to_pass(rec, tmp_path, capsys):
    import pickle

    import torch

    ckpt = tmp_path / "run.h5.ckpt"
    torch.save({"step": 4}, ckpt)  # what the search writes next to its record: a torch file, not HDF5
    for command, out in (("plot", tmp_path / "figs"), ("report", tmp_path / "r.html")):
        line = refused([command, ckpt, "--out", out], tmp_path, ["is a nasdiag checkpoint", f"the record {rec}"], capsys)
        assert "damaged" not in line and "salvage" not in line
    # recognised by its signature too (an old pickle-format checkpoint, renamed), with no record beside it
    renamed = tmp_path / "state.bin"
    renamed.write_bytes(pickle.dumps({"step": 4}, protocol=2))
    refused(["plot", renamed, "--out", tmp_path / "figs"], tmp_path,
            ["is a nasdiag checkpoint", "the .h5 record it belongs to"], capsys)
