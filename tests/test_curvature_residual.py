"""The split of the exact mixing-weight curvature that docs/hessian.md's "Reading" rests on
(scripts/curvature_residual.py), checked where theory says "equals" (float64).

Z_k enters the loss only through its node, x_j = Σ_k Z_k B_k + ..., so ``∂²L/∂Z_k² = d²L(x_j + t·B_k)/dt²``;
the second-order chain rule splits that into the Gauss-Newton term and the residual of the modules
downstream of x_j. On one cell the consumers of a node are the last modules whose second derivative is
not zero (after them: the next node's sum, global pooling, the classifier), so Gauss-Newton plus the
immediate consumers' residual is the exact diagonal; with BatchNorm in eval mode every consumer is
piecewise linear, the residual vanishes and the Gauss-Newton term is the exact diagonal.
"""

import functools
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))

from curvature_accuracy import builder  # noqa: E402
from curvature_residual import decompose  # noqa: E402

from nasdiag.hessian import arch_diag_hessian  # noqa: E402


def _rel(a, b):
    keys = list(b)
    x, y = torch.cat([a[k] for k in keys]), torch.cat([b[k] for k in keys])
    return float((x - y).norm() / y.norm())


@functools.lru_cache(maxsize=None)
def _decomposed(name):
    net, x, y = builder(name, "tiny")(torch.device("cpu"))
    return name, net, x, y, decompose(net, x, y)


@pytest.fixture(params=["cell_train", "cell_eval"])
def split(request):
    return _decomposed(request.param)


def test_line_derivative_is_the_exact_mixing_weight_curvature(split):
    _, net, x, y, parts = split
    exact = arch_diag_hessian(net, F.cross_entropy, x, y, net.edge_specs(), mode="exact_per_edge")
    assert _rel(parts["exact"], exact) < 1e-12


def test_gauss_newton_plus_immediate_residual_is_exact_on_one_cell(split):
    name, _, _, _, parts = split
    whole = {n: parts["ggn_exact"][n] + parts["immediate_residual"][n] for n in parts["exact"]}
    assert _rel(whole, parts["exact"]) < 1e-10
    if name == "cell_train":  # the residual is most of it: Gauss-Newton alone is far off
        assert _rel(parts["ggn_exact"], parts["exact"]) > 0.3
    else:  # eval-mode BatchNorm: nothing downstream has a second derivative
        assert max(float(v.abs().max()) for v in parts["immediate_residual"].values()) < 1e-12


def test_ggn_mode_is_the_gauss_newton_term_in_eval_mode():
    # (with train-mode BatchNorm the ggn mode adds the statistics' cross-sample coupling: docs/hessian.md)
    _, net, x, y, parts = _decomposed("cell_eval")
    ggn = arch_diag_hessian(net, F.cross_entropy, x, y, net.edge_specs(), mode="ggn")
    assert _rel(ggn, parts["ggn_exact"]) < 1e-10


@pytest.mark.parametrize("affine", [False, True])
def test_batchnorm_curvature_pieces_give_the_line_second_derivative(affine):
    """The closed form the output-space sketch rests on, against autograd along a random line (float64)."""
    from curvature_residual import batchnorm_curvature_pieces

    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3, affine=affine).double()
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 2.0)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64) * 2 + 1
    g, u = torch.randn_like(x), torch.randn_like(x)
    t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    (first,) = torch.autograd.grad((g * bn(x + t * u)).sum(), t, create_graph=True)
    (second,) = torch.autograd.grad(first, t)
    pc = batchnorm_curvature_pieces(bn, x, g)
    d, s, G = pc["dims"], pc["s"], pc["G"]
    l1u, l2u = (pc["l1"] * u).sum(d, keepdim=True), (pc["l2"] * u).sum(d, keepdim=True)
    spread = (u - u.mean(d, keepdim=True)).square().sum(d, keepdim=True) / pc["M"]
    closed = (-2 / s**3 * l1u * l2u + 3 * G / s**5 * l2u**2 - G / s**3 * spread).sum()
    assert abs(float(closed - second)) < 1e-10 * max(1.0, abs(float(second)))
