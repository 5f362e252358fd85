"""Step time of the search methods on one supernet (DSNAS computes only the sampled op of each edge).

A step is ``method.step(train_batch, val_batch)`` on random data of the digits shape. Methods alternate
step by step (after one warm-up step each), so that drift of a shared machine hits them all; medians and
minima (the least disturbed step) are reported with the ratio to DARTS, the machine, sizes, torch
version and date.

    python scripts/bench_methods.py --C 8 --layers 3 --steps 4 --batch 64 --size 8 --repeats 20
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

import torch

from nasdiag.errors import run_script
from nasdiag.search import Schedule, available_methods, get_method
from nasdiag.supernet import Network

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_args import Parser, at_least, channels, names as known_names, supernet, threads as thread_count  # noqa: E402


def main(argv=None) -> None:
    from bench_cost import machine

    ap = Parser(description=__doc__.splitlines()[0])  # one line, exit 2 for a bad value (tracebacks before)
    ap.add_argument("--methods", type=known_names(sorted(available_methods()), "method"), default="darts,dsnas,snas,proxyless")
    ap.add_argument("--C", type=channels, default=8)
    ap.add_argument("--layers", type=at_least(1), default=3)
    ap.add_argument("--steps", type=at_least(1), default=4, help="intermediate nodes per cell")
    ap.add_argument("--batch", type=at_least(1), default=64)
    ap.add_argument("--size", type=at_least(1), default=8, help="input height = width")
    ap.add_argument("--channels", type=at_least(1), default=1)
    ap.add_argument("--repeats", type=at_least(1), default=20)
    ap.add_argument("--threads", type=thread_count(), default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    g = torch.Generator().manual_seed(0)

    def batch():
        return (torch.randn(args.batch, args.channels, args.size, args.size, generator=g),
                torch.randint(0, 10, (args.batch,), generator=g))

    methods = {}
    for name in names:
        torch.manual_seed(0)  # the same supernet for every method
        net = supernet(lambda: Network(args.C, 10, args.layers, steps=args.steps, multiplier=args.steps,  # 4 by default:
                                       in_channels=args.channels))  # --steps 1-3 was the cell's ValueError traceback
        methods[name] = get_method(name)(net, schedule=Schedule(epochs=1, steps_per_epoch=args.repeats + 1))
    times = {name: [] for name in names}
    for rep in range(args.repeats + 1):
        train, val = batch(), batch()
        for name, m in methods.items():
            t0 = time.perf_counter()
            m.step(train, val)
            if rep:  # the first step of each method warms up
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[names[0]])
    print(f"# {machine(torch.device('cpu'))}; torch {torch.__version__}; {datetime.date.today()}")
    print(f"# Network(C={args.C}, layers={args.layers}, steps={args.steps}), batch {args.batch} x "
          f"{args.channels}x{args.size}x{args.size}, {args.repeats} steps each (interleaved)")
    print(f"| method | median step (ms) | min step (ms) | median / {names[0]} |")
    print("| --- | --- | --- | --- |")
    for name in names:
        med, low = statistics.median(times[name]), min(times[name])
        print(f"| {name} | {1e3 * med:.1f} | {1e3 * low:.1f} | {med / base:.2f} |")


if __name__ == "__main__":
    sys.exit(run_script("bench_methods", main))
