"""Recorder audit, round 9: file-size limits (RLIMIT_FSIZE, SIGXFSZ ignored, so writes fail with EFBIG) at many
limits picked from the sizes of an unlimited run; the documented `load` surface against plain h5py reads (dtypes,
wide rows, a path that first appears late and one that stops appearing, Unicode meta, NaN/inf counts); two writers
on one path; a reader polling across segment rollovers; the checkpoint/record invariant of a killed search.

References are this file's own: values logged as known functions of the step, the files read with plain h5py, and
an uninterrupted run of the same seed."""

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
