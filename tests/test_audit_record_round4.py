"""Recorder audit, round 4: the record's file moved or deleted while written, a segment that cannot be created,
steps beyond int64, rows without elements, Python scalars through the callback, the row digest against its
documented formula, and the reader's memory on large rows.

References are this file's own: the values logged (known functions of the step), the digest computed from
docs/schema.md's formula with Python integers, files read back with plain h5py, and numpy's own arrays for the
memory a load cannot avoid."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import textwrap
import tracemalloc
import warnings

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder, RecordWarning, load, load_meta
from nasdiag.record.callbacks import RecorderCallback


def _x(step: int) -> float:
    return step * 0.5 + 0.125


# --- the record moved or deleted while it is written --------------------------------------------------------


@pytest.mark.parametrize("how", ["moved", "deleted"])
def test_a_record_moved_or_deleted_while_written_is_one_record_error_at_the_next_flush(tmp_path, how):
    """Before, the writer went on into the moved file (and put the segment of a new path next to the old name,
    where no record was left) or into the deleted inode, losing every later row without a word."""
    path = tmp_path / "run.h5"
    rec = Recorder(path, flush_every=2, flush_seconds=None)
    for step in range(4):  # two flushes: 4 rows committed
        rec.log(step, {"scalars/x": _x(step)})
    if how == "moved":
        os.rename(path, tmp_path / "kept.h5")
    else:
        os.unlink(path)
    rec.log(4, {"scalars/x": _x(4)})
    with pytest.raises(RecordError) as raised:
        rec.log(5, {"scalars/x": _x(5)})  # the flush of rows 4, 5
    message = str(raised.value)
    assert "\n" not in message and "moved or deleted" in message and "4 committed rows" in message, message
    assert "2 buffered rows are not written" in message, message
    with pytest.raises(RecordError, match="accepts no more rows"):
        rec.log(6, {"scalars/new": 1.0})  # a new path: no segment appears next to the old name
    rec.close()
    assert sorted(os.listdir(tmp_path)) == (["kept.h5"] if how == "moved" else [])
    if how == "moved":  # the moved file holds exactly the committed rows, intact
        out = load(tmp_path / "kept.h5")
        np.testing.assert_array_equal(out["step"], np.arange(4))
        np.testing.assert_array_equal(out["scalars/x"], [_x(s) for s in range(4)])


def test_a_record_moved_and_put_back_is_written_on(tmp_path):
    """Only another file at the path (or none) is refused: the same file back in place is the record."""
    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=2, flush_seconds=None) as rec:
        for step in range(4):
            rec.log(step, {"scalars/x": _x(step)})
            if step == 1:
                os.rename(path, tmp_path / "elsewhere.h5")
                os.rename(tmp_path / "elsewhere.h5", path)
    np.testing.assert_array_equal(load(path)["scalars/x"], [_x(s) for s in range(4)])


# --- a segment that cannot be created -----------------------------------------------------------------------


def test_a_segment_that_cannot_be_created_keeps_its_rows_and_every_later_log_is_one_record_error(tmp_path, monkeypatch):
    """A new path switches the writer to a new segment; when the folder has turned read-only by then, the
    segment cannot be published. Before, the full buffer then made every later log an IndexError of numpy (the
    row buffer overflowed), and nothing said whether the rows were kept."""
    path = tmp_path / "run.h5"
    rec = Recorder(path, flush_every=2, flush_seconds=None)
    for step in range(4):
        rec.log(step, {"scalars/x": _x(step)})
    real_link = os.link

    def read_only(src, dst, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), dst)

    monkeypatch.setattr(os, "link", read_only)
    rec.log(4, {"scalars/x": _x(4), "scalars/y": -4.0})  # buffered for the new segment
    errors = []
    for step in range(5, 9):
        try:
            rec.log(step, {"scalars/x": _x(step), "scalars/y": -float(step)})
        except RecordError as err:  # any other exception fails the test
            errors.append(str(err))
    assert len(errors) == 4 and all("read-only" in e and "\n" not in e for e in errors), errors
    assert "2 buffered rows are not written yet" in errors[0], errors[0]
    assert rec.rows_buffered == 2  # steps 4 and 5; the refused rows 6..8 are not half-buffered
    np.testing.assert_array_equal(load(path)["step"], np.arange(4))  # what was committed is readable meanwhile
    monkeypatch.setattr(os, "link", real_link)  # the folder is writable again
    rec.log(9, {"scalars/x": _x(9), "scalars/y": -9.0})
    rec.close()
    out = load(path)
    steps = [0, 1, 2, 3, 4, 5, 9]
    np.testing.assert_array_equal(out["step"], steps)
    np.testing.assert_array_equal(out["scalars/x"], [_x(s) for s in steps])
    np.testing.assert_array_equal(out["valid/scalars/y"], [s >= 4 for s in steps])
    np.testing.assert_array_equal(out["scalars/y"][4:], [-4.0, -5.0, -9.0])


_FULL_DISK_CHILD = textwrap.dedent("""
    import os, resource, sys, time, warnings
    import numpy as np
    from nasdiag.record import Recorder, RecordError, load
    warnings.simplefilter("ignore")
    path = sys.argv[1]
    rec = Recorder(path, flush_every=4, flush_seconds=None)
    row = lambda s: {"scalars/x": s * 0.5 + 0.125, "arch/w": np.full(64, float(s))}
    for s in range(8):
        rec.log(s, row(s))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path), hard))  # Python ignores SIGXFSZ: EFBIG
    try:
        for s in range(8, 5000):
            rec.log(s, row(s))
    except RecordError as err:
        print("ERR", rec.rows_committed, err, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    start = time.monotonic()
    out = load(path)  # the failed recorder is still open
    print("LOADED", out["step"].size, round(time.monotonic() - start, 2), flush=True)
    np.testing.assert_array_equal(out["scalars/x"], out["step"] * 0.5 + 0.125)
    np.testing.assert_array_equal(out["arch/w"], np.repeat(out["step"][:, None], 64, 1).astype(float))
    print("VALUES OK", flush=True)
""")


def test_a_record_whose_writer_hit_a_full_disk_loads_in_the_same_process_before_the_recorder_is_closed(tmp_path):
    """After a failed write the segment's descriptor points at /dev/null; the file stayed open until `close`, and
    HDF5 hands an open file to every later open of it in the process, so a `load` meanwhile read nothing and
    retried without end (killed after minutes; SIGTERM waited for it). Reference: the rows the writer reported
    committed, each a known function of its step."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    try:
        child = subprocess.run([sys.executable, "-c", _FULL_DISK_CHILD, str(tmp_path / "run.h5")], env=env,
                               capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("loading the record of a recorder that hit a full disk hung")
    lines = child.stdout.splitlines()
    assert child.returncode == 0 and len(lines) == 3, (child.stdout, child.stderr[-2000:])
    _, committed, message = lines[0].split(" ", 2)
    assert "disk full or file-size limit" in message and int(committed) >= 8, message
    _, loaded, seconds = lines[1].split()
    assert int(loaded) == int(committed) and float(seconds) < 10, lines[1]
    assert lines[2] == "VALUES OK"


# --- steps and values ---------------------------------------------------------------------------------------


def test_a_step_beyond_int64_is_one_record_error_and_the_record_keeps_its_rows(tmp_path):
    """Before, a Python int step of 2**63 came out of the int64 step buffer as numpy's OverflowError."""
    path = tmp_path / "run.h5"
    largest = int(np.iinfo(np.int64).max)
    with Recorder(path, flush_seconds=None) as rec:
        rec.log(0, {"scalars/x": _x(0)})
        for step in (largest + 1, np.uint64(largest + 1), 2**70):
            with pytest.raises(RecordError, match="int64"):
                rec.log(step, {"scalars/x": 1.0})
        rec.log(largest, {"scalars/x": _x(1)})  # the largest step there is still fits
    out = load(path)
    assert out["step"].dtype == np.int64
    np.testing.assert_array_equal(out["step"], [0, largest])
    with RecorderCallback(tmp_path / "callback.h5", flush_seconds=None) as callback:
        with pytest.raises(RecordError, match="int64"):
            callback.on_step_end(largest + 1, {"scalars/x": 1.0})
        callback.on_step_end(3, {"scalars/x": 1.0})
    np.testing.assert_array_equal(load(tmp_path / "callback.h5")["step"], [3])


def test_a_value_without_elements_is_refused_at_its_log_and_every_other_row_is_written(tmp_path):
    """Before, a (3, 0) row was accepted and the flush then failed to create the segment (HDF5 chunks cannot
    have a 0-long axis): every buffered row, of every path, was lost, at close."""
    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=4, flush_seconds=None) as rec:
        rec.log(0, {"scalars/x": _x(0)})
        for empty in (np.zeros((3, 0)), np.zeros(0, np.float32), np.zeros((0, 2), bool)):
            with pytest.raises(RecordError, match="no elements") as raised:
                rec.log(1, {"scalars/x": _x(1), "hessian/empty": empty})
            assert "\n" not in str(raised.value)
        rec.log(1, {"scalars/x": _x(1)})
    out = load(path)
    np.testing.assert_array_equal(out["step"], [0, 1])
    np.testing.assert_array_equal(out["scalars/x"], [_x(0), _x(1)])
    assert "hessian/empty" not in out


def _unconvertible(kind: str):
    import torch

    return {"ragged list": lambda: [1.0, [2.0, 3.0]], "sparse tensor": lambda: torch.ones(2).to_sparse(),
            "meta tensor": lambda: torch.ones(2, device="meta")}[kind]()


@pytest.mark.parametrize("kind", ["ragged list", "sparse tensor", "meta tensor"])
def test_a_value_that_cannot_become_an_array_is_one_record_error_at_its_call_and_costs_only_its_row(tmp_path, kind):
    """Before, `Recorder.log` let numpy's or torch's own error out (ValueError, NotImplementedError),
    and through the callback the value failed at the hand-over of its batch: that batch and every later one were
    lost, each later call raising the same error."""
    bad = _unconvertible(kind)
    with Recorder(tmp_path / "direct.h5", flush_every=2, flush_seconds=None) as rec:
        rec.log(0, {"scalars/x": _x(0)})
        with pytest.raises(RecordError, match="cannot be"):
            rec.log(1, {"scalars/x": _x(1), "scalars/v": bad})
        rec.log(2, {"scalars/x": _x(2), "scalars/v": np.array([1.0, 2.0])})
    with RecorderCallback(tmp_path / "callback.h5", flush_every=2, flush_seconds=None) as callback:
        for step in range(7):
            values = {"scalars/x": _x(step), "scalars/v": bad if step == 2 else np.array([float(step), 0.0])}
            if step == 2:
                with pytest.raises(RecordError, match="cannot be"):
                    callback.on_step_end(step, values)
            else:
                callback.on_step_end(step, values)
    for name, steps in (("direct.h5", [0, 2]), ("callback.h5", [0, 1, 3, 4, 5, 6])):
        out = load(tmp_path / name)
        np.testing.assert_array_equal(out["step"], steps)
        np.testing.assert_array_equal(out["scalars/x"], [_x(s) for s in steps])
    np.testing.assert_array_equal(load(tmp_path / "callback.h5")["scalars/v"][:, 0], [0, 1, 3, 4, 5, 6])


def test_under_ddp_a_row_of_another_shape_costs_only_itself(tmp_path, monkeypatch):
    """Rows reduced across ranks are stacked per path; one row of another shape failed the stacking of its batch,
    which then stayed held (raw, unreduced) and failed every later hand-over: rows held grew without bound and
    nothing after it was recorded. One rank of two ranks holding the same rows (rule mean: the reduction returns
    them), as a stand-in for a process group."""
    from nasdiag import distributed

    monkeypatch.setattr(distributed, "world_size", lambda group=None: 2)
    monkeypatch.setattr(distributed, "reduce_statistics", lambda stats, **kw: {p: np.asarray(v) for p, v in stats.items()})
    with RecorderCallback(tmp_path / "run.h5", flush_every=2, flush_seconds=None) as callback:
        refused_at = {4: 2, 6: 5}  # the call handing over the batch that holds the row of shape (3,)
        for step in range(8):
            values = {"scalars/x": _x(step), "scalars/v": np.full(3 if step in (2, 5) else 2, float(step))}
            if step in refused_at:
                with pytest.raises(RecordError, match=f"at step {refused_at[step]}: got shape \\(3,\\)"):
                    callback.on_step_end(step, values)
            else:
                callback.on_step_end(step, values)
            assert callback.rows_held <= 2
    steps = [0, 1, 3, 4, 6, 7]
    out = load(tmp_path / "run.h5")
    np.testing.assert_array_equal(out["step"], steps)
    np.testing.assert_array_equal(out["scalars/v"], np.repeat(np.array(steps, float)[:, None], 2, 1))


def test_a_python_int_on_a_float_path_is_recorded_through_the_callback_as_through_the_recorder(tmp_path):
    """`Recorder.log` casts a Python int to its float path; the callback turned it into a numpy int64 first, so the
    same row was refused there (and lost). Reference: the values as Python computes them."""
    rows = [(0, {"scalars/loss": 0.5, "scalars/pruned": 0}), (1, {"scalars/loss": 0, "scalars/pruned": 2}),
            (2, {"scalars/loss": 2**60, "scalars/pruned": 0}), (3, {"scalars/loss": 0.25})]
    with RecorderCallback(tmp_path / "run.h5", flush_every=8, flush_seconds=None) as callback:
        for step, values in rows[:3]:
            callback.on_step_end(step, values)
        callback.flush()  # the next row is handed over in its own batch, after the paths exist
        callback.on_step_end(*rows[3])
    out = load(tmp_path / "run.h5")
    np.testing.assert_array_equal(out["step"], [0, 1, 2, 3])
    assert out["scalars/loss"].dtype == np.float64 and out["scalars/pruned"].dtype == np.int64
    np.testing.assert_array_equal(out["scalars/loss"], [0.5, 0.0, float(2**60), 0.25])
    np.testing.assert_array_equal(out["scalars/pruned"][:3], [0, 2, 0])


def test_float64_nonfinite_values_and_unicode_names_round_trip_exactly(tmp_path):
    """float64 stays float64 bit for bit (subnormals, -0.0, NaN, ±inf), NaN/inf are counted per path as the
    vocabulary says, int64 and bool keep their dtype, and op/edge names keep any character (also '/')."""
    meta = {"op_names": ["skip", "conv/3x3", "Ωπ"], "edge_names": {"normal": ["0→2", "1/2"]}, "cell_types": ["normal"]}
    weights = np.array([[np.nextafter(0, 1), -0.0, 1 / 3], [np.inf, -np.inf, np.nan]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(tmp_path / "run.h5", meta=meta, flush_every=2, flush_seconds=None) as rec:
            for step in range(3):
                rec.log(step, {"arch/normal/weights": weights * (step + 1), "scalars/n": np.int64(-(2**62) - step),
                               "scalars/ok": np.bool_(step % 2), "scalars/loss": 0.1 * step})
    with h5py.File(tmp_path / "run.h5", "r") as f:
        stored = f["arch/normal/weights"][()]
        assert stored.dtype == np.float64 and f["scalars/n"].dtype == np.int64 and f["scalars/ok"].dtype == bool
    want = np.stack([weights * (step + 1) for step in range(3)])
    assert stored.tobytes() == want.tobytes()  # -0.0, the subnormal and NaN's bits included
    out, got_meta = load(tmp_path / "run.h5"), load_meta(tmp_path / "run.h5")
    np.testing.assert_array_equal(out["scalars/n"], [-(2**62), -(2**62) - 1, -(2**62) - 2])
    np.testing.assert_array_equal(out["scalars/loss"], [0.0, 0.1, 0.2])
    assert got_meta["nonfinite_counts"]["arch/normal/weights"] == 3 * 3
    assert got_meta["op_names"] == meta["op_names"] and got_meta["edge_names"] == meta["edge_names"]
    assert list(out["meta/edge_names/normal"]) == ["0→2", "1/2"]


@pytest.mark.parametrize("meta, key", [({"op_names": ["skip", "bad\udc80"]}, "op_names"),  # os.fsdecode of non-UTF-8 bytes
                                       ({"edge_names": {"normal": ["0-2\ud800"]}}, "edge_names/normal"),
                                       ({"method": "darts\udc80"}, "method"), ({"op_names": ["a\x00b"]}, "op_names")])
def test_meta_text_hdf5_cannot_store_is_refused_naming_its_key_before_any_file_is_made(tmp_path, meta, key):
    """Before, the recorder opened, then failed to create its segment with "cannot create record segment ...:
    'utf-8' codec can't encode ..." (a storage error, no key named)."""
    with pytest.raises(RecordError) as raised:
        Recorder(tmp_path / "run.h5", meta=meta)
    message = str(raised.value)
    assert f"meta[{key!r}]" in message and "segment" not in message and "\n" not in message, message
    assert os.listdir(tmp_path) == []


# --- the row digest and the memory of reading large rows ----------------------------------------------------

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _weights(name: str, nbytes: int) -> np.ndarray:
    """docs/schema.md's w_part[b] = splitmix64(seed_part + b) | 1, with Python integers (then as uint64)."""
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return np.array([_splitmix64((seed + b) & _MASK) | 1 for b in range(nbytes)], dtype=np.uint64)


def test_every_row_digest_is_the_documented_weighted_byte_sum_also_for_rows_over_a_mebibyte(tmp_path):
    """The digest of each row from docs/schema.md's formula: Σ_parts Σ_b w_part[b]·byte[b] mod 2**64 with bit 63
    set; a row of 1 MiB + 24 bytes is summed by the writer in two blocks of its bytes."""
    big = np.arange(131075, dtype=np.float64)  # 1 048 600 bytes
    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=4, flush_seconds=None) as rec:
        rec.log(3, {"big/x": big, "scalars/n": np.int32(7)})
        rec.log(5, {"scalars/n": np.int32(-1)})  # big/x missing: NaN fill, present False
        rec.log(9, {"big/x": -big, "scalars/n": np.int32(2)})
    with h5py.File(path, "r") as f:
        paths = [p.decode() if isinstance(p, bytes) else p for p in f["present"].attrs["paths"]]
        parts = [("step", f["step"][()]), ("present", f["present"][()])] + [(p, f[p][()]) for p in paths]
        stored = f["digest"][()]
    assert paths == ["big/x", "scalars/n"]
    weights = {}
    for row in range(3):
        total = 0
        for name, data in parts:
            raw = np.frombuffer(np.ascontiguousarray(data[row], data.dtype.newbyteorder("<")).tobytes(), np.uint8)
            if name not in weights:
                weights[name] = _weights(name, raw.size) if raw.size < 1000 else None
            if weights[name] is None:  # the large part: the same formula, vectorised over its bytes
                seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
                with np.errstate(over="ignore"):
                    x = np.uint64(seed) + np.arange(raw.size, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
                    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
                    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
                    w = (x ^ (x >> np.uint64(31))) | np.uint64(1)
                    total += int(np.sum(w * raw.astype(np.uint64), dtype=np.uint64))
            else:
                total += sum(int(w) * int(b) for w, b in zip(weights[name], raw))
        assert int(stored[row]) == (total & _MASK) | (1 << 63), row


def test_loading_large_rows_needs_no_temporaries_proportional_to_the_record(tmp_path):
    """The digest check summed whole blocks of up to 4096 rows as uint64, 8 bytes per stored byte: loading 16 MiB
    of 128 KiB rows peaked at about 10 times the data (gigabytes for a long record of such rows). Now its
    temporaries are bounded (8 MiB); the rest of a load is the data itself, read, merged and returned."""
    rows, width = 128, 16384  # 128 KiB rows, 16 MiB
    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=32, flush_seconds=None) as rec:
        for step in range(rows):
            rec.log(step, {"big/x": np.full(width, float(step))})
    data_bytes = rows * width * 8
    tracemalloc.start()
    try:
        out = load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(out["big/x"][:, 0], np.arange(rows, dtype=float))
    assert peak < 4 * data_bytes + (8 << 20), f"load peaked at {peak / 2**20:.0f} MiB for {data_bytes / 2**20:.0f} MiB of rows"
