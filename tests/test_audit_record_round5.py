"""Recorder audit, round 5: SIGKILL of a writer that resumes from a checkpoint before its last step (replaying steps
into a later segment) while a reader in another process polls the record; dtypes and shapes round-tripped through
plain h5py and `load`; file handles, HDF5 objects and the writer lock released on every path out.

References are this file's own: every value the writer logs is a known function of the step (and of the session, so
which session's row won is visible), numpy's own casts, plain h5py reads, /proc/self/fd and a second process's
flock."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
import warnings

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder, RecordWarning, load, load_meta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAST = 60


def _value(step: int) -> np.ndarray:
    """The (2, 3) float32 row every session logs at ``step``: NaN at every 7th step."""
    row = np.arange(6, dtype=np.float32).reshape(2, 3) + step
    if step % 7 == 0:
        row[1, 1] = np.nan
    return row


_WRITER = textwrap.dedent("""
    import sys, time, warnings
    import numpy as np
    sys.path.insert(0, sys.argv[4])
    from test_audit_record_round5 import _value
    from nasdiag.record import Recorder
    warnings.simplefilter("ignore")
    path, flush_every, session = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rec = Recorder(path, flush_every=flush_every, flush_seconds=None, resume=True)
    committed = rec.last_committed_step
    # a checkpoint at or before the last committed step: the steps after it are replayed
    start = 0 if committed is None else max(0, committed - (session * 5) % 9)
    print("OPEN", start, flush=True)
    for step in range(start, LAST + 1):
        row = {"cost/normal/mean": _value(step), "scalars/session": np.int64(session)}
        if step % 3 == 0:
            row["regret/normal/alive"] = np.array([step % 2 == 0, True])
        rec.log(step, row)
        if rec.last_committed_step != committed:
            committed = rec.last_committed_step
            print("C", committed, flush=True)
        time.sleep(0.002)
    rec.close()
    print("DONE", flush=True)
""").replace("LAST", str(LAST))

_READER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from test_audit_record_round5 import _value
    from nasdiag.record import load
    path, stop = sys.argv[1], sys.argv[3]
    seen, errors = [], []
    while not os.path.exists(stop):
        try:
            if os.path.exists(path):
                out = load(path)
                steps = out["step"]
                assert (np.diff(steps) > 0).all(), steps
                for i, s in enumerate(steps):
                    np.testing.assert_array_equal(out["cost/normal/mean"][i], _value(int(s)))
                    if "regret/normal/alive" in out:
                        assert out["valid/regret/normal/alive"][i] == (s % 3 == 0)
                seen.append(int(steps.size))
        except Exception as err:
            errors.append(f"{type(err).__name__}: {str(err)[:300]}")
        time.sleep(0.01)
    print(json.dumps({"seen": seen, "errors": errors[:5]}), flush=True)
""")


