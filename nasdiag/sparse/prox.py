"""Proximal operators of the sparse group lasso (sparse-supernet eq 5, 9, 10).

Groups are given as an integer tensor ``groups`` of the shape of the parameter: ``groups[i]`` is the
group of element i (ids 0..G−1, every id used). In SparseNAS a group is a node: every A_ij^o with
i < j, o ∈ O entering node j (eq 2), i.e. the rows of the (E, K) weights whose edge ends at j.
No Python loop over groups: norms are gathered with ``index_add_``.
"""

from __future__ import annotations

import math
from typing import Union

import torch

from nasdiag.errors import ConfigError

Threshold = Union[float, torch.Tensor]


def _check_groups(z: torch.Tensor, groups: torch.Tensor) -> int:
    if not isinstance(groups, torch.Tensor):  # None or a list was "'NoneType' object has no attribute 'shape'"
        whole = (f" (None, the whole tensor one group, is HAPG's option; here: torch.zeros({tuple(z.shape)}, "
                 f"dtype=torch.long))" if groups is None else "")
        raise ConfigError(f"groups must be an integer tensor of group ids of the parameter's shape {tuple(z.shape)}, "
                          f"got a {type(groups).__name__}{whole}")
    if groups.shape != z.shape:
        raise ConfigError(f"groups must have the parameter's shape {tuple(z.shape)}, got {tuple(groups.shape)}")
    if groups.dtype not in (torch.int32, torch.int64):
        raise ConfigError(f"groups must be an integer tensor of group ids, got {groups.dtype}")
    if groups.numel() and int(groups.min()) < 0:
        raise ConfigError(f"groups must hold group ids 0..G−1, got the negative id {int(groups.min())}")
    return int(groups.max()) + 1 if groups.numel() else 0


def check_number(value, what: str) -> None:
    """`ConfigError` naming ``what`` unless ``value`` is one real number (a Python number or a one-element tensor): a
    string, bool, None or vector went on into a comparison's TypeError or torch's RuntimeError."""
    try:
        if isinstance(value, (str, bytes, bool)):
            raise TypeError
        float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"{what} must be a number, got {value!r}") from None


def _check_threshold(threshold: Threshold, what: str) -> None:
    """A proximal threshold t = η·λ·(…) must be ≥ 0: a negative one would expand z instead of shrinking it. (NaN is
    let through: it makes the result NaN, visibly, as a NaN gradient does.)"""
    try:  # a string or None was torch's "new(): invalid data type 'str'" TypeError or "Could not infer dtype" RuntimeError
        t = torch.as_tensor(threshold)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"the {what} threshold must be a real number or tensor, got {threshold!r}") from None
    if t.dtype == torch.bool or t.is_complex():
        raise ConfigError(f"the {what} threshold must be a real number or tensor, got {t.dtype}")
    if bool((t < 0).any()):
        raise ConfigError(f"the {what} threshold must be >= 0 (a step size times λα or λ(1 − α)), got {float(t.min())}")


def group_norms(z: torch.Tensor, groups: torch.Tensor) -> tuple:
    """(‖z_(n)‖₂, |z_(n)|) per group n, each (G,): Euclidean norm and size of every group.

    The norm is taken of z_(n) / max|z_(n)| (``torch.linalg.vector_norm`` does not scale: it gives 0 for [1e-200,
    1e-200]), so that z² neither underflows (a group of weights below 1e-154, float32 1e-19, had norm 0:
    ``prox_group`` zeroed it even at threshold 0, λ = 0 or α = 1) nor overflows (above 1e154 it was ∞); a NaN element
    gives a NaN norm, and a zero group norm 0 with gradient 0 (a subgradient of ‖·‖₂ at 0; the gradient of √0 was
    NaN)."""
    G = _check_groups(z, groups)
    flat_groups = groups.reshape(-1).long()
    flat = z.reshape(-1)
    peak = torch.zeros(G, dtype=z.dtype, device=z.device).scatter_reduce(0, flat_groups, flat.detach().abs(), "amax")
    unit = torch.where((peak > 0) & torch.isfinite(peak), peak, torch.ones_like(peak))
    sq = torch.zeros(G, dtype=z.dtype, device=z.device).index_add_(0, flat_groups, (flat / unit[flat_groups]) ** 2)
    zero = sq == 0
    norms = torch.where(zero, torch.zeros_like(sq), unit * torch.where(zero, torch.ones_like(sq), sq).sqrt())
    sizes = torch.bincount(flat_groups, minlength=G).to(z.dtype)
    return norms, sizes


