"""Step time of the search methods on one supernet (DSNAS computes only the sampled op of each edge).

A step is ``method.step(train_batch, val_batch)`` on random data of the digits shape. Methods alternate
step by step (after one warm-up step each), so that drift of a shared machine hits them all; medians and
minima (the least disturbed step) are reported with the ratio to DARTS, the machine, sizes, torch
version and date.

    python scripts/bench_methods.py --C 8 --layers 3 --steps 4 --batch 64 --size 8 --repeats 20
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network


def main() -> None:
    from bench_cost import machine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="darts,dsnas,snas,proxyless")
    ap.add_argument("--C", type=int, default=8)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="intermediate nodes per cell")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=8, help="input height = width")
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = args.methods.split(",")
    g = torch.Generator().manual_seed(0)

    def batch():
        return (torch.randn(args.batch, args.channels, args.size, args.size, generator=g),
                torch.randint(0, 10, (args.batch,), generator=g))

    methods = {}
    for name in names:
        torch.manual_seed(0)  # the same supernet for every method
        net = Network(args.C, 10, args.layers, steps=args.steps, in_channels=args.channels)
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
    main()
