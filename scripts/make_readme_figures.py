#!/usr/bin/env python
"""Regenerate the small figures the README shows (``docs/img/*.png``), one of each kind.

Runs the main job (DARTS on digits through ``nasdiag.search.run``, with its digits preset) for two
seeds with short searches, then draws from the records, with nasdiag's figure registry, the figures a
user gets from ``nasdiag plot``: scalars, the architecture heatmap and its evolution, the cost and
Hessian heatmaps, the derived genotype, the most probable wiring per epoch, and the comparison of the
two runs on one colour scale (copied from ``<runs>/compare``, where the comparisons are drawn). ``--plot-only``
redraws from the records. Two 2-epoch main jobs: about
1 minute on 2 idle CPU cores.

    python scripts/make_readme_figures.py
"""

from __future__ import annotations

import os
import sys
import time
from nasdiag.errors import run_script
from script_args import (
    Parser, UsageError, at_least, dpi, refuse_other_figures, refuse_other_records, threads as thread_count, write_file,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

#: README image -> (registered figure, cell type or None)
FIGURES = {
    "scalars": ("scalars", None),
    "arch_heatmap": ("arch", "normal"),
    "arch_evolution": ("arch_evolution", "normal"),
    "cost_heatmap": ("cost", "normal"),
    "hessian_heatmap": ("hessian", "normal"),
    "genotype": ("genotype", "normal"),
    "wiring": ("wiring", "normal"),
}

#: the README image of the two runs' cost heatmaps side by side
COMPARED = "compare_cost_heatmap"


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0], plot_options=('out', 'runs', 'dpi'))  # the rest: refused with --plot-only
    parser.add_argument("--out", default="docs/img", help="folder of the README's images")
    parser.add_argument("--runs", default="runs/readme", help="folder of the records")
    parser.add_argument("--epochs", type=at_least(1), default=2)
    parser.add_argument("--dpi", type=dpi, default=70, help="small PNGs: the README shows them at their size")
    parser.add_argument("--threads", type=thread_count(), default=None, help="torch threads of the searches (default: the run's)")
    parser.add_argument("--engine", default="auto", choices=("auto", "fast", "eager"), help="supernet engine")
    parser.add_argument("--plot-only", action="store_true")
    return parser.parse_args(argv)


def main(argv=None):
    from nasdiag.plot.registry import NothingToDraw, family_nonfinite, iter_figures, nonfinite_summary, save, write_comparison
    from nasdiag.plot.style import paper_style
    from nasdiag.record import load

    args = parse_args(argv)
    records = {f"seed {s}": os.path.join(args.runs, f"darts_seed{s}.h5") for s in (0, 1)}
    missing = [path for path in records.values() if args.plot_only and not os.path.exists(path)]
    if missing:  # before the folder is made: the refusal left an empty --out folder
        raise UsageError(f"no record at {missing[0]}; run without --plot-only first")
    refuse_other_records(records.values(), "darts", "--runs", plot_only=args.plot_only)
    # the user's own docs/img/scalars.png (or a comparison of theirs in <runs>/compare) was replaced without a word
    refuse_other_figures(args.out, [*FIGURES, COMPARED], "png")
    refuse_other_figures(os.path.join(args.runs, "compare"), None, "png", "--runs")
    if not args.plot_only:
        from nasdiag.search import SearchConfig
        from nasdiag.search.runner import check_paths

        configs = [SearchConfig(method="darts", dataset="digits", epochs=args.epochs, seed=seed, record=path, force=True,
                                progress=False, threads=args.threads, engine=args.engine)
                   for seed, path in enumerate(records.values())]
        for config in configs:  # both records before the first search: seed 1's was refused after seed 0's had run
            check_paths(config)
    os.makedirs(args.out, exist_ok=True)  # before the runs: an unwritable folder fails at once, not after them
    if not args.plot_only:
        from nasdiag.search import run

        os.makedirs(args.runs, exist_ok=True)
        for config, (label, path) in zip(configs, records.items()):
            start = time.perf_counter()
            run(config)
            print(f"{label}: {path} ({time.perf_counter() - start:.0f} s)")
    loaded = {label: load(path) for label, path in records.items()}
    first = loaded["seed 0"]
    wanted = {value: key for key, value in FIGURES.items()}
    tried = {}
    for spec, cell, _, thunk in iter_figures(first, [name for name, _ in FIGURES.values()]):
        image = wanted.get((spec.name, cell))
        if image is None:
            continue
        tried[spec.name] = spec
        try:
            with paper_style():
                fig = thunk()
        except NothingToDraw as exc:
            print(f"skipped {image}: {exc}", file=sys.stderr)  # stdout lists the images written, as the other scripts
            continue
        path = os.path.join(args.out, f"{image}.png")
        save(fig, path, args.dpi)
        print(path)
    found = family_nonfinite(first, list(tried.values()))
    if found:  # drawn grey (marked in the figures) without a word, where nasdiag plot of the record counts them
        print(f"{records['seed 0']}: {nonfinite_summary(found)} in the drawn families, marked in the figures",
              file=sys.stderr)
    compared = write_comparison(loaded, os.path.join(args.runs, "compare"), figures=["cost"], dpi=args.dpi)
    for line in compared.skipped:  # no compare_cost_heatmap.png (a run without costs) was not said
        print(f"skipped compare: {line}", file=sys.stderr)
    for path in compared.files:
        if "normal" in path.name:
            target = os.path.join(args.out, f"{COMPARED}.png")
            # copied (the comparisons stay together in <runs>/compare), not moved: os.replace from --runs was "Invalid
            # cross-device link" where --out lies on another file system, after the searches, and replaced a link of
            # that name in --out (docs/img/compare_cost_heatmap.png -> ...) by the figure, the link lost
            write_file(target, path.read_bytes(), "figure")
            print(target)


if __name__ == "__main__":
    sys.exit(run_script("make_readme_figures", main))
