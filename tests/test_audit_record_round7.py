"""Recorder audit, round 7: the segment rollover of schema.MAX_SEGMENT_CHUNKS (monkeypatched small) under live
readers in another process, resumes, new paths and NaN counts; segment numbers past 9999; segments left being built,
replaced by another segment, or named through a symbolic link; the report's count of resumes; whole searches and
figures killed inside a write (scripts/tear_writes.c) and resumed.

References are this file's own: values logged as known functions of the step (and of the session that logged
them), file names built by hand, plain h5py reads, and an uninterrupted run of the same seed for the searches."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import warnings

import h5py
import numpy as np
import pytest
import torch

from test_record_torn_writes import tear_library  # noqa: F401  (a fixture: scripts/tear_writes.c, built)

from nasdiag.record import RecordError, Recorder, RecordWarning, load, load_meta, schema


def test_segments_past_9999_belong_to_their_record(tmp_path):
    """segment_path names segment 10000 ``run.seg10000.h5``; list_segments looked for exactly four digits, so from
    there on `load` silently left the newest rows out and a resume tried to create an existing segment again."""
    path = str(tmp_path / "run.h5")
    indices = [0, 1, 9999, 10000, 10001, 123456]
    for index in indices:
        open(schema.segment_path(path, index), "w").close()
    assert os.path.basename(schema.segment_path(path, 10000)) == "run.seg10000.h5"
    for other in ("run.seg01234.h5", "run.seg0000.h5", "run.seg12x45.h5", "run.seg123.h5", "run.seg10000.h5.tmp"):
        open(tmp_path / other, "w").close()  # not a name segment_path gives to any segment of run.h5
    assert schema.list_segments(path) == [(index, schema.segment_path(path, index)) for index in indices]
    for index in indices[1:]:
        assert schema.segment_owner(schema.segment_path(path, index)) == path
    for other in ("run.seg01234.h5", "run.seg0000.h5", "run.seg12x45.h5", "run.seg123.h5"):
        assert schema.segment_owner(str(tmp_path / other)) is None, other
    bare = str(tmp_path / "bare")  # a record without a suffix
    open(bare, "w").close()
    open(schema.segment_path(bare, 10000), "w").close()
    assert schema.list_segments(bare) == [(0, bare), (10000, bare + ".seg10000")]
    assert schema.segment_owner(bare + ".seg10000") == bare


# --- the segment rollover ----------------------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDE = 4096  # float32: 16 KiB a row, one HDF5 chunk a row (schema.chunk_rows)


def _row(step: int, session: int, late_from: int | None = None) -> dict:
    """What a session logs at ``step``: a 16 KiB row whose value names step and session, a scalar, and from
    ``late_from`` on a path first logged there."""
    row = {"wide/x": np.full(WIDE, step + 1000 * session, np.float32), "scalars/a": float(step)}
    if late_from is not None and step >= late_from:
        row[f"scalars/late{session}"] = -float(step)
    return row


def _committed_rows(file: str) -> int:
    """Committed rows of one segment, by plain h5py: /step up to its first -1 slot."""
    with h5py.File(file, "r", swmr=True) as f:
        steps = f["step"][()]
    return int(np.argmax(steps < 0)) if (steps < 0).any() else int(steps.size)


def _check_previous_segments(path: str) -> None:
    """Every segment lists every earlier segment with its committed rows, read here with plain h5py."""
    files = schema.list_segments(path)
    assert [index for index, _ in files] == list(range(len(files)))
    rows = [_committed_rows(file) for _, file in files]
    for index, file in files:
        with h5py.File(file, "r", swmr=True) as f:
            listed = json.loads(f.attrs["previous_segments"])
            assert int(f.attrs["segment"]) == index
        assert listed == [[i, rows[i]] for i in range(index)], (file, listed)


_KILLED_AFTER_ROLLOVER = textwrap.dedent("""
    import os, signal, sys, warnings
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    from test_audit_record_round7 import _row
    from nasdiag.record import Recorder, schema
    schema.MAX_SEGMENT_CHUNKS = 2
    warnings.simplefilter("ignore")
    path, late_from = sys.argv[1], int(sys.argv[2])
    rec = Recorder(path, flush_every=2, flush_seconds=None)
    segments = 1
    for step in range(100):
        rec.log(step, _row(step, 0, late_from))
        if len(schema.list_segments(path)) != segments:  # a flush opened a segment: killed right after it
            segments = len(schema.list_segments(path))
            if segments == 5:
                print("KILLED", rec.last_committed_step, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_path_first_logged_in_the_flush_that_rolls_over_and_a_resume_right_after_the_rollover(tmp_path, monkeypatch):
    """MAX_SEGMENT_CHUNKS=2 with one chunk a row: a segment holds 2 rows. With flush_every=2 the row of step 5 brings
    a new path while rows 4 (buffered) must go to a new segment: the flush that rolls over and the switch for the new
    path happen at one log. A writer killed right after a rollover published a segment, resumed, and a second path
    first logged in the resumed session: every step once, with its session's value and validity, and every segment
    lists its predecessors as they are."""
    monkeypatch.setattr(schema, "MAX_SEGMENT_CHUNKS", 2)
    path = str(tmp_path / "run.h5")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "scripts"), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.run([sys.executable, "-c", _KILLED_AFTER_ROLLOVER, path, "5", os.path.dirname(__file__)],
                           capture_output=True, text=True, env=env, timeout=120)
    assert child.returncode == -signal.SIGKILL and "KILLED" in child.stdout, child.stderr[-2000:]
    committed = int(child.stdout.split()[1])
    out = load(path)
    np.testing.assert_array_equal(out["step"], np.arange(committed + 1))
    np.testing.assert_array_equal(out["wide/x"][:, 0], np.arange(committed + 1, dtype=np.float32))
    np.testing.assert_array_equal(out["valid/scalars/late0"], np.arange(committed + 1) >= 5)
    _check_previous_segments(path)
    start = committed - 1  # a checkpoint one step back: that step is replayed into the new segment
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(path, resume=True, flush_every=3, flush_seconds=None) as rec:
            assert rec.last_committed_step == committed
            for step in range(start, 20):
                rec.log(step, _row(step, 1, late_from=start + 2))
    out = load(path)
    steps = np.arange(20)
    np.testing.assert_array_equal(out["step"], steps)
    session = np.where(steps >= start, 1, 0)
    np.testing.assert_array_equal(out["wide/x"], np.repeat((steps + 1000 * session).astype(np.float32)[:, None], WIDE, 1))
    np.testing.assert_array_equal(out["scalars/a"], steps.astype(float))
    np.testing.assert_array_equal(out["valid/scalars/late0"], (steps >= 5) & (steps < start))
    np.testing.assert_array_equal(out["valid/scalars/late1"], steps >= start + 2)
    np.testing.assert_array_equal(out["scalars/late1"][steps >= start + 2], -steps[steps >= start + 2].astype(float))
    _check_previous_segments(path)


