"""SparseNAS (Wu et al., AAAI 2021): a sparse supernet searched with hierarchical proximal optimization.

Every edge mixes its candidate ops linearly, x_j = Σ_{i<j} Σ_o A_ij^o o(x_i) (sparse-supernet eq 1: no
softmax, no ``none`` op), and A minimises the bilevel objective of eq 4 with the sparse-group-lasso
penalty Ω_SGL(A) = λα‖A‖₁ + λ(1−α) Σ_n √|A_(n)| ‖A_(n)‖₂ (eq 2), where the group A_(n) of node n holds
every weight of every edge entering n. A takes HAPG or AdamHAPG steps (eq 6–10, ``nasdiag.sparse``)
on the second-order hypergradient of eq 11–13 (``nasdiag.search.unrolled``), which is composed from the
cost primitive: with linear weights ∂L/∂A = C = ∂L/∂Z itself (wiring supplement §2). λ grows linearly
over the epochs (the "pathwise" progressive sparsification of the paper's §Optimization, step 0.01).

The derived architecture is the mixed path: every op whose weight is non-zero (``derive_mixed_genotype``),
and the cell output concatenates only the nodes that kept an incoming weight ("removing the operations with zero
weights and the nodes with all zero incoming weights", §Sparse Supernet). The proximal step's zeros are not repaired
(no op is put back on an emptied edge): an edge, or a whole node group (eq 10), may be emptied; that is the node
sparsity the paper searches for. They are not frozen either: as in any proximal method, a later step moves a zero
weight again where its gradient step passes the thresholds (eq 9, 10), so the genotype is that of the last A.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from nasdiag import vocabulary as V
from nasdiag.distributed import finite_on_every_rank
from nasdiag.search.base import Batch, SearchError, accuracy, check_batch, failing_row, loss_text, nonfinite_loss_error
from nasdiag.search.hyperparameters import hp
from nasdiag.errors import ConfigError
from nasdiag.search.methods.darts import DARTS, SGDAdamHyperparameters
from nasdiag.search import unrolled
from nasdiag.search.registry import register
from nasdiag.search.unrolled import functional_cost, sgd_momentum_buffers, unrolled_gradient, weight_params
from nasdiag.sparse import HAPG, AdamHAPG
from nasdiag.supernet import DARTS_PRIMITIVES, derive_mixed_genotype
from nasdiag.supernet.cell import edge_nodes
from nasdiag.supernet.genotype import without_removed_nodes  # noqa: F401  (BayesNAS imports it from here)


def _refuse_unused(h) -> None:
    """Raise `ConfigError` where a hyperparameter that the chosen configuration never reads was changed (it would be
    accepted and do nothing): ``hapg_lr`` under AdamHAPG, ``alpha_lr`` and ``alpha_betas`` under HAPG,
    ``fd_eps_scale`` with ``first_order``. Unchanged means its default or the value the digits preset gives it
    (the preset's ``alpha_lr`` is applied whatever the optimizer)."""
    unused = {"adamhapg": ("hapg_lr",), "hapg": ("alpha_lr", "alpha_betas")}[h.optimizer]
    if h.first_order:
        unused += ("fd_eps_scale",)
    fields, preset = type(h).__dataclass_fields__, SparseNAS.digits_preset
    changed = [name for name in unused if getattr(h, name) not in (fields[name].default, preset.get(name, fields[name].default))]
    if changed:
        setting = f"optimizer={h.optimizer}" + (", first_order=True" if h.first_order else "")
        raise ConfigError(f"sparsenas: {', '.join(f'{n}={getattr(h, n)!r}' for n in changed)} is not used with {setting} "
                          "(hapg_lr is HAPG's step size, alpha_lr and alpha_betas AdamHAPG's, fd_eps_scale the "
                          "second-order finite difference's); drop it or choose the setting that uses it")


@register("sparsenas")
class SparseNAS(DARTS):
    """SparseNAS with HAPG or AdamHAPG (``--hp optimizer=hapg|adamhapg``).

    The w step is DARTS's (SGD, momentum 0.9, weight decay 3e-4, cosine from 0.025: the paper's CNN search
    setting). Each :meth:`step` records what DARTS records plus ``sparsity/lambda``,
    ``sparsity/<cell>/nonzero`` and ``arch/<cell>/weights`` = A; with the second-order step ``scalars/val_loss`` and
    ``scalars/val_acc`` are those at the unrolled w' (as darts2's) and ``scalars/alpha_grad_norm`` is ‖eq 13's
    hypergradient‖, before the proximal step.
    """

    graph_capturable = False  # the proximal step runs eagerly (its state: HAPG/AdamHAPG per-parameter dicts)
    check_train_loss = True  # the step reads the host anyway (the val loss's check)

    #: the paper's search space is DARTS's without the zero op (§Convolutional Neural Architecture Search)
    primitives = tuple(p for p in DARTS_PRIMITIVES if p != "none")

    @dataclass
    class Hyperparameters(SGDAdamHyperparameters):
        # DARTS's w settings; no weight decay of A (the sparse-group-lasso penalty is A's regulariser, eq 2)
        alpha_lr: float = hp(3e-4, "AdamHAPG's Adam learning rate (sparse-supernet appendix, CNN search; optimizer=adamhapg only).",
                             low=0, low_open=True)
        alpha_betas: Tuple[float, float] = hp((0.5, 0.999), "AdamHAPG's Adam betas (sparse-supernet appendix; "
                                                            "optimizer=adamhapg only).", low=0, high=1, high_open=True)
        optimizer: str = hp("adamhapg", "Proximal optimizer of A: hapg or adamhapg (the paper's best, Table 1).",
                            choices=("hapg", "adamhapg"))
        hapg_lr: float = hp(0.025, "HAPG's initial step size η, cosine-annealed (sparse-supernet, CNN search setting; "
                                   "optimizer=hapg).", low=0, low_open=True)
        sgl_alpha: float = hp(0.5, "α of eq 2, balancing element (op) and group (node) sparsity (Table 5: 0.5 best).",
                              low=0, high=1)
        lambda_step: float = hp(0.01, "λ grows by this much per epoch, from λ = lambda_step in the first (Fig. 4: 0.01 chosen).",
                                low=0)
        first_order: bool = hp(False, "Use ∇_A l_val at the current w instead of the second-order hypergradient of eq 13.")
        fd_eps_scale: float = hp(0.01, "r in ε = r/‖∇_w' l_val‖ of eq 13's finite difference (DARTS's 0.01).",
                                 low=0, low_open=True)
        init_scale: float = hp(1e-3, "A starts at 1/K + init_scale·N(0, 1) per op (uniform mixing; the paper does not say).",
                               low=0)

        def validate(self) -> None:
            super().validate()
            _refuse_unused(self)  # a setting the configuration does not read is refused, not silently ignored

    def build(self) -> None:
        h = self.hp
        self.build_weight_optimizer()  # DARTS's w training; A takes the proximal steps below instead of Adam
        K = len(self.network.primitives)
        with torch.no_grad():
            for a in self.network.arch_parameters():
                noise = torch.randn(a.shape, generator=self.generator, device=a.device, dtype=a.dtype)
                a.copy_(1.0 / K + h.init_scale * noise)
        groups = [self.node_groups(cell_type) for cell_type in self.network.alphas()]
        params = [{"params": [a], "groups": [g], "lam": h.lambda_step, "alpha": h.sgl_alpha}
                  for a, g in zip(self.network.arch_parameters(), groups)]
        if h.optimizer == "hapg":
            self.arch_optimizer = HAPG(params, lr=h.hapg_lr)
            self.arch_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.arch_optimizer, self.schedule.epochs)
        else:
            self.arch_optimizer = AdamHAPG(params, lr=h.alpha_lr, betas=tuple(h.alpha_betas))

    def node_groups(self, cell_type: str) -> torch.Tensor:
        """(E, K) group ids: every weight of an edge entering intermediate node n is in group n − 2 (eq 2). The edges are
        the network's ``edge_nodes``, or, on a supernet without them (``nasdiag.search.supernet.adapt``: a
        DARTS-convention supernet, which had no such attribute and stopped the build in an AttributeError), the DARTS
        order of its ``steps``."""
        A = self.network.alphas()[cell_type]
        pairs = getattr(self.network, "edge_nodes", None) or edge_nodes(self.network.steps)
        dst = torch.tensor([j for _, j in pairs], device=A.device)
        return (dst - 2).unsqueeze(1).expand(A.shape).contiguous()

    @property
    def lam(self) -> float:
        """The current λ (the same for every cell type)."""
        return float(self.arch_optimizer.param_groups[0]["lam"])

    # -- relaxation ----------------------------------------------------------------------------------
    def forward_weights(self) -> Dict[str, torch.Tensor]:
        """A itself: the linear mixing of eq 1."""
        return {t: a.detach() for t, a in self.network.alphas().items()}

    def eval_weights(self) -> Dict[str, torch.Tensor]:
        return self.forward_weights()

    def probabilities(self) -> Dict[str, torch.Tensor]:
        """|A| normalised per edge (E, K): each op's share of its edge, 0 for pruned ops."""
        out = {}
        for t, a in self.network.alphas().items():
            m = a.detach().abs()
            out[t] = m / m.sum(-1, keepdim=True).clamp_min(torch.finfo(m.dtype).tiny)
        return out

    def genotype(self):
        """The mixed path (every non-zero weight) without the removed nodes: a node without any incoming weight left (or
        fed only by removed nodes) is removed, with the ops leaving it and from the cell's output concatenation (the
        paper's node sparsity, :func:`without_removed_nodes`)."""
        net = self.network
        return without_removed_nodes(derive_mixed_genotype(self.finite_architecture(self.forward_weights()), net.steps,
                                                           net.multiplier, net.primitives))

    # -- the A step --------------------------------------------------------------------------------
    def arch_gradient(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        """``{cell type: (E, K)}`` ∇_A l_val (eq 11): the second-order estimate of eq 13 (or the first-order
        one), computed without changing any state (the global generators too: a supernet with train-mode dropout draws
        the same masks here and in the next step). The penalty enters through the proximal step, not here."""
        if unrolled.host_checks_allowed():  # as step() does: a wrong batch is one line (its label range is read
            check_batch(self.network, train_batch, "search-train")  # back, which a graph capture must not do)
            check_batch(self.network, val_batch, "search-val")
        A = self.forward_weights()
        with unrolled.random_state_kept():
            if self.hp.first_order:  # functional, on copies of the buffers: SearchMethod.cost would move BatchNorm's
                params = {n: p.detach() for n, p in weight_params(self.network).items()}  # running statistics
                buffers = {n: b.detach().clone() for n, b in self.network.named_buffers()}
                return dict(functional_cost(self.network, params, buffers, *val_batch, A).costs)
            return self._unrolled(train_batch, val_batch, A).arch_grad

    def _unrolled(self, train_batch, val_batch, A, observe_probe: bool = False):
        group = self.w_optimizer.param_groups[0]
        params = weight_params(self.network)
        extra = {"val_context": (lambda: self._probe_recording(val_batch[1]))} if observe_probe else {}
        return unrolled_gradient(self.network, train_batch, val_batch, A, lambda costs: dict(costs), xi=group["lr"],
                                 momentum=group["momentum"], momentum_buffers=sgd_momentum_buffers(self.w_optimizer, params),
                                 weight_decay=group["weight_decay"], eps_scale=self.hp.fd_eps_scale, **extra)

    def arch_step(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        """One proximal step of A (eq 6–10) on the hypergradient; its exact zeros (ops, edges, whole nodes) are not
        repaired, and a later step may move them again (where its gradient step passes the thresholds of eq 9, 10)."""
        A = self.forward_weights()
        if self.hp.first_order:
            result = self.cost(*val_batch, A)
            grads, loss, logits = result.costs, result.loss, result.logits
        else:
            unrolled = self._unrolled(train_batch, val_batch, A, observe_probe=True)
            self._observe_costs(unrolled.val.per_cell, None)
            self._last_arch_batch = val_batch
            grads, loss, logits = unrolled.arch_grad, unrolled.val.loss, unrolled.val.logits
        if not finite_on_every_rank(loss):  # under DDP: every rank stops at this step, before A's update
            raise nonfinite_loss_error(f"the search-val loss is {loss_text(loss)}: lower the learning rates or check the data",
                                       {"scalars/val_loss": loss})
        for cell_type, a in self.network.alphas().items():
            a.grad = grads[cell_type].to(a.dtype)
        self.arch_optimizer.step()
        stats = {"scalars/val_loss": loss, "scalars/val_acc": accuracy(logits, val_batch[1]),
                 "scalars/alpha_grad_norm": torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))}
        # No repair of emptied edges: eq 10 zeroes whole node groups by design (node sparsity), and putting an op
        # back on every emptied edge would make the removal of a node impossible.
        for cell_type, a in self.network.alphas().items():
            stats[V.SPARSITY_NONZERO.path(cell=cell_type)] = a.detach() != 0
        stats[V.SPARSITY_LAMBDA.path()] = self.scalar_statistic(self.lam)
        return stats

    def step(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        stats = {"scalars/w_lr": self.scalar_statistic(self.w_optimizer.param_groups[0]["lr"])}
        with failing_row(stats):  # a NaN loss raises before its update (A's or w's), its row recorded
            stats.update(self.arch_step(train_batch, val_batch))
            weights = self.forward_weights()
            stats.update(self.weight_step(*train_batch, weights))
        stats.update(self.arch_statistics(weights))
        return stats

    def epoch_end(self, epoch: int) -> None:
        """Cosine schedules step; λ rises linearly: λ = lambda_step · (epochs done + 1)."""
        self.step_schedules(self.scheduler, *([self.arch_scheduler] if hasattr(self, "arch_scheduler") else []))
        for group in self.arch_optimizer.param_groups:
            group["lam"] = self.hp.lambda_step * (epoch + 2)
        if not math.isfinite(self.lam):
            raise SearchError(f"λ became {self.lam}; use a smaller lambda_step")
