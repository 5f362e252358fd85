"""Audit round 5 of the search methods and statistics that earlier rounds covered least: XNAS, SparseNAS, BayesNAS
and ASM-NAS, each against a float64 transcription written here from its paper, never from nasdiag.

References (all in this file): Algorithm 1 of XNAS with its rewards R = −∇_p ℓ · f_i taken by autograd w.r.t. explicit
per-cell mixing leaves, the EG step, the wipeout of lines 11-12, Γ_t/γ_t of eq 28, the linearized regret of eq 31 and
eq 3-4; the proximal operator of the sparse group lasso characterized without a solver (x = prox(z) iff z − x is a
subgradient of the penalty at x); HAPG/AdamHAPG of eq 6-10 and the progressive λ over several epochs; the exact
second-order hypergradient of sparse-supernet eq 11-12 by autograd through w'(A); BayesNAS's A.3.2, A.3.8, A.3.9,
A.2.14 and the entropy pruning of Algorithm 2 on the per-cell curvature taken by double backward; ASM-NAS's eq 4.3-4.5
and the argmax-count selection of Algorithm 1 on the validation set. The supernet's forward is nasdiag's (a tiny
float64 ``Network``), used as a function of (w, Z).

Defects these tests found (each fails without its fix): a negative proximal threshold moved weights away from zero;
a NaN γ(t−1) became ω = ∞, s = 0 and pruned its op; group_dims out of range wrapped to another Table S3 row; a
forecaster state of other shapes was loaded; HAPG/AdamHAPG, bayes and regret primitives raised builtin tracebacks on
bad input; SparseNAS.arch_gradient (first order) moved BatchNorm's running statistics; an XNAS step past T moved w
before failing; the SparseNAS/BayesNAS mixed genotype kept the ops leaving a removed node.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from nasdiag import vocabulary as V
from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network
from test_audit_methods_round2 import SGD, cosine  # momentum SGD with decay, the cosine lr
from test_audit_methods_round2 import Reference as Round2Reference
from test_audit_methods_round3 import _assert_same  # nested tensors/dicts/lists equal, bit for bit

B = 4


def batches(n, seed, B=B, classes=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, classes, (B,), generator=g))
            for _ in range(n)]


class Reference(Round2Reference):
    """Round 2's supernet as a function of (w, Z) (a frozen copy, own SGD step), with each cell's own Z leaf."""

    def __init__(self, net):
        super().__init__(net)
        self.types = [c.cell_type for c in self.net.cells]

    def cell_costs(self, w, x, y, per_type, active=None):
        """C_c = ∂L/∂Z_c for each cell c (its own leaf), the loss at Z_c = per_type[type of c]."""
        leaves = [per_type[t].clone().requires_grad_(True) for t in self.types]
        loss = self.loss(w, x, y, leaves, active)
        return loss.detach(), list(torch.autograd.grad(loss, leaves))


def assert_same_weights(net, ref, rtol=1e-9, atol=1e-12):
    for n, p in net.named_parameters():
        if n in ref.w:
            torch.testing.assert_close(p.detach(), ref.w[n], rtol=rtol, atol=atol, msg=n)


# == XNAS ===========================================================================================================
class Algorithm1:
    """XNAS Algorithm 1 for a batch of E forecasters over K experts, written from the paper: v_0 = 1 (line 2), the
    mixture u = v/Σv predicts (line 5), v ← v·exp(ηR) (line 9), θ_t = max_i v_{t,i}·exp(−2ηL(T − t)ζ) (line 11),
    every v < θ_t removed (line 12). Kept as S = Σ_s R_s (ln v = ηS) so that ties stay exact; γ_t = Π Γ_s with
    Γ_t = 1 + (mass wiped at t)/(mass kept at t) (eq 28); regret eq 31 against the surviving experts."""

    def __init__(self, E, K, eta, L, T, zeta=1.0):
        self.S = torch.zeros(E, K, dtype=torch.float64)
        self.alive = torch.ones(E, K, dtype=torch.bool)
        self.eta, self.L, self.T, self.zeta, self.t = eta, L, T, zeta, 0
        self.mixture_total = torch.zeros(E, dtype=torch.float64)
        self.expert_total = torch.zeros(E, K, dtype=torch.float64)
        self.log_gamma = torch.zeros(E, dtype=torch.float64)
        self.removed_at = torch.full((E, K), math.nan, dtype=torch.float64)  # ln v at removal

    @property
    def log_v(self):
        return torch.where(self.alive, self.eta * self.S, torch.full_like(self.S, -math.inf))

    @property
    def u(self):
        return torch.softmax(self.log_v, -1)

    def round(self, R):
        self.t += 1
        self.mixture_total += (self.u * torch.where(self.alive, R, 0.0)).sum(-1)
        self.expert_total += torch.where(self.alive, R, 0.0)
        self.S = torch.where(self.alive, self.S + R, self.S)
        log_v = self.log_v
        log_theta = log_v.amax(-1, keepdim=True) - 2 * self.eta * self.L * (self.T - self.t) * self.zeta
        # strict, with a relative allowance of 1e-9 for equality reached through different rounding
        wiped = self.alive & (log_v < log_theta - 1e-9 * (1 + log_theta.abs()))
        kept = self.alive & ~wiped
        mass = torch.exp(log_v - log_v.amax(-1, keepdim=True))
        gone, stay = (mass * wiped).sum(-1), (mass * kept).sum(-1)
        self.log_gamma += torch.log1p(gone / stay)
        self.removed_at = torch.where(wiped, log_v, self.removed_at)
        self.alive = kept
        return wiped

    def survivor_regret(self):
        best = self.expert_total.masked_fill(~self.alive, -math.inf).amax(-1)
        return best - self.mixture_total

    def bound(self, K):
        return self.eta * self.t * self.L ** 2 / 2 + (math.log(K) - self.log_gamma) / self.eta


def test_xnas_steps_are_algorithm_1_with_rewards_minus_the_per_cell_costs_and_wipeouts():
    """Several XNAS steps on a float64 supernet (1 normal cell, 2 reduction cells: r = 1 and 2 rounds a step) against
    Algorithm 1 written here: line 4 momentum SGD of w (decay, clip, cosine) at u on the train batch, wiped-out ops not
    computed; lines 5-8 R = −∂L_val/∂Z_c per cell c by autograd at u with the new w, clipped to [−L, L]; lines 9-12 one
    round per cell in network order with η = η*(T_c, L, K) of eq 4, T_c = steps × r_c. Then every recorded statistic:
    ln v (at removal for wiped ops), alive, survivor regret (eq 31), eq 3 with γ_t of eq 28, the step's wipeouts, the
    clipped rewards (0 for ops not computed), active_fraction and reward_clip_fraction."""
    cls = get_method("xnas")
    prims = ("skip_connect", "max_pool_3x3", "avg_pool_3x3", "sep_conv_3x3")
    L = 2e-3  # the rewards are ~1e-2: most clipped, so ±L rounds wipe out within the run
    h = cls.Hyperparameters(reward_bound=L, lr_scale=3.0, grad_clip=0.5)
    torch.manual_seed(3)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=prims).double()
    epochs, per_epoch = 2, 3
    method = cls(net, h, schedule=Schedule(epochs=epochs, steps_per_epoch=per_epoch, batch_size=B))
    ref = Reference(net)
    sgd = SGD(h.w_momentum, h.w_weight_decay)
    K, E = len(prims), net.num_edges
    rounds = {"normal": 1, "reduce": 2}
    steps = epochs * per_epoch
    fc = {t: Algorithm1(E, K, h.lr_scale * math.sqrt(2 * math.log(K) / (steps * r * L * L)), L, steps * r)
          for t, r in rounds.items()}
    data = batches(2 * steps, 5)
    wiped_total = 0
    for step in range(steps):
        epoch = step // per_epoch
        (xt, yt), (xv, yv) = data[2 * step], data[2 * step + 1]
        u = {t: f.u for t, f in fc.items()}
        alive = {t: f.alive.clone() for t, f in fc.items()}
        active = None if all(a.all() for a in alive.values()) else alive
        on = sum(int(alive[t].sum()) * r for t, r in rounds.items()) / sum(E * K * r for r in rounds.values())
        stats = method.step((xt, yt), (xv, yv))
        train_loss = ref.weight_step(sgd, cosine(h.w_lr, h.w_lr_min, epoch, epochs), h.grad_clip, xt, yt, u, active)
        val_loss, costs = ref.cell_costs(ref.w, xv, yv, u, active)
        assert_same_weights(net, ref)
        torch.testing.assert_close(stats["scalars/train_loss"], train_loss, rtol=1e-10, atol=0)
        torch.testing.assert_close(stats["scalars/val_loss"].double(), val_loss, rtol=1e-10, atol=0)
        assert float(stats["scalars/active_fraction"]) == pytest.approx(on, rel=1e-12)
        clipped_n = counted = 0
        for t, f in fc.items():
            raw = [-c for c, ty in zip(costs, ref.types) if ty == t]
            clipped_n += sum(int(((r.abs() > L) & f.alive).sum()) for r in raw)
            counted += int(f.alive.sum()) * len(raw)
            R = [r.clamp(-L, L) for r in raw]
            wiped = torch.zeros(E, K, dtype=torch.bool)
            for r in R:
                wiped |= f.round(r)
            wiped_total += int(wiped.sum())
            torch.testing.assert_close(stats[V.REGRET_REWARDS.path(cell=t)], torch.stack(R), rtol=1e-8, atol=1e-14)
            assert torch.equal(stats[V.REGRET_ALIVE.path(cell=t)], f.alive)
            assert torch.equal(stats[V.REGRET_WIPEOUTS.path(cell=t)], wiped)
            log_v = torch.where(f.alive, f.log_v, f.removed_at)
            torch.testing.assert_close(stats[V.REGRET_LOG_WEIGHTS.path(cell=t)], log_v, rtol=1e-8, atol=1e-10)
            torch.testing.assert_close(stats[V.REGRET_REGRET.path(cell=t)], f.survivor_regret(), rtol=1e-7, atol=1e-12)
            torch.testing.assert_close(stats[V.REGRET_GAMMA.path(cell=t)], f.log_gamma.exp(), rtol=1e-10, atol=0)
            torch.testing.assert_close(stats[V.REGRET_BOUND.path(cell=t)], f.bound(K), rtol=1e-10, atol=0)
            assert not stats[V.REGRET_NONFINITE.path(cell=t)].any()
            torch.testing.assert_close(stats[V.ARCH_PROBABILITIES.path(cell=t)], f.u, rtol=1e-8, atol=1e-15)
            assert (f.survivor_regret() <= f.bound(K) + 1e-12).all()  # Theorem 1 at every t
        assert float(stats["scalars/reward_clip_fraction"]) == pytest.approx(clipped_n / counted, rel=1e-12)
        if (step + 1) % per_epoch == 0:
            method.epoch_end(epoch)
    assert wiped_total > 0  # lines 11-12 acted
    assert all(f.alive.any(-1).all() for f in fc.values())  # Lemma 1: never an edge without an op


# == bad input to the primitives: one line, the right type, never a silent wrong number ===========================
def _one_line(excinfo, *words):
    message = str(excinfo.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("call, words", [
    (lambda S, z, g: S.prox_l1(z, -0.1), ("ℓ1 threshold", ">= 0", "-0.1")),
    (lambda S, z, g: S.prox_l1(z, torch.tensor([0.1, -0.2, 0.0, 0.3])), ("ℓ1 threshold", "-0.2")),
    (lambda S, z, g: S.prox_group(z, -0.1, g), ("group threshold", ">= 0")),
    (lambda S, z, g: S.prox_sgl(z, 0.1, -0.1, g), ("group threshold", ">= 0")),
    (lambda S, z, g: S.prox_group(z, torch.ones(5), g), ("one value per group", "(2,)", "(5,)")),
    (lambda S, z, g: S.prox_group(z, 0.1, g - 1), ("negative id", "-1")),
])
def test_a_negative_proximal_threshold_or_group_id_is_refused_not_an_expansion(call, words):
    """Eq 9-10 shrink: the threshold is a step size times λα or λ(1 − α), ≥ 0. A negative one moved every weight
    AWAY from zero (prox_l1(z, −0.1) = z + 0.1·sign(z)), silently; a negative group id was an IndexError, a threshold
    of the wrong length a broadcasting RuntimeError."""
    from nasdiag import sparse as S
    from nasdiag.errors import ConfigError
    z = torch.tensor([[0.5, -0.3, 0.05, 0.2]], dtype=torch.float64).expand(3, 4).contiguous()
    g = torch.tensor([[0] * 4, [1] * 4, [1] * 4])
    with pytest.raises(ConfigError) as excinfo:
        call(S, z, g)
    _one_line(excinfo, *words)


@pytest.mark.parametrize("make, words", [
    (lambda S, p, g: S.HAPG([p], lr="fast"), ("learning rate", "number", "'fast'")),
    (lambda S, p, g: S.HAPG([p], lr=math.inf), ("learning rate", "finite", "inf")),
    (lambda S, p, g: S.HAPG([p], lr=0.1, lam=math.inf), ("lam", "finite", "inf")),
    (lambda S, p, g: S.HAPG([p], lr=0.1, lam=0.1, groups=[g.double()]), ("groups[0]", "integer", "float64")),
    (lambda S, p, g: S.HAPG([p], lr=0.1, lam=0.1, groups=[g[:2]]), ("groups[0]", "(2, 4)", "(3, 4)")),
    (lambda S, p, g: S.AdamHAPG([p], lam=0.1, groups=[g - 1]), ("groups[0]", "negative id")),
    (lambda S, p, g: S.AdamHAPG([p], betas=(0.5,)), ("betas", "two numbers")),
    (lambda S, p, g: S.AdamHAPG([p], eps=-1e-8), ("eps", "> 0")),
    (lambda S, p, g: S.AdamHAPG([p], eps=0.0), ("eps", "> 0")),
])
def test_hapg_and_adamhapg_refuse_what_they_cannot_use_at_construction(make, words):
    """Before: a float groups tensor was accepted and truncated to ids by .long() at each step, a groups tensor of the
    wrong shape passed construction, negative ids reached bincount's RuntimeError, betas=(0.5,) was an IndexError,
    lr='fast' a TypeError from '>', lr=inf made every weight NaN, and eps ≤ 0 gives η_i = lr/0 = inf for a weight with
    zero gradient (z = A − inf·0 = NaN) where torch's Adam refuses a negative eps."""
    from nasdiag import sparse as S
    from nasdiag.errors import ConfigError
    p = nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    g = torch.tensor([[0] * 4, [1] * 4, [1] * 4])
    with pytest.raises(ConfigError) as excinfo:
        make(S, p, g)
    _one_line(excinfo, *words)


