"""Fault injection in subprocesses (the harness is scripts/record_kill_trials.py). Each test states
what may be lost (at most the unflushed buffer) and checks that everything else is on disk, exact,
with `verify_rows` comparing the record to the rows the child logged (a known function of the step)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder, load

# The fault-injection harness is a script, not part of the package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from record_kill_trials import WriterProcess, expected_row, kill_trial, verify_rows  # noqa: E402

KILL_TRIALS = 20


def test_sigkill_at_random_moments_leaves_exact_prefix(tmp_path):
    """20 writers killed with SIGKILL (scripts/record_kill_trials.py runs more). kill_trial checks
    that the record loads, holds exactly the first rows logged, loses at most one buffer, and resumes
    without touching the crashed files."""
    reports = []
    for seed in range(KILL_TRIALS):
        try:
            reports.append(kill_trial(tmp_path, seed))
        except AssertionError as err:
            raise AssertionError(f"SIGKILL trial seed={seed}: {err}") from None
    for r in reports:
        assert r["reported"] <= r["rows_on_disk"] <= r["reported"] + r["flush_every"], r
    # The sample must include kills right after opening, resumed (rewinding) writers and per-row flushes.
    assert any("after open" in r["moment"] for r in reports)
    assert any(r["resume"] for r in reports)
    assert any(r["flush_every"] == 1 for r in reports)
    assert any(r["rows_on_disk"] > r["flush_every"] for r in reports)


def test_sigterm_at_random_moments_loses_nothing(tmp_path):
    """SIGTERM may land inside log or a flush; the recorder then finishes that, writes everything,
    closes cleanly and lets the process end by the signal."""
    for seed in range(100, 106):
        try:
            report = kill_trial(tmp_path, seed, signal.SIGTERM)
        except AssertionError as err:
            raise AssertionError(f"SIGTERM trial seed={seed}: {err}") from None
        assert report["rows_on_disk"] >= report["reported"]


def test_sigterm_flushes_buffer_and_terminates(tmp_path):
    path = tmp_path / "run.h5"
    child = WriterProcess({"path": str(path), "count": 10, "flush_every": 64, "end": "hold"})
    child.wait_for("HOLD")
    assert load(path)["step"].size == 0  # all 10 rows still buffered
    code = child.signal(signal.SIGTERM)
    assert code == -signal.SIGTERM  # the default action still runs after the flush
    verify_rows(path, [{"start": 0, "tag": 0, "rows": 10}])
    assert not os.path.exists(f"{path}.lock")
    with h5py.File(path, "r") as f:  # closed cleanly: plain h5py, no SWMR flag needed
        assert f["step"].shape == (10,)


def test_sigterm_with_application_handler_flushes_and_keeps_recording(tmp_path):
    """An application's own SIGTERM handler (checkpoint, requeue) still runs and decides; the
    recorder flushes first and stays open, so the run can go on logging."""
    path = tmp_path / "run.h5"
    child = WriterProcess({"path": str(path), "count": 10, "flush_every": 64, "end": "hold",
                           "own_sigterm": True, "after_term": 5})
    child.wait_for("HOLD")
    child.proc.send_signal(signal.SIGTERM)
    child.wait_for("TERM")
    # the 10 rows were flushed before the application's handler ran; the child goes on logging its 5 rows meanwhile,
    # and on a loaded machine some may be on disk already by the time this reads
    verify_rows(path, [{"start": 0, "tag": 0, "min_rows": 10, "max_rows": 15}])
    assert child.finish() == 0
    verify_rows(path, [{"start": 0, "tag": 0, "rows": 15}])


def test_sigterm_inside_a_torch_func_transform_flushes_the_held_rows(tmp_path):
    """The exact curvature runs inside torch.func's ``jvp``; a SIGTERM landing there used to fail the flush
    (the held rows stacked under the transform became a dual tensor without storage). The application's
    handler runs after the flush, and the rows are on disk while the run is still open."""
    import torch

    from nasdiag.record.callbacks import RecorderCallback

    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        callback = RecorderCallback(str(tmp_path / "run.h5"))
        for step in range(1, 6):
            callback.on_step_end(step, {"scalars/loss": torch.tensor(float(step))})

        def inside(v):
            os.kill(os.getpid(), signal.SIGTERM)
            return 2 * v

        torch.func.jvp(inside, (torch.ones(3),), (torch.ones(3),))
        assert calls == [signal.SIGTERM]
        assert load(tmp_path / "run.h5")["step"].tolist() == [1, 2, 3, 4, 5]
        callback.close()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_exception_in_with_block_flushes(tmp_path):
    path = tmp_path / "run.h5"
    child = WriterProcess({"path": str(path), "count": 13, "flush_every": 64, "end": "raise"})
    assert child.finish() == 1
    verify_rows(path, [{"start": 0, "tag": 0, "rows": 13}])


def test_normal_exit_without_close_flushes(tmp_path):
    path = tmp_path / "run.h5"
    child = WriterProcess({"path": str(path), "count": 7, "flush_every": 64, "end": "exit"})
    assert child.finish() == 0
    verify_rows(path, [{"start": 0, "tag": 0, "rows": 7}])


def _namespace_wrapper(mount_command: str) -> list[str] | None:
    """argv prefix running a child after ``mount_command`` in a private mount namespace, or None
    where mount namespaces are not available."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = [unshare, "-m", "--propagation", "private", "sh", "-c"]
    if subprocess.run(prefix + [mount_command], capture_output=True).returncode != 0:
        return None
    return prefix + [f'{mount_command} && exec "$0" "$@"']


