"""What one ``with probe.record():`` block captures, and the hooks that capture it.

Capture rules for the cost C_k = <∂L/∂x_j, O_k(x_i)> (wiring supplement §2.1):
  * candidate outputs O_k(x) come from **forward hooks on the candidate modules** (a reference, no
    copy; the costs are computed under no_grad); a candidate's output *tensor* is never hooked, because ``skip_connect`` returns its input
    object and a hook there would fire with the gradient of another consumer;
  * ∂L/∂x_j comes from **one tensor hook on each edge's output** (a node is a plain sum of edges, so the
    gradient there is ∂L/∂x_j); the costs are computed in that hook and the candidate outputs released;
  * a cell's output gets one tensor hook for its output-edge costs;
  * the path split hooks the autograd nodes of an edge's forward that read its input: what they pass back is
    J_eᵀ ∂L/∂x_m, gathered in the step's own backward (a nested backward would fire every hook on its way).
Everything here lives for one block; the probe keeps only the small per-step results.
"""

from __future__ import annotations

import inspect
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import get_gradient_edge

from nasdiag.cost import edge_costs, eps_deviation, output_edge_costs
from nasdiag.cost.scale_invariance import uses_running_statistics
from nasdiag.hessian._hvp import random_state
from nasdiag.hooks import Hooks
from nasdiag.edges import EdgeSpec
from nasdiag.probe.discovery import CellInfo, ProbeError, _cell_edge_list


def data_parallel_refusal(what: str) -> str:
    """The line for ``nn.DataParallel`` over several devices: it runs shallow copies of the model in threads, one per
    device, and every copy fires the original's hooks, so one step's captures would mix the devices' batch slices
    (seen as "its mixed op ran twice in one forward")."""
    return (f"{what}: nn.DataParallel over several devices runs per-device copies of the model in threads, which "
            "nasdiag's hooks cannot tell apart; use torch.nn.parallel.DistributedDataParallel (one process per device, a "
            "probe in each) or one device (nn.DataParallel(model, device_ids=[0]) or the bare model)")


class Router:
    """The probe's planned hooks (built once at ``attach``, see :mod:`nasdiag.hooks`) call these; they
    forward to the step being recorded (``capture``), and do nothing outside a step.

    A model deep-copied (or pickled, ``torch.save(model)``) inside a ``record()`` block (e.g. the unrolled twin of
    second-order DARTS) copies the installed hooks with it; their copy of the router is a fresh one without a step,
    so the twin's hooks record nothing and keep nothing (a copied router held a copy of the step's captures, and
    every later forward and backward of the twin appended to it: a leak of ~30 tensors a step on a 3-cell
    supernet)."""

    __slots__ = ("capture",)

    def __init__(self):
        self.capture: Optional["StepCapture"] = None

    def __reduce__(self):  # copy.deepcopy and pickle: a router without a step
        return (Router, ())

    def edge_pre(self, pos, module, args, kwargs):
        cap = self.capture
        return None if cap is None else cap.edge_pre(pos, module, args, kwargs)

    def edge_post(self, pos, module, args, output):
        cap = self.capture
        return None if cap is None else cap.edge_post(pos, module, args, output)

    def candidate_post(self, slots, module, args, output):
        cap = self.capture
        return None if cap is None else cap.candidate_post(slots, module, args, output)

    def cell_pre(self, pos, module, args):
        cap = self.capture
        return None if cap is None else cap.cell_pre(pos, module, args)

    def cell_post(self, pos, module, args, output):
        cap = self.capture
        return None if cap is None else cap.cell_post(pos, module, args, output)

    def norm_pre(self, key, module, args):
        cap = self.capture
        return None if cap is None else cap.norm_pre(key, module, args)

    def model_pre(self, module, args, kwargs):
        cap = self.capture
        return None if cap is None else cap.model_pre(module, args, kwargs)

    def model_post(self, module, args, output):
        cap = self.capture
        return None if cap is None else cap.model_post(module, args, output)


class EdgeCall:
    """One forward of one edge inside the block (``model_call``: how many forwards of the whole model had
    started when it ran, so per-sample rows of different model forwards are told apart)."""

    __slots__ = ("pos", "x", "inp", "inp_edge", "first_node", "through", "consumers", "left", "split_done", "reached",
                 "weights", "outputs", "versions", "indirect", "cell_call", "model_call")

    def __init__(self, pos: int, n_ops: int, model_call: int = 0):
        self.pos = pos
        self.model_call = model_call
        self.inp = self.inp_edge = self.weights = self.cell_call = None
        self.first_node = -1  # path split: sequence number below every autograd node of this call's forward
        self.through: Optional[torch.Tensor] = None  # path split: J_eᵀ ∂L/∂x_m gathered so far (shape of inp)
        self.consumers = self.left = 0  # path split: hooked nodes reading the input; those yet to run this backward
        self.split_done = False  # path split: parts were taken from this call at least once
        self.reached = False
        self.outputs: Optional[List[Optional[torch.Tensor]]] = [None] * n_ops
        self.versions: List[int] = [0] * n_ops
        self.x: Optional[torch.Tensor] = None  # the edge's input x_i, to tell a candidate's own call O_k(x_i) ...
        self.indirect: Optional[set] = None  # ... from its calls on other inputs (ops whose output came from such a call)


class CellCall:
    """One forward of one cell inside the block."""

    __slots__ = ("pos", "output", "version", "edge_calls", "model_call", "node_grad", "node_channels", "node_edges")

    def __init__(self, pos: int, model_call: int = 0):
        self.pos = pos
        self.model_call = model_call
        self.output: Optional[torch.Tensor] = None
        self.version = 0
        self.edge_calls: Dict[int, List[EdgeCall]] = {}
        #: path split: node -> the gradient the split gathered there (output slice + J_eᵀ ∂L/∂x_m of the edges leaving
        #: it), kept only while some edge ending at the node has not been checked against it
        self.node_grad: Dict[int, torch.Tensor] = {}
        #: DARTS-convention cells: output node -> channels of the edges ending there (their output must be the
        #: concatenation of those nodes in equal chunks)
        self.node_channels: Optional[Dict[int, int]] = None
        #: ... and the outputs of those edges, until the cell output is checked to be those nodes
        self.node_edges: Optional[Dict[int, List[torch.Tensor]]] = None


#: what the capture keeps per backward: (index of the model forward it belongs to, (B, K) or (B, n_nodes) terms)
Part = Tuple[int, torch.Tensor]


