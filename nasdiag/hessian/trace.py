"""Record which module consumed and produced which autograd edge during one forward pass.

Modules whose type has a diagonal-Hessian rule are *rule leaves*: their interior is never walked, the
rule stands in for it. Childless modules without a rule are *opaque leaves*: the graph walk goes
through their interior op by op (glue rules), unless they own parameters, which is an error.
Everything else is a container whose forward code is glue between its children.

Hooks live only inside the ``with`` block; nothing is kept on the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from nasdiag.hessian.modes import CurvatureRuntimeError
from nasdiag.hessian.rules import HessianRule, ModuleCall, rule_for
from nasdiag.hooks import Hooks

__all__ = ["ModuleTracer", "RuleCall", "OpaqueCall"]

Edge = Tuple[object, int]  # (autograd node, output index)


def edge_of(t: torch.Tensor) -> Optional[Edge]:
    """The autograd edge that produced ``t`` (None if it does not require grad)."""
    if not t.requires_grad:
        return None
    e = get_gradient_edge(t)
    return (e.node, e.output_nr)


@dataclass
class RuleCall:
    call: ModuleCall
    rule: HessianRule
    input_edge: Optional[Edge]
    output_edge: Edge


@dataclass
class OpaqueCall:
    name: str
    module: nn.Module
    input_edges: List[Edge] = field(default_factory=list)
    output_edges: List[Edge] = field(default_factory=list)


class ModuleTracer:
    """``with ModuleTracer(model) as tracer: out = model(x)`` records the calls of ``model``'s leaves.

    Attributes (after the forward):
        rule_calls: ``{output node: RuleCall}``.
        opaque_calls: opaque leaves that ran on tensors requiring grad.
        leaf_names: ``{module: qualified name}`` of rule leaves.
    """

    def __init__(self, model: nn.Module, overrides: Mapping[type, HessianRule] | None = None):
        self.model = model
        self.overrides = overrides
        self.rule_calls: Dict[object, RuleCall] = {}
        self.opaque_calls: List[OpaqueCall] = []
        self.rule_leaves: Dict[str, Tuple[nn.Module, HessianRule]] = {}
        self.opaque_leaves: Dict[str, nn.Module] = {}
        #: ``{id(tensor): parameter name}`` of substituted leaves, for error messages (set by the caller)
        self.tensor_names: Dict[int, str] = {}
        #: ``{rule-leaf name: why}``: calls on the graph that its rule could not record (no single input tensor,
        #: an output that is not one tensor); the walk crosses them op by op, their own parameters it cannot reach
        self.unrecorded: Dict[str, str] = {}
        self._hooks = Hooks()
        self._leaf_of: Dict[int, tuple] = {}
        self._classify()

    def _classify(self) -> None:
        seen = set()
        stack = [("", self.model)]
        while stack:
            name, module = stack.pop()
            if id(module) in seen:  # a module registered under two names is hooked once
                continue
            seen.add(id(module))
            rule = rule_for(module, self.overrides)
            children = list(module.named_children())
            if rule is not None:
                self.rule_leaves[name] = (module, rule)
            elif not children:
                self.opaque_leaves[name] = module
            else:
                stack.extend((f"{name}.{child}" if name else child, m) for child, m in reversed(children))

    def owner_of(self, param_name: str) -> Tuple[Optional[str], str]:
        """``(rule-leaf module name, attribute)`` owning ``param_name``, or ``(None, param_name)``."""
        parts = param_name.split(".")
        for cut in range(len(parts) - 1, -1, -1):
            prefix = ".".join(parts[:cut])
            if prefix in self.rule_leaves:
                return prefix, ".".join(parts[cut:])
        return None, param_name

    def __enter__(self) -> "ModuleTracer":
        # One pre/post hook pair serves every rule leaf (looked up by module), so that entering costs
        # no allocation per module; re-entrant calls of one module nest on its pending stack.
        self._leaf_of = {id(m): (name, m, rule, []) for name, (m, rule) in self.rule_leaves.items()}
        _refuse_global_forward_hooks(self.rule_leaves)
        # the user's own forward hooks on a rule leaf run after ours (below), so that the rule sees the module's own
        # output and what a hook does to it is walked as glue; their pre-hooks run before ours, so the rule sees the
        # input the module saw
        user_hooks = {id(m): (m, list(m._forward_hooks)) for m, _ in self.rule_leaves.values() if m._forward_hooks}
        for name, (m, _) in self.rule_leaves.items():
            if id(m) in user_hooks and not hasattr(m._forward_hooks, "move_to_end"):
                raise CurvatureRuntimeError(
                    f"module {name!r} ({type(m).__name__}) has forward hooks of its own, which may change its output, "
                    "and this torch cannot run them after the curvature's; remove them for the call or use mode='exact'"
                )
        self._hooks = Hooks()
        for module, _ in self.rule_leaves.values():
            self._hooks.forward_pre(module, self._rule_pre, with_kwargs=True)
            self._hooks.forward(module, self._rule_post)
        for name, module in self.opaque_leaves.items():
            pre, post = self._opaque_hooks(name)
            self._hooks.forward_pre(module, pre)
            self._hooks.forward(module, post)
        self._hooks.install()  # all or nothing: a failed install removes what it placed
        for module, keys in user_hooks.values():  # ours were appended: moving the user's behind them puts ours first
            for key in keys:
                module._forward_hooks.move_to_end(key)
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.remove()
        # the plan's hooks are this tracer's bound methods: kept, they closed a reference cycle that held the traced
        # forward's tensors (rule_calls) until Python's cyclic collector ran; entering builds a new plan
        self._hooks = Hooks()
        self._leaf_of = {}

    def _rule_pre(self, module, args, kwargs):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None and not args:  # called by keyword, e.g. linear(input=x): the one tensor among the keywords
            tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            x = kwargs["input"] if isinstance(kwargs.get("input"), torch.Tensor) else (tensors[0] if len(tensors) == 1 else None)
        self._leaf_of[id(module)][3].append((x, None if x is None else edge_of(x)))

    def _rule_post(self, module, args, output):
        name, _, rule, pending = self._leaf_of[id(module)]
        x, in_edge = pending.pop()
        if x is None or not isinstance(output, torch.Tensor):
            if isinstance(output, torch.Tensor) and output.requires_grad or any(
                isinstance(o, torch.Tensor) and o.requires_grad for o in (output if isinstance(output, (tuple, list)) else ())
            ):
                # its rule cannot stand in for this call: its own parameters would silently get no curvature
                self.unrecorded.setdefault(name, "was called without one input tensor" if x is None else
                                           f"returned a {type(output).__name__}, not one tensor")
            return
        if not output.requires_grad:
            return
        out_edge = edge_of(output)
        if in_edge is not None and out_edge[0] is in_edge[0] and out_edge[1] == in_edge[1]:
            return  # returned its input unchanged (Identity, eval Dropout): nothing to do
        if out_edge[0] in self.rule_calls:
            raise CurvatureRuntimeError(
                f"module {name!r} ({type(module).__name__}) returned the output of another module unchanged, so the "
                "diagonal recursions cannot tell the two apart; compute a new tensor in its forward, or use mode='exact'"
            )
        self.rule_calls[out_edge[0]] = RuleCall(ModuleCall(name, module, x, output, _call_params(module, rule)), rule,
                                                in_edge, out_edge)

    def _opaque_hooks(self, name: str):
        pending: List[List[Edge]] = []

        def pre(module, args):
            pending.append([e for a in args if isinstance(a, torch.Tensor) and (e := edge_of(a)) is not None])

        def post(module, args, output):
            in_edges = pending.pop()
            outs = output if isinstance(output, (tuple, list)) else (output,)
            out_edges = [e for o in outs if isinstance(o, torch.Tensor) and (e := edge_of(o)) is not None]
            if out_edges:
                self.opaque_calls.append(OpaqueCall(name, module, in_edges, out_edges))

        return pre, post


def _call_params(module: nn.Module, rule: HessianRule) -> Dict[str, torch.Tensor]:
    """The tensors the module's forward used for the parameters its rule reads: its own parameters, and for a name
    the rule reads that is no parameter of the module the attribute the forward used instead, as a pruned layer's
    ``weight`` (``weight_orig · mask``, set by its pre-hook) or a parametrized one's (computed from
    ``parametrizations.weight``). Without it the rule would miss the weight (a ``KeyError``) or, for a norm, take γ = 1."""
    params = dict(module._parameters)
    for attr in rule.param_names:
        if attr not in params:
            value = getattr(module, attr, None)
            if isinstance(value, torch.Tensor):
                params[attr] = value
    return params


def _refuse_global_forward_hooks(rule_leaves) -> None:
    """torch runs its global forward hooks (``register_module_forward_hook``) before a module's own, so one that
    changes an output would change what a rule sees as its module's output: the diagonal would be silently wrong."""
    from torch.nn.modules import module as _torch_module

    if rule_leaves and _torch_module._global_forward_hooks:
        raise CurvatureRuntimeError(
            "global forward hooks are registered (torch.nn.modules.module.register_module_forward_hook); they run "
            "before a module's own hooks and may change its output, which the diagonal-Hessian rules would not see; "
            "remove them for the call or use mode='exact'"
        )
