"""Figures drawn from records (files), never from live models, so any old run can be redrawn.

Every function takes the dict returned by :func:`nasdiag.record.load` and returns a matplotlib Figure.
"""

from __future__ import annotations

from nasdiag.errors import NasdiagError
from typing import Dict, List, Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # batch scripts have no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import seaborn as sns  # noqa: E402


class PlotError(NasdiagError, ValueError):
    """A record lacks what a figure needs; the message names the missing path."""


def _strings(record: Dict[str, np.ndarray], key: str, n: int, prefix: str) -> List[str]:
    if key in record:
        return [str(s) for s in np.atleast_1d(record[key])]
    return [f"{prefix}{i}" for i in range(n)]


def op_names(record: Dict[str, np.ndarray], n: int) -> List[str]:
    return _strings(record, "meta/op_names", n, "op ")


def edge_names(record: Dict[str, np.ndarray], cell_type: str, n: int) -> List[str]:
    return _strings(record, f"meta/edge_names/{cell_type}", n, "edge ")


def cell_types(record: Dict[str, np.ndarray], group: str = "arch") -> List[str]:
    """Cell types with at least one dataset under ``<group>/``, in record order."""
    found = []
    for key in record:
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == group and parts[1] not in found:
            found.append(parts[1])
    return found


def _series(record: Dict[str, np.ndarray], path: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows in which ``path`` was logged."""
    if path not in record:
        available = ", ".join(k for k in record if not k.startswith(("valid/", "meta/"))) or "none"
        raise PlotError(f"record has no {path!r}; available: {available}")
    valid = record.get(f"valid/{path}", np.ones(len(record["step"]), bool))
    return record["step"][valid], record[path][valid]


def matrix_heatmap(
    matrix: np.ndarray,
    rows: Sequence[str],
    cols: Sequence[str],
    title: str,
    center: Optional[float] = None,
    cmap: str = "viridis",
    annotate: bool = True,
) -> plt.Figure:
    """A seaborn heatmap of an (edges x ops) matrix. NaN cells are left blank and counted in the title."""
    matrix = np.asarray(matrix, dtype=float)
    n_nan = int(np.isnan(matrix).sum())
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(cols), 1.0 + 0.45 * len(rows)))
    sns.heatmap(
        matrix,
        ax=ax,
        xticklabels=cols,
        yticklabels=rows,
        cmap="RdBu_r" if center is not None else cmap,
        center=center,
        annot=annotate and matrix.size <= 200,
        fmt=".3f" if np.nanmax(np.abs(matrix), initial=0) < 10 else ".2g",
        annot_kws={"fontsize": 7},
        cbar=True,
    )
    ax.set_xlabel("operation")
    ax.set_ylabel("edge")
    ax.set_title(title + (f"  [{n_nan} NaN]" if n_nan else ""))
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    return fig


def arch_heatmap(record: Dict[str, np.ndarray], cell_type: str, quantity: str = "weights", row: int = -1) -> plt.Figure:
    """Architecture weights (or raw parameters) of one cell type at one recorded row, edge x op."""
    return _row_heatmap(record, f"arch/{cell_type}/{quantity}", f"architecture {quantity}", cell_type, row)


def arch_evolution(record: Dict[str, np.ndarray], cell_type: str, quantity: str = "weights") -> plt.Figure:
    """One panel per edge, one line per op: how the mixing weights moved over the search
    (the wiring paper's Figs 2 and 4)."""
    steps, values = _series(record, f"arch/{cell_type}/{quantity}")
    T, E, K = values.shape
    ops = op_names(record, K)
    edges = edge_names(record, cell_type, E)
    cols = min(E, 5)
    rows = int(np.ceil(E / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), sharex=True, squeeze=False)
    palette = sns.color_palette("tab10", K)
    for e in range(rows * cols):
        ax = axes[e // cols][e % cols]
        if e >= E:
            ax.axis("off")
            continue
        for k in range(K):
            ax.plot(steps, values[:, e, k], color=palette[k], lw=1.2, label=ops[k])
        ax.set_title(f"edge {edges[e]}", fontsize=9)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6, loc="best")
    fig.supxlabel("step")
    fig.supylabel(quantity)
    fig.suptitle(f"{cell_type} cell: evolution of architecture {quantity}")
    fig.tight_layout()
    return fig


def scalar_curves(record: Dict[str, np.ndarray], names: Optional[Sequence[str]] = None) -> plt.Figure:
    """Losses on one panel, accuracies on another, everything else on a third."""
    if names is None:
        names = [k[len("scalars/") :] for k in record if k.startswith("scalars/") and record[k].ndim == 1]
    groups = {"loss": [], "accuracy": [], "other": []}
    for name in names:
        key = "loss" if "loss" in name else "accuracy" if "acc" in name else "other"
        groups[key].append(name)
    panels = [(g, n) for g, n in groups.items() if n]
    if not panels:
        raise PlotError("record has no scalars/ datasets to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, (group, members) in zip(axes[0], panels):
        for name in members:
            steps, values = _series(record, f"scalars/{name}")
            ax.plot(steps, values, lw=1.2, marker="o" if len(steps) < 30 else None, ms=3, label=name)
        ax.set_title(group)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _row_heatmap(
    record: Dict[str, np.ndarray], path: str, title: str, cell_type: str, row: int, center: Optional[float] = None
) -> plt.Figure:
    """Heatmap of the (E, K) value of ``path`` at one recorded row."""
    steps, values = _series(record, path)
    if len(steps) == 0:
        raise PlotError(f"record has no rows with {path}")
    matrix = values[row]
    E, K = matrix.shape
    return matrix_heatmap(
        matrix,
        edge_names(record, cell_type, E),
        op_names(record, K),
        f"{cell_type} cell: {title} at step {int(steps[row])}",
        center=center,
    )


def cost_heatmap(record: Dict[str, np.ndarray], cell_type: str, row: int = -1) -> plt.Figure:
    """Cost mean E[C] per op x edge (the wiring paper's Figs 5, 6, 19–21), centred at 0."""
    return _row_heatmap(record, f"cost/{cell_type}/mean", "cost mean E[C]", cell_type, row, center=0.0)


def hessian_heatmap(record: Dict[str, np.ndarray], cell_type: str, row: int = -1) -> plt.Figure:
    """Diagonal Hessian of the mixing weights per op x edge, centred at 0."""
    return _row_heatmap(record, f"hessian/{cell_type}/diag", "diag d2L/dZ2", cell_type, row, center=0.0)
