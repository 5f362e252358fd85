"""Figures audit, round 5: every registered heatmap of a record built here through the public `Recorder` shows
exactly the logged values, edges down and ops across (wiring supplement Figs 5, 6, 19-21: "each operation (x-axis)
on each edge (y-axis)"; SparseNAS Fig. 7: ops across, edges down; ASM-NAS Fig. 4), with the record's names on the
axes, a colour range that is the data's, and a NaN cell hatched and annotated "NaN", never drawn as 0; the line
figures plot the logged numbers at the logged steps; no figure changes the record it is drawn from.

The references are the arrays logged here (cast to float32 with numpy, as the recorder stores them) and this file's
own transforms of them (p − 1/K, √Var, |A|), read back from the matplotlib objects (``ax.images[0].get_array()``,
tick labels, the image's norm, line data)."""

from __future__ import annotations

import re
import warnings

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from nasdiag.plot.registry import NothingToDraw, draw_record, iter_figures, registered  # noqa: E402
from nasdiag.plot.style import plt  # noqa: E402
from nasdiag.record import Recorder, RecordWarning, load  # noqa: E402

OPS = ["none", "skip_connect", "sep_conv_3x3", "max_pool_3x3"]
EDGES = {"normal": ["0->2", "1->2", "0->3", "1->3", "2->3"], "reduce": ["0->2'", "1->2'", "0->3'", "1->3'", "2->3'"]}
E, K = 5, 4
NAN_CELL = (1, 2)  # (edge, op) of the one NaN of the cost mean