@pytest.mark.slow
def test_sigkill_of_writers_that_replay_from_a_checkpoint_with_a_reader_in_another_process(tmp_path):
    """Each session resumes at a step at or before the last committed one and is killed at a random moment. Every
    committed step stays in the record exactly once, in order, with the value of the latest session that
    committed it; a reader process sees only whole, correct rows throughout."""
    rng = random.Random(5)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    here = os.path.dirname(os.path.abspath(__file__))
    path, stop = str(tmp_path / "run.h5"), str(tmp_path / "stop")
    reader = subprocess.Popen([sys.executable, "-c", _READER, path, here, stop], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    starts, committed_by = {}, {}  # session -> its first step; session -> last step it reported committed
    try:
        for session in range(1, 12):
            flush_every = rng.choice([1, 2, 5])
            child = subprocess.Popen([sys.executable, "-c", _WRITER, path, str(flush_every), str(session), here],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            last_session = session == 11
            commits = rng.randint(1, 4)
            for line in child.stdout:
                if line.startswith("OPEN"):
                    starts[session] = int(line.split()[1])
                elif line.startswith("C "):
                    committed_by[session] = int(line.split()[1])
                    commits -= 1
                    if commits == 0 and not last_session:
                        time.sleep(rng.uniform(0.0, 0.008))  # inside a log, a flush, a segment switch
                        child.kill()
                        break
                elif line.startswith("DONE"):
                    break
            out, err = child.communicate(timeout=120)
            for line in out.splitlines():
                if line.startswith("C ") and line.count(" ") == 1:
                    committed_by[session] = int(line.split()[1])
            assert child.returncode in ((0,) if last_session else (0, -9)), err
            assert "Traceback" not in err, err
    finally:
        open(stop, "w").close()
        report, reader_err = reader.communicate(timeout=120)
    found = json.loads(report.strip().splitlines()[-1]) if report.strip() else {"seen": [], "errors": [reader_err]}
    assert found["errors"] == [], found["errors"]
    assert len(found["seen"]) > 5, found
    out = load(path)
    np.testing.assert_array_equal(out["step"], np.arange(LAST + 1))
    for i in range(LAST + 1):
        np.testing.assert_array_equal(out["cost/normal/mean"][i], _value(i))
        assert out["valid/regret/normal/alive"][i] == (i % 3 == 0)
        if i % 3 == 0:
            np.testing.assert_array_equal(out["regret/normal/alive"][i], [i % 2 == 0, True])
        # the row of the latest session that reached step i and reported it committed, or of a later one
        # that may have committed it just before its kill
        winner = int(out["scalars/session"][i])
        reported = [s for s, last in committed_by.items() if starts.get(s, LAST + 1) <= i <= last]
        assert winner >= max(reported, default=0) and starts[winner] <= i, (i, winner, reported)
    assert int(out["scalars/session"][LAST]) == 11
    meta = load_meta(path)
    assert len(meta["segments"]) >= 2


def _dtype_values():
    import torch

    big = np.random.default_rng(0).standard_normal((300, 257)).astype(np.float32)  # 300 kB a row: one row per chunk
    return {
        # path: (logged value, the array the record must hold: numpy's own conversion)
        "x/f16": (np.array([1.5, np.nan, np.inf, -65504.0], np.float16), None),
        "x/bf16": (torch.tensor([1.5, float("nan"), -3.0], dtype=torch.bfloat16), np.array([1.5, np.nan, -3.0], np.float32)),
        "x/t0": (torch.tensor(2.5, dtype=torch.float64), np.float64(2.5)),
        "x/n0": (np.float16(3.0), None),
        "x/i8": (np.array([-128, 127], np.int8), None),
        "x/u64": (np.array([2**64 - 1, 0], np.uint64), None),
        "x/tu8": (torch.tensor([255, 0], dtype=torch.uint8), np.array([255, 0], np.uint8)),
        "x/bool": (torch.tensor([[True], [False]]), np.array([[True], [False]])),
        "x/strided": (np.arange(12.0).reshape(3, 4)[:, ::2].T, None),  # a non-contiguous view
        "x/big_endian": (np.array([1.0, -2.0], ">f8"), np.array([1.0, -2.0])),
        "x/large": (big, None),
    }


def test_dtypes_and_shapes_round_trip_through_plain_h5py_and_load(tmp_path):
    """Logged at steps 0 and 5, left out at step 9: the rows hold exactly numpy's conversion of the value and its
    dtype (bfloat16 as float32), the missing row the fill value; NaN/inf counted per documented rule."""
    values = _dtype_values()
    path = str(tmp_path / "run.h5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(path, flush_every=2, flush_seconds=None) as rec:
            rec.log(0, {"scalars/only": 0.0, **{p: v for p, (v, _) in values.items()}})
            rec.log(5, {p: v for p, (v, _) in values.items()})
            rec.log(9, {"scalars/only": 1.0})
    out = load(path)
    np.testing.assert_array_equal(out["step"], [0, 5, 9])
    with h5py.File(path, "r") as f:
        for p, (value, want) in values.items():
            want = np.asarray(value) if want is None else np.asarray(want)
            want = want.astype(want.dtype.newbyteorder("="))
            for got in (f[p][()], out[p]):
                assert got.dtype == want.dtype and got.shape == (3, *want.shape), p
                np.testing.assert_array_equal(got[:2], np.stack([want, want]), err_msg=p)
                fill = {"f": np.nan, "b": False}.get(want.dtype.kind, 0)
                np.testing.assert_array_equal(got[2], np.full(want.shape, fill, want.dtype), err_msg=p)
            np.testing.assert_array_equal(out[f"valid/{p}"], [True, True, False])
            bad = 2 * int(np.count_nonzero(~np.isfinite(want))) if want.dtype.kind == "f" else 0
            assert int(f[p].attrs["nonfinite_count"]) == bad, p
    counts = load_meta(path)["nonfinite_counts"]
    assert {p: n for p, n in counts.items() if n} == {"x/f16": 4, "x/bf16": 2}


def _open_fds() -> set:
    return set(os.listdir("/proc/self/fd"))


def _lock_is_free(path) -> bool:
    """Whether another process can take the record's writer lock now."""
    probe = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
             "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n    sys.exit(1)\n")
    return subprocess.run([sys.executable, "-c", probe, str(path) + ".lock"]).returncode == 0


def test_every_way_out_releases_file_handles_hdf5_objects_and_the_lock(tmp_path):
    path = str(tmp_path / "run.h5")
    meta = {"op_names": ["a", "b"], "edge_names": {"n": ["0->2"]}, "cell_types": ["n"]}
    with Recorder(path, meta=meta, flush_every=2, flush_seconds=None) as rec:
        for s in range(3):
            rec.log(s, {"scalars/x": float(s)})
    fds, objects = _open_fds(), len(h5py.h5f.get_obj_ids())

    def released():
        assert _open_fds() == fds and len(h5py.h5f.get_obj_ids()) == objects
        assert _lock_is_free(path)

    # a resume into another search space
    with pytest.raises(RecordError, match="op_names"):
        Recorder(path, meta={**meta, "op_names": ["a", "c"]}, resume=True)
    released()
    # an exception in the with block, after a segment switch for a new path
    with pytest.raises(KeyError), warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(path, resume=True, flush_every=2, flush_seconds=None) as rec:
            rec.log(10, {"scalars/x": 1.0})
            rec.log(11, {"scalars/x": 1.0})
            rec.log(12, {"scalars/y": 1.0})
            with pytest.raises(RecordError, match="shape"):
                rec.log(13, {"arch/n/weights": np.ones((3, 3))})
            raise KeyError("the loop failed")
    released()
    # a record that is not one
    with open(tmp_path / "other.h5", "wb") as fh:
        fh.write(b"not a record")
    with pytest.raises(RecordError):
        load(str(tmp_path / "other.h5"))
    released()
    np.testing.assert_array_equal(load(path)["step"], [0, 1, 2, 10, 11, 12])
    released()


_EXIT = textwrap.dedent("""
    import gc, sys, warnings
    from nasdiag.record import Recorder
    warnings.simplefilter("ignore")
    rec = Recorder(sys.argv[1], flush_every=1000, flush_seconds=None)
    for step in range(5):
        rec.log(step, {"scalars/x": step * 0.5})
    if sys.argv[2] == "gc":
        del rec
        gc.collect()
    raise SystemExit(3) if sys.argv[2] == "exit" else RuntimeError("uncaught")
""")


@pytest.mark.parametrize("how", ["exit", "uncaught", "gc"])
def test_rows_buffered_at_interpreter_exit_are_written_and_the_lock_released(tmp_path, how):
    path = str(tmp_path / "run.h5")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _EXIT, path, how], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert "RecordError" not in done.stderr and "HDF5" not in done.stderr, done.stderr
    np.testing.assert_array_equal(load(path)["scalars/x"], np.arange(5) * 0.5)
    assert not os.path.exists(path + ".lock") and _lock_is_free(path)


def test_the_reserved_roots_docs_schema_lists_are_the_ones_the_recorder_refuses(tmp_path):
    """docs/schema.md listed step, present, meta and valid; the recorder also refuses digest (the row checksums)."""
    import re

    with open(os.path.join(ROOT, "docs", "schema.md"), encoding="utf-8") as fh:
        line = next(ln for ln in fh if "are reserved roots" in ln)
    documented = set(re.findall(r"`(\w+)`", line.split(";")[-1]))
    refused = set()
    for root in ("step", "present", "digest", "meta", "valid", "steps", "data", "paths", "lock"):
        try:
            with Recorder(str(tmp_path / f"{root}.h5"), flush_seconds=None) as rec:
                rec.log(0, {f"{root}/x": 1.0})
        except RecordError as err:
            assert "reserved" in str(err)
            refused.add(root)
    assert refused == documented


def test_a_value_of_more_axes_than_hdf5_holds_is_refused_at_its_log_and_the_recorder_goes_on(tmp_path):
    """A 32-axis row was accepted, then its segment could not be created (HDF5: at most 32 axes, the rows one of
    them): that flush and every later log, flush and close failed, and every row after it was lost."""
    path = str(tmp_path / "run.h5")
    with Recorder(path, flush_every=2, flush_seconds=None) as rec:
        rec.log(0, {"scalars/x": 0.0})
        rec.log(1, {"scalars/x": 1.0})
        with pytest.raises(RecordError, match="32 axes.*at most 31"):
            rec.log(2, {"scalars/x": 2.0, "x/deep": np.ones((1,) * 32)})
        rec.log(3, {"scalars/x": 3.0, "x/ok": np.full((1,) * 31, 7.0)})  # the most a row may have
        rec.log(4, {"scalars/x": 4.0})
    out = load(path)
    np.testing.assert_array_equal(out["step"], [0, 1, 3, 4])
    np.testing.assert_array_equal(out["scalars/x"], [0.0, 1.0, 3.0, 4.0])
    assert out["x/ok"].shape == (4,) + (1,) * 31 and out["x/ok"][2].item() == 7.0


@pytest.mark.parametrize("cell", [".", ".."])
def test_a_cell_type_named_dot_is_refused_as_a_name_before_any_file_is_made(tmp_path, cell):
    """'.' passed the name check and failed as 'cannot create record segment ...: name already exists', blaming
    the storage for the meta."""
    path = tmp_path / "run.h5"
    with pytest.raises(RecordError, match=r"cell type .* is invalid"):
        Recorder(str(path), meta={"op_names": ["a", "b"], "edge_names": {cell: ["0->2"]}, "cell_types": [cell]})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("key", ["segments", "run_id", "schema_version", "nonfinite_counts", "torch_version"])
def test_a_meta_key_that_load_meta_reports_for_the_record_is_refused_not_silently_replaced(tmp_path, key):
    """meta={"segments": ...} was stored, and load_meta returned the record's segment list under it instead: the
    user's value was gone from the documented view of the meta without a word."""
    path = tmp_path / "run.h5"
    with pytest.raises(RecordError, match=f"meta key '{key}' is reserved"):
        Recorder(str(path), meta={"method": "darts", key: "mine"})
    assert os.listdir(tmp_path) == []
    with Recorder(str(path), meta={"method": "darts", "notes": "mine"}) as rec:  # any other key is kept
        rec.log(0, {"scalars/x": 1.0})
    assert load_meta(str(path))["notes"] == "mine"


def _documented_families():
    """(pattern, shape, dtype) of every row of the family table of docs/schema.md."""
    import re

    with open(os.path.join(ROOT, "docs", "schema.md"), encoding="utf-8") as fh:
        text = fh.read()
    table = text.split("<!-- families:")[1].split("<!-- end of families -->")[0]
    return [(m.group(1), m.group(2), m.group(3)) for m in re.finditer(r"^\| `([^`]+)` \| ([^|]+?) \| (\w+) \|", table, re.M)]


def test_load_returns_every_documented_family_with_its_row_shape_dtype_and_validity(tmp_path):
    """One path of each family of docs/schema.md at its documented shape (E = 2 edges, K = 3 ops, R = 2 cells) and
    dtype, logged at steps 0 and 2 and left out at step 1: load gives (T, *shape) of that dtype, the logged values,
    the fill value and valid = False where it was left out."""
    sizes = {"E": 2, "K": 3, "R": 2}
    dtypes = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "bool": np.bool_}
    families = _documented_families()
    assert len(families) > 30
    rng = np.random.default_rng(4)
    values = {}
    for pattern, shape, dtype in families:
        path = pattern.replace("<cell>", "normal").replace("<name>", "some")
        dims = tuple(sizes[d] for d in shape.strip("()").replace(" ", "").split(",") if d)
        values[path] = (rng.standard_normal(dims) * 5).astype(dtypes[dtype])
    meta = {"op_names": ["a", "b", "c"], "edge_names": {"normal": ["0->2", "1->2"]}, "cell_types": ["normal"]}
    path = str(tmp_path / "run.h5")
    with Recorder(path, meta=meta, flush_seconds=None) as rec:
        rec.log(0, values)
        rec.log(1, {"scalars/other": 1.0})
        rec.log(2, values)
    out = load(path)
    np.testing.assert_array_equal(out["step"], [0, 1, 2])
    for p, v in values.items():
        assert out[p].dtype == v.dtype and out[p].shape == (3, *v.shape), p
        np.testing.assert_array_equal(out[p][[0, 2]], np.stack([v, v]), err_msg=p)
        np.testing.assert_array_equal(out[p][1], np.full(v.shape, {"f": np.nan, "b": False}.get(v.dtype.kind, 0), v.dtype))
        np.testing.assert_array_equal(out[f"valid/{p}"], [True, False, True])
    assert [str(s) for s in out["meta/op_names"]] == ["a", "b", "c"]
    assert [str(s) for s in out["meta/edge_names/normal"]] == ["0->2", "1->2"]
    assert load_meta(path)["edge_names"] == {"normal": ["0->2", "1->2"]}


