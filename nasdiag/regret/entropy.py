"""Normalized entropy of mixture weights (XNAS §8.5), a measure of how dense a forecaster still is."""

from __future__ import annotations

import math

import torch
from nasdiag.regret.errors import RegretError, RegretTypeError
from nasdiag.regret.rewards import _as_tensor

__all__ = ["normalized_entropy", "mean_normalized_entropy"]


def normalized_entropy(weights: torch.Tensor) -> torch.Tensor:
    """``H = -(1 / ln N) sum_i u_i ln u_i`` per forecaster (eq 54), with ``0 ln 0 = 0``.

    1 for uniform weights, 0 for a single surviving expert.

    Args:
        weights: ``(..., N)`` mixture weights ``u`` (non-negative, summing to 1 over the last axis,
            e.g. :attr:`Forecaster.weights` or ``softmax(alpha)``), ``N >= 2``. Wiped-out experts
            count in ``N`` with weight 0, as in eq 54.

    Returns:
        ``(...,)`` tensor, same floating dtype. A forecaster whose weights contain NaN/inf gets NaN
        (kept, not hidden); all finite rows are validated.
    """
    weights = _as_tensor(weights, "weights")
    if not weights.is_floating_point():
        raise RegretTypeError(f"weights must be a floating-point tensor, got dtype {weights.dtype}")
    if weights.ndim < 1 or weights.shape[-1] < 2:
        raise RegretError(
            f"weights must have shape (..., N) with N >= 2 experts (ln 1 = 0 leaves eq 54 undefined); "
            f"got {tuple(weights.shape)}"
        )
    finite_row = torch.isfinite(weights).all(-1)
    checked = weights[finite_row]
    if (checked < 0).any():
        raise RegretError(
            "weights must be non-negative mixture weights u = v / sum v, got negative entries; pass "
            "softmax(alpha), not the architecture parameters alpha themselves"
        )
    # loose on purpose: catches alpha or unnormalized v passed by mistake, accepts float32 rounding
    tol = 1e-5
    if ((checked.sum(-1) - 1).abs() > tol).any():
        raise RegretError(
            "weights must sum to 1 over the last axis (they are mixture weights u); pass "
            "softmax(alpha), not the architecture parameters alpha themselves"
        )
    plogp = torch.where(weights > 0, weights * torch.log(weights), torch.zeros_like(weights))
    entropy = -plogp.sum(-1) / math.log(weights.shape[-1])
    # NaN rows: `weights > 0` is False for NaN, so force them back to NaN explicitly.
    return entropy.masked_fill(~finite_row, math.nan)


def mean_normalized_entropy(weights: torch.Tensor) -> torch.Tensor:
    """The mean of :func:`normalized_entropy` over all forecasters (eq 55), a 0-d tensor.

    Args:
        weights: ``(..., N)``, e.g. ``(E, K)`` for the edges of a normal cell (eq 55 averages over the
            forecasters of one cell type). NaN propagates.
    """
    return normalized_entropy(weights).mean()
