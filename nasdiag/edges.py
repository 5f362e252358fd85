"""One description of a supernet edge, and the one function that turns user input into such descriptions.

An *edge* is a mixed op: a module whose forward output is ``x_j = Σ_k Z_k O_k(x_i)`` over K candidate op
modules O_k (wiring supplement §2, eq. of the cost assignment; sparse-supernet eq. 1 for real-valued Z).
``Network.edge_specs()`` (the reference supernet), the probe's discovery (any model) and the curvature
engines (``nasdiag.hessian``) all speak :class:`EdgeSpec`. This module depends on ``torch.nn`` only, so
every layer may import it.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Callable, List, Mapping, Optional, Sequence, Tuple, Union

from torch import nn

from nasdiag.errors import NasdiagError

__all__ = ["EdgeSpec", "EdgeSpecError", "EdgesArg", "op_names_of", "resolve_edges"]


class EdgeSpecError(NasdiagError, ValueError):
    """Bad edge description; the message says what was wrong and how to fix it."""


@dataclass(frozen=True)
class EdgeSpec:
    """One edge of a supernet.

    Attributes:
        name: stable name; for discovered edges the qualified module name in ``model.named_modules()``
            (nasdiag's ``Network``: ``"cells.<k>.edges.<e>"``), else the key the caller chose.
        module: the mixed op; its forward output is the edge output ``Σ_k Z_k O_k(x)``.
        ops: the K candidate op modules, in mixing-weight order.
        op_names: K labels (the mixed op's ``primitives``, else ``"<k>:<class name>"``).
        weights_arg: True when the mixing weights are the forward's second argument (or ``weights=``), as
            for nasdiag's ``MixedOp`` and the DARTS convention.
        cell: qualified name of the cell holding the edge; cell_type (``"normal"``/``"reduce"``),
            cell_index, edge_index (position in the cell, DARTS order), src, dst (node pair i -> j):
            where known, else None.
    """

    name: str
    module: nn.Module = field(repr=False)
    ops: Tuple[nn.Module, ...] = field(repr=False)
    op_names: Tuple[str, ...]
    weights_arg: bool = True
    cell: Optional[str] = None
    cell_type: Optional[str] = None
    cell_index: Optional[int] = None
    edge_index: Optional[int] = None
    src: Optional[int] = None
    dst: Optional[int] = None

    @property
    def n_ops(self) -> int:
        """K, the number of candidate ops."""
        return len(self.ops)

    @property
    def label(self) -> str:
        """``"i->j"`` when the node pair is known, else the name."""
        return f"{self.src}->{self.dst}" if self.src is not None else self.name


def op_names_of(module: nn.Module, ops: Sequence[nn.Module]) -> Tuple[str, ...]:
    """K labels of a mixed op's candidates: its ``primitives`` if it has one name (a string) per op, else
    ``"<k>:<class>"``. NASLib's ``MixedOp.primitives`` is the list of op modules themselves: their multi-line reprs were
    taken for the labels of the record's columns."""
    names = getattr(module, "primitives", None)
    try:  # a list, tuple or array of names (not a string, whose letters would be taken for them)
        names = list(names) if names is not None and not isinstance(names, (str, nn.Module)) else None
    except TypeError:
        names = None
    if names is not None and len(names) == len(ops) and all(isinstance(n, str) for n in names):
        return tuple(str(n) for n in names)
    return tuple(f"{k}:{type(op).__name__}" for k, op in enumerate(ops))


#: what :func:`resolve_edges` accepts: ``{name: EdgeSpec | (module, [ops]) | module}`` or a sequence of EdgeSpec
EdgesArg = Union[Mapping[str, object], Sequence[EdgeSpec]]


def resolve_edges(model: nn.Module, edges: EdgesArg,
                  candidates: Optional[Callable[[nn.Module], Optional[Sequence[nn.Module]]]] = None) -> List[EdgeSpec]:
    """Check a caller's edge description against ``model`` and return one :class:`EdgeSpec` per edge.

    Args:
        model: the module the edges must belong to.
        edges: ``{name: value}`` with value an :class:`EdgeSpec` (or any object with ``.module`` and
            ``.ops``), a pair ``(mixed-op module, [candidate op modules])``, or a bare mixed-op module when
            ``candidates`` can tell its ops; or a sequence of :class:`EdgeSpec` (e.g.
            ``Network.edge_specs()``), keyed by their ``.name``. Mapping keys name the result.
        candidates: ``candidates(module) -> ops or None`` for bare modules (the probe passes its discovery
            rule); without it a bare module is refused.

    Returns:
        EdgeSpecs in the order given; what an input EdgeSpec knew (cell, node pair, ...) is kept.

    Raises:
        EdgeSpecError: an empty or malformed description, a module (mixed op or candidate) that is not a
            submodule of ``model``, a candidate that is not a submodule of its mixed op, a module listed as two
            edges, an edge without candidate ops, a candidate that is the mixed op itself.
    """
    if isinstance(edges, (list, tuple)) and edges and all(hasattr(e, "name") and hasattr(e, "module") for e in edges):
        names = [e.name for e in edges]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # a dict would keep only the last of them: an edge silently lost
            raise EdgeSpecError(
                f"edge name(s) {', '.join(repr(n) for n in twice)} given to more than one EdgeSpec; names key the "
                "results, so give each edge its own name (e.g. dataclasses.replace(spec, name=...))"
            )
        edges = {e.name: e for e in edges}
    if not isinstance(edges, Mapping) or not edges:
        raise EdgeSpecError(
            "edges must be a non-empty {edge name: mixed-op module or (mixed-op module, [candidate op modules])} "
            f"mapping or a list of EdgeSpec (e.g. net.edge_specs()), got {type(edges).__name__}"
        )
    in_model = {id(m) for m in model.modules()}
    specs: List[EdgeSpec] = []
    seen = {}
    for name, value in edges.items():
        if not isinstance(name, str):
            raise EdgeSpecError(f"edge names must be strings, got {name!r} ({type(name).__name__})")
        spec = _spec_of(name, value, candidates)
        for what, m in [("mixed op", spec.module)] + [(f"candidate op {k}", o) for k, o in enumerate(spec.ops)]:
            if id(m) not in in_model:
                raise EdgeSpecError(
                    f"edge {name!r}: its {what} ({type(m).__name__}) is not a submodule of the model; pass modules "
                    "of this model instance, e.g. from model.named_modules() or model.edge_specs() (was the model "
                    "copied after building the map?)"
                )
        itself = [k for k, o in enumerate(spec.ops) if o is spec.module]
        if itself:  # its forward hook would fire after the edge's own: a candidate that never seems to run
            raise EdgeSpecError(
                f"edge {name!r}: candidate op(s) {itself} are the mixed op {type(spec.module).__name__} itself; list the "
                "candidate modules its forward calls, e.g. (module, list(module.ops))"
            )
        inside = {id(m) for m in spec.module.modules()}
        foreign = [k for k, o in enumerate(spec.ops) if id(o) not in inside]
        if foreign:
            raise EdgeSpecError(
                f"edge {name!r}: candidate op(s) {foreign} ({', '.join(type(spec.ops[k]).__name__ for k in foreign)}) "
                f"are not submodules of the mixed op {type(spec.module).__name__}, so they are not what it mixes; "
                "list the modules its forward calls, e.g. (module, list(module.ops))"
            )
        if id(spec.module) in seen:
            raise EdgeSpecError(
                f"edges {seen[id(spec.module)]!r} and {name!r} are the same module: a module cannot be two edges; "
                "list each edge once"
            )
        seen[id(spec.module)] = name
        specs.append(spec)
    return specs


def _spec_of(name: str, value, candidates) -> EdgeSpec:
    if isinstance(value, EdgeSpec):
        module, ops = value.module, value.ops
    elif isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], nn.Module):
        module, ops = value
    elif isinstance(value, nn.Module):
        _check_called(name, value)
        module, ops = value, candidates(value) if candidates is not None else None
        if ops is None:
            # a module with `_ops` whose forward takes another argument (x, weights, tau=1.0) was told it had no `_ops`;
            # without a discovery rule (the curvature functions) the reason is only that ops are taken explicitly
            listed = next((a for a in ("_ops", "ops") if isinstance(getattr(value, a, None), nn.ModuleList)), None)
            how = f"(module, list(module.{listed}))" if listed else "(module, [candidate op modules])"
            if candidates is None:
                why = f"this function takes each edge's candidate ops explicitly, in the order the module mixes them; pass {how}"
            elif listed == "_ops":
                why = ("its forward does not take exactly two positional arguments (x, weights), so it is not taken for a "
                       f"DARTS-convention mixed op; pass {how}")
            else:
                why = f"it is neither a nasdiag MixedOp nor a DARTS-convention mixed op with `_ops`; pass {how}"
            raise EdgeSpecError(f"edge {name!r}: cannot tell the candidate ops of a {type(value).__name__}: {why}")
    elif hasattr(value, "module") and hasattr(value, "ops"):
        module, ops = value.module, value.ops
    else:
        raise EdgeSpecError(
            f"edge {name!r} maps to {type(value).__name__}; expected an EdgeSpec, a mixed-op module or "
            "(mixed-op module, [candidate op modules])"
        )
    if not isinstance(module, nn.Module):
        raise EdgeSpecError(f"edge {name!r}: the mixed op must be an nn.Module, got {type(module).__name__}")
    _check_called(name, module)
    try:
        ops = tuple(ops)
    except TypeError:
        ops = ()
    if not ops or not all(isinstance(o, nn.Module) for o in ops):
        raise EdgeSpecError(f"edge {name!r}: the candidate ops must be a non-empty sequence of nn.Module")
    if isinstance(value, EdgeSpec):
        return value if value.name == name else dataclasses.replace(value, name=name)
    return EdgeSpec(name, module, ops, op_names_of(module, ops))


