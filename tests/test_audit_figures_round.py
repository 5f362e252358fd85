"""Audit of the figures against the records they are drawn from: what a cell, an annotation or a curve shows is
the recorded number (read back with h5py), non-finite values never break a figure, and one record always
gives byte-identical files, in every format."""

from __future__ import annotations

import warnings

import h5py
import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from nasdiag import vocabulary as V  # noqa: E402
from nasdiag.plot.arch import arch_evolution  # noqa: E402
from nasdiag.plot.registry import Heatmap, write_figures  # noqa: E402
from nasdiag.plot.style import plt, render_heatmap  # noqa: E402
from nasdiag.record import Recorder, RecordWarning, load  # noqa: E402

OPS = ["none", "skip_connect", "max_pool_3x3"]
EDGES = ["0->2", "1->2", "0->3", "1->3", "2->3"]


def _record(path, rows):
    """A one-cell record with ``rows[t]`` logged at step t + 1 (NaN/inf kept as they are)."""
    meta = {"method": "darts", "op_names": OPS, "edge_names": {"normal": EDGES}, "cell_types": ["normal"],
            "config": {"steps": 2, "multiplier": 2}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(str(path), meta=meta) as rec:
            for t, row in enumerate(rows):
                rec.log(t + 1, {"scalars/epoch": t, **row})
    return path


def _uniform(E=5, K=3):
    return np.full((E, K), 1.0 / K)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_arch_evolution_draws_a_probability_that_is_nan_or_inf_at_one_step(tmp_path, bad):
    p = _uniform()
    p[1, 2] = bad
    path = _record(tmp_path / "r.h5", [{"arch/normal/probabilities": _uniform()},
                                       {"arch/normal/probabilities": p},
                                       {"arch/normal/probabilities": _uniform()}])
    with h5py.File(path) as f:
        stored = f["arch/normal/probabilities"][:, 1, 2]
    fig = arch_evolution(load(path), "normal")
    try:
        ax = fig.axes[1]  # edge 1->2
        assert ax.get_title(loc="left") == "edge 1->2"
        line = next(l for l in ax.get_lines() if l.get_label() == "max_pool_3x3")
        np.testing.assert_array_equal(line.get_ydata(), stored)
        kind = "NaN" if np.isnan(bad) else "+inf"
        assert kind in ax.get_legend_handles_labels()[1]  # the bad step is marked, not dropped
        assert np.isfinite(ax.get_ylim()).all() and ax.get_ylim()[1] >= 1.0 / 3
    finally:
        plt.close(fig)


def test_heatmap_annotation_of_a_nonzero_value_is_not_zero():
    # a huge dynamic range (a Hessian diagonal): 100 next to 1e5 rounds to 0.00 at the map's precision
    matrix = np.array([[1e5, 100.0, 0.0], [-1e-3, 2.5e4, 3.0]])
    fig = render_heatmap(Heatmap(matrix, ["0->2", "1->2"], OPS, "t", "h", signed=None))
    try:
        ax = fig.axes[0]
        texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
        scale = 1e5  # the colour bar's "(x 1e5)": the largest |value| shown as 1.00
        assert "(x 1e5)" in fig.axes[1].get_ylabel()
        assert texts[(0, 2)] == "0"  # an exact zero
        for (i, j), value in np.ndenumerate(matrix):
            shown = float(texts[(i, j)].replace("−", "-")) * scale
            assert np.sign(shown) == np.sign(value)
            assert abs(shown - value) <= 0.5 * abs(value) + 1e-12, (i, j, texts[(i, j)])
    finally:
        plt.close(fig)


@pytest.mark.parametrize("fmt", ["svg", "pdf"])
def test_one_record_gives_identical_files(tmp_path, fmt):
    cost = np.linspace(-1, 1, 15).reshape(5, 3)
    path = _record(tmp_path / "r.h5", [{"cost/normal/mean": cost}])
    first = write_figures(path, tmp_path / "a", fmt=fmt, figures=["cost"])
    second = write_figures(path, tmp_path / "b", fmt=fmt, figures=["cost"])
    assert [p.name for p in first] == [p.name for p in second] == [f"cost_normal_heatmap.{fmt}"]
    assert first[0].read_bytes() == second[0].read_bytes()


def test_comparison_labels_the_edges_of_a_run_whose_edges_differ_from_its_neighbour():
    from nasdiag.plot.style import render_heatmaps

    edges14 = [f"e{i}" for i in range(14)]
    panels = {"big": Heatmap(np.ones((14, 3)), edges14, OPS, "c, x", "h"),
              "small": Heatmap(np.ones((5, 3)), EDGES, OPS, "c, y", "h")}
    fig = render_heatmaps(panels)
    try:
        shown = [[t.get_text() for t in ax.get_yticklabels()] for ax in fig.axes[:2]]
        assert shown == [edges14, EDGES]  # the 5-edge panel's rows are not left unnamed next to 14 others
    finally:
        plt.close(fig)


def test_hessian_comparison_says_which_mode_each_run_used(tmp_path):
    from nasdiag.plot.hessian import hessian_diag
    from nasdiag.plot.style import render_heatmaps

    records = {}
    for mode in ("ggn", "approx"):
        path = tmp_path / f"{mode}.h5"
        meta = {"method": "darts", "op_names": OPS, "edge_names": {"normal": EDGES}, "cell_types": ["normal"],
                "config": {"steps": 2, "hessian_mode": mode}}
        with Recorder(str(path), meta=meta) as rec:
            rec.log(1, {"hessian/normal/diag": np.ones((5, 3))})
        records[mode] = load(path)
    fig = render_heatmaps({mode: hessian_diag(r, "normal", 0) for mode, r in records.items()})
    try:
        texts = " ".join([fig.get_suptitle()] + [ax.get_title(loc="left") for ax in fig.axes]
                         + [ax.get_ylabel() for ax in fig.axes])
        assert "ggn mode" in texts and "approx mode" in texts
    finally:
        plt.close(fig)


def _marked_points(ax):
    """(x, y) of every point drawn with a marker on ``ax`` (a line without markers draws no lone point)."""
    points = set()
    for line in ax.get_lines():
        if line.get_marker() in (None, "None", "", " ") or line.get_transform() != ax.transData:
            continue
        points.update(zip(np.asarray(line.get_xdata(), float).tolist(), np.asarray(line.get_ydata(), float).tolist()))
    return points


def test_a_line_plot_shows_a_finite_value_that_has_no_finite_neighbour():
    from nasdiag.plot.style import integer_steps, plot_series

    fig, ax = plt.subplots()
    try:
        plot_series(ax, [1, 2, 3, 4], [np.nan, 0.5, np.nan, 2.0], lw=1.0)
        assert {(2.0, 0.5), (4.0, 2.0)} <= _marked_points(ax)  # a line alone leaves both invisible
        integer_steps(ax)
        fig.canvas.draw()
        fig2, ax2 = plt.subplots()
        plot_series(ax2, [7], [1.0])
        integer_steps(ax2)
        fig2.canvas.draw()
        lo, hi = ax2.get_xlim()
        ticks = [t for t in ax2.get_xticks() if lo <= t <= hi]
        assert ticks == [7.0]  # one step: its integer tick, not 6.96, 6.98, ...
        plt.close(fig2)
    finally:
        plt.close(fig)


def test_bayes_gamma_of_one_update_shows_every_value_and_marks_gamma_zero(tmp_path):
    from nasdiag.plot.bayes import bayes_gamma

    gamma = np.ones((5, 3))
    gamma[0] = 0.0  # a dead switch: off the log scale
    gamma[1, 1] = 1e-9
    path = _record(tmp_path / "r.h5", [{"bayes/normal/gamma": gamma}])
    with h5py.File(path) as f:
        stored = f["bayes/normal/gamma"][0]
    fig = bayes_gamma(load(path), "normal")
    try:
        for e in range(1, 5):  # one update: every γ > 0 is a visible point at step 1
            assert {(1.0, float(v)) for v in stored[e]} <= _marked_points(fig.axes[e])
        edge0 = fig.axes[0]
        marks = [l for l in edge0.get_lines() if l.get_transform() == edge0.get_xaxis_transform() and len(l.get_xdata())]
        assert sum(len(l.get_xdata()) for l in marks) == 3  # each γ = 0 marked at the panel's floor
        assert any("γ ≤ 0" in label for label in edge0.get_legend_handles_labels()[1])
    finally:
        plt.close(fig)


def test_cost_heatmaps_say_the_loss_is_the_batch_mean(tmp_path):
    from nasdiag.plot.cost import cost_mean, cost_std

    path = _record(tmp_path / "r.h5", [{"cost/normal/mean": np.ones((5, 3)), "cost/normal/var": np.ones((5, 3))}])
    record = load(path)
    for draw in (cost_mean, cost_std):  # the Hessian heatmap says it; C = ∂L/∂Z scales with B if L is a sum
        hm = draw(record, "normal", 0)
        assert "batch-mean" in hm.title + hm.colorbar


def test_arch_evolution_of_signed_mixing_weights_is_not_clipped_at_zero(tmp_path):
    z = np.full((5, 3), 0.2)
    z[2, 0] = -0.7  # an old record's arch/<cell>/weights (signed linear mixing weights): below 0
    path = _record(tmp_path / "r.h5", [{"arch/normal/weights": z}, {"arch/normal/weights": z}])
    fig = arch_evolution(load(path), "normal")
    try:
        lo, hi = fig.axes[2].get_ylim()
        assert lo <= -0.7 and hi >= 0.2
    finally:
        plt.close(fig)


def test_comparison_title_does_not_state_the_first_runs_step_for_every_run(tmp_path):
    from nasdiag.plot.attention import attention_mean
    from nasdiag.plot.style import render_heatmaps

    a = _record(tmp_path / "a.h5", [{"attention/normal/mean": np.full((5, 3), 0.3)}])  # step 1
    b = _record(tmp_path / "b.h5", [{}, {}, {"attention/normal/mean": np.full((5, 3), 0.6)}])  # step 3
    panels = {"a": attention_mean(load(a), "normal", 0), "b": attention_mean(load(b), "normal", 2)}
    fig = render_heatmaps(panels)
    try:
        assert "step 1" not in fig.get_suptitle() and "mean attention" in fig.get_suptitle()
        assert [ax.get_title(loc="left") for ax in fig.axes[:2]] == ["a (step 1)", "b (step 3)"]
    finally:
        plt.close(fig)


def _nan_marks(ax):
    edge = ax.get_xaxis_transform()
    return sorted(float(x) for l in ax.get_lines() if l.get_transform() == edge and l.get_marker() == "X"
                  for x in l.get_xdata())


def test_a_scalar_that_is_nan_in_every_row_is_marked_not_left_out(tmp_path):
    from nasdiag.plot.sampling import temperature_entropy
    from nasdiag.plot.scalars import scalar_curves

    rows = [{"scalars/train_loss": np.nan, "scalars/train_acc": 0.5, "scalars/temperature": 5.0,
             "scalars/entropy": np.nan} for _ in range(3)]
    record = load(_record(tmp_path / "r.h5", rows))
    fig = scalar_curves(record)
    try:
        losses = next(ax for ax in fig.axes if ax.get_title(loc="left") == "losses")
        assert _nan_marks(losses) == [1.0, 2.0, 3.0]
        assert any(label.startswith("train_loss") for label in losses.get_legend_handles_labels()[1])
    finally:
        plt.close(fig)
    fig = temperature_entropy(record)
    try:
        entropy = next(ax for ax in fig.axes if ax.get_title(loc="left").startswith("mean entropy"))
        assert _nan_marks(entropy) == [1.0, 2.0, 3.0]
    finally:
        plt.close(fig)


def test_report_images_keep_what_is_drawn_outside_the_canvas(tmp_path):
    # the BayesNAS panels put their op legend and title above the axes grid, as `nasdiag plot` files show them
    import base64
    import io

    from matplotlib.image import imread

    from nasdiag.plot.report import _png

    fig = plt.figure(figsize=(2.0, 1.0))
    fig.add_axes([0.1, 0.1, 0.8, 0.8])
    fig.text(0.5, 1.3, "legend above the canvas", ha="center")
    height = imread(io.BytesIO(base64.b64decode(_png(fig, 50)))).shape[0]
    assert height > 1.15 * 50  # the canvas is 50 px high (the axes 40); the text sits 0.3 in above it


def test_regret_curves_of_a_14_edge_cell_have_14_colours(tmp_path):
    from matplotlib.colors import to_hex

    from nasdiag.plot.regret import regret_bound

    edges = [f"{i}->{j}" for j in range(2, 6) for i in range(j)]  # the DARTS cell: 14 edges
    meta = {"method": "xnas", "op_names": OPS, "edge_names": {"normal": edges}, "cell_types": ["normal"]}
    path = tmp_path / "r.h5"
    with Recorder(str(path), meta=meta) as rec:
        for s in (1, 2):
            rec.log(s, {"regret/normal/regret": np.arange(14.0) * s, "regret/normal/bound": np.arange(14.0) * 2 * s})
    fig = regret_bound(load(path), "normal")
    try:
        handles, labels = fig.axes[0].get_legend_handles_labels()
        colours = {label: to_hex(h.get_color()) for h, label in zip(handles, labels)}
        assert sorted(colours) == sorted(edges) and len(set(colours.values())) == 14
    finally:
        plt.close(fig)


def test_integer_counts_are_annotated_as_integers(tmp_path):
    from nasdiag.plot.sampling import sample_counts

    counts = np.arange(15).reshape(5, 3)
    path = _record(tmp_path / "r.h5", [{"sample/normal/count": counts}])
    fig = render_heatmap(sample_counts(load(path), "normal", 0))
    try:
        assert sorted(t.get_text() for t in fig.axes[0].texts) == sorted(str(c) for c in counts.ravel())
    finally:
        plt.close(fig)
