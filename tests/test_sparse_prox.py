"""The SGL proximal operators and HAPG/AdamHAPG (sparse-supernet eq 5–10) against independent references:
the optimality (subgradient) conditions of the problems they solve, a direct convex solve with scipy, and
the reduction of AdamHAPG to HAPG when every weight has the same step size."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize, root

from nasdiag.errors import ConfigError
from nasdiag.sparse import HAPG, AdamHAPG, prox_group, prox_l1, prox_sgl, sgl_penalty

SUBGRAD_TOL = 1e-10


def _groups(sizes):
    return torch.cat([torch.full((n,), g, dtype=torch.long) for g, n in enumerate(sizes)])


vectors = st.lists(st.floats(-3, 3, allow_nan=False, allow_subnormal=False), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(z=vectors, t=st.floats(0, 2))
def test_prox_l1_satisfies_the_subgradient_condition(z, t):
    # x = argmin ½‖x − z‖² + t‖x‖₁  ⇔  z − x ∈ t ∂‖x‖₁: z_i − x_i = t sgn(x_i) where x_i ≠ 0, |z_i| ≤ t where x_i = 0
    z = torch.tensor(z, dtype=torch.float64)
    x = prox_l1(z, t)
    nz = x != 0
    assert torch.allclose((z - x)[nz], t * torch.sign(x[nz]), atol=SUBGRAD_TOL)
    assert bool(((z[~nz].abs()) <= t + SUBGRAD_TOL).all())


@settings(max_examples=200, deadline=None)
@given(z=vectors, t=st.floats(0, 2), data=st.data())
def test_prox_group_satisfies_the_subgradient_condition(z, t, data):
    # x = argmin ½‖x − z‖² + t Σ_n √|n| ‖x_n‖₂: per group, z_n − x_n = t√|n| x_n/‖x_n‖ if x_n ≠ 0, else ‖z_n‖ ≤ t√|n|
    z = torch.tensor(z, dtype=torch.float64)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(z) - 1)), max_size=3)))
    sizes = np.diff([0, *[c for c in cuts if c < len(z)], len(z)]).tolist()
    groups = _groups(sizes)
    x = prox_group(z, t, groups)
    for g, n in enumerate(sizes):
        zg, xg = z[groups == g], x[groups == g]
        if xg.norm() > 0:
            assert torch.allclose(zg - xg, t * n**0.5 * xg / xg.norm(), atol=1e-9)
        else:
            assert zg.norm() <= t * n**0.5 + SUBGRAD_TOL


def _direct_sgl_solve(z, t1, t2):
    """argmin_x ½‖x − z‖² + t1‖x‖₁ + t2 √n ‖x‖₂ for one group, by SLSQP on the smooth epigraph form
    x = u − v (u, v ≥ 0), s ≥ ‖x‖₂ (written s² ≥ ‖x‖², s ≥ 0)."""
    n = len(z)
    z = np.asarray(z, dtype=np.float64)

    def objective(w):
        u, v, s = w[:n], w[n:2 * n], w[-1]
        x = u - v
        return 0.5 * np.sum((x - z) ** 2) + t1 * np.sum(u + v) + t2 * np.sqrt(n) * s

    def grad(w):
        u, v = w[:n], w[n:2 * n]
        r = (u - v) - z
        return np.concatenate([r + t1, -r + t1, [t2 * np.sqrt(n)]])

    cons = [{"type": "ineq", "fun": lambda w: w[-1] ** 2 - np.sum((w[:n] - w[n:2 * n]) ** 2),
             "jac": lambda w: np.concatenate([-2 * (w[:n] - w[n:2 * n]), 2 * (w[:n] - w[n:2 * n]), [2 * w[-1]]])}]
    start = np.concatenate([np.maximum(z, 0), np.maximum(-z, 0), [np.linalg.norm(z) + 1]])
    res = minimize(objective, start, jac=grad, constraints=cons, bounds=[(0, None)] * (2 * n + 1), method="SLSQP",
                   options={"ftol": 1e-16, "maxiter": 2000})
    x = res.x[:n] - res.x[n:2 * n]
    # SLSQP stops near 1e-8; on the support it found the objective is smooth: solve its stationarity
    # condition x − z + t1 sgn(x) + t2 √n x/‖x‖ = 0 there to round-off (scipy root, analytic Jacobian)
    support = np.abs(x) > 1e-6
    if support.any():
        sign, zs, c = np.sign(x[support]), z[support], t2 * np.sqrt(n)
        grad_s = lambda xs: xs - zs + t1 * sign + c * xs / np.linalg.norm(xs)  # noqa: E731
        hess_s = lambda xs: (np.eye(len(xs)) * (1 + c / np.linalg.norm(xs))  # noqa: E731
                             - c * np.outer(xs, xs) / np.linalg.norm(xs) ** 3)
        x = np.zeros(n)
        x[support] = root(grad_s, x0=(res.x[:n] - res.x[n:2 * n])[support], jac=hess_s, tol=1e-15).x
    return x


@pytest.mark.parametrize("seed", range(6))
def test_prox_sgl_on_one_group_equals_a_direct_convex_solve(seed):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=6) * 2
    t1, t2 = rng.uniform(0, 1), rng.uniform(0, 0.6)
    ours = prox_sgl(torch.tensor(z), t1, t2, torch.zeros(6, dtype=torch.long)).numpy()
    ref = _direct_sgl_solve(z, t1, t2)
    assert np.abs(ours - ref).max() < 1e-8
    # the composition (eq 5) is the prox of the sum: its objective is not beaten by the direct solve
    f = lambda x: 0.5 * np.sum((x - z) ** 2) + t1 * np.abs(x).sum() + t2 * np.sqrt(6) * np.linalg.norm(x)  # noqa: E731
    assert f(ours) <= f(ref) + 1e-12


def test_prox_gives_exact_zeros_where_the_conditions_say_zero():
    z = torch.tensor([0.2, -0.1, 3.0, 0.05, 0.04], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1])
    x = prox_sgl(z, 0.15, 0.1, groups)
    assert x[1] == 0 and x[0] != 0          # |z| ≤ t1 → exactly 0
    assert bool((x[3:] == 0).all())         # whole group below its threshold → exactly 0


def test_sgl_penalty_matches_its_definition():
    a = torch.tensor([[1.0, -2.0], [0.5, 0.0], [3.0, 4.0]], dtype=torch.float64)
    groups = torch.tensor([[0, 0], [0, 0], [1, 1]])
    lam, alpha = 0.7, 0.3
    expected = lam * alpha * 10.5 + lam * (1 - alpha) * (2 * np.sqrt(1 + 4 + 0.25) + np.sqrt(2) * 5)
    assert float(sgl_penalty(a, lam, alpha, groups)) == pytest.approx(expected, rel=1e-14)


def _run(opt_cls, grads, **kw):
    p = torch.nn.Parameter(torch.tensor([0.8, -0.3, 0.05, 1.5, -2.0, 0.4], dtype=torch.float64))
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    opt = opt_cls([p], groups=[groups], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_adamhapg_with_equal_step_sizes_reduces_to_hapg():
    # Gradients of equal magnitude c in every entry give Adam equal per-weight step sizes
    # η = lr/(1−β₁ᵗ)/(√(c²) + ε) with β₁ = 0 (m = g); HAPG with that η must take the same steps.
    c, lr, eps = 0.5, 0.05, 1e-8
    rng = np.random.default_rng(0)
    grads = [torch.tensor(c * rng.choice([-1.0, 1.0], size=6)) for _ in range(8)]
    adam = _run(AdamHAPG, grads, lr=lr, betas=(0.0, 0.9), eps=eps, lam=0.8, alpha=0.4)
    eta = lr / (c + eps)
    hapg = _run(HAPG, [g / c for g in grads], lr=eta * c, lam=0.8 / c, alpha=0.4)
    # HAPG sees direction g/c with step ηc = η·c, i.e. the same z_t; thresholds η c λ' = η λ with λ' = λ/c
    assert torch.allclose(adam, hapg, atol=1e-12)


def test_hapg_converges_to_the_sgl_regularised_least_squares_solution():
    # min ½‖Xa − y‖²/n + Ω_SGL(a): HAPG with exact gradients against a direct solve (SLSQP, epigraph form)
    rng = np.random.default_rng(3)
    X, y = rng.normal(size=(40, 4)), rng.normal(size=40)
    lam, alpha = 0.3, 0.5
    a = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    groups = torch.tensor([0, 0, 1, 1])
    opt = HAPG([a], lr=0.2, lam=lam, alpha=alpha, groups=[groups])
    Xt, yt = torch.tensor(X), torch.tensor(y)
    for _ in range(3000):
        opt.zero_grad()
        (0.5 * ((Xt @ a - yt) ** 2).mean()).backward()
        opt.step()
    obj = lambda v: 0.5 * np.mean((X @ v - y) ** 2) + float(sgl_penalty(torch.tensor(v), lam, alpha, groups))  # noqa: E731
    best = min((minimize(obj, rng.normal(size=4), method="Nelder-Mead", options={"xatol": 1e-12, "fatol": 1e-14, "maxiter": 40000})
                for _ in range(4)), key=lambda r: r.fun)
    assert obj(a.detach().numpy()) <= best.fun + 1e-9
    assert np.abs(a.detach().numpy() - best.x).max() < 1e-4


def test_bad_options_are_one_line_errors():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match="alpha"):
        HAPG([p], lr=0.1, alpha=1.5)
    with pytest.raises(ConfigError, match="lam"):
        AdamHAPG([p], lam=-1)
    with pytest.raises(ConfigError, match="learning rate"):
        HAPG([p], lr=0)
    with pytest.raises(ConfigError, match="shape"):
        prox_group(torch.zeros(3), 0.1, torch.zeros(2, dtype=torch.long))
