"""The §8.3 Monte Carlo: batched runs against one forecaster per run, and the theory it must obey."""

import importlib.util
import os

import numpy as np
import pytest
import torch

from nasdiag.regret import Forecaster, SoftmaxGD, simulate_gaussian_experts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def draws(seed, runs, steps, n, sigma):
    """The biases and rewards simulate_gaussian_experts draws from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    biases = torch.randn(runs, n, generator=gen, dtype=torch.float64)
    rewards = torch.stack([torch.randn(runs, n, generator=gen, dtype=torch.float64) * sigma + biases
                           for _ in range(steps)])
    return biases, rewards


def test_plumbing_batched_runs_match_one_forecaster_per_run():
    """Plumbing: the vectorised Monte Carlo drives Forecaster/SoftmaxGD as one loop per run would (the
    forecaster itself is checked against a literal Algorithm 1 in test_regret_forecaster/test_method_xnas)."""
    runs, steps, n, sigma, seed = 12, 40, 4, 1.5, 7
    out = simulate_gaussian_experts(n, sigma, runs, steps, generator=torch.Generator().manual_seed(seed))
    biases, rewards = draws(seed, runs, steps, n, sigma)
    torch.testing.assert_close(out.biases, biases, rtol=0, atol=0)
    for r in range(runs):
        xnas = Forecaster(n, out.lr, out.loss_bound, steps)
        gd = SoftmaxGD(n, out.lr)
        for t in range(steps):
            xnas.update(rewards[t, r])
            gd.update(rewards[t, r])
        assert float(out.xnas_regret[r]) == pytest.approx(float(xnas.regret), rel=1e-12)
        assert float(out.gd_regret[r]) == pytest.approx(float(gd.regret), rel=1e-12)
        best = int(biases[r].argmax())
        assert bool(out.xnas_correct[r]) == (int(xnas.weights.argmax()) == best)
        assert bool(out.gd_correct[r]) == (int(gd.weights.argmax()) == best)
        assert int(out.xnas_alive[r]) == int(xnas.alive.sum())


def test_xnas_selects_the_leader_in_cumulative_reward():
    """At t = T the threshold is max v itself, so XNAS ends on the expert of largest sum_t R_t,i
    (when no reward broke the bound, Lemma 1 guarantees that expert is still alive)."""
    runs, steps, n, sigma, seed = 200, 60, 6, 2.0, 3
    out = simulate_gaussian_experts(n, sigma, runs, steps, loss_bound=40.0,
                                    generator=torch.Generator().manual_seed(seed))
    assert int(out.bound_violations.sum()) == 0
    biases, rewards = draws(seed, runs, steps, n, sigma)
    totals = rewards.sum(0)
    leader = totals.argmax(-1)
    torch.testing.assert_close(out.uniform_regret, totals.amax(-1) - totals.mean(-1), rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(out.xnas_correct, leader == biases.argmax(-1))
    assert (out.xnas_alive == 1).all()


def test_theorem1_in_every_run_with_bounded_rewards():
    out = simulate_gaussian_experts(5, 0.5, 300, 100, loss_bound=12.0, generator=torch.Generator().manual_seed(0))
    assert int(out.bound_violations.sum()) == 0  # |b| + 0.5 |z| < 12 for these draws
    assert (out.xnas_regret <= out.xnas_bound).all()
    assert ((out.xnas_gamma >= 1) & (out.xnas_gamma < 5)).all()


def test_xnas_regret_grows_slower_with_n_than_gd():
    """Fig. 8 left, qualitatively, at a reduced size: from N = 4 to 32 a regret growing like
    sqrt(ln N) grows x1.6 and one growing like sqrt(N) x2.8; the midpoint 2.2 separates them."""
    gen = torch.Generator().manual_seed(11)
    small = simulate_gaussian_experts(4, 1.0, 200, 200, generator=gen)
    large = simulate_gaussian_experts(32, 1.0, 200, 200, generator=gen)
    xnas_growth = float(large.xnas_regret.mean() / small.xnas_regret.mean())
    gd_growth = float(large.gd_regret.mean() / small.gd_regret.mean())
    assert float(large.xnas_regret.mean()) < float(large.gd_regret.mean())
    assert xnas_growth < 2.2 < gd_growth


def test_script_writes_record_and_draws_figure_from_it(tmp_path):
    spec = importlib.util.spec_from_file_location("xnas_statistical", os.path.join(ROOT, "scripts", "xnas_statistical.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "xs"
    args = ["--out", str(out), "--runs", "8", "--steps", "12", "--n-grid", "2,3,5", "--sigma-grid", "0.5,2",
            "--lr-multipliers", "1,4", "--threads", "1"]
    script.main(args)
    from nasdiag.record import load

    data = load(str(out / "record.h5"))
    assert data["regret/vs_n/xnas/regret"].shape == (7, 8)
    assert np.array_equal(data["regret/vs_n/n_experts"][data["valid/regret/vs_n/n_experts"]], [2, 3, 5])
    assert data["valid/regret/vs_sigma/sigma"].sum() == 2 and data["valid/regret/vs_lr/lr"].sum() == 2
    figure = out / "fig8.png"
    assert figure.stat().st_size > 10_000
    figure.unlink()
    script.main(["--out", str(out), "--plot-only"])  # redrawn from the record alone (the run's options are refused)
    assert figure.exists() and (out / "fits.json").exists()
