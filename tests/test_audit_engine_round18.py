"""Round-18 audit of the fast engine (``nasdiag.supernet.engine``): a pure speed-up, the same numbers as the eager
modules. References: the eager forward (torch's own modules run one by one) and, for the module swapped in below, the
BatchNorm written out by hand; live tensors counted with ``gc``.

Defects found (each test fails without its fix):

* The engine's plans were keyed by the identities of the cells and candidate ops only. A module replaced *inside* an
  op after the first forward (an op's BatchNorm or conv swapped, as ``nn.SyncBatchNorm.convert_sync_batchnorm`` or a
  user freezing/re-initialising a layer does) kept the op's identity, so the plan went on computing with the old
  module: the new one's eps, weights, buffers and hooks unseen (output 2e-3 off with one BatchNorm of another eps,
  a probe's hook on it never called). The plan is rebuilt when any child of a cell module is replaced
  (test_a_module_swapped_inside_a_candidate_op_after_the_first_forward_is_the_one_computed).
* The same for a BatchNorm's eps or momentum set on some edges after the first forward: the plan refuses to batch
  edges that differ in them when it is built, but then each batched call read its first module's values for all
  (output 4e-3 off with one eps, running statistics 0.7 off with one momentum); a change rebuilds the plan
  (test_a_batchnorm_eps_or_momentum_set_on_some_edges_after_the_first_forward_is_used).
* A method's step captured as a CUDA graph (fast engine on CUDA) was keyed by optimizer settings, accumulators, module
  modes and two parameter addresses only: after either change above, or a hook put on a cell module (which sends the
  plain forward to the eager modules and calls the hook), the graph replayed the old plan's kernels; the key now holds
  the plan in use and whether the cells are hooked (checked on the key: a CPU replay stand-in re-runs Python)
  (test_the_captured_steps_state_key_changes_with_what_the_engine_plan_bakes_in).

Checked and right (fast vs eager in float64, 3 steps of each method through the method API, records compared to
1e-12: α, weights, BN buffers, step outputs, diagnostics incl. per-sample rows, curvature): every registered method
(asmnas and the sampled dsnas/proxyless run the eager modules by design: per-sample attention, active-op masks) with
hessian modes diag, approx, exact, exact_per_edge, ggn, hutchinson:2; norms layer/instance and order conv-bn-relu (eager
by design, said in an EngineWarning); 5×5 and 1×1 images, 3 steps and 3 layers (reduction after reduction); live tensors
flat over 50-200 steps of each method (the sampled ones fluctuate with the sample, bounded), the plan cache one entry.
Left alone: ggn_mc differs by ~2e-9 relative between the engines, as much as eager vs eager with the input scaled by
1 + 1e-15 (its Rademacher draws multiply eigenvectors of near-degenerate output Hessians: the estimator's conditioning).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

from nasdiag.search.base import Schedule
from nasdiag.search.registry import available_methods
from nasdiag.supernet import Network

DT = torch.float64


def _net(**kw):
    torch.manual_seed(0)
    return Network(4, 3, 2, steps=2, multiplier=2, reductions=[1], **kw).to(DT)


def _same_forward(net, eager, x):
    """net(x) = eager(x) and every buffer after it (running statistics, counts) equal, to 1e-12 in float64."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engine's fallback notes
        out = net(x)
    ref = eager(x)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12), (out - ref).abs().max()
    sd, se = net.state_dict(), eager.state_dict()
    for name in sd:
        assert torch.allclose(sd[name].to(DT), se[name].to(DT), rtol=0, atol=1e-12), name


def test_a_module_swapped_inside_a_candidate_op_after_the_first_forward_is_the_one_computed():
    """A BatchNorm of another eps swapped into an op of a net whose fast plan is built: the fast forward = the eager
    one, and a hook on the new module is called with its input normalized by hand (batch mean, biased variance, its
    own eps); the old plan computed with the old module (2e-3 off) and never called the hook."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 7, 7, generator=g, dtype=DT)
    net = _net()
    net.set_engine("fast")
    net(x)  # builds the plan
    k = net.primitives.index("sep_conv_3x3")
    block = net.cells[0].edges[0].ops[k][0]
    block[3] = nn.BatchNorm2d(block[3].num_features, affine=False, eps=0.5).to(DT)
    eager = _net()
    eager.load_state_dict(net.state_dict())
    eager.cells[0].edges[0].ops[k][0][3].eps = 0.5
    eager.set_engine("eager")
    _same_forward(net, eager, x)  # the new module's running statistics got this forward's update too

    seen = []
    handle = block[3].register_forward_hook(lambda m, inp, o: seen.append((inp[0].detach(), o.detach())))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net(x)
    finally:
        handle.remove()
    assert len(seen) == 1
    y, o = seen[0]
    mean = y.mean((0, 2, 3), keepdim=True)
    var = y.var((0, 2, 3), unbiased=False, keepdim=True)
    assert torch.allclose(o, (y - mean) / torch.sqrt(var + 0.5), rtol=0, atol=1e-12)


def test_a_batchnorm_eps_or_momentum_set_on_some_edges_after_the_first_forward_is_used():
    """eps and momentum set on the BatchNorms of some edges of a net whose fast plan is built: the plan refuses to
    batch edges that differ in them when it is built, but after that each batched call read its first module's values
    for every edge (output 4e-3 off, running statistics 0.7 off); the forward = the eager one, buffers included."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 7, 7, generator=g, dtype=DT)
    net = _net()
    net.set_engine("fast")
    net(x)  # builds the plan
    eager = _net()
    eager.load_state_dict(net.state_dict())
    eager.set_engine("eager")
    sep, pool = net.primitives.index("sep_conv_3x3"), net.primitives.index("max_pool_3x3")
    for n in (net, eager):
        n.cells[0].edges[1].ops[sep][0][3].momentum = 0.7
        n.cells[0].edges[2].ops[sep][0][3].eps = 0.3
        n.cells[0].edges[1].ops[pool][1].momentum = 0.6
    _same_forward(net, eager, x)


