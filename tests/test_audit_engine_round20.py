"""Round-20 audit of the fast path (``nasdiag.supernet.engine``, ``nasdiag.cuda_graphs``): the search's batched engine and
its CUDA-graph step must be the eager computation. References: the eager modules of the same network (every op called
one by one), and, for the graphed step, a stand-in of ``torch.cuda`` on the CPU that is faithful to what a replay does
and does not do (its kernels change tensors in place; no Python of the step runs).

Defects found (each test fails without its fix):

* A replayed step runs no Python, so what the step sets on the method in Python stays as the *last capture* left it. The
  cost service (and darts2's step) keep the architecture batch as ``_last_arch_batch``, which ``diagnostics()`` takes
  the Hessian diagonal on ("on the last cost batch"): with two graphs (a user loop whose last batch of an epoch is
  smaller, which StepGraph captures once it comes again) the replays of the full-batch graph left it pointing at the
  partial batch's static buffers, so the recorded ``hessian/<cell>/diag`` was that of an old partial batch, silently
  (CUDA only). StepGraph keeps such attributes per graph and puts them back after each replay
  (test_the_hessian_after_a_replayed_step_is_taken_on_that_steps_batch_with_two_graphs; only what a capture set is
  put back: test_a_replay_puts_back_only_what_its_capture_set).
* A method's step on a network with a hook on any module was captured and replayed: a hook on the classifier or stem
  (outside the cells, which the round-18 key did not cover) or one attached globally ran at the capture only; one on a
  cell module changed the engine's plan key, so the graph was captured anew, with the eager forward, and then replayed
  without calling the hook (a probe attached to the network outside the method, a user's statistics, a hook scaling a
  tensor by a Python value: silently skipped or frozen at the capture's value). A hooked network's step runs plainly,
  as ``nasdiag.hessian.graphed`` already did for a hooked model (test_a_step_of_a_network_with_a_hook_is_never_replayed).
* The state keys of a captured step, of the search's curvature graph and of GraphedDiagHessian did not hold autocast: a
  step captured outside ``torch.autocast`` replayed float32 kernels inside it and one captured inside replayed
  half-precision kernels outside it; ``nasdiag.cuda_graphs.ambient_state`` (grad mode, autocast per device) is part of
  each key (test_a_captured_steps_and_curvatures_state_key_holds_autocast).
* The same for a hook on a parameter's gradient (``register_hook``, ``register_post_accumulate_grad_hook``): the step was
  captured and replayed without calling it; such a step runs plainly
  (test_a_step_with_a_gradient_hook_on_a_parameter_is_never_replayed). And the step's key held the cells' BatchNorm
  settings (through the engine's plan) but not the stem's: its momentum or eps set between steps was replayed with
  the old value; the key holds every module's identity, mode and normalization settings, as the curvature graph's
  (``nasdiag.cuda_graphs.module_flags``) (test_the_captured_steps_state_key_changes_with_the_stems_batchnorm_settings).
* The fast engine recognised candidate ops by structure with ``isinstance(op, nn.Sequential)``: a Sequential subclass
  with a forward of its own (a user's residual around sep_conv's very blocks) or an op whose forward was set on the
  instance was batched as the plain op, silently under the default engine ``auto`` (output 0.5 off). Types are
  matched exactly and a forward set on a module makes the op unbatched: eager, said in an EngineWarning under ``fast``
  (test_an_op_of_a_known_structure_with_a_forward_of_its_own_runs_eager_and_says_so). Likewise the curvature tape ran
  a Sequential preprocessing as its layers, a subclass's forward ignored; it now declines
  (test_a_cell_preprocessing_with_a_forward_of_its_own_leaves_the_curvature_to_the_per_op_modules).
* The same one level up: the batched cells compute ``Cell.forward`` and ``MixedOp.forward``, and a subclass overriding
  either (a partial-channel mixed op, a cell with drop-path) was never called (output 0.15-0.3 off, silently under
  ``auto``); such a network runs eager, said under ``fast``
  (test_a_mixed_op_or_cell_with_a_forward_of_its_own_runs_eager_and_says_so). nasdiag's own AttentionMixedOp
  overrides the forward too, so a network with attention attached now runs eager also when given explicit weights
  (ASM-NAS, its one user, runs eager by design).
* ``_graph_prepare`` switches Adam to ``capturable=True`` before a capture, and the checkpoint of a graphed GPU run
  (the default engine on CUDA) holds the switch: resumed with ``--device cpu`` (a resume may change the device) the
  first α step stopped in Adam's AssertionError that capturable steps need a GPU. ``load_state_dict`` keeps a group
  capturable only where it was before the load (test_a_checkpoint_of_a_graphed_run_resumes_on_the_cpu_as_a_plain_one).

Checked and right (scratch scripts, float64 CPU, fast vs the eager modules of a deep copy): forward, ∂L/∂w, ∂L/∂Z and
every buffer after a forward+backward to 1e-11 for steps 1-3, multiplier 1-2, reductions [0], [0, 1], [2], none,
layers 1-3, op sets {none, skip}, {max pool}, {avg pool, none}, {skip}, {dil 5x5, sep 5x5}, affine norms, norm_eps 0.3,
no classifier bias, batches of 1, 2 and 3, images 1x1 to 7x7, channels_last; the batched curvature recursion (diag,
approx) against arch_diag_hessian on the per-op modules for the same shapes (relative 4e-12 at worst, on 2 samples of
1x1 maps), buffers untouched; top eigenvalues (joint and per type), diag rows and the steps around them of darts, snas
and xnas; a two-epoch search of every method (cost and hessian diagnostics) interrupted mid-epoch 1 under --engine
fast and resumed under --engine eager equals the uninterrupted eager run to 1e-10 (record, every path); every method
under --engine fast warns once per reason where a forward runs eager (asmnas, bayesnas's rule hooks, the active-op
masks of dsnas/proxyless/xnas); torch.compile (aot_eager) of the fast network equals eager.

Left alone: the engine leaves the 'none' column out, so a NaN or inf mixing weight of 'none' alone (eager: NaN·0) and
non-finite activations (eager: C_none NaN) give a finite output / C_none = 0 where eager gives NaN (the Zero op's
documented cost is identically 0; any non-finite activation makes the other columns NaN anyway). An op's forward set on
the instance or a class changed after the plan was built is not seen until the plan is rebuilt. With two captured
graphs the parameters' ``.grad`` attributes point at the last capture's buffers after a replay of the other (the
optimizer inside each graph reads its own; only a caller reading ``.grad`` after the step sees the other graph's). Under
``auto`` on the CPU the eager fallback is silent, as set_engine documents (eager is the reference computation). torch's
optimizers load a state's tensors without copying them: one state_dict() loaded into two methods shares their Adam
moments (torch's behaviour; a checkpoint read from disk is not shared). docs/hessian.md and BENCHMARKS.md say the
batched recursion equals the per-op one "to 1e-14" (relative 1.5e-15 on tests/test_engine_curvature.py's networks; up
to 4e-12 where a BatchNorm normalizes a handful of values): true of the networks named.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from nasdiag.search.base import Schedule
from nasdiag.search.registry import available_methods
from nasdiag.supernet import Network

DT = torch.float64


def _net(**kw):
    torch.manual_seed(0)
    return Network(4, 3, 3, steps=2, multiplier=2, reductions=[1], **kw).to(DT)


def _batch(g, B, H=6):
    return torch.randn(B, 3, H, H, generator=g, dtype=DT), torch.randint(0, 3, (B,), generator=g)


class _ReplayRunsNoPython:
    """``torch.cuda``'s graphs at StepGraph's boundary, on the CPU. A capture runs the step's Python once (recording its
    kernels): here it runs the step, and the replay that StepGraph does right after a capture returns those outputs
    (the capture and its first replay: one step). A later replay runs the recorded kernels on the static inputs and no
    Python: here the step runs on the static inputs, and the method's attributes are put back as they were before it."""

    def __init__(self, method):
        self.method = method

    def eager(self, fn, args):
        return fn(*args)

    def capture(self, fn, args):
        return [fn, args, fn(*args)], None

    def replay(self, graph, static_out):
        fn, args, first = graph
        if first is not None:
            graph[2] = None
            return first
        kept = dict(self.method.__dict__)
        out = fn(*args)
        self.method.__dict__.clear()
        self.method.__dict__.update(kept)
        return out


