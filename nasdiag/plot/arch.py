"""Architecture figures (``arch/<cell>/...``): the distribution as deviation from uniform, its evolution
per edge, and the derived genotype drawn as a cell."""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from nasdiag import vocabulary as V
from nasdiag.plot import cells as C
from nasdiag.plot.registry import Heatmap, NothingToDraw, figure, heatmap, valid_rows
from nasdiag.plot.style import (
    PAGE, edge_names, epoch_of, grid_shape, integer_steps, legend_outside, op_names, plot_series, plt, series, step_of,
    wrap,
)
from nasdiag.record.schema import loads_json  # reads the NaN form of the record's JSON ({"__float__": "nan"})

#: newer records hold the distribution the genotype comes from; older ones only the mixing weights Z
ARCH_FAMILIES = (V.ARCH_PROBABILITIES, V.ARCH_WEIGHTS)


def arch_path(record, cell: str) -> str:
    for fam in ARCH_FAMILIES:
        path = fam.path(cell=cell)
        if path in record:
            return path
    raise NothingToDraw(f"the record has no arch/{cell}/probabilities or arch/{cell}/weights")


def _quantity(path: str) -> str:
    return "p = probabilities()" if path.endswith("probabilities") else "mixing weight Z"


def _symbol(path: str) -> str:
    """The symbol of `_quantity`: the colour bar of an old record's weights names Z, as its title does, not p."""
    return "p" if path.endswith("probabilities") else "Z"


@heatmap(ARCH_FAMILIES, name="arch", file="arch_{cell}_heatmap", paper="DARTS Fig. 3-style weights; wiring supplement Figs 2, 4 (last epoch)",
         caption="The architecture distribution of each edge as its deviation from uniform, p − 1/K: red ops gained "
                 "weight, blue ops lost it; a flat map means the search has not moved.")
def arch_deviation(record, cell: str, row: int) -> Heatmap:
    path = arch_path(record, cell)
    stored = np.asarray(record[path][row])
    p = stored.astype(float)
    E, K = p.shape
    deviation = p - 1.0 / K
    if stored.dtype.kind == "f":  # 1/K as the record stores it (float32: 1/3 is 0.33333334) is uniform, not 1e-8 above it
        deviation[stored == stored.dtype.type(1.0 / K)] = 0.0
    return Heatmap(deviation, edge_names(record, cell, E), op_names(record, K),
                   f"{cell} cell: {_quantity(path)} − 1/K, step {step_of(record, row)}",
                   f"{_symbol(path)} − 1/K  (K = {K}; > 0: above uniform)", signed=True, step=step_of(record, row))


@figure(ARCH_FAMILIES, name="arch_evolution", file="arch_{cell}_evolution", paper="wiring supplement Figs 2, 4",
        caption="How the architecture distribution of each edge moved over the search, one line per op, with the "
                "uniform 1/K as a dashed reference.")
def arch_evolution(record, cell: str):
    path = arch_path(record, cell)
    steps, values = series(record, path)
    T, E, K = values.shape
    ops, edges = op_names(record, K), edge_names(record, cell, E)
    rows, cols = grid_shape(E, 5)
    fig, axes = plt.subplots(rows, cols, figsize=(PAGE, 0.5 + 1.25 * rows), sharex=True, sharey=True, squeeze=False)
    colors = plt.get_cmap("tab10" if K <= 10 else "tab20")(np.arange(K))
    finite = values[np.isfinite(values)]  # an inf would make the y limit infinite; it is marked at the top instead
    top = float(finite.max()) if finite.size else 1.0
    bottom = min(0.0, float(finite.min()) * 1.05) if finite.size else 0.0  # signed Z of old records stays in view
    for e, ax in enumerate(axes.ravel()):
        if e >= E:
            ax.axis("off")
            continue
        ax.axhline(1.0 / K, color="#888888", ls="--", lw=0.8, label="uniform 1/K")
        for k in range(K):
            plot_series(ax, steps, values[:, e, k], color=colors[k], lw=1.0, label=ops[k])
        ax.set_title(f"edge {edges[e]}", fontsize=7, loc="left", pad=2)
        ax.set_ylim(bottom, max(top * 1.05, 1.5 / K))
        integer_steps(ax)
    legend_outside(fig, axes)
    fig.supxlabel("step")
    fig.supylabel(_quantity(path))
    fig.suptitle(f"{cell} cell: evolution of the architecture distribution per edge")
    return fig


