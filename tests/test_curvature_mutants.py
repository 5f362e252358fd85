"""Regressions that the curvature accuracy bounds (tests/test_curvature_accuracy.py) and the per-rule tests let
through, found by mutation testing of nasdiag.hessian: each test here fails on a small change of the library
that silently makes a curvature worse, and says which. References are independent of the recursions under
test: torch.func / autograd Hessians in float64, or theorems (the Gauss-Newton matrix equals the Hessian within
an edge when nothing downstream curves).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import arch_diag_hessian

from test_hessian_arch_diag import DisjointMixed
from test_hessian_weights_rules import _check

DT = torch.float64


@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4)], ids=["rows", "sequence"])
def test_square_linear_rule_is_exact_for_a_separable_loss(shape):
    """``LinearRule`` with a square weight against torch.func (bayesnas-appendix C.1.4-C.1.5): the rule tests'
    layers are not square, so ``Wᵀ`` in place of ``W`` (in ``H_x = h (W∘W)`` or ``H_W = hᵀ x²``) went unseen."""
    torch.manual_seed(0)
    module = nn.Linear(4, 4)
    nn.init.normal_(module.weight)  # far from symmetric, so W and Wᵀ differ in every entry
    _check(module, torch.randn(*shape))


class OneEdge(nn.Module):
    """``x → tanh(Linear) → mixed op [→ tanh]``: with the last tanh, the residual ``Σ g ∂²f/∂Z²`` (what the
    Gauss-Newton matrix drops) is non-zero but, like the Gauss-Newton part, diagonal within the edge."""

    def __init__(self, curved: bool):
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.mixed = DisjointMixed()
        self.head = nn.Tanh() if curved else nn.Identity()
        self.register_buffer("z", torch.softmax(torch.randn(3), 0))

    def forward(self, x):
        return self.head(self.mixed(self.pre(x), self.z))


def one_edge(curved: bool):
    torch.manual_seed(1)
    net = OneEdge(curved).to(DT)
    x, y = torch.randn(12, 3, dtype=DT), torch.randn(12, 6, dtype=DT)

    def loss_of(z):
        return F.mse_loss(torch.func.functional_call(net, {"z": z}, (x,)), y)

    dense = torch.autograd.functional.hessian(loss_of, net.z.clone())
    return net, x, y, {"e": (net.mixed, list(net.mixed.ops))}, dense


def test_hutchinson_is_exact_where_the_hessian_minus_its_control_is_diagonal():
    """``hutchinson:<k>`` (``diag C + ε ⊙ (H − C) ε``) is exact for any k when ``H − C`` is diagonal within the
    edge, as here (disjoint candidates, elementwise curvature after them): a shrunk or dropped correction
    ``ε ⊙ (H − C) ε`` (biased towards the control C) fails, which the statistical bound of
    tests/test_hessian_hutchinson.py (z < 5 at k = 48) does not see for a 10% shrink."""
    net, x, y, edges, dense = one_edge(curved=True)
    exact = torch.diagonal(dense)
    ggn = arch_diag_hessian(net, F.mse_loss, x, y, edges, mode="ggn")["e"]
    assert float((ggn - exact).norm() / exact.norm()) > 0.05  # the residual matters: C alone is far off
    assert (dense - torch.diag(exact)).abs().max() < 1e-14 * exact.abs().max()  # H is diagonal within the edge
    for seed in (0, 1):
        got = arch_diag_hessian(net, F.mse_loss, x, y, edges, mode="hutchinson:1", seed=seed)["e"]
        torch.testing.assert_close(got, exact, rtol=1e-9, atol=1e-14)


def test_ggn_mc_averages_its_samples():
    """``ggn_mc`` with S samples is the mean of S unbiased draws of the Gauss-Newton diagonal, which equals the
    Hessian's here (nothing curves after the mixed op): its error shrinks like 1/√S. Every other test draws
    S = 1, where ``1/S`` and ``1/√S`` in the draws' scale agree."""
    net, x, y, edges, dense = one_edge(curved=False)
    exact = torch.diagonal(dense)

    def error(samples):
        got = arch_diag_hessian(net, F.mse_loss, x, y, edges, mode="ggn_mc", samples=samples)["e"]
        return float((got - exact).norm() / exact.norm())

    one, many = error(1), error(256)  # measured 0.297, 0.0099
    assert many < 0.05 and many < 0.3 * one, (one, many)