def test_a_nan_variance_gives_nan_switches_never_the_dead_switch_that_prunes():
    """ω = √(γ − C)/γ (A.2.8) is ∞ only for a dead switch, γ = 0 (then s = |w|/ω = 0: the op is pruned for good).
    A NaN γ(t−1) selected that branch too (``γ > 0`` is False for NaN): s = 0, γ = 0 and the op was pruned by Algorithm
    2 step 4 on a NaN, silently. Now the NaN reaches ω, s and γ (recorded, flagged), and `prune` keeps the op."""
    from nasdiag.bayes import omega, parent_matrix, prune, sparse_bayes_update
    gamma = torch.tensor([[1.0, math.nan, 0.0, 0.5]], dtype=torch.float64)
    cov = torch.tensor([[0.5, 0.3, 0.0, 0.25]], dtype=torch.float64)
    om = omega(gamma, cov)
    assert math.isnan(float(om[0, 1]))
    assert float(om[0, 2]) == math.inf
    torch.testing.assert_close(om[0, [0, 3]], torch.tensor([math.sqrt(0.5), math.sqrt(0.25) / 0.5], dtype=torch.float64))
    w = torch.tensor([[0.8, 0.8, 0.0, 0.2]], dtype=torch.float64)
    u = sparse_bayes_update(w, torch.ones_like(w), gamma, parent_matrix([(0, 2)]).double())
    assert math.isnan(float(u.switch[0, 1])) and math.isnan(float(u.gamma[0, 1]))
    alive, _ = prune(torch.ones(1, 4, dtype=torch.bool), u.gamma)
    assert bool(alive[0, 1])  # NaN prunes nothing


