"""Audit round 20 of the wiring paper's theorems (supplement §2, §4 Thm. 1, §5 Cor. 1.2, §6 Thm. 2, §8.1-8.2) and
the probe's scale-invariance bookkeeping, against a float64 supernet written here from scratch (the minimal cell of
Fig. 7 with the node protocol: input nodes 0, 1, intermediate nodes 2, 3, edges (0,2) (1,2) (0,3) (1,3) (2,3), the
output the concatenation of nodes 2 and 3; ReLU-conv-norm preprocessing; global average pooling and a bias-free
classifier) whose ∂L/∂Z (leaf Z), output-edge costs (a scalar multiplier on each node's slice of the cell output)
and path parts (a copy of Z per consumer of node 2) come from plain autograd. Never nasdiag against nasdiag.

Defects found (each test fails without its fix):

* ``attach(..., norm_deviation=True)`` measured eps/(var + eps) of the module that makes an op invariant whenever it
  had an ``eps`` and was not the op itself, so an op ``Sequential(conv, RMSNorm)`` with the user's own degree-0 rule
  (registered as the docs say) stopped the user's forward inside a pre-hook with eps_deviation's
  UnsupportedModuleError, where the same norm as a bare op was NaN; and an op ending in a constant module
  (``Sequential(conv, Zero())``, J = 0 exactly) was NaN where a bare ``Zero`` is 0.0. Only torch's normalizations
  are measured; a constant module is 0.0 wherever it sits
  (test_invariance_deviation_of_a_users_degree_0_module_inside_an_op_is_nan_and_a_constant_one_is_0).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.cost import HOMOGENEITY_RULES, degree_rule, register_homogeneity_rule

DT = torch.float64


class _RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) over the last dim: f(c·x) = f(x) as eps → 0, a user's own normalization."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()


class _Zero(nn.Module):
    """The ``none`` op, a constant 0 of the input's shape."""

    forward = staticmethod(lambda x: x.mul(0.0))


class _Mixed(nn.Module):
    """A DARTS-convention mixed op: Σ_k w_k·op_k(x), its candidates the list ``_ops``."""

    def __init__(self, ops):
        super().__init__()
        self._ops = nn.ModuleList(ops)

    def forward(self, x, weights):
        return torch.stack([op(x) for op in self._ops], -1) @ weights


class _Head(nn.Module):
    def __init__(self, edge):
        super().__init__()
        self.edge, self.head = edge, nn.Linear(4, 3)

    def forward(self, x, w):
        return self.head(self.edge(x, w))


def test_invariance_deviation_of_a_users_degree_0_module_inside_an_op_is_nan_and_a_constant_one_is_0():
    """Reference: J_f(x)·x by torch.func.jvp: 0 exactly for the ops ending in a constant module; for the RMSNorm ops
    eps_deviation has no formula (it names the four torch normalizations), so the probe's answer is NaN, as it
    already was for the bare RMSNorm op. The LayerNorm op is measured: eps/(var + eps) of its input."""
    register_homogeneity_rule(_RMSNorm, degree_rule(0.0, "x / rms(x)"))
    register_homogeneity_rule(_Zero, degree_rule(0.0, "constant zero"))
    try:
        torch.manual_seed(0)
        ln = nn.LayerNorm(4, elementwise_affine=False, eps=1e-3)
        ops = [nn.Sequential(nn.Linear(4, 4, bias=False), _RMSNorm()), _RMSNorm(),
               nn.Sequential(nn.Linear(4, 4), _Zero()), _Zero(), nn.Sequential(nn.Linear(4, 4, bias=False), ln)]
        edge = _Mixed(ops)
        net = _Head(edge).to(DT)

        x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
        w = torch.softmax(torch.randn(len(ops), dtype=DT), 0)
        for k in (2, 3):  # the reference: J·x = d/dc f(c·x) at c = 1 is exactly 0 for a constant output
            _, jx = torch.func.jvp(ops[k], (x,), (x,))
            assert bool((jx == 0).all())
        probe = nasdiag.attach(net, edges={"e": (edge, list(ops))}, norm_deviation=True)
        with probe.record():
            F.cross_entropy(net(x, w), y).backward()
        dev = probe.invariance_deviation()["e"]
        names = probe.edges[0].op_names
        assert math.isnan(dev[names[0]]) and math.isnan(dev[names[1]])
        assert dev[names[2]] == 0.0 and dev[names[3]] == 0.0
        h = ops[4][0](x).detach()
        expected = (1e-3 / (h.var(-1, unbiased=False) + 1e-3)).max()
        assert dev[names[4]] == pytest.approx(float(expected), rel=1e-12)
    finally:
        HOMOGENEITY_RULES.pop(_RMSNorm, None)
        HOMOGENEITY_RULES.pop(_Zero, None)
