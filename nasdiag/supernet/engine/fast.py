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
- the mixing x_j = Σ_k Z_k O_k(x_i) is one batched matrix product with the stacked (B, m, d, K', C, H, W) outputs.

The cost C = ∂L/∂Z (wiring supplement §2) of a per-cell Z leaf is then the gradient of that one product,
so costs, α-gradients and every statistic built on them are those of the eager path up to float
rounding (checked in float64 in tests/test_engine.py).

The engine applies to supernets built of those op structures (the DARTS primitives, order
``relu-conv-bn``, BatchNorm), in training mode, with (E, K) mixing weights shared by the batch, no
active-ops mask, no hooks on the cells' modules and no ``torch.func`` transform running: anything else
runs on the eager modules (:func:`fast_forward` returns None and says why).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

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
    blocks = list(op) if isinstance(op, nn.Sequential) and all(isinstance(b, nn.Sequential) for b in op) else [op]
    for b in blocks:
        if not (isinstance(b, nn.Sequential) and len(b) == 4 and type(b[0]) is nn.ReLU and not b[0].inplace):
            return None
        dw, pw = b[1], b[2]
        if _conv_signature(dw) is None or _conv_signature(pw) is None or _bn_signature(b[3]) is None:
            return None
        if dw.groups != dw.in_channels or dw.out_channels != dw.in_channels or pw.kernel_size != (1, 1) or pw.groups != 1 \
                or pw.stride != (1, 1) or pw.in_channels != dw.out_channels or b[3].num_features != pw.out_channels:
            return None
    return blocks


def _classify(op: nn.Module, stride: int) -> Tuple[Optional[str], tuple]:
    """(kind, signature) of one candidate op; kind None when the engine does not know its structure."""
    if type(op) is Zero:
        return "zero", ("zero", op.stride)
    if type(op) is nn.Identity:
        return ("identity", ("identity",)) if stride == 1 else (None, ())
    if type(op) is FactorizedReduce:
        sig = (_conv_signature(op.conv_1), _conv_signature(op.conv_2), _bn_signature(op.norm))
        if op.order != "relu-conv-bn" or None in sig or op.conv_1.kernel_size != (1, 1) or op.conv_1.stride != (2, 2):
            return None, ()
        return "factorized", ("factorized",) + sig
    if isinstance(op, nn.Sequential) and len(op) == 2 and type(op[0]) in (nn.MaxPool2d, nn.AvgPool2d):
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
class _Stage:
    """Source nodes whose outgoing edges are computed together (same number d of edges from each)."""

    sources: Tuple[int, ...]
    degree: int
    positions: List[int]  # edge index (Cell.edge_nodes order) of each position, source-major
    dests: List[int]  # destination node of each position
    columns: List[_Column]  # ops that contribute (the zero op is left out: its output and cost are 0)
    z_index: List[int] = field(default_factory=list)  # flat index into Z (E·K) of each (position, column)
    _device_index: Dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def z_index_on(self, device: torch.device) -> torch.Tensor:
        # Cached per device: building it inside a CUDA-graph capture would be a pageable host copy.
        idx = self._device_index.get(device)
        if idx is None:
            idx = torch.tensor(self.z_index, dtype=torch.long, device=device)
            # one made under a torch.func transform is a wrapper of that call: reusing it later (or deep-copying
            # the network) fails with "Cannot access storage of TensorWrapper", so it is not cached
            if torch._C._functorch.peek_interpreter_stack() is None:
                self._device_index[device] = idx
        return idx


@dataclass
class CellPlan:
    stages: List[_Stage]
    num_ops: int


class Unsupported(Exception):
    """The supernet has a structure the fast engine does not batch (the message says what)."""


def plan_cell(cell: nn.Module) -> CellPlan:
    """Group a nasdiag :class:`~nasdiag.supernet.Cell`'s edges into stages and its ops into batched columns.

    Raises:
        Unsupported: an op whose structure the engine does not know, or ops of one column that differ.
    """
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
            columns = []
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
                    columns.append(_Column(k, kind, mods, sig))
            stage = _Stage(srcs, len(out_edges[srcs[0]]), positions, [nodes[e][1] for e in positions], columns)
            stage.z_index = [e * K + c.k for e in positions for c in columns]
            stages.append(stage)
    return CellPlan(stages, K)


# -- batched computation --------------------------------------------------------------------------------

def _gather_bn(bns: Sequence[nn.Module]):
    rm = torch.cat([b.running_mean for b in bns])
    rv = torch.cat([b.running_var for b in bns])
    w = torch.cat([b.weight for b in bns]) if bns[0].affine else None
    bias = torch.cat([b.bias for b in bns]) if bns[0].affine else None
    return rm, rv, w, bias


#: Give affine-free BatchNorms a unit scale and zero shift on CUDA (the same function: x̂·1 + 0), which lets
#: torch pick cuDNN's kernels for float32 instead of its native ones: 125.1 -> 117.7 ms per graphed DARTS
#: iteration on an H200 (BENCHMARKS.md, "Search engine", measures both). The scale gets no gradient.
UNIT_AFFINE_ON_CUDA = True


def _batch_norm(y: torch.Tensor, bns: Sequence[nn.Module]) -> torch.Tensor:
    """BatchNorm of the stacked channels of ``len(bns)`` edges, updating each module's running statistics."""
    rm, rv, w, b = _gather_bn(bns)
    if w is None and UNIT_AFFINE_ON_CUDA and y.is_cuda:
        w, b = y.new_ones(rm.shape), y.new_zeros(rm.shape)
    out = F.batch_norm(y, rm, rv, w, b, True, bns[0].momentum, bns[0].eps)
    with torch.no_grad():
        n = bns[0].num_features
        torch._foreach_copy_([m.running_mean for m in bns], list(rm.split(n)))
        torch._foreach_copy_([m.running_var for m in bns], list(rv.split(n)))
        torch._foreach_add_([m.num_batches_tracked for m in bns], 1)
    return out


def _shared_batch_norm(y: torch.Tensor, bns_per_source: Sequence[Sequence[nn.Module]]) -> torch.Tensor:
    """BatchNorm of a parameter-free op output ``y`` (B, m·C, H, W) shared by the d edges of each of m sources.

    Every edge of a source normalizes the same tensor, so the output is computed once; each edge's module
    gets the running-statistics update ``r ← (1 − momentum)·r + momentum·stat`` it would have made itself.
    """
    first = bns_per_source[0][0]
    out = F.batch_norm(y, None, None, None, None, True, 0.0, first.eps)
    with torch.no_grad():
        var, mean = torch.var_mean(y, dim=(0, 2, 3), correction=1)
        C = first.num_features
        mod_rm, mod_rv, src_mean, src_var = [], [], [], []
        for a, bns in enumerate(bns_per_source):
            for m in bns:
                mod_rm.append(m.running_mean)
                mod_rv.append(m.running_var)
                src_mean.append(mean[a * C:(a + 1) * C])
                src_var.append(var[a * C:(a + 1) * C])
        mom = first.momentum
        torch._foreach_mul_(mod_rm, 1 - mom)
        torch._foreach_add_(mod_rm, src_mean, alpha=mom)
        torch._foreach_mul_(mod_rv, 1 - mom)
        torch._foreach_add_(mod_rv, src_var, alpha=mom)
        torch._foreach_add_([m.num_batches_tracked for bns in bns_per_source for m in bns], 1)
    return out


def _pool(X: torch.Tensor, op: nn.Sequential) -> torch.Tensor:
    p = op[0]
    if type(p) is nn.MaxPool2d:
        return F.max_pool2d(X, p.kernel_size, p.stride, p.padding)
    return F.avg_pool2d(X, p.kernel_size, p.stride, p.padding, count_include_pad=p.count_include_pad)


def _chain(rr: torch.Tensor, ops: Sequence[nn.Module], n: int) -> torch.Tensor:
    """ReLU → depthwise → 1×1 → BN blocks of n edges at once; ``rr`` (B, n·C, H, W) = ReLU(input) per edge."""
    blocks_per_edge = [_chain_blocks(op) for op in ops]
    y = rr
    for depth in range(len(blocks_per_edge[0])):
        blocks = [bl[depth] for bl in blocks_per_edge]
        dw, pw = blocks[0][1], blocks[0][2]
        if depth > 0:
            y = F.relu(y)
        w_dw = torch.cat([b[1].weight for b in blocks])  # (n·C, 1, k, k)
        y = F.conv2d(y, w_dw, None, dw.stride, dw.padding, dw.dilation, groups=w_dw.shape[0])
        # The n edges' 1×1 convs as one batched matrix product over (batch, edge): a grouped cuDNN conv
        # spent most of its time transposing layouts (measured on an H200, BENCHMARKS.md).
        w_pw = torch.stack([b[2].weight.flatten(1) for b in blocks])  # (n, C_out, C)
        B, _, H, W = y.shape
        y = torch.matmul(w_pw, y.view(B, n, -1, H * W)).view(B, -1, H, W)
        y = _batch_norm(y, [b[3] for b in blocks])
    return y


def _factorized(r: torch.Tensor, ops: Sequence[FactorizedReduce], m: int, n: int) -> torch.Tensor:
    """``FactorizedReduce`` of n edges (d per source) from r = ReLU(X), X (B, m·C, H, W)."""
    shifted = r[:, :, 1:, 1:]
    if r.shape[-1] % 2 or r.shape[-2] % 2:
        shifted = F.pad(shifted, (0, r.shape[-1] % 2, 0, r.shape[-2] % 2))
    w1 = torch.cat([op.conv_1.weight for op in ops])  # (n·C/2, C, 1, 1), source-major: groups = m
    w2 = torch.cat([op.conv_2.weight for op in ops])
    o1 = F.conv2d(r, w1, None, 2, 0, 1, groups=m)
    o2 = F.conv2d(shifted, w2, None, 2, 0, 1, groups=m)
    B, _, H, W = o1.shape
    half = ops[0].conv_1.out_channels
    y = torch.stack([o1.view(B, n, half, H, W), o2.view(B, n, half, H, W)], dim=2).view(B, n * 2 * half, H, W)
    return _batch_norm(y, [op.norm for op in ops])


def _stage_outputs(stage: _Stage, X: torch.Tensor, Z: torch.Tensor) -> torch.Tensor:
    """Mixed outputs (B, m, d, C, H', W') of every edge of a stage.

    Args:
        X: (B, m·C, H, W), the m source nodes concatenated along channels.
        Z: (E·K,) the cell's mixing weights, flattened.
    """
    m, d = len(stage.sources), stage.degree
    n = m * d
    B, mC, H, W = X.shape
    C = mC // m
    r = rr = None
    outs = []
    for col in stage.columns:
        if col.kind == "identity":
            y = X.view(B, m, 1, C, H, W).expand(B, m, d, C, H, W)
        elif col.kind == "pool":
            p = _pool(X, col.modules[0])
            p = _shared_batch_norm(p, [[op[1] for op in col.modules[a * d:(a + 1) * d]] for a in range(m)])
            y = p.view(B, m, 1, C, *p.shape[-2:]).expand(B, m, d, C, *p.shape[-2:])
        else:
            if r is None:
                r = F.relu(X)
            if col.kind == "chain":
                if rr is None:  # ReLU(input) once per edge: the depthwise convs differ per edge
                    rr = r.view(B, m, 1, C, H, W).expand(B, m, d, C, H, W).reshape(B, n * C, H, W)
                y = _chain(rr, col.modules, n)
            else:
                y = _factorized(r, col.modules, m, n)
            y = y.view(B, m, d, C, *y.shape[-2:])
        outs.append(y)
    stacked = torch.stack(outs, dim=3)  # (B, m, d, K', C, H', W')
    Hp, Wp = stacked.shape[-2:]
    # Σ_k Z_k O_k as one batched (1 × K')·(K' × C·H'·W') product per (sample, edge): one pass over the op
    # outputs forward and one per gradient backward, where a broadcast product and a sum make several.
    z = Z.index_select(0, stage.z_index_on(Z.device)).view(n, 1, len(outs))
    return torch.matmul(z, stacked.view(B, n, len(outs), -1)).view(B, m, d, C, Hp, Wp)


def cell_forward(cell: nn.Module, plan: CellPlan, s0: torch.Tensor, s1: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The batched equivalent of ``Cell.forward(s0, s1, weights)`` for (E, K) weights."""
    states: Dict[int, torch.Tensor] = {0: cell.preprocess0(s0), 1: cell.preprocess1(s1)}
    partial: Dict[int, List[torch.Tensor]] = {}
    Z = weights.reshape(-1)
    last = 1 + cell.steps
    for stage in plan.stages:
        for node in range(2, 2 + cell.steps):  # sum the nodes this stage reads (all their sources are done)
            if node in stage.sources and node not in states:
                states[node] = _sum(partial.pop(node))
        X = states[stage.sources[0]] if len(stage.sources) == 1 else torch.cat([states[s] for s in stage.sources], dim=1)
        out = _stage_outputs(stage, X, Z)
        for a in range(len(stage.sources)):
            for t in range(stage.degree):
                partial.setdefault(stage.dests[a * stage.degree + t], []).append(out[:, a, t])
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
    from torch.nn.modules import module as _m

    if _m._global_forward_hooks or _m._global_forward_pre_hooks or _m._global_backward_hooks \
            or getattr(_m, "_global_backward_pre_hooks", None):
        return True
    mods = net.__dict__["_fast_plans"][2]
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in mods)


def _fingerprint(net: nn.Module) -> tuple:
    # Identities of every cell and candidate op: a module swapped in after the plan was built (a custom op,
    # a wrapped edge) must not be computed by the plan of the old one.
    return tuple(id(op) for cell in net.cells for edge in cell.edges for op in edge.ops) + tuple(map(id, net.cells))


def _plans(net: nn.Module) -> List[CellPlan]:
    """Cell plans, cached outside the module tree and rebuilt when a cell or op module is replaced;
    raises :class:`Unsupported`."""
    fingerprint = _fingerprint(net)
    cached = net.__dict__.get("_fast_plans")
    if cached is None or cached[0] != fingerprint:
        try:
            plans = [plan_cell(cell) for cell in net.cells]
        except Unsupported as exc:
            plans = exc
        cached = net.__dict__["_fast_plans"] = (fingerprint, plans, [m for cell in net.cells for m in cell.modules()])
    if isinstance(cached[1], Unsupported):
        raise cached[1]
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
    if _running_statistics_off(net):
        return "BatchNorm running statistics are off (track_running_stats=False or momentum=None after the plan was built)"
    return None


def _running_statistics_off(net: nn.Module) -> bool:
    # The plan checks each BatchNorm when it is built; a flag switched afterwards (nasdiag.hessian's
    # batch_statistics_only does so around exact Hessian products) would make it update buffers that are off.
    mods = net.__dict__["_fast_plans"][2]
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and (not m.track_running_stats or m.momentum is None)
               for m in mods)


def fast_forward(net: nn.Module, x: torch.Tensor, per_cell: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Network.forward(x, per_cell)`` through the batched cells (call :func:`why_not_fast` first)."""
    plans = net.__dict__["_fast_plans"][1]
    s0 = s1 = net.stem(x)
    for cell, plan, w in zip(net.cells, plans, per_cell):
        s0, s1 = s1, cell_forward(cell, plan, s0, s1, w)
    return net.classifier(net.global_pooling(s1).flatten(1))


_QUIET_UNDER_AUTO = ("hooks are registered", "the supernet is in eval mode", "a torch.func transform",
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
