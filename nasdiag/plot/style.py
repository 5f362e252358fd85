"""Shared look of nasdiag figures and the helpers every figure module uses.

Sizes are for a two-column paper: one column is 3.4 in wide, fonts are 7-8 pt, so a figure placed at
its natural size stays readable. Signed quantities get a diverging map centred at 0 (``RdBu_r``: red
positive), non-negative ones a sequential map (``viridis``). Annotations never print ``-0.000``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple


def _import_matplotlib():
    """Import matplotlib and pyplot with the Agg backend, and return both.

    Figures are always drawn with Agg into files, whatever MPLBACKEND names; matplotlib validates MPLBACKEND when it
    is imported, so an invalid one (a typo, a GUI backend of another machine) was a traceback at the end of a whole
    search. It is hidden from that first import only, and left set for everything else.

    What matplotlib logs while it loads is said as one warning: with no writable home (``HOME=/nonexistent`` of a
    service account, ``HOME=/dev/null``) plot, report and the end of a search printed two lines of its logger ("mkdir -p
    failed for path ...", then four lines' worth on a temporary cache folder), neither a nasdiag line."""
    import logging
    import warnings

    said: List[str] = []

    class _Said(logging.Handler):
        def emit(self, record):
            said.append(" ".join(record.getMessage().split()))

    log, handler = logging.getLogger("matplotlib"), _Said(logging.WARNING)
    propagate, log.propagate = log.propagate, False
    log.addHandler(handler)
    backend = os.environ.pop("MPLBACKEND", None)
    try:
        import matplotlib
        matplotlib.use("Agg")  # batch scripts and reports have no display
        import matplotlib.pyplot as pyplot
    finally:
        if backend is not None:
            os.environ["MPLBACKEND"] = backend
        log.removeHandler(handler)
        log.propagate = propagate
    temporary = [m for m in said if m.startswith("Matplotlib created a temporary")]
    reasons = [m for m in said if m not in temporary]
    if temporary:  # its reasons and its remedy in one line
        warnings.warn(f"matplotlib found no writable folder for its settings and font cache ({'; '.join(reasons) or 'no home folder'}), "
                      "so it uses a temporary one, removed at exit, and rebuilds its font cache at each run: set MPLCONFIGDIR "
                      "to a writable folder", stacklevel=2)
    else:
        for message in reasons:
            warnings.warn(f"matplotlib: {message}", stacklevel=2)
    return matplotlib, pyplot


matplotlib, plt = _import_matplotlib()
import numpy as np  # noqa: E402
from matplotlib.colors import Normalize, TwoSlopeNorm  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from nasdiag.plot.registry import (  # noqa: E402
    NONFINITE_KINDS, Heatmap, NothingToDraw, nonfinite_counts, nonfinite_text, valid_rows,
)

COLUMN = 3.4  # inches: one column of a two-column paper
PAGE = 7.0  # inches: both columns
DIVERGING = "RdBu_r"
SEQUENTIAL = "viridis"
RC = {
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "figure.titlesize": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "figure.constrained_layout.use": True,
    "svg.fonttype": "none",
    "pdf.fonttype": 42,
}


@contextmanager
def paper_style():
    """rcParams of every nasdiag figure (fonts readable in a two-column paper, constrained layout)."""
    with matplotlib.rc_context(RC):
        yield


# -- record access -----------------------------------------------------------------------------------
def _strings(record: Mapping[str, np.ndarray], key: str, n: int, prefix: str) -> List[str]:
    if key in record:
        names = [str(s) for s in np.atleast_1d(record[key])]
        if len(names) == n:
            return names
    return [f"{prefix}{i}" for i in range(n)]


def op_names(record: Mapping[str, np.ndarray], n: int) -> List[str]:
    """The K candidate op names of the record (``meta/op_names``), else ``op 0 .. op K-1``."""
    return _strings(record, "meta/op_names", n, "op ")


def edge_names(record: Mapping[str, np.ndarray], cell: str, n: int) -> List[str]:
    """The E edge labels ``i->j`` of a cell type (``meta/edge_names/<cell>``), else ``edge 0 ..``."""
    return _strings(record, f"meta/edge_names/{cell}", n, "edge ")


def none_finite(values: np.ndarray, all_nan: str, subject: str) -> str:
    """Why ``values`` (none finite) have nothing to draw: ``all_nan`` where they are all NaN (or none), else
    ``subject`` with their counts (an all-inf map or curve was said to be NaN)."""
    counts = nonfinite_counts(np.asarray(values, dtype=float))
    return all_nan if set(counts) <= {"NaN"} else f"{subject} no finite value ({nonfinite_text(counts)})"


def series(record: Mapping[str, np.ndarray], path: str) -> Tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows in which ``path`` was logged; `NothingToDraw` if there are none or
    no value is finite (NaN, ±inf)."""
    rows = valid_rows(record, path)
    values = np.asarray(record[path][rows], dtype=float)
    if rows.size == 0:
        raise NothingToDraw(f"{path} has no rows yet")
    if not np.isfinite(values).any():
        raise NothingToDraw(f"{path} {none_finite(values, 'is NaN in every row', 'has')}; nothing to draw")
    return record["step"][rows], values


def marked_series(record: Mapping[str, np.ndarray], path: str) -> Tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows in which ``path`` was logged, also when none is finite: a curve of a figure
    whose other curves have values, drawn with `plot_series`, then shows only its NaN/inf marks instead of
    vanishing. `NothingToDraw` if there are no rows."""
    rows, steps = logged_rows(record, path)
    return steps, np.asarray(record[path][rows], dtype=float)


def logged_rows(record: Mapping[str, np.ndarray], path: str) -> Tuple[np.ndarray, np.ndarray]:
    """(rows, steps) in which ``path`` was logged; `NothingToDraw` if there are none yet."""
    rows = valid_rows(record, path)
    if rows.size == 0:
        raise NothingToDraw(f"{path} has no rows yet")
    return rows, np.asarray(record["step"])[rows]


def ops_on_per_edge(record: Mapping[str, np.ndarray], cell: str, path: str, *, ylabel: str, title: str,
                    width: float = COLUMN):
    """Step plot of how many ops of each edge are still on over the steps, from a boolean ``(T, E, K)`` mask
    family (XNAS's alive experts, BayesNAS's switches); the y axis runs over 1..K."""
    rows, steps = logged_rows(record, path)
    on = np.asarray(record[path][rows]).astype(bool)
    counts, (E, K) = on.sum(-1), on.shape[1:]  # counts: (T, E)
    names = edge_names(record, cell, E)
    fig, ax = plt.subplots(figsize=(width, 2.4))
    colors = plt.get_cmap("tab20")
    # a small vertical offset per edge keeps overlapping step curves apart; all of them within ±0.3, so that a curve
    # stays nearest its count and inside the 0.5..K+0.5 axis (0.04 apart, 30 edges put a 1-op edge at 0.42, off it)
    pitch = min(0.04, 0.6 / max(E - 1, 1))
    for e in range(E):
        y = counts[:, e] + pitch * (e - (E - 1) / 2)
        ax.step(steps, y, where="post", color=colors(e % 20), lw=1.0, label=names[e])
        mark_isolated(ax, steps, y, color=colors(e % 20))  # one row (one step, one update): a dot, not empty axes
    ax.set_ylim(0.5, K + 0.5)
    ax.set_yticks(range(1, K + 1))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    integer_steps(ax)
    ax.legend(fontsize=5, frameon=False, ncol=2)
    ax.set_title(title, loc="left")
    return fig


def epoch_span(record: Mapping[str, np.ndarray], path: str, row: int) -> str:
    """Which steps an epoch statistic at ``row`` averages: ``"steps a-b (epoch e)"``.

    Epoch statistics (cost moments) cover the steps after the previous epoch end, up to this row's step: the previous
    row that logged ``path`` or, where this row logged ``scalars/epoch`` (a search's epoch end), ``scalars/epoch``;
    the search resets the moments at every epoch end, also one that logged no row of ``path`` (a cell type with no
    cost observation that epoch). The first one starts at the record's first step.
    """
    rows = valid_rows(record, path)
    if epoch_of(record, row) is not None:
        rows = np.union1d(rows, valid_rows(record, "scalars/epoch"))
    steps = record["step"]
    earlier = rows[rows < row]
    first = int(steps[earlier[-1]]) + 1 if earlier.size else int(steps[0])
    last = int(steps[row])
    text = f"steps {first}-{last}" if first < last else f"step {last}"
    epoch = epoch_of(record, row)
    if epoch is not None:
        text += f" (epoch {epoch})" if epoch >= 0 else " (before training)"
    return text


def epoch_of(record: Mapping[str, np.ndarray], row: int) -> Optional[int]:
    """The epoch logged in ``row`` (``scalars/epoch``), or None where it was not logged or is NaN/inf (a
    figure then names the row by its step)."""
    if "scalars/epoch" not in record or not record.get("valid/scalars/epoch", np.ones(len(record["step"]), bool))[row]:
        return None
    epoch = float(record["scalars/epoch"][row])
    return int(epoch) if math.isfinite(epoch) else None


def step_of(record: Mapping[str, np.ndarray], row: int) -> int:
    """The step (``record["step"]``) of the record's ``row``, as an int: what a figure's title names."""
    return int(record["step"][row])


# -- non-finite values: drawn, never hidden ----------------------------------------------------------------
#: how a line plot marks each kind of non-finite value at its step: (marker, y in axes coordinates)
NONFINITE_MARKERS = {"NaN": ("X", 0.0), "+inf": ("^", 1.0), "−inf": ("v", 0.0)}
#: how a heatmap fills a non-finite cell: (face colour, hatch); none of them is a colour of the maps
NONFINITE_CELLS = {"NaN": ("#d9d9d9", "xxx"), "+inf": ("#f0f0f0", "///"), "−inf": ("#f0f0f0", "\\\\\\")}


def mark_nonfinite(ax, steps, values, color=None) -> None:
    """Mark each step where the 1-D series ``values`` is NaN, +inf or −inf with a marker at the axes edge
    (NaN: ``X`` at the bottom, +inf: ``^`` at the top, −inf: ``v`` at the bottom) in the series' colour;
    the legend gets one black entry per kind ("NaN", "+inf", "−inf"), once per axes. A line plot alone
    leaves a gap at a NaN and nothing at all for an isolated finite point between NaNs."""
    steps, values = np.asarray(steps), np.asarray(values, dtype=float)
    labels = set(ax.get_legend_handles_labels()[1])
    edge = ax.get_xaxis_transform()  # x in data (steps), y in axes coordinates: the edge whatever the data
    for kind, hit in _nonfinite_masks(values).items():
        if not hit.any():
            continue
        marker, y = NONFINITE_MARKERS[kind]
        ax.plot(steps[hit], np.full(int(hit.sum()), y), ls="none", marker=marker, ms=5,
                color="k" if color is None else color,  # an RGBA array (a colormap's) has no truth value
                transform=edge, clip_on=False, zorder=5)
        if kind not in labels:  # an empty line: a legend entry for the kind, not for one series
            ax.plot([], [], ls="none", marker=marker, ms=5, color="k", label=kind)
            labels.add(kind)


def mark_isolated(ax, steps, values, color=None) -> None:
    """Draw a dot at each finite value of the 1-D series ``values`` whose neighbouring steps are not finite (or
    absent): a line without markers draws nothing there, so a record with one row, or a value between NaNs,
    would leave an empty plot."""
    steps, values = np.asarray(steps), np.asarray(values, dtype=float)
    finite = np.isfinite(values)
    before = np.concatenate([[False], finite[:-1]])
    after = np.concatenate([finite[1:], [False]])
    lone = finite & ~before & ~after
    if lone.any():
        ax.plot(steps[lone], values[lone], ls="none", marker="o", ms=2.5, color="k" if color is None else color)


def plot_series(ax, steps, values, **kwargs):
    """``ax.plot(steps, values, **kwargs)`` with the series' NaN/inf steps marked (`mark_nonfinite`) and, on a
    line without markers, a dot at each finite value with no finite neighbour (`mark_isolated`)."""
    (line,) = ax.plot(steps, values, **kwargs)
    if line.get_marker() in (None, "None", "", " "):
        mark_isolated(ax, steps, values, color=line.get_color())
    mark_nonfinite(ax, steps, values, color=line.get_color())
    return line


def _nonfinite_masks(values: np.ndarray) -> dict:
    return {"NaN": np.isnan(values), "+inf": np.isposinf(values), "−inf": np.isneginf(values)}


def integer_steps(ax) -> None:
    """Step axes show integer ticks only."""
    # min_n_ticks=1: over a single step the locator otherwise falls back to fractional ticks (0.96, 0.98, ...)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6, min_n_ticks=1))


# -- numbers -----------------------------------------------------------------------------------------
#: integers up to this are annotated as they are (6 digits fit a heatmap cell at 5.5 pt), never scaled to 1e3, 1e4 ...
INTEGER_LIMIT = 1e6


def scale_exponent(values: np.ndarray) -> int:
    """Power of ten that brings the largest |value| into [1, 1000) when it is outside [0.01, 1000); else 0.

    Integers below `INTEGER_LIMIT` (counts: samples of a long DSNAS run, argmax votes) are not scaled: scaled, 1247
    and 3 samples were annotated ``1.25`` and ``3e-3`` (x 1e3), no longer the counts they are."""
    finite = np.abs(values[np.isfinite(values)])
    top = float(finite.max()) if finite.size else 0.0
    if top == 0.0 or 0.01 <= top < 1000 or top < INTEGER_LIMIT and np.array_equal(finite, np.round(finite)):
        return 0
    return int(math.floor(math.log10(top)))


def kept_exponent(values: np.ndarray, signed: Optional[bool], limits: Optional[Tuple[float, float]]) -> int:
    """`scale_exponent` of the cells the colour scale keeps (`colour_scale`): an outlier it leaves out (one diverged
    entry) set the power of ten, and every other cell was annotated with one digit (1.2e-4 and 1.4e-4 both ``1e-10``
    on a bar ``(x 1e6)``, the bar's ticks scaled twice)."""
    norm, _, clipped = colour_scale(values, signed, limits)
    if clipped is None:
        return scale_exponent(values)
    return scale_exponent(values[np.isfinite(values) & (values >= norm.vmin) & (values <= norm.vmax)])


def number(value: float, decimals: int = 2) -> str:
    """A short annotation: NaN as ``NaN``, and anything that rounds to zero as ``0`` (never ``-0.00``)."""
    if not np.isfinite(value):
        return "NaN" if np.isnan(value) else ("inf" if value > 0 else "-inf")
    text = f"{value:.{decimals}f}"
    if float(text) == 0.0:
        return "0"
    return text


def annotation(value: float, decimals: int) -> str:
    """A heatmap cell's text: :func:`number`, except that a non-zero value too small for the map's
    ``decimals`` is written ``2e-4``, so that ``0`` is only ever an exact zero (a pruned op, no cost)
    and a cell of a map spanning many decades still shows its own magnitude and sign."""
    if np.isfinite(value) and abs(value) >= 1e4 and not (value == round(value) and abs(value) < INTEGER_LIMIT):
        # a cell beyond a clipped scale, in the kept cells' units: 2.5e9, not "2500000000.00"
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    text = number(value, decimals)
    if text == "0" and value != 0:
        mantissa, exponent = f"{value:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return text


def _decimals(top: float) -> int:
    return 3 if top < 1 else 2 if top < 10 else 1 if top < 100 else 0


# -- heatmaps ----------------------------------------------------------------------------------------
#: a colour scale leaves out, as outliers, cells beyond OUTLIER_FACTOR times the 90th percentile of the cells'
#: magnitudes (so at most a tenth of the cells): one diverged entry must not flatten every other cell to one colour
OUTLIER_QUANTILE = 0.9
OUTLIER_FACTOR = 10.0


@dataclass(frozen=True)
class Clipped:
    """A colour scale that left out outlier cells: ``limit`` is the scale's end (largest |value| kept for a
    signed map, largest value kept for a sequential one), ``cells`` how many lie beyond it, ``extreme`` the
    farthest of them; in the units of the values given to `colour_scale`."""

    limit: float
    cells: int
    extreme: float
    signed: bool

    def text(self, scale: float = 1.0) -> str:
        """``"colour scale clipped at ±0.0031: 1 cell beyond it (up to 0.5) in its end colour"``,
        the numbers multiplied by ``scale`` (back to the record's units)."""
        sign = "±" if self.signed else ""
        many = "cell" if self.cells == 1 else "cells"
        return (f"colour scale clipped at {sign}{self.limit * scale:.3g}: {self.cells} {many} beyond it (up to "
                f"{self.extreme * scale:.3g}) in its end colour")


def _outlier_limit(spans: np.ndarray) -> Optional[Tuple[float, int, float]]:
    """(largest kept span, cells beyond it, largest span) when a few of the non-negative ``spans`` lie more than
    `OUTLIER_FACTOR` times beyond their `OUTLIER_QUANTILE` quantile; None when none do."""
    if spans.size == 0:
        return None
    bulk = float(np.quantile(spans, OUTLIER_QUANTILE))
    top = float(spans.max())
    if not bulk > 0 or top <= OUTLIER_FACTOR * bulk:
        return None
    kept = float(spans[spans <= OUTLIER_FACTOR * bulk].max())
    return kept, int(np.count_nonzero(spans > kept)), top


def colour_scale(values: np.ndarray, signed: Optional[bool], limits: Optional[Tuple[float, float]]):
    """(norm, colour map name, `Clipped` or None) of a heatmap of ``values`` (NaN/inf ignored).

    ``signed``: a diverging map centred at 0 (None: when any value is negative), else a sequential one from the
    smallest to the largest value. ``limits`` fixes the scale; without them a few outlier cells (see
    `OUTLIER_FACTOR`) are left out of the scale, drawn in its end colour and reported by the `Clipped`.
    """
    finite = values[np.isfinite(values)]
    if signed is None:
        signed = bool(finite.size and finite.min() < 0)
    clipped = None
    if limits is not None:
        lo, hi = limits
    elif signed:
        magnitude = np.abs(finite)
        top = float(magnitude.max()) if finite.size else 1.0
        outliers = _outlier_limit(magnitude)
        if outliers is not None:
            top = outliers[0]
            clipped = Clipped(top, outliers[1], outliers[2], True)
        lo, hi = -(top or 1.0), (top or 1.0)
    else:
        lo = float(finite.min()) if finite.size else 0.0
        hi = float(finite.max()) if finite.size else 1.0
        outliers = _outlier_limit(finite - lo)
        if outliers is not None:
            hi = lo + outliers[0]
            clipped = Clipped(hi, outliers[1], lo + outliers[2], False)
        if hi == lo:
            hi = lo + 1.0
    if signed:
        return TwoSlopeNorm(vcenter=0.0, vmin=min(lo, -1e-300), vmax=max(hi, 1e-300)), DIVERGING, clipped
    return Normalize(vmin=lo, vmax=hi), SEQUENTIAL, clipped


def _extend(clipped: Optional[Clipped]) -> str:
    """The colour bar's arrow(s) for the cells beyond a clipped scale."""
    if clipped is None:
        return "neither"
    return "both" if clipped.signed else "max"


#: inches per heatmap column at the least: op names are written at 45°, so neighbours stand LABEL_PITCH · sin 45° apart,
#: just over the height of a 7 pt tick label (0.097 in); past the page width a heatmap of many ops grows wider
#: instead of printing its op names on top of each other
LABEL_PITCH = 0.15


def _draw_matrix(ax, hm: Heatmap, matrix: np.ndarray, norm, cmap: str, annotate: bool, row_labels: bool = True,
                 absent: Optional[np.ndarray] = None):
    """``absent``: cells of an edge or op the run does not have (a comparison aligned by name), left blank but for a dash."""
    cm = plt.get_cmap(cmap).with_extremes(bad="#d9d9d9")
    image = ax.imshow(np.ma.masked_invalid(matrix), cmap=cm, norm=norm, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(hm.cols)), hm.cols, rotation=45, ha="right", rotation_mode="anchor")
    ax.set_yticks(range(len(hm.rows)), hm.rows if row_labels else [])
    ax.tick_params(length=0)
    absent = np.zeros(matrix.shape, bool) if absent is None else absent
    for i, j in np.argwhere(absent):  # white with a dash: not a colour of the maps (0 is near-white on a diverging one)
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white", lw=0.0, zorder=2))
        ax.text(j, i, "–", ha="center", va="center", fontsize=6, color="#888888", zorder=3)
    for kind, hit in _nonfinite_masks(matrix).items():
        face, hatch = NONFINITE_CELLS[kind]
        for i, j in np.argwhere(hit & ~absent):
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=face, hatch=hatch, edgecolor="#555555",
                                   lw=0.0, zorder=2))
    for spine in ax.spines.values():
        spine.set_visible(False)
    if annotate and matrix.size <= 240:
        finite = matrix[np.isfinite(matrix)]
        kept = finite[(finite >= norm.vmin) & (finite <= norm.vmax)]  # a cell beyond a clipped scale sets no decimals
        decimals = _decimals(float(np.abs(kept).max()) if kept.size else 0.0)
        if finite.size and np.array_equal(finite, np.round(finite)):
            decimals = 0  # counts (samples, argmax votes): "7", not "7.0"
        for (i, j), v in np.ndenumerate(matrix):
            if absent[i, j]:
                continue
            shade = norm(v) if np.isfinite(v) else 0.5
            dark = cmap == SEQUENTIAL and shade < 0.55 or cmap == DIVERGING and abs(float(shade) - 0.5) > 0.33
            ax.text(j, i, annotation(v, decimals), ha="center", va="center", fontsize=5.5,
                    color="white" if dark and np.isfinite(v) else "black", zorder=3)  # over a hatched cell too
    return image


