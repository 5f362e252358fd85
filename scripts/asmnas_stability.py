#!/usr/bin/env python
"""ASM-NAS §5.3.1 / Fig. 3 (performance stability), ASM-NAS vs DARTS on digits, over several seeds.

Each (method, seed) is one ``nasdiag.search.run`` on the embedded digits (its record ``<method>_seed<s>.h5``
in ``--out``). On the trained supernet, with the search-val split:

- the **selected op** per edge and cell type (ASM-NAS: most per-sample attention argmaxes, Algorithm 1;
  DARTS: argmax softmax(α)), and how many seeds agree with the most frequent choice per edge;
- the **supernet accuracy** (ASM-NAS: attention mixing; DARTS: softmax(α)) and the **discretised accuracy**
  (every edge replaced by its selected op, no retraining);
- the paper's §5.3.1 protocol: replace the mixed op of **one** edge by its selected op, keep the rest, and
  measure the accuracy change; the paper's Fig. 3 plots it per edge index (a smaller change = more stable).

Results go to ``summary.json`` in ``--out``; the figure ``stability.png`` is drawn from it, so
``--plot-only`` redraws it from an old run. What differs from the paper: digits (8×8) and a small supernet
(``--C``, ``--layers``, ``--steps``; 2 epochs) rather than CIFAR-10 with 15 cells and 30 epochs; one normal
and one reduction cell per method (nasdiag shares cells of a type) rather than per-cell selection; several
seeds (the paper reports one run) to show the spread of genotypes and accuracies.

    python scripts/asmnas_stability.py --out runs/asmnas_stability
    python scripts/asmnas_stability.py --out runs/asmnas_stability --plot-only

Defaults: 3 min 19 s wall with ``--threads 1`` on the shared 2-core box at load ≈ 8 (62 CPU-s; BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import Counter
from nasdiag.errors import NasdiagError, run_script
from script_args import (Parser, at_least, channels, refuse_other_figures, refuse_other_records, threads as thread_count,
                         torch_threads, write_table)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

METHODS = {"asmnas": "ASM-NAS", "darts": "DARTS"}


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0], plot_options=('out',))  # the rest: refused with --plot-only
    parser.add_argument("--out", default="runs/asmnas_stability", help="output folder (records, summary.json, stability.png)")
    parser.add_argument("--seeds", type=at_least(1), default=3, help="seeds 0..N-1 per method")
    parser.add_argument("--epochs", type=at_least(1), default=2)
    parser.add_argument("--C", type=channels, default=4)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="intermediate nodes per cell (2: 5 edges)")
    parser.add_argument("--batch-size", type=at_least(1), default=64)
    parser.add_argument("--threads", type=thread_count(), default=None)
    parser.add_argument("--plot-only", action="store_true", help="redraw the figure from summary.json")
    return parser.parse_args(argv)


def _accuracy(net, weights, loader):
    import torch

    p = next(net.parameters())
    # rows without an attention edge become (E, K) tensors: the form every engine of Network.forward takes
    weights = [torch.stack(row) if all(w is not None for w in row) else row for row in weights]
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            logits = net(x.to(p.device, p.dtype), weights)
            correct += int((logits.argmax(1) == y.to(p.device)).sum())
            total += len(y)
    return correct / total


def study_one(method, loader):
    """Selected ops, supernet / discretised accuracy and the one-edge replacement accuracies of a trained method."""
    import torch

    from nasdiag.supernet.attention import attention_weights

    net = method.network
    probs = method.probabilities()
    selected = {t: p.argmax(-1) for t, p in probs.items()}
    K = len(net.primitives)
    attention = method.name == "asmnas"

    def mixing():  # the trained supernet's own mixing, per cell (lists of per-edge weights)
        if attention:
            return attention_weights(net)
        soft = {t: torch.softmax(a.detach(), -1) for t, a in net.alphas().items()}
        return [list(soft[c.cell_type].unbind(0)) for c in net.cells]

    def one_hot(t, e):
        p = next(net.parameters())
        return torch.nn.functional.one_hot(selected[t][e], K).to(p.device, p.dtype)

    base = _accuracy(net, mixing(), loader)
    discrete = _accuracy(net, [[one_hot(c.cell_type, e) for e in range(net.num_edges)] for c in net.cells], loader)
    replaced = {}
    for t in net.cell_types:
        accs = []
        for e in range(net.num_edges):
            w = mixing()
            for k, c in enumerate(net.cells):
                if c.cell_type == t:
                    w[k][e] = one_hot(t, e)
            accs.append(_accuracy(net, w, loader))
        replaced[t] = accs
    return {"selected": {t: [net.primitives[i] for i in s.tolist()] for t, s in selected.items()},
            "supernet_acc": base, "discrete_acc": discrete, "replaced_acc": replaced,
            "genotype": str(method.genotype())}


def run_study(args):
    """The searches and their study, with torch at ``--threads`` for them only (`script_args.torch_threads`)."""
    with torch_threads(args.threads):
        return _run_study(args)


def _run_study(args):
    import torch
    from torch.utils.data import DataLoader

    from nasdiag.data import load_dataset
    from nasdiag.search import SearchConfig, run
    from nasdiag.search.runner import check_paths

    # the supernet options refused before the folder is made (--C 3 left an empty --out folder)
    SearchConfig(C=args.C, layers=args.layers, steps=args.steps, batch_size=args.batch_size).validate()
    configs = {(name, seed): SearchConfig(method=name, dataset="digits", seed=seed, epochs=args.epochs, C=args.C,
                                          layers=args.layers, steps=args.steps, batch_size=args.batch_size,
                                          diagnostics=(), progress=False, force=True, threads=args.threads,
                                          record=os.path.join(args.out, f"{name}_seed{seed}.h5"))
               for name in METHODS for seed in range(args.seeds)}
    # every record path before the first search, not at its own run: darts_seed0.h5 a file of the user's (or one of
    # another method, which --force would replace) was refused after the ASM-NAS searches, their records left behind
    for (name, _), config in configs.items():
        refuse_other_records([config.record], name)
        check_paths(config)
    made, folder = [], os.path.abspath(args.out)
    while not os.path.exists(folder):  # the folders makedirs makes, deepest first
        made.append(folder)
        folder = os.path.dirname(folder)
    os.makedirs(args.out, exist_ok=True)
    runs = []
    started = time.perf_counter()
    for name in METHODS:
        for seed in range(args.seeds):
            tic = time.perf_counter()
            config = configs[name, seed]
            record = config.record
            try:
                result = run(config)
            except BaseException:
                # a run refused before it wrote anything (--batch-size past the digits split: known only to run) left
                # the empty --out folder, and its parents, behind; only empty folders this call made are removed
                for path in made:
                    with contextlib.suppress(OSError):
                        os.rmdir(path)
                raise
            val = load_dataset("digits", seed=seed).val
            out = study_one(result.method, DataLoader(val, batch_size=512))
            out.update(method=name, seed=seed, record=record, seconds=time.perf_counter() - tic)
            runs.append(out)
            print(f"{METHODS[name]:8s} seed {seed}: supernet {out['supernet_acc']:.3f} discretised {out['discrete_acc']:.3f} "
                  f"({out['seconds']:.0f} s)", flush=True)
    summary = {"config": vars(args), "runs": runs, "seconds": time.perf_counter() - started,
               "torch_threads": torch.get_num_threads()}
    # renamed over the old one: open("w") emptied it first, and Ctrl-C mid-write left a truncated summary.json
    write_table(os.path.join(args.out, "summary.json"), json.dumps(summary, indent=1))
    print(f"all runs: {summary['seconds']:.0f} s")
    return summary


def agreement(runs, method):
    """{cell type: [seeds agreeing with the most frequent op, per edge]} of one method."""
    mine = [r for r in runs if r["method"] == method]
    out = {}
    for t in mine[0]["selected"]:
        E = len(mine[0]["selected"][t])
        out[t] = [Counter(r["selected"][t][e] for r in mine).most_common(1)[0][1] for e in range(E)]
    return out


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = summary["runs"]
    seeds = max(r["seed"] for r in runs) + 1
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    width = 0.4
    for m, (name, label) in enumerate(METHODS.items()):
        mine = [r for r in runs if r["method"] == name]
        if not mine:
            continue
        agree = agreement(runs, name)
        labels = [f"{t[0]}{e}" for t in agree for e in range(len(agree[t]))]
        values = [v for t in agree for v in agree[t]]
        axes[0].bar(np.arange(len(values)) + (m - 0.5) * width, values, width, label=label)
        for i, key in enumerate(("supernet_acc", "discrete_acc")):
            ys = [r[key] for r in mine]
            axes[1].scatter(np.full(len(ys), 2 * i + m * 0.8) + np.linspace(-0.1, 0.1, len(ys)), ys, s=14,
                            color=f"C{m}", label=label if i == 0 else None)
        drops = np.array([[r["supernet_acc"] - a for t in r["replaced_acc"] for a in r["replaced_acc"][t]] for r in mine])
        axes[2].errorbar(np.arange(drops.shape[1]) + (m - 0.5) * 0.2, drops.mean(0), yerr=drops.std(0), fmt="o-",
                         ms=3, lw=1, capsize=2, label=label)
    axes[0].set_xticks(np.arange(len(labels)), labels, fontsize=6)
    axes[0].set_ylabel(f"seeds agreeing (of {seeds})")
    axes[0].set_title("genotype agreement per edge (n: normal, r: reduce)", fontsize=8, loc="left")
    axes[0].legend(fontsize=7, frameon=False)
    axes[1].set_xticks([0.4, 2.4], ["supernet", "discretised"])
    axes[1].set_ylabel("search-val accuracy")
    axes[1].set_title("accuracy per seed", fontsize=8, loc="left")
    axes[1].legend(fontsize=7, frameon=False)
    axes[2].axhline(0, color="grey", lw=0.8)
    axes[2].set_xticks(np.arange(len(labels)), labels, fontsize=6)
    axes[2].set_ylabel("accuracy drop (mean ± sd)")
    axes[2].set_title("§5.3.1: supernet − one edge replaced by its op", fontsize=8, loc="left")
    axes[2].legend(fontsize=7, frameon=False)
    fig.suptitle("ASM-NAS vs DARTS: performance stability over seeds (asm-nas §5.3.1, Fig. 3; digits)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    from nasdiag.plot.registry import save

    # nasdiag's save: written under a fresh name and renamed over the figure (savefig on its name left a truncated
    # stability.png after a Ctrl-C mid-write), through a link, with nasdiag's mark (a rerun replaces it), then closed
    save(fig, path, 150)


def _summary(path):
    """The summary.json of a run of this script at ``path`` (None: there is none); a file of that name cut short (a
    full disk, a kill while it was written) or of another tool is one `NasdiagError` line: --plot-only was a
    JSONDecodeError or KeyError traceback, and a run replaced another tool's summary.json without a word."""
    if not os.path.lexists(path):
        return None
    try:
        with open(path) as f:
            summary = json.load(f)
    except (ValueError, UnicodeDecodeError):
        summary = None
    keys = ("method", "seed", "selected", "supernet_acc", "discrete_acc", "replaced_acc")
    runs = summary.get("runs") if isinstance(summary, dict) else None
    # a "runs" list of another tool's (or none) was max()'s ValueError or a KeyError ('seed') traceback
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) and all(k in r for k in keys)
                                                          and r["method"] in METHODS for r in runs):
        raise NasdiagError(f"{path} is not a summary of asmnas_stability.py (cut short, or another tool's file); move it "
                           f"away (then run the study again), or give another --out")
    return summary


def main(argv=None):
    args = parse_args(argv)
    summary_path = os.path.join(args.out, "summary.json")
    refuse_other_figures(args.out, ["stability"], "png")  # the user's own stability.png was replaced without a word
    summary = _summary(summary_path)
    if args.plot_only:
        if summary is None:
            raise NasdiagError(f"{summary_path} does not exist; run without --plot-only first")
    else:
        summary = run_study(args)
    figure = os.path.join(args.out, "stability.png")
    plot(summary, figure)
    print(f"wrote {summary_path} and {figure}")


if __name__ == "__main__":
    sys.exit(run_script("asmnas_stability", main))
