"""Streaming statistics of costs across steps: E[C], E[C²] and per-op counts (SNAS-Series style).

Welford/Chan updates in float64, so that long runs neither lose precision nor store history.
"""

from __future__ import annotations

from typing import Optional, Tuple

import math
import numbers

import torch
from nasdiag.cost.errors import CostError, require_tensors


class CostMoments:
    """Running count, mean and variance of costs of a fixed shape (e.g. (E, K) per cell type).

    Each :meth:`update` adds N observations; ``mask`` selects which entries of which observation count
    (e.g. only sampled ops under one-hot sampling, where ``count`` becomes the per-op sample count).
    A NaN observation is kept (the mean becomes NaN): it is recorded, never dropped.

    Accuracy: every entry accumulates its observations minus a shift K, the mean of its first observed
    batch, so that the rounding of the running means (and of Chan's δ² term) is at the scale of the spread,
    not of |E[C]|: without it, data with |mean|/std = 1e8 lost 3e-10 of its variance (numpy's two-pass:
    2e-16) and 1e15 lost 8 %. Costs of any finite magnitude keep a finite mean and variance where numpy's
    two-pass does (a variance beyond float64 range is inf, never NaN).

    Attributes (all float64, shape ``shape``):
        count: number of observations per entry.
        mean: E[C] over them. var: E[C²] − E[C]² (population variance). second_moment: E[C²].
    """

    def __init__(self, shape: Tuple[int, ...], device: torch.device | str | None = None):
        dims = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else None
        if dims is None or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in dims):
            # an int was "'int' object is not iterable", a float or negative dim torch.zeros' TypeError / RuntimeError
            raise CostError(f"CostMoments: shape must be a tuple of non-negative ints, e.g. (E, K), got {shape!r}")
        self.shape = tuple(int(d) for d in dims)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.reset()

    def reset(self) -> None:
        """Forget every observation."""
        z = torch.zeros(self.shape, dtype=torch.float64, device=self.device)
        self.count, self._shift, self._shifted_mean, self._m2 = z.clone(), z.clone(), z.clone(), z.clone()

    @property
    def mean(self) -> torch.Tensor:
        return self._shift + self._shifted_mean

    @property
    def var(self) -> torch.Tensor:
        # 0/0 stays NaN: an entry never observed has no variance.
        return self._m2 / self.count

    @property
    def second_moment(self) -> torch.Tensor:
        return self.var + self.mean**2

    def update(self, observations: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
        """Add observations of shape (N, *shape) (or ``shape`` for one); ``mask`` is bool, same shape."""
        require_tensors("CostMoments.update", observations=observations, **({} if mask is None else {"mask": mask}))
        obs = observations.detach().to(self.device, torch.float64)
        if obs.shape == self.shape:
            obs = obs.unsqueeze(0)
            mask = None if mask is None else mask.unsqueeze(0)
        if obs.shape[1:] != self.shape:
            raise CostError(f"observations must have shape (N, *{self.shape}), got {tuple(observations.shape)}")
        if mask is None:
            selected = torch.ones_like(obs, dtype=torch.bool)
        else:
            if mask.shape != obs.shape:
                raise CostError(f"mask must have the shape of the observations {tuple(obs.shape)}, got {tuple(mask.shape)}")
            if mask.dtype != torch.bool:
                raise CostError(f"mask must be a bool tensor (which observations count), got {mask.dtype}")
            selected = mask.to(self.device)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        n_b = selected.sum(0, dtype=torch.float64)
        # The shift of an entry observed for the first time: its batch mean (divided before summing, so that
        # finite costs near the float64 limit give a finite shift). A non-finite one leaves the shift at 0.
        # torch.where, never w·x: a NaN or an overflowing square at an unselected entry must not leak in.
        guess = torch.where(selected, obs / n_b.clamp(min=1), zero).sum(0)
        first = (self.count == 0) & (n_b > 0) & torch.isfinite(guess)
        self._shift.copy_(torch.where(first, guess, self._shift))
        shifted = torch.where(selected, obs - self._shift, zero)
        # Finite costs of the other sign than a shift near the float64 limit ([1e308] then [-1e308]) overflow in the
        # shifted frame (|C − K| up to twice the largest float): the mean was ∓inf, the variance NaN, where numpy's is
        # finite and inf. Such an entry drops its shift (no cancellation to guard against at that spread).
        self._rebase((selected & torch.isfinite(obs) & ~torch.isfinite(shifted)).any(0))
        shifted = torch.where(selected, obs - self._shift, zero)
        mean_b = shifted.sum(0) / n_b.clamp(min=1)
        # a sum beyond float64 range of finite costs: divided before summing, as the shift's guess
        mean_b = torch.where(torch.isfinite(mean_b), mean_b, torch.where(selected, shifted / n_b.clamp(min=1), zero).sum(0))
        m2_b = torch.where(selected, (shifted - mean_b) ** 2, zero).sum(0)
        self._merge(n_b, mean_b, m2_b)

    def _rebase(self, entries: torch.Tensor) -> None:
        """Move ``entries`` to shift 0, their running mean into the shifted mean (the variance is frame-free)."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        moved = torch.where(self.count > 0, self._shifted_mean + self._shift, zero)
        self._shifted_mean.copy_(torch.where(entries, moved, self._shifted_mean))
        self._shift.copy_(torch.where(entries, zero, self._shift))

    def _merge(self, n_b: torch.Tensor, mean_b: torch.Tensor, m2_b: torch.Tensor) -> None:
        """Chan's pairwise update with batch statistics ``mean_b`` (in this accumulator's shifted frame), ``m2_b``."""
        n = self.count + n_b
        frac = torch.where(n > 0, n_b / n.clamp(min=1), torch.zeros_like(n))
        has_b = n_b > 0
        mean_a = self._shifted_mean
        delta = mean_b - mean_a
        # An inf (or NaN) mean on either side: Chan's update would give inf − inf = NaN for [inf] then [1]; the
        # direct weighted mean gives inf, as the same values in one batch (and numpy) do, and the variance is NaN.
        # Finite means whose difference overflows take the direct mean too; their variance is beyond range: inf.
        finite_means = torch.isfinite(mean_a) & torch.isfinite(mean_b)
        chan = finite_means & torch.isfinite(delta)
        direct = mean_a * (self.count / n.clamp(min=1)) + mean_b * frac
        mean = torch.where(has_b, torch.where(chan, mean_a + delta * frac, direct), mean_a)
        # δ²·n_a·n_b/n as (δ·n_b/n)·(δ·n_a): 0 for a first batch (n_a = 0) however large δ is (δ² alone overflows
        # beyond |δ| = 1.3e154 and inf·0 made the variance of finite costs NaN).
        between = torch.where(chan, self._m2 + m2_b + (delta * frac) * (delta * self.count),
                              torch.where(finite_means, torch.full_like(self._m2, math.inf), torch.full_like(self._m2, math.nan)))
        m2 = torch.where(has_b, between, self._m2)
        # In place: a search step captured as a CUDA graph keeps accumulating into these very tensors.
        self._shifted_mean.copy_(mean)
        self._m2.copy_(m2)
        self.count.copy_(n)

    def merge(self, other: "CostMoments") -> None:
        """Fold in the statistics of another accumulator (e.g. another DDP rank)."""
        if not isinstance(other, CostMoments):
            raise CostError(f"CostMoments.merge: other must be a CostMoments, got {type(other).__name__}")
        if other.shape != self.shape:
            raise CostError(f"cannot merge moments of shape {other.shape} into {self.shape}")
        count, shift = other.count.to(self.device), other._shift.to(self.device)
        # an entry only the other has observed takes its shift, so that its statistics are copied exactly
        self._shift.copy_(torch.where((self.count == 0) & (count > 0), shift, self._shift))
        other_mean = shift + other._shifted_mean.to(self.device)
        mean_b = (shift - self._shift) + other._shifted_mean.to(self.device)
        # shifts of opposite signs near the float64 limit overflow in this frame: as in update, drop this entry's shift
        over = (count > 0) & ~torch.isfinite(mean_b) & torch.isfinite(other_mean) & torch.isfinite(self.mean)
        self._rebase(over)
        self._merge(count, torch.where(over, other_mean, mean_b), other._m2.to(self.device))
