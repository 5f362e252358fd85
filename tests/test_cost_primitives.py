"""nasdiag.cost on bare tensors, each against autograd / torch.func / numpy (float64)."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from nasdiag import cost
from nasdiag.supernet import Network, Zero


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


# --- cost assignment (§2.1) ------------------------------------------------------------------

def test_edge_costs_are_the_gradient_of_the_mixing_weights():
    B, K = 5, 4
    outs = [_rand(B, 3, 2, 2, seed=k) for k in range(K)]
    g = _rand(B, 3, 2, 2, seed=10)
    w = _rand(K, seed=11).requires_grad_()
    out = sum(w[k] * outs[k] for k in range(K))
    (out * g).sum().backward()  # L = <g, out>, so ∂L/∂out = g
    torch.testing.assert_close(cost.edge_costs(g, outs), w.grad, rtol=0, atol=1e-12)

    wb = _rand(B, K, seed=12).requires_grad_()
    out = sum(wb[:, k, None, None, None] * outs[k] for k in range(K))
    (out * g).sum().backward()
    per = cost.edge_costs(g, outs, per_sample=True)
    torch.testing.assert_close(per, wb.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(per.sum(0), cost.edge_costs(g, outs), rtol=0, atol=1e-12)


def test_edge_costs_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shape"):
        cost.edge_costs(_rand(2, 3), [_rand(2, 4)])
    with pytest.raises(ValueError, match="at least one"):
        cost.edge_costs(_rand(2, 3), [])


def test_output_edge_costs_match_scalar_multipliers_on_the_slices():
    B = 3
    out0 = _rand(B, 6, 2, 2)
    slices = {2: (0, 2), 3: (2, 4), 5: (4, 6)}
    s = torch.ones(3, dtype=torch.float64, requires_grad=True)
    scaled = torch.cat([s[i] * out0[:, a:b] for i, (a, b) in enumerate(slices.values())], dim=1)
    W = _rand(6 * 4, 2, seed=1)
    loss = torch.tanh(scaled.flatten(1) @ W).sum()
    (g,) = torch.autograd.grad(loss, scaled, retain_graph=True)
    loss.backward()
    torch.testing.assert_close(cost.output_edge_costs(g, out0, slices), s.grad, rtol=0, atol=1e-12)
    per = cost.output_edge_costs(g, out0, slices, per_sample=True)
    assert per.shape == (B, 3)
    torch.testing.assert_close(per.sum(0), s.grad, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="outside"):
        cost.output_edge_costs(g, out0, {2: (4, 9)})


def test_scatter_cells_lays_out_and_marks_missing():
    rows = _rand(3, 2)
    out = cost.scatter_cells(rows, torch.tensor([0, 1, 1]), torch.tensor([1, 0, 1]), 2, 2)
    assert torch.isnan(out[0, 0]).all()
    torch.testing.assert_close(out[1, 1], rows[2])
    torch.testing.assert_close(out[0, 1], rows[0])


# --- maps to architecture gradients -------------------------------------------------------------

def _loss_of(Z, seed=3):
    # an arbitrary smooth function of (E, K) weights, standing in for a network
    A = _rand(*Z.shape, seed=seed)
    return (torch.sin(Z * A) * A).sum() + (Z**2).sum() * 0.3


def test_softmax_jacobian_matches_torch_func():
    p = torch.softmax(_rand(3, 5), -1)
    alpha = torch.log(p)
    jac = torch.func.vmap(torch.func.jacrev(lambda a: torch.softmax(a, -1)))(alpha)
    torch.testing.assert_close(cost.softmax_jacobian(p), jac, rtol=0, atol=1e-12)


def test_darts_alpha_grad_matches_autograd_through_softmax():
    alpha = _rand(4, 6).requires_grad_()
    p = torch.softmax(alpha, -1)
    Z = p.detach().clone().requires_grad_()
    _loss_of(Z).backward()
    _loss_of(torch.softmax(alpha, -1)).backward()
    torch.testing.assert_close(cost.darts_alpha_grad(Z.grad, p.detach()), alpha.grad, rtol=0, atol=1e-12)


def test_proxyless_alpha_grad_is_the_gate_gradient_through_the_softmax_jacobian():
    # BinaryConnect (supplement §2.2): ∂L/∂α_i = Σ_j ∂L/∂g_j ∂p_j/∂α_i, the gate gradient taken as the
    # gradient of p. Reference: torch.func's Jacobian of the softmax, independent of the map's closed form.
    alpha = _rand(4, 6)
    p = torch.softmax(alpha, -1)
    gates = torch.nn.functional.one_hot(torch.tensor([0, 3, 5, 2]), 6).to(torch.float64).requires_grad_()
    _loss_of(gates).backward()
    jac = torch.func.vmap(torch.func.jacrev(lambda a: torch.softmax(a, -1)))(alpha)  # (E, K, K): ∂p_j/∂α_i at [j, i]
    expected = torch.einsum("ej,eji->ei", gates.grad, jac)
    torch.testing.assert_close(cost.proxyless_alpha_grad(gates.grad, p), expected, rtol=0, atol=1e-12)


def test_snas_alpha_grad_matches_autograd_through_gumbel_softmax():
    alpha = _rand(4, 6).requires_grad_()
    G = -torch.log(-torch.log(torch.rand(4, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)))
    lam = 0.7
    Z = torch.softmax((alpha + G) / lam, -1)
    Zl = Z.detach().clone().requires_grad_()
    _loss_of(Zl).backward()
    _loss_of(Z).backward()
    torch.testing.assert_close(cost.snas_alpha_grad(Zl.grad, Z.detach(), lam), alpha.grad, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="temperature"):
        cost.snas_alpha_grad(Zl.grad, Z.detach(), 0.0)


def test_dsnas_alpha_grad_is_the_sampled_cost_times_the_score_function():
    # DSNAS: ∂L/∂α = C(Z^s) ∇_α log p_s per edge. Reference: autograd of log p_s (the score function) times
    # the sampled op's cost read from the gate gradient, independent of the map's (Z·C)(Z − p) form.
    alpha = _rand(4, 6).requires_grad_()
    s = torch.tensor([1, 0, 5, 3])
    onehot = torch.nn.functional.one_hot(s, 6).to(torch.float64)
    Zl = onehot.clone().requires_grad_()
    _loss_of(Zl).backward()
    sampled_cost = Zl.grad.gather(1, s[:, None]).squeeze(1)
    log_p_s = torch.log_softmax(alpha, -1).gather(1, s[:, None]).squeeze(1)
    score = torch.stack([torch.autograd.grad(log_p_s[e], alpha, retain_graph=True)[0][e] for e in range(4)])
    got = cost.dsnas_alpha_grad(Zl.grad, onehot, torch.softmax(alpha, -1).detach())
    torch.testing.assert_close(got, sampled_cost[:, None] * score, rtol=0, atol=1e-12)


def test_maps_reject_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        cost.darts_alpha_grad(_rand(2, 3), _rand(2, 4))


def test_loss_minus_entropy_is_the_logit_inner_product_of_the_gradient():
    # Thm. 2's last step: <∂L/∂Y, Y> for the mean cross-entropy, by autograd.
    Y = _rand(7, 5).requires_grad_()
    t = torch.tensor([0, 1, 2, 3, 4, 0, 1])
    (gY,) = torch.autograd.grad(torch.nn.functional.cross_entropy(Y, t), Y)
    torch.testing.assert_close(cost.loss_minus_entropy(Y.detach(), t), (gY * Y.detach()).sum(), rtol=0, atol=1e-12)


# --- streaming statistics -------------------------------------------------------------------------

def test_cost_moments_match_numpy_over_the_history_with_masks():
    rng = np.random.default_rng(0)
    m = cost.CostMoments((3, 4))
    hist, masks = [], []
    for step in range(7):
        n = int(rng.integers(1, 4))
        obs = rng.normal(size=(n, 3, 4)) * (step + 1)
        mask = rng.random((n, 3, 4)) < 0.6
        m.update(torch.from_numpy(obs), torch.from_numpy(mask))
        hist.append(obs)
        masks.append(mask)
    H, M = np.concatenate(hist), np.concatenate(masks)
    cnt = M.sum(0)
    mean = np.where(cnt > 0, (H * M).sum(0) / np.maximum(cnt, 1), 0)
    var = np.where(cnt > 0, (M * (H - mean) ** 2).sum(0) / np.maximum(cnt, 1), np.nan)
    np.testing.assert_array_equal(m.count.numpy(), cnt)
    np.testing.assert_allclose(m.mean.numpy()[cnt > 0], mean[cnt > 0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m.var.numpy()[cnt > 0], var[cnt > 0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(m.second_moment.numpy()[cnt > 0], ((H**2 * M).sum(0) / np.maximum(cnt, 1))[cnt > 0], rtol=1e-10)


def test_cost_moments_merge_equals_one_accumulator_and_nan_is_kept():
    a, b, both = cost.CostMoments((2,)), cost.CostMoments((2,)), cost.CostMoments((2,))
    x, y = _rand(5, 2), _rand(3, 2, seed=1) + 4
    a.update(x)
    b.update(y)
    both.update(torch.cat([x, y]))
    a.merge(b)
    torch.testing.assert_close(a.mean, both.mean)
    torch.testing.assert_close(a.var, both.var)
    bad = torch.tensor([[math.nan, 1.0]], dtype=torch.float64)
    a.update(bad)
    assert torch.isnan(a.mean[0]) and not torch.isnan(a.mean[1])
    # a NaN at an entry that is masked out does not leak in
    c = cost.CostMoments((2,))
    c.update(bad, torch.tensor([[False, True]]))
    assert c.count.tolist() == [0.0, 1.0] and not torch.isnan(c.mean).any()
    c.reset()
    assert c.count.sum() == 0
    with pytest.raises(ValueError, match="shape"):
        c.update(_rand(4, 3))


# --- scale invariance (Thm. 1, §8.1–8.2) -------------------------------------------------------------

@pytest.mark.parametrize("order", ["relu-conv-bn", "conv-bn-relu", "conv-relu-bn"])
@pytest.mark.parametrize("norm", ["batch", "layer", "instance"])
def test_flags_agree_with_evaluating_f_at_scaled_inputs(order, norm):
    net = Network.minimal(4, 3, 1, order=order, norm=norm, norm_eps=1e-14, reductions=[]).double()
    x = _rand(4, 4, 6, 6)
    mixed = net.cells[0].edges[4]
    for name, op in zip(mixed.primitives, mixed.ops):
        flagged = cost.is_scale_invariant(op)
        with torch.no_grad():
            same = torch.allclose(op(3.7 * x), op(x), rtol=1e-9, atol=1e-9)
        assert flagged == same, (name, flagged, same)
        assert flagged == (name != "skip_connect")


def test_non_homogeneous_modules_are_not_flagged():
    conv_bias = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, bias=True), nn.Sigmoid(), nn.BatchNorm2d(2))
    assert not cost.is_scale_invariant(conv_bias)
    bn = nn.Sequential(nn.ReLU(), nn.Conv2d(2, 2, 1, bias=False), nn.BatchNorm2d(2))
    assert cost.is_scale_invariant(bn)
    bn.eval()  # running statistics: an affine map, not invariant
    assert not cost.is_scale_invariant(bn)
    assert cost.analyse(nn.Sequential(nn.ReLU(), nn.Conv2d(2, 2, 1, bias=False))).degree == 1
    assert cost.is_scale_invariant(Zero(1))


@pytest.mark.parametrize(
    "build, invariant",
    [
        (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=True), nn.BatchNorm2d(3, eps=1e-14)), True),
        (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=True), nn.InstanceNorm2d(3, eps=1e-14)), True),
        (lambda: nn.Sequential(nn.ReLU(), nn.Conv2d(2, 3, 1, bias=True), nn.BatchNorm2d(3, eps=1e-14)), True),
        (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, bias=True), nn.MaxPool2d(2), nn.BatchNorm2d(3, eps=1e-14)), True),
        # one group over all channels subtracts one mean: the per-channel bias minus its mean stays
        (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=True), nn.GroupNorm(1, 3, eps=1e-14)), False),
        (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=True), nn.ReLU(), nn.BatchNorm2d(3, eps=1e-14)), False),
    ],
)
def test_bias_before_a_normalization_over_its_constant_axes_is_invariant(build, invariant):
    torch.manual_seed(0)
    op = build().double()
    with torch.no_grad():
        for p in op.parameters():
            p.normal_()
    x = _rand(4, 2, 6, 6)
    with torch.no_grad():
        same = torch.allclose(op(3.7 * x), op(x), rtol=1e-9, atol=1e-9)
    assert same == invariant and cost.is_scale_invariant(op) == invariant


def test_import_cost_does_not_import_the_supernet():
    import subprocess
    import sys

    code = "import nasdiag.cost, nasdiag.hessian, sys; assert 'nasdiag.supernet' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_module_fails_loudly_and_a_registered_rule_is_used():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.op = nn.Sequential(nn.ReLU(), nn.Conv2d(2, 2, 1, bias=False), nn.BatchNorm2d(2))

        def forward(self, x):
            return self.op(x)

    with pytest.raises(cost.UnsupportedModuleError, match="register_homogeneity_rule"):
        cost.analyse(Wrapper())
    cost.register_homogeneity_rule(Wrapper, cost.delegate_rule("op"))
    try:
        assert cost.is_scale_invariant(Wrapper())
        with pytest.raises(ValueError, match="exists"):
            cost.register_homogeneity_rule(Wrapper, cost.delegate_rule("op"))
    finally:
        del cost.HOMOGENEITY_RULES[Wrapper]

    class MyConv(nn.Conv2d):  # rewrites forward: the Conv rule must not be borrowed
        def forward(self, x):
            return super().forward(x) + 1

    with pytest.raises(cost.UnsupportedModuleError):
        cost.analyse(MyConv(2, 2, 1, bias=False))


@pytest.mark.parametrize(
    "norm",
    [
        nn.BatchNorm2d(3, affine=False, track_running_stats=False, eps=1e-2),
        nn.InstanceNorm2d(3, affine=False, eps=1e-2),
        nn.GroupNorm(1, 3, affine=False, eps=1e-2),
        nn.LayerNorm([3, 4, 4], elementwise_affine=False, eps=1e-2),
    ],
    ids=["batch", "instance", "group", "layer"],
)
def test_eps_deviation_is_the_exact_directional_derivative(norm):
    """J_N(x)·x = N(x) · eps/(var + eps) per normalization group (torch.func.jvp along the scale)."""
    norm = norm.double()
    x = _rand(5, 3, 4, 4) * 0.2  # small variance, so that eps matters
    one = torch.ones((), dtype=torch.float64)
    _, jx = torch.func.jvp(lambda c: norm(c * x), (one,), (one,))
    factor = cost.eps_deviation(norm, x)
    y = norm(x)
    if isinstance(norm, nn.BatchNorm2d):
        pred = y * factor[None, :, None, None]
    elif isinstance(norm, nn.InstanceNorm2d):
        pred = y * factor[:, :, None, None]
    elif isinstance(norm, nn.GroupNorm):
        pred = y * factor[:, :, None, None]
    else:
        pred = y * factor[:, None, None, None]
    torch.testing.assert_close(jx, pred, rtol=1e-9, atol=1e-12)
    assert 1e-3 < float(factor.max()) < 1  # not trivially zero at this eps


def test_cost_moments_of_an_infinite_cost_do_not_depend_on_the_batching():
    """[inf] then [1] gives numpy's mean (inf) and variance (NaN) of [inf, 1], as one batch of both does."""
    inf = float("inf")
    for history in ([[inf], [1.0]], [[1.0], [inf]], [[inf, 1.0]], [[inf], [-inf]], [[2.0, inf], [3.0], [4.0]]):
        m = cost.CostMoments((1,))
        for batch in history:
            m.update(torch.tensor(batch, dtype=torch.float64).reshape(-1, 1))
        flat = np.array(sum(history, []))
        with np.errstate(invalid="ignore"):
            expected_mean, expected_var = flat.mean(), flat.var()
        np.testing.assert_equal(float(m.mean), expected_mean)
        np.testing.assert_equal(float(m.var), expected_var)