@pytest.mark.parametrize("call, words", [
    (lambda Bz: Bz.group_norms(torch.randn(4, 3), (3,)), ("group_dims", "2-d", "(3,)")),
    (lambda Bz: Bz.structured_update(torch.randn(4, 3), torch.rand(4, 3), torch.ones(3), (5,)), ("group_dims", "(5,)")),
    (lambda Bz: Bz.expand_groups(torch.ones(3), torch.randn(4, 3), (-3,)), ("group_dims", "(-3,)")),
    (lambda Bz: Bz.parent_matrix([(0, 2), (1,)]), ("edge_nodes", "pairs")),
    (lambda Bz: Bz.prune(torch.ones(3, 4, dtype=torch.bool), torch.ones(2, 4)), ("alive", "(2, 4)", "(3, 4)")),
])
def test_bayes_primitives_refuse_dimensions_and_shapes_they_do_not_have(call, words):
    """group_dims=(3,) on a 2-d weight was taken modulo the dimension (3 % 2 = 1): the groups of another Table S3 row,
    silently (γ per input feature instead of an error). A malformed edge list was a ValueError from unpacking, alive
    and γ of different shapes a broadcasting RuntimeError."""
    from nasdiag import bayes as Bz
    with pytest.raises(Bz.update.BayesError) as excinfo:
        call(Bz)
    _one_line(excinfo, *words)


