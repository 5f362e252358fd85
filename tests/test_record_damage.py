"""Damaged records are refused, never read as data: truncation at random offsets, flipped bytes in
data chunks, missing or shortened segments. Each case checks the failure names the file and the
first bad row, and that ``load(salvage=True)`` returns exactly the rows before it, equal to what
was logged (the rows are a known function of the step)."""

from __future__ import annotations

import os
import random
import shutil
import time
import warnings

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder, RecordWarning, load, load_meta

E, K = 14, 8
ROW_BYTES = E * K * 4  # arch/normal/weights, float32


def _row(step: int) -> dict:
    return {
        "scalars/loss": step * 0.5,
        "arch/normal/weights": np.full((E, K), step, np.float32) + np.arange(E * K, dtype=np.float32).reshape(E, K) / 1000,
        "regret/normal/alive": np.array([step % 2 == 0, True]),
    }


def _write(path, steps, **kwargs) -> None:
    with Recorder(path, flush_every=16, flush_seconds=None, **kwargs) as rec:
        for step in steps:
            rec.log(step, _row(step))


def _write_copying_midway(path, copy, steps, later_steps) -> None:
    """Log ``steps``, flush, copy the live file to ``copy`` (marked open for SWMR writing, as after a
    crash), then log ``later_steps`` and close."""
    with Recorder(path, flush_every=16, flush_seconds=None) as rec:
        for step in steps:
            rec.log(step, _row(step))
        rec.flush()
        shutil.copy(path, copy)
        for step in later_steps:
            rec.log(step, _row(step))


def _assert_rows(out: dict, steps) -> None:
    """``out`` holds exactly the rows logged at ``steps`` (nothing invented, nothing zeroed)."""
    np.testing.assert_array_equal(out["step"], list(steps))
    for i, step in enumerate(steps):
        for path, value in _row(step).items():
            np.testing.assert_array_equal(out[path][i], value, err_msg=f"{path} at step {step}")


def _salvaged(path) -> dict:
    with pytest.warns(RecordWarning, match="damaged"):
        return load(path, salvage=True)


def _flip(file, offset: int) -> None:
    with open(file, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x5A]))


@pytest.fixture(scope="module")
def closed_record(tmp_path_factory):
    path = tmp_path_factory.mktemp("closed") / "run.h5"
    _write(path, range(300))
    return path


@pytest.fixture(scope="module")
def crashed_record(tmp_path_factory):
    """A copy of a record taken while its writer was alive: marked open for SWMR writing, as after a
    crash (HDF5 skips its own end-of-file check for these)."""
    folder = tmp_path_factory.mktemp("crashed")
    _write_copying_midway(folder / "live.h5", folder / "run.h5", range(300), [])
    return folder / "run.h5"


