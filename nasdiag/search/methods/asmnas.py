"""ASM-NAS (architecture self-attention mechanism; asm-nas §4, Algorithm 1).

Every mixed op gets an architecture self-attention module (``nasdiag.supernet.attention``): the edge
outputs Σ_k a^k o^k(x) (eq 4.2) with a = softmax(σ(FC4(ReLU(FC3(ReLU(FC2(ReLU(FC1(E))))))))) of the
mean embeddings E of the candidate outputs (eq 4.3-4.5), per sample. The attention weights Θ are network
weights: (w, Θ) are trained single-level by momentum SGD on the training split (Algorithm 1, lines 3-5);
there are no architecture parameters (the supernet's α are left untouched and unused).

Selection (Algorithm 1, lines 6-12) is a forward pass over the whole validation split with (w, Θ)
frozen: for each cell and edge the per-sample argmax of a is counted. nasdiag does it at every
supernet evaluation (after each epoch; the last one is the final selection) and records the counts
summed over the cells of a type, ``attention/<cell>/count`` (E, K).

What nasdiag's contract cannot take from the paper as it stands, and what it does instead:

- The paper selects per cell (15 cells, 15 selected cells). nasdiag derives one normal and one
  reduction cell: counts are summed over the cells of a type.
- Algorithm 1 (lines 7-12) counts cell ℓ with cells 1..ℓ−1 already replaced by their selected ops; nasdiag counts
  every cell in one pass of the attention supernet (its cells of a type share one selection, so there is no
  per-cell replacement to make first).
- A sample counts for one op per edge: torch's argmax, so where several ops share the largest a (a sigmoid of
  eq 4.4 saturated at 1 in the run's dtype) the first of them in the primitive order; a sample whose a holds a NaN
  counts for none (argmax took the first NaN).
- The paper keeps the argmax op of every edge; nasdiag's genotype applies the DARTS rule (``none``
  excluded, the 2 strongest incoming edges per node) to the count-normalised selection frequencies,
  so the genotype is comparable to DARTS's (the paper's cells in its Appendix A have 2 inputs per node);
  an op never selected on its edge is never named (an edge that ``none`` won is no candidate input).
- :meth:`probabilities` = counts / counts.sum(-1) (selection frequencies) once a selection has run;
  before the first one, the batch-mean attention of the latest step (uniform 1/K before any step); under DDP
  the mean of the ranks' batch means (the global batch's), the same on every rank.
- The supernet evaluation after each epoch mixes by attention (data-dependent); ``eval_weights()``
  (fixed (E, K), used by the Hessian diagnostics) are the :meth:`probabilities`.

The cost of the attention coefficients, C = ∂L/∂a (wiring supplement §2: <∂L/∂x_j, o^k(x_i)> per
sample), comes out of the same backward as ∂L/∂(w, Θ) and feeds the streaming cost statistics
(``cost/<cell>/*``), per sample (E, B, K) summed to the batch cost as for other per-sample weights.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import nn

from nasdiag import vocabulary as V
from nasdiag.distributed import finite_on_every_rank
from nasdiag.search.base import (Batch, SearchError, SearchMethod, accuracy, buffers_kept, check_batch, mean_over_ranks,
                                 loss_text, nonfinite_loss_error)
from nasdiag.search.hyperparameters import Hyperparameters, hp
from nasdiag.search.registry import register
from nasdiag.supernet import derive_genotype
from nasdiag.supernet.attention import attach_attention, attention_weights, collect_attention


@register("asmnas")
class ASMNAS(SearchMethod):
    """ASM-NAS: attention modules on every edge, single-level SGD on (w, Θ), argmax-count selection.

    Each :meth:`step` (on the training batch; the validation batch is not used) returns
    ``scalars/{train_loss,train_acc,w_lr}``, ``attention/<cell>/mean`` (batch-mean a (E, K), mean over
    the cells of the type) and ``arch/<cell>/{probabilities,weights}`` (``weights`` = the batch-mean
    attention). After each epoch :meth:`epoch_statistics` gives ``attention/<cell>/count``.
    """

    single_level = True
    state_attributes = ("selection_counts", "attention_mean")

    # No digits preset: the paper's values reach search-val accuracy 0.84 / 0.95 / 0.95 / 0.96 after the 4 epochs
    # of the CLI default run (seed 0; BENCHMARKS.md "Search methods on digits").

    @dataclass
    class Hyperparameters(Hyperparameters):
        w_lr: float = hp(0.025, "Initial SGD learning rate of (w, Θ) (asm-nas §5.1).", low=0, low_open=True)
        w_lr_min: float = hp(0.0, "Final learning rate of the cosine schedule: 'annealed down to zero' (asm-nas §5.1).", low=0)
        w_momentum: float = hp(0.9, "SGD momentum (asm-nas §5.1).", low=0, high=1)
        w_weight_decay: float = hp(3e-4, "Weight decay of (w, Θ) (asm-nas §5.1).", low=0)
        grad_clip: float = hp(5.0, "Gradient-norm clip of (w, Θ) (DARTS code default; the paper names none).", low=0, low_open=True)
        attention_hidden: int = hp(16, "Width of each of the 3 hidden FC layers of eq 4.4 (not given in the paper; nasdiag: 2K for K = 8).", low=1,
                                   high=1024)  # 2·h² weights per edge: past 1024, gigabytes for scoring K = 8 ops

    def build(self) -> None:
        h = self.hp
        try:
            attach_attention(self.network, (h.attention_hidden,) * 3)
        except ValueError as exc:
            raise SearchError(f"asmnas: {exc}") from None
        if hasattr(self.network, "set_engine"):
            if getattr(self.network, "engine", None) == "fast":  # asked for by name (--engine fast): said, as set_engine
                from nasdiag.supernet.engine import EngineWarning  # promises where the fast engine cannot apply

                warnings.warn("engine 'fast': asmnas runs the eager modules, since attention mixing is per sample and "
                              "data-dependent, which the fast engine does not batch; pass engine auto or eager",
                              EngineWarning, stacklevel=3)
            self.network.set_engine("eager")  # attention mixing is per-sample and data-dependent: the batched engine does not apply
        self.w_optimizer = torch.optim.SGD(self.network.weight_parameters(), lr=h.w_lr, momentum=h.w_momentum,
                                           weight_decay=h.w_weight_decay)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.w_optimizer, self.schedule.epochs, eta_min=h.w_lr_min)
        E, K = self.network.num_edges, len(self.network.primitives)
        p = next(self.network.parameters())
        #: ``{cell type: (E, K) int64}`` argmax counts of the last selection, or None before the first
        self.selection_counts: Optional[Dict[str, torch.Tensor]] = None
        #: ``{cell type: (E, K)}`` batch-mean attention of the latest step (uniform before any)
        self.attention_mean: Dict[str, torch.Tensor] = {
            t: torch.full((E, K), 1.0 / K, dtype=p.dtype, device=p.device) for t in self.network.cell_types}

    # -- architecture distribution -------------------------------------------------------------------
    def probabilities(self) -> Dict[str, torch.Tensor]:
        """Selection frequencies counts/Σcounts per edge once a selection ran, else the latest batch-mean attention.
        NaN on an edge where no sample was counted (its attention NaN for every sample: a diverged supernet)."""
        if self.selection_counts is None:
            return {t: m.detach().clone() for t, m in self.attention_mean.items()}
        return {t: (c.double() / c.sum(-1, keepdim=True)).to(self.attention_mean[t].dtype)
                for t, c in self.selection_counts.items()}

    def genotype(self):
        """DARTS's rule on :meth:`probabilities`; once a selection ran, only ops selected at least once on their edge
        are named (``derive_genotype`` with ``eligible`` counts > 0). An edge where ``none`` won every sample is no
        candidate input; a node left with fewer than two candidates keeps ``("none", i)`` (no connection) in the other
        places, never an op the selection never chose."""
        net = self.network
        eligible = None if self.selection_counts is None else {t: c.cpu() > 0 for t, c in self.selection_counts.items()}
        return derive_genotype(self.finite_architecture(self.probabilities()), net.steps, net.multiplier, net.primitives,
                               eligible=eligible)

    def _per_type(self, per_cell: List[torch.Tensor]) -> Dict[str, List[torch.Tensor]]:
        out: Dict[str, List[torch.Tensor]] = {}
        for cell, value in zip(self.network.cells, per_cell):
            out.setdefault(cell.cell_type, []).append(value)
        return out

    # -- training (Algorithm 1, line 4) ---------------------------------------------------------------
    def attention_cost(self, x: torch.Tensor, y: torch.Tensor, *, train_weights: bool = True, observe: bool = True):
        """One attention forward/backward; returns (loss, logits, per-cell a (E, B, K), per-cell C = ∂L/∂a (E, B, K)).

        The loss is the batch-mean cross-entropy, so each sample's row of C carries the 1/B. With
        ``train_weights`` ∂L/∂(w, Θ) are accumulated into ``.grad`` (through ``self.model``, the DDP
        wrapper under DDP); otherwise only C is computed.
        """
        module = self.model if train_weights else self.network
        with collect_attention(self.network) as store, self._probe_recording(y):
            logits = module(x, attention_weights(self.network))
            loss = nn.functional.cross_entropy(logits, y)
            taps = [a for row in store for a in row]
            if any(a is None for a in taps):
                raise SearchError("asmnas: an edge did not mix by attention in this forward")
            if train_weights:
                loss.backward()
                grads = [a.grad for a in taps]
            else:
                grads = list(torch.autograd.grad(loss, taps))
        E = len(store[0])
        attn = [torch.stack([a.detach() for a in row]) for row in store]
        costs = [torch.stack([torch.zeros_like(a) if g is None else g for a, g in zip(row, grads[k * E:(k + 1) * E])])
                 for k, row in enumerate(store)]
        if observe:
            self._observe_costs(costs, None)
        return loss.detach(), logits.detach(), attn, costs

    def step(self, train_batch: Batch, val_batch: Optional[Batch] = None) -> Dict[str, torch.Tensor]:
        """One SGD step on (w, Θ) with the training loss (Algorithm 1, line 4); ``val_batch`` is not used."""
        x, y = train_batch
        stats = {"scalars/w_lr": self.scalar_statistic(self.w_optimizer.param_groups[0]["lr"])}
        self.w_optimizer.zero_grad(set_to_none=True)
        loss, logits, attn, _ = self.attention_cost(x, y)
        if not finite_on_every_rank(loss):  # under DDP: every rank stops at this step, before (w, Θ) are updated with it
            raise nonfinite_loss_error(f"asmnas: the training loss is {loss_text(loss)}; lower --hp w_lr or check the data",
                                       {**stats, "scalars/train_loss": loss})
        self._last_arch_batch = (x, y)  # the Hessian diagnostics' batch (single-level: the training batch)
        nn.utils.clip_grad_norm_(self.network.weight_parameters(), self.hp.grad_clip)
        self.w_optimizer.step()
        per_type = self._per_type(attn)
        # cells of the type, then batch; under DDP the rank mean (equal batches: the global batch's), so that the
        # architecture state, its records (rule 'same') and a checkpoint's (rank 0's) agree on every rank
        means = mean_over_ranks([torch.stack(rows).mean(dim=(0, 2)) for rows in per_type.values()])
        self.attention_mean.update(zip(per_type, means))
        stats.update({"scalars/train_loss": loss, "scalars/train_acc": accuracy(logits, y)})
        for t, m in self.attention_mean.items():
            stats[V.ATTENTION_MEAN.path(cell=t)] = m.clone()
            stats[V.ARCH_WEIGHTS.path(cell=t)] = m.clone()
        for t, p in self.probabilities().items():
            stats[V.ARCH_PROBABILITIES.path(cell=t)] = p
        return stats

    def epoch_end(self, epoch: int) -> None:
        self.step_schedules(self.scheduler)

    # -- selection (Algorithm 1, lines 6-12) -----------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, loader) -> Dict[str, float]:
        """The selection pass: mean loss and accuracy of the attention-mixed supernet over ``loader`` and,
        per cell type, the per-sample argmax counts of a (w, Θ frozen; forward only). The counts become
        :attr:`selection_counts` (and so :meth:`probabilities` and the genotype).

        BatchNorm uses batch statistics, as during the search, and its running statistics are left as they were (as
        ``SearchMethod.evaluate``).
        """
        net = self.network
        p = next(net.parameters())
        K = len(net.primitives)
        counts = {t: torch.zeros(net.num_edges, K, dtype=torch.int64, device=p.device) for t in net.cell_types}
        loss_sum = torch.zeros((), dtype=torch.float64, device=p.device)
        correct = torch.zeros((), dtype=torch.int64, device=p.device)
        unpredicted = torch.zeros((), dtype=torch.bool, device=p.device)
        total = 0
        with collect_attention(net) as store, buffers_kept(net):
            for x, y in loader:
                x, y = x.to(p.device, p.dtype), y.to(p.device)
                check_batch(net, (x, y), "evaluation")  # a label past the classifier was cross-entropy's IndexError
                logits = net(x, attention_weights(net))
                loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").double()
                correct += (logits.argmax(1) == y).sum()
                unpredicted |= torch.isnan(logits).any()  # no prediction: the accuracy is NaN (as `accuracy`'s)
                total += len(y)
                for cell, row in zip(net.cells, store):
                    a = torch.stack(row)  # (E, B, K)
                    # a sample whose a holds a NaN selects nothing (argmax took the first NaN: a diverged edge read
                    # as a unanimous selection of op 0)
                    picked = nn.functional.one_hot(a.argmax(-1), K) * ~torch.isnan(a).any(-1, keepdim=True)
                    counts[cell.cell_type] += picked.sum(1)
        if total == 0:
            raise SearchError("evaluate() got an empty loader")
        self.selection_counts = counts
        return {"loss": float(loss_sum) / total, "acc": math.nan if bool(unpredicted) else float(correct) / total}

    def epoch_statistics(self) -> Dict[str, torch.Tensor]:
        """``attention/<cell>/count`` of the last selection (empty before the first)."""
        if self.selection_counts is None:
            return {}
        return {V.ATTENTION_COUNT.path(cell=t): c.clone() for t, c in self.selection_counts.items()}
