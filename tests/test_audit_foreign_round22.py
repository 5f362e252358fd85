"""Round 22, foreign supernets: nasdiag attached to supernets written the way NAS codebases write them (NNI's
LayerChoice with a ModuleDict of candidates and α in a ParameterDict, NASLib's edges holding their ops and α, the
original DARTS code), without nasdiag.supernet. References: autograd in float64 on the user's own model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag import cost
from nasdiag.probe import ProbeError


def _ops(C):
    return [nn.Identity(), nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C, affine=False)),
            nn.AvgPool2d(3, 1, 1, count_include_pad=False), nn.MaxPool2d(3, 1, 1)]


class LayerChoice(nn.Module):
    """NNI-style: candidates in a ModuleDict keyed by name; the weights are computed inside the forward from an α the
    model holds in a ParameterDict (the forward takes x alone)."""

    def __init__(self, C, alphas, label):
        super().__init__()
        self.candidates = nn.ModuleDict(zip(["skip", "conv", "avg", "max"], _ops(C)))
        self.label = label
        self._alphas = [alphas]  # not a submodule: the model owns the ParameterDict

    def forward(self, x):
        w = torch.softmax(self._alphas[0][self.label], -1)
        return sum(wk * op(x) for wk, op in zip(w, self.candidates.values()))


class NNINet(nn.Module):
    def __init__(self, C=4, n=3):
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.alphas = nn.ParameterDict({f"lc{i}": nn.Parameter(0.5 * torch.randn(4)) for i in range(n)})
        self.choices = nn.ModuleList([LayerChoice(C, self.alphas, f"lc{i}") for i in range(n)])
        self.head = nn.Linear(C, 5)

    def forward(self, x):
        h = self.stem(x)
        for lc in self.choices:
            h = lc(h)
        return self.head(h.mean((2, 3)))


def _nni(seed=0):
    torch.manual_seed(seed)
    net = NNINet().double()
    edges = {lc.label: (lc, list(lc.candidates.values())) for lc in net.choices}
    g = torch.Generator().manual_seed(seed + 1)
    return net, edges, torch.randn(6, 3, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g)


def test_hessian_of_an_edge_that_computes_its_weights_inside_is_refused_at_attach():
    """A mixed op whose forward takes x alone (NNI's LayerChoice, weights = softmax of an α it reads inside) gives
    the curvature engines no weights to shift. attach(hessian=...) took it, the step ran, and probe.hessian() then
    raised "the mixed op was called without mixing weights ...; list mixed ops, not candidate ops, as edges", which
    is what the user had done. Now attach refuses it in one line naming the edges and what to change."""
    net, edges, x, y = _nni()
    with pytest.raises(ProbeError, match=r"hessian=.*lc0.*forward\(x, weights\)") as info:
        nasdiag.attach(net, edges=edges, hessian="exact")
    assert "\n" not in str(info.value)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in net.modules())
    # what the line promises: without hessian= the costs are right (the span check takes the weights inside); they give
    # ∂L/∂α through darts_alpha_grad, against autograd's α.grad of the user's own model (float64)
    with pytest.raises(ProbeError, match="pass edges="):
        nasdiag.attach(net)
    probe = nasdiag.attach(net, edges=edges)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    costs = probe.costs()
    for name, a in net.alphas.items():
        got = cost.darts_alpha_grad(costs[name], torch.softmax(a.detach(), -1))
        torch.testing.assert_close(got, a.grad, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("mode", ["exact", "diag"])
def test_arch_diag_hessian_names_weights_computed_inside_the_forward(mode):
    """The engines' line for the same case said only "list mixed ops, not candidate ops, as edges"."""
    from nasdiag.hessian import CurvatureError, arch_diag_hessian

    net, edges, x, y = _nni()
    with pytest.raises(CurvatureError, match=r"computes its weights inside its forward.*forward\(x, weights\)"):
        arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode)


class _EdgeData:
    """NASLib's edge data: the object holding the edge's α, handed to the mixed op's forward."""

    def __init__(self, alpha):
        self.alpha = alpha


class NASLibMixedOp(nn.Module):
    """NASLib-style: candidates registered as "primitive-<k>" children and kept in a plain list; forward(x, edge_data)."""

    def __init__(self, C):
        super().__init__()
        self.primitives = _ops(C)
        for k, op in enumerate(self.primitives):
            self.add_module(f"primitive-{k}", op)

    def forward(self, x, edge_data):
        return sum(w * op(x) for w, op in zip(torch.softmax(edge_data.alpha, -1), self.primitives))


class NASLibNet(nn.Module):
    def __init__(self, C=4):
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.edges = nn.ModuleList([NASLibMixedOp(C) for _ in range(2)])
        self.edge_data = [_EdgeData(nn.Parameter(torch.randn(4, dtype=torch.float64))) for _ in range(2)]
        self.head = nn.Linear(C, 5)

    def forward(self, x):
        h = self.stem(x)
        for op, data in zip(self.edges, self.edge_data):
            h = op(h, data)
        return self.head(h.mean((2, 3)))


def _naslib(seed=0):
    torch.manual_seed(seed)
    net = NASLibNet().double()
    edges = {f"e{i}": (op, op.primitives) for i, op in enumerate(net.edges)}
    g = torch.Generator().manual_seed(seed + 1)
    return net, edges, torch.randn(6, 3, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g)


@pytest.mark.parametrize("mode", ["exact", "diag", "ggn"])
def test_hessian_of_a_mixed_op_given_an_object_for_its_weights_says_so(mode):
    """forward(x, edge_data) with the α inside the object: `exact` and `ggn` said "mixing weights must have shape (K,)
    or (B, K) ..., got _EdgeData; list exactly the ops the mixed op mixes" (the ops listed were right), `diag` that
    the op "was called without mixing weights". Now each names the object and what forward to give it."""
    net, edges, x, y = _naslib()
    probe = nasdiag.attach(net, edges=edges, hessian=mode)
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    costs = probe.costs()  # right all the same: ∂L/∂α through darts_alpha_grad against autograd (float64)
    for i, data in enumerate(net.edge_data):
        got = cost.darts_alpha_grad(costs[f"e{i}"], torch.softmax(data.alpha.detach(), -1))
        torch.testing.assert_close(got, data.alpha.grad, rtol=1e-9, atol=1e-15)
    with pytest.raises(nasdiag.hessian.CurvatureError,
                       match=r"called with a _EdgeData object as its second argument, not a tensor of mixing weights.*"
                             r"forward\(x, weights\)") as info:
        probe.hessian()
    assert "list exactly the ops" not in str(info.value)
