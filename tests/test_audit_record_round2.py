"""Recorder audit, round 2: SIGKILL of a writer at random moments (appending, flushing, switching segments for a
new path, updating the NaN counts, resuming) while a live reader polls; schema versions; the writer's memory.

The writer here is this file's own child loop; every value it logs is a known function of the step, so the
reference is computed here, not read from the recorder. Plain h5py reads the files where the format is what
is being checked."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder, RecordWarning, load, load_meta
from nasdiag.record import reader as record_reader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAST_STEP = 80


def _row(step: int) -> dict:
    """What the writer logs at ``step``: NaN every 4th step (so the NaN counts change at most flushes), a path
    first logged at step 20 and one at step 50 (each switches the writer to a new segment)."""
    row = {"scalars/a": float("nan") if step % 4 == 0 else step * 0.25,
           "cost/normal/mean": np.full((3, 2), step, np.float32) + np.arange(6, dtype=np.float32).reshape(3, 2),
           "regret/normal/alive": np.array([step % 2 == 0, True, step % 3 == 0])}
    if step >= 20:
        row["scalars/late"] = np.int64(-step)
    if step >= 50 and step % 5 == 0:
        row["hessian/normal/diag"] = np.full((3, 2), -0.5 * step)  # negative curvature, every 5th step only
    return row


_WRITER = textwrap.dedent("""
    import sys, time, warnings
    sys.path.insert(0, sys.argv[3])
    from test_audit_record_round2 import _row
    from nasdiag.record import Recorder
    warnings.simplefilter("ignore")
    path, flush_every = sys.argv[1], int(sys.argv[2])
    rec = Recorder(path, flush_every=flush_every, flush_seconds=None, resume=True)
    step = 0 if rec.last_step is None else rec.last_step + 1
    print("OPEN", step, flush=True)
    committed = rec.last_committed_step
    while step <= LAST:
        rec.log(step, _row(step))
        if rec.last_committed_step != committed:
            committed = rec.last_committed_step
            print("C", committed, flush=True)
        time.sleep(0.002)
        step += 1
    rec.close()
    print("DONE", flush=True)
