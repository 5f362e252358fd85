"""Deriving discrete architectures from mixing weights."""

from __future__ import annotations

from collections import namedtuple
from typing import List, Mapping, Sequence, Tuple

import torch

from nasdiag.supernet.cell import edge_nodes

#: The DARTS genotype: ``normal``/``reduce`` list ``(op name, input node)`` pairs, ``k`` per
#: intermediate node in node order; ``*_concat`` lists the nodes concatenated into the cell output.
Genotype = namedtuple("Genotype", "normal normal_concat reduce reduce_concat")

#: A mixed-path genotype for the sparse methods: ``normal``/``reduce`` list every kept
#: ``(op name, i, j)`` triple, so a node may keep several ops per edge and any number of edges.
MixedGenotype = namedtuple("MixedGenotype", "normal normal_concat reduce reduce_concat")


def _check(weights: torch.Tensor, steps: int, primitives: Sequence[str]) -> torch.Tensor:
    weights = torch.as_tensor(weights).detach().cpu()
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
) -> List[Tuple[str, int]]:
    """The DARTS rule for one cell: for each intermediate node keep the ``edges_per_node`` incoming
    edges whose strongest op outside ``exclude`` is strongest, each with that op.

    Args:
        weights: (E, K) mixing weights (e.g. softmax(α)) in :func:`edge_nodes` order.

    Returns:
        ``[(op name, input node), ...]``, ``edges_per_node`` per node, nodes in order; within a node
        the stronger edge comes first. Ties break towards the lower edge/op index.
    """
    weights = _check(weights, steps, primitives)
    allowed = torch.tensor([p not in exclude for p in primitives])
    if not allowed.any():
        raise ValueError(f"every primitive is excluded ({list(exclude)}); nothing to derive")
    masked = weights.masked_fill(~allowed, float("-inf"))
    genes: List[Tuple[str, int]] = []
    offset = 0
    for node in range(steps):
        n_in = node + 2
        block = masked[offset : offset + n_in]
        best_w, best_op = block.max(dim=1)
        if edges_per_node > n_in:
            raise ValueError(f"node {node + 2} has {n_in} incoming edges, cannot keep {edges_per_node}")
        # stable sort so that ties keep the lower input node
        order = sorted(range(n_in), key=lambda i: (-best_w[i].item(), i))[:edges_per_node]
        genes.extend((primitives[int(best_op[i])], i) for i in order)
        offset += n_in
    return genes


def derive_genotype(
    weights: Mapping[str, torch.Tensor],
    steps: int,
    multiplier: int,
    primitives: Sequence[str],
    edges_per_node: int = 2,
) -> Genotype:
    """:func:`derive_cell` for each cell type of ``weights`` (``{"normal": (E, K), "reduce": (E, K)}``);
    a missing cell type gives an empty list."""
    concat = list(range(2 + steps - multiplier, 2 + steps))
    cells = {t: derive_cell(w, steps, primitives, edges_per_node) for t, w in weights.items()}
    return Genotype(cells.get("normal", []), concat, cells.get("reduce", []), concat)


def derive_mixed_cell(
    weights: torch.Tensor,
    steps: int,
    primitives: Sequence[str],
    threshold: float = 0.0,
    exclude: Sequence[str] = ("none",),
) -> List[Tuple[str, int, int]]:
    """The mixed-path rule for sparse methods (SparseNAS eq 1): keep every op with
    ``|weight| > threshold`` (``threshold=0``: every non-zero op), except those in ``exclude``.

    Returns:
        ``[(op name, i, j), ...]`` in (edge, op) order.
    """
    if threshold < 0:
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
    """:func:`derive_mixed_cell` for each cell type of ``weights``."""
    concat = list(range(2 + steps - multiplier, 2 + steps))
    cells = {t: derive_mixed_cell(w, steps, primitives, threshold) for t, w in weights.items()}
    return MixedGenotype(cells.get("normal", []), concat, cells.get("reduce", []), concat)