@pytest.mark.parametrize("kind", ["closed", "crashed"])
def test_truncation_at_random_offsets_is_refused_and_salvage_is_an_exact_prefix(kind, closed_record, crashed_record, tmp_path):
    source = closed_record if kind == "closed" else crashed_record
    size = os.path.getsize(source)
    rng = random.Random(15)
    offsets = sorted(rng.randrange(size // 20, size) for _ in range(8)) + [size // 2]
    refused = 0
    for offset in offsets:
        path = tmp_path / f"cut{offset}.h5"
        shutil.copy(source, path)
        os.truncate(path, offset)
        start = time.perf_counter()
        try:
            out = load(path)
        except RecordError as err:
            message = str(err)
            assert str(path) in message and "row" in message and "\n" not in message, message
            refused += 1
            salvaged = _salvaged(path)
            _assert_rows(salvaged, range(salvaged["step"].size))  # an exact prefix, maybe empty
            assert salvaged["step"].size < 300
        else:  # only bytes nothing refers to were cut: then every row must be intact
            _assert_rows(out, range(300))
        assert time.perf_counter() - start < 10, f"reading a file cut at {offset} took too long"
    assert refused >= len(offsets) - 1, f"only {refused} of {len(offsets)} truncations were detected"


def test_half_truncated_record_no_longer_reads_as_zeros(closed_record, tmp_path):
    path = tmp_path / "half.h5"
    shutil.copy(closed_record, path)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(RecordError, match=r"is damaged at .*half\.h5 row \d+"):
        load(path)
    with pytest.raises(RecordError, match="damaged"):
        load_meta(path)
    salvaged = _salvaged(path)
    assert 0 < salvaged["step"].size < 300
    _assert_rows(salvaged, range(salvaged["step"].size))


@pytest.mark.parametrize("dataset", ["arch/normal/weights", "scalars/loss", "step", "present", "digest"])
def test_flipped_byte_in_a_data_chunk_names_its_row(closed_record, tmp_path, dataset):
    path = tmp_path / "flipped.h5"
    shutil.copy(closed_record, path)
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        chunk = ds.id.get_chunk_info(ds.id.get_num_chunks() - 1)  # the last chunk: rows chunk_offset[0] ...
        first_row = chunk.chunk_offset[0]
        row_bytes = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=int))
        rows_in_chunk = min(ds.chunks[0], ds.shape[0] - first_row)
    within = 3 if rows_in_chunk > 3 else rows_in_chunk - 1
    bad_row = first_row + within
    _flip(path, chunk.byte_offset + within * row_bytes + row_bytes // 2)
    with pytest.raises(RecordError) as info:
        load(path)
    message = str(info.value)
    assert f"{path} row {bad_row}" in message, message
    _assert_rows(_salvaged(path), range(bad_row))


def _three_segments(path) -> None:
    _write(path, range(0, 40))
    _write(path, range(40, 80), resume=True)
    _write(path, range(80, 120), resume=True)


def test_missing_segment_is_refused(tmp_path):
    path = tmp_path / "run.h5"
    _three_segments(path)
    _assert_rows(load(path), range(120))
    os.remove(tmp_path / "run.seg0001.h5")
    with pytest.raises(RecordError, match=r"run\.seg0001\.h5 row 0: the segment is missing"):
        load(path)
    _assert_rows(_salvaged(path), range(40))  # the later segment is dropped with the gap

    first = tmp_path / "first.h5"
    _three_segments(first)
    os.remove(first)
    with pytest.raises(RecordError, match=r"first\.h5 row 0: the segment is missing"):
        load(first)
    assert _salvaged(first)["step"].size == 0


def test_segment_with_fewer_rows_than_recorded_is_refused(tmp_path):
    """Segment 0 replaced by an older copy of itself (valid rows, but fewer than segment 1 recorded
    for it when it was created)."""
    path = tmp_path / "run.h5"
    _write_copying_midway(path, tmp_path / "old.h5", range(8), range(8, 16))
    _write(path, range(16, 20), resume=True)
    shutil.copy(tmp_path / "old.h5", path)
    with pytest.raises(RecordError, match=r"run\.h5 row 8: it has 8 rows, but .*run\.seg0001\.h5 recorded 16"):
        load(path)
    _assert_rows(_salvaged(path), range(8))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_resume_of_a_damaged_record_is_refused_and_changes_nothing(crashed_record, tmp_path, damage):
    path = tmp_path / "run.h5"
    shutil.copy(crashed_record, path)
    if damage == "truncated":
        os.truncate(path, os.path.getsize(path) * 2 // 3)
    else:
        with h5py.File(path, "r", swmr=True) as f:
            offset = f["arch/normal/weights"].id.get_chunk_info(2).byte_offset
        _flip(path, offset + 10)
    before = path.read_bytes()
    with pytest.raises(RecordError, match="damaged"):
        Recorder(path, resume=True)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]


def test_not_a_record_and_folders_are_one_line_errors(tmp_path):
    text = tmp_path / "notes.h5"
    text.write_text("not an HDF5 file\n" * 10)
    with pytest.raises(RecordError) as info:
        load(text)
    assert str(text) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(RecordError, match="is a folder"):
        load(tmp_path)


def test_live_record_is_not_damaged(tmp_path):
    """Rows not yet committed are simply not there: a record read between flushes loads clean."""
    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=4, flush_seconds=None) as rec:
        for step in range(10):
            rec.log(step, _row(step))
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                _assert_rows(load(path), range(4 * ((step + 1) // 4)))


def test_nasdiag_plot_refuses_a_truncated_record_in_one_line(closed_record, tmp_path):
    import subprocess
    import sys

    path = tmp_path / "half.h5"
    shutil.copy(closed_record, path)
    os.truncate(path, os.path.getsize(path) // 2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "nasdiag", "plot", str(path), "--out", str(tmp_path / "figs")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "damaged" in lines[0] and str(path) in lines[0] and "Traceback" not in done.stderr, done.stderr
    figs = tmp_path / "figs"
    assert not figs.exists() or not any(figs.iterdir())  # no figure drawn from damaged data
