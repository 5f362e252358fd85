#!/usr/bin/env python
"""Wiring supplement §8, Figs 19-21: the cost-mean heatmaps of the minimal cell with other normalizations
and other op stacking orders, at initialization and near θ's convergence.

Variants (``--variants``), each one minimal cell (Fig. 7) under the fixed-α protocol of
``wiring_cost_heatmaps.py`` (α uniform, θ trained on uniformly sampled children, DSNAS):

- ``layer``:        LayerNorm in every op (§8.1: the cost passed through it is still nullified, Thm 1);
- ``instance``:     affine-free InstanceNorm (§8.1, Fig. 19: every cost mean is exactly 0 (eq 16), before
                    and after training, up to float rounding);
- ``conv-relu-bn``: Conv-ReLU-BN order (§8.2, Fig. 20);
- ``conv-bn-relu``: Conv-BN-ReLU order (§8.2, Fig. 21);
- ``batch``:        the reference, ReLU-Conv-BN with BatchNorm (Figs 5-7).

Each variant writes ``<out>/<variant>/record.h5`` and its heatmaps ``cost_normal_heatmap_{init,final}``
drawn from it by nasdiag's figure registry (``--plot-only`` redraws them).

What differs from the paper: digits instead of CIFAR-10, C = 8, 5 epochs of θ training; CIFAR-10 from
a local folder with ``--dataset cifar10 --data-dir DIR``. Timing: BENCHMARKS.md.

    python scripts/wiring_variants.py --out runs/wiring_variants
"""

from __future__ import annotations

import os
import sys

import wiring_common as W
from nasdiag.errors import run_script
from script_args import (
    Parser, UsageError, at_least, channels, seed as seed_number,
)

EXPERIMENT = "wiring §8 variants"  # meta config's experiment: the wiring scripts share their method
VARIANTS = {
    "batch": dict(norm="batch", order="relu-conv-bn"),
    "layer": dict(norm="layer", order="relu-conv-bn"),
    "instance": dict(norm="instance", order="relu-conv-bn", affine=False),
    "conv-relu-bn": dict(norm="batch", order="conv-relu-bn"),
    "conv-bn-relu": dict(norm="batch", order="conv-bn-relu"),
}


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0], plot_options=('out', 'variants', 'format'))  # the rest: refused with --plot-only
    parser.add_argument("--out", default="runs/wiring_variants")
    parser.add_argument("--variants", default="layer,instance,conv-relu-bn,conv-bn-relu",
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--protocol", default="dsnas", choices=W.PROTOCOLS)
    parser.add_argument("--epochs", type=at_least(1), default=5)
    parser.add_argument("--C", type=channels, default=8)
    parser.add_argument("--batch-size", type=at_least(1), default=64)
    parser.add_argument("--observe-batches", type=at_least(1), default=8)
    parser.add_argument("--dataset", default="digits", choices=("digits", "cifar10"))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--seed", type=seed_number(), default=0)
    parser.add_argument("--format", default="png", choices=("png", "pdf", "svg"))
    parser.add_argument("--plot-only", action="store_true")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    variants = W.chosen_runs(args.variants, "--variants", "variant", VARIANTS, "layer,instance", args.out,
                             args.format, args.plot_only, EXPERIMENT)
    splits = None if args.plot_only else W.load_splits(args.dataset, args.data_dir, args.seed, args.batch_size,
                                                                   args.observe_batches)
    for name in variants:
        folder = os.path.join(args.out, name)
        record = os.path.join(folder, "record.h5")
        if not args.plot_only:
            net = W.make_network("minimal", 1, splits.num_classes, splits.in_channels, C=args.C, reductions=(),
                                 seed=args.seed, **VARIANTS[name])
            os.makedirs(folder, exist_ok=True)  # after the supernet: one too large for memory left an empty folder
            config = {"experiment": EXPERIMENT, "variant": name, **VARIANTS[name], "protocol": args.protocol,
                      "epochs": args.epochs, "C": args.C, "dataset": args.dataset, "batch_size": args.batch_size,
                      "seed": args.seed, "steps": net.steps, "multiplier": net.multiplier}
            seconds = W.train_fixed(net, splits, record, config, args.epochs, args.batch_size, args.observe_batches,
                                    seed=args.seed)
            print(f"{name}: {record} ({seconds:.0f} s)")
        elif not os.path.exists(record):
            raise UsageError(f"no record at {record}; run without --plot-only first")
        for path in W.draw_cost_heatmaps(record, folder, args.format):
            print(path)


if __name__ == "__main__":
    sys.exit(run_script("wiring_variants", main))
