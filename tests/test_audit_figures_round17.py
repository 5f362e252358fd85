"""Figures audit, round 17: records written here through the public `Recorder` with planted values of known structure
(a distinct value per edge × op, a gradient over the steps, NaN/inf in known cells), every figure drawn through the
plot API and its drawn data read back from the matplotlib artists (line data, panel titles, axis labels).

The references are the arrays logged here and this file's own numpy on them; nothing is computed by nasdiag.

Checked and found right (probes in the round's scratch, not kept as tests where earlier rounds cover them): every
heatmap (cost, cost_std, hessian, arch, attention, attention_counts, sample_counts, sparsity_weights) of a record with a
distinct value per edge × op, a gradient over the steps, NaN/+inf in known cells and a second cell type of other E and
K draws the logged row edges down, ops across as its tick labels say, at ``--at init``, a middle step and ``final``,
titled with that row's step (the cost with the steps it averages), the NaN/inf counted in the title and annotated
"NaN"/"inf"; the comparison's panels share one norm that spans every run's finite cells; the BayesNAS γ/ω/curvature
panels, switches, the eigenvalue curves, the sampling curves and the SparseNAS evolution (each panel over its own
largest |A|, the max in its label) plot the logged numbers at the logged steps; the genotype (DARTS rule) and the most
probable wiring are this file's own transcription of the rule on random p; `nasdiag plot` and `report` of that record
draw and list the same 20 figures.

Left alone: a map whose decimals a larger value sets writes 0.06 as "0.1" but 0.04 as "4e-2" (the documented rule
for values below the decimals); a comparison leaves out, without a line of its own, a run that has no row at the
``--at`` step (its own folder's line says so)."""

from __future__ import annotations

import warnings

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402

from nasdiag.plot.registry import iter_figures  # noqa: E402
from nasdiag.plot.style import plt  # noqa: E402
from nasdiag.record import Recorder, RecordWarning, load  # noqa: E402


def _write(path, meta, rows):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(str(path), meta=meta, flush_seconds=None) as rec:
            for step, row in rows:
                rec.log(step, row)
    return str(path)


def _figure(record, name):
    (fig,) = [thunk() for spec, _, _, thunk in iter_figures(record, [name])]
    return fig


def test_the_nonfinite_loss_flag_is_not_drawn_as_a_loss_of_one(tmp_path):
    """A search whose loss turns NaN records the failing row with ``scalars/nonfinite_loss`` = 1 (search/base.py). The
    scalars figure grouped every name holding "loss" into the losses panel, y label "cross-entropy": the flag was a
    point of loss 1.0 at the failing step, and it stretched the y axis of a run whose losses are 0.02-0.1 tenfold. The
    panel of losses holds the logged losses only, on their own range; the flag is drawn in a panel of its own."""
    losses = [0.1 / s for s in range(1, 6)]
    rows = [(s, {"scalars/train_loss": loss}) for s, loss in zip(range(1, 6), losses)]
    rows.append((6, {"scalars/train_loss": np.nan, "scalars/nonfinite_loss": 1.0}))
    fig = _figure(load(_write(tmp_path / "r.h5", {"method": "darts"}, rows)), "scalars")
    try:
        panels = {ax.get_title(loc="left"): ax for ax in fig.axes if ax.get_title(loc="left")}
        ax = panels["losses"]
        curves = {ln.get_label(): ln for ln in ax.get_lines() if len(ln.get_xdata()) == 6}
        assert [label.split("\n")[0] for label in curves] == ["train_loss"], list(curves)
        np.testing.assert_allclose(next(iter(curves.values())).get_ydata()[:5], np.float32(losses))
        assert ax.get_ylim()[1] < 0.2, ax.get_ylim()  # the losses' range (0.02-0.1), not stretched to a flag's 1
        flag = [ln for a in fig.axes for ln in a.get_lines() if ln.get_label() == "nonfinite_loss"]
        assert flag and all(ln.axes is not ax for ln in flag)
        assert flag[0].get_ydata()[-1] == 1.0
    finally:
        plt.close(fig)