def test_every_segment_being_built_that_a_killed_writer_left_is_removed_by_the_next_writer(tmp_path):
    """docs/schema.md: ``*.tmp``, a segment being built, is removed by the next writer. Only those of the segments the
    next writer itself would number were: a record replaced with overwrite=True, or resumed with fewer segments than
    the killed writer had reached, kept the others for good (and a search's --force left them next to its record)."""
    path = str(tmp_path / "run.h5")
    for step in range(3):
        with Recorder(path, resume=True, flush_seconds=None) as rec:
            rec.log(step, {"scalars/a": float(step)})
    assert len(schema.list_segments(path)) == 3
    left = [schema.temp_path(schema.segment_path(path, index)) for index in (0, 2, 7, 10000)]
    others = [str(tmp_path / name) for name in ("run.seg007.h5.tmp", "other.seg0002.h5.tmp", "run.h5.ckpt.tmp")]
    for file in left + others:
        open(file, "w").close()
    with Recorder(path, resume=True, flush_seconds=None) as rec:
        rec.log(3, {"scalars/a": 3.0})
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["run.h5", *(os.path.basename(schema.segment_path(path, i)) for i in (1, 2, 3))] + [os.path.basename(f) for f in others])
    for file in left:
        open(file, "w").close()
    with Recorder(path, overwrite=True, flush_seconds=None) as rec:
        rec.log(0, {"scalars/a": 0.0})
    assert sorted(os.listdir(tmp_path)) == sorted(["run.h5"] + [os.path.basename(f) for f in others])
    np.testing.assert_array_equal(load(path)["step"], [0])


# --- kills inside a write (scripts/tear_writes.c) ------------------------------------------------------------------


