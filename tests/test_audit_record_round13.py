"""Round-13 audit of the record (nasdiag/record, the resume path): "runs that lose nothing" and the live-readable
record, checked against this file's own plain h5py reading of the segments (docs/schema.md: committed rows are
``/step`` up to its first -1, ``/present`` says what a row logged, the later segment's row of a step wins whole),
never against nasdiag reading itself.

Checked and found right (scratch runs, not all kept as tests): `load` and `load_meta` against the plain reading on
records of four sessions with nested replays (0-69, 20-40, 30-35, 50-52) and size rollovers (MAX_SEGMENT_CHUNKS 8,
18 segments), int8/16/32/64, uint8/64, bool, float16/32/64/128 and big-endian columns, a column first logged late
and one that stops, NaN/inf rows: every step once, in order, each segment's ``nonfinite_count`` its own count of the
logged rows, ``nonfinite_counts`` that of the rows `load` returns; every torch dtype through `Recorder.log` and
`RecorderCallback` (float8 and bfloat16 as float32); meta (nested config with None and NaN, extra keys, the
versions) round-trips, and a resume with the same NaN in its config is no change; a writer of 20000 rows of 50
scalars grows by nothing between row 2000 and 20000 (tracemalloc; 10 MB file for 9.3 MB of rows), a
RecorderCallback of 8000 rows of 50 tensors likewise; 150 `cp` copies of a segment written with flush_every=1 by
another process all load (committed prefixes, values right), and `load` polling a live writer that rolls over every
few rows saw only whole prefixes; a copy of segments taken across a rollover is refused as damaged with its salvage
prefix (docs' damage table); a resume with another column dtype is one line and nothing of the row is written; a
segment of schema version 3 is one line for load, resume, `nasdiag search --resume` and `nasdiag plot`, touching
nothing; `nasdiag search --resume` whose checkpoint is past its record (its last segment restored from before) is
one line, touching nothing, and one with another --dtype likewise; `nasdiag plot`/`report` flag the NaN/inf of a
record with int/bool scalars and a late column."""

import os
import shutil
import warnings

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder, RecordWarning, load


def _segment_name(path, index):
    """docs/schema.md's file names: run.h5, run.seg0001.h5, ..."""
    return str(path) if index == 0 else str(path)[: -len(".h5")] + f".seg{index:04d}.h5"


def _plain_record(path):
    """{step: {path: value}} of a record as docs/schema.md describes it, read with plain h5py: each segment's committed
    rows, only what ``/present`` says each row logged, the row of a later segment replacing an earlier one whole."""
    rows, index = {}, 0
    while os.path.exists(_segment_name(path, index)):
        with h5py.File(_segment_name(path, index), "r", swmr=True) as f:
            steps = f["step"][()]
            n = int(np.argmax(steps < 0)) if (steps < 0).any() else len(steps)
            paths = [p.decode() if isinstance(p, bytes) else p for p in f["present"].attrs["paths"]]
            present = f["present"][:n]
            data = {p: f[p][:n] for p in paths}
            for r in range(n):
                rows[int(steps[r])] = {p: data[p][r] for j, p in enumerate(paths) if present[r, j]}
        index += 1
    return rows


def test_a_recorder_whose_process_changes_its_working_folder_keeps_writing_the_record_it_opened(tmp_path, monkeypatch):
    """A relative record path named a file of the working folder at each write: after a chdir (a notebook's %cd, a
    framework moving into its output folder) the first flush replaced a placeholder ``run.h5`` in the new folder,
    leaving the record the recorder opened empty, and a later segment went there too; `load` of the record returned
    the rows before the chdir without a word (the last segment missing as a whole cannot be noticed)."""
    opened, other = tmp_path / "opened", tmp_path / "other"
    opened.mkdir(), other.mkdir()
    monkeypatch.chdir(opened)
    logged = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder("run.h5", flush_every=2, flush_seconds=None) as rec:
            for step in range(8):
                if step == 1:
                    monkeypatch.chdir(other)  # before the first flush (the placeholder's replacement)
                row = {"scalars/x": step + 0.5, "ints/i": np.int32(-step)}
                if step >= 6:
                    row["late/y"] = step % 2 == 0  # a path first logged after the first flush: the next segment
                rec.log(step, row)
                logged[step] = row
    assert os.listdir(other) == []
    monkeypatch.chdir(tmp_path)
    record = opened / "run.h5"
    plain = _plain_record(record)
    assert sorted(plain) == list(range(8)) and os.path.exists(_segment_name(record, 1))
    got = load(record)
    assert got["step"].tolist() == list(range(8))
    for i, step in enumerate(range(8)):
        assert plain[step].keys() == logged[step].keys(), step
        for p, value in logged[step].items():
            assert plain[step][p] == value and got[p][i] == value and got[f"valid/{p}"][i], (step, p)


