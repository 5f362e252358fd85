"""ProxylessNAS (Cai et al., ICLR 2019), gradient mode with binary gates (BinaryConnect), on the
DARTS supernet: bi-level, only sampled paths computed.

- **w step** (search-train batch): one path per edge sampled from p = softmax(α) and gated on; only it is
  computed (the binarised forward of ProxylessNAS).
- **α step** (search-val batch), the two-path update: per edge two distinct paths S = {a, b} are
  sampled from p without replacement; one of them is gated on (g one-hot, drawn with p renormalised over
  S) and **both** are computed (the gated-off one contributes 0·O(x) and gives its cost). With the
  cost C = ∂L/∂g of that forward (wiring supplement §2), the BinaryConnect gradient (§2.2; ProxylessNAS
  eq 4 restricted to the candidates S, as its two-path mode does) is

      ∂L/∂α_i = Σ_{j∈S} C_j p'_j (δ_ij − p'_i)  for i ∈ S,  0 otherwise,   p'_i = exp α_i / Σ_{m∈S} exp α_m,

  i.e. ``nasdiag.cost.proxyless_alpha_grad(C·1_S, p')`` with p' zero outside S. After the Adam step
  the two updated α are shifted by log(Σ_S exp α_new / Σ_S exp α_old), so that the probabilities of
  the unsampled paths are unchanged (ProxylessNAS's rescaling of the two updated parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from nasdiag import vocabulary as V
from nasdiag.cost import proxyless_alpha_grad
from nasdiag.search.base import Batch, SearchError, accuracy, failing_row
from nasdiag.search.hyperparameters import hp
from nasdiag.search.methods._sampling import (SampleCounts, argmax_onehot, check_finite_loss, host_masks, mean_entropy,
                                              sample_onehot, sample_two_paths)
from nasdiag.search.methods.darts import DARTS
from nasdiag.search.registry import register


def pair_probabilities(alpha: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """p' = softmax of α over the sampled pair of each edge, 0 outside it; (E, K) for α (E, K), pair (E, K) bool."""
    return torch.softmax(alpha.masked_fill(~pair, float("-inf")), dim=-1)


