"""SparseNAS weight-distribution figures (sparse-supernet Figs 7, 8): a short search through `nasdiag.search.run`,
then ``nasdiag plot`` draws |A| per cell at a step and over the epochs; the map's zeros are exactly the ops the
method recorded as pruned; records without A, or with A NaN, say "nothing to draw" in one line."""

from __future__ import annotations

import argparse
import contextlib

import numpy as np
import pytest

from nasdiag import vocabulary as V
from nasdiag.plot import commands, write_figures
from nasdiag.plot.registry import registered, resolve_row
from nasdiag.record import Recorder, load
from plot_records import write_record

FIGURES = "sparsity_weights,sparsity_evolution"


@pytest.fixture(scope="module")
def sparse_record(tmp_path_factory):
    from nasdiag.search.config import SearchConfig
    from nasdiag.search.runner import run

    path = tmp_path_factory.mktemp("sparse") / "s.h5"
    # two steps (one per epoch); HAPG with a large step and λ so that the proximal step prunes ops at once (A spread
    # around 1/K by init_scale: some ops and, in the reduction cell, a whole node go, the others stay)
    cfg = SearchConfig(method="sparsenas", dataset="synthetic", epochs=2, batch_size=256, C=2, layers=3, steps=2,
                       multiplier=2, record=str(path), figures=None, diagnostics=(), progress=False, threads=1,
                       hp={"first_order": True, "optimizer": "hapg", "hapg_lr": 0.5, "lambda_step": 0.3, "init_scale": 0.05})
    run(cfg)
    return path


def plot(argv):
    parser = argparse.ArgumentParser(prog="nasdiag")
    commands.add_plot_arguments(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plot", *argv])
    return args.handler(args)


def test_nasdiag_plot_draws_the_weight_distributions_of_every_cell(sparse_record, tmp_path):
    import matplotlib.image as mpimg

    code = plot([str(sparse_record), "--out", str(tmp_path), "--figures", FIGURES, "--dpi", "40", "--no-progress"])
    assert code == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["sparsity_normal_evolution.png", "sparsity_normal_weights.png",
                     "sparsity_reduce_evolution.png", "sparsity_reduce_weights.png"]
    for name in names:
        pixels = mpimg.imread(tmp_path / name)[..., :3]
        assert pixels.std() > 0.05, f"{name} is blank"


def test_the_map_is_abs_A_and_its_zeros_are_the_recorded_pruned_ops(sparse_record):
    record = load(sparse_record)
    spec = registered()["sparsity_weights"]
    for cell in ("normal", "reduce"):
        row = resolve_row(record, V.SPARSITY_NONZERO.path(cell=cell), "final")
        hm = spec.draw(record, cell, row)
        A = record[V.ARCH_PARAMS.path(cell=cell)][row]
        np.testing.assert_array_equal(hm.matrix, np.abs(A))
        nonzero = record[V.SPARSITY_NONZERO.path(cell=cell)][row]
        np.testing.assert_array_equal(hm.matrix != 0, nonzero)
        assert 0 < nonzero.sum() < nonzero.size, "the setting should prune some ops and keep others"
        assert not hm.signed  # emptied edges are drawn as zeros (eq 10 removes whole nodes)


def test_evolution_shows_the_first_step_and_every_epoch_end(sparse_record):
    from nasdiag.plot.sparsity import epoch_rows

    record = load(sparse_record)
    rows = epoch_rows(record, V.SPARSITY_NONZERO.path(cell="normal"))
    ends = np.flatnonzero(record["valid/scalars/epoch"])
    assert rows == sorted({0, *ends.tolist()})  # step 1 is also the end of epoch 0 here: one panel each


def test_absent_or_empty_weights_say_nothing_to_draw(tmp_path):
    # a DARTS record has no sparsity/ family: the figures are not drawn and nothing is reported
    darts = write_record(tmp_path / "darts.h5", epochs=1, cells=("normal",))
    assert list(write_figures(darts, tmp_path / "d", figures=["sparsity"], dpi=40)) == []
    # the family without A (no arch/<cell>/params) and with A NaN: one line each, no figure
    E, K = 5, 3
    for name, params in (("no_params", None), ("nan_params", np.full((E, K), np.nan))):
        path = tmp_path / f"{name}.h5"
        with pytest.warns(Warning) if params is not None else contextlib.nullcontext():  # the recorder flags NaN
            with Recorder(str(path), meta={"method": "sparsenas"}) as rec:
                row = {V.SPARSITY_NONZERO.path(cell="normal"): np.ones((E, K), bool)}
                if params is not None:
                    row[V.ARCH_PARAMS.path(cell="normal")] = params
                rec.log(1, row)
        written = write_figures(path, tmp_path / name, figures=["sparsity"], dpi=40)
        assert list(written) == []
        assert len(written.skipped) == 2
        assert all("nothing to draw" in line and "\n" not in line for line in written.skipped), written.skipped

