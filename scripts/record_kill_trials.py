"""Fault injection for records: writers in child processes, killed or starved on purpose.

    python scripts/record_kill_trials.py                  # 200 SIGKILL trials in a temporary folder
    python scripts/record_kill_trials.py --trials 1000 --dir /scratch/me   # on the file system you use
    python scripts/record_kill_trials.py --signal SIGTERM
    python scripts/record_kill_trials.py --tear           # killed inside a write (needs cc)

Each trial (`kill_trial`) starts a writer in a child process (fresh, or resuming and rewinding an
existing record), kills it right after opening or after a random number of commits, then checks that
the record loads, holds exactly the first rows logged (no torn row), lost at most one unflushed
buffer, and resumes without touching the crashed files. Prints one JSON line per trial, a summary,
and exits 1 if any trial failed.

The child writes rows that are a known function of the step (`expected_row`), reports every commit
on stdout, and is then killed (SIGKILL / SIGTERM), hits a file-size limit, raises, or exits without
closing. tests/test_record_faults.py drives the same harness (`WriterProcess`, `verify_rows`,
`kill_trial`); it lives here, not in the package, because only tests and this script use it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

TAG_OFFSET = 10**9  # far above any step a trial reaches


def expected_row(step: int, tag: int = 0, late_from: int | None = None, nan_every: int | None = None) -> dict:
    """The values the child logs at ``step`` (``tag`` tells writers of one record apart)."""
    row = {
        "scalars/a": step * 0.5 + TAG_OFFSET * tag,
        "scalars/i": np.int64(step + TAG_OFFSET * tag),
        "arch/normal/weights": np.full((2, 3), step + tag, np.float32),
        "regret/normal/alive": np.array([step % 2 == 0, True]),
    }
    if late_from is not None and step >= late_from:
        row["scalars/late"] = -float(step) - tag
    if nan_every and step % nan_every == 0:
        row["scalars/a"] = float("nan")
        row["arch/normal/weights"][0, 1] = np.inf
    return row


# --- child side ------------------------------------------------------------------------------


def child_main(cfg: dict) -> None:
    """Run one writer as described by ``cfg`` (see `WriterProcess`); talk to the parent on stdout."""
    from nasdiag.record import RecordError, Recorder, load

    def say(*words):
        print(*words, flush=True)

    if cfg.get("fsize"):
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"]))
    terminated = []
    if cfg.get("own_sigterm"):
        # A handler of the application's own (like a checkpoint-and-requeue one), installed first.
        def on_term(signum, frame):
            terminated.append(signum)
            say("TERM")

        signal.signal(signal.SIGTERM, on_term)
    try:
        recorder = Recorder(
            cfg["path"],
            meta={"method": "crashtest", "seed": cfg.get("seed", 0)},
            flush_every=cfg.get("flush_every", 8),
            resume=cfg.get("resume", False),
            overwrite=cfg.get("overwrite", False),
            flush_seconds=None,
        )
    except RecordError as err:
        rows = "none"
        try:
            rows = str(len(load(cfg["path"])["step"]))
        except RecordError:
            pass
        say("REFUSED", rows, str(err))
        return
    say("READY")
    start, count = cfg.get("start", 0), cfg.get("count", -1)
    late_from, nan_every, tag = cfg.get("late_from"), cfg.get("nan_every"), cfg.get("tag", 0)
    bad_shape_at = cfg.get("bad_shape_at")
    reported = 0
    step = start
    end = cfg.get("end", "close")
    failed = False
    # "exit" leaves without closing, to test the close at interpreter exit.
    with contextlib.nullcontext() if end == "exit" else recorder:
        while not failed and (count < 0 or step < start + count):
            if step == bad_shape_at:
                try:
                    recorder.log(step, {"scalars/a": 0.0, "arch/normal/weights": np.zeros((3, 3), np.float32)})
                except RecordError:
                    say("BAD", step)
                step += 1
                continue
            try:
                recorder.log(step, expected_row(step, tag, late_from, nan_every))
            except RecordError as err:
                say("ERR", recorder.rows_committed, str(err))
                failed = True
                break
            if recorder.rows_committed != reported:
                reported = recorder.rows_committed
                say("C", reported)
            if cfg.get("sleep"):
                time.sleep(cfg["sleep"])
            step += 1
        if not failed:
            say("LOGGED", step - start)
            if end == "hold":
                say("HOLD")
                while not terminated:
                    time.sleep(0.05)
                for extra in range(step, step + cfg.get("after_term", 0)):
                    recorder.log(extra, expected_row(extra, tag, late_from, nan_every))
            if end == "raise":
                raise RuntimeError("crashtest: raised inside the with block")
            if end == "exit":
                sys.exit(0)
    if cfg.get("report_rows_after"):  # for files that vanish with the child (a private tmpfs)
        out = load(cfg["path"])
        n = out["step"].size
        expected = np.arange(start, start + n)
        prefix = np.array_equal(out["step"], expected) and np.array_equal(out["scalars/i"], expected + TAG_OFFSET * tag)
        say("ROWS", n, "prefix" if prefix else "not-a-prefix")
    say("DONE", recorder.rows_committed)


# --- parent side -----------------------------------------------------------------------------


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)


class WriterProcess:
    """A writer child. ``cfg``: path, start, count (-1: endless), flush_every, resume, overwrite,
    tag, late_from, nan_every, bad_shape_at, sleep (s per row), fsize (RLIMIT_FSIZE bytes),
    end ("close", "hold": wait for a signal, "raise", "exit": leave without closing),
    own_sigterm (install an application SIGTERM handler first), after_term (rows logged after it ran).
    ``wrapper``: argv prefix (for example an ``unshare`` command); ``env``: extra environment variables."""

    def __init__(self, cfg: dict, wrapper: list[str] | None = None, env: dict | None = None):
        argv = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)]
        env = dict(os.environ, PYTHONPATH=_pythonpath(), **(env or {}))
        self.proc = subprocess.Popen(
            (wrapper or []) + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: queue.Queue = queue.Queue()
        self.committed = 0
        self.history: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.endswith("\n"):  # a line cut short by a kill is not evidence of anything
                self.lines.put(line[:-1])
        self.lines.put(None)

    def _take(self, timeout: float) -> str | None:
        line = self.lines.get(timeout=timeout)
        if line is not None:
            self.history.append(line)
            if line.startswith("C "):
                self.committed = int(line.split()[1])
        return line

    def wait_for(self, prefix: str, timeout: float = 60.0, committed_at_least: int | None = None) -> str:
        """Read lines until one starts with ``prefix`` (or ``committed`` reaches a number)."""
        deadline = time.monotonic() + timeout
        while True:
            if committed_at_least is not None and self.committed >= committed_at_least:
                return f"C {self.committed}"
            line = self._take(max(0.01, deadline - time.monotonic()))
            if line is None:
                raise RuntimeError(f"writer ended before {prefix!r}: {self.history[-5:]} {self.stderr()}")
            if committed_at_least is None and line.startswith(prefix):
                return line

    def signal(self, signum: int) -> int:
        self.proc.send_signal(signum)
        return self.finish()

    def finish(self, timeout: float = 60.0) -> int:
        """Wait for the child, then drain what it printed before it ended."""
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        while True:
            try:
                if self._take(0.01) is None:
                    break
            except queue.Empty:
                break
        return code

    def stderr(self) -> str:
        return self.proc.stderr.read() if self.proc.poll() is not None else ""


def verify_rows(path, writers: list[dict]) -> dict:
    """Check ``load(path)`` against the rows the writers logged, in order (a later writer wins).

    ``writers``: per writer ``start``, ``tag``, ``late_from``, ``nan_every``, and either ``rows``
    (exactly this many committed) or, for the last writer only, ``min_rows`` .. ``max_rows``.
    Each writer's committed rows must be the first rows it logged, complete and exact; nothing else
    may be there. Raises AssertionError on any difference; returns the last writer's row count.
    """
    from nasdiag.record import load

    out = load(path)
    steps = out["step"]
    last = writers[-1]
    tags = out["scalars/i"] // TAG_OFFSET if steps.size else np.zeros(0, np.int64)
    n_last = int(np.count_nonzero(tags == last["tag"]))
    low, high = (last["rows"], last["rows"]) if "rows" in last else (last["min_rows"], last["max_rows"])
    assert low <= n_last <= high, f"last writer: {n_last} rows on disk, expected {low}..{high}"
    owner: dict[int, dict] = {}
    for writer in writers:
        n = n_last if writer is last else writer["rows"]
        for s in range(writer["start"], writer["start"] + n):
            owner[s] = writer
    assert steps.tolist() == sorted(owner), f"steps on disk {steps.tolist()[:12]}... expected {sorted(owner)[:12]}..."
    for i, s in enumerate(steps.tolist()):
        writer = owner[s]
        row = expected_row(s, writer["tag"], writer.get("late_from"), writer.get("nan_every"))
        for key, value in row.items():
            assert out[f"valid/{key}"][i], f"{key} missing at step {s}"
            np.testing.assert_array_equal(out[key][i], value, err_msg=f"{key} at step {s}")
        if "scalars/late" in out and "scalars/late" not in row:
            assert not out["valid/scalars/late"][i], f"scalars/late should be missing at step {s}"
    return n_last


def _file_digests(path) -> dict[str, bytes]:
    import hashlib

    from nasdiag.record.schema import list_segments

    return {file: hashlib.sha256(open(file, "rb").read()).digest() for _, file in list_segments(os.fspath(path))}


def kill_trial(directory, seed: int, signum: int = signal.SIGKILL) -> dict:
    """One trial: a writer (fresh, or resuming a record and rewinding) gets ``signum`` at a random
    moment (early: while creating its segment; or after a random number of commits). Then the
    record must load with exactly a prefix of the logged rows, and a resume must succeed without
    touching the earlier files. SIGKILL may lose at most one buffer; SIGTERM (which may land inside
    a flush) must lose nothing that was logged, close every file cleanly, remove the lock and end
    the process by the signal. Returns a summary of the trial."""
    from nasdiag.record import Recorder

    rng = random.Random(seed)
    path = os.path.join(os.fspath(directory), f"kill{seed}-{signum}.h5")
    flush_every = rng.choice([1, 3, 8, 64])
    writers: list[dict] = []
    cfg = {"path": path, "start": 0, "count": -1, "flush_every": flush_every, "tag": 0}
    if rng.random() < 0.3:
        base_rows = rng.randint(1, 150)
        with Recorder(path, flush_every=rng.choice([4, 64]), flush_seconds=None) as rec:
            for s in range(base_rows):
                rec.log(s, expected_row(s))
        writers.append({"start": 0, "tag": 0, "rows": base_rows})
        cfg.update(start=rng.randint(0, base_rows), tag=1, resume=True)
    else:
        cfg.update(late_from=rng.choice([None, rng.randint(0, 200)]), nan_every=rng.choice([None, 5]))
    child = WriterProcess(cfg)
    child.wait_for("READY")
    if rng.random() < 0.3:
        moment = f"{rng.uniform(0, 0.03) * 1e3:.1f} ms after open"
        time.sleep(float(moment.split()[0]) / 1e3)
    else:
        target = rng.randint(1, 400)
        child.wait_for("C", committed_at_least=target)
        delay = rng.uniform(0, 0.005)
        time.sleep(delay)
        moment = f"{delay * 1e3:.1f} ms after {target} commits"
    child.proc.send_signal(signum)
    code = child.finish()
    assert code == -signum, f"writer ended with {code}, not by signal {signum}: {child.stderr()[-2000:]}"
    reported = child.committed
    killed = signum == signal.SIGKILL
    writers.append(
        {
            "start": cfg["start"],
            "tag": cfg["tag"],
            "late_from": cfg.get("late_from"),
            "nan_every": cfg.get("nan_every"),
            "min_rows": reported,
            "max_rows": reported + flush_every if killed else 10**9,
        }
    )
    rows = verify_rows(path, writers)
    if not killed:
        import h5py

        from nasdiag.record.schema import list_segments

        assert not os.path.exists(path + ".lock"), "the lock file outlived a SIGTERM"
        for _, file in list_segments(path):
            with h5py.File(file, "r"):  # without swmr=True: only a cleanly closed file opens
                pass
    _check_resume_leaves_files(path)
    return {"seed": seed, "signal": signal.Signals(signum).name, "flush_every": flush_every,
            "resume": cfg.get("resume", False), "moment": moment, "reported": reported, "rows_on_disk": rows,
            "lost_at_most": flush_every if killed else 0}


TEAR_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tear_writes.c")


def build_tear_library(directory) -> str | None:
    """Compile scripts/tear_writes.c into ``directory``; None where there is no C compiler (or no
    LD_PRELOAD: the library interposes glibc's pwrite on Linux)."""
    import shutil

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        return None
    out = os.path.join(os.fspath(directory), "tear_writes.so")
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", out, TEAR_SOURCE, "-ldl"], capture_output=True, text=True)
    return out if done.returncode == 0 and os.path.exists(out) else None


def tear_trial(directory, seed: int, tear_at: int, library: str, metadata_only: bool = False) -> dict:
    """One trial of the worst a SIGKILL can do to one write: a fresh writer (``seed`` picks flush_every and
    whether a late column opens a second segment) logs 400 rows under ``library`` (`build_tear_library`),
    which writes only the first page of the ``tear_at``-th page-crossing write to the record (of HDF5
    metadata only, with ``metadata_only``) and kills the writer (SIGKILL) there. The record must then load with exactly the first rows logged, lose at most one
    buffer, and resume without touching the crashed files. If the writer makes fewer such writes, it ends
    normally and every row must be there."""
    rng = random.Random(seed)
    path = os.path.join(os.fspath(directory), f"tear{seed}-{tear_at}{'m' if metadata_only else ''}.h5")
    flush_every = rng.choice([1, 3, 8, 64])
    cfg = {"path": path, "start": 0, "count": 400, "flush_every": flush_every, "tag": 0,
           "late_from": rng.choice([None, rng.randint(0, 200)]), "nan_every": rng.choice([None, 5])}
    child = WriterProcess(cfg, env={"LD_PRELOAD": library, "NASDIAG_TEAR_AT": str(tear_at),
                                    "NASDIAG_TEAR_PAGE": str(mmap.PAGESIZE),
                                    "NASDIAG_TEAR_METADATA": "1" if metadata_only else "0"})
    code = child.finish(timeout=120)
    torn = code == -signal.SIGKILL
    assert torn or code == 0, f"writer ended with {code}: {child.stderr()[-2000:]}"
    reported = child.committed
    writer = {"start": 0, "tag": 0, "late_from": cfg["late_from"], "nan_every": cfg["nan_every"]}
    writer.update({"min_rows": reported, "max_rows": reported + flush_every} if torn else {"rows": 400})
    rows = verify_rows(path, [writer])
    _check_resume_leaves_files(path)
    return {"seed": seed, "tear_at": tear_at, "metadata_only": metadata_only, "flush_every": flush_every, "torn": torn, "reported": reported,
            "rows_on_disk": rows}


def _check_resume_leaves_files(path) -> None:
    """A resume after a crash must start a new segment: the crashed files stay byte for byte as they were."""
    from nasdiag.record import Recorder, load

    before = _file_digests(path)
    steps = load(path)["step"]
    with Recorder(path, resume=True, flush_seconds=None) as rec:
        expected_last = int(steps.max()) if steps.size else None
        assert rec.last_step == expected_last, (rec.last_step, expected_last)
        next_step = 0 if expected_last is None else expected_last + 1
        rec.log(next_step, {"scalars/a": 0.25})
    after = _file_digests(path)
    assert all(after[file] == digest for file, digest in before.items()), "resume modified a crashed segment"
    assert load(path)["step"].tolist() == steps.tolist() + [next_step]


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # script_args, also when imported by the tests
    from script_args import Parser, UsageError, at_least

    # one line, exit 2: --trials -1 reported "-1/-1 SIGKILL trials intact", exit 0, and --dir naming a file was
    # os.makedirs' FileExistsError traceback (--trials 0 stays: the folder made, no trial)
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=at_least(0), default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--signal", default="SIGKILL", choices=["SIGKILL", "SIGTERM"])
    parser.add_argument("--tear", action="store_true",
                        help="tear trials instead: a writer killed inside a write, after its first page "
                             "(needs a C compiler; see scripts/tear_writes.c)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(f"record_kill_trials: error: {exc}", file=sys.stderr)
        return 2
    if args.child is not None:
        child_main(json.loads(args.child))
        return 0
    if args.dir is not None:  # a folder not made yet (tempfile's traceback otherwise)
        os.makedirs(args.dir, exist_ok=True)
    if args.tear:
        return _tear_main(args)
    failures = 0
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for seed in range(args.seed, args.seed + args.trials):
            try:
                report = kill_trial(directory, seed, signal.Signals[args.signal])
                print(json.dumps(report), flush=True)
            except Exception as err:  # noqa: BLE001 - report every kind of failure, go on
                failures += 1
                print(json.dumps({"seed": seed, "failed": f"{type(err).__name__}: {err}"}), flush=True)
    print(f"{args.trials - failures}/{args.trials} {args.signal} trials intact")
    return 1 if failures else 0


def _tear_main(args) -> int:
    failures = 0
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        library = build_tear_library(directory)
        if library is None:
            print("tear trials need a C compiler (cc) on Linux; none found", file=sys.stderr)
            return 2
        rng = random.Random(args.seed)
        for seed in range(args.seed, args.seed + args.trials):
            metadata_only = seed % 2 == 1
            tear_at = rng.randint(1, 100 if metadata_only else 600)
            try:
                print(json.dumps(tear_trial(directory, seed, tear_at, library, metadata_only)), flush=True)
            except Exception as err:  # noqa: BLE001 - report every kind of failure, go on
                failures += 1
                print(json.dumps({"seed": seed, "tear_at": tear_at, "failed": f"{type(err).__name__}: {err}"}), flush=True)
    print(f"{args.trials - failures}/{args.trials} tear trials intact")
    return 1 if failures else 0


if __name__ == "__main__":
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    sys.exit(main())
