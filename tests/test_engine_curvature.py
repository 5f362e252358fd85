"""The mixing-weight recursions (C.3.1 ``diag``, C.3.2 ``approx``) on the fast engine's batched ops against the
same recursion on the eager per-op modules (``arch_diag_hessian``, whose rules are tested against autograd and
exact Hessians elsewhere), in float64: batching edges, summing shared diagonals before a rule, and the tape must
change nothing but rounding. Networks with reduction cells cover the factorized skip columns and the
FactorizedReduce preprocessing; odd image sizes cover their padding."""

import copy
import warnings

import pytest
import torch
from torch import nn

from nasdiag.search.base import Schedule
from nasdiag.search.methods.darts import DARTS
from nasdiag.supernet import Network
from nasdiag.supernet.engine.curvature import mixing_curvature

from eager_curvature import eager_per_edge


def _net(size_seed=0, **kw):
    torch.manual_seed(size_seed)
    net = Network(kw.pop("C", 4), 5, kw.pop("layers", 3), in_channels=3, alpha_init_scale=1.0, **kw).double()
    return net.train()


def _batch(size, n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def _weights(net, seed=2):
    g = torch.Generator().manual_seed(seed)
    return {t: torch.softmax(2 * torch.randn(a.shape, generator=g, dtype=a.dtype), -1) for t, a in net.alphas().items()}


def _eager_per_cell(net, x, y, weights, mode):
    """``arch_diag_hessian`` on the per-op modules, arranged per cell."""
    specs, per_edge = eager_per_edge(net, x, y, weights, mode)
    out = [torch.zeros(len(cell.edges), len(cell.edges[0].ops), dtype=x.dtype) for cell in net.cells]
    for e in specs:
        out[e.cell_index][e.edge_index] = per_edge[e.name]
    return out


def _assert_close(got, ref, tol=1e-10):
    assert len(got) == len(ref)
    for c, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == b.shape
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < tol, f"cell {c}: relative error {err:.2e}"


@pytest.mark.parametrize("mode", ["approx", "diag"])
@pytest.mark.parametrize("size", [8, 7])
def test_batched_recursion_equals_the_eager_modules(mode, size):
    net = _net()
    x, y = _batch(size)
    weights = _weights(net)
    got = mixing_curvature(net, x, y, net._cell_weights(weights), mode)
    ref = _eager_per_cell(net, x, y, weights, mode)
    _assert_close(got, ref)
    # the ops of an edge differ (the zero op exactly 0), so equality is not between constant rows
    zero = net.cells[0].edges[0].primitives.index("none")
    assert torch.all(got[0][:, zero] == 0) and got[0][:, zero + 1:].std() > 0


def test_affine_norms_and_fewer_output_nodes():
    net = _net(affine=True, steps=3, multiplier=2, layers=4)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d) and m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    x, y = _batch(6, n=5)
    weights = _weights(net, seed=4)
    _assert_close(mixing_curvature(net, x, y, net._cell_weights(weights), "approx"),
                  _eager_per_cell(net, x, y, weights, "approx"))


def test_leaves_buffers_and_gradients_as_they_were():
    net = _net()
    x, y = _batch(8)
    net(x)  # one fast forward: the running statistics are linked into the engine's flat buffer
    before = {k: v.clone() for k, v in net.state_dict().items()}
    mixing_curvature(net, x, y, net._cell_weights(_weights(net)), "approx")
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in net.parameters())


def test_returns_none_where_the_fast_engine_does_not_apply():
    net = _net()
    x, y = _batch(8)
    per_cell = net._cell_weights(_weights(net))
    net.eval()
    assert mixing_curvature(net, x, y, per_cell, "approx") is None
    net.train()
    handle = net.cells[0].edges[0].ops[3].register_forward_hook(lambda *a: None)
    try:
        assert mixing_curvature(net, x, y, per_cell, "approx") is None
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="mode must be one of"):
        mixing_curvature(net, x, y, per_cell, "exact")


@pytest.mark.parametrize("mode", ["approx", "diag"])
def test_search_curvature_is_the_same_on_either_engine(mode):
    """``method.curvature`` takes the batched recursion under the fast engine and the hooked one under eager."""
    net = _net()
    data = [_batch(8, seed=s) for s in range(3)]
    results = {}
    for engine in ("fast", "eager"):
        method = DARTS(copy.deepcopy(net).set_engine(engine), schedule=Schedule(epochs=1, steps_per_epoch=4),
                       hessian_mode=mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            method.step(data[0], data[1])
            results[engine] = method.curvature(*data[2])
    for key, ref in results["eager"].items():
        if key.endswith("/diag"):
            err = ((results["fast"][key] - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-10, key