def _title(hm: Heatmap, clipped: Optional[Clipped] = None, scale: float = 1.0) -> str:
    counts = nonfinite_counts(hm.matrix)
    notes = ([nonfinite_text(counts)] if counts else []) + ([clipped.text(scale)] if clipped is not None else [])
    return hm.title + "".join(f"  [{note}]" for note in notes)


def _nonfinite_legend(fig, matrices) -> None:
    """One legend under the figure for the kinds of non-finite cells the ``matrices`` hold (none: no legend)."""
    kinds = [k for k in NONFINITE_KINDS if any(nonfinite_counts(m).get(k) for m in matrices)]
    if kinds:
        handles = [Patch(facecolor=NONFINITE_CELLS[k][0], hatch=NONFINITE_CELLS[k][1], edgecolor="#555555", label=k)
                   for k in kinds]
        fig.legend(handles=handles, loc="outside lower left", ncol=len(kinds), frameon=False, fontsize=6,
                   title="non-finite cells", title_fontsize=6)


def wrap(text: str, inches: float, fontsize: float = 8.0) -> str:
    """``text`` broken into lines that fit ``inches`` at ``fontsize`` (about 16 characters per inch at 8 pt)."""
    import textwrap

    width = max(12, int(inches * 16 * 8 / fontsize))
    return "\n".join(textwrap.fill(line, width, break_long_words=False) for line in text.split("\n"))


