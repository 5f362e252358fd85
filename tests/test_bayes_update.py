"""The sparse-Bayesian update of BayesNAS (appendix §A) against direct numerical minimisation (scipy,
float64), autograd, and a linear-Gaussian model whose posterior and evidence are known in closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import optimize, stats

from nasdiag.bayes import (ENTROPY_THRESHOLD_GAMMA, covariance, dependent_gamma, entropy, group_bayes_update, group_omega,
                           group_switch, lasso_weights, omega, parent_matrix, posterior_mean, prune, sparse_bayes_update,
                           switch)
from nasdiag.supernet.cell import edge_nodes as darts_edge_nodes

T = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731


def test_switch_a2_11_minimises_the_bound_of_a2_10():
    rng = np.random.default_rng(0)
    for _ in range(20):
        w, om = rng.normal() * 3, rng.uniform(0.05, 5)
        # minimise w²/s + ω² s over s > 0 directly (log-parametrised)
        res = optimize.minimize_scalar(lambda u: w * w / math.exp(u) + om * om * math.exp(u), bounds=(-20, 20),
                                       method="bounded", options={"xatol": 1e-12})
        assert float(switch(T(w), T(om))) == pytest.approx(math.exp(res.x), rel=1e-5)


def test_lasso_a2_12_and_switch_a2_13_minimise_the_joint_cost_a2_10():
    """(w, s) = argmin ½Hw² + w(g − Hw*) + ½(w²/s + ω² s): A.2.12's soft threshold and A.2.13's s = |w|/ω."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        h, ws, g, om = rng.uniform(0.1, 4), rng.normal(), rng.normal() * 2, rng.uniform(0.01, 3)

        def cost(v):
            w, u = v
            return 0.5 * h * w * w + w * (g - h * ws) + 0.5 * (w * w / math.exp(u) + om * om * math.exp(u))

        w_closed = float(lasso_weights(T(ws), T(g), T(h), T(om)))
        s_closed = float(switch(T(w_closed), T(om)))
        best = min((optimize.minimize(cost, x0, method="Nelder-Mead", options={"xatol": 1e-11, "fatol": 1e-14, "maxiter": 20000})
                    for x0 in ([0.5, 0.0], [-0.5, 0.0], [w_closed + 0.3, 1.0])), key=lambda r: r.fun)
        # the joint minimum over s (s → 0 where w = 0) equals the lasso objective at the closed-form w
        lasso = lambda w: 0.5 * h * w * w + w * (g - h * ws) + om * abs(w)  # noqa: E731
        ref = optimize.minimize_scalar(lasso, bounds=(-50, 50), method="bounded", options={"xatol": 1e-12})
        assert w_closed == pytest.approx(ref.x, abs=1e-6)
        assert lasso(w_closed) <= best.fun + 1e-9
        if abs(w_closed) > 1e-3:
            assert best.x[0] == pytest.approx(w_closed, abs=1e-4)
            assert s_closed == pytest.approx(math.exp(best.x[1]), rel=1e-3)


def test_omega_a2_8_is_the_gradient_of_the_concave_part():
    """ω² = ∂/∂s [log s + log(1/s + H)] at s = γ (A.2.7), by autograd; C of A.3.2 = (1/γ + H)⁻¹."""
    gamma = torch.tensor([0.01, 0.3, 1.0, 7.0], dtype=torch.float64, requires_grad=True)
    h = T(0.5, 2.0, 0.0, 10.0)
    v = (torch.log(gamma) + torch.log(1 / gamma + h)).sum()
    (grad,) = torch.autograd.grad(v, gamma)
    g = gamma.detach()
    cov = covariance(g, h)
    torch.testing.assert_close(cov, torch.linalg.inv(torch.diag(1 / g) + torch.diag(h)).diagonal())
    torch.testing.assert_close(omega(g, cov) ** 2, grad)


