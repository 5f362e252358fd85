"""Cell depth of a genotype (XNAS §10, Table 4)."""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple, Union
from nasdiag.regret.errors import RegretError

__all__ = ["cell_depth"]

Cell = Sequence[Tuple]

#: the op of a gene that connects nothing (derive_cell fills a node's missing places with it: XNAS, ASM-NAS)
NO_CONNECTION = "none"


def _is_integer(value) -> bool:
    try:
        return not isinstance(value, (bool, str)) and int(value) == value
    except (TypeError, ValueError, OverflowError):
        return False


def _sources(cell: Cell, edges_per_node: int):
    try:
        cell = list(cell)
    except TypeError:
        raise RegretError(f"a cell is a list of (op name, input node) pairs (Genotype.normal) or a Genotype, got "
                          f"{type(cell).__name__}") from None
    if not cell:
        raise RegretError("the cell is empty: a cell list needs (op name, input node) pairs")
    sources = []
    for position, gene in enumerate(cell):
        if not isinstance(gene, (tuple, list)) or len(gene) not in (2, 3):
            raise RegretError(
                f"gene {position} is {gene!r}; expected (op name, input node) as in Genotype.normal "
                "or (op name, i, j) as in MixedGenotype"
            )
        if len(gene) == 2:
            source, target = gene[1], 2 + position // edges_per_node
        else:
            source, target = gene[1], gene[2]
        if not _is_integer(source) or not 0 <= source < target:
            raise RegretError(
                f"gene {position} {tuple(gene)!r}: input node must be an integer in [0, {target}) for node "
                f"{target} (0, 1 are the cell inputs, 2.. the intermediate nodes, edges_per_node="
                f"{edges_per_node})"
            )
        if gene[0] != NO_CONNECTION:  # derive_cell's filler ("none", i): no connection, so no depth (Table 4)
            sources.append(int(source))
    return sources


def cell_depth(
    cell: Union[Cell, object],
    concat: Optional[Sequence[int]] = None,
    *,
    edges_per_node: int = 2,
) -> Union[float, Dict[str, float]]:
    """The depth of a cell: the mean index of the node each of its connections comes from (Table 4).

    Nodes are indexed as in the DARTS genotype (and in §10): 0 = output of cell k-2, 1 = output of
    cell k-1, 2.. the intermediate nodes. A connection from node ``i`` has depth ``i``; the cell depth
    is the average over all of its connections. E.g. the DARTS (V2) normal cell has depth 0.625 and
    the XNAS one 1.375 (Table 4). A gene ``("none", i)`` is no connection (the filler of a node left with fewer
    than two candidate inputs, :func:`nasdiag.supernet.derive_cell`) and does not count.

    Args:
        cell: a cell list ``[(op name, input node), ...]`` with ``edges_per_node`` pairs per
            intermediate node in node order (``Genotype.normal``), or ``[(op, i, j), ...]``
            (``MixedGenotype``); or a whole ``Genotype``/``MixedGenotype``, in which case the depth of
            each cell type is returned.
        concat: the cell's output nodes (``Genotype.normal_concat``). Only validated (every node must
            exist); Table 4's metric averages over connections and does not depend on it.
        edges_per_node: inputs per intermediate node of a ``(op, input)`` list (2 in DARTS).

    Returns:
        a float for a cell list; ``{"normal": float, "reduce": float}`` for a genotype (a cell type
        with an empty list is left out); NaN for a cell whose genes are all ``("none", i)`` (no connection).
    """
    if hasattr(cell, "normal") and hasattr(cell, "reduce"):
        if concat is not None:
            raise RegretError("pass concat only with a cell list; a Genotype carries its own *_concat")
        depths = {}
        for kind in ("normal", "reduce"):
            genes = getattr(cell, kind)
            if genes:
                depths[kind] = cell_depth(genes, getattr(cell, f"{kind}_concat", None),
                                          edges_per_node=edges_per_node)
        return depths
    if not _is_integer(edges_per_node) or edges_per_node < 1:
        raise RegretError(f"edges_per_node must be a positive integer, got {edges_per_node!r}")
    sources = _sources(cell, int(edges_per_node))
    if concat is not None:
        cell = list(cell)
        if len(cell[0]) == 2:
            n_nodes = 2 + -(-len(cell) // edges_per_node)
        else:
            n_nodes = 1 + max(gene[2] for gene in cell)
        try:
            concat = list(concat)
        except TypeError:
            raise RegretError(f"concat must be a list of output nodes (Genotype.normal_concat), got {concat!r}") from None
        bad = [node for node in concat if not (_is_integer(node) and 0 <= node < n_nodes)]
        if bad:
            raise RegretError(f"concat names nodes {bad} that the cell does not have (nodes 0..{n_nodes - 1})")
    return sum(sources) / len(sources) if sources else math.nan
