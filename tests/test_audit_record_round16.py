"""Round-16 audit of the record (nasdiag/record): files that are not records, or records of a newer layout, handed
to the reader; unusual values; a live reader in another process beside a writer of several families at different
rates, killed with SIGKILL and resumed.

References are this file's own: the files below are written with plain h5py, the values logged are known
functions of the step, and what comes back is compared with them in numpy, bit for bit.

Checked and found right (scratch runs, not all kept as tests): NaN (with payloads), ±inf, ±0.0, the smallest
subnormal, the largest and smallest normal of float16/32/64, the extremes of every int and uint width, bools,
0-d tensors and arrays, bfloat16 tensors, Fortran-ordered, negatively strided, big-endian arrays and transposed
tensors round-trip through `Recorder.log`, `load` and plain h5py bit for bit, with `nonfinite_count` and
`load_meta(...)["nonfinite_counts"]` the numpy count; names of 70000 characters and 200 levels; 300 paths of
300-character names write no HDF5 metadata block across a page (scripts/tear_writes.c, the first such write
killed: none); an empty file, a text file, an HDF5 file of other datasets, one with a user block, a folder and a
dangling link are each one `RecordError` line for `load`, `load_meta` and a resume; a plain h5py reader in another
process following a live record with `dataset.refresh()` as docs/schema.md says (4000 reads) sees exact prefixes.

Defects these tests found (each fails without its fix): HDF5 files with a /step and /present of another kind
(0-d or float /step, a path naming a group, a /present narrower than its paths) raised IndexError/AttributeError or
loaded truncated steps, and a newer-schema record without /present was called "not a record; remove it";
RecorderCallback.on_exception, .flush and Recorder.flush left every row of a batch unwritten when one held row had
another shape; a float64 value on a float32 path was cast silently (two 0-d tensors in a callback batch, or
np.float64 through Recorder.log) where it is refused otherwise; under DDP one row of another dtype cost its whole
batch or, in a first batch, promoted the path (an int64 2**60 + 1 recorded as 2**60); z.conj().imag, the imaginary
part the docs ask for, raised torch's RuntimeError out of Recorder.log.
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder, load, load_meta


def _paths_attr(names):
    return np.array(names, dtype=h5py.string_dtype())


def _zero_d_step(f):  # someone's file of a step counter and a mask
    f["step"] = np.int64(5)
    f["present"] = np.zeros((3, 0), bool)
    f["present"].attrs["paths"] = _paths_attr([])


def _step_group(f):
    f.create_group("step")
    f.create_group("present")


def _float_step(f):
    f["step"] = np.array([0.5, 1.5, 2.5])
    f["present"] = np.zeros((3, 0), bool)
    f["present"].attrs["paths"] = _paths_attr([])


def _path_is_a_group(f):
    f["step"] = np.arange(3)
    f["present"] = np.ones((3, 1), bool)
    f["present"].attrs["paths"] = _paths_attr(["losses"])
    f.create_group("losses")


def _present_narrower_than_paths(f):
    f["step"] = np.arange(3)
    f["present"] = np.ones((3, 1), bool)
    f["present"].attrs["paths"] = _paths_attr(["a/x", "a/y"])
    f["a/x"] = np.arange(3.0)
    f["a/y"] = np.arange(3.0)


@pytest.mark.parametrize("make", [_zero_d_step, _step_group, _float_step, _path_is_a_group, _present_narrower_than_paths])
def test_an_hdf5_file_whose_step_or_present_is_of_another_kind_is_one_record_error_for_load_and_resume(tmp_path, make):
    """read_segment took any file with a /step and a /present for a record: a 0-d /step raised IndexError, a path
    naming a group AttributeError, a /present narrower than its paths IndexError (tracebacks), and a float /step
    loaded as steps truncated to ints (0.5 -> 0) and was resumed into."""
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        make(f)
    before = sorted(os.listdir(tmp_path))
    for call in (load, load_meta, lambda p: Recorder(p, resume=True).close()):
        with pytest.raises(RecordError) as info:
            call(path)
        message = str(info.value)
        assert str(path) in message and "\n" not in message, message
    assert sorted(os.listdir(tmp_path)) == before  # no lock, no segment left behind


def test_a_record_of_a_newer_schema_without_present_says_upgrade_not_remove_it(tmp_path):
    """A newer layout is what a schema version bump means: one without /present was called 'not a nasdiag record
    segment ...; remove or rename it', advice that deletes a record a newer nasdiag reads."""
    path = tmp_path / "run.h5"
    with h5py.File(path, "w") as f:
        f.attrs["schema_version"] = np.int64(3)
        f.attrs["nasdiag_version"] = "9.0"
        f["step"] = np.arange(3)
        f["rows/loss"] = np.arange(3.0)
    for call in (load, lambda p: Recorder(p, resume=True).close()):
        with pytest.raises(RecordError, match="upgrade nasdiag") as info:
            call(path)
        assert "remove" not in str(info.value) and "\n" not in str(info.value)


