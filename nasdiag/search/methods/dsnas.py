"""DSNAS (Hu et al., CVPR 2020): one-hot architecture samples, only the sampled op of each edge
computed, trained single-level (w and α on the same training batch).

Per step and edge a one-hot Z ~ Cat(p), p = softmax(α) (α the logits of p; shared by the batch and by
the cells of a type). The forward computes only the sampled op (active-op mask; the other ops are
never called). Its backward gives ∂L/∂w and the cost C = ∂L/∂Z (wiring supplement §2), of which DSNAS
uses the sampled entry: the credit C(Z^s) = ⟨∂L/∂x_j, O_s(x_i)⟩ scales the score function,
∂L/∂α = (Z·C)(Z − p) (``nasdiag.cost.dsnas_alpha_grad``).

The cost statistics are observed only for the sampled ops, so ``cost/<cell>/count`` is the per-op
sample count times the cells of the type (each cell one observation per sample; ``sample/<cell>/count``
is the sample count itself) and ``cost/<cell>/mean`` is E[C | sampled], NaN for an op never sampled: the
DSNAS cost-mean protocol of the wiring supplement (Fig. 6b).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from nasdiag.cost import dsnas_alpha_grad
from nasdiag.search.base import Batch, failing_row
from nasdiag.search.methods._sampling import SampleCounts, argmax_onehot, host_masks, mean_entropy, sample_onehot, single_level_step
from nasdiag.search.methods.darts import DARTS
from nasdiag.search.registry import register


@register("dsnas")
class DSNAS(DARTS):
    """DSNAS: one-hot samples, only sampled ops computed, single-level.

    The optimizers of w (SGD, cosine schedule) and α (Adam) are DARTS's, with DARTS's default values
    (the seeds give no DSNAS-specific ones). :meth:`probabilities` is softmax(α). The supernet
    evaluation after each epoch runs the **most likely child**: the argmax op of each edge
    (:meth:`eval_weights`), since w is trained on one-hot children.

    Each :meth:`step` returns ``scalars/{train_loss,train_acc,w_lr,alpha_grad_norm,entropy}``,
    ``sample/<cell>/{onehot,count}`` (the step's sample; cumulative counts per edge × op) and
    ``arch/<cell>/{params,probabilities,weights}``.
    """

    single_level = True
    #: with ``--dataset digits`` (unless given): 4 epochs are only ~44 steps, too few for the DARTS
    #: values (α barely moves at lr 3e-4, so w is trained on ever-different random children and the
    #: argmax child reaches ~0.3 search-val accuracy); a fast α concentrates p, so the children w trains
    #: converge to the evaluated one (BENCHMARKS.md, "Search methods on digits").
    digits_preset = {"w_lr": 0.1, "alpha_lr": 0.3}

    @dataclass
    class Hyperparameters(DARTS.Hyperparameters):
        pass

    def build(self) -> None:
        super().build()
        #: cumulative samples per (edge, op): ``sample/<cell>/count``
        self.sample_counts = SampleCounts()

    def forward_weights(self) -> Dict[str, torch.Tensor]:
        """A fresh one-hot sample Z ~ Cat(softmax(α)) per cell type, (E, K), drawn with ``self.generator``; `SearchError`
        where p is NaN or inf (it was torch.multinomial's RuntimeError)."""
        probs = self.finite_architecture(self.probabilities(), "no child can be sampled from them")
        return {t: sample_onehot(p, self.generator) for t, p in probs.items()}

    def eval_weights(self) -> Dict[str, torch.Tensor]:
        """The most likely child: one-hot argmax of p per edge."""
        return argmax_onehot(self.probabilities())

    def step(self, train_batch: Batch, val_batch: Optional[Batch] = None) -> Dict[str, torch.Tensor]:
        """One single-level step on ``train_batch`` (``val_batch`` is not used)."""
        stats = {"scalars/w_lr": self.scalar_statistic(self.w_optimizer.param_groups[0]["lr"])}
        probs = self.probabilities()
        z = self.forward_weights()
        with failing_row(stats):
            stats.update(single_level_step(self, train_batch, z, host_masks(z),
                                           lambda t, cost: dsnas_alpha_grad(cost, z[t], probs[t])))
        self.sample_counts.update(z)
        stats.update(self.sample_counts.statistics(z))
        stats["scalars/entropy"] = mean_entropy(self.probabilities())
        stats.update(self.arch_statistics(z))
        return stats
