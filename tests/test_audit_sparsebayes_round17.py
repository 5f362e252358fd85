"""Audit round 17 of nasdiag.sparse (SparseNAS's proximal operators, HAPG, AdamHAPG) and nasdiag.bayes at their edge
cases, against an auditor's own float64 transcription of the papers (sparse-supernet eq 2, 5-10 and §"Hierarchical
Proximal Optimization"; bayesnas appendix A.2.8, A.2.13, A.2.14, A.3.2, Algorithm 2 step 4) and a brute-force
minimiser; no nasdiag helper computes a reference.

Rounds 11, 13 and 14 transcribed whole SparseNAS/BayesNAS steps through the methods and tests/test_sparse_prox.py the
subgradient conditions of scalar thresholds on finite inputs of moderate size; here: per-element and per-group
thresholds against a brute-force minimiser, λ = 0, huge λ, groups at 0, tiny/huge/NaN elements, empty parameters,
Adam's bias correction with a skipped step, the lower median of even groups, BayesNAS's γ at 0, ∞ and the entropy
threshold, negative and NaN curvature.

Defects these tests found (each fails without its fix):

- ``group_norms`` summed z² unscaled: a group of weights below 1e-154 (float32: 1e-19, reached by weights the ℓ1
  threshold shrank) had norm 0, so ``prox_group`` zeroed it at threshold 0, i.e. HAPG/AdamHAPG at λ = 0 or α = 1
  (the lasso) was not the plain step, and above 1e154 the norm (``sgl_penalty``) was ∞
  (test_a_zero_group_threshold_is_the_identity_for_tiny_weights_and_the_penalty_of_huge_ones_is_finite);
- ``sgl_penalty``'s gradient at a group that is exactly 0 was NaN (the gradient of √0), which an SGD/Adam baseline
  on the penalty (scripts/sparsenas_digits.py) takes into every weight (test_sgl_penalty_gradient_at_a_zero_group
  _is_a_subgradient_not_nan);
- ``prox_group`` of a group holding a NaN zeroed its other elements (a NaN norm failed "norm > 0", the test of a
  zero group): ops silently pruned by a NaN; the group is NaN now (test_a_nan_element_makes_its_group_nan_not_its
  _other_elements_zero);
- ``switch`` (A.2.13) read w = 0 as s = 0 also where ω is NaN (a NaN curvature or γ(t−1)), so γ = 0 pruned the op on a
  NaN, which docs/bayesnas.md says never happens (test_a_nan_curvature_or_gamma_at_w_zero_gives_a_nan_switch_never_a
  _pruned_op);
- ``add_param_group`` on HAPG/AdamHAPG gave the new group the constructor's ``groups`` (a default), so a tensor of the
  same shape was grouped as the constructor's parameter, silently (docs: None is one group per tensor), and took
  float or negative group ids unchecked (test_a_param_group_added_later_is_one_group_per_tensor_not_the
  _constructors_grouping);
- ``AdamHAPG.step`` with an empty parameter stopped in torch's "max(): Expected reduction dim" RuntimeError (HAPG
  and torch.optim.Adam step it) (test_adamhapg_steps_an_empty_parameter_as_hapg_does).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from nasdiag.bayes import (covariance, dependent_gamma, group_bayes_update, omega, parent_matrix, prune, sparse_bayes_update,
                           structured_update, switch)
from nasdiag.errors import ConfigError
from nasdiag.sparse import HAPG, AdamHAPG, prox_group, prox_l1, prox_sgl, sgl_penalty

D = torch.float64


# -- the auditor's transcriptions ---------------------------------------------------------------------------------
def ref_soft(v, t):
    """Eq 9 elementwise, plain Python floats."""
    return [math.copysign(max(abs(a) - b, 0.0), a) for a, b in zip(v, t)]


def ref_prox_sgl(v, t_el, t_grp, groups):
    """Eq 5, 9, 10 with per-element ℓ1 thresholds t_el and per-group thresholds t_grp, loops over the groups."""
    x = ref_soft(v, t_el)
    out = list(x)
    for n in set(groups):
        idx = [i for i, g in enumerate(groups) if g == n]
        norm = math.sqrt(sum(x[i] ** 2 for i in idx))
        scale = 0.0 if norm == 0 else max(1 - math.sqrt(len(idx)) * t_grp[n] / norm, 0.0)
        for i in idx:
            out[i] = x[i] * scale
    return out


def objective(x, v, t_el, t_grp, groups):
    """½‖x − v‖² + Σ_i t_i |x_i| + Σ_n T_n √|n| ‖x_(n)‖₂ (numpy, x of shape (..., d))."""
    val = 0.5 * ((x - v) ** 2).sum(-1) + (np.abs(x) * t_el).sum(-1)
    for n in sorted(set(groups)):
        idx = [i for i, g in enumerate(groups) if g == n]
        val = val + t_grp[n] * math.sqrt(len(idx)) * np.sqrt((x[..., idx] ** 2).sum(-1))
    return val


def brute_force_group(v, t_el, T, size):
    """Minimise one group's objective by a zooming grid search (no structure of the solution is used)."""
    centre, half = np.array(v, dtype=np.float64), np.abs(v).max() + 1.0
    axis = np.linspace(-1, 1, 41)
    for _ in range(14):
        pts = np.stack(np.meshgrid(*([axis] * size), indexing="ij"), -1).reshape(-1, size) * half + centre
        vals = objective(pts, np.asarray(v), np.asarray(t_el), [T], [0] * size)
        centre, half = pts[int(np.argmin(vals))], half / 8
    return centre


