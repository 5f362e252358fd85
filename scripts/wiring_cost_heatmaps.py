#!/usr/bin/env python
"""Wiring supplement Figs 5, 6 (and the minimal cell of Fig. 7): cost mean per op × edge at
initialization and near θ's convergence.

Protocol (supplement §3): α fixed; θ trained with child networks sampled uniformly (DSNAS, default) or
on the supernet at uniform α (DARTS, ``--protocol darts``); the cost statistics E[C], C = ∂L/∂Z, are
collected before training (θ at initialization, ``--observe-batches`` batches) and over the last epoch
of training ("near θ's convergence"). Configurations (``--configs``):

- ``minimal1``: one minimal cell (Fig. 7: 2 intermediate nodes, 5 edges; edge 2->3 intermediate);
- ``minimal8``: 8 stacked minimal cells, DARTS's two reduction cells (Fig. 5);
- ``darts8``:   8 stacked DARTS cells, 14 edges each (Fig. 6).

Each configuration writes ``<out>/<config>/record.h5``; the heatmaps are drawn from it by nasdiag's
figure registry (``cost_<cell>_heatmap_init`` and ``_final``), so ``--plot-only`` redraws them.

What differs from the paper: digits (8×8 grey images; θ trains on the 719 of search-train, of the 1438 search
images) instead of CIFAR-10, C = 8 channels, 5 epochs of θ training (55 steps of 64) instead of 150 epochs; the
same code runs CIFAR-10 from a local folder (``--dataset cifar10 --data-dir DIR``, a 5000-image subset). The
paper's cell-wise statistics are pooled over the cells of a type (normal, reduce). Timing: BENCHMARKS.md
(``--configs minimal1`` alone is the quick one; ``darts8`` the slowest).

    python scripts/wiring_cost_heatmaps.py --out runs/wiring_cost
    python scripts/wiring_cost_heatmaps.py --out runs/wiring_cost --plot-only
"""

from __future__ import annotations

import os
import sys

import wiring_common as W
from nasdiag.errors import run_script
from script_args import (
    Parser, UsageError, at_least, channels, seed as seed_number,
)

EXPERIMENT = "wiring cost heatmaps"  # meta config's experiment: the wiring scripts share their method
CONFIGS = {"minimal1": ("minimal", 1), "minimal8": ("minimal", 8), "darts8": ("darts", 8)}


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0], plot_options=('out', 'configs', 'format'))  # the rest: refused with --plot-only
    parser.add_argument("--out", default="runs/wiring_cost")
    parser.add_argument("--configs", default="minimal1,minimal8,darts8", help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--protocol", default="dsnas", choices=W.PROTOCOLS)
    parser.add_argument("--epochs", type=at_least(1), default=5)
    parser.add_argument("--C", type=channels, default=8)
    parser.add_argument("--batch-size", type=at_least(1), default=64)
    parser.add_argument("--observe-batches", type=at_least(1), default=8, help="batches of the statistics at initialization")
    parser.add_argument("--dataset", default="digits", choices=("digits", "cifar10"))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--seed", type=seed_number(), default=0)
    parser.add_argument("--format", default="png", choices=("png", "pdf", "svg"))
    parser.add_argument("--plot-only", action="store_true", help="redraw the figures from existing records")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    configs = W.chosen_runs(args.configs, "--configs", "configuration", CONFIGS, "minimal1,darts8", args.out,
                            args.format, args.plot_only, EXPERIMENT)
    splits = None if args.plot_only else W.load_splits(args.dataset, args.data_dir, args.seed, args.batch_size,
                                                                   args.observe_batches)
    for name in configs:
        folder = os.path.join(args.out, name)
        record = os.path.join(folder, "record.h5")
        if not args.plot_only:
            cell, layers = CONFIGS[name]
            net = W.make_network(cell, layers, splits.num_classes, splits.in_channels, C=args.C,
                                 reductions=() if layers == 1 else None, seed=args.seed)
            os.makedirs(folder, exist_ok=True)  # after the supernet: one too large for memory left an empty folder
            config = {"experiment": EXPERIMENT, "configuration": name, "cell": cell, "layers": layers,
                      "protocol": args.protocol, "epochs": args.epochs, "C": args.C, "dataset": args.dataset,
                      "batch_size": args.batch_size, "seed": args.seed, "steps": net.steps, "multiplier": net.multiplier}
            seconds = W.train_fixed(net, splits, record, config, args.epochs, args.batch_size, args.observe_batches,
                                    seed=args.seed)
            print(f"{name}: {record} ({seconds:.0f} s)")
        elif not os.path.exists(record):
            raise UsageError(f"no record at {record}; run without --plot-only first")
        for path in W.draw_cost_heatmaps(record, folder, args.format):
            print(path)


if __name__ == "__main__":
    sys.exit(run_script("wiring_cost_heatmaps", main))
