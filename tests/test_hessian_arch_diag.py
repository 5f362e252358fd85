"""``arch_diag_hessian`` (bayesnas-appendix C.3.1-C.3.2) against autograd (a zero leaf δ added to each
edge's mixing weights, float64).

``∂²L/∂Z_k² = B_kᵀ H_j B_k`` exactly; the BayesNAS formula ``Σ B_k² h_j`` keeps the diagonal of
``H_j``. It is therefore exact for an edge whose output reaches an elementwise (MSE) loss through
ops that keep the Hessian diagonal, in both modes (``approx`` too: that H is constant per channel),
and for ``wrt="alpha"`` when, in addition, the candidate outputs have disjoint supports. Errors on
the full supernet are measured in docs/hessian.md.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import arch_diag_hessian, diag_hessian
from nasdiag.supernet import DARTS_PRIMITIVES, MixedOp, Network
from nasdiag.supernet.ops import OpConfig

from conftest import assert_no_module_hooks
from test_hessian_weights_reference import DT, assert_rel_close, delta_arch_hessian, func_diag_hessian


def _diag(blocks):
    return {k: torch.diagonal(b) for k, b in blocks.items()}


def _close(got, expected, rtol=1e-9):
    assert list(got) == list(expected)
    for k in expected:
        scale = expected[k].abs().max().item() or 1.0
        assert (got[k] - expected[k]).abs().max().item() <= rtol * scale, (k, got[k], expected[k])


class TwoEdges(nn.Module):
    """stem → edge A (node 1) → edge B (output); B's output is the prediction."""

    def __init__(self, norm="batch", C=3):
        super().__init__()
        cfg = OpConfig(norm=norm)
        self.stem = nn.Conv2d(1, C, 3, padding=1)
        self.edge_a = MixedOp(C, 1, DARTS_PRIMITIVES, cfg)
        self.edge_b = MixedOp(C, 1, DARTS_PRIMITIVES, cfg)
        K = len(DARTS_PRIMITIVES)
        self.register_buffer("z_a", torch.softmax(torch.randn(K), 0))
        self.register_buffer("z_b", torch.softmax(torch.randn(K), 0))

    def forward(self, x):
        return self.edge_b(self.edge_a(self.stem(x), self.z_a), weights=self.z_b)

    def edges(self):
        return {"a": (self.edge_a, list(self.edge_a.ops)), "b": (self.edge_b, list(self.edge_b.ops))}


@pytest.mark.parametrize("norm", ["batch", "layer", "instance"])
@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_last_edge_exact_under_elementwise_loss(mode, norm):
    torch.manual_seed(0)
    model = TwoEdges(norm).to(DT)
    x = torch.randn(3, 1, 5, 5, dtype=DT)
    y = torch.randn(3, 3, 5, 5, dtype=DT)
    edges = model.edges()
    got = arch_diag_hessian(model, F.mse_loss, x, y, edges, mode=mode)
    ref = _diag(delta_arch_hessian(model, F.mse_loss, x, y, edges))
    _close({"b": got["b"]}, {"b": ref["b"]})
    assert got["a"].shape == (len(DARTS_PRIMITIVES),) and torch.isfinite(got["a"]).all()


class PerSampleEdge(nn.Module):
    def __init__(self, C=2, B=3):
        super().__init__()
        self.stem = nn.Conv2d(1, C, 3, padding=1)
        self.edge = MixedOp(C, 2, DARTS_PRIMITIVES, OpConfig(order="conv-bn-relu"))
        self.register_buffer("z", torch.rand(B, len(DARTS_PRIMITIVES)))

    def forward(self, x):
        return self.edge(self.stem(x), self.z)


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_per_sample_weights_strided_edge(mode):
    torch.manual_seed(1)
    model = PerSampleEdge().to(DT)
    x = torch.randn(3, 1, 6, 6, dtype=DT)
    y = torch.randn(3, 2, 3, 3, dtype=DT)
    edges = {"e": (model.edge, list(model.edge.ops))}
    got = arch_diag_hessian(model, lambda o, t: F.mse_loss(o, t, reduction="sum"), x, y, edges, mode=mode)
    ref = _diag(delta_arch_hessian(model, lambda o, t: F.mse_loss(o, t, reduction="sum"), x, y, edges))
    _close(got, ref)


class DisjointMixed(nn.Module):
    """A mixed op whose candidates write disjoint features: ∂²L/∂Z² is diagonal under MSE; weights (K,) or (B, K)
    (the GGN modes' per-sample shift)."""

    def __init__(self, K=3, d=4, width=2):
        super().__init__()
        self.ops = nn.ModuleList(nn.Linear(d, K * width) for _ in range(K))
        with torch.no_grad():
            for k, op in enumerate(self.ops):
                keep = torch.zeros(K * width)
                keep[k * width : (k + 1) * width] = 1
                op.weight.mul_(keep[:, None])
                op.bias.mul_(keep)

    def forward(self, x, weights):
        return sum(weights[..., k : k + 1] * op(x) for k, op in enumerate(self.ops))


class AlphaNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.mixed = DisjointMixed()
        self.alpha = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.mixed(self.pre(x), torch.softmax(self.alpha, 0))


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_alpha_chain_rule_exact_for_disjoint_candidates(mode):
    torch.manual_seed(2)
    model = AlphaNet().to(DT)
    x, y = torch.randn(5, 3, dtype=DT), torch.randn(5, 6, dtype=DT)
    edges = {"e": (model.mixed, list(model.mixed.ops))}
    got = arch_diag_hessian(model, F.mse_loss, x, y, edges, mode=mode, wrt="alpha")

    def loss_of(alpha):
        return F.mse_loss(torch.func.functional_call(model, {"alpha": alpha}, (x,)), y)

    ref = torch.diagonal(torch.func.hessian(loss_of)(model.alpha.detach()))
    _close(got, {"e": ref})


@pytest.mark.parametrize(
    "order,norm", [("relu-conv-bn", "batch"), ("conv-bn-relu", "layer"), ("conv-relu-bn", "instance")]
)
def test_plumbing_supernet_alpha_routes_agree(order, norm):
    """Plumbing (nasdiag against nasdiag, no independent reference): per-edge C.3 + softmax chain rule, summed over the cells sharing α, equals the glue route of
    diag_hessian through the supernet's own softmax (the same recursion reached two ways)."""
    torch.manual_seed(3)
    net = Network.minimal(4, 5, 3, in_channels=1, order=order, norm=norm).to(DT)
    x, y = torch.randn(4, 1, 8, 8, dtype=DT), torch.randint(0, 5, (4,))
    specs = net.edge_specs()
    per_edge = arch_diag_hessian(net, F.cross_entropy, x, y, {s.name: s for s in specs}, mode="diag", wrt="alpha")
    whole = diag_hessian(net, F.cross_entropy, x, y, mode="diag", params=[n for n, _ in net.named_arch_parameters()])
    for cell_type, alpha in net.alphas().items():
        summed = torch.zeros_like(alpha)
        for s in specs:
            if s.cell_type == cell_type:
                summed[s.edge_index] += per_edge[s.name]
        torch.testing.assert_close(whole[f"alphas_{cell_type}"], summed, rtol=1e-10, atol=1e-12)


def test_exact_mode_dispatches_to_hvp_route():
    torch.manual_seed(4)
    model = TwoEdges(C=2).to(DT)
    x, y = torch.randn(2, 1, 4, 4, dtype=DT), torch.randn(2, 2, 4, 4, dtype=DT)
    edges = model.edges()
    got = arch_diag_hessian(model, F.mse_loss, x, y, edges, mode="exact")
    _close(got, _diag(delta_arch_hessian(model, F.mse_loss, x, y, edges)), 1e-8)
    with pytest.raises(ValueError, match="rules"):
        arch_diag_hessian(model, F.mse_loss, x, y, edges, mode="exact", rules={})


def test_supernet_runs_leaves_no_trace():
    torch.manual_seed(5)
    net = Network.minimal(4, 5, 2, in_channels=1, norm="batch").to(DT)
    x, y = torch.randn(4, 1, 8, 8, dtype=DT), torch.randint(0, 5, (4,))
    buffers = {k: b.clone() for k, b in net.named_buffers()}
    edges = {s.name: s for s in net.edge_specs()}
    for mode, wrt in (("diag", "Z"), ("approx", "alpha")):
        out = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt=wrt)
        assert list(out) == list(edges)
        assert all(v.shape == (len(net.primitives),) and torch.isfinite(v).all() for v in out.values())
        if wrt == "Z":  # the 'none' op outputs zeros: its curvature in Z is zero
            assert all(v[net.primitives.index("none")] == 0 for v in out.values())
    for k, b in net.named_buffers():
        assert torch.equal(b, buffers[k]), k
    assert_no_module_hooks(net)


def test_bad_edges_raise():
    torch.manual_seed(6)
    model = TwoEdges(C=2).to(DT)
    x, y = torch.randn(2, 1, 4, 4, dtype=DT), torch.randn(2, 2, 4, 4, dtype=DT)
    edges = model.edges()
    with pytest.raises(ValueError, match="mode"):
        arch_diag_hessian(model, F.mse_loss, x, y, edges, mode="fast")
    with pytest.raises(ValueError, match="wrt"):
        arch_diag_hessian(model, F.mse_loss, x, y, edges, wrt="beta")
    model.z_b.fill_(0.5)  # not a probability vector
    with pytest.raises(ValueError, match="softmax"):
        arch_diag_hessian(model, F.mse_loss, x, y, edges, wrt="alpha")
    unused = MixedOp(2, 1, DARTS_PRIMITIVES)
    model.spare = unused
    with pytest.raises(ValueError, match="never ran"):
        arch_diag_hessian(model, F.mse_loss, x, y, {**edges, "spare": (unused, list(unused.ops))})
    assert_no_module_hooks(model)


def test_supernet_classifier_exact_in_diag_mode():
    """The classifier is the supernet's last FC layer: its diagonal is exact under cross-entropy."""
    torch.manual_seed(7)
    net = Network.minimal(4, 5, 3, in_channels=1).to(DT)
    x, y = torch.randn(4, 1, 8, 8, dtype=DT), torch.randint(0, 5, (4,))
    names = ["classifier.weight", "classifier.bias"]
    got = diag_hessian(net, F.cross_entropy, x, y, mode="diag", params=names)
    assert_rel_close(got, func_diag_hessian(net, F.cross_entropy, x, y, names=names), 1e-10)
