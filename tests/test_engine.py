"""The batched-ops engine and the CUDA-graph step runner against the eager per-op modules (CPU, float64).

Reference: the eager path (one module per candidate op, a Python loop over edges), which the rest of the
test suite validates against autograd and the papers' theorems. "Equals" is checked to 1e-10 in float64.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from nasdiag.search.base import Schedule
from nasdiag.search.methods.darts import DARTS
from nasdiag.supernet import Network
from nasdiag.supernet.engine import EngineWarning, why_not_fast
from nasdiag.supernet.engine.graph import GraphWarning, StepGraph

TOL = 1e-10


def _net(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("steps", 3)
    kw.setdefault("multiplier", 3)
    net = Network(4, 5, 3, in_channels=2, alpha_init_scale=1.0, **kw).double()  # cells: normal, reduce, reduce
    return net


def _pair(**kw):
    eager = _net(**kw).set_engine("eager")
    fast = copy.deepcopy(eager).set_engine("fast")
    return eager, fast


def _max_diff(xs, ys):
    return max((a - b).abs().max().item() for a, b in zip(xs, ys))


def _fwd_bwd(net, x, y):
    leaves = [net.softmax_weights()[c.cell_type].detach().clone().requires_grad_(True) for c in net.cells]
    logits = net(x, leaves)
    F.cross_entropy(logits, y).backward()
    return logits.detach(), [z.grad for z in leaves]


@pytest.mark.parametrize("size", [8, 7])  # 7: odd sizes pad FactorizedReduce's shifted branch
def test_fast_forward_backward_equals_eager_float64(size):
    eager, fast = _pair()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 2, size, size, generator=g, dtype=torch.float64), torch.randint(0, 5, (5,), generator=g)
    assert why_not_fast(fast, x, [w for w in fast.softmax_weights().values()]) is None
    for _ in range(2):  # twice: running statistics after one update feed nothing, but must match
        lo_e, c_e = _fwd_bwd(eager, x, y)
        lo_f, c_f = _fwd_bwd(fast, x, y)
    assert (lo_e - lo_f).abs().max() < TOL
    assert _max_diff(c_e, c_f) < TOL  # costs C = dL/dZ of every cell (wiring supplement §2)
    assert _max_diff([p.grad for p in eager.weight_parameters()], [p.grad for p in fast.weight_parameters()]) < TOL
    be, bf = dict(eager.named_buffers()), dict(fast.named_buffers())
    assert be.keys() == bf.keys()
    assert _max_diff(list(be.values()), list(bf.values())) < TOL  # running mean/var and num_batches_tracked


def test_fast_is_taken_and_launches_far_fewer_kernels():
    """The fast path really runs: forward + backward dispatch far fewer non-view ops (≈ kernels)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not getattr(func, "is_view", False) and func.name() not in ("aten::detach", "aten::empty.memory_format"):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    eager, fast = _pair(steps=2, multiplier=2)
    x = torch.randn(3, 2, 8, 8, dtype=torch.float64)

    def ops(net):
        Count.n = 0
        with Count():
            net(x).sum().backward()
        return Count.n

    fast(x)  # the first fast forward also links the BatchNorm statistics to one buffer (once per network)
    assert ops(fast) * 2 < ops(eager)