def _loop_with_a_row_of_another_shape(path, steps, bad_step):
    """A callback holding rows of ``steps`` (flush_every above them, so nothing is handed over yet), the row of
    ``bad_step`` with a vector of another length; ``s/a`` is the step."""
    import torch

    from nasdiag.record.callbacks import RecorderCallback

    callback = RecorderCallback(path, flush_every=64, flush_seconds=None)
    for step in steps:
        callback.on_step_end(step, {"s/a": torch.tensor(float(step), dtype=torch.float64),
                                    "v/x": torch.zeros(4 if step == bad_step else 3)})
    return callback


def _committed_on_disk(path):
    with h5py.File(path, "r", swmr=True) as f:
        steps = f["step"][()]
        n = int(np.argmax(steps < 0)) if (steps < 0).any() else len(steps)
        return steps[:n], f["s/a"][:n]


@pytest.mark.parametrize("hook", ["on_exception", "flush"])
def test_a_held_row_of_another_shape_costs_only_itself_when_on_exception_or_flush_commits_the_rows(tmp_path, hook):
    """on_exception ('writes what is held first, then raises') and flush ('commit it to disk') raised at the hand-over
    of the bad row before the recorder's flush: the 5 good rows stayed in memory (0 committed, on disk nothing), lost
    to the kill that often follows an exception."""
    path = tmp_path / "run.h5"
    callback = _loop_with_a_row_of_another_shape(path, range(6), bad_step=2)
    with pytest.raises(RecordError, match="at step 2") as info:
        callback.on_exception(RuntimeError("out of memory")) if hook == "on_exception" else callback.flush()
    assert "\n" not in str(info.value)
    kept = np.array([0, 1, 3, 4, 5])
    assert callback.recorder.rows_buffered == 0 and callback.recorder.last_committed_step == 5
    steps, values = _committed_on_disk(path)  # before close: what a kill now would leave
    np.testing.assert_array_equal(steps, kept)
    np.testing.assert_array_equal(values, kept.astype(np.float64))
    callback.close()


