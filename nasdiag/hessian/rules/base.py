"""Per-module derivative maths for the diagonal Hessian recursions, and the registry of rules.

A rule knows one module type and nothing about the graph around it. Given the diagonal ``h_out`` of the
Hessian of the loss w.r.t. the module's output (same shape as the output), it returns

* ``input_diag``: the diagonal w.r.t. the module's input, ``(J∘J)ᵀ h_out + Σ_o g_o ∂²y_o/∂x²``
  (bayesnas-appendix C.1.5 for an FC layer, C.2.2 for a convolution, the ``B² H + D`` form for an
  elementwise activation), where ``J = ∂y/∂x`` and ``g = ∂L/∂y``;
* ``param_diag``: the diagonal w.r.t. the module's own parameters (C.1.4, C.2.1/C.2.3).

Both are exact when the Hessian w.r.t. the output is diagonal; the graph engine
(:mod:`nasdiag.hessian.propagate`) is what accumulates them across modules, edges and calls. The
``*_approx`` variants implement the feature-mean approximation (C.2.4-C.2.5) where it differs.

Users add rules for their own modules with :func:`register_rule`.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple, Type

import torch
from torch import nn

from nasdiag.hessian.modes import CurvatureError, CurvatureRuntimeError, CurvatureTypeError
from nasdiag.rules import REGISTRY, RuleRegistry, UnsupportedModuleError, type_name, unsupported_message

__all__ = [
    "HessianRule",
    "channel_mean",
    "ModuleCall",
    "UnsupportedModuleError",
    "check_rules",
    "register_rule",
    "rule_for",
    "supported_modules",
]


class ModuleCall:
    """One call of a module during the traced forward pass, as its rule sees it.

    Args:
        name: qualified module name (for messages).
        module: the module.
        input, output: the tensors of the call (stored detached). ``call.input`` / ``call.output``
            raise if the tensor was modified in place after this record was made, since the rules
            need the values the module actually saw.
        params: the module's own parameters at call time, ``{name: tensor}`` (default: the module's).
        grad_output: ``∂L/∂output``, filled in by the engine for rules that need it.
    """

    __slots__ = ("name", "module", "params", "grad_output", "_input", "_output", "_versions")

    def __init__(self, name, module, input, output, params=None, grad_output=None):
        self.name = name
        self.module = module
        if params is None:
            params = module._parameters  # the module's own, as named_parameters(recurse=False) lists them
        self.params = {k: p.detach() for k, p in params.items() if p is not None}
        self.grad_output = grad_output
        self._input = input
        self._output = output
        self._versions = (input._version, output._version)

    @property
    def input(self) -> torch.Tensor:
        self._check_version(self._input, self._versions[0], "input")
        return self._input.detach()

    @property
    def input_rank(self) -> int:
        """The rank the module was called at (valid after in-place changes of the values)."""
        return self._input.dim()

    @property
    def output(self) -> torch.Tensor:
        self._check_version(self._output, self._versions[1], "output")
        return self._output.detach()

    def _check_version(self, ref: torch.Tensor, version: int, what: str) -> None:
        if ref._version != version:
            raise CurvatureRuntimeError(
                f"the {what} of module {self.name!r} ({type(self.module).__name__}) was modified in place after the "
                "module ran, so its Hessian rule would read wrong values; turn off inplace=True in the modules "
                "that follow it (e.g. nn.ReLU(inplace=False)) or use mode='exact'"
            )


def channel_mean(h: torch.Tensor, dims) -> torch.Tensor:
    """``h.mean(dims)``, read off directly when ``h`` is already constant along ``dims`` because it was
    broadcast there (stride 0, as the feature-mean rules return it), which skips a full reduction."""
    if all(h.stride(d) == 0 or h.shape[d] == 1 for d in dims):
        index = tuple(0 if d in dims else slice(None) for d in range(h.dim()))
        return h[index]
    return h.mean(dims)


class HessianRule:
    """Derivative maths of one module type for the diagonal recursions.

    Subclasses implement :meth:`input_diag` and, if the module has parameters, :meth:`param_diag`;
    :meth:`input_approx` / :meth:`param_approx` default to the ``diag`` versions (right for rules whose
    cost is already elementwise, such as activations, pooling and normalization).

    Attributes:
        param_names: names (as in ``module.named_parameters(recurse=False)``) the rule can differentiate.
    """

    param_names: Tuple[str, ...] = ()

    def needs_grad_output(self, module: nn.Module) -> bool:
        """Whether the rule reads ``call.grad_output`` (= ∂L/∂output), i.e. has a second-order residual
        term ``Σ_o g_o ∂²y_o/∂x²``; the engine computes that gradient only for such calls."""
        return False

    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def param_diag(self, call: ModuleCall, h_out: torch.Tensor) -> Dict[str, torch.Tensor]:
        if self.param_names:
            raise NotImplementedError
        return {}

    def input_approx(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        return self.input_diag(call, h_out)

    def param_approx(self, call: ModuleCall, h_out: torch.Tensor) -> Dict[str, torch.Tensor]:
        return self.param_diag(call, h_out)

    def check(self, module: nn.Module, name: str) -> None:
        """Raise :class:`UnsupportedModuleError` for a configuration of ``module`` the rule cannot handle."""

    def additive_params(self, module: nn.Module) -> Dict[str, frozenset]:
        """``{parameter attribute: axes}`` for parameters that only add a term to the output that is
        constant along ``axes`` (:data:`nasdiag.rules.BATCH`, ``SPATIAL``, ...), such as a bias. A
        following normalization over those axes removes such a parameter's effect exactly, and the
        engine then reports exactly zero curvature for it (its true value)."""
        return {}


#: the ``"hessian"`` table of the one per-module rule registry (:mod:`nasdiag.rules`)
_RULES: Dict[Type[nn.Module], HessianRule] = REGISTRY.table("hessian")

_HOW = (
    "Register one with nasdiag.hessian.register_rule(YourModule, rule) (a HessianRule subclass; "
    "ElementwiseRule(fn) covers elementwise activations), pass rules={YourModule: rule} to this call, "
    "or use mode='exact'."
)


def register_rule(module_type: Type[nn.Module], rule: HessianRule, *, overwrite: bool = False) -> None:
    """Register ``rule`` for ``module_type`` (and subclasses that keep its ``forward``: the registry's
    one lookup rule, :meth:`nasdiag.rules.RuleRegistry.lookup`).

    Example::

        class Swish(nn.Module):
            def forward(self, x):
                return x * torch.sigmoid(x)

        register_rule(Swish, ElementwiseRule(lambda x: x * torch.sigmoid(x)))
    """
    _check_module_type(module_type, "module_type")
    if not isinstance(rule, HessianRule):
        raise CurvatureTypeError(
            f"rule must be a HessianRule instance, got {type(rule).__name__}; pass an instance, e.g. ElementwiseRule(fn), not a class"
        )
    try:
        REGISTRY.register("hessian", module_type, rule, overwrite=overwrite, how=" (or pass rules={type: rule} to a single call)")
    except ValueError as err:  # a rule for the type exists: the registry's line, as the curvature API's error (a ValueError)
        raise CurvatureError(str(err)) from None


def _check_module_type(key, what: str) -> None:
    if not (isinstance(key, type) and issubclass(key, nn.Module)):
        hint = f"nn.{key}" if isinstance(key, str) else type_name(type(key)) if isinstance(key, nn.Module) else "nn.BatchNorm2d"
        raise CurvatureTypeError(
            f"{what} must be a module type (an nn.Module subclass), got {key!r} ({type(key).__name__}); name the class "
            f"itself, e.g. {hint}"
        )


def check_rules(rules) -> Optional[Dict[Type[nn.Module], HessianRule]]:
    """``rules=`` of a curvature call as a dict ``{module type: HessianRule instance}``, or one
    :class:`CurvatureTypeError` line: a key that is no module type (a name ``"BatchNorm2d"``, a module instance)
    matches no module and the override would be ignored silently; a value that is no rule instance fails deep inside."""
    if rules is None:
        return None
    if not isinstance(rules, Mapping):
        raise CurvatureTypeError(
            f"rules must be a mapping {{module type: HessianRule}}, got {type(rules).__name__}; pass e.g. "
            "rules={nn.BatchNorm2d: NormRule(through_statistics=False)}"
        )
    for key, rule in rules.items():
        _check_module_type(key, "each key of rules")
        if not isinstance(rule, HessianRule):
            shown = rule.__name__ if isinstance(rule, type) else type(rule).__name__
            raise CurvatureTypeError(
                f"rules[{key.__name__}] must be a HessianRule instance, got {shown}; pass an instance, e.g. "
                "ElementwiseRule(fn) or NormRule(through_statistics=False)" + (", not the class" if isinstance(rule, type) else "")
            )
    return dict(rules)


def rule_for(module: nn.Module, overrides: Mapping[type, HessianRule] | None = None) -> Optional[HessianRule]:
    """The rule for ``module``, or None: per-call ``overrides`` first, looked up as the registry is (the module's type,
    then the type nearest in its MRO whose ``forward`` it keeps), so an override of ``nn.BatchNorm2d`` also holds for a
    subclass of it that the registry's ``nn.BatchNorm2d`` rule would cover; then the registry."""
    if overrides:
        scratch = RuleRegistry()
        scratch.tables["hessian"] = dict(overrides)
        rule = scratch.lookup(module, "hessian")
        if rule is not None:
            return rule
    return REGISTRY.lookup(module, "hessian")


def supported_modules(overrides: Mapping[type, HessianRule] | None = None) -> List[str]:
    """Names of the module types with a rule (``nn.Conv2d``, ``package.Module``), sorted."""
    return REGISTRY.supported("hessian", overrides)


def unsupported_module_message(name: str, module: nn.Module, why: str, overrides=None) -> str:
    return unsupported_message("diagonal-Hessian", name, module, why, _HOW, overrides)