def render_heatmap(hm: Heatmap, annotate: bool = True):
    """One heatmap figure: title, axis labels, colour bar labelled with ``hm.colorbar``."""
    matrix = np.asarray(hm.matrix, dtype=float)
    if matrix.size == 0 or not np.isfinite(matrix).any():
        raise NothingToDraw(f"{hm.title}: {none_finite(matrix, 'every value is NaN', 'it has')}; nothing to draw")
    p = kept_exponent(matrix, hm.signed, hm.limits)
    shown = matrix / 10.0**p
    limits = None if hm.limits is None else (hm.limits[0] / 10.0**p, hm.limits[1] / 10.0**p)
    norm, cmap, clipped = colour_scale(shown, hm.signed, limits)
    n_rows, n_cols = matrix.shape
    width = max(min(PAGE, max(COLUMN, 1.3 + 0.36 * n_cols)), 1.3 + LABEL_PITCH * n_cols)
    height = 1.0 + 0.2 * n_rows + 0.25
    fig, ax = plt.subplots(figsize=(width, height))
    image = _draw_matrix(ax, hm, shown, norm, cmap, annotate)
    ax.set_xlabel(hm.xlabel)
    ax.set_ylabel(hm.ylabel)
    # the title spans the axes and the colour bar; long ones wrap instead of running into the bar's label
    ax.set_title(wrap(_title(hm, clipped, 10.0**p), width - 0.9), loc="left")
    bar = fig.colorbar(image, ax=ax, shrink=0.9, pad=0.02, extend=_extend(clipped))
    bar.set_label(wrap(hm.colorbar + (f"  (x 1e{p})" if p else ""), 0.8 * (height - 0.9), 7), fontsize=7)
    _nonfinite_legend(fig, [matrix])
    return fig