@pytest.mark.parametrize("name", ["darts", "darts2"])
def test_the_hessian_after_a_replayed_step_is_taken_on_that_steps_batch_with_two_graphs(name):
    """Steps of 4, then of 3 samples (a last partial batch), each signature captured when it comes again, then a
    replay of the 4-sample graph: ``diagnostics()`` takes the mixing-weight Hessian on the last cost batch, which must
    hold that step's search-val batch (it held the 3-sample graph's buffers: the Hessian of an older batch), and equal
    the Hessian of a plain (eager, ungraphed) method stepped on the same batches."""
    cls = available_methods()[name]
    methods = []
    for engine in ("fast", "eager"):
        net = _net().set_engine(engine)
        methods.append(cls(net, None, schedule=Schedule(epochs=1, steps_per_epoch=8, batch_size=4), hessian_mode="diag"))
    graphed, plain = methods
    graphed.step.backend = _ReplayRunsNoPython(graphed)
    graphed.step.enabled = lambda tensors: True
    graphed.step.prepare = None  # Adam's capturable=True, which only CUDA tensors take
    g = torch.Generator().manual_seed(1)
    sizes = [4, 3, 4, 3, 4]  # eager, eager, capture, capture, replay
    batches = [(_batch(g, B), _batch(g, B)) for B in sizes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph's one line on the changed batch shape
        for train, val in batches:
            graphed.step(train, val)
            plain.step(train, val)
    assert graphed.step.counts == {"eager": 2, "capture": 2, "replay": 1, "plain": 0}
    x, y = graphed._last_arch_batch
    last = batches[-1][1]
    assert x.shape == last[0].shape and torch.equal(x, last[0]) and torch.equal(y, last[1]), "a stale batch"
    a, b = graphed.diagnostics(), plain.diagnostics()
    keys = [k for k in b if k.startswith("hessian/") and k.endswith("/diag")]
    assert keys and sorted(a) == sorted(b)
    for k in keys:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-12), k


