"""Figures audit, round 2: records at the edges (NaN/inf epochs, all-inf rows, one outlier cell, huge K, one
edge, a record still being written) against what the record holds, read back with plain h5py or written here.

Every registered figure must draw or be skipped with a reason; a colour scale that one cell would flatten must
say that it was clipped, and tick labels must be the record's op and edge names."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import h5py
import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from nasdiag.cli import main  # noqa: E402
from nasdiag.plot.registry import Heatmap, draw_record  # noqa: E402
from nasdiag.plot.style import plt, render_heatmap, render_heatmaps  # noqa: E402
from nasdiag.record import Recorder, RecordWarning, load  # noqa: E402

OPS = ["none", "skip_connect", "max_pool_3x3"]
EDGES = ["0->2", "1->2", "0->3", "1->3", "2->3"]


def _record(path, rows, ops=OPS, edges=EDGES):
    """A one-cell record with ``rows[t]`` logged at step t + 1, NaN/inf kept as they are."""
    meta = {"method": "darts", "op_names": list(ops), "edge_names": {"normal": list(edges)}, "cell_types": ["normal"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(str(path), meta=meta, flush_seconds=None) as rec:
            for t, row in enumerate(rows):
                rec.log(t + 1, row)
    return path


def _figure_text(fig) -> str:
    texts = [fig.get_suptitle()] if fig._suptitle is not None else []
    for ax in fig.axes:
        texts += [ax.get_title(loc="left"), ax.get_title(), ax.get_ylabel()]
    return " ".join(texts)


def test_an_epoch_that_is_nan_or_inf_names_the_row_by_its_step_instead_of_crashing(tmp_path):
    """``int(NaN)`` raised ValueError from the sparsity panels, the wiring panels and every epoch-averaged title."""
    E, K = len(EDGES), len(OPS)
    rows = []
    for t, epoch in enumerate([0.0, np.nan, np.inf]):
        rows.append({"scalars/epoch": epoch, "arch/normal/params": np.full((E, K), t + 1.0),
                     "arch/normal/probabilities": np.full((E, K), 1.0 / K) + 0.01 * t * np.eye(E, K),
                     "sparsity/normal/nonzero": np.ones((E, K), bool),
                     "cost/normal/mean": np.full((E, K), 0.1 * (t + 1))})
    path = _record(tmp_path / "r.h5", rows)
    with h5py.File(path, "r") as f:
        stored = f["scalars/epoch"][()]
    assert np.isnan(stored[1]) and np.isinf(stored[2])
    drawn = draw_record(load(path), tmp_path / "figs", figures=["sparsity_evolution", "wiring", "cost"], dpi=20)
    assert sorted(p.name for p in drawn.files) == ["cost_normal_heatmap.png", "sparsity_normal_evolution.png",
                                                   "wiring_normal.png"], drawn.skipped
    from nasdiag.plot.arch import wiring_evolution
    from nasdiag.plot.cost import cost_mean
    from nasdiag.plot.sparsity import sparsity_evolution

    record = load(path)
    assert cost_mean(record, "normal", 2).title.endswith("step 3")  # epoch inf: the step alone
    assert "(epoch 0)" in cost_mean(record, "normal", 0).title
    for draw in (sparsity_evolution, wiring_evolution):
        fig = draw(record, "normal")
        try:
            text = _figure_text(fig)
            assert "epoch 0" in text and "step 2" in text and "step 3" in text, text
            assert "nan" not in text.lower().replace("nan ", "")  # no "epoch nan"
        finally:
            plt.close(fig)


def test_a_heatmap_row_that_is_inf_everywhere_is_skipped_as_inf_not_as_nan(tmp_path):
    E, K = len(EDGES), len(OPS)
    path = _record(tmp_path / "r.h5", [{"cost/normal/mean": np.ones((E, K))}, {"cost/normal/mean": np.full((E, K), -np.inf)}])
    drawn = draw_record(load(path), tmp_path / "figs", figures=["cost"], dpi=20)
    assert drawn.files == []
    (line,) = drawn.skipped
    assert f"{E * K} −inf" in line and "step 2" in line and "NaN" not in line, line


def _outlier_matrix():
    rng = np.random.default_rng(3)
    m = 1e-3 * rng.standard_normal((14, 8))
    m[3, 2] = 0.5  # one diverged cell, 500 times the rest
    return m


def _colour_limits(fig):
    """The colour scale's ends in the values' units (the colour bar's ``(x 1e<p>)`` undone)."""
    image, bar = fig.axes[0].images[0], fig.axes[-1].get_ylabel().replace("\n", " ")
    scale = 10.0 ** int(bar.split("(x 1e")[1].split(")")[0]) if "(x 1e" in bar else 1.0
    return image.norm.vmin * scale, image.norm.vmax * scale


def test_one_outlier_cell_does_not_flatten_the_colour_scale_and_the_figure_says_so():
    m = _outlier_matrix()
    edges, ops = [f"e{i}" for i in range(14)], [f"op{k}" for k in range(8)]
    fig = render_heatmap(Heatmap(m, edges, ops, "normal cell: cost mean", "E[C]", signed=True))
    try:
        lo, hi = _colour_limits(fig)
        rest = np.abs(np.delete(m.ravel(), 3 * 8 + 2)).max()
        assert hi == pytest.approx(rest) and lo == pytest.approx(-rest)  # the scale spans the other 111 cells
        title = fig.axes[0].get_title(loc="left").replace("\n", " ")
        assert "clipped at ±0.00" in title and "1 cell beyond it (up to 0.5)" in title, title
        assert fig.axes[1].get_label() == "<colorbar>"
        # the outlier cell still shows its own value
        texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in fig.axes[0].texts}
        bar = fig.axes[1].get_ylabel().replace("\n", " ")
        assert float(texts[(3, 2)]) * 10.0 ** int(bar.split("(x 1e")[1].split(")")[0]) == pytest.approx(0.5)
        # labels are the given names, in order
        assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ops
        assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == edges
    finally:
        plt.close(fig)
    # a sequential map (a standard deviation) and a comparison across runs clip and say so too
    fig = render_heatmaps({"a": Heatmap(np.abs(m), edges, ops, "normal cell: cost std", "std", signed=False),
                           "b": Heatmap(np.abs(m), edges, ops, "normal cell: cost std", "std", signed=False)})
    try:
        assert _colour_limits(fig)[1] < 0.01 and "2 cells beyond it" in fig.get_suptitle().replace("\n", " ")
    finally:
        plt.close(fig)


