"""Figures of SparseNAS (sparse-supernet Figs 7, 8): the distribution of the linear mixing weights A of a cell
type over its edges and ops, at one step and over the epochs.

SparseNAS mixes the ops linearly (eq 1) and records A itself as ``arch/<cell>/params`` next to
``sparsity/<cell>/nonzero``; the figures are registered for the ``sparsity/`` family, so only records of a
sparse-supernet search get them, and they show |A| (A's sign is the op's sign in the sum, its magnitude what
Figs 7, 8 colour). An exact zero is an op the proximal step (eq 9, 10) pruned; each title counts them.
"""

from __future__ import annotations

from typing import List

import numpy as np

from nasdiag import vocabulary as V
from nasdiag.plot.registry import Heatmap, NothingToDraw, figure, heatmap, valid_rows
from nasdiag.plot.style import edge_names, epoch_of, op_names, render_heatmaps, step_of

#: at most this many epochs side by side: the first, the last and evenly spaced ones between
MAX_PANELS = 8


def _magnitudes(record, cell: str, row: int) -> np.ndarray:
    """(E, K) |A| of ``cell`` at ``row``; NothingToDraw if A was not logged in that row."""
    path = V.ARCH_PARAMS.path(cell=cell)
    if path not in record or row not in set(valid_rows(record, path).tolist()):
        raise NothingToDraw(f"the record has no {path} at step {step_of(record, row)}; nothing to draw")
    return np.abs(np.asarray(record[path][row], dtype=float))


def _weights_heatmap(record, cell: str, row: int, title: str) -> Heatmap:
    a = _magnitudes(record, cell, row)
    E, K = a.shape
    pruned = int((a == 0).sum())
    return Heatmap(a, edge_names(record, cell, E), op_names(record, K), f"{title}, {pruned} of {E * K} ops pruned",
                   "|A| (0: pruned by the proximal step)", signed=False, step=step_of(record, row))


@heatmap(V.SPARSITY_NONZERO, name="sparsity_weights", file="sparsity_{cell}_weights", reads=V.ARCH_PARAMS,
         paper="sparse-supernet Fig. 7 (Fig. 8 is the same map transposed)",
         caption="The magnitude |A| of the linear mixing weight of every op on every edge (eq 1) at the step: a darker "
                 "cell is a smaller weight, 0 an op the proximal step pruned; a good search leaves a few clearly "
                 "larger weights and the rest at or near zero.")
def sparsity_weights(record, cell: str, row: int) -> Heatmap:
    return _weights_heatmap(record, cell, row, f"{cell} cell: |A| at step {step_of(record, row)}")


def epoch_rows(record, path: str) -> List[int]:
    """Rows of ``path`` to show over a search: the first logged one, then the last one at or before each epoch
    end (``scalars/epoch``), thinned to `MAX_PANELS` (first and last kept); without epoch rows, evenly spaced ones."""
    rows = valid_rows(record, path)
    if rows.size == 0:
        raise NothingToDraw(f"{path} has no rows yet")
    ends = np.flatnonzero(record.get("valid/scalars/epoch", np.zeros(len(record["step"]), bool)))
    picked = [int(rows[0])] + [int(rows[rows <= end][-1]) for end in ends if (rows <= end).any()]
    if len(picked) == 1:
        picked = [int(rows[i]) for i in np.linspace(0, rows.size - 1, min(rows.size, MAX_PANELS)).round().astype(int)]
    picked = sorted(set(picked))
    if len(picked) > MAX_PANELS:
        picked = [picked[int(i)] for i in np.linspace(0, len(picked) - 1, MAX_PANELS).round()]
    return picked


def _label(record, row: int) -> str:
    epoch = epoch_of(record, row)
    return f"epoch {epoch}" if epoch is not None else f"step {step_of(record, row)}"


@figure(V.SPARSITY_NONZERO, name="sparsity_evolution", file="sparsity_{cell}_evolution", reads=V.ARCH_PARAMS,
        paper="sparse-supernet Figs 7, 8, over the epochs",
        caption="|A| of every op on every edge after the first step and at each epoch end, each panel divided by its "
                "largest |A| (given in its title) so that the shape of the distribution stays visible while λ rises: "
                "a few ops near 1, the pruned ones at exactly 0.")
def sparsity_evolution(record, cell: str):
    rows = epoch_rows(record, V.SPARSITY_NONZERO.path(cell=cell))
    panels = {}
    for row in rows:
        try:
            hm = _weights_heatmap(record, cell, row, f"{cell} cell: |A| / max |A| per edge and op over the search")
        except NothingToDraw:
            continue
        finite = hm.matrix[np.isfinite(hm.matrix)]
        # the largest finite |A|: dividing by an inf one turned every other op into 0, "pruned"
        top = float(finite.max()) if finite.size else 0.0
        # every panel on [0, 1]: the distribution's shape, not its scale, is what Figs 7, 8 compare
        hm.matrix = hm.matrix / top if top > 0 else hm.matrix
        hm.limits = (0.0, 1.0)
        hm.colorbar = "|A| / max |A| of the panel (0: pruned)"
        panels[f"{_label(record, row)}: max {top:.2g}, {int((hm.matrix == 0).sum())} pruned"] = hm
    if not any(np.isfinite(hm.matrix).any() for hm in panels.values()):
        raise NothingToDraw(f"arch/{cell}/params is missing or NaN in every row shown; nothing to draw")
    fig = render_heatmaps(panels)
    fig.suptitle(f"{cell} cell: |A| per edge and op over the search, relative to each panel's largest")
    return fig
