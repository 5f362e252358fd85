"""Which candidate ops nullify the cost passed back through them (wiring supplement §4, Thm. 1; §8.1–8.2).

An op f with f(c·x) = f(x) for every c > 0 satisfies J_f(x)·x = d/dc f(c·x)|_{c=1} = 0, so the cost
<J_fᵀ g, x> that a downstream gradient g passes back through f onto its own input x is zero. This module
decides scale invariance from the **module structure**, with the homogeneity rules of the one per-module
registry (:mod:`nasdiag.rules`): each rule returns the degree d of positive homogeneity, f(c·x) = c^d f(x)
+ o(c) for c > 0 (None: not homogeneous), where o is an additive term (a bias) constant along some axes.
Composition multiplies degrees and carries the additive term along the axes it stays constant on; once a
degree-0 module (a normalization using the statistics of its own input) has been reached and it removes
that term (the term is constant over its normalization groups), whatever follows cannot undo the
invariance. So ReLU → conv → BN, conv → BN → ReLU, conv → ReLU → BN (§8.2), pool → BN, conv(bias) → BN,
conv(bias) → InstanceNorm and ReLU → conv(bias) → BN are all invariant; conv(bias) → GroupNorm(1, C)
is not (the per-channel bias varies inside the one group, so the mean subtraction keeps b − mean(b)), nor
conv(bias) → train-mode Dropout → BN (the mask multiplies the bias), nor Linear(bias) → BatchNorm1d on a
(B, C, L) input (the Linear acts on L, inside the norm's groups). Where the answer depends on the rank of a
module's input (``nn.Linear``, ``nn.LayerNorm`` over fewer dims than channel and space), pass an example
input; without one the rules answer what holds at every rank.

Exactness: a normalization divides by sqrt(var + eps), so invariance holds only as eps → 0. For an
affine-free normalization N with input x (group variance var), J_N(x)·x = N(x)·eps/(var + eps) per
normalization group (with an affine: (N(x) − β)·eps/(var + eps)); :func:`eps_deviation` returns that
factor, which is the relative deviation "of order eps/var" reported by the probe.
"""

from __future__ import annotations

import torch
from torch import nn

from nasdiag.cost.errors import CostError, require_tensors
from nasdiag.rules import (
    REGISTRY,
    Homogeneity,
    HomogeneityRule,
    LazyModuleError,
    UnsupportedModuleError,
    analyse,
    compose,
    degree_rule,
    delegate_rule,
    input_ranks_of,
    sequential_rule,
)

__all__ = [
    "HOMOGENEITY_RULES",
    "Homogeneity",
    "UnsupportedModuleError",
    "analyse",
    "compose",
    "degree_rule",
    "delegate_rule",
    "eps_deviation",
    "input_ranks_of",
    "is_scale_invariant",
    "register_homogeneity_rule",
    "sequential_rule",
]

Rule = HomogeneityRule

#: module type -> rule(module, analyse): the ``"homogeneity"`` table of the one rule registry
#: (``nasdiag.rules.REGISTRY``), looked up by its one rule. Extend with :func:`register_homogeneity_rule`.
HOMOGENEITY_RULES = REGISTRY.table("homogeneity")


def register_homogeneity_rule(module_type, rule: Rule, *, overwrite: bool = False) -> None:
    """Register ``rule(module, analyse) -> Homogeneity`` for ``module_type`` (and subclasses that keep
    its ``forward``). ``analyse`` analyses a child module. Helpers: :func:`degree_rule`,
    :func:`sequential_rule`, :func:`delegate_rule`, :func:`compose`.

    Raises:
        TypeError: ``module_type`` is not an ``nn.Module`` subclass, or ``rule`` is not callable (it would be
            stored and fail, as "'str' object is not callable", in every later analysis of a model holding one).
        ValueError: a rule for ``module_type`` exists and ``overwrite`` is False."""
    if not callable(rule):
        raise TypeError(f"register_homogeneity_rule: rule must be callable as rule(module, analyse) -> Homogeneity, got "
                        f"{type(rule).__name__}; e.g. nasdiag.cost.degree_rule(1.0, 'why')")
    REGISTRY.register("homogeneity", module_type, rule, overwrite=overwrite)


