"""probe.hessian(): the probe hands the recorded batch to nasdiag.hessian (issue 4 §2)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import nasdiag
from nasdiag.probe import ProbeError

from conftest import float64_batch, tiny_network


def tiny(seed=0):
    # 3 candidates keep the exact reference (one second backward per entry) fast
    return tiny_network(1, seed, reductions=[], primitives=["skip_connect", "avg_pool_3x3", "sep_conv_3x3"])


def data(B=4):
    return float64_batch(B, hw=6)


def test_exact_hessian_equals_autograd_second_derivative_of_a_leaf_Z():
    net = tiny()
    x, y = data()
    g = torch.Generator().manual_seed(3)
    Z = [torch.softmax(torch.randn(net.num_edges, 3, generator=g, dtype=torch.float64), -1).requires_grad_()]
    probe = nasdiag.attach(net, hessian="exact")
    with probe.record(targets=y):
        F.cross_entropy(net(x, Z), y).backward()
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    got = probe.hessian()
    for k, v in net.named_buffers():
        assert torch.equal(v, buffers[k]), k  # running statistics untouched
    # independent reference: ∂²L/∂Z_ek² by double backward, on a copy with the same BN state
    ref_net = copy.deepcopy(net)
    Zr = [Z[0].detach().clone().requires_grad_()]
    (gZ,) = torch.autograd.grad(F.cross_entropy(ref_net(x, Zr), y), Zr[0], create_graph=True)
    for e in range(net.num_edges):
        diag = torch.stack([torch.autograd.grad(gZ[e, k], Zr[0], retain_graph=True)[0][e, k] for k in range(3)])
        torch.testing.assert_close(got[f"cells.0.edges.{e}"], diag, rtol=1e-8, atol=1e-12)


def test_plumbing_approx_and_keyword_weights_reach_the_hessian_engine_unchanged():
    """Plumbing test (nasdiag against nasdiag): the probe hands the keyword weights to the Hessian engine unchanged; the engine's numbers have independent references in tests/test_curvature_accuracy.py and tests/test_hessian_arch_exact.py."""
    from nasdiag.hessian import arch_diag_hessian

    net = tiny()
    x, y = data()
    probe = nasdiag.attach(net, hessian="approx", loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="sum"))
    w = {"normal": torch.softmax(net.alphas_normal.detach(), -1)}
    with probe.record(targets=y):
        F.cross_entropy(net(x, weights=w), y).backward()
    got = probe.hessian()
    edges = {s.name: (s.module, list(s.module.ops)) for s in net.edge_specs()}
    want = arch_diag_hessian(lambda_free(net, w), lambda out, t: F.cross_entropy(out, t, reduction="sum"), x, y, edges, mode="approx")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=0)
    agg = probe.aggregate(got)
    assert agg["normal"].shape == (net.num_edges, 3)


class lambda_free(torch.nn.Module):  # noqa: N801 - a tiny test wrapper
    def __init__(self, net, w):
        super().__init__()
        self.net, self.w = net, w

    def forward(self, x):
        return self.net(x, weights=self.w)


def test_plumbing_alpha_chain_rule_is_passed_through():
    """Plumbing test (nasdiag against nasdiag): the probe passes wrt='alpha' through; the chain rule itself is checked against autograd in tests/test_alpha_chain_softmax_check.py."""
    from nasdiag.hessian.arch_exact import exact_arch_diag_hessian

    net = tiny()
    x, y = data()
    probe = nasdiag.attach(net, hessian="exact")
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    got = probe.hessian(wrt="alpha")
    edges = {s.name: (s.module, list(s.module.ops)) for s in net.edge_specs()}
    want = exact_arch_diag_hessian(net, F.cross_entropy, x, y, edges, wrt="alpha")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-14)


def test_hessian_misuse_is_explained():
    net = tiny()
    x, y = data()
    with pytest.raises(ProbeError, match="hessian='diag'"):
        nasdiag.attach(net).hessian()
    with pytest.raises(ProbeError, match=r"attach\(hessian=\.\.\.\): unknown curvature mode 'full'; choose one of .*approx"):
        nasdiag.attach(net, hessian="full")
    with pytest.raises(ProbeError, match="one of .*'approx'"):  # the valid modes are listed
        nasdiag.attach(net, loss_fn=F.cross_entropy)
    probe = nasdiag.attach(net, hessian="exact")
    with pytest.raises(ProbeError, match="no completed recorded step"):
        probe.hessian()
    with probe.record():
        # a loss whose targets cannot be read off its gradient (the default cross-entropy's can)
        F.cross_entropy(net(x), y, label_smoothing=0.1).backward()
        with pytest.raises(ProbeError, match="after the probe.record"):
            probe.hessian()
    with pytest.raises(ProbeError, match="targets"):
        probe.hessian()
    assert set(probe.hessian(targets=y)) == set(probe.edge_names)


def test_a_mistyped_mode_gets_the_engines_suggestion_at_attach_and_at_call():
    import nasdiag
    from nasdiag.probe import ProbeError

    net = tiny()
    with pytest.raises(ProbeError, match=r"attach\(hessian=\.\.\.\): unknown curvature mode 'Exact'; did you mean 'exact'\?"):
        nasdiag.attach(net, hessian="Exact")
    with pytest.raises(ProbeError, match=r"needs k, the number of Hessian-vector products"):
        nasdiag.attach(net, hessian="hutchinson")
    probe = nasdiag.attach(net, hessian="diag")
    with pytest.raises(ProbeError, match=r"probe.hessian\(mode=\.\.\.\): unknown curvature mode 'ggn-mc'; did you mean 'ggn_mc'\?"):
        probe.hessian(mode="ggn-mc")
