"""kill -9 a running ``nasdiag search`` at random times, resume it, and check the record and the final
state against an uninterrupted run.

Each trial starts a search in a subprocess and SIGKILLs it after a random delay, uniform over the
length of a whole run (so kills land during imports, steps, record flushes, segment creation,
checkpoint writes and exit in proportion to their time); then ``--resume`` (or, if the first
process died before its record existed, a fresh start) runs, itself killed at random up to
``--kills-per-trial`` times, until one process finishes (or ``--resume`` answers that the run
already finished: the kill hit after the final checkpoint). The trial passes when

- the record equals the uninterrupted run's: the same paths, every step exactly once, every value
  bitwise equal (NaN where NaN);
- the final checkpoint's network, optimizer states and generator are bitwise equal to the
  uninterrupted run's (losses, α and weights, CPU, fixed seed);
- no temporary file (``*.tmp``) is left.

Usage: ``python scripts/kill_resume_trials.py --trials 20 --kills-per-trial 3`` (prints the counts).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_args import Parser, UsageError, at_least  # noqa: E402

from nasdiag.errors import run_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 3
SEARCH = ["--C", "4", "--layers", "3", "--steps", "2", "--batch-size", "240", "--diagnostics", "cost",
          "--threads", "1", "--no-progress", "--no-figs", "--device", "cpu"]  # bitwise only on the CPU (docs/methods.md)


def _command(out: Path, *extra: str, epochs: int = EPOCHS):
    return [sys.executable, "-m", "nasdiag", "search", "--epochs", str(epochs), *SEARCH, "--out", str(out), *extra]


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def reference(folder: Path, epochs: int = EPOCHS) -> tuple[Path, float]:
    """An uninterrupted run; returns its record and its wall time."""
    out = folder / "reference.h5"
    start = time.monotonic()
    proc = subprocess.run(_command(out, epochs=epochs), capture_output=True, text=True, env=_env(), cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"reference run failed:\n{proc.stderr}")
    return out, time.monotonic() - start


def _run_killed(cmd, delay: float) -> tuple[int, str]:
    """Run ``cmd``; SIGKILL it after ``delay`` seconds unless it ended. Returns (exit code, stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    try:
        _, err = proc.communicate(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
    return proc.returncode, err


def trial(folder: Path, duration: float, kills: int, rng: random.Random, epochs: int = EPOCHS) -> dict:
    """One trial: up to ``kills`` SIGKILLs at random times, resuming after each; returns what happened."""
    out = folder / "run.h5"
    killed, resumed = 0, 0
    code, err = _run_killed(_command(out, epochs=epochs), rng.uniform(0, duration) if kills else 600)
    killed += code == -signal.SIGKILL
    while code != 0:
        if code == 2 and "already finished" in err:
            break  # killed after its final checkpoint, while exiting: the run is complete
        if code != -signal.SIGKILL:
            raise RuntimeError(f"search failed with exit code {code}:\n{err}")
        extra = ("--resume",) if out.exists() else ()
        resumed += bool(extra)
        delay = rng.uniform(0, duration) if killed < kills else 600
        code, err = _run_killed(_command(out, *extra, epochs=epochs), delay)
        killed += code == -signal.SIGKILL
    return {"kills": killed, "resumes": resumed, "record": out}


def compare(record: Path, reference_record: Path) -> list[str]:
    """Differences between a resumed run and the uninterrupted one (empty: equal)."""
    from nasdiag.record import load

    problems = []
    a, b = load(record), load(reference_record)
    steps = a["step"]
    if len(np.unique(steps)) != len(steps):
        problems.append("a step is recorded twice")
    if set(a) != set(b):
        problems.append(f"paths differ: {sorted(set(a) ^ set(b))}")
    for key in sorted(set(a) & set(b) - {"meta/config"}):  # meta/config names the record path, which differs
        x, y = np.asarray(a[key]), np.asarray(b[key])
        same = x.shape == y.shape and (np.array_equal(x, y, equal_nan=True) if x.dtype.kind == "f" else np.array_equal(x, y))
        if not same:
            problems.append(f"{key} differs")
    sa = torch.load(str(record) + ".ckpt", weights_only=False)["method"]
    sb = torch.load(str(reference_record) + ".ckpt", weights_only=False)["method"]
    for name, t in sb["network"].items():
        if not torch.equal(sa["network"][name], t):
            problems.append(f"final {name} differs")
    if not torch.equal(sa["generator"], sb["generator"]):
        problems.append("final generator state differs")
    if repr(sa["objects"]) != repr(sb["objects"]):
        problems.append("final optimizer/scheduler state differs")
    stray = [p.name for p in record.parent.iterdir() if p.name.endswith(".tmp")]
    if stray:
        problems.append(f"stray files {stray}")
    return problems


def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])  # one line, exit 2 (--trials 0 reported "0 trials", exit 0)
    parser.add_argument("--trials", type=at_least(1), default=20)
    parser.add_argument("--kills-per-trial", type=at_least(1), default=3)
    parser.add_argument("--seed", type=at_least(0), default=0)
    parser.add_argument("--folder", default="/tmp/nasdiag-kill-trials")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    # the searches run in the repository's folder (cwd=ROOT): a relative --folder wrote their records there, and the
    # trials then looked for them here; a folder of an earlier run was the reference search's refusal as a traceback
    folder = Path(args.folder).resolve()
    earlier = [p.name for p in (folder / "ref", *(folder / f"trial{i:03d}" for i in range(args.trials))) if p.exists()]
    if earlier:
        raise UsageError(f"--folder {args.folder} holds {', '.join(earlier[:3])}{' ...' if len(earlier) > 3 else ''} of an "
                         f"earlier run, which the trials would write again; give another --folder, or remove it")
    folder.mkdir(parents=True, exist_ok=True)
    ref, duration = reference(folder / "ref")
    print(f"uninterrupted run: {duration:.1f} s")
    kills = resumes = failures = 0
    for i in range(args.trials):
        sub = folder / f"trial{i:03d}"
        sub.mkdir()
        result = trial(sub, duration, args.kills_per_trial, rng)
        problems = compare(result["record"], ref)
        kills, resumes = kills + result["kills"], resumes + result["resumes"]
        failures += bool(problems)
        print(f"trial {i}: {result['kills']} kills, {result['resumes']} resumes: {'; '.join(problems) or 'equal'}", flush=True)
    print(f"{args.trials} trials, {kills} kill points, {resumes} resumes, {failures} trials differing from the "
          f"uninterrupted run (torch {torch.__version__})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run_script("kill_resume_trials", main))
