"""BayesNAS (Zhou et al., ICML 2019), Algorithm 2 of the appendix on nasdiag's supernet.

The architecture parameters w are the linear mixing weights of the ops (Z = w on alive ops, 0 on pruned
ones; no softmax), one (E, K) tensor per cell type shared by the cells of the type. Each op has a
hierarchical sparse prior w ~ N(0, s) whose switch s depends on the edges entering its source node
(A.2.14). A step is Algorithm 2:

1. the regularised maximum likelihood A.3.1 on the search-train batch: one SGD step on the network weights
   𝒲 (weight decay λ) and on w, whose gradient is ∂L/∂Z (``SearchMethod.cost``, single level: one backward
   for both) plus the reweighted-ℓ1 penalty λ_w·ω·√ℵ·sign(w) (groups below);
2. every ``update_every`` steps (default: the last step of each epoch, one iteration t of Algorithm 2 per
   epoch): the diagonal mixing-weight curvature at the current w on the same batch,
   ``nasdiag.hessian.arch_diag_hessian`` in ``hessian_mode`` (C.3), per cell, of the energy E_D/λ_w
   (:meth:`energy_curvature`: the batch's *summed* loss over λ_w, see "Scale" below);
3. C (A.3.2), ω (A.3.9), s (A.3.8) and γ (A.2.14), ``nasdiag.bayes.group_bayes_update``;
4. entropy pruning: an op whose ½ ln(2πe γ) ≤ 0 is switched off for good and no longer computed
   (:meth:`active_ops`); an edge may lose every op (it is removed; through A.2.14 a node whose input edges
   are all removed then loses its output edges at the next update);
5. pruned ops' w are set to 0; with ``reset_w`` the surviving ops' w restart at 1 ("fix w = 1", read literally
   per iteration; off by default, see docs/bayesnas.md).

**Groups (A.3.6–A.3.11).** The paper keeps one w per cell and ties the switches of the ℵ cells of a kind.
nasdiag's supernet shares one w per cell type, so a group is the ℵ copies of that shared w (equal
elements), each with the curvature of its own cell (the per-edge numbers of ``nasdiag.hessian``, no
cross-cell terms): C_i per cell (A.3.2), ω = √(Σ_i ω_i²) (A.3.9), s = ‖w_group‖₂/ω = √ℵ|w|/ω (A.3.8),
and the step-1 penalty λ_w ω ‖w_group‖₂ = λ_w ω √ℵ |w| (A.3.1). For ℵ = 1 these are A.2.8 and A.2.13.
``bayes/<cell>/covariance`` records the mean of the C_i, ``bayes/<cell>/curvature`` the sum of the H_i.

**Scale of the curvature.** The closed forms of §A.1–A.2 (A.1.2, A.2.12) weigh the ℓ1 term ‖ω w‖₁ by 1,
A.3.1 by λ_w: min E_D + λ_w Σ ω|w| is min E_D/λ_w + Σ ω|w|, so C, ω and s are those of the energy
E_D/λ_w and H = ∇∇E_D/λ_w. E_D is the negative log-likelihood of the data (Proposition 2:
p(Y | w, X) ∝ exp(−E_D)), a *sum* over samples; one update sees one batch, so H is the curvature of the
batch's summed cross-entropy, B·∇∇(mean loss) with B the global batch (all DDP ranks). The batch-mean
curvature alone (as before) was ≈ 1e-4 on digits: C ≈ γ, ω ≈ √H, s = |w|/√H grew every update and
nothing was ever pruned (docs/bayesnas.md).

**Curvature mode.** The update needs only the mixing-weight curvature (C.3); the weight curvature of
C.1–C.2 enters BayesNAS only through §B (compression: ``nasdiag.bayes.structured``,
``scripts/bayes_compression.py``). Entries where H is
not finite or not positive leave that op's ω, s and C unchanged (a Laplace approximation needs H > 0; a
NaN is flagged in ``hessian/<cell>/nonfinite``, the curvature itself is recorded as it came). The default
``ggn`` (the generalized Gauss-Newton diagonal, exact over the classes) is positive semidefinite and tells
the ops of an edge apart; ``approx`` (C.3.2, the paper's feature-mean recursion) gives nearly the same
value to every op of an edge and, on nasdiag's supernet, sometimes a negative one (docs/hessian.md,
docs/bayesnas.md).

The genotype is the surviving mixed path: every op still switched on (``derive_mixed_genotype``); a node
without a surviving incoming op (or fed only by such nodes) is dropped from the cell's output concatenation, with
the ops leaving it (``sparsenas.without_removed_nodes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import nn

from nasdiag import vocabulary as V
from nasdiag.distributed import world_size
from nasdiag.bayes import dependent_gamma, group_bayes_update, parent_matrix, prune
from nasdiag.hessian import ARCH_MODES, CurvatureError
from nasdiag.search.base import Batch, CellWeights, SearchError, SearchMethod, accuracy, failing_row, mean_over_ranks
from nasdiag.search.hyperparameters import Hyperparameters, hp
from nasdiag.search.methods._sampling import check_finite_loss
from nasdiag.search.registry import register
from nasdiag.search.methods.sparsenas import without_removed_nodes
from nasdiag.supernet import DARTS_PRIMITIVES, Network, derive_mixed_genotype
from nasdiag.supernet.cell import edge_nodes


class _AtFixedWeights(nn.Module):
    """The supernet at fixed mixing weights: ``forward(x) = net(x, weights)``, as the curvature engine expects."""

    def __init__(self, net, weights: CellWeights):
        super().__init__()
        self.net = net
        self.weights = weights

    def forward(self, inp):
        return self.net(inp, self.weights)


@register("bayesnas")
class BayesNAS(SearchMethod):
    """BayesNAS: reweighted-ℓ1 training of the mixing weights, sparse-Bayesian switches, entropy pruning.

    Each :meth:`step` returns ``scalars/{train_loss,train_acc,w_lr}``, ``arch/<cell>/{params,probabilities,weights}``
    (``params`` and ``probabilities`` after the step, ``weights`` the Z its likelihood forward used) and, every step
    (the values of the last update), ``bayes/<cell>/{gamma,omega,prior_variance,covariance,curvature,switch}`` and
    ``bayes/updated``; on update steps also ``hessian/<cell>/nonfinite``.
    """

    single_level = True
    #: §D.1 lists seven ops: DARTS's without the zero op
    primitives = tuple(p for p in DARTS_PRIMITIVES if p != "none")
    state_attributes = ("gamma", "omega", "prior_variance", "covariance", "curvature_used", "alive", "steps_done")

    @dataclass
    class Hyperparameters(Hyperparameters):
        w_lr: float = hp(0.1, "Initial momentum-SGD learning rate of the network weights and of w (appendix §D.1).",
                         low=0, low_open=True)
        w_lr_min: float = hp(0.0, "Final learning rate of the cosine schedule (the paper gives none; DARTS-style cosine).", low=0)
        w_momentum: float = hp(0.9, "SGD momentum (appendix §D.1).", low=0, high=1)
        w_weight_decay: float = hp(1e-4, "Weight decay λ of the network weights, the λ‖𝒲‖² of A.3.1 (appendix §D.1).", low=0)
        grad_clip: float = hp(5.0, "Gradient-norm clip of the network weights (DARTS code default; the paper gives none).",
                              low=0, low_open=True)
        lambda_w: float = hp(0.007, "Sparsity intensity λ_w of the reweighted ℓ1 term of A.3.1 (Figs. S6-S7: 0.007); "
                             "the update's energy is E_D/λ_w, so λ_w > 0.", low=0, low_open=True)
        update_every: int = hp(0, "Steps between updates of γ, ω, C, s and pruning (Algorithm 2, steps 2-4); "
                               "0 = once per epoch, at its last step (the paper's iteration t spans epochs).", low=0,
                               steps=True)
        hessian_mode: str = hp("ggn", "Mixing-weight curvature mode of nasdiag.hessian for H (C.3; the paper's recursion "
                               "C.3.2 is 'approx'; 'ggn' is positive semidefinite and tells the ops apart, docs/bayesnas.md).",
                               choices=ARCH_MODES)
        init_gamma: float = hp(1.0, "γ(0) of every op (Algorithm 2, initialisation: 1).", low=0, low_open=True)
        reset_w: bool = hp(False, "After an update, surviving w restart at 1 (a literal per-iteration reading of Algorithm 2 "
                                  "step 5, 'fix w = 1'; off by default: step 5 is read as training the final pruned net, and "
                                  "the reset undoes each epoch's training: digits search-val 0.70 vs 0.94, docs/bayesnas.md).")

    def build(self) -> None:
        h = self.hp
        net = self.network
        with torch.no_grad():
            for a in net.arch_parameters():
                a.fill_(1.0)  # Algorithm 2: w(0) = 1
        self.w_optimizer = torch.optim.SGD(net.weight_parameters(), lr=h.w_lr, momentum=h.w_momentum,
                                           weight_decay=h.w_weight_decay)
        self.arch_optimizer = torch.optim.SGD(net.arch_parameters(), lr=h.w_lr, momentum=h.w_momentum)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.w_optimizer, self.schedule.epochs, eta_min=h.w_lr_min)
        self.arch_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.arch_optimizer, self.schedule.epochs,
                                                                         eta_min=h.w_lr_min)
        alphas = net.alphas()
        like = lambda value: {t: torch.full_like(a.detach(), value) for t, a in alphas.items()}  # noqa: E731
        self.gamma = like(h.init_gamma)
        self.omega = like(1.0)  # Algorithm 2: ω(0) = 1
        self.prior_variance = like(h.init_gamma)
        self.covariance = like(h.init_gamma)
        self.curvature_used = like(0.0)
        self.alive = {t: torch.ones_like(a, dtype=torch.bool, device="cpu") for t, a in alphas.items()}
        self.steps_done = 0
        # an adapted DARTS-convention supernet has no edge_nodes (an AttributeError): its edges are in the DARTS order
        pairs = getattr(net, "edge_nodes", None) or edge_nodes(net.steps)
        self._parents = parent_matrix(pairs, device=next(iter(alphas.values())).device)
        self._group_size = {t: sum(1 for c in net.cells if c.cell_type == t) for t in alphas}  # ℵ of A.3.6
        #: whether this process has seen the curvature mode run on the supernet's mixed ops (not saved: checked again
        #: after a resume)
        self._curvature_checked = isinstance(net, Network)

    # -- relaxation ----------------------------------------------------------------------------------
    def forward_weights(self) -> CellWeights:
        """Z = w on alive ops, 0 on pruned ones (E, K): the linear mixing of the BayesNAS supernet."""
        # selected, not multiplied: a pruned op's Z is exactly 0 whatever its w holds
        return {t: torch.where(self.alive[t].to(a.device), a.detach(), torch.zeros_like(a.detach()))
                for t, a in self.network.alphas().items()}

    def eval_weights(self) -> CellWeights:
        return self.forward_weights()

    def active_ops(self) -> Optional[CellWeights]:
        """The ops to compute: those still switched on, or None while nothing is pruned (the supernet's fast engine
        then applies). A removed edge (every op pruned) computes its first op at Z = 0, which adds exactly 0: the
        supernet computes at least one op per edge."""
        if all(bool(m.all()) for m in self.alive.values()):
            return None
        out = {}
        for t, m in self.alive.items():
            m = m.clone()
            m[~m.any(-1), 0] = True
            out[t] = m
        return out

    def probabilities(self) -> CellWeights:
        """γ on alive ops normalised per edge (E, K): each op's share of its edge's prior variance. A NaN γ of an alive
        op makes its edge's shares NaN (recorded, never its share 0); a pruned op's share is 0 whatever its γ."""
        out = {}
        for t, g in self.gamma.items():
            # selected, not multiplied and NaN-zeroed: an alive op's NaN γ stays NaN, a pruned op's γ is never read
            m = torch.where(self.alive[t].to(g.device), g, torch.zeros_like(g))
            out[t] = m / m.sum(-1, keepdim=True).clamp_min(torch.finfo(m.dtype).tiny)
        return out

    def genotype(self):
        net = self.network
        on = {t: m.to(torch.float64) for t, m in self.alive.items()}
        # a node whose incoming ops are all switched off is removed with the ops leaving it (A.2.14 prunes those only
        # at the next update, which the last one of a run does not have)
        return without_removed_nodes(derive_mixed_genotype(on, net.steps, net.multiplier, net.primitives))

    # -- Algorithm 2 -----------------------------------------------------------------------------------
    def likelihood_step(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Step 1 (A.3.1): one SGD step on 𝒲 and w of L + λ_w Σ ω‖w_group‖₂ (= λ_w Σ ω√ℵ|w|; + λ‖𝒲‖² as weight
        decay), L the batch-mean cross-entropy."""
        net = self.network
        self.w_optimizer.zero_grad(set_to_none=True)
        self.arch_optimizer.zero_grad(set_to_none=True)
        weights = self.forward_weights()
        # observed: the switched-on ops; a removed edge's first op is computed at Z = 0 but pruned (no cost statistics)
        result = self.cost(x, y, weights, active=self.active_ops(), train_weights=True, observed=self.alive)
        stats = {"scalars/train_loss": result.loss, "scalars/train_acc": accuracy(result.logits, y)}
        check_finite_loss(self, result, stats)  # before 𝒲, w and the switches take anything from a NaN/inf loss
        nn.utils.clip_grad_norm_(net.weight_parameters(), self.hp.grad_clip)
        for t, a in net.alphas().items():
            on = self.alive[t].to(a.device)
            # ∂/∂w of λ_w ω ‖w_group‖₂ (A.3.1) with the group's ℵ elements all equal to the shared w: √ℵ ω sign(w)
            penalty = self.hp.lambda_w * self._group_size[t] ** 0.5 * self.omega[t] * torch.sign(a.detach())
            # selected, not multiplied by the mask: a pruned op has γ = 0, so ω = ∞ (A.3.9) and ω·sign(0) is NaN
            grad = torch.where(on, result.costs[t] + penalty, torch.zeros_like(penalty))
            a.grad = grad.to(a.dtype)
        self.w_optimizer.step()
        self.arch_optimizer.step()
        return stats

    def cell_curvatures(self, x: torch.Tensor, y: torch.Tensor) -> CellWeights:
        """diag ∂²L/∂Z² of each cell's own Z at the current Z (C.3), of the batch-mean cross-entropy:
        ``{cell type: (ℵ, E, K)}``, ℵ the cells of the type in network order (no cross-cell terms: the
        curvature of each element of the group of A.3.6)."""
        from nasdiag.hessian import arch_diag_hessian

        net = self.network
        weights = self.forward_weights()
        edges = {f"net.{e.name}": e for e in net.edge_specs()}
        per_edge = arch_diag_hessian(_AtFixedWeights(net, weights), nn.functional.cross_entropy, x, y, edges,
                                     mode=self.hp.hessian_mode)
        position = {}  # cell index -> position among the cells of its type
        for i, cell in enumerate(net.cells):
            position[i] = sum(1 for c in net.cells[:i] if c.cell_type == cell.cell_type)
        out = {t: torch.zeros(sum(1 for c in net.cells if c.cell_type == t), *z.shape, dtype=z.dtype, device=z.device)
               for t, z in weights.items()}
        for key, e in edges.items():
            out[e.cell_type][position[e.cell_index], e.edge_index] = per_edge[key].detach().to(out[e.cell_type].dtype)
        # under DDP: the curvature of the global mean loss (rank mean), so every rank makes the same update
        return dict(zip(out, mean_over_ranks(list(out.values()))))

    def mixing_curvature(self, x: torch.Tensor, y: torch.Tensor) -> CellWeights:
        """diag ∂²L/∂Z² (E, K) per cell type, :meth:`cell_curvatures` summed over the cells of the type (C.3), of
        the batch-mean cross-entropy, in the update's mode ``hp.hessian_mode``: the number ``SearchMethod.curvature``
        records as ``hessian/<cell>/diag`` where the run's ``hessian_mode`` is that mode, except ``exact`` (whose
        recorded diagonal adds the cross-cell terms of the shared Z; each cell's own curvature here has none)."""
        return {t: h.sum(0) for t, h in self.cell_curvatures(x, y).items()}

    def energy_curvature(self, x: torch.Tensor, y: torch.Tensor) -> CellWeights:
        """Step 2: the curvature the update uses, diag ∇∇(E_D/λ_w) of each cell's own Z, ``{cell type: (ℵ, E, K)}``,
        with E_D the summed cross-entropy of the global batch (B = local batch × DDP ranks):
        B/λ_w · :meth:`cell_curvatures`.

        A.3.1 weighs the reweighted ℓ1 term by λ_w where A.2.12 weighs it by 1, so the energy of §A is
        E_D/λ_w; E_D is the negative log-likelihood of the data (Proposition 2), a sum over samples.
        """
        batch = x.shape[0] * world_size()
        return {t: h * (batch / self.hp.lambda_w) for t, h in self.cell_curvatures(x, y).items()}

    def bayes_update(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Steps 2-5: curvature, C/ω/s/γ of each group (A.3.2, A.3.8, A.3.9, A.2.14), entropy pruning, w ← 0 on
        pruned ops (← 1 on survivors with ``reset_w``)."""
        stats: Dict[str, torch.Tensor] = {}
        curvature = self.energy_curvature(x, y)
        # new dicts, never in-place edits: a state_dict() taken earlier holds the old ones
        cov, om, s, gamma, alive = (dict(d) for d in (self.covariance, self.omega, self.prior_variance, self.gamma,
                                                       self.alive))
        for t, a in self.network.alphas().items():
            H = curvature[t]  # (ℵ, E, K)
            finite = torch.isfinite(H).all(0)
            # the Laplace approximation needs H > 0: where no cell of the group has it (or one is not finite)
            # this op keeps its previous C, ω, s (its γ still follows its parents through A.2.14)
            informative = finite & (H > 0).any(0)
            w = self.forward_weights()[t]
            u = group_bayes_update(w.expand_as(H), H.nan_to_num(0.0, 0.0, 0.0), gamma[t], self._parents.to(H.dtype))
            cov[t] = torch.where(informative, u.cov.mean(0), cov[t])
            om[t] = torch.where(informative, u.omega, om[t])
            # an op pruned earlier has w = 0, so its switch is s = |w|/ω = 0 (A.2.13) whatever its curvature (often 0
            # once it is off: a removed node's output is exactly 0, where ReLU has slope 0); a stale s > 0 would keep
            # up the sum over its edge's predecessors in A.2.14 for the edges downstream of it
            dead = ~self.alive[t].to(H.device)
            s[t] = torch.where(informative | dead, u.switch, s[t])
            gamma[t] = dependent_gamma(s[t], self._parents.to(H.dtype))
            alive[t], _ = prune(alive[t], gamma[t].cpu())
            stats[V.HESSIAN_NONFINITE.path(cell=t)] = ~finite.all()
            with torch.no_grad():
                on = alive[t].to(a.device)
                a.copy_(torch.where(on, torch.ones_like(a) if self.hp.reset_w else a, torch.zeros_like(a)))
        self.covariance, self.omega, self.prior_variance, self.gamma = cov, om, s, gamma
        self.alive = alive
        self.curvature_used = {t: h.sum(0) for t, h in curvature.items()}
        # momentum of pruned or reset w must not carry into the next iteration
        self.arch_optimizer.state.clear()
        return stats

    def update_due(self) -> bool:
        every = self.hp.update_every or self.schedule.steps_per_epoch
        return (self.steps_done + 1) % every == 0

    def bayes_statistics(self) -> Dict[str, torch.Tensor]:
        stats = {}
        for t in self.gamma:
            stats[V.BAYES_GAMMA.path(cell=t)] = self.gamma[t].clone()
            stats[V.BAYES_OMEGA.path(cell=t)] = self.omega[t].clone()
            stats[V.BAYES_PRIOR_VARIANCE.path(cell=t)] = self.prior_variance[t].clone()
            stats[V.BAYES_COVARIANCE.path(cell=t)] = self.covariance[t].clone()
            stats[V.BAYES_CURVATURE.path(cell=t)] = self.curvature_used[t].clone()
            stats[V.BAYES_SWITCH.path(cell=t)] = self.alive[t].clone()
        return stats

    def check_curvature(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """`SearchError` unless the update's curvature mode runs on the supernet's mixed ops: a supernet nasdiag did
        not build (``adapt``) may have mixed ops that cannot take the per-sample (B, K) weights of the GGN modes (DARTS's
        ``zip(weights, self._ops)``), which stopped the first update, an epoch in, after its likelihood step had moved
        w and 𝒲. One curvature on the first batch, before any update; nasdiag's own Network needs none."""
        try:
            self.cell_curvatures(x, y)
        except CurvatureError as err:
            raise SearchError(f"bayesnas: its update's curvature, hessian_mode={self.hp.hessian_mode!r}, cannot run on "
                              f"this supernet ({err}); pass --hp hessian_mode=diag (or exact), "
                              "Hyperparameters(hessian_mode='diag') in code") from None
        self._curvature_checked = True

    def step(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        if not self._curvature_checked:
            self.check_curvature(*train_batch)
        stats = {"scalars/w_lr": self.scalar_statistic(self.w_optimizer.param_groups[0]["lr"])}
        used = self.forward_weights()  # arch/<cell>/weights: the Z of this step's forward, not the w after it
        with failing_row(stats):
            stats.update(self.likelihood_step(*train_batch))
        updated = self.update_due()
        if updated:
            stats.update(self.bayes_update(*train_batch))
        self.steps_done += 1
        stats[V.BAYES_UPDATED.path()] = torch.tensor(updated)
        stats.update(self.bayes_statistics())
        stats.update(self.arch_statistics(used))
        return stats

    def epoch_end(self, epoch: int) -> None:
        self.step_schedules(self.scheduler, self.arch_scheduler)
