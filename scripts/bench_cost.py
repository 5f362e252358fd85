"""Step-time overhead of the cost probe on the reference supernet (issue 3 §6, target <= 1.10x).

A step is zero_grad + forward + mean cross-entropy + backward. Plain and probed steps alternate, so that
drift of a shared machine hits both; the ratios of medians and of minima (the least disturbed step) are
reported, with the machine, sizes, torch version and date. Optional rows: path split and normalization-deviation tracking.

    python scripts/bench_cost.py --device cpu --C 8 --layers 5 --batch 16 --size 16
    python scripts/bench_cost.py --device cuda --C 16 --layers 8 --batch 64 --size 32
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import nasdiag
from nasdiag.errors import run_script
from nasdiag.supernet import Network

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_args import Parser, at_least, channels, device as device_name, supernet, threads as thread_count  # noqa: E402


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU {cpu}, {torch.get_num_threads()} threads"


def main(argv=None) -> None:
    ap = Parser(description=__doc__.splitlines()[0])  # one line, exit 2 for a bad value (tracebacks before)
    ap.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--C", type=channels, default=8)
    ap.add_argument("--layers", type=at_least(1), default=5)
    ap.add_argument("--steps-per-cell", type=at_least(1), default=4, dest="cell_steps")
    ap.add_argument("--batch", type=at_least(1), default=16)
    ap.add_argument("--size", type=at_least(1), default=16, help="input height = width")
    ap.add_argument("--iters", type=at_least(1), default=20)
    ap.add_argument("--warmup", type=at_least(0), default=3)
    ap.add_argument("--threads", type=thread_count(0), default=0, help="torch CPU threads (0: leave as is)")
    ap.add_argument("--extras", action="store_true", help="also time path_split=True and norm_deviation=True")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    torch.manual_seed(0)
    net = supernet(lambda: Network(args.C, 10, args.layers, steps=args.cell_steps, multiplier=args.cell_steps),
                   device).to(device)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def plain():
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()

    def probed(probe):
        def step():
            net.zero_grad(set_to_none=True)
            with probe.record():
                F.cross_entropy(net(x), y).backward()
        return step

    variants = {"probe": probed(nasdiag.attach(net))}
    if args.extras:
        variants["probe+path_split"] = probed(nasdiag.attach(net, path_split=True))
        variants["probe+norm_deviation"] = probed(nasdiag.attach(net, norm_deviation=True))
    times = {"plain": [], **{k: [] for k in variants}}
    for i in range(args.warmup + args.iters):
        for name, fn in [("plain", plain), *variants.items()]:
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)

    n_edges = len(net.edge_specs())
    print(f"# bench_cost  {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {machine(device)}; torch {torch.__version__}")
    print(f"supernet: Network(C={args.C}, layers={args.layers}, steps={args.cell_steps}), {n_edges} edges x "
          f"{len(net.primitives)} ops; batch {args.batch} x 3 x {args.size} x {args.size}, float32; "
          f"{args.iters} timed steps after {args.warmup} warm-up, alternating")
    base, base_min = statistics.median(times["plain"]), min(times["plain"])
    print(f"{'variant':<22} {'median (ms)':>12} {'ratio':>7} {'min (ms)':>10} {'ratio':>7}")
    for name in ["plain", *variants]:
        med, low = statistics.median(times[name]), min(times[name])
        print(f"{name:<22} {1e3 * med:12.2f} {med / base:7.3f} {1e3 * low:10.2f} {low / base_min:7.3f}")


if __name__ == "__main__":
    sys.exit(run_script("bench_cost", main))