def _common_names(names: Sequence[Sequence[str]]) -> Optional[List[str]]:
    """The longest list of ``names`` when it differs from another and holds the names of every list (each distinct):
    the one axis the panels can share. None when they are equal, or not all in one list (unrelated runs keep theirs)."""
    longest = list(max(names, key=len))
    if all(list(n) == longest for n in names) or any(len(set(n)) != len(n) or not set(n) <= set(longest) for n in names):
        return None
    return longest


def align_panels(panels: Mapping[str, Heatmap]):
    """``(panels, absent)``: heatmaps whose op (or edge) names are all among one run's (a DARTS space of 8 ops beside a
    SparseNAS or BayesNAS one of 7, without ``none``) put on that run's columns (rows), so that one op or edge is in one
    place in every panel; ``absent[label]`` marks the cells of names that run lacks (None: it has all)."""
    all_rows = _common_names([list(hm.rows) for hm in panels.values()])
    all_cols = _common_names([list(hm.cols) for hm in panels.values()])
    aligned, absent = {}, {}
    for label, hm in panels.items():
        rows, cols = all_rows or list(hm.rows), all_cols or list(hm.cols)
        r, c = [rows.index(n) for n in hm.rows], [cols.index(n) for n in hm.cols]
        matrix = np.full((len(rows), len(cols)), np.nan)
        matrix[np.ix_(r, c)] = np.asarray(hm.matrix, dtype=float)
        mask = np.ones(matrix.shape, bool)
        mask[np.ix_(r, c)] = False
        aligned[label] = dataclasses.replace(hm, matrix=matrix, rows=rows, cols=cols)
        absent[label] = mask if mask.any() else None
    return aligned, absent