def test_group_switch_a3_8_minimises_a3_7_and_group_omega_a3_9_is_the_concave_gradient():
    """A group of ℵ elements sharing s: Σ_i (w_i²/s + ω_i² s) is minimised at s = ‖w‖₂/√(Σ ω_i²) (A.3.7-A.3.8,
    scipy), and ω_group² = ∂/∂s Σ_i [log s + log(1/s + H_i)] at s = γ (A.3.9 from A.2.7, autograd)."""
    rng = np.random.default_rng(7)
    for aleph in (1, 2, 5):
        w, h = rng.normal(size=aleph) * 2, rng.uniform(0.01, 5, size=aleph)
        gamma = rng.uniform(0.05, 3)
        g = torch.tensor(gamma, dtype=torch.float64, requires_grad=True)
        H = torch.tensor(h, dtype=torch.float64)
        (grad,) = torch.autograd.grad((torch.log(g) + torch.log(1 / g + H)).sum(), g)
        om = group_omega(g.detach(), covariance(g.detach(), H))
        assert float(om) ** 2 == pytest.approx(float(grad), rel=1e-12)
        oms = omega(g.detach(), covariance(g.detach(), H)).numpy()
        res = optimize.minimize_scalar(lambda u: sum(wi * wi / math.exp(u) + oi * oi * math.exp(u) for wi, oi in zip(w, oms)),
                                       bounds=(-20, 20), method="bounded", options={"xatol": 1e-12})
        assert float(group_switch(T(*w), om)) == pytest.approx(math.exp(res.x), rel=1e-5)
    # a group of one is the single-parameter update (A.2.8, A.2.13)
    P = parent_matrix(darts_edge_nodes(2)).double()
    wg, hg, gg = (torch.rand(5, 3, dtype=torch.float64) + 0.1 for _ in range(3))
    one, grp = sparse_bayes_update(wg, hg, gg, P), group_bayes_update(wg.unsqueeze(0), hg.unsqueeze(0), gg, P)
    for a, b in ((one.omega, grp.omega), (one.switch, grp.switch), (one.gamma, grp.gamma), (one.cov, grp.cov[0])):
        torch.testing.assert_close(a, b)


def test_negative_curvature_is_clamped_and_dead_switch_stays_dead():
    cov = covariance(T(1.0, 0.0), T(-3.0, 2.0))
    torch.testing.assert_close(cov, T(1.0, 0.0))  # H < 0 treated as 0: C = γ
    om = omega(T(1.0, 0.0), cov)
    assert om[0] == 0 and math.isinf(om[1])
    assert switch(T(0.7), om[1:]) == 0
    # γ = ∞ (the limits): C = 1/H, ω = 0
    torch.testing.assert_close(covariance(T(math.inf), T(4.0)), T(0.25))
    assert omega(T(math.inf), T(0.25)) == 0


def test_linear_gaussian_toy_posterior_and_evidence():
    """E_D(w) = ‖y − Xw‖²/(2σ²) with orthogonal columns: H = diag(XᵀX)/σ² is exact and the coordinates
    decouple. (1) A.1.6 at any expansion point w* equals the conjugate posterior N(Σ Xᵀy/σ², Σ),
    Σ = (XᵀX/σ² + S⁻¹)⁻¹; (2) iterating A.3.2 → A.2.8 → A.2.12 → A.2.13 (no edge dependency) converges
    to the s maximising the marginal likelihood log N(y | 0, σ²I + X S Xᵀ), found by scipy."""
    rng = np.random.default_rng(3)
    n, d, sigma = 12, 3, 0.7
    q, _ = np.linalg.qr(rng.normal(size=(n, d)))
    X = q * np.array([2.0, 1.0, 3.0])
    w_true = np.array([1.5, 0.0, -0.8])
    y = X @ w_true + sigma * rng.normal(size=n)
    H = np.diag(X.T @ X) / sigma**2
    # (1) posterior at an arbitrary expansion point
    S = np.array([0.5, 2.0, 0.1])
    Sigma = np.linalg.inv(X.T @ X / sigma**2 + np.diag(1 / S))
    mu = Sigma @ X.T @ y / sigma**2
    w_star = rng.normal(size=d)
    g = -X.T @ (y - X @ w_star) / sigma**2
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    torch.testing.assert_close(covariance(t(S), t(H)), t(np.diag(Sigma)))
    torch.testing.assert_close(posterior_mean(t(w_star), t(g), t(H), t(S)), t(mu))
    # (2) type-II maximum likelihood by the CCCP of A.2
    def neg_evidence(log_s):
        return -stats.multivariate_normal(np.zeros(n), sigma**2 * np.eye(n) + X @ np.diag(np.exp(log_s)) @ X.T).logpdf(y)
    ref = optimize.minimize(neg_evidence, np.zeros(d), method="L-BFGS-B", bounds=[(-30, 8)] * d)
    s_ref = np.exp(ref.x)
    s, w = t(np.ones(d)), t(np.ones(d))
    parents = torch.zeros(d, d, dtype=torch.float64)
    for _ in range(400):
        g = -t(X.T @ (y - X @ w.numpy())) / sigma**2
        om = omega(s, covariance(s, t(H)))
        w = lasso_weights(w, g, t(H), om)
        s = dependent_gamma(switch(w, om).unsqueeze(-1), parents).squeeze(-1)  # no predecessors: γ = s
    assert neg_evidence(np.log(np.maximum(s.numpy(), 1e-13))) <= ref.fun + 1e-6
    for got, want in zip(s.tolist(), s_ref):
        assert got == pytest.approx(want, rel=1e-3, abs=1e-6)


