"""Which candidate ops nullify the cost passed back through them (wiring supplement §4, Thm. 1; §8.1–8.2).

An op f with f(c·x) = f(x) for every c > 0 satisfies J_f(x)·x = d/dc f(c·x)|_{c=1} = 0, so the cost
<J_fᵀ g, x> that a downstream gradient g passes back through f onto its own input x is zero. This module
decides scale invariance from the **module structure**, with a registry of per-module rules: each rule
returns the degree d of positive homogeneity, f(c·x) = c^d f(x) for c > 0 (None: not homogeneous).
Composition multiplies degrees, and once a degree-0 module (a normalization using the statistics of its
own input) has been reached, whatever follows cannot undo the invariance. So ReLU → conv → BN,
conv → BN → ReLU, conv → ReLU → BN (§8.2) and pool → BN are all invariant.

Exactness: a normalization divides by sqrt(var + eps), so invariance holds only as eps → 0. For an
affine-free normalization N with input x (group variance var), J_N(x)·x = N(x)·eps/(var + eps) per
normalization group (with an affine: (N(x) − β)·eps/(var + eps)); :func:`eps_deviation` returns that
factor, which is the relative deviation "of order eps/var" reported by the probe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Type

import torch
from torch import nn

from nasdiag.supernet.ops import FactorizedReduce, Zero


@dataclass(frozen=True)
class Homogeneity:
    """Result of the analysis of one module.

    Attributes:
        degree: d with f(c·x) = c^d f(x) for all c > 0; 0 means scale-invariant; None: not homogeneous.
        reason: a short human-readable derivation.
        invariant_by: the module that makes the op scale-invariant (the first normalization on the path,
            or a ``Zero``), None when not invariant.
    """

    degree: Optional[float]
    reason: str
    invariant_by: Optional[nn.Module] = None

    @property
    def invariant(self) -> bool:
        return self.degree == 0


Rule = Callable[[nn.Module, Callable[[nn.Module], Homogeneity]], Homogeneity]

#: module type -> rule(module, analyse). Looked up along the MRO; extend with :func:`register_homogeneity_rule`.
HOMOGENEITY_RULES: Dict[Type[nn.Module], Rule] = {}


class UnsupportedModuleError(TypeError):
    """A module on an op's path has no homogeneity rule."""


def register_homogeneity_rule(module_type: Type[nn.Module], rule: Rule, *, overwrite: bool = False) -> None:
    """Register ``rule(module, analyse) -> Homogeneity`` for ``module_type`` (and subclasses that keep
    its ``forward``). ``analyse`` analyses a child module. Helpers: :func:`degree_rule`,
    :func:`sequential_rule`, :func:`delegate_rule`."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
    if module_type in HOMOGENEITY_RULES and not overwrite:
        raise ValueError(f"a homogeneity rule for {module_type.__name__} exists; pass overwrite=True to replace it")
    HOMOGENEITY_RULES[module_type] = rule


def degree_rule(degree: Optional[float], why: str) -> Rule:
    """A rule that returns a fixed degree (``0`` makes the module itself the invariance source)."""

    def rule(module, analyse):
        return Homogeneity(degree, f"{type(module).__name__}: {why}", module if degree == 0 else None)

    return rule


def compose(parts: List[Tuple[str, Homogeneity]]) -> Homogeneity:
    """Homogeneity of f_n ∘ ... ∘ f_1 given each f_i's (``parts`` in application order)."""
    degree: Optional[float] = 1.0
    steps = []
    for name, h in parts:
        steps.append(f"{name}[{'not homogeneous' if h.degree is None else f'degree {h.degree:g}'}]")
        if h.degree == 0:
            # f(c x) = g(h(c x)) = g(h(x)): nothing after a degree-0 map can matter.
            if degree is None:
                return Homogeneity(None, " -> ".join(steps) + ": not homogeneous before the invariant map")
            return Homogeneity(0.0, " -> ".join(steps) + f": invariant ({h.reason})", h.invariant_by)
        if h.degree is None or degree is None:
            degree = None
        else:
            degree *= h.degree
    return Homogeneity(degree, " -> ".join(steps))


def sequential_rule(module: nn.Module, analyse) -> Homogeneity:
    return compose([(f"{i}:{type(child).__name__}", analyse(child)) for i, child in enumerate(module)])


def delegate_rule(attr: str) -> Rule:
    """For a wrapper whose forward is ``return self.<attr>(x)`` (e.g. DARTS ``ReLUConvBN.op``)."""

    def rule(module, analyse):
        child = getattr(module, attr)
        h = analyse(child)
        return Homogeneity(h.degree, f"{type(module).__name__}.{attr}: {h.reason}", h.invariant_by)

    return rule


def _bias_free_linear(module, analyse):
    if getattr(module, "bias", None) is not None:
        return Homogeneity(None, f"{type(module).__name__} with bias (affine, not homogeneous)")
    return Homogeneity(1.0, f"{type(module).__name__} without bias (linear)")


def _batch_norm(module, analyse):
    if module.training or not module.track_running_stats:
        return Homogeneity(0.0, f"{type(module).__name__} with batch statistics", module)
    return Homogeneity(None, f"{type(module).__name__} in eval mode with running statistics (affine map)")


def _instance_norm(module, analyse):
    if module.track_running_stats and not module.training:
        return Homogeneity(None, f"{type(module).__name__} in eval mode with running statistics (affine map)")
    return Homogeneity(0.0, f"{type(module).__name__} (per-sample statistics)", module)


def _padding(module, analyse):
    value = getattr(module, "value", 0.0)
    if value != 0:
        return Homogeneity(None, f"{type(module).__name__} pads with {value} (not homogeneous)")
    return Homogeneity(1.0, f"{type(module).__name__} pads with 0")


