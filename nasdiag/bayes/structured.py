"""Structural Bayesian compression (BayesNAS appendix §B, Algorithm 3 and Table S3) on bare weight tensors.

A structured sparse prior gives every *group* of a weight tensor one variance: the weights of group g are
N(0, γ_g I) (Table S3, second column). Which elements form a group is said by ``group_dims``, the dimensions
that *index* the groups; the other dimensions hold the group's elements. For a conv weight (N, C, M, K):

===================== ============== ==============================================
Table S3              ``group_dims``  one γ per
===================== ============== ==============================================
(a) shape-wise         (1, 2, 3)      input channel and kernel position (c, m, k)
(b) row-wise           (1, 2)         (c, m)
(c) column-wise        (1, 3)         (c, k)
(e) channel-wise       (1,)           input channel c
(f) group shape-wise   (2, 3)         kernel position (m, k)
(j) filter-wise        (0,)           output filter n
===================== ============== ==============================================

A fully connected weight (out, in) is the case M = K = 1: ``(0,)`` groups the weights of each output neuron,
``(1,)`` those of each input feature.

One iteration t of Algorithm 3, per layer (elementwise, Γ = γ broadcast over each group's elements):

* B.0.2 / Table S3: γ_g(t) = ‖W_g(t)‖₂ / ω_g(t−1);
* B.0.3: C(t) = (Γ(t)⁻¹ + diag H(t))⁻¹;
* B.0.4: α(t) = −C(t)/γ(t)² + 1/γ(t) (elementwise: each element's ω_i² of A.2.8);
* B.0.5 / Table S3: ω_g(t) = √(Σ_{i∈g} α_i(t)) (the |·| of the table is a no-op: α ≥ 0 since 0 ≤ C ≤ γ).

Step 1's penalty is the reweighted group lasso R(ω ∘ W) = Σ_g ω_g ‖W_g‖₂ (Table S3, third column), weighted by
λ^l (B.0.1). As for Algorithm 2 (``nasdiag.search.methods.bayesnas``), the closed forms are those of the
energy E_D/λ^l: the caller passes H of E_D/λ^l, E_D the batch's summed loss.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable, Sequence, Tuple

import torch

from nasdiag.bayes.update import BayesError, check_tensors, covariance, omega, switch

__all__ = ["StructuredUpdate", "group_norms", "group_lasso_penalty", "structured_update", "expand_groups"]


def _element_dims(weight: torch.Tensor, group_dims: Sequence[int]) -> Tuple[int, ...]:
    def is_dim(d) -> bool:
        try:
            return not isinstance(d, bool) and -weight.dim() <= operator.index(d) < weight.dim()
        except TypeError:
            return False

    if isinstance(group_dims, (str, bytes)) or not isinstance(group_dims, Iterable):  # 0 for (0,): a bare TypeError
        raise BayesError(f"group_dims must be a sequence of dimensions, e.g. (0,) for one group per filter, got "
                         f"{group_dims!r}")
    group_dims = tuple(group_dims)
    if not all(is_dim(d) for d in group_dims):
        raise BayesError(f"group_dims must be dimensions of the {weight.dim()}-d weight (−{weight.dim()} … "
                         f"{weight.dim() - 1}), got {tuple(group_dims)}")
    dims = tuple(sorted(operator.index(d) % weight.dim() for d in group_dims))
    if len(set(dims)) != len(dims) or not dims:
        raise BayesError(f"group_dims must be distinct dimensions of the {weight.dim()}-d weight, got {tuple(group_dims)}")
    return tuple(d for d in range(weight.dim()) if d not in dims)


def _groups_shape(weight: torch.Tensor, group_dims: Sequence[int]) -> Tuple[int, ...]:
    """The shape of a per-group tensor: ``weight``'s along ``group_dims`` (sorted)."""
    elem = _element_dims(weight, group_dims)
    return tuple(n for d, n in enumerate(weight.shape) if d not in elem)


def _check_per_group(name: str, per_group: torch.Tensor, weight: torch.Tensor, group_dims: Sequence[int]) -> None:
    want = _groups_shape(weight, group_dims)
    check_tensors(**{name: (per_group, f"{want}, one entry per group")})
    if tuple(per_group.shape) != want:  # a reshape would take any tensor of as many entries, in its order
        raise BayesError(f"{name} must have one entry per group, shape {want}, got {tuple(per_group.shape)}")