@pytest.mark.parametrize("where", ["classifier", "cell", "global"])
def test_a_step_of_a_network_with_a_hook_is_never_replayed(where):
    """A replay runs no Python: a hook on a module of the network (a user's statistics, an attached probe's) would be
    called at the capture only, and a hook that scales a tensor by a value read in Python would replay the capture's
    value. A hooked network's step runs plainly (what nasdiag.hessian.graphed does for a hooked model): a hook on the
    classifier (outside the cells) was captured and replayed; one on a cell module made the engine's plan key change,
    the graph was captured anew with the eager forward and then replayed without the hook. Here a hook multiplies the
    logits by a factor read in Python at each call, changed between steps: every step = a plain eager method's with
    the same hook (1e-12, float64), the hook called once per training forward, none captured or replayed (the CPU
    stand-in's replay runs the step's Python, so what is checked is that no step was replayed); once the hook is
    removed the step is captured and replayed again."""
    cls = available_methods()["darts"]
    methods = []
    for engine in ("fast", "eager"):
        net = _net().set_engine(engine)
        methods.append(cls(net, None, schedule=Schedule(epochs=1, steps_per_epoch=8, batch_size=4)))
    graphed, plain = methods
    graphed.step.backend = _ReplayRunsNoPython(graphed)
    graphed.step.enabled = lambda tensors: graphed._graph_applies()  # CPU tensors: the rest of _graph_enabled
    graphed.step.prepare = None
    scale = {"value": 1.0}
    calls = []

    def hook(module, inputs, output):
        calls.append(module)
        return output * scale["value"] if where != "cell" else output

    handles = []
    for m in methods:
        if where == "classifier":
            handles.append(m.network.classifier.register_forward_hook(hook))
        elif where == "cell":
            handles.append(m.network.cells[1].preprocess1[2].register_forward_hook(hook))
    if where == "global":
        handles.append(torch.nn.modules.module.register_module_forward_hook(
            lambda mod, i, o: calls.append(mod) if mod is graphed.network.classifier else None))
    g = torch.Generator().manual_seed(2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s in range(4):
                scale["value"] = 1.0 + 0.5 * s
                train, val = _batch(g, 4), _batch(g, 4)
                before = len(calls)
                a = graphed.step(train, val)
                if where != "global":
                    assert len(calls) - before == 2, (s, len(calls) - before)  # the α step's forward and the w step's
                    b = plain.step(train, val)
                    assert len(calls) - before == 4
                    for k in b:
                        assert torch.allclose(a[k].to(DT), b[k].to(DT), rtol=0, atol=1e-12), (s, k)
                else:
                    assert len(calls) - before == 2, (s, len(calls) - before)
    finally:
        for h in handles:
            h.remove()
    assert graphed.step.counts["replay"] == graphed.step.counts["capture"] == 0, graphed.step.counts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(3):
            graphed.step(_batch(g, 4), _batch(g, 4))
    assert graphed.step.counts["capture"] == 1 and graphed.step.counts["replay"] == 1


def test_a_captured_steps_and_curvatures_state_key_holds_autocast():
    """A capture records the kernels autocast chose: a step (or curvature) captured outside ``torch.autocast`` would
    replay its float32 kernels inside it, and one captured inside replay half-precision kernels outside it. The state
    keys of a method's step and of its curvature graph, and of GraphedDiagHessian, held grad mode (the step) but not
    autocast; each changes with it (checked on the key: a replay stand-in on the CPU re-runs Python under the
    current autocast, so it cannot show the stale kernels)."""
    from nasdiag.hessian.graphed import GraphedDiagHessian

    cls = available_methods()["darts"]
    net = _net().set_engine("fast")
    m = cls(net, None, schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=4), hessian_mode="diag")
    g = torch.Generator().manual_seed(3)
    m.step(_batch(g, 4), _batch(g, 4))
    m.diagnostics()
    weights = GraphedDiagHessian(torch.nn.Sequential(torch.nn.Linear(3, 2)), F.cross_entropy, mode="diag")
    keys = (m._graph_state_key, m._curvature_graph.state_key, weights.graph.state_key)
    outside = [key() for key in keys]
    assert [key() for key in keys] == outside
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            inside = [key() for key in keys]
        assert all(a != b for a, b in zip(inside, outside)), dtype
    assert [key() for key in keys] == outside