def _rows(seed: int = 0):
    """Two rows (steps 3 and 7) of every heatmap family for two cell types, float32, with known values."""
    rng = np.random.default_rng(seed)
    rows = {}
    for step in (3, 7):
        row = {"scalars/epoch": float(step // 4)}
        for c, offset in (("normal", 0.0), ("reduce", 10.0)):
            cost = (rng.uniform(-2, 2, (E, K)) * 1e-4).astype(np.float32)
            cost[NAN_CELL] = np.nan
            row.update({
                f"arch/{c}/probabilities": rng.dirichlet(np.ones(K), E).astype(np.float32),
                f"arch/{c}/params": (rng.uniform(-1, 1, (E, K)) + offset).astype(np.float32),
                f"cost/{c}/mean": cost,
                f"cost/{c}/var": rng.uniform(0.1, 1, (E, K)).astype(np.float32),
                f"hessian/{c}/diag": rng.uniform(-50, 50, (E, K)).astype(np.float32),
                f"attention/{c}/mean": rng.uniform(0.1, 1, (E, K)).astype(np.float32),
                f"attention/{c}/count": rng.integers(1, 100, (E, K)),
                f"sample/{c}/count": rng.integers(1, 100, (E, K)),
                f"sparsity/{c}/nonzero": rng.random((E, K)) > 0.3,
            })
        rows[step] = row
    return rows


def _write(path, rows):
    meta = {"method": "darts", "op_names": OPS, "edge_names": EDGES, "cell_types": list(EDGES)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(str(path), meta=meta, flush_seconds=None) as rec:
            for step, row in rows.items():
                rec.log(step, row)
    return str(path)


#: what each heatmap shows, computed here from the logged row
EXPECTED = {
    "arch": lambda row, c: row[f"arch/{c}/probabilities"].astype(float) - 1.0 / K,
    "cost": lambda row, c: row[f"cost/{c}/mean"].astype(float),
    "cost_std": lambda row, c: np.sqrt(row[f"cost/{c}/var"].astype(float)),
    "hessian": lambda row, c: row[f"hessian/{c}/diag"].astype(float),
    "attention": lambda row, c: row[f"attention/{c}/mean"].astype(float),
    "attention_counts": lambda row, c: row[f"attention/{c}/count"].astype(float),
    "sample_counts": lambda row, c: row[f"sample/{c}/count"].astype(float),
    "sparsity_weights": lambda row, c: np.abs(row[f"arch/{c}/params"].astype(float)),
}
#: signed maps are diverging around 0 (symmetric range); the rest run from the smallest to the largest value
SIGNED = {"arch": True, "cost": True, "hessian": True}


def _colourbar_exponent(fig) -> int:
    label = fig.axes[1].get_ylabel().replace("\n", " ")
    return int(label.split("(x 1e")[1].split(")")[0]) if "(x 1e" in label else 0


def test_the_registered_heatmaps_are_the_ones_checked_here():
    assert {name for name, spec in registered().items() if spec.is_heatmap} == set(EXPECTED)


@pytest.mark.parametrize("at", ["init", "final"])
def test_every_heatmap_shows_the_logged_values_edges_down_ops_across_on_the_datas_range(tmp_path, at):
    rows = _rows()
    record = load(_write(tmp_path / "run.h5", rows))
    row = rows[3 if at == "init" else 7]
    seen = set()
    for spec, cell, _, thunk in iter_figures(record, at=at):
        if not spec.is_heatmap:
            continue
        fig = thunk()
        try:
            ax = fig.axes[0]
            image = ax.images[0]
            want = EXPECTED[spec.name](row, cell)
            shown = np.ma.filled(image.get_array().astype(float), np.nan) * 10.0 ** _colourbar_exponent(fig)
            assert shown.shape == (E, K), spec.name  # rows: edges, columns: ops
            np.testing.assert_allclose(shown, want, rtol=1e-9, equal_nan=True, err_msg=f"{spec.name} {cell}")
            assert [t.get_text() for t in ax.get_xticklabels()] == OPS, spec.name
            assert [t.get_text() for t in ax.get_yticklabels()] == EDGES[cell], spec.name
            assert ax.get_xlabel() == "operation" and ax.get_ylabel().startswith("edge")
            finite = want[np.isfinite(want)] / 10.0 ** _colourbar_exponent(fig)
            lo, hi = image.norm.vmin, image.norm.vmax
            if SIGNED.get(spec.name):
                assert (lo, hi) == pytest.approx((-np.abs(finite).max(), np.abs(finite).max()), rel=1e-9), spec.name
            else:
                assert (lo, hi) == pytest.approx((finite.min(), finite.max()), rel=1e-9), spec.name
            title = ax.get_title(loc="left").replace("\n", " ")
            assert re.search(rf"\bsteps? (\d+-)?{3 if at == 'init' else 7}\b", title), (spec.name, title)  # the row's step
            seen.add((spec.name, cell))
        finally:
            plt.close(fig)
    assert seen == {(name, c) for name in EXPECTED for c in EDGES}


def test_a_nan_cell_is_hatched_annotated_nan_and_counted_never_drawn_as_zero(tmp_path):
    rows = _rows()
    record = load(_write(tmp_path / "run.h5", rows))
    (spec, cell, _, thunk), = [f for f in iter_figures(record, figures=["cost"]) if f[1] == "normal"]
    fig = thunk()
    try:
        ax = fig.axes[0]
        mask = np.ma.getmaskarray(ax.images[0].get_array())
        assert np.argwhere(mask).tolist() == [list(NAN_CELL)]  # not coloured at all, in particular not as 0
        i, j = NAN_CELL
        hatched = [(p.get_x(), p.get_y(), p.get_hatch()) for p in ax.patches]
        assert hatched == [(j - 0.5, i - 0.5, "xxx")]
        texts = {tuple(map(float, t.get_position())): t.get_text() for t in ax.texts}
        assert texts[(float(j), float(i))] == "NaN"
        assert "[1 NaN]" in ax.get_title(loc="left").replace("\n", " ")
        assert [t.get_text() for t in fig.legends[0].get_texts()] == ["NaN"]
        # the finite cells are annotated with their own value, at their own (op, edge) position
        exponent = _colourbar_exponent(fig)
        cost = rows[7]["cost/normal/mean"].astype(float)
        for (e, k), value in np.ndenumerate(cost):
            if np.isfinite(value):
                assert float(texts[(float(k), float(e))]) == pytest.approx(value / 10.0**exponent, abs=0.006)
    finally:
        plt.close(fig)


def _line_record(path, T=6):
    """Per-step families of the line figures: p, XNAS regret and bound, alive experts, wipeouts."""
    rng = np.random.default_rng(1)
    meta = {"method": "xnas", "op_names": OPS, "edge_names": {"normal": EDGES["normal"]}, "cell_types": ["normal"]}
    logged = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(str(path), meta=meta, flush_seconds=None) as rec:
            for t in range(T):
                step = 10 + 3 * t  # steps that are not row indices
                alive = rng.random((E, K)) > 0.25
                wiped = np.zeros((E, K), bool)
                wiped[t % E, t % K] = t % 2 == 1
                row = {"arch/normal/probabilities": rng.dirichlet(np.ones(K), E).astype(np.float32),
                       "regret/normal/regret": rng.uniform(0, 1, E).astype(np.float32),
                       "regret/normal/bound": rng.uniform(1, 2, E).astype(np.float32),
                       "regret/normal/alive": alive, "regret/normal/wipeouts": wiped}
                rec.log(step, row)
                logged[step] = row
    return str(path), logged


def test_line_figures_plot_the_logged_numbers_at_the_logged_steps(tmp_path):
    path, logged = _line_record(tmp_path / "run.h5")
    steps = np.array(sorted(logged))
    record = load(path)
    figures = {spec.name: thunk for spec, _, _, thunk in iter_figures(record)}
    # arch_evolution: one panel per edge, one line per op, p over the steps
    fig = figures["arch_evolution"]()
    try:
        for e in range(E):
            ax = fig.axes[e]
            assert ax.get_title(loc="left") == f"edge {EDGES['normal'][e]}"
            lines = {ln.get_label(): ln for ln in ax.get_lines()}
            for k, op in enumerate(OPS):
                np.testing.assert_array_equal(lines[op].get_xdata(), steps)
                np.testing.assert_allclose(lines[op].get_ydata(), [logged[s]["arch/normal/probabilities"][e, k] for s in steps])
            assert lines["uniform 1/K"].get_ydata()[0] == pytest.approx(1 / K)
    finally:
        plt.close(fig)
    # XNAS regret and its bound: one solid and one dashed curve per edge, same colour
    fig = figures["regret_bound"]()
    try:
        ax = fig.axes[0]
        solid = {ln.get_label(): ln for ln in ax.get_lines() if ln.get_linestyle() == "-" and not ln.get_label().startswith("_")}
        dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        assert list(solid) == EDGES["normal"] and len(dashed) == E
        for e, name in enumerate(EDGES["normal"]):
            np.testing.assert_array_equal(solid[name].get_xdata(), steps)
            np.testing.assert_allclose(solid[name].get_ydata(), [logged[s]["regret/normal/regret"][e] for s in steps])
            np.testing.assert_allclose(dashed[e].get_ydata(), [logged[s]["regret/normal/bound"][e] for s in steps])
            assert dashed[e].get_color() == solid[name].get_color()
    finally:
        plt.close(fig)
    # alive experts: per edge the number of alive ops (each curve offset by a fixed fraction below 0.5)
    fig = figures["alive_experts"]()
    try:
        ax = fig.axes[0]
        for e, line in enumerate(ln for ln in ax.get_lines() if ln.get_label() in EDGES["normal"]):
            counts = [logged[s]["regret/normal/alive"][e].sum() for s in steps]
            np.testing.assert_allclose(np.round(line.get_ydata()), counts)
            assert np.abs(line.get_ydata() - counts).max() < 0.5
    finally:
        plt.close(fig)
    # wipeouts: one point per (step, edge, op) event, at its step and its edge's row, coloured by op
    fig = figures["wipeouts"]()
    try:
        ax = fig.axes[0]
        events = sorted((s, e, k) for s in steps for e, k in zip(*np.nonzero(logged[s]["regret/normal/wipeouts"])))
        drawn = []
        for collection in ax.collections:
            k = OPS.index(collection.get_label())
            for x, y in collection.get_offsets():
                drawn.append((int(x), int(round(y)), k))
        assert sorted(drawn) == events
        assert [t.get_text() for t in ax.get_yticklabels()] == EDGES["normal"]
    finally:
        plt.close(fig)


def _snapshot(record):
    return {k: np.array(v, copy=True) for k, v in record.items()}


def _same(a, b):
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert np.array_equal(a[key], b[key], equal_nan=a[key].dtype.kind == "f"), key


@pytest.mark.parametrize("rows", ["one", "nan"])
def test_drawing_every_figure_leaves_the_record_unchanged(tmp_path, rows):
    """One row of every family (so init = final), or the two-row record with NaN/inf in every float family."""
    logged = _rows()
    if rows == "one":
        logged = {7: logged[7]}
    else:
        for row in logged.values():
            for key, value in row.items():
                if np.asarray(value).dtype.kind == "f" and np.ndim(value):
                    value.flat[0], value.flat[-1] = np.inf, np.nan
    path, line_logged = _line_record(tmp_path / "lines.h5")
    for record in (load(_write(tmp_path / "run.h5", logged)), load(path)):
        before = _snapshot(record)
        drawn = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for _, _, _, thunk in iter_figures(record, at="init,final"):  # drawn, not saved: saving reads only
                try:
                    fig = thunk()
                except NothingToDraw:
                    continue
                fig.canvas.draw()
                plt.close(fig)
                drawn += 1
        assert drawn >= 7
        _same(before, record)


def test_a_wiring_whose_every_row_holds_a_nan_is_skipped_with_a_reason_not_an_index_error(tmp_path):
    """p finite in most cells but NaN (or inf) in one cell of every row: the wiring figure dropped every row and
    then indexed the empty selection (IndexError out of `draw_record`, so `nasdiag plot` stopped at it)."""
    logged = _rows()
    for row in logged.values():
        row["arch/normal/probabilities"][0, 0] = np.nan
        row["arch/reduce/probabilities"][4, 3] = np.inf
    record = load(_write(tmp_path / "run.h5", logged))
    drawn = draw_record(record, tmp_path / "figs", figures=["wiring", "arch"])
    assert sorted(p.name for p in drawn.files) == ["arch_normal_heatmap.png", "arch_reduce_heatmap.png"]
    assert sorted(drawn.skipped) == [
        "wiring_normal: arch/normal/probabilities has a NaN or inf in every row; no wiring to derive",
        "wiring_reduce: arch/reduce/probabilities has a NaN or inf in every row; no wiring to derive",
    ]


def _malformed_record(path):
    """A record written without op or edge names (so the recorder checks no E/K): some paths with rows of another
    shape than their family's."""
    rng = np.random.default_rng(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(str(path), meta={"method": "custom"}, flush_seconds=None) as rec:
            for step in range(3):
                rec.log(step, {
                    "arch/normal/probabilities": np.full(E, 1.0 / K),  # (E,), not (E, K)
                    "cost/normal/mean": rng.standard_normal((E, K)),  # fine: drawn
                    "regret/normal/regret": rng.random(E),
                    "regret/normal/bound": rng.random(E - 1) + 1,  # E - 1 edges beside E
                    "arch/reduce/params": rng.standard_normal((2, E, K)),  # read by the sparsity figures
                    "sparsity/reduce/nonzero": rng.random((E, K)) > 0.5,
                    "hessian/top_eigenvalue": np.ones(3),  # (3,), not ()
                    "hessian/normal/top_eigenvalue": 1.0,
                })
    return str(path)


def test_paths_whose_rows_are_not_their_familys_shape_are_left_out_with_a_reason_not_a_traceback(tmp_path):
    """The recorder checks E and K only against meta that names them; figures unpacked (E, K) from an (E,) row
    (ValueError), indexed an (E - 1,) bound per edge (IndexError), plotted a (T, 3) eigenvalue as one curve, and read
    a 3-axis |A|, each out of `draw_record`, so `nasdiag plot` stopped with a traceback."""
    record = load(_malformed_record(tmp_path / "run.h5"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        drawn = draw_record(record, tmp_path / "figs")
    names = sorted(p.name for p in drawn.files)
    assert "cost_normal_heatmap.png" in names and "hessian_normal_eigenvalue.png" in names
    skipped = "\n".join(drawn.skipped)
    for gone in ("arch_normal_heatmap", "arch_normal_evolution", "regret_bound_normal"):
        assert gone not in " ".join(names) and gone in skipped, gone
    assert "arch/normal/probabilities has rows of shape (5,), not the (E, K) of its family" in skipped
    assert re.search(r"regret/normal/bound has rows of shape \(4,\): E = 4, but \S+/normal/\S+ gives E = 5", skipped)
    assert not any(name.startswith("sparsity_reduce") for name in names)  # |A| of 3 axes is left out, and said so
    assert "arch/reduce/params has rows of shape (2, 5, 4), not the (E, K) of its family; left out of the figures" in skipped
    assert "hessian/top_eigenvalue has rows of shape (3,), not the () of its family; left out of the figures" in skipped


def test_nasdiag_plot_of_a_record_with_malformed_paths_draws_the_rest(tmp_path, capsys):
    from nasdiag.cli import main

    path = _malformed_record(tmp_path / "run.h5")
    code = main(["plot", path, "--out", str(tmp_path / "figs")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Traceback" not in captured.err + captured.out
    assert (tmp_path / "figs" / "cost_normal_heatmap.png").exists()


def test_a_record_being_written_draws_its_committed_rows_only(tmp_path):
    """Drawn while its recorder is open, with rows buffered after the last flush: the heatmap shows the last
    committed row and the curves end there; the buffered rows appear once flushed."""
    meta = {"method": "darts", "op_names": OPS, "edge_names": {"normal": EDGES["normal"]}, "cell_types": ["normal"]}
    rng = np.random.default_rng(3)
    logged = {}
    path = str(tmp_path / "run.h5")
    rec = Recorder(path, meta=meta, flush_every=4, flush_seconds=None)
    try:
        for step in range(10):  # steps 0-7 committed, 8 and 9 buffered
            logged[step] = rng.dirichlet(np.ones(K), E).astype(np.float32)
            rec.log(step, {"arch/normal/probabilities": logged[step]})
        for committed in (7, 9):
            record = load(path)
            figures = {spec.name: thunk for spec, _, _, thunk in iter_figures(record, figures=["arch", "arch_evolution"])}
            fig = figures["arch"]()
            try:
                shown = np.ma.filled(fig.axes[0].images[0].get_array().astype(float), np.nan)
                np.testing.assert_allclose(shown, logged[committed].astype(float) - 1 / K, rtol=1e-12)
            finally:
                plt.close(fig)
            fig = figures["arch_evolution"]()
            try:
                line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == OPS[0])
                np.testing.assert_array_equal(line.get_xdata(), np.arange(committed + 1))
            finally:
                plt.close(fig)
            rec.flush()
    finally:
        rec.close()


def test_nasdiag_report_of_a_record_with_malformed_paths_lists_them_instead_of_a_traceback(tmp_path):
    """The report's genotype line unpacked (E, K) from the (E,) p: ValueError out of write_report."""
    from nasdiag.plot import write_report

    path = _malformed_record(tmp_path / "run.h5")
    write_report(path, str(tmp_path / "report.html"))
    page = (tmp_path / "report.html").read_text()
    for line in ("arch/normal/probabilities has rows of shape (5,), not the (E, K) of its family",
                 "arch/reduce/params has rows of shape (2, 5, 4), not the (E, K) of its family",
                 "hessian/top_eigenvalue has rows of shape (3,), not the () of its family"):
        assert line in page, line
    assert 'id="cost_normal_heatmap"' in page