def is_scale_invariant(module: nn.Module, example_input=None) -> bool:
    """True when f(c·x) = f(x) for all c > 0 (as eps → 0), i.e. the op nullifies the cost passed back
    through it (Thm. 1). Depends on train/eval mode: BatchNorm with running statistics is not invariant.
    A bias before a normalization over the axes the bias is constant on (conv bias → BatchNorm or
    InstanceNorm) is removed by it, so such an op is invariant too.

    ``example_input`` (a tensor, or a tuple of arguments) tells the rules the rank each submodule sees
    (:func:`~nasdiag.rules.input_ranks_of`: one forward, buffers restored). Without it, ``nn.Linear`` (which
    acts on the last dim: the channel of a 2-D input, a spatial dim otherwise) is taken at its most cautious,
    so Linear(bias) → BatchNorm1d is called invariant only when the example shows a 2-D input."""
    if example_input is not None and not isinstance(example_input, (torch.Tensor, tuple)):
        raise CostError(f"is_scale_invariant: example_input must be the op's input tensor or a tuple of its arguments, "
                        f"got {type(example_input).__name__}")
    try:
        ranks = input_ranks_of(module, example_input) if example_input is not None else None
    except LazyModuleError as err:  # the cost layer's error of bad input
        raise CostError(f"is_scale_invariant: {err}") from None
    return analyse(module, ranks).invariant


# --- the deviation at finite eps ---------------------------------------------------------------

def _group_variance(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Biased variance over each normalization group of ``module``'s input x (B, C, ...)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        dims = [0] + list(range(2, x.dim()))
        return x.var(dim=dims, unbiased=False)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        if x.dim() == module._get_no_batch_dim():  # an unbatched (C, ...) input: one sample
            x = x.unsqueeze(0)
        return x.var(dim=list(range(2, x.dim())), unbiased=False)
    if isinstance(module, nn.GroupNorm):
        return x.reshape(x.shape[0], module.num_groups, -1).var(dim=-1, unbiased=False)
    if isinstance(module, nn.LayerNorm):
        n = len(module.normalized_shape)
        return x.var(dim=list(range(x.dim() - n, x.dim())), unbiased=False)
    raise UnsupportedModuleError(
        f"eps_deviation: {type(module).__name__} is not a BatchNorm, InstanceNorm, GroupNorm or LayerNorm"
    )


def _check_norm_input(norm: nn.Module, x: torch.Tensor) -> None:
    """A CostError where ``norm`` could not be called on ``x`` (its variance would be that of other groups: a number of
    no normalization), checked as torch's forward checks it."""
    why = None
    if isinstance(norm, nn.modules.lazy.LazyModuleMixin) and norm.has_uninitialized_params():
        return  # its sizes are those of its first input
    if isinstance(norm, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)):
        try:
            norm._check_input_dim(x)
        except NotImplementedError:  # a subclass of the bare _BatchNorm: no rank of its own
            pass
        except ValueError as err:
            why = str(err)
        else:
            batched = not isinstance(norm, nn.modules.instancenorm._InstanceNorm) or x.dim() != norm._get_no_batch_dim()
            channels = x.shape[1 if batched else 0]
            # as torch: a norm takes any number of channels where it uses no affine map and no running buffers (a
            # BatchNorm in training uses them only with track_running_stats)
            buffers = norm.running_mean is not None and (not isinstance(norm, nn.modules.batchnorm._BatchNorm)
                                                         or not norm.training or norm.track_running_stats)
            strict = norm.affine or buffers
            if strict and channels != norm.num_features:
                why = f"{channels} channels where it normalizes {norm.num_features}"
    elif isinstance(norm, nn.GroupNorm):
        if x.dim() < 2 or (x.shape[1] != norm.num_channels if norm.affine else x.shape[1] % norm.num_groups):
            why = (f"expected (B, {norm.num_channels}, ...)" if norm.affine
                   else f"expected (B, C, ...) with C divisible by its {norm.num_groups} groups")
    elif isinstance(norm, nn.LayerNorm):
        n = len(norm.normalized_shape)
        if x.dim() < n or tuple(x.shape[x.dim() - n:]) != tuple(norm.normalized_shape):
            why = f"expected trailing dims {tuple(norm.normalized_shape)}"
    if why is not None:
        raise CostError(f"eps_deviation: {type(norm).__name__} cannot normalize an input of shape {tuple(x.shape)} ({why}); "
                        "pass the tensor the normalization is called on")


