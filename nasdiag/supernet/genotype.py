"""Deriving discrete architectures from mixing weights."""

from __future__ import annotations

import numbers
from collections import namedtuple
from typing import List, Mapping, Optional, Sequence, Tuple

import torch

from nasdiag.supernet.cell import edge_nodes

#: The DARTS genotype: ``normal``/``reduce`` list ``(op name, input node)`` pairs, ``k`` per
#: intermediate node in node order; ``*_concat`` lists the nodes concatenated into the cell output.
Genotype = namedtuple("Genotype", "normal normal_concat reduce reduce_concat")

#: A mixed-path genotype for the sparse methods: ``normal``/``reduce`` list every kept
#: ``(op name, i, j)`` triple, so a node may keep several ops per edge and any number of edges.
MixedGenotype = namedtuple("MixedGenotype", "normal normal_concat reduce reduce_concat")


def _whole(name: str, value, low: int, high: Optional[int] = None, high_name: str = "") -> int:
    """``value`` as an int in [low, high], or a one-line ValueError (a float was range()'s TypeError; steps = 0 or a
    multiplier past steps derived a cell of no node or concatenated nodes that do not exist, node −1 and the inputs)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high_name}{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return int(value)


def _concat(steps: int, multiplier: int) -> List[int]:
    """The nodes concatenated into the cell output: the last ``multiplier`` of the ``steps`` intermediate nodes."""
    steps = _whole("steps", steps, 1)
    multiplier = _whole("multiplier", multiplier, 1, steps, "steps = ")
    return list(range(2 + steps - multiplier, 2 + steps))


def _refuse_other_cell_types(weights, eligible=None) -> None:
    """A Genotype has a normal and a reduce cell: the cells of any other type were derived and dropped without a word
    (an adapted supernet's ``"up"`` cells: its method's genotype() had only its normal cell)."""
    for what, value in (("weights", weights), ("eligible", eligible)):
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"{what} must be a dict {{cell type: (E, K) tensor}} ('normal', 'reduce'), got {type(value).__name__}")
        other = [t for t in value if t not in ("normal", "reduce")]
        if other:
            raise ValueError(f"{what} has cell type(s) {other}, but a genotype holds only 'normal' and 'reduce' cells; "
                             "derive the cells of other types one by one with derive_cell (or derive_mixed_cell)")


def _check(weights: torch.Tensor, steps: int, primitives: Sequence[str]) -> torch.Tensor:
    _whole("steps", steps, 1)
    weights = torch.as_tensor(weights).detach().cpu()
    if weights.dtype == torch.bool:  # a mask of the ops kept (1 and 0): abs/argmax of bool were torch's tracebacks
        weights = weights.to(torch.float64)
    E = len(edge_nodes(steps))
    if weights.shape != (E, len(primitives)):
        raise ValueError(
            f"weights must have shape (E, K) = ({E}, {len(primitives)}) for steps={steps} and "
            f"{len(primitives)} primitives, got {tuple(weights.shape)}"
        )
    if weights.is_floating_point() and bool(torch.isnan(weights).any()):
        # NaN compares false with every weight: the picks would be arbitrary, an architecture that looks like any other
        edges = sorted({int(e) for e in torch.isnan(weights).any(1).nonzero()[:, 0]})
        raise ValueError(f"weights are NaN on edge(s) {edges}: no architecture can be derived from them (a diverged search?)")
    return weights


def derive_cell(
    weights: torch.Tensor,
    steps: int,
    primitives: Sequence[str],
    edges_per_node: int = 2,
    exclude: Sequence[str] = ("none",),
    eligible: Optional[torch.Tensor] = None,
) -> List[Tuple[str, int]]:
    """The DARTS rule for one cell: for each intermediate node keep the ``edges_per_node`` incoming
    edges whose strongest op outside ``exclude`` is strongest, each with that op.

    Args:
        weights: (E, K) mixing weights (e.g. softmax(α)) in :func:`edge_nodes` order.
        eligible: optional (E, K) bool, the ops the genotype may name (XNAS: the experts not wiped out;
            ASM-NAS: the ops selected at least once). An op outside it is never named, and an edge with no
            eligible op outside ``exclude`` is not a candidate input. A node with fewer than
            ``edges_per_node`` candidate inputs keeps them all and fills its remaining places with
            ``(exclude[0], i)`` (``"none"``: no connection) on its other edges, strongest ``exclude[0]`` weight
            first, where that op is eligible; it never names an op outside ``eligible``.

    Returns:
        ``[(op name, input node), ...]``, ``edges_per_node`` per node, nodes in order; within a node
        the stronger edge comes first. Ties break towards the lower edge/op index.
    """
    if isinstance(edges_per_node, bool) or not isinstance(edges_per_node, int) or edges_per_node < 1:
        raise ValueError(f"edges_per_node must be an integer >= 1, got {edges_per_node!r}")
    weights = _check(weights, steps, primitives)
    allowed = torch.tensor([p not in exclude for p in primitives])
    if not allowed.any():
        raise ValueError(f"every primitive is excluded ({list(exclude)}); nothing to derive")
    if eligible is None:
        eligible = torch.ones(weights.shape, dtype=torch.bool)
    eligible = torch.as_tensor(eligible).detach().cpu().bool()
    if eligible.shape != weights.shape:
        raise ValueError(f"eligible must have the shape of weights {tuple(weights.shape)}, got {tuple(eligible.shape)}")
    usable = eligible & allowed
    filler = primitives.index(exclude[0]) if exclude and exclude[0] in primitives else None
    genes: List[Tuple[str, int]] = []
    offset = 0
    for node in range(steps):
        n_in = node + 2
        if edges_per_node > n_in:
            raise ValueError(f"node {node + 2} has {n_in} incoming edges, cannot keep {edges_per_node}")
        best = {}  # input node -> (strongest usable op, its weight); argmax among usable ops only, so a row of
        for i in range(n_in):  # -inf never names an excluded op; ties keep the lower op index
            ops = usable[offset + i].nonzero()[:, 0]
            if len(ops):
                k = int(ops[int(weights[offset + i, ops].argmax())])
                best[i] = (k, weights[offset + i, k].item())
        candidates = list(best)
        # stable sort so that ties keep the lower input node
        order = sorted(candidates, key=lambda i: (-best[i][1], i))[:edges_per_node]
        genes.extend((primitives[best[i][0]], i) for i in order)
        if len(order) < edges_per_node:
            rest = [i for i in range(n_in) if i not in candidates
                    and filler is not None and bool(eligible[offset + i, filler])]
            rest = sorted(rest, key=lambda i: (-weights[offset + i, filler].item(), i))[: edges_per_node - len(order)]
            if len(order) + len(rest) < edges_per_node:
                raise ValueError(f"node {node + 2} has {len(order)} incoming edge(s) with an eligible op outside "
                                 f"{list(exclude)} and no eligible {exclude[0] if exclude else 'excluded op'!r} "
                                 f"to fill the other {edges_per_node - len(order)}: no {edges_per_node}-input genotype")
            genes.extend((primitives[filler], i) for i in rest)
        offset += n_in
    return genes


def derive_genotype(
    weights: Mapping[str, torch.Tensor],
    steps: int,
    multiplier: int,
    primitives: Sequence[str],
    edges_per_node: int = 2,
    eligible: Optional[Mapping[str, torch.Tensor]] = None,
) -> Genotype:
    """:func:`derive_cell` for each cell type of ``weights`` (``{"normal": (E, K), "reduce": (E, K)}``);
    a missing cell type gives an empty list. ``eligible``: optional ``{cell type: (E, K) bool}``, the ops
    each cell may name (:func:`derive_cell`). ValueError (one line) unless steps is an integer >= 1 and multiplier one
    from 1 to steps (the nodes concatenated into the output are the last ``multiplier`` intermediate nodes), and for a
    cell type other than ``"normal"`` and ``"reduce"`` (a Genotype has no place for it: use :func:`derive_cell`)."""
    concat = _concat(steps, multiplier)
    _refuse_other_cell_types(weights, eligible)
    eligible = eligible or {}
    cells = {t: derive_cell(w, steps, primitives, edges_per_node, eligible=eligible.get(t)) for t, w in weights.items()}
    return Genotype(cells.get("normal", []), concat, cells.get("reduce", []), concat)


def derive_mixed_cell(
    weights: torch.Tensor,
    steps: int,
    primitives: Sequence[str],
    threshold: float = 0.0,
    exclude: Sequence[str] = ("none",),
) -> List[Tuple[str, int, int]]:
    """The mixed-path rule for sparse methods (SparseNAS eq 1): keep every op with
    ``|weight| > threshold`` (``threshold=0``: every non-zero op), except those in ``exclude``. ``weights`` may be a
    bool mask of the ops kept (as the derivation rules take any weights, True is 1 and False 0).

    Returns:
        ``[(op name, i, j), ...]`` in (edge, op) order.
    """
    if not threshold >= 0:  # NaN too: |w| > NaN is False everywhere, an empty architecture
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    weights = _check(weights, steps, primitives)
    keep = weights.abs() > threshold
    return [
        (primitives[k], i, j)
        for e, (i, j) in enumerate(edge_nodes(steps))
        for k in range(len(primitives))
        if keep[e, k] and primitives[k] not in exclude
    ]


def derive_mixed_genotype(
    weights: Mapping[str, torch.Tensor],
    steps: int,
    multiplier: int,
    primitives: Sequence[str],
    threshold: float = 0.0,
) -> MixedGenotype:
    """:func:`derive_mixed_cell` for each cell type of ``weights``; steps, multiplier and the cell types as
    :func:`derive_genotype` takes them."""
    concat = _concat(steps, multiplier)
    _refuse_other_cell_types(weights)
    cells = {t: derive_mixed_cell(w, steps, primitives, threshold) for t, w in weights.items()}
    return MixedGenotype(cells.get("normal", []), concat, cells.get("reduce", []), concat)


def without_removed_nodes(genes: MixedGenotype) -> MixedGenotype:
    """A mixed genotype with the paper's node sparsity applied: an intermediate node is removed when no op enters it from
    a cell input or from a node that is kept ("the nodes with all zero incoming weights", §Sparse Supernet; such a node
    is x_j = 0), and with it the ops that leave it and its place in the output concatenation. Nodes in order, so a node
    fed only by removed nodes is removed too."""
    parts = []
    for kind in ("normal", "reduce"):
        cell = getattr(genes, kind)
        live = set()
        for j in sorted({j for _, _, j in cell}):
            if any(target == j and (i < 2 or i in live) for _, i, target in cell):
                live.add(j)
        kept = [(op, i, j) for op, i, j in cell if j in live and (i < 2 or i in live)]
        parts += [kept, [n for n in getattr(genes, f"{kind}_concat") if n in live]]
    return MixedGenotype(*parts)