def test_a_step_with_a_gradient_hook_on_a_parameter_is_never_replayed():
    """A hook on a weight's gradient (``register_hook``: a user's clipping or logging) runs in the backward's Python,
    which a replay does not run: such a step was captured and replayed. Each step runs plainly while the hook is on
    (called once per step: the w step's backward) and equals a plain eager method with the same hook (float64)."""
    cls = available_methods()["darts"]
    methods = [cls(_net().set_engine(e), None, schedule=Schedule(epochs=1, steps_per_epoch=8, batch_size=4))
               for e in ("fast", "eager")]
    graphed, plain = methods
    graphed.step.backend = _ReplayRunsNoPython(graphed)
    graphed.step.enabled = lambda tensors: graphed._graph_applies()
    graphed.step.prepare = None
    calls, scale = [], {"value": 1.0}
    handles = [m.network.cells[0].preprocess0[1].weight.register_hook(lambda grad: calls.append(1) or grad * scale["value"])
               for m in methods]
    g = torch.Generator().manual_seed(4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s in range(3):
                scale["value"] = 0.5 * (s + 1)
                train, val = _batch(g, 4), _batch(g, 4)
                a = graphed.step(train, val)
                assert len(calls) == 2 * s + 1
                b = plain.step(train, val)
                for k in b:
                    assert torch.allclose(a[k].to(DT), b[k].to(DT), rtol=0, atol=1e-12), (s, k)
    finally:
        for h in handles:
            h.remove()
    assert graphed.step.counts == {"eager": 0, "capture": 0, "replay": 0, "plain": 3}


def test_the_captured_steps_state_key_changes_with_the_stems_batchnorm_settings():
    """The stem's BatchNorm is outside the engine's plan (round 18 keyed the cells' BatchNorms through it): its
    momentum or eps set between steps is a constant of the captured kernels, so the step's state key must change."""
    cls = available_methods()["darts"]
    net = _net().set_engine("fast")
    m = cls(net, None, schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=4))
    g = torch.Generator().manual_seed(5)
    m.step(_batch(g, 4), _batch(g, 4))
    bn = net.stem[1]
    for attr, value in (("momentum", 0.5), ("eps", 1e-3)):
        before = m._graph_state_key()
        setattr(bn, attr, value)
        assert m._graph_state_key() != before, attr