def render_heatmaps(panels: Mapping[str, Heatmap], annotate: bool = False):
    """The same heatmap of several runs side by side on one colour scale (one colour bar). Panels whose edge or op
    names are all among one run's are drawn on that run's (`align_panels`): a name a run lacks is a blank cell there,
    and the panel's title says which."""
    originals = {k: np.asarray(hm.matrix, dtype=float) for k, hm in panels.items()}  # the title counts their NaN/inf
    panels, absent = align_panels(panels)
    labels = list(panels)
    matrices = {k: np.asarray(panels[k].matrix, dtype=float) for k in labels}
    every = np.concatenate([m.ravel() for m in matrices.values()])
    if not np.isfinite(every).any():
        every_run = np.concatenate([m.ravel() for m in originals.values()])
        raise NothingToDraw(f"{none_finite(every_run, 'every value of every run is NaN', 'the runs have')}; nothing to draw")
    first = panels[labels[0]]
    p = kept_exponent(every, first.signed, first.limits)
    limits = None if first.limits is None else (first.limits[0] / 10.0**p, first.limits[1] / 10.0**p)
    norm, cmap, clipped = colour_scale(every / 10.0**p, first.signed, limits)
    n = len(labels)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    n_rows, n_cols = matrices[labels[0]].shape
    # two pages wide at most, unless the op names need more (LABEL_PITCH)
    width = max(min(2 * PAGE, 0.8 + (0.9 + 0.28 * n_cols) * cols), 0.8 + (0.9 + LABEL_PITCH * n_cols) * cols)
    panel_w = (width - 0.8) / cols
    shared, tail_list = split_colorbar_labels([panels[k].colorbar for k in labels])
    tails = dict(zip(labels, tail_list))
    fig, axes = plt.subplots(rows, cols, figsize=(width, 0.9 + rows * (0.6 + 0.17 * n_rows)), squeeze=False)
    image = None
    for i, ax in enumerate(axes.ravel()):
        if i >= n:
            ax.axis("off")
            continue
        hm = panels[labels[i]]
        # rows are named at the left of each grid row, and on any panel whose edges differ from that one's
        # (runs of different cells: their rows are not the neighbour's)
        named = i % cols == 0 or list(hm.rows) != list(panels[labels[i - i % cols]].rows)
        image = _draw_matrix(ax, hm, matrices[labels[i]] / 10.0**p, norm, cmap, annotate, row_labels=named,
                             absent=absent[labels[i]])
        when = f" (step {hm.step})" if hm.step is not None else ""
        counts = nonfinite_counts(originals[labels[i]])
        title = labels[i] + when + (f" [{nonfinite_text(counts)}]" if counts else "")
        if absent[labels[i]] is not None:  # the blank cells: names of the other runs this run does not have
            lacks = [n for n in hm.rows if absent[labels[i]][hm.rows.index(n)].all()]
            lacks += [n for n in hm.cols if absent[labels[i]][:, hm.cols.index(n)].all()]
            title += f" [blank: no {', '.join(lacks)}]"
        if tails[labels[i]]:  # this run's part of the colour-bar label (its K, its unit), true for it alone
            title += "\n" + wrap(tails[labels[i]], panel_w, 6)
        ax.set_title(title, fontsize=7 if not tails[labels[i]] else 6, loc="left")
    fig.supxlabel(first.xlabel)
    fig.supylabel(first.ylabel)
    clip_note = "\n" + wrap(f"[{clipped.text(10.0**p)}]", width, 9) if clipped is not None else ""
    fig.suptitle(shared_title(first.title) + ", one colour scale across runs" + clip_note)
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, pad=0.01, extend=_extend(clipped))
    bar.set_label(wrap(shared + (f"  (x 1e{p})" if p else ""), 0.7 * rows * (0.6 + 0.17 * n_rows), 7), fontsize=7)
    _nonfinite_legend(fig, originals.values())
    return fig