def test_weight_hutchinson_is_exact_for_a_diagonal_hessian_at_any_k():
    """``diag_hessian(mode="hutchinson:<k>")`` is ``(1/k) Σ_s ε_s ⊙ H ε_s``: exact for any k when H is diagonal
    (the last layer's bias under MSE), so its normalization is checked to round-off; the statistical test of
    tests/test_hessian_hutchinson.py runs k = 4000, where 1/(k + 1) for 1/k is invisible."""
    from nasdiag.hessian import diag_hessian

    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    x, y = torch.randn(7, 3, dtype=DT), torch.randn(7, 3, dtype=DT)
    bias = net[2].bias.detach().clone()
    dense = torch.autograd.functional.hessian(lambda b: F.mse_loss(torch.func.functional_call(net, {"2.bias": b}, (x,)), y), bias)
    assert (dense - torch.diag(torch.diagonal(dense))).abs().max() == 0
    for k in (1, 3):
        got = diag_hessian(net, F.mse_loss, x, y, mode=f"hutchinson:{k}", params=["2.bias"])["2.bias"]
        torch.testing.assert_close(got, torch.diagonal(dense), rtol=1e-12, atol=0)


class TiedEdge(nn.Module):
    """One mixed op called twice (tied weights) on two features of the input; the two outputs are concatenated,
    so the calls write disjoint outputs and MSE couples nothing: C.3.1 summed over the calls is exact."""

    def __init__(self):
        super().__init__()
        self.pre_a = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.pre_b = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.mixed = DisjointMixed()
        self.register_buffer("z", torch.softmax(torch.randn(3), 0))

    def forward(self, x):
        return torch.cat([self.mixed(self.pre_a(x), self.z), self.mixed(self.pre_b(x), self.z)], 1)


@pytest.mark.parametrize("mode", ["diag", "approx", "ggn", "hutchinson:1", "exact"])
def test_a_mixed_op_called_twice_sums_its_calls(mode):
    """``arch_diag_hessian`` of a tied mixed op is the curvature of its one Z, summed over its calls (its docstring);
    against autograd, where every mode is exact: C.3.1/C.3.2 because MSE couples no entries, the Gauss-Newton
    matrix (and so Hutchinson with it as control) because nothing curves after the mixed op. Counting only one
    call (C.3's sum, or the GGN's per-sample shift of the last call only) went unseen."""
    torch.manual_seed(3)
    net = TiedEdge().to(DT)
    x, y = torch.randn(5, 3, dtype=DT), torch.randn(5, 12, dtype=DT)
    dense = torch.autograd.functional.hessian(lambda z: F.mse_loss(torch.func.functional_call(net, {"z": z}, (x,)), y), net.z.clone())
    got = arch_diag_hessian(net, F.mse_loss, x, y, {"e": (net.mixed, list(net.mixed.ops))}, mode=mode)["e"]
    torch.testing.assert_close(got, torch.diagonal(dense), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_feature_mean_of_the_last_edge_is_per_channel(mode):
    """C.3.2 averages ``h_j`` per channel (over batch and space). With a loss whose curvature is elementwise and
    constant within each channel but differs between channels, both C.3.1 and C.3.2 are exact on the last edge
    (against autograd). The MSE tests have one constant curvature everywhere, where any grouping gives the
    same mean: grouping by the wrong axis was caught only by comparing with the fast engine's own recursion."""
    from test_hessian_arch_diag import TwoEdges

    torch.manual_seed(4)
    net = TwoEdges("batch").to(DT)
    x, y = torch.randn(3, 1, 5, 5, dtype=DT), torch.randn(3, 3, 5, 5, dtype=DT)
    scale = torch.tensor([0.5, 2.0, 7.0], dtype=DT).view(1, 3, 1, 1)

    def loss_fn(out, target):  # per sample, separable: ∂²L/∂out² = scale_c / N, constant in each channel
        return 0.5 * (scale * (out - target).square()).sum() / out.shape[0]

    dense = torch.autograd.functional.hessian(lambda z: loss_fn(torch.func.functional_call(net, {"z_b": z}, (x,)), y), net.z_b.clone())
    got = arch_diag_hessian(net, loss_fn, x, y, net.edges(), mode=mode)["b"]
    torch.testing.assert_close(got, torch.diagonal(dense), rtol=1e-9, atol=1e-14)