def test_dependent_gamma_a2_14_and_parents():
    pairs = darts_edge_nodes(3)  # (0,2),(1,2),(0,3),(1,3),(2,3),(0,4),(1,4),(2,4),(3,4)
    P = parent_matrix(pairs)
    for e, (i, _) in enumerate(pairs):
        assert [f for f in range(len(pairs)) if P[e, f]] == [f for f, (_, j) in enumerate(pairs) if j == i]
    rng = np.random.default_rng(4)
    s = torch.tensor(rng.uniform(0.1, 2, size=(len(pairs), 4)), dtype=torch.float64)
    got = dependent_gamma(s, P.double())
    for e, (i, _) in enumerate(pairs):
        up = sum(float(s[f].sum()) for f, (_, j) in enumerate(pairs) if j == i)
        for o in range(4):
            want = float(s[e, o]) if up == 0 else 1 / (1 / up + 1 / float(s[e, o]))
            assert float(got[e, o]) == pytest.approx(want, rel=1e-12)
    assert dependent_gamma(torch.zeros_like(s), P.double()).eq(0).all()
    s[5] = math.inf  # an edge with no information: its own γ is ∞, its children's γ is their parents' sum
    got = dependent_gamma(s, P.double())
    assert torch.isinf(got[5]).all() and torch.isfinite(got[:5]).all() and not got.isnan().any()


def test_prune_entropy_rule_is_monotone_and_may_empty_an_edge():
    """Algorithm 2 step 4 and nothing else: alive ⟺ alive before and ½ ln(2πe γ) > 0, so an edge whose every op
    has γ ≤ 1/(2πe) is removed (reported as emptied); NaN γ prunes nothing."""
    assert float(entropy(T(ENTROPY_THRESHOLD_GAMMA))) == pytest.approx(0.0, abs=1e-12)
    g = torch.Generator().manual_seed(5)
    alive = torch.ones(6, 5, dtype=torch.bool)
    emptied_any = False
    for _ in range(30):
        gamma = torch.rand(6, 5, generator=g, dtype=torch.float64) * 0.15
        gamma[0, 0] = math.nan
        new, emptied = prune(alive, gamma)
        assert torch.equal(new, alive & ((0.5 * torch.log(2 * math.pi * math.e * gamma) > 0) | gamma.isnan()))
        assert torch.equal(emptied, alive.any(-1) & ~new.any(-1))
        emptied_any |= bool(emptied.any())
        alive = new
    assert emptied_any and not alive[1:].any() and alive[0, 0]


def test_shape_errors_are_one_line():
    from nasdiag.errors import NasdiagError

    with pytest.raises(NasdiagError, match="one shape"):
        sparse_bayes_update(torch.ones(2, 3), torch.ones(2, 3), torch.ones(3, 2), torch.zeros(2, 2))
    with pytest.raises(NasdiagError, match="ℵ, E, K"):
        group_bayes_update(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2, 2))
    with pytest.raises(NasdiagError, match=">= 0"):
        covariance(T(-1.0), T(1.0))