def test_a_map_whose_large_values_are_many_keeps_its_full_scale():
    """Only a few cells (at most a tenth) are ever left out: a whole op column of large values is data."""
    m = np.full((14, 8), 1e-3)
    m[:, 4] = 5.0  # one op (an eighth of the cells) curves far more than the others
    m[0, 0] = 0.0
    fig = render_heatmap(Heatmap(m, [f"e{i}" for i in range(14)], [f"op{k}" for k in range(8)], "h", "h", signed=None))
    try:
        assert _colour_limits(fig) == (0.0, 5.0)
        assert "clipped" not in fig.axes[0].get_title(loc="left")
    finally:
        plt.close(fig)


def test_huge_k_and_a_single_edge_label_every_op_and_edge_or_skip_the_cell_drawing(tmp_path):
    ops = [f"op_{k:03d}" for k in range(120)]
    K = len(ops)
    probabilities = np.full((1, K), 1.0 / K)
    probabilities[0, 7] += 0.5
    path = _record(tmp_path / "r.h5", [{"arch/normal/probabilities": probabilities / probabilities.sum()}],
                   ops=ops, edges=["0->2"])
    drawn = draw_record(load(path), tmp_path / "figs", figures=["arch", "genotype", "wiring"], dpi=20)
    assert [p.name for p in drawn.files] == ["arch_normal_heatmap.png"]
    assert len(drawn.skipped) == 2 and all("1 edges is not a DARTS cell" in line for line in drawn.skipped), drawn.skipped
    from nasdiag.plot.arch import arch_deviation
    from nasdiag.plot.style import paper_style

    record = load(path)
    for compare in (False, True):
        with paper_style():  # the rcParams every nasdiag figure is drawn with (7 pt tick labels)
            hm = arch_deviation(record, "normal", 0)
            fig = render_heatmaps({"a": hm, "b": hm}) if compare else render_heatmap(hm)
            fig.canvas.draw()
        try:
            ax = fig.axes[0]
            assert [t.get_text() for t in ax.get_xticklabels()] == ops
            assert [t.get_text() for t in ax.get_yticklabels()] == ["0->2"]
            # the op names stand at 45°: neighbours are pitch · sin 45° apart, which must exceed a label's height
            pitch = ax.get_position().width * fig.get_figwidth() / K
            height = ax.get_xticklabels()[0].get_fontsize() / 72
            assert pitch * np.sin(np.pi / 4) >= height, (pitch, height)  # 7 inches for 120 names printed them on top of each other
        finally:
            plt.close(fig)


