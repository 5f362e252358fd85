"""The figure registry: a new family gets its figure by registering one function; every registered figure
is drawn from a record that has its paths, rows are chosen with ``at``, NaN-only data is skipped in one line."""

from __future__ import annotations

import numpy as np
import pytest

from nasdiag import vocabulary as V
from nasdiag.plot import registry as R
from nasdiag.plot import write_figures
from nasdiag.record import load
from plot_records import EDGES, OPS, softmax, write_record


@pytest.fixture(scope="module")
def record_path(tmp_path_factory):
    return write_record(tmp_path_factory.mktemp("rec") / "run.h5")


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(R, "_FIGURES", dict(R.registered()))


def test_a_new_family_is_drawn_by_registering_one_function(tmp_path, clean_registry):
    import matplotlib.pyplot as plt

    seen = []

    @R.figure("toy/<cell>/thing", name="toy", caption="A toy statistic per cell.")
    def toy(record, cell):
        seen.append((cell, record[f"toy/{cell}/thing"].shape))
        fig, ax = plt.subplots()
        ax.plot(record["step"], record[f"toy/{cell}/thing"])
        return fig

    path = write_record(tmp_path / "toy.h5", epochs=1, cells=("normal",),
                        extra={s: {"toy/normal/thing": float(s)} for s in range(1, 5)})
    written = write_figures(path, tmp_path / "figs", figures=["toy"], dpi=40)
    assert [p.name for p in written] == ["toy_normal.png"]
    assert seen == [("normal", (4,))]
    with pytest.raises(ValueError, match="already registered"):
        R.figure("toy/<cell>/thing", name="toy", caption="x")(lambda record, cell: None)


def test_every_builtin_figure_is_drawn_with_stable_names(record_path, tmp_path):
    written = write_figures(record_path, tmp_path, dpi=40)
    names = {p.name for p in written}
    assert {"scalars.png", "arch_normal_heatmap.png", "arch_reduce_evolution.png", "cost_normal_heatmap.png",
            "hessian_reduce_heatmap.png", "genotype_normal.png", "wiring_reduce.png"} <= names
    assert written.skipped == []
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_at_selects_rows_by_step(record_path, tmp_path):
    record = load(record_path)
    cost = V.COST_MEAN.path(cell="normal")
    assert record["step"][R.resolve_row(record, cost, "init")] == 4  # epoch rows are steps 4, 8, 12
    assert record["step"][R.resolve_row(record, cost, "final")] == 12
    assert record["step"][R.resolve_row(record, cost, 11)] == 8  # the last epoch row at or before step 11
    with pytest.raises(R.NothingToDraw, match="first recorded at step 4"):
        R.resolve_row(record, cost, 3)
    written = write_figures(record_path, tmp_path, figures=["cost"], at="init,final,9", dpi=40)
    assert sorted(p.name for p in written) == sorted(
        f"cost_{c}_heatmap_{a}.png" for c in ("normal", "reduce") for a in ("init", "final", "step9"))
    with pytest.raises(R.PlotError, match="--at takes init, final or a step"):
        write_figures(record_path, tmp_path, at="last")
    with pytest.raises(R.PlotError, match="unknown figure"):
        write_figures(record_path, tmp_path, figures=["costs"])