def _bar_exponent(fig) -> int:
    bar = fig.axes[1].get_ylabel().replace("\n", " ")
    return int(bar.split("(x 1e")[1].split(")")[0]) if "(x 1e" in bar else 0


def test_one_diverged_cell_sets_neither_the_power_of_ten_nor_the_annotations_of_the_others(tmp_path):
    """docs/figures.md: a few outlier cells are kept out of the colour scale and "the annotations keep every value". The
    power of ten of the colour bar came from the largest cell all the same: a cost map of 1.1e-4 .. 3.4e-4 with one
    diverged entry of 1e6 was drawn "(x 1e6)" and every other cell annotated with one digit, 1.2e-4, 1.4e-4 and 1.1e-4
    all "1e-10" (the bar's ticks scaled twice, an offset 1e-10 on top). Each annotation, times the bar's power of ten,
    is its cell's value to the printed precision (the planted values are 0.1e-4 apart), the outlier's too."""
    ops, edges = ["none", "skip", "conv", "pool"], ["0->2", "1->2", "0->3"]
    cost = np.array([[1.2, -2.3, 3.4, 1.6], [1.1, 2.7, -1.9, 0.0], [1.5, 1.4, -1.3, 2.2]]) * 1e-4
    cost[1, 3] = 1e6  # a diverged entry
    meta = {"method": "darts", "op_names": ops, "edge_names": {"normal": edges}, "cell_types": ["normal"]}
    fig = _figure(load(_write(tmp_path / "c.h5", meta, [(1, {"cost/normal/mean": cost})])), "cost")
    try:
        fig.canvas.draw()
        ax, bar = fig.axes[0], fig.axes[1]
        p = _bar_exponent(fig)
        texts = [t.get_text() for t in ax.texts]
        assert len(texts) == cost.size
        for text, value in zip(texts, cost.ravel()):
            assert abs(float(text) * 10.0**p - value) <= 0.02 * abs(value), (text, p, value)
        kept = np.abs(np.delete(cost.ravel(), 7)).max()
        np.testing.assert_allclose(ax.images[0].norm.vmax * 10.0**p, kept, rtol=1e-12)  # the scale ends at the kept cells
        assert bar.yaxis.get_offset_text().get_text() == ""  # the bar's ticks read in the bar's own units
        assert "1 cell beyond it" in ax.get_title(loc="left").replace("\n", " ")
    finally:
        plt.close(fig)


def test_the_entropy_ceiling_of_cell_types_with_different_k_is_the_mean_over_their_edges(tmp_path):
    """``scalars/entropy`` is the mean over the edges of every cell type of −Σ p log p (vocabulary; `mean_entropy`
    concatenates the edges), so its ceiling, uniform p on every edge, is Σ_c E_c log K_c / Σ_c E_c. A record of cell
    types with different K (written without op names: the recorder checks K per cell type only against them) had the
    dashed line at the first cell type's log K (log 4 = 1.39 for 5 edges of 4 ops beside 2 edges of 3 ops: 1.30), a
    "ceiling" that uniform p never reaches; the one-K case stays log K."""
    def uniform(E, K):
        return np.full((E, K), 1.0 / K, np.float32)

    rows = [(s, {"scalars/entropy": 1.0 - 0.1 * s, "arch/normal/probabilities": uniform(5, 4),
                 "arch/reduce/probabilities": uniform(2, 3)}) for s in range(1, 4)]
    fig = _figure(load(_write(tmp_path / "k.h5", {"method": "snas"}, rows)), "sampling")
    try:
        dashed = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        assert len(dashed) == 1
        np.testing.assert_allclose(dashed[0].get_ydata()[0], (5 * np.log(4) + 2 * np.log(3)) / 7, rtol=1e-12)
        entropy = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_linestyle() == "-" and len(ln.get_xdata()) == 3]
        np.testing.assert_allclose(entropy[-1].get_ydata(), np.float32([0.9, 0.8, 0.7]))
    finally:
        plt.close(fig)


