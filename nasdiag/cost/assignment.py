"""Cost assignment of the wiring paper: C(Z_ij^k) = <∂L/∂x_j, O_ij^k(x_i)> (supplement §2, eq. of §2.1).

Pure tensor maths on captured tensors; the probe (``nasdiag.probe``) supplies the tensors.

Why this is ∂L/∂Z: a mixed op computes ``x_j ⊇ Σ_k Z_k O_k(x_i)``, so ∂L/∂Z_k = <∂L/∂x_j, O_k(x_i)>
whatever produced Z (softmax, one-hot sample, linear weights). The gradient at the edge output equals
∂L/∂x_j because a node is a plain sum of its incoming edges.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from typing import Mapping, Sequence, Tuple

import torch
from nasdiag.cost.errors import CostError, require_tensors


#: On a CPU, edge outputs up to this many elements are stacked into one bmm; larger ones are paired op
#: by op (measured crossover ~1.3e5 elements with K = 8, 1-2 threads; docs/probe.md, "Overhead").
_CPU_BATCHED_MAX_NUMEL = 1 << 17


def _accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The promoted dtype of the inputs, at least float32: candidates of one mixed op may differ in dtype
    under autocast (a conv's float16 beside an identity's float32), and half sums lose the cost."""
    promoted = functools.reduce(torch.promote_types, dtypes)
    return torch.float32 if promoted in (torch.float16, torch.bfloat16) else promoted


def _autocast_off(t: torch.Tensor):
    """A context with autocast off on ``t``'s device where it is on: the costs are computed in a backward hook, and a
    backward run inside ``torch.autocast`` would cast their bmm down to half precision (costs rounded to 3 digits)."""
    device = t.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


