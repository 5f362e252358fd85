"""Rewards against autograd: XNAS reward (eq 18/35, R = -C) and GD-with-softmax effective reward (eq 37)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nasdiag.regret import SoftmaxGD, gd_softmax_reward, rewards_from_gradient, xnas_reward


def smooth_loss(p, w):
    """A non-linear loss of the prediction, so that grad_p l depends on p."""
    return (torch.sin(p) * w).sum(-1) + 0.5 * (p * p).sum(-1) + torch.logsumexp(p, -1)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 8), st.integers(1, 6))
def test_eq37_matches_autograd_through_softmax(seed, n_experts, dim):
    gen = torch.Generator().manual_seed(seed)
    batch = 4
    alpha = (3 * torch.randn(batch, n_experts, generator=gen, dtype=torch.float64)).requires_grad_()
    experts = torch.randn(batch, n_experts, dim, generator=gen, dtype=torch.float64)
    w = torch.randn(dim, generator=gen, dtype=torch.float64)
    u = torch.softmax(alpha, -1)
    p = (u.unsqueeze(-1) * experts).sum(-2)  # eq 1
    loss = smooth_loss(p, w).sum()
    (grad_alpha,) = torch.autograd.grad(loss, alpha)
    p_leaf = p.detach().requires_grad_()
    (grad_p,) = torch.autograd.grad(smooth_loss(p_leaf, w).sum(), p_leaf)
    effective = gd_softmax_reward(rewards_from_gradient(grad_p, experts), u.detach())
    torch.testing.assert_close(effective, -grad_alpha, rtol=1e-12, atol=1e-13)  # eq 6: R~ = -dl/dalpha
    torch.testing.assert_close(effective.sum(-1), torch.zeros(batch, dtype=torch.float64), atol=1e-12, rtol=0)


def test_xnas_reward_is_minus_the_derivative_wrt_mixing_weight():
    """eq 35 / Algorithm 1 line 8: R_i = -dl/du_i for a linear mixture; the probe's cost C = dL/dZ."""
    gen = torch.Generator().manual_seed(0)
    edges, ops, dim = 5, 7, 3
    z = torch.rand(edges, ops, generator=gen, dtype=torch.float64).requires_grad_()
    op_outputs = torch.randn(edges, ops, dim, generator=gen, dtype=torch.float64)
    w = torch.randn(dim, generator=gen, dtype=torch.float64)
    node = (z.unsqueeze(-1) * op_outputs).sum(-2)
    (cost,) = torch.autograd.grad(smooth_loss(node, w).sum(), z)
    node_leaf = node.detach().requires_grad_()
    (grad_node,) = torch.autograd.grad(smooth_loss(node_leaf, w).sum(), node_leaf)
    torch.testing.assert_close(xnas_reward(cost), rewards_from_gradient(grad_node, op_outputs), rtol=1e-12, atol=1e-13)


def test_softmax_gd_forecaster_is_gradient_descent_on_alpha():
    """SoftmaxGD's trajectory equals alpha <- alpha - lr autograd(l)(alpha) for l(p) = c . p, p = u."""
    gen = torch.Generator().manual_seed(2)
    n, steps, lr = 4, 30, 0.7
    costs = torch.randn(steps, n, generator=gen, dtype=torch.float64)  # experts are the axes: p = u
    alpha = torch.tensor([0.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    gd = SoftmaxGD(n, lr, init_log_weights=alpha.clone())
    for t in range(steps):
        leaf = alpha.clone().requires_grad_()
        (grad,) = torch.autograd.grad(torch.softmax(leaf, -1) @ costs[t], leaf)
        alpha = alpha - lr * grad
        gd.update(xnas_reward(costs[t]))
    torch.testing.assert_close(gd.log_weights, alpha, rtol=1e-12, atol=1e-12)


def test_reward_input_errors():
    with pytest.raises(TypeError, match="floating-point"):
        xnas_reward(torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="same number of experts"):
        gd_softmax_reward(torch.ones(2, 3), torch.ones(2, 4) / 4)
    with pytest.raises(ValueError, match=r"\(\.\.\., K, D\)"):
        rewards_from_gradient(torch.ones(5), torch.ones(3, 4))