@pytest.mark.parametrize("call, kind, words", [
    (lambda R: R.simulate_gaussian_experts(4, "noisy", 2, 2), "RegretTypeError", ("sigma", "'noisy'")),
    (lambda R: R.simulate_gaussian_experts(4, 1.0, 2, 0), "RegretError", ("n_steps", "positive")),
    (lambda R: R.simulate_gaussian_experts(4, 1.0, 0, 3), "RegretError", ("n_runs", "positive")),
    (lambda R: R.simulate_gaussian_experts(1, 1.0, 2, 3), "RegretError", ("n_experts", ">= 2")),
    (lambda R: R.simulate_gaussian_experts(4, 1.0, 2, 3, loss_bound=-1.0), "RegretError", ("loss_bound",)),
    (lambda R: R.simulate_gaussian_experts(4, 1.0, 2, 3, gd_lr=0.0), "RegretError", ("gd_lr",)),
    (lambda R: R.cell_depth(None), "RegretError", ("cell", "NoneType")),
    (lambda R: R.cell_depth([("sep_conv_3x3", None), ("skip_connect", 1)]), "RegretError", ("gene 0", "input node")),
    (lambda R: R.rewards_from_gradient(torch.randn(5, 3), torch.randn(4, 2, 3)), "RegretError", ("broadcast", "(5, 3)")),
    (lambda R: R.gd_softmax_reward(torch.randn(5, 3), torch.full((4, 3), 1 / 3)), "RegretError", ("broadcast", "(4, 3)")),
    (lambda R: R.Forecaster(3, 0.1, 1.0, 5, dtype="float64"), "RegretTypeError", ("dtype", "float64")),
])
def test_regret_primitives_bad_input_is_one_regret_error_naming_the_argument(call, kind, words):
    """docs/regret.md: bad input is one RegretError. Before: sigma='noisy' was '<' not supported between 'str' and
    'int', n_steps=0 blamed 'T', cell_depth(None) and a None input node were TypeErrors from iter()/int(), leading
    shapes that do not broadcast were torch RuntimeErrors, dtype='float64' an AttributeError."""
    from nasdiag import regret as R
    with pytest.raises(getattr(R, kind)) as excinfo:
        call(R)
    _one_line(excinfo, *words)


