"""DARTS (Liu et al., ICLR 2019), second order: the α step uses the unrolled-step hypergradient.

g = ∇_α L_val(w', α) − ξ·[∇_α L_train(w⁺, α) − ∇_α L_train(w⁻, α)] / (2ε) with
w' = w − ξ(∇_w L_train + μ·b + λ·w), w^± = w ± ε ∇_{w'} L_val(w', α), ε = 0.01 / ‖∇_{w'} L_val‖
(sparse-supernet eq 11–13, DARTS eq 7–8). Every ∇_α term is ``darts_alpha_grad(C, p)`` of the costs
C = ∂L/∂Z of one forward (wiring supplement §2.1); see ``nasdiag.search.unrolled``. The w step is
first-order DARTS's. ``docs/darts2.md`` reports the finite-difference accuracy, including the ReLU kink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import torch

from nasdiag.cost import darts_alpha_grad
from nasdiag.search.base import Batch, accuracy, check_batch, failing_row
from nasdiag.search.hyperparameters import hp
from nasdiag.search.methods.darts import DARTS
from nasdiag.search import unrolled
from nasdiag.search.registry import register
from nasdiag.search.unrolled import (UnrolledGradient, sgd_momentum_buffers, unrolled_gradient,
                                     weight_params)


@register("darts2")
class DARTS2(DARTS):
    """Second-order DARTS: first-order DARTS with the α-gradient replaced by the hypergradient of eq 13.

    ξ is the current learning rate of w and the unrolled step uses w's SGD momentum buffer and weight
    decay, as in DARTS's ``architect.py``. Each :meth:`step` returns what first-order DARTS returns
    (``scalars/val_loss`` and ``scalars/val_acc`` are those of the forward at w') plus
    ``scalars/fd_eps`` (ε; NaN where ∇_w' L_val = 0, the mixed term then 0), ``scalars/unrolled_train_loss``
    (L_train at w) and ``scalars/implicit_grad_norm`` (‖ξ·[∇_α L_train(w⁺) − ∇_α L_train(w⁻)]/(2ε)‖).
    """

    # Capture-safe: ε stays on the device and the finiteness checks are skipped while capturing
    # (``unrolled.host_checks_allowed``); every op is computed, so the weight step averages its own gradients.
    graph_capturable = True
    averages_own_gradients = True
    check_train_loss = True  # the step reads the host anyway (the unrolled losses' checks)

    @dataclass
    class Hyperparameters(DARTS.Hyperparameters):
        fd_eps_scale: float = hp(0.01, "r in ε = r / ‖∇_w' L_val‖ of the finite difference (DARTS code, "
                                       "architect._hessian_vector_product r=1e-2; sparse-supernet eq 13).",
                                 low=0, low_open=True)

    def arch_gradient(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        """``{cell type: (E, K)}``: the hypergradient of eq 13 the next :meth:`step` would apply to α,
        computed without changing any state (weights, BatchNorm statistics, optimizers, the global generators: a
        supernet with train-mode dropout draws the same masks here and in the next step)."""
        if unrolled.host_checks_allowed():  # as step() does: a wrong batch is one line (its label range is read
            check_batch(self.network, train_batch, "search-train")  # back, which a graph capture must not do)
            check_batch(self.network, val_batch, "search-val")
        with unrolled.random_state_kept():
            return self._unrolled(train_batch, val_batch).arch_grad

    def _unrolled(self, train_batch: Batch, val_batch: Batch, observe_probe: bool = False) -> UnrolledGradient:
        probs = self.probabilities()
        params = weight_params(self.network)
        group = self.w_optimizer.param_groups[0]
        context = (lambda: self._probe_recording(val_batch[1])) if observe_probe else None
        extra = {} if context is None else {"val_context": context}
        return unrolled_gradient(
            self.network, train_batch, val_batch, probs,
            lambda costs: {t: darts_alpha_grad(c, probs[t]) for t, c in costs.items()},
            xi=group["lr"], momentum=group["momentum"], momentum_buffers=sgd_momentum_buffers(self.w_optimizer, params),
            weight_decay=group["weight_decay"], eps_scale=self.hp.fd_eps_scale, **extra)

    def alpha_step(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        """One Adam step on α with the hypergradient of eq 13."""
        result = self._unrolled(train_batch, val_batch, observe_probe=True)
        for cell_type, alpha in self.network.alphas().items():
            alpha.grad = result.arch_grad[cell_type].to(alpha.dtype)
        grad_norm = torch.linalg.vector_norm(torch.stack([a.grad.norm() for a in self.network.arch_parameters()]))
        implicit_norm = result.xi * torch.linalg.vector_norm(torch.stack([g.norm() for g in result.implicit.values()]))
        self.alpha_optimizer.step()
        self._observe_costs(result.val.per_cell, None)
        self._last_arch_batch = val_batch
        y = val_batch[1]
        return {"scalars/val_loss": result.val.loss, "scalars/val_acc": accuracy(result.val.logits, y),
                "scalars/alpha_grad_norm": grad_norm, "scalars/implicit_grad_norm": implicit_norm,
                "scalars/unrolled_train_loss": result.train_loss,
                "scalars/fd_eps": torch.where(torch.isfinite(result.eps), result.eps, torch.full_like(result.eps, math.nan))}

    def step(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        stats = {"scalars/w_lr": self.scalar_statistic(self.w_optimizer.param_groups[0]["lr"])}
        with failing_row(stats):  # a NaN loss (unrolled forwards, w step) raises before its update, its row recorded
            stats.update(self.alpha_step(train_batch, val_batch))
            weights = self.forward_weights()
            stats.update(self.weight_step(*train_batch, weights))
        stats.update(self.arch_statistics(weights))
        return stats