_LIVE_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from nasdiag.record import Recorder
    meta = {"method": "darts", "op_names": ["none", "skip_connect", "max_pool_3x3"],
            "edge_names": {"normal": ["0->2", "1->2", "0->3", "1->3", "2->3"]}, "cell_types": ["normal"]}
    rec = Recorder(sys.argv[1], meta=meta, flush_every=2, flush_seconds=None)
    for step in range(1, 100000):
        rec.log(step, {"scalars/train_loss": 1.0 / step, "cost/normal/mean": np.full((5, 3), step, np.float32)})
        if step == 6:
            print("READY", flush=True)
        time.sleep(0.002)
""")


def test_nasdiag_plot_and_report_of_a_record_still_being_written(tmp_path):
    path = tmp_path / "live.h5"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _LIVE_WRITER, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "READY"
        assert main(["plot", str(path), "--out", str(tmp_path / "figs"), "--figures", "scalars,cost", "--dpi", "20"]) == 0
        assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["cost_normal_heatmap.png", "scalars.png"]
        assert main(["report", str(path), "--out", str(tmp_path / "r.html"), "--figures", "cost", "--dpi", "20"]) == 0
        assert (tmp_path / "r.html").read_text().count("<img") >= 1
    finally:
        child.kill()
        child.wait()
    # a plot of a record that does not exist, and of a record no figure can draw: one line, exit 2
    assert main(["plot", str(tmp_path / "missing.h5"), "--out", str(tmp_path / "f2")]) == 2
    empty = _record(tmp_path / "other.h5", [{"other/x": 1.0}])
    assert main(["plot", str(empty), "--out", str(tmp_path / "f3")]) == 2
    assert not (tmp_path / "f3").exists()


def test_sparsity_panels_of_a_row_with_an_infinite_weight_keep_the_other_ops_and_their_pruned_count(tmp_path):
    from nasdiag.plot.sparsity import sparsity_evolution

    E, K = len(EDGES), len(OPS)
    a = np.arange(1.0, E * K + 1).reshape(E, K)
    a[0, 0] = 0.0  # one pruned op
    a[4, 2] = np.inf  # one diverged weight
    path = _record(tmp_path / "r.h5", [{"arch/normal/params": a, "sparsity/normal/nonzero": a != 0}])
    with h5py.File(path, "r") as f:
        stored = np.abs(f["arch/normal/params"][0])
    fig = sparsity_evolution(load(path), "normal")
    try:
        ax = fig.axes[0]
        shown = np.ma.filled(ax.images[0].get_array().astype(float), np.nan)
        finite = np.isfinite(stored)
        top = stored[finite].max()
        np.testing.assert_allclose(shown[finite], stored[finite] / top)  # were all 0: divided by inf
        assert "1 pruned" in ax.get_title(loc="left") and "+inf" in ax.get_title(loc="left"), ax.get_title(loc="left")
    finally:
        plt.close(fig)


def _every_family_row(fill: float, E: int, K: int) -> dict:
    """One row of every vocabulary family (``<cell>`` = normal, ``<name>`` = loss), float values ``fill``."""
    from nasdiag import vocabulary as V

    row = {}
    for fam in V.families():
        path = fam.pattern.replace("<cell>", "normal").replace("<name>", "loss")
        dims = [d.strip() for d in fam.shape.strip("()").split(",") if d.strip()]
        shape = tuple({"E": E, "K": K, "R": 2}[d] for d in dims)
        kind = np.dtype(fam.dtype).kind
        if kind == "b":
            row[path] = np.ones(shape, bool) if shape else True
        elif kind == "i":
            row[path] = np.full(shape, 3, np.int64) if shape else np.int64(3)
        elif not shape:
            row[path] = float(fill)
        else:
            values = np.full(shape, fill, np.float32)
            if np.isfinite(fill):  # distinct values: a constant map is not what is being tested
                values = values + 0.01 * np.arange(values.size, dtype=np.float32).reshape(shape)
            row[path] = values
    return row


@pytest.mark.slow
def test_every_registered_figure_draws_or_says_why_across_nan_and_inf_rows(tmp_path):
    """Rows of every family, the middle ones NaN or ±inf everywhere (the epoch too), the last finite: every
    (figure, cell) the registry yields is a file or one skip line, and nothing raises."""
    from nasdiag.plot.registry import iter_figures

    E, K = len(EDGES), len(OPS)
    rows = [_every_family_row(v, E, K) for v in (0.2, np.nan, np.inf, -np.inf, 0.4)]
    path = _record(tmp_path / "r.h5", rows)
    record = load(path)
    expected = len(list(iter_figures(record)))
    drawn = draw_record(record, tmp_path / "figs", dpi=20)
    assert len(drawn.files) + len(drawn.skipped) == expected
    assert len(drawn.files) >= expected - 3, drawn.skipped  # only the figures with nothing to show may be skipped
    assert all(": " in line for line in drawn.skipped)
