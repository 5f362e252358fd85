"""Seaborn figures from records: architecture heatmaps and evolution, scalar curves, cost and Hessian heatmaps."""

from nasdiag.plot.figures import (
    PlotError,
    arch_evolution,
    arch_heatmap,
    cost_heatmap,
    hessian_heatmap,
    matrix_heatmap,
    scalar_curves,
)
from nasdiag.plot.files import FORMATS, write_figures

__all__ = [
    "FORMATS",
    "PlotError",
    "arch_evolution",
    "arch_heatmap",
    "cost_heatmap",
    "hessian_heatmap",
    "matrix_heatmap",
    "scalar_curves",
    "write_figures",
]
