"""DARTS (Liu et al., 2019), first order: alternate an α step on search-val and a w step on search-train.

∂L/∂α is the cost C = ∂L/∂Z of the wiring paper seen through the softmax (wiring paper §2.1):
∂L/∂α = (diag(p) − ppᵀ)·C, summed over the cells that share α.
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence

import torch
from torch import nn

from nasdiag.search.base import Batch, SearchMethod, accuracy
from nasdiag.supernet import Network


class DARTS(SearchMethod):
    """First-order DARTS.

    Args:
        network: the supernet; α are its ``arch_parameters()``, w its ``weight_parameters()``.
        epochs: length of the cosine schedule of the w learning rate.
        w_lr, w_lr_min, w_momentum, w_weight_decay, grad_clip: SGD on w with cosine annealing
            (DARTS defaults 0.025 → 0.001, momentum 0.9, weight decay 3e-4, clip 5).
        alpha_lr, alpha_betas, alpha_weight_decay: Adam on α (3e-4, (0.5, 0.999), 1e-3).
        probe: optional ``nasdiag.attach(network)``; the α step is recorded by it (see
            :meth:`SearchMethod.diagnostics`).

    Each :meth:`step` returns (batch means, 0-dim tensors): ``scalars/train_loss``, ``scalars/train_acc``
    (w step), ``scalars/val_loss``, ``scalars/val_acc`` (α step), ``scalars/w_lr``, ``scalars/alpha_grad_norm``,
    plus ``arch/<cell type>/{params,weights}`` after the update.
    """

    name = "darts"

    def __init__(
        self,
        network: Network,
        epochs: int,
        w_lr: float = 0.025,
        w_lr_min: float = 0.001,
        w_momentum: float = 0.9,
        w_weight_decay: float = 3e-4,
        grad_clip: float = 5.0,
        alpha_lr: float = 3e-4,
        alpha_betas: Sequence[float] = (0.5, 0.999),
        alpha_weight_decay: float = 1e-3,
        probe=None,
    ):
        super().__init__(network, probe)
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.grad_clip = grad_clip
        self.w_optimizer = torch.optim.SGD(
            network.weight_parameters(), lr=w_lr, momentum=w_momentum, weight_decay=w_weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.w_optimizer, epochs, eta_min=w_lr_min)
        self.alpha_optimizer = torch.optim.Adam(
            network.arch_parameters(), lr=alpha_lr, betas=tuple(alpha_betas), weight_decay=alpha_weight_decay
        )

    def mixing_weights(self) -> Dict[str, torch.Tensor]:
        return {t: w.detach() for t, w in self.network.softmax_weights().items()}

    def alpha_step(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        """One Adam step on α with the search-val loss (first-order: w held fixed)."""
        self.alpha_optimizer.zero_grad(set_to_none=True)
        with self.recording(y):
            logits = self.model(x)
            loss = nn.functional.cross_entropy(logits, y)
            loss.backward()
        grad_norm = torch.linalg.vector_norm(torch.stack([a.grad.norm() for a in self.network.arch_parameters()]))
        self.alpha_optimizer.step()
        return {"scalars/val_loss": loss.detach(), "scalars/val_acc": accuracy(logits.detach(), y), "scalars/alpha_grad_norm": grad_norm}

    def weight_step(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        """One SGD step on w with the search-train loss, α held fixed."""
        self.w_optimizer.zero_grad(set_to_none=True)
        weights = {t: z.detach() for t, z in self.network.softmax_weights().items()}
        logits = self.model(x, weights)
        loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
        nn.utils.clip_grad_norm_(self.network.weight_parameters(), self.grad_clip)
        self.w_optimizer.step()
        return {"scalars/train_loss": loss.detach(), "scalars/train_acc": accuracy(logits.detach(), y)}

    def step(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        stats = {"scalars/w_lr": torch.tensor(self.w_optimizer.param_groups[0]["lr"])}
        stats.update(self.alpha_step(*val_batch))
        stats.update(self.weight_step(*train_batch))
        stats.update(self.arch_statistics())
        return stats

    def epoch_end(self, epoch: int) -> None:
        self.scheduler.step()

    def state_dict(self) -> Dict:
        return {
            "network": self.network.state_dict(),
            "w_optimizer": self.w_optimizer.state_dict(),
            "alpha_optimizer": self.alpha_optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.network.load_state_dict(state["network"])
        self.w_optimizer.load_state_dict(state["w_optimizer"])
        self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