def test_a_resume_that_adds_names_which_do_not_fit_the_recorded_rows_is_refused_touching_nothing(tmp_path):
    """A record written without op/edge names, resumed with names of another E or K: the names were taken and the
    old rows kept, so the record said K = 3 over rows of K = 4 (and the recorder went on accepting K = 4)."""
    from nasdiag.record import ResumeMismatchError

    path = str(tmp_path / "run.h5")
    with Recorder(path, meta={"method": "darts"}, flush_seconds=None) as rec:
        rec.log(0, {"arch/normal/weights": np.ones((5, 4), np.float32)})
    before = sorted(os.listdir(tmp_path)), open(path, "rb").read()
    meta = {"method": "darts", "op_names": ["a", "b", "c"], "edge_names": {"normal": [f"e{i}" for i in range(5)]},
            "cell_types": ["normal"]}
    with pytest.raises(ResumeMismatchError, match=r"arch/normal/weights.*\(5, 3\).*got \(5, 4\)") as err:
        Recorder(path, meta=meta, resume=True)
    assert err.value.differences["op_names"] == (None, ["a", "b", "c"])
    assert (sorted(os.listdir(tmp_path)), open(path, "rb").read()) == before
    # names that fit are taken
    with Recorder(path, meta={**meta, "op_names": ["a", "b", "c", "d"]}, resume=True, flush_seconds=None) as rec:
        rec.log(1, {"arch/normal/weights": np.ones((5, 4), np.float32)})
    assert load_meta(path)["op_names"] == ["a", "b", "c", "d"]