def _torn_env(library: str, tear_at: int, files: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), LD_PRELOAD=library,
                NASDIAG_TEAR_AT=str(tear_at), NASDIAG_TEAR_PAGE=str(mmap.PAGESIZE), NASDIAG_TEAR_FILES=files,
                MPLBACKEND="Agg")


_DRAW = textwrap.dedent("""
    import sys
    import matplotlib.pyplot as plt
    import numpy as np
    from nasdiag.plot.registry import save
    fig, ax = plt.subplots()
    ax.imshow(np.random.default_rng(0).random((300, 300)))  # noise: a PNG of many writes
    save(fig, sys.argv[1], 100)
    print("SAVED", flush=True)
""")


@pytest.mark.parametrize("tear_at", [2])
def test_a_figure_killed_mid_write_leaves_no_truncated_file_under_its_name(tmp_path, tear_library, tear_at):
    """A search killed while it drew its figures (its run complete, so --resume only says it finished) left the
    figure being written truncated under its own name, a PNG that looks drawn and is not. The kill here comes after
    the first page of the tear_at-th write that crosses a page; the figure is either whole or absent."""
    path = tmp_path / "figs" / "arch_normal_heatmap.png"
    path.parent.mkdir()
    done = subprocess.run([sys.executable, "-c", _DRAW, str(path)], capture_output=True, text=True, timeout=120,
                          env=_torn_env(tear_library, tear_at, ".png,.png.tmp"))
    assert done.returncode == -signal.SIGKILL, f"no write was torn (exit {done.returncode}): {done.stderr[-1000:]}"
    assert not path.exists(), f"a truncated figure of {path.stat().st_size} bytes is left under the figure's name"
    again = subprocess.run([sys.executable, "-c", _DRAW, str(path)], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, MPLBACKEND="Agg"))
    assert again.returncode == 0, again.stderr[-1000:]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and sorted(os.listdir(path.parent)) == [path.name]


_SEARCH = ["--epochs", "2", "--C", "2", "--layers", "3", "--steps", "2", "--batch-size", "240", "--diagnostics", "cost",
           "--threads", "1", "--no-progress", "--no-figs", "--device", "cpu", "--dtype", "float64"]


