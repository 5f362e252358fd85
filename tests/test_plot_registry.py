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
