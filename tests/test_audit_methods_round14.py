"""Audit round 14 of the search methods: each method's update transcribed here, in float64, from its paper (SNAS,
DSNAS, BayesNAS §A, XNAS Algorithm 1) and plain torch, and compared over several steps with nasdiag's (no nasdiag
helper computes a reference).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.func import functional_call

from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network
from test_audit_methods_round11 import DartsArchitect

CLASSES = 3
SMOOTH = ("none", "skip_connect", "avg_pool_3x3", "sep_conv_3x3")


def _net(seed=0, prims=SMOOTH):
    torch.manual_seed(seed)
    return Network(4, CLASSES, 3, steps=2, multiplier=2, in_channels=1, primitives=prims).to(torch.float64)


def _batches(n, seed, B=4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (B,), generator=g))
            for _ in range(n)]


def _cosine(lr0, lr_min, epoch, epochs):
    return lr_min + (lr0 - lr_min) * (1 + math.cos(math.pi * epoch / epochs)) / 2


class SingleLevel:
    """A single-level search (SNAS, DSNAS) on a copy of the supernet as a function of (w, α, the step's sample):
    one forward at the mixing weights Z, ∂L/∂w and ∂L/∂α by autograd (SNAS Theorem 2: the credit assignment IS
    autograd through the relaxed sample), then Adam on α (L2 weight decay, DARTS's optimizer) and the w step:
    clip the gradient norm, momentum SGD with weight decay, where a parameter without a gradient this step (an op
    not on the sampled path) is not touched, as torch's SGD skips it. The random draws come from the method's own
    generator, seeded seed + 7919, in the order of the cell types."""

    def __init__(self, net, h, seed, epochs):
        self.net, self.h, self.epochs = copy.deepcopy(net), h, epochs
        arch = {id(a) for a in self.net.arch_parameters()}
        self.w = {n: p.detach().clone() for n, p in self.net.named_parameters() if id(p) not in arch}
        self.alpha = {t: a.detach().clone() for t, a in self.net.alphas().items()}
        self.types = {i: c.cell_type for i, c in enumerate(self.net.cells)}
        self.gen = torch.Generator().manual_seed(seed + 7919)
        self.buf, self.adam, self.epoch = {}, {}, 0

    def lr(self):
        return _cosine(self.h.w_lr, self.h.w_lr_min, self.epoch, self.epochs)

    def on_path(self, name, onehot):
        """False for a parameter of op k of edge e of a cell whose type's sample is not k there."""
        parts = name.split(".")
        if onehot is None or parts[0] != "cells" or "ops" not in parts:
            return True
        cell, edge, op = int(parts[1]), int(parts[parts.index("edges") + 1]), int(parts[parts.index("ops") + 1])
        return bool(onehot[self.types[cell]][edge, op] == 1)

    def step(self, x, y, mix, onehot=None):
        """mix(α) → {type: Z} differentiable in α; onehot: the sample where only its ops run (DSNAS)."""
        h = self.h
        w = {n: t.clone().requires_grad_(True) for n, t in self.w.items()}
        alpha = {t: a.clone().requires_grad_(True) for t, a in self.alpha.items()}
        buffers = {n: b.clone() for n, b in self.net.named_buffers()}
        loss = torch.nn.functional.cross_entropy(functional_call(self.net, {**w, **buffers}, (x, mix(alpha))), y)
        grads = torch.autograd.grad(loss, list(alpha.values()) + list(w.values()))
        ga = dict(zip(alpha, grads[:len(alpha)]))
        gw = {n: g for n, g in zip(w, grads[len(alpha):]) if self.on_path(n, onehot)}
        DartsArchitect.arch_update(self, ga)  # round 11's Adam with L2 decay, on this object's alpha, adam and h
        norm = torch.sqrt(sum((g ** 2).sum() for g in gw.values()))
        scale = torch.clamp(h.grad_clip / (norm + 1e-6), max=1.0)
        lr = self.lr()
        for n, g in gw.items():
            d = g * scale + h.w_weight_decay * self.w[n]
            self.buf[n] = d if n not in self.buf else h.w_momentum * self.buf[n] + d
            self.w[n] = self.w[n] - lr * self.buf[n]
        gnorm = torch.sqrt(sum((g ** 2).sum() for g in ga.values()))
        probs = {t: torch.softmax(a, -1) for t, a in self.alpha.items()}
        ent = torch.cat([-(p * p.log()).sum(-1) for p in probs.values()]).mean()
        return {"scalars/train_loss": loss.detach(), "scalars/alpha_grad_norm": gnorm, "scalars/entropy": ent,
                "scalars/w_lr": lr}


def _close(method, ref, stats, want, rtol):
    for t, a in method.network.alphas().items():
        torch.testing.assert_close(a.detach(), ref.alpha[t], rtol=rtol, atol=1e-13)
        torch.testing.assert_close(stats[f"arch/{t}/params"], ref.alpha[t], rtol=rtol, atol=1e-13)
        torch.testing.assert_close(stats[f"arch/{t}/probabilities"], torch.softmax(ref.alpha[t], -1), rtol=rtol, atol=1e-13)
    arch = {id(a) for a in method.network.arch_parameters()}
    got = {n: p.detach() for n, p in method.network.named_parameters() if id(p) not in arch}
    assert got.keys() == ref.w.keys()
    for n in got:
        torch.testing.assert_close(got[n], ref.w[n], rtol=rtol, atol=1e-13, msg=lambda m, n=n: f"{n}: {m}")
    for k, v in want.items():
        assert float(stats[k]) == pytest.approx(float(v), rel=rtol, abs=1e-13), k


# -- SNAS: Gumbel-softmax relaxed sample, τ annealed per epoch, autograd through the relaxation -------------------
def test_snas_five_steps_over_two_epoch_ends_follow_the_gumbel_softmax_relaxation_transcribed():
    """Z = softmax((α + G)/τ), G = −log(−log U) with U drawn in float64 from the method's generator; τ = τ0·decay^epoch;
    ∂L/∂α by autograd through Z (SNAS Theorem 2) and ∂L/∂w from the same backward. α, w, the recorded sample Z, τ,
    loss, gradient norm and entropy after each of 5 steps (2 per epoch) agree to 1e-10 (float64 reassociation)."""
    cls = get_method("snas")
    h = cls.Hyperparameters(alpha_lr=0.05, tau0=2.0, tau_decay=0.5, tau_min=0.6)
    net, seed = _net(1), 3
    method = cls(net, h, schedule=Schedule(epochs=3, steps_per_epoch=2, batch_size=4), seed=seed)
    ref = SingleLevel(net, h, seed, 3)
    tau = h.tau0
    for i, (x, y) in enumerate(_batches(5, 11)):
        if i and i % 2 == 0:
            method.epoch_end(i // 2 - 1)
            ref.epoch += 1
            tau = max(tau * h.tau_decay, h.tau_min)  # 2 → 1 → 0.6 (the floor)
        noise = {t: -torch.log(-torch.log(torch.rand(a.shape, generator=ref.gen, dtype=torch.float64)))
                 for t, a in ref.alpha.items()}
        z = {t: torch.softmax((ref.alpha[t] + noise[t]) / tau, -1) for t in ref.alpha}
        want = ref.step(x, y, lambda al: {t: torch.softmax((al[t] + noise[t]) / tau, -1) for t in al})
        stats = method.step((x, y))
        assert float(stats["scalars/temperature"]) == tau
        for t in z:
            torch.testing.assert_close(stats[f"arch/{t}/weights"], z[t], rtol=1e-12, atol=1e-14)
        _close(method, ref, stats, want, 1e-10)


# -- DSNAS: one-hot sample, only its ops computed, score-function credit ---------------------------------------
def test_dsnas_five_steps_over_two_epoch_ends_follow_the_one_hot_straight_through_update_transcribed():
    """Z ~ Cat(softmax(α)) by torch.multinomial on the method's generator; the forward at the one-hot Z; the α
    gradient C(Z^s)·∇_α log p_s with C(Z^s) = ∂L/∂Z_s by autograd at the one-hot point (straight-through: the
    forward is the one-hot, the gradient flows into the sampled gate and through log p); w updated only on the
    sampled path (the other ops' weights, momentum and weight decay untouched). 5 steps, 2 per epoch."""
    cls = get_method("dsnas")
    h = cls.Hyperparameters(alpha_lr=0.05)
    net, seed = _net(2), 4
    method = cls(net, h, schedule=Schedule(epochs=3, steps_per_epoch=2, batch_size=4), seed=seed)
    ref = SingleLevel(net, h, seed, 3)
    counts = {t: torch.zeros(a.shape, dtype=torch.int64) for t, a in ref.alpha.items()}
    observed = {t: [] for t in ref.alpha}
    for i, (x, y) in enumerate(_batches(5, 12)):
        if i and i % 2 == 0:
            method.epoch_end(i // 2 - 1)
            ref.epoch += 1
        p = {t: torch.softmax(a, -1) for t, a in ref.alpha.items()}
        onehot = {t: torch.zeros_like(p[t]).scatter_(-1, torch.multinomial(p[t], 1, generator=ref.gen), 1.0) for t in p}

        def mix(al):
            # straight-through: value Z (one-hot), ∂Z_s/∂α = Z_s ∇ log p_s, so ∂L/∂α = (∂L/∂Z_s)(Z − p)
            out = {}
            for t, a in al.items():
                logp = torch.log_softmax(a, -1)
                score = (onehot[t] * logp).sum(-1, keepdim=True)
                out[t] = onehot[t] * torch.exp(score - score.detach())
            return out

        # the per-cell costs C = ∂L/∂Z_cell at the one-hot (before the step), observed for the sampled ops only
        zs = [onehot[t].clone().requires_grad_(True) for t in ref.types.values()]
        buffers = {n: b.clone() for n, b in ref.net.named_buffers()}
        cell_loss = torch.nn.functional.cross_entropy(functional_call(ref.net, {**ref.w, **buffers}, (x, zs)), y)
        for t, c in zip(ref.types.values(), torch.autograd.grad(cell_loss, zs)):
            observed[t].append(torch.where(onehot[t] == 1, c, math.nan))
        want = ref.step(x, y, mix, onehot)
        stats = method.step((x, y))
        for t in onehot:
            counts[t] += onehot[t].long()
            torch.testing.assert_close(stats[f"sample/{t}/onehot"], onehot[t], rtol=0, atol=0)
            assert torch.equal(stats[f"sample/{t}/count"], counts[t])
        _close(method, ref, stats, want, 1e-10)
    # the DSNAS cost-mean protocol (module docstring, wiring supplement Fig. 6b): E[C | sampled], count = samples × cells
    diag = method.diagnostics()
    for t, rows in observed.items():
        obs = torch.stack(rows)  # (steps × cells, E, K), NaN where not sampled
        n = (~obs.isnan()).sum(0)
        assert torch.equal(diag[f"cost/{t}/count"], n) and torch.equal(n, counts[t] * list(ref.types.values()).count(t))
        mean = obs.nansum(0) / n
        torch.testing.assert_close(diag[f"cost/{t}/mean"], mean, rtol=1e-9, atol=1e-15, equal_nan=True)
        var = torch.where(n > 0, ((obs - mean) ** 2).nansum(0) / n, math.nan)
        torch.testing.assert_close(diag[f"cost/{t}/var"][n > 0], var[n > 0], rtol=1e-7, atol=1e-18)


# -- XNAS: Algorithm 1 (EG with wipeout) over 20 steps, wipeouts included -----------------------------------------
@pytest.mark.parametrize("zeta", [1.3, 0.3])
def test_xnas_twenty_steps_follow_algorithm_1_with_its_wipeouts_regret_and_bound(zeta):
    """Algorithm 1 transcribed on a copy of the supernet: line 4, SGD on w with the search-train loss at u (an op
    wiped out is not computed: its weights untouched); line 8, R = −∂L_val/∂Z at u by autograd, one round per cell of
    the type in network order, clipped to [−L, L]; line 9, ln v += ηR over the alive experts; line 11-12, θ_t = max v ·
    exp(−2ηL(T − t)ζ), every v < θ_t removed; eq 28, Γ_t = 1 + wiped mass / kept mass; eq 31 over the alive experts
    (mixture before each round); eq 3, ηtL²/2 + (ln N − ln γ_t)/η; η = η*·scale with η* = sqrt(2 ln N/(T L²)) (eq 4).
    L = 1e-4 makes almost every reward ±L, so experts of opposite sign part by 2ηL per round and wipeouts must
    happen inside the 20 steps (T = 21 steps). With ζ < 1 (no Lemma 1) eq 3 still bounds the regret against the
    survivors (the proof's (23) over I_t)."""
    cls = get_method("xnas")
    L, steps = 1e-4, 21
    h = cls.Hyperparameters(reward_bound=L, zeta=zeta, lr_scale=3.0)
    net = _net(5)
    method = cls(net, h, schedule=Schedule(epochs=1, steps_per_epoch=steps, batch_size=4))
    ref = copy.deepcopy(net)
    arch = {id(a) for a in ref.arch_parameters()}
    w = {n: p.detach().clone() for n, p in ref.named_parameters() if id(p) not in arch}
    buffers = {n: b.clone() for n, b in ref.named_buffers()}
    types = [c.cell_type for c in ref.cells]
    N = len(ref.primitives)
    E = ref.num_edges
    logv = {t: torch.zeros(E, N, dtype=torch.float64) for t in set(types)}
    alive = {t: torch.ones(E, N, dtype=torch.bool) for t in logv}
    lng = {t: torch.zeros(E, dtype=torch.float64) for t in logv}
    tally_f = {t: torch.zeros(E, dtype=torch.float64) for t in logv}
    tally_e = {t: torch.zeros(E, N, dtype=torch.float64) for t in logv}
    rounds = {t: 0 for t in logv}
    T = {t: steps * types.count(t) for t in logv}
    eta = {t: 3.0 * math.sqrt(2 * math.log(N) / (T[t] * L * L)) for t in logv}
    buf, wiped_any = {}, 0
    removed = {t: torch.full((E, N), math.nan, dtype=torch.float64) for t in logv}
    data = _batches(40, 21)
    for step in range(20):
        (x, y), (xv, yv) = data[2 * step], data[2 * step + 1]
        u = {t: torch.softmax(v, -1) for t, v in logv.items()}

        def on_path(name):
            parts = name.split(".")
            if parts[0] != "cells" or "ops" not in parts:
                return True
            t = types[int(parts[1])]
            return bool(alive[t][int(parts[parts.index("edges") + 1]), int(parts[parts.index("ops") + 1])])

        # line 4
        wl = {n: t.clone().requires_grad_(True) for n, t in w.items()}
        loss = torch.nn.functional.cross_entropy(functional_call(ref, {**wl, **buffers}, (x, u)), y)
        gw = {n: g for n, g in zip(wl, torch.autograd.grad(loss, list(wl.values()))) if on_path(n)}
        norm = torch.sqrt(sum((g ** 2).sum() for g in gw.values()))
        scale = torch.clamp(h.grad_clip / (norm + 1e-6), max=1.0)
        for n, g in gw.items():
            d = g * scale + h.w_weight_decay * w[n]
            buf[n] = d if n not in buf else h.w_momentum * buf[n] + d
            w[n] = w[n] - h.w_lr * buf[n]
        # lines 5-8: one Z leaf per cell
        zs = [u[t].clone().requires_grad_(True) for t in types]
        val = torch.nn.functional.cross_entropy(functional_call(ref, {**w, **buffers}, (xv, zs)), yv)
        costs = torch.autograd.grad(val, zs)
        wiped_now = {t: torch.zeros(E, N, dtype=torch.bool) for t in logv}
        at_start = {t: a.clone() for t, a in alive.items()}
        recorded = {t: [] for t in logv}
        clipped = sum(int(((c.abs() > L) & at_start[t]).sum()) for t, c in zip(types, costs))
        counted = sum(int(at_start[t].sum()) for t in types)
        for cell_type, c in zip(types, costs):  # one round per cell, network order
            t = cell_type
            R = (-c).clamp(-L, L)
            recorded[t].append(torch.where(at_start[t], R, 0.0))  # an op not computed has cost 0
            rounds[t] += 1
            mix = torch.softmax(logv[t], -1)
            tally_f[t] += (mix * R).sum(-1)
            tally_e[t] += torch.where(alive[t], R, 0.0)
            logv[t] = torch.where(alive[t], logv[t] + eta[t] * R, -math.inf)
            top = logv[t].amax(-1, keepdim=True)
            margin = 2 * eta[t] * L * (T[t] - rounds[t]) * zeta
            # v < θ strictly: with rewards clipped to ±L an expert can sit exactly on θ (a sum of ±ηL equal to the
            # margin), which rounding must not remove; 1e-9 relative is far below one round's ηL
            out = alive[t] & (logv[t] < top - margin - 1e-9 * (top.abs() + margin + 1))
            if out.any():
                kept, gone = alive[t] & ~out, out
                lng[t] += torch.log1p(torch.logsumexp(logv[t].masked_fill(~gone, -math.inf), -1).exp()
                                      / torch.logsumexp(logv[t].masked_fill(~kept, -math.inf), -1).exp())
                alive[t] = kept
                removed[t] = torch.where(out, logv[t], removed[t])  # recorded as the ln v at its removal
                logv[t] = logv[t].masked_fill(out, -math.inf)
                wiped_now[t] |= out
        stats = method.step((x, y), (xv, yv))
        assert float(stats["scalars/train_loss"]) == pytest.approx(float(loss.detach()), rel=1e-10)
        assert float(stats["scalars/val_loss"]) == pytest.approx(float(val.detach()), rel=1e-10)
        assert float(stats["scalars/reward_clip_fraction"]) == pytest.approx(clipped / counted, rel=1e-15)
        on = sum(int(at_start[t].sum()) for t in types)
        assert float(stats["scalars/active_fraction"]) == pytest.approx(on / (len(types) * E * N), rel=1e-15)
        for t in logv:
            torch.testing.assert_close(stats[f"regret/{t}/rewards"], torch.stack(recorded[t]), rtol=1e-9, atol=1e-14)
            assert torch.equal(stats[f"regret/{t}/alive"].cpu(), alive[t]), (step, t)
            assert torch.equal(stats[f"regret/{t}/wipeouts"].cpu(), wiped_now[t]), (step, t)
            torch.testing.assert_close(stats[f"arch/{t}/probabilities"], torch.softmax(logv[t], -1), rtol=1e-9, atol=1e-14)
            lw = stats[f"regret/{t}/log_weights"]
            torch.testing.assert_close(lw, torch.where(alive[t], logv[t], removed[t]), rtol=1e-9, atol=1e-12)
            surv = tally_e[t].masked_fill(~alive[t], -math.inf).amax(-1) - tally_f[t]
            torch.testing.assert_close(stats[f"regret/{t}/regret"], surv, rtol=1e-8, atol=1e-14)
            torch.testing.assert_close(stats[f"regret/{t}/gamma"], lng[t].exp(), rtol=1e-10, atol=0)
            bound = eta[t] * rounds[t] * L * L / 2 + (math.log(N) - lng[t]) / eta[t]
            torch.testing.assert_close(stats[f"regret/{t}/bound"], bound, rtol=1e-10, atol=0)
            assert (surv <= bound).all()
            wiped_any += int(wiped_now[t].sum())
        arch_ = {id(a) for a in method.network.arch_parameters()}
        for n, p in method.network.named_parameters():
            if id(p) not in arch_:
                torch.testing.assert_close(p.detach(), w[n], rtol=1e-9, atol=1e-12, msg=lambda m, n=n: f"{step} {n}: {m}")
    assert wiped_any >= 3  # the wipeouts the test is about happened


# -- BayesNAS: Algorithm 2 steps 1-5 (A.3.1, A.3.2, A.3.8, A.3.9, A.2.14, entropy pruning) ---------------------
def _ggn_diag_per_cell(net, params, x, zs):
    """diag of the Gauss-Newton matrix Σ_b J_bᵀ (diag p_b − p_b p_bᵀ)/B J_b of the batch-mean cross-entropy with
    respect to each cell's own Z, zs[i] (J_b = ∂logits_b/∂Z_i by autograd; the samples are independent: LayerNorm)."""

    def logits_of(*z):
        return functional_call(net, params, (x, list(z)))

    jac = torch.autograd.functional.jacobian(logits_of, tuple(z.clone() for z in zs))
    p = torch.softmax(logits_of(*zs).detach(), -1)
    Hb = (torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)) / x.shape[0]  # (B, D, D)
    return [torch.einsum("bcek,bcd,bdek->ek", J, Hb, J) for J in jac]


def test_bayesnas_four_steps_with_two_updates_follow_algorithm_2_transcribed():
    """Step 1: SGD (momentum, cosine rate) on 𝒲 (weight decay λ, clipped) and on w with ∂L/∂Z + λ_w √ℵ ω sign(w), pruned
    ops not computed; steps 2-5 at each epoch's last step: H_i = (B/λ_w)·diag GGN of each cell's own Z (E_D/λ_w,
    E_D the summed loss), C_i = (1/γ + H_i)⁻¹ (A.3.2), ω = √(Σ_i (γ − C_i)/γ²) (A.3.9), s = ‖w_group‖/ω = √ℵ|w|/ω
    (A.3.8), γ = (1/Σ_parents Σ_o s + 1/s)⁻¹ (A.2.14), prune where ½ln(2πeγ) ≤ 0, w ← 0 there, momentum of w reset.
    A LayerNorm supernet, so that the GGN of the batch is the per-sample sum the reference computes."""
    cls = get_method("bayesnas")
    h = cls.Hyperparameters(w_lr=0.3, init_gamma=0.006)  # small γ(0): ops are pruned at the first update
    torch.manual_seed(7)
    net = Network(4, CLASSES, 3, steps=2, multiplier=2, in_channels=1, primitives=cls.primitives,
                  norm="layer").to(torch.float64)
    epochs, per_epoch = 2, 2
    method = cls(net, h, schedule=Schedule(epochs=epochs, steps_per_epoch=per_epoch, batch_size=4))
    ref = copy.deepcopy(method.network)  # after build: w(0) = 1
    arch = {id(a) for a in ref.arch_parameters()}
    W = {n: p.detach().clone() for n, p in ref.named_parameters() if id(p) not in arch}
    types = [c.cell_type for c in ref.cells]
    aleph = {t: types.count(t) for t in set(types)}
    E, K = ref.num_edges, len(ref.primitives)
    # DARTS edge order: node j = 2.. takes an edge from every earlier node
    pairs = [(i, j + 2) for j in range(ref.steps) for i in range(j + 2)]
    parents = [[f for f, (_, dst) in enumerate(pairs) if dst == pairs[e][0]] for e in range(E)]
    wv = {t: torch.ones(E, K, dtype=torch.float64) for t in aleph}
    gamma = {t: torch.full((E, K), h.init_gamma, dtype=torch.float64) for t in aleph}
    omega = {t: torch.ones(E, K, dtype=torch.float64) for t in aleph}
    s = {t: torch.full((E, K), h.init_gamma, dtype=torch.float64) for t in aleph}
    cov = {t: torch.full((E, K), h.init_gamma, dtype=torch.float64) for t in aleph}
    curv = {t: torch.zeros(E, K, dtype=torch.float64) for t in aleph}
    alive = {t: torch.ones(E, K, dtype=torch.bool) for t in aleph}
    bufW, bufw, pruned = {}, {}, 0
    data = _batches(4, 31)
    for step, (x, y) in enumerate(data):
        epoch = step // per_epoch
        if step and step % per_epoch == 0:
            method.epoch_end(epoch - 1)
        lr = _cosine(h.w_lr, h.w_lr_min, epoch, epochs)
        Z = Z_step = {t: torch.where(alive[t], wv[t], 0.0) for t in aleph}

        def on_path(name):
            parts = name.split(".")
            if parts[0] != "cells" or "ops" not in parts:
                return True
            t, e, k = types[int(parts[1])], int(parts[parts.index("edges") + 1]), int(parts[parts.index("ops") + 1])
            return bool(alive[t][e, k]) or (not alive[t][e].any() and k == 0)

        Wl = {n: v.clone().requires_grad_(True) for n, v in W.items()}
        Zl = {t: z.clone().requires_grad_(True) for t, z in Z.items()}
        loss = torch.nn.functional.cross_entropy(functional_call(ref, Wl, (x, Zl)), y)
        grads = torch.autograd.grad(loss, list(Wl.values()) + list(Zl.values()))
        gW = {n: g for n, g in zip(Wl, grads[:len(Wl)]) if on_path(n)}
        gZ = dict(zip(Zl, grads[len(Wl):]))
        norm = torch.sqrt(sum((g ** 2).sum() for g in gW.values()))
        scale = torch.clamp(h.grad_clip / (norm + 1e-6), max=1.0)
        for n, g in gW.items():
            d = g * scale + h.w_weight_decay * W[n]
            bufW[n] = d if n not in bufW else h.w_momentum * bufW[n] + d
            W[n] = W[n] - lr * bufW[n]
        for t in aleph:
            d = torch.where(alive[t], gZ[t] + h.lambda_w * math.sqrt(aleph[t]) * omega[t] * torch.sign(wv[t]), 0.0)
            bufw[t] = d if t not in bufw else h.w_momentum * bufw[t] + d
            wv[t] = wv[t] - lr * bufw[t]
        updated = (step + 1) % per_epoch == 0
        if updated:
            Z = {t: torch.where(alive[t], wv[t], 0.0) for t in aleph}
            per_cell = {t: [] for t in aleph}
            for t, H in zip(types, _ggn_diag_per_cell(ref, W, x, [Z[t] for t in types])):
                per_cell[t].append(H * x.shape[0] / h.lambda_w)  # E_D/λ_w: the summed loss over λ_w
            for t in aleph:
                H = torch.stack(per_cell[t])  # (ℵ, E, K)
                informative = (H > 0).any(0)
                g = gamma[t]
                C = 1 / (1 / g + H)
                om2 = ((g - C) / g ** 2).sum(0)
                om = om2.sqrt()
                sw = torch.where(Z[t] == 0, 0.0, math.sqrt(aleph[t]) * Z[t].abs() / om)
                cov[t] = torch.where(informative, C.mean(0), cov[t])
                omega[t] = torch.where(informative & alive[t], om, torch.where(alive[t], omega[t], math.inf))
                s[t] = torch.where(informative | ~alive[t], sw, s[t])
                curv[t] = H.sum(0)
            for t in aleph:
                up = torch.stack([s[t][parents[e]].sum() if parents[e] else torch.tensor(math.inf, dtype=torch.float64)
                                  for e in range(E)]).unsqueeze(-1)
                gamma[t] = 1 / (1 / up + 1 / s[t])
                before = alive[t]
                alive[t] = alive[t] & ~(0.5 * torch.log(2 * math.pi * math.e * gamma[t]) <= 0)
                pruned += int((before & ~alive[t]).sum())
                wv[t] = torch.where(alive[t], wv[t], 0.0)
            bufw = {}
        stats = method.step((x, y), (x, y))
        assert float(stats["scalars/train_loss"]) == pytest.approx(float(loss.detach()), rel=1e-10)
        assert bool(stats["bayes/updated"]) == updated
        for t in aleph:
            torch.testing.assert_close(method.network.alphas()[t].detach(), wv[t], rtol=1e-9, atol=1e-12)
            share = gamma[t] * alive[t]  # each alive op's share of its edge's prior variance
            torch.testing.assert_close(stats[f"arch/{t}/probabilities"], share / share.sum(-1, keepdim=True), rtol=1e-8, atol=1e-14)
            torch.testing.assert_close(stats[f"arch/{t}/weights"], Z_step[t], rtol=1e-9, atol=1e-12)  # its forward's Z
            assert torch.equal(stats[f"bayes/{t}/switch"].cpu(), alive[t]), (step, t)
            every = torch.ones_like(alive[t])  # C, ω and H only where alive: a pruned op's are left as they were
            for key, want, on in (("gamma", gamma[t], every), ("prior_variance", s[t], every), ("covariance", cov[t], alive[t]),
                                  ("omega", omega[t], alive[t]), ("curvature", curv[t], alive[t])):
                got = stats[f"bayes/{t}/{key}"]
                torch.testing.assert_close(got[on], want[on], rtol=1e-8, atol=1e-12,
                                           msg=lambda m, key=key, t=t: f"step {step} {t} {key}: {m}")
        arch_ = {id(a) for a in method.network.arch_parameters()}
        for n, p_ in method.network.named_parameters():
            if id(p_) not in arch_:
                torch.testing.assert_close(p_.detach(), W[n], rtol=1e-9, atol=1e-12, msg=lambda m, n=n: f"{step} {n}: {m}")
    assert pruned >= 3  # the pruning the test is about happened


# -- ProxylessNAS: binary gates, two-path α update (eq 4 over the sampled pair) and the rescaling ------------------
def test_proxyless_four_steps_follow_the_two_path_binary_gate_update_transcribed():
    """w step: one path per edge ~ Cat(p), only it computed, SGD (clip, momentum, weight decay; other paths' weights
    untouched). α step: two paths without replacement, one gated on with p renormalised over the pair (the draws in
    that order from the method's generator); ∂L/∂α_i = Σ_j ∂L/∂g_j ∂p'_j/∂α_i (ProxylessNAS eq 4 over the pair, p' the
    softmax over it; by autograd of ⟨C, p'(α)⟩, C = ∂L/∂g by autograd at the gates); Adam (β1 = 0, no decay); then
    the pair's α shifted so that Σ_S exp α is what it was (the unsampled paths' probabilities unchanged)."""
    cls = get_method("proxyless")
    h = cls.Hyperparameters(alpha_lr=0.2)
    net, seed = _net(8), 6
    method = cls(net, h, schedule=Schedule(epochs=2, steps_per_epoch=2, batch_size=4), seed=seed)
    ref = SingleLevel(net, h, seed, 2)
    data = _batches(8, 41)
    for step in range(4):
        if step == 2:
            method.epoch_end(0)
            ref.epoch += 1
        train, val = data[2 * step], data[2 * step + 1]
        p = {t: torch.softmax(a, -1) for t, a in ref.alpha.items()}
        onehot = {t: torch.zeros_like(p[t]).scatter_(-1, torch.multinomial(p[t], 1, generator=ref.gen), 1.0) for t in p}
        # the w step: SingleLevel's with α held (a zero α rate is not a hyperparameter: keep α and Adam aside)
        alpha, adam = dict(ref.alpha), dict(ref.adam)
        want = ref.step(*train, lambda al: {t: onehot[t] + 0 * a for t, a in al.items()}, onehot)
        ref.alpha, ref.adam = alpha, adam
        pairs, gates = {}, {}
        for t in p:
            idx = torch.multinomial(p[t], 2, replacement=False, generator=ref.gen)
            pick = torch.multinomial(p[t].gather(-1, idx), 1, generator=ref.gen)
            pairs[t] = torch.zeros_like(p[t], dtype=torch.bool).scatter_(-1, idx, True)
            gates[t] = torch.zeros_like(p[t]).scatter_(-1, idx.gather(-1, pick), 1.0)
        buffers = {n: b.clone() for n, b in ref.net.named_buffers()}
        gl = {t: g.clone().requires_grad_(True) for t, g in gates.items()}
        val_loss = torch.nn.functional.cross_entropy(functional_call(ref.net, {**ref.w, **buffers}, (val[0], gl)), val[1])
        C = dict(zip(gl, torch.autograd.grad(val_loss, list(gl.values()))))
        b1, b2 = h.alpha_betas
        gsq = 0.0
        for t, a in ref.alpha.items():
            al = a.clone().requires_grad_(True)
            pp = torch.softmax(al.masked_fill(~pairs[t], -math.inf), -1)
            (g,) = torch.autograd.grad((C[t].detach() * pp).sum(), al)
            gsq = gsq + (g ** 2).sum()
            m, v, k = ref.adam.get(t, (torch.zeros_like(a), torch.zeros_like(a), 0))
            m, v, k = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, k + 1
            ref.adam[t] = (m, v, k)
            new = a - h.alpha_lr * (m / (1 - b1 ** k)) / ((v / (1 - b2 ** k)).sqrt() + 1e-8)
            lse = lambda z: torch.logsumexp(z.masked_fill(~pairs[t], -math.inf), -1, keepdim=True)  # noqa: E731
            ref.alpha[t] = torch.where(pairs[t], new - (lse(new) - lse(a)), a)
            outside = ~pairs[t]
            torch.testing.assert_close(torch.softmax(ref.alpha[t], -1)[outside], p[t][outside], rtol=1e-12, atol=1e-15)
        stats = method.step(train, val)
        assert float(stats["scalars/train_loss"]) == pytest.approx(float(want["scalars/train_loss"]), rel=1e-10)
        assert float(stats["scalars/val_loss"]) == pytest.approx(float(val_loss.detach()), rel=1e-10)
        for t in p:
            assert torch.equal(stats[f"sample/{t}/onehot"], gates[t]) and torch.equal(stats[f"sample/{t}/paths"], pairs[t].double())
        probs = [torch.softmax(a, -1) for a in ref.alpha.values()]
        _close(method, ref, stats, {"scalars/alpha_grad_norm": gsq.sqrt(),
                                    "scalars/entropy": torch.cat([-(q * q.log()).sum(-1) for q in probs]).mean()}, 1e-10)


# -- every method's genotype against the DARTS / mixed-path rule applied to what it recorded -----------------------
def _pairs(steps):
    return [(i, j + 2) for j in range(steps) for i in range(j + 2)]


def _darts_rule(weights, steps, prims, eligible=None):
    """DARTS's genotype: per node the two incoming edges whose strongest op other than none (among the eligible) is
    strongest, with that op; fewer than two candidates: the rest of the places are ('none', i) on the other edges,
    strongest none first, where none is eligible (nasdiag's documented filler)."""
    E, K = weights.shape
    eligible = torch.ones(E, K, dtype=torch.bool) if eligible is None else eligible
    genes, e0 = [], 0
    for node in range(steps):
        best = []
        for i in range(node + 2):
            ops = [k for k in range(K) if prims[k] != "none" and eligible[e0 + i, k]]
            if ops:
                k = max(ops, key=lambda k: (float(weights[e0 + i, k]), -k))
                best.append((-float(weights[e0 + i, k]), i, k))
        best.sort()
        chosen = [(prims[k], i) for _, i, k in best[:2]]
        if len(chosen) < 2 and "none" in prims:
            z = prims.index("none")
            rest = sorted((-float(weights[e0 + i, z]), i) for i in range(node + 2)
                          if i not in [c[1] for c in chosen] and eligible[e0 + i, z])
            chosen += [("none", i) for _, i in rest[:2 - len(chosen)]]
        genes += chosen
        e0 += node + 2
    return genes


def _mixed_rule(weights, steps, prims):
    """Every op with a non-zero weight other than none, in (edge, op) order, without the nodes no kept op reaches
    (from a cell input or a kept node), the ops leaving them, and their places in the output concatenation."""
    pairs = _pairs(steps)
    ops = [(prims[k], i, j) for e, (i, j) in enumerate(pairs) for k in range(len(prims))
           if weights[e, k] != 0 and prims[k] != "none"]
    kept = {0, 1}
    for j in range(2, steps + 2):
        if any(jj == j and i in kept for _, i, jj in ops):
            kept.add(j)
    return [o for o in ops if o[1] in kept and o[2] in kept], sorted(kept - {0, 1})


@pytest.mark.parametrize("name", ["darts", "darts2", "snas", "dsnas", "proxyless", "xnas", "asmnas", "sparsenas",
                                  "bayesnas"])
def test_every_methods_genotype_is_the_rule_applied_to_its_recorded_architecture(name):
    """Three steps of each method (fast α rates so that its architecture moves), then genotype() against the rule
    applied by hand to the last step's records: softmax of arch/<cell>/params (DARTS family), the EG weights of
    regret/<cell>/log_weights over regret/<cell>/alive (XNAS), the selection counts (ASM-NAS), the non-zero
    arch/<cell>/params without removed nodes (SparseNAS) and the bayes/<cell>/switch ops (BayesNAS)."""
    cls = get_method(name)
    fast = {"alpha_lr": 0.3} if "alpha_lr" in cls.Hyperparameters.keys() else {}
    if name == "xnas":
        fast = {"lr_scale": 30.0, "reward_bound": 1e-3}
    prims = cls.primitives[:5] if cls.primitives else ("none",) + SMOOTH[1:] + ("max_pool_3x3",)
    if name == "bayesnas":
        prims = cls.primitives
    net = _net(9, prims=prims)
    method = cls(net, cls.Hyperparameters(**fast), schedule=Schedule(epochs=1, steps_per_epoch=3, batch_size=4), seed=2)
    data = _batches(6, 51)
    for k in range(3):
        stats = method.step(data[2 * k], data[2 * k + 1])
    steps = net.steps
    genotype = method.genotype()
    for t in ("normal", "reduce"):
        if name in ("darts", "darts2", "snas", "dsnas", "proxyless"):
            want = _darts_rule(torch.softmax(stats[f"arch/{t}/params"], -1), steps, prims)
        elif name == "xnas":
            alive = stats[f"regret/{t}/alive"]
            want = _darts_rule(torch.softmax(stats[f"regret/{t}/log_weights"].masked_fill(~alive, -math.inf), -1), steps,
                               prims, alive)
        elif name == "asmnas":
            method.evaluate(data[:2])
            counts = method.epoch_statistics()[f"attention/{t}/count"]
            genotype = method.genotype()
            want = _darts_rule(counts / counts.sum(-1, keepdim=True), steps, prims, counts > 0)
        else:
            on = stats[f"arch/{t}/params"] if name == "sparsenas" else stats[f"bayes/{t}/switch"].double()
            want, concat = _mixed_rule(on, steps, prims)
            assert list(getattr(genotype, f"{t}_concat")) == concat
        assert list(map(tuple, getattr(genotype, t))) == want, (t, getattr(genotype, t), want)


# -- ASM-NAS: eq 4.2-4.5 on every edge, one single-level SGD step on (w, Θ), the argmax-count selection ----------------
def test_asmnas_one_step_and_selection_follow_eq_4_2_to_4_5_transcribed():
    """On a copy of the supernet, each attention edge's output is checked against eq 4.2-4.5 written here from the
    Linear layers' raw matrices (e^k the mean of y^k over C, H, W; z = σ(Θ4 δ(Θ3 δ(Θ2 δ(Θ1 E)))); a = softmax(z);
    Σ a^k y^k); then (w, Θ) take one SGD step (clip, momentum, weight decay) of the batch-mean loss by autograd;
    attention/<cell>/mean is the mean of a over the cells of the type and the batch; the selection counts the
    per-sample argmax of a (Algorithm 1, lines 6-12)."""
    from nasdiag.supernet.attention import AttentionMixedOp

    cls = get_method("asmnas")
    h = cls.Hyperparameters()
    method = cls(_net(10), h, schedule=Schedule(epochs=2, steps_per_epoch=1, batch_size=4))
    ref = copy.deepcopy(method.network)
    taps, costs = [], {}

    def check(module, args, out):
        x, weights = args[0], args[1] if len(args) > 1 else None
        assert weights is None
        ys = [op(x) for op in module.ops]
        E_ = torch.stack([y.mean(dim=(1, 2, 3)) for y in ys], -1)
        lin = [m for m in module.attention.net if isinstance(m, torch.nn.Linear)]
        z = E_
        for n, m in enumerate(lin):
            z = z @ m.weight.T + m.bias
            z = torch.relu(z) if n < 3 else torch.sigmoid(z)
        a = torch.softmax(z, -1)
        torch.testing.assert_close(out, sum(a[:, k, None, None, None] * y for k, y in enumerate(ys)), rtol=1e-12, atol=1e-14)
        taps.append(a.detach())
        if out.requires_grad:  # C = ∂L/∂a per sample = <∂L/∂(edge output), y^k> (wiring supplement §2)
            out.register_hook(lambda g, ys=[y.detach() for y in ys], n=len(taps) - 1: costs.__setitem__(
                n, torch.stack([(g * y).flatten(1).sum(1) for y in ys], -1)))  # keyed by the forward's edge order

    hooks = [m.register_forward_hook(check) for m in ref.modules() if isinstance(m, AttentionMixedOp)]
    assert len(hooks) == len(ref.cells) * ref.num_edges
    x, y = _batches(1, 61)[0]
    params = [p for p in ref.parameters() if p.requires_grad and all(p is not a for a in ref.arch_parameters())]
    loss = torch.nn.functional.cross_entropy(ref(x, [[None] * ref.num_edges for _ in ref.cells]), y)
    grads = torch.autograd.grad(loss, params)
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
    scale = torch.clamp(h.grad_clip / (norm + 1e-6), max=1.0)
    want = [p.detach() - h.w_lr * (g * scale + h.w_weight_decay * p.detach()) for p, g in zip(params, grads)]
    stats = method.step((x, y))
    assert float(stats["scalars/train_loss"]) == pytest.approx(float(loss.detach()), rel=1e-12)
    got = [p for p in method.network.parameters() if p.requires_grad and all(p is not a for a in method.network.arch_parameters())]
    assert len(got) == len(want)
    for p, w_ in zip(got, want):
        torch.testing.assert_close(p.detach(), w_, rtol=1e-10, atol=1e-13)
    types = [c.cell_type for c in ref.cells]
    per_cell = [torch.stack(taps[i * ref.num_edges:(i + 1) * ref.num_edges]) for i in range(len(ref.cells))]  # (E, B, K)
    assert sorted(costs) == list(range(len(ref.cells) * ref.num_edges))
    by_edge = {(n // ref.num_edges, n % ref.num_edges): c for n, c in costs.items()}  # cells, then edges, in order
    diag = method.diagnostics()
    for t in set(types):
        mean = torch.stack([a for a, c in zip(per_cell, types) if c == t]).mean(dim=(0, 2))
        torch.testing.assert_close(stats[f"attention/{t}/mean"], mean, rtol=1e-12, atol=1e-14)
        cells = [i for i, c in enumerate(types) if c == t]  # the batch cost of each cell, one observation per cell
        obs = torch.stack([torch.stack([by_edge[(i, e)].sum(0) for e in range(ref.num_edges)]) for i in cells])
        torch.testing.assert_close(diag[f"cost/{t}/mean"], obs.mean(0), rtol=1e-9, atol=1e-15)
    # selection: the copy takes the same step by hand, then both count argmaxes over the same two batches
    with torch.no_grad():
        for p, w_ in zip(params, want):
            p.copy_(w_)
    taps.clear()
    loader = _batches(2, 62)
    method.evaluate(loader)
    with torch.no_grad():
        for xb, _ in loader:
            ref(xb, [[None] * ref.num_edges for _ in ref.cells])
    counts = {t: torch.zeros(ref.num_edges, len(ref.primitives), dtype=torch.int64) for t in set(types)}
    for b in range(len(loader)):
        for i, t in enumerate(types):
            a = torch.stack(taps[(b * len(types) + i) * ref.num_edges:(b * len(types) + i + 1) * ref.num_edges])
            counts[t] += torch.nn.functional.one_hot(a.argmax(-1), len(ref.primitives)).sum(1)
    for t in counts:
        assert torch.equal(method.epoch_statistics()[f"attention/{t}/count"], counts[t])
    for hk in hooks:
        hk.remove()


@pytest.mark.filterwarnings("ignore:.*NaN/inf")  # cost means of ops never observed (wiped out, never selected)
@pytest.mark.parametrize("name", ["dsnas", "xnas", "asmnas"])
def test_the_run_objects_genotype_is_the_rule_applied_to_the_records_last_row(name, tmp_path, monkeypatch):
    """run() returns SearchResult.genotype: the rule applied to the architecture the record's last row holds (softmax
    of arch/<cell>/params; XNAS's EG weights over the alive experts; ASM-NAS's last selection counts, recorded at the
    epoch end), not to a state before or after it."""
    import dataclasses

    import nasdiag.data
    from torch.utils.data import TensorDataset

    from nasdiag.record import load
    from nasdiag.search import SearchConfig, run

    full = nasdiag.data.load_dataset

    def cut(dataset, **kwargs):  # 16 samples per split: 2 steps of 8 per epoch
        s = full(dataset, **kwargs)
        return dataclasses.replace(s, train=TensorDataset(*s.train[:16]), val=TensorDataset(*s.val[:16]))

    monkeypatch.setattr(nasdiag.data, "load_dataset", cut)
    hp = {"xnas": {"reward_bound": 2e-3, "zeta": 0.25}, "asmnas": {"attention_hidden": 4}}.get(name, {"alpha_lr": 0.3})
    result = run(SearchConfig(method=name, C=2, layers=3, steps=2, multiplier=2, batch_size=8, epochs=2, dtype="float64",
                              progress=False, threads=1, record=str(tmp_path / "r.h5"), device="cpu", hp=hp))
    rec = load(str(tmp_path / "r.h5"))
    prims = [str(p) for p in rec["meta/op_names"]]
    for t in ("normal", "reduce"):
        if name == "dsnas":
            want = _darts_rule(torch.softmax(torch.as_tensor(rec[f"arch/{t}/params"][-1]), -1), 2, prims)
        elif name == "xnas":
            alive = torch.as_tensor(rec[f"regret/{t}/alive"][-1])
            u = torch.softmax(torch.as_tensor(rec[f"regret/{t}/log_weights"][-1]).masked_fill(~alive, -math.inf), -1)
            want = _darts_rule(u, 2, prims, alive)
        else:
            rows = rec[f"valid/attention/{t}/count"].nonzero()[0]
            counts = torch.as_tensor(rec[f"attention/{t}/count"][rows[-1]]).double()
            want = _darts_rule(counts / counts.sum(-1, keepdim=True), 2, prims, counts > 0)
        assert list(map(tuple, getattr(result.genotype, t))) == want, (t, getattr(result.genotype, t), want)


def test_bayesnas_records_the_mixing_weights_its_step_forward_used():
    """arch/<cell>/weights is "the mixing weights Z the step's forward used" (docs/schema.md): for BayesNAS the Z of the
    likelihood step's forward, w(0) = 1 at the first step. It recorded the Z after the step (w after its SGD step, and
    0 for the ops an update had just pruned), which no forward used (a 0.05-sized difference after one step here)."""
    cls = get_method("bayesnas")
    method = cls(_net(11, prims=cls.primitives), cls.Hyperparameters(),
                 schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=4))
    for x, y in _batches(2, 71):
        used = {t: torch.where(method.alive[t], a.detach(), 0.0) for t, a in method.network.alphas().items()}
        stats = method.step((x, y), (x, y))
        for t, z in used.items():
            assert torch.equal(stats[f"arch/{t}/weights"], z), (t, (stats[f"arch/{t}/weights"] - z).abs().max())