def _search(out, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "nasdiag", "search", *_SEARCH, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=env or dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def uninterrupted_search(tmp_path_factory):
    reference = tmp_path_factory.mktemp("reference") / "run.h5"
    done = _search(reference)
    assert done.returncode == 0, done.stderr[-2000:]
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("files, tear_at", [(".h5,.h5.tmp", 6), (".ckpt.tmp", 150)], ids=["record", "checkpoint"])
def test_a_search_killed_inside_a_write_resumes_to_the_uninterrupted_record(tmp_path, tear_library, uninterrupted_search,
                                                                           files, tear_at):
    """A float64 search (CPU, bitwise reproducible) killed inside a write of its record or of its epoch checkpoint
    (the write cut after its first page), then --resume: the checkpoint left is never past the record's last step,
    and the record and final checkpoint equal an uninterrupted run's bit for bit, with no temporary file left."""
    from kill_resume_trials import compare

    out = tmp_path / "run.h5"
    killed = _search(out, env=dict(_torn_env(tear_library, tear_at, files), OMP_NUM_THREADS="1"))
    assert killed.returncode == -signal.SIGKILL, f"no write was torn (exit {killed.returncode}): {killed.stderr[-1000:]}"
    if os.path.exists(f"{out}.ckpt"):
        steps = load(out)["step"]
        checkpoint = torch.load(f"{out}.ckpt", weights_only=False)["step"]
        assert checkpoint <= (int(steps.max()) if steps.size else 0), (checkpoint, steps)
    resumed = _search(out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert compare(out, uninterrupted_search) == []


def test_each_segment_counts_the_nonfinite_values_of_its_own_rows_across_a_rollover(tmp_path, monkeypatch):
    """docs/schema.md: a data dataset's nonfinite_count is the number of NaN/inf elements in its committed rows of the
    segment. A rollover closes the segment before the buffered batch is written, and reset the count of that batch
    too: every segment after the first said 0 for rows full of NaN. Counted here from the rows with plain h5py."""
    monkeypatch.setattr(schema, "MAX_SEGMENT_CHUNKS", 2)
    path = str(tmp_path / "run.h5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(path, flush_every=3, flush_seconds=None) as rec:
            for step in range(14):
                row = np.full(WIDE, float(step), np.float32)
                row[: step % 4] = [np.nan, np.inf, -np.inf][: step % 4]
                rec.log(step, {"wide/x": row, "scalars/a": np.nan if step % 5 == 0 else float(step)})
    assert len(schema.list_segments(path)) > 3
    for _, file in schema.list_segments(path):
        n = _committed_rows(file)
        with h5py.File(file, "r") as f:
            for name in ("wide/x", "scalars/a"):
                expected = int(np.count_nonzero(~np.isfinite(f[name][:n])))
                assert int(f[name].attrs["nonfinite_count"]) == expected, (file, name)


def test_a_record_named_through_a_symbolic_link_keeps_every_segment_next_to_its_file(tmp_path):
    """The lock of a record named through a link lies next to the file it points to, "so every name of a record has
    one lock" (docs/schema.md); its later segments did not: a resume through ``runs/latest.h5 -> data/real.h5``
    wrote ``runs/latest.seg0001.h5``, and the record read by its own name silently lacked those rows. A dangling link
    made a new record fail ("appeared while this recorder held the lock"), and overwrite=True replaced the link."""
    (tmp_path / "data").mkdir()
    (tmp_path / "runs").mkdir()
    real, link = str(tmp_path / "data" / "real.h5"), str(tmp_path / "runs" / "latest.h5")
    os.symlink(os.path.join("..", "data", "real.h5"), link)  # dangling until the record is made
    with Recorder(link, flush_seconds=None) as rec:
        rec.log(0, {"scalars/a": 0.0})
    for session in (1, 2):
        with Recorder(link if session == 1 else real, resume=True, flush_seconds=None) as rec:
            rec.log(session, {"scalars/a": float(session), f"scalars/s{session}": 1.0})
    assert os.listdir(tmp_path / "runs") == ["latest.h5"] and os.path.islink(link)
    for name in (real, link):
        out = load(name)
        np.testing.assert_array_equal(out["step"], [0, 1, 2])
        np.testing.assert_array_equal(out["valid/scalars/s1"], [False, True, False])
    with Recorder(link, overwrite=True, flush_seconds=None) as rec:
        rec.log(7, {"scalars/b": 7.0})
    assert os.path.islink(link) and sorted(os.listdir(tmp_path / "data")) == ["real.h5"]
    for name in (real, link):
        np.testing.assert_array_equal(load(name)["step"], [7])


_LIVE_WRITER = textwrap.dedent("""
    import sys, time, warnings
    sys.path.insert(0, sys.argv[5])
    from test_audit_record_round7 import _row
    from nasdiag.record import Recorder, schema
    schema.MAX_SEGMENT_CHUNKS = 2
    warnings.simplefilter("ignore")
    path, flush_every, session, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rec = Recorder(path, flush_every=flush_every, flush_seconds=None, resume=True)
    committed = rec.last_committed_step
    for step in range(start, 40):
        rec.log(step, _row(step, session, late_from=start + 3))
        if rec.last_committed_step != committed:
            committed = rec.last_committed_step
            print("C", committed, flush=True)
        time.sleep(0.004)
    rec.close()
    print("DONE", flush=True)
""")

_LIVE_READER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from nasdiag.record import load
    path, stop = sys.argv[1], sys.argv[2]
    seen, errors = [], []
    while not os.path.exists(stop):
        try:
            out = load(path) if os.path.exists(path) else {"step": np.zeros(0)}
            steps = out["step"]
            if steps.size:
                assert (np.diff(steps) > 0).all(), steps
                assert (out["scalars/a"] == steps).all()
                x = out["wide/x"]
                assert (x == x[:, :1]).all() and (x[:, 0] % 1000 == steps).all(), "a row mixes values"
            seen.append(int(steps.size))
        except Exception as err:
            errors.append(f"{type(err).__name__}: {str(err)[:300]}")
        time.sleep(0.005)
    print(json.dumps({"seen": seen, "errors": errors[:5]}), flush=True)
""")


@pytest.mark.slow
def test_a_reader_in_another_process_sees_whole_rows_across_rollovers_kills_and_resumes(tmp_path):
    """Writers with a segment of 2 rows (MAX_SEGMENT_CHUNKS=2, one chunk a row), each resumed a few steps before the
    last committed one and killed after a few commits, then one that finishes; a reader process loads the record
    all along. It never fails and never sees a row mixing two sessions' values; the record ends with every step
    once, from the last session that committed it, and every segment lists its predecessors as they are."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "scripts"), os.environ.get("PYTHONPATH", "")]))
    here = os.path.dirname(os.path.abspath(__file__))
    path, stop = str(tmp_path / "run.h5"), str(tmp_path / "stop")
    reader = subprocess.Popen([sys.executable, "-c", _LIVE_READER, path, stop], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    owner = {}  # step -> the session whose row the record must hold
    start = 0
    try:
        for session, (flush_every, commits) in enumerate([(1, 5), (3, 3), (2, 4), (2, None)], start=1):
            writer = subprocess.Popen([sys.executable, "-c", _LIVE_WRITER, path, str(flush_every), str(session),
                                       str(start), here], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env)
            seen = 0
            for line in writer.stdout:
                if line.startswith("C "):
                    seen += 1
                    if seen == commits:
                        writer.send_signal(signal.SIGKILL)
                        break
            assert writer.wait(timeout=120) in ((0,) if commits is None else (-signal.SIGKILL,)), writer.stderr.read()
            steps = load(path)["step"]
            assert int(steps.max()) > max(owner, default=-1)  # each session got past the last: it owns start..max
            for step in range(start, int(steps.max()) + 1):
                owner[step] = session
            start = max(0, int(steps.max()) - 2)  # a checkpoint two steps back: those are replayed
    finally:
        open(stop, "w").close()
        report = json.loads(reader.communicate(timeout=120)[0])
    assert report["errors"] == [] and max(report["seen"]) >= 20, report
    out = load(path)
    np.testing.assert_array_equal(out["step"], np.arange(40))
    np.testing.assert_array_equal(out["wide/x"][:, 0], [step + 1000 * owner[step] for step in range(40)])
    _check_previous_segments(path)


_RESUME_ONCE = textwrap.dedent("""
    import sys
    from nasdiag.record import Recorder
    with Recorder(sys.argv[1], resume=True, flush_seconds=None) as rec:
        rec.log(10, {"scalars/train_loss": 0.5})
""")


def test_the_report_counts_the_resumes_of_a_record_not_its_segments(tmp_path, monkeypatch):
    """One session writes 4 segments (a path first logged after the first flush, then rollovers): the report said
    "4 segment(s), 3 resume(s)" of a run never resumed (every search records its epoch values in a second segment,
    so every report said 1 resume). A resume in another process is one."""
    from nasdiag.plot.report import build_report

    monkeypatch.setattr(schema, "MAX_SEGMENT_CHUNKS", 2)
    path = str(tmp_path / "run.h5")
    with Recorder(path, flush_every=1, flush_seconds=None) as rec:
        for step in range(6):
            rec.log(step, {"scalars/train_loss": 1.0 / (step + 1), "wide/x": np.zeros(WIDE, np.float32),
                           **({"scalars/epoch": 0.0} if step >= 1 else {})})
    segments = len(schema.list_segments(path))
    assert segments > 3
    assert f"{segments} segment(s), 0 resume(s)" in build_report(path, figures=["scalars"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", _RESUME_ONCE, path], check=True, env=env, timeout=120)
    assert f"{segments + 1} segment(s), 1 resume(s)" in build_report(path, figures=["scalars"])


def test_the_kill_trials_make_the_folder_they_are_given(tmp_path, capsys):
    """``record_kill_trials.py --dir /scratch/me`` (its docstring's example) ended in tempfile's traceback when the
    folder did not exist yet."""
    from record_kill_trials import main

    folder = tmp_path / "not" / "yet"
    assert main(["--trials", "0", "--dir", str(folder)]) == 0
    assert folder.is_dir() and os.listdir(folder) == []
    assert "0/0 SIGKILL trials intact" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["copied over", "swapped"])
def test_a_segment_replaced_by_another_of_its_run_is_damage_not_silently_missing_rows(tmp_path, how):
    """A segment file replaced by a copy of another segment of the run (same run id, rows and predecessors that
    check out) lost its own rows without a word; swapped segments let the older row of a replayed step win. Each
    segment says its number (root attribute ``segment``); a file under another number is reported as damage, and
    salvage keeps the segments before it."""
    path = str(tmp_path / "run.h5")
    for session, steps in enumerate([(0, 1), (2, 3), (4, 5), (4, 6)]):  # the last session replays step 4
        with Recorder(path, resume=True, flush_seconds=None) as rec:
            for step in steps:
                rec.log(step, {"scalars/a": float(step + 10 * session)})
    one, two = schema.segment_path(path, 2), schema.segment_path(path, 3)
    if how == "copied over":
        shutil.copyfile(one, two)
    else:
        os.rename(one, one + ".x")
        os.rename(two, one)
        os.rename(one + ".x", two)
    with pytest.raises(RecordError, match=r"seg0002.*holds segment 3 of its run|seg0003.*holds segment 2 of its run"):
        load(path)
    with pytest.warns(RecordWarning, match="intact rows"):
        out = load(path, salvage=True)
    kept = 6 if how == "copied over" else 4  # the segments before the one under a wrong number
    np.testing.assert_array_equal(out["step"], [0, 1, 2, 3, 4, 5][:kept])
    np.testing.assert_array_equal(out["scalars/a"], [0.0, 1.0, 12.0, 13.0, 24.0, 25.0][:kept])


_LOAD = textwrap.dedent("""
    import sys
    from nasdiag.record import RecordError, load
    try:
        load(sys.argv[1])
    except RecordError as err:
        print("REFUSED", err, flush=True)
""")


def test_a_damaged_record_whose_stale_lock_names_a_live_process_is_refused_at_once(tmp_path):
    """A killed writer leaves its lock file, and its pid soon names another process (pid_max is often 32768). The
    reader took that for a live writer and read a damaged segment with HDF5's SWMR retries: `load` hung for more
    than ten minutes instead of failing at once. A live writer holds its flock, which the kernel lists."""
    path = str(tmp_path / "run.h5")
    for step in range(3):
        with Recorder(path, resume=True, flush_seconds=None) as rec:
            rec.log(step, {"scalars/a": float(step), "wide/x": np.zeros(WIDE, np.float32)})
    middle = schema.segment_path(path, 1)
    os.truncate(middle, os.path.getsize(middle) // 2)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        with open(schema.lock_path(path), "w") as fh:  # what the killed writer left, its pid now another's
            json.dump({"pid": bystander.pid, "host": socket.gethostname(), "since": "2026-01-01T00:00:00"}, fh)
        done = subprocess.run([sys.executable, "-c", _LOAD, path], capture_output=True, text=True, timeout=90,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    finally:
        bystander.kill()
        bystander.wait()
    assert done.stdout.startswith("REFUSED") and "seg0001" in done.stdout and "damaged" in done.stdout, done


def test_load_meta_counts_the_nonfinite_values_of_the_rows_the_record_holds(tmp_path):
    """A resume replays the steps after its checkpoint into a new segment, and the later row wins. load_meta's
    nonfinite_counts (shown on the report page) also counted the replaced rows: a NaN at a replayed step twice,
    where `load` returns it once."""
    path = str(tmp_path / "run.h5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)  # the NaN/inf are meant
        for start in (0, 2, 3):  # two resumes from a checkpoint before the last step
            with Recorder(path, resume=True, flush_seconds=None) as rec:
                for step in range(start, 6):
                    rec.log(step, {"scalars/a": np.nan if step in (1, 3) else float(step),
                                   "arch/x": np.full((2, 3), np.inf if step == 4 else 0.0)})
    out = load(path)
    np.testing.assert_array_equal(out["step"], np.arange(6))
    counts = load_meta(path)["nonfinite_counts"]
    assert counts == {"scalars/a": int(np.count_nonzero(~np.isfinite(out["scalars/a"]))),
                      "arch/x": int(np.count_nonzero(~np.isfinite(out["arch/x"])))} == {"scalars/a": 2, "arch/x": 6}


def test_the_checkpoint_of_a_record_named_through_a_link_is_next_to_the_file_it_points_to(tmp_path):
    """A search recorded at data/real.h5 and resumed with --out runs/latest.h5 (a link to it) was refused: "its
    checkpoint runs/latest.h5.ckpt is missing; start again with --force", and --force replaces the record. The
    checkpoint follows the record's file as its segments and lock do (schema.resolve_link)."""
    from nasdiag.search.config import SearchConfig

    (tmp_path / "data").mkdir()
    (tmp_path / "runs").mkdir()
    real, link = tmp_path / "data" / "real.h5", tmp_path / "runs" / "latest.h5"
    os.symlink(os.path.join("..", "data", "real.h5"), link)
    real.touch()
    assert SearchConfig(record=str(link)).checkpoint == os.path.realpath(real) + ".ckpt"
    assert SearchConfig(record=str(real)).checkpoint == str(real) + ".ckpt"
    assert SearchConfig(record=None).checkpoint is None
