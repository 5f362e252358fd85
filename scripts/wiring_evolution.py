#!/usr/bin/env python
"""Wiring supplement Figs 1-4: the evolution of p_α on every edge and of the most probable wiring, for
DSNAS (single-level, Figs 1, 2) and DARTS (bi-level, Figs 3, 4).

Each method runs a search through ``nasdiag.search.run`` (the same run as ``nasdiag search``),
recording ``arch/<cell>/probabilities`` at every step and the cost statistics every epoch. The
figures are drawn from the records by nasdiag's figure registry (``--plot-only`` redraws them):

- ``<method>/arch_<cell>_evolution``: p_α of every op on every edge over the steps, with 1/K (Figs 2, 4);
- ``<method>/wiring_<cell>``: after every epoch, the wiring of largest probability, on each edge the op
  with the highest p_α and the edge dropped where that op is ``none`` (Figs 1, 3);
- ``<method>/genotype_<cell>``: the derived genotype at the end.

What differs from the paper: digits instead of CIFAR-10, a 3-cell supernet with C = 8 (the main job's)
and 8 epochs instead of 150 (DSNAS) or 50 (DARTS); the methods run with their digits preset (a larger
α learning rate, see ``nasdiag methods``) so that p_α moves within 8 epochs. CIFAR-10 from a local
folder with ``--dataset cifar10 --data-dir DIR`` (then the paper's defaults). Timing: BENCHMARKS.md
(about two main jobs).

    python scripts/wiring_evolution.py --out runs/wiring_evolution
"""

from __future__ import annotations

import os
import sys
import time

import wiring_common as W
from nasdiag.errors import run_script
from script_args import (
    Parser, UsageError, at_least, channels, refuse_other_figures,
    refuse_other_records, refuse_repeats, seed as seed_number,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

FIGURES = ["arch_evolution", "wiring", "genotype"]


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0], plot_options=('out', 'methods', 'format'))  # the rest: refused with --plot-only
    parser.add_argument("--out", default="runs/wiring_evolution")
    parser.add_argument("--methods", default="dsnas,darts", help="comma-separated registered methods")
    parser.add_argument("--epochs", type=at_least(1), default=8)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--C", type=channels, default=8)
    parser.add_argument("--dataset", default="digits", choices=("digits", "cifar10"))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--seed", type=seed_number(), default=0)
    parser.add_argument("--format", default="png", choices=("png", "pdf", "svg"))
    parser.add_argument("--plot-only", action="store_true")
    return parser.parse_args(argv)


def search_config(args, method: str):
    """The search of ``method`` whose record is ``<out>/<method>/record.h5``."""
    from nasdiag.search import SearchConfig

    return SearchConfig(method=method, dataset=args.dataset, data_dir=args.data_dir, epochs=args.epochs,
                        layers=args.layers, C=args.C, seed=args.seed, diagnostics=("cost",),
                        record=os.path.join(args.out, method, "record.h5"), force=True, progress=False)


def main(argv=None):
    args = parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise UsageError(f"--methods {args.methods!r} names no method; give registered methods, e.g. dsnas,darts")
    from nasdiag.search.config import did_you_mean
    from nasdiag.search.registry import available_methods

    unknown = [m for m in methods if m not in available_methods()]  # before the first run, not after it
    if unknown:
        raise UsageError(f"unknown method(s) {', '.join(unknown)};{did_you_mean(unknown[0], available_methods()) or ''} "
                         f"choose from {', '.join(sorted(available_methods()))}")
    refuse_repeats(methods, "--methods")
    for method in methods:  # the figures' folders, also for --plot-only; each record of its own method
        refuse_other_figures(os.path.join(args.out, method), None, args.format)
        refuse_other_records([os.path.join(args.out, method, "record.h5")], method, plot_only=args.plot_only)
    if args.plot_only:  # every record there and holding p_α, before the first method's figures
        W.refuse_records_without([os.path.join(args.out, method, "record.h5") for method in methods], FIGURES)
    if not args.plot_only:  # the run options refused before the first folder is made (--C 3 left an empty one)
        from nasdiag.search import SearchConfig

        SearchConfig(dataset=args.dataset, data_dir=args.data_dir, epochs=args.epochs, layers=args.layers, C=args.C,
                     seed=args.seed).validate()
        from nasdiag.search.runner import check_paths

        for method in methods:  # every record before the first search: a later one was refused after the first ran
            check_paths(search_config(args, method))
    for method in methods:
        folder = os.path.join(args.out, method)
        record = os.path.join(folder, "record.h5")
        if not args.plot_only:
            from nasdiag.search import run

            os.makedirs(folder, exist_ok=True)
            start = time.perf_counter()
            run(search_config(args, method))
            print(f"{method}: {record} ({time.perf_counter() - start:.0f} s)")
        elif not os.path.exists(record):
            raise UsageError(f"no record at {record}; run without --plot-only first")
        for path in W.draw_figures(record, folder, args.format, FIGURES):
            print(path)


if __name__ == "__main__":
    sys.exit(run_script("wiring_evolution", main))
