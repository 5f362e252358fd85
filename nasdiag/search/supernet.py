"""What a search method needs from a supernet, and the adapter for supernets nasdiag did not build.

A method talks to ``method.network`` through this interface (nasdiag's
:class:`~nasdiag.supernet.Network` offers it natively):

- ``cell_types`` (list of str), ``cells`` (each with ``.cell_type``), ``steps``, ``multiplier``,
  ``primitives``, ``num_edges``;
- ``alphas()`` → ``{cell type: nn.Parameter (E, K)}``, ``arch_parameters()``, ``weight_parameters()``;
- ``forward(x, weights, active=None)`` with ``weights`` a ``{cell type: (E, K)}`` mapping or one
  (E, K) tensor per cell, and ``active`` an optional ``{cell type: (E, K) bool}`` of ops to compute;
- ``edge_specs()``.

:func:`adapt` gives that interface to a DARTS-convention supernet (``model_search.py`` of the DARTS
code and its descendants): mixed ops with candidates in a ModuleList ``_ops`` and a forward
``(x, weights) = Σ_k w_k·op_k(x)``, cells with ``_ops``, ``_steps``, ``_multiplier``, ``reduction`` and a
forward ``(s0, s1, weights)``, and α as ``alphas_<cell type>`` attributes of the model.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from nasdiag.errors import ConfigError
from nasdiag.hooks import Hooks
from nasdiag.supernet import Network


def as_supernet(model: nn.Module):
    """``model`` itself if it offers the interface above, else :func:`adapt` ``(model)``."""
    if isinstance(model, (Network, AdaptedSupernet)):
        return model
    required = ("cell_types", "cells", "alphas", "arch_parameters", "weight_parameters", "edge_specs")
    if all(hasattr(model, a) for a in required):
        return model
    return adapt(model)


@dataclass(frozen=True, eq=False)
class CellView:
    """One cell of an adapted supernet: its qualified name, module, type and position among the cells."""

    name: str
    module: nn.Module
    cell_type: str
    index: int


def adapt(model: nn.Module, *, alphas: Optional[Mapping[str, torch.Tensor]] = None,
          primitives: Optional[Sequence[str]] = None, skip_inactive: bool = True) -> "AdaptedSupernet":
    """The supernet interface around a DARTS-convention ``model`` (see the module docstring).

    Args:
        model: the supernet. Its edges and cells are found by ``nasdiag.probe`` discovery; every edge
            must belong to a cell with a type (``reduction``) and an edge index.
        alphas: ``{cell type: (E, K) tensor}``; default the model's ``alphas_<cell type>`` attributes.
            α kept as plain tensors (DARTS keeps Variables outside the module) or as buffers are re-registered
            as ``nn.Parameter`` s of ``model`` sharing their storage, so that ``state_dict``, ``.to()`` and
            DDP see them; the model's own lists of them (``_arch_parameters``) see every update.
        primitives: K op names (default: the mixed ops' ``primitives``, else ``"<k>:<class name>"``);
            the genotype rule needs a ``"none"`` name to exclude it.
        skip_inactive: compute only active ops (see :class:`AdaptedSupernet`); False computes every op
            with the inactive mixing weights masked to zero (warns once).

    Raises:
        ConfigError: no edges, edges outside typed cells, cells of one type with different edge
            counts, a cell whose edges are not in DARTS's layout (a cell declaring its nodes, docs/probe.md, is
            read when they are: its steps and multiplier from its node pairs and last output nodes; NAS-Bench-201's
            cell is not), missing α, α of the wrong shape.
    """
    return AdaptedSupernet(model, alphas=alphas, primitives=primitives, skip_inactive=skip_inactive)


def _whole(value) -> Optional[int]:
    """``value`` as an int where it is a whole number (an int, numpy's or torch's integer), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _darts_layout(model: nn.Module, cells, edges) -> Tuple[int, int]:
    """(steps, multiplier) of the DARTS cells of ``model``, which every method's genotype and edge dependencies read:
    a cell's ``_steps``/``steps`` (else the count whose DARTS order its declared node pairs follow) and
    ``_multiplier``/``multiplier`` (else its declared output nodes, the last ones). A cell of another layout
    (NAS-Bench-201's, whose node 1 has one input) or cells of different sizes raise `ConfigError`."""
    from nasdiag.supernet.cell import edge_nodes

    found = set()
    for cell in cells:
        pairs = [(e.src, e.dst) for e in sorted((e for e in edges if e.cell_index == cell.cell_index), key=lambda e: e.edge_index)]
        steps = _whole(getattr(cell.module, "_steps", getattr(cell.module, "steps", None)))
        if steps is None:
            steps = next((s for s in range(len(pairs) + 1) if len(edge_nodes(s)) == len(pairs)), None)
        if (steps is None or steps < 1 or len(pairs) != len(edge_nodes(steps))
                or any(p != q for p, q in zip(pairs, edge_nodes(steps)) if None not in p)):
            raise ConfigError(
                f"cannot adapt {type(model).__name__}: cell {cell.name!r} is not a DARTS cell (its {len(pairs)} edges join the "
                f"nodes {pairs}; a DARTS cell of `_steps` nodes feeds each node j >= 2 from every earlier one, nodes 0 and 1 its "
                "inputs), and the methods' genotype and edge dependencies read that layout; search it in a loop of your own "
                "with nasdiag.attach (docs/probe.md)")
        multiplier = _whole(getattr(cell.module, "_multiplier", getattr(cell.module, "multiplier", None)))
        if multiplier is None and tuple(cell.output_nodes) == tuple(range(2 + steps - len(cell.output_nodes), 2 + steps)):
            multiplier = len(cell.output_nodes)
        if multiplier is None or not 1 <= multiplier <= steps:
            raise ConfigError(f"cannot adapt {type(model).__name__}: cell {cell.name!r} has no `_multiplier` in [1, {steps}] "
                              f"(the last nodes its output concatenates), got {multiplier!r}; give the cell `_multiplier`")
        found.add((steps, multiplier))
    if len(found) != 1:
        raise ConfigError(f"cannot adapt {type(model).__name__}: its cells differ in (steps, multiplier) {sorted(found)}; "
                          "nasdiag's methods read one cell layout")
    return found.pop()


