"""Finding the edges (mixed ops) and cells of a supernet, and naming them.

Edge names:
  * discovered edges are named by their qualified module name in ``model.named_modules()``
    (nasdiag: ``"cells.<k>.edges.<e>"``, equal to ``Network.edge_specs()[i].name``; DARTS code:
    ``"cells.<k>._ops.<e>"``), so they are stable across runs and processes;
  * edges passed in ``attach(model, edges={...})`` keep the caller's keys.

The node protocol (for cell types, node pairs and output-edge costs). A module is a *cell* when it
  * declares ``output_node_slices`` (node -> (start, stop) channel range of that node in its forward
    output, dim 1) and optionally ``output_nodes``, ``edge_nodes`` (one (i, j) per edge, aligned with
    its ``edges`` ModuleList) and ``cell_type``; nasdiag's ``Cell`` does; or
  * follows the DARTS convention: ``_ops`` (ModuleList of mixed ops, edges in DARTS order), ``_steps``,
    ``_multiplier`` and a forward ``(s0, s1, weights)`` (or with more arguments: PC-DARTS's ``weights2``); its
    output is the concatenation of the last ``_multiplier`` nodes with equal channel counts, and its type is
    ``"reduce"`` if ``reduction``.
Edges that are descendants of a cell get its cell index (order of cells in ``named_modules()``), type,
their edge index (position in the cell's ``edges``/``_ops``) and node pair (declared ``edge_nodes``,
else the DARTS order for ``steps``/``_steps``).
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from nasdiag.edges import EdgesArg, EdgeSpec, EdgeSpecError, op_names_of, resolve_edges  # noqa: F401 (re-exported)
from nasdiag.edges import input_parameter, weights_parameter  # noqa: F401 (re-exported)
from nasdiag.errors import NasdiagError
from nasdiag.supernet.cell import edge_nodes as darts_edge_nodes
from nasdiag.supernet.mixed import MixedOp


class ProbeError(NasdiagError, ValueError):
    """Bad input to the probe; the message says what was wrong and how to fix it."""


@dataclass(frozen=True, eq=False)
class CellInfo:
    """A cell that declares its nodes (see module docstring).

    ``output_node_slices`` is None for DARTS-convention cells: equal chunks of the output, resolved
    from its shape at record time. ``edges`` are positions into ``Probe.edges``.
    """

    name: str
    module: nn.Module
    cell_type: Optional[str]
    cell_index: int
    output_nodes: Tuple[int, ...]
    output_node_slices: Optional[Dict[int, Tuple[int, int]]]
    edges: Tuple[int, ...] = field(default=())


def _positional_arity(module: nn.Module) -> int:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return -1
    if any(p.kind in (p.VAR_POSITIONAL,) for p in params):
        return -1
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def is_darts_mixed_op(module: nn.Module) -> bool:
    """DARTS convention: candidates in the ModuleList ``_ops`` and forward ``(x, weights)``. The DARTS
    ``Cell`` also has ``_ops`` (of mixed ops) but a forward ``(s0, s1, weights)``: it is excluded."""
    ops = getattr(module, "_ops", None)
    return isinstance(ops, nn.ModuleList) and len(ops) > 0 and _positional_arity(module) == 2


def is_mixed_op(module: nn.Module) -> bool:
    """A discovered mixed op: nasdiag's ``MixedOp`` or the DARTS convention (:func:`is_darts_mixed_op`)."""
    return isinstance(module, MixedOp) or is_darts_mixed_op(module)


def _candidates(module: nn.Module) -> Optional[Tuple[nn.Module, ...]]:
    if isinstance(module, MixedOp):
        return tuple(module.ops)
    if is_darts_mixed_op(module):
        return tuple(module._ops)
    return None


def _cell_edge_list(cell: nn.Module) -> Optional[Sequence[nn.Module]]:
    for attr in ("edges", "_ops"):
        seq = getattr(cell, attr, None)
        if isinstance(seq, (nn.ModuleList, list, tuple)):
            return seq
        if isinstance(seq, nn.ModuleDict):  # edges keyed by name ("1-2", NASLib's; "2<-1", NAS-Bench-201's), in its order
            return list(seq.values())
    return None