class _Residual(torch.nn.Sequential):
    """A candidate op built of the very blocks of sep_conv_3x3, whose forward adds its input (a user's residual op)."""

    def forward(self, x):
        return x + super().forward(x)


@pytest.mark.parametrize("how", ["subclass", "instance forward"])
def test_an_op_of_a_known_structure_with_a_forward_of_its_own_runs_eager_and_says_so(how):
    """The engine recognised ops by structure with ``isinstance(op, nn.Sequential)``: a Sequential subclass whose
    forward adds a residual around sep_conv's blocks (or a pooling op whose forward was set on the instance) was
    batched as the plain op, silently under the default engine (output 0.5 off here). Such an op is not batched: the
    forward under ``fast`` = the eager modules' (which call the op's own forward), buffers included, with one
    EngineWarning naming the op."""
    from nasdiag.supernet.engine import EngineWarning, why_not_fast

    def built():
        net = _net()
        k = net.primitives.index("sep_conv_3x3" if how == "subclass" else "max_pool_3x3")
        for cell in net.cells:
            for edge in cell.edges:
                if how == "subclass" and edge.stride == 1:
                    edge.ops[k] = _Residual(*edge.ops[k])
                elif how != "subclass":
                    op = edge.ops[k]
                    op.forward = lambda x, op=op: torch.nn.Sequential.forward(op, x) * 0.5
        return net, net.primitives[k]

    (net, name), (eager, _) = built(), built()
    eager.set_engine("eager")
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(6), dtype=DT)
    reason = why_not_fast(net.set_engine("fast"), x, [net.softmax_weights()[c.cell_type] for c in net.cells])
    assert reason is not None and name in reason
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _same_forward(net, eager, x)
    assert [str(w.message).count(name) for w in caught if w.category is EngineWarning] == [1]


def _same_forward(net, eager, x):
    """net(x) = eager(x), and every buffer after it, to 1e-12 in float64."""
    out, ref = net(x), eager(x)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12), (out - ref).abs().max()
    sd, se = net.state_dict(), eager.state_dict()
    for key in sd:
        assert torch.allclose(sd[key].to(DT), se[key].to(DT), rtol=0, atol=1e-12), key


def test_a_cell_preprocessing_with_a_forward_of_its_own_leaves_the_curvature_to_the_per_op_modules():
    """The curvature's tape ran a Sequential preprocessing as its layers one by one: a subclass with a forward of its
    own (here ReLU-conv-BN halved) was computed as the plain layers, so the recursion walked another function than
    the forward. The batched recursion now declines (None: the search then runs it on the per-op modules), as for any
    preprocessing it does not know."""
    from nasdiag.supernet.engine.curvature import mixing_curvature

    class Halved(torch.nn.Sequential):
        def forward(self, x):
            return 0.5 * super().forward(x)

    net = _net().set_engine("fast")
    net.cells[2].preprocess1 = Halved(*net.cells[2].preprocess1)
    x, y = _batch(torch.Generator().manual_seed(7), 4)
    per_cell = [net.softmax_weights()[c.cell_type].detach() for c in net.cells]
    assert mixing_curvature(net, x, y, per_cell, "diag") is None