def test_a_forecaster_state_of_the_wrong_shapes_is_refused_before_anything_is_loaded():
    """A state with the same configuration but tensors of other shapes (corrupt, or edited by hand) was loaded as it
    was: ln v of 5 experts into a forecaster of 3, which then broadcast or failed at a later update. It is refused
    with the forecaster left as it was; a state of another configuration still says which settings differ."""
    from nasdiag.regret import Forecaster, RegretError
    fc = Forecaster(3, 0.1, 1.0, 5, shape=(2,))
    fc.update(torch.tensor([[0.5, -0.5, 0.0], [1.0, 0.0, -1.0]], dtype=torch.float64))
    before = fc.state_dict()
    for key, bad in (("log_weights", torch.zeros(2, 5)), ("alive", torch.ones(3, dtype=torch.bool)),
                     ("expert_reward", torch.zeros(2)), ("log_gamma", torch.zeros(3))):
        with pytest.raises(RegretError) as excinfo:
            fc.load_state_dict({**before, key: bad})
        _one_line(excinfo, key, "shape")
        assert torch.equal(fc.log_weights, before["log_weights"]) and torch.equal(fc.alive, before["alive"])
    with pytest.raises(RegretError, match="configured differently"):
        fc.load_state_dict(Forecaster(4, 0.1, 1.0, 5, shape=(2,)).state_dict())


# == BayesNAS: Algorithm 2 steps 2-5 ================================================================================
def _cell_hessian_diagonals(ref, x, y, per_type):
    """diag ∂²L/∂Z_c² of the batch-mean cross-entropy for each cell's own leaf Z_c, by double backward, element by
    element: {cell type: (ℵ, E, K)} with the cells of a type in network order."""
    leaves = [per_type[t].clone().requires_grad_(True) for t in ref.types]
    loss = ref.loss(ref.w, x, y, leaves)
    grads = torch.autograd.grad(loss, leaves, create_graph=True)
    out = {t: [] for t in per_type}
    for leaf, g, t in zip(leaves, grads, ref.types):
        diag = torch.zeros_like(leaf)
        for e in range(leaf.shape[0]):
            for k in range(leaf.shape[1]):
                diag[e, k] = torch.autograd.grad(g[e, k], leaf, retain_graph=True)[0][e, k]
        out[t].append(diag.detach())
    return {t: torch.stack(rows) for t, rows in out.items()}