def uses_running_statistics(norm: nn.Module) -> bool:
    """Whether ``norm``'s forward normalizes with its running buffers, as torch decides it: then it is an affine map,
    not a normalization by its input's statistics (``nasdiag.rules``'s BatchNorm and InstanceNorm rules). A BatchNorm in
    eval mode with its buffers (kept when ``track_running_stats`` is turned off after construction); an InstanceNorm,
    or another module with a ``track_running_stats`` flag, in eval mode with it on."""
    if isinstance(norm, nn.modules.batchnorm._BatchNorm):
        return not norm.training and not (norm.running_mean is None and norm.running_var is None)
    return bool(getattr(norm, "track_running_stats", False)) and not norm.training


def eps_deviation(norm: nn.Module, norm_input: torch.Tensor) -> torch.Tensor:
    """Relative deviation from scale invariance of a normalization at its real eps.

    For an affine-free normalization N, J_N(x)·x = N(x) · eps/(var + eps) in every normalization group
    (differentiate (c·x − c·μ)/sqrt(c²·var + eps) at c = 1), so eps/(var + eps) ≈ eps/var is the factor by
    which the cost passed back through N fails to vanish.

    Args:
        norm: BatchNorm*, InstanceNorm*, GroupNorm or LayerNorm.
        norm_input: its input x, (B, C, ...).

    Returns:
        eps/(var + eps) per normalization group: (C,) for BatchNorm, (B, C) for InstanceNorm (an unbatched
        (C, ...) input is one sample: (1, C)), (B, G) for GroupNorm, the input's shape without the normalized
        dims for LayerNorm ((B,) over all but the batch dim, (B, C) over the spatial dims); dtype of the input, at
        least float32 (a half-precision input is measured in float32).

    Raises:
        CostError: ``norm_input`` is not a tensor, or not one ``norm`` can normalize (rank, channels, normalized shape);
            ``norm`` is a BatchNorm or InstanceNorm in eval mode with running statistics (an affine map: J_N(x)·x is
            γ·x/sqrt(running_var + eps), of the order of N(x), not a deviation of order eps/var).
        UnsupportedModuleError: ``norm`` is not one of the normalizations above.
    """
    require_tensors("eps_deviation", norm_input=norm_input)
    _check_norm_input(norm, norm_input)
    if uses_running_statistics(norm):
        raise CostError(f"eps_deviation: this {type(norm).__name__} is in eval mode with running statistics, an affine map "
                        "that is not scale-invariant at any eps (J_N(x)·x = γ·x/sqrt(running_var + eps), not N(x)·eps/(var + eps)); call "
                        "it in train mode, or use one with track_running_stats=False")
    # at least float32, as the costs: in half precision eps/(var + eps) < 6e-8 is a subnormal or 0 (the deviation of an
    # input of std 30 at eps = 1e-5 came out 0.0, "exactly invariant"; of std 10, 24 % off)
    x = norm_input.detach()
    var = _group_variance(norm, x.to(torch.promote_types(x.dtype, torch.float32)))
    return norm.eps / (var + norm.eps)
