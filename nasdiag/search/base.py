"""What every search method offers to the search loop, the CLI and the recorder."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Dict, Mapping, Optional, Tuple

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

    With a ``probe`` (``nasdiag.attach(network, ...)``) the architecture step runs inside
    ``probe.record()``, so the costs C = ∂L/∂Z of every architecture step are accumulated, and
    :meth:`diagnostics` hands out their statistics (and the mixing-weight Hessian diagonal when the
    probe was attached with ``hessian=``).
    """

    name = "base"

    def __init__(self, network: Network, probe=None):
        if not isinstance(network, Network):
            raise TypeError(f"{type(self).__name__} needs a nasdiag.supernet.Network, got {type(network).__name__}")
        if probe is not None and probe.model is not network:
            raise ValueError("the probe must be attached to the method's network: nasdiag.attach(network, ...)")
        self.network = network
        self.probe = probe
        #: what the training forwards call: the network, or its DistributedDataParallel wrapper
        self.model: nn.Module = network

    def distribute(self, device_ids=None) -> None:
        """Train data-parallel across the ranks of the initialised default process group.

        The training forwards then go through ``DistributedDataParallel``, which averages the gradients
        of w and α over the ranks at every backward (``find_unused_parameters``: the weight step uses
        detached mixing weights, so α takes no part in it). Each rank must see its own shard of the
        data (:func:`~nasdiag.search.run_search` shards by rank). The probe keeps observing the
        network's own modules, so every rank measures its own batch; the recorder's callback reduces
        those statistics across ranks before rank 0 writes them.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("distribute() needs torch.distributed.init_process_group() first (e.g. launch with torchrun)")
        self.model = nn.parallel.DistributedDataParallel(
            self.network, device_ids=device_ids, find_unused_parameters=True
        )

    def recording(self, targets: Optional[torch.Tensor] = None):
        """The probe's recording block for an architecture step, or a no-op context without a probe."""
        return self.probe.record(targets=targets) if self.probe is not None else nullcontext()

    def diagnostics(self) -> Dict[str, torch.Tensor]:
        """Probe statistics since the last call, as record paths, then reset them.

        ``cost/<cell type>/{mean,var,count}`` (E, K) over the architecture steps (each cell of a type is
        one observation per step); with ``hessian=`` on the probe, ``hessian/<cell type>/diag`` (E, K):
        the diagonal of ∂²L/∂Z² on the last recorded batch at the current parameters, summed over the
        cells that share the mixing weights (cross-cell terms dropped). Empty without a probe.
        """
        if self.probe is None or self.probe.steps_recorded == 0:
            return {}
        stats = dict(self.probe.statistics())
        self.probe.reset_statistics()
        if self.probe.hessian_mode is not None:
            per_group = self.probe.aggregate(self.probe.hessian())
            stats.update({f"hessian/{group}/diag": h.detach() for group, h in per_group.items()})
        return stats

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
