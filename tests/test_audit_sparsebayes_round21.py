"""Round-21 audit of nasdiag.sparse (sparse-group-lasso prox, HAPG, AdamHAPG) and nasdiag.bayes (§A, §B) on bare
tensors, against an auditor's own float64 transcriptions written here (sparse-supernet eq 6-10 and §"Hierarchical
Proximal Optimization"; bayesnas appendix A.2.8, A.2.13, A.2.14, A.3.2, A.3.8, A.3.9, B.0.2-B.0.5) and, for the prox, a
generic convex solver (scipy's Powell on the prox objective); no nasdiag helper computes a reference.

Rounds 17 and 20 covered the prox against a brute-force minimiser and the subgradient conditions, HAPG as FISTA with a
changing η, AdamHAPG's uneven groups with a skipped step, §A at γ, H ∈ {0, tiny, 1, huge, ∞} and NaN, §B's Table S3
groupings. Here: several parameter groups, each with its own options (lr, λ, α, and AdamHAPG's betas and eps), over
several steps with λ and η changed between steps.

Defects these tests found (each fails without its fix):

- AdamHAPG checked betas and eps only as the constructor's arguments: a parameter group's own ``betas=(0.5, 1.0)`` or
  ``eps=0`` (docs/sparsenas.md: one ConfigError line at construction) was accepted and made every weight NaN at the
  first step, ``betas=(1.0, 0.999)`` a ZeroDivisionError traceback, a string eps a TypeError traceback; each group's
  (and, at a step, a changed value) is checked as the constructor's
  (test_a_parameter_groups_own_adam_betas_or_eps_are_checked_as_the_constructors);
- HAPG/AdamHAPG given parameter-group dicts and the constructor's ``groups=[ids_a]`` handed every dict without its own
  ``groups`` that list (torch's defaults), read from its first tensor: the second dict's parameter was grouped by the
  first parameter's ids, silently where the shapes agree; ``groups=[ids_a, ids_b]`` (one tensor per parameter, as the
  docstring says) was refused as "1 parameters, 2 groups tensors"; one line naming the per-dict form
  (test_the_constructors_groups_with_several_parameter_groups_is_one_line_not_the_first_groups_ids_for_all);
- ``structured_update``, ``sparse_bayes_update`` and ``group_bayes_update`` given Algorithm 3's ω(0) = 1 or Algorithm
  2's γ(0) = 1 as the number 1.0 (or a list) stopped in "'float' object has no attribute 'shape'", an AttributeError
  traceback naming no argument; one BayesError line naming the argument and its shape
  (test_a_start_of_one_given_as_a_number_is_one_bayes_error_line_naming_the_argument);
- ``sgl_penalty``/``prox_group``/``prox_sgl`` with ``groups=None`` (HAPG's option for one group per tensor) or a list
  stopped in an AttributeError traceback ("'NoneType' object has no attribute 'shape'"), a NumPy array was refused as
  "an integer tensor ..., got int64"; one ConfigError line naming the tensor wanted
  (test_the_operators_given_groups_that_are_not_a_tensor_say_so_in_one_line).

Checked and right (scratch, the sharpest kept below): prox_sgl against Powell at 60 random points (per-element and
per-group thresholds, singletons, zero groups, exact thresholds); HAPG/AdamHAPG over five steps with two parameter groups
of their own lr, λ, α, betas, eps and λ/η changed every step; state_dict save/load mid-run bit-equal for both; a
non-contiguous parameter and its ids step as the contiguous one; §A's group_bayes_update (ℵ = 1..3, zero w, zero H,
negative H, γ = 0, tiny/huge γ, chains of A.2.14 parents) and §B's structured_update at ω(t−1) ∈ {0, ∞} with a zero
group against own per-element loops.

Noticed, left alone:

- AdamHAPG's step size η_i = lr/(1 − β₁ⁿ)/(√v̂_i + ε) carries Adam's first-moment bias correction (z = A − η_i m with
  the raw m), so the ℓ1/group thresholds η_i λ(…) are 1/(1 − β₁ⁿ) larger in the first steps (2× at step 1 with the
  paper's β₁ = 0.5) than with the gradient estimate m̂ and η_i = lr/(√v̂_i + ε); the paper does not say which, the
  docstring states this one (torch's Adam code computes its step size so);
- ``nasdiag.bayes``' group norms (structured ``group_norms``, ``group_switch``) use torch.linalg.vector_norm, which
  squares unscaled: a group of weights below 1e-154 (float32: 1e-19) has γ = 0 (dead) where its ℵ = 1 update gives
  ~1e-170; either is far below any pruning threshold, so nothing a run does changes;
- a parameter group's unknown keys (``weight_decay``) are ignored, as by torch's optimizers (docs: A has no weight
  decay; ``HAPG(..., weight_decay=...)`` is Python's one-line TypeError); group ids changed between steps are checked
  for shape only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nasdiag.errors import ConfigError
from nasdiag.sparse import AdamHAPG, HAPG, prox_sgl


# ---------------------------------------------------------------- own transcription (numpy float64) of eq 6-10


def _soft(z, t):  # eq 9
    return np.sign(z) * np.maximum(np.abs(z) - t, 0.0)


def _group_shrink(z, t, g):  # eq 10, one threshold per group (or one for all)
    out = z.copy()
    for n in np.unique(g):
        m = g == n
        norm = np.linalg.norm(z[m])
        tn = t[n] if np.ndim(t) else t
        out[m] = 0.0 if norm == 0 else max(0.0, 1.0 - np.sqrt(m.sum()) * tn / norm) * z[m]
    return out


def _u(t):  # eq 7-8's momentum, the first step counted as t = 2 (the module docstring's convention)
    return (t - 2) / (t + 1)


def _own_hapg(a0, grads, lrs, lams, alpha, g):
    """HAPG, eq 6-10: z = A − ηg, the ℓ1 prox at ηλα, the group prox at ηλ(1 − α), then eq 7-8."""
    a, v, out = a0.copy(), np.zeros_like(a0), []
    for k, (grad, lr, lam) in enumerate(zip(grads, lrs, lams)):
        t = k + 2
        prox = _group_shrink(_soft(a - lr * grad, lr * lam * alpha), lr * lam * (1 - alpha), g)
        v = prox - a + _u(t - 1) * v
        a = prox + _u(t) * v
        out.append(a.copy())
    return out


def _own_adamhapg(a0, grads, lrs, lams, alpha, g, b1, b2, eps):
    """AdamHAPG as its docstring states it: η_i = lr/(1 − β₁ⁿ)/(√(s_i/(1 − β₂ⁿ)) + ε), z = A − η_i m_i, the ℓ1 prox at
    η_i λα, the group prox at the lower median of the group's η_i times λ(1 − α), then eq 7-8."""
    a, v, m, s, out = a0.copy(), np.zeros_like(a0), np.zeros_like(a0), np.zeros_like(a0), []
    for k, (grad, lr, lam) in enumerate(zip(grads, lrs, lams)):
        t, n = k + 2, k + 1
        m = b1 * m + (1 - b1) * grad
        s = b2 * s + (1 - b2) * grad * grad
        eta = lr / (1 - b1**n) / (np.sqrt(s / (1 - b2**n)) + eps)
        z = a - eta * m
        t_group = np.array([np.sort(eta[g == i])[((g == i).sum() - 1) // 2] for i in range(g.max() + 1)])
        prox = _group_shrink(_soft(z, eta * lam * alpha), t_group * lam * (1 - alpha), g)
        v = prox - a + _u(t - 1) * v
        a = prox + _u(t) * v
        out.append(a.copy())
    return out


# ---------------------------------------------------------------- the prox against a generic convex solver


def test_prox_sgl_is_the_argmin_of_its_objective_found_by_a_generic_solver_at_singletons_zero_groups_and_the_threshold():
    """prox_sgl(z, t, τ, g) = argmin_x ½‖x − z‖² + Σ_i t_i|x_i| + Σ_n τ_n √|g_n| ‖x_(n)‖₂ (eq 5, 9, 10), with per-element
    ℓ1 thresholds (AdamHAPG's) or one, per-group τ, singleton groups, a group of zeros, and a group exactly at its
    threshold after the ℓ1 step (then exactly 0: docs/sparsenas.md; dyadic values, so that the threshold is exact in
    floating point too). F is 1-strongly convex, so F(x) − F(x*) ≥ ½‖x − x*‖²: the prox must reach no higher F than
    Powell's minimum (up to round-off of F, 1e-13) and lie within √(2 (F(Powell) − F(prox))) of it."""
    from scipy.optimize import minimize

    rng = np.random.default_rng(2021)
    g = np.array([0, 1, 1, 1, 1, 2, 2, 2, 3])  # groups 0 and 3 singletons, group 1 of 4 (√4 = 2 exactly)
    sizes = np.bincount(g)
    for case in range(8):
        z = rng.normal(size=9)
        if case % 2:
            z[g == 2] = 0.0
        t = rng.uniform(0, 0.4, 9) if case % 4 < 2 else rng.uniform(0, 0.4)
        tau = rng.uniform(0, 0.8, 4)
        exact = case % 3 == 0
        if exact:  # soft(z)_(1) = ±0.5 each: norm 1 = √4 · τ_1 exactly
            z[g == 1] = rng.choice([-0.75, 0.75], size=4)
            if np.ndim(t):
                t[g == 1] = 0.25
            else:
                t = 0.25
            tau[1] = 0.5

        def objective(x):
            return (0.5 * np.sum((x - z) ** 2) + np.sum(t * np.abs(x))
                    + sum(tau[n] * np.sqrt(sizes[n]) * np.linalg.norm(x[g == n]) for n in range(4)))

        ours = prox_sgl(torch.tensor(z), torch.tensor(np.asarray(t)), torch.tensor(tau), torch.tensor(g)).numpy()
        solved = min((minimize(objective, x0, method="Powell", options=dict(xtol=1e-12, ftol=1e-15, maxiter=40000))
                      for x0 in (z, np.zeros(9))), key=lambda r: r.fun)
        gap = solved.fun - objective(ours)
        assert gap >= -1e-13, (case, gap)
        assert np.linalg.norm(ours - solved.x) <= np.sqrt(2 * max(gap, 0.0) + 1e-13), case
        if exact:
            assert not ours[g == 1].any(), ours
        if case % 2:
            assert not ours[g == 2].any()


# ---------------------------------------------------------------- AdamHAPG's per-group options


def test_a_parameter_groups_own_adam_betas_or_eps_are_checked_as_the_constructors():
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    before = p.detach().clone()
    for bad in (dict(betas=(0.5, 1.0)), dict(betas=(1.0, 0.999)), dict(eps=0.0), dict(eps="1e-8"), dict(betas=(0.5,))):
        with pytest.raises(ConfigError, match="Adam (betas|eps)"):
            AdamHAPG([{"params": [p], **bad}], lr=0.1, lam=0.1)
        opt = AdamHAPG([p], lr=0.1, lam=0.1)
        with pytest.raises(ConfigError, match="Adam (betas|eps)"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))], **bad})
        assert len(opt.param_groups) == 1
        # set between steps, as λ and η may be: refused at the step, before any weight moves
        opt.param_groups[0].update(bad)
        p.grad = torch.ones_like(p)
        with pytest.raises(ConfigError, match="Adam (betas|eps)"):
            opt.step()
        assert torch.equal(p.detach(), before) and not opt.state
    p.grad = None


