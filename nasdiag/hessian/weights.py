"""``diag_hessian``: diagonal Hessians of a model's weights by the BayesNAS recursions
(bayesnas-appendix C.1.2–C.1.5 for FC layers, C.2.1–C.2.5 for convolutions)."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from nasdiag.hessian._hvp import check_model, forward_failures_explained, functional_forward, preserved_buffers, scalar_loss
from nasdiag.hessian.exact_weights import (ChainDoesNotApply, as_linear_chain, chain_exact_diag, chain_fits, hvp_exact_diag,
                                           hvp_hutchinson_diag, refuse_reentrant_checkpoint)
from nasdiag.hessian.modes import WEIGHT_MODES, CurvatureError, CurvatureTypeError, check_mode, split_mode
from nasdiag.hessian.loss_curvature import LossCouplesSamplesError, output_hessian_diagonal
from nasdiag.hessian.propagate import walk_diagonals
from nasdiag.hessian.rules import HessianRule, UnsupportedModuleError
from nasdiag.hessian.rules.base import check_rules, unsupported_module_message
from nasdiag.hessian.trace import ModuleTracer

__all__ = ["diag_hessian", "HESSIAN_MODES"]

HESSIAN_MODES = WEIGHT_MODES

Params = Union[None, Mapping[str, torch.Tensor], Iterable[Union[str, Tuple[str, torch.Tensor], torch.Tensor]]]


def diag_hessian(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, object], torch.Tensor],
    inputs,
    targets,
    mode: str = "approx",
    params: Params = None,
    *,
    rules: Optional[Mapping[type, HessianRule]] = None,
) -> Dict[str, torch.Tensor]:
    """Diagonal of the Hessian of ``loss_fn(model(inputs), targets)`` w.r.t. named tensors of ``model``.

    Modes (bayesnas-appendix §C; docs/hessian.md lists what each drops, with measured errors):

    * ``"exact"``: the true diagonal. Chains of ``nn.Linear`` and elementwise activations use the
      per-sample full pre-activation recursion (C.1.2-C.1.3); any other model one Hessian-vector
      product per entry (small nets). Train-mode BatchNorm is differentiated through its batch
      statistics.
    * ``"diag"``: the diagonal recursion, C.1.4-C.1.5 for ``nn.Linear`` and C.2.1-C.2.3 for
      ``nn.Conv2d`` (unfolded to FC rows), per element of every activation, over the module DAG
      (sums at fan-outs). Exact for the last layer when the loss Hessian's diagonal is all that layer
      sees (an FC last layer with any per-sample loss); drops off-diagonal pre-activation terms below.
    * ``"approx"``: the feature-mean approximation C.2.4-C.2.5 (and its FC analogue): each linear
      layer replaces the pre-activation diagonal by its mean over batch and space per channel, and a
      BatchNorm/InstanceNorm through its statistics passes on the mean of its input diagonal over each of its
      groups. Cheapest.
    * ``"hutchinson:<k>"`` (e.g. ``"hutchinson:16"``): Hutchinson's unbiased estimate of the exact
      diagonal from k Rademacher probes (k Hessian-vector products, seed 0); k has no default.

    Args:
        model: any ``nn.Module``; ``model(inputs)`` (``model(*inputs)`` for a tuple) returns one tensor
            (N, ...). The recursions need every module on the path between the loss and the requested
            tensors to have a rule (:func:`~nasdiag.hessian.register_rule`), and the glue ops between
            modules to be sums, concatenations, views, slices, constant or weight products, softmax.
        loss_fn: ``loss_fn(outputs, targets) -> scalar``, e.g. ``F.cross_entropy`` or ``F.mse_loss``,
            mean or sum. The result is the Hessian of exactly that scalar: with ``reduction="mean"``
            (the nasdiag default) it is the Hessian of the batch mean, ``"sum"`` gives N times that.
            ``diag``/``approx`` need a per-sample loss (checked). A loss that reads a requested parameter itself
            (weight decay written into it) is refused: its curvature in that term would be left out.
        inputs, targets: one mini-batch.
        mode: ``"exact"``, ``"diag"``, ``"approx"`` or ``"hutchinson:<k>"``.
        params: which tensors; default ``model.named_parameters()``. Names (``"fc.weight"``),
            ``(name, tensor)`` pairs or a ``{name: tensor}`` mapping of parameters of ``model``; a given
            tensor is the value to evaluate at (substituted by ``torch.func.functional_call``), so
            frozen parameters and other points are fine.
        rules: per-call ``{module type: HessianRule}`` overriding the registry (``diag``/``approx``), e.g.
            ``{nn.BatchNorm2d: NormRule(through_statistics=False)}``; looked up as the registry is, so a subclass
            that keeps its base's ``forward`` takes its base's override. Keys that are no module types (a name, a
            module instance) and values that are no rule instances are refused.

    Returns:
        ``{name: tensor}`` keyed and shaped as the parameters, detached, in the parameters' dtype.
        Parameters the loss does not depend on get zeros; a NaN or inf loss gives NaN entries (never a finite
        curvature, also where torch's backward of it is finite: docs/hessian.md).

    Raises:
        UnsupportedModuleError: (``diag``/``approx``) a module or op on the path has no rule; the
            message names it, lists the supported modules and says how to register a rule.
        CurvatureError (a ``ValueError``; ``CurvatureTypeError`` for a wrong type): unknown mode or parameter name,
            a loss coupling samples (``diag``/``approx``), a loss that is not a scalar of the outputs, targets the
            loss cannot take, inputs of another dtype or device than the model's, ...

    Side effects: none. Hooks are removed on every path, BatchNorm running statistics are unchanged,
    nothing is kept between calls.
    """
    check_mode(mode, WEIGHT_MODES)
    rules = check_rules(rules)
    if rules is not None and mode not in ("diag", "approx"):
        raise CurvatureError(f"rules= only applies to mode='diag' or 'approx'; mode={mode!r} uses no per-module rules")
    check_model(model, loss_fn, "diag_hessian")
    _refuse_empty_batch(inputs)
    values = named_values(model, params)
    loss_fn = _outputs_only(loss_fn, model, values)
    name, probes = split_mode(mode)
    if name == "hutchinson":
        return _in_dtypes_of(values, hvp_hutchinson_diag(model, loss_fn, inputs, targets, values, probes))
    if mode == "exact":
        chain = as_linear_chain(model)
        if chain is not None and isinstance(inputs, torch.Tensor):
            owned = {f"{n}.{k}" if n else k for n, m in chain for k, _ in m.named_parameters(recurse=False)}
            if set(values) <= owned and chain_fits(chain, inputs):
                try:
                    with forward_failures_explained(model, inputs):
                        return _in_dtypes_of(values, chain_exact_diag(chain, loss_fn, inputs, targets, values))
                except (LossCouplesSamplesError, ChainDoesNotApply):
                    pass  # the per-sample recursion does not apply (a coupling loss, rows that are not (N, F)); HVPs do
        return _in_dtypes_of(values, hvp_exact_diag(model, loss_fn, inputs, targets, values))
    return recursion_diag(model, loss_fn, inputs, targets, mode, values, rules)


def _outputs_only(loss_fn: Callable, model: nn.Module, values: Dict[str, torch.Tensor],
                  what: str = "diag_hessian") -> Callable:
    """``loss_fn``, refusing in one line a call whose loss reads a requested parameter of the model itself, besides
    the outputs (weight decay written into the loss: ``F.cross_entropy(o, t) + λ Σ‖θ‖²`` closing over
    ``model.parameters()``). Every mode differentiates the loss in the outputs (the recursions' seed) or at the values
    substituted into the forward, so such a term's curvature (2λ per entry) was left out, silently. The loss's own
    graph is walked, stopping at the outputs. ``what`` names the caller in the line."""
    aliases = _parameter_aliases(model)
    requested = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)
                 if any(n in aliases.get(v, (v,)) for v in values)}

    def checked(outputs, targets):
        loss = loss_fn(outputs, targets)
        if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            parts = outputs.values() if isinstance(outputs, Mapping) else outputs if isinstance(outputs, (tuple, list)) else (outputs,)
            tensors = [t for t in parts if isinstance(t, torch.Tensor)]
            name = _parameter_read_by(loss, {t.grad_fn for t in tensors if t.grad_fn is not None}, requested)
            if name is not None:
                raise CurvatureError(
                    f"loss_fn reads the model's parameter {name!r} itself, not only through the model outputs (a penalty "
                    f"such as weight decay written into the loss), and {what} differentiates the loss in the outputs, "
                    "so that term's curvature would be left out; keep loss_fn a function of (outputs, targets) and add the "
                    "penalty's curvature yourself (2·λ per entry for λ·‖θ‖²)"
                )
        return loss

    return checked


def _parameter_read_by(loss: torch.Tensor, stops: set, requested: Dict[int, str]) -> Optional[str]:
    """The name of a ``requested`` parameter whose gradient accumulator the loss's graph reaches without passing
    through ``stops`` (the nodes that made the outputs), or None. A key may also be the id of a node itself (an
    edge's output node, :mod:`nasdiag.hessian.arch`)."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stops:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in requested:
            return requested[id(variable)]
        if id(node) in requested:
            return requested[id(node)]
        stack.extend(n for n, _ in node.next_functions)
    return None


def _in_dtypes_of(values: Dict[str, torch.Tensor], result: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``result`` in the dtypes of ``values`` (the parameters'), as documented: the Hessian-vector products are in the
    loss's dtype, which a loss computed in float32 on float64 outputs, or autocast, makes another (float32 or bfloat16
    diagonals of float64 or float32 parameters, where ``diag``/``approx`` gave the parameters' dtype)."""
    return {k: v.to(values[k].dtype) for k, v in result.items()}


def recursion_diag(model, loss_fn, inputs, targets, mode, values, rules=None) -> Dict[str, torch.Tensor]:
    """``diag``/``approx`` over the traced module DAG (see :func:`diag_hessian`)."""
    tracer = ModuleTracer(model, rules)
    module_targets: Dict[str, Dict[str, str]] = {}
    glue_names = []
    aliases = _parameter_aliases(model)
    for name in values:
        owners = [tracer.owner_of(alias) for alias in aliases.get(name, (name,))]
        if all(owner is None for owner, _ in owners):
            glue_names.append(name)
            continue
        for owner, attr in owners:  # a parameter held by several modules (tied weights): every holder's calls count
            if owner is None:
                continue
            module, rule = tracer.rule_leaves[owner]
            if attr not in rule.param_names:
                raise UnsupportedModuleError(
                    unsupported_module_message(
                        owner, module, f"owns {attr!r}, which its rule {type(rule).__name__} does not differentiate", rules
                    )
                )
            module_targets.setdefault(owner, {})[attr] = name
    for name in glue_names:
        _reject_unruled_owner(tracer, name, rules)

    leaves = {n: v.detach().requires_grad_(True) for n, v in values.items()}
    tracer.tensor_names.update({id(leaf): n for n, leaf in leaves.items()})
    with preserved_buffers(model), torch.enable_grad():
        with tracer:
            outputs = functional_forward(model, leaves, inputs)
        if not isinstance(outputs, torch.Tensor):
            raise CurvatureTypeError(
                f"model must return one tensor for mode={mode!r}, got {type(outputs).__name__}; return the outputs alone "
                "(or wrap the model), or use mode='exact', which takes any outputs loss_fn accepts"
            )
        loss = scalar_loss(loss_fn, outputs, targets)
        refuse_reentrant_checkpoint(loss)
        for owner in module_targets:
            if owner in tracer.unrecorded:
                module = tracer.rule_leaves[owner][0]
                raise UnsupportedModuleError(
                    f"module {owner!r} ({type(module).__name__}) {tracer.unrecorded[owner]}, so its rule cannot give the "
                    "curvature of its parameters; call it with its input as the first positional argument and use its "
                    "tensor output, or use mode='exact'"
                )
        if not outputs.requires_grad:  # the outputs do not depend on the requested tensors: zero curvature
            return {n: torch.zeros_like(v) for n, v in values.items()}
        # a loss reading the forward elsewhere than at its outputs (an auxiliary loss on features the model stored):
        # the recursion is seeded at the outputs only, so that term was left out (110% off on the layer below)
        name = _parameter_read_by(loss, {outputs.grad_fn}, {id(leaf): n for n, leaf in leaves.items()})
        if name is not None:
            raise CurvatureError(
                f"loss_fn reads a tensor the forward computed from {name!r} besides the model outputs (an auxiliary loss "
                f"on features the model stored), and mode={mode!r} starts its recursion from the loss Hessian at the "
                "outputs, so that term's curvature would be left out; use mode='exact', which differentiates the whole "
                "loss"
            )
        # every requested tensor, also one a rule leaf owns: forward code may use it too (F.linear(x, self.fc.weight)),
        # and the walk must reach that use (summed with the rule's, or refused where no glue rule applies), not skip it
        leaf_targets = {get_gradient_edge(leaves[n]).node: n for n in values}
        h_out = output_hessian_diagonal(loss_fn, outputs, targets)
        found, _, _ = walk_diagonals(tracer, loss, outputs, h_out, mode, module_targets, leaf_targets)
    return {n: (found[n].detach().reshape(v.shape) if n in found else torch.zeros_like(v)).to(v.dtype) for n, v in values.items()}


def _parameter_aliases(model: nn.Module) -> Dict[str, Tuple[str, ...]]:
    """``{name in model.named_parameters(): every name the same Parameter is registered under}`` (tied weights such
    as ``l2.weight = l1.weight`` are listed once by ``named_parameters``, under the first name)."""
    names_of: Dict[int, list] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(n)
    return {names[0]: tuple(names) for names in names_of.values()}


def _reject_unruled_owner(tracer: ModuleTracer, name: str, rules) -> None:
    """A parameter owned by a module that has no rule (and is not a container's own tensor used in
    glue code, like a supernet's α) cannot be handled."""
    module_name = name.rpartition(".")[0]
    module = tracer.opaque_leaves.get(module_name)
    # a ParameterDict/ParameterList is never called: its parameters (a supernet's α) are read by the forward of a
    # module above it, glue like a module's own tensor
    if module is not None and not isinstance(module, (nn.ParameterDict, nn.ParameterList)):
        raise UnsupportedModuleError(
            unsupported_module_message(module_name, module, f"owns parameter {name!r} but has no diagonal-Hessian rule", rules)
        )


def named_values(model: nn.Module, params: Params) -> Dict[str, torch.Tensor]:
    """Normalize ``params`` to ``{name: tensor}``, checking names and shapes against the model."""
    known = dict(model.named_parameters())
    lazy = [n for n, p in known.items() if nn.parameter.is_lazy(p)]
    if lazy:  # torch's "Can't access the shape of an uninitialized parameter" from deep inside otherwise
        raise CurvatureError(
            f"{_short(lazy)} of the model are not initialized yet (lazy modules such as nn.LazyLinear); run one forward "
            "of the model on a batch first, then take the curvature"
        )
    if params is None:
        pairs = list(known.items())
    elif isinstance(params, Mapping):
        pairs = list(params.items())
    elif isinstance(params, (str, torch.Tensor)):
        raise CurvatureTypeError(
            f"params must be a collection (names, (name, tensor) pairs or a {{name: tensor}} mapping), got one "
            f"{type(params).__name__}; wrap it in a list, e.g. params=[{params!r}]" if isinstance(params, str) else
            "params must be a collection (names, (name, tensor) pairs or a {name: tensor} mapping), got one tensor; "
            "pass params=[tensor] (a parameter of the model) or {name: value}"
        )
    elif isinstance(params, nn.Module):  # iterating it raised a bare TypeError (or, for a Sequential, listed modules)
        raise CurvatureTypeError(
            f"params must name tensors of the model, got a module ({type(params).__name__}); for its parameters pass "
            "params=list(module.parameters()), or their names as in model.named_parameters()"
        )
    elif not isinstance(params, Iterable):
        raise CurvatureTypeError(
            f"params must be a collection (names, (name, tensor) pairs or a {{name: tensor}} mapping), got "
            f"{type(params).__name__} {params!r}; pass e.g. params=['fc.weight'], or params=None for every parameter"
        )
    else:
        by_id = {id(p): n for n, p in known.items()}
        pairs = []
        for item in params:
            if isinstance(item, str):
                pairs.append((item, known.get(item)))
            elif isinstance(item, tuple) and len(item) == 2:
                pairs.append(item)
            elif isinstance(item, torch.Tensor) and id(item) in by_id:
                pairs.append((by_id[id(item)], item))
            else:
                raise CurvatureTypeError(
                    f"params entries must be names, (name, tensor) pairs or parameters of the model, got {type(item).__name__}; "
                    "name the tensor as in model.named_parameters() or pass it as a (name, value) pair"
                )
    if not pairs:
        raise CurvatureError(
            "params is empty: there is nothing to take a Hessian with respect to; "
            + ("the model has no parameters (model.named_parameters() is empty): pass a model with parameters"
               if not known else "pass the names of the parameters to differentiate, or params=None for all of them")
        )
    out = {}
    for name, value in pairs:
        if name not in known:
            tied = [a for a, names in _parameter_aliases(model).items() if name in names]
            if tied:  # registered under this name too, but named_parameters (and the result) list it once
                raise CurvatureError(
                    f"{name!r} is the same Parameter as {tied[0]!r} (tied weights), which model.named_parameters() "
                    f"and the result list once, under {tied[0]!r}; name it {tied[0]!r}"
                )
            close = [k for k in known if name.split(".")[-1] in k][:5] if isinstance(name, str) else []
            raise CurvatureError(
                f"{name!r} is not a parameter of the model; name one as in model.named_parameters()"
                + (f", e.g. {close}" if close else f" (it has {_short(list(known))})")
            )
        if not isinstance(value, torch.Tensor) or value.shape != known[name].shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise CurvatureError(
                f"params[{name!r}] must be a tensor of shape {tuple(known[name].shape)} (the parameter's), got {shape}; "
                "pass a value of that shape"
            )
        if not torch.is_floating_point(value):
            raise CurvatureError(
                f"params[{name!r}] has dtype {value.dtype}; a Hessian needs floating point: pass a value of the parameter's dtype "
                f"{known[name].dtype}"
            )
        if value.dtype != known[name].dtype or value.device != known[name].device:
            # substituted into the forward, it would meet the model's other tensors in another dtype or on another
            # device: torch's bare "self and mat2 must have the same dtype" from inside the model
            raise CurvatureTypeError(
                f"params[{name!r}] is {value.dtype} on {value.device}, but the model's parameter is {known[name].dtype} on "
                f"{known[name].device}; pass value.to(dtype={known[name].dtype}, device='{known[name].device}')"
            )
        out[name] = value
    return out


def _refuse_empty_batch(inputs) -> None:
    """A batch of no samples has no loss to differentiate (a mean over it is NaN): one line, not an IndexError from
    inside the recursion or a diagonal of zeros."""
    first = inputs[0] if isinstance(inputs, tuple) and inputs else inputs
    if isinstance(first, torch.Tensor) and first.dim() > 0 and first.shape[0] == 0:
        raise CurvatureError(
            f"inputs hold no samples (shape {tuple(first.shape)}, batch dim 0 of size 0); pass a batch of at least one sample"
        )


def _short(names, n: int = 5) -> str:
    if not names:
        return "none"
    return ", ".join(repr(x) for x in names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")
