"""The graph walk of the diagonal recursions over a module DAG.

One backward sweep over the autograd graph of the forward pass, in reverse topological order, carries
a diagonal ``h`` (same shape as the tensor) from the loss to the requested tensors:

* at a rule leaf (a module with a :class:`~nasdiag.hessian.rules.HessianRule`) the rule maps the
  diagonal w.r.t. its output to the diagonals w.r.t. its input and its parameters, and the walk jumps
  straight to the producer of the module's input;
* at any other autograd node (the glue between modules) a glue rule applies the squared backward;
* where a tensor fans out to several consumers their contributions are summed. This is the diagonal
  recursion on a DAG: the cross terms ``J_aᵀ H_ab J_b`` between the branches of a fan-out (and the
  off-diagonal terms inside each tensor) are dropped, exactly as C.1.4-C.1.5 drop the off-diagonal
  pre-activation Hessian on a chain. On a chain with a diagonal loss Hessian nothing is dropped.

Only the part of the graph between the loss and the requested tensors is visited.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge

from nasdiag.hessian.glue import UnsupportedGlue, glue_rule_for
from nasdiag.hessian.modes import CurvatureError
from nasdiag.hessian.rules.base import ModuleCall, UnsupportedModuleError, unsupported_module_message
from nasdiag.hessian.rules.elementwise import ElementwiseRule
from nasdiag.hessian.trace import Edge, ModuleTracer, RuleCall, edge_of
from nasdiag.rules import SPATIAL, analyse

__all__ = ["walk_diagonals"]

MODES = ("diag", "approx")


def walk_diagonals(
    tracer: ModuleTracer,
    loss: torch.Tensor,
    outputs: torch.Tensor,
    h_outputs: torch.Tensor,
    mode: str,
    module_targets: Optional[Mapping[str, Mapping[str, str]]] = None,
    leaf_targets: Optional[Mapping[object, str]] = None,
    observe: Optional[Mapping[Edge, str]] = None,
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Run the recursion from ``h_outputs`` (diagonal of ∂²loss/∂outputs², shape of ``outputs``).

    Args:
        tracer: the calls recorded during the forward that produced ``outputs``.
        loss: the scalar loss on ``outputs`` (its graph must still be alive).
        mode: ``"diag"`` (C.1.4-C.1.5, C.2.1-C.2.3) or ``"approx"`` (C.2.4-C.2.5).
        module_targets: ``{rule-leaf name: {param attribute: result key}}`` parameters to return.
        leaf_targets: ``{AccumulateGrad node: result key}`` leaf tensors reached through glue.
        observe: ``{(node, output index): key}`` tensors whose diagonal (and gradient) to report.

    Returns:
        ``(param_diagonals, observed_h, observed_g)``; parameter diagonals are summed over calls.
    """
    if mode not in MODES:
        raise CurvatureError(f"mode must be one of {MODES}, got {mode!r}")
    module_targets, leaf_targets = dict(module_targets or {}), dict(leaf_targets or {})
    root = edge_of(outputs)
    if root is None:
        raise CurvatureError("the model output does not require grad, so nothing in it depends on the requested tensors; "
                             "ask for tensors the model uses, outside torch.no_grad()")
    rule_calls = tracer.rule_calls
    observe_nodes: Dict[object, List[Tuple[int, str]]] = {}
    for (node, nr), key in dict(observe or {}).items():
        observe_nodes.setdefault(node, []).append((nr, key))

    def children(node) -> List[Optional[Edge]]:
        rc = rule_calls.get(node)
        if rc is not None:
            return [rc.input_edge]
        return [None if n is None else (n, nr) for n, nr in node.next_functions]

    def is_target(node) -> bool:
        rc = rule_calls.get(node)
        if rc is not None and rc.call.name in module_targets:
            return True
        return node in leaf_targets or node in observe_nodes

    order, needed = _postorder(root[0], children, is_target)
    interiors = _OpaqueInteriors(tracer)
    removed = _removed_additive_params(order, children, rule_calls, module_targets, interiors)

    # --- gradients the residual terms need, in one backward ---------------------------------
    grad_edges: List[GradientEdge] = []
    grad_slot: Dict[Tuple[object, int], int] = {}

    def want_grad(node, nr):
        if (node, nr) not in grad_slot:
            grad_slot[(node, nr)] = len(grad_edges)
            grad_edges.append(GradientEdge(node, nr))

    for node in order:
        if not needed[node]:
            continue
        rc = rule_calls.get(node)
        if rc is not None:
            if rc.input_edge is not None and needed.get(rc.input_edge[0]) and rc.rule.needs_grad_output(rc.call.module):
                want_grad(*rc.output_edge)
        else:
            glue = glue_rule_for(node)
            if glue is not None and glue.needs_grad:
                want_grad(node, 0)
        for nr, _ in observe_nodes.get(node, ()):
            want_grad(node, nr)
    grads: Sequence[Optional[torch.Tensor]] = ()
    if grad_edges:
        grads = torch.autograd.grad(loss, grad_edges, retain_graph=True, allow_unused=True)

    def grad_of(node, nr, like, who=None):
        g = grads[grad_slot[(node, nr)]]
        if g is None:
            # The sweep reached this edge, so it lies between the loss and the requested tensors, yet autograd
            # finds no path to it: the tensor's history was rewritten after it was recorded (an in-place op on
            # a view of it, e.g. ReLU(inplace=True) on InstanceNorm's output, which is a view). Its gradient,
            # which a residual term needs, cannot be read; zeros would be a silently wrong diagonal.
            raise UnsupportedModuleError(
                f"{who or reached_from.get(node, 'an op')}: ∂L/∂(its output) cannot be read because the output was "
                "modified in place through a view after it was computed (e.g. nn.ReLU(inplace=True) after an "
                "InstanceNorm), which rewrote its autograd history; turn off inplace=True in the module that "
                "follows it, or use mode='exact'"
            )
        return g

    # --- the sweep -------------------------------------------------------------------------
    opaque_by_node = {e[0]: oc for oc in tracer.opaque_calls for e in oc.output_edges}
    buffers: Dict[object, Dict[int, torch.Tensor]] = {root[0]: {root[1]: h_outputs}}
    reached_from: Dict[object, str] = {root[0]: "the model output"}
    params: Dict[str, torch.Tensor] = {}
    observed_h: Dict[str, torch.Tensor] = {}
    observed_g: Dict[str, torch.Tensor] = {}

    def push(edge: Optional[Edge], h: Optional[torch.Tensor], origin: str) -> None:
        if edge is None or h is None or not needed.get(edge[0]):
            return
        node, nr = edge
        slots = buffers.setdefault(node, {})
        prev = slots.get(nr)
        slots[nr] = h if prev is None else prev + h
        reached_from.setdefault(node, origin)

    with torch.no_grad():
        for node in reversed(order):
            if not needed[node]:
                continue
            slots = buffers.pop(node, None)
            if slots is None:
                continue
            for nr, key in observe_nodes.get(node, ()):
                h = slots.get(nr)
                if h is not None:
                    observed_h[key] = h if key not in observed_h else observed_h[key] + h
                    g = grad_of(node, nr, h)
                    observed_g[key] = g if key not in observed_g else observed_g[key] + g
            if node in leaf_targets:
                key, h = leaf_targets[node], slots.get(0)
                if h is not None:
                    params[key] = h if key not in params else params[key] + h
                continue
            rc = rule_calls.get(node)
            if rc is not None:
                h_out = slots.get(rc.output_edge[1])
                if h_out is not None:
                    _apply_rule(rc, h_out, mode, module_targets, needed, params, push, grad_of, removed.get(node, ()))
                continue
            oc = opaque_by_node.get(node)
            if oc is not None and any(True for _ in oc.module.parameters()):
                raise UnsupportedModuleError(
                    unsupported_module_message(
                        oc.name, oc.module, "has parameters but no diagonal-Hessian rule", tracer.overrides
                    )
                )
            _apply_glue(node, slots, needed, push, grad_of, tracer, reached_from, interiors)
    return params, observed_h, observed_g


