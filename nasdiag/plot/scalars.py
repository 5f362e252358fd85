"""Scalar curves (``scalars/<name>``), grouped by meaning: losses, accuracies, learning rates, norms."""

from __future__ import annotations

from typing import Dict, List

import numpy as np

from nasdiag import vocabulary as V
from nasdiag.plot.registry import NothingToDraw, figure
from nasdiag.plot.style import PAGE, grid_shape, integer_steps, marked_series, plot_series, plt

#: how a known scalar is named in legends: which split, which step, which convention
DESCRIPTIONS = {
    "train_loss": "train_loss\n(w step, batch)",
    "val_loss": "val_loss\n(α step, batch)",
    "search_val_loss": "search_val_loss\n(epoch eval., whole split)",
    "train_acc": "train_acc\n(w step, batch)",
    "val_acc": "val_acc\n(α step, batch)",
    "search_val_acc": "search_val_acc\n(epoch eval., whole split)",
    "w_lr": "w_lr (SGD on w)",
    "alpha_grad_norm": "‖∂L/∂α‖₂ (α step)",
}

#: panels in display order: (title, y label, test on the scalar's name)
GROUPS = (
    ("losses", "cross-entropy", lambda n: "loss" in n),
    ("accuracies", "top-1 accuracy", lambda n: "acc" in n),
    ("learning rates", "learning rate", lambda n: n.endswith("lr") or "_lr_" in n),
    ("norms", "ℓ2 norm", lambda n: "norm" in n),
)
#: panels of one figure: a record of a scalar per layer (10^4 paths) drew a panel each, a figure of 5000 rows that
#: took hours to lay out (300 panels: a minute); the panels past it are named in the title, not drawn
MAX_PANELS = 24
#: counters, not curves
SKIPPED = ("epoch",)
#: flags (``scalars/nonfinite_loss`` = 1 on the row whose loss was NaN/inf), not values of a meaning group: in the
#: losses panel the flag was a point of cross-entropy 1 on the failing step
FLAGS = ("nonfinite_",)


def group_scalars(names: List[str]) -> Dict[str, List[str]]:
    """``{panel title: [scalar names]}``: the four meaning groups, then one panel per other scalar."""
    groups: Dict[str, List[str]] = {}
    for name in names:
        if name in SKIPPED:
            continue
        title = name if name.startswith(FLAGS) else next((t for t, _, test in GROUPS if test(name)), name)
        groups.setdefault(title, []).append(name)
    order = [t for t, _, _ in GROUPS]
    return dict(sorted(groups.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


@figure(V.SCALAR, name="scalars", file="scalars", caption=(
    "Per-step and per-epoch scalars grouped by meaning: losses, accuracies, learning rates and gradient norms; "
    "val_* are the α step's batch, search_val_* the evaluation of the whole search-val split after each epoch."))
def scalar_curves(record, cell=None):
    names = [k[len("scalars/"):] for k in record if k.startswith("scalars/") and np.ndim(record[k]) == 1]
    curves = {}
    for name in names:
        try:  # a scalar NaN in every row is kept: its marks show it (a NaN loss is what a reader looks for)
            curves[name] = marked_series(record, f"scalars/{name}")
        except NothingToDraw:
            continue
    groups = group_scalars(list(curves))
    if not any(np.isfinite(curves[n][1]).any() for members in groups.values() for n in members):
        raise NothingToDraw("no scalar has a finite value; nothing to draw")
    left_out = [name for members in list(groups.values())[MAX_PANELS:] for name in members]
    groups = dict(list(groups.items())[:MAX_PANELS])
    rows, cols = grid_shape(len(groups), 2)
    fig, axes = plt.subplots(rows, cols, figsize=(PAGE if cols > 1 else PAGE / 2, 0.4 + 1.7 * rows), squeeze=False)
    ylabels = {t: y for t, y, _ in GROUPS}
    for ax, (title, members) in zip(axes.ravel(), groups.items()):
        for name in members:
            steps, values = curves[name]
            plot_series(ax, steps, values, lw=1.1, marker="o" if len(steps) < 30 else None, ms=3,
                        label=DESCRIPTIONS.get(name, name))
        finite = np.concatenate([v[np.isfinite(v)] for v in (curves[n][1] for n in members)])
        if title == "learning rates" and finite.size and finite.min() > 0 and finite.max() > 30 * finite.min():
            ax.set_yscale("log")  # only where a schedule spans decades
        ax.set_title(title, loc="left")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabels.get(title, title))
        integer_steps(ax)
        # right of the panel: a legend inside would cover the curves
        ax.legend(fontsize=6, frameon=False, loc="center left", bbox_to_anchor=(1.02, 0.5), borderaxespad=0.0)
    for ax in axes.ravel()[len(groups):]:
        ax.axis("off")
    fig.suptitle("Scalars of the run" + (f" ({len(left_out)} more not drawn, past {MAX_PANELS} panels: "
                                         f"{', '.join(left_out[:3])}{', ...' if len(left_out) > 3 else ''})"
                                         if left_out else ""))
    return fig
