"""XNAS (Nayman et al., NeurIPS 2019): every edge is a forecaster over its candidate ops (Algorithm 1).

One :class:`~nasdiag.regret.Forecaster` per cell type, batched over its E edges. A step is Algorithm 1
with the mixing weights u = v / Σv (eq 1):

- line 4: an SGD step on w with the search-train loss at u;
- lines 5–8: the prediction at u on the search-val batch; the rewards are minus the costs,
  R = −C = −∂L_val/∂Z (``nasdiag.regret.xnas_reward``), computed once by :meth:`SearchMethod.cost`;
- lines 9–12: the EG step v ← v·exp(ηR) and the wipeout of every v < max v·exp(−2ηL(T − t)ζ).

**Rounds.** α is shared by the r_c cells of a type, and each cell's costs are a reward vector of its
own, so a step plays r_c rounds, one per cell in network order: T_c = |val| / batch × epochs × r_c
rounds in a run (the steps of the run × r_c), the horizon of the thresholds and of η*_c (eq 4;
§3.1 "Multiple Learning Rates" counts T_c = d × 𝓔 × r_c with d the validation set size, i.e. one round
per sample; we count one round per cell and step, the updates the forecaster actually makes, so the
wipeout thresholds reach their final value at the last step).

**L** is the gradient clip (§3.2.2): the bound on |R| that eq 3–4 and Lemma 1 assume. With
``clip_rewards`` (default) each reward is clipped to [−L, L], as clipping the gradient does, so the
guarantees hold for the sequence the forecaster sees (best expert never wiped out, regret ≤ bound).

No weight decay and no momentum on the architecture (§3.2.2): v changes only by the EG step.
Wiped-out experts are not computed in later forwards (:meth:`active_ops`).

**Regret.** Eq 2 measures the forecaster against the best of all N experts in hindsight, wiped-out ones
included; but a wiped-out op is not computed, so its later rewards are unknown (its cost is 0 only because
it contributes nothing). The forecasters are given NaN for them (unknown, never a fictitious 0), and
``regret/<cell>/regret`` is the regret against the experts still alive (eq 31 with min over I_t,
:attr:`Forecaster.survivor_regret`). With ζ ≥ 1 and |R| ≤ L it is eq 31 over all N exactly (Lemma 1: the best
expert in hindsight is alive); with ζ < 1 it is a lower bound of it (§3.2.2: ζ < 1 gives up the guarantee
on eq 2). Eq 3 (``regret/<cell>/bound``) bounds the recorded regret for every ζ: the proof's lower bound
(23) taken over I_t needs no Lemma 1.

**Non-finite costs.** A NaN/inf cost of an alive op (with a finite val loss) does not stop the search and
never reaches the weights: that edge's forecaster sits the round out (:meth:`Forecaster.update` with
``skip``: no EG step, nothing added to its regret; the round still counts towards T), the reward is
recorded as it came in ``regret/<cell>/rewards`` and the edge is flagged in ``regret/<cell>/nonfinite``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import torch
from torch import nn

from nasdiag import vocabulary as V
from nasdiag.distributed import finite_on_every_rank
from nasdiag.errors import ConfigError
from nasdiag.regret import Forecaster, xnas_reward
from nasdiag.search.base import Batch, CellWeights, SearchError, SearchMethod, accuracy, loss_text, nonfinite_loss_error
from nasdiag.search.hyperparameters import Hyperparameters, hp
from nasdiag.search.registry import register
from nasdiag.supernet import derive_genotype


class CellForecasters(dict):
    """``{cell type: Forecaster over (E,) edges}`` that saves and loads with the method's state."""

    def state_dict(self) -> Dict[str, dict]:
        return {t: f.state_dict() for t, f in self.items()}

    def load_state_dict(self, state: Mapping[str, dict]) -> None:
        if set(state) != set(self):
            raise SearchError(f"the saved forecasters are for cell types {sorted(state)}, this supernet has {sorted(self)}")
        for t, f in self.items():
            f.load_state_dict(state[t])
            if not f.alive.any(-1).all():
                raise SearchError(f"the saved {t} forecasters have an edge with every op wiped out; the state is corrupt")



