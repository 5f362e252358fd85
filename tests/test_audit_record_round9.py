"""Recorder audit, round 9: file-size limits (RLIMIT_FSIZE, SIGXFSZ ignored, so writes fail with EFBIG) at many
limits picked from the sizes of an unlimited run; the documented `load` surface against plain h5py reads (dtypes,
wide rows, a path that first appears late and one that stops appearing, Unicode meta, NaN/inf counts); two writers
on one path; a reader polling across segment rollovers; the checkpoint/record invariant of a killed search.

References are this file's own: values logged as known functions of the step, the files read with plain h5py, and
an uninterrupted run of the same seed.

Checked and found right (scratch runs, not all kept as tests): RLIMIT_FSIZE sweeps at byte and page granularity
(flush_every 1/4/8, MAX_SEGMENT_CHUNKS 2 and 4096, a late path) keep an exact prefix that resumes exactly; a
`nasdiag search` under `ulimit -f` 1 to 480 KiB stops with one line (record or checkpoint), and --resume equals the
uninterrupted run; a SIGKILL at each of the 22 record/checkpoint write moments of a 2-epoch search resumes to the
uninterrupted run with the checkpoint never past the record; two processes racing for one path (new, resume,
overwrite; 24 races) leave one writer's rows intact and refuse the other; a reader thread beside a writer thread
of the same process across 51 rollovers sees whole prefixes; `nasdiag plot`/`report` on records of one row, NaN
rows, all-NaN rows and four segments flag NaNs and skip with a reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_child(code: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


# --- file-size limits --------------------------------------------------------------------------------------------

_FSIZE_CHILD = textwrap.dedent("""
    import glob, json, os, resource, sys, warnings
    import numpy as np
    from nasdiag.record import Recorder, RecordError, load
    warnings.simplefilter("ignore")
    folder, N = sys.argv[1], 70

    def row(s):
        r = {"scalars/x": s * 0.5 + 0.125, "arch/w": np.arange(40, dtype=np.float64) + s, "ints/i": np.int64(3 * s)}
        if s >= 30:
            r["late/y"] = np.float32(-s)  # a path first logged after the first flush: the writer rolls over
        return r

    ops = ["none", "max_pool_3x3", "avg_pool_3x3", "skip_connect", "sep_conv_3x3", "sep_conv_5x5", "dil_conv_3x3"]
    edges = [f"{j}<-{i}" for j in range(2, 6) for i in range(j)]
    META = {"method": "darts", "seed": 0, "config": {"lr": 0.025, "epochs": 50, "out": folder}, "op_names": ops,
            "cell_types": ["normal", "reduce"], "edge_names": {"normal": edges, "reduce": edges}}  # a search's header

    def write(path, limit, resume=False):
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        error, rec = None, None
        try:
            rec = Recorder(path, meta=None if resume else META, flush_every=4, flush_seconds=None, resume=resume)
            start = 0 if rec.last_step is None else rec.last_step + 1
            for s in range(start, N):
                rec.log(s, row(s))
            rec.close()
        except RecordError as err:
            error = str(err)
        finally:
            if rec is not None:
                try:
                    rec.close()
                except RecordError:
                    pass
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        return error, (None if rec is None else rec.last_committed_step)

    unlimited = os.path.join(folder, "free", "run.h5")
    os.makedirs(os.path.dirname(unlimited))
    assert write(unlimited, resource.RLIM_INFINITY) == (None, N - 1)
    sizes = sorted(os.path.getsize(f) for f in glob.glob(unlimited[:-3] + "*.h5"))
    header_only = os.path.join(folder, "header", "run.h5")
    Recorder(header_only, meta=META).close()  # no rows: the file a recorder publishes first stays
    sizes.append(os.path.getsize(header_only))
    limits = sorted({0, 1, *(int(size * q) for size in sizes for q in (0.1, 0.3, 0.5, 0.7, 0.85, 0.95, 0.999, 1.2, 1.4))})
    for limit in limits:
        path = os.path.join(folder, str(limit), "run.h5")
        os.makedirs(os.path.dirname(path))
        error, committed = write(path, limit)
        try:
            steps = load(path)["step"].tolist()
        except RecordError as err:
            steps = "no record" if "no record" in str(err) else str(err)
        again, _ = write(path, resource.RLIM_INFINITY, resume=True)
        out = load(path)
        exact = out["step"].tolist() == list(range(N)) and all(
            np.array_equal(out[k][s], v) and out[k].dtype == np.asarray(v).dtype for s in range(N) for k, v in row(s).items())
        exact = exact and not out["valid/late/y"][:30].any()
        left = sorted(os.path.basename(f) for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp"))
        print(json.dumps({"limit": limit, "error": error, "committed": committed, "steps": steps, "resume_error": again,
                          "exact": bool(exact), "tmp": left}), flush=True)
    print("DONE", flush=True)
""")


def test_a_writer_under_any_file_size_limit_says_so_in_one_line_keeps_its_rows_and_resumes_exactly(tmp_path):
    """RLIMIT_FSIZE from 0 bytes to just under each segment's full size and the header-only file's (taken from an
    unlimited run of the same rows and meta, a search's), in one child. HDF5 swallows a write that fails while it
    creates objects ("Exception ignored in ObjectID.__dealloc__"), so a limit below the header-only file the recorder
    publishes first ended in a segmentation fault when that file was closed (and, after a failed close, when its
    descriptor was asked for), not a RecordError: a `nasdiag search` under `ulimit -f 8` died with exit code 139.
    Segments are now built in memory and written as one image. At every limit: one `RecordError` line naming the
    full disk (or no error), the record loads as exactly the committed steps (or there is none),
    `last_committed_step` is its last step, no `*.tmp` is left once the next writer ran, and a resume with the space
    back gives the rows of the unlimited run, float64, int64 and float32 as logged."""
    child = _run_child(_FSIZE_CHILD, tmp_path, timeout=300)
    lines = child.stdout.splitlines()
    assert child.returncode == 0 and lines and lines[-1] == "DONE", (child.returncode, child.stdout[-2000:],
                                                                      child.stderr[-3000:])
    results = [json.loads(line) for line in lines[:-1]]
    assert len(results) >= 10
    for r in results:
        if r["error"] is not None:
            assert "\n" not in r["error"] and "disk full or file-size limit reached" in r["error"], r
        if r["steps"] == "no record":
            assert r["committed"] is None and r["error"] is not None, r
        else:
            assert isinstance(r["steps"], list), r
            assert r["steps"] == list(range(len(r["steps"]))), r  # a prefix of the logged steps
            assert (r["committed"] if r["committed"] is not None else -1) == len(r["steps"]) - 1, r
        assert r["resume_error"] is None and r["exact"] and r["tmp"] == [], r
    assert any(r["steps"] == "no record" for r in results) and any(r["error"] and r["steps"] for r in results)


# --- the documented load surface against plain h5py ---------------------------------------------------------------


def _h5py_record(path: str) -> dict:
    """The merged record as docs/schema.md describes it, read with plain h5py only: segment 0 is ``path``, segment
    i is ``<root>.seg<iiii><ext>``; a segment's committed rows are /step up to its first -1; where a step appears in
    several segments the later segment's row wins; rows sorted by step; a path not logged in a row is its fill."""
    import glob

    import h5py
    import numpy as np

    root, ext = os.path.splitext(path)
    files = [path] + sorted(glob.glob(root + ".seg[0-9][0-9][0-9][0-9]" + ext))
    rows: dict[int, dict] = {}  # step -> {path: value}, later segments overwrite
    dtypes: dict[str, tuple] = {}
    nonfinite_attrs = []
    for file in files:
        with h5py.File(file, "r", swmr=True) as f:
            steps = f["step"][()]
            n = int(np.argmax(steps < 0)) if (steps < 0).any() else len(steps)
            paths = [p.decode() if isinstance(p, bytes) else str(p) for p in f["present"].attrs["paths"]]
            present = f["present"][:n]
            segment, logged = {}, {int(steps[t]): {} for t in range(n)}
            for j, p in enumerate(paths):
                dtypes[p] = (f[p].dtype, f[p].shape[1:])
                values = f[p][:n]
                own = int(np.count_nonzero(~np.isfinite(values[present[:, j]]))) if values.dtype.kind == "f" else 0
                segment[p] = (int(f[p].attrs["nonfinite_count"]), own)
                for t in np.flatnonzero(present[:, j]):
                    logged[int(steps[t])][p] = values[t]
            rows.update(logged)  # the later segment's row, whole
            nonfinite_attrs.append(segment)
            meta = {"op_names": f["meta/op_names"].asstr()[()].tolist() if "meta/op_names" in f else None,
                    "method": f.attrs["method"], "seed": int(f.attrs["seed"])}
    order = sorted(rows)
    out = {"step": np.array(order, np.int64)}
    for p, (dtype, shape) in dtypes.items():
        fill = np.nan if dtype.kind == "f" else (False if dtype.kind == "b" else 0)
        out[p] = np.stack([np.asarray(rows[s].get(p, np.full(shape, fill, dtype)), dtype) for s in order])
        out[f"valid/{p}"] = np.array([p in rows[s] for s in order])
    return {"data": out, "nonfinite": nonfinite_attrs, "meta": meta}


def _wide_row(step: int, session: int, width: int) -> dict:
    import numpy as np

    row = {f"wide/c{j:04d}": float(step * 10000 + j + session / 4) for j in range(width) if j % 5 == 0 or step < 6}
    row["wide/c0003"] = [np.nan, np.inf, -np.inf, 1.5][step % 4]  # NaN/inf rows, recorded as they are
    row["arch/normal/weights"] = np.arange(6, dtype=np.float64).reshape(2, 3) * step + session
    row["f32/x"] = np.float32(step / 3)
    row["f16/x"] = np.float16(-step / 7)
    row["int/i8"] = np.int8(-step)
    row["int/u64"] = np.uint64(2**64 - 1 - step)
    row["flags/b"] = bool(step % 3)
    if session == 0 and step < 7:
        row["gone/after"] = np.full(3, step + 0.25)  # stops appearing
    if session == 1 and step >= 9:
        row["late/since"] = np.int64(step * step)  # first appears late, after the session's first flush
    return row


def test_load_equals_a_plain_h5py_reading_of_a_wide_record_with_late_gone_replayed_and_nonfinite_paths(tmp_path):
    """`load` against this file's h5py reading of the same segments (docs/schema.md: committed rows, the later
    segment's row wins whole, fill values, ``valid/``), on a record of about 1000 columns: a path that stops
    appearing, one that first appears late (a rollover), steps replayed by a resume, NaN/inf rows, every kind of
    dtype (float64/32/16, int8, uint64 beyond int64, bool), Unicode meta. Also: each segment's ``nonfinite_count``
    attribute is the NaN/inf count of its logged rows, and `load_meta`'s ``nonfinite_counts`` that of the rows
    `load` returns."""
    import warnings

    import numpy as np

    from nasdiag.record import Recorder, RecordWarning, load, load_meta

    path = str(tmp_path / "run.h5")
    width = 1000
    meta = {"method": "dárts", "seed": 3, "op_names": ["none", "0→2", "conv/3x3"], "cell_types": ["normal"],
            "edge_names": {"normal": ["é→1", "ü→2"]}, "note": {"ключ": "значение"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(path, meta=meta, flush_every=3, flush_seconds=None) as rec:
            for step in range(0, 8):
                rec.log(step, _wide_row(step, 0, width))
        with Recorder(path, flush_every=3, flush_seconds=None, resume=True) as rec:
            for step in range(5, 12):  # replays 5..7 from a "checkpoint"
                rec.log(step, _wide_row(step, 1, width))
    reference = _h5py_record(path)
    want = reference["data"]
    got = load(path)
    assert len(reference["nonfinite"]) >= 3  # segment 0, the resume, the rollover of late/since
    np.testing.assert_array_equal(want["step"], np.arange(12))
    data_keys = {k for k in got if not k.startswith("meta/")}
    assert data_keys == set(want), sorted(data_keys ^ set(want))
    for key, expected in want.items():
        assert got[key].dtype == expected.dtype and got[key].shape == expected.shape, key
        np.testing.assert_array_equal(got[key], expected, err_msg=key)  # NaN == NaN for numpy here
    # the rows as logged, not only as h5py reads them back
    for i, step in enumerate(range(12)):
        session = 1 if step >= 5 else 0
        for p, value in _wide_row(step, session, width).items():
            np.testing.assert_array_equal(got[p][i], np.asarray(value, dtype=got[p].dtype), err_msg=f"{p} {step}")
            assert got[f"valid/{p}"][i], (p, step)
    assert not got["valid/gone/after"][5:].any() and np.isnan(got["gone/after"][5:]).all()  # replaced rows, whole
    assert not got["valid/late/since"][:9].any() and (got["late/since"][:9] == 0).all()
    assert got["int/u64"].dtype == np.uint64 and got["int/u64"][0] == 2**64 - 1
    np.testing.assert_array_equal(got["meta/op_names"], meta["op_names"])
    np.testing.assert_array_equal(got["meta/edge_names/normal"], meta["edge_names"]["normal"])
    assert got["meta/method"] == "dárts" and got["meta/seed"] == 3 and got["meta/seed"].dtype == np.int64
    assert json.loads(str(got["meta/note"])) == meta["note"]
    assert reference["meta"]["op_names"] == meta["op_names"]
    for segment in reference["nonfinite"]:
        for p, (attribute, own) in segment.items():
            assert attribute == own, (p, attribute, own)
    counts = load_meta(path)["nonfinite_counts"]
    for p in want:
        if p.startswith("valid/") or p == "step" or want[p].dtype.kind != "f":
            continue
        own = int(np.count_nonzero(~np.isfinite(want[p][want[f"valid/{p}"]])))
        assert counts.get(p, 0) == own, (p, counts.get(p), own)


# --- two writers on one path ---------------------------------------------------------------------------------------


def test_a_second_writer_that_meets_a_lock_taken_a_moment_ago_names_its_holder_not_pid_none(tmp_path):
    """Two writers started together: the loser may read the lock file between the winner's flock and the winner
    writing its description into it. It said "another writer (pid None on None since None)" (2 in 24 races of two
    processes here). The lock is taken here with an empty file, and described 50 ms later as a writer would: the
    refusal names that pid; a lock never described says "holder unknown", without None."""
    import fcntl
    import threading

    from nasdiag.record import RecordError, Recorder, schema

    path = str(tmp_path / "run.h5")
    fd = os.open(schema.lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RecordError) as never_described:
            Recorder(path)
        describe = threading.Timer(0.05, os.write, (fd, json.dumps({"pid": 4242, "host": "elsewhere",
                                                                    "since": "2026-01-01T00:00:00"}).encode()))
        describe.start()
        with pytest.raises(RecordError) as described:
            Recorder(path)
        describe.join()
    finally:
        os.close(fd)
    assert "None" not in str(never_described.value) and "holder unknown" in str(never_described.value)
    assert "pid 4242 on elsewhere" in str(described.value), str(described.value)
    assert not os.path.exists(path)  # neither refused writer made a file


# --- the checkpoint/record invariant at every kill point of a search ------------------------------------------------

_KILL_POINTS_CHILD = textwrap.dedent("""
    import glob, json, os, signal, sys
    import h5py, numpy as np, torch
    torch.set_num_threads(1)
    import nasdiag.cli as cli
    from nasdiag.record import writer
    from nasdiag.search import checkpoint

    # the moments are counted writes: a flush because 10 s passed (a loaded machine) would add writes and move them
    import time as real_time, types
    writer.time = types.SimpleNamespace(**{**vars(real_time), "monotonic": lambda: 0.0})  # the rest as it is

    # the search's lazy imports (the data's sklearn, torch._dynamo, the methods), paid once here, not in each fork
    import sklearn.datasets, torch._dynamo, nasdiag.search.runner, nasdiag.search.methods, nasdiag.hessian
    import nasdiag.regret, nasdiag.distributed

    folder, points = sys.argv[1], [int(k) for k in sys.argv[2].split(",")]
    SEARCH = ["search", "--epochs", "2", "--C", "2", "--layers", "3", "--steps", "2", "--batch-size", "240",
              "--diagnostics", "cost", "--threads", "1", "--no-progress", "--no-figs", "--device", "cpu",
              "--dtype", "float64"]
    events, kill_at = [], [0]

    def event(name):
        events.append(name)
        if len(events) == kill_at[0]:
            os.kill(os.getpid(), signal.SIGKILL)

    def around(owner, attribute, name):
        original = getattr(owner, attribute)
        def wrapped(*args, **kwargs):
            event(name + " begins")
            result = original(*args, **kwargs)
            event(name + " ends")
            return result
        setattr(owner, attribute, wrapped)

    around(writer.Recorder, "_write_batch", "record batch")
    around(writer.Recorder, "_create_segment", "record segment")
    around(checkpoint.os, "fsync", "checkpoint fsync")  # the os module: every fsync and replace of the process
    around(checkpoint.os, "replace", "replace")

    def search(out, *extra, kill=0):
        pid = os.fork()
        if pid == 0:
            kill_at[0] = kill
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1), os.dup2(quiet, 2)  # the search's own output
            try:
                code = cli.main(SEARCH + ["--out", out, *extra])
            except BaseException:
                code = 99
            with open(out + ".events", "w") as fh:
                json.dump(events, fh)
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    def last_recorded(out):  # plain h5py: the largest committed step of any segment
        last = -1
        for file in glob.glob(out[:-3] + "*.h5"):
            with h5py.File(file, "r", swmr=True) as f:
                steps = f["step"][()]
                if (steps >= 0).any():
                    last = max(last, int(steps[steps >= 0].max()))
        return last

    reference = os.path.join(folder, "reference.h5")
    assert search(reference) == 0
    names = json.load(open(reference + ".events"))
    print("RESULT " + json.dumps({"events": names}), flush=True)
    for k in points:
        if k > len(names):
            continue
        out = os.path.join(folder, f"killed{k}.h5")
        killed = search(out, kill=k)
        ckpt = torch.load(out + ".ckpt", weights_only=False)["step"] if os.path.exists(out + ".ckpt") else None
        recorded = last_recorded(out) if os.path.exists(out) else None
        resumed = search(out, *(["--resume"] if os.path.exists(out) else []))
        print("RESULT " + json.dumps({"k": k, "at": names[k - 1], "killed": killed, "checkpoint": ckpt, "recorded": recorded,
                          "resumed": resumed}), flush=True)
    print("DONE", flush=True)
""")


@pytest.mark.slow
def test_a_search_killed_at_each_write_of_its_record_and_checkpoint_resumes_to_the_uninterrupted_run(tmp_path):
    """A float64 search (CPU, bitwise reproducible) SIGKILLed at chosen moments around its segment creations, batches
    of rows and checkpoint writes (fsync, rename), counted in an uninterrupted run: the kill lands on exactly that
    moment (a fork per run, so the imports are paid once; scratch runs of every one of the 22 moments agreed). After each kill the checkpoint left
    is never past the record's last committed step (read with plain h5py), and --resume ends in a record equal to
    the uninterrupted one (this file's h5py reading, bitwise, NaN where NaN) and the same final network and
    generator. A kill after the final checkpoint leaves a finished run, which --resume says in one line."""
    import numpy as np
    import torch

    # the moments (numbered in the uninterrupted run, whose event names are checked below): the first segment
    # published; the first checkpoint written, the first batch not; the placeholder replaced by the segment, the
    # batch's rows not written; the batch committed, its checkpoint not begun; the checkpoint written, not renamed;
    # the second epoch's batch begun; the final checkpoint not renamed; everything done
    points = {2: "record segment ends", 7: "record batch begins", 10: "replace ends", 12: "record batch ends",
              15: "replace begins", 17: "record batch begins", 21: "replace begins", 22: "replace ends"}
    child = _run_child(_KILL_POINTS_CHILD, tmp_path, ",".join(map(str, points)), timeout=900)
    lines = [line[len("RESULT "):] for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    assert child.returncode == 0 and child.stdout.rstrip().endswith("DONE"), (child.stdout[-2000:], child.stderr[-3000:])
    names = json.loads(lines[0])["events"]
    trials = [json.loads(line) for line in lines[1:]]
    assert len(names) == max(points) and all(names[k - 1] == name for k, name in points.items()), names
    assert len(trials) == len(points)
    reference = _h5py_record(str(tmp_path / "reference.h5"))["data"]
    final = torch.load(tmp_path / "reference.h5.ckpt", weights_only=False)["method"]
    for trial in trials:
        assert trial["killed"] == -9, trial
        if trial["checkpoint"] is not None and trial["recorded"] is not None:
            assert trial["checkpoint"] <= max(trial["recorded"], 0), trial
        if trial["k"] == len(names):  # after the last checkpoint: nothing left to do
            assert trial["resumed"] == 2, trial
        else:
            assert trial["resumed"] == 0, trial
        out = str(tmp_path / f"killed{trial['k']}.h5")
        got = _h5py_record(out)["data"]
        assert set(got) == set(reference), trial
        for key, expected in reference.items():
            np.testing.assert_array_equal(got[key], expected, err_msg=f"{key} {trial}")
        state = torch.load(out + ".ckpt", weights_only=False)["method"]
        assert all(torch.equal(state["network"][name], t) for name, t in final["network"].items()), trial
        assert torch.equal(state["generator"], final["generator"]), trial
        assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")], trial


def test_load_takes_every_path_type_the_recorder_takes_and_refuses_others_in_one_record_error(tmp_path):
    """`Recorder` takes str, os.PathLike and bytes (os.fsdecode), and refuses anything else with a RecordError;
    `load`/`load_meta` of the same record by its bytes path was a TypeError traceback ("can't concat str to bytes",
    from the segment glob), and of an int or None a TypeError of os.fspath."""
    import numpy as np

    from nasdiag.record import RecordError, Recorder, load, load_meta

    path = str(tmp_path / "run.h5")
    with Recorder(os.fsencode(path), flush_seconds=None) as rec:
        rec.log(4, {"scalars/x": 0.5})
    for name in (path, os.fsencode(path), tmp_path / "run.h5"):
        np.testing.assert_array_equal(load(name)["scalars/x"], [0.5])
        assert load_meta(name)["segments"] == [path]
    for bad in (3, None, 1.5):
        for function in (load, load_meta):
            with pytest.raises(RecordError, match="path must be a str or os.PathLike"):
                function(bad)
