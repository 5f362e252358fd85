"""Figures of the sampling methods (SNAS, DSNAS, ProxylessNAS): the relaxation's temperature and the
entropy of p over steps, and how often each op of each edge was sampled."""

from __future__ import annotations

import numpy as np

from nasdiag import vocabulary as V
from nasdiag.plot.registry import Heatmap, NothingToDraw, figure, heatmap
from nasdiag.plot.style import PAGE, edge_names, integer_steps, marked_series, op_names, plot_series, plt, step_of


@figure((V.SAMPLE_TEMPERATURE, V.SAMPLE_ENTROPY), name="sampling", file="sampling_temperature_entropy",
        caption="The Gumbel-softmax temperature τ of each step's sample (SNAS, annealed per epoch) and the mean "
                "entropy of p = softmax(α) per edge: how far the architecture distribution is from one-hot.")
def temperature_entropy(record, cell=None):
    panels = []
    for fam, label in ((V.SAMPLE_TEMPERATURE, "temperature τ"), (V.SAMPLE_ENTROPY, "mean entropy of p (nats)")):
        try:  # one NaN in every row is kept as a panel of marks when the other has values
            panels.append((label, *marked_series(record, fam.pattern)))
        except NothingToDraw:
            continue
    if not any(np.isfinite(values).any() for _, _, values in panels):
        raise NothingToDraw("neither the temperature nor the entropy has a finite value")
    fig, axes = plt.subplots(1, len(panels), figsize=(PAGE * len(panels) / 2, 2.2), squeeze=False)
    for ax, (label, steps, values) in zip(axes.ravel(), panels):
        plot_series(ax, steps, values, lw=1.1, marker="o" if len(steps) < 30 else None, ms=3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=6, frameon=False)
        ax.set_title(label, loc="left")
        ax.set_xlabel("step")
        integer_steps(ax)
    if any(label.startswith("mean entropy") for label, *_ in panels):
        ceiling = _uniform_entropy(record)
        if ceiling is not None:  # the uniform distribution's entropy, the ceiling
            axes.ravel()[-1].axhline(ceiling[0], color="grey", lw=0.8, ls="--", label=f"{ceiling[1]} = {ceiling[0]:.2f}")
            axes.ravel()[-1].legend(fontsize=6, frameon=False)
    fig.suptitle("Sampling: temperature and entropy")
    return fig


def _uniform_entropy(record):
    """(value, label) of the mean entropy's ceiling, the uniform p on every edge: log K, or where the cell types have
    different K the mean of log K over the edges of every cell type, as ``scalars/entropy`` averages (the first cell
    type's log K was drawn); None without (E, K) rows to read E and K from."""
    shapes = [np.shape(record[k])[1:] for k in record if V.ARCH_PROBABILITIES.regex.match(k)]
    shapes = shapes or [np.shape(record[k])[1:] for k in record if V.SAMPLE_COUNT.regex.match(k)]
    shapes = [s for s in shapes if len(s) == 2 and s[0] > 0 and s[1] > 0]
    if not shapes:
        return None
    if len({K for _, K in shapes}) == 1:
        return float(np.log(shapes[0][1])), "log K"
    return float(sum(E * np.log(K) for E, K in shapes) / sum(E for E, _ in shapes)), "mean log K over the edges"


@heatmap(V.SAMPLE_COUNT, name="sample_counts", file="sample_count_{cell}_heatmap",
         paper="wiring supplement Fig. 6b protocol (DSNAS cost means over sampled ops)",
         caption="How many times each op of each edge was sampled up to the step (DSNAS one-hot samples, "
                 "ProxylessNAS binary gates): the number of observations behind each DSNAS cost mean.")
def sample_counts(record, cell: str, row: int) -> Heatmap:
    path = V.SAMPLE_COUNT.path(cell=cell)
    m = np.asarray(record[path][row], dtype=float)
    E, K = m.shape
    step = step_of(record, row)
    return Heatmap(m, edge_names(record, cell, E), op_names(record, K),
                   f"{cell} cell: samples per op up to step {step}", "times sampled (cumulative)",
                   signed=False, step=step)
