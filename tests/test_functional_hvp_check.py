"""The forward-over-reverse products behind ``exact`` are checked once against autograd's reverse-over-reverse ones.

A wrong forward-mode rule (as torch 2.13 has for ``jvp(jvp)`` through train-mode BatchNorm) would make every
``exact`` number wrong without an error. Here a cube op with a deliberately wrong ``jvp`` stands in for it: the
check must catch it, ``backend="auto"`` must fall back to the reverse route and return the true diagonal (taken
independently, by finite differences of autograd gradients, float64), and ``backend="func"`` must refuse."""

import pytest
import torch
from torch import nn

from nasdiag.hessian import CurvatureRuntimeError
from nasdiag.hessian._hvp import functional_hvp
from nasdiag.hessian.arch_exact import exact_arch_diag_hessian

DT = torch.float64


class _CubeWithWrongTangent(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 * x**2  # right, and differentiable

    @staticmethod
    def jvp(ctx, tangent):
        (x,) = ctx.saved_tensors
        return 2 * x**2 * tangent  # wrong: 3 x² t


class _Mixed(nn.Module):
    def __init__(self, cube):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3, bias=False)])
        self.cube = cube

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self.ops))


class _Net(nn.Module):
    def __init__(self, cube):
        super().__init__()
        self.mixed = _Mixed(cube)
        self.head = nn.Linear(3, 2)
        self.z = torch.tensor([0.3, 0.7], dtype=DT)

    def forward(self, x):
        return self.head(self.mixed.cube(self.mixed(x, self.z)))  # the cube sees the mixing weights


def _cube(x):
    return _CubeWithWrongTangent.apply(x)


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def test_a_wrong_forward_mode_rule_is_caught_before_any_product_is_used():
    x = torch.randn(5, dtype=DT)
    products = functional_hvp(lambda p: (_cube(p) ** 2).sum(), x)  # the tangent of the cube matters here
    with pytest.raises(CurvatureRuntimeError, match="disagrees with autograd's reverse-over-reverse"):
        products(torch.eye(5, dtype=DT))
    right = functional_hvp(lambda p: ((p**3) ** 2).sum(), x)
    torch.testing.assert_close(right(torch.eye(5, dtype=DT)), torch.diag(30 * x**4), rtol=1e-12, atol=1e-12)


def test_exact_falls_back_to_the_reverse_route_and_is_right():
    torch.manual_seed(0)
    net = _Net(_cube).to(DT)
    x, y = torch.randn(6, 3, dtype=DT), torch.randint(0, 2, (6,))
    edges = {"mixed": (net.mixed, list(net.mixed.ops))}
    with pytest.warns(RuntimeWarning, match="products are not usable"):
        got = exact_arch_diag_hessian(net, _loss, x, y, edges)["mixed"]
    with pytest.raises(CurvatureRuntimeError):
        exact_arch_diag_hessian(net, _loss, x, y, edges, backend="func")

    def grad_at(z):
        z = z.clone().requires_grad_(True)
        net.z = z
        (g,) = torch.autograd.grad(_loss(net(x), y), z)
        return g

    z0, eps = net.z.clone(), 1e-5
    fd = torch.stack([(grad_at(z0 + eps * e) - grad_at(z0 - eps * e))[k] / (2 * eps) for k, e in enumerate(torch.eye(2, dtype=DT))])
    net.z = z0
    torch.testing.assert_close(got, fd, rtol=1e-6, atol=1e-9)