def _check_called(name: str, module: nn.Module) -> None:
    """A container without a forward of its own (``nn.ModuleList``, ``nn.ModuleDict``) is never called, so no edge
    output exists to read: its costs would be NaN at every step, with a warning to run the forward that did run."""
    if getattr(type(module), "forward", None) is nn.Module.forward:
        raise EdgeSpecError(
            f"edge {name!r}: the mixed op is a {type(module).__name__}, which has no forward of its own and is never "
            "called, so there is no edge output Σ_k w_k·op_k(x) to read; map a module whose forward returns that sum "
            "(where the cell's forward mixes the ops itself, as NAS-Bench-201's search cell does with "
            "sum(op(x) * w for op, w in zip(ops, weights)), move that line into a small module with forward(x, weights))"
        )


def _positional_parameter(module: nn.Module, index: int, default: str) -> str:
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return default
    return params[index].name if len(params) > index else default


def weights_parameter(module: nn.Module) -> str:
    """The name of a mixed op's second forward parameter, the mixing weights when passed by keyword
    (``forward(x, w)`` called as ``op(x, w=w)``); ``"weights"`` where the signature cannot tell."""
    return _positional_parameter(module, 1, "weights")


def input_parameter(module: nn.Module) -> str:
    """The name of a mixed op's first forward parameter, its input x_i when passed by keyword
    (``op(x=h, weights=w)``); ``"x"`` where the signature cannot tell."""
    return _positional_parameter(module, 0, "x")
