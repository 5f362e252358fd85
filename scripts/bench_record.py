"""Overhead of recording: cost per step against a search step, and throughput.

    python scripts/bench_record.py            # full run, prints a table and a JSON line
    python scripts/bench_record.py --quick    # fewer rows, for a smoke check

Measures, with the default ``flush_every=64`` and SWMR on:

1. ``log`` of a CLI-like row (about 20 paths: method scalars, (E, K) arch/cost/hessian/regret
   arrays for both cell types) amortised over flushes, against one first-order DARTS step of a
   small supernet on CPU (a cheap step, so the ratio is pessimistic). Target <= 2 %.
2. Throughput of one-scalar rows (target >= 1e5 rows/s) and of 20-scalar rows (scalar values/s).
3. ``load`` of the records written.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nasdiag.errors import run_script  # noqa: E402
from nasdiag.record import Recorder, load  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_args import Parser, UsageError  # noqa: E402


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cli_row(step: int, edges: int, ops: int, rng) -> dict:
    row = {f"scalars/{name}": float(rng.random()) for name in ("train_loss", "train_acc", "val_loss", "val_acc", "w_lr", "alpha_grad_norm")}
    for cell in ("normal", "reduce"):
        row[f"arch/{cell}/params"] = rng.standard_normal((edges, ops)).astype(np.float32)
        row[f"arch/{cell}/weights"] = rng.random((edges, ops)).astype(np.float32)
        row[f"cost/{cell}/mean"] = rng.standard_normal((edges, ops)).astype(np.float32)
        row[f"cost/{cell}/var"] = rng.random((edges, ops)).astype(np.float32)
        row[f"cost/{cell}/count"] = np.int64(step)
        row[f"hessian/{cell}/diag"] = rng.random((edges, ops)).astype(np.float32)
        row[f"regret/{cell}/regret"] = np.float32(rng.random())
    return row


def time_log(path: str, rows: list[dict], flush_every: int = 64) -> float:
    """Seconds per ``log`` call (amortised over flushes, including close)."""
    start = time.perf_counter()
    with Recorder(path, flush_every=flush_every, overwrite=True, flush_seconds=None) as rec:
        for step, row in enumerate(rows):
            rec.log(step, row)
    return (time.perf_counter() - start) / len(rows)


def time_search_step(repeats: int) -> tuple[float, str]:
    """Median seconds of one first-order DARTS step of a small supernet (CPU)."""
    import torch

    from nasdiag.search import Schedule, get_method
    from nasdiag.supernet import Network

    torch.manual_seed(0)
    net = Network(C=8, num_classes=10, layers=3)
    method = get_method("darts")(net, schedule=Schedule(epochs=1, steps_per_epoch=repeats + 1))
    batch = 32
    x, y = torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,))
    method.step((x, y), (x, y))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        method.step((x, y), (x, y))
        times.append(time.perf_counter() - start)
    return statistics.median(times), f"DARTS 1st order, Network(C=8, layers=3), batch {batch}x3x16x16, torch {torch.__version__}"


def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", default=None, help="where to write the records (default: a temp folder)")
    args = parser.parse_args(argv)
    if args.dir is not None and not os.path.isdir(args.dir):  # tempfile's NotADirectoryError traceback
        raise UsageError(f"--dir {args.dir} is not a folder; give an existing folder for the records, or leave --dir out")
    n_scalar = 20_000 if args.quick else 200_000
    n_cli = 1_000 if args.quick else 10_000
    repeats = 3
    rng = np.random.default_rng(0)
    edges, ops = 14, 8
    results: dict = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        cli_rows = [_cli_row(s, edges, ops, rng) for s in range(n_cli)]
        per_row = min(time_log(os.path.join(tmp, "cli.h5"), cli_rows) for _ in range(repeats))
        results["cli_row_paths"] = len(cli_rows[0])
        results["cli_row_us"] = per_row * 1e6
        step_s, step_desc = time_search_step(repeats=5 if args.quick else 10)
        results["search_step_ms"] = step_s * 1e3
        results["search_step"] = step_desc
        results["overhead_percent"] = 100 * per_row / step_s
        results["break_even_step_ms"] = per_row / 0.02 * 1e3  # any longer search step meets the 2 % target

        one = [{"scalars/loss": float(i)} for i in range(n_scalar)]
        per_one = min(time_log(os.path.join(tmp, "one.h5"), one) for _ in range(repeats))
        results["scalar_rows_per_s"] = 1 / per_one

        names = [f"scalars/s{j}" for j in range(20)]
        wide = [{name: float(i + j) for j, name in enumerate(names)} for i in range(n_scalar // 10)]
        per_wide = min(time_log(os.path.join(tmp, "wide.h5"), wide) for _ in range(repeats))
        results["wide_rows_per_s"] = 1 / per_wide
        results["wide_scalar_values_per_s"] = 20 / per_wide

        start = time.perf_counter()
        out = load(os.path.join(tmp, "one.h5"))
        results["load_one_scalar_rows_per_s"] = out["step"].size / (time.perf_counter() - start)
        start = time.perf_counter()
        out = load(os.path.join(tmp, "cli.h5"))
        results["load_cli_rows_per_s"] = out["step"].size / (time.perf_counter() - start)

    import h5py

    results.update(
        cpu=_cpu_model(), torch_version=__import__("torch").__version__, h5py_version=h5py.__version__,
        hdf5_version=h5py.version.hdf5_version, rows_one_scalar=n_scalar, rows_cli=n_cli, flush_every=64,
    )
    print(f"CPU: {results['cpu']}; torch {results['torch_version']}, h5py {results['h5py_version']} (HDF5 {results['hdf5_version']})")
    print(f"CLI-like row ({results['cli_row_paths']} paths, E={edges}, K={ops}): {results['cli_row_us']:.1f} us/step")
    print(f"search step ({results['search_step']}): {results['search_step_ms']:.1f} ms")
    print(f"recording overhead: {results['overhead_percent']:.3f} % of a search step (target <= 2 %); "
          f"met by any step longer than {results['break_even_step_ms']:.1f} ms")
    print(f"one-scalar rows: {results['scalar_rows_per_s']:.3g} rows/s (target >= 1e5)")
    print(f"20-scalar rows: {results['wide_rows_per_s']:.3g} rows/s = {results['wide_scalar_values_per_s']:.3g} scalar values/s")
    print(f"load: {results['load_one_scalar_rows_per_s']:.3g} one-scalar rows/s, {results['load_cli_rows_per_s']:.3g} CLI rows/s")
    print(json.dumps(results))
    ok = results["overhead_percent"] <= 2 and results["scalar_rows_per_s"] >= 1e5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_script("bench_record", main))
