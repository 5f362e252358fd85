"""A twenty-third new user's misuse of the ``nasdiag`` CLI, run as a user runs it (``python -m nasdiag`` in a
subprocess): what rounds 1-22 (test_cli_errors.py, test_cli_*misuse*.py, test_audit_newuser*.py) did not cover.

Checked and found right (not repeated as tests): the main job run twice on one --out, --resume of a finished run,
--resume with another --seed, --resume --force (one line each, nothing touched); plot/report of the checkpoint, a
continuation segment, a lock path, a zero-byte file, another program's HDF5 file with and without /meta or with a
/step, a record of schema version 3 (one line each), copies cut by ``head -c`` (one line, or every row read when only
the unused tail of the file was cut); every bad --at/--dpi/--format/--figures value; options of one command given to
another; Ctrl-C/SIGTERM while plot or report draw (130/143, one line, the old page kept), Ctrl-C while a search draws
its figures (the line names the complete record and the plot command); ``| head`` / ``| true`` (141, no traceback);
PYTHONWARNINGS=error for plot and report; CUDA_VISIBLE_DEVICES='' with --device cuda (one line); a search over a
record being written (one line); --force while a reader holds the record open (replaced, the reader keeps its copy);
two --resume of one killed run at once (one runs, the other is one line; every step once); a schema-1 record (drawn,
resumed); a read-only current folder with a relative --out (one line each); PYTHONIOENCODING=ascii with a -inf.

Left alone: a record copied alone without its later segments is drawn as a shorter run without a word (segment 0
cannot know of later ones: a writer change, records area; README now says so); other OMP_* variables that libgomp
rejects (OMP_PROC_BIND=bogus, ...) still print its line; search --force while an earlier run of the same --out still
draws its figures (both exit 0, one figure folder).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _nasdiag(argv, tmp_path, **env):
    full = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "nasdiag", *argv], cwd=tmp_path, env=full, capture_output=True,
                          text=True, timeout=300)


def _libgomp() -> str:
    import torch

    path = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not path.exists():
        pytest.skip("this torch build does not ship libgomp")
    return str(path)


def test_an_omp_num_threads_openmp_cannot_read_leaves_a_mistake_one_line(tmp_path):
    """``OMP_NUM_THREADS=0`` (or ``abc``, or set empty) put an empty line and "libgomp: Invalid value for environment
    variable OMP_NUM_THREADS" before every line of a command that loads torch: ``nasdiag methods bogus`` was three
    lines on stderr. OpenMP ignores such a value; so does nasdiag now, and a mistake is its one line (the values it
    drops are checked against libgomp below)."""
    done = _nasdiag(["methods", "bogus"], tmp_path, OMP_NUM_THREADS="0")
    assert done.returncode == 2, done
    assert done.stderr.splitlines() == [done.stderr.strip()] and "unknown method 'bogus'" in done.stderr, done.stderr


def test_the_omp_num_threads_nasdiag_drops_are_those_libgomp_cannot_read(tmp_path):
    """The values dropped are exactly those torch's own libgomp rejects when it loads (it says so on stderr); one a
    libgomp reads (`` 2 ``, ``2,1``, ``+2``) is kept for it."""
    from nasdiag.cli import _omp_threads_readable

    library = _libgomp()
    for value in ["abc", "0", "", " ", "2", " 2 ", "2,1", "2 , 3", "+2", "02", "1,", ",2", "-1", "0x2", "2abc", "1.5",
                  "4294967296", "9223372036854775807", "9223372036854775808", "99999999999999999999", "\u0663"]:
        loaded = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({library!r})"],
                                env=dict(os.environ, OMP_NUM_THREADS=value), capture_output=True, text=True, timeout=60)
        assert loaded.returncode == 0, loaded
        assert _omp_threads_readable(value) == ("Invalid value" not in loaded.stderr), (value, loaded.stderr)


def test_plot_or_report_of_a_killed_writers_lock_file_names_the_record(tmp_path, capsys):
    """A writer killed mid-run leaves ``run.h5.lock`` next to its record; ``nasdiag plot run.h5.lock`` (tab completion
    picks it) said "is not a nasdiag record: it is not an HDF5 file (no HDF5 signature); pass a record that nasdiag
    search or nasdiag.record.Recorder wrote", naming no record, where the checkpoint and a later segment name the record
    to pass. The line names it, nothing is written, and doing what it says draws the record."""
    from nasdiag.cli import main

    writer = ("import os\nfrom nasdiag.record import Recorder\nrec = Recorder('run.h5', meta={'method': 'mine'})\n"
              "for step in range(1, 4):\n    rec.log(step, {'scalars/train_loss': 1.0 / step})\nrec.flush()\nos._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", writer], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0 and (tmp_path / "run.h5.lock").is_file(), done  # left as by a kill
    before = sorted(p.name for p in tmp_path.iterdir())
    lock = str(tmp_path / "run.h5.lock")
    capsys.readouterr()
    for argv in (["plot", lock, "--out", str(tmp_path / "figs")], ["report", lock, "--out", str(tmp_path / "page.html")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"pass the record {tmp_path / 'run.h5'} instead" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert main(["plot", str(tmp_path / "run.h5"), "--out", str(tmp_path / "figs"), "--figures", "scalars"]) == 0
    assert (tmp_path / "figs" / "scalars.png").is_file()


def test_a_segment_of_a_run_that_never_resumed_is_not_said_to_hold_the_rows_after_a_resume(tmp_path, capsys):
    """The main job's record is two files without any resume (its first cost row, at the end of epoch 1, is a new
    column after the first flush: a new segment). ``nasdiag plot runs/darts.seg0001.h5`` said it holds "the rows after
    a resume" of a run never resumed, and the README said a record is several files "after a resume" only."""
    from nasdiag.cli import main
    from nasdiag.record import Recorder
    from nasdiag.record.schema import list_segments

    record = tmp_path / "run.h5"
    with Recorder(record, meta={"method": "mine"}) as rec:  # as the search: scalars every step, costs at epoch end
        rec.log(1, {"scalars/train_loss": 1.0})
        rec.flush()
        rec.log(2, {"scalars/train_loss": 0.5, "cost/normal/mean": [[0.1, 0.2]]})
    assert [index for index, _ in list_segments(str(record))] == [0, 1]  # a segment without a resume
    capsys.readouterr()
    for argv in (["plot", str(tmp_path / "run.seg0001.h5"), "--out", str(tmp_path / "figs")],
                 ["report", str(tmp_path / "run.seg0001.h5"), "--out", str(tmp_path / "page.html")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"pass the record {record}" in err, err
        assert "the rows after a resume)" not in err, err
    readme = (ROOT / "README.md").read_text()
    assert "After a resume a record is several" not in readme.replace("\n", " ")


def test_plot_or_report_of_a_segment_left_half_built_names_the_record(tmp_path, capsys):
    """A writer killed while it built a segment leaves it under its temporary name (docs/schema.md: ``*.tmp``, a
    segment being built); ``nasdiag plot runs/*`` takes it. ``run.seg0001.h5.tmp`` was called a damaged record ("it
    holds segment 1 of its run, not segment 0"), and ``run.h5.tmp`` (segment 0, as --force builds it) was drawn as a
    run of its own, exit 0. Each names the record to pass; nothing is written."""
    import shutil

    from nasdiag.cli import main
    from nasdiag.record import Recorder

    record = tmp_path / "run.h5"
    with Recorder(record, meta={"method": "mine"}) as rec:
        rec.log(1, {"scalars/train_loss": 1.0})
        rec.flush()
        rec.log(2, {"scalars/train_loss": 0.5, "cost/normal/mean": [[0.1, 0.2]]})
    os.rename(tmp_path / "run.seg0001.h5", tmp_path / "run.seg0001.h5.tmp")  # killed before it was published
    shutil.copy(record, tmp_path / "run.h5.tmp")
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    for temp in ("run.seg0001.h5.tmp", "run.h5.tmp"):
        for argv in (["plot", str(tmp_path / temp), "--out", str(tmp_path / "figs")],
                     ["report", str(tmp_path / temp), "--out", str(tmp_path / "page.html")]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"pass the record {record} instead" in err, err
            assert "damaged" not in err, err
            assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_an_extension_refused_by_pythonwarnings_error_leaves_no_new_segment(tmp_path, capsys):
    """``PYTHONWARNINGS=error nasdiag search ... --resume --epochs 2`` of a finished 1-epoch run: the warning that
    it extends the run, raised as an error, was one line and exit 2 (as docs say of every mistake), but it came after
    the record was opened: the refused command left a new empty ``run.seg0001.h5`` next to the record. It is raised
    before anything is opened now; every file is as it was, and the same command without the error filter extends."""
    import warnings

    from nasdiag.cli import main
    from test_cli_errors import TINY, snapshot

    out = tmp_path / "run.h5"
    assert main(["search", *TINY, "--out", str(out)]) == 0
    before = snapshot(tmp_path)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as PYTHONWARNINGS=error
        assert main(["search", *TINY, "--out", str(out), "--resume", "--epochs", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "extends the run from 1 to 2" in err, err
    assert snapshot(tmp_path) == before
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert main(["search", *TINY, "--out", str(out), "--resume", "--epochs", "2"]) == 0
    assert any("extends the run from 1 to 2" in str(w.message) for w in said), [str(w.message) for w in said]


@pytest.mark.parametrize("side, what", [(".ckpt", "the checkpoint of the record being read"),
                                        (".lock", "the writer lock of the record being read")])
def test_a_report_out_on_the_checkpoint_or_lock_of_its_record_names_what_it_is(side, what, tmp_path, capsys):
    """``nasdiag report run.h5 --out run.h5.ckpt --force`` (tab completion) was refused as "--out run.h5.ckpt is the
    record being read (run.h5.ckpt)": the record read is run.h5. The line says the file is its checkpoint (or lock),
    and the file is kept."""
    from nasdiag.cli import main
    from nasdiag.record import Recorder

    record = tmp_path / "run.h5"
    with Recorder(record, meta={"method": "mine"}) as rec:
        rec.log(1, {"scalars/train_loss": 1.0})
    kept = b"the search's resume state\n"
    (tmp_path / ("run.h5" + side)).write_bytes(kept)  # named as the search names it; its content is not read
    capsys.readouterr()
    assert main(["report", str(record), "--out", str(tmp_path / ("run.h5" + side)), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"is {what}, {record}" in err and "is the record being read" not in err, err
    assert (tmp_path / ("run.h5" + side)).read_bytes() == kept
