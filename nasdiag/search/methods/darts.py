"""DARTS (Liu et al., ICLR 2019), first order: alternate an α step on search-val and a w step on search-train.

∂L/∂α is the cost C = ∂L/∂Z of the wiring supplement seen through the softmax (§2.1):
∂L/∂α = (diag(p) − ppᵀ)·C, summed over the cells that share α (``nasdiag.cost.darts_alpha_grad``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Tuple

import torch
from torch import nn

from nasdiag.cost import darts_alpha_grad
from nasdiag.distributed import finite_on_every_rank
from nasdiag.search.base import Batch, SearchMethod, accuracy, failing_row, loss_text, nonfinite_loss_error
from nasdiag.search.hyperparameters import Hyperparameters, hp
from nasdiag.search.registry import register
from nasdiag.search.unrolled import host_checks_allowed


@dataclass
class SGDAdamHyperparameters(Hyperparameters):
    """DARTS's optimizer settings of w (SGD, cosine schedule, gradient clip) and of the architecture (Adam learning
    rate and betas), without α's weight decay: the base of methods whose architecture step has a regulariser of
    its own (SparseNAS's proximal step), where a weight decay of α would be accepted and do nothing."""

    w_lr: float = hp(0.025, "Initial SGD learning rate of w (DARTS §A.1.1, CIFAR-10).", low=0, low_open=True)
    w_lr_min: float = hp(0.001, "Final learning rate of w's cosine schedule (DARTS code default).", low=0)
    w_momentum: float = hp(0.9, "SGD momentum of w (DARTS §A.1.1).", low=0, high=1)
    w_weight_decay: float = hp(3e-4, "Weight decay of w (DARTS §A.1.1).", low=0)
    grad_clip: float = hp(5.0, "Gradient-norm clip of w (DARTS code default).", low=0, low_open=True)
    alpha_lr: float = hp(3e-4, "Adam learning rate of α (DARTS §A.1.1).", low=0, low_open=True)
    alpha_betas: Tuple[float, float] = hp((0.5, 0.999), "Adam betas of α (DARTS §A.1.1).", low=0, high=1, high_open=True)


@register("darts")
class DARTS(SearchMethod):
    """First-order DARTS (ξ = 0 in eq 11 of the sparse-supernet paper).

    Each :meth:`step` returns (0-dim batch means unless stated): ``scalars/train_loss``,
    ``scalars/train_acc`` (w step), ``scalars/val_loss``, ``scalars/val_acc`` (α step),
    ``scalars/w_lr``, ``scalars/alpha_grad_norm``, and ``arch/<cell>/{params,probabilities,weights}``
    after the update.
    """

    graph_capturable = True
    averages_own_gradients = True  # every op is computed in every weight step: no DDP wrapper needed
    #: :meth:`weight_step` raises on a NaN/inf training loss before the update (one host read per step). First-order
    #: DARTS does not: its step stays free of host reads, and the run stops at the epoch end's check instead, its
    #: NaN rows recorded. Methods whose step reads the host anyway (darts2, sparsenas) turn it on.
    check_train_loss: ClassVar[bool] = False

    #: Overrides applied on the embedded digits (the main job); the paper's values stay the defaults for
    #: CIFAR-10. With α lr 3e-4 the 88 α steps of 8 digits epochs move every mixing weight by < 0.003 from
    #: 1/8: Adam moves α by about lr per step, so α cannot leave uniform. With 3e-2 (same run, same ~2 min)
    #: the strongest op of each normal edge reaches p = 0.15-0.31 and leads the next one by > 0.02 on 10 of
    #: 14 edges (measured on the main job, seed 0; BENCHMARKS.md).
    digits_preset = {"alpha_lr": 3e-2}

    @dataclass
    class Hyperparameters(SGDAdamHyperparameters):
        alpha_weight_decay: float = hp(1e-3, "Weight decay of α (DARTS §A.1.1).", low=0)

    def build(self) -> None:
        h = self.hp
        self.build_weight_optimizer()
        self.alpha_optimizer = torch.optim.Adam(self.network.arch_parameters(), lr=h.alpha_lr, betas=tuple(h.alpha_betas),
                                                weight_decay=h.alpha_weight_decay)

    def build_weight_optimizer(self) -> None:
        """w's momentum SGD (``self.w_optimizer``) and its cosine schedule to ``w_lr_min`` (``self.scheduler``)."""
        h = self.hp
        self.w_optimizer = torch.optim.SGD(self.network.weight_parameters(), lr=h.w_lr, momentum=h.w_momentum,
                                           weight_decay=h.w_weight_decay)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.w_optimizer, self.schedule.epochs, eta_min=h.w_lr_min)

    def probabilities(self) -> Dict[str, torch.Tensor]:
        return {t: torch.softmax(a.detach(), dim=-1) for t, a in self.network.alphas().items()}

    def alpha_step(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        """One Adam step on α with the search-val loss (first order: w held fixed).

        ∂L/∂α = darts_alpha_grad(C, p) with C = ∂L/∂Z at Z = p = softmax(α) (wiring supplement §2.1).
        """
        probs = self.probabilities()
        result = self.cost(x, y, probs)
        for cell_type, alpha in self.network.alphas().items():
            alpha.grad = darts_alpha_grad(result.costs[cell_type], probs[cell_type]).to(alpha.dtype)
        grad_norm = torch.linalg.vector_norm(torch.stack([a.grad.norm() for a in self.network.arch_parameters()]))
        self.alpha_optimizer.step()
        return {"scalars/val_loss": result.loss, "scalars/val_acc": accuracy(result.logits, y), "scalars/alpha_grad_norm": grad_norm}

    def weight_step(self, x: torch.Tensor, y: torch.Tensor, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """One SGD step on w with the search-train loss, the mixing weights held fixed."""
        self.w_optimizer.zero_grad(set_to_none=True)
        logits = self.model(x, {t: z.detach() for t, z in weights.items()})
        loss = nn.functional.cross_entropy(logits, y)
        if self.check_train_loss and host_checks_allowed() and not finite_on_every_rank(loss):  # DDP: every rank stops
            raise nonfinite_loss_error(f"{self.name}: the search-train loss is {loss_text(loss)} (not finite); the search stops "
                                       "before the w step. Lower the learning rates or check the data for NaN/inf",
                                       {"scalars/train_loss": loss.detach()})
        if loss.requires_grad:  # every weight frozen (requires_grad=False): α is searched on fixed weights, no w step
            loss.backward()
        self.average_weight_gradients()  # data parallel: ∂L/∂w averaged over ranks (a no-op in one process)
        nn.utils.clip_grad_norm_(self.network.weight_parameters(), self.hp.grad_clip)
        self.w_optimizer.step()
        return {"scalars/train_loss": loss.detach(), "scalars/train_acc": accuracy(logits.detach(), y)}

    def step(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        stats = {"scalars/w_lr": self.scalar_statistic(self.w_optimizer.param_groups[0]["lr"])}
        with failing_row(stats):
            stats.update(self.alpha_step(*val_batch))
            weights = self.forward_weights()
            stats.update(self.weight_step(*train_batch, weights))
        stats.update(self.arch_statistics(weights))
        return stats

    def epoch_end(self, epoch: int) -> None:
        self.step_schedules(self.scheduler)
