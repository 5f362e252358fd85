"""A step (a training step, a curvature computation) captured once as a CUDA graph and replayed.

A DARTS step on the reference supernet is thousands of small kernels; launching them from Python costs
more than running them. :class:`StepGraph` captures a step function (forwards, backwards, optimizer
steps, on-device statistics) with ``torch.cuda.graph`` and replays it on static input buffers.

The rules that keep a replay equal to the step it stands for:

- **the batch signature** (shape, dtype, device of every input tensor) selects the graph. A batch of
  another shape (a last partial batch, another image size) never replays a graph captured for a
  different one: it runs eagerly, with a one-line warning the first time, and is captured once the same
  signature comes again;
- **the state key** (``state_key()``: learning rates and other optimizer settings, identities of the
  statistics accumulators, ...) baked into the graph: when it changes every graph is dropped, one step
  runs eagerly (it creates what the step creates lazily) and the next is captured;
- the step function must be *capture-safe*: no host synchronisation, no Python state that changes per
  step (counters), no random numbers, every accumulator updated in place. A capture that fails or that
  changes the state key disables the graph for good, with a one-line warning; steps then run eagerly;
- a replay runs no Python: an attribute the step sets (``python_state``, e.g. a method's reference to the
  batch it took last, which is that graph's static input) keeps what the last *capture* set, which may be
  another graph's. Those named are kept per graph and put back after each of its replays.

Outputs are cloned after each replay, so a caller may keep them across steps.
"""

from __future__ import annotations

import gc

import warnings
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch


class GraphWarning(UserWarning):
    """A step runs without its CUDA graph (shape change, failed capture); the message says why."""