def test_hapg_and_adamhapg_with_two_parameter_groups_of_their_own_options_are_the_own_transcription():
    """Two parameter groups with their own lr, λ, α (and AdamHAPG's betas, eps), irregular groups with singletons, λ
    and η changed at every step: each parameter follows its own group's options (the transcription above), five steps."""
    rng = np.random.default_rng(21)
    steps = 5
    g1, g2 = np.array([0, 1, 2, 0, 0, 2, 1]), np.array([0, 1, 1, 1, 2])  # g2's groups 0 and 2 are singletons
    a1, a2 = rng.normal(size=7) * 0.3, rng.normal(size=5) * 0.3
    grads1, grads2 = [rng.normal(size=7) for _ in range(steps)], [rng.normal(size=5) for _ in range(steps)]
    lrs1, lrs2 = rng.uniform(0.01, 0.2, steps), rng.uniform(0.01, 0.2, steps)
    lams1, lams2 = rng.uniform(0, 1.5, steps), rng.uniform(0, 1.5, steps)
    (b1, e1), (b2, e2) = ((0.5, 0.999), 1e-8), ((0.8, 0.95), 1e-3)
    for adam in (False, True):
        p1 = torch.nn.Parameter(torch.tensor(a1))
        p2 = torch.nn.Parameter(torch.tensor(a2))
        groups = [{"params": [p1], "groups": [torch.tensor(g1)], "alpha": 0.3},
                  {"params": [p2], "groups": [torch.tensor(g2)], "alpha": 0.8}]
        if adam:
            groups[1].update(betas=b2, eps=e2)
            opt = AdamHAPG(groups, lr=0.1, betas=b1, eps=e1)
            want1 = _own_adamhapg(a1, grads1, lrs1, lams1, 0.3, g1, *b1, e1)
            want2 = _own_adamhapg(a2, grads2, lrs2, lams2, 0.8, g2, *b2, e2)
        else:
            opt = HAPG(groups, lr=0.1)
            want1 = _own_hapg(a1, grads1, lrs1, lams1, 0.3, g1)
            want2 = _own_hapg(a2, grads2, lrs2, lams2, 0.8, g2)
        for k in range(steps):
            for group, lr, lam in zip(opt.param_groups, (lrs1[k], lrs2[k]), (lams1[k], lams2[k])):
                group["lr"], group["lam"] = float(lr), float(lam)
            p1.grad, p2.grad = torch.tensor(grads1[k]), torch.tensor(grads2[k])
            opt.step()
            # float64 round-off of a few operations on O(1) numbers
            np.testing.assert_allclose(p1.detach().numpy(), want1[k], rtol=0, atol=1e-13)
            np.testing.assert_allclose(p2.detach().numpy(), want2[k], rtol=0, atol=1e-13)