def test_structured_update_table_s3_filter_wise_against_autograd_and_scipy():
    """Algorithm 3 / Table S3 on a conv weight with filter-wise groups: γ_g = ‖W_g‖₂/ω_g(t−1) minimises
    ‖W_g‖²/γ + ω_g(t−1)² γ (scipy); ω_g(t)² = Σ_i α_i is ∂/∂γ Σ_{i∈g} [log γ + log(1/γ + H_i)] at γ_g (B.0.3-B.0.5,
    autograd); a group per element reduces to A.2.8 / A.2.13."""
    from nasdiag.bayes.structured import group_lasso_penalty, structured_update
    from nasdiag.errors import NasdiagError

    g = torch.Generator().manual_seed(11)
    W = torch.randn(4, 3, 3, 3, generator=g, dtype=torch.float64)
    H = torch.rand(4, 3, 3, 3, generator=g, dtype=torch.float64) * 5
    om_prev = torch.rand(4, generator=g, dtype=torch.float64) + 0.2
    u = structured_update(W, H, om_prev, group_dims=(0,))
    for n in range(4):
        norm2 = float(W[n].square().sum())
        res = optimize.minimize_scalar(lambda v: norm2 / math.exp(v) + float(om_prev[n]) ** 2 * math.exp(v),
                                       bounds=(-20, 20), method="bounded", options={"xatol": 1e-12})
        assert float(u.gamma[n]) == pytest.approx(math.exp(res.x), rel=1e-5)
        gam = u.gamma[n].clone().requires_grad_(True)
        (grad,) = torch.autograd.grad((torch.log(gam) + torch.log(1 / gam + H[n])).sum(), gam)
        assert float(u.omega[n]) ** 2 == pytest.approx(float(grad), rel=1e-12)
    # R(ω ∘ W) of Table S3: Σ_n ω_n ‖W_n‖₂
    assert float(group_lasso_penalty(W, u.omega, (0,))) == pytest.approx(
        sum(float(u.omega[n]) * float(W[n].norm()) for n in range(4)), rel=1e-12)
    # one group per element: γ = |w|/ω(t−1) (A.2.13), ω = √(γ − C)/γ (A.2.8)
    om1 = torch.rand(4, 3, 3, 3, generator=g, dtype=torch.float64) + 0.2
    e = structured_update(W, H, om1, group_dims=(0, 1, 2, 3))
    torch.testing.assert_close(e.gamma, switch(W, om1))
    torch.testing.assert_close(e.omega, omega(e.gamma, covariance(e.gamma, H)))
    with pytest.raises(NasdiagError, match="one entry per group"):
        structured_update(W, H, torch.ones(3, dtype=torch.float64), group_dims=(0,))


def test_compression_script_writes_record_and_figure_and_prunes(tmp_path, capsys):
    """scripts/bayes_compression.py (Algorithm 3 on a small conv net on digits), shortened: the record has a row
    per iteration, groups only ever disappear, and the printed paths exist."""
    import importlib.util
    import pathlib

    from nasdiag.record import load

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bayes_compression.py"
    spec = importlib.util.spec_from_file_location("bayes_compression", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--out", str(tmp_path), "--iterations", "3", "--epochs-per-iteration", "1", "--lam", "1e-3"]) == 0
    printed = capsys.readouterr().out
    rec = load(str(tmp_path / "compression.h5"))
    assert rec["step"].tolist() == [1, 2, 3]
    alive = np.stack([rec[f"scalars/alive_{n}"] for n in ("conv1", "conv2", "fc1", "fc2")])
    assert (np.diff(alive, axis=1) <= 0).all() and alive[:, -1].sum() < 8 + 16 + 256 + 32
    assert f"record: {tmp_path / 'compression.h5'}" in printed and (tmp_path / "compression.png").exists()
    assert script.main(["--out", str(tmp_path), "--lam", "0"]) == 2
