"""Write every figure a record supports into a folder."""

from __future__ import annotations

from pathlib import Path
from typing import List

import matplotlib.pyplot as plt

from nasdiag.plot import figures

FORMATS = ("png", "pdf", "svg")


def write_figures(record_path, out_dir, fmt: str = "png", dpi: int = 120) -> List[Path]:
    """Draw every figure the record at ``record_path`` supports into ``out_dir``.

    Always: ``scalars``; per cell type with architecture records: ``arch_<type>_heatmap`` (final
    weights, edge x op) and ``arch_<type>_evolution``; per cell type with cost or Hessian records:
    ``cost_<type>_heatmap``, ``hessian_<type>_heatmap``.

    Returns:
        The written files, in order.
    """
    from nasdiag.record import load

    if fmt not in FORMATS:
        raise figures.PlotError(f"unknown figure format {fmt!r}; choose one of {', '.join(FORMATS)}")
    record = load(record_path)
    if len(record["step"]) == 0:
        raise figures.PlotError(f"record {record_path} has no committed rows yet; nothing to plot")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [("scalars", lambda: figures.scalar_curves(record))]
    for cell_type in figures.cell_types(record, "arch"):
        jobs.append((f"arch_{cell_type}_heatmap", lambda c=cell_type: figures.arch_heatmap(record, c)))
        jobs.append((f"arch_{cell_type}_evolution", lambda c=cell_type: figures.arch_evolution(record, c)))
    for cell_type in figures.cell_types(record, "cost"):
        if f"cost/{cell_type}/mean" in record:
            jobs.append((f"cost_{cell_type}_heatmap", lambda c=cell_type: figures.cost_heatmap(record, c)))
    for cell_type in figures.cell_types(record, "hessian"):
        if f"hessian/{cell_type}/diag" in record:
            jobs.append((f"hessian_{cell_type}_heatmap", lambda c=cell_type: figures.hessian_heatmap(record, c)))
    written = []
    for name, draw in jobs:
        fig = draw()
        path = out / f"{name}.{fmt}"
        try:
            fig.savefig(path, dpi=dpi)
        finally:
            plt.close(fig)
        written.append(path)
    return written