#: the step a heatmap title names ("at step 3", "up to step 3", "after step 3", "steps 1-16 (epoch 0)"): each
#: comparison panel names its own, so the shared title must not state the first run's
_TITLE_STEP = re.compile(r"\s*\b(?:at |up to |after )?steps? \d+(?:-\d+)?(?: \((?:epoch \d+|before training)\))?")


def shared_title(title: str) -> str:
    """What a heatmap title says that is true of every run it is compared with: the part before its first comma
    (", steps a-b ...", ", 3 of 40 ops pruned" are one run's), without a step it names."""
    return _TITLE_STEP.sub("", title.split(",")[0]).strip()


def split_colorbar_labels(labels: Sequence[str]) -> Tuple[str, List[str]]:
    """(shared, tails): the part of the runs' colour-bar labels true for every run, and each run's rest.

    Equal labels share everything (tails all ``""``). Otherwise the shared part is their common beginning
    cut back to before its last `` (`` or space, so that no run-specific number (``K = 8`` of one
    run, ``K = 7`` of another) is printed on the one colour bar; each tail is that run's label after it.
    """
    labels = list(labels)
    if len(set(labels)) == 1:
        return labels[0], [""] * len(labels)
    common = os.path.commonprefix(labels)
    cut = common.rfind(" (")
    if cut < 0:
        cut = common.rfind(" ")
    shared = common[:max(cut, 0)].strip()
    return shared, [label[len(shared):].strip() for label in labels]


def legend_outside(fig, axes, ncol: int = 1) -> None:
    """One legend for the figure, right of the axes, never over data."""
    handles, labels = [], []
    for ax in np.ravel(axes):
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="outside right center", ncol=ncol, frameon=False)


def grid_shape(n: int, max_cols: int = 5) -> Tuple[int, int]:
    """(rows, cols) of a grid of ``n`` panels, at most ``max_cols`` wide."""
    cols = min(n, max_cols)
    return math.ceil(n / cols), cols


__all__ = [
    "COLUMN", "DIVERGING", "PAGE", "SEQUENTIAL", "colour_scale", "edge_names", "epoch_of", "epoch_span", "grid_shape", "integer_steps", "kept_exponent",
    "annotation", "legend_outside", "mark_isolated", "mark_nonfinite", "marked_series", "number", "op_names", "paper_style", "plot_series", "render_heatmap",
    "render_heatmaps", "scale_exponent", "series", "shared_title", "split_colorbar_labels", "step_of",
]