def _factorized_reduce(module, analyse):
    # relu? -> cat(conv_1(x), conv_2(shift(x))) -> norm (-> relu); each branch is positively homogeneous
    # of the conv's degree, the cat preserves it, and the norm makes the op invariant.
    convs = [analyse(module.conv_1), analyse(module.conv_2)]
    if any(c.degree != 1 for c in convs):
        return Homogeneity(None, "FactorizedReduce with a non-linear conv branch")
    parts = [("relu", analyse(module.relu)), ("cat(conv_1, conv_2)", convs[0]), ("norm", analyse(getattr(module, "norm", None) or module.bn))]
    return compose(parts)


for _t in (nn.ReLU, nn.LeakyReLU, nn.PReLU, nn.Identity, nn.Flatten, nn.Dropout, nn.Dropout2d,
           nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
           nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd):
    HOMOGENEITY_RULES[_t] = degree_rule(1.0, "positively homogeneous of degree 1")
for _t in (nn.modules.conv._ConvNd, nn.Linear):
    HOMOGENEITY_RULES[_t] = _bias_free_linear
for _t in (nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d):
    HOMOGENEITY_RULES[_t] = _padding
for _t in (nn.Sigmoid, nn.Tanh, nn.GELU, nn.SiLU, nn.ELU, nn.Softplus, nn.Softmax):
    HOMOGENEITY_RULES[_t] = degree_rule(None, "not positively homogeneous")
HOMOGENEITY_RULES[nn.modules.batchnorm._BatchNorm] = _batch_norm
HOMOGENEITY_RULES[nn.modules.instancenorm._InstanceNorm] = _instance_norm
HOMOGENEITY_RULES[nn.GroupNorm] = degree_rule(0.0, "per-sample group statistics")
HOMOGENEITY_RULES[nn.LayerNorm] = degree_rule(0.0, "per-sample statistics")
HOMOGENEITY_RULES[nn.Sequential] = sequential_rule
HOMOGENEITY_RULES[Zero] = degree_rule(0.0, "constant zero output (J = 0)")
HOMOGENEITY_RULES[FactorizedReduce] = _factorized_reduce


def _find_rule(module: nn.Module) -> Rule:
    cls = type(module)
    if cls in HOMOGENEITY_RULES:
        return HOMOGENEITY_RULES[cls]
    for base in cls.__mro__[1:]:
        if base in HOMOGENEITY_RULES:
            # A subclass written outside torch that rewrites forward is another function: its base's
            # rule does not apply. (Inside torch.nn, e.g. Conv2d vs _ConvNd, the rule covers the family.)
            if not cls.__module__.startswith("torch.") and cls.forward is not base.forward:
                break
            return HOMOGENEITY_RULES[base]
    supported = sorted({t.__name__ for t in HOMOGENEITY_RULES})
    raise UnsupportedModuleError(
        f"no homogeneity rule for module type {cls.__module__}.{cls.__name__}, so its scale invariance "
        f"cannot be decided. Supported: {', '.join(supported)}. Register one with "
        f"nasdiag.cost.register_homogeneity_rule({cls.__name__}, rule), e.g. "
        f"nasdiag.cost.delegate_rule('op') for a wrapper whose forward is self.op(x), or "
        f"nasdiag.cost.degree_rule(1.0, 'why') for a positively homogeneous map."
    )


def analyse(module: nn.Module) -> Homogeneity:
    """Positive-homogeneity degree of ``module`` as a function of its (single) input, from its structure.

    Raises:
        UnsupportedModuleError: a module on the path has no rule (names it, lists the supported ones).
    """
    return _find_rule(module)(module, analyse)


def is_scale_invariant(module: nn.Module) -> bool:
    """True when f(c·x) = f(x) for all c > 0 (as eps → 0), i.e. the op nullifies the cost passed back
    through it (Thm. 1). Depends on train/eval mode: BatchNorm with running statistics is not invariant."""
    return analyse(module).invariant


# --- the deviation at finite eps ---------------------------------------------------------------

def _group_variance(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Biased variance over each normalization group of ``module``'s input x (B, C, ...)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        dims = [0] + list(range(2, x.dim()))
        return x.var(dim=dims, unbiased=False)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return x.var(dim=list(range(2, x.dim())), unbiased=False)
    if isinstance(module, nn.GroupNorm):
        return x.reshape(x.shape[0], module.num_groups, -1).var(dim=-1, unbiased=False)
    if isinstance(module, nn.LayerNorm):
        n = len(module.normalized_shape)
        return x.var(dim=list(range(x.dim() - n, x.dim())), unbiased=False)
    raise UnsupportedModuleError(
        f"eps_deviation: {type(module).__name__} is not a BatchNorm, InstanceNorm, GroupNorm or LayerNorm"
    )


def eps_deviation(norm: nn.Module, norm_input: torch.Tensor) -> torch.Tensor:
    """Relative deviation from scale invariance of a normalization at its real eps.

    For an affine-free normalization N, J_N(x)·x = N(x) · eps/(var + eps) in every normalization group
    (differentiate (c·x − c·μ)/sqrt(c²·var + eps) at c = 1), so eps/(var + eps) ≈ eps/var is the factor by
    which the cost passed back through N fails to vanish.

    Args:
        norm: BatchNorm*, InstanceNorm*, GroupNorm or LayerNorm.
        norm_input: its input x, (B, C, ...).

    Returns:
        eps/(var + eps) per normalization group: (C,) for BatchNorm, (B, C) for InstanceNorm,
        (B, G) for GroupNorm, (B,) for LayerNorm; dtype of the input.
    """
    var = _group_variance(norm, norm_input.detach())
    return norm.eps / (var + norm.eps)