def test_engine_choice_and_fallbacks_warn_once():
    eager, fast = _pair()
    with pytest.raises(ValueError, match="unknown engine"):
        fast.set_engine("turbo")
    x = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    per_sample = {t: w.unsqueeze(1).expand(-1, 3, -1) for t, w in fast.softmax_weights().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out_f = [fast(x, per_sample) for _ in range(2)]
    msgs = [str(w.message) for w in caught if issubclass(w.category, EngineWarning)]
    assert len(msgs) == 1 and "per sample" in msgs[0]
    out_e = eager(x, per_sample)
    assert (out_f[0] - out_e).abs().max() < TOL
    fast.eval()
    assert "eval mode" in why_not_fast(fast, x, list(fast.softmax_weights().values()))
    fast.train()
    handle = fast.cells[0].edges[0].ops[4].register_forward_hook(lambda *a: None)
    try:
        assert "hooks" in why_not_fast(fast, x, list(fast.softmax_weights().values()))
    finally:
        handle.remove()
    auto = copy.deepcopy(fast).set_engine("auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto: eager where the fast path cannot apply, silently
        auto(x, per_sample)
    # an op module replaced after the plan was built: the plan is rebuilt (here: the engine cannot batch it)
    fast(x)
    for net in (fast, eager):
        net.cells[0].edges[0].ops[4] = torch.nn.Identity()
    assert "differs between edges" in why_not_fast(fast, x, list(fast.softmax_weights().values()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (fast(x) - eager(x)).abs().max() < TOL


def _method(engine, seed=0, **kw):
    net = _net(seed, **kw).set_engine(engine)
    return DARTS(net, schedule=Schedule(epochs=2, steps_per_epoch=4), hessian_mode="approx")


def _batches(sizes, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in sizes:
        out.append(((torch.randn(b, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (b,), generator=g)),
                    (torch.randn(b, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (b,), generator=g))))
    return out


def _state(method):
    net = method.network
    tensors = [p.detach() for p in net.parameters()] + list(net.buffers())
    for opt in (method.w_optimizer, method.alpha_optimizer):
        for st in opt.state.values():
            tensors += [v for v in st.values() if torch.is_tensor(v)]
    return tensors


def test_darts_step_on_both_engines_agrees_float64():
    """One DARTS step (α step + w step) per engine: weights, α, optimizer state, cost statistics and the
    mixing-weight Hessian diagonal (BayesNAS C.3) agree to 1e-10."""
    methods = [_method("eager"), _method("fast")]
    results = []
    for m in methods:
        stats = [m.step(*b) for b in _batches([6, 6])]
        results.append((stats, m.diagnostics()))
    (s_e, d_e), (s_f, d_f) = results
    for a, b in zip(s_e, s_f):
        assert a.keys() == b.keys()
        assert _max_diff(list(a.values()), list(b.values())) < TOL
    assert d_e.keys() == d_f.keys() and any(k.startswith("hessian/") for k in d_e) and any(k.startswith("cost/") for k in d_e)
    for k in d_e:
        assert torch.equal(d_e[k].isnan(), d_f[k].isnan()), k
        assert (d_e[k].double() - d_f[k].double()).nan_to_num().abs().max() < TOL, k
    assert _max_diff(_state(methods[0]), _state(methods[1])) < TOL


class FakeGraphs:
    """Stands in for ``torch.cuda`` at the StepGraph boundary on CPU: capture records the step and its
    static inputs without running it; replay runs it on the static inputs, as a real graph replays its
    kernels on the captured buffers. A stale replay would therefore compute on stale shapes or data."""

    def __init__(self, fail=False):
        self.fail = fail
        self.replayed_shapes = []
        self.released = []

    def eager(self, fn, args):
        return fn(*args)

    def capture(self, fn, args):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return (fn, args), None

    def replay(self, graph, static_out):
        fn, args = graph
        self.replayed_shapes.append(args[0][0].shape[0])
        return fn(*args)

    def release(self, graph):
        self.released.append(graph)


def _graphed(method, backend):
    def prepare():  # like Adam's switch to capturable=True: a setting the captured step bakes in changes
        for group in method.alpha_optimizer.param_groups:
            group["prepared_for_capture"] = True

    return StepGraph(type(method).step.__get__(method), method._graph_state_key, prepare=prepare, backend=backend,
                     name="darts step")


def test_graphed_steps_equal_plain_steps_and_never_replay_a_stale_shape():
    sizes = [6, 6, 6, 6, 4, 6, 4, 4, 4]  # a partial batch mid-run, then a shape that persists
    plain, graphed = _method("fast", steps=2, multiplier=2), _method("fast", steps=2, multiplier=2)
    backend = FakeGraphs()
    runner = _graphed(graphed, backend)
    batches = _batches(sizes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, b in enumerate(batches):
            a, g = plain.step(*b), runner(*b)
            assert _max_diff(list(a.values()), list(g.values())) < TOL, i
            if i == 5:  # the cost statistics are read and reset: the state key changes, the graph is dropped
                da, dg = plain.diagnostics(), graphed.diagnostics()
                assert _max_diff([da[k] for k in da if k.startswith("cost/")], [dg[k] for k in da if k.startswith("cost/")]) < TOL
    assert _max_diff(_state(plain), _state(graphed)) < TOL
    shape_warnings = [w for w in caught if issubclass(w.category, GraphWarning)]
    assert len(shape_warnings) == 1 and "from 6x2x8x8, 6, 6x2x8x8, 6 to 4x2x8x8" in str(shape_warnings[0].message)
    # 6 eager, 6 capture(+replay), 6 6 replay, 4 eager (warned), 6 replay, [reset: key changed] 4 eager,
    # 4 capture(+replay), 4 replay
    assert runner.counts == {"eager": 3, "capture": 2, "replay": 4, "plain": 0}
    assert backend.replayed_shapes == [6, 6, 6, 6, 4, 4]


def test_graph_capture_failure_falls_back_with_one_warning():
    plain, graphed = _method("fast", steps=2, multiplier=2), _method("fast", steps=2, multiplier=2)
    runner = _graphed(graphed, FakeGraphs(fail=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in _batches([5, 5, 5, 5]):
            a, g = plain.step(*b), runner(*b)
            assert _max_diff(list(a.values()), list(g.values())) < TOL
    assert sum(issubclass(w.category, GraphWarning) for w in caught) == 1
    assert runner.counts["capture"] == 0 and runner.disabled_reason.startswith("capture failed")
    assert _max_diff(_state(plain), _state(graphed)) < TOL


def test_darts_step_is_graphed_only_on_cuda_with_the_fast_engine():
    m = _method("fast")
    assert isinstance(m.step, StepGraph)
    m.step(*_batches([4])[0])
    assert m.step.counts["plain"] == 1  # CPU tensors: never captured


def test_released_graphs_are_freed_and_captured_anew():
    """``release()`` (before a process group with captured collectives is destroyed) frees every graph through
    the backend; the next steps run eagerly, capture anew and still equal plain steps."""
    plain, graphed = _method("fast", steps=2, multiplier=2), _method("fast", steps=2, multiplier=2)
    backend = FakeGraphs()
    runner = _graphed(graphed, backend)
    batches = _batches([5] * 5)
    for i, b in enumerate(batches):
        if i == 3:
            runner.release()
            assert len(backend.released) == 1 and not runner._graphs
        a, g = plain.step(*b), runner(*b)
        assert _max_diff(list(a.values()), list(g.values())) < TOL, i
    # eager, capture, replay, [release] eager, capture
    assert runner.counts == {"eager": 2, "capture": 2, "replay": 1, "plain": 0}
    assert _max_diff(_state(plain), _state(graphed)) < TOL



def test_loading_a_state_releases_the_captured_graph():
    """Loading a state replaces the optimizers' state tensors (Adam's moments), which a captured graph would keep
    updating in place: ``load_state_dict`` releases the graph, and the steps after it equal plain steps from
    the same state."""
    import copy

    plain, graphed = _method("fast", steps=2, multiplier=2), _method("fast", steps=2, multiplier=2)
    backend = FakeGraphs()
    graphed.step = _graphed(graphed, backend)
    batches = _batches([5] * 6)
    for i, b in enumerate(batches[:4]):  # eager, capture, replay, replay
        plain.step(*b)
        graphed.step(*b)
        if i == 1:
            state = copy.deepcopy(plain.state_dict())
    plain.load_state_dict(copy.deepcopy(state))
    graphed.load_state_dict(copy.deepcopy(state))
    assert len(backend.released) == 1 and not graphed.step._graphs
    for b in batches[4:]:
        a, g = plain.step(*b), graphed.step(*b)
        assert _max_diff(list(a.values()), list(g.values())) < TOL
    assert graphed.step.counts == {"eager": 2, "capture": 2, "replay": 2, "plain": 0}
    # the loaded (plain) optimizer settings lacked what prepare() sets: it ran again before the new capture
    assert graphed.alpha_optimizer.param_groups[0].get("prepared_for_capture") is True
    assert _max_diff(_state(plain), _state(graphed)) < TOL

# -- BatchNorm running statistics: linked to one buffer, updated in place ------------------------------------

def _edge_norms(net):
    return [m for cell in net.cells for m in cell.edges.modules() if isinstance(m, torch.nn.BatchNorm2d)]


def _train_forward(net, x, y):
    F.cross_entropy(net(x), y).backward()


def _assert_same_buffers(a, b):
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    assert ba.keys() == bb.keys()
    for k in ba:
        assert ba[k].dtype == bb[k].dtype and (ba[k].double() - bb[k].double()).abs().max() < TOL, k


def test_running_statistics_after_fast_steps_equal_eager_steps_and_alias_one_buffer():
    eager, fast = _pair()
    batches = _batches([5, 5, 5])
    for (x, y), _ in batches:
        _train_forward(eager, x, y)
        _train_forward(fast, x, y)
        _assert_same_buffers(eager, fast)
    norms = _edge_norms(fast)
    # the fast path updated the modules' own buffer tensors through one shared memory (no gather/scatter)
    assert len({m.running_var.untyped_storage().data_ptr() for m in norms}) == 1
    assert all(int(m.num_batches_tracked) == 3 for m in norms)
    fast.eval(), eager.eval()  # eval-mode (eager) forwards read the same, aliased buffers
    x = batches[0][0][0]
    assert (fast(x) - eager(x)).abs().max() < TOL


def test_statistics_follow_deepcopy_to_load_state_dict_and_engine_switches():
    """After each way of copying or replacing the buffers, the next fast forward still updates the modules'
    buffers exactly as the eager modules update theirs (and a copy does not touch the original)."""
    eager, fast = _pair()
    (x, y), (x2, y2) = _batches([5])[0]
    _train_forward(eager, x, y), _train_forward(fast, x, y)

    fast_copy, eager_copy = copy.deepcopy(fast), copy.deepcopy(eager)
    before = {k: v.clone() for k, v in fast.named_buffers()}
    _train_forward(fast_copy, x2, y2), _train_forward(eager_copy, x2, y2)
    _assert_same_buffers(eager_copy, fast_copy)
    memory = {m.running_mean.untyped_storage().data_ptr() for m in _edge_norms(fast_copy)}
    assert len(memory) == 1 and memory != {m.running_mean.untyped_storage().data_ptr() for m in _edge_norms(fast)}
    assert all(torch.equal(v, before[k]) for k, v in fast.named_buffers())

    fast.float().double(), eager.float().double()  # new buffer tensors (rounded through float32 alike)
    _train_forward(eager, x2, y2), _train_forward(fast, x2, y2)
    _assert_same_buffers(eager, fast)

    state = copy.deepcopy(eager_copy.state_dict())
    fast.load_state_dict(state), eager.load_state_dict(state)  # copied into the buffers in place
    _train_forward(eager, x, y), _train_forward(fast, x, y)
    _assert_same_buffers(eager, fast)
    fast.load_state_dict(copy.deepcopy(state), assign=True), eager.load_state_dict(copy.deepcopy(state), assign=True)
    _train_forward(eager, x, y), _train_forward(fast, x, y)
    _assert_same_buffers(eager, fast)

    fast.set_engine("eager")  # switching engines mid-run: the eager modules update the aliased buffers
    _train_forward(eager, x2, y2), _train_forward(fast, x2, y2)
    fast.set_engine("fast")
    _train_forward(eager, x, y), _train_forward(fast, x, y)
    _assert_same_buffers(eager, fast)


def test_functional_call_with_buffers_updates_the_passed_buffers_as_eager_does():
    """``functional_call`` with buffers (what the unrolled second-order step runs, on scratch copies) updates
    the buffers passed in, as the eager modules do, and leaves the modules' own statistics alone."""
    eager, fast = _pair()
    (x, y), (x2, y2) = _batches([5])[0]
    _train_forward(eager, x, y), _train_forward(fast, x, y)
    own = {k: v.clone() for k, v in fast.named_buffers()}
    memory = _edge_norms(fast)[0].running_mean.untyped_storage().data_ptr()
    passed = {}
    for net in (eager, fast):
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
        buffers = {n: b.clone() for n, b in net.named_buffers()}
        torch.func.functional_call(net, (params, buffers), (x2,))
        passed[net.engine] = buffers
    for k in passed["eager"]:
        assert (passed["eager"][k].double() - passed["fast"][k].double()).abs().max() < TOL, k
    assert any(not torch.equal(passed["fast"][k], own[k]) for k in own)  # the call did update them
    assert all(torch.equal(v, own[k]) for k, v in fast.named_buffers())
    _train_forward(eager, x2, y2), _train_forward(fast, x2, y2)
    _assert_same_buffers(eager, fast)
    # the stand-ins were not linked: the statistics still live where a CUDA graph captured before would update them
    assert {m.running_mean.untyped_storage().data_ptr() for m in _edge_norms(fast)} == {memory}


def test_linking_keeps_a_pending_graph_usable():
    """An eager forward's graph (BatchNorm saved the buffers) is differentiated after the first fast forward
    re-pointed those buffers: the values are the same, so autograd must not report an in-place change."""
    eager, fast = _pair()
    (x, y), _ = _batches([5])[0]
    losses = []
    for net in (eager, fast):
        net.set_engine("eager")
        first = F.cross_entropy(net(x), y)
        net.set_engine("fast")
        losses.append(first + F.cross_entropy(net(x), y))
    for loss in losses:
        loss.backward()
    assert _max_diff([p.grad for p in eager.weight_parameters()], [p.grad for p in fast.weight_parameters()]) < TOL
    _assert_same_buffers(eager, fast)


def test_linked_fast_forward_neither_scatters_statistics_nor_takes_a_second_statistics_pass():
    """Once linked, BatchNorm updates the modules' statistics in place: a forward+backward dispatches no scatter of
    running statistics (``_foreach_copy_``) and no separate batch-statistics pass for the shared pool BatchNorms
    (``var_mean``); the buffers still equal the eager modules' (checked above and here)."""
    eager, fast = _pair()
    (x, y), (x2, y2) = _batches([5])[0]
    _train_forward(eager, x, y), _train_forward(fast, x, y)
    names = _dispatched(lambda: _train_forward(fast, x2, y2))
    _train_forward(eager, x2, y2)
    assert "aten::native_batch_norm" in names  # the mode saw the forward
    assert not {"aten::_foreach_copy_", "aten::var_mean.correction"} & names, names
    _assert_same_buffers(eager, fast)


def _dispatched(fn) -> set:
    """Names of the aten ops ``fn()`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.name())
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        fn()
    return ops.names


def test_edge_outputs_of_a_stage_are_unbound_not_selected():
    """The backward of the split of a stage's output into its edges stacks their gradients in one op: a select per
    edge would fill a zero tensor of the whole output per edge and sum them (the gradients are checked above)."""
    _, fast = _pair()
    (x, y), _ = _batches([5])[0]
    names = _dispatched(lambda: _train_forward(fast, x, y))
    assert "aten::unbind.int" in names and "aten::select_backward" not in names


def test_a_first_forward_under_inference_mode_leaves_nothing_behind_that_training_cannot_use():
    """Nothing made under inference mode is kept (an inference tensor cannot be saved for backward later)."""
    eager, fast = _pair()
    (x, y), (x2, y2) = _batches([5])[0]
    with torch.inference_mode():
        assert (fast(x) - eager(x)).abs().max() < TOL
    for b in ((x, y), (x2, y2)):
        _train_forward(eager, *b), _train_forward(fast, *b)
    _assert_same_buffers(eager, fast)
    assert len({m.running_mean.untyped_storage().data_ptr() for m in _edge_norms(fast)}) == 1


def test_no_garbage_collection_runs_during_a_capture(monkeypatch):
    """A collection during a CUDA-graph capture can free tensors of other streams, which fails the capture at
    random; the backend disables the collector while capturing and restores it after, also on failure."""
    import contextlib
    import gc

    from nasdiag.cuda_graphs import CudaGraphBackend

    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())

    def step(fail):
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 1

    assert gc.isenabled()
    backend = CudaGraphBackend()
    backend.capture(step, (False,))
    with pytest.raises(RuntimeError):
        backend.capture(step, (True,))
    assert seen == [False, False] and gc.isenabled()