@pytest.mark.parametrize("how", ["one row in its batch", "two rows in a batch", "Recorder.log of np.float64"])
def test_a_float64_value_on_a_float32_path_is_refused_however_it_comes(tmp_path, how):
    """A 0-d float64 tensor on a float32 path was refused when alone in the callback's batch but, two in a batch,
    stacked into np.float64 scalars (a Python float subclass) and cast to float32 without a word; Recorder.log took
    np.float64 likewise while refusing np.array(1.1) and a float64 tensor."""
    import torch

    from nasdiag.record.callbacks import RecorderCallback

    path = tmp_path / "run.h5"
    value = np.float64(1.1)  # float32(1.1) != 1.1: a silent cast is visible in the record
    if how == "Recorder.log of np.float64":
        with Recorder(path, flush_seconds=None) as rec:
            rec.log(0, {"s/a": np.float32(0.5)})
            with pytest.raises(RecordError, match="float64") as info:
                rec.log(1, {"s/a": value})
    else:
        callback = RecorderCallback(path, flush_every=8, flush_seconds=None)
        callback.on_step_end(0, {"s/a": torch.tensor(0.5, dtype=torch.float32)})
        callback.flush()
        for step in range(1, 2 if how == "one row in its batch" else 3):
            callback.on_step_end(step, {"s/a": torch.tensor(value + step, dtype=torch.float64)})
        with pytest.raises(RecordError, match="float64") as info:
            callback.flush()
        callback.close()
    assert "\n" not in str(info.value)
    data = load(path)
    np.testing.assert_array_equal(data["step"], [0])  # nothing of a float64 row went into the float32 path
    assert data["s/a"].dtype == np.float32 and data["s/a"][0] == np.float32(0.5)


def test_under_ddp_a_row_of_another_dtype_costs_only_itself_and_no_value_is_promoted(tmp_path, monkeypatch):
    """Rows reduced across ranks were stacked per path into their common dtype: one float64 row among float32 ones
    made the whole batch float64, and the recorder refused all four rows (naming step 4, a float32 one); in the first
    batch an int64 2**60 + 1 beside a Python float 3.5 became the float64 2**60. Each such row is now refused alone,
    as `Recorder.log` refuses it in a single process. One rank of two holding the same rows (rule mean returns them),
    as a stand-in for a process group, as in round 4."""
    import torch

    from nasdiag import distributed
    from nasdiag.record.callbacks import RecorderCallback

    monkeypatch.setattr(distributed, "world_size", lambda group=None: 2)
    monkeypatch.setattr(distributed, "reduce_statistics", lambda stats, **kw: {p: np.asarray(v) for p, v in stats.items()})
    big = 2**60 + 1  # not a float64
    refused = {}
    callback = RecorderCallback(tmp_path / "run.h5", flush_every=4, flush_seconds=None)
    for step in range(8):
        x = torch.tensor(step + 0.5, dtype=torch.float64 if step == 6 else torch.float32)
        n = torch.tensor(big) if step == 0 else 3.5 if step == 1 else 7  # Python ints are cast to int64, a float is not
        try:
            callback.on_step_end(step, {"s/x": x, "s/n": n})
        except RecordError as err:
            refused[step] = str(err)
    try:
        callback.close()
    except RecordError as err:
        refused["close"] = str(err)
    assert "at step 1: got Python float 3.5" in refused.pop(4) and "at step 6: got dtype float64" in refused.pop("close")
    assert not refused, refused
    out = load(tmp_path / "run.h5")
    kept = np.array([0, 2, 3, 4, 5, 7])
    np.testing.assert_array_equal(out["step"], kept)
    assert out["s/x"].dtype == np.float32 and out["s/n"].dtype == np.int64
    np.testing.assert_array_equal(out["s/x"], (kept + 0.5).astype(np.float32))
    assert out["s/n"].tolist() == [big] + [7] * 5


def test_recorder_flush_with_a_callback_holding_a_row_of_another_shape_writes_the_other_rows(tmp_path):
    """`Recorder.flush` (a checkpoint's, or the SIGTERM guard's under an application handler) reaches the callback's
    held rows through its flush listener; the listener raised at the bad row and the flush stopped, leaving the 5 good
    rows the listener had handed over unwritten (0 committed)."""
    path = tmp_path / "run.h5"
    callback = _loop_with_a_row_of_another_shape(path, range(6), bad_step=2)
    with pytest.raises(RecordError, match="at step 2"):
        callback.recorder.flush()
    kept = np.array([0, 1, 3, 4, 5])
    steps, values = _committed_on_disk(path)
    np.testing.assert_array_equal(steps, kept)
    np.testing.assert_array_equal(values, kept.astype(np.float64))
    callback.close()