def test_the_constructors_groups_with_several_parameter_groups_is_one_line_not_the_first_groups_ids_for_all():
    """``HAPG([{"params": [a]}, {"params": [b]}], groups=[ids_a])``: torch hands every dict without its own ``groups`` the
    constructor's list, read from its first tensor, so b (a's shape) was grouped by a's ids, silently; and
    ``groups=[ids_a, ids_b]`` (one tensor per parameter, as the docstring says) was refused as "1 parameters, 2 groups
    tensors". One line naming the per-dict form; a single dict, or dicts with their own groups, work as before."""
    a = torch.nn.Parameter(torch.tensor([3.0, 4.0, 0.1, 0.1], dtype=torch.float64))
    b = torch.nn.Parameter(torch.tensor([3.0, 4.0, 0.1, 0.1], dtype=torch.float64))
    ids_a, ids_b = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 2, 3])
    for make in (HAPG, AdamHAPG):
        for groups in ([ids_a], [ids_a, ids_b]):
            with pytest.raises(ConfigError, match="give each dict its own"):
                make([{"params": [a]}, {"params": [b]}], lr=0.1, lam=0.5, groups=groups)
        # what works: each dict its own ids (the constructor's then names nothing), or one dict
        opt = make([{"params": [a], "groups": [ids_a]}, {"params": [b], "groups": [ids_b]}], lr=0.1, lam=0.5)
        assert [g["groups"][0] is i for g, i in zip(opt.param_groups, (ids_a, ids_b))] == [True, True]
        assert make([{"params": [a]}], lr=0.1, lam=0.5, groups=[ids_a]).param_groups[0]["groups"][0] is ids_a
    # the grouping the per-dict form gives b is b's own: at λ = 1, α = 0, η = 1 and zero gradient, eq 10 with b's
    # singletons (threshold 1 each) keeps 3 − 1 and 4 − 1; a's ids (pairs, threshold √2 on norms 5 and 0.14) would not
    b.grad = torch.zeros_like(b)
    HAPG([{"params": [b], "groups": [ids_b]}], lr=1.0, lam=1.0, alpha=0.0).step()
    np.testing.assert_allclose(b.detach().numpy(), [2.0, 3.0, 0.0, 0.0], rtol=0, atol=1e-15)