""").replace("LAST", str(LAST_STEP))


def _expected_steps_ok(out: dict, n: int) -> None:
    """The first ``n`` rows of ``out`` are steps 0..n-1, each complete and exactly what was logged."""
    np.testing.assert_array_equal(out["step"], np.arange(n))
    for i in range(n):
        row = _row(i)
        for path in ("scalars/a", "cost/normal/mean", "regret/normal/alive", "scalars/late", "hessian/normal/diag"):
            if path not in out:
                assert path not in row, (path, i)
                continue
            assert bool(out[f"valid/{path}"][i]) == (path in row), (path, i)
            if path in row:
                np.testing.assert_array_equal(out[path][i], np.asarray(row[path]).astype(out[path].dtype), err_msg=f"{path} at {i}")


class _LiveReader(threading.Thread):
    """Polls the record with `load` and with plain h5py (SWMR) while writers come and go."""

    def __init__(self, path):
        super().__init__(daemon=True)
        self.path, self.stop, self.seen, self.errors = path, threading.Event(), [], []

    def run(self):
        while not self.stop.is_set():
            try:
                if os.path.exists(self.path):
                    out = load(self.path)
                    _expected_steps_ok(out, out["step"].size)
                    self.seen.append(int(out["step"].size))
                    # a plain h5py open beside the test's own loads in this process: HDF5 shares the file between
                    # them, so it takes its turn with nasdiag's readers (one closing under another crashed)
                    with record_reader._READS, h5py.File(self.path, "r", swmr=True) as f:
                        steps = f["step"][()]
                        committed = int(np.argmax(steps < 0)) if (steps < 0).any() else steps.size
                        assert f["cost/normal/mean"].shape[0] >= committed if "cost/normal/mean" in f else True
            except Exception as err:  # noqa: BLE001 - every failure of a reader is the finding
                self.errors.append(f"{type(err).__name__}: {err}")
            time.sleep(0.01)


@pytest.mark.slow
def test_sigkill_at_random_moments_with_a_live_reader_then_resume_equals_the_uninterrupted_record(tmp_path):
    rng = random.Random(11)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    path = str(tmp_path / "run.h5")
    reader = _LiveReader(path)
    reader.start()
    reported, kills = -1, 0
    try:
        for attempt in range(12):
            flush_every = rng.choice([1, 3, 7])
            child = subprocess.Popen([sys.executable, "-c", _WRITER, path, str(flush_every), os.path.dirname(__file__)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            moment = rng.choice(["opening", "commits"])
            if moment == "opening":  # while importing, taking the lock, adopting the record, creating a segment
                time.sleep(rng.uniform(0.0, 0.6))
            else:
                target = rng.randint(1, 6)
                for line in child.stdout:
                    if line.startswith("C "):
                        reported = max(reported, int(line.split()[1]))
                        target -= 1
                        if target == 0:
                            break
                    if line.startswith("DONE"):
                        break
                time.sleep(rng.uniform(0.0, 0.01))  # land inside a log, a flush or an attribute update
            child.kill()
            out, err = child.communicate()
            done = "DONE" in out
            reported = max([reported] + [int(x.split()[1]) for x in out.splitlines() if x.startswith("C ") and x.count(" ") == 1])
            assert child.returncode in (0, -9), err
            if os.path.exists(path):
                rows = load(path)
                assert rows["step"].size - 1 >= reported  # every row reported committed is there
                _expected_steps_ok(rows, rows["step"].size)
            if done:
                break
            kills += 1
        else:
            child = subprocess.run([sys.executable, "-c", _WRITER, path, "5", os.path.dirname(__file__)],
                                   capture_output=True, text=True, env=env, timeout=120)
            assert "DONE" in child.stdout, child.stderr
        time.sleep(0.1)
    finally:
        reader.stop.set()
        reader.join(10)
    assert kills >= 3
    assert reader.errors == [], reader.errors[:3]
    assert len(reader.seen) > 5 and reader.seen == sorted(reader.seen) and reader.seen[-1] > reader.seen[0], reader.seen[-5:]
    # the uninterrupted run, written in one session
    reference = str(tmp_path / "reference.h5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(reference, flush_every=4, flush_seconds=None) as rec:
            for step in range(LAST_STEP + 1):
                rec.log(step, _row(step))
    got, want = load(path), load(reference)
    _expected_steps_ok(got, LAST_STEP + 1)
    assert sorted(got) == sorted(want)
    for key in want:
        if not key.startswith("meta/"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)  # bitwise, NaN where NaN
    nan_steps = len(range(0, LAST_STEP + 1, 4))
    counts = [{k: n for k, n in load_meta(p)["nonfinite_counts"].items() if n} for p in (path, reference)]
    assert counts == [{"scalars/a": nan_steps}] * 2


def _closed_record(path, steps=range(3)):
    with Recorder(str(path), meta={"method": "darts", "op_names": ["a", "b"]}, flush_seconds=None) as rec:
        for s in steps:
            rec.log(s, {"scalars/loss": float(s)})
    return path


def test_a_record_of_a_newer_schema_version_is_refused_for_reading_and_resuming(tmp_path):
    """A layout this reader does not know must not be read as if it were its own, nor continued in its format."""
    path = _closed_record(tmp_path / "run.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = np.int64(99)
        f.attrs["nasdiag_version"] = "9.0"
    before = path.read_bytes()
    with pytest.raises(RecordError, match=r"schema version 99 .*9\.0.*reads versions up to 2.*upgrade nasdiag") as info:
        load(path)
    assert "\n" not in str(info.value)
    with pytest.raises(RecordError, match="schema version 99"):
        Recorder(path, resume=True)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]  # no segment, no lock left


def test_a_version_1_record_written_with_plain_h5py_loads_and_resumes(tmp_path):
    """docs/schema.md: version 1 has no /digest and no previous_segments; its rows load, and a resume continues it."""
    path = tmp_path / "old.h5"
    with h5py.File(path, "w", libver=("v110", "v110")) as f:
        f.attrs.update({"schema_version": np.int64(1), "method": "darts", "config": "{}", "seed": np.int64(3),
                        "run_id": "old-run", "segment": np.int64(0)})
        meta = f.create_group("meta")
        meta.create_dataset("op_names", data=np.array(["a", "b"], dtype=h5py.string_dtype()))
        f.create_dataset("step", data=np.array([0, 1, 2, -1], np.int64), maxshape=(None,), chunks=(8,))
        f.create_dataset("scalars/loss", data=np.array([1.0, np.nan, 3.0, 0.0]), maxshape=(None,), chunks=(8,))
        f.create_dataset("arch/normal/weights", data=np.arange(16, dtype=np.float32).reshape(4, 2, 2), maxshape=(None, 2, 2),
                         chunks=(8, 2, 2))
        present = f.create_dataset("present", data=np.array([[1, 1], [1, 0], [1, 1], [0, 0]], bool), maxshape=(None, None),
                                   chunks=(8, 2))
        present.attrs["paths"] = np.array(["scalars/loss", "arch/normal/weights"], dtype=h5py.string_dtype())
    out = load(path)
    np.testing.assert_array_equal(out["step"], [0, 1, 2])  # the -1 slot was never committed
    np.testing.assert_array_equal(out["scalars/loss"], [1.0, np.nan, 3.0])
    np.testing.assert_array_equal(out["valid/arch/normal/weights"], [True, False, True])
    np.testing.assert_array_equal(out["arch/normal/weights"][2], np.arange(8, 12, dtype=np.float32).reshape(2, 2))
    assert np.isnan(out["arch/normal/weights"][1]).all()
    assert load_meta(path)["schema_version"] == 1 and load_meta(path)["seed"] == 3
    with Recorder(path, resume=True, flush_seconds=None) as rec:
        assert rec.last_step == 2
        rec.log(3, {"scalars/loss": 4.0, "arch/normal/weights": np.zeros((2, 2), np.float32)})
    out = load(path)
    np.testing.assert_array_equal(out["step"], [0, 1, 2, 3])
    np.testing.assert_array_equal(out["scalars/loss"], [1.0, np.nan, 3.0, 4.0])
    assert load_meta(path)["run_id"] == "old-run"
    with h5py.File(tmp_path / "old.seg0001.h5", "r") as f:
        assert json.loads(f.attrs["previous_segments"]) == [[0, 3]]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from /proc (Linux)")
def test_2000_rows_of_30_paths_do_not_grow_the_writer(tmp_path):
    """HDF5 keeps up to 1 MiB of chunks per open dataset by default; a writer only ever rewrites the last chunk, so
    that cache held the finished chunks of every path (26 MB more after 2000 rows of 30 (14, 8) paths)."""
    paths = [f"cost/c{p}/mean" for p in range(30)]
    block = np.ones((14, 8), np.float32)
    with Recorder(tmp_path / "run.h5", flush_every=16, flush_seconds=None) as rec:
        for s in range(200):
            rec.log(s, {**{p: block * s for p in paths}, "scalars/a": float(s)})
        base = _rss_bytes()
        for s in range(200, 2200):
            rec.log(s, {**{p: block * s for p in paths}, "scalars/a": float(s)})
        grown = _rss_bytes() - base
    assert grown < 6 * 2**20, f"the writer grew by {grown / 2**20:.1f} MiB over 2000 rows"
    assert load(tmp_path / "run.h5")["step"].size == 2200


def test_a_record_open_in_one_reader_of_the_process_opens_in_every_other(tmp_path):
    """HDF5 shares a file opened twice in one process and refuses a second open with another close degree. The
    reader of a record without a live writer opened it with a strong one, so meanwhile every other open failed:
    a plain h5py.File ("file close degree doesn't match") and a load that sees a live writer (read as damaged)."""
    from nasdiag.record.reader import open_segment_file

    path = _closed_record(tmp_path / "run.h5")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        held = open_segment_file(str(path), live=False)  # what `load` holds while it reads a finished record
        try:
            with h5py.File(path, "r", swmr=True) as f:
                np.testing.assert_array_equal(f["step"][()], [0, 1, 2])
            # a writer that is alive (another process holds the lock): the live path of the reader
            (tmp_path / "run.h5.lock").write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname()}))
            np.testing.assert_array_equal(load(path)["scalars/loss"], [0.0, 1.0, 2.0])
        finally:
            held.close()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_second_writer_through_a_symbolic_link_to_the_record_is_refused(tmp_path):
    """The lock was ``<given path>.lock``: a writer given a link to a live record took its own lock, resumed the
    record into ``alias.seg0001.h5`` and the two names then held two different runs."""
    path = tmp_path / "run.h5"
    alias = tmp_path / "alias.h5"
    with Recorder(path, flush_every=1, flush_seconds=None) as rec:
        rec.log(0, {"scalars/x": 1.0})
        alias.symlink_to(path)
        for kwargs in ({"resume": True}, {"overwrite": True}):
            with pytest.raises(RecordError, match=f"another writer \\(pid {os.getpid()} on ") as info:
                Recorder(alias, flush_seconds=None, **kwargs)
            assert "\n" not in str(info.value)
        rec.log(1, {"scalars/x": 2.0})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias.h5", "run.h5"]
    np.testing.assert_array_equal(load(alias)["scalars/x"], [1.0, 2.0])


def test_a_flush_every_whose_buffers_do_not_fit_in_memory_is_one_record_error(tmp_path):
    """numpy's MemoryError (a traceback) came out of the constructor, and out of `log` for a row too big to buffer."""
    with pytest.raises(RecordError, match=r"flush_every=10000000000000 rows .*does not fit in memory.*smaller flush_every"):
        Recorder(tmp_path / "a.h5", flush_every=10**13)
    assert list(tmp_path.iterdir()) == []
    with Recorder(tmp_path / "b.h5", flush_every=10**5, flush_seconds=None) as rec:
        rec.log(0, {"scalars/a": 1.0})
        rec.flush()
        with pytest.raises(RecordError, match=r"'arch/huge'.*shape \(100000, 100000, 1000\).*smaller flush_every") as info:
            rec.log(1, {"scalars/a": 2.0, "arch/huge": np.lib.stride_tricks.as_strided(np.zeros(1, np.float32),
                                                                                     (10**5, 10**5, 1000), (0, 0, 0))})
        assert "\n" not in str(info.value)
        rec.log(2, {"scalars/a": 3.0})  # the refused row left nothing behind
    out = load(tmp_path / "b.h5")
    np.testing.assert_array_equal(out["step"], [0, 2])
    assert "arch/huge" not in out


def test_a_buffer_larger_than_the_free_memory_is_refused_even_where_the_kernel_overcommits(tmp_path, monkeypatch):
    """A kernel that overcommits (vm.overcommit_memory=1, common on GPU hosts) lets numpy 'allocate' 80 TB, and the
    writer is killed without a message when the rows are written; the free memory the kernel reports decides."""
    from nasdiag import memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2048 kB\nMemAvailable:   1024 kB\n")  # 1 MiB free
    monkeypatch.setattr(memory, "MEMINFO", str(meminfo))
    monkeypatch.setattr(memory, "CGROUP_MEMORY", (str(tmp_path / "none"), str(tmp_path / "none")))
    monkeypatch.setattr(np, "empty", lambda shape, dtype=float: np.zeros(0, dtype))  # numpy never refuses
    with pytest.raises(RecordError, match=r"flush_every=262144 rows .*does not fit in memory.*smaller flush_every"):
        Recorder(tmp_path / "a.h5", flush_every=2**18)  # 2 MiB of int64 steps
    assert list(tmp_path.iterdir()) == [meminfo]
