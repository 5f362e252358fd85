"""Round-19 audit of the record (nasdiag/record): "runs that lose nothing" at the edges of the file names a record
derives from its own (later segments, the files they are built as, the writer's lock), and a live reader beside a
writer that rolls over and resumes.

References are this file's own: the folder's file-name limit from ``os.pathconf`` (bytes, so a name of multi-byte
letters counts its UTF-8 bytes), the values logged kept in numpy here, and the segments read back with plain h5py.

Defects these tests found (each fails without its fix):
- a record name that fits the folder but whose later segments do not (``<root>.seg0001<ext>.tmp`` is 12 bytes
  longer) was taken: the run lost its buffered rows at its first rollover (a path first logged late), and every
  resume was refused, for ever ('File name too long'); a lock file's ENAMETOOLONG said 'record to a writable
  location'. Refused at the `Recorder`'s construction in one line giving the longest name that fits, before any
  file (or folder) is made.
- ``flush_seconds`` of numpy's numbers (np.float32(0.5), np.int64(2)) was refused as 'must be a positive number',
  True was taken as 1 s, and a callback that opens no recorder (target None, a rank > 0) took any value that rank
  0's Recorder refused. One check for both.
- `nasdiag report` of a live record read it three times (rows, NaN/inf counts, segments): a flush between the reads
  put NaNs of rows the page does not show into its counts. One reading for all three (nasdiag/plot/report.py).
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from nasdiag.record import Recorder, RecordError


def _name_max(folder) -> int:
    return os.pathconf(str(folder), "PC_NAME_MAX")


def _plain_rows(folder, prefix: str) -> dict[int, dict[str, float]]:
    """Committed rows of every file of the record (plain h5py, segments in order, a later one's row wins)."""
    files = sorted(f for f in os.listdir(folder) if f.startswith(prefix) and f.endswith(".h5"))
    files.sort(key=lambda f: (f != prefix + ".h5", f))
    rows: dict[int, dict[str, float]] = {}
    for f in files:
        with h5py.File(os.path.join(folder, f), "r", swmr=True) as h:
            steps = h["step"][()]
            n = int(np.argmax(steps < 0)) if (steps < 0).any() else len(steps)
            for i in range(n):
                row = {}
                for fam in ("a", "b"):
                    key = f"scalars/{fam}"
                    if key in h and i < h[key].shape[0]:
                        row[fam] = float(h[key][i])
                rows[int(steps[i])] = row
    return rows


@pytest.mark.parametrize("letter", ["r", "é"])  # é is 2 bytes in UTF-8: the limit is in bytes
def test_a_record_name_whose_later_segments_cannot_exist_is_refused_before_any_file_and_the_longest_that_fits_resumes(
    tmp_path, letter
):
    name_max = _name_max(tmp_path)
    per = len(letter.encode())
    # every name the record derives: <root>.seg0001.h5.tmp is the longest (12 bytes beyond the record's own name)
    fits = name_max - len(".seg0001" + ".tmp")
    root_fits = (fits - len(".h5")) // per
    too_long = letter * (root_fits + 1) + ".h5"
    assert len(os.fsencode(too_long)) <= name_max - len(".lock")  # the record and its lock file could be created
    folder = tmp_path / "runs"  # not made yet: a refused name leaves no folder either
    with pytest.raises(RecordError) as err:
        Recorder(str(folder / too_long), meta={})
    assert "\n" not in str(err.value) and "too long" in str(err.value)
    assert not folder.exists()

    name = letter * root_fits + ".h5"
    path = str(tmp_path / name)
    logged: dict[int, dict[str, float]] = {}
    with Recorder(path, meta={}, flush_every=2) as rec:
        for s in range(5):
            logged[s] = {"a": float(s)}
            rec.log(s, {"scalars/a": logged[s]["a"]})
        for s in range(5, 9):  # a path first logged after the first flush: a later segment
            logged[s] = {"a": float(s), "b": -float(s)}
            rec.log(s, {"scalars/a": logged[s]["a"], "scalars/b": logged[s]["b"]})
    with Recorder(path, meta={}, resume=True) as rec:  # a resume: another later segment
        logged[9] = {"a": 9.0, "b": -9.0}
        rec.log(9, {"scalars/a": 9.0, "scalars/b": -9.0})
    got = _plain_rows(tmp_path, name[: -len(".h5")])
    assert got == logged


@pytest.mark.parametrize("value", [np.float32(0.5), np.int64(2), np.float16(0.25)])
def test_a_numpy_number_of_seconds_is_a_flush_interval_like_the_python_number(tmp_path, value):
    """flush_seconds=np.float32(0.5) (a config read with numpy) was refused as 'must be a positive number, got 0.5'."""
    with Recorder(str(tmp_path / "run.h5"), meta={}, flush_seconds=value) as rec:
        assert rec.flush_seconds == float(value)


@pytest.mark.parametrize("value", [True, np.bool_(True), "10", 0, -1.0, float("nan")])
def test_a_flush_interval_that_is_no_positive_number_is_refused_alike_by_the_recorder_and_a_rank_that_writes_nothing(
    tmp_path, value
):
    """True was taken as 1 s; a callback that opens no recorder (target None, a rank > 0) took any flush_seconds while
    rank 0's Recorder refused it, so that rank went on into its loop."""
    from nasdiag.record import RecorderCallback

    for make in (
        lambda: Recorder(str(tmp_path / "run.h5"), meta={}, flush_seconds=value),
        lambda: RecorderCallback(None, flush_seconds=value),
    ):
        with pytest.raises(RecordError, match="flush_seconds must be a positive number") as err:
            make()
        assert "\n" not in str(err.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.filterwarnings("ignore::nasdiag.record.RecordWarning")  # the NaN logged, as the writer says
def test_the_report_of_a_live_record_counts_the_nonfinite_values_and_segments_of_the_rows_it_shows(tmp_path, monkeypatch):
    """build_report read the rows (`load`), then the NaN/inf counts (`load_meta`), then the segments, each a reading of
    its own: a writer flushing between them put a NaN of a row the page does not show into its 'NaN/inf values' line
    (a page of steps 0-9, all finite, said scalars/a: 1) and its segment line said steps 0-10. The writer's flush is
    made to fall right after the first reading here; the reference is numpy's count over the rows the page lists."""
    import nasdiag.record.reader as reader
    from nasdiag.plot.report import build_report

    path = str(tmp_path / "run.h5")
    rec = Recorder(path, meta={}, flush_every=1000)
    for s in range(10):
        rec.log(s, {"scalars/a": float(s)})
    rec.flush()
    real_read = reader.read_segments
    readings = []

    def read_then_the_writer_goes_on(*args, **kwargs):
        segments = real_read(*args, **kwargs)
        if not readings:
            rec.log(10, {"scalars/a": float("nan")})
            rec.flush()
        readings.append(len(segments))
        return segments

    monkeypatch.setattr(reader, "read_segments", read_then_the_writer_goes_on)
    try:
        page = build_report(path, figures=[], dpi=20)
    finally:
        rec.close()
    monkeypatch.undo()
    with h5py.File(path, "r") as f:  # plain h5py: the rows the page lists, steps 0-9
        shown = f["scalars/a"][:10]
    assert "steps 0–9" in page and np.isfinite(shown).all()
    assert "NaN/inf values" not in page and "steps 0–10" not in page