def _costs_with_missing(g: torch.Tensor, outputs: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """(B, K) per-sample costs; NaN columns for candidates whose forward did not run."""
    present = [k for k, o in enumerate(outputs) if o is not None]
    if len(present) == len(outputs):
        return edge_costs(g, outputs, per_sample=True)
    B = g.shape[0] if g.dim() else 1
    out = g.new_full((B, len(outputs)), math.nan, dtype=torch.promote_types(g.dtype, torch.float32))
    if present:
        out[:, present] = edge_costs(g, [outputs[k] for k in present], per_sample=True).to(out.dtype)
    return out


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` unchanged (``torch.broadcast_shapes`` gives ``target``)."""
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


_VMAP = getattr(getattr(torch._C._functorch, "TransformType", None), "Vmap", None)


def _under_vmap() -> bool:
    """Whether the current forward runs inside ``torch.func.vmap``: its tensors are per-vmap-call batched wrappers,
    not the step's x_i, O_k(x_i) and ∂L/∂x_j (the costs leaked them out of the transform: torch's internal assert)."""
    stack = torch._C._functorch.get_interpreter_stack() if _VMAP is not None else None
    return bool(stack) and any(i.key() == _VMAP for i in stack)


_FT = torch._C._functorch
_BATCHED = tuple(getattr(_FT, n) for n in ("is_batchedtensor", "is_legacy_batchedtensor") if hasattr(_FT, n))


def _is_batched(g: torch.Tensor) -> bool:
    """Whether a backward hook got a gradient batched over the rows of ``grad_outputs``
    (``torch.autograd.grad(..., is_grads_batched=True)`` runs the backward under vmap): one vector-Jacobian product per
    row, not the step's ∂L/∂x_j (tensors of the transform kept in the costs broke the end of the block)."""
    return any(f(g) for f in _BATCHED)


def _batched_backward(where: str) -> ProbeError:
    return ProbeError(
        f"{where}: a backward batched over its grad_outputs (torch.autograd.grad(..., is_grads_batched=True), "
        "torch.func.jacrev: under vmap) reached it inside probe.record(); its gradients are one vector-Jacobian product per row, not the step's "
        "∂L/∂x_j; take batched gradients outside the block and record a plain backward of the loss")


def tensors_in(value) -> List[torch.Tensor]:
    """The tensors of ``value`` and of its dicts, tuples and lists, at any depth."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (Mapping, tuple, list)):
        return [t for item in (value.values() if isinstance(value, Mapping) else value) for t in tensors_in(item)]
    return []


def first_tensor(value):
    """``value`` if it is no container, else the first tensor with a dimension in it (dict values, tuple and list items,
    depth first: a scalar such as ``{"tau": tensor(0.5), "x": x}``'s holds no batch) and with samples where any has
    (an empty placeholder entry is no empty batch)."""
    if not isinstance(value, (Mapping, tuple, list)):
        return value
    tensors = [t for t in tensors_in(value) if t.dim()]
    return next((t for t in tensors if t.shape[0]), tensors[0] if tensors else None)


def _is_list_entry(cell: CellInfo, edge: EdgeSpec) -> bool:
    """Whether ``edge``'s module is the entry at its edge index of ``cell``'s edge list (not an edge inside it)."""
    seq = _cell_edge_list(cell.module)
    return seq is not None and 0 <= edge.edge_index < len(seq) and seq[edge.edge_index] is edge.module


def _equal_chunks(nodes: Sequence[int], channels: int) -> Dict[int, Tuple[int, int]]:
    if channels % len(nodes):
        raise ProbeError(f"a DARTS-convention cell output has {channels} channels, not divisible among its {len(nodes)} output nodes")
    c = channels // len(nodes)
    return {n: (i * c, (i + 1) * c) for i, n in enumerate(nodes)}


class StepCapture:
    """Hooks and buffers of one recorded step. Created and discarded by ``Probe.record``."""

    def __init__(self, edges: Sequence[EdgeSpec], cells: Sequence[CellInfo], *, path_split: bool,
                 check_convention: Sequence[bool], incoming: Dict[Tuple[int, int], List[int]],
                 hooks: Hooks, track_selected: bool = False, weights_names: Optional[Sequence[str]] = None,
                 input_names: Optional[Sequence[str]] = None,
                 keep_model_io: bool = False, weights_presumed: Optional[Sequence[bool]] = None,
                 check_nodes: Optional[Sequence[bool]] = None, order_given: Optional[Sequence[bool]] = None,
                 check_concat: Optional[Sequence[object]] = None):
        N = len(edges)
        #: per edge, whether its candidate list was given by the caller (its order against the weights is checked)
        self.order_given = list(order_given) if order_given is not None else [False] * N
        # edges mapped by the caller whose forward is (x, w): w is their weights only where it is (K,) or (B, K)
        self.weights_presumed = list(weights_presumed) if weights_presumed is not None else [False] * N
        self.edges, self.cells = edges, cells
        # the keyword the mixing weights go by when passed as one (the forward's second parameter)
        self.weights_names = list(weights_names) if weights_names is not None else ["weights"] * N
        # ... and the keyword of the input x_i (op(x=h, weights=w): its path split and the returned-input check need it)
        self.input_names = list(input_names) if input_names is not None else ["x"] * N
        self.keep_model_io = keep_model_io  # only probe.hessian() needs the batch and the logits
        self.model_calls = 0  # forwards of the whole model started in this block
        self.call_modes: Dict[int, bool] = {}  # model forward (index) -> the model's train/eval mode in it
        self.call_batch: Dict[int, int] = {}  # model forward (index) -> the batch size of its first argument
        self.first_name: Optional[str] = None  # the name of the model forward's first parameter ("" where none)
        #: autograd's node numbers at the start and end of the attached module's last call (with grad mode on)
        self.call_span: Optional[List[Optional[int]]] = None
        self.path_split = path_split
        self.track_selected = track_selected  # only statistics="sampled" needs which ops had weight != 0
        self.check_convention = list(check_convention)
        # path split: per edge, whether ∂L/∂(its output) is still to be checked against the gradient the split gathers
        # at its end node (the split is right only where the node is the plain sum of its incoming edges)
        self.check_nodes = list(check_nodes) if check_nodes is not None else [path_split] * N
        self.pending_nodes = {(edges[p].cell_index, edges[p].dst) for p in range(N) if self.check_nodes[p]} \
            if path_split else set()
        self.incoming = incoming  # (cell pos, node) -> edge positions ending at that node
        self.per_sample: List[List[Part]] = [[] for _ in range(N)]
        self.n_forward = [0] * N
        #: forwards run with grad mode off (torch.no_grad / torch.inference_mode): nothing to capture
        self.n_grad_off = [0] * N
        #: forwards whose output did not require grad (nothing before the edge carries a gradient)
        self.n_without_grad = [0] * N
        #: edges whose candidate op ran with grad mode on while no mixed op listing it was being called: the mixed op
        #: was run through a method that calls no module hooks (GDAS's ``op.forward_gdas(x, w, k)``, ``op.forward(x, w)``)
        self.ops_outside: set = set()
        self.missing_ops: List[set] = [set() for _ in range(N)]
        #: edge -> length of weights its forward got that is not its K (a candidate added since attach?)
        self.k_changed: Dict[int, int] = {}
        self.selected: List[Optional[torch.Tensor]] = [None] * N
        self.paths: List[Dict[str, List[Part]]] = [{} for _ in range(N)]
        self.node_costs: List[List[Part]] = [[] for _ in cells]
        self.modified_cells: set = set()  # cells whose output was modified in place after their forward
        self.cells_not_tensor: Dict[int, str] = {}  # cells whose forward returned no tensor: the type it returned
        #: DARTS-convention cells whose output is not the concatenation of their output nodes (e.g. their sum): why
        self.cells_not_concat: Dict[int, str] = {}
        #: per cell, whether its output is still to be checked to be its output nodes (DARTS convention): True, False
        #: once it was, or why it is not (flagged at every step without checking again)
        self.check_concat = list(check_concat) if check_concat is not None else [True] * len(cells)
        #: per edge, its end node where that is an output node of a DARTS-convention cell (undeclared slices), else None
        #: (an edge inside an entry of the cell's edge list, PC-DARTS's mix on a channel slice, returns no node's width)
        self.chunk_node = [e.dst if e.cell_index is not None and cells[e.cell_index].output_node_slices is None
                           and e.dst in cells[e.cell_index].output_nodes and _is_list_entry(cells[e.cell_index], e)
                           else None for e in edges]
        self.deviation: Dict[Tuple[int, int], torch.Tensor] = {}
        self.open_edge: List[Optional[EdgeCall]] = [None] * N
        #: per edge, (model forward, weights) of its last call: a second call in the same model forward must have
        #: the same weights (tied Z), else the module is two edges with two Z and its summed costs belong to neither
        self.call_weights: List[Optional[Tuple[int, torch.Tensor]]] = [None] * N
        self.open_cell: List[Optional[CellCall]] = [None] * len(cells)
        self.hooks = hooks  # the block's installed hooks; tensor hooks are added to them
        self.model_inputs = None
        self.kept_call = -1  # which model forward model_inputs are of
        self.kept_reached = False  # a backward reached an edge of that forward (else hessian() would re-run another batch)
        self.rng_state = None  # the global generators' state when that forward began
        #: hessian mode: each edge's weights at its first call in the first model forward (the re-run must see them)
        self.first_weights: List[Optional[torch.Tensor]] = [None] * N
        self.ran_kept = [False] * N  # hessian mode: per edge, whether the kept model forward ran it (its re-run will)
        self.model_output: Optional[torch.Tensor] = None  # logits of the first model call (hessian mode)
        self.output_grad: Optional[torch.Tensor] = None  # ∂L/∂logits, to infer cross-entropy targets
        self.split_calls: List[EdgeCall] = []  # path split: calls whose J_eᵀ g is gathered by node hooks
        #: path split: the block's cell calls; their edge calls point back at them (call.cell_call), a reference cycle that
        #: only Python's cyclic collector freed, so each step's captured activations outlived the block (several steps of
        #: them on the device at a time) unless the cycle is broken when the block ends (release)
        self.cell_calls: List[CellCall] = []
        self._marker: Optional[torch.Tensor] = None  # a leaf whose products read autograd's sequence counter

    # -- forward hooks ---------------------------------------------------------------------
    def edge_pre(self, pos: int, module, args, kwargs):
        if getattr(module, "_is_replica", False):
            raise ProbeError(data_parallel_refusal(f"edge {self.edges[pos].name!r} ran in a copy of the model made by nn.DataParallel"))
        edge = self.edges[pos]
        if not torch.is_grad_enabled():
            # an evaluation forward (no_grad / inference_mode) has no backward, hence no cost; inference
            # tensors have no version counter to read either. Counted, to say so if no other forward ran.
            self.n_grad_off[pos] += 1
            self.open_edge[pos] = None
            return None
        if _under_vmap():
            raise ProbeError(
                f"edge {edge.name!r} ran inside torch.func.vmap within probe.record(): its tensors are batched per vmap "
                "call, not the step's x_i, O_k(x_i) and ∂L/∂x_j; run vmap outside the block and record a plain forward "
                "and backward (costs(per_sample=True) gives the per-sample terms)")
        call = EdgeCall(pos, edge.n_ops, self.model_calls)
        if self.keep_model_io and self.model_calls == self.kept_call:
            self.ran_kept[pos] = True
        call.x = args[0] if args else kwargs.get(self.input_names[pos])
        # Only what a feature needs is kept: this hook runs for every edge at every step.
        if edge.weights_arg:
            w = args[1] if len(args) > 1 else kwargs.get(self.weights_names[pos])
            self._check_tied(pos, w)
            if isinstance(w, torch.Tensor) and w.dim() in (1, 2) and w.shape[-1] != edge.n_ops:
                self.k_changed[pos] = w.shape[-1]
            if self.keep_model_io and self.model_calls == self.kept_call and self.first_weights[pos] is None \
                    and isinstance(w, torch.Tensor):
                self.first_weights[pos] = w.detach()
        if edge.weights_arg and (self.track_selected or self.check_convention[pos]):
            if self.weights_presumed[pos] and not (isinstance(w, torch.Tensor) and w.is_floating_point()
                                                   and w.dim() in (1, 2) and w.shape[-1] == edge.n_ops):
                w = None  # a second argument of another kind: not the weights (the output's span is checked instead)
            if isinstance(w, torch.Tensor):
                call.weights = w.detach()
            elif self.track_selected:
                raise ProbeError(
                    f"edge {edge.name!r}: statistics='sampled' needs the mixing weights of every forward, but this call "
                    f"passed no (K,) or (B, K) tensor (K = {edge.n_ops}) as the second argument or as "
                    f"{self.weights_names[pos]}=; pass the weights there or attach with statistics='all'"
                )
        if self.path_split and edge.cell_index is not None:
            if isinstance(call.x, torch.Tensor):
                call.inp = call.x
                if call.inp.requires_grad and self.incoming.get((edge.cell_index, edge.src)):
                    # the input as this edge read it, even if the tensor is modified in place afterwards
                    call.inp_edge = get_gradient_edge(call.inp)
                    call.first_node = self._sequence_now()
            ccall = self.open_cell[edge.cell_index]
            if ccall is not None:
                call.cell_call = ccall
                ccall.edge_calls.setdefault(pos, []).append(call)
        self.open_edge[pos] = call
        return None

    def _check_tied(self, pos: int, w) -> None:
        """A mixed op called again in the same forward of the model must get the same weights: calls with tied Z
        add up to ∂L/∂Z, but one module serving two edges with two different Z (e.g. the same mixed op placed at two
        positions of a cell's ``_ops``) would report the sum of two edges' costs under one name."""
        if not isinstance(w, torch.Tensor) or w.dim() != 1 or self.model_calls == 0:
            # only (K,) weights shared by the batch: (B, K) per-sample weights may differ between calls that see different
            # samples (a forward run in chunks); and only where the model's forwards are told apart
            return
        prev = self.call_weights[pos]
        self.call_weights[pos] = (self.model_calls, w)
        if prev is None or prev[0] != self.model_calls:
            return
        v = prev[1]
        if v is w or (v.shape == w.shape and v.dtype == w.dtype and v.device == w.device
                      and (v.data_ptr() == w.data_ptr() and v.stride() == w.stride() or torch.equal(v.detach(), w.detach()))):
            return
        raise ProbeError(
            f"edge {self.edges[pos].name!r}: its mixed op ran twice in one forward of the model with different mixing weights, so "
            "one module serves two edges with two Z and its costs would add up both edges' costs under one name; give "
            "each edge its own mixed-op module (candidate op modules may be shared between mixed ops)"
        )

    def candidate_post(self, slots: Sequence[Tuple[int, int]], module, args, output):
        if torch.is_grad_enabled() and all(self.open_edge[pos] is None for pos, _ in slots):
            self.ops_outside.update(pos for pos, _ in slots)
        for pos, k in slots:
            call = self.open_edge[pos]
            if call is None:  # the candidate ran outside its mixed op's forward
                continue
            if not isinstance(output, torch.Tensor):
                raise ProbeError(
                    f"edge {self.edges[pos].name!r}: candidate op {k} ({type(module).__name__}) returned "
                    f"{type(output).__name__}, not a tensor, so O_k(x_i) of the cost <∂L/∂x_j, O_k(x_i)> is not known; "
                    "list as candidate the submodule that returns the tensor the mixed op weights "
                    "(attach(model, edges={name: (mixed op, [candidate modules])})), or have the op return only that tensor")
            # A candidate op module may also run inside another candidate, on another input (an op shared by two
            # candidates, e.g. [conv, Sequential(pre, conv)]): O_k(x_i) is its call on the edge's own input, whichever
            # ran last; only where no call of it had that input (a mixed op transforming x first) the last call counts.
            if call.x is not None and args and args[0] is call.x:
                if call.indirect is not None:
                    call.indirect.discard(k)
            elif call.outputs[k] is not None and (call.indirect is None or k not in call.indirect):
                continue
            else:
                call.indirect = {k} if call.indirect is None else call.indirect | {k}
            # no detach() here (one dispatch per candidate per step): the costs are computed under
            # no_grad in edge_grad, so the graph is never extended through these references.
            call.outputs[k] = output
            call.versions[k] = output._version
        return None

    def edge_post(self, pos: int, module, args, output):
        call, self.open_edge[pos] = self.open_edge[pos], None
        edge = self.edges[pos]
        if call is None:
            return None
        if not isinstance(output, torch.Tensor):
            raise ProbeError(
                f"edge {edge.name!r}: the mixed op returned {type(output).__name__}; the probe needs a tensor "
                "Σ_k w_k·op_k(x). Map the edge to the module that returns that sum."
            )
        if output.is_meta:
            raise ProbeError(
                f"edge {edge.name!r} ran on the meta device, where tensors have no values, so there are no costs to "
                "compute; materialize the model first (model.to_empty(device=...) and load its weights) and record "
                "real inputs"
            )
        if call.x is not None and output is call.x:
            # A hook on this tensor is a hook on x_i: it would fire with the gradient of x_i's other consumers too,
            # not ∂L/∂x_j alone (e.g. skip_connect returned as is for a one-hot Z): a wrong cost, never a silent one.
            raise ProbeError(
                f"edge {edge.name!r}: the mixed op returned its input tensor object itself, so ∂L/∂x_j cannot be told "
                "from the gradient of the input's other consumers; return a new tensor, e.g. weights[k] * op(x)."
            )
        for k, o in enumerate(call.outputs):
            # a candidate whose output the weighted sum broadcasts (a `none` op returning a 0-dim zero, a learned
            # (1, C, 1, 1) map) is mixed as its expansion: O_k(x_i) is that view (no copy), as in Σ_k w_k·op_k(x)
            if o is not None and o.shape != output.shape and _broadcasts_to(o.shape, output.shape):
                call.outputs[k] = o.expand(output.shape)
        self.n_forward[pos] += 1
        node = self.chunk_node[pos]
        if node is not None and output.dim() >= 2 and self.open_cell[edge.cell_index] is not None:
            ccall = self.open_cell[edge.cell_index]
            ccall.node_channels = ccall.node_channels or {}
            ccall.node_channels[node] = output.shape[1]
            if self.check_concat[edge.cell_index] is True:
                ccall.node_edges = ccall.node_edges or {}
                ccall.node_edges.setdefault(node, []).append(output.detach())
        missing = [k for k, o in enumerate(call.outputs) if o is None]
        self.missing_ops[pos].update(missing)
        if call.weights is not None:
            w = call.weights
            if self.track_selected:
                sel = (w != 0) if w.dim() == 1 else (w != 0).reshape(-1, w.shape[-1]).any(0)
                self.selected[pos] = sel if self.selected[pos] is None else self.selected[pos] | sel
            if self.check_convention[pos] and not missing:
                # equal weights pass the check in any order of a caller's candidate list: checked again at the next step
                self.check_convention[pos] = not self._check_weighted_sum(edge, call, output) or (
                    self.order_given[pos] and w.shape[-1] > 1 and bool((w == w[..., :1]).all()))
        elif self.check_convention[pos] and not missing:
            self.check_convention[pos] = not self._check_span(edge, call, output)
        if not output.requires_grad:
            if torch.is_grad_enabled():  # (under no_grad the message says to turn grad mode on)
                self.n_without_grad[pos] += 1
            return None
        if self.path_split and call.cell_call is not None and call.inp is not None \
                and self.incoming.get((edge.cell_index, edge.src)):
            self.split_calls.append(call)
            if call.inp_edge is not None:
                self._hook_consumers(call, output)
        self.hooks.tensor(output, lambda g, call=call: self.edge_grad(call, g))
        return None

    def _check_weighted_sum(self, edge: EdgeSpec, call: EdgeCall, output: torch.Tensor) -> bool:
        # A checkable invariant: the costs equal ∂L/∂w only if out = Σ_k w_k O_k (e.g. not PC-DARTS's
        # partial channels). Checked once per edge, on the first recorded forward with finite values.
        w = call.weights
        if w.dim() == 0 or w.shape[-1] != len(call.outputs):
            raise ProbeError(
                f"edge {edge.name!r}: its forward received weights of shape {tuple(w.shape)} for {len(call.outputs)} "
                f"candidate ops; pass (K,) or (B, K) weights with K = {len(call.outputs)}, one per candidate, in the order "
                "of the candidate list"
            )
        err = self._deviation(call, output, lambda: self._weighted_sum_error(w, call.outputs, output))
        if math.isnan(err):  # a NaN/inf value (a NaN batch, diverged weights) decides nothing: checked at a finite step
            return False
        if not err <= self._tolerance(output, len(call.outputs)):
            self._check_versions(call)  # a candidate output changed in place since (op(x).mul_(w)) says so, not this
            raise ProbeError(
                f"edge {edge.name!r}: its output is not Σ_k w_k·op_k(x) of its forward's weights and candidate ops "
                f"({self._how_far(call, output, err)}), so <∂L/∂out, op_k(x)> would not be ∂L/∂w_k. Map the edge, "
                "with attach(model, edges={name: (module, [candidate ops in the order of its weights])}), to a module whose "
                "output is that sum (for "
                "PC-DARTS's partial channels: a module mixing the ops on the channel slice, with the split, concatenation "
                "and shuffle outside it)."
            )
        return True

    def _check_span(self, edge: EdgeSpec, call: EdgeCall, output: torch.Tensor) -> bool:
        # Without the weights, out = Σ_k Z_k O_k(x) can still be checked: per sample, the output must lie in the
        # span of the candidates' outputs (whatever Z the module used inside). A module that is not a mixed op
        # (e.g. Sequential(Linear, ReLU) mapped with [Linear]) or a list missing candidates fails it.
        err = self._deviation(call, output, lambda: self._span_error(call.outputs, output))
        if math.isnan(err):  # as in _check_weighted_sum
            return False
        if not err <= self._tolerance(output, len(call.outputs)):
            self._check_versions(call)  # as in _check_weighted_sum
            raise ProbeError(
                f"edge {edge.name!r}: its output is not a weighted sum Σ_k w_k·op_k(x) of the outputs of its "
                f"{edge.n_ops} candidate op(s) {list(edge.op_names)} ({self._how_far(call, output, err, 'residual')}), so it is not a mixed op "
                "of these candidates and <∂L/∂out, op_k(x)> is no cost. Map the edge to the module that returns that "
                "sum, with every candidate op it mixes: attach(model, edges={name: (module, [candidate ops])})."
            )
        return True

    @staticmethod
    def _deviation(call: EdgeCall, output: torch.Tensor, relative_error) -> float:
        """``relative_error()`` where every candidate output has the edge output's shape, else inf."""
        if {tuple(o.shape) for o in call.outputs} != {tuple(output.shape)}:
            return float("inf")
        return relative_error()

    @staticmethod
    def _how_far(call: EdgeCall, output: torch.Tensor, err: float, what: str = "deviation") -> str:
        shapes = sorted({tuple(o.shape) for o in call.outputs if o.shape != output.shape})
        if shapes:  # the deviation is not even defined: say why
            return (f"its candidate ops return shape {', '.join(map(str, shapes))} but it returns "
                    f"{tuple(output.shape)}")
        return f"relative {what} {err:.3g}"

    @staticmethod
    def _tolerance(output: torch.Tensor, n_ops: int) -> float:
        # half precision rounds each candidate's product and every partial sum of the K terms: a mixed op summing them
        # in another order than the check (reversed, or stacked and summed) deviates by up to ~K roundings (bfloat16,
        # K = 8: 1e-2 of the output measured, every step, where 1e-3 refused such a mixed op at its first step)
        if output.dtype in (torch.float16, torch.bfloat16):
            return max(1e-3, n_ops * torch.finfo(output.dtype).eps)
        return 1e-5

    @staticmethod
    def _span_error(outputs, output: torch.Tensor) -> float:
        """Largest relative least-squares residual of ``output[b]`` on ``{outputs[k][b]}`` over the first 4 samples."""
        with torch.no_grad():
            n = min(output.shape[0], 4) if output.dim() else 1
            y = output.detach()[:n].reshape(n, -1, 1).to("cpu", torch.float64)
            a = torch.stack([o.detach()[:n].reshape(n, -1) for o in outputs], -1).to("cpu", torch.float64)  # (n, F, K)
            if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(y).all())):
                return math.nan  # no least squares through NaN/inf (pinv's SVD raises): nothing checked at this step
            fit = a @ (torch.linalg.pinv(a) @ y)
            scale = y.abs().max().clamp(min=1e-30)
            return float((fit - y).abs().max() / scale)

    @staticmethod
    def _weighted_sum_error(w: torch.Tensor, outputs, output: torch.Tensor) -> float:
        with torch.no_grad():
            # in at least float32: a half-precision sum here would add its own rounding to the mixed op's
            dtype = torch.promote_types(torch.promote_types(output.dtype, w.dtype), torch.float32)
            w = w.to(dtype)
            if w.dim() == 1:
                expected = sum(w[k] * o.to(dtype) for k, o in enumerate(outputs))
            else:
                shape = (w.shape[0],) + (1,) * (output.dim() - 1)
                expected = sum(w[:, k].reshape(shape) * o.to(dtype) for k, o in enumerate(outputs))
            scale = output.detach().abs().max().to(dtype).clamp(min=1e-30)
            return float((expected - output.detach().to(dtype)).abs().max() / scale)

    def cell_pre(self, pos: int, module, args):
        self.open_cell[pos] = CellCall(pos, self.model_calls)
        if self.path_split:
            self.cell_calls.append(self.open_cell[pos])
        return None

    def cell_post(self, pos: int, module, args, output):
        ccall, self.open_cell[pos] = self.open_cell[pos], None
        if ccall is None:
            return None
        if not isinstance(output, torch.Tensor):  # e.g. (output, auxiliary loss): no output costs, output_costs() says why
            self.cells_not_tensor[pos] = type(output).__name__
            return None
        cell = self.cells[pos]
        if ccall.node_channels is not None and output.dim() >= 2:
            widths = [ccall.node_channels.get(n) for n in cell.output_nodes]
            if None not in widths and (len(set(widths)) != 1 or sum(widths) != output.shape[1]):
                # the equal chunks of the DARTS convention would not be the nodes (a cell summing its nodes): NaN, flagged
                self.cells_not_concat[pos] = (f"has {output.shape[1]} channels where its output nodes "
                                              f"{list(cell.output_nodes)} have {widths}")
                self.check_concat[pos] = False  # the widths tell at every step: no edge outputs to keep for the check
                return None
            node_edges, ccall.node_edges = ccall.node_edges, None
            if self.check_concat[pos] is True and node_edges is not None and None not in widths:
                # equal widths are not yet the nodes: a 1x1 convolution of the concatenation keeps them
                why = self._not_the_nodes(cell, node_edges, output)  # "": not checked at this step (NaN)
                if why != "":
                    self.check_concat[pos] = why or False
            if isinstance(self.check_concat[pos], str):
                self.cells_not_concat[pos] = self.check_concat[pos]
                return None
        if output.requires_grad:
            ccall.output = output.detach()  # shares the version counter: an in-place change after the cell shows
            ccall.version = output._version
            self.hooks.tensor(output, lambda g, c=ccall: self.cell_grad(c, g))
        return None

    def _not_the_nodes(self, cell: CellInfo, node_edges: Dict[int, List[torch.Tensor]], output: torch.Tensor):
        """Why each equal chunk of a DARTS-convention cell's output is not its output node (per sample, in the span of
        the outputs of the edges ending there: a node is their sum, maybe scaled per edge, e.g. by a drop-path), None
        where they are, or "" where a NaN/inf leaves it open (checked at a finite step)."""
        unchecked = None
        for node, (a, b) in _equal_chunks(cell.output_nodes, output.shape[1]).items():
            chunk, parts = output[:, a:b], node_edges.get(node, [])
            if not parts or any(t.shape != chunk.shape for t in parts):
                return (f"has chunk {tuple(chunk.shape)} for node {node}, whose edges return "
                        f"{sorted({tuple(t.shape) for t in parts})}")
            err = self._span_error(parts, chunk)
            if math.isnan(err):
                unchecked = ""
            elif err > self._tolerance(chunk, len(parts)):
                return (f"has a chunk for node {node} that is not that node (relative residual {err:.3g} off the span of "
                        "its edges' outputs)")
        return unchecked

    def norm_pre(self, key: Tuple[int, int], module, args):
        if self.open_edge[key[0]] is None:
            # not inside this edge's forward: a normalization shared with another edge's op (one-shot weight sharing)
            # or run outside any edge measures another input than the one this edge's op saw
            return None
        if uses_running_statistics(module):
            # a forward in eval mode (a validation pass with grad on inside the block): this BatchNorm/InstanceNorm is an
            # affine map of its running statistics there, the op is not invariant, and its input is another batch's
            return None
        dev = eps_deviation(module, args[0]).max()
        prev = self.deviation.get(key)
        self.deviation[key] = dev if prev is None else torch.maximum(prev, dev)
        return None

    def model_pre(self, module, args, kwargs):
        if not self._continues_last_call(args, kwargs):
            self.model_calls += 1
        self.call_span = [self._sequence_now(), None] if torch.is_grad_enabled() else None
        self.call_modes.setdefault(self.model_calls, module.training)
        first = self._first_argument(module, args, kwargs)
        if self.model_calls not in self.call_batch and isinstance(first, torch.Tensor) and first.dim():
            self.call_batch[self.model_calls] = first.shape[0]
        if torch.is_grad_enabled() and isinstance(first, torch.Tensor) and first.dim() and first.shape[0] == 0:
            # a rank's last batch of drop_last=False can be empty: its mean loss is NaN, yet ∂L/∂Z sums over no sample
            # to 0, a cost of 0 observed as a step's (and pooled across ranks), or a torch max() traceback in the checks
            raise ProbeError(f"the model's input {tuple(first.shape)} holds no samples: a recorded step needs at least one "
                             "(its mean loss is NaN, its costs would be 0); skip empty batches (under DDP every rank needs "
                             "samples: shard with DistributedSampler, which pads, or drop_last=True)")
        # the first call of the model in the block that has a backward: a validation forward under no_grad before it
        # is not the batch the costs (and the curvature asked after them) are of
        if self.keep_model_io and self.model_inputs is None and torch.is_grad_enabled():
            self.model_inputs = (args, kwargs)
            self.kept_call = self.model_calls
            self.rng_state = random_state()  # hessian()'s re-run draws this forward's dropout masks
        return None

    def _first_argument(self, module, args, kwargs):
        """The model call's first argument, passed positionally or by its name (``model(x=x)``, a keyword-only input):
        dim 0 of it is the batch its edges' rows are counted in (read by position only, a model called by keyword had no
        batch size, so a forward running an edge in chunks added other samples' rows up and a path dropped in a
        micro-batch was refused as such a forward). A batch given as a dict, tuple or list (``model({"x": x, ...})``,
        ``model((x, y))``) is counted by its first tensor: read as no batch at all, an edge run on chunks of it added
        other samples' rows up silently, and a path dropped in a micro-batch was refused as such a forward."""
        if args or not kwargs:
            first = args[0] if args else None
        else:
            if self.first_name is None:
                try:
                    params = [p.name for p in inspect.signature(module.forward).parameters.values()
                              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                except (TypeError, ValueError):
                    params = []
                self.first_name = params[0] if params else ""
            # a forward(**batch) (HF style, model(**batch)) names no parameter: its batch is in the keywords' values
            first = kwargs.get(self.first_name) if self.first_name else list(kwargs.values())
        return first_tensor(first)

    def model_post(self, module, args, output):
        if self.call_span is not None and self.call_span[1] is None and torch.is_grad_enabled():
            self.call_span[1] = self._sequence_now()
        if self.keep_model_io and self.model_output is None and self.model_calls == self.kept_call \
                and isinstance(output, torch.Tensor):
            self.model_output = output.detach()
            if output.requires_grad:
                self.hooks.tensor(output, self._output_grad)
        return None

    def _continues_last_call(self, args, kwargs) -> bool:
        """Whether this call of the attached module reads what its last call computed: a sub-module applied twice in one
        forward of the whole model (a cell reused at two depths) is one forward, whose calls of an edge must share Z and
        add up per sample, not two micro-batches. The autograd nodes of the inputs are searched back to the last call's
        (autograd numbers its nodes in creation order; nodes made before that call cannot depend on it)."""
        span = self.call_span
        if span is None or span[1] is None or not self.model_calls:
            return False
        lo, hi = span
        inputs = tensors_in((args, kwargs))  # in dicts too: a block taking {"h": h, ...} applied at two depths
        stack = [t.grad_fn for t in inputs if t.grad_fn is not None]
        seen = {id(n): n for n in stack}  # the node objects are kept alive: an id is not reused while searching
        while stack:
            node = stack.pop()
            nr = node._sequence_nr()
            if lo <= nr <= hi:
                return True
            for child, _ in node.next_functions:
                if child is not None and id(child) not in seen and child._sequence_nr() >= lo:
                    seen[id(child)] = child
                    stack.append(child)
        return False

    def _output_grad(self, g: torch.Tensor):
        if _is_batched(g):
            raise _batched_backward("the model output")
        self.output_grad = g.detach() if self.output_grad is None else self.output_grad + g.detach()
        return None

    # -- tensor hooks (backward) -------------------------------------------------------------
    def _check_versions(self, call: EdgeCall) -> None:
        edge = self.edges[call.pos]
        for k, o in enumerate(call.outputs):
            if o is not None and o._version != call.versions[k]:
                raise ProbeError(
                    f"edge {edge.name!r}: the output of candidate op {k} ({edge.op_names[k]}) was modified in place "
                    "after the forward; its cost cannot be computed. Use out-of-place ops (e.g. w * op(x), not op(x).mul_(w); "
                    "ReLU(inplace=False))."
                )

    def edge_grad(self, call: EdgeCall, g: torch.Tensor):
        if call.outputs is None:
            return None
        if _is_batched(g):
            raise _batched_backward(f"edge {self.edges[call.pos].name!r}")
        self._check_versions(call)
        call.reached = True
        if call.model_call == self.kept_call:
            self.kept_reached = True
        if self.path_split and call.cell_call is None and self.edges[call.pos].cell_index is not None:
            raise self._outside_cell(call)
        if self.check_nodes[call.pos] and call.cell_call is not None:
            self._check_node(call, g)
        if torch.is_grad_enabled():  # a create_graph backward must not record the probe's arithmetic
            with torch.no_grad():
                self.per_sample[call.pos].append((call.model_call, _costs_with_missing(g, call.outputs)))
        else:  # the usual backward already runs without grad mode; skip the context manager
            self.per_sample[call.pos].append((call.model_call, _costs_with_missing(g, call.outputs)))
        # the references stay until the block ends (release): a second backward through the same forward
        # (retain_graph=True) adds its costs, as it adds to .grad
        return None

    # -- path split (Thm. 1): J_eᵀ ∂L/∂x_m gathered in the block's own backward --------------------------------
    def _sequence_now(self) -> int:
        """Autograd's node counter now: nodes created later (this edge's forward) have larger numbers."""
        if self._marker is None:
            self._marker = torch.zeros((), requires_grad=True)
        return (self._marker * 1.0).grad_fn._sequence_nr()

    def _hook_consumers(self, call: EdgeCall, output: torch.Tensor) -> None:
        """Hook the autograd nodes of this edge's forward that read its input x_j: what they pass back to x_j,
        summed, is J_eᵀ ∂L/∂x_m. Read in the block's own backward, so no second backward runs: a nested
        autograd.grad would fire every other hook on the way (another probe's, a retain_grad on a node) with a
        partial gradient."""
        root = output.grad_fn
        if root is None:
            return
        target, target_nr = call.inp_edge.node, call.inp_edge.output_nr
        # seen keeps the node objects alive: torch < 2.13 makes a new Python wrapper per access and frees it after
        # use, so the id of a freed wrapper is reused by the next one and an id-only set skips unvisited nodes
        stack, seen, consumers = [root], {id(root): root}, []
        while stack:
            node = stack.pop()
            slots = []
            for slot, (child, nr) in enumerate(node.next_functions):
                if child is None:
                    continue
                if child is target and nr == target_nr:
                    slots.append(slot)
                elif id(child) not in seen and child._sequence_nr() > call.first_node:  # inside this forward only
                    seen[id(child)] = child
                    stack.append(child)
            if slots:
                consumers.append((node, tuple(slots)))
        call.consumers = call.left = len(consumers)
        for node, slots in consumers:
            self.hooks.node(node, lambda grads, _, call=call, slots=slots: self._through(call, grads, slots))

    def _through(self, call: EdgeCall, grads, slots) -> None:
        with torch.no_grad():
            for s in slots:
                if grads[s] is not None:
                    if _is_batched(grads[s]):
                        raise _batched_backward(f"edge {self.edges[call.pos].name!r}")
                    g = grads[s].detach()
                    call.through = g if call.through is None else call.through + g
                    self._gather_node(call.cell_call, self.edges[call.pos].src, g)
        call.left -= 1
        if call.left == 0:  # every node reading x_j has run: this backward's J_eᵀ ∂L/∂x_m is complete
            call.left = call.consumers
            self._split(call)
        return None

    def _split(self, call: EdgeCall) -> None:
        """Path parts <J_eᵀ ∂L/∂x_m, O_k(x_i)> of the edges (i, j) ending at the split edge e's source node j."""
        # an edge whose output does not depend on its input passes nothing through
        v = call.through if call.through is not None else torch.zeros_like(call.inp)
        call.through, call.split_done = None, True
        edge = self.edges[call.pos]
        with torch.no_grad():
            for ie in self.incoming.get((edge.cell_index, edge.src), []):
                for icall in call.cell_call.edge_calls.get(ie, []):
                    if icall.outputs is not None:
                        self._check_versions(icall)
                        self._check_shapes(icall, v, edge.src)
                        self.paths[ie].setdefault(edge.name, []).append(
                            (icall.model_call, _costs_with_missing(v, icall.outputs)))

    def _gather_node(self, ccall: Optional[CellCall], node: Optional[int], g: torch.Tensor) -> None:
        if ccall is None or (ccall.pos, node) not in self.pending_nodes:
            return
        prev = ccall.node_grad.get(node)
        ccall.node_grad[node] = g if prev is None or prev.shape != g.shape else prev + g

    def _not_plain_node(self, call: EdgeCall, node: int, what: str) -> ProbeError:
        edge = self.edges[call.pos]
        return ProbeError(
            f"edge {edge.name!r}: path_split needs node {node} of cell {self.cells[edge.cell_index].name!r} to be the "
            f"plain sum of its incoming edges' outputs, x_j = Σ_i edge_ij(x_i), but {what}: the node scales or reshapes "
            "the edge's output (e.g. PC-DARTS's edge normalization β_ij·edge, partial channels, a channel shuffle) or "
            "feeds something besides the cell output and its edges, so the path parts would be wrong. Fold such "
            "factors into the edge's mixing weights, or attach without path_split (costs() do not need it)"
        )

    def _outside_cell(self, call: EdgeCall) -> ProbeError:
        # a gradient reached a forward of the edge that ran while its cell's forward was not running: the path parts
        # (and the "output" part) of that call cannot be tied to a node of the cell, so they would be silently missing
        edge = self.edges[call.pos]
        return ProbeError(
            f"edge {edge.name!r}: path_split needs each edge of cell {self.cells[edge.cell_index].name!r} to run inside "
            "that cell's forward, but the gradient reached a forward of the edge that ran outside it (e.g. recomputed in "
            "the backward by torch.utils.checkpoint(..., use_reentrant=True) around an edge or node inside the cell, or "
            "the edge called without its cell), so its path parts would be missing; checkpoint whole cells or use "
            "use_reentrant=False, or attach without path_split (costs() do not need it)"
        )

    def _check_shapes(self, call: EdgeCall, g: torch.Tensor, node: int) -> None:
        shape = next((tuple(o.shape) for o in call.outputs if o is not None and o.shape != g.shape), None)
        if shape is not None:
            raise self._not_plain_node(call, node, f"the edge's candidate outputs have shape {shape} and the node "
                                                   f"{tuple(g.shape)}")

    def _check_node(self, call: EdgeCall, g: torch.Tensor) -> None:
        """∂L/∂(edge output) must equal the gradient the split gathered at the edge's end node j, as it does when
        x_j = Σ_i edge_ij(x_i) and nothing else reads x_j; checked once per edge."""
        node = self.edges[call.pos].dst
        returned = self.cells_not_tensor.get(call.cell_call.pos)
        not_concat = self.cells_not_concat.get(call.cell_call.pos)
        if not_concat is not None:
            raise ProbeError(
                f"edge {self.edges[call.pos].name!r}: path_split reads each output node's slice of cell "
                f"{self.cells[call.cell_call.pos].name!r}'s output, but that output {not_concat}, so it is not their "
                "concatenation (e.g. their sum, or a 1x1 convolution of it) and has no slice per node; declare output_node_slices for a "
                "concatenation in another layout, or attach without path_split (costs() do not need it)"
            )
        if returned is not None:
            raise ProbeError(
                f"edge {self.edges[call.pos].name!r}: path_split reads the gradient of cell "
                f"{self.cells[call.cell_call.pos].name!r}'s output, but its forward returned {returned}, not the tensor of "
                "its concatenated output nodes; return the cell output tensor from the cell's forward, or attach without "
                "path_split (costs() do not need it)"
            )
        gathered = call.cell_call.node_grad.get(node)
        if gathered is None or gathered.shape != g.shape:
            what = ("no gradient reached the node through the cell output or its edges" if gathered is None else
                    f"the edge's output has shape {tuple(g.shape)} and the node {tuple(gathered.shape)}")
            raise self._not_plain_node(call, node, what)
        with torch.no_grad():
            scale = torch.maximum(g.abs().max(), gathered.abs().max())
            dev = float((g - gathered).abs().max() / scale.clamp(min=1e-30))
        if math.isnan(dev):  # as in _check_weighted_sum: checked at a finite step
            return
        if dev > (1e-2 if g.dtype in (torch.float16, torch.bfloat16) else 1e-4):
            raise self._not_plain_node(call, node, f"∂L/∂(edge output) differs from the gradient gathered at node {node} "
                                                   f"(relative deviation {dev:.3g})")
        self.check_nodes[call.pos] = False

    def finish(self) -> None:
        """End of the block: splits not completed in a backward (some node reading x_j never ran), and the zero
        parts of reached edges whose forward does not read their input at all."""
        for call in self.split_calls:
            if call.through is not None or (call.reached and call.consumers == 0 and not call.split_done):
                self._split(call)

    def cell_grad(self, ccall: CellCall, g: torch.Tensor):
        if ccall.output is None:
            return None
        if _is_batched(g):
            raise _batched_backward(f"the output of cell {self.cells[ccall.pos].name!r}")
        cell = self.cells[ccall.pos]
        out = ccall.output
        slices = cell.output_node_slices or _equal_chunks(cell.output_nodes, out.shape[1])
        with torch.no_grad():
            self._cell_costs(ccall, g, out, slices)
        return None

    def _cell_costs(self, ccall: CellCall, g: torch.Tensor, out: torch.Tensor, slices) -> None:
        node_costs = output_edge_costs(g, out, slices, per_sample=True)
        if out._version != ccall.version:
            # <∂L/∂out, out> needs the output as it left the cell; its values were changed in place since (e.g.
            # out.mul_(2) read back as 2× the cost): not computable, so NaN, flagged at the end of the block
            node_costs = torch.full_like(node_costs, math.nan)
            self.modified_cells.add(ccall.pos)
        self.node_costs[ccall.pos].append((ccall.model_call, node_costs))
        if self.path_split:
            for node, (a, b) in slices.items():
                self._gather_node(ccall, node, g[:, a:b])
                for ie in self.incoming.get((ccall.pos, node), []):
                    for icall in ccall.edge_calls.get(ie, []):
                        if icall.outputs is not None:
                            self._check_shapes(icall, g[:, a:b], node)
                            self.paths[ie].setdefault("output", []).append(
                                (icall.model_call, _costs_with_missing(g[:, a:b], icall.outputs)))

    def release(self) -> None:
        """Drop every captured tensor (the hooks are removed with the block's :class:`Hooks`)."""
        self.open_edge = [None] * len(self.open_edge)
        self.open_cell = [None] * len(self.open_cell)
        self.call_weights = [None] * len(self.call_weights)
        self.split_calls = []
        for ccall in self.cell_calls:  # the cycle cell call -> edge calls -> cell call (path split)
            ccall.edge_calls, ccall.node_grad = {}, {}
        self.cell_calls = []
