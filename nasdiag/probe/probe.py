"""``nasdiag.attach(model) -> Probe``: scoped hooks on a supernet's edges and the statistics built from them."""

from __future__ import annotations

import inspect
import math
import sys
import threading
import warnings
from functools import partial
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from nasdiag.cost import CostMoments, analyse
from nasdiag.cost.assignment import _scatter
from nasdiag.hessian import arch_diag_hessian
from nasdiag.hessian._hvp import leaf_sources, random_state, set_random_state
from nasdiag.hessian.modes import ARCH_MODES, CurvatureError, check_mode
from nasdiag.hooks import Hooks
from nasdiag.probe.capture import Router, StepCapture, first_tensor, tensors_in, data_parallel_refusal
from nasdiag.edges import EdgesArg, EdgeSpec
from nasdiag.probe.discovery import CellInfo, ProbeError, discover, is_mixed_op, weights_parameter as _weights_parameter
from nasdiag.probe.discovery import input_parameter as _input_parameter
from nasdiag.probe.discovery import _candidates, _cell_edge_list, _cell_edge_nodes
from nasdiag.probe.layout import Group, build_groups

STATISTICS_MODES = ("all", "sampled")
#: the normalizations whose eps/(var + eps) ``nasdiag.cost.eps_deviation`` measures
_EPS_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.GroupNorm, nn.LayerNorm)
HESSIAN_MODES = ARCH_MODES  # the curvature modes, spelled once in nasdiag.hessian.modes


def _check_hessian_mode(mode, where: str) -> None:
    """The curvature engine's own check (it names a near miss such as ``"Exact"``, or a count missing from
    ``"hutchinson"``), reported as the probe's error."""
    try:
        check_mode(mode, HESSIAN_MODES)
    except CurvatureError as exc:
        raise ProbeError(f"{where}: {exc}") from None


class _StepResult:
    """The small per-step results kept after a block (no activations, no graph)."""

    __slots__ = ("per_sample", "costs", "matrix", "available", "not_run", "selected", "paths", "node_costs", "deviation", "invariant",
                 "cells_not_tensor", "cells_not_concat",
                 "model_inputs", "rng_state", "targets", "model_output", "output_grad", "first_weights", "ran_kept",
                 "kept_reached", "input_versions", "targets_versions")

    def __init__(self):
        self.per_sample: List[Optional[torch.Tensor]] = []
        self.costs: List[torch.Tensor] = []
        self.matrix: Optional[torch.Tensor] = None  # (N, K) costs when all edges share K and ran once
        self.available: List[bool] = []
        self.not_run: List[Tuple[int, ...]] = []  # per edge: candidate ops that did not run (no cost, not observed)
        self.selected: List[Optional[torch.Tensor]] = []
        self.paths: List[Dict[str, List[torch.Tensor]]] = []
        self.node_costs: List[Optional[torch.Tensor]] = []
        self.deviation: Dict[Tuple[int, int], torch.Tensor] = {}
        #: norm_deviation: the ops scale-invariant in the train/eval mode of the step, (edge, op) -> constant op?
        self.invariant: Dict[Tuple[int, int], bool] = {}
        self.cells_not_tensor: Dict[int, str] = {}  # cells whose forward returned no tensor: the type it returned
        self.cells_not_concat: Dict[int, str] = {}  # DARTS-convention cells whose output is not their nodes' concatenation
        self.model_inputs = None
        self.rng_state = None
        self.targets = None
        self.model_output = None
        self.output_grad = None
        self.first_weights: List[Optional[torch.Tensor]] = []
        self.ran_kept: List[bool] = []  # hessian mode: per edge, whether the kept model call ran it (with grad mode on)
        self.kept_reached = False  # hessian mode: the block's backward reached an edge of the kept model call
        #: hessian mode: the kept call's tensors and those of record(targets=...), with their versions at the block's end
        self.input_versions: List[Tuple[torch.Tensor, int]] = []
        self.targets_versions: List[Tuple[torch.Tensor, int]] = []


def _sum_calls(parts: List[Tuple[int, torch.Tensor]], call_batch: Optional[Mapping[int, int]] = None,
               calls: Sequence[int] = ()) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(per-sample rows or None, summed (K,)) of ``(model forward, (B, K) terms)`` parts.

    Parts of one forward of the model (an edge called twice in it, several backwards through it) are terms of
    the same samples and add up; different forwards (micro-batches accumulated in one block) see different
    samples, so their rows are concatenated in call order. None where the rows of one forward differ in
    shape or the forwards differ in K, or where ``call_batch`` (model forward -> its input's batch size) shows
    that one forward ran its batch through the edge in chunks (calls of fewer samples adding up to it: other
    samples, whose rows must not add up). ``calls``: the forwards with rows at any edge; one this edge has no part of
    (a path dropped in that micro-batch) gets NaN rows, ``call_batch`` of them, so that row b is sample b at every edge
    (None where its batch size is unknown).
    """
    total = sum(t.sum(0) for _, t in parts)
    by_call: Dict[int, List[torch.Tensor]] = {}
    for call, t in parts:
        by_call.setdefault(call, []).append(t)
    rows = []
    for call in sorted(set(by_call) | set(calls)):  # in call order: one backward through several forwards reaches the last first
        batch = (call_batch or {}).get(call)
        ts = by_call.get(call)
        if ts is None:
            if batch is None:
                return None, total
            rows.append(total.new_full((batch, total.shape[-1]), math.nan))
            continue
        if len(ts) > 1 and batch is not None and all(t.dim() and t.shape[0] < batch for t in ts) \
                and sum(t.shape[0] for t in ts) == batch:
            return None, total
        if len({t.shape for t in ts}) != 1:
            return None, total
        rows.append(ts[0] if len(ts) == 1 else sum(ts))
    if len({r.shape[1:] for r in rows}) != 1:
        return None, total
    return (rows[0] if len(rows) == 1 else torch.cat(rows, 0)), total


def _tensor_versions(values) -> List[Tuple[torch.Tensor, int]]:
    """``(tensor, version counter)`` of the tensors among ``values`` (and in their tuples, lists and dicts, at any depth: a
    batch given as ``{"x": x}`` was not looked into): a tensor modified in place later (a static input buffer refilled
    with the next batch) shows a higher version."""
    # an inference tensor has no version counter
    return [(t, t._version) for t in tensors_in(list(values)) if not t.is_inference()]


def _check_flag(option: str, value) -> None:
    # bool("no") is True: a string or number here would switch the option on silently
    if not isinstance(value, (bool, np.bool_)):
        raise ProbeError(f"{option} must be True or False, got {value!r} ({type(value).__name__})")


def _takes_no_weights(module: nn.Module) -> bool:
    """True where ``module``'s forward has no parameter besides its input (no second positional or keyword parameter,
    no ``*args``/``**kwargs``), so no mixing weights can be passed to it; False where the signature cannot be read."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return False
    return len(params) <= 1


def _short_list(names: Sequence[str], n: int = 5) -> str:
    head = ", ".join(repr(x) for x in names[:n])
    return head + (f" and {len(names) - n} more" if len(names) > n else "")


