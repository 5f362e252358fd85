"""NaN and ±inf in figures: recorded, counted by ``nasdiag plot`` and marked in every figure, never hidden;
and a comparison's colour bar says only what is true of every run (K differs between methods)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from matplotlib.patches import Rectangle

from nasdiag.cli import main
from nasdiag.plot.arch import arch_deviation
from nasdiag.plot.cost import cost_mean
from nasdiag.plot.registry import resolve_row
from nasdiag.plot.scalars import scalar_curves
from nasdiag.plot.style import render_heatmap, render_heatmaps
from nasdiag.record import RecordWarning, load
from plot_records import write_record

INF_CELL = (3, 2)  # the +inf entry of the epoch's cost mean (edge 3, op 2)


@pytest.fixture(scope="module")
def nonfinite_record(tmp_path_factory):
    """Steps 1-2: ``scalars/x`` = [NaN, 1.0]; the cost mean of step 2 holds one +inf."""
    cost = np.full((5, 8), 1e-3)
    cost[INF_CELL] = np.inf
    extra = {1: {"scalars/x": np.nan}, 2: {"scalars/x": 1.0, "cost/normal/mean": cost}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)  # the recorder flags the NaN/inf: as it should
        return write_record(tmp_path_factory.mktemp("nonfinite") / "rec.h5", epochs=1, steps_per_epoch=2,
                            cells=("normal",), extra=extra)


def test_plot_prints_the_nonfinite_counts_of_the_drawn_families(nonfinite_record, tmp_path, capsys):
    code = main(["plot", str(nonfinite_record), "--out", str(tmp_path / "figs"), "--figures", "scalars,cost",
                 "--dpi", "30"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith(str(nonfinite_record)))
    assert "1 NaN, 1 +inf" in line
    assert "scalars/x: 1 NaN" in line and "cost/normal/mean: 1 +inf" in line


def test_a_clean_record_says_it_has_no_nonfinite_values(tmp_path, capsys):
    rec = write_record(tmp_path / "clean.h5", epochs=1, steps_per_epoch=2, cells=("normal",))
    assert main(["plot", str(rec), "--out", str(tmp_path / "figs"), "--figures", "scalars", "--dpi", "30"]) == 0
    assert "no NaN/inf in the drawn families" in capsys.readouterr().out


def test_line_plots_mark_each_nan_step_at_the_axes_edge(nonfinite_record):
    import matplotlib.pyplot as plt

    fig = scalar_curves(load(nonfinite_record))
    try:
        (ax,) = [a for a in fig.axes if a.get_title(loc="left") == "x"]
        curve = next(line for line in ax.lines if line.get_label() == "x")
        assert list(curve.get_xdata()) == [1, 2]  # the NaN step stays in the series (a gap in the line) ...
        marks = [line for line in ax.lines if line.get_marker() == "X" and len(line.get_xdata())]
        assert len(marks) == 1 and list(marks[0].get_xdata()) == [1]  # ... and is marked at step 1
        assert list(marks[0].get_ydata()) == [0.0]  # at the bottom edge, in axes coordinates
        assert marks[0].get_transform() == ax.get_xaxis_transform()
        assert marks[0].get_color() == curve.get_color()  # in the colour of its series
        assert [t.get_text() for t in ax.get_legend().get_texts()].count("NaN") == 1
        finite_axes = [a for a in fig.axes if a.get_title(loc="left") == "losses"]
        assert "NaN" not in [t.get_text() for t in finite_axes[0].get_legend().get_texts()]
    finally:
        plt.close(fig)


def test_heatmaps_hatch_nonfinite_cells_and_name_them_in_a_legend(nonfinite_record):
    import matplotlib.pyplot as plt

    record = load(nonfinite_record)
    row = resolve_row(record, "cost/normal/mean", "final")
    hm = cost_mean(record, "normal", row)
    for fig in (render_heatmap(hm), render_heatmaps({"a": hm, "b": cost_mean(record, "normal", row)})):
        try:
            ax = fig.axes[0]
            hatched = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_hatch()]
            assert len(hatched) == 1 and hatched[0].get_hatch() == "///"
            assert hatched[0].get_xy() == (INF_CELL[1] - 0.5, INF_CELL[0] - 0.5)  # (x: op, y: edge)
            assert [t.get_text() for legend in fig.legends for t in legend.get_texts()] == ["+inf"]
            assert "1 +inf" in ax.get_title(loc="left")
        finally:
            plt.close(fig)


def _probabilities_record(K: int) -> dict:
    p = np.full((1, 5, K), 1.0 / K)
    p[0, :, 0] += 0.05
    return {"step": np.array([3]), "arch/normal/probabilities": p / p.sum(-1, keepdims=True)}


def test_comparison_colour_bar_is_true_for_every_panel_when_K_differs():
    import matplotlib.pyplot as plt

    panels = {"darts": arch_deviation(_probabilities_record(8), "normal", 0),
              "sparsenas": arch_deviation(_probabilities_record(7), "normal", 0)}
    fig = render_heatmaps(panels)
    try:
        (bar,) = [im.colorbar for ax in fig.axes for im in ax.get_images() if im.colorbar is not None]
        bar_label = bar.ax.get_ylabel()
        assert "K = " not in bar_label and bar_label.startswith("p − 1/K")
        titles = {ax.get_title(loc="left").split(" ")[0]: ax.get_title(loc="left") for ax in fig.axes[:2]}
        assert "K = 8" in titles["darts"] and "K = 7" in titles["sparsenas"]
    finally:
        plt.close(fig)
    from nasdiag.plot.style import split_colorbar_labels

    assert split_colorbar_labels(["E[C]", "E[C]"]) == ("E[C]", ["", ""])  # equal labels: all on the bar