def test_the_imaginary_part_of_a_conjugate_is_recorded_as_numpy_computes_it(tmp_path):
    """docs/schema.md refuses complex tensors and asks for 'a complex value as its real and imaginary parts'; the
    imaginary part of a conjugate, z.conj().imag, is a view with torch's negative bit, whose .numpy() raised
    RuntimeError out of Recorder.log (a traceback, the row lost)."""
    import torch

    z = np.array([1 + 2j, 3 - 4j, -0.5 + 0j], np.complex64)
    with Recorder(tmp_path / "run.h5", flush_seconds=None) as rec:
        rec.log(0, {"z/re": torch.from_numpy(z).conj().real, "z/im": torch.from_numpy(z).conj().imag})
    out = load(tmp_path / "run.h5")
    assert out["z/im"].dtype == np.float32
    np.testing.assert_array_equal(out["z/im"][0], np.conj(z).imag)
    np.testing.assert_array_equal(out["z/re"][0], z.real)


_FAMILIES = '''
import numpy as np


def expected_problem(d):
    """None if ``d`` (a `load`) is rows 0..T-1 of the loop below, each family at its rate; else what is wrong."""
    s = d["step"]
    if not np.array_equal(s, np.arange(s.size)):
        return f"steps are not a prefix: {s.tolist()}"
    if s.size == 0:
        return None
    loss = np.where(s % 11 != 0, s.astype(np.float32) * np.float32(0.5), np.float32(np.nan)).astype(np.float32)
    if d["scalars/loss"].tobytes() != loss.tobytes() or not d["valid/scalars/loss"].all():
        return "scalars/loss"
    every2 = s % 2 == 0
    w = np.arange(15, dtype=np.float32).reshape(5, 3)[None] + s[:, None, None].astype(np.float32)
    got = d["arch/normal/weights"]
    if not (np.array_equal(d["valid/arch/normal/weights"], every2) and np.array_equal(got[every2], w[every2])
            and np.isnan(got[~every2]).all()):
        return "arch/normal/weights"
    epoch = s % 7 == 6
    if epoch.any() or "scalars/epoch" in d:
        if not (np.array_equal(d["valid/scalars/epoch"], epoch) and np.array_equal(d["scalars/epoch"][epoch], s[epoch] // 7)
                and np.array_equal(d["scalars/search_val_loss"][epoch], -s[epoch].astype(np.float64))):
            return "epoch rows"
    return None


def row(step):
    import torch

    out = {"scalars/loss": torch.tensor(np.float32(step) * np.float32(0.5) if step % 11 else np.nan, dtype=torch.float32)}
    if step % 2 == 0:
        out["arch/normal/weights"] = torch.arange(15, dtype=torch.float32).reshape(5, 3) + step
    return out
'''

_LOCKSTEP_WRITER = '''
import sys, torch
from families import row
from nasdiag.record.callbacks import RecorderCallback
path, start, stop, resume = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
meta = {"op_names": ["a", "b", "c"], "edge_names": {"normal": [f"e{i}" for i in range(5)]}, "cell_types": ["normal"]}
callback = RecorderCallback(path, meta=meta, flush_every=5, flush_seconds=None, resume=resume)
for step in range(start, stop):
    callback.on_step_end(step, row(step))
    if step % 7 == 6:
        callback.on_epoch_end(step // 7, {"scalars/search_val_loss": torch.tensor(-float(step), dtype=torch.float64)})
    print("handed", step, flush=True)
    sys.stdin.readline()  # lockstep: the parent kills here, knowing every step handed in
callback.close()
print("closed", flush=True)
'''

_LIVE_READER = '''
import sys, time, warnings
from families import expected_problem
from nasdiag.record import RecordError, load
path, stop_file = sys.argv[1], sys.argv[2]
reads = 0
import os
while not os.path.exists(stop_file):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = load(path)
    except RecordError as err:
        if "no record at" in str(err):
            continue
        print("BAD", err, flush=True)
        continue
    problem = expected_problem(data)
    if problem:
        print("BAD", problem, flush=True)
    reads += 1
print("READS", reads, flush=True)
'''