def test_bayesnas_updates_are_a_3_2_a_3_9_a_3_8_a_2_14_and_entropy_pruning_on_autograd_curvature():
    """Algorithm 2 steps 2-5 over three iterations, each after a step 1 of the method's own, against this file's
    transcription: H_i = B/λ_w · diag ∂²L/∂Z_i² of each cell i of a type (E_D = B × the batch-mean loss, the energy
    of A.3.1 divided by λ_w), C_i = (1/γ(t−1) + H_i)⁻¹ (A.3.2), ω = √(Σ_i (γ(t−1) − C_i)/γ(t−1)²) (A.3.9), s =
    ‖w_group‖₂/ω = √ℵ|w|/ω (A.3.8), γ = (1/Σ_{edges into the source node} Σ_o s + 1/s)⁻¹ (A.2.14; γ = s from a cell
    input), an op pruned once ½ ln(2πeγ) ≤ 0 and its w set to 0. Every recorded statistic is compared."""
    cls = get_method("bayesnas")
    prims = cls.primitives[:4]
    h = cls.Hyperparameters(update_every=1, hessian_mode="exact", lambda_w=0.05)
    torch.manual_seed(21)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=prims).double()
    method = cls(net, h, schedule=Schedule(epochs=1, steps_per_epoch=3, batch_size=B))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # a spread of |w| (Algorithm 2 starts at w = 1): some ops are pruned within the three updates
        for a in net.arch_parameters():
            a.copy_(torch.empty(a.shape, dtype=torch.float64).uniform_(-0.6, 1.4, generator=g))
    aleph = {"normal": 1, "reduce": 2}
    E, K = net.num_edges, len(prims)
    into = [[f for f, (_, j) in enumerate(net.edge_nodes) if j == i] for i, _ in net.edge_nodes]  # A.2.14's Σ_{i<j}
    gamma = {t: torch.ones(E, K, dtype=torch.float64) for t in aleph}
    omega = {t: torch.ones(E, K, dtype=torch.float64) for t in aleph}
    switch = {t: torch.ones(E, K, dtype=torch.float64) for t in aleph}
    alive = {t: torch.ones(E, K, dtype=torch.bool) for t in aleph}
    pruned = 0
    for (x, y) in batches(3, 8):
        method.likelihood_step(x, y)  # step 1 is round 2's test; here the update is checked on the w it leaves
        ref = Reference(net)
        w = {t: torch.where(alive[t], a.detach(), 0.0) for t, a in net.alphas().items()}
        H = {t: d * (B / h.lambda_w) for t, d in _cell_hessian_diagonals(ref, x, y, w).items()}
        stats = method.bayes_update(x, y)
        for t, n in aleph.items():
            assert H[t].shape[0] == n and (H[t] > 0).all(0).any()  # curvature exists for most ops: the update acts
            gp = gamma[t]
            C = gp / (1 + gp * H[t].clamp_min(0))  # A.3.2, elementwise for the diagonal Hessian
            # A.3.9; a pruned op has γ = 0, where the method records ω = ∞ (docs/bayesnas.md; its s is 0 either way)
            om = torch.where(gp == 0, math.inf, torch.sqrt(((gp - C) / gp ** 2).sum(0)))
            informative = (H[t] > 0).any(0)  # a Laplace approximation needs H > 0: elsewhere C, ω, s stay
            s = torch.where(w[t] == 0, 0.0, math.sqrt(n) * w[t].abs() / om)  # A.3.8; a pruned op (w = 0) has s = 0
            s = torch.where(informative | ~alive[t], s, switch[t])
            om = torch.where(informative, om, omega[t])
            upstream = torch.stack([s[f].sum() if f else torch.tensor(0.0, dtype=torch.float64) for f in into])
            has = torch.tensor([bool(f) for f in into]).unsqueeze(1)
            new_gamma = torch.where(has, 1 / (1 / upstream.unsqueeze(1) + 1 / s), s)  # A.2.14
            keep = alive[t] & ~(0.5 * torch.log(2 * math.pi * math.e * new_gamma) <= 0)
            pruned += int((alive[t] & ~keep).sum())
            torch.testing.assert_close(method.covariance[t], torch.where(informative, C.mean(0), method.covariance[t]))
            torch.testing.assert_close(method.omega[t], om, rtol=1e-9, atol=0)
            torch.testing.assert_close(method.prior_variance[t], s, rtol=1e-9, atol=0)
            torch.testing.assert_close(method.gamma[t], new_gamma, rtol=1e-9, atol=0)
            torch.testing.assert_close(method.curvature_used[t], H[t].sum(0), rtol=1e-9, atol=1e-9)
            assert torch.equal(method.alive[t], keep)
            assert bool((net.alphas()[t].detach()[~keep] == 0).all())  # step 5: w = 0 on pruned ops
            torch.testing.assert_close(net.alphas()[t].detach()[keep], w[t][keep], rtol=0, atol=0)  # reset_w off
            assert not bool(stats[V.HESSIAN_NONFINITE.path(cell=t)])
            gamma[t], omega[t], switch[t], alive[t] = new_gamma, om, s, keep
        method.steps_done += 1
    assert pruned > 0  # step 4 acted


# == SparseNAS: the proximal operator of eq 5 with AdamHAPG's per-weight and per-group thresholds ====================
@pytest.mark.parametrize("seed", range(4))
def test_hierarchical_prox_with_per_weight_and_per_group_thresholds_satisfies_the_optimality_conditions(seed):
    """Eq 5 = eq 10 ∘ eq 9 with AdamHAPG's thresholds (t_i = η_i λα per weight, t_n = median η λ(1 − α) per group) is the
    exact proximal operator of Ω(x) = Σ_i t_i|x_i| + Σ_n t_n √|n| ‖x_(n)‖₂, characterized without a solver:
    x = prox_Ω(z) ⟺ z − x ∈ ∂Ω(x). Per group n: if x_(n) = 0, some s ∈ [−1, 1]^n gives ‖z − t∘s‖ ≤ t_n √|n|, i.e.
    ‖soft(z, t)‖ ≤ t_n √|n|; else z_i − x_i = t_i sgn(x_i) + t_n √|n| x_i/‖x_(n)‖ where x_i ≠ 0 and |z_i| ≤ t_i where
    x_i = 0 (the group term's subgradient is 0 there). Also: x minimizes the objective against random perturbations."""
    from nasdiag.sparse import prox_sgl
    g = torch.Generator().manual_seed(seed)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3]).repeat_interleave(2).reshape(10, 2)  # (E=10, K=2)
    z = torch.randn(10, 2, generator=g, dtype=torch.float64)
    t1 = 0.6 * torch.rand(10, 2, generator=g, dtype=torch.float64)
    t2 = 0.5 * torch.rand(4, generator=g, dtype=torch.float64)
    t2[3] = 5.0  # one group certainly emptied
    x = prox_sgl(z, t1, t2, groups)
    for n in range(4):
        m = groups == n
        zn, xn, tn, size = z[m], x[m], t1[m], int(m.sum())
        if bool((xn == 0).all()):
            soft = torch.sign(zn) * (zn.abs() - tn).clamp_min(0)
            assert float(soft.norm()) <= float(t2[n]) * math.sqrt(size) + 1e-12
        else:
            on = xn != 0
            want = tn[on] * torch.sign(xn[on]) + t2[n] * math.sqrt(size) * xn[on] / xn.norm()
            torch.testing.assert_close((zn - xn)[on], want, rtol=1e-10, atol=1e-12)
            assert bool((zn[~on].abs() <= tn[~on] + 1e-12).all())
    assert bool((x[groups == 3] == 0).all()) and bool((x != 0).any())

    def objective(v):
        norms = torch.stack([v[groups == n].norm() * math.sqrt(int((groups == n).sum())) for n in range(4)])
        return 0.5 * ((v - z) ** 2).sum() + (t1 * v.abs()).sum() + (t2 * norms).sum()

    best = objective(x)
    for _ in range(200):
        assert float(objective(x + 1e-3 * torch.randn(10, 2, generator=g, dtype=torch.float64))) >= float(best) - 1e-15