@pytest.mark.parametrize("change", ["momentum", "eps", "swap", "hook"])
def test_the_captured_steps_state_key_changes_with_what_the_engine_plan_bakes_in(change):
    """A step captured as a CUDA graph replays the kernels of the plan it was captured with: a BatchNorm's momentum or
    eps set, a module swapped inside an op, a hook put on a cell module (the eager forward then runs, the hook is
    called) must drop the graph, i.e. change the step's state key (the momentum, eps and swap are the two fixes above;
    the key held only optimizer settings, accumulators, modes and two parameter addresses)."""
    cls = available_methods()["darts"]
    net = _net()
    net.set_engine("fast")
    m = cls(net, None, schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=4))
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(4, 3, 7, 7, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g))
    m.step(batch, batch)
    before = m._graph_state_key()
    assert m._graph_state_key() == before
    bn = net.cells[0].edges[1].ops[net.primitives.index("sep_conv_3x3")][0][3]
    handle = None
    if change == "momentum":
        bn.momentum = 0.7
    elif change == "eps":
        bn.eps = 0.3
    elif change == "swap":
        net.cells[0].edges[1].ops[net.primitives.index("sep_conv_3x3")][0][3] = nn.BatchNorm2d(
            bn.num_features, affine=False).to(DT)
    else:
        handle = bn.register_forward_hook(lambda *a: None)
    try:
        assert m._graph_state_key() != before
    finally:
        if handle is not None:
            handle.remove()


def _three_steps(name, engine, mode, H):
    cls = available_methods()[name]
    torch.manual_seed(0)
    net = Network(4, 3, 3, steps=3, multiplier=3, reductions=[1, 2]).to(DT)
    net.set_engine(engine)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, H, H, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)) for _ in range(6)]
    m = cls(net, None, schedule=Schedule(epochs=1, steps_per_epoch=3, batch_size=4), hessian_mode=mode)
    outs = [m.step(data[2 * s], data[2 * s + 1]) for s in range(3)]
    return outs, m.diagnostics(), net.state_dict()


@pytest.mark.parametrize("name,mode", [("darts", "diag"), ("snas", "approx")])
def test_fast_equals_eager_over_three_steps_with_curvature_on_odd_images_and_consecutive_reductions(name, mode):
    """5×5 images through two reduction cells in a row (stride-2 pooling and FactorizedReduce on odd sizes), three
    steps, the mixing-weight curvature of the fast engine's batched recursion: every record = the eager engine's."""
    fast, eager = _three_steps(name, "fast", mode, 5), _three_steps(name, "eager", mode, 5)

    def flat(obj):
        if isinstance(obj, dict):
            return [v for k in sorted(obj) for v in flat(obj[k])]
        if isinstance(obj, (list, tuple)):
            return [v for o in obj for v in flat(o)]
        return [obj] if torch.is_tensor(obj) else []

    a, b = flat(fast), flat(eager)
    assert len(a) == len(b) and any(t.is_floating_point() and t.numel() > 1 for t in a)
    assert any(k.startswith("hessian/") for k in fast[1])
    for s, t in zip(a, b):
        if s.is_floating_point():
            assert torch.allclose(s, t, rtol=0, atol=1e-12, equal_nan=True), (s - t).abs().max()
        else:
            assert torch.equal(s, t)


def test_fifty_fast_steps_keep_the_live_tensors_flat():
    """darts on the fast engine with cost and curvature diagnostics: no tensor kept per step."""
    cls = available_methods()["darts"]
    net = _net()
    net.set_engine("fast")
    m = cls(net, None, schedule=Schedule(epochs=1, steps_per_epoch=60, batch_size=4), hessian_mode="diag")
    g = torch.Generator().manual_seed(1)

    def live():
        gc.collect()
        with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
            warnings.simplefilter("ignore")
            return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    counts = []
    for s in range(50):
        x, y = torch.randn(4, 3, 7, 7, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)
        m.step((x, y), (x, y))
        if s % 10 == 9:
            m.diagnostics()
            counts.append(live())
    assert len(set(counts[1:])) == 1, counts
