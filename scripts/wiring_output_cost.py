#!/usr/bin/env python
"""Wiring supplement §6, Figs 11-16 (Theorem 2, Remark 1): the cost at the output edges of the last cell,
C_Z, with the loss L_θ and the output entropy H_θ over epochs, overall and split by correctly and
wrongly classified samples.

Setup (supplement §6): one minimal cell (Fig. 7) before global average pooling and a bias-free linear
classifier, α fixed, θ trained with uniformly sampled children (DSNAS, Figs 11, 14) or at uniform α
(DARTS, Figs 12, 13, 15, 16: ``--protocol darts``). After every epoch (and before training) the whole
search-train split (Figs 11, 12) and the search-val split (the "search set", Fig. 13) are evaluated:
per sample, C_Z is read from the probe's output-edge costs (``nasdiag.attach``,
``Probe.output_costs(per_sample=True)``, summed over the cell's output nodes and multiplied by B, since
the per-sample terms of a batch-mean loss carry 1/B), L_θ is the sample's cross-entropy and H_θ the
entropy of its softmax output. Theorem 2 says C_Z = L_θ − H_θ for every sample; the record keeps the
largest deviation (``scalars/thm2_max_abs_error_<split>``) as a check.

Rows: one per epoch end (``scalars/epoch`` −1 before training) with ``scalars/<quantity>_<split>``
and ``..._<split>_correct`` / ``_wrong`` means (quantity: cz, loss, entropy; split: train, search), plus
``scalars/accuracy_<split>``, the share of the split's samples that the ``_correct`` means are over (the rest:
``_wrong``). Figures, drawn from the record (``--plot-only`` redraws them):

- ``fig11_12_13.png``: per split, L_θ and H_θ on the left axis and C_Z on the right axis (Figs 11-13);
- ``fig14_16.png``: the same for correct and wrong samples (Figs 14-16). Only the correct side has a sign
  theorem: C_Z ≤ 0 on every correctly classified sample (§6; its largest value is kept as
  ``scalars/cz_<split>_correct_max``); the paper's "positive at low accuracy" is a tendency of the means
  of the wrong ones, not a bound (a wrong sample with p = (0.4, 0.35, 0.25), label 1, has C_Z = −0.03).

What differs from the paper: digits instead of CIFAR-10, C = 8, 10 epochs instead of 150 (DSNAS) or
50 (DARTS). Timing: BENCHMARKS.md.

    python scripts/wiring_output_cost.py --out runs/wiring_output_cost
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

import wiring_common as W
from nasdiag.errors import run_script
from script_args import (
    Parser, UsageError, at_least, channels, refuse_other_figures,
    refuse_other_records, seed as seed_number,
)

QUANTITIES = {"loss": "L_θ (cross-entropy)", "entropy": "H_θ (output entropy)", "cz": "C_Z (output-edge cost)"}
EXPERIMENT = "wiring Thm 2"  # meta config's experiment: the wiring scripts share their method
SPLITS = {"train": "search-train set (θ's data)", "search": "search set (held out from θ)"}


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0], plot_options=('out', 'format'))  # the rest: refused with --plot-only
    parser.add_argument("--out", default="runs/wiring_output_cost")
    parser.add_argument("--protocol", default="dsnas", choices=W.PROTOCOLS)
    parser.add_argument("--epochs", type=at_least(1), default=10)
    parser.add_argument("--C", type=channels, default=8)
    parser.add_argument("--batch-size", type=at_least(1), default=64)
    parser.add_argument("--dataset", default="digits", choices=("digits", "cifar10"))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--seed", type=seed_number(), default=0)
    parser.add_argument("--format", default="png", choices=("png", "pdf", "svg"))
    parser.add_argument("--plot-only", action="store_true")
    return parser.parse_args(argv)


def evaluate(method, probe, dataset, split: str, batch_size: int = 256):
    """Per-sample C_Z, L_θ, H_θ over ``dataset`` at the current θ (θ unchanged), as means overall and by
    correct/wrong classification."""
    last_cell = None
    columns = {q: [] for q in QUANTITIES}
    correct = []
    for x, y in W.batches(dataset, batch_size, 0, shuffle=False):
        weights = method.forward_weights()
        result = method.cost(x, y, weights, active=method.active_for(weights), observe=False, record_probe=True)
        nodes = probe.output_costs(per_sample=True)
        last_cell = last_cell or list(nodes)[-1]
        columns["cz"].append(len(y) * sum(nodes[last_cell].values()))
        log_p = torch.log_softmax(result.logits.double(), dim=1)
        columns["loss"].append(-log_p.gather(1, y[:, None]).squeeze(1))
        columns["entropy"].append(-(log_p.exp() * log_p).sum(1))
        correct.append(result.logits.argmax(1) == y)
    values = {q: torch.cat(v).double() for q, v in columns.items()}
    right = torch.cat(correct)
    row = {f"scalars/thm2_max_abs_error_{split}": (values["cz"] - (values["loss"] - values["entropy"])).abs().max()}
    for q, v in values.items():
        row[f"scalars/{q}_{split}"] = v.mean()
        for part, mask in (("correct", right), ("wrong", ~right)):
            row[f"scalars/{q}_{split}_{part}"] = v[mask].mean() if mask.any() else torch.tensor(float("nan"))
    row[f"scalars/accuracy_{split}"] = right.double().mean()
    # eq 12's sign argument, per sample: where the label has the largest logit, −Y_{b,n_b} + Σ_n p_bn Y_bn ≤ 0
    row[f"scalars/cz_{split}_correct_max"] = values["cz"][right].max() if right.any() else torch.tensor(float("nan"))
    return row


def largest(data, name: str) -> str:
    """The largest finite ``scalars/<name>`` over the evaluated epochs, and the epochs where it is NaN/inf: np.nanmax
    left a NaN of a diverged epoch out of the summary (max |C_Z − (L_θ − H_θ)| = 1e-7 of a run whose last epochs were
    NaN). A ``cz_<split>_correct_max`` is NaN also where no sample was classified correctly."""
    rows = data[f"valid/scalars/{name}"]
    values, epochs = np.asarray(data[f"scalars/{name}"][rows], dtype=float), data["scalars/epoch"][rows]
    finite = np.isfinite(values)
    text = f"{values[finite].max():.2e}" if finite.any() else "no finite value"
    if not finite.all():
        text += f" (NaN/inf at epoch {', '.join(str(int(e)) for e in epochs[~finite])})"
    return text


def legend_entries(fig):
    """(handles, labels) of every axes of ``fig``, each label once: the quantities and the NaN/inf marks of any panel."""
    entries = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    return list(entries.values()), list(entries)


def draw(record_path: str, out: str, fmt: str) -> list:
    from nasdiag.plot.registry import save
    from nasdiag.plot.style import PAGE, integer_steps, paper_style, plot_series, plt
    from nasdiag.record import load

    record = load(record_path)
    if not np.any(record.get("valid/scalars/loss_train", False)):  # no evaluation yet (stopped, or live): a KeyError
        raise UsageError(f"{record_path} holds no evaluated epoch yet (a run stopped before its first evaluation, or "
                         "one still writing it); let the run evaluate an epoch, or run again without --plot-only")

    def series(name):
        rows = record[f"valid/scalars/{name}"]
        return record["scalars/epoch"][rows], record[f"scalars/{name}"][rows]

    def panel(ax, suffix, title):
        twin = ax.twinx()
        for q, color in (("loss", "#1f77b4"), ("entropy", "#2ca02c")):
            # NaN/inf marked at the axes edge (a split with no wrong sample has NaN means), not left as a gap
            plot_series(ax, *series(f"{q}_{suffix}"), color=color, marker="o", ms=2.5, lw=1.1, label=QUANTITIES[q])
        plot_series(twin, *series(f"cz_{suffix}"), color="#d62728", marker="s", ms=2.5, lw=1.1, label=QUANTITIES["cz"])
        twin.axhline(0, color="#d62728", lw=0.6, ls=":")
        twin.spines["right"].set_visible(True)
        ax.set_xlabel("epoch (−1: before training)")
        integer_steps(ax)
        ax.set_ylabel("L_θ, H_θ  (mean over samples)")
        twin.set_ylabel("C_Z  (mean over samples)", color="#d62728")
        ax.set_title(title, loc="left")
        return ax, twin

    written = []
    with paper_style():
        fig, axes = plt.subplots(1, 2, figsize=(PAGE, 2.4))
        for ax, (split, label) in zip(axes, SPLITS.items()):
            panel(ax, split, label)
        fig.legend(*legend_entries(fig), loc="outside lower center", ncol=3, frameon=False)
        fig.suptitle("Thm 2: output-edge cost C_Z = L_θ − H_θ of the last cell (wiring supplement Figs 11-13)")
        path = os.path.join(out, f"fig11_12_13.{fmt}")
        save(fig, path, 150)
        written.append(path)

        fig, axes = plt.subplots(2, 2, figsize=(PAGE, 4.4))
        for r, (split, label) in enumerate(SPLITS.items()):
            for c, part in enumerate(("correct", "wrong")):
                panel(axes[r, c], f"{split}_{part}", f"{label}: {part}ly classified")
        fig.legend(*legend_entries(fig), loc="outside lower center", ncol=3, frameon=False)
        # only the correct side is a theorem (§6: Y_{b,n_b} = max_n Y_bn gives C_Z ≤ 0 per sample); a wrongly
        # classified sample can have C_Z < 0 too (p = (0.4, 0.35, 0.25) with label 1: −0.03), and the means
        # where wrong do turn negative as θ trains
        fig.suptitle("Thm 2 by classification: C_Z ≤ 0 on every correctly classified sample; "
                     "no fixed sign where wrong (wiring supplement Figs 14-16)")
        path = os.path.join(out, f"fig14_16.{fmt}")
        save(fig, path, 150)
        written.append(path)
    return written


def main(argv=None):
    import warnings

    with warnings.catch_warnings():  # the filter for this run only: main() in a session silenced the probe's warning
        # for the rest of it (warnings.filters is the interpreter's)
        # under the dsnas protocol the unsampled ops do not run, so the probe's per-op costs of them are NaN by
        # design; only its output-edge costs are used here
        warnings.filterwarnings("ignore", message="probe: some candidate ops did not run", category=RuntimeWarning)
        return _main(argv)


def _main(argv):
    import nasdiag

    args = parse_args(argv)
    record = os.path.join(args.out, "record.h5")
    refuse_other_figures(args.out, ["fig11_12_13", "fig14_16"], args.format)
    # --plot-only of another script's record (xnas_toys', a search's) was "holds no evaluated epoch yet (a run stopped
    # before its first evaluation...)"; one of this method without this script's evaluations is refused by draw
    refuse_other_records([record], W.FixedArchitecture.name, plot_only=args.plot_only, experiment=EXPERIMENT)
    if not args.plot_only:
        splits = W.load_splits(args.dataset, args.data_dir, args.seed, args.batch_size)  # first: a refused --data-dir left an empty folder
        # Theorem 2 needs the classifier without bias, after global average pooling of the last cell
        net = W.make_network("minimal", 1, splits.num_classes, splits.in_channels, C=args.C, reductions=(),
                             classifier_bias=False, seed=args.seed)
        os.makedirs(args.out, exist_ok=True)  # not for --plot-only (its refusal left an empty folder), nor before the
        # supernet (one too large for memory left it too)
        probe = nasdiag.attach(net)
        config = {"experiment": EXPERIMENT, "protocol": args.protocol, "epochs": args.epochs, "C": args.C,
                  "dataset": args.dataset, "batch_size": args.batch_size, "seed": args.seed, "classifier_bias": False,
                  "steps": net.steps, "multiplier": net.multiplier}

        def hook(method, epoch):
            return {**evaluate(method, probe, splits.train, "train"), **evaluate(method, probe, splits.val, "search")}

        start = time.perf_counter()
        W.train_fixed(net, splits, record, config, args.epochs, args.batch_size, observe_batches=0, probe=probe,
                      epoch_hook=hook, seed=args.seed)
        print(f"record: {record} ({time.perf_counter() - start:.0f} s)")
        from nasdiag.record import load

        data = load(record)
        for split in SPLITS:
            print(f"{split}: max |C_Z − (L_θ − H_θ)| = {largest(data, f'thm2_max_abs_error_{split}')}, largest C_Z of a "
                  f"correctly classified sample = {largest(data, f'cz_{split}_correct_max')} (Thm 2: ≤ 0)")
    elif not os.path.exists(record):
        raise UsageError(f"no record at {record}; run without --plot-only first")
    for path in draw(record, args.out, args.format):
        print(path)


if __name__ == "__main__":
    sys.exit(run_script("wiring_output_cost", main))