# == resume equals uninterrupted, where earlier rounds did not look ===================================================
RESUME = {  # settings under which the state saved mid-run holds what round 2's first-order/no-pruning cases did not
    "xnas": ({"reward_bound": 2e-3, "zeta": 0.25}, ("skip_connect", "max_pool_3x3", "avg_pool_3x3", "sep_conv_3x3")),
    "sparsenas": ({"optimizer": "adamhapg", "alpha_lr": 0.05, "lambda_step": 0.2}, None),
    "bayesnas": ({"update_every": 1, "lambda_w": 0.05, "hessian_mode": "exact"}, None),
}


@pytest.mark.parametrize("name", sorted(RESUME))
def test_a_state_saved_after_wipeouts_prunes_or_second_order_steps_continues_bit_identically(name):
    """state_dict() after 3 of 6 steps (2 epochs of 3) through torch.save/load into a method built from other
    weights and another seed: XNAS after wipeouts (the forecasters' wipeout log, γ, alive masks, not-computed ops),
    SparseNAS's second-order AdamHAPG (Adam moments, HAPG momentum, w's momentum buffers in w'), BayesNAS with an
    update every step (switches pruned, the cleared α momentum). The last 3 steps and the epoch end equal the
    uninterrupted run's, bit for bit: every statistic, every parameter, the genotype."""
    import io

    cls = get_method(name)
    hp, prims = RESUME[name]
    prims = prims or cls.primitives[:4]
    schedule = Schedule(epochs=2, steps_per_epoch=3, batch_size=B)

    def build(seed):
        torch.manual_seed(seed)
        net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=prims).double()
        method = cls(net, cls.Hyperparameters(**hp), schedule=schedule, seed=seed)
        if name == "bayesnas":  # build() sets w = 1; a spread of |w| so that ops are pruned before the save
            with torch.no_grad():
                for a in net.arch_parameters():
                    order = torch.randperm(a.numel(), generator=torch.Generator().manual_seed(seed))
                    a.copy_(torch.linspace(-0.4, 1.2, a.numel(), dtype=torch.float64)[order].reshape(a.shape))
        return method

    data = batches(12, 60)
    pairs = list(zip(data[::2], data[1::2]))
    first = build(1)
    for pair in pairs[:3]:
        first.step(*pair)
    first.epoch_end(0)
    if name == "xnas":
        assert any(not f.alive.all() for f in first.forecasters.values())  # wipeouts before the save
    if name == "bayesnas":
        assert any(not m.all() for m in first.alive.values())  # ops pruned before the save
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = build(2)
    second.load_state_dict(torch.load(buffer, weights_only=False))
    for pair in pairs[3:]:
        s1, s2 = first.step(*pair), second.step(*pair)
        assert s1.keys() == s2.keys()
        for path in s1:
            assert torch.equal(s1[path], s2[path]), (name, path)
    first.epoch_end(1)
    second.epoch_end(1)
    for (n, a), b in zip(first.network.named_parameters(), second.network.parameters()):
        assert torch.equal(a, b), (name, n)
    assert first.genotype() == second.genotype()