@pytest.mark.parametrize("what", ["mixed op", "cell"])
def test_a_mixed_op_or_cell_with_a_forward_of_its_own_runs_eager_and_says_so(what):
    """The batched cells compute ``Cell.forward`` and ``MixedOp.forward``; a subclass overriding either (a user's
    partial-channel mixed op, a cell with drop-path: here each output scaled) was never called by the fast engine: its
    forward silently ignored under the default engine (output 0.15 / 0.3 off). Such a network runs eager, said in an
    EngineWarning naming the class under ``fast``; the forward = the eager modules' (which call the overrides)."""
    from nasdiag.supernet.cell import Cell
    from nasdiag.supernet.engine import EngineWarning
    from nasdiag.supernet.mixed import MixedOp

    class HalfMixed(MixedOp):
        def forward(self, x, weights, active=None):
            return 0.5 * super().forward(x, weights, active)

    class DoubledCell(Cell):
        def forward(self, s0, s1, weights, active=None):
            return 2 * super().forward(s0, s1, weights, active)

    def built():
        net = _net()
        for cell in net.cells:
            if what == "cell":
                cell.__class__ = DoubledCell
            else:
                for edge in cell.edges:
                    edge.__class__ = HalfMixed
        return net

    net, eager = built().set_engine("fast"), built().set_engine("eager")
    x = torch.randn(3, 3, 6, 6, generator=torch.Generator().manual_seed(8), dtype=DT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _same_forward(net, eager, x)
    name = "DoubledCell" if what == "cell" else "HalfMixed"
    assert [name in str(w.message) for w in caught if w.category is EngineWarning] == [True]


def test_a_replay_puts_back_only_what_its_capture_set():
    """StepGraph's python_state: a step that sets the attribute gets its capture's value back after each replay; a
    step that leaves it alone leaves alone what was set between its replays (here by the caller)."""
    from nasdiag.cuda_graphs import StepGraph

    class Holder:
        last = None

    holder = Holder()

    def setting(x):
        holder.last = x
        return x * 2

    def leaving(x):
        return x * 3

    runs = {}
    for name, fn in (("setting", setting), ("leaving", leaving)):
        graph = StepGraph(fn, lambda: 0, python_state=(holder, ("last",)), name=name)
        graph.backend = _ReplayRunsNoPython(holder)
        runs[name] = graph
    a, b = torch.zeros(2), torch.zeros(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph's one line on the changed shape
        for t in (a, a, b, b):  # eager, capture, eager (a new shape), capture
            runs["setting"](t)
    runs["setting"](torch.ones(2))  # a replay of the first graph: its static batch, now holding ones
    assert holder.last.shape == (2,) and torch.equal(holder.last, torch.ones(2))
    for t in (a, a):
        runs["leaving"](t)
    holder.last = "set by the caller"
    runs["leaving"](a)
    assert runs["leaving"].counts["replay"] == 1 and holder.last == "set by the caller"


def test_a_checkpoint_of_a_graphed_run_resumes_on_the_cpu_as_a_plain_one():
    """A step captured as a CUDA graph first switches Adam to ``capturable=True`` (its step count on the device), and
    the checkpoint of that run holds the switch: resumed on the CPU (``--device`` may change on a resume) the α step
    stopped in Adam's AssertionError "If capturable=True, params and state_steps must be on supported devices". The
    state of a method prepared for capture (as on the GPU) loads into a fresh CPU method, whose next steps equal those
    resumed from the same point's unprepared state (float64, 1e-12)."""
    cls = available_methods()["darts"]

    def fresh():
        return cls(_net().set_engine("fast"), None, schedule=Schedule(epochs=1, steps_per_epoch=8, batch_size=4))

    g = torch.Generator().manual_seed(9)
    batches = [(_batch(g, 4), _batch(g, 4)) for _ in range(4)]
    m = fresh()
    for train, val in batches[:2]:
        m.step(train, val)
    plain = copy.deepcopy(m.state_dict())  # (torch's optimizers load a state's tensors without copying them)
    m._graph_prepare()  # what the graphed GPU run did before its capture
    prepared = copy.deepcopy(m.state_dict())
    assert prepared["objects"]["alpha_optimizer"]["param_groups"][0]["capturable"] is True
    a, b = fresh(), fresh()
    a.load_state_dict(prepared)
    b.load_state_dict(plain)
    for train, val in batches[2:]:
        sa, sb = a.step(train, val), b.step(train, val)
        for k in sb:
            assert torch.allclose(sa[k].to(DT), sb[k].to(DT), rtol=0, atol=1e-12), k