def _compiled_without_hooks(model: nn.Module) -> bool:
    """Whether torch.compile has compiled a forward of ``model`` (or ``module.compile()`` one of its modules) while dynamo
    does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``, torch's default): code compiled
    while the probe's hooks were not in place (a call before or between blocks) runs without them, so no edge is seen."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or not getattr(getattr(dynamo, "config", None), "skip_nnmodule_hook_guards", False):
        return False
    try:
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    except AttributeError:  # a torch without it: the generic warning
        return False
    codes = {}
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            return True
        code = getattr(type(m).forward, "__code__", None)
        if code is not None:
            codes[id(code)] = code
    try:
        return any(entries(code) for code in codes.values())
    except Exception:  # noqa: BLE001 (a private helper: any failure is the generic warning)
        return False


class Probe:
    """Per-edge cost diagnostics of one supernet (wiring supplement §2).

    Build it with :func:`attach`. Use::

        probe = nasdiag.attach(net)
        with probe.record():
            loss = F.cross_entropy(net(x), y)
            loss.backward()
        probe.costs()          # {edge: (K,)} = ∂L/∂Z of the step
        probe.statistics()     # {"cost/<cell type>/mean": (E, K), ...} across steps

    Hooks exist only inside ``record()``; between blocks the model is untouched (``torch.func`` works on
    it) and the probe holds only the small results of the last step plus the running statistics.
    """

    def __init__(self, model: nn.Module, edges: Optional[EdgesArg] = None, *,
                 statistics: str = "all", path_split: bool = False, norm_deviation: bool = False,
                 hessian: Optional[str] = None, loss_fn: Optional[Callable] = None):
        if statistics not in STATISTICS_MODES:
            raise ProbeError(f"statistics must be one of {STATISTICS_MODES}, got {statistics!r}")
        for option, value in (("path_split", path_split), ("norm_deviation", norm_deviation)):
            _check_flag(option, value)
        if hessian is not None:
            _check_hessian_mode(hessian, "attach(hessian=...)")
        if loss_fn is not None and not callable(loss_fn):
            raise ProbeError("loss_fn must be callable as loss_fn(outputs, targets) -> scalar")
        if loss_fn is not None and hessian is None:
            raise ProbeError(f"loss_fn is only used by probe.hessian(); pass hessian=<mode> too (one of {HESSIAN_MODES})")
        if isinstance(model, nn.DataParallel) and len(model.device_ids) > 1:
            raise ProbeError(data_parallel_refusal(f"the model is nn.DataParallel over {len(model.device_ids)} devices"))
        self.model = model
        infos, cells = discover(model, edges)
        self._edges: Tuple[EdgeSpec, ...] = tuple(infos)
        self._cells: Tuple[CellInfo, ...] = tuple(cells)
        self._index = {e.name: p for p, e in enumerate(self._edges)}
        self.statistics_mode = statistics
        if statistics == "sampled":
            blind = [e.name for e in self._edges if not e.weights_arg]
            if blind:
                raise ProbeError(
                    f"statistics='sampled' needs each edge's mixing weights, passed as the second argument of its forward "
                    f"(x, weights); the forward of edge(s) {_short_list(blind)} does not take two positional arguments. "
                    "Use statistics='all'."
                )
        if hessian is not None:
            # the curvature engines shift the weights the forward receives: a forward(x) that computes them inside (NNI's
            # LayerChoice, NASLib's edge reading its own α) took the step and failed in probe.hessian() with a hint to
            # list mixed ops, which the caller had done
            closed = [e.name for e in self._edges if _takes_no_weights(e.module)]
            if closed:
                raise ProbeError(
                    f"hessian={hessian!r} takes the curvature in the mixing weights each edge's forward receives, as its "
                    f"second argument (x, weights), but the forward of edge(s) {_short_list(closed)} takes x alone (it "
                    "computes its weights inside, e.g. a softmax of an α it holds); give the mixed op a forward(x, weights) "
                    "and pass the weights from the model's forward, or attach without hessian= (costs are right without it)"
                )
        self.path_split = bool(path_split)
        if self.path_split:
            unplaced = [e.name for e in self._edges if e.src is None or e.cell_index is None]
            if unplaced:
                raise ProbeError(
                    f"path_split=True needs every edge's cell and node pair (i, j); unknown for {_short_list(unplaced)}. "
                    "Declare them with the node protocol (docs/probe.md) or leave path_split off."
                )
            owners: Dict[int, List[str]] = {}  # mixed op -> the cells it is an edge of
            for cell in self._cells:
                seq = list(_cell_edge_list(cell.module) or ())
                for m in dict.fromkeys(seq):
                    owners.setdefault(id(m), []).append(cell.name)
                twice = next((m for m in seq if sum(x is m for x in seq) > 1), None)
                if twice is not None:
                    # discovery gives such a module the node pair of its first position: the calls at its other
                    # positions read and feed other nodes, so their parts would go to the wrong edges
                    at = [e for e, x in enumerate(seq) if x is twice]
                    raise ProbeError(
                        f"path_split=True: one mixed-op module is at positions {at} of the edges of cell {cell.name!r} (one "
                        "module for several node pairs, e.g. tied weights within the cell), so its calls cannot be told "
                        "apart by node pair; give each position its own mixed op (candidate op modules may be shared) "
                        "or leave path_split off (costs() add up its calls)"
                    )
            tied = next((e for e in self._edges if len(owners.get(id(e.module), ())) > 1), None)
            if tied is not None:
                # its calls in the other cells ran outside the cell it is placed in: refused in the first backward as a
                # forward outside its cell's (checkpointing), the wrong reason
                raise ProbeError(
                    f"path_split=True: the mixed op of edge {tied.name!r} is an edge of cells {owners[id(tied.module)]} "
                    "(one module tied across cells), so its calls cannot be told apart by cell and node pair; give each "
                    "cell its own mixed op (candidate op modules may be shared) or leave path_split off (costs() add up "
                    "its calls)"
                )
        self.norm_deviation = bool(norm_deviation)
        self.hessian_mode = hessian
        self.loss_fn = loss_fn
        self._incoming: Dict[Tuple[int, int], List[int]] = {}
        for p, e in enumerate(self._edges):
            if e.cell_index is not None and e.dst is not None:
                self._incoming.setdefault((e.cell_index, e.dst), []).append(p)
        slots: Dict[int, List[Tuple[int, int]]] = {}
        self._candidate_modules: Dict[int, nn.Module] = {}
        for p, e in enumerate(self._edges):
            for k, op in enumerate(e.ops):
                slots.setdefault(id(op), []).append((p, k))
                self._candidate_modules[id(op)] = op
        self._candidate_slots = slots
        # every edge's output is checked once to be Σ_k w_k·op_k(x): against its weights where the forward receives
        # them, else to lie in the span of its candidates' outputs (a module that is not a mixed op)
        self._convention_unchecked = [True] * len(self._edges)
        self._nodes_unchecked = [self.path_split] * len(self._edges)  # path split: ∂L/∂(edge output) = gradient at j?
        # DARTS-convention cells: is the output the nodes' concatenation? Checkable where every edge ending at an output
        # node is an edge of the probe (a node summing an unmapped module's output is no sum of the probe's edges)
        self._concat_unchecked = [self._nodes_are_edge_sums(cell) for cell in self._cells]
        self._weights_presumed = [e.weights_arg and not is_mixed_op(e.module) for e in self._edges]
        # a candidate list the caller gave (not the mixed op's own) may be in another order than the weights, which
        # equal weights (a zero-initialised α) cannot tell: its check waits for a step whose weights differ
        self._order_given = [tuple(e.ops) != tuple(_candidates(e.module) or ()) for e in self._edges]
        self._weights_names = [_weights_parameter(e.module) for e in self._edges]
        self._input_names = [_input_parameter(e.module) for e in self._edges]  # x_i passed by keyword
        # where each discovered edge sits in the model: a mixed op or candidate replaced or removed after attach is
        # told apart from one that did not run (the planned hooks are on the modules seen at attach)
        modules = dict(model.named_modules())
        self._placed = [modules.get(e.name) is e.module for e in self._edges]
        self._groups: Tuple[Group, ...] = tuple(build_groups(self._edges))
        self._moments: Dict[str, CostMoments] = {}
        self._last: Optional[_StepResult] = None
        self._norm_cache: Dict[bool, Dict[Tuple[int, int], nn.Module]] = {}
        self._invariant_cache: Dict[bool, Dict[Tuple[int, int], bool]] = {}  # per mode: (edge, op) -> constant op?
        self._step_mode = False  # train/eval mode of the model when the current block began
        self._router = Router()
        self._plans: Dict[Optional[bool], Hooks] = {}
        if self.norm_deviation:
            self._invariance_norms()  # fails here, not in the first step, on an op without rules
        self._index_cache: Dict[Tuple[str, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}
        self._recording = False
        self._recording_thread: Optional[int] = None  # the thread whose block is open
        self._steps = 0
        self._any_step = False  # a block has completed since attach (reset_statistics keeps it)

    # -- structure ---------------------------------------------------------------------------
    @property
    def edges(self) -> Tuple[EdgeSpec, ...]:
        """Every edge, in discovery order (``named_modules()`` order, or the order of the ``edges`` map)."""
        return self._edges

    @property
    def edge_names(self) -> List[str]:
        return [e.name for e in self._edges]

    @property
    def cells(self) -> Tuple[CellInfo, ...]:
        """Cells that declare their nodes (see docs/probe.md, "node protocol")."""
        return self._cells

    @property
    def groups(self) -> Tuple[Group, ...]:
        """How edges are laid out in :meth:`statistics` (cell types, or the documented fallbacks)."""
        return self._groups

    @property
    def steps_recorded(self) -> int:
        """Completed ``record()`` blocks since attach or :meth:`reset_statistics`."""
        return self._steps

    # -- recording -------------------------------------------------------------------------------
    def record(self, targets=None) -> "Recording":
        """Capture one step: ``with probe.record(): out = model(x); loss.backward()``.

        Hooks are registered on entry and removed on every exit path (also when the body raises); the
        backward must run inside the block. ``targets`` are kept for :meth:`hessian` only.
        Several forwards or backwards in one block add up, as ``.grad`` does; a ``torch.autograd.grad`` pass that
        reaches the edges counts too (.grad does not see it: docs/probe.md, "Recording a step"). Forwards run with grad mode off
        (``torch.no_grad()``, ``torch.inference_mode()``, e.g. a validation pass) are left alone: no cost exists there.
        The returned block may be entered again, one step per ``with``; entering it returns the probe.
        """
        return Recording(self, targets)

    def _begin(self, block: "Recording") -> "Probe":
        if self._recording:
            if self._recording_thread != threading.get_ident():
                raise ProbeError(
                    "another thread is inside a probe.record() block of this probe: a probe records one step at a time; "
                    "give each thread its own model and its own nasdiag.attach"
                )
            raise ProbeError("probe.record() blocks cannot be nested")
        self._last = None  # a failed block leaves no stale step behind
        self._step_mode = self.model.training
        plan = self._hook_plan()
        cap = StepCapture(self._edges, self._cells, path_split=self.path_split,
                          check_convention=self._convention_unchecked, incoming=self._incoming,
                          hooks=plan, track_selected=self.statistics_mode == "sampled",
                          weights_names=self._weights_names, input_names=self._input_names,
                          keep_model_io=self.hessian_mode is not None,
                          weights_presumed=self._weights_presumed, check_nodes=self._nodes_unchecked,
                          order_given=self._order_given, check_concat=self._concat_unchecked)
        self._router.capture = cap
        self._recording = True
        self._recording_thread = threading.get_ident()
        try:
            plan.install()
        except BaseException:
            self._finish(cap)
            raise
        block.capture, block.plan = cap, plan
        return self

    def _end(self, block: "Recording", completed: bool) -> None:
        cap, plan = block.capture, block.plan
        block.capture = block.plan = None
        try:
            try:
                if completed:
                    cap.finish()
                result = self._collect(cap) if completed else None  # a body that raised records nothing
            finally:
                plan.remove()
        finally:
            self._finish(cap)
        if result is None:
            return
        result.targets = block.targets
        if self.hessian_mode is not None:  # as the block leaves them (a forward may modify its input in place)
            if result.model_inputs is not None:
                result.input_versions = _tensor_versions((*result.model_inputs[0], *result.model_inputs[1].values()))
            result.targets_versions = _tensor_versions((block.targets,))
        if self.norm_deviation:  # which ops were invariant is a property of the step's mode, not of the mode when read
            # the mode of the model forwards the backward reached (a validation pass in the block is not the step)
            modes = {cap.call_modes.get(call, self._step_mode) for parts in cap.per_sample for call, _ in parts}
            ran = (not self._step_mode) if modes and self._step_mode not in modes else self._step_mode
            if ran == self._step_mode:
                result.invariant = self._invariant_cache[self._step_mode]
            else:
                # the normalizations measured were chosen for the mode the block began in: none of the step's own
                result.deviation = {}
                if ran not in self._invariant_cache and self.model.training == ran:
                    self._invariance_norms()  # the model is in the step's mode now: which of its ops are invariant
                result.invariant = self._invariant_cache.get(ran, {})
                names = ("eval", "train")
                warnings.warn(
                    f"probe: the model ran in {names[ran]} mode inside this probe.record() block but was in "
                    f"{names[self._step_mode]} mode when the block began, so invariance_deviation() of this step is NaN "
                    f"(the normalizations to measure are chosen when the block begins); call model.{names[ran]}() "
                    "before the block", RuntimeWarning, stacklevel=3)
        self._convention_unchecked = cap.check_convention
        self._nodes_unchecked = cap.check_nodes
        self._concat_unchecked = cap.check_concat
        self._last = result
        self._steps += 1
        self._any_step = True
        self._update_statistics(result)

    def _finish(self, cap: StepCapture) -> None:
        self._router.capture = None
        cap.release()
        self._recording = False

    def _hook_plan(self) -> Hooks:
        """The forward hooks of a step, built once (per train/eval mode when norms are tracked)."""
        key = self.model.training if self.norm_deviation else None
        if key in self._plans:
            return self._plans[key]
        r, plan = self._router, Hooks()
        for p, e in enumerate(self._edges):
            plan.forward_pre(e.module, partial(r.edge_pre, p), with_kwargs=True)
            plan.forward(e.module, partial(r.edge_post, p))
        for oid, slots in self._candidate_slots.items():
            plan.forward(self._candidate_modules[oid], partial(r.candidate_post, slots))
        for c, cell in enumerate(self._cells):
            plan.forward_pre(cell.module, partial(r.cell_pre, c))
            plan.forward(cell.module, partial(r.cell_post, c))
        if self.norm_deviation:
            for (p, k), norm in self._invariance_norms().items():
                plan.forward_pre(norm, partial(r.norm_pre, (p, k)))
        # counts the model's forwards (per-sample rows of different forwards are kept apart; a call reading what the
        # last one computed, a sub-module applied twice, is the same forward) and, for hessian(), keeps the first
        # one's batch and logits
        plan.forward_pre(self.model, r.model_pre, with_kwargs=True)
        plan.forward(self.model, r.model_post)
        self._plans[key] = plan
        return plan

    def _nodes_are_edge_sums(self, cell: CellInfo) -> bool:
        if cell.output_node_slices is not None:
            return False  # declared slices are taken as given
        seq = list(_cell_edge_list(cell.module) or ())
        pairs = _cell_edge_nodes(cell.module, len(seq)) or []
        ours = {id(e.module) for e in self._edges}
        return bool(pairs) and all(id(m) in ours for m, (_, j) in zip(seq, pairs) if j in cell.output_nodes)

    def _invariance_norms(self) -> Dict[Tuple[int, int], nn.Module]:
        """(edge, op) -> the normalization that makes the op scale-invariant; cached per train/eval mode."""
        key = self.model.training
        if key not in self._norm_cache:
            norms, invariant = {}, {}
            for p, e in enumerate(self._edges):
                for k, op in enumerate(e.ops):
                    h = analyse(op)
                    norm = h.invariant_by
                    if h.invariant:
                        # a constant op (Zero, bare or last in a Sequential): J = 0 exactly
                        invariant[(p, k)] = norm is not None and not hasattr(norm, "eps")
                    # a candidate op that is itself a normalization (a bare BatchNorm2d or LayerNorm op) is measured too;
                    # a module of the user's own degree-0 rule (nn.RMSNorm) has no eps/(var + eps) here: NaN, as bare
                    if isinstance(norm, _EPS_NORMS):
                        norms[(p, k)] = norm
            self._norm_cache[key] = norms
            self._invariant_cache[key] = invariant
        return self._norm_cache[key]

    def _collect(self, cap: StepCapture) -> _StepResult:
        r = _StepResult()
        no_forward, no_grad, partial_ops = [], [], []
        parts = cap.per_sample
        r.available = [bool(pp) for pp in parts]
        n_rows = None
        if all(len(pp) == 1 for pp in parts) and len({pp[0][1].shape for pp in parts}) == 1 \
                and len({pp[0][0] for pp in parts}) == 1:
            # the common case: one call per edge, same forward, batch and K: two kernels for all edges
            stacked = torch.stack([pp[0][1] for pp in parts])  # (N, B, K)
            r.per_sample = list(stacked.unbind(0))
            r.matrix = stacked.sum(1)
            r.costs = list(r.matrix.unbind(0))
        else:
            calls = sorted({call for pp in parts for call, _ in pp})  # the forwards the backward reached
            batches = [(cap.call_batch or {}).get(call) for call in calls]
            # an edge with no rows at all (forward never ran, backward never reached it) gets a NaN row per sample of
            # those forwards, as one missing from some of them does: (B, K), row b sample b at every edge
            n_rows = sum(batches) if batches and None not in batches else None
            for pp in parts:
                ps, total = _sum_calls(pp, cap.call_batch, calls) if pp else (None, None)
                r.per_sample.append(ps)
                r.costs.append(total)
            absent = [e.name for e, pp in zip(self._edges, parts) if pp and len({c for c, _ in pp}) < len(calls)]
            if absent:
                warnings.warn(
                    f"probe: {len(absent)} edge(s) ({_short_list(absent)}) took no part in some of the block's "
                    f"{len(calls)} model forwards (e.g. a path dropped in a micro-batch): their per-sample rows of those "
                    "forwards' samples are NaN; costs() sums the forwards they took part in", RuntimeWarning, stacklevel=4)
        no_grad_path: List[str] = []
        grad_off: List[str] = []
        bypassed: List[str] = []
        for p, e in enumerate(self._edges):
            if not r.available[p]:
                if cap.n_forward[p] == 0 and cap.n_grad_off[p]:
                    grad_off.append(e.name)
                elif cap.n_forward[p] == 0 and p in cap.ops_outside:
                    bypassed.append(e.name)
                elif cap.n_forward[p] == 0:
                    no_forward.append(e.name)
                elif cap.n_without_grad[p] == cap.n_forward[p]:
                    no_grad_path.append(e.name)
                else:
                    no_grad.append(e.name)
            r.not_run.append(tuple(sorted(cap.missing_ops[p])))
            if cap.missing_ops[p]:
                partial_ops.append(f"{e.name} ops {sorted(cap.missing_ops[p])}")
        ref = next((t for t in r.costs if t is not None), None)
        if ref is None:  # no edge observed: NaN in the dtype and device of the parameters
            ref = next(self.model.parameters(), torch.empty(0)).detach()
            ref = ref if ref.is_floating_point() else ref.float()
        r.costs = [t if t is not None else ref.new_full((e.n_ops,), math.nan) for t, e in zip(r.costs, self._edges)]
        if n_rows is not None:
            r.per_sample = [ref.new_full((n_rows, e.n_ops), math.nan) if not r.available[p] else ps
                            for p, (ps, e) in enumerate(zip(r.per_sample, self._edges))]
        r.selected = cap.selected
        r.paths = cap.paths
        for c in range(len(self._cells)):
            nodes = cap.node_costs[c]
            r.node_costs.append(_sum_calls(nodes)[0] if nodes else None)
        r.deviation = cap.deviation
        r.cells_not_tensor = cap.cells_not_tensor
        r.cells_not_concat = cap.cells_not_concat
        r.model_inputs, r.rng_state = cap.model_inputs, cap.rng_state
        r.first_weights = cap.first_weights
        r.ran_kept, r.kept_reached = cap.ran_kept, cap.kept_reached
        r.model_output, r.output_grad = cap.model_output, cap.output_grad
        if no_forward or partial_ops or cap.k_changed:
            self._check_unchanged([p for p in range(len(self._edges))
                                   if cap.missing_ops[p] or not cap.n_forward[p] or p in cap.k_changed])
        if cap.k_changed and self.statistics_mode == "sampled":
            p, k = next(iter(cap.k_changed.items()))
            raise ProbeError(
                f"edge {self._edges[p].name!r}: statistics='sampled' reads which ops had weight != 0, but its forward got "
                f"{k} mixing weights for its {self._edges[p].n_ops} candidate ops; pass one weight per candidate op")
        if no_forward and _compiled_without_hooks(self.model):
            warnings.warn(
                f"probe: the forward of {len(no_forward)} edge(s) ({_short_list(no_forward)}) ran no hook of the probe "
                "inside probe.record(): the model runs code torch.compile made while they were not in place (a compiled call "
                "before the block or between blocks), and dynamo "
                "does not guard on module hooks (torch._dynamo.config.skip_nnmodule_hook_guards = True, torch's default), "
                "so that code runs without them; their costs are NaN for this step and they are left out of the "
                "statistics. Set torch._dynamo.config.skip_nnmodule_hook_guards = False before the model's first "
                "compiled call (after torch._dynamo.reset() if it ran).", RuntimeWarning, stacklevel=4)
        elif no_forward:
            warnings.warn(
                f"probe: the forward of {len(no_forward)} edge(s) never ran inside probe.record() "
                f"({_short_list(no_forward)}); their costs are NaN for this step and they are left out of the statistics. "
                "Run the model's forward inside the block.", RuntimeWarning, stacklevel=4)
        if bypassed:
            warnings.warn(
                f"probe: the candidate ops of {len(bypassed)} edge(s) ({_short_list(bypassed)}) ran inside "
                "probe.record() but their mixed op module was never called: a method called on it directly (GDAS's "
                "op.forward_gdas(x, weights, index), op.forward(x, weights)) runs no module hooks, so the probe sees no "
                "x_i, weights or edge output; their costs are NaN for this step and they are left out of the statistics. "
                "Call the module itself (op(x, weights), with a forward that does what the method does).",
                RuntimeWarning, stacklevel=4)
        if grad_off:
            warnings.warn(
                f"probe: the backward never reached {len(grad_off)} edge(s) ({_short_list(grad_off)}): their forward ran "
                "only with grad mode off (inside torch.no_grad() or torch.inference_mode()), so there is no gradient and no "
                "cost; their costs are NaN for this step and they are left out of the statistics. Run the forward you "
                "want costs of with grad mode on inside probe.record().", RuntimeWarning, stacklevel=4)
        if no_grad:
            warnings.warn(
                f"probe: the backward never reached {len(no_grad)} edge(s) ({_short_list(no_grad)}); their costs are NaN "
                "for this step and they are left out of the statistics. Call loss.backward() inside probe.record(), "
                "with a loss that depends on these edges and grad mode on.", RuntimeWarning, stacklevel=4)
        if no_grad_path:
            warnings.warn(
                f"probe: the output of {len(no_grad_path)} edge(s) ({_short_list(no_grad_path)}) did not require grad "
                "(neither its input, its mixing weights nor its candidate ops carry a gradient), so the backward never "
                "computes ∂L/∂x_j there; their costs are NaN for this step and they are left out of the statistics. "
                "Pass mixing weights that require grad (e.g. Z.requires_grad_()) to observe them.",
                RuntimeWarning, stacklevel=4)
        if cap.modified_cells:
            names = [self._cells[c].name for c in sorted(cap.modified_cells)]
            warnings.warn(
                f"probe: the output of cell(s) {_short_list(names)} was modified in place after the cell's forward, so "
                "their output costs <∂L/∂out, out> are NaN for this step (edge costs are unaffected); use out-of-place "
                "ops on cell outputs (e.g. ReLU(inplace=False), out = out * s).", RuntimeWarning, stacklevel=4)
        if partial_ops:
            warnings.warn(
                f"probe: some candidate ops did not run in their mixed op's forward ({_short_list(partial_ops)}); "
                "their costs are NaN (not observed): C_k = <∂L/∂x_j, O_k(x_i)> needs O_k(x_i). Run every candidate op "
                "to cost them all (a one-hot Z may multiply all of them), or attach(..., statistics='sampled') to "
                "keep statistics of the ops that ran.", RuntimeWarning, stacklevel=4)
        return r

    def _check_unchanged(self, suspects: Sequence[int]) -> None:
        """Raise if the mixed op or a candidate op of an edge in ``suspects`` (some op or the whole edge unobserved, or
        weights of another length than its K) was replaced, added or removed since attach: its hooks are on the
        modules seen at attach, so the new one is not observed, which is not an op that did not run."""
        modules = dict(self.model.named_modules()) if any(self._placed[p] for p in suspects) else {}
        for p in suspects:
            e = self._edges[p]
            if self._placed[p] and modules.get(e.name) is not e.module:
                what = f"the mixed op of edge {e.name!r} was replaced or removed"
            elif not self._order_given[p] and (_candidates(e.module) or ()) != tuple(e.ops):
                what = f"the candidate ops of edge {e.name!r} were replaced, added or removed"
            else:
                continue
            raise ProbeError(f"the model changed since nasdiag.attach: {what}; attach again after changing the supernet")

    # -- results of the last step ---------------------------------------------------------------
    def _require_step(self) -> _StepResult:
        if self._last is None and self._recording:
            raise ProbeError(
                "the step being recorded is complete only when its `with probe.record():` block ends (the costs are "
                "collected then); read costs(), output_costs() and the other results after the block"
            )
        if self._last is None:
            raise ProbeError(
                "no completed recorded step: run `with probe.record(): loss = ...; loss.backward()` first "
                "(a block whose body raised records nothing)"
            )
        return self._last

    def costs(self, per_sample: bool = False) -> Dict[str, torch.Tensor]:
        """Cost of every candidate op of every edge at the last step: C_k = ∂L/∂Z_k = <∂L/∂x_j, O_k(x_i)>
        (wiring supplement §2.1), whatever the weights Z were (softmax, one-hot sample, linear).

        Returns:
            ``{edge name: (K,)}``; with ``per_sample``, ``{edge name: (B, K)}``. Dtype and device of the
            model's activations. Batch convention: the per-sample terms <∂L/∂x_j[b], O_k(x_i)[b]> **sum** to the
            (K,) costs, so with a mean loss each carries the loss's normaliser (1/B). With per-sample weights Z of
            shape (B, K), the (B, K) terms are exactly ∂L/∂Z_bk; row b is sample b's own loss gradient only where
            nothing couples the samples (not under train-mode BatchNorm). A loss term on Z or α themselves (a
            regularizer) is not part of the cost: it does not reach x_j. Several calls of an edge in one forward
            of the model (weight tying) and several backwards through it add up per sample; the rows of different
            forwards of the model in one block (micro-batches) are concatenated in call order, so B is then the
            total over those forwards. The model is the attached module: a call of it that reads what its previous
            call computed (a sub-module applied at two depths) is the same forward.
            NaN (with a warning at the end of the block) where the edge's forward never ran,
            the backward never reached it, or a candidate op did not run; per sample such an edge has NaN rows
            for every sample of the block's forwards (one NaN row where no edge was reached).
        """
        _check_flag("per_sample", per_sample)
        r = self._require_step()
        self._flag_nan(r)
        if not per_sample:
            return {e.name: r.costs[p] for p, e in enumerate(self._edges)}
        out = {}
        for p, e in enumerate(self._edges):
            ps = r.per_sample[p]
            if ps is None and r.available[p]:
                raise ProbeError(f"edge {e.name!r} ran with different batch sizes, or on chunks of the model's batch, in one "
                                 "forward of the model; per-sample costs are undefined (costs() still sums them): run "
                                 "chunks as separate model calls, whose rows are concatenated")
            out[e.name] = ps if ps is not None else r.costs[p].new_full((1, e.n_ops), math.nan)
        return out

    def _flag_nan(self, r: _StepResult) -> None:
        if r.matrix is not None:  # one synchronisation for all edges
            nan = ~torch.isfinite(r.matrix)  # an inf cost (∂L/∂Z past the dtype's range) is flagged as a NaN one
            if any(r.not_run):  # an op that did not run is NaN by design (flagged at the end of the block)
                nan = nan.cpu()
                for p, ks in enumerate(r.not_run):
                    nan[p, list(ks)] = False
            has_nan = nan.any(1).tolist()
        else:
            has_nan = [bool((~torch.isfinite(c)).index_fill(0, torch.tensor(ks, dtype=torch.long, device=c.device), 0).any())
                       if ks else not bool(torch.isfinite(c).all()) for c, ks in zip(r.costs, r.not_run)]
        bad = [e.name for p, e in enumerate(self._edges) if r.available[p] and has_nan[p]]
        if bad:
            warnings.warn(f"probe: NaN cost at edge(s) {_short_list(bad)} (e.g. a NaN loss; or an inf one: ∂L/∂Z past the "
                          "range of its dtype); it is recorded as it is in the statistics too", RuntimeWarning, stacklevel=3)

    def cell_type_costs(self) -> Dict[str, torch.Tensor]:
        """Costs of the last step summed over the cells of each group, ``{group: (E, K)}``: for α shared by
        a cell type this is the cost of the shared Z, so ``darts_alpha_grad(cell_type_costs()[t], softmax(α_t))``
        is ∂L/∂α_t (§2.1 summed over the cells). NaN where an edge was not observed."""
        r = self._require_step()
        return self.aggregate({e.name: r.costs[p] for p, e in enumerate(self._edges)})

    def output_costs(self, per_sample: bool = False) -> Dict[str, Dict[int, torch.Tensor]]:
        """Output-edge costs of the last step, per cell and output node n:
        <∂L/∂(node n's slice of the cell output), x_n> (wiring supplement §5–6).

        Summed over a cell's nodes this is 0 for a cell followed only by scale-invariant ops (Cor. 1.2,
        as eps → 0) and L − H for the last cell before GAP and a bias-free classifier (Thm. 2).

        Returns:
            ``{cell name: {node: 0-dim tensor}}`` (``per_sample``: (B,) tensors summing to those).
        Raises:
            ProbeError: the model has no cells declaring their nodes (docs/probe.md, "node protocol").
        """
        _check_flag("per_sample", per_sample)
        r = self._require_step()
        if not self._cells:
            raise ProbeError(
                "output_costs() needs cells that declare their nodes: output_node_slices {node: (start, stop)} on the "
                "cell module, or the DARTS convention (_ops, _steps, _multiplier); see docs/probe.md"
            )
        out, unreached, not_tensor, not_concat = {}, [], [], []
        for c, cell in enumerate(self._cells):
            ps = r.node_costs[c]
            if ps is None:
                (not_tensor if c in r.cells_not_tensor else not_concat if c in r.cells_not_concat else unreached).append(cell.name)
                ps = r.costs[0].new_full((1, len(cell.output_nodes)), math.nan)
            vals = ps if per_sample else ps.sum(0)
            out[cell.name] = {n: vals[..., i] for i, n in enumerate(cell.output_nodes)}
        if unreached:
            warnings.warn(f"probe: no gradient reached the output of cell(s) {_short_list(unreached)}; their output "
                          "costs are NaN", RuntimeWarning, stacklevel=2)
        if not_tensor:
            kinds = sorted({r.cells_not_tensor[c] for c, cell in enumerate(self._cells) if cell.name in not_tensor})
            warnings.warn(f"probe: the forward of cell(s) {_short_list(not_tensor)} returned {', '.join(kinds)}, not the "
                          "tensor of its concatenated output nodes, so their output costs are NaN (edge costs are "
                          "unaffected); return the cell output tensor from the cell's forward", RuntimeWarning, stacklevel=2)
        if not_concat:
            why = "; ".join(f"{cell.name!r} {r.cells_not_concat[c]}" for c, cell in enumerate(self._cells) if cell.name in not_concat)
            warnings.warn(f"probe: the output of DARTS-convention cell(s) {_short_list(not_concat)} is not the concatenation "
                          f"of their last _multiplier nodes in equal chunks ({why}; e.g. a sum of the nodes, or a 1x1 convolution "
                          "of their concatenation), so there is no "
                          "slice per node and their output costs are NaN (edge costs are unaffected); declare "
                          "output_node_slices on the cell for a concatenation in another layout", RuntimeWarning, stacklevel=2)
        return out

    def path_costs(self, per_sample: bool = False) -> Dict[str, Dict[str, torch.Tensor]]:
        """Split of each edge's cost by the path its gradient took from the edge's end node j:
        ``"output"`` (through node j's slice of the cell output) and, for each edge e leaving j, e's name
        (through e: <J_eᵀ ∂L/∂x_m, O_k(x_i)>). Needs ``attach(..., path_split=True)``.

        For a declared cell the parts sum to :meth:`costs` (no other consumer of a node exists). Thm. 1: the
        part through an edge whose active candidate ops are all scale-invariant is 0 as eps → 0, summed
        over everything entering node j with its weights (exactly per op only when that op's output is the
        whole of x_j, e.g. DSNAS with the other incoming edges sampled to ``none``); see docs/probe.md.

        Returns:
            ``{edge name: {path: (K,)}}``; ``per_sample``: (B, K) parts. ``"output"`` is a path only for edges
            ending at an output node; an edge whose end node feeds neither the output nor another edge maps to ``{}``.
        """
        _check_flag("per_sample", per_sample)
        if not self.path_split:
            raise ProbeError("path_costs() needs attach(model, ..., path_split=True) (it hooks the autograd nodes of every intermediate edge)")
        r = self._require_step()
        out = {}
        for p, e in enumerate(self._edges):
            parts = {}
            for path, vals in r.paths[p].items():
                ps, total = _sum_calls(vals)
                parts[path] = ps if per_sample else total
            out[e.name] = parts
        return out

    # -- scale invariance (Thm. 1, §8.1-8.2) ------------------------------------------------------
    def scale_invariant_ops(self) -> Dict[str, torch.Tensor]:
        """``{edge: (K,) bool}``: candidate ops f with f(c·x) = f(x) for c > 0, decided from module structure
        by the rules of ``nasdiag.cost.HOMOGENEITY_RULES`` in the model's current train/eval mode. Such an op
        passes back no cost (Thm. 1), exactly only as the norm eps → 0 (see :meth:`invariance_deviation`). The ranks
        of the ops' inputs are not used: where the answer depends on them it is the one that holds at every rank (an
        op ``Linear(bias) → BatchNorm1d``, invariant on 2-D inputs only, is False); ``nasdiag.cost.is_scale_invariant(op,
        x_i)`` decides it with an example input.

        Raises:
            nasdiag.cost.UnsupportedModuleError: an op contains a module without a rule (the message says how to register one).
        """
        return {e.name: torch.tensor([analyse(op).invariant for op in e.ops]) for e in self._edges}

    def invariance_deviation(self) -> Dict[str, Dict[str, float]]:
        """Relative deviation from exact invariance at the real eps, measured at the last step:
        ``{edge: {op name: max over groups of eps/(var + eps)}}`` of the normalization that makes the op
        invariant (``nasdiag.cost.eps_deviation``), for every op scale-invariant in the train/eval mode the step
        ran in (whatever the mode is when this is read, e.g. after a validation pass in eval mode); 0.0 for
        ``Zero`` ops (and ops ending in one); NaN where that module is not a BatchNorm, InstanceNorm, GroupNorm or
        LayerNorm (a module of your own degree-0 rule). Needs ``attach(..., norm_deviation=True)`` (one variance per normalization input)."""
        if not self.norm_deviation:
            raise ProbeError("invariance_deviation() needs attach(model, ..., norm_deviation=True)")
        r = self._require_step()
        out = {}
        for p, e in enumerate(self._edges):
            row = {}
            for k, op in enumerate(e.ops):
                if (p, k) not in r.invariant:
                    continue
                if r.invariant[(p, k)]:
                    row[e.op_names[k]] = 0.0  # constant op: J = 0 exactly
                elif (p, k) in r.deviation:
                    row[e.op_names[k]] = float(r.deviation[(p, k)])
                else:
                    row[e.op_names[k]] = math.nan
            out[e.name] = row
        return out

    # -- curvature of the mixing weights (bayesnas-appendix C.3.1–C.3.2) ---------------------------
    def hessian(self, wrt: str = "Z", *, inputs=None, targets=None, mode: Optional[str] = None) -> Dict[str, torch.Tensor]:
        """Diagonal of ∂²L/∂Z² of every edge's mixing weights at the last recorded batch (bayesnas-appendix
        C.3.1–C.3.2 for ``"diag"``/``"approx"``, Hessian-vector products for ``"exact"``), by
        ``nasdiag.hessian.arch_diag_hessian`` in the mode given to ``attach(..., hessian=mode)``.

        The batch is the one the block's first model call saw (its positional and keyword arguments, kept
        for this step only) with the targets given to ``probe.record(targets=y)``; the loss is
        ``attach(..., loss_fn=...)`` (default: mean cross-entropy). With the default loss and no targets
        given, the class labels are recovered from the block's backward: for L = CE(z, y) averaged (or summed)
        over the batch, ∂L/∂z = (softmax(z) − onehot(y)) / B (or without the 1/B), so onehot(y) =
        softmax(z) − B·∂L/∂z; the recovery is checked to give one-hot rows, else an error asks for targets. The model is re-run outside the block
        with BatchNorm in its current mode and its current parameters (call it before ``optimizer.step()`` for the
        curvature of the recorded step; a re-run whose mixing weights differ from the step's is refused); its running
        statistics are restored, and it draws the random numbers the recorded call drew (its dropout masks) with
        the caller's generators left as they were. Autocast is the caller's, not the step's: outside ``torch.autocast``
        the re-run is in the parameters' dtype (after a bfloat16 autocast step, the curvature of the float32 model; a
        forward that made Z in bfloat16 there is a `ProbeError` naming both dtypes), inside it the autocast forward's.
        A `DistributedDataParallel` wrapper is re-run as the module it wraps
        (the curvature of this rank's batch, no collective: one rank may call it alone).

        Args:
            wrt: ``"Z"``, or ``"alpha"`` for the chain rule through Z = softmax(α) per edge (needs
                probability-vector weights). Edges whose weights come from one shared α: ``"exact"`` refuses them
                (one line naming ``nasdiag.hessian.alpha_diag_hessian``, the exact shared-α diagonal), the other
                modes give per-edge numbers without the cross-cell terms. Weights computed before the model call
                (``net(x, softmax(α))``) lose their graph in the block's backward: they are re-run as values, each
                edge's own softmax, and ``"exact"`` (which reads shared α from that graph) is then one line.
            inputs, targets: override the captured batch (``inputs`` a tensor or a tuple of positional args).
            mode: one of ``nasdiag.hessian.ARCH_MODES`` for this call (default: ``attach(..., hessian=mode)``).
                Where no sample interacts (eval-mode BatchNorm, no normalization) ``"ggn"`` equals ``"exact"`` and
                ``"ggn_mc"`` tracks it; under train-mode BatchNorm no cheap mode does (docs/hessian.md, "Choosing a
                mode", gives the accuracy and cost of each).

        Returns:
            ``{edge name: (K,)}``, dtype of the loss, batch convention of ``loss_fn`` (mean: of the batch mean).
        """
        mode = self.hessian_mode if mode is None else mode
        if mode is None:
            raise ProbeError(
                "hessian() needs attach(model, ..., hessian='diag' | 'approx' | 'ggn_mc' | ...) or hessian(mode=...); "
                f"modes: {', '.join(HESSIAN_MODES)}"
            )
        _check_hessian_mode(mode, "probe.hessian(mode=...)")
        if self._recording:
            raise ProbeError("call probe.hessian() after the probe.record() block, not inside it")
        r = self._require_step() if inputs is None or targets is None else self._last
        partial = [(e.name, r.not_run[p]) for p, e in enumerate(self._edges) if r.not_run[p]] if r is not None else []
        if partial:
            # the re-run forward would compute the same ops: a Z_k whose op O_k did not run enters the forward at most as
            # a bare term (GDAS adds w_k = 0), so its "curvature" would not be that of Σ_k Z_k O_k(x) (silently 0 or junk)
            name, ops = partial[0]
            more = f" (and {len(partial) - 1} more edge(s))" if len(partial) > 1 else ""
            raise ProbeError(
                f"hessian(): candidate op(s) {list(ops)} of edge {name!r}{more} did not run in the recorded step (only "
                "the sampled op computed, as in GDAS or ProxylessNAS), so ∂²L/∂Z_k² of x_j = Σ_k Z_k O_k(x_i) cannot be "
                "computed for them; run every candidate op in the forward (a one-hot Z may multiply all of them) to get "
                "the curvature"
            )
        if inputs is not None and r is not None and r.model_inputs is not None:
            _check_like_recorded(inputs, r.model_inputs[0])
        # a DistributedDataParallel wrapper's forward is a collective (rank 0's buffers broadcast, when the module has
        # any): a hessian() of one rank alone waited for the others, or paired with their next step's forward
        model, device = _local_module(self.model)
        rerun = inputs is None and r is not None  # the recorded call is re-run: it must see the recorded weights
        if rerun and r.model_inputs is not None and not r.kept_reached and any(r.available):
            # the costs are of a later forward (the training batch); this one (a validation forward run with grad mode
            # on) was never backwarded: its re-run would give the curvature of another batch, with these targets
            raise ProbeError(
                "hessian(): the block's first model call with grad mode on, whose batch hessian() re-runs, was not "
                "reached by the block's backward (e.g. a validation forward without torch.no_grad() before the training "
                "forward), so it is not the batch of the costs; run evaluation forwards under torch.no_grad(), or pass "
                "hessian(inputs=x, targets=y)"
            )
        recorded = (r.input_versions if inputs is None else []) + (r.targets_versions if targets is None else []) \
            if r is not None else []
        if any(t._version != v for t, v in recorded):
            raise ProbeError(
                "hessian(): the recorded batch (the model call's inputs or the targets given to probe.record) was modified "
                "in place since the block (e.g. a static input buffer refilled with the next batch), so its re-run would "
                "be another batch; call probe.hessian() before refilling it, or pass hessian(inputs=x, targets=y)"
            )
        if inputs is None:
            if r.model_inputs is None and self.hessian_mode is None:
                # hessian(mode=...) on a probe attached without hessian=: the block kept no batch (it was told the model
                # was not called in the block)
                raise ProbeError(f"hessian(mode={mode!r}): the recorded batch is kept only by a probe attached with "
                                 "attach(model, ..., hessian=<mode>); attach it so, or pass hessian(inputs=x, targets=y)")
            if r.model_inputs is None:
                raise ProbeError("the model was not called inside the last probe.record() block (call it as model(x): "
                                 "model.forward(x) runs no hooks); pass inputs=")
            args, kwargs = r.model_inputs
            if wrt == "alpha":
                args, kwargs = _without_freed_graphs(args, kwargs, mode)
            inputs = args[0] if len(args) == 1 else tuple(args)
            if kwargs:
                model = _BoundKeywords(model, _to_device(kwargs, device))
        inputs = _to_device(inputs, device)  # as the wrapper moves them
        if targets is None:
            targets = r.targets if r is not None else None
            if targets is None and self.loss_fn is None and r is not None:
                targets = _cross_entropy_targets(r.model_output, r.output_grad)
            if targets is None:
                grad = r.output_grad if r is not None else None
                # a NaN loss (a NaN in the batch) leaves a NaN ∂L/∂logits: no labels to read, whatever the loss was
                why = ("the block's ∂L/∂(model output) holds NaN/inf (a NaN/inf loss), so they cannot be read from it; the "
                       "curvature of that batch is NaN" if isinstance(grad, torch.Tensor) and grad.is_floating_point()
                       and not bool(torch.isfinite(grad).all()) else
                       "they are inferred only when the block's loss is the default mean or summed cross-entropy of the "
                       "model's output")
                raise ProbeError(
                    f"hessian() needs the targets of the batch: use probe.record(targets=y) or hessian(targets=y) ({why})"
                )
        # the default loss pairs the targets with the rows of the model's output: the recorded call's logits where it is
        # re-run (a time-major input (T, B, ...), as a recurrent cell search takes, holds its batch in dim 1), else dim 0
        # of the first input tensor (of a dict or tuple batch too)
        first = r.model_output if rerun and isinstance(r.model_output, torch.Tensor) else first_tensor(inputs)
        if (self.loss_fn is None and isinstance(targets, torch.Tensor) and isinstance(first, torch.Tensor)
                and targets.dim() >= 1 and first.dim() >= 1 and targets.shape[0] != first.shape[0]):
            raise ProbeError(
                f"hessian(): the targets hold {targets.shape[0]} labels but the batch has {first.shape[0]} samples; "
                "pass the targets of the same batch (probe.record(targets=y) or hessian(inputs=x, targets=y))"
            )
        loss_fn = self.loss_fn or torch.nn.functional.cross_entropy
        if not rerun:
            return arch_diag_hessian(model, loss_fn, inputs, targets, self._edges, mode=mode, wrt=wrt)
        # an edge the recorded call did not run (a path dropped at this step, progressive shrinking) has no curvature
        # there: NaN, as its cost, and the curvature of the edges that ran (the engine refuses an edge that never runs)
        ran = [e for p, e in enumerate(self._edges) if r.ran_kept[p]]
        if not ran:
            raise ProbeError("hessian(): no edge ran (with grad mode on) in the recorded model call, so there is no "
                             "mixing-weight curvature to compute; record a step whose forward runs the edges")
        caller = random_state()
        # re-running the recorded call: it must mix with the recorded Z and draw the recorded forward's dropout masks
        set_random_state(r.rng_state)
        try:
            with self._same_weights_as_recorded(r):
                out = arch_diag_hessian(model, loss_fn, inputs, targets, ran, mode=mode, wrt=wrt)
        finally:
            set_random_state(caller)
        if len(ran) == len(self._edges):
            return out
        skipped = [e.name for p, e in enumerate(self._edges) if not r.ran_kept[p]]
        warnings.warn(f"probe.hessian(): the recorded model call did not run {len(skipped)} edge(s) "
                      f"({_short_list(skipped)}); their curvature is NaN for this step", RuntimeWarning, stacklevel=2)
        like = next(iter(out.values()))
        return {e.name: out[e.name] if r.ran_kept[p] else like.new_full((e.n_ops,), math.nan)
                for p, e in enumerate(self._edges)}

    def _same_weights_as_recorded(self, r: _StepResult) -> Hooks:
        """Hooks refusing a re-run forward whose mixing weights differ from the recorded step's (a forward that draws
        its Z, as GDAS's or SNAS's Gumbel samples, would give the curvature at another sample, silently)."""
        plan = Hooks()
        for p, e in enumerate(self._edges):
            if p < len(r.first_weights) and r.first_weights[p] is not None:
                plan.forward_pre(e.module, partial(self._compare_weights, p, r.first_weights[p]), with_kwargs=True)
        return plan

    def _compare_weights(self, p: int, recorded: torch.Tensor, module, args, kwargs):
        w = args[1] if len(args) > 1 else kwargs.get(self._weights_names[p])
        if not isinstance(w, torch.Tensor) or w.shape != recorded.shape:
            return None
        try:
            same = torch.equal(w.detach(), recorded)
        except RuntimeError:  # inside a torch.func transform the values cannot be read; the plain passes are checked
            return None
        if not same and w.dtype != recorded.dtype:
            # a step under torch.autocast whose forward computed Z in bfloat16 (a matmul before the softmax), re-run
            # outside it in float32: not "α changed", which the line below would say
            now, then = (str(t).replace("torch.", "") for t in (w.dtype, recorded.dtype))
            raise ProbeError(
                f"hessian(): edge {self._edges[p].name!r} got {now} mixing weights when the recorded batch was re-run, "
                f"where the recorded step's forward computed them in {then} (the step ran under torch.autocast and "
                "hessian() does not, or the model's dtype changed since the block); call probe.hessian() inside the step's "
                "torch.autocast(...) for the curvature of that forward, or pass hessian(inputs=x, targets=y) for the "
                "curvature of the model in its own dtype"
            )
        if not same:
            raise ProbeError(
                f"hessian(): edge {self._edges[p].name!r} got other mixing weights when the recorded batch was re-run "
                "than in the recorded step: α changed since the block (an optimizer step: call probe.hessian() before "
                "optimizer.step()), or the forward draws its Z (a Gumbel sample as in GDAS or SNAS: make the draw "
                "repeatable by reseeding its generator before each forward, or pass the weights as an argument and call "
                "hessian(inputs=..., targets=...))"
            )
        return None

    def aggregate(self, per_edge: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Lay any ``{edge: (K,)}`` result out per group and sum over the cells of the group, ``{group: (E, K)}``
        (e.g. ``{"hessian/<t>/diag": v}`` for the recorder); NaN in a slot no cell has an edge for. An edge without a value,
        or a value that is not a tensor of that edge's (K,) shape (per-sample (B, K) rows), is a `ProbeError`."""
        missing = [e.name for e in self._edges if e.name not in per_edge]
        if missing:
            raise ProbeError(f"aggregate() needs a value for every edge; missing {_short_list(missing)}")
        for e in self._edges:  # a (B, K) per-sample result or another K was a torch unpacking error, or an (E, K') array
            v = per_edge[e.name]
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != (e.n_ops,):
                got = f"shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
                raise ProbeError(
                    f"aggregate() takes one (K,) tensor per edge, e.g. costs() or hessian(); edge {e.name!r} has "
                    f"K = {e.n_ops} candidate ops, got {got} (per-sample rows: sum them over dim 0 first)"
                )
        out = {}
        for g in self._groups:
            rows = torch.stack([per_edge[self._edges[p].name] for p in g.members])
            obs = self._layout(g, rows)[0]
            if len(g.members) == g.n_cells * g.n_edges:
                out[g.name] = obs.sum(0)
                continue
            # Cells of a type may lack some edge index (fewer nodes): their NaN slots are not edges, so they add
            # nothing to the shared α's row (§2.1 sums over the cells that use it); a row no cell has stays NaN.
            exists = self._layout(g, torch.ones_like(rows))[0] == 1
            summed = torch.where(exists, obs, torch.zeros_like(obs)).sum(0)
            out[g.name] = torch.where(exists.any(0), summed, torch.full_like(summed, math.nan))
        return out

    # -- statistics across steps -----------------------------------------------------------------
    def _layout(self, g: Group, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (g.name, rows.device)
        if key not in self._index_cache:  # device copies of the layout, made once (no copy per step)
            self._index_cache[key] = (g.cell_slot.to(rows.device), g.edge_index.to(rows.device))
        slot, eidx = self._index_cache[key]
        obs = _scatter(rows, slot, eidx, g.n_cells, g.n_edges)  # layout checked in discovery; no host sync per step
        return obs, ~torch.isnan(obs)

    def _update_statistics(self, r: _StepResult) -> None:
        # No host-device synchronisation here: masks stay on the device, NaN is flagged when read.
        for g in self._groups:
            rows = torch.stack([r.costs[p] for p in g.members]).to(torch.float64)
            avail = None
            if not all(r.available[p] for p in g.members):
                avail = torch.tensor([r.available[p] for p in g.members]).to(rows.device).unsqueeze(1).expand_as(rows)
            if any(r.not_run[p] for p in g.members):
                # an op that did not run has no cost at this step (NaN in costs()): not an observation, as for an
                # edge whose forward never ran; a NaN *value* (e.g. a NaN loss) is still recorded
                ran = torch.ones(rows.shape, dtype=torch.bool)
                at = [(row, k) for row, p in enumerate(g.members) for k in r.not_run[p]]
                ran[[row for row, _ in at], [k for _, k in at]] = False
                ran = ran.to(rows.device)
                avail = ran if avail is None else avail & ran
            if self.statistics_mode == "sampled":
                none = torch.zeros(g.n_ops, dtype=torch.bool, device=rows.device)
                sel = torch.stack([none if r.selected[p] is None else r.selected[p].to(rows.device) for p in g.members])
                avail = sel if avail is None else avail & sel
            obs, present = self._layout(g, rows)
            if avail is None:
                # cells of a type may lack some edge index: those entries are NaN in the layout, not observed
                mask = None if len(g.members) == g.n_cells * g.n_edges else self._layout(g, torch.ones_like(rows))[0] == 1
            else:
                mask = self._layout(g, avail.to(rows.dtype))[0] == 1  # NaN (no such edge) compares False
            if g.name not in self._moments:
                self._moments[g.name] = CostMoments((g.n_edges, g.n_ops), device=rows.device)
            self._moments[g.name].update(obs, mask)

    def statistics(self) -> Dict[str, np.ndarray]:
        """Streaming cost statistics in the recorder's schema, a flat ``{dataset path: numpy array}``:
        ``"cost/<group>/mean"`` E[C] and ``"cost/<group>/var"`` E[C²] − E[C]² (float64),
        ``"cost/<group>/count"`` (int64), each (E, K).

        Groups are cell types when every edge has one and the edges of each type share K (the cells of a type
        are separate observations of the same (E, K) entry, so ``count`` = steps × cells), else ``"edges"``
        (n_edges, K), else one group per edge (docs/probe.md). With ``statistics="sampled"``, an entry is observed only when its mixing weight
        was non-zero, so under one-hot sampling ``count`` is the per-op sample count and ``mean`` is E[C | sampled].
        Entries never observed are NaN with count 0 (after :meth:`reset_statistics`: all of them).

        Raises:
            ProbeError: no ``record()`` block has completed since ``attach``.
        """
        if not self._any_step:
            raise ProbeError("no completed recorded step yet: statistics() needs one `with probe.record(): "
                             "loss = ...; loss.backward()` block first")
        out, nan_groups = {}, []
        for g in self._groups:
            m = self._moments.get(g.name) or CostMoments((g.n_edges, g.n_ops))
            if not bool(torch.isfinite(m.mean).all()):  # an inf cost: the mean ±inf, the variance NaN; flagged as a NaN
                nan_groups.append(g.name)
            out[f"cost/{g.name}/mean"] = torch.where(m.count > 0, m.mean, torch.full_like(m.mean, math.nan)).cpu().numpy()
            out[f"cost/{g.name}/var"] = m.var.cpu().numpy()
            out[f"cost/{g.name}/count"] = m.count.cpu().numpy().astype(np.int64)
        if nan_groups:
            warnings.warn(f"probe: the cost statistics of {_short_list(nan_groups)} hold NaN/inf (a NaN or inf cost was observed)",
                          RuntimeWarning, stacklevel=2)
        return out

    def moments(self) -> Dict[str, CostMoments]:
        """The live accumulators behind :meth:`statistics` (e.g. to ``merge`` across DDP ranks)."""
        return dict(self._moments)

    def reset_statistics(self) -> None:
        """Forget the streaming statistics (the last step's results stay readable)."""
        self._moments.clear()
        self._steps = 0

    def __repr__(self) -> str:
        return (f"Probe({len(self._edges)} edges, {len(self._cells)} cells, groups={[g.name for g in self._groups]}, "
                f"statistics={self.statistics_mode!r}, path_split={self.path_split}, hessian={self.hessian_mode!r})")


def _check_like_recorded(inputs, recorded_args) -> None:
    """``hessian(inputs=...)`` must look like the recorded call's positional arguments but for the batch size: a
    tensor of another shape fails deep inside the curvature engine's forward with torch's traceback."""
    given = inputs if isinstance(inputs, tuple) else (inputs,)
    for i, (a, b) in enumerate(zip(given, recorded_args)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 1 and b.dim() >= 1 \
                and (a.dim() != b.dim() or a.shape[1:] != b.shape[1:]):
            raise ProbeError(
                f"hessian(inputs=...): argument {i} has shape {tuple(a.shape)} but the recorded model call had "
                f"{tuple(b.shape)}; pass inputs shaped like the recorded batch (the batch size may differ)"
            )


def _graph_freed(t: torch.Tensor) -> bool:
    """Whether a backward has freed the graph that computed ``t`` from its leaves (its saved tensors are gone)."""
    leaves = leaf_sources(t) if t.grad_fn is not None else []
    if not leaves:
        return False
    try:
        torch.autograd.grad(t, leaves, grad_outputs=torch.ones_like(t), retain_graph=True, allow_unused=True)
    except RuntimeError as err:
        if "freed" in str(err):
            return True
        raise
    return False


def _without_freed_graphs(args, kwargs, mode: str):
    """The recorded call's arguments for ``hessian(wrt="alpha")``, those whose graph the block's backward freed as
    values: weights computed before the model call (``net(x, softmax(α))``) keep a graph that can no longer be
    differentiated, which the chain rule's softmax check stopped in (torch's "backward through the graph a second
    time"); as values they are weights without a graph, taken as softmax(α) of each edge's own α. ``exact`` reads from
    that graph whether edges share one α (which it refuses): without it, one line."""
    from torch.utils._pytree import tree_map

    freed = []
    values = tree_map(lambda v: (freed.append(v) or v.detach()) if isinstance(v, torch.Tensor) and _graph_freed(v)
                      else v, (tuple(args), dict(kwargs)))
    if freed and mode == "exact":
        raise ProbeError(
            "hessian(wrt='alpha', mode='exact'): the recorded model call was given tensors computed before it (mixing "
            "weights such as net(x, softmax(α))) whose graph the block's backward freed, so whether edges share one α, "
            "which exact refuses (nasdiag.hessian.alpha_diag_hessian gives that diagonal), cannot be read; compute the "
            "weights inside the model's forward, call backward(retain_graph=True) in the block, or use another mode"
        )
    return values


def _cross_entropy_targets(logits: Optional[torch.Tensor], grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Class labels y such that ``grad`` is ∂/∂logits of cross_entropy(logits, y) with reduction mean or sum,
    or None if no such labels exist (another loss, label smoothing, several model calls, no backward)."""
    if logits is None or grad is None or logits.dim() != 2 or grad.shape != logits.shape:
        return None
    probs = torch.softmax(logits.to(torch.float64), dim=1)
    # a bfloat16 gradient (a backward under torch.autocast) is rounded to 2⁻⁹ relative: 2e-3 of a one-hot entry, measured;
    # a float32 one to ~3e-7 (B up to 4096, N up to 1000), so 1e-5 there: the half floor 1e-3 let label smoothing 5e-4 pass
    half = grad.dtype in (torch.float16, torch.bfloat16) or logits.dtype in (torch.float16, torch.bfloat16)
    tol = 1e-6 if logits.dtype == torch.float64 else max(1e-3, torch.finfo(grad.dtype).eps) if half else 1e-5
    for scale in (logits.shape[0], 1):  # mean, then sum reduction
        onehot = probs - scale * grad.to(torch.float64)
        labels = onehot.argmax(dim=1)
        if (onehot - torch.nn.functional.one_hot(labels, logits.shape[1])).abs().max() <= tol:
            return labels
    return None


def _local_module(model: nn.Module) -> Tuple[nn.Module, Optional[torch.device]]:
    """The module a DistributedDataParallel wrapper runs, and the device the wrapper moves the inputs to (None: as
    they are); other models as they are. The wrapper's forward adds only communication: the broadcast of rank 0's
    buffers, which the recorded forward already made, and the reducer's bookkeeping for a backward. A torch.compile
    wrapper is re-run as the eager module it wraps, a module compiled in place (``model.compile()``) through its eager
    call (the exact mode's re-runs under torch.func stopped in dynamo's AssertionError): the same forward and
    parameters."""
    compiled = sys.modules.get("torch._dynamo.eval_frame")
    if compiled is not None and isinstance(model, getattr(compiled, "OptimizedModule", ())):
        return _local_module(model._orig_mod)
    if getattr(model, "_compiled_call_impl", None) is not None:
        return _EagerCall(model), None
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return model, None
    ids = model.device_ids
    return model.module, (torch.device(model.device_type, ids[0]) if ids else None)


def _to_device(values, device: Optional[torch.device]):
    """``values`` (tensors in tuples, lists and dicts) on ``device`` (None: unchanged)."""
    from torch.utils._pytree import tree_map

    if device is None:
        return values
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, values)


class _EagerCall(nn.Module):
    """``model``'s eager call (its hooks and forward), past the code of ``model.compile()``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model._call_impl(*args, **kwargs)


class _BoundKeywords(nn.Module):
    """``model(*args, **kwargs)`` with the keyword arguments of the recorded call fixed (e.g. ``weights=``)."""

    def __init__(self, model: nn.Module, kwargs: dict):
        super().__init__()
        self.model = model
        self._kwargs = kwargs

    def forward(self, *args):
        return self.model(*args, **self._kwargs)


class Recording:
    """One ``with probe.record():`` block (see :meth:`Probe.record`); reusable, one step per ``with``."""

    __slots__ = ("probe", "targets", "capture", "plan")

    def __init__(self, probe: Probe, targets=None):
        self.probe, self.targets = probe, targets
        self.capture: Optional[StepCapture] = None
        self.plan: Optional[Hooks] = None

    def __enter__(self) -> Probe:
        if self.capture is not None:
            raise ProbeError("probe.record() blocks cannot be nested")
        return self.probe._begin(self)

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.probe._end(self, exc_type is None)
        return False


def attach(model: nn.Module, edges: Optional[EdgesArg] = None, **options) -> Probe:
    """Attach cost diagnostics to a supernet; nothing is hooked until ``probe.record()``.

    Args:
        model: any ``nn.Module``.
        edges: None to discover nasdiag ``MixedOp`` s and DARTS-convention mixed ops (``_ops`` candidates,
            forward ``(x, weights)``); or ``{edge name: mixed-op module | (module, [candidate op modules])}``.
        statistics: ``"all"`` (default) or ``"sampled"`` (see :meth:`Probe.statistics`).
        path_split: also split each edge's cost by path (:meth:`Probe.path_costs`).
        norm_deviation: measure eps/(var + eps) of the normalizations that make ops invariant.
        hessian: None or one of ``nasdiag.hessian.ARCH_MODES`` (``"approx"``, ``"ggn_mc"``, ``"exact"``, ...); enables :meth:`Probe.hessian`.
            The curvature is taken in the weights each edge's forward receives: an edge whose forward takes x alone
            (weights computed inside it) is refused.
        loss_fn: ``loss_fn(outputs, targets) -> scalar`` for :meth:`Probe.hessian` (default: mean cross-entropy).

    Raises:
        ProbeError: no discoverable edge, an edge map naming a module not in the model, a bad option, ``hessian=``
            with an edge whose forward takes no weights.
    """
    return Probe(model, edges, **options)