def _cell_declaration(module: nn.Module):
    """(output_nodes, output_node_slices or None) if ``module`` is a cell, else None."""
    slices = getattr(module, "output_node_slices", None)
    if isinstance(slices, Mapping) and slices:
        nodes = tuple(getattr(module, "output_nodes", None) or slices.keys())
        missing = [n for n in nodes if n not in slices]
        if missing:
            raise ProbeError(f"cell {type(module).__name__} declares output_nodes {list(nodes)} but no output_node_slices for {missing}")
        ranges = {int(n): (int(slices[n][0]), int(slices[n][1])) for n in nodes}
        spans = sorted(ranges.values())
        bad = [r for r in spans if not 0 <= r[0] < r[1]] or [b for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
        if bad:  # an overlap would count those channels in two nodes' output costs (and in Cor. 1.2's sum)
            raise ProbeError(
                f"cell {type(module).__name__} declares output_node_slices {ranges}: each (start, stop) must satisfy "
                f"0 <= start < stop and the ranges must not overlap (offending: {bad[0]})"
            )
        return nodes, ranges
    if (
        isinstance(getattr(module, "_ops", None), nn.ModuleList)
        and hasattr(module, "_steps")
        and hasattr(module, "_multiplier")
        and _positional_arity(module) >= 3  # (s0, s1, weights); PC-DARTS's (s0, s1, weights, weights2)
    ):
        steps, mult = int(module._steps), int(module._multiplier)
        return tuple(range(2 + steps - mult, 2 + steps)), None
    return None


def _cell_type(cell: nn.Module) -> Optional[str]:
    t = getattr(cell, "cell_type", None)
    if t is not None:
        return str(t)
    red = getattr(cell, "reduction", None)
    if isinstance(red, bool):
        return "reduce" if red else "normal"
    return None


def _declared_edge_nodes(cell: nn.Module, name: str, n_edges: int) -> None:
    """A cell's declared ``edge_nodes`` must be one (i, j), 0 <= i < j, per edge of its list: one of another length was
    ignored without a word (no node pairs, or DARTS's order from ``steps``), a pair j -> i taken as given."""
    nodes = getattr(cell, "edge_nodes", None)
    if nodes is None or callable(nodes):
        return
    try:  # ints, numpy or 0-dim torch integers (operator.index); a float or bool node number is no node
        ok = not any(isinstance(v, bool) for pair in nodes for v in pair)
        pairs = [(operator.index(i), operator.index(j)) for i, j in nodes]
    except (TypeError, ValueError):
        pairs, ok = [], False
    if not ok or len(pairs) != n_edges or any(not 0 <= i < j for i, j in pairs):
        shown = pairs if ok else " ".join(repr(nodes).split())[:80]  # one line, also for a tensor's repr
        raise ProbeError(
            f"cell {name!r} declares edge_nodes {shown}, but they must be one (i, j) pair of node numbers with "
            f"0 <= i < j per edge of its edge list, in its order ({n_edges} edges); fix or remove the declaration"
        )


def _cell_edge_nodes(cell: nn.Module, n_edges: int) -> Optional[List[Tuple[int, int]]]:
    nodes = getattr(cell, "edge_nodes", None)
    if nodes is not None and not callable(nodes) and len(nodes) == n_edges:
        return [(int(i), int(j)) for i, j in nodes]
    steps = getattr(cell, "steps", getattr(cell, "_steps", None))
    if isinstance(steps, int):
        nodes = darts_edge_nodes(steps)
        if len(nodes) == n_edges:
            return nodes
    return None


def _torchscript_refusal(what: str) -> str:
    """The line for a TorchScript module where the probe must hook Python forwards."""
    return (f"{what} is TorchScript (torch.jit.script or torch.jit.trace): its forward runs in the TorchScript "
            "interpreter, which calls no Python forward hooks on the modules inside it, so the probe cannot capture "
            "x_i, O_k(x_i) or ∂L/∂x_j there; attach the eager model (a torch.compile'd model works)")


def _scripted(modules) -> Optional[nn.Module]:
    """The first of ``modules`` (an edge's mixed op and candidate ops: the modules the probe hooks) that is TorchScript;
    a scripted submodule inside an eager candidate op (a scripted activation) is not hooked and harms nothing."""
    return next((m for m in modules if isinstance(m, torch.jit.ScriptModule)), None)


def discover(model: nn.Module, edges: Optional[EdgesArg] = None) -> Tuple[List[EdgeSpec], List[CellInfo]]:
    """The edges and cells of ``model`` (see the module docstring for naming and the node protocol).

    ``edges``: None to discover them, else any description :func:`nasdiag.edges.resolve_edges` accepts
    (bare modules are resolved by the discovery rule: nasdiag ``MixedOp`` or DARTS ``_ops``).

    Raises:
        ProbeError: no discoverable edge; an edge map naming a module not in the model; a module that is
            two edges; candidate ops that cannot be inferred; a TorchScript model, or an edge (or a scripted mixed op
            discovery would skip) holding TorchScript modules, whose forward calls no Python hooks.
    """
    if not isinstance(model, nn.Module):
        raise ProbeError(f"attach() needs an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise ProbeError(_torchscript_refusal(f"the model ({type(model).__name__})"))
    named = list(model.named_modules())
    if edges is not None:
        try:
            given = resolve_edges(model, edges, candidates=_candidates)
        except EdgeSpecError as err:
            raise ProbeError(str(err)) from None
    else:
        given = [EdgeSpec(qual, m, ops, op_names_of(m, ops)) for qual, m in named if (ops := _candidates(m)) is not None]
        # a scripted mixed op (or cell) has no ModuleList `_ops` any more: it would be left out silently
        scripted = next((q for q, m in named if isinstance(m, torch.jit.ScriptModule)
                         and (hasattr(m, "_ops") or getattr(m, "original_name", None) == MixedOp.__name__)), None)
        if scripted is not None:
            raise ProbeError(_torchscript_refusal(f"module {scripted!r}"))
        if not given and isinstance(model, torch.fx.GraphModule):
            raise ProbeError(
                f"no edges found in {type(model).__name__}: a torch.fx graph (torch.export, torch.fx.symbolic_trace) runs "
                "its mixed ops as traced operations, not as modules, so no forward hook of theirs fires; attach the eager "
                "model (a torch.compile'd model works)"
            )
        if not given:
            raise ProbeError(
                f"no edges found in {type(model).__name__}: nasdiag discovers nasdiag.supernet.MixedOp and "
                "DARTS-convention mixed ops (candidates in a ModuleList `_ops`, forward(x, weights) = Σ_k w_k·op_k(x)). "
                "For any other supernet pass edges={name: mixed-op module or (module, [candidate op modules])}."
            )

    for spec in given:
        scripted = _scripted((spec.module, *spec.ops))
        if scripted is not None:
            raise ProbeError(_torchscript_refusal(f"edge {spec.name!r} holds a {type(scripted).__name__}, which"))

    # Cells: modules declaring their nodes; an edge belongs to its nearest cell ancestor.
    cells_raw = [(q, m, d) for q, m in named if (d := _cell_declaration(m)) is not None]
    for q, m, _ in cells_raw:
        seq = _cell_edge_list(m)
        if seq is not None:
            _declared_edge_nodes(m, q, len(seq))
    cell_of_module: Dict[int, int] = {}
    inside = [{id(sub) for sub in m.modules()} for _, m, _ in cells_raw]
    for c, (q, m, _) in enumerate(cells_raw):
        for sub in m.modules():
            prev = cell_of_module.get(id(sub))
            # a deeper cell (inside the one seen before) is nearer: it takes the module; a sibling cell holding it too
            # (a mixed op tied across cells) leaves it with the first, whose path names it (it was given the last cell,
            # an edge "cells.0.edges.3" of cell "cells.1")
            if sub is not m and (prev is None or id(m) in inside[prev]):
                cell_of_module[id(sub)] = c

    infos: List[EdgeSpec] = []
    cell_edges: Dict[int, List[int]] = {}
    edge_modules = {id(spec.module) for spec in given}
    for spec in given:
        m = spec.module
        c = cell_of_module.get(id(m))
        kw = {}
        if c is not None:
            q, cell, _ = cells_raw[c]
            kw = dict(cell=q, cell_type=_cell_type(cell), cell_index=c)
            seq = _cell_edge_list(cell)
            if seq is not None:
                idx = next((e for e, x in enumerate(seq) if x is m), None)
                if idx is None:  # the one edge inside an entry of the list that is no edge itself (PC-DARTS: the ops' mix
                    # on the channel slice, mapped inside the partial-channel module at that position): that position's
                    inner = [e for e, x in enumerate(seq)  # (it had no edge index or node pair: no (E, K) per cell type)
                             if id(x) not in edge_modules and any(sub is m for sub in x.modules())]
                    if len(inner) == 1 and sum(id(sub) in edge_modules for sub in seq[inner[0]].modules()) == 1:
                        idx = inner[0]
                if idx is not None:
                    kw["edge_index"] = idx
                    pairs = _cell_edge_nodes(cell, len(seq))
                    if pairs is not None:
                        kw["src"], kw["dst"] = pairs[idx]
            cell_edges.setdefault(c, []).append(len(infos))
        # a mapped module with a forward (x, w) is taken to receive its mixing weights as w: checked on the first
        # recorded step (a second argument that is not (K,) or (B, K) weights is ignored, see StepCapture.edge_pre)
        takes_weights = is_mixed_op(m) or (edges is not None and _positional_arity(m) == 2)
        infos.append(dataclasses.replace(spec, weights_arg=takes_weights, **kw))

    cells = [
        CellInfo(q, m, _cell_type(m), c, d[0], d[1], tuple(cell_edges.get(c, ())))
        for c, (q, m, d) in enumerate(cells_raw)
    ]
    return infos, cells