def test_a_live_reader_beside_a_callback_of_three_rates_killed_and_resumed_sees_prefixes_and_the_end_is_whole(tmp_path):
    """A RecorderCallback (flush_every 5) records a per-step scalar (NaN every 11th), an (E, K) family every 2nd
    step and epoch rows every 7th through on_epoch_end; it is SIGKILLed after step 23 is handed in, and resumed from
    a checkpoint 3 steps before the last committed one, while another process loads the record in a loop. Every read
    is rows 0..T-1 exactly, each family at its rate; the kill loses at most flush_every rows plus the open one
    (docs/schema.md, Durability); the end holds every step once, exactly; the stale lock blocks nothing."""
    import signal
    import subprocess
    import sys

    (tmp_path / "families.py").write_text(_FAMILIES)
    (tmp_path / "writer.py").write_text(_LOCKSTEP_WRITER)
    (tmp_path / "reader.py").write_text(_LIVE_READER)
    sys.path.insert(0, str(tmp_path))
    try:
        from families import expected_problem
    finally:
        sys.path.remove(str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root, os.environ.get("PYTHONPATH", "")]))
    path, stop_file = tmp_path / "run.h5", tmp_path / "stop"
    reader = subprocess.Popen([sys.executable, str(tmp_path / "reader.py"), str(path), str(stop_file)], env=env,
                              stdout=subprocess.PIPE, text=True)

    def session(start, stop, resume, kill_after=None):
        writer = subprocess.Popen([sys.executable, str(tmp_path / "writer.py"), str(path), str(start), str(stop),
                                   "1" if resume else "0"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for line in writer.stdout:
            if line.startswith("handed") and int(line.split()[1]) == kill_after:
                writer.send_signal(signal.SIGKILL)
                break
            writer.stdin.write("\n")
            writer.stdin.flush()
        writer.wait(timeout=120)
        return writer.returncode

    try:
        assert session(0, 60, False, kill_after=23) == -signal.SIGKILL
        crashed = load(path)
        assert expected_problem(crashed) is None
        assert 24 - (5 + 1) <= crashed["step"].size <= 24  # at most flush_every rows plus the open one lost
        assert os.path.exists(f"{path}.lock")  # the killed writer's: stale, it blocks no one
        assert session(max(int(crashed["step"][-1]) - 3, 0), 60, True) == 0
    finally:
        stop_file.touch()
        out, _ = reader.communicate(timeout=120)
    assert "BAD" not in out and "READS" in out, out
    assert int(out.split("READS")[1].split()[0]) > 0
    final = load(path)
    assert expected_problem(final) is None and final["step"].size == 60
    assert not os.path.exists(f"{path}.lock")


def test_under_ddp_a_big_endian_row_is_recorded_as_the_recorder_records_it(tmp_path, monkeypatch):
    """`Recorder.log` stores a big-endian array in the native byte order; the DDP dtype check must not take '>f8'
    for another dtype than float64 (the stand-in process group of the test above)."""
    from nasdiag import distributed
    from nasdiag.record.callbacks import RecorderCallback

    monkeypatch.setattr(distributed, "world_size", lambda group=None: 2)
    monkeypatch.setattr(distributed, "reduce_statistics", lambda stats, **kw: {p: np.asarray(v) for p, v in stats.items()})
    with RecorderCallback(tmp_path / "run.h5", flush_every=4, flush_seconds=None) as callback:
        for step in range(4):
            callback.on_step_end(step, {"s/v": np.array([step, -0.0], ">f8" if step % 2 else "<f8")})
    out = load(tmp_path / "run.h5")
    np.testing.assert_array_equal(out["step"], np.arange(4))
    assert out["s/v"].dtype == np.float64
    np.testing.assert_array_equal(out["s/v"][:, 0], np.arange(4.0))
    assert np.signbit(out["s/v"][:, 1]).all()
