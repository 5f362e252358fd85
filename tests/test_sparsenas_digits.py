"""The DIGITS pruning ablation (sparse-supernet Fig. 3, `scripts/sparsenas_digits.py`) on a reduced grid: HAPG with
SGL is sparser than SGD with the subgradients of the same penalty, in weights and in groups, at comparable
accuracy, and SGL keeps fewer groups than Lasso; HAPG without the penalty (λ = 0, the same optimizer with no
proximal shrinkage) does not satisfy the claims. The record round trip, the figure and bad command lines."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sparsenas_digits.py"

#: λ from the paper's range (10^-4 … 10^-3.7); 300 search epochs (paper 500) and 20 stand-alone epochs (3000)
LAMBDAS = (1e-4, 10 ** -3.7)
EPOCHS, RETRAIN = 300, 20
#: at comparable accuracy (within 3 points of the grid's best): ≥ 5 points more weight sparsity, ≥ 3 fewer groups
MARGINS = dict(accuracy_slack=0.03, sparsity_margin=0.05, group_margin=3.0)


@pytest.fixture(scope="module")
def sd():
    spec = importlib.util.spec_from_file_location("sparsenas_digits", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def grid(sd):
    """HAPG and SGD with SGL, HAPG with Lasso, at each λ; and HAPG with λ = 0 (no proximal shrinkage)."""
    data = sd.digits_tensors(0)
    runs = [sd.run_config(o, p, lam, data, EPOCHS, RETRAIN, 0)
            for lam in LAMBDAS for o, p in (("sgd", "sgl"), ("hapg", "sgl"), ("hapg", "lasso"))]
    unpenalised = sd.run_config("hapg", "sgl", 0.0, data, EPOCHS, RETRAIN, 0)
    return runs, unpenalised


@pytest.mark.slow
def test_hapg_with_sgl_is_sparser_than_sgd_and_than_lasso(sd, grid):
    runs, _ = grid
    claims = sd.claim_holds(runs, **MARGINS)
    assert claims.holds("prox_vs_subgradient"), claims.summary()  # element and group sparsity
    assert claims.holds("sgl_vs_lasso", "group"), claims.summary()
    assert claims.comparisons["prox_vs_subgradient"].lambdas == len(LAMBDAS)  # every λ at comparable accuracy
    # the proximal step leaves exact zeros; the network still classifies (10 classes: chance is 0.1)
    assert all(r.accuracy > 0.9 for r in runs)


@pytest.mark.slow
def test_the_claims_fail_without_the_proximal_shrinkage(sd, grid):
    runs, unpenalised = grid
    # the HAPG rows replaced by HAPG at λ = 0 (same optimizer, momentum and schedule, no penalty)
    control = [dataclasses.replace(unpenalised, penalty=r.penalty, lam=r.lam) if r.optimizer == "hapg" else r for r in runs]
    claims = sd.claim_holds(control, **MARGINS)
    assert not claims.holds("prox_vs_subgradient", "element")
    assert not claims.holds("prox_vs_subgradient", "group")
    assert not claims.holds("sgl_vs_lasso", "group")
    assert unpenalised.sparsity < 0.01 and unpenalised.groups == 124  # nothing pruned without λ


def test_claims_need_both_sides_and_respect_the_accuracy_floor(sd):
    R = sd.Result
    rows = [R("sgd", "sgl", 1e-4, 0.96, 64, 60, 0.10), R("hapg", "sgl", 1e-4, 0.95, 40, 40, 0.60)]
    assert sd.claim_holds(rows).holds("prox_vs_subgradient")
    assert not sd.claim_holds(rows).holds("sgl_vs_lasso")  # no Lasso rows: the claim is absent, not true
    # the sparse network lost accuracy beyond the slack: it is not comparable, so nothing is claimed
    collapsed = [rows[0], dataclasses.replace(rows[1], accuracy=0.5)]
    assert not sd.claim_holds(collapsed).holds("prox_vs_subgradient")


def test_record_round_trip_and_the_four_panels(sd, tmp_path, capsys):
    import matplotlib.image as mpimg

    R = sd.Result
    rows = [R(o, p, lam, 0.9 + lam, 64 - i, 60 - i, 0.1 * i, 1.0)
            for i, (o, p, lam) in enumerate([("sgd", "sgl", 1e-4), ("sgd", "sgl", 1e-3), ("hapg", "lasso", 1e-4),
                                             ("hapg", "lasso", 1e-3)])]
    sd.write_record(rows, tmp_path / "fig3.h5", {"epochs": 1})
    for back, row in zip(sd.read_record(tmp_path / "fig3.h5"), rows, strict=True):
        assert (back.optimizer, back.penalty, back.features, back.neurons) == (row.optimizer, row.penalty, row.features, row.neurons)
        assert (back.lam, back.accuracy, back.sparsity) == pytest.approx((row.lam, row.accuracy, row.sparsity), rel=1e-6)
    assert sd.main(["--out", str(tmp_path), "--plot-only"]) == 0
    out = capsys.readouterr().out
    assert f"figure: {tmp_path / 'fig3.png'}" in out and "| sgd | sgl |" in out
    pixels = mpimg.imread(tmp_path / "fig3.png")[..., :3]
    assert pixels.std() > 0.05


@pytest.mark.parametrize("argv, message", [
    (["--optimizers", "sgd,rmsprop"], "unknown optimizer"),
    (["--penalties", "ridge"], "unknown penalty"),
    (["--lambdas", "1e-4,0"], "λ must be > 0"),
    (["--lambdas=-1e-3"], "λ must be > 0"),
    (["--lambdas", "small"], "not a number"),
    (["--epochs", "0"], "--epochs must be >= 1"),
])
def test_bad_command_lines_exit_2_with_one_line(sd, tmp_path, capsys, argv, message):
    assert sd.main([*argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "x").exists()  # nothing written
