"""How per-edge costs are grouped into the recorder's (E, K) arrays.

* Every edge has a cell type and an edge index (nasdiag's Network, the DARTS convention), and the edges of
  each type have the same K: one group per cell type, shape (E, K), E = 1 + the largest edge index of that
  type; the cells of a type are the observations of one step (their slot = order among cells of that type).
  A cell type whose edges have different op sets (different K) has no (E, K) layout: the fallbacks below.
* Otherwise, if all edges have the same K: one group ``"edges"`` of shape (n_edges, K), edges in probe
  order, one observation per step.
* Otherwise: one group per edge, named by the edge, shape (1, K_e).

A group name is the ``<cell>`` part of the record paths ``cost/<cell>/mean`` (``nasdiag.vocabulary``), which holds
letters, digits and ``_ . - + =`` only: any other character of a cell type or edge name (``"0->2"``, ``"cell/a"``)
becomes ``_`` there, so that the path stays one of its family (pooled across DDP ranks, found by the plots).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from nasdiag.edges import EdgeSpec
from nasdiag.probe.discovery import ProbeError


@dataclass(frozen=True)
class Group:
    """One (E, K) array family of the record.

    Attributes:
        name: cell type, ``"edges"``, or an edge name.
        members: positions into ``Probe.edges``.
        cell_slot, edge_index: (len(members),) int64 layout of each member in (n_cells, E, K).
        n_cells, n_edges, n_ops: the layout's shape.
        edge_labels: E labels (``"i->j"`` or edge names). op_names: K labels, column k's op name where every
            member names it alike, else ``"op k"`` (edges of one K but other op lists share the columns by position).
    """

    name: str
    members: Tuple[int, ...]
    cell_slot: torch.Tensor
    edge_index: torch.Tensor
    n_cells: int
    n_edges: int
    n_ops: int
    edge_labels: Tuple[str, ...]
    op_names: Tuple[str, ...]


def _column_names(members: Sequence[EdgeSpec]) -> Tuple[str, ...]:
    # edge 0's names were given to every edge: another edge's column k silently got a name it does not run
    return tuple(names[0] if len(set(names)) == 1 else f"op {k}" for k, names in enumerate(zip(*(e.op_names for e in members))))


def _same_k_per_cell_type(edges: Sequence[EdgeSpec]) -> bool:
    ks = {}
    for e in edges:
        ks.setdefault(e.cell_type, set()).add(e.n_ops)
    return all(len(k) == 1 for k in ks.values())


#: what a ``<cell>`` placeholder of a record path may not hold (``nasdiag.vocabulary.Family.regex``)
_NOT_IN_PATH = re.compile(r"[^A-Za-z0-9_.\-+=]")


def build_groups(edges: Sequence[EdgeSpec]) -> List[Group]:
    out, named = [], {}
    for g in _groups(edges):
        path_name = _NOT_IN_PATH.sub("_", g.name) or "_"
        if path_name in named:
            raise ProbeError(
                f"the statistics groups {named[path_name]!r} and {g.name!r} both go to the record paths "
                f"cost/{path_name}/... (characters other than letters, digits and _ . - + = become _); give the edges "
                "(or cell types) names that differ there"
            )
        named[path_name] = g.name
        out.append(g if g.name == path_name else dataclasses.replace(g, name=path_name))
    return out


def _groups(edges: Sequence[EdgeSpec]) -> List[Group]:
    if all(e.cell_type is not None and e.edge_index is not None for e in edges) and _same_k_per_cell_type(edges):
        groups = []
        for t in dict.fromkeys(e.cell_type for e in edges):
            members = [p for p, e in enumerate(edges) if e.cell_type == t]
            Ks = {edges[p].n_ops for p in members}
            cell_ids = list(dict.fromkeys(edges[p].cell_index for p in members))
            slot = [cell_ids.index(edges[p].cell_index) for p in members]
            eidx = [edges[p].edge_index for p in members]
            pairs = set(zip(slot, eidx))
            if len(pairs) != len(members):
                raise ProbeError(f"two edges of cell type {t!r} share a cell and an edge index")
            E = max(eidx) + 1
            labels = [None] * E
            for p in members:
                labels[edges[p].edge_index] = labels[edges[p].edge_index] or edges[p].label
            labels = [lab or f"edge {i}" for i, lab in enumerate(labels)]
            groups.append(
                Group(t, tuple(members), torch.tensor(slot), torch.tensor(eidx), len(cell_ids), E, Ks.pop(),
                      tuple(labels), _column_names([edges[p] for p in members]))
            )
        return groups
    Ks = {e.n_ops for e in edges}
    if len(Ks) == 1:
        n = len(edges)
        return [Group("edges", tuple(range(n)), torch.zeros(n, dtype=torch.long), torch.arange(n), 1, n, Ks.pop(),
                      tuple(e.label for e in edges), _column_names(edges))]
    return [
        Group(e.name, (p,), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1, 1, e.n_ops,
              (e.label,), e.op_names)
        for p, e in enumerate(edges)
    ]