def _in_one_dtype(call: ModuleCall, h_out: torch.Tensor) -> Tuple[ModuleCall, torch.Tensor]:
    """``(call, h_out)`` with the call's input, output, parameters and ``h_out`` in one floating dtype (the promotion of
    theirs), where they differ. Under autocast a module sees an input of another dtype than its parameters and than the
    diagonal coming back from the module after it (a float32 conv fed float32 data, then a Linear whose bfloat16 product
    gives a bfloat16 diagonal; an AvgPool2d on a bfloat16 conv output with a float32 diagonal from a BatchNorm), and the
    rules' kernels (``conv2d_weight``, the pooling backwards) take one dtype: before round 23 ``diag_hessian`` in
    ``diag``/``approx`` stopped there with torch's raw dtype error under CPU bfloat16 autocast."""
    tensors = [h_out, call._input, call._output, *call.params.values()]
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if len(dtypes) <= 1:
        return call, h_out
    dtype = dtypes.pop()
    for other in dtypes:
        dtype = torch.promote_types(dtype, other)
    def to(t: torch.Tensor) -> torch.Tensor:  # integer inputs (indices) stay as they are
        return t.to(dtype) if t.is_floating_point() else t

    cast = ModuleCall(call.name, call.module, to(call.input), to(call.output), {k: to(p) for k, p in call.params.items()})
    return cast, h_out.to(dtype)


