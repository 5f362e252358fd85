"""A sixth new user's misuse of the ``nasdiag`` CLI: what rounds 1-5 (test_cli_errors.py, test_cli_search_misuse.py,
test_cli_plot_misuse.py, test_cli_misuse_round3/4/5.py) did not cover: the environment (MPLBACKEND), resolutions too
low to render text, CIFAR-10 folders whose batches are pickles of the wrong values. Every mistake is one line on
stderr, exit code 2, and leaves the folder as it was (`refused` compares sha256s)."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nasdiag.cli import main
from test_cli_errors import ROOT, TINY
from test_cli_plot_misuse import rec, refused, snapshot, source  # noqa: F401 (fixtures)


def _nasdiag(argv, env=None, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "nasdiag", *map(str, argv)], capture_output=True, text=True, env=env,
                          timeout=120, **kwargs)


# -- the environment ----------------------------------------------------------------------------------------
def test_an_invalid_mplbackend_does_not_stop_the_figures(rec, tmp_path):
    """``MPLBACKEND=nonsense`` (a typo, or a GUI backend set for another machine): matplotlib validates it when it
    is imported, so plot and report ended in a ValueError traceback, and a search in one after it had run to
    the end. nasdiag always draws with Agg into files, so the variable does not matter to it."""
    proc = _nasdiag(["plot", rec, "--out", tmp_path / "figs", "--figures", "scalars", "--dpi", "20"],
                    env={"MPLBACKEND": "nonsense"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert [p.suffix for p in (tmp_path / "figs").iterdir()] == [".png"]


# -- resolutions ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command,out", [("plot", "figs"), ("report", "r.html")])
@pytest.mark.parametrize("dpi", ["1", "7", "14"])
def test_a_resolution_too_low_for_the_text(rec, tmp_path, capsys, command, out, dpi):
    """``--dpi 5`` passed the positive check, then FreeType refused the figures' 5 pt text at under half a pixel
    ("invalid ppem value"): a RuntimeError traceback from matplotlib's png renderer, after some files were written."""
    refused([command, rec, "--out", tmp_path / out, "--dpi", dpi], tmp_path, ["--dpi", "at least 15", f"not {dpi}"],
            capsys)


def test_the_lowest_resolution_draws_the_smallest_text(rec, tmp_path, capsys):
    """At the smallest --dpi accepted, the figures with the smallest text (5.5 pt heatmap annotations and op names
    of the genotype drawing) are drawn, none skipped."""
    code = main(["plot", str(rec), "--out", str(tmp_path / "figs"), "--dpi", "15", "--figures", "cost,genotype"])
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    assert len(list((tmp_path / "figs").glob("*.png"))) == int(out.split(": ")[1].split()[0]) >= 2


# -- --data-dir: batches of the wrong values -----------------------------------------------------------------
def _batches(folder: Path, data, labels, extra=None) -> Path:
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": data, b"labels": labels} if extra is None else extra
        (folder / name).write_bytes(pickle.dumps(batch))
    return folder


_RNG = np.random.default_rng(0)
_LABELS = [i % 10 for i in range(20)]


@pytest.mark.parametrize("data,labels,extra,needle", [
    # a cast to uint8 silently floored images in [0, 1] to 0 (all black) and wrapped -1 to 255
    (_RNG.random((20, 3072)), _LABELS, None, "'data' must hold bytes (integers 0..255), not floating-point values"),
    (-np.ones((20, 3072), np.int64), _LABELS, None, "'data' must hold bytes (integers 0..255), not values from -1 to -1"),
    # a Python list with 300 in it: numpy's OverflowError was a traceback
    ([[300] * 3072] * 20, _LABELS, None, "not values from 300 to 300"),
    # labels 0.0..8.9 were floored, True/False taken as classes 1/0
    (np.zeros((20, 3072), np.uint8), [i * 0.45 for i in range(20)], None, "'labels' must hold class numbers 0..9, not floating-point"),
    (np.zeros((20, 3072), np.uint8), [True] * 20, None, "'labels' must hold class numbers 0..9, not true/false"),
    # no image at all: a ValueError traceback from the split ("need at least one array to concatenate")
    (np.zeros((0, 3072), np.uint8), [], None, "0 images and 0 labels"),
    # CIFAR-100 has fine_labels
    (None, None, {b"data": np.zeros((20, 3072), np.uint8), b"fine_labels": _LABELS}, "it is a CIFAR-100 batch"),
])
def test_batches_of_the_wrong_values(data, labels, extra, needle, tmp_path, capsys):
    folder = _batches(tmp_path / "cifar", data, labels, extra)
    refused(["search", *TINY, "--dataset", "cifar10", "--data-dir", folder, "--out", tmp_path / "run.h5"], tmp_path,
            [str(folder / "data_batch_1"), "is not a CIFAR-10 python batch", needle], capsys)


# -- plot: where the figures cannot go ---------------------------------------------------------------------
def _uncreatable(tmp_path: Path) -> Path:
    """A folder that cannot be created (root ignores chmod, so /proc stands in)."""
    if os.geteuid() == 0:
        return Path("/proc/nasdiag-cannot-create/figs")
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o555)
    return locked / "figs"


@pytest.mark.parametrize("batch", [False, True])
def test_a_figure_folder_that_cannot_be_created(rec, tmp_path, capsys, batch):
    """Over many records, each was "skipped: cannot read it (No such file or directory)" as if the records were
    unreadable, then "none of the 2 records could be drawn"; alone it said "No such file or directory (/proc/...)"."""
    other = [Path(shutil.copy(rec, tmp_path / "other.h5"))] if batch else []
    out = _uncreatable(tmp_path)
    try:
        refused(["plot", rec, *other, "--out", out, "--no-progress"], tmp_path,
                [f"cannot create the figure folder {out}", "give an --out"], capsys)
    finally:
        if out.parent.is_relative_to(tmp_path):
            out.parent.chmod(0o755)


def test_a_figure_folder_name_too_long_is_a_write_error(rec, tmp_path, capsys):
    """Two runs with the same 252-character file name in folders ``pp1/`` and ``pp2/`` get the folders ``pp1_<name>``
    and ``pp2_<name>``: 256 characters, more than a file system allows. Each was "skipped: cannot read it (File
    name too long)", blaming the record."""
    name = "r" * 252 + ".h5"
    records = []
    for parent in ("pp1", "pp2"):
        (tmp_path / parent).mkdir()
        records.append(str(shutil.copy(rec, tmp_path / parent / name)))
    code = main(["plot", *records, "--out", str(tmp_path / "figs"), "--no-progress", "--figures", "scalars"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 3 and "Traceback" not in err, err
    for line, parent in zip(lines, ("pp1", "pp2")):
        assert f"cannot write its figures into {tmp_path / 'figs' / parent}_r" in line and "cannot read" not in line, line
    assert not (tmp_path / "figs").exists()


def test_version(capsys):
    """``nasdiag --version`` was "unrecognized arguments: --version"."""
    import nasdiag

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"nasdiag {nasdiag.__version__}\n"


@pytest.mark.parametrize("command,out,records", [("plot", "figs", [""]), ("plot", "figs", ["{rec}", " "]),
                                                 ("report", "r.html", [""])])
def test_an_empty_record_path(rec, tmp_path, capsys, command, out, records):
    """``nasdiag plot "$RUN"`` with RUN unset said "no record at  (no file and no segments next to it)"."""
    records = [r.replace("{rec}", str(rec)) for r in records]
    refused([command, *records, "--out", tmp_path / out, "--no-progress"][: None if command == "plot" else -1],
            tmp_path, "a record path is empty; pass the record file", capsys)