def ref_adam_direction(state, g, lr, b1, b2, eps):
    """Kingma & Ba's update: returns (m̂/(√v̂ + ε)·lr, per-element step size lr/(1 − β₁ⁿ)/(√v̂ + ε))."""
    state["n"] += 1
    n = state["n"]
    state["m"] = [b1 * m + (1 - b1) * gi for m, gi in zip(state["m"], g)]
    state["s"] = [b2 * s + (1 - b2) * gi * gi for s, gi in zip(state["s"], g)]
    eta = [lr / (1 - b1**n) / (math.sqrt(s / (1 - b2**n)) + eps) for s in state["s"]]
    return [e * m for e, m in zip(eta, state["m"])], eta


def lower_median(values):
    return sorted(values)[(len(values) - 1) // 2]


def u(t):
    """Eq 7-8's u_t = (t − 2)/(t + 1), paper numbering; nasdiag's first step is the paper's t = 2 (documented)."""
    return (t - 2) / (t + 1)


# -- proximal operators ------------------------------------------------------------------------------------------------
def test_prox_sgl_with_per_element_and_per_group_thresholds_is_the_brute_force_minimiser():
    # AdamHAPG calls prox_l1 with one threshold per element (η_i λα) and prox_group with one per group; the composition
    # is the exact prox of Σ t_i|x_i| + Σ T_n √|n| ‖x_(n)‖ (nested hierarchy): a grid search must find no lower point
    gen = torch.Generator().manual_seed(17)
    groups = [0, 1, 1, 2, 2, 2, 3, 3]
    for trial in range(3):
        v = (torch.randn(8, generator=gen, dtype=D) * 1.5).tolist()
        t_el = (torch.rand(8, generator=gen, dtype=D) * 0.6).tolist()
        t_grp = (torch.rand(4, generator=gen, dtype=D) * 0.8).tolist()
        if trial == 1:
            t_grp[2] = 5.0  # a group the group threshold zeroes
            t_el[6] = t_el[7] = 10.0  # a group the ℓ1 threshold zeroes
        got = prox_sgl(torch.tensor(v, dtype=D), torch.tensor(t_el, dtype=D), torch.tensor(t_grp, dtype=D),
                       torch.tensor(groups))
        assert got.tolist() == pytest.approx(ref_prox_sgl(v, t_el, t_grp, groups), abs=1e-14)
        for n in range(4):
            idx = [i for i, g in enumerate(groups) if g == n]
            best = brute_force_group([v[i] for i in idx], [t_el[i] for i in idx], t_grp[n], len(idx))
            mine = got[idx].numpy()
            f_mine = objective(mine, np.array([v[i] for i in idx]), np.array([t_el[i] for i in idx]), [t_grp[n]],
                               [0] * len(idx))
            f_best = objective(best, np.array([v[i] for i in idx]), np.array([t_el[i] for i in idx]), [t_grp[n]],
                               [0] * len(idx))
            assert f_mine <= f_best + 1e-12
            # 1-strong convexity: ‖x − x*‖² ≤ 2 (F(x) − F(x*)); the grid's last cell is below 1e-10
            assert np.abs(mine - best).max() < 1e-6


def test_a_zero_group_threshold_is_the_identity_for_tiny_weights_and_the_penalty_of_huge_ones_is_finite():
    groups = torch.tensor([0, 0, 1])
    z = torch.tensor([1e-24, -2e-24, 3e-24], dtype=torch.float32)  # z² underflows in float32
    assert torch.equal(prox_group(z, 0.0, groups), z)
    assert torch.equal(prox_sgl(z, 0.0, 0.0, groups), z)
    z64 = torch.tensor([3e-170, 4e-170, 1.0], dtype=D)
    # a threshold below the norm (5e-170) keeps the group, scaled by 1 − √2 t/‖z‖
    t = 1e-171
    assert prox_group(z64, t, groups)[:2].tolist() == pytest.approx([3e-170 * (1 - math.sqrt(2) * t / 5e-170),
                                                                       4e-170 * (1 - math.sqrt(2) * t / 5e-170)], rel=1e-14)
    # HAPG at λ = 0 is the plain gradient step (first step: no momentum), whatever the size of the weights
    p = torch.nn.Parameter(torch.tensor([3e-24, 1.0], dtype=torch.float32))
    opt = HAPG([p], lr=0.1, lam=0.0, groups=[torch.tensor([0, 1])])
    p.grad = torch.tensor([1e-24, 0.5], dtype=torch.float32)
    expected = p.detach() - 0.1 * p.grad
    opt.step()
    assert torch.equal(p.detach(), expected)
    # Ω_SGL (eq 2) of weights past 1e154: λ(1 − α)√2 ‖(1e200, 1e200)‖ = 2e200, not ∞
    assert float(sgl_penalty(torch.tensor([1e200, 1e200], dtype=D), 1.0, 0.0, torch.tensor([0, 0]))) == \
        pytest.approx(2e200, rel=1e-15)


def test_sgl_penalty_gradient_at_a_zero_group_is_a_subgradient_not_nan():
    w = torch.tensor([0.0, 0.0, 1.0, -2.0], dtype=D, requires_grad=True)
    lam, alpha = 0.3, 0.4
    sgl_penalty(w, lam, alpha, torch.tensor([0, 0, 1, 1])).backward()
    # ∂Ω at the zero group ∋ 0 (torch's |x|' = 0 at 0 as well); elsewhere λα sgn(w) + λ(1−α)√2 w/‖w‖
    norm = math.sqrt(5.0)
    expected = [0.0, 0.0, lam * alpha + lam * (1 - alpha) * math.sqrt(2) * 1 / norm,
                -lam * alpha + lam * (1 - alpha) * math.sqrt(2) * -2 / norm]
    assert w.grad.tolist() == pytest.approx(expected, rel=1e-14, abs=1e-300)


def test_a_nan_element_makes_its_group_nan_not_its_other_elements_zero():
    z = torch.tensor([1.0, math.nan, 2.0, 3.0], dtype=D)
    out = prox_group(z, 0.1, torch.tensor([0, 0, 1, 1]))
    assert bool(out[:2].isnan().all())  # before: [0, nan]: the 1.0 pruned by a NaN
    scale = 1 - math.sqrt(2) * 0.1 / math.sqrt(13.0)
    assert out[2:].tolist() == pytest.approx([2 * scale, 3 * scale], rel=1e-15)
    # an ∞ element: ‖z‖ = ∞, scale 1 (the limit), nothing NaN
    out = prox_group(torch.tensor([1.0, math.inf], dtype=D), 0.1, torch.tensor([0, 0]))
    assert out.tolist() == [1.0, math.inf]
    # HAPG: a NaN gradient leaves the whole group NaN (seen), the other group as eq 6-10 say
    p = torch.nn.Parameter(torch.tensor([1.0, 0.5, 2.0], dtype=D))
    opt = HAPG([p], lr=0.1, lam=0.1, alpha=0.5, groups=[torch.tensor([0, 0, 1])])
    p.grad = torch.tensor([math.nan, 0.0, 1.0], dtype=D)
    opt.step()
    assert bool(p[:2].isnan().all())
    x = ref_prox_sgl([2.0 - 0.1], [0.1 * 0.1 * 0.5], [0.1 * 0.1 * 0.5], [0])
    assert p[2].item() == pytest.approx(x[0], rel=1e-15)


# -- HAPG / AdamHAPG --------------------------------------------------------------------------------------------------
def test_adamhapg_steps_an_empty_parameter_as_hapg_does():
    for make in (lambda ps: HAPG(ps, lr=0.1, lam=0.1), lambda ps: AdamHAPG(ps, lr=0.1, lam=0.1)):
        empty = torch.nn.Parameter(torch.zeros(0, 3, dtype=D))
        full = torch.nn.Parameter(torch.tensor([1.0, -1.0], dtype=D))
        opt = make([empty, full])
        empty.grad, full.grad = torch.zeros(0, 3, dtype=D), torch.tensor([0.5, 0.5], dtype=D)
        opt.step()
        assert empty.shape == (0, 3) and bool(torch.isfinite(full).all())


def test_lambda_zero_is_the_unregularised_accelerated_step_over_several_steps():
    # λ = 0: both proximal operators are the identity, so HAPG is eq 6-8 without prox (bit for bit: same operations),
    # AdamHAPG the same with Adam's step in eq 6
    gen = torch.Generator().manual_seed(3)
    A0 = torch.randn(6, generator=gen, dtype=D)
    grads = [torch.randn(6, generator=gen, dtype=D) for _ in range(5)]
    groups = torch.tensor([0, 0, 1, 1, 1, 2])
    for kind in ("hapg", "adam"):
        p = torch.nn.Parameter(A0.clone())
        opt = (HAPG([p], lr=0.05, lam=0.0, alpha=0.3, groups=[groups]) if kind == "hapg"
               else AdamHAPG([p], lr=0.05, betas=(0.5, 0.999), lam=0.0, alpha=0.3, groups=[groups]))
        A, v, adam = A0.clone(), torch.zeros(6, dtype=D), {"n": 0, "m": [0.0] * 6, "s": [0.0] * 6}
        for k, g in enumerate(grads):
            t = k + 2  # the paper's t of nasdiag's k-th step (first step u = 0)
            if kind == "hapg":
                z = A - 0.05 * g
            else:
                step, _ = ref_adam_direction(adam, g.tolist(), 0.05, 0.5, 0.999, 1e-8)
                z = A - torch.tensor(step, dtype=D)
            v = z - A + u(t - 1) * v
            A = z + u(t) * v
            p.grad = g.clone()
            opt.step()
            if kind == "hapg":
                assert torch.equal(p.detach(), A)
            else:
                torch.testing.assert_close(p.detach(), A, rtol=1e-13, atol=1e-15)


def test_huge_lambda_zeroes_everything_at_the_first_step_and_a_zero_group_with_zero_gradient_stays_zero():
    for make in (lambda ps, lam: HAPG(ps, lr=0.025, lam=lam, groups=[torch.tensor([0, 0, 1, 1])]),
                 lambda ps, lam: AdamHAPG(ps, lr=3e-4, lam=lam, groups=[torch.tensor([0, 0, 1, 1])])):
        p = torch.nn.Parameter(torch.tensor([5.0, -3.0, 1e3, 2.0], dtype=D))
        opt = make([p], 1e300)  # AdamHAPG: η_i λ overflows to ∞: still exact zeros, no NaN
        p.grad = torch.tensor([1.0, 0.0, -2.0, 1e-3], dtype=D)
        opt.step()
        assert p.tolist() == [0.0, 0.0, 0.0, 0.0]
        # a group at 0 with zero gradient stays exactly 0 over steps (its z is 0, its momentum 0), the other moves
        p = torch.nn.Parameter(torch.tensor([0.0, 0.0, 1.0, 2.0], dtype=D))
        opt = make([p], 1e-3)
        for _ in range(3):
            p.grad = torch.tensor([0.0, 0.0, 0.3, -0.2], dtype=D)
            opt.step()
            assert p[:2].tolist() == [0.0, 0.0] and bool((p[2:] != 0).all())


def test_adamhapg_uneven_groups_four_steps_with_a_skipped_step_and_a_new_lambda():
    # eq 6 by Adam, eq 9 with each η_i, eq 10 with the lower median of the group's η_i, eq 7-8; a parameter whose
    # gradient is None at a step is not stepped (its Adam count and its momentum count stand still, as torch's Adam)
    gen = torch.Generator().manual_seed(11)
    groups = [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    lr, b1, b2, eps, alpha = 0.02, 0.5, 0.999, 1e-8, 0.5
    lams = [0.05, 0.05, 0.2, 0.2]
    A0 = (torch.randn(10, generator=gen, dtype=D) * 0.3).tolist()
    B0 = [0.4, -0.1]
    p = torch.nn.Parameter(torch.tensor(A0, dtype=D))
    q = torch.nn.Parameter(torch.tensor(B0, dtype=D))
    opt = AdamHAPG([p, q], lr=lr, betas=(b1, b2), eps=eps, lam=lams[0], alpha=alpha,
                   groups=[torch.tensor(groups), torch.tensor([0, 0])])
    ref = {"p": dict(A=A0, v=[0.0] * 10, t=1, adam={"n": 0, "m": [0.0] * 10, "s": [0.0] * 10}, groups=groups),
           "q": dict(A=B0, v=[0.0] * 2, t=1, adam={"n": 0, "m": [0.0] * 2, "s": [0.0] * 2}, groups=[0, 0])}
    for k in range(4):
        lam = lams[k]
        for group in opt.param_groups:
            group["lam"] = lam
        grads = {"p": (torch.randn(10, generator=gen, dtype=D)).tolist(),
                 "q": None if k == 1 else (torch.randn(2, generator=gen, dtype=D)).tolist()}
        p.grad = torch.tensor(grads["p"], dtype=D)
        q.grad = None if grads["q"] is None else torch.tensor(grads["q"], dtype=D)
        opt.step()
        for name, param in (("p", p), ("q", q)):
            r, g = ref[name], grads[name]
            if g is None:
                assert param.tolist() == r["A"]
                continue
            r["t"] += 1
            step, eta = ref_adam_direction(r["adam"], g, lr, b1, b2, eps)
            z = [a - s for a, s in zip(r["A"], step)]
            G = max(r["groups"]) + 1
            med = [lower_median([e for e, gg in zip(eta, r["groups"]) if gg == n]) for n in range(G)]
            prox = ref_prox_sgl(z, [e * lam * alpha for e in eta], [m * lam * (1 - alpha) for m in med], r["groups"])
            t = r["t"]
            r["v"] = [x - a + u(t - 1) * vv for x, a, vv in zip(prox, r["A"], r["v"])]
            r["A"] = [x + u(t) * vv for x, vv in zip(prox, r["v"])]
            assert param.tolist() == pytest.approx(r["A"], rel=1e-12, abs=1e-15)


# -- BayesNAS closed forms at their edges ---------------------------------------------------------------------------------
def test_bayes_update_at_gamma_zero_infinity_and_negative_or_nan_curvature():
    # A.3.2: C = (1/γ + H)⁻¹ with H < 0 read as 0 (documented); A.2.8: ω = √(γ − C)/γ; A.2.13: s = |w|/ω
    gamma = torch.tensor([0.0, math.inf, 2.0, 2.0, 2.0, 1e-300], dtype=D)
    H = torch.tensor([3.0, 4.0, -5.0, math.nan, 0.5, 1e300], dtype=D)
    C = covariance(gamma, H)
    expected_C = [0.0, 1 / 4.0, 2.0, math.nan, 1 / (1 / 2.0 + 0.5), 1 / (1e300 + 1e300)]
    for got, want in zip(C.tolist(), expected_C):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-15)
    om = omega(gamma, C, curvature=H)
    # γ = 0: ∞ (dead switch); γ = ∞: 0; H ≤ 0: √(γ − γ)/γ = 0; NaN stays NaN; otherwise √(γ − C)/γ
    assert om[0].item() == math.inf and om[1].item() == 0.0 and om[2].item() == 0.0 and math.isnan(om[3].item())
    assert om[4].item() == pytest.approx(math.sqrt(2.0 - 1 / 1.0) / 2.0, rel=1e-15)
    # γH = 1e0 here: γ − C = γ²H/(1 + γH) = 5e-301, √ / γ = √(H/(1+γH)) = √(1e300/2)
    assert om[5].item() == pytest.approx(math.sqrt(1e300 / 2), rel=1e-14)
    w = torch.tensor([0.0, 0.7, 0.7, 0.7, -0.7, 0.0], dtype=D)
    s = switch(w, om)
    assert s[0].item() == 0.0 and s[1].item() == math.inf and s[2].item() == math.inf and math.isnan(s[3].item())
    assert s[4].item() == pytest.approx(0.7 / (math.sqrt(1.0) / 2.0), rel=1e-15)


def test_dependent_gamma_and_entropy_pruning_at_the_threshold_and_a_removed_node():
    # A.2.14 on a 2-step cell: edges (0,2), (1,2), (0,3), (1,3), (2,3); the parents of (2,3) are the edges into node 2
    pairs = [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    P = parent_matrix(pairs).to(D)
    s = torch.tensor([[0.3, 0.2], [0.1, 0.4], [1.0, 2.0], [math.inf, 0.5], [0.6, 0.0]], dtype=D)
    g = dependent_gamma(s, P)
    up = 0.3 + 0.2 + 0.1 + 0.4
    want = [[0.3, 0.2], [0.1, 0.4], [1.0, 2.0], [math.inf, 0.5], [1 / (1 / up + 1 / 0.6), 0.0]]
    torch.testing.assert_close(g, torch.tensor(want, dtype=D), rtol=1e-15, atol=0)
    # every edge into node 2 removed (s = 0): the edge leaving it gets γ = 0 whatever its own s (A.2.14)
    s2 = s.clone()
    s2[:2] = 0.0
    assert dependent_gamma(s2, P)[4].tolist() == [0.0, 0.0]
    # Algorithm 2 step 4: prune iff ½ ln(2πe γ) ≤ 0 ⇔ γ ≤ 1/(2πe); NaN prunes nothing; a pruned op never returns
    T = 1 / (2 * math.pi * math.e)
    gam = torch.tensor([[T * (1 - 1e-12), T * (1 + 1e-12)], [math.nan, 10.0], [0.0, 0.0]], dtype=D)
    alive = torch.tensor([[True, True], [True, False], [True, True]])
    keep, emptied = prune(alive, gam)
    assert keep.tolist() == [[False, True], [True, False], [False, False]]
    assert emptied.tolist() == [False, False, True]


def test_group_update_of_one_element_is_the_single_update_and_groups_sum_their_omega_squares():
    # A.3.9 with ℵ = 1 is A.2.8; for ℵ = 3: ω² = Σ_i (γ − C_i)/γ², s = ‖w_group‖/ω (A.3.8)
    gen = torch.Generator().manual_seed(5)
    E, K, N = 5, 3, 3
    w = torch.randn(E, K, generator=gen, dtype=D)
    H = torch.rand(N, E, K, generator=gen, dtype=D) * 4
    H[1, 0, 0] = -2.0  # one cell's negative curvature counts as 0 in its own C_i
    gamma = torch.rand(E, K, generator=gen, dtype=D) + 0.1
    P = parent_matrix([(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]).to(D)
    upd = group_bayes_update(w.expand(N, E, K), H, gamma, P)
    for e, k in itertools.product(range(E), range(K)):
        gm = gamma[e, k].item()
        Cs = [1 / (1 / gm + max(H[i, e, k].item(), 0.0)) for i in range(N)]
        om = math.sqrt(sum((gm - c) / gm**2 for c in Cs))
        assert upd.omega[e, k].item() == pytest.approx(om, rel=1e-12)
        assert upd.switch[e, k].item() == pytest.approx(math.sqrt(N) * abs(w[e, k].item()) / om, rel=1e-12)
        for i in range(N):
            assert upd.cov[i, e, k].item() == pytest.approx(Cs[i], rel=1e-14)


def test_a_nan_curvature_or_gamma_at_w_zero_gives_a_nan_switch_never_a_pruned_op():
    # docs/bayesnas.md: "a NaN γ(t−1), curvature or w gives NaN ω, s and γ, never the ω = ∞ of a dead switch that
    # would prune the op"; at w = 0 the switch was |w|/ω read as 0 (the w = 0 case) and γ = 0 pruned the op
    P = parent_matrix([(0, 2), (1, 2)]).to(D)
    w = torch.tensor([[0.0, 0.5], [0.0, 0.2]], dtype=D)
    for H, gamma in ((torch.tensor([[math.nan, 1.0], [1.0, 1.0]], dtype=D), torch.ones(2, 2, dtype=D)),
                     (torch.ones(2, 2, dtype=D), torch.tensor([[math.nan, 1.0], [1.0, 1.0]], dtype=D))):
        upd = sparse_bayes_update(w, H, gamma, P)
        assert math.isnan(upd.switch[0, 0].item()) and math.isnan(upd.gamma[0, 0].item())
        keep, _ = prune(torch.ones(2, 2, dtype=torch.bool), upd.gamma)
        assert bool(keep[0, 0])
        # a finite ω at w = 0 is s = 0 (A.2.13: the minimiser of w²/s + ω²s), so that op is pruned (γ = 0 ≤ 1/(2πe))
        assert upd.switch[1, 0].item() == 0.0 and not bool(keep[1, 0])


def test_a_param_group_added_later_is_one_group_per_tensor_not_the_constructors_grouping():
    # docs/sparsenas.md: groups None = the whole tensor one group; the constructor's groups (of p) were inherited as a
    # default by add_param_group, so q (same shape) was split as p is, silently
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0], dtype=D))
    q0, g = [0.1, 0.2, 5.0], [0.3, -0.2, 0.1]
    lr, lam = 0.1, 0.3
    for kind in ("hapg", "adam"):
        q = torch.nn.Parameter(torch.tensor(q0, dtype=D))
        opt = (HAPG if kind == "hapg" else AdamHAPG)([p], lr=lr, lam=lam, alpha=0.0, groups=[torch.tensor([0, 0, 1])])
        opt.add_param_group({"params": [q]})
        q.grad, p.grad = torch.tensor(g, dtype=D), None
        opt.step()
        if kind == "hapg":
            step, eta = [lr * gi for gi in g], [lr] * 3
        else:
            step, eta = ref_adam_direction({"n": 0, "m": [0.0] * 3, "s": [0.0] * 3}, g, lr, 0.5, 0.999, 1e-8)
        z = [a - b for a, b in zip(q0, step)]
        want = ref_prox_sgl(z, [0.0] * 3, [lower_median(eta) * lam], [0, 0, 0])  # one group of three
        assert 0 < want[0] and q.tolist() == pytest.approx(want, rel=1e-13, abs=0)
        # an added group's own groups are checked as the constructor's: one line, nothing added
        n = len(opt.param_groups)
        for bad in ([torch.tensor([0.5, 1.0])], [torch.tensor([0, -1])], [torch.tensor([0, 0]), torch.tensor([0])]):
            with pytest.raises(ConfigError, match="groups"):
                opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=D))], "groups": bad})
            assert len(opt.param_groups) == n