def _apply_rule(rc: RuleCall, h_out, mode, module_targets, needed, params, push, grad_of, removed=()) -> None:
    call, rule = rc.call, rc.rule
    rule.check(call.module, call.name)
    call, h_out = _in_one_dtype(call, h_out)
    wanted = module_targets.get(call.name)
    if wanted:
        per_param = rule.param_diag(call, h_out) if mode == "diag" else rule.param_approx(call, h_out)
        for attr in removed:  # a following normalization removes its effect: the curvature is exactly 0
            if attr in per_param:  # (× 0 keeps a NaN or inf of the batch a NaN: flagged, not hidden)
                per_param[attr] = per_param[attr] * 0
        for attr, key in wanted.items():
            if attr in per_param:
                params[key] = per_param[attr] if key not in params else params[key] + per_param[attr]
    if rc.input_edge is not None and needed.get(rc.input_edge[0]):
        if rule.needs_grad_output(call.module):
            grad = grad_of(*rc.output_edge, h_out, f"module {call.name!r} ({type(call.module).__name__})")
            call.grad_output = grad.to(h_out.dtype) if isinstance(grad, torch.Tensor) and grad.is_floating_point() else grad
        h_in = rule.input_diag(call, h_out) if mode == "diag" else rule.input_approx(call, h_out)
        call.grad_output = None
        push(rc.input_edge, h_in, f"module {call.name!r} ({type(call.module).__name__})")