# ---------------------------------------------------------------- §A / §B entry points


def test_a_start_of_one_given_as_a_number_is_one_bayes_error_line_naming_the_argument():
    """Algorithms 2 and 3 start at γ(0) = 1 and ω(0) = 1; given as the number 1.0 (or a list), the updates (and
    expand_groups) stopped in "'float' object has no attribute 'shape'", an AttributeError traceback naming no argument.
    One BayesError line naming the argument and its shape; the tensor start works and is the own transcription (B.0.2-B.0.5 with ω = 1:
    γ = ‖W_n‖, C = γ/(1 + γH), ω² = Σ H/(1 + γH))."""
    from nasdiag.bayes import expand_groups, group_bayes_update, parent_matrix, sparse_bayes_update, structured_update
    from nasdiag.bayes.update import BayesError

    W = torch.tensor([[3.0, 4.0], [0.6, 0.8], [0.0, 0.0]], dtype=torch.float64)
    H = torch.tensor([[1.0, 2.0], [0.0, 4.0], [1.0, 1.0]], dtype=torch.float64)
    parents = parent_matrix([(0, 2), (1, 2), (2, 3)]).double()
    calls = {
        "omega_prev": lambda: structured_update(W, H, 1.0, (0,)),
        "curvature": lambda: structured_update(W, H.tolist(), torch.ones(3, dtype=torch.float64), (0,)),
        "gamma_prev": lambda: sparse_bayes_update(W, H, 1.0, parents),
        "w": lambda: group_bayes_update(W.tolist(), H.unsqueeze(0), torch.ones(3, 2, dtype=torch.float64), parents),
        "per_group": lambda: expand_groups([1.0, 1.0, 1.0], W, (0,)),
    }
    for name, call in calls.items():
        with pytest.raises(BayesError, match=f"^{name} must be a tensor of shape"):
            call()
    u = structured_update(W, H, torch.ones(3, dtype=torch.float64), (0,))
    gamma = np.array([5.0, 1.0, 0.0])
    np.testing.assert_allclose(u.gamma.numpy(), gamma, rtol=1e-15)
    h = H.numpy()
    omega2 = [np.sum(h[n] / (1 + gamma[n] * h[n])) for n in range(2)]
    np.testing.assert_allclose(u.omega.numpy()[:2], np.sqrt(omega2), rtol=1e-14)
    assert u.omega[2] == np.inf  # a zero group: γ = 0, dead


