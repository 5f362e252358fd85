"""``wrt="alpha"`` chains through ``Z = softmax(α)`` of the architecture parameter itself; weights made any
other way (a temperature, as in SNAS/GDAS's relaxations) must be refused, not silently mis-chained.

Reference for the accepted case: ``torch.autograd.functional.hessian`` w.r.t. α (float64, no BatchNorm)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nasdiag.hessian import arch_diag_hessian


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Identity()])

    def forward(self, x, weights):
        w = weights.unsqueeze(-1)  # (K, 1) or (B, K, 1): per-sample weights too (the GGN modes)
        return sum(w[..., k, :] * op(x) for k, op in enumerate(self.ops))


class Net(nn.Module):
    def __init__(self, temperature):
        super().__init__()
        self.alpha = nn.Parameter(torch.randn(2, 3))
        self.edges = nn.ModuleList([Mixed(), Mixed()])
        self.head = nn.Linear(4, 3)
        self.temperature = temperature

    def forward(self, x, alpha=None):
        alpha = self.alpha if alpha is None else alpha
        for e, a in zip(self.edges, alpha):
            x = torch.tanh(e(x, F.softmax(a / self.temperature, -1)))
        return self.head(x)


def _setup(temperature):
    torch.manual_seed(0)
    net = Net(temperature).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    edges = {f"e{i}": (m, list(m.ops)) for i, m in enumerate(net.edges)}
    return net, x, y, edges


@pytest.mark.parametrize("mode", ["exact", "diag", "approx", "ggn", "ggn_mc", "hutchinson:2"])
def test_weights_with_a_temperature_are_refused_for_alpha(mode):
    net, x, y, edges = _setup(0.5)
    with pytest.raises(ValueError, match=r"softmax\(α/τ\) with τ = 0\.5"):
        arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt="alpha")
    arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt="Z")  # w.r.t. Z nothing is chained


def test_plain_softmax_weights_pass_and_chain_exactly():
    net, x, y, edges = _setup(1.0)
    got = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="exact", wrt="alpha")
    full = torch.autograd.functional.hessian(lambda a: F.cross_entropy(net(x, a), y), net.alpha.detach())
    ref = torch.diagonal(full.reshape(6, 6)).reshape(2, 3)
    assert torch.allclose(torch.stack([got["e0"], got["e1"]]), ref, atol=1e-12, rtol=1e-10)


class _Dangling(Net):
    """The second edge runs, but its output is thrown away: the loss does not depend on it."""

    def forward(self, x, alpha=None):
        h = torch.tanh(self.edges[0](x, F.softmax(self.alpha[0], -1)))
        self.edges[1](h, F.softmax(self.alpha[1], -1))
        return self.head(h)


@pytest.mark.parametrize("mode", ["exact", "diag", "approx", "ggn", "ggn_mc", "hutchinson:2"])
def test_an_edge_the_loss_ignores_is_zero_and_said_in_every_mode(mode):
    torch.manual_seed(0)
    net = _Dangling(1.0).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    edges = {f"e{i}": (m, list(m.ops)) for i, m in enumerate(net.edges)}
    with pytest.warns(RuntimeWarning, match=r"does not depend on edge\(s\) \['e1'\]"):
        got = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode)
    assert torch.equal(got["e1"], torch.zeros(3, dtype=torch.float64)) and bool(got["e0"].abs().sum() > 0)
