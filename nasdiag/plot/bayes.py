"""Figures of BayesNAS's sparse-Bayesian update (appendix §A): the evolution of γ (with the entropy pruning
threshold), ω and the curvature per edge and op, and the switches still on per edge."""

from __future__ import annotations

import math

import numpy as np

from nasdiag import vocabulary as V
from nasdiag.plot.registry import NothingToDraw, figure
from nasdiag.plot.style import (
    PAGE, edge_names, integer_steps, logged_rows, mark_isolated, mark_nonfinite, op_names, ops_on_per_edge, plt,
)

#: Algorithm 2, step 4: ½ ln(2πe γ) ≤ 0 ⟺ γ ≤ 1/(2πe)
_PRUNE_GAMMA = 1.0 / (2.0 * math.pi * math.e)
#: legend entry of the values a log panel cannot place (γ = 0 of a dead switch), marked at its floor
_OFF_LOG = "{} ≤ 0 (off the log axis)"


def _per_edge_panels(record, cell, family, ylabel, title, *, log=False, threshold=None):
    """One small panel per edge: the (T, K) values of ``family`` over the steps, one line per op."""
    path = family.path(cell=cell)
    rows, steps = logged_rows(record, path)
    values = np.asarray(record[path][rows], dtype=float)  # (T, E, K)
    if not np.isfinite(values).any():
        raise NothingToDraw(f"{path} is not finite in any row; nothing to draw")
    E, K = values.shape[1], values.shape[2]
    edges, ops = edge_names(record, cell, E), op_names(record, K)
    cols = min(E, 5)
    nrows = -(-E // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(PAGE, 1.5 * nrows + 0.6), sharex=True, squeeze=False)
    # one colour per op: tab10 repeats after 10, which drew op k and op k + 10 as one colour under two names
    colors = plt.get_cmap("tab10" if K <= 10 else "tab20")
    for e, ax in enumerate(axes.flat):
        if e >= E:
            ax.axis("off")
            continue
        for k in range(K):
            y = values[:, e, k]
            if log:
                # γ = 0 (a dead switch) has no logarithm: left out of the line, marked at the panel's floor
                off = np.isfinite(y) & (y <= 0)
                y = np.where(off, np.nan, y)
                if off.any():
                    ax.plot(steps[off], np.zeros(int(off.sum())), ls="none", marker="o", mfc="none", ms=4,
                            color=colors(k % colors.N), transform=ax.get_xaxis_transform(), clip_on=False, zorder=5)
                    if not any(lab == _OFF_LOG.format(ylabel) for lab in ax.get_legend_handles_labels()[1]):
                        ax.plot([], [], ls="none", marker="o", mfc="none", ms=4, color="k", label=_OFF_LOG.format(ylabel))
            ax.plot(steps, y, color=colors(k % colors.N), lw=0.9, label=ops[k] if e == 0 else None)
            mark_isolated(ax, steps, y, color=colors(k % colors.N))  # one update (one epoch): points, not an empty panel
            mark_nonfinite(ax, steps, values[:, e, k], color=colors(k % colors.N))  # recorded NaN/inf, not γ = 0
        if threshold is not None:
            ax.axhline(threshold, color="k", lw=0.7, ls=":")
        if log:
            ax.set_yscale("log")
        ax.set_title(edges[e], fontsize=7, loc="left")
        ax.tick_params(labelsize=6)
        integer_steps(ax)
    for ax in axes[-1]:
        ax.set_xlabel("step", fontsize=7)
    axes[0][0].set_ylabel(ylabel, fontsize=7)
    entries = {}  # label -> handle: the ops (first panel) and each NaN/inf kind once, from whichever panel has it
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    ncol = min(len(entries), 7)
    fig.legend(list(entries.values()), list(entries), fontsize=6, frameon=False, ncol=ncol,
               loc="lower center", bbox_to_anchor=(0.5, 1.0))
    # the title above the legend, however many rows it has (about 0.13 in each at 6 pt)
    legend_rows = -(-len(entries) // ncol)
    fig.suptitle(title, fontsize=8, x=0.01, ha="left", va="bottom",
                 y=1.0 + (0.13 * legend_rows + 0.04) / fig.get_figheight())
    return fig


@figure(V.BAYES_GAMMA, name="bayes_gamma", file="bayes_gamma_{cell}", paper="BayesNAS A.2.14, Algorithm 2 step 4",
        caption="γ of every op per edge over the steps (log scale); ops are pruned when γ falls to the dotted "
                "line 1/(2πe), where the entropy ½ ln(2πe γ) reaches 0.")
def bayes_gamma(record, cell):
    return _per_edge_panels(record, cell, V.BAYES_GAMMA, "γ", f"{cell} cell: BayesNAS γ per op", log=True,
                            threshold=_PRUNE_GAMMA)


@figure(V.BAYES_OMEGA, name="bayes_omega", file="bayes_omega_{cell}", paper="BayesNAS A.2.8",
        caption="ω of every op per edge over the steps: the weight of each op's ℓ1 penalty in the next "
                "likelihood step (A.3.1); a larger ω shrinks the op's mixing weight harder.")
def bayes_omega(record, cell):
    return _per_edge_panels(record, cell, V.BAYES_OMEGA, "ω", f"{cell} cell: BayesNAS ω per op")


@figure(V.BAYES_CURVATURE, name="bayes_curvature", file="bayes_curvature_{cell}", paper="BayesNAS C.3, A.3.2",
        caption="The mixing-weight curvature ∂²L/∂Z² the last update used, per edge and op (summed over the "
                "cells of the type); the update ignores entries ≤ 0.")
def bayes_curvature(record, cell):
    return _per_edge_panels(record, cell, V.BAYES_CURVATURE, "∂²L/∂Z²", f"{cell} cell: curvature used by BayesNAS")


@figure(V.BAYES_SWITCH, name="bayes_switches", file="bayes_switches_{cell}", paper="BayesNAS Algorithm 2 step 4",
        caption="How many ops of each edge are still switched on after entropy pruning, over the steps; an "
                "edge never drops below one op.")
def bayes_switches(record, cell):
    return ops_on_per_edge(record, cell, V.BAYES_SWITCH.path(cell=cell), ylabel="ops switched on",
                           title=f"{cell} cell: BayesNAS switches", width=PAGE / 2)
