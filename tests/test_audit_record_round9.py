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

    def write(path, limit, resume=False):
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        error, rec = None, None
        try:
            rec = Recorder(path, flush_every=4, flush_seconds=None, resume=resume)
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
    limits = sorted({0, 1, 600, *(int(size * q) for size in sizes for q in (0.1, 0.3, 0.5, 0.7, 0.85, 0.95, 0.999, 1.2, 1.4))})
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
    """RLIMIT_FSIZE from 0 bytes to just under each segment's full size (taken from an unlimited run of the same
    rows), in one child. A limit below the header-only file the recorder publishes first (600 bytes here) made
    HDF5's close of it fail, and the writer then asked HDF5 for the descriptor of that half-closed file: a
    segmentation fault, not a RecordError. At every limit: one `RecordError` line naming the full disk (or no
    error), the record loads as exactly the committed steps (or there is none), `last_committed_step` is its
    last step, no `*.tmp` is left once the next writer ran, and a resume with the space back gives the rows of
    the unlimited run, float64, int64 and float32 as logged."""
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
