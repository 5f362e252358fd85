"""Cost heatmaps (``cost/<cell>/...``): E[C] and its spread per op × edge (wiring supplement §2)."""

from __future__ import annotations

import numpy as np

from nasdiag import vocabulary as V
from nasdiag.plot.registry import Heatmap, heatmap
from nasdiag.plot.style import edge_names, epoch_span, op_names, step_of

#: the sign convention, in words: C is the slope of the batch-mean loss L in the op's mixing weight Z
COST_SIGN = "> 0: more weight raises L"


@heatmap(V.COST_MEAN, name="cost", file="cost_{cell}_heatmap", paper="wiring supplement Figs 5, 6, 19-21",
         caption="Cost mean E[C] of every op on every edge, averaged over the steps of an epoch and the cells of the "
                 "type: positive cost pushes the op's weight down under gradient descent, negative cost pulls it up.")
def cost_mean(record, cell: str, row: int) -> Heatmap:
    path = V.COST_MEAN.path(cell=cell)
    m = np.asarray(record[path][row], dtype=float)
    E, K = m.shape
    return Heatmap(m, edge_names(record, cell, E), op_names(record, K),
                   f"{cell} cell: cost mean E[C], C = ∂L/∂Z, {epoch_span(record, path, row)}", f"E[C]  (L: batch-mean loss; {COST_SIGN})",
                   signed=True, step=step_of(record, row))


@heatmap(V.COST_VAR, name="cost_std", file="cost_{cell}_std", paper="wiring supplement §2 (spread behind Figs 5, 6)",
         caption="Standard deviation of the cost over the same observations as the cost mean: where it dwarfs |E[C]| "
                 "the sign of the mean is noise.")
def cost_std(record, cell: str, row: int) -> Heatmap:
    path = V.COST_VAR.path(cell=cell)
    var = np.asarray(record[path][row], dtype=float)
    s = np.sqrt(np.clip(var, 0, None))
    s[np.isneginf(var)] = -np.inf  # hatched and counted as the −inf it is; the clip made it a 0 cell
    E, K = s.shape
    return Heatmap(s, edge_names(record, cell, E), op_names(record, K),
                   f"{cell} cell: cost std √Var[C], {epoch_span(record, path, row)}", "√Var[C]  (L: batch-mean loss; ≥ 0)",
                   signed=False, step=step_of(record, row))