def _removed_additive_params(order, children, rule_calls, module_targets,
                             interiors: Optional["_OpaqueInteriors"] = None) -> Dict[object, Tuple[str, ...]]:
    """``{rule-call node: (attr, ...)}``: requested parameters that only add a term constant along some
    axes (a bias, :meth:`HessianRule.additive_params`) and whose output reaches the loss only through
    modules and sums that carry such a term (linear maps, max pooling, ``+``/``-``) into normalizations whose
    groups it is constant over, on every path of every fan-out. The normalizations subtract it exactly, so
    the loss does not depend on them: gradient and every Hessian entry are zero. The diagonal recursion
    alone would report ``Σ diag(H_x)`` over the channel, which is not zero (the off-diagonal terms it drops
    cancel it). The per-module facts come from the homogeneity rules of :mod:`nasdiag.rules`, told the rank
    each module was called at; a module without a diagonal-Hessian rule (``nn.ZeroPad2d``, glue inside) is
    crossed as one step by its homogeneity rule when it maps one input to one output."""
    wanted = [rc for rc in rule_calls.values() if module_targets.get(rc.call.name)]
    if not wanted:
        return {}
    consumers: Dict[Edge, List[object]] = {}
    for node in order:
        for e in children(node):
            if e is not None:
                consumers.setdefault(e, []).append(node)
    ranks: Dict[object, Optional[int]] = {}
    for rc in rule_calls.values():
        rank = rc.call.input_rank
        ranks[rc.call.module] = rank if ranks.get(rc.call.module, rank) == rank else None
    ranks = {m: r for m, r in ranks.items() if r is not None}
    out: Dict[object, Tuple[str, ...]] = {}
    for rc in wanted:
        own = _homogeneity(rc.call.module, ranks)
        # a module with an additive parameter (affine map, convolution, normalization) keeps its input's rank; on
        # a (batch, features) output there is no spatial dim, so the term is constant along it (LayerNorm's β)
        vacuous = frozenset((SPATIAL,)) if rc.call.input_rank == 2 else frozenset()
        additive = rc.rule.additive_params(rc.call.module)
        attrs = tuple(
            attr
            for attr, axes in additive.items()
            if attr in module_targets[rc.call.name]
            and _term_removed(rc.output_edge, _term_axes(frozenset(axes), own, len(additive)) | vacuous, consumers,
                              rule_calls, ranks, interiors)
        )
        if attrs:
            out[rc.output_edge[0]] = attrs
    return out


def _homogeneity(module, ranks):
    try:
        return analyse(module, ranks)
    except UnsupportedModuleError:
        return None


def _term_axes(axes, own, n_additive):
    # The Hessian rule declares the axes without knowing the rank; the homogeneity rule, told the rank, describes
    # the module's own additive term (nn.Linear on more than two dims: its bias varies along the last, a spatial,
    # dim and is constant along batch and channel). With one additive parameter that term is the parameter's, so
    # its axes are the homogeneity rule's; with several, the term of each is narrowed by what holds of their sum.
    if own is None or own.offset is None:
        return axes
    return own.offset if n_additive == 1 else axes & own.offset


#: autograd nodes through which an additive term passes unchanged (x ± y: the term of either side stays a term)
_SUMS = ("AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1")


def _module_step(node, edge: Edge, rule_calls, interiors):
    """``(module, its output edge, whether its rule differentiates through statistics)`` when ``node`` is where a
    module applied to the tensor ``edge`` starts: a rule leaf, or the first op inside an opaque leaf called on that
    one tensor alone, with one output. None for an op between modules."""
    rc = rule_calls.get(node)
    if rc is not None:
        return rc.call.module, rc.output_edge, getattr(rc.rule, "through_statistics", True)
    oc = interiors.of(node) if interiors is not None else None
    if oc is not None and len(oc.input_edges) == 1 and oc.input_edges[0] == edge and len(oc.output_edges) == 1:
        return oc.module, oc.output_edges[0], True
    return None


def _term_removed(edge: Edge, term, consumers, rule_calls, ranks, interiors=None) -> bool:
    # state per path: the axes the parameter's additive term is constant along, and, once a normalization has
    # divided by statistics that depend on it without removing it, the axes of that positive factor (None
    # before): conv(bias) -> GroupNorm(1, C) -> InstanceNorm removes the bias through both
    pending, seen = [(edge, term, None)], set()
    while pending:
        edge, term, factor = pending.pop()
        if (edge, term, factor) in seen:
            continue
        seen.add((edge, term, factor))
        after = consumers.get(edge, [])
        if not after:  # the term reaches the model's output
            return False
        for node in after:
            step = _module_step(node, edge, rule_calls, interiors)
            if step is None:
                # a sum passes the term, but not a factor that scales only one of its summands
                if type(node).__name__ not in _SUMS or factor is not None:
                    return False
                pending.append(((node, 0), term, None))
                continue
            module, output_edge, through_statistics = step
            h = _homogeneity(module, ranks)
            if h is None:
                return False
            if h.degree == 0:
                # a rule that holds the batch statistics fixed (NormRule(through_statistics=False)) computes the
                # Hessian of the frozen-statistics net, in which the term is not removed
                if not through_statistics:
                    return False
                if h.removes_term(term) and h.divides_factor(factor):
                    continue
                after_norm = h.after_normalization(term, factor)
                if after_norm is None:
                    return False
                pending.append((output_edge, *after_norm))
                continue
            passed = h.passes(term)
            if passed is None:
                return False
            passed_factor = None if factor is None else h.passes_factor(factor)
            if factor is not None and passed_factor is None:
                return False
            pending.append((output_edge, passed, passed_factor))
    return True