@register("xnas")
class XNAS(SearchMethod):
    """XNAS: EG forecasters with wipeout on the architecture, SGD on w (Algorithm 1).

    :meth:`probabilities` (and the forward mixing weights) are the EG weights u; :meth:`active_ops` the
    experts not wiped out. Each :meth:`step` returns ``scalars/{train_loss,train_acc,val_loss,val_acc,
    w_lr,active_fraction,reward_clip_fraction}``, ``arch/<cell>/{probabilities,weights}`` and, per edge,
    ``regret/<cell>/{log_weights,alive,regret,bound,gamma,wipeouts,rewards,nonfinite}`` (see the vocabulary; the
    log-weight of a wiped-out expert is the one at its removal, not -inf).
    """

    #: Override on the embedded digits (`nasdiag search --dataset digits`); the paper's values stay the defaults.
    #: Digits costs are ~1e-2, far inside L = 5, so with L = 5 every wipeout waits for the last steps (the margin
    #: 2ηL(T − t) shrinks to 0 only at T): the last round leaves one op per edge and the supernet evaluated after
    #: epoch 4 is that child, untrained as such (search-val accuracy 0.865 / 0.954 / 0.967 / 0.312 after epochs
    #: 1-4). L = 0.01 (rewards clipped to it, so Lemma 1 and eq 3 still hold for what the forecasters see) moves
    #: the wipeouts into epoch 4 (active fraction 0.77 there): 0.882 / 0.951 / 0.968 / 0.705. A larger EG rate
    #: (η = 30 η*, §3.2.2 Remark 1: η* is the rate that minimises the bound, and eq 3 holds for any η) lets the
    #: weights concentrate early, so w trains mostly the ops that survive: 0.940 after epoch 4 (idle dev box,
    #: CLI, 4 epochs; lr_scale 10 gives 0.889). BENCHMARKS.md.
    digits_preset = {"reward_bound": 0.01, "lr_scale": 30.0}

    @dataclass
    class Hyperparameters(Hyperparameters):
        w_lr: float = hp(0.025, "Initial SGD learning rate of w (DARTS §A.1.1; XNAS searches with DARTS's w "
                                "training, §9.1).", low=0, low_open=True)
        w_lr_min: float = hp(0.001, "Final learning rate of w's cosine schedule (DARTS code default).", low=0)
        w_momentum: float = hp(0.9, "SGD momentum of w (DARTS §A.1.1).", low=0, high=1)
        w_weight_decay: float = hp(3e-4, "Weight decay of w (DARTS §A.1.1); none on the architecture (XNAS §3.2.2).",
                                   low=0)
        grad_clip: float = hp(5.0, "Gradient-norm clip of w and the reward bound L of eq 3-4 (XNAS §3.2.2 sets L "
                                   "to the gradient clip; 5 is the DARTS code default, §3.2.2's example uses 1).",
                              low=0, low_open=True)
        zeta: float = hp(1.0, "Wipeout relaxation ζ of the threshold (XNAS §3.2.2; 1 = Algorithm 1; ζ >= 1 keeps "
                              "Lemma 1's guarantee, larger wipes out later; smaller wipes out sooner and voids it).",
                         low=0, low_open=True, float64=True)
        lr_scale: float = hp(1.0, "η_c = lr_scale · η*_c of eq 4 (XNAS §3.2.2 Remark 1: η* is an upper bound that "
                                  "can be fine-tuned; 1 = the theoretical rate).", low=0, low_open=True, float64=True)
        reward_bound: Optional[float] = hp(None, "L of eq 3-4 if set; default (None) the gradient clip grad_clip "
                                                 "(XNAS §3.2.2).", low=0, low_open=True, float64=True)
        clip_rewards: bool = hp(True, "Clip each reward to [-L, L], the gradient clip that makes L a bound on |R| "
                                      "(eq 20; XNAS §3.2.2 'gradient clipping').")

    def build(self) -> None:
        h, net, schedule = self.hp, self.network, self.schedule
        self.w_optimizer = torch.optim.SGD(net.weight_parameters(), lr=h.w_lr, momentum=h.w_momentum,
                                           weight_decay=h.w_weight_decay)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.w_optimizer, schedule.epochs, eta_min=h.w_lr_min)
        if schedule.total_steps < 1:
            raise ConfigError(f"xnas needs the run's length for its horizon T (eq 4): got {schedule.epochs} epochs × "
                              f"{schedule.steps_per_epoch} steps per epoch")
        device = next(net.parameters()).device
        K = len(net.primitives)
        if K < 2:
            raise ConfigError(f"xnas needs at least 2 candidate ops per edge, the supernet has {K}")
        #: ``{cell type: r_c}``: cells sharing the forecasters of a type, one round each per step
        self.replications = {t: sum(c.cell_type == t for c in net.cells) for t in net.cell_types}
        self.forecasters = CellForecasters()
        #: L, the bound on |R| (eq 3-4, 20) that the thresholds and η* assume
        self.loss_bound = h.grad_clip if h.reward_bound is None else h.reward_bound
        for t, r in self.replications.items():
            horizon = schedule.total_steps * r
            lr = h.lr_scale * Forecaster.optimal_lr(horizon, self.loss_bound, K)
            self.forecasters[t] = Forecaster(K, lr, self.loss_bound, horizon, zeta=h.zeta, shape=(net.num_edges,),
                                             dtype=torch.float64, device=device)

    # -- the architecture -------------------------------------------------------------------------------
    def probabilities(self) -> CellWeights:
        """``{cell type: (E, K)}`` the EG mixing weights u = v / Σ v (eq 1), 0 for wiped-out experts."""
        dtype = next(self.network.parameters()).dtype
        return {t: f.weights.to(dtype) for t, f in self.forecasters.items()}

    def genotype(self):
        """The discretization stage (§2.1, DARTS's rule): per node the two edges with the strongest expert other than
        ``none``, each replaced by that expert; from the float64 EG weights u, and only experts still alive are named
        (``derive_genotype`` with ``eligible`` the alive experts). An edge whose only surviving expert is ``none`` is
        no candidate input; a node left with fewer than two candidates keeps ``("none", i)`` (no connection) in the
        other places, never an expert that was wiped out."""
        net = self.network
        u = self.finite_architecture({t: f.weights.detach().cpu() for t, f in self.forecasters.items()})
        alive = {t: f.alive.cpu() for t, f in self.forecasters.items()}
        return derive_genotype(u, net.steps, net.multiplier, net.primitives, eligible=alive)

    def active_ops(self) -> Optional[CellWeights]:
        """``{cell type: (E, K) bool}`` (CPU) the experts not wiped out: only these are computed. None while
        no expert has been wiped out (every op computed; the supernet's fast engine then applies)."""
        alive = {t: f.alive.cpu() for t, f in self.forecasters.items()}
        return None if all(a.all() for a in alive.values()) else alive

    def arch_statistics(self, forward_weights: Optional[CellWeights] = None) -> Dict[str, torch.Tensor]:
        # the network's α are not used by XNAS (its architecture parameters are ln v, recorded under regret/)
        return {k: v for k, v in super().arch_statistics(forward_weights).items() if not V.ARCH_PARAMS.regex.match(k)}

    # -- the step ---------------------------------------------------------------------------------------
    def weight_step(self, x: torch.Tensor, y: torch.Tensor, weights: CellWeights,
                    active: Optional[CellWeights]) -> Dict[str, torch.Tensor]:
        """Algorithm 1 line 4: one SGD step on w with the search-train loss at u, wiped-out ops not computed."""
        self.w_optimizer.zero_grad(set_to_none=True)
        logits = self.model(x, weights) if active is None else self.model(x, weights, active=active)
        loss = nn.functional.cross_entropy(logits, y)
        if not finite_on_every_rank(loss):  # under DDP: every rank stops at this step
            raise nonfinite_loss_error(f"the search-train loss is {loss_text(loss)} (xnas step {self.rounds_played + 1}): "
                                  "lower w_lr or check the data", {"scalars/train_loss": loss.detach()})
        if loss.requires_grad:  # every weight frozen (requires_grad=False): the experts learn on fixed weights, no w step
            loss.backward()
        nn.utils.clip_grad_norm_(self.network.weight_parameters(), self.hp.grad_clip)
        self.w_optimizer.step()
        return {"scalars/train_loss": loss.detach(), "scalars/train_acc": accuracy(logits.detach(), y)}

    @property
    def rounds_played(self) -> int:
        """Steps taken so far (each plays r_c rounds of the forecasters of cell type c)."""
        first = next(iter(self.forecasters.values()))
        return first.rounds // self.replications[next(iter(self.forecasters))]

    def rewards(self, per_cell) -> Dict[str, torch.Tensor]:
        """``{cell type: (r_c, E, K)}`` the rounds' rewards R = −C (Algorithm 1 line 8), one per cell in
        network order, before clipping; float64."""
        by_type: Dict[str, list] = {t: [] for t in self.forecasters}
        for cell, cost in zip(self.network.cells, per_cell):
            by_type[cell.cell_type].append(xnas_reward(cost.detach().to(torch.float64)))
        return {t: torch.stack(rows) for t, rows in by_type.items()}

    def step(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        if any(f.rounds + self.replications[t] > f.horizon for t, f in self.forecasters.items()):
            # before w moves: past the horizon the forecasters refuse their rounds (the thresholds depend on T − t)
            raise SearchError(f"xnas has taken all {self.schedule.total_steps} steps of its run ({self.schedule.epochs} epochs "
                              f"× {self.schedule.steps_per_epoch} steps): the wipeout thresholds and η* (eq 4) are fixed by "
                              "that horizon T; start a new run with the wanted --epochs")
        u, active = self.probabilities(), self.active_ops()
        stats: Dict[str, torch.Tensor] = {"scalars/w_lr": self.scalar_statistic(self.w_optimizer.param_groups[0]["lr"]),
                                          "scalars/active_fraction": self._active_fraction(active)}
        try:
            stats.update(self.weight_step(*train_batch, u, active))
        except SearchError as err:  # the failing row, with what the step knew, is recorded before the run stops
            err.statistics = {**stats, **getattr(err, "statistics", {})}
            raise
        x, y = val_batch
        result = self.cost(x, y, u, active=active)
        stats.update({"scalars/val_loss": result.loss, "scalars/val_acc": accuracy(result.logits, y)})
        if not finite_on_every_rank(result.loss):
            raise nonfinite_loss_error(f"the search-val loss is {loss_text(result.loss)} (xnas step {self.rounds_played + 1}): "
                                  "the rewards would corrupt the forecasters; lower w_lr or check the data", stats)
        L = self.loss_bound
        clipped, counted = 0, 0
        for t, rewards in self.rewards(result.per_cell).items():
            f = self.forecasters[t]
            alive = f.alive
            finite = torch.isfinite(rewards)
            clipped += int(((rewards.abs() > L) & finite)[:, alive].sum())
            counted += int(finite[:, alive].sum())  # the finite rewards of alive experts (a NaN one is flagged, not clipped)
            if self.hp.clip_rewards:
                # only finite rewards: clamp keeps NaN but makes ±inf ±L, a finite reward the forecaster would play
                # (an infinite cost must sit its round out and be flagged, as a NaN does)
                rewards = torch.where(finite, rewards.clamp(-L, L), rewards)
            # ops not computed in this step's forward (wiped out before it): reward unknown, not 0
            observed = rewards if active is None else rewards.masked_fill(~active[t].to(rewards.device), math.nan)
            wiped, nonfinite = torch.zeros_like(alive), torch.zeros_like(alive[:, 0])
            for round_rewards in observed:  # one round per cell of the type
                skip = f.skip_nonfinite(round_rewards)  # such an edge sits the round out, flagged
                nonfinite |= skip
                wiped |= f.update(round_rewards, skip=skip)
            if not f.alive.any(-1).all():  # Lemma 1 makes this impossible; refuse rather than divide by zero
                raise SearchError(f"every op of a {t} edge was wiped out at xnas step {self.rounds_played}")
            stats.update(self._regret_statistics(t, f, wiped, rewards))
            stats[V.REGRET_NONFINITE.path(cell=t)] = nonfinite
        # no finite reward of an alive expert (every edge flagged nonfinite): 0/0 is NaN, not the 0 of "nothing clipped"
        stats["scalars/reward_clip_fraction"] = torch.tensor(clipped / counted if counted else math.nan, dtype=torch.float64)
        stats.update(self.arch_statistics(u))
        return stats

    def _regret_statistics(self, cell_type: str, f: Forecaster, wiped: torch.Tensor, rewards: torch.Tensor):
        return {
            V.REGRET_LOG_WEIGHTS.path(cell=cell_type): self._recorded_log_weights(f),
            V.REGRET_ALIVE.path(cell=cell_type): f.alive,
            V.REGRET_REGRET.path(cell=cell_type): f.survivor_regret,
            V.REGRET_BOUND.path(cell=cell_type): f.bound(),
            V.REGRET_GAMMA.path(cell=cell_type): f.gamma,
            V.REGRET_WIPEOUTS.path(cell=cell_type): wiped,
            V.REGRET_REWARDS.path(cell=cell_type): rewards.clone(),
        }

    @staticmethod
    def _recorded_log_weights(f: Forecaster) -> torch.Tensor:
        """(E, K) ln v, where a wiped-out expert keeps the ln v at which it was removed (finite, so records
        carry no -inf; ``regret/<cell>/alive`` tells the removed ones apart)."""
        log_v = f.log_weights
        removed = f.wipeout_log
        if len(removed):
            log_v[removed.forecaster[:, 0], removed.expert] = removed.log_weight
        return log_v

    def _active_fraction(self, active: Optional[CellWeights]) -> torch.Tensor:
        """Fraction of the supernet's (cell, edge, op) computations this step's forwards make."""
        if active is None:
            return torch.tensor(1.0, dtype=torch.float64)
        on = sum(int(active[t].sum()) * r for t, r in self.replications.items())
        total = sum(active[t].numel() * r for t, r in self.replications.items())
        return torch.tensor(on / total, dtype=torch.float64)

    def epoch_end(self, epoch: int) -> None:
        self.step_schedules(self.scheduler)

    def extend_schedule(self, epochs: int) -> None:
        raise SearchError("xnas cannot extend a run: the wipeout thresholds and η* (eq 4) are fixed by the horizon "
                          "T; start a new run with the wanted --epochs")