def test_the_operators_given_groups_that_are_not_a_tensor_say_so_in_one_line():
    """sgl_penalty/prox_group/prox_sgl with groups=None (HAPG's "whole tensor one group") or a list stopped in "'NoneType'
    object has no attribute 'shape'", an AttributeError traceback; a NumPy array was refused as "an integer tensor ...,
    got int64" (an int64 array). One ConfigError line naming the tensor wanted; the zeros it points to are one group."""
    from nasdiag.sparse import prox_group, sgl_penalty

    a = torch.tensor([[3.0, -4.0], [0.0, 0.0]], dtype=torch.float64)
    for groups in (None, [[0, 0], [0, 0]], np.zeros((2, 2), dtype=np.int64)):
        for call in (lambda: sgl_penalty(a, 0.5, 0.0, groups), lambda: prox_group(a, 1.0, groups),
                     lambda: prox_sgl(a, 0.1, 1.0, groups)):
            with pytest.raises(ConfigError, match=r"groups must be an integer tensor .* shape \(2, 2\), got a "):
                call()
    # the whole tensor one group, as the line says: λ(1 − α)·√4·‖a‖ = 0.5·2·5
    whole = torch.zeros((2, 2), dtype=torch.long)
    assert float(sgl_penalty(a, 0.5, 0.0, whole)) == pytest.approx(5.0, rel=1e-15)