def _apply_glue(node, slots, needed, push, grad_of, tracer: ModuleTracer, reached_from, interiors: "_OpaqueInteriors") -> None:
    glue = glue_rule_for(node)
    nexts = node.next_functions
    wanted = [n is not None and bool(needed.get(n)) for n, _ in nexts]
    if glue is None:
        if type(node).__name__ == "BackwardHookFunctionBackward":
            raise UnsupportedModuleError(_backward_hook_message(tracer))
        why = "has no diagonal-Hessian rule"
        if type(node).__name__ == "CopySlices":  # an in-place write into a slice; torch's circular padding is one
            why += (" (an in-place write into part of a tensor, as x[i] = y or F.pad(x, p, mode='circular'); for "
                    "circular padding use the nn.CircularPad1d/2d/3d modules, which have a rule)")
        raise UnsupportedModuleError(_glue_message(node, why, tracer, reached_from))
    n_out = max(slots) + 1 if slots else 1
    n_out = max(n_out, len(getattr(node, "_input_metadata", ())) or 1)
    h_outs = [slots.get(i) for i in range(n_out)]
    grad_out = grad_of(node, 0, h_outs[0]) if glue.needs_grad else None
    if glue.joins and sum(wanted) > 1:
        # x ± f(x) inside one module (nn.Tanhshrink, a user's x + tanh(x)): the inputs are two branches of one
        # input of the module rejoined entry by entry, and the recursion would drop the cross term J_a J_b h
        # between them (-2 sech² h for Tanhshrink): the module's own diagonal would be wrong, so it needs a rule
        inside = interiors.of(node)
        if inside is not None and _rejoins_one_input(node, wanted, inside, interiors):
            raise UnsupportedModuleError(
                unsupported_module_message(
                    inside.name,
                    inside.module,
                    f"adds two functions of one of its inputs ({type(node).__name__}); the diagonal recursion would "
                    "drop the cross term between them, so it needs a rule of its own (ElementwiseRule(fn) for an "
                    "elementwise activation)",
                    tracer.overrides,
                )
            )
    if glue.bilinear and sum(wanted) > 1:
        inside = interiors.of(node)
        if inside is not None:
            raise UnsupportedModuleError(
                unsupported_module_message(
                    inside.name,
                    inside.module,
                    f"multiplies two functions of its input ({type(node).__name__}); the diagonal recursion would drop "
                    "the second-order cross term between them, so it needs a rule of its own",
                    tracer.overrides,
                )
            )
        # In forward code between modules a product of two factors is a fan-out whose cross term the DAG recursion
        # drops (w_k · O_k(x) of a mixed op); but two elementwise functions of one tensor (x * x, x * sigmoid(x)) are
        # one elementwise function of it, whose own second derivative that would drop: a silently wrong diagonal
        factors = [_elementwise_sources(e, needed, tracer.rule_calls) for e, w in zip(nexts, wanted) if w]
        if set(factors[0]) & set(factors[1]):
            raise UnsupportedModuleError(_glue_message(
                node, "multiplies two elementwise functions of one tensor (as x * x or x * torch.sigmoid(x) do); the "
                "diagonal recursion would drop the second-order cross term between the factors, so the product needs a "
                "module with a rule (nn.SiLU for x * sigmoid(x); ElementwiseRule(fn) for any elementwise fn)",
                tracer, reached_from))
    try:
        outs = glue.apply(node, h_outs, grad_out, wanted)
    except UnsupportedGlue as err:
        raise UnsupportedModuleError(_glue_message(node, f"is not supported here ({err})", tracer, reached_from)) from None
    origin = reached_from.get(node, "?")
    for (child, nr), h, want in zip(nexts, outs, wanted):
        if want and h is not None:
            shape = tuple(child._input_metadata[nr].shape)
            if tuple(h.shape) != shape:
                h = h.sum_to_size(shape)
            push((child, nr), h, origin)