def _inner_per_sample(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ over all but the first dim of a·b, shape (B,), in :func:`_accumulation_dtype` of a and b."""
    if a.shape != b.shape:
        raise CostError(
            f"cannot pair a gradient of shape {tuple(a.shape)} with a tensor of shape {tuple(b.shape)}: "
            "a candidate op's output must have the shape of the mixed op's output"
        )
    dtype = _accumulation_dtype(a.dtype, b.dtype)
    a, b = a.to(dtype), b.to(dtype)
    if a.dim() == 0:
        return (a * b).reshape(1)
    N = math.prod(a.shape[1:])  # not -1: an empty batch (B = 0) leaves -1 undetermined
    return torch.linalg.vecdot(a.reshape(a.shape[0], N), b.reshape(b.shape[0], N))


def edge_costs(
    grad_output: torch.Tensor, candidate_outputs: Sequence[torch.Tensor], per_sample: bool = False
) -> torch.Tensor:
    """Costs of the K candidate ops of one edge, C_k = <∂L/∂x_j, O_k(x_i)> (wiring supplement §2.1).

    Args:
        grad_output: ∂L/∂(edge output) = ∂L/∂x_j, shape (B, ...), dim 0 the batch.
        candidate_outputs: K tensors O_k(x_i), each of the shape of ``grad_output``.
        per_sample: return the per-sample terms instead of their sum.

    Returns:
        (K,) or, with ``per_sample``, (B, K), in the promoted dtype of the inputs, at least float32 (half
        inputs, and candidates of mixed dtypes under autocast, are accumulated in it).
        Batch convention: the per-sample terms **sum** to the (K,) costs; the loss's own reduction is
        inherited, so with a mean loss every per-sample term carries the 1/B factor.
    """
    if len(candidate_outputs) == 0:
        raise CostError("an edge needs at least one candidate op output to assign costs")
    if not (isinstance(grad_output, torch.Tensor) and all(isinstance(o, torch.Tensor) for o in candidate_outputs)):
        require_tensors("edge_costs", grad_output=grad_output,
                        **{f"candidate_outputs[{k}]": o for k, o in enumerate(candidate_outputs)})
    with _autocast_off(grad_output):
        return _edge_costs(grad_output, candidate_outputs, per_sample)


def _edge_costs(grad_output: torch.Tensor, candidate_outputs: Sequence[torch.Tensor], per_sample: bool) -> torch.Tensor:
    batched = grad_output.dim() > 0 and all(o.shape == grad_output.shape for o in candidate_outputs)
    if batched and (grad_output.is_cuda or grad_output.numel() <= _CPU_BATCHED_MAX_NUMEL):
        # 2 kernels (stack, bmm) for the K ops instead of K dot products: the step is launch-bound on a
        # GPU, and dispatch-bound on a CPU for small maps; large CPU maps pay more for the stacked copy.
        K, B = len(candidate_outputs), grad_output.shape[0]
        dtype = _accumulation_dtype(grad_output.dtype, *(o.dtype for o in candidate_outputs))
        N = math.prod(grad_output.shape[1:])  # not -1: an empty batch (B = 0) leaves -1 undetermined
        stacked = torch.stack([o.to(dtype) for o in candidate_outputs]).reshape(K, B, N)
        g = grad_output.to(dtype).reshape(B, 1, N)
        # per[b, k] = Σ_n g[b, n] S[k, b, n]: one batched (1 × N)(N × K) product per sample
        per = torch.bmm(g, stacked.permute(1, 2, 0)).reshape(B, K)
    else:
        per = torch.stack([_inner_per_sample(grad_output, o) for o in candidate_outputs], dim=-1)
    return per if per_sample else per.sum(0)


def output_edge_costs(
    grad_cell_output: torch.Tensor,
    cell_output: torch.Tensor,
    node_slices: Mapping[int, Tuple[int, int]],
    per_sample: bool = False,
) -> torch.Tensor:
    """Costs of a cell's output edges: for each intermediate node n concatenated into the output,
    <∂L/∂out[:, a_n:b_n], out[:, a_n:b_n]> = <∂L/∂(node n's slice), x_n> (wiring supplement §5–6).

    An output edge is a skip connection with an implicit weight 1, so this is the cost of that weight.
    Summed over the nodes of a cell it is <∂L/∂out, out>: 0 for a cell followed only by scale-invariant
    ops (Cor. 1.2), L − H for the last cell before GAP and a bias-free classifier (Thm. 2, eq. 12).

    Args:
        grad_cell_output, cell_output: (B, C_out, ...), nodes concatenated along dim 1.
        node_slices: node -> (start, stop) channel range in the output, in the order to return.

    Returns:
        (n_nodes,) or, with ``per_sample``, (B, n_nodes); per-sample terms sum to the former.
    """
    if not isinstance(node_slices, Mapping) or not node_slices:
        raise CostError(f"node_slices must be a non-empty {{node: (start, stop)}} mapping of the output nodes' channel "
                        f"ranges, got {node_slices!r}")
    require_tensors("output_edge_costs", grad_cell_output=grad_cell_output, cell_output=cell_output)
    if cell_output.dim() < 2 or grad_cell_output.shape != cell_output.shape:
        # a gradient of another shape would pair its channels with other channels of the output: a number of no node
        raise CostError(f"output_edge_costs: the gradient has shape {tuple(grad_cell_output.shape)} and the cell output "
                        f"{tuple(cell_output.shape)}; pass the cell output (B, C_out, ...) and ∂L/∂ of it, of its shape")
    C = cell_output.shape[1]
    cols = []
    for node, bounds in node_slices.items():
        try:
            start, stop = (operator.index(b) for b in bounds)
        except (TypeError, ValueError):
            raise CostError(f"output node {node} has channel range {bounds!r}; give each node a (start, stop) pair of ints") from None
        if not 0 <= start < stop <= C:
            raise CostError(f"output node {node} has channel range ({start}, {stop}) outside the {C} output channels")
        with _autocast_off(cell_output):
            cols.append(_inner_per_sample(grad_cell_output[:, start:stop], cell_output[:, start:stop]))
    per = torch.stack(cols, dim=-1)
    return per if per_sample else per.sum(0)


def scatter_cells(
    edge_costs_: torch.Tensor, cell_slot: torch.Tensor, edge_index: torch.Tensor, n_cells: int, n_edges: int
) -> torch.Tensor:
    """Lay per-edge costs out as (n_cells, E, K) for α shared by a cell type; missing entries are NaN.

    Args:
        edge_costs_: (N, K), one row per edge of the probe.
        cell_slot: (N,) int64, the position of the edge's cell among the cells of its type.
        edge_index: (N,) int64, the edge's index inside its cell (DARTS order).

    Raises:
        CostError: an argument that is not a tensor; costs not (N, K); indices not N integers in range; a (cell, edge) slot given twice (the later
            row would silently overwrite the earlier).

    Returns:
        (n_cells, n_edges, K); ``.sum(0)`` is the cost of the shared Z (what ∂L/∂α needs, §2.1) where every
        cell has every edge. An edge missing from a cell is NaN there and so in its sum: sum only the cells
        that have it (``torch.nansum`` would also drop a NaN *cost*, which must be flagged, not dropped).
    """
    require_tensors("scatter_cells", edge_costs_=edge_costs_, cell_slot=cell_slot, edge_index=edge_index)
    if edge_costs_.dim() != 2:
        raise CostError(f"scatter_cells: edge costs must be (N, K), one row per edge, got shape {tuple(edge_costs_.shape)}")
    N, K = edge_costs_.shape
    for name, idx, size in (("cell_slot", cell_slot, n_cells), ("edge_index", edge_index, n_edges)):
        if idx.shape != (N,) or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise CostError(f"scatter_cells: {name} must be {N} integer indices, one per row of the costs, got a "
                            f"{idx.dtype} tensor of shape {tuple(idx.shape)}")
        if N and not bool(((idx >= 0) & (idx < size)).all()):
            raise CostError(f"scatter_cells: {name} must lie in [0, {size}), got values from {int(idx.min())} to {int(idx.max())}")
    if N and len(torch.unique(cell_slot.long() * n_edges + edge_index.long())) != N:
        # a second row for a (cell, edge) slot would overwrite the first: a cost silently lost
        raise CostError("scatter_cells: two rows of the costs have the same (cell_slot, edge_index); each edge of each "
                        "cell must appear once")
    return _scatter(edge_costs_, cell_slot, edge_index, n_cells, n_edges)


def _scatter(edge_costs_: torch.Tensor, cell_slot: torch.Tensor, edge_index: torch.Tensor, n_cells: int,
             n_edges: int) -> torch.Tensor:
    """:func:`scatter_cells` without its checks (host syncs): for a layout checked once, e.g. the probe's per step."""
    K = edge_costs_.shape[-1]
    out = edge_costs_.new_full((n_cells, n_edges, K), float("nan"))
    out[cell_slot, edge_index] = edge_costs_
    return out
