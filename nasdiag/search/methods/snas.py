"""SNAS (Xie et al., ICLR 2019): a Gumbel-softmax relaxation of one-hot architecture samples, trained
single-level (w and α on the same training batch).

α are the logits of p: p = softmax(α) per edge, so log p = α − logsumexp(α) and α is log p up to a
per-edge constant (to which the relaxation is blind). The forward uses the relaxed sample

    Z = softmax((log p + G)/τ) = softmax((α + G)/τ),   G ~ Gumbel(0, 1) i.i.d. per (edge, op),

one sample per step and edge, shared by the batch and the cells of a type. The cost C = ∂L/∂Z of that
forward (wiring supplement §2) gives the α-gradient through the relaxation's Jacobian,
∂L/∂α = (1/τ)(diag Z − ZZᵀ)·C (``nasdiag.cost.snas_alpha_grad``), from the same backward as ∂L/∂w.
τ is annealed geometrically per epoch. (SNAS's resource constraint is not part of this method.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from nasdiag.cost import snas_alpha_grad
from nasdiag.search.base import Batch, failing_row
from nasdiag.search.hyperparameters import hp
from nasdiag.search.methods._sampling import gumbel_noise, mean_entropy, single_level_step
from nasdiag.search.methods.darts import DARTS
from nasdiag.search.registry import register


@register("snas")
class SNAS(DARTS):
    """SNAS: Gumbel-softmax samples, single-level, τ annealed.

    The optimizers of w (SGD, cosine schedule) and α (Adam) are DARTS's, with DARTS's default values
    (the seeds give no SNAS-specific ones). :meth:`probabilities` is softmax(α), the genotype and
    the supernet evaluation use it.

    Each :meth:`step` returns ``scalars/{train_loss,train_acc,w_lr,alpha_grad_norm,temperature,entropy}``
    (``entropy``: mean over edges of H(p) in nats, after the update; ``temperature``: the τ of this
    step's sample) and ``arch/<cell>/{params,probabilities,weights}``, ``weights`` being the relaxed
    sample Z of the step.
    """

    single_level = True
    state_attributes = ("temperature",)

    @dataclass
    class Hyperparameters(DARTS.Hyperparameters):
        tau0: float = hp(1.0, "Initial Gumbel-softmax temperature τ (SNAS code default).", low=0, low_open=True)
        tau_decay: float = hp(0.97, "τ is multiplied by this after every epoch (SNAS code default).", low=0, low_open=True, high=1)
        tau_min: float = hp(0.0, "Floor of the annealed τ (0: none; nasdiag's choice).", low=0)

    def build(self) -> None:
        super().build()
        #: the current temperature τ (a float; saved with the method's state)
        self.temperature = float(self.hp.tau0)

    def forward_weights(self) -> Dict[str, torch.Tensor]:
        """A fresh relaxed sample Z = softmax((α + G)/τ) per cell type, (E, K), drawn with ``self.generator``."""
        out = {}
        for t, alpha in self.network.alphas().items():
            a = alpha.detach()
            g = gumbel_noise(a.shape, self.generator, a.dtype, a.device)
            out[t] = torch.softmax((a + g) / self.temperature, dim=-1)
        return out

    def step(self, train_batch: Batch, val_batch: Optional[Batch] = None) -> Dict[str, torch.Tensor]:
        """One single-level step on ``train_batch`` (``val_batch`` is not used)."""
        tau = self.temperature
        stats = {"scalars/w_lr": self.scalar_statistic(self.w_optimizer.param_groups[0]["lr"]),
                 "scalars/temperature": torch.tensor(tau, dtype=torch.float64)}
        z = self.forward_weights()
        with failing_row(stats):
            stats.update(single_level_step(self, train_batch, z, None,
                                           lambda t, cost: snas_alpha_grad(cost, z[t], tau)))
        stats["scalars/entropy"] = mean_entropy(self.probabilities())
        stats.update(self.arch_statistics(z))
        return stats

    def epoch_end(self, epoch: int) -> None:
        super().epoch_end(epoch)
        self.temperature = max(self.temperature * self.hp.tau_decay, self.hp.tau_min)