#: autograd nodes of entrywise maps (also of views, which keep the entries): followed by
#: :func:`_elementwise_sources` when one input of theirs depends on the requested tensors
_ELEMENTWISE = frozenset((
    "AddBackward0", "AddBackward1", "SubBackward0", "RsubBackward0", "RsubBackward1", "NegBackward0", "MulBackward0",
    "MulBackward1", "DivBackward0", "DivBackward1", "SigmoidBackward0", "TanhBackward0", "ReluBackward0",
    "ThresholdBackward0", "WhereBackward0", "CloneBackward0", "ToCopyBackward0", "AliasBackward0",
    "NativeDropoutBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "PermuteBackward0",
    "TransposeBackward0", "TransposeBackward1", "TBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
    "SqueezeBackward3", "SqueezeBackward4", "UnsqueezeBackward0",
))


def _elementwise_sources(edge: Edge, needed, rule_calls) -> List[Edge]:
    """The tensors (edges) ``edge`` is an elementwise function of: itself, then down through entrywise ops and
    elementwise modules (``nn.Sigmoid``, ...) as long as one input of each depends on the requested tensors."""
    found: List[Edge] = []
    while edge is not None and edge not in found:
        found.append(edge)
        node = edge[0]
        rc = rule_calls.get(node)
        if rc is not None:
            edge = rc.input_edge if isinstance(rc.rule, ElementwiseRule) else None
            continue
        if type(node).__name__ not in _ELEMENTWISE:
            break
        inputs = list(dict.fromkeys((n, nr) for n, nr in node.next_functions if n is not None and needed.get(n)))
        edge = inputs[0] if len(inputs) == 1 else None
    return found


def _backward_hook_message(tracer: ModuleTracer) -> str:
    """One line for the autograd op torch wraps around a module call with a full backward hook (or pre-hook), which
    the glue message would blame on the forward code between modules and tell to wrap in a module."""
    from torch.nn.modules import module as _torch_module

    hooked = [f"{name or '<root>'!r} ({type(m).__name__})" for name, m in tracer.model.named_modules()
              if m._backward_hooks or m._backward_pre_hooks]
    if _torch_module._global_backward_hooks or _torch_module._global_backward_pre_hooks:
        hooked.append("every module (a global one: torch.nn.modules.module.register_module_full_backward_hook)")
    return (f"a full backward hook (register_full_backward_hook / register_full_backward_pre_hook) on module "
            f"{', '.join(hooked) or 'of the model'} wraps its call in an autograd op the diagonal recursions cannot "
            "cross; remove the hook for the curvature call or use mode='exact'")


def _glue_message(node, why: str, tracer: ModuleTracer, reached_from) -> str:
    op = type(node).__name__
    where = _OpaqueInteriors(tracer).of(node)  # error path: a fresh map is cheap enough
    if where is not None:
        return unsupported_module_message(
            where.name, where.module, f"computes autograd op {op}, which {why}", tracer.overrides
        )
    owners = _parameter_owners(node, tracer)
    return (
        f"autograd op {op} (in the forward code between modules, on the path reached from "
        f"{reached_from.get(node, 'the model output')}{owners}) {why}. Wrap the computation in a module and register a rule "
        "with nasdiag.hessian.register_rule(YourModule, rule), register a glue rule with "
        "nasdiag.hessian.glue.register_glue_rule(name, rule), or use mode='exact'."
    )