# -- genotypes -----------------------------------------------------------------------------------------
def _meta_json(record, key: str):
    if f"meta/{key}" not in record:
        return None
    try:
        return loads_json(str(record[f"meta/{key}"]))
    except ValueError:
        return str(record[f"meta/{key}"])


def _latest(record, fam, cell: str, row: int) -> Optional[np.ndarray]:
    """``fam`` of ``cell`` at its last valid row up to ``row``, or None."""
    path = fam.path(cell=cell)
    if path in record:
        rows = valid_rows(record, path)
        rows = rows[rows <= row]
        if rows.size:
            return np.asarray(record[path][rows[-1]])
    return None


def _mixed_mask(record, cell: str, row: int) -> Optional[np.ndarray]:
    """Surviving ops of mixed-path methods at ``row`` (SparseNAS non-zeros, BayesNAS switches), or None."""
    for fam in (V.SPARSITY_NONZERO, V.BAYES_SWITCH):
        found = _latest(record, fam, cell, row)
        if found is not None:
            return found.astype(bool)
    return None


def _eligible(record, cell: str, row: int, p: np.ndarray):
    """The distribution and the ops a genotype may name at ``row``, as the method derives them: XNAS the experts
    alive (u from ln v, no float32 underflow), ASM-NAS the ops its last selection chose (count > 0); else all."""
    alive, log_v = _latest(record, V.REGRET_ALIVE, cell, row), _latest(record, V.REGRET_LOG_WEIGHTS, cell, row)
    if alive is not None and log_v is not None and alive.shape == p.shape == log_v.shape:
        z = np.where(alive.astype(bool), log_v.astype(float), -np.inf)
        z = np.exp(z - z.max(-1, keepdims=True))
        return z / z.sum(-1, keepdims=True), alive.astype(bool)
    if alive is not None and alive.shape == p.shape:
        return p, alive.astype(bool)
    counts = _latest(record, V.ATTENTION_COUNT, cell, row)
    if counts is not None and counts.shape == p.shape:
        counts = counts.astype(float)
        return counts / np.maximum(counts.sum(-1, keepdims=True), 1), counts > 0
    return p, None


def cell_genes(record, cell: str, row: int) -> List[C.Gene]:
    """The genotype of ``cell`` at ``row``: the recorded genotype (``meta/genotype``) for the last row if
    there is one; every surviving op for mixed-path methods, removed nodes dropped; else the DARTS rule
    (``nasdiag.supernet.derive_genotype``: two strongest non-``none`` inputs per node) on the distribution, naming
    only the experts alive (XNAS) or the ops selected (ASM-NAS counts), as the method's own genotype does."""
    path = arch_path(record, cell)
    p = np.asarray(record[path][row], dtype=float)
    E, K = p.shape
    steps = C.steps_of(E)
    ops = op_names(record, K)
    recorded = _meta_json(record, "genotype")
    if recorded is not None and row == int(valid_rows(record, path)[-1]):
        genotype = C.parse_genotype(recorded)
        if genotype.get(cell):
            return C.genes_from_pairs(genotype[cell], steps)
    mask = _mixed_mask(record, cell, row)
    if mask is not None:
        from nasdiag.supernet import MixedGenotype, edge_nodes
        from nasdiag.supernet.genotype import without_removed_nodes

        genes = [(ops[k], i, j) for e, (i, j) in enumerate(edge_nodes(steps)) for k in range(K) if mask[e, k] and ops[k] != "none"]
        return without_removed_nodes(MixedGenotype(genes, [], [], [])).normal  # as the methods' genotype: removed nodes dropped
    if not np.isfinite(p).all():
        raise NothingToDraw(f"{path} has NaN at step {step_of(record, row)}; no genotype to derive")
    import torch

    from nasdiag.supernet import derive_cell  # the per-cell rule of derive_genotype

    p, eligible = _eligible(record, cell, row, p)
    try:
        genes = derive_cell(torch.as_tensor(p), steps, ops, eligible=None if eligible is None else torch.as_tensor(eligible))
    except ValueError as exc:  # e.g. a recorded mask with an edge where nothing is alive
        raise NothingToDraw(f"no genotype at step {step_of(record, row)}: {exc}") from None
    return C.genes_from_pairs(genes, steps)