class AdaptedSupernet(nn.Module):
    """A DARTS-convention supernet seen through nasdiag's supernet interface (built by :func:`adapt`).

    ``forward(x, weights, active)`` calls the model's own forward; for its duration (hooks of one
    ``nasdiag.hooks.Hooks`` plan, removed in ``finally`` on every path) a forward pre-hook on every mixed
    op replaces the mixing-weights argument its cell passes (DARTS: softmax(α); positional, or by the keyword of the
    op's second forward parameter) by the row of the given per-cell Z, so ∂L/∂Z reaches the Z leaves and α is
    untouched by the forward. It runs before the op's other pre-hooks, so a probe (``nasdiag.attach(network)``) and the
    curvature routes see the Z the method passes.

    Active ops: with ``active``, a second pre-hook, run after every other (so a probe still sees the (K,) row of Z
    and which ops it weighs), hands the mixed op a ModuleList of its active candidates (swapped into ``_ops`` for this
    call, restored in ``finally``) and the matching entries of Z, so the DARTS forward
    ``sum(w * op(x) for w, op in zip(weights, self._ops))`` computes only those. This relies
    on the convention that the mixed op iterates ``_ops`` together with ``weights``; for a mixed op that
    does otherwise, adapt with ``skip_inactive=False``: every op is then computed and inactive ones get
    mixing weight 0 (same outputs and costs, no saving).
    """

    def __init__(self, model: nn.Module, *, alphas=None, primitives=None, skip_inactive: bool = True):
        super().__init__()
        from nasdiag.probe.discovery import ProbeError, discover, weights_parameter

        self.model = model
        try:
            edges, cells = discover(model)
        except ProbeError as err:
            raise ConfigError(f"cannot adapt {type(model).__name__} as a supernet: {err}") from None
        untyped = [e.name for e in edges if e.cell_index is None or e.cell_type is None or e.edge_index is None]
        if untyped:
            raise ConfigError(
                f"cannot adapt {type(model).__name__}: edges {untyped[:3]} are not inside a DARTS-convention cell with a "
                "type (`reduction`) and an edge position (`_ops`); give the cells `_ops`, `_steps`, `_multiplier`, `reduction`")
        used = sorted({e.cell_index for e in edges})
        self.cells: List[CellView] = [CellView(cells[c].name, cells[c].module, cells[c].cell_type, slot)
                                      for slot, c in enumerate(used)]
        slot_of = {c: slot for slot, c in enumerate(used)}
        present = {c.cell_type for c in self.cells}
        self._cell_types = [t for t in ("normal", "reduce") if t in present] + sorted(present - {"normal", "reduce"})
        self._edges = list(edges)
        E = {t: 1 + max(e.edge_index for e in edges if e.cell_type == t) for t in self._cell_types}
        for slot, c in enumerate(used):
            n = sum(1 for e in edges if e.cell_index == c)
            if n != E[self.cells[slot].cell_type]:
                raise ConfigError(f"cell {cells[c].name!r} has {n} edges, other {self.cells[slot].cell_type} cells have "
                                  f"{E[self.cells[slot].cell_type]}; α cannot be shared by the cells of a type")
        Ks = {e.n_ops for e in edges}
        if len(Ks) != 1:
            raise ConfigError(f"the mixed ops have different numbers of candidate ops {sorted(Ks)}; nasdiag needs one K")
        K = Ks.pop()
        self.primitives = list(primitives) if primitives is not None else list(edges[0].op_names)
        if len(self.primitives) != K:
            raise ConfigError(f"primitives names {len(self.primitives)} ops but the mixed ops have K={K}")
        self._E = E
        self.steps, self.multiplier = _darts_layout(model, [cells[c] for c in used], edges)
        self._alpha_names = self._bind_alphas(alphas, K)
        # per mixed op: (cell slot, edge index, candidate ops); the pre-hook plan is built once
        self._where = {id(e.module): (slot_of[e.cell_index], e.edge_index, e.ops) for e in edges}
        # the name of each mixed op's weights parameter, for a cell that passes them by keyword (``op(x, weights=w)``)
        self._weights_names = {id(e.module): weights_parameter(e.module) for e in edges}
        self._hooks = Hooks()
        for e in edges:
            # first among the op's pre-hooks: a probe's or a curvature route's hooks, installed before this forward,
            # then see (and shift) the substituted Z, not the weights the cell passes
            self._hooks.forward_pre(e.module, self._substitute, with_kwargs=True, prepend=True)
            # last: the pre-hooks before it (a probe's) read the (K,) row; only the op's own forward gets the active ops
            self._hooks.forward_pre(e.module, self._keep_active, with_kwargs=True)
        self.skip_inactive = bool(skip_inactive)
        self._warned_dense = False
        self._forward_state: Optional[Tuple[list, Optional[list]]] = None
        self._swapped: Dict[int, Tuple[nn.Module, nn.Module]] = {}

    # -- α --------------------------------------------------------------------------------------
    def _bind_alphas(self, alphas, K: int) -> Dict[str, str]:
        names = {}
        for t in self._cell_types:
            if alphas is not None:
                if t not in alphas:
                    raise ConfigError(f"alphas lacks cell type {t!r}; give {{{', '.join(repr(c) for c in self._cell_types)}: (E, K) tensor}}")
                a = alphas[t]
                owner = next((n for n, p in self.model.named_parameters() if p is a), None)
            else:
                owner = f"alphas_{t}"
                a = getattr(self.model, owner, None)
                if a is None:
                    raise ConfigError(f"{type(self.model).__name__} has no attribute {owner!r}; pass adapt(model, alphas={{cell type: α}})")
            if not isinstance(a, torch.Tensor) or tuple(a.shape) != (self._E[t], K):
                raise ConfigError(f"α of the {t} cells must be a ({self._E[t]}, {K}) tensor, got "
                                  f"{tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__}")
            if owner is None or not isinstance(a, nn.Parameter):
                # a plain tensor (DARTS's Variable): register it on the model, sharing its storage
                owner = owner or f"alphas_{t}"
                param = nn.Parameter(a.detach(), requires_grad=True)
                if owner in self.model.__dict__:
                    del self.model.__dict__[owner]
                self.model._buffers.pop(owner, None)  # α kept as a buffer (out of parameters()): torch's KeyError before
                self.model.register_parameter(owner, param)
            names[t] = owner
        return names

    # -- the interface --------------------------------------------------------------------------
    @property
    def cell_types(self) -> List[str]:
        return list(self._cell_types)

    @property
    def num_edges(self) -> int:
        return max(self._E.values())

    @property
    def layers(self) -> int:
        return len(self.cells)

    def alphas(self) -> Dict[str, nn.Parameter]:
        """``{cell type: α (E, K)}``."""
        return {t: self.model.get_parameter(n) for t, n in self._alpha_names.items()}

    def arch_parameters(self) -> List[nn.Parameter]:
        return list(self.alphas().values())

    def weight_parameters(self) -> List[nn.Parameter]:
        arch = {id(a) for a in self.arch_parameters()}
        return [p for p in self.model.parameters() if id(p) not in arch]

    def softmax_weights(self) -> Dict[str, torch.Tensor]:
        return {t: torch.softmax(a, dim=-1) for t, a in self.alphas().items()}

    def edge_specs(self):
        """Every edge (name, module, ops, op_names, cell_type, cell_index, edge_index, src, dst), in
        discovery order; names are qualified module names of the adapted model."""
        return list(self._edges)

    # -- forward --------------------------------------------------------------------------------
    def _per_cell(self, value, what: str) -> list:
        if isinstance(value, Mapping):
            missing = [t for t in self._cell_types if t not in value]
            if missing:
                raise ValueError(f"{what} missing for cell types {missing}; got keys {list(value)}")
            return [value[c.cell_type] for c in self.cells]
        value = list(value)
        if len(value) != len(self.cells):
            raise ValueError(f"a sequence of {what} needs one (E, K) tensor per cell ({len(self.cells)}), got {len(value)}")
        return value

    def forward(self, x: torch.Tensor, weights=None, active=None) -> torch.Tensor:
        """The model's forward with mixing weights Z (``{cell type: (E, K)}`` or one (E, K) per cell;
        default softmax(α)) and optional active-op masks (same forms, bool; read on the host once)."""
        per_cell = self._per_cell(self.softmax_weights() if weights is None else weights, "mixing weights")
        if any(w.dim() != 2 for w in per_cell):
            raise ValueError("an adapted supernet takes (E, K) mixing weights per cell; per-sample (E, B, K) "
                             "weights need nasdiag's own Network")
        K = len(self.primitives)
        for cell, w in zip(self.cells, per_cell):  # DARTS's zip(weights, self._ops) dropped ops of a short row silently
            if tuple(w.shape) != (self._E[cell.cell_type], K):
                raise ValueError(f"the mixing weights of cell {cell.name!r} ({cell.cell_type}) must be (E, K) = "
                                 f"({self._E[cell.cell_type]}, {K}), got {tuple(w.shape)}")
        masks = None
        if active is not None:
            masks = [torch.as_tensor(m).bool().cpu() for m in self._per_cell(active, "active-op masks")]
            if not self.skip_inactive and not self._warned_dense:
                warnings.warn("this adapted supernet computes every op (skip_inactive=False): inactive ops get "
                              "mixing weight 0 but are still computed", stacklevel=2)
                self._warned_dense = True
        self._forward_state = (per_cell, masks)
        try:
            with self._hooks:
                return self.model(x)
        finally:
            self._forward_state = None
            for module, original in self._swapped.values():
                module._ops = original
            self._swapped.clear()

    def _substitute(self, module: nn.Module, args: tuple, kwargs: dict):
        slot, e, ops = self._where[id(module)]
        per_cell, masks = self._forward_state
        row = per_cell[slot][e]
        if masks is not None:
            mask = masks[slot][e]
            if not bool(mask.any()):
                raise ValueError(f"every candidate op of edge {e} of cell {self.cells[slot].name!r} is inactive; "
                                 "keep at least one op per edge active")
            if not self.skip_inactive:
                row = row * mask.to(row.device, row.dtype)
        if len(args) >= 2:
            return (args[0], row) + tuple(args[2:]), kwargs
        name = self._weights_names[id(module)]
        if name in kwargs and len(args) == 1:
            # passed on positionally (the op's second parameter), the way the curvature routes' hooks read them
            return (args[0], row), {k: v for k, v in kwargs.items() if k != name}
        raise ConfigError(f"mixed op {type(module).__name__} was called without its mixing weights (the DARTS convention "
                          f"passes them as the second argument, forward(x, {name}))")

    def _keep_active(self, module: nn.Module, args: tuple, kwargs: dict):
        """With ``active`` and ``skip_inactive``: the active candidates swapped into ``_ops`` and their entries of the
        (K,) row (the second positional argument, where :meth:`_substitute` put it)."""
        per_cell, masks = self._forward_state
        if masks is None or not self.skip_inactive:
            return None
        slot, e, ops = self._where[id(module)]
        idx = masks[slot][e].nonzero().flatten()
        self._swapped.setdefault(id(module), (module, module._ops))  # the original, once per forward
        module._ops = nn.ModuleList(ops[k] for k in idx.tolist())
        return (args[0], args[1][idx.to(args[1].device)]) + tuple(args[2:]), kwargs