def test_all_nan_record_says_nothing_to_draw(tmp_path):
    import warnings

    with pytest.warns(Warning):  # the recorder flags every NaN it stores
        path = write_record(tmp_path / "nan.h5", epochs=1, nan=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = write_figures(path, tmp_path / "figs", dpi=40)
    assert list(written) == []
    assert any("cost_normal_heatmap" in line and "NaN" in line for line in written.skipped)
    assert all("\n" not in line for line in written.skipped)
    assert caught == []  # no empty-slice or layout warnings: nothing was drawn


def test_arch_heatmap_is_the_deviation_from_uniform(record_path):
    record = load(record_path)
    row = R.resolve_row(record, "arch/normal/probabilities", "final")
    hm = R.registered()["arch"].draw(record, "normal", row)
    assert hm.signed and list(hm.cols) == OPS and list(hm.rows) == EDGES
    np.testing.assert_allclose(hm.matrix + 1 / len(OPS), record["arch/normal/probabilities"][row], atol=1e-7)
    np.testing.assert_allclose(hm.matrix.sum(1), 0, atol=1e-6)  # a distribution minus uniform sums to 0


def test_genotype_of_the_record(record_path):
    from nasdiag.plot.arch import cell_genes

    record = load(record_path)
    genes = cell_genes(record, "normal", len(record["step"]) - 1)
    assert genes == [("max_pool_3x3", 1, 2), ("skip_connect", 0, 2), ("sep_conv_5x5", 2, 3), ("sep_conv_3x3", 1, 3)]


def test_mixed_path_genotype_keeps_every_surviving_op(tmp_path):
    from nasdiag.plot.arch import cell_genes
    from nasdiag.plot.cells import genes_from_pairs, parse_genotype

    mask = np.zeros((len(EDGES), len(OPS)), bool)
    mask[0, [0, 1, 4]] = True  # none is never drawn: it is the absence of an edge
    mask[4, [2, 3]] = True
    extra = {s: {V.SPARSITY_NONZERO.path(cell="normal"): mask} for s in range(1, 5)}
    path = write_record(tmp_path / "sparse.h5", epochs=1, cells=("normal",), extra=extra)
    record = load(path)
    genes = cell_genes(record, "normal", len(record["step"]) - 1)
    assert genes == [("skip_connect", 0, 2), ("sep_conv_3x3", 0, 2), ("max_pool_3x3", 2, 3), ("avg_pool_3x3", 2, 3)]
    # a recorded genotype, as the namedtuple's repr or as JSON, gives the same genes
    text = ("Genotype(normal=[('sep_conv_3x3', 1), ('skip_connect', 0), ('dil_conv_3x3', 2), ('sep_conv_5x5', 0)], "
            "normal_concat=range(2, 4), reduce=[], reduce_concat=range(2, 4))")
    for value in (text, '{"normal": [["sep_conv_3x3", 1], ["skip_connect", 0], ["dil_conv_3x3", 2], ["sep_conv_5x5", 0]]}'):
        g = parse_genotype(value)
        assert genes_from_pairs(g["normal"], 2) == [("sep_conv_3x3", 1, 2), ("skip_connect", 0, 2),
                                                    ("dil_conv_3x3", 2, 3), ("sep_conv_5x5", 0, 3)]
    assert parse_genotype(text)["normal_concat"] == [2, 3]


def test_numbers_and_colour_maps():
    import matplotlib.pyplot as plt

    from nasdiag.plot.style import DIVERGING, SEQUENTIAL, number, render_heatmap, scale_exponent

    assert [number(v, 3) for v in (-1e-9, -0.0004, -0.0006, 0.25, float("nan"))] == ["0", "0", "-0.001", "0.250", "NaN"]
    assert scale_exponent(np.array([3e-4, -1e-5, np.nan])) == -4 and scale_exponent(np.array([0.5])) == 0
    rows, cols = ["a", "b"], ["x", "y"]
    for matrix, cmap in (([[0.1, 2.0], [0.0, 1.0]], SEQUENTIAL), ([[-0.1, 2.0], [0.0, 1.0]], DIVERGING)):
        fig = render_heatmap(R.Heatmap(np.array(matrix), rows, cols, "t", "c"))
        image = fig.axes[0].get_images()[0]
        assert image.get_cmap().name.startswith(cmap)
        if cmap == DIVERGING:  # centred at 0, symmetric
            assert image.norm.vcenter == 0 and image.norm.vmin == -image.norm.vmax
        plt.close(fig)
    with pytest.raises(R.NothingToDraw):
        render_heatmap(R.Heatmap(np.full((2, 2), np.nan), rows, cols, "t", "c"))
