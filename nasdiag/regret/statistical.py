"""The statistical setting of XNAS §8.3: selecting the best of N noisy experts, many runs at once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from nasdiag.regret.forecaster import Forecaster, SoftmaxGD, _positive
from nasdiag.regret.errors import RegretError, RegretTypeError

__all__ = ["GaussianExpertsOutcome", "default_loss_bound", "simulate_gaussian_experts"]


@dataclass
class GaussianExpertsOutcome:
    """Per-run results of :func:`simulate_gaussian_experts` (R runs, N experts).

    Attributes:
        biases: ``(R, N)`` the experts' inherent values ``b_i ~ N(0, 1)``.
        lr, loss_bound: the eta and L both forecasters used.
        xnas_regret, gd_regret: ``(R,)`` regret of eq 2 with the linear losses ``l_t(f_i) = -R_{t,i}``
            (for linear losses eq 2 and the linearized regret of eq 31 coincide).
        uniform_regret: ``(R,)`` regret of the fixed uniform mixture (no learning at all),
            ``max_i S_i - mean_i S_i`` with ``S_i = sum_t R_t,i``: the ceiling a forecaster that
            learns nothing reaches.
        xnas_correct, gd_correct: ``(R,)`` bool, whether the expert of largest final weight is the one
            of largest bias (§8.3's correct selection).
        xnas_bound: ``(R,)`` eq 3 at the end of each run (a guarantee on ``xnas_regret`` only with
            ``zeta >= 1`` and no reward beyond L, §3.2.2).
        xnas_gamma: ``(R,)`` aggregated wipeout factor gamma_T (eq 28).
        xnas_alive: ``(R,)`` experts left after the wipeouts.
        bound_violations: ``(R,)`` rewards of alive experts with ``|R| > L`` (Gaussian rewards are
            unbounded, so L is a high quantile, not a bound).
    """

    biases: torch.Tensor
    lr: float
    loss_bound: float
    xnas_regret: torch.Tensor
    gd_regret: torch.Tensor
    uniform_regret: torch.Tensor
    xnas_correct: torch.Tensor
    gd_correct: torch.Tensor
    xnas_bound: torch.Tensor
    xnas_gamma: torch.Tensor
    xnas_alive: torch.Tensor
    bound_violations: torch.Tensor


def default_loss_bound(sigma: float) -> float:
    """``L = 3 sqrt(1 + sigma^2)``: three standard deviations of a reward ``R = b + sigma z`` with
    ``b, z ~ N(0, 1)``; §8.3 does not state the L it used for these unbounded rewards."""
    square = sigma * sigma
    # hypot where sigma^2 overflows (sigma = 1e200: L = 3e200, not inf); the plain form elsewhere keeps past runs' L
    return 3.0 * (math.sqrt(1.0 + square) if square < math.inf else math.hypot(1.0, sigma))


def simulate_gaussian_experts(
    n_experts: int,
    sigma: float,
    n_runs: int = 1000,
    n_steps: int = 1000,
    *,
    lr: Optional[float] = None,
    gd_lr: Optional[float] = None,
    loss_bound: Optional[float] = None,
    zeta: float = 1.0,
    generator: Optional[torch.Generator] = None,
    dtype: torch.dtype = torch.float64,
) -> GaussianExpertsOutcome:
    """Monte Carlo of §8.3 (Fig. 8) for XNAS (Algorithm 1) and GD with softmax (eq 5-6).

    Each run draws biases ``b_i ~ N(0, 1)``; at every step both forecasters receive the *same*
    rewards ``R_{t,i} ~ N(b_i, sigma^2)`` (common random numbers, so the comparison has less noise).
    All runs advance together as one batch of forecasters: the only Python loop is over time.

    Args:
        n_experts: N >= 2.
        sigma: reward noise standard deviation ``sigma_R`` (>= 0).
        n_runs, n_steps: R runs of T steps (§8.3: 1000 x 1000).
        lr: XNAS's eta; default ``eta*`` of eq 4 with T = n_steps, L = loss_bound.
        gd_lr: GD's eta; default the same as XNAS's (§8.2 also uses one rate for both).
        loss_bound: L; default :func:`default_loss_bound`.
        zeta: XNAS wipeout relaxation (1 = Algorithm 1).
        generator: torch RNG for reproducibility.
        dtype: float64 by default.
    """
    try:
        if isinstance(sigma, (str, bytes, bool)):
            raise TypeError
        sigma = float(sigma)
    except (TypeError, ValueError):
        raise RegretTypeError(f"sigma must be a number (the reward noise's standard deviation), got {sigma!r}") from None
    if sigma < 0 or not math.isfinite(sigma):
        raise RegretError(f"sigma must be a finite standard deviation >= 0, got {sigma}")
    # named as the caller named them (Forecaster would call them N, T, shape)
    if generator is not None and not isinstance(generator, torch.Generator):  # torch's randn() would list its overloads
        raise RegretTypeError(f"generator must be a torch.Generator (torch.Generator().manual_seed(seed)) or None, got "
                              f"{generator!r:.80}")
    n_experts = _positive("n_experts", n_experts, integer=True)
    n_runs = _positive("n_runs", n_runs, integer=True)
    n_steps = _positive("n_steps", n_steps, integer=True)
    if n_experts < 2:
        raise RegretError(f"n_experts must be >= 2 (one expert leaves nothing to select), got {n_experts}")
    loss_bound = default_loss_bound(sigma) if loss_bound is None else _positive("loss_bound", loss_bound)
    lr = Forecaster.optimal_lr(n_steps, loss_bound, n_experts) if lr is None else _positive("lr", lr)
    gd_lr = lr if gd_lr is None else _positive("gd_lr", gd_lr)
    xnas = Forecaster(n_experts, lr, loss_bound, n_steps, zeta=zeta, shape=(n_runs,), dtype=dtype)
    gd = SoftmaxGD(n_experts, gd_lr, shape=(n_runs,), dtype=dtype)
    biases = torch.randn(n_runs, n_experts, generator=generator, dtype=dtype)
    for _ in range(n_steps):
        rewards = torch.randn(n_runs, n_experts, generator=generator, dtype=dtype).mul_(sigma).add_(biases)
        xnas.update(rewards)
        gd.update(rewards)
    best = biases.argmax(-1)
    totals = -gd.expert_losses  # S_i = sum_t R_t,i, the same for both forecasters
    return GaussianExpertsOutcome(
        biases=biases,
        lr=lr,
        loss_bound=loss_bound,
        xnas_regret=xnas.regret,
        gd_regret=gd.regret,
        uniform_regret=totals.amax(-1) - totals.mean(-1),
        xnas_correct=xnas.weights.argmax(-1) == best,
        gd_correct=gd.weights.argmax(-1) == best,
        xnas_bound=xnas.bound(),
        xnas_gamma=xnas.gamma,
        xnas_alive=xnas.alive.sum(-1),
        bound_violations=xnas.bound_violations,
    )