def prox_l1(z: torch.Tensor, threshold: Threshold) -> torch.Tensor:
    """Eq 9: [Prox_{t‖·‖₁}(z)]_i = sgn(z_i)(|z_i| − t_i)_+, the soft threshold.

    Args:
        z: any shape. threshold: t ≥ 0, a scalar or a tensor broadcastable to z (per-element step sizes
            of AdamHAPG: t_i = η_i λα).
    """
    _check_threshold(threshold, "ℓ1")
    shape = torch.as_tensor(threshold).shape
    try:  # a threshold that does not broadcast to z was torch's "The size of tensor a ... must match" RuntimeError
        fits = torch.broadcast_shapes(shape, z.shape) == z.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ConfigError(f"the ℓ1 threshold must be a scalar or broadcast to z's shape {tuple(z.shape)}, got {tuple(shape)}")
    return torch.sign(z) * torch.clamp(z.abs() - threshold, min=0)


def prox_group(z: torch.Tensor, threshold: Threshold, groups: torch.Tensor) -> torch.Tensor:
    """Eq 10: [Prox(z)]_(n) = (1 − √|z_(n)| t_n / ‖z_(n)‖₂)_+ z_(n), the group soft threshold.

    It is the proximal operator of t Σ_n √|z_(n)| ‖z_(n)‖₂ (the ℓ1/ℓ2 term of eq 2 with t = ηλ(1−α)).

    Args:
        z: any shape. threshold: t ≥ 0, a scalar or a (G,) tensor (one per group: AdamHAPG's median step
            size of the group times λ(1−α)). groups: group id per element, z's shape.

    Returns:
        z's shape; a group whose norm is at most √|z_(n)| t_n is exactly zero.
    """
    norms, sizes = group_norms(z, groups)
    _check_threshold(threshold, "group")
    t = torch.as_tensor(threshold, dtype=z.dtype, device=z.device)
    if t.numel() != 1 and t.shape != norms.shape:
        raise ConfigError(f"the group threshold must be a scalar or one value per group, shape {tuple(norms.shape)}, "
                          f"got {tuple(t.shape)}")
    # a zero group stays zero (0/0 is the subgradient case ‖z‖ ≤ threshold); a NaN norm (a NaN element) makes the
    # whole group NaN, not its other elements 0 as "norm > 0" selected
    zero = norms == 0
    scale = torch.clamp(1 - sizes.sqrt() * t / torch.where(zero, torch.ones_like(norms), norms), min=0)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return z * scale[groups.long()]


def prox_sgl(z: torch.Tensor, l1_threshold: Threshold, group_threshold: Threshold, groups: torch.Tensor) -> torch.Tensor:
    """Eq 5: Prox_Ω = Prox_{group} ∘ Prox_{ℓ1}, the hierarchical proximal operator of the sparse group
    lasso (exact for this nested hierarchy: the ℓ1 children lie inside the ℓ2 groups).

    With step size η: ``prox_sgl(z, η λ α, η λ (1 − α), groups)`` as in eq 7–8.
    """
    return prox_group(prox_l1(z, l1_threshold), group_threshold, groups)


def sgl_penalty(a: torch.Tensor, lam: float, alpha: float, groups: torch.Tensor) -> torch.Tensor:
    """Ω_SGL(A) = λα‖A‖₁ + λ(1−α) Σ_n √|A_(n)| ‖A_(n)‖₂ (eq 2), a 0-dim tensor. `ConfigError` for λ < 0 or infinite, α
    outside [0, 1] (eq 2's ranges; they gave a negative "penalty", and λ = ∞ a NaN one: ∞·0) or either not a number (a
    string or a vector was Python's "'>=' not supported" TypeError or torch's "Boolean value of Tensor" RuntimeError)."""
    for name, value in (("the sparsity strength lam (λ)", lam), ("alpha (α)", alpha)):
        check_number(value, f"sgl_penalty: {name}")
    if not 0 <= lam < math.inf:
        raise ConfigError(f"sgl_penalty: the sparsity strength lam (λ) must be a finite number >= 0, got {lam}")
    if not 0 <= alpha <= 1:
        raise ConfigError(f"sgl_penalty: alpha (α) balances element and group sparsity and must be in [0, 1], got {alpha}")
    norms, sizes = group_norms(a, groups)
    return lam * alpha * a.abs().sum() + lam * (1 - alpha) * (sizes.sqrt() * norms).sum()
