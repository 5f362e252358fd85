"""Figures of ASM-NAS: the attention coefficients per cell type as edge × op heatmaps (asm-nas Fig. 4) and
the per-sample argmax counts of the selection pass."""

from __future__ import annotations

import numpy as np

from nasdiag import vocabulary as V
from nasdiag.plot.registry import Heatmap, heatmap
from nasdiag.plot.style import edge_names, op_names, step_of


def _edge_op_heatmap(record, family, cell: str, row: int, title: str, label: str) -> Heatmap:
    m = np.asarray(record[family.path(cell=cell)][row], dtype=float)
    E, K = m.shape
    step = step_of(record, row)
    return Heatmap(m, edge_names(record, cell, E), op_names(record, K), title.format(cell=cell, step=step), label,
                   signed=False, step=step)


@heatmap(V.ATTENTION_MEAN, name="attention", file="attention_{cell}_heatmap",
         paper="asm-nas Fig. 4 (there one panel per cell of 15; nasdiag records the mean over the cells of a type)",
         caption="Batch-mean attention a (eq 4.5) per edge and op at the step, averaged over the cells of the type: "
                 "which candidate outputs the self-attention modules emphasise.")
def attention_mean(record, cell: str, row: int) -> Heatmap:
    return _edge_op_heatmap(record, V.ATTENTION_MEAN, cell, row, "{cell} cell: mean attention at step {step}",
                            "attention a (batch mean)")


@heatmap(V.ATTENTION_COUNT, name="attention_counts", file="attention_count_{cell}_heatmap",
         paper="asm-nas Algorithm 1, lines 6-12 (selection)",
         caption="Per-sample argmax counts of the attention over the search-val split (summed over the cells of the "
                 "type): the op with the most counts on an edge is the one ASM-NAS selects.")
def attention_counts(record, cell: str, row: int) -> Heatmap:
    return _edge_op_heatmap(record, V.ATTENTION_COUNT, cell, row, "{cell} cell: selection counts after step {step}",
                            "samples with this op's a largest")