@pytest.mark.parametrize("how", ["file-size limit", "tiny filesystem"])
def test_disk_full_keeps_committed_rows(tmp_path, how):
    directory = tmp_path / "disk"
    directory.mkdir()
    path = directory / "run.h5"
    cfg = {"path": str(path), "count": -1, "flush_every": 8}
    wrapper = None
    if how == "file-size limit":
        cfg["fsize"] = 256 * 1024  # RLIMIT_FSIZE with SIGXFSZ ignored: writes fail with EFBIG
    else:
        # A 512 KiB tmpfs (ENOSPC); its content vanishes with the namespace, so the child reports.
        wrapper = _namespace_wrapper(f'mount -t tmpfs -o size=512k tmpfs "{directory}"')
        if wrapper is None:
            pytest.skip("no mount namespaces here for a tiny filesystem; the file-size-limit case covers disk full")
        cfg["report_rows_after"] = True
    child = WriterProcess(cfg, wrapper)
    line = child.wait_for("ERR")
    after = child.wait_for("ROWS") if wrapper else None
    assert child.finish() == 0  # a clean exit: the failed file was closed without crashing HDF5
    _, committed, message = line.split(" ", 2)
    committed = int(committed)
    assert "disk full or file-size limit" in message and "intact" in message, message
    assert committed > 50  # the limit was hit after a good number of batches
    if wrapper:
        _, rows, steps_ok = after.split()
        assert committed <= int(rows) <= committed + 8 and steps_ok == "prefix", after
        return
    verify_rows(path, [{"start": 0, "tag": 0, "min_rows": committed, "max_rows": committed + 8}])
    # Once space is back the record resumes.
    with Recorder(path, resume=True, flush_seconds=None) as rec:
        rec.log(rec.last_step + 1, expected_row(rec.last_step + 1))


def _read_only_wrapper(directory) -> list[str] | None:
    """Run a child with ``directory`` bind-mounted read-only (as root, chmod does not stop writes)."""
    return _namespace_wrapper(f'mount -o bind,ro "{directory}" "{directory}" && ! touch "{directory}/probe" 2>/dev/null')


