"""Curvature figures (``hessian/<cell>/...``): the mixing-weight Hessian diagonal (BayesNAS §C.3) and the
top α-Hessian eigenvalue over the search."""

from __future__ import annotations

import numpy as np

from nasdiag import vocabulary as V
from nasdiag.plot.registry import Heatmap, NothingToDraw, figure, heatmap
from nasdiag.plot.style import (
    COLUMN, edge_names, integer_steps, marked_series, none_finite, op_names, plot_series, plt, step_of,
)
from nasdiag.record.schema import loads_json  # reads the NaN form of the record's JSON ({"__float__": "nan"})


def _mode(record, sep: str = ", ") -> str:
    try:
        config = loads_json(str(record["meta/config"])) if "meta/config" in record else {}
    except ValueError:
        config = {}
    mode = config.get("hessian_mode") if isinstance(config, dict) else None
    return f"{sep}{mode} mode" if mode else ""


@heatmap(V.HESSIAN_DIAG, name="hessian", file="hessian_{cell}_heatmap", paper="BayesNAS appendix C.3.1-C.3.2",
         caption="Diagonal of the loss Hessian in the mixing weights, ∂²L/∂Z², per op and edge on the epoch's last "
                 "batch (summed over the cells of the type): how sharply the loss bends as one op's weight changes. "
                 "Sequential colours when every entry is ≥ 0, diverging around 0 otherwise.")
def hessian_diag(record, cell: str, row: int) -> Heatmap:
    path = V.HESSIAN_DIAG.path(cell=cell)
    h = np.asarray(record[path][row], dtype=float)
    E, K = h.shape
    # not signed by assumption: the diagonal of a non-convex loss's Hessian can be negative
    return Heatmap(h, edge_names(record, cell, E), op_names(record, K),
                   f"{cell} cell: diag ∂²L/∂Z²{_mode(record)}, last batch at step {step_of(record, row)}",
                   # the mode on the colour bar too: a comparison keeps each run's own there, the title's is cut
                   f"∂²L/∂Z²  (L: batch-mean loss{_mode(record, '; ')})", signed=None, step=step_of(record, row))


@figure(V.HESSIAN_TOP_EIGENVALUE, name="hessian_eigenvalue", file="hessian_{cell}_eigenvalue",
        reads=V.HESSIAN_JOINT_TOP_EIGENVALUE, paper="RobustDARTS's dominant-eigenvalue curve",
        caption="Largest eigenvalue of the α-Hessian of the cell type, and (dashed) of all cell types' α jointly, at "
                "the recorded steps: a steady rise of the joint one is the early-stopping signal of RobustDARTS.")
def top_eigenvalue(record, cell: str):
    drawn = []
    for path, style in ((V.HESSIAN_TOP_EIGENVALUE.path(cell=cell), dict(marker="o", ms=3, lw=1.1, label=f"α of the {cell} cells")),
                        # records written before the joint eigenvalue was recorded have only the per-type one
                        (V.HESSIAN_JOINT_TOP_EIGENVALUE.path(), dict(marker="s", ms=2.5, lw=1.0, ls="--", color="0.35",
                                                                     label="all α jointly"))):
        if path not in record:
            continue
        try:  # a curve NaN in every row still shows its NaN marks beside the other one
            drawn.append((marked_series(record, path), style))
        except NothingToDraw:
            continue
    if not drawn:
        raise NothingToDraw(f"{V.HESSIAN_TOP_EIGENVALUE.path(cell=cell)} has no rows yet")
    if not any(np.isfinite(values).any() for (_, values), _ in drawn):
        names = [p for p in (V.HESSIAN_TOP_EIGENVALUE.path(cell=cell), V.HESSIAN_JOINT_TOP_EIGENVALUE.path()) if p in record]
        every = np.concatenate([values.ravel() for (_, values), _ in drawn])
        raise NothingToDraw(f"{' and '.join(names)} " + none_finite(every, f"{'is' if len(names) == 1 else 'are'} NaN in every row",
                                                                    "has" if len(names) == 1 else "have") + "; nothing to draw")
    fig, ax = plt.subplots(figsize=(COLUMN, 2.0))
    for (steps, values), style in drawn:
        plot_series(ax, steps, values, **style)
    ax.legend(fontsize=6, frameon=False)
    ax.set_xlabel("step")
    ax.set_ylabel("λ_max(∂²L/∂α²)")
    integer_steps(ax)
    ax.set_title(f"{cell} cell: top eigenvalue of the α-Hessian", loc="left")
    return fig
