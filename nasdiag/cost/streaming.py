"""Streaming statistics of costs across steps: E[C], E[C²] and per-op counts (SNAS-Series style).

Welford/Chan updates in float64, so that long runs neither lose precision nor store history.
"""

from __future__ import annotations

from typing import Optional, Tuple

import math

import torch
from nasdiag.cost.errors import CostError


class CostMoments:
    """Running count, mean and variance of costs of a fixed shape (e.g. (E, K) per cell type).

    Each :meth:`update` adds N observations; ``mask`` selects which entries of which observation count
    (e.g. only sampled ops under one-hot sampling, where ``count`` becomes the per-op sample count).
    A NaN observation is kept (the mean becomes NaN): it is recorded, never dropped.

    Attributes (all float64, shape ``shape``):
        count: number of observations per entry.
        mean: E[C] over them. var: E[C²] − E[C]² (population variance). second_moment: E[C²].
    """

    def __init__(self, shape: Tuple[int, ...], device: torch.device | str | None = None):
        self.shape = tuple(shape)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.reset()

    def reset(self) -> None:
        """Forget every observation."""
        z = torch.zeros(self.shape, dtype=torch.float64, device=self.device)
        self.count, self.mean, self._m2 = z.clone(), z.clone(), z.clone()

    @property
    def var(self) -> torch.Tensor:
        # 0/0 stays NaN: an entry never observed has no variance.
        return self._m2 / self.count

    @property
    def second_moment(self) -> torch.Tensor:
        return self.var + self.mean**2

    def update(self, observations: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
        """Add observations of shape (N, *shape) (or ``shape`` for one); ``mask`` is bool, same shape."""
        obs = observations.detach().to(self.device, torch.float64)
        if obs.shape == self.shape:
            obs = obs.unsqueeze(0)
            mask = None if mask is None else mask.unsqueeze(0)
        if obs.shape[1:] != self.shape:
            raise CostError(f"observations must have shape (N, *{self.shape}), got {tuple(observations.shape)}")
        if mask is None:
            w = torch.ones_like(obs)
        else:
            if mask.shape != obs.shape:
                raise CostError(f"mask must have the shape of the observations {tuple(obs.shape)}, got {tuple(mask.shape)}")
            w = mask.to(self.device, torch.float64)
        # where(w, obs, 0) rather than w * obs: a NaN at an unselected entry must not leak in.
        obs_w = torch.where(w > 0, obs, torch.zeros_like(obs))
        n_b = w.sum(0)
        mean_b = obs_w.sum(0) / n_b.clamp(min=1)
        m2_b = (w * (obs_w - mean_b) ** 2).sum(0)
        self._merge(n_b, mean_b, m2_b)

    def _merge(self, n_b: torch.Tensor, mean_b: torch.Tensor, m2_b: torch.Tensor) -> None:
        n = self.count + n_b
        delta = mean_b - self.mean
        frac = torch.where(n > 0, n_b / n.clamp(min=1), torch.zeros_like(n))
        has_b = n_b > 0
        # An inf (or NaN) mean on either side: Chan's update would give inf − inf = NaN for [inf] then [1]; the
        # direct weighted mean gives inf, as the same values in one batch (and numpy) do, and the variance is NaN.
        finite = torch.isfinite(self.mean) & torch.isfinite(mean_b)
        direct = (self.count * self.mean + n_b * mean_b) / n.clamp(min=1)
        mean = torch.where(has_b, torch.where(finite, self.mean + delta * frac, direct), self.mean)
        m2 = torch.where(has_b, torch.where(finite, self._m2 + m2_b + delta**2 * self.count * frac,
                                            torch.full_like(self._m2, math.nan)), self._m2)
        # In place: a search step captured as a CUDA graph keeps accumulating into these very tensors.
        self.mean.copy_(mean)
        self._m2.copy_(m2)
        self.count.copy_(n)

    def merge(self, other: "CostMoments") -> None:
        """Fold in the statistics of another accumulator (e.g. another DDP rank)."""
        if other.shape != self.shape:
            raise CostError(f"cannot merge moments of shape {other.shape} into {self.shape}")
        self._merge(other.count.to(self.device), other.mean.to(self.device), other._m2.to(self.device))