@register("proxyless")
class ProxylessNAS(DARTS):
    """ProxylessNAS with two-path binary gates (see the module docstring).

    w: DARTS's SGD and cosine schedule and values (the supernet is DARTS's). α: Adam with
    ProxylessNAS's values; β1 = 0 and no weight decay keep α of unsampled paths fixed (their gradient
    is 0). :meth:`probabilities` is softmax(α); the supernet evaluation runs the most likely child
    (argmax op per edge, :meth:`eval_weights`).

    Each :meth:`step` returns ``scalars/{train_loss,train_acc,val_loss,val_acc,w_lr,alpha_grad_norm,
    entropy}``, ``sample/<cell>/onehot`` (the α step's binary gates), ``sample/<cell>/count``
    (cumulative gates), ``sample/<cell>/paths`` (the α step's two sampled paths) and
    ``arch/<cell>/{params,probabilities,weights}`` (``weights``: the binary gates).
    """

    #: with ``--dataset digits`` (unless given): 4 epochs are only ~44 steps; at ProxylessNAS's α rate
    #: (1e-3, and only the two sampled entries of an edge move per step) p stays near uniform, so w is
    #: trained on ever-different random paths and the argmax child stays below 0.6 search-val accuracy;
    #: a fast α concentrates p (BENCHMARKS.md, "Search methods on digits").
    digits_preset = {"w_lr": 0.1, "alpha_lr": 0.6}

    @dataclass
    class Hyperparameters(DARTS.Hyperparameters):
        alpha_lr: float = hp(1e-3, "Adam learning rate of α (ProxylessNAS code default).", low=0, low_open=True)
        alpha_betas: Tuple[float, float] = hp((0.0, 0.999), "Adam betas of α (ProxylessNAS code default; β1 = 0 "
                                                            "leaves unsampled paths unmoved).", low=0, high=1, high_open=True)
        alpha_weight_decay: float = hp(0.0, "Weight decay of α (ProxylessNAS code default).", low=0)

    def build(self) -> None:
        K = len(self.network.primitives)
        if K < 2:  # the α step's two paths: with one op the first step ran the w step, then stopped in torch.multinomial
            raise SearchError(f"proxyless samples two paths per edge for its α step: the supernet needs at least 2 "
                              f"candidate ops, it has {K} ({', '.join(self.network.primitives)})")
        super().build()
        #: cumulative binary gates of the α steps: ``sample/<cell>/count``
        self.sample_counts = SampleCounts()

    def forward_weights(self) -> Dict[str, torch.Tensor]:
        """Binary gates of one path per edge, sampled from p with ``self.generator`` (the w step's forward); `SearchError`
        where p is NaN or inf (it was torch.multinomial's RuntimeError)."""
        probs = self.finite_architecture(self.probabilities(), "no path can be sampled from them")
        return {t: sample_onehot(p, self.generator) for t, p in probs.items()}

    def eval_weights(self) -> Dict[str, torch.Tensor]:
        """The most likely child: one-hot argmax of p per edge."""
        return argmax_onehot(self.probabilities())

    def weight_step(self, x: torch.Tensor, y: torch.Tensor, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """One SGD step on w at binary gates ``weights``, only the gated paths computed."""
        self.w_optimizer.zero_grad(set_to_none=True)
        result = self.cost(x, y, weights, active=host_masks(weights), train_weights=True, observe=False)
        stats = {"scalars/train_loss": result.loss, "scalars/train_acc": accuracy(result.logits, y)}
        check_finite_loss(self, result, stats)
        torch.nn.utils.clip_grad_norm_(self.network.weight_parameters(), self.hp.grad_clip)
        self.w_optimizer.step()
        return stats

    def alpha_step(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The two-path α update on (x, y) (module docstring), then the rescaling of the two updated α.

        Returns the val loss/accuracy, the gates' sample statistics, the entropy of p and the arch
        statistics after the update (``arch/<cell>/weights``: the binary gates).
        """
        pairs, gates = {}, {}
        for t, p in self.finite_architecture(self.probabilities(), "no path can be sampled from them").items():
            pairs[t], gates[t] = sample_two_paths(p, self.generator)
        result = self.cost(x, y, gates, active=host_masks(pairs))
        stats = {"scalars/val_loss": result.loss, "scalars/val_acc": accuracy(result.logits, y)}
        check_finite_loss(self, result, stats, "search-val")
        alphas = self.network.alphas()
        old = {}
        for t, alpha in alphas.items():
            old[t] = alpha.detach().clone()
            p_pair = pair_probabilities(old[t], pairs[t])
            alpha.grad = proxyless_alpha_grad(result.costs[t] * pairs[t], p_pair).to(alpha.dtype)
        stats["scalars/alpha_grad_norm"] = torch.linalg.vector_norm(
            torch.stack([a.grad.norm() for a in self.network.arch_parameters()]))
        self.alpha_optimizer.step()
        with torch.no_grad():
            for t, alpha in alphas.items():
                shift = (torch.logsumexp(alpha.masked_fill(~pairs[t], float("-inf")), -1, keepdim=True)
                         - torch.logsumexp(old[t].masked_fill(~pairs[t], float("-inf")), -1, keepdim=True))
                alpha.sub_(shift * pairs[t])
        self.sample_counts.update(gates)
        stats.update(self.sample_counts.statistics(gates))
        for t, pair in pairs.items():
            stats[V.SAMPLE_PATHS.path(cell=t)] = pair.to(gates[t].dtype)
        stats["scalars/entropy"] = mean_entropy(self.probabilities())
        stats.update(self.arch_statistics(gates))
        return stats

    def step(self, train_batch: Batch, val_batch: Optional[Batch] = None) -> Dict[str, torch.Tensor]:
        """A w step on ``train_batch`` (one path per edge), then the two-path α step on ``val_batch``."""
        stats = {"scalars/w_lr": self.scalar_statistic(self.w_optimizer.param_groups[0]["lr"])}
        with failing_row(stats):
            stats.update(self.weight_step(*train_batch, self.forward_weights()))
            stats.update(self.alpha_step(*val_batch))
        return stats