def _concat(record, steps: int) -> List[int]:
    config = _meta_json(record, "config")
    multiplier = int(config.get("multiplier") or steps) if isinstance(config, dict) else steps
    return list(range(2 + steps - multiplier, 2 + steps))


@figure(ARCH_FAMILIES, name="genotype", file="genotype_{cell}", rows=True, paper="DARTS Figs 4, 5 (cells); XNAS Fig. 9",
        caption="The derived cell: for each intermediate node its two strongest inputs with their strongest op other than "
                "none (DARTS rule), or every surviving op for mixed-path methods; dashed arrows are the concatenated outputs.")
def genotype_cell(record, cell: str, row: int):
    path = arch_path(record, cell)
    steps = C.steps_of(record[path].shape[1])
    genes = cell_genes(record, cell, row)
    # a node no op enters was removed (mixed-path methods: without_removed_nodes), and with it its place in the output
    # concatenation, as in the method's genotype; every node of a DARTS-rule cell has its inputs
    concat = [n for n in _concat(record, steps) if any(j == n for _, _, j in genes)]
    return C.cell_figure(genes, steps, concat, f"{cell} cell, derived at step {step_of(record, row)}")


@figure(ARCH_FAMILIES, name="wiring", file="wiring_{cell}", paper="wiring supplement Figs 1, 3",
        caption="The most probable wiring after each epoch: on every edge the op of highest probability, the edge "
                "dropped where that op is none, drawn as a cell.")
def wiring_evolution(record, cell: str):
    path = arch_path(record, cell)
    series(record, path)  # NothingToDraw when there are no rows or only NaN
    rows = valid_rows(record, path)
    rows = rows[np.isfinite(record[path][rows]).all(axis=(1, 2))]
    if rows.size == 0:  # finite values, but a NaN/inf in every row: no row has a wiring
        raise NothingToDraw(f"{path} has a NaN or inf in every row; no wiring to derive")
    if "scalars/epoch" in record:  # one cell per epoch end, else a few evenly spaced rows
        ends = np.flatnonzero(record.get("valid/scalars/epoch", np.zeros(len(record["step"]), bool)))
        picked = [int(rows[rows <= r][-1]) for r in ends if (rows <= r).any()]
    else:
        picked = []
    if not picked:
        picked = sorted({int(rows[i]) for i in np.linspace(0, rows.size - 1, min(rows.size, 6)).round().astype(int)})
    # an epoch whose row holds a NaN/inf falls back to the previous epoch's row: that row is drawn once, not twice
    picked = list(dict.fromkeys([int(rows[0])] + picked))
    if len(picked) > 12:  # at most 12 panels: first, last and evenly spaced between
        picked = [picked[int(i)] for i in np.linspace(0, len(picked) - 1, 12).round()]
    E, K = record[path].shape[1:]
    steps, ops = C.steps_of(E), op_names(record, K)
    n_rows, n_cols = grid_shape(len(picked), 3)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(PAGE, 0.3 + (0.5 + 0.3 * steps) * n_rows), squeeze=False)
    for ax, row in zip(axes.ravel(), picked):
        genes = C.most_probable_wiring(np.asarray(record[path][row], dtype=float), ops)
        label = f"step {step_of(record, row)}"
        epoch = epoch_of(record, row)
        if epoch is not None:
            label = f"epoch {epoch} ({label})"
        C.draw_cell(ax, genes, steps, _concat(record, steps), label, short=True)
    for ax in axes.ravel()[len(picked):]:
        ax.axis("off")
    short = [f"{C.short_name(op)} = {op}" for op in ops if C.short_name(op) != op]  # the record's ops, not DARTS's
    title = f"{cell} cell: most probable wiring over the search" + (f" ({', '.join(short)})" if short else "")
    unfinished = [step_of(record, r) for r in valid_rows(record, path) if not np.isfinite(record[path][r]).all()]
    if unfinished:  # the rows left out: a reader must not take the next panel for them
        title += f"  [no wiring at step {', '.join(map(str, unfinished[:5]))}{', ...' if len(unfinished) > 5 else ''}: NaN/inf]"
    fig.suptitle(wrap(title, PAGE, 9))
    return fig
