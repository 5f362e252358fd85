"""The batched-ops engine: the same supernet function as the per-op modules, in far fewer kernels.

The eager forward (``Cell.forward``) runs one module per candidate op and a Python loop over edges,
about 50 small kernels per edge. Here the edges that leave the same node are computed together, reading
the very parameters and buffers of the per-op modules (so optimizers, ``state_dict``, checkpoints and
``torch.func.functional_call`` see nothing new):

- a *stage* is a set of source nodes whose outgoing edges are computed at once: nodes 0 and 1 (both
  ready when the cell starts), then each intermediate node as soon as it is summed;
- parameter-free ops are computed once per source and shared by its edges: the skip connection, and
  max/avg pooling with its affine-free BatchNorm (same input, hence the same batch statistics; every
  edge's running statistics still get the update its own module would have made);
- ops with weights (a ``ReLU → depthwise conv → 1×1 conv → BN`` chain: ``sep_conv`` is two such
  blocks, ``dil_conv`` one; ``FactorizedReduce`` skips of reduction cells) become one depthwise conv over
  the stacked channels of all edges (groups = edges × C), one batched matrix product for the edges' 1×1
  convs and one BatchNorm over the stacked channels (per channel, so identical to one BN per edge);
- the mixing x_j = Σ_k Z_k O_k(x_i) is one batched matrix product with the stacked (B, m, d, K', C, H, W) outputs;
- the running statistics of every edge BatchNorm live in one flat buffer that the modules' own buffer tensors
  alias (:class:`_RunningStatistics`), so each batched BatchNorm updates them in place;
- optionally (``COLUMN_STREAMS_ON_CUDA``, off: it costs memory), the op columns of a stage run on side CUDA streams.

The cost C = ∂L/∂Z (wiring supplement §2) of a per-cell Z leaf is then the gradient of that one product,
so costs, α-gradients and every statistic built on them are those of the eager path up to float
rounding (checked in float64 in tests/test_engine.py). A forward can keep the intermediate tensors of every
batched call on a tape, from which :mod:`nasdiag.supernet.engine.curvature` runs the mixing-weight curvature
recursion on the same batched calls.

The engine applies to supernets built of those op structures (the DARTS primitives, order
``relu-conv-bn``, BatchNorm), in training mode (every module of the cells too), with (E, K) mixing weights
shared by the batch, no active-ops mask, no hooks on the cells' modules and no ``torch.func`` transform running: anything else
runs on the eager modules (:func:`fast_forward` returns None and says why).
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hooks import has_module_hooks
from nasdiag.supernet.ops import FactorizedReduce, Zero

ENGINES = ("auto", "fast", "eager")


class EngineWarning(UserWarning):
    """The fast engine was asked for but this forward runs on the eager modules (the message says why)."""


# -- structure of the candidate ops ---------------------------------------------------------------------

@dataclass
class _Column:
    """One candidate op k at every edge of a stage.

    kind: ``"zero"``, ``"identity"``, ``"pool"`` (parameter-free, shared per source), ``"chain"``
    (ReLU → depthwise → 1×1 → BN blocks) or ``"factorized"`` (per-edge weights).
    modules: the op module of each stage position.
    """

    k: int
    kind: str
    modules: List[nn.Module]
    signature: tuple
    blocks: List[List[nn.Sequential]] = field(default_factory=list)  # chain: per depth, the block of each position
    norms: List["_Norm"] = field(default_factory=list)  # its BatchNorm calls, in the order they run


def _bn_signature(bn: nn.Module) -> Optional[tuple]:
    if type(bn) is not nn.BatchNorm2d or not bn.track_running_stats or bn.momentum is None:
        return None
    return ("bn", bn.eps, bn.momentum, bn.affine)


def _conv_signature(conv: nn.Module) -> Optional[tuple]:
    if type(conv) is not nn.Conv2d or conv.bias is not None or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return None
    return ("conv", conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups)


def _chain_blocks(op: nn.Module) -> Optional[List[nn.Sequential]]:
    """The ReLU → depthwise conv → 1×1 conv → BN blocks of ``op`` (``dil_conv``: one, ``sep_conv``: two), or None."""
    blocks = list(op) if type(op) is nn.Sequential and all(type(b) is nn.Sequential for b in op) else [op]
    for b in blocks:
        if not (type(b) is nn.Sequential and len(b) == 4 and type(b[0]) is nn.ReLU and not b[0].inplace):
            return None
        dw, pw = b[1], b[2]
        if _conv_signature(dw) is None or _conv_signature(pw) is None or _bn_signature(b[3]) is None:
            return None
        if dw.groups != dw.in_channels or dw.out_channels != dw.in_channels or pw.kernel_size != (1, 1) or pw.groups != 1 \
                or pw.stride != (1, 1) or pw.padding != (0, 0) or pw.in_channels != dw.out_channels \
                or b[3].num_features != pw.out_channels:
            return None
    return blocks


def _own_forward(op: nn.Module) -> bool:
    """Whether a module of ``op`` has a forward set on the instance (``module.forward = ...``): the engine computes
    what the module classes it recognises compute, which such a forward may not."""
    return any("forward" in vars(m) for m in op.modules())


def _classify(op: nn.Module, stride: int) -> Tuple[Optional[str], tuple]:
    """(kind, signature) of one candidate op; kind None when the engine does not know its structure. Types are
    matched exactly: a subclass (an ``nn.Sequential`` whose forward adds a residual) computes something else."""
    if _own_forward(op):
        return None, ()
    if type(op) is Zero:
        return "zero", ("zero", op.stride)
    if type(op) is nn.Identity:
        return ("identity", ("identity",)) if stride == 1 else (None, ())
    if type(op) is FactorizedReduce:
        # the batched call is F.relu and two 1×1 convs of stride 2, no padding: a module swapped in for the ReLU (a
        # LeakyReLU, an in-place one) or a conv of another shape computes something else (was 0.07 off, silently)
        sig = (_conv_signature(op.conv_1), _conv_signature(op.conv_2), _bn_signature(op.norm))
        if op.order != "relu-conv-bn" or None in sig or type(op.relu) is not nn.ReLU or op.relu.inplace \
                or any(c.kernel_size != (1, 1) or c.stride != (2, 2) or c.padding != (0, 0) or c.dilation != (1, 1)
                       or c.groups != 1 for c in (op.conv_1, op.conv_2)):
            return None, ()
        return "factorized", ("factorized",) + sig
    if type(op) is nn.Sequential and len(op) == 2 and type(op[0]) in (nn.MaxPool2d, nn.AvgPool2d):
        p, bn = op[0], op[1]
        if _bn_signature(bn) is None or bn.affine or getattr(p, "ceil_mode", False):
            return None, ()
        if type(p) is nn.MaxPool2d:
            if p.dilation not in (1, (1, 1)) or p.return_indices:
                return None, ()
            sig = ("max", p.kernel_size, p.stride, p.padding)
        else:
            if p.divisor_override is not None:
                return None, ()
            sig = ("avg", p.kernel_size, p.stride, p.padding, p.count_include_pad)
        return "pool", ("pool",) + sig + _bn_signature(bn)
    blocks = _chain_blocks(op)
    if blocks is not None:
        return "chain", ("chain",) + tuple((_conv_signature(b[1]), _conv_signature(b[2]), _bn_signature(b[3])) for b in blocks)
    return None, ()


@dataclass
class _Norm:
    """One BatchNorm call of the engine: the BatchNorms of a column's edges, over their stacked channels.

    A chain depth or a ``FactorizedReduce`` column normalizes (B, n·C, H, W) with one module per edge
    (``shared`` False). A pool column normalizes the m sources' (B, m·C, H', W') once and gives each of
    the d edges per source the running-statistic update its own module would make (``shared`` True).
    ``stats`` and ``scratch`` are set by :class:`_RunningStatistics` while the modules are linked to it.
    """

    modules: List[nn.Module]  # source-major, as the stacked channels
    sources: int  # m
    shared: bool
    stats: Optional[torch.Tensor] = None  # (2, n·C): every module's running mean (row 0) and var (row 1), aliased
    scratch: Optional[torch.Tensor] = None  # shared only: (2, m·C) batch mean and unbiased var of the last call

    @property
    def channels(self) -> int:
        """Channels of the normalized tensor (the width of ``weight``/``bias`` of the call)."""
        C = self.modules[0].num_features
        return self.sources * C if self.shared else len(self.modules) * C


@dataclass
class _Stage:
    """Source nodes whose outgoing edges are computed together (same number d of edges from each)."""

    sources: Tuple[int, ...]
    degree: int
    positions: List[int]  # edge index (Cell.edge_nodes order) of each position, source-major
    dests: List[int]  # destination node of each position
    columns: List[_Column]  # ops that contribute (the zero op is left out: its output is 0; see zero_index)
    z_index: List[int] = field(default_factory=list)  # flat index into Z (E·K) of each (position, column)
    zero_index: List[int] = field(default_factory=list)  # the same of each (position, zero op)
    _device_index: Dict[tuple, torch.Tensor] = field(default_factory=dict)
    _unit: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def z_index_on(self, device: torch.device, zero: bool = False) -> torch.Tensor:
        """``z_index`` (or, with ``zero``, ``zero_index``) as a tensor on ``device``."""
        # Cached per device: building it inside a CUDA-graph capture would be a pageable host copy.
        idx = self._device_index.get((device, zero))
        if idx is None:
            idx = torch.tensor(self.zero_index if zero else self.z_index, dtype=torch.long, device=device)
            # one made under a torch.func transform is a wrapper of that call: reusing it later (or deep-copying
            # the network) fails with "Cannot access storage of TensorWrapper", so it is not cached; nor is an
            # inference tensor (inference mode), which autograd refuses to save later
            if torch._C._functorch.peek_interpreter_stack() is None and not torch.is_inference_mode_enabled():
                self._device_index[(device, zero)] = idx
        return idx

    def unit_affine(self, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """A unit scale and zero shift wide enough for every affine-free BatchNorm call of the stage (sliced
        per call), made once per device and dtype, not per call."""
        key = (like.device, like.dtype)
        unit = self._unit.get(key)
        if unit is None:
            width = max((norm.channels for col in self.columns for norm in col.norms), default=1)
            unit = like.new_ones(width), like.new_zeros(width)
            if _may_keep(like):
                self._unit[key] = unit
        return unit


def _may_keep(t: torch.Tensor) -> bool:
    """Whether a tensor made now may be kept across calls: not one made inside a CUDA-graph capture (its memory
    belongs to the graph's pool), under inference mode or by a torch.func transform (a wrapper of that call)."""
    if torch.is_inference_mode_enabled() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


@dataclass
class CellPlan:
    stages: List[_Stage]
    num_ops: int

    @property
    def norms(self) -> List[_Norm]:
        return [norm for stage in self.stages for col in stage.columns for norm in col.norms]


class Unsupported(Exception):
    """The supernet has a structure the fast engine does not batch (the message says what)."""


def plan_cell(cell: nn.Module) -> CellPlan:
    """Group a nasdiag :class:`~nasdiag.supernet.Cell`'s edges into stages and its ops into batched columns.

    Raises:
        Unsupported: a cell or mixed op with a forward of its own (a subclass's, or one set on the instance: the
            engine computes ``Cell.forward`` and ``MixedOp.forward``), an op whose structure the engine does not know,
            or ops of one column that differ.
    """
    from nasdiag.supernet.cell import Cell
    from nasdiag.supernet.mixed import MixedOp

    for module, base, what in [(cell, Cell, "cell")] + [(e, MixedOp, "mixed op") for e in cell.edges]:
        if getattr(type(module), "forward", None) is not base.forward or "forward" in vars(module):
            raise Unsupported(f"a {what} of type {type(module).__name__} has a forward of its own (the engine batches "
                              f"{base.__name__}.forward)")
    edges = list(cell.edges)
    nodes = list(cell.edge_nodes)
    K = len(edges[0].ops)
    if any(len(e.ops) != K for e in edges):
        raise Unsupported("edges with different numbers of candidate ops")
    out_edges: Dict[int, List[int]] = {}
    for e, (i, _) in enumerate(nodes):
        out_edges.setdefault(i, []).append(e)
    groups = [(0, 1)] + [(n,) for n in range(2, 2 + cell.steps) if n in out_edges]
    stages = []
    for sources in groups:
        sources = tuple(s for s in sources if s in out_edges)
        if not sources:
            continue
        degrees = {len(out_edges[s]) for s in sources}
        if len(degrees) != 1:
            sources_list = [(s,) for s in sources]
        else:
            sources_list = [sources]
        for srcs in sources_list:
            positions = [e for s in srcs for e in out_edges[s]]
            strides = {edges[e].stride for e in positions}
            if len(strides) != 1:
                raise Unsupported("edges of one source node with different strides")
            stride = strides.pop()
            columns, zeros = [], []
            for k in range(K):
                mods = [edges[e].ops[k] for e in positions]
                kinds = [_classify(m, stride) for m in mods]
                kind, sig = kinds[0]
                if kind is None:
                    raise Unsupported(f"candidate op {edges[positions[0]].primitives[k]!r} ({type(mods[0]).__name__}) "
                                      "has a structure the fast engine does not batch")
                if any(kk != (kind, sig) for kk in kinds):
                    raise Unsupported(f"candidate op {edges[positions[0]].primitives[k]!r} differs between edges")
                if kind != "zero":
                    columns.append(_column(k, kind, mods, sig, len(srcs)))
                else:
                    zeros.append(k)
            if not columns:  # torch.stack of no columns: "stack expects a non-empty TensorList" at the forward
                raise Unsupported("every candidate op is 'none' (a stage with nothing to batch)")
            stage = _Stage(srcs, len(out_edges[srcs[0]]), positions, [nodes[e][1] for e in positions], columns)
            stage.z_index = [e * K + c.k for e in positions for c in columns]
            stage.zero_index = [e * K + k for e in positions for k in zeros]
            stages.append(stage)
    return CellPlan(stages, K)


def _column(k: int, kind: str, mods: List[nn.Module], signature: tuple, sources: int) -> _Column:
    col = _Column(k, kind, mods, signature)
    if kind == "chain":
        per_edge = [_chain_blocks(op) for op in mods]
        col.blocks = [[bl[depth] for bl in per_edge] for depth in range(len(per_edge[0]))]
        col.norms = [_Norm([b[3] for b in blocks], sources, shared=False) for blocks in col.blocks]
    elif kind == "factorized":
        col.norms = [_Norm([op.norm for op in mods], sources, shared=False)]
    elif kind == "pool":
        col.norms = [_Norm([op[1] for op in mods], sources, shared=True)]
    return col


# -- running statistics ---------------------------------------------------------------------------------

def _buffer_getter(buffers: dict) -> tuple:
    return buffers.get("running_mean"), buffers.get("running_var"), buffers.get("num_batches_tracked")


class _RunningStatistics:
    """The running statistics of every BatchNorm the engine calls, in one flat buffer the modules' buffers alias.

    Linking copies each module's ``running_mean``/``running_var`` into one float tensor (per :class:`_Norm`: the
    means of its modules, then their variances, so that ``norm.stats`` is a (2, n·C) tensor on it) and its
    ``num_batches_tracked`` into one int64 tensor, and points the modules' own buffer tensors at their slots
    (``Tensor.set_``: the tensor objects stay, so ``state_dict``, eval-mode and eager forwards, optimizers,
    DDP's buffer list and a caller holding the buffer tensors themselves see the same values). A BatchNorm call
    of the engine then updates every module in place (no gather/scatter), and the step counters are one
    ``add_`` per forward. Tensors that merely shared the old memory (a ``state_dict()``, ``.detach()`` or
    ``.data`` taken before the first fast forward) keep the values of that moment. Since all statistics share
    one storage, ``torch.save`` of a single buffer or one cell's ``state_dict`` writes the whole buffer (the
    values loaded back are right).

    Before each fast forward :meth:`ensure_linked` checks on the host that every module buffer still lies at
    its slot. Tensors put in by the user for good (``.to()``, ``load_state_dict(assign=True)``, assignment)
    are linked anew from their current values; while the linked tensors are still alive elsewhere, the
    modules hold temporary stand-ins (``torch.func.functional_call`` with buffers, a Hessian's scratch
    copies), so that call gathers and scatters per BatchNorm as the modules would update the stand-ins.
    (A caller that keeps the old buffer tensors alive after a ``.to()`` therefore keeps the engine on that
    slower, equally exact path until it drops them.)
    Nothing is linked inside a CUDA-graph capture, under inference mode or a torch.func transform.
    """

    def __init__(self, norms: List[_Norm]):
        self.norms = norms
        self.modules = [m for norm in norms for m in norm.modules]
        self.flat: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None
        self._slots: List[Tuple[int, int]] = []  # per buffer of buffers(): (0: flat / 1: counts, element offset)
        self._expected: List[int] = []
        self._expected_for: Optional[tuple] = None
        self._linked: Optional[List[weakref.ref]] = None

    def __getstate__(self):  # deepcopy / pickle: weak references neither copy nor pickle; pointers are recomputed
        state = dict(self.__dict__)
        state.update(_linked=None, _expected_for=None, _expected=[])
        return state

    def buffers(self) -> List[Optional[torch.Tensor]]:
        """Every module's running mean, running variance and step counter (None where one is missing)."""
        get = _buffer_getter
        return [t for m in self.modules for t in get(m._buffers)]

    def ensure_linked(self) -> bool:
        """True when every module's statistics alias the flat buffers (linking them now if allowed)."""
        if not self.modules:
            return True
        current = self.buffers()
        if self._is_linked(current):
            return True
        if not self._may_link(current):
            return False
        self._link(current)
        return True

    def _is_linked(self, current: List[Optional[torch.Tensor]]) -> bool:
        if self.flat is None:
            return False
        bases = (self.flat.data_ptr(), self.counts.data_ptr())
        if self._expected_for != bases:
            sizes = (self.flat.element_size(), self.counts.element_size())
            self._expected = [bases[which] + offset * sizes[which] for which, offset in self._slots]
            self._expected_for = bases
        try:
            return list(map(torch.Tensor.data_ptr, current)) == self._expected  # ~0.4 ms for 900 BatchNorms
        except TypeError:  # a buffer is None
            return False

    def _may_link(self, current: List[Optional[torch.Tensor]]) -> bool:
        if any(t is None or t.requires_grad or t.is_inference() for t in current):
            return False
        stats, counts = current[0::3] + current[1::3], current[2::3]
        for group in (stats, counts):
            if any(t.dtype != group[0].dtype or t.device != group[0].device for t in group):
                return False
        if any(t.dim() != 1 for t in stats) or any(t.dim() != 0 for t in counts) or not _may_keep(current[0]):
            return False
        if self._linked is not None:  # linked tensors alive but out of the modules: a temporary swap
            for ref, t in zip(self._linked, current):
                old = ref()
                if old is not None and old is not t:
                    return False
        return True

    def _link(self, current: List[torch.Tensor]) -> None:
        by_module = {id(m): current[3 * i:3 * i + 3] for i, m in enumerate(self.modules)}
        like = current[0]
        parts, slots, placed = [], {}, 0
        rows: List[Tuple[int, int]] = []  # per norm: (offset of its means row, row pitch)
        for norm in self.norms:
            pitch = _aligned(len(norm.modules) * norm.modules[0].num_features)
            rows.append((placed, pitch))
            for row in (0, 1):  # running means, then running variances, each row starting aligned
                start = placed
                for m in norm.modules:
                    t = by_module[id(m)][row]
                    parts.append(t.reshape(-1))
                    slots[(id(m), row)] = placed
                    placed += t.numel()
                parts.append(like.new_zeros(start + pitch - placed))
                placed = start + pitch
        scratch_rows = []
        for norm in self.norms:
            if norm.shared:
                scratch_rows.append((placed, _aligned(norm.channels)))
                placed += 2 * scratch_rows[-1][1]
        with torch.no_grad():
            flat = torch.cat(parts + [like.new_zeros(placed - sum(p.numel() for p in parts))])
            counts = torch.stack([by_module[id(m)][2] for m in self.modules])
            store, count_store = flat.untyped_storage(), counts.untyped_storage()
            preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
            # Re-pointing a buffer is an in-place change of that tensor to autograd; its values are the same, and a
            # graph that saved it (BatchNorm saves its running statistics) must stay usable, as after the
            # (unversioned) in-place update of BatchNorm itself.
            with (preserve(tuple(current)) if preserve is not None else nullcontext()):
                for i, m in enumerate(self.modules):
                    rm, rv, nbt = current[3 * i:3 * i + 3]
                    rm.set_(store, slots[(id(m), 0)], rm.shape, (1,))
                    rv.set_(store, slots[(id(m), 1)], rv.shape, (1,))
                    nbt.set_(count_store, i, (), ())
        self._slots = [s for i, m in enumerate(self.modules) for s in ((0, slots[(id(m), 0)]), (0, slots[(id(m), 1)]), (1, i))]
        scratch_rows.reverse()
        for norm, (offset, pitch) in zip(self.norms, rows):
            norm.stats = _alias(flat, offset, (2, len(norm.modules) * norm.modules[0].num_features), pitch)
            if norm.shared:
                offset, pitch = scratch_rows.pop()
                norm.scratch = _alias(flat, offset, (2, norm.channels), pitch)
        self.flat, self.counts = flat, counts
        self._expected_for = None
        self._linked = [weakref.ref(t) for t in current]


def _aligned(numel: int) -> int:
    """``numel`` rounded up to a multiple of 32 elements, so that every row of statistics a kernel reads starts
    as aligned as a tensor of its own (128 bytes in float32)."""
    return -(-numel // 32) * 32


def _alias(flat: torch.Tensor, offset: int, shape: Tuple[int, int], pitch: int) -> torch.Tensor:
    """A (rows, cols) tensor on ``flat``'s memory from element ``offset``, rows ``pitch`` elements apart, that is
    not an autograd view of it: it has a version counter of its own, so the in-place update of one BatchNorm's
    statistics does not invalidate the running statistics another BatchNorm call saved for its backward."""
    alias = flat.new_empty(0)
    with torch.no_grad():
        alias.set_(flat.untyped_storage(), offset, shape, (pitch, 1))
    return alias


# -- batched computation --------------------------------------------------------------------------------

#: Give affine-free BatchNorms a unit scale and zero shift on CUDA (the same function: x̂·1 + 0), which lets
#: torch pick cuDNN's kernels for float32 instead of its native ones: 125.1 -> 117.7 ms per graphed DARTS
#: iteration on an H200 (BENCHMARKS.md, "Search engine", measures both). The scale gets no gradient.
UNIT_AFFINE_ON_CUDA = True

#: Run the op columns of a stage (sep/dil chains, pools, factorized reductions) on side CUDA streams of their
#: own, so that their small kernels overlap (in a CUDA-graph capture they become parallel branches; autograd
#: runs each column's backward on its stream too). CPU forwards are not affected. Off by default: tensors
#: shared between streams are ``record_stream``-ed, and inside a capture the allocator keeps their memory until
#: the capture ends. Measured on an H200 (BENCHMARKS.md, "Search engine", run 6): the graphed DARTS iteration
#: 102.8 → 83.9 ms, its peak memory 7.00 → 14.15 GiB (the eager reference's: 7.61 GiB). Set it to True
#: where memory is plentiful.
COLUMN_STREAMS_ON_CUDA = False


@dataclass
class _Run:
    """How one fast forward runs: statistics linked (else gathered per call), unit affine, column streams, and
    an optional ``tape`` that keeps the intermediate tensors a curvature recursion needs
    (:mod:`nasdiag.supernet.engine.curvature`): ``tape.keep(owner, name, tensor)`` for the stage and column
    tensors, ``tape.preprocess(module, x)`` to run a cell's preprocessing."""

    linked: bool
    unit_affine: bool
    streams: Optional[List["torch.cuda.Stream"]]
    tape: Optional[object] = None

    def keep(self, owner, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.tape is not None:
            self.tape.keep(owner, name, t)
        return t


class _StreamPool:
    """Side streams per device for the op columns, kept on the network (``__dict__``), never copied or pickled."""

    def __init__(self):
        self.by_device: Dict[torch.device, list] = {}

    def __deepcopy__(self, memo):
        return _StreamPool()

    def __getstate__(self):
        return {"by_device": {}}

    def get(self, device: torch.device, count: int) -> list:
        streams = self.by_device.setdefault(device, [])
        while len(streams) < count:
            streams.append(torch.cuda.Stream(device=device))
        return streams


def _gather_bn(bns: Sequence[nn.Module]):
    rm = torch.cat([b.running_mean for b in bns])
    rv = torch.cat([b.running_var for b in bns])
    return rm, rv


def _affine(y: torch.Tensor, norm: _Norm, unit: Optional[Tuple[torch.Tensor, torch.Tensor]]):
    """(weight, bias) of a BatchNorm call: the modules' own, or a unit scale and zero shift (``unit``), or None."""
    bns = norm.modules
    if bns[0].affine:
        return torch.cat([b.weight for b in bns]), torch.cat([b.bias for b in bns])
    if unit is None:
        return None, None
    ones, zeros = unit
    if ones.dtype != y.dtype:  # e.g. autocast: the stage input and the normalized tensor differ in dtype
        return y.new_ones(norm.channels), y.new_zeros(norm.channels)
    return ones[:norm.channels], zeros[:norm.channels]


def _batch_norm(y: torch.Tensor, norm: _Norm, run: _Run, unit) -> torch.Tensor:
    """BatchNorm of the stacked channels of ``len(norm.modules)`` edges, updating each module's running statistics."""
    bns = norm.modules
    rm, rv = (norm.stats[0], norm.stats[1]) if run.linked else _gather_bn(bns)
    w, b = _affine(y, norm, unit)
    out = F.batch_norm(y, rm, rv, w, b, True, bns[0].momentum, bns[0].eps)
    if not run.linked:
        with torch.no_grad():
            n = bns[0].num_features
            torch._foreach_copy_([m.running_mean for m in bns], list(rm.split(n)))
            torch._foreach_copy_([m.running_var for m in bns], list(rv.split(n)))
            torch._foreach_add_([m.num_batches_tracked for m in bns], 1)
    return out


def _shared_batch_norm(y: torch.Tensor, norm: _Norm, run: _Run, unit) -> torch.Tensor:
    """BatchNorm of a parameter-free op output ``y`` (B, m·C, H, W) shared by the d edges of each of m sources.

    Every edge of a source normalizes the same tensor, so the output is computed once; each edge's module
    gets the running-statistic update ``r ← (1 − momentum)·r + momentum·stat`` it would have made itself,
    with the batch mean and unbiased variance that the one BatchNorm call leaves in scratch running buffers
    (momentum 1: they become the batch statistics; no second pass over ``y``).
    """
    bns = norm.modules
    first, m = bns[0], norm.sources
    C, d = first.num_features, len(bns) // norm.sources
    scratch = norm.scratch if run.linked else first.running_mean.new_zeros(2, m * C)
    w, b = _affine(y, norm, unit)
    out = F.batch_norm(y, scratch[0], scratch[1], w, b, True, 1.0, first.eps)
    mom = first.momentum
    with torch.no_grad():
        if run.linked:
            norm.stats.view(2, m, d, C).mul_(1 - mom).add_(scratch.view(2, m, 1, C), alpha=mom)
        else:
            mods = [mod.running_mean for mod in bns] + [mod.running_var for mod in bns]
            stat = [scratch[row, (i // d) * C:(i // d + 1) * C] for row in (0, 1) for i in range(len(bns))]
            torch._foreach_mul_(mods, 1 - mom)
            torch._foreach_add_(mods, stat, alpha=mom)
            torch._foreach_add_([mod.num_batches_tracked for mod in bns], 1)
    return out


def _pool(X: torch.Tensor, op: nn.Sequential) -> torch.Tensor:
    p = op[0]
    if type(p) is nn.MaxPool2d:
        return F.max_pool2d(X, p.kernel_size, p.stride, p.padding)
    return F.avg_pool2d(X, p.kernel_size, p.stride, p.padding, count_include_pad=p.count_include_pad)


def _chain(rr: torch.Tensor, col: _Column, n: int, run: _Run, unit) -> torch.Tensor:
    """ReLU → depthwise → 1×1 → BN blocks of n edges at once; ``rr`` (B, n·C, H, W) = ReLU(input) per edge."""
    y = rr
    for depth, (blocks, norm) in enumerate(zip(col.blocks, col.norms)):
        dw = blocks[0][1]
        if depth > 0:
            y = F.relu(y)
        run.keep(col, "relu_out", y)
        w_dw = torch.cat([b[1].weight for b in blocks])  # (n·C, 1, k, k)
        y = run.keep(col, "dw_out", F.conv2d(y, w_dw, None, dw.stride, dw.padding, dw.dilation, groups=w_dw.shape[0]))
        # The n edges' 1×1 convs as one batched matrix product over (batch, edge): a grouped cuDNN conv
        # spent most of its time transposing layouts (measured on an H200, BENCHMARKS.md).
        w_pw = torch.stack([b[2].weight.flatten(1) for b in blocks])  # (n, C_out, C)
        B, _, H, W = y.shape
        y = run.keep(col, "bn_in", torch.matmul(w_pw, y.view(B, n, -1, H * W)).view(B, -1, H, W))
        y = run.keep(col, "bn_out", _batch_norm(y, norm, run, unit))
    return y


def _factorized(r: torch.Tensor, col: _Column, m: int, n: int, run: _Run, unit) -> torch.Tensor:
    """``FactorizedReduce`` of n edges (d per source) from r = ReLU(X), X (B, m·C, H, W)."""
    ops = col.modules
    shifted = r[:, :, 1:, 1:]
    if r.shape[-1] % 2 or r.shape[-2] % 2:
        shifted = F.pad(shifted, (0, r.shape[-1] % 2, 0, r.shape[-2] % 2))
    w1 = torch.cat([op.conv_1.weight for op in ops])  # (n·C/2, C, 1, 1), source-major: groups = m
    w2 = torch.cat([op.conv_2.weight for op in ops])
    o1 = F.conv2d(r, w1, None, 2, 0, 1, groups=m)
    o2 = F.conv2d(run.keep(col, "shifted", shifted), w2, None, 2, 0, 1, groups=m)
    B, _, H, W = o1.shape
    half = ops[0].conv_1.out_channels
    y = torch.stack([o1.view(B, n, half, H, W), o2.view(B, n, half, H, W)], dim=2).view(B, n * 2 * half, H, W)
    for name, t in (("o1", o1), ("o2", o2), ("bn_in", y)):
        run.keep(col, name, t)
    return run.keep(col, "bn_out", _batch_norm(y, col.norms[0], run, unit))


def _column_output(col: _Column, X: torch.Tensor, r, rr, m: int, d: int, run: _Run, unit) -> torch.Tensor:
    """Outputs (B, m, d, C, H', W') of one op column at every edge of a stage."""
    B, mC, H, W = X.shape
    C = mC // m
    if col.kind == "identity":
        return X.view(B, m, 1, C, H, W).expand(B, m, d, C, H, W)
    if col.kind == "pool":
        pooled = run.keep(col, "bn_in", _pool(X, col.modules[0]))
        p = run.keep(col, "bn_out", _shared_batch_norm(pooled, col.norms[0], run, unit))
        return p.view(B, m, 1, C, *p.shape[-2:]).expand(B, m, d, C, *p.shape[-2:])
    y = _chain(rr, col, m * d, run, unit) if col.kind == "chain" else _factorized(r, col, m, m * d, run, unit)
    return y.view(B, m, d, C, *y.shape[-2:])


def _stage_outputs(stage: _Stage, X: torch.Tensor, Z: torch.Tensor, run: _Run) -> torch.Tensor:
    """Mixed outputs (B, m, d, C, H', W') of every edge of a stage.

    Args:
        X: (B, m·C, H, W), the m source nodes concatenated along channels.
        Z: (E·K,) the cell's mixing weights, flattened.
    """
    m, d = len(stage.sources), stage.degree
    n = m * d
    B, mC, H, W = X.shape
    C = mC // m
    kinds = {col.kind for col in stage.columns}
    r = F.relu(X) if kinds & {"chain", "factorized"} else None
    # ReLU(input) once per edge: the depthwise convs differ per edge
    rr = r.view(B, m, 1, C, H, W).expand(B, m, d, C, H, W).reshape(B, n * C, H, W) if "chain" in kinds else None
    unit = stage.unit_affine(X) if run.unit_affine else None
    if run.streams is None:
        outs = [_column_output(col, X, r, rr, m, d, run, unit) for col in stage.columns]
    else:
        outs = _column_outputs_on_streams(stage, X, r, rr, m, d, run, unit)
    stacked = torch.stack(outs, dim=3)  # (B, m, d, K', C, H', W')
    Hp, Wp = stacked.shape[-2:]
    # Σ_k Z_k O_k as one batched (1 × K')·(K' × C·H'·W') product per (sample, edge): one pass over the op
    # outputs forward and one per gradient backward, where a broadcast product and a sum make several.
    z = Z.index_select(0, stage.z_index_on(Z.device)).view(n, 1, len(outs))
    if stage.zero_index:
        # the zero op's term Z_k·0 of each edge, added to its other weights: + 0, or NaN where the zero op's weight is
        # NaN or inf, as in the eager sum (left out, a non-finite weight of 'none' alone gave a finite output where the
        # eager one is NaN); no host read, and ∂L/∂Z of the zero op stays 0 where ∂L/∂z is finite
        z = z + Z.index_select(0, stage.z_index_on(Z.device, zero=True)).view(n, 1, -1).mul(0).sum(-1, keepdim=True)
    out = torch.matmul(z, stacked.view(B, n, len(outs), -1)).view(B, m, d, C, Hp, Wp)
    if run.tape is not None:
        for name, t in (("X", X), ("r", r), ("stacked", stacked), ("z", z), ("out", out)):
            run.keep(stage, name, t)
    return out


def _column_outputs_on_streams(stage: _Stage, X: torch.Tensor, r, rr, m: int, d: int, run: _Run, unit) -> List[torch.Tensor]:
    """The columns of a stage, each on its own side stream forked from and joined back to the current one.

    Tensors made on the current stream and read on a side stream (X, r, rr, the unit affine) are recorded on
    that stream, and each column's output on the current stream, so the caching allocator does not hand
    their memory out while the other stream may still use it (forward or backward).
    """
    main = torch.cuda.current_stream(X.device)
    shared_inputs = [t for t in (X, r, rr) + tuple(unit or ()) if t is not None]
    outs, forked = [], []
    for col, side in zip(stage.columns, run.streams):
        if col.kind == "identity":  # a view of X: nothing to compute
            outs.append(_column_output(col, X, r, rr, m, d, run, unit))
            continue
        side.wait_stream(main)
        with torch.cuda.stream(side):
            y = _column_output(col, X, r, rr, m, d, run, unit)
        for t in shared_inputs:
            t.record_stream(side)
        outs.append(y)
        forked.append((side, y))
    for side, y in forked:
        main.wait_stream(side)
        y.record_stream(main)
    return outs


def cell_forward(cell: nn.Module, plan: CellPlan, s0: torch.Tensor, s1: torch.Tensor, weights: torch.Tensor,
                 run: Optional[_Run] = None) -> torch.Tensor:
    """The batched equivalent of ``Cell.forward(s0, s1, weights)`` for (E, K) weights (``run``: how, see
    :func:`fast_forward`; default: statistics gathered per BatchNorm call, no streams)."""
    if run is None:
        run = _Run(linked=False, unit_affine=UNIT_AFFINE_ON_CUDA and s1.is_cuda, streams=None)
    if run.tape is None:
        states: Dict[int, torch.Tensor] = {0: cell.preprocess0(s0), 1: cell.preprocess1(s1)}
    else:
        states = {0: run.tape.preprocess(cell.preprocess0, s0), 1: run.tape.preprocess(cell.preprocess1, s1)}
    partial: Dict[int, List[torch.Tensor]] = {}
    Z = weights.reshape(-1)
    last = 1 + cell.steps
    for stage in plan.stages:
        for node in range(2, 2 + cell.steps):  # sum the nodes this stage reads (all their sources are done)
            if node in stage.sources and node not in states:
                states[node] = _sum(partial.pop(node))
        X = states[stage.sources[0]] if len(stage.sources) == 1 else torch.cat([states[s] for s in stage.sources], dim=1)
        out = _stage_outputs(stage, X, Z, run)  # (B, m, d, C, H', W')
        # One unbind, not a select per edge: its backward stacks the edges' gradients in one kernel, where each
        # select's backward fills a zero tensor of the whole output, copies its slice in, and autograd sums them.
        for dest, term in zip(stage.dests, out.flatten(1, 2).unbind(1)):
            partial.setdefault(dest, []).append(term)
    for node in range(2, last + 1):
        if node not in states:
            states[node] = _sum(partial.pop(node))
    return torch.cat([states[n] for n in cell.output_nodes], dim=1)


def _sum(terms: List[torch.Tensor]) -> torch.Tensor:
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


# -- dispatch -------------------------------------------------------------------------------------------

def _cell_modules_hooked(net: nn.Module) -> bool:
    return has_module_hooks(net.__dict__["_fast_plans"][2])


def _fingerprint(net: nn.Module) -> tuple:
    # Identities of every cell and candidate op: a module swapped in after the plan was built (a custom op,
    # a wrapped edge) must not be computed by the plan of the old one.
    return tuple(id(op) for cell in net.cells for edge in cell.edges for op in edge.ops) + tuple(map(id, net.cells))


def _children(net: nn.Module) -> tuple:
    # The child dicts of every module in the cells and their modules: a module swapped in *inside* a candidate op
    # (an op's BatchNorm or conv replaced, nn.SyncBatchNorm.convert_sync_batchnorm) keeps the op's identity, and the
    # plan, which holds the old module, computed with it (the new one's eps, weights, hooks and buffers unseen).
    # And every BatchNorm's eps and momentum: a batched call reads its first module's, and edges that differ in them
    # are not batched together (the plan says so), but a value set on some modules after the plan was built was
    # silently the first module's for all of them
    mods = [m for cell in net.cells for m in cell.modules()]
    dicts = [m._modules for m in mods if m._modules]
    bns = [m for m in mods if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return dicts, list(map(tuple, map(dict.values, dicts))), bns, [(m.eps, m.momentum) for m in bns]


def _children_replaced(cached: tuple) -> bool:
    dicts, children, bns, settings = cached[4]
    return list(map(tuple, map(dict.values, dicts))) != children or [(m.eps, m.momentum) for m in bns] != settings


_GENERATIONS = itertools.count()


def plan_key(net: nn.Module) -> Hashable:
    """What a step captured as a CUDA graph bakes in of the engine (a part of its state key): the plan in use (a new
    one when a cell, op, module inside an op, or a BatchNorm's eps or momentum changes) and whether hooks on the
    cells' modules send the forwards to the eager modules. None before the first forward or for another supernet."""
    if "_fast_plans" not in net.__dict__:
        return None
    try:
        _plans(net)
    except Unsupported as exc:
        return str(exc)
    return net.__dict__["_fast_plans"][5], _cell_modules_hooked(net)


def _plans(net: nn.Module) -> List[CellPlan]:
    """Cell plans, cached outside the module tree and rebuilt when a cell, op or module inside an op is replaced or
    a BatchNorm's eps or momentum is set; raises :class:`Unsupported`."""
    fingerprint = _fingerprint(net)
    cached = net.__dict__.get("_fast_plans")
    if cached is None or cached[0] != fingerprint or _children_replaced(cached):
        try:
            plans = [plan_cell(cell) for cell in net.cells]
            statistics = _RunningStatistics([norm for plan in plans for norm in plan.norms])
        except Unsupported as exc:
            plans, statistics = str(exc), None  # the reason only: a kept exception's traceback keeps its frames alive
        cached = net.__dict__["_fast_plans"] = (fingerprint, plans, [m for cell in net.cells for m in cell.modules()],
                                                statistics, _children(net), next(_GENERATIONS))
    if isinstance(cached[1], str):
        # a new exception per call: raising one object again chains each raise's frames (the forward's batch and
        # graph) onto its traceback, which then grew by a step's tensors at every forward
        raise Unsupported(cached[1])
    return cached[1]


def why_not_fast(net: nn.Module, x: torch.Tensor, per_cell: Sequence[torch.Tensor], active=None) -> Optional[str]:
    """None if :func:`fast_forward` applies to this call, else the reason it runs on the eager modules."""
    if not net.training:
        return "the supernet is in eval mode (each edge's BatchNorm uses its own running statistics)"
    if active is not None:
        return "an active-ops mask is given"
    if any(not isinstance(w, torch.Tensor) for w in per_cell):
        return "mixing weights are given per edge (a sequence of tensors per cell)"
    if any(w.dim() != 2 for w in per_cell):
        return "mixing weights are given per sample"
    transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if transforms_active is not None and transforms_active():
        return "a torch.func transform is running"
    try:
        _plans(net)
    except Unsupported as exc:
        return str(exc)
    if _cell_modules_hooked(net):
        return "hooks are registered on the cells' modules (a probe or a Hessian rule)"
    eval_module = _cell_module_in_eval(net)
    if eval_module is not None:
        return (f"the supernet is in train mode but its module {eval_module} is in eval mode (a BatchNorm there "
                "normalizes with its running statistics)")
    if _running_statistics_off(net):
        return "BatchNorm running statistics are off (track_running_stats=False or momentum=None after the plan was built)"
    return None


def _cell_module_in_eval(net: nn.Module) -> Optional[str]:
    # The batched calls normalize every edge by the batch's statistics and update every running statistic, as in
    # training; a cell module switched to eval on its own (frozen BatchNorms, ``net.cells[k].eval()``) normalizes
    # with its running statistics in the eager forward, which the batched path silently did not (other costs).
    mods = net.__dict__["_fast_plans"][2]
    if all(m.training for m in mods):
        return None
    names = {id(m): n for n, m in net.named_modules()}
    return next(names.get(id(m), type(m).__name__) for m in mods if not m.training)


def _running_statistics_off(net: nn.Module) -> bool:
    # The plan checks each BatchNorm when it is built; a flag switched afterwards (nasdiag.hessian's
    # batch_statistics_only does so around exact Hessian products) would make it update buffers that are off.
    mods = net.__dict__["_fast_plans"][2]
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and (not m.track_running_stats or m.momentum is None)
               for m in mods)


def fast_forward(net: nn.Module, x: torch.Tensor, per_cell: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Network.forward(x, per_cell)`` through the batched cells (call :func:`why_not_fast` first)."""
    _, plans, _, statistics, _, _ = net.__dict__["_fast_plans"]
    linked = statistics.ensure_linked()
    if linked and statistics.counts is not None:
        with torch.no_grad():
            statistics.counts.add_(1)  # every edge BatchNorm's num_batches_tracked, as each module would count
    streams = None
    if COLUMN_STREAMS_ON_CUDA and x.is_cuda:
        pool = net.__dict__.get("_fast_streams")
        if pool is None:
            pool = net.__dict__["_fast_streams"] = _StreamPool()
        streams = pool.get(x.device, max(len(stage.columns) for plan in plans for stage in plan.stages))
    run = _Run(linked, UNIT_AFFINE_ON_CUDA and x.is_cuda, streams)
    s0 = s1 = net.stem(x)
    for cell, plan, w in zip(net.cells, plans, per_cell):
        s0, s1 = s1, cell_forward(cell, plan, s0, s1, w, run)
    return net.classifier(net.global_pooling(s1).flatten(1))


_QUIET_UNDER_AUTO = ("hooks are registered", "the supernet is in eval mode", "the supernet is in train mode but",
                     "a torch.func transform",
                     "BatchNorm running statistics are off")


def resolve(net: nn.Module, x: torch.Tensor, per_cell: Sequence[torch.Tensor], active=None) -> bool:
    """Whether this forward of ``net`` takes the fast path under its engine choice.

    ``"eager"``: never. ``"fast"``: whenever :func:`why_not_fast` allows, else one warning per reason.
    ``"auto"``: the fast path wherever it applies (it pays on CPU too: BENCHMARKS.md, "Search engine"),
    else eager, with one warning per reason on CUDA where a method's forwards cannot use it (per-sample
    weights, active-op masks, an op structure it does not batch); probes and Hessian rules hook the per-op
    modules by design, and eval mode and ``torch.func`` transforms are not a method's training forwards,
    so those stay silent.
    """
    engine = getattr(net, "engine", "auto")
    if engine == "eager":
        return False
    reason = why_not_fast(net, x, per_cell, active)
    if reason is None:
        return True
    if engine == "fast" or (x.device.type == "cuda" and not reason.startswith(_QUIET_UNDER_AUTO)):
        told = net.__dict__.setdefault("_fast_told", set())
        if reason not in told:
            told.add(reason)
            warnings.warn(f"engine {engine!r}: this forward runs on the eager modules because {reason}", EngineWarning,
                          stacklevel=3)
    return False