def test_a_nan_in_the_weights_the_sparsity_figures_draw_is_counted_in_the_plot_line(tmp_path, capsys):
    """The SparseNAS figures are registered for the boolean ``sparsity/<cell>/nonzero`` and draw |A| of
    ``arch/<cell>/params``: a NaN weight was a hatched cell counted in the heatmap's title ("[1 NaN]"), while `nasdiag
    plot`'s line for the record (docs: "the NaN/inf counts of the drawn families") said "no NaN/inf in the drawn
    families". The line counts the NaN the figures draw."""
    from nasdiag.cli import main

    a = np.arange(1, 21, dtype=np.float32).reshape(5, 4)
    a[2, 1], a[0, 0] = np.nan, 0.0
    meta = {"method": "sparsenas", "op_names": ["a", "b", "c", "d"], "cell_types": ["normal"]}
    path = _write(tmp_path / "s.h5", meta, [(1, {"arch/normal/params": a, "sparsity/normal/nonzero": a != 0})])
    fig = _figure(load(path), "sparsity_weights")
    try:
        assert "[1 NaN]" in fig.axes[0].get_title(loc="left").replace("\n", " ")  # what the figure shows
    finally:
        plt.close(fig)
    assert main(["plot", path, "--out", str(tmp_path / "figs"), "--figures", "sparsity", "--dpi", "20"]) == 0
    out = capsys.readouterr().out
    assert "arch/normal/params: 1 NaN" in out and "no NaN/inf" not in out, out


def test_a_nan_of_the_joint_eigenvalue_the_eigenvalue_figure_draws_is_counted_in_the_plot_line(tmp_path, capsys):
    """The eigenvalue figure is registered for ``hessian/<cell>/top_eigenvalue`` and also draws ``hessian/top_eigenvalue``
    (all α jointly, dashed): a NaN of the joint one was marked in the figure while `nasdiag plot`'s line said "no NaN/inf
    in the drawn families"."""
    from nasdiag.cli import main

    rows = [(s, {"hessian/normal/top_eigenvalue": float(s), "hessian/top_eigenvalue": np.nan if s == 2 else 2.0 * s})
            for s in (1, 2, 3)]
    path = _write(tmp_path / "h.h5", {"method": "darts", "cell_types": ["normal"]}, rows)
    fig = _figure(load(path), "hessian_eigenvalue")
    try:
        joint = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "all α jointly"]
        np.testing.assert_array_equal(joint[0].get_ydata(), [2.0, np.nan, 6.0])  # drawn, its NaN marked
        assert "NaN" in [ln.get_label() for ln in fig.axes[0].get_lines()]
    finally:
        plt.close(fig)
    assert main(["plot", path, "--out", str(tmp_path / "figs"), "--figures", "hessian_eigenvalue", "--dpi", "20"]) == 0
    out = capsys.readouterr().out
    assert "hessian/top_eigenvalue: 1 NaN" in out and "no NaN/inf" not in out, out


def test_a_bound_logged_in_fewer_rows_than_the_regret_is_drawn_at_its_own_steps_not_marked_nan(tmp_path):
    """The regret figure read the bound at the regret's rows: a record that logs the bound of Theorem 1 less often
    (every other step) had NaN, the reader's fill for a row without the path, at the other steps, each marked with the
    NaN cross and a "NaN" legend entry, for values the record never held. The bound is drawn at the steps it was logged
    in, with its logged values; no NaN is marked where none was recorded."""
    E = 3
    regret = {s: np.arange(E) + 0.1 * s for s in range(1, 5)}
    bound = {s: 10.0 + np.arange(E) + s for s in (2, 4)}
    rows = [(s, {"regret/normal/regret": regret[s], **({"regret/normal/bound": bound[s]} if s in bound else {})})
            for s in range(1, 5)]
    path = _write(tmp_path / "x.h5", {"method": "xnas", "cell_types": ["normal"]}, rows)
    fig = _figure(load(path), "regret_bound")
    try:
        ax = fig.axes[0]
        dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        assert len(dashed) == E
        for e, line in enumerate(dashed):
            np.testing.assert_array_equal(line.get_xdata(), [2, 4])
            np.testing.assert_allclose(line.get_ydata(), [bound[2][e], bound[4][e]])
        assert "NaN" not in [ln.get_label() for ln in ax.get_lines()]
    finally:
        plt.close(fig)