def _parameter_owners(node, tracer: ModuleTracer) -> str:
    """``", using parameter 'w' of module 'block' (Block)"`` for parameters the op reads directly."""
    names = {**{id(p): n for n, p in tracer.model.named_parameters()}, **tracer.tensor_names}
    found, frontier = [], [node]
    for _ in range(3):  # the parameter may sit behind a transpose or view
        frontier = [c for n in frontier for c, _ in n.next_functions if c is not None]
        for child in frontier:
            name = names.get(id(getattr(child, "variable", None)))
            if name is None or any(repr(name) in f for f in found):
                continue
            module_name = name.rpartition(".")[0]
            module = tracer.model.get_submodule(module_name)
            noted = any(f"of module {module_name or '<root>'!r}" in f for f in found)  # the note once per module
            found.append(f"parameter {name!r} of module {module_name or '<root>'!r} ({type(module).__name__})"
                         + ("" if noted else _read_by_parent(module_name, tracer)))
    return (", using " + ", ".join(found)) if found else ""


def _read_by_parent(module_name: str, tracer: ModuleTracer) -> str:
    """For a rule leaf that never ran (its parent's forward reads its parameters directly, as
    ``nn.MultiheadAttention`` reads ``out_proj.weight``): the parent, the module type that would need a rule."""
    if module_name not in tracer.rule_leaves or not module_name or \
            any(rc.call.name == module_name for rc in tracer.rule_calls.values()):
        return ""
    parent = module_name.rpartition(".")[0]
    return (f", which is never called: the forward of {parent or '<root>'!r} "
            f"({type(tracer.model.get_submodule(parent)).__name__}) reads it directly")


class _OpaqueInteriors:
    """``of(node)``: the opaque leaf whose interior (the autograd nodes between its outputs and its inputs)
    holds ``node``, or None. Mapped once per walk, on first use: the walk asks for every product and sum with
    two inputs on the path, and a supernet has many."""

    def __init__(self, tracer: ModuleTracer):
        self.tracer = tracer
        self._owner: Optional[Dict[object, object]] = None

    def of(self, node):
        if self._owner is None:
            self._owner = {}
            for oc in self.tracer.opaque_calls:
                stop = {e[0] for e in oc.input_edges}
                stack = [e[0] for e in oc.output_edges]
                while stack:
                    n = stack.pop()
                    if n is None or n in stop or n in self._owner:
                        continue
                    self._owner[n] = oc
                    stack.extend(c for c, _ in n.next_functions if c is not None)
        return self._owner.get(node)


def _rejoins_one_input(node, wanted, oc, interiors: _OpaqueInteriors) -> bool:
    """Whether two of ``node``'s wanted inputs both depend on one input of the opaque call ``oc`` through its
    interior (a fan-out inside the module that ``node`` joins again)."""
    inputs = {e[0] for e in oc.input_edges}
    reached = []
    for (child, _), want in zip(node.next_functions, wanted):
        if not want or child is None:
            continue
        found, stack, seen = set(), [child], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in inputs:
                found.add(n)
            elif interiors.of(n) is oc:
                stack.extend(c for c, _ in n.next_functions if c is not None)
        if any(found & other for other in reached):
            return True
        reached.append(found)
    return False


def _postorder(root, children, is_target):
    """Iterative DFS: nodes children-first, and whether each leads to a target."""
    order: List[object] = []
    needed: Dict[object, bool] = {}
    stack: List[Tuple[object, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            needed[node] = is_target(node) or any(e is not None and needed.get(e[0], False) for e in children(node))
            order.append(node)
            continue
        if node in needed:
            continue
        needed[node] = False  # visited; finalized when expanded
        stack.append((node, True))
        for e in children(node):
            if e is not None and e[0] not in needed:
                stack.append((e[0], False))
    return order, needed
