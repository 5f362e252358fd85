"""Figures audit, round 21: the figure families earlier rounds read back least (the alive-experts and switch step
plots, the wipeout scatter, the sampling and scalar curves, the attention counts, the report's embedded images and
key numbers) of records written here through the public `Recorder` with known values, distinct per edge, op and step,
read back from the matplotlib artists (line data, axis limits, tick labels, annotation texts) and compared with this
file's own expectation.

The references are the arrays logged here and this file's own arithmetic on them; nothing is computed by nasdiag.

Checked and found right (probes in the round's scratch, not kept as tests where earlier rounds cover them): the wipeout
scatter puts each planted event at its logged step (rows logged every other step), its edge row and its op's legend
entry; the sampling figure's temperature and entropy curves (entropy logged every third step) and its log K ceiling, and
the scalars figure's panels (a +inf loss marked at its step, a learning rate spanning decades on a log axis, a constant
one beside it, norms, other scalars in panels of their own) plot the logged numbers at the logged steps; every
registered figure of a record of 35 edges (7 nodes) × 8 ops names every edge and op (heatmap tick labels, one titled
panel per edge, one legend entry per edge or op) and of a record of one step draws a visible mark for every value; the
most probable wiring of the 35-edge cell labels the argmax op of every edge whose argmax is not none;
wiring_output_cost's Figs 11-16 put L_θ, H_θ on the left axis and C_Z on the twin axis of the right split and part, at
the logged epochs; the report's key numbers of that record are the last logged values with their steps (a NaN last
value shown with the last finite one).

Left alone: past 20 edges the regret and alive/switch curves repeat tab20's colours (no qualitative map has more; the
legend still names each edge); heatmaps of more than 240 cells are drawn without annotations (colour and bar only, as
before); `nasdiag plot` of several records prints a comparison's skipped lines only when no comparison figure was drawn.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from nasdiag.plot.registry import iter_figures  # noqa: E402
from nasdiag.plot.style import plt  # noqa: E402
from nasdiag.record import load  # noqa: E402

from test_audit_figures_round17 import _write  # noqa: E402


def _figures(record, names):
    return {spec.name: thunk() for spec, _, _, thunk in iter_figures(record, names)}


@pytest.mark.parametrize("E", [3, 35])
def test_the_ops_on_per_edge_curves_stay_nearest_their_count_and_on_the_axis_however_many_edges(tmp_path, E):
    """alive_experts and bayes_switches draw how many ops of each edge are on as step curves, each edge shifted
    0.04 × (e − (E − 1)/2) to keep overlapping curves apart, on a y axis of 0.5..K + 0.5. A cell of 7 intermediate nodes
    has 35 edges: the shift reached ±0.68, so edge 0 with 2 ops on was drawn at 1.32 (read as 1), with 1 op at 0.32,
    below the axis and not drawn at all. Every curve must stay nearer its own count than any other and inside the axis."""
    K = 4
    counts = np.array([[1 + (e + s) % K for e in range(E)] for s in range(4)])  # (T, E): every count on every edge
    rows = []
    for s in range(4):
        on = np.arange(K)[None, :] < counts[s][:, None]
        rows.append((10 * (s + 1), {"regret/normal/alive": on, "bayes/normal/switch": on}))
    record = load(_write(tmp_path / "r.h5", {"method": "xnas"}, rows))
    figs = _figures(record, ["alive_experts", "bayes_switches"])
    try:
        assert set(figs) == {"alive_experts", "bayes_switches"}
        for name, fig in figs.items():
            ax = fig.axes[0]
            lo, hi = ax.get_ylim()
            curves = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
            assert list(curves) == [f"edge {e}" for e in range(E)], name
            for e in range(E):
                x, y = curves[f"edge {e}"].get_data()
                np.testing.assert_array_equal(x, [10, 20, 30, 40])
                assert np.all(np.abs(np.asarray(y) - counts[:, e]) < 0.5), (name, e, y, counts[:, e])
                assert np.all((lo < np.asarray(y)) & (np.asarray(y) < hi)), (name, e, y, (lo, hi))
    finally:
        plt.close("all")


def test_the_bayes_panels_and_the_wipeouts_give_each_of_twelve_ops_its_own_colour(tmp_path):
    """bayes_gamma/omega/curvature draw one line per op in every edge's panel, wipeouts one point per wiped op, each
    coloured by op and named in one legend; both took tab10's colour k % 10, so in a space of 12 ops op 0 and op 10 (and
    1 and 11) were one colour under two names: a reader could not tell which op a curve or point is (arch_evolution and
    the regret curves switch to tab20 past 10). Each op keeps its own colour, and its curve is the logged values."""
    E, K, T = 2, 12, 3
    ops = [f"op_{k}" for k in range(K)]
    values = {s: (1 + np.arange(E * K).reshape(E, K)) * 10.0 ** (s - 2) for s in range(1, T + 1)}  # γ > 0: log axis
    rows = []
    for s in range(1, T + 1):
        wiped = np.zeros((E, K), bool)
        wiped[s % E, [s - 1, s - 1 + 10 * (s < 3)]] = True  # op 0 and op 10, then op 1 and op 11, then op 2
        rows.append((s, {"bayes/normal/gamma": values[s], "bayes/normal/omega": values[s],
                         "bayes/normal/curvature": values[s], "regret/normal/wipeouts": wiped}))
    record = load(_write(tmp_path / "r.h5", {"method": "bayesnas", "op_names": ops}, rows))
    figs = _figures(record, ["bayes_gamma", "bayes_omega", "bayes_curvature", "wipeouts"])
    try:
        assert len(figs) == 4
        for name in ("bayes_gamma", "bayes_omega", "bayes_curvature"):
            fig = figs[name]
            handles = dict(zip([t.get_text() for t in fig.legends[0].get_texts()], fig.legends[0].legend_handles))
            colours = [matplotlib.colors.to_hex(handles[op].get_color()) for op in ops]
            assert len(set(colours)) == K, (name, colours)
            for e, ax in enumerate(fig.axes[:E]):
                curves = [line for line in ax.get_lines() if len(line.get_xdata()) == T]
                assert len(curves) == K, (name, e)
                for k, line in enumerate(curves):
                    assert matplotlib.colors.to_hex(line.get_color()) == colours[k], (name, e, k)
                    np.testing.assert_array_equal(line.get_xdata(), [1, 2, 3])
                    np.testing.assert_allclose(line.get_ydata(), [values[s][e, k] for s in (1, 2, 3)], rtol=1e-6)
        ax = figs["wipeouts"].axes[0]
        points = {}
        for coll in ax.collections:
            points[coll.get_label()] = (matplotlib.colors.to_hex(coll.get_facecolor()[0]),
                                        sorted((int(x), int(round(y))) for x, y in coll.get_offsets()))
        assert points.keys() == {"op_0", "op_10", "op_1", "op_11", "op_2"}
        assert len({colour for colour, _ in points.values()}) == 5, points
        assert {op: where for op, (_, where) in points.items()} == {
            "op_0": [(1, 1)], "op_10": [(1, 1)], "op_1": [(2, 0)], "op_11": [(2, 0)], "op_2": [(3, 1)]}
    finally:
        plt.close("all")