def test_alpha_one_is_the_lasso_step_and_alpha_zero_the_group_lasso_step():
    # eq 2's α: α = 1 leaves only λ‖A‖₁ (eq 10's threshold 0: the identity, exactly), α = 0 only the group term
    gen = torch.Generator().manual_seed(8)
    A0, g = torch.randn(7, generator=gen, dtype=D), torch.randn(7, generator=gen, dtype=D)
    groups = [0, 0, 0, 1, 1, 2, 2]
    lr, lam = 0.1, 2.0
    for alpha in (1.0, 0.0):
        p = torch.nn.Parameter(A0.clone())
        opt = HAPG([p], lr=lr, lam=lam, alpha=alpha, groups=[torch.tensor(groups)])
        p.grad = g.clone()
        opt.step()
        z = (A0 - lr * g).tolist()
        want = (ref_soft(z, [lr * lam] * 7) if alpha == 1.0
                else ref_prox_sgl(z, [0.0] * 7, [lr * lam] * 3, groups))
        assert p.tolist() == pytest.approx(want, rel=1e-14, abs=1e-16)
        if alpha == 1.0:
            assert p.tolist() == ref_soft(z, [lr * lam] * 7)  # no group factor at all, bit for bit


def test_structured_update_channel_wise_with_a_zero_channel_and_negative_curvature():
    # B.0.2-B.0.5, Table S3 (e) channel-wise on a conv weight (N, C, M, K), transcribed with loops
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(3, 4, 2, 2, generator=gen, dtype=D)
    W[:, 1] = 0.0  # a removed channel: γ = 0, ω = ∞ (stays removed)
    H = torch.rand(3, 4, 2, 2, generator=gen, dtype=D) * 3
    H[0, 0, 0, 0] = -1.0  # counts as 0 (B.0.3 as A.3.2)
    om0 = torch.rand(4, generator=gen, dtype=D) + 0.5
    upd = structured_update(W, H, om0, (-3,))  # a negative dim names the same channel axis
    for c in range(4):
        norm = math.sqrt(float((W[:, c] ** 2).sum()))
        gam = norm / om0[c].item() if norm else 0.0
        assert upd.gamma[c].item() == pytest.approx(gam, rel=1e-14)
        if gam == 0:
            assert upd.omega[c].item() == math.inf
            continue
        total = 0.0
        for n, m, k in itertools.product(range(3), range(2), range(2)):
            C = 1 / (1 / gam + max(H[n, c, m, k].item(), 0.0))
            total += -C / gam**2 + 1 / gam
        assert upd.omega[c].item() == pytest.approx(math.sqrt(total), rel=1e-12)