def _flatten(obj: Any, out: List[torch.Tensor]) -> Any:
    """Replace every tensor in nested tuples/lists/dicts by its index in ``out``."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return _Slot(len(out) - 1)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_flatten(o, out) for o in obj)
    if isinstance(obj, dict):
        return {k: _flatten(v, out) for k, v in obj.items()}
    return obj


def _structure_key(obj: Any) -> Hashable:
    """What a call passes besides its tensors' values: the nesting and every non-tensor argument (a graph bakes those
    in, so a call that differs in them must not replay it). Unhashable leaves count by identity."""
    if isinstance(obj, _Slot):
        return ("tensor", obj.index)
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__,) + tuple(_structure_key(o) for o in obj)
    if isinstance(obj, dict):
        return ("dict",) + tuple((k, _structure_key(v)) for k, v in obj.items())
    try:
        hash(obj)
    except TypeError:
        return ("id", id(obj))
    return (type(obj).__name__, obj)


def _fill(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, (tuple, list)):
        return type(obj)(_fill(o, tensors) for o in obj)
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    return obj


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _clone_outputs(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, dict):
        return {k: _clone_outputs(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_clone_outputs(v) for v in out)
    return out


def ambient_state() -> Hashable:
    """What a capture bakes in of torch's ambient state, for a state key: grad mode and, per device type, whether
    autocast is on and to which dtype (a step captured outside ``torch.autocast`` replays its float32 kernels inside
    it, one captured inside replays half-precision kernels outside it)."""
    return (torch.is_grad_enabled(),) + tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                                              for device in ("cuda", "cpu"))


def module_flags(model: torch.nn.Module) -> Hashable:
    """Every module's identity, train/eval mode and normalization settings, for a state key: what decides which
    kernels a capture records and with which constants (a submodule put in eval mode or swapped for another, a
    BatchNorm's tracking switched off, its eps or momentum changed: each a Python number baked into the kernels)."""
    # read from each module's __dict__ (plain attributes): getattr of one a module lacks goes through nn.Module's
    # __getattr__ and its AttributeError, about 2x slower, which a step's key pays on every call
    return tuple((id(m), m.training, d.get("track_running_stats"), d.get("momentum"), d.get("eps"))
                 for m in model.modules() for d in (m.__dict__,))


class CudaGraphBackend:
    """The boundary to ``torch.cuda``: eager steps on a side stream, capture, replay (mocked in CPU tests).

    Args:
        pool: None (each graph gets a private memory pool), or a callable returning the memory pool of a live
            graph to share (``graph.pool()``, see :meth:`StepGraph.pool`) or None. Sharing is safe for graphs
            that are replayed one at a time on one stream and whose outputs are copied before another graph
            replays (:class:`StepGraph` clones them): each graph's temporaries are dead between its replays, so
            another graph may reuse their memory, and the pool holds the largest graph's memory instead of the
            sum. (A pool is shared through a live graph, not a kept ``graph_pool_handle()``: once every graph of a
            handle is freed, capturing into it again trips an assertion of torch's allocator.)
    """

    def __init__(self, pool: Optional[Callable[[], Any]] = None):
        self._side = None
        self._pool = pool

    def eager(self, fn: Callable, args: Any) -> Any:
        # Warm-up and uncaptured steps run on a side stream, as torch.cuda.graph's documentation asks
        # (lazily created handles and autograd's stream bookkeeping then match the capture).
        if self._side is None:
            self._side = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            out = fn(*args)
        current.wait_stream(self._side)
        return out

    def capture(self, fn: Callable, args: Any) -> Tuple[Any, Any]:
        """Record ``fn(*args)`` without running it; returns (graph, static outputs)."""
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection while capturing: a collection that frees CUDA tensors of earlier work (used on
        # other streams) makes the allocator query their events, which a capture forbids; the capture then
        # fails at random, depending on how much garbage the process holds (torch.cuda.graph collects only
        # before it starts).
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=None if self._pool is None else self._pool()):
                out = fn(*args)
        finally:
            if collecting:
                gc.enable()
        return graph, out

    def replay(self, graph: Any, static_out: Any) -> Any:
        graph.replay()
        return static_out

    def pool_of(self, graph: Any) -> Any:
        """The memory pool of a captured graph, for another capture to share."""
        return graph.pool()

    def release(self, graph: Any) -> None:
        """Free a captured graph now (not when the garbage collector gets to it)."""
        torch.cuda.synchronize()
        graph.reset()


class StepGraph:
    """Run ``step(*args)`` as a replayed CUDA graph where it is safe (see the module docstring).

    Args:
        step: the capture-safe step function; its tensor arguments (nested in tuples, lists, dicts)
            become static input buffers.
        state_key: returns a hashable summary of everything the capture bakes in besides the inputs.
        enabled: returns True when this call may use a graph (else the step runs plainly, e.g. on CPU,
            under DDP or with the eager engine).
        prepare: called once before the first capture (e.g. switch Adam to ``capturable=True``).
        backend: :class:`CudaGraphBackend` (default) or a stand-in with the same three methods.
        name: what the warnings call the step.
        python_state: ``(obj, names)``: attributes of ``obj`` the step may set in Python; those its capture set are
            put back after every replay of that graph (with two graphs, e.g. a last partial batch, a replay of the
            first left what the second's capture set: a reference to the other graph's static batch).
    """

    def __init__(self, step: Callable[..., Any], state_key: Callable[[], Hashable], *,
                 enabled: Callable[[Tuple[torch.Tensor, ...]], bool] = lambda tensors: True,
                 prepare: Optional[Callable[[], None]] = None, backend: Any = None, name: str = "step",
                 python_state: Optional[Tuple[Any, Tuple[str, ...]]] = None):
        self.step = step
        self.python_state = python_state
        self.state_key = state_key
        self.enabled = enabled
        self.prepare = prepare
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.name = name
        self.disabled_reason: Optional[str] = None
        self._prepared = False
        self._key: Hashable = None
        # signature -> (graph, static inputs, outputs, the python_state its capture left)
        self._graphs: Dict[tuple, Tuple[Any, List[torch.Tensor], Any, Dict[str, Any]]] = {}
        self._seen: set = set()  # signatures stepped eagerly since the key last changed
        self._last_signature: Optional[tuple] = None
        self._told: set = set()
        #: how the calls ran: {"replay": n, "capture": n, "eager": n, "plain": n}
        self.counts = {"replay": 0, "capture": 0, "eager": 0, "plain": 0}

    def _warn(self, message: str) -> None:
        if message not in self._told:
            self._told.add(message)
            warnings.warn(message, GraphWarning, stacklevel=3)

    def __call__(self, *args: Any) -> Any:
        tensors: List[torch.Tensor] = []
        structure = _flatten(args, tensors)
        if self.disabled_reason is not None or not self.enabled(tuple(tensors)):
            self.counts["plain"] += 1
            return self.step(*args)
        signature = (_structure_key(structure),) + tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)
        key = self.state_key()
        if key != self._key:
            self._graphs.clear()
            self._seen.clear()
            self._key = key
        entry = self._graphs.get(signature)
        if entry is not None:
            graph, static, static_out, kept = entry
            for dst, src in zip(static, tensors):
                dst.copy_(src, non_blocking=True)
            self.counts["replay"] += 1
            self._last_signature = signature
            out = _clone_outputs(self.backend.replay(graph, static_out))
            self._put_back(kept)
            return out
        if signature in self._seen:
            return self._capture_and_run(signature, structure, tensors)
        if self._graphs or (self._last_signature is not None and self._last_signature != signature):
            previous = self._last_signature
            what = (f"batch shapes changed from {_shapes(previous)} to {_shapes(signature)}"
                    if previous is None or previous[0] == signature[0] else "its non-tensor arguments changed")
            self._warn(f"{self.name}: {what}; this step runs without the CUDA graph (captured anew if they come again)")
        self.counts["eager"] += 1
        out = self.backend.eager(self.step, args)
        self._seen.add(signature)
        self._key = self.state_key()  # the eager step may create state (accumulators, optimizer buffers)
        self._last_signature = signature
        return out

    def pool(self) -> Any:
        """The memory pool of one of this step's live graphs (None when it has none, or its backend cannot say),
        for another graph to share (:class:`CudaGraphBackend`'s ``pool``)."""
        pool_of = getattr(self.backend, "pool_of", None)
        for graph, *_ in self._graphs.values():
            return None if pool_of is None else pool_of(graph)
        return None

    def release(self) -> None:
        """Free every captured graph; later calls capture anew, after ``prepare`` runs again (a loaded state
        may have undone what it set, e.g. Adam's ``capturable``). Call it before destroying a process group
        whose collectives were captured: NCCL cannot tear down a communicator that a live graph still uses
        (the destroy hangs)."""
        release = getattr(self.backend, "release", None)
        for graph, *_ in self._graphs.values():
            if release is not None:
                release(graph)
        self._graphs.clear()
        self._seen.clear()
        self._prepared = False

    def _capture_and_run(self, signature: tuple, structure: Any, tensors: List[torch.Tensor]) -> Any:
        if not self._prepared and self.prepare is not None:
            self.prepare()  # may change the state key (e.g. Adam's capturable flag): the graph is keyed after it
            self._prepared = True
        static = [t.detach().clone() for t in tensors]
        static_args = _fill(structure, static)
        key_before = self.state_key()
        python_before = self._python_state_now()
        try:
            graph, static_out = self.backend.capture(self.step, static_args)
        except Exception as exc:  # a host sync, an unsupported op: this step cannot be captured
            self.disabled_reason = f"capture failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            self._warn(f"{self.name}: CUDA-graph {self.disabled_reason}; steps run without the graph from now on")
            self._graphs.clear()
            self.counts["plain"] += 1
            return self.step(*_fill(structure, tensors))
        if self.state_key() != key_before:
            self.disabled_reason = "the step changed its state key while being captured (not capture-safe)"
            self._warn(f"{self.name}: {self.disabled_reason}; steps run without the graph from now on")
            self._graphs.clear()
            raise RuntimeError(f"{self.name}: the captured step changed Python-side state; it was not run. "
                               "Mark the method graph_capturable = False.")
        # only what the step set (a replay of a step that leaves an attribute alone must leave it alone too)
        set_by_step = {name: value for name, value in self._python_state_now().items()
                       if name not in python_before or python_before[name] is not value}
        self._graphs[signature] = (graph, static, static_out, set_by_step)
        self._key = key_before
        self.counts["capture"] += 1
        self._last_signature = signature
        return _clone_outputs(self.backend.replay(graph, static_out))

    def _python_state_now(self) -> Dict[str, Any]:
        if self.python_state is None:
            return {}
        obj, names = self.python_state
        return {name: getattr(obj, name) for name in names if hasattr(obj, name)}

    def _put_back(self, kept: Dict[str, Any]) -> None:
        if kept:
            obj = self.python_state[0]
            for name, value in kept.items():
                setattr(obj, name, value)


def _shapes(signature: Optional[tuple]) -> str:
    if signature is None:
        return "none"
    return ", ".join("x".join(map(str, s[0])) for s in signature[1:])
