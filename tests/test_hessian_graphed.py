"""Curvature diagonals replayed as CUDA graphs (nasdiag.hessian.graphed) against plain calls.

The reference is the plain recursion on the same inputs and parameter values (``diag_hessian`` /
``arch_diag_hessian``), itself tested against autograd elsewhere; these tests check that capturing and
replaying changes nothing: same numbers after the parameters moved, a new capture for a new batch shape,
plain calls where a graph cannot apply. The GPU tests run in float64 so that "the same numbers" means 1e-10.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import CurvatureError, diag_hessian
from nasdiag.cuda_graphs import StepGraph
from nasdiag.hessian.graphed import GraphedDiagHessian, curvature_graph, has_user_hooks
from nasdiag.search.base import Schedule
from nasdiag.search.methods.darts import DARTS
from nasdiag.supernet import Network
from nasdiag.supernet.engine.graph import GraphWarning

from eager_curvature import eager_per_edge



def _conv_bn(device="cpu", dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(6, 4)).to(device, dtype)


def _batch(n, device="cpu", dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=g).to(device, dtype), torch.randint(0, 4, (n,), generator=g).to(device)


def _max_rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)).item() for k in b)


def test_modes_that_read_the_host_are_refused():
    net = _conv_bn()
    for mode in ("exact", "hutchinson:2"):
        with pytest.raises(CurvatureError, match="cannot be captured"):
            GraphedDiagHessian(net, F.cross_entropy, mode=mode)
    with pytest.raises(CurvatureError, match="unknown curvature mode"):
        GraphedDiagHessian(net, F.cross_entropy, mode="aprox")
    with pytest.raises(CurvatureError, match="parameter names"):
        GraphedDiagHessian(net, F.cross_entropy, params=[("0.weight", net[0].weight)])
    # values to evaluate at would be ignored by a graph that reads the parameters' storage: refused, not dropped
    with pytest.raises(CurvatureError, match="got dict"):
        GraphedDiagHessian(net, F.cross_entropy, params={"0.weight": net[0].weight * 2})
    with pytest.raises(CurvatureError, match="got str"):
        GraphedDiagHessian(net, F.cross_entropy, params="0.weight")
    with pytest.raises(CurvatureError, match="not parameters of the model"):
        GraphedDiagHessian(net, F.cross_entropy, params=["0.weight", "conv.weight"])


class _Replay:
    """Stands in for torch.cuda at StepGraph's boundary on the CPU: capture keeps the function and its static
    arguments, replay runs exactly those, as a CUDA graph replays the kernels it recorded."""

    def eager(self, fn, args):
        return fn(*args)

    def capture(self, fn, args):
        return (fn, args), None

    def replay(self, graph, static_out):
        fn, args = graph
        return fn(*args)


def test_a_call_with_other_non_tensor_arguments_never_replays_a_graph():
    g = StepGraph(lambda x, shift: x + shift, lambda: 0, backend=_Replay())
    x = torch.zeros(3)
    for _ in range(3):
        assert torch.equal(g(x, 0.0), x)
    with pytest.warns(GraphWarning, match="non-tensor arguments changed"):
        assert torch.equal(g(x, 5.0), x + 5)
    assert torch.equal(g(x, 5.0), x + 5)  # now captured for 5.0
    assert torch.equal(g(x, 0.0), x)  # and 0.0 still replays its own graph
    assert g.counts == {"replay": 2, "capture": 2, "eager": 2, "plain": 0}


def test_the_curvature_graph_is_keyed_on_every_modules_mode():
    net = _conv_bn()
    graph = curvature_graph(lambda x, y: {}, net, "approx", name="test")
    key = graph.state_key()
    net[1].eval()  # one BatchNorm to running statistics: other kernels, so another capture
    assert graph.state_key() != key
    net[1].train()
    assert graph.state_key() == key
    net[1].track_running_stats = False
    assert graph.state_key() != key


def test_the_curvature_graph_is_keyed_on_a_normalizations_eps_and_on_a_swapped_module():
    # eps is a Python float baked into a captured batch_norm kernel, and a parameter-free module put in place
    # of another (a GELU for the ReLU) changes no storage the key would see: either change must capture anew.
    net = _conv_bn()
    graph = curvature_graph(lambda x, y: {}, net, "approx", name="test")
    key = graph.state_key()
    net[1].eps = 1e-3
    assert graph.state_key() != key
    net[1].eps = 1e-5
    assert graph.state_key() == key
    net[2] = nn.GELU()
    assert graph.state_key() != key


def test_on_the_cpu_the_calls_are_plain_and_equal_diag_hessian():
    net = _conv_bn()
    x, y = _batch(8)
    h = GraphedDiagHessian(net, F.cross_entropy, mode="approx", params=["0.weight", "5.bias"])
    got = h(x, y)
    assert set(got) == {"0.weight", "5.bias"}
    assert _max_rel(got, diag_hessian(net, F.cross_entropy, x, y, mode="approx", params=["0.weight", "5.bias"])) == 0
    assert h.graph.counts["plain"] == 1 and h.graph.counts["capture"] == 0


def test_user_hooks_are_seen():
    net = _conv_bn()
    assert not has_user_hooks(net)
    handle = net[2].register_forward_hook(lambda *a: None)
    try:
        assert has_user_hooks(net)
    finally:
        handle.remove()
    assert not has_user_hooks(net)


@pytest.mark.parametrize("mode", ["approx", "diag"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replayed_weight_diagonal_equals_plain_calls_as_parameters_move(mode):
    net = _conv_bn("cuda")
    h = GraphedDiagHessian(net, F.cross_entropy, mode=mode)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    batches = [_batch(8, "cuda", seed=s) for s in range(4)]
    for i, (x, y) in enumerate(batches):
        got = h(x, y)
        assert _max_rel(got, diag_hessian(net, F.cross_entropy, x, y, mode=mode)) < 1e-10
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()  # in place: the graph reads the new values
    assert h.graph.counts == {"replay": 2, "capture": 1, "eager": 1, "plain": 0}
    x, y = _batch(5, "cuda")
    with pytest.warns(GraphWarning, match="batch shapes changed"):
        got = h(x, y)
    assert _max_rel(got, diag_hessian(net, F.cross_entropy, x, y, mode=mode)) < 1e-10
    h.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_search_curvature_is_replayed_and_equals_arch_diag_hessian():
    torch.manual_seed(0)
    net = Network(4, 10, 3, in_channels=3, alpha_init_scale=1.0).cuda().double()
    method = DARTS(net, schedule=Schedule(epochs=1, steps_per_epoch=8), hessian_mode="approx")
    g = torch.Generator().manual_seed(3)
    data = [tuple(t.cuda() for t in (torch.randn(8, 3, 8, 8, generator=g).double(), torch.randint(0, 10, (8,), generator=g)))
            for _ in range(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):
            method.step(data[i], data[i + 1])  # α and w move between the curvature calls
            x, y = data[i + 2]
            got = method.curvature(x, y)
            weights = method.eval_weights()
            specs, per_edge = eager_per_edge(net, x, y, weights, "approx")
            for cell_type in weights:
                ref = torch.zeros_like(weights[cell_type])
                for e in specs:
                    if e.cell_type == cell_type:
                        ref[e.edge_index] += per_edge[e.name]
                h = got[f"hessian/{cell_type}/diag"]
                assert ((h - ref).abs().max() / ref.abs().max()).item() < 1e-10
    assert method._curvature_graph.counts["replay"] == 2 and method._curvature_graph.counts["capture"] == 1
    method.release_graphs()
    assert method._curvature_graph is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replayed_curvature_between_replayed_steps_changes_no_step():
    """The step's and the curvature's graphs share one memory pool: replaying the curvature between two step
    replays must leave the steps' results as they are without it (float64)."""
    torch.manual_seed(0)
    net = Network(4, 10, 3, in_channels=3, alpha_init_scale=1.0).cuda().double()
    g = torch.Generator().manual_seed(5)
    data = [tuple(t.cuda() for t in (torch.randn(8, 3, 8, 8, generator=g).double(), torch.randint(0, 10, (8,), generator=g)))
            for _ in range(7)]
    with_curv = DARTS(net, schedule=Schedule(epochs=1, steps_per_epoch=8), hessian_mode="approx")
    without = DARTS(copy.deepcopy(net), schedule=Schedule(epochs=1, steps_per_epoch=8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(6):
            a = with_curv.step(data[i], data[i + 1])
            with_curv.curvature(*data[i + 1])
            b = without.step(data[i], data[i + 1])
            for k in b:
                assert torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-12), k
    assert with_curv._curvature_graph.counts["replay"] >= 3 and with_curv.step.counts["replay"] >= 3
    for p, q in zip(with_curv.network.parameters(), without.network.parameters()):
        assert torch.allclose(p, q, rtol=1e-9, atol=1e-12)


class _PooledReplay(_Replay):
    """_Replay whose captures report the pool they were asked to share, like torch.cuda.graph(pool=...)."""

    def __init__(self, pool=None):
        self.pool = pool
        self.asked = []

    def capture(self, fn, args):
        shared = None if self.pool is None else self.pool()
        self.asked.append(shared)
        return (fn, args, f"pool of capture {len(self.asked)}" if shared is None else shared), None

    def replay(self, graph, static_out):
        return graph[0](*graph[1])

    def pool_of(self, graph):
        return graph[2]


def test_a_new_capture_shares_the_pool_of_a_live_graph_and_never_of_a_released_one():
    first = StepGraph(lambda x: x + 1, lambda: 0, backend=_PooledReplay())
    second = StepGraph(lambda x: x * 2, lambda: 0, backend=_PooledReplay(pool=first.pool))
    x = torch.ones(2)
    assert first.pool() is None
    for _ in range(2):
        first(x)
    assert first.pool() == "pool of capture 1"
    for _ in range(2):
        second(x)
    assert second.backend.asked == ["pool of capture 1"]
    first.release()  # its graphs are gone: a later capture must not be handed their pool
    assert first.pool() is None
    for _ in range(2):
        second(torch.ones(3))
    assert second.backend.asked == ["pool of capture 1", None]