def test_read_only_location(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    existing = directory / "old.h5"
    with Recorder(existing, flush_every=4, flush_seconds=None) as rec:
        for s in range(9):
            rec.log(s, expected_row(s))
    before = existing.read_bytes()
    wrapper = _read_only_wrapper(directory)
    if wrapper is None:
        if os.geteuid() == 0:
            pytest.skip("root without mount namespaces: no way to make a read-only folder here")
        directory.chmod(0o555)
    try:
        fresh = WriterProcess({"path": str(directory / "new.h5"), "count": 3}, wrapper)
        refused = fresh.wait_for("REFUSED")
        resumed = WriterProcess({"path": str(existing), "count": 3, "resume": True, "start": 9}, wrapper)
        refused_resume = resumed.wait_for("REFUSED")
        fresh.finish(), resumed.finish()
    finally:
        directory.chmod(0o755)
    assert refused.startswith("REFUSED none ") and "read-only or not writable" in refused, refused
    # The child could still read the old record from the read-only folder, all 9 rows.
    assert refused_resume.startswith("REFUSED 9 ") and "read-only or not writable" in refused_resume, refused_resume
    assert not (directory / "new.h5").exists()
    assert existing.read_bytes() == before
    verify_rows(existing, [{"start": 0, "tag": 0, "rows": 9}])


def test_second_writer_refused_and_nothing_truncated(tmp_path):
    path = tmp_path / "run.h5"
    first = WriterProcess({"path": str(path), "count": 21, "flush_every": 4, "end": "hold"})
    first.wait_for("HOLD")
    for extra in ({}, {"resume": True}, {"overwrite": True}):
        second = WriterProcess({"path": str(path), "count": 5, "tag": 1, **extra})
        line = second.wait_for("REFUSED")
        second.finish()
        assert f"pid {first.proc.pid}" in line and "another writer" in line, line
    with pytest.raises(RecordError, match="another writer"):
        Recorder(path, overwrite=True)
    # The live record is untouched: its 20 committed rows (5 batches of 4) read back exactly.
    verify_rows(path, [{"start": 0, "tag": 0, "rows": 20}])
    first.signal(signal.SIGTERM)
    verify_rows(path, [{"start": 0, "tag": 0, "rows": 21}])


def test_live_reader_sees_consistent_growing_prefix(tmp_path):
    path = tmp_path / "run.h5"
    child = WriterProcess({"path": str(path), "count": -1, "flush_every": 4, "sleep": 0.0005, "late_from": 30})
    try:
        child.wait_for("C", committed_at_least=8)
        seen = []
        for _ in range(15):
            rows = verify_rows(path, [{"start": 0, "tag": 0, "late_from": 30, "min_rows": 0, "max_rows": 10**9}])
            seen.append(rows)
            with h5py.File(path, "r", swmr=True) as f:  # plain h5py can follow the live file too
                steps = f["step"][()]
                committed = steps[: np.argmax(steps < 0)] if (steps < 0).any() else steps
                np.testing.assert_array_equal(committed, np.arange(committed.size))
                assert f["scalars/a"].shape[0] >= committed.size  # data is written before /step
    finally:
        child.proc.kill()
        child.finish()
    assert seen == sorted(seen) and seen[-1] > seen[0] >= 8, seen


def test_shape_change_and_nonfinite_in_child(tmp_path):
    path = tmp_path / "run.h5"
    child = WriterProcess({"path": str(path), "count": 30, "flush_every": 8, "nan_every": 5, "bad_shape_at": 12})
    bad = child.wait_for("BAD")
    child.finish()
    assert bad == "BAD 12"
    assert "RecordWarning" in child.proc.stderr.read()
    out = load(path)
    kept = [s for s in range(30) if s != 12]
    np.testing.assert_array_equal(out["step"], kept)
    for i, s in enumerate(kept):
        row = expected_row(s, nan_every=5)
        np.testing.assert_array_equal(out["scalars/a"][i], row["scalars/a"])
        np.testing.assert_array_equal(out["arch/normal/weights"][i], row["arch/normal/weights"])
    nan_steps = [s for s in kept if s % 5 == 0]
    with h5py.File(path, "r") as f:
        assert f["scalars/a"].attrs["nonfinite_count"] == len(nan_steps)
        assert f["arch/normal/weights"].attrs["nonfinite_count"] == len(nan_steps)
