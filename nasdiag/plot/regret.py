"""Figures of XNAS's forecasters (one per edge): regret against the bound of Theorem 1, the experts still
alive over the steps, and the wipeout events."""

from __future__ import annotations

import numpy as np

from nasdiag import vocabulary as V
from nasdiag.plot.registry import NothingToDraw, figure
from nasdiag.plot.style import (
    COLUMN, PAGE, edge_names, integer_steps, logged_rows, marked_series, none_finite, op_names, ops_on_per_edge,
    plot_series, plt,
)


@figure((V.REGRET_REGRET, V.REGRET_BOUND), name="regret_bound", file="regret_bound_{cell}", paper="XNAS Theorem 1, eq 3",
        caption="Regret of each edge's forecaster against its surviving experts (eq 31, solid; the regret over all experts for ζ ≥ 1 "
                "by Lemma 1, possibly less for ζ < 1) and its Theorem 1 bound (eq 3, dashed, same colour) over "
                "the steps; the bound holds for this regret, any ζ, when every reward is within L.")
def regret_bound(record, cell):
    regret_path, bound_path = V.REGRET_REGRET.path(cell=cell), V.REGRET_BOUND.path(cell=cell)
    rows, steps = logged_rows(record, regret_path)
    regret = np.asarray(record[regret_path][rows], dtype=float)
    if not np.isfinite(regret).any():
        raise NothingToDraw(f"{regret_path} {none_finite(regret, 'is NaN in every row', 'has')}; nothing to draw")
    # the bound at the rows it was logged in: at the regret's rows, a row without it read as a recorded NaN (marked)
    bound_steps, bound = marked_series(record, bound_path) if bound_path in record else (None, None)
    E = regret.shape[1]
    names = edge_names(record, cell, E)
    fig, ax = plt.subplots(figsize=(COLUMN, 2.4))
    # one colour per edge: tab10 repeats after 10 (a DARTS cell has 14), which made edge e and e + 10 one curve
    colors = plt.get_cmap("tab10" if E <= 10 else "tab20")
    for e in range(E):
        plot_series(ax, steps, regret[:, e], color=colors(e % colors.N), lw=1.1, label=names[e])
        if bound is not None:
            plot_series(ax, bound_steps, bound[:, e], color=colors(e % colors.N), lw=0.8, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("regret (solid), bound (dashed)")
    integer_steps(ax)
    ax.legend(fontsize=6, frameon=False, ncol=2)
    ax.set_title(f"{cell} cell: XNAS regret vs bound", loc="left")
    return fig


@figure(V.REGRET_ALIVE, name="alive_experts", file="alive_experts_{cell}", paper="XNAS Algorithm 1, lines 11-12",
        caption="How many candidate ops (experts) of each edge survive the wipeout after each step: the computed "
                "part of the supernet shrinks as inferior ops are wiped out.")
def alive_experts(record, cell):
    return ops_on_per_edge(record, cell, V.REGRET_ALIVE.path(cell=cell), ylabel="alive experts",
                           title=f"{cell} cell: alive experts per edge")


@figure(V.REGRET_WIPEOUTS, name="wipeouts", file="wipeouts_{cell}", paper="XNAS Algorithm 1, line 12",
        caption="Each wipeout event: the step (x) at which an op (colour) of an edge (y) was removed from the "
                "forecaster's experts and stopped being computed.")
def wipeouts(record, cell):
    path = V.REGRET_WIPEOUTS.path(cell=cell)
    rows, steps = logged_rows(record, path)
    wiped = np.asarray(record[path][rows]).astype(bool)  # (T, E, K)
    t, e, k = np.nonzero(wiped)
    if t.size == 0:
        raise NothingToDraw(f"no op of the {cell} cell has been wiped out yet")
    E, K = wiped.shape[1], wiped.shape[2]
    ops = op_names(record, K)
    fig, ax = plt.subplots(figsize=(PAGE / 2, 0.3 * E + 1.4))
    colors = plt.get_cmap("tab10" if K <= 10 else "tab20")  # one colour per op, as the legend names them
    for op in np.unique(k):
        sel = k == op
        jitter = 0.5 * (op - (K - 1) / 2) / K  # ops of one edge side by side
        ax.scatter(steps[t[sel]], e[sel] + jitter, s=14, color=colors(op % colors.N), label=ops[op])
    ax.set_yticks(range(E))
    ax.set_yticklabels(edge_names(record, cell, E))
    ax.invert_yaxis()
    ax.set_xlabel("step")
    ax.set_ylabel("edge")
    integer_steps(ax)
    ax.legend(fontsize=6, frameon=False, bbox_to_anchor=(1.0, 1.0), loc="upper left")
    ax.set_title(f"{cell} cell: wipeouts ({t.size} ops)", loc="left")
    return fig