def expand_groups(per_group: torch.Tensor, weight: torch.Tensor, group_dims: Sequence[int]) -> torch.Tensor:
    """A per-group tensor (the shape of ``weight`` along ``group_dims``) broadcast to every element: Γ of B.0.3."""
    _check_per_group("per_group", per_group, weight, group_dims)
    elem = _element_dims(weight, group_dims)
    shape = [1 if d in elem else weight.shape[d] for d in range(weight.dim())]
    return per_group.reshape(shape).expand_as(weight)


def group_norms(weight: torch.Tensor, group_dims: Sequence[int]) -> torch.Tensor:
    """‖W_g‖₂ per group, shape ``weight.shape`` along ``group_dims``."""
    return torch.linalg.vector_norm(weight, dim=_element_dims(weight, group_dims)) if _element_dims(weight, group_dims) \
        else weight.abs()


def group_lasso_penalty(weight: torch.Tensor, om: torch.Tensor, group_dims: Sequence[int]) -> torch.Tensor:
    """R(ω ∘ W) = Σ_g ω_g ‖W_g‖₂ (Table S3), a differentiable scalar; groups with ω = ∞ (dead) must be masked
    out by the caller (their weights are zero and stay zero). ``om``: one entry per group (or a scalar)."""
    norms = group_norms(weight, group_dims)
    if isinstance(om, torch.Tensor) and om.dim():
        _check_per_group("omega", om, weight, group_dims)
    return (om * norms).sum()


@dataclass
class StructuredUpdate:
    """One update of Algorithm 3, step 3: ``gamma`` and ``omega`` per group, ``cov`` and ``alpha`` per element."""

    gamma: torch.Tensor
    cov: torch.Tensor
    alpha: torch.Tensor
    omega: torch.Tensor


def structured_update(weight: torch.Tensor, curvature: torch.Tensor, omega_prev: torch.Tensor,
                      group_dims: Sequence[int]) -> StructuredUpdate:
    """Algorithm 3, step 3 for one layer: γ (B.0.2), C (B.0.3), α (B.0.4), ω (B.0.5) by Table S3's rules.

    Args:
        weight: W(t) after step 1, any shape.
        curvature: diag H(t) of the energy, the shape of ``weight`` (negative entries count as 0).
        omega_prev: ω(t−1) ≥ 0 per group (the shape of ``weight`` along ``group_dims``); Algorithm 3 starts at 1.
            A NaN ω(t−1) (or weight) gives its group a NaN γ and ω, never the γ = 0 of a zero group (a dead one).
        group_dims: the dimensions that index the groups (module docstring).
    """
    check_tensors(weight=(weight, "(N, C, M, K) or any"), curvature=(curvature, "the weight's"))
    _element_dims(weight, group_dims)  # group_dims checked before they are used below
    want = _groups_shape(weight, group_dims)
    check_tensors(omega_prev=(omega_prev, f"{want}, one entry per group (ω(0) = 1: torch.ones{want})"))
    if curvature.shape != weight.shape:
        raise BayesError(f"curvature must have the weight's shape {tuple(weight.shape)}, got {tuple(curvature.shape)}")
    _check_per_group("omega", omega_prev, weight, group_dims)
    if bool((omega_prev < 0).any()):  # else refused below as a negative gamma, which the caller did not pass
        raise BayesError(f"omega must be >= 0 (a reweighting of the group lasso); got min {float(omega_prev.min()):.3g}")
    norms = group_norms(weight, group_dims)
    # B.0.2 in A.3.8's form, :func:`switch`'s conventions: a zero group gives 0 (ω = ∞ next: dead), except where ω(t−1)
    # is NaN, which gives NaN, never the γ = 0 of a dead group
    gamma = switch(norms, omega_prev)
    cov = covariance(expand_groups(gamma, weight, group_dims), curvature)  # B.0.3
    alpha = omega(expand_groups(gamma, weight, group_dims), cov, curvature=curvature).square()  # B.0.4: 1/γ − C/γ², ∞ where γ = 0
    elem = _element_dims(weight, group_dims)
    om = (alpha.sum(dim=elem) if elem else alpha).sqrt()  # B.0.5
    return StructuredUpdate(gamma=gamma, cov=cov, alpha=alpha, omega=om)
