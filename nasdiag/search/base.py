"""What every search method offers to the search loop, the CLI and the recorder."""

from __future__ import annotations

from typing import Dict, Mapping, Tuple

import torch
from torch import nn

from nasdiag.supernet import Genotype, Network, derive_genotype

Batch = Tuple[torch.Tensor, torch.Tensor]


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Fraction of correct top-1 predictions, a 0-dim tensor."""
    return (logits.argmax(dim=1) == targets).float().mean()


class SearchMethod:
    """A differentiable NAS method on a :class:`~nasdiag.supernet.Network`.

    A method owns its optimizers and turns one (search-train batch, search-val batch) pair into one
    update of the weights w and the architecture parameters. It returns its statistics as a mapping of
    record paths (``"scalars/..."``, ``"arch/<cell type>/..."``) to tensors; it never writes files.
    """

    name = "base"

    def __init__(self, network: Network):
        if not isinstance(network, Network):
            raise TypeError(f"{type(self).__name__} needs a nasdiag.supernet.Network, got {type(network).__name__}")
        self.network = network

    # -- to implement ------------------------------------------------------------------------
    def step(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def mixing_weights(self) -> Dict[str, torch.Tensor]:
        """Current mixing weights Z per cell type, (E, K) each, detached."""
        raise NotImplementedError

    def epoch_end(self, epoch: int) -> None:
        """Called after each epoch (learning-rate schedules)."""

    def state_dict(self) -> Dict:
        return {"network": self.network.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        self.network.load_state_dict(state["network"])

    # -- shared ------------------------------------------------------------------------------
    def genotype(self) -> Genotype:
        net = self.network
        return derive_genotype(self.mixing_weights(), net.steps, net.multiplier, net.primitives)

    def arch_statistics(self) -> Dict[str, torch.Tensor]:
        """``arch/<cell type>/params`` (the raw α) and ``arch/<cell type>/weights`` (Z), (E, K) each."""
        stats = {}
        for cell_type, alpha in self.network.alphas().items():
            stats[f"arch/{cell_type}/params"] = alpha.detach().clone()
        for cell_type, z in self.mixing_weights().items():
            stats[f"arch/{cell_type}/weights"] = z.detach().clone()
        return stats

    @torch.no_grad()
    def evaluate(self, loader) -> Dict[str, float]:
        """Mean loss and accuracy of the supernet (current mixing weights) over ``loader``.

        BatchNorm uses batch statistics, as during the search (DARTS evaluates the supernet this way).
        """
        net = self.network
        device = next(net.parameters()).device
        total, loss_sum, correct = 0, 0.0, 0.0
        weights = self.mixing_weights()
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = net(x, weights)
            loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            total += len(y)
        if total == 0:
            raise ValueError("evaluate() got an empty loader")
        return {"loss": loss_sum / total, "acc": correct / total}