def test_load_of_four_sessions_with_nested_replays_and_rollovers_equals_the_plain_reading(tmp_path, monkeypatch):
    """Steps 0-69, then resumes replaying 20-40, 30-35 and 50-52 (each from a "checkpoint"), rows large enough that
    a segment rolls over every few batches, an int16 column only the second session logs and a NaN every 9th step:
    `load` gives every step once, in order, each from the last session that logged it, as the plain reading does,
    and each segment's ``nonfinite_count`` is its own logged rows' count."""
    from nasdiag.record import load_meta, schema

    monkeypatch.setattr(schema, "MAX_SEGMENT_CHUNKS", 8)  # rows of 16 KiB, a chunk each: a segment every 2 batches
    path = tmp_path / "run.h5"
    want = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        for session, steps in enumerate((range(0, 70), range(20, 41), range(30, 36), range(50, 53))):
            with Recorder(path, flush_every=3, flush_seconds=None, resume=session > 0) as rec:
                for step in steps:
                    row = {"scalars/v": np.nan if step % 9 == 0 else step + session / 10,
                           "big/b": np.full(4096, session, np.float32)}
                    if session == 1 and step > 30:
                        row["late/l"] = np.int16(step)
                    rec.log(step, row)
                    want[step] = row
    plain = _plain_record(path)
    assert sorted(plain) == sorted(want) == list(range(70))
    got = load(path)
    assert got["step"].tolist() == list(range(70))
    for i, step in enumerate(range(70)):
        assert plain[step].keys() == want[step].keys(), step
        for p in ("scalars/v", "big/b", "late/l"):
            assert got[f"valid/{p}"][i] == (p in want[step]), (step, p)
            if p in want[step]:
                np.testing.assert_array_equal(got[p][i], want[step][p], err_msg=f"{p} {step}")
                np.testing.assert_array_equal(plain[step][p], want[step][p], err_msg=f"{p} {step}")
    index = 0
    while os.path.exists(_segment_name(path, index)):
        with h5py.File(_segment_name(path, index), "r", swmr=True) as f:
            steps = f["step"][()]
            column = list(f["present"].attrs["paths"]).index("scalars/v")
            logged = f["present"][: len(steps), column]
            own = int(np.isnan(f["scalars/v"][: len(steps)][logged]).sum())
            assert int(f["scalars/v"].attrs["nonfinite_count"]) == own, index
        index += 1
    assert index > 8
    assert load_meta(path)["nonfinite_counts"]["scalars/v"] == sum(step % 9 == 0 for step in range(70))


def test_a_copy_of_a_live_record_loads_the_rows_committed_when_it_was_copied(tmp_path):
    """``cp`` of a record while its writer holds it: the copy is marked open for SWMR writing as the live file is
    (plain h5py needs ``swmr=True``, as docs/schema.md says), has no live writer's lock beside it, and `load` gives
    the rows committed at the copy; segments copied on both sides of a rollover are refused as damaged, naming
    the salvage, which returns the earlier copy's rows."""
    from nasdiag.record.errors import DamagedRecordError

    path, copy = tmp_path / "run.h5", tmp_path / "copy"
    copy.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(path, flush_every=2, flush_seconds=None) as rec:
            for step in range(7):  # 6 committed, 1 buffered
                rec.log(step, {"scalars/x": step * 0.25})
            shutil.copyfile(path, copy / "run.h5")
            with pytest.raises(OSError):
                h5py.File(copy / "run.h5", "r").close()
            assert sorted(_plain_record(copy / "run.h5")) == list(range(6))
            got = load(copy / "run.h5")
            assert got["step"].tolist() == list(range(6)) and got["scalars/x"].tolist() == [s * 0.25 for s in range(6)]
            for step in range(7, 12):
                rec.log(step, {"scalars/x": step * 0.25, **({"late/y": 1.0} if step >= 10 else {})})
            rec.flush()
            shutil.copyfile(_segment_name(path, 1), _segment_name(copy / "run.h5", 1))
        with pytest.raises(DamagedRecordError, match="salvage=True") as err:
            load(copy / "run.h5")
        assert len(str(err.value).splitlines()) == 1 and err.value.intact_rows == 6
        assert load(copy / "run.h5", salvage=True)["step"].tolist() == list(range(6))
    assert load(path)["step"].tolist() == list(range(12))


def test_a_resume_that_logs_another_dtype_on_a_recorded_path_is_one_line_and_writes_nothing_of_the_row(tmp_path):
    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=4, flush_seconds=None) as rec:
        for step in range(5):
            rec.log(step, {"ints/i": np.int32(step), "scalars/x": float(step)})
    with Recorder(path, flush_every=4, flush_seconds=None, resume=True) as rec:
        for bad in ({"ints/i": np.int64(5)}, {"ints/i": 5.0}, {"ints/i": True}, {"scalars/x": np.float32(5)}):
            with pytest.raises(RecordError) as err:
                rec.log(5, {"scalars/x": 5.0, "ints/i": np.int32(5), **bad})
            assert len(str(err.value).splitlines()) == 1
        rec.log(5, {"scalars/x": 5.0, "ints/i": 5})
    plain = _plain_record(path)
    assert sorted(plain) == list(range(6))
    assert plain[5]["ints/i"].dtype == np.int32 and plain[5]["ints/i"] == 5 and plain[5]["scalars/x"] == 5.0


def test_tensors_of_dtypes_numpy_lacks_are_recorded_as_float32_with_their_nan_counted(tmp_path):
    """docs/schema.md: bfloat16 and the float8 types (no numpy dtype) are recorded as float32, NaN kept and counted."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "run.h5"
    kinds = [torch.bfloat16] + [getattr(torch, k) for k in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, k)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(path, flush_every=2, flush_seconds=None) as rec:
            for step in range(3):
                rec.log(step, {f"low/{str(k)[6:]}": torch.tensor([0.5, float("nan") if step == 1 else 1.0, -2.0]).to(k)
                               for k in kinds})
    plain = _plain_record(path)
    with h5py.File(path, "r", swmr=True) as f:
        counts = {p: int(f[p].attrs["nonfinite_count"]) for p in plain[0]}
    for p in plain[0]:
        assert plain[0][p].dtype == np.float32, p
        assert plain[0][p].tolist() == [0.5, 1.0, -2.0] and np.isnan(plain[1][p][1]) and counts[p] == 1, p
