"""What the sampling methods (SNAS, DSNAS, ProxylessNAS) share: drawing samples from p = softmax(α),
counting them, and the single-level step in which one backward gives both ∂L/∂w and C = ∂L/∂Z.

All samples are drawn with the method's ``self.generator`` (saved with its state, so resume is exact),
one sample per edge and step, shared by the batch and by the cells of a type (α is shared by them too;
the cost of the shared sample is then the sum of the cells' costs, wiring supplement §2.1).
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from nasdiag import vocabulary as V
from nasdiag.distributed import finite_on_every_rank
from nasdiag.search.base import Batch, CostStep, SearchMethod, accuracy, loss_text, nonfinite_loss_error

CellWeights = Dict[str, torch.Tensor]


def gumbel_noise(shape, generator: torch.Generator, dtype: torch.dtype, device) -> torch.Tensor:
    """Standard Gumbel noise G = −log(−log U), U ~ U(0, 1), clamped away from U = 0."""
    u = torch.rand(shape, generator=generator, dtype=dtype, device=device)
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(dtype).tiny)))


def sample_onehot(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(E, K) one-hot rows Z ~ Cat(p) for probs (E, K), in the dtype of ``probs``."""
    idx = torch.multinomial(probs, 1, generator=generator)
    return torch.zeros_like(probs).scatter_(-1, idx, 1.0)


def sample_two_paths(probs: torch.Tensor, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """ProxylessNAS two-path sampling for probs (E, K): two distinct paths per edge drawn from p
    without replacement, then one of them gated on with the probabilities renormalised over the pair.

    Returns:
        (pair, gates): pair (E, K) bool, the two sampled paths; gates (E, K) one-hot (dtype of probs),
        the binary gate, inside the pair.
    """
    pair_idx = torch.multinomial(probs, 2, replacement=False, generator=generator)  # (E, 2)
    pair_probs = probs.gather(-1, pair_idx)
    pick = torch.multinomial(pair_probs, 1, generator=generator)  # (E, 1) in {0, 1}
    pair = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, pair_idx, True)
    gates = torch.zeros_like(probs).scatter_(-1, pair_idx.gather(-1, pick), 1.0)
    return pair, gates


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy −Σ_k p_k log p_k (nats) over the last dim; 0·log 0 = 0."""
    return -torch.special.xlogy(probs, probs).sum(-1)


def mean_entropy(probs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """0-dim mean entropy of p over every edge of every cell type (``scalars/entropy``)."""
    return torch.cat([entropy(p).reshape(-1) for p in probs.values()]).mean()


def host_masks(masks: Mapping[str, torch.Tensor]) -> CellWeights:
    """Active-op masks on the host (one device sync per step: which ops run is a host decision)."""
    return {t: m.detach().bool().cpu() for t, m in masks.items()}


class SampleCounts:
    """Cumulative number of samples per (edge, op) and cell type (``sample/<cell>/count``), a stateful
    object so the method's automatic ``state_dict`` saves it."""

    def __init__(self):
        self.counts: Dict[str, torch.Tensor] = {}

    def update(self, onehot: Mapping[str, torch.Tensor]) -> None:
        for t, z in onehot.items():
            add = z.detach().round().to(torch.int64)
            # counts restored from a checkpoint are on the CPU (it is loaded there); the samples are where the net is
            self.counts[t] = self.counts[t].to(add.device) + add if t in self.counts else add

    def statistics(self, onehot: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``sample/<cell>/onehot`` of this step and ``sample/<cell>/count`` so far."""
        stats = {}
        for t, z in onehot.items():
            stats[V.SAMPLE_ONEHOT.path(cell=t)] = z.detach().clone()
            stats[V.SAMPLE_COUNT.path(cell=t)] = self.counts[t].clone()
        return stats

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {t: c.clone() for t, c in self.counts.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.counts = {t: c.clone() for t, c in state.items()}


def check_finite_loss(method: SearchMethod, result: CostStep, stats: Dict[str, torch.Tensor], what: str = "training") -> None:
    """Raise `SearchError` before any update with it if the ``what`` loss is NaN/inf (one host read of a 0-dim tensor).

    The error carries the step's statistics (``err.statistics``, with ``scalars/nonfinite_loss`` = 1)
    so the run can record the NaN row, flagged, before it stops; the method's state is that of the
    last finite step.
    """
    if finite_on_every_rank(result.loss):  # under DDP every rank stops at the same step, so the row is recorded
        return
    raise nonfinite_loss_error(f"{method.name}: the {what} loss is {loss_text(result.loss)} (not finite); the search stops "
                               "before updating w or α with it. Lower the learning rates or check the data for NaN/inf", stats)


def single_level_step(method: SearchMethod, batch: Batch, weights: CellWeights, active: Optional[CellWeights],
                      alpha_grad: Callable[[str, torch.Tensor], torch.Tensor]) -> Dict[str, torch.Tensor]:
    """One single-level step (SNAS, DSNAS): w and α updated on the same training batch, from ONE
    forward/backward at the mixing weights ``weights`` (only ``active`` ops computed).

    That backward accumulates ∂L/∂w into the weights' ``.grad`` and gives C = ∂L/∂Z
    (:meth:`SearchMethod.cost` with ``train_weights=True``); α.grad = ``alpha_grad(cell type, C)``
    with C summed over the cells of the type. Then w is clipped to ``hp.grad_clip`` and both
    optimizers step. Expects ``method.w_optimizer``, ``method.alpha_optimizer`` and ``hp.grad_clip``.

    Returns:
        ``scalars/train_loss``, ``scalars/train_acc`` (batch means), ``scalars/alpha_grad_norm``.
    """
    x, y = batch
    method.w_optimizer.zero_grad(set_to_none=True)
    result = method.cost(x, y, weights, active=active, train_weights=True)
    stats = {"scalars/train_loss": result.loss, "scalars/train_acc": accuracy(result.logits, y)}
    check_finite_loss(method, result, stats)
    for cell_type, alpha in method.network.alphas().items():
        alpha.grad = alpha_grad(cell_type, result.costs[cell_type]).to(alpha.dtype)
    stats["scalars/alpha_grad_norm"] = torch.linalg.vector_norm(
        torch.stack([a.grad.norm() for a in method.network.arch_parameters()]))
    nn.utils.clip_grad_norm_(method.network.weight_parameters(), method.hp.grad_clip)
    method.alpha_optimizer.step()
    method.w_optimizer.step()
    return stats


def argmax_onehot(probs: Mapping[str, torch.Tensor]) -> CellWeights:
    """The most likely child: one-hot argmax of p per edge, ``{cell type: (E, K)}``."""
    return {t: torch.zeros_like(p).scatter_(-1, p.argmax(-1, keepdim=True), 1.0) for t, p in probs.items()}