@pytest.mark.parametrize("first_order", [True, False])
def test_sparsenas_arch_gradient_changes_no_state(first_order):
    """``SparseNAS.arch_gradient`` promises ∇_A l_val "computed without changing any state". First order it went through
    ``SearchMethod.cost``: a train-mode forward of the network itself, which moved every BatchNorm running statistic
    (and replaced the batch the Hessian diagnostics use). Now both orders leave buffers, parameters, .grad, the
    optimizers and the diagnostics' batch as they were; the first-order value is ∂l_val/∂A by autograd (Z = A)."""
    cls = get_method("sparsenas")
    torch.manual_seed(4)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=cls.primitives[:3]).double()
    method = cls(net, cls.Hyperparameters(first_order=first_order), schedule=Schedule(epochs=2, steps_per_epoch=2,
                                                                                      batch_size=B))
    train, val, other = batches(3, 17)
    method.step(train, val)  # optimizer states and the diagnostics' batch exist
    before = {n: b.clone() for n, b in net.named_buffers()}
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    last = getattr(method, "_last_arch_batch", None)
    state = copy.deepcopy(method.state_dict())
    net.zero_grad(set_to_none=True)
    grads = method.arch_gradient(train, other)
    for n, b in net.named_buffers():
        assert torch.equal(b, before[n]), n
    for n, p in net.named_parameters():
        assert torch.equal(p.detach(), params[n]) and p.grad is None, n
    assert getattr(method, "_last_arch_batch", None) is last
    _assert_same(method.state_dict()["objects"], state["objects"])  # optimizers, schedulers
    if first_order:
        ref = Reference(net)
        A = {t: a.detach().clone().requires_grad_(True) for t, a in net.alphas().items()}
        want = torch.autograd.grad(ref.loss(ref.w, *other[:1], other[1], A), list(A.values()))
        for (t, _), w in zip(A.items(), want):
            torch.testing.assert_close(grads[t], w, rtol=1e-10, atol=1e-14)


def test_xnas_step_past_its_horizon_is_one_search_error_before_anything_moves():
    """T (eq 4, the thresholds' horizon) is the run's steps × r_c. A step past it took its SGD step on w (and moved
    BatchNorm's statistics) and only then met the forecaster's HorizonError, whose advice ("create it with the horizon
    you need") is for the regret API, not a search: the state was left half-updated. Now it is one SearchError line,
    raised before w, the buffers or the forecasters change."""
    from nasdiag.search import SearchError
    cls = get_method("xnas")
    torch.manual_seed(0)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=("skip_connect", "avg_pool_3x3")).double()
    method = cls(net, schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=B))
    data = batches(6, 3)
    method.step(data[0], data[1])
    method.step(data[2], data[3])
    before = {n: t.clone() for n, t in net.state_dict().items()}
    forecasters = copy.deepcopy(method.forecasters.state_dict())
    with pytest.raises(SearchError) as excinfo:
        method.step(data[4], data[5])
    _one_line(excinfo, "all 2 steps", "horizon", "--epochs")
    for n, t in net.state_dict().items():
        assert torch.equal(t, before[n]), n
    _assert_same(method.forecasters.state_dict(), forecasters)


# == the derived mixed path: removed nodes take the ops leaving them along ==========================================
@pytest.mark.parametrize("name", ["sparsenas", "bayesnas"])
def test_a_removed_node_takes_the_ops_leaving_it_out_of_the_mixed_genotype(name):
    """SparseNAS: "the final architecture will be derived by removing the operations with zero weights and the nodes
    with all zero incoming weights". A removed node is x_j = 0, so the ops on the edges leaving it carry o(0) = 0: in
    the supernet they change nothing (checked here: the logits equal those with their weights zeroed). The genotype
    dropped the node from the output concatenation but kept those ops, e.g. ('sep_conv_3x3', 2, 3) with node 2 gone,
    and kept a node fed only by removed nodes. BayesNAS the same at the end of a run: A.2.14 switches such ops off
    only at the next update, which the last one does not have."""
    cls = get_method(name)
    prims = cls.primitives[:4]
    torch.manual_seed(5)
    net = Network(4, 3, 3, steps=3, multiplier=3, in_channels=1, primitives=prims).double()
    method = cls(net, schedule=Schedule(epochs=1, steps_per_epoch=1, batch_size=B))
    edges = net.edge_nodes  # (0,2) (1,2) (0,3) (1,3) (2,3) (0,4) (1,4) (2,4) (3,4)
    on = torch.zeros(len(edges), len(prims), dtype=torch.bool)  # node 2 without input: removed
    for edge in ((2, 3), (2, 4), (3, 4)):
        on[edges.index(edge)] = True  # node 3 fed only by node 2: removed too; their ops into node 4 go with them
    on[edges.index((1, 4)), 0] = True  # node 4 stays: one op from a cell input
    with torch.no_grad():
        for a in net.arch_parameters():
            a.copy_(torch.where(on, 0.5 + torch.rand(a.shape, dtype=torch.float64), 0.0))
    if name == "bayesnas":
        method.alive = {t: on.clone() for t in method.alive}
    genes = method.genotype()
    kept = [(prims[0], 1, 4)]
    assert genes.normal == kept and genes.reduce == kept
    assert genes.normal_concat == [4] and genes.reduce_concat == [4]
    # the dropped ops carry nothing: zeroing them leaves the supernet's function as it is
    x, _ = batches(1, 2)[0]
    alive_only = {t: torch.where(on, a.detach(), 0.0) for t, a in net.alphas().items()}
    dropped = torch.zeros_like(on)
    dropped[edges.index((1, 4)), 0] = True
    with torch.no_grad():
        full = net(x, alive_only)
        reduced = net(x, {t: torch.where(dropped, a, 0.0) for t, a in alive_only.items()})
    torch.testing.assert_close(full, reduced, rtol=1e-12, atol=1e-12)
