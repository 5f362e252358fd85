"""Audit round 19 of the search methods ("search methods II" and the architecture a search returns): each update
transcribed here in float64 from its paper / the source docs name, on a supernet written here from scratch (a DARTS-
convention model of Linear/tanh cells, 2 intermediate nodes, 3 candidate ops: none, skip_connect, tanh_linear; two
normal cells and one reduce cell), adapted with ``nasdiag.search.supernet.adapt`` as a user's own supernet is. One
step of nasdiag's method and of the transcription from the same state and batch; every updated tensor compared to
1e-10. References: plain torch autograd on the model's own forward (``Tiny.forward(x, Z)``), torch.func, and the
optimizers written out (torch SGD/Adam semantics as DARTS uses them); no nasdiag helper computes a reference.

Defects these tests found (each fails without its fix):

- BayesNAS with its default curvature (``ggn``) on a supernet adapted from DARTS's own code (docs/methods.md: any
  registered method searches one) stopped at its first update, an epoch in, in the GGN's CurvatureError (DARTS's
  ``zip(weights, self._ops)`` cannot take per-sample (B, K) weights), after that step's likelihood update had moved w,
  the network weights and the momentum, advising a ``mode=`` argument BayesNAS does not have; the first step now checks
  the mode and refuses in one SearchError line naming ``hessian_mode=diag``, before any update.
- ``derive_genotype`` / ``derive_mixed_genotype`` took a cell layout that does not exist (multiplier past steps: nodes
  [-1, 0, 1, 2, 3] concatenated; multiplier 0, steps 0) silently, a float multiplier in range()'s TypeError.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from nasdiag.search import Schedule, get_method
from nasdiag.search.base import SearchError
from nasdiag.search.supernet import adapt

D, H, CLASSES, B = 3, 2, 3, 5
PRIMS = ["none", "skip_connect", "tanh_linear"]
TOL = dict(rtol=1e-10, atol=1e-12)


class Zero(nn.Module):
    def forward(self, x):
        return x * 0.0


class Skip(nn.Module):
    def forward(self, x):
        return x


class TanhLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H, bias=False)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class MixedOp(nn.Module):
    def __init__(self):
        super().__init__()
        self._ops = nn.ModuleList([Zero(), Skip(), TanhLinear()])

    def forward(self, x, weights):  # weights (K,), or (B, K) per sample (the GGN curvature modes pass them)
        if weights.dim() == 2:
            return sum(weights[:, k:k + 1] * op(x) for k, op in enumerate(self._ops))
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class Cell(nn.Module):
    def __init__(self, c_pp, c_p, reduction):
        super().__init__()
        self.reduction, self._steps, self._multiplier = reduction, 2, 2
        self.pre0, self.pre1 = nn.Linear(c_pp, H), nn.Linear(c_p, H)
        self._ops = nn.ModuleList([MixedOp() for _ in range(5)])

    def forward(self, s0, s1, weights):
        states, off = [torch.tanh(self.pre0(s0)), torch.tanh(self.pre1(s1))], 0
        for _ in range(self._steps):
            s = sum(self._ops[off + j](h, weights[off + j]) for j, h in enumerate(states))
            off += len(states)
            states.append(s)
        return torch.cat(states[-self._multiplier:], dim=1)


class Tiny(nn.Module):
    """normal, reduce, normal cells; α as DARTS keeps them (``alphas_normal``, ``alphas_reduce``)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(D, H)
        self.cells = nn.ModuleList([Cell(H, H, False), Cell(H, 2 * H, True), Cell(2 * H, 2 * H, False)])
        self.classifier = nn.Linear(2 * H, CLASSES)
        self.alphas_normal = nn.Parameter(0.7 * torch.randn(5, 3))
        self.alphas_reduce = nn.Parameter(0.7 * torch.randn(5, 3))

    def forward(self, x, Z=None):
        """Z: None (softmax(α)), ``{cell type: (E, K)}``, or a list of one (E, K) per cell."""
        s0 = s1 = self.stem(x)
        for i, c in enumerate(self.cells):
            t = "reduce" if c.reduction else "normal"
            z = torch.softmax(getattr(self, "alphas_" + t), -1) if Z is None else Z[i] if isinstance(Z, list) else Z[t]
            s0, s1 = s1, c(s0, s1, z)
        return self.classifier(s1)


def tiny(seed=0):
    torch.manual_seed(seed)
    return Tiny().double()


def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, D, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (B,), generator=g))
            for _ in range(n)]


def method(name, model, epochs=3, **hp):
    M = get_method(name)
    return M(adapt(model, primitives=PRIMS), M.Hyperparameters(**hp), schedule=Schedule(epochs=epochs, steps_per_epoch=1),
             seed=5)


class Ref:
    """The auditor's copy of the state: w and α as plain float64 tensors, the loss as the model's own forward."""

    def __init__(self, model, hp):
        self.model = copy.deepcopy(model)
        self.hp = hp
        self.w = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("alphas_")}
        self.alpha = {t: getattr(model, "alphas_" + t).detach().clone() for t in ("normal", "reduce")}
        self.buf = {}
        self.adam = {t: (torch.zeros_like(a), torch.zeros_like(a)) for t, a in self.alpha.items()}
        self.adam_t = 0

    def loss(self, w, Z, batch):
        x, y = batch
        return F.cross_entropy(functional_call(self.model, w, (x,), {"Z": Z}), y)

    def sgd(self, grads, lr):
        """DARTS's w step: clip the gradient norm (torch's clip_grad_norm_: coef = clip/(norm + 1e-6) where < 1), then
        SGD with momentum and (L2) weight decay; a weight without a gradient (an op not computed) is not touched."""
        h = self.hp
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values()))
        coef = min(1.0, float(h.grad_clip / (norm + 1e-6)))
        for n, g in grads.items():
            d = g * coef + h.w_weight_decay * self.w[n]
            self.buf[n] = d if n not in self.buf else h.w_momentum * self.buf[n] + d
            self.w[n] = self.w[n] - lr * self.buf[n]

    def adam_step(self, grads, betas, weight_decay):
        lr, (b1, b2), eps = self.hp.alpha_lr, betas, 1e-8
        self.adam_t += 1
        for t, g in grads.items():
            g = g + weight_decay * self.alpha[t]
            m, v = self.adam[t]
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            self.adam[t] = (m, v)
            mhat, vhat = m / (1 - b1 ** self.adam_t), v / (1 - b2 ** self.adam_t)
            self.alpha[t] = self.alpha[t] - lr * mhat / (vhat.sqrt() + eps)


def cosine(h, epoch, epochs):
    return h.w_lr_min + (h.w_lr - h.w_lr_min) * (1 + math.cos(math.pi * epoch / epochs)) / 2


def assert_state(m, ref):
    net = m.network.model
    for n, p in net.named_parameters():
        if n.startswith("alphas_"):
            torch.testing.assert_close(p.detach(), ref.alpha[n[len("alphas_"):]], **TOL)
        else:
            torch.testing.assert_close(p.detach(), ref.w[n], **TOL, msg=n)


def generator_copy(m):
    return torch.Generator().set_state(m.generator.get_state())


# --------------------------------------------------------------------------------------------------- SNAS
def test_snas_two_steps_follow_the_gumbel_softmax_relaxation_its_temperature_schedule_and_floor():
    """SNAS eq: Z = softmax((α + G)/τ), G = −log(−log U); ∂L/∂α is the reparameterised gradient through Z (SNAS's
    credit assignment, Theorem 2), by autograd here; single level (w and α on the training batch); τ ← max(τ·decay,
    floor) per epoch: 2 → 1 → 0.7 (floored) with tau0 = 2, tau_decay = 0.5, tau_min = 0.7."""
    model = tiny(1)
    hpv = dict(alpha_lr=0.05, tau0=2.0, tau_decay=0.5, tau_min=0.7)
    m = method("snas", model, **hpv)
    ref = Ref(model, m.hp)
    taus = []
    for epoch, batch in enumerate(batches(3, 11)):
        tau = [2.0, 1.0, 0.7][epoch]
        g = generator_copy(m)
        alpha = {t: a.clone().requires_grad_(True) for t, a in ref.alpha.items()}
        Z = {}
        for t in ("normal", "reduce"):
            u = torch.rand(alpha[t].shape, generator=g, dtype=torch.float64)
            Z[t] = torch.softmax((alpha[t] + (-torch.log(-torch.log(u)))) / tau, -1)
        w = {n: v.clone().requires_grad_(True) for n, v in ref.w.items()}
        loss = ref.loss(w, Z, batch)
        grads = torch.autograd.grad(loss, list(w.values()) + list(alpha.values()))
        gw, ga = dict(zip(w, grads[:len(w)])), dict(zip(alpha, grads[len(w):]))
        ref.adam_step(ga, m.hp.alpha_betas, m.hp.alpha_weight_decay)
        ref.sgd(gw, cosine(m.hp, epoch, 3))
        stats = m.step(batch)
        torch.testing.assert_close(stats["scalars/alpha_grad_norm"], torch.sqrt(sum((g ** 2).sum() for g in ga.values())), **TOL)
        taus.append(float(stats["scalars/temperature"]))
        torch.testing.assert_close(stats["scalars/train_loss"], loss.detach(), **TOL)
        for t in Z:
            torch.testing.assert_close(stats[f"arch/{t}/weights"], Z[t].detach(), **TOL)
        assert_state(m, ref)
        p_new = torch.cat([torch.softmax(a, -1) for a in ref.alpha.values()])  # H(p) in nats after the update, edge mean
        torch.testing.assert_close(stats["scalars/entropy"], -(p_new * p_new.log()).sum(-1).mean(), **TOL)
        m.epoch_end(epoch)
    assert taus == [2.0, 1.0, 0.7] and m.temperature == 0.7


# --------------------------------------------------------------------------------------------------- DSNAS
def test_dsnas_two_steps_follow_the_one_hot_credit_and_only_the_sampled_ops_weights_move():
    """DSNAS: Z one-hot ~ Cat(softmax(α)); ∂L/∂α = C_s (Z − p) with C = ∂L/∂Z of the one-hot forward (autograd here,
    every op computed), summed over the cells of a type; w updated only where the forward used it: the tanh_linear
    weights of an edge whose sample is not tanh_linear stay bit-equal (no weight decay, no momentum)."""
    model = tiny(2)
    m = method("dsnas", model, alpha_lr=0.05)
    ref = Ref(model, m.hp)
    counts = {}
    for epoch, batch in enumerate(batches(2, 12)):
        g = generator_copy(m)
        p = {t: torch.softmax(a, -1) for t, a in ref.alpha.items()}
        Z = {t: torch.zeros_like(p[t]).scatter_(-1, torch.multinomial(p[t], 1, generator=g), 1.0) for t in p}
        Zl = {t: z.clone().requires_grad_(True) for t, z in Z.items()}
        w = {n: v.clone().requires_grad_(True) for n, v in ref.w.items()}
        loss = ref.loss(w, Zl, batch)
        grads = torch.autograd.grad(loss, list(w.values()) + list(Zl.values()))
        gw, C = dict(zip(w, grads[:len(w)])), dict(zip(Zl, grads[len(w):]))
        ga = {t: (Z[t] * C[t]).sum(-1, keepdim=True) * (Z[t] - p[t]) for t in Z}
        # the ops the one-hot forward computes: the sampled tanh_linear's weight only
        used = {}
        for n, gn in gw.items():
            parts = n.split(".")
            if "_ops" in parts:
                cell, edge = int(parts[1]), int(parts[3])
                t = "reduce" if model.cells[cell].reduction else "normal"
                if Z[t][edge, 2] != 1:
                    assert gn.abs().max() == 0
                    continue
            used[n] = gn
        before = {n: v.clone() for n, v in ref.w.items()}
        ref.adam_step(ga, m.hp.alpha_betas, m.hp.alpha_weight_decay)
        ref.sgd(used, cosine(m.hp, epoch, 3))
        stats = m.step(batch)
        torch.testing.assert_close(stats["scalars/alpha_grad_norm"], torch.sqrt(sum((g ** 2).sum() for g in ga.values())), **TOL)
        counts = {t: counts.get(t, 0) + Z[t] for t in Z} if epoch else dict(Z)
        for t in Z:
            torch.testing.assert_close(stats[f"sample/{t}/onehot"], Z[t], rtol=0, atol=0)
            assert torch.equal(stats[f"sample/{t}/count"], counts[t].long())
        assert_state(m, ref)
        assert any(torch.equal(ref.w[n], before[n]) for n in ref.w if n not in used)
        m.epoch_end(epoch)


# --------------------------------------------------------------------------------------------------- ProxylessNAS
def test_proxyless_step_follows_two_path_binary_gates_and_rescales_the_pair():
    """ProxylessNAS two-path mode (its code's ``set_arch_param_grad`` / ``rescale_updated_arch_param``): w step at
    one path sampled from p; α step: a pair drawn from p without replacement, one gated on with p renormalised over
    the pair, ∂L/∂α_i = Σ_{j∈S} C_j p'_j (δ_ij − p'_i), Adam (β1 = 0), then the pair shifted by
    log(Σ_S exp α_new / Σ_S exp α_old): the probabilities of the unsampled ops are unchanged."""
    model = tiny(3)
    m = method("proxyless", model, alpha_lr=0.05)
    ref = Ref(model, m.hp)
    for epoch, (tb, vb) in enumerate(zip(batches(2, 13), batches(2, 14))):
        g = generator_copy(m)
        p = {t: torch.softmax(a, -1) for t, a in ref.alpha.items()}
        Zw = {t: torch.zeros_like(p[t]).scatter_(-1, torch.multinomial(p[t], 1, generator=g), 1.0) for t in p}
        w = {n: v.clone().requires_grad_(True) for n, v in ref.w.items()}
        gw = dict(zip(w, torch.autograd.grad(ref.loss(w, Zw, tb), list(w.values()))))
        used = {}
        for n, gn in gw.items():
            parts = n.split(".")
            if "_ops" in parts and Zw["reduce" if model.cells[int(parts[1])].reduction else "normal"][int(parts[3]), 2] != 1:
                continue
            used[n] = gn
        ref.sgd(used, cosine(m.hp, epoch, 3))
        pairs, gates = {}, {}
        for t in p:
            idx = torch.multinomial(p[t], 2, replacement=False, generator=g)
            pick = torch.multinomial(p[t].gather(-1, idx), 1, generator=g)
            pairs[t] = torch.zeros_like(p[t], dtype=torch.bool).scatter_(-1, idx, True)
            gates[t] = torch.zeros_like(p[t]).scatter_(-1, idx.gather(-1, pick), 1.0)
        Gl = {t: z.clone().requires_grad_(True) for t, z in gates.items()}
        C = dict(zip(Gl, torch.autograd.grad(ref.loss(ref.w, Gl, vb), list(Gl.values()))))
        ga, old = {}, {t: a.clone() for t, a in ref.alpha.items()}
        for t in p:
            ga[t] = torch.zeros_like(p[t])
            for e in range(5):
                S = pairs[t][e].nonzero()[:, 0].tolist()
                ps = torch.softmax(old[t][e, S], -1)
                for a, i in enumerate(S):
                    ga[t][e, i] = sum(C[t][e, j] * ps[b] * (float(a == b) - ps[a]) for b, j in enumerate(S))
        ref.adam_step(ga, m.hp.alpha_betas, m.hp.alpha_weight_decay)
        for t in p:
            for e in range(5):
                S = pairs[t][e].nonzero()[:, 0]
                off = torch.log(ref.alpha[t][e, S].exp().sum() / old[t][e, S].exp().sum())
                ref.alpha[t][e, S] -= off
        stats = m.step(tb, vb)
        torch.testing.assert_close(stats["scalars/alpha_grad_norm"], torch.sqrt(sum((g ** 2).sum() for g in ga.values())), **TOL)
        for t in p:
            torch.testing.assert_close(stats[f"sample/{t}/paths"].bool(), pairs[t], rtol=0, atol=0)
            torch.testing.assert_close(stats[f"sample/{t}/onehot"], gates[t], rtol=0, atol=0)
            pn, po = torch.softmax(ref.alpha[t], -1), p[t]
            torch.testing.assert_close(pn[~pairs[t]], po[~pairs[t]], rtol=1e-13, atol=1e-15)
        assert_state(m, ref)
        m.epoch_end(epoch)


# --------------------------------------------------------------------------------------------------- DARTS 2nd order
def _fd_hypergradient(ref, tb, vb, xi, r):
    """DARTS architect.py transcribed: w' = w − ξ(∇_w L_train + μ b + λ w), g = ∇_α L_val(w') − ξ [∇_α L_train(w⁺) −
    ∇_α L_train(w⁻)] / (2ε), w± = w ± ε ∇_w' L_val(w'), ε = r/‖∇_w' L_val‖; and the exact g by autograd through w'(α)."""
    h = ref.hp

    def Zof(alpha):
        return {t: torch.softmax(a, -1) for t, a in alpha.items()}

    def unrolled(alpha, create_graph):
        w = {n: v.clone().requires_grad_(True) for n, v in ref.w.items()}
        gw = torch.autograd.grad(ref.loss(w, Zof(alpha), tb), list(w.values()), create_graph=create_graph)
        return {n: ref.w[n] - xi * (gn + h.w_momentum * ref.buf.get(n, torch.zeros_like(gn)) + h.w_weight_decay * ref.w[n])
                for n, gn in zip(w, gw)}

    alpha = {t: a.clone().requires_grad_(True) for t, a in ref.alpha.items()}
    exact = dict(zip(alpha, torch.autograd.grad(ref.loss(unrolled(alpha, True), Zof(alpha), vb), list(alpha.values()))))
    w1 = {n: v.detach().requires_grad_(True) for n, v in unrolled(alpha, False).items()}
    grads = torch.autograd.grad(ref.loss(w1, Zof(alpha), vb), list(w1.values()) + list(alpha.values()))
    v, dalpha = dict(zip(w1, grads[:len(w1)])), dict(zip(alpha, grads[len(w1):]))
    eps = r / torch.sqrt(sum((g ** 2).sum() for g in v.values()))

    def ga(sign):
        wpm = {n: ref.w[n] + sign * eps * v[n] for n in ref.w}
        return dict(zip(alpha, torch.autograd.grad(ref.loss(wpm, Zof(alpha), tb), list(alpha.values()))))

    gp, gm = ga(1.0), ga(-1.0)
    implicit = {t: (gp[t] - gm[t]) / (2 * eps) for t in alpha}
    extra = {"scalars/fd_eps": eps, "scalars/implicit_grad_norm": xi * torch.sqrt(sum((g ** 2).sum() for g in implicit.values())),
             "scalars/val_loss": ref.loss(w1, Zof(ref.alpha), vb), "scalars/unrolled_train_loss": ref.loss(ref.w, Zof(ref.alpha), tb)}
    return {t: dalpha[t] - xi * implicit[t] for t in alpha}, exact, extra


def test_darts2_hypergradient_and_step_follow_darts_architect_with_the_momentum_buffer_and_weight_decay():
    """After one step (momentum buffers filled, lr annealed by an epoch end) the hypergradient is DARTS's finite
    difference transcribed (1e-10), which itself approaches the exact unrolled gradient by autograd through one SGD
    step with that momentum buffer and weight decay (r = 1e-5 on this smooth net: central difference, O(ε²))."""
    model = tiny(4)
    m = method("darts2", model, alpha_lr=0.05, fd_eps_scale=1e-5, w_weight_decay=0.01)
    ref = Ref(model, m.hp)
    for epoch, (tb, vb) in enumerate(zip(batches(2, 15), batches(2, 16))):
        xi = cosine(m.hp, epoch, 3)
        g_fd, g_exact, extra = _fd_hypergradient(ref, tb, vb, xi, m.hp.fd_eps_scale)
        g_m = m.arch_gradient(tb, vb)
        for t in g_fd:
            torch.testing.assert_close(g_m[t], g_fd[t], rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(g_fd[t], g_exact[t], rtol=1e-6, atol=1e-8)
        ref.adam_step(g_fd, m.hp.alpha_betas, m.hp.alpha_weight_decay)
        w = {n: v.clone().requires_grad_(True) for n, v in ref.w.items()}
        Z = {t: torch.softmax(a, -1) for t, a in ref.alpha.items()}
        ref.sgd(dict(zip(w, torch.autograd.grad(ref.loss(w, Z, tb), list(w.values())))), xi)
        stats = m.step(tb, vb)
        assert_state(m, ref)
        for k, v in extra.items():  # ε = r/‖∇_w' L_val‖, ξ‖mixed term‖, L_val at w', L_train at w
            torch.testing.assert_close(stats[k], v.detach(), rtol=1e-9, atol=1e-12, msg=k)
        torch.testing.assert_close(stats["scalars/w_lr"], torch.tensor(xi, dtype=torch.float64), rtol=0, atol=0)
        m.epoch_end(epoch)


# --------------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("name", ["snas", "dsnas", "proxyless", "darts2"])
def test_a_state_saved_mid_run_continues_bit_equal_on_a_fresh_method(name):
    """state_dict after 3 steps (mid-epoch 2, the generator, momentum buffers, Adam moments, τ, sample counts saved)
    then 3 more steps: a fresh method built on a fresh copy of the supernet that loads the state ends bit-equal."""
    M = get_method(name)
    sched = Schedule(epochs=3, steps_per_epoch=2)
    data = list(zip(batches(6, 21), batches(6, 22)))

    def build(model):
        return M(adapt(model, primitives=PRIMS), M.Hyperparameters(alpha_lr=0.05), schedule=sched, seed=9)

    def run(m, steps):
        out = []
        for k in steps:
            out.append(m.step(*data[k]))
            if k % 2 == 1:
                m.epoch_end(k // 2)
        return out

    a = build(tiny(6))
    run(a, range(3))
    state = copy.deepcopy(a.state_dict())
    rows_a = run(a, range(3, 6))
    b = build(tiny(7))  # other initial weights: everything must come from the state
    torch.manual_seed(123)  # and nothing from torch's global generator
    b.load_state_dict(state)
    rows_b = run(b, range(3, 6))
    for (n, p), (n2, q) in zip(a.network.named_parameters(), b.network.named_parameters()):
        assert n == n2 and torch.equal(p, q), n
    for ra, rb in zip(rows_a, rows_b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert torch.equal(ra[k], rb[k]) or (ra[k].isnan().all() and rb[k].isnan().all()), k
    assert a.genotype() == b.genotype()


# --------------------------------------------------------------------------------------------------- discretization
def _darts_parse(W, steps, prims):
    """DARTS's ``Network.genotype._parse`` (model_search.py) transcribed: per node the 2 inputs with the largest
    non-none weight (``sorted`` is stable: ties keep the lower input), each with its argmax non-none op (strict ``>``:
    ties keep the lower op)."""
    none = prims.index("none")
    gene, start, n = [], 0, 2
    for i in range(steps):
        rows = W[start:start + n].tolist()
        edges = sorted(range(i + 2), key=lambda x: -max(rows[x][k] for k in range(len(prims)) if k != none))[:2]
        for j in edges:
            k_best = None
            for k in range(len(prims)):
                if k != none and (k_best is None or rows[j][k] > rows[j][k_best]):
                    k_best = k
            gene.append((prims[k_best], j))
        start, n = start + n, n + 1
    return gene


@pytest.mark.parametrize("name", ["darts", "darts2", "snas", "dsnas", "proxyless"])
def test_the_genotype_is_darts_parse_of_softmax_alpha_with_ties_and_zero_weight_edges_and_nan_is_refused(name):
    """Normal α all equal (every tie: lower input, lower op); reduce α with edges whose non-none weights are all 0
    (α = −inf; node 2 must take one: DARTS names its first non-none op), an edge of equal ops and strict winners; the two cells derived from their own α. NaN or +inf α (p NaN)
    is a one-line SearchError naming the edge, never an architecture; genotype() draws no random number."""
    model = tiny(8)
    with torch.no_grad():
        model.alphas_normal.zero_()
        model.alphas_reduce.copy_(torch.tensor([[9.0, -math.inf, -math.inf], [0.0, 1.0, 2.0], [0.0, 3.0, 1.0], [0.0, 0.0, 0.0],
                                                [9.0, -math.inf, -math.inf]]))
    m = method(name, model)
    state = m.generator.get_state()
    genes = m.genotype()
    assert torch.equal(m.generator.get_state(), state)
    for t in ("normal", "reduce"):
        want = _darts_parse(torch.softmax(getattr(model, "alphas_" + t).detach(), -1), 2, PRIMS)
        assert list(map(tuple, getattr(genes, t))) == want, t
        assert list(getattr(genes, f"{t}_concat")) == [2, 3]
    assert genes.reduce[:2] == [("tanh_linear", 1), ("skip_connect", 0)] and genes.normal[0] == ("skip_connect", 0)
    for bad in (math.nan, math.inf):
        with torch.no_grad():
            model.alphas_reduce[3, 1] = bad
        with pytest.raises(SearchError, match=r"reduce architecture weights are NaN or inf on edge\(s\) \[3\]") as err:
            m.genotype()
        assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------------- BayesNAS
def test_bayesnas_two_steps_with_updates_follow_algorithm_2_on_a_foreign_supernet():
    """Algorithm 2 as docs/bayesnas.md cites it, update_every = 1: (A.3.1) momentum SGD on 𝒲 (clipped, weight decay)
    and on w with ∂L/∂Z + λ_w ω √ℵ sign(w); H_i = B/λ_w · GGN diagonal of cell i's own Z (autograd Jacobians here);
    C_i = (1/γ + H_i)⁻¹ (A.3.2), ω = √Σ_i (γ − C_i)/γ² (A.3.9), s = √ℵ|w|/ω (A.3.8), γ by A.2.14 (s summed over
    every op of the edges entering the source node; γ = s from a cell input), prune where ½ ln(2πe γ) ≤ 0, w ← 0
    there, w's momentum dropped; the second step's penalty uses the updated ω and computes no pruned op."""
    model = tiny(10)
    M = get_method("bayesnas")
    hpv = dict(w_lr=0.05, lambda_w=0.05, init_gamma=0.05, update_every=1)
    m = M(adapt(model, primitives=PRIMS), M.Hyperparameters(**hpv), schedule=Schedule(epochs=2, steps_per_epoch=2),
          seed=3)
    ref = Ref(model, m.hp)
    h = m.hp
    E, K = 5, 3
    pairs = [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    types = ["normal", "reduce", "normal"]
    aleph = {"normal": 2, "reduce": 1}
    w = {t: torch.ones(E, K, dtype=torch.float64) for t in aleph}
    gamma = {t: torch.full((E, K), h.init_gamma, dtype=torch.float64) for t in aleph}
    omega = {t: torch.ones(E, K, dtype=torch.float64) for t in aleph}
    s_prev = {t: torch.full((E, K), h.init_gamma, dtype=torch.float64) for t in aleph}
    alive = {t: torch.ones(E, K, dtype=torch.bool) for t in aleph}
    wbuf = {}
    pruned_any = False
    for step, batch in enumerate(batches(2, 31)):
        x, y = batch
        Z = {t: torch.where(alive[t], w[t], torch.zeros_like(w[t])) for t in w}
        Zl = {t: z.clone().requires_grad_(True) for t, z in Z.items()}
        wl = {n: v.clone().requires_grad_(True) for n, v in ref.w.items()}
        grads = torch.autograd.grad(ref.loss(wl, Zl, batch), list(wl.values()) + list(Zl.values()))
        gw, C = dict(zip(wl, grads[:len(wl)])), dict(zip(Zl, grads[len(wl):]))
        used = {}
        for n, gn in gw.items():  # a pruned op is not computed: its weights take no step
            parts = n.split(".")
            if "_ops" in parts and not alive[types[int(parts[1])]][int(parts[3]), 2]:
                continue
            used[n] = gn
        ref.sgd(used, cosine(h, step // 2, 2))
        for t in w:
            g = torch.where(alive[t], C[t] + h.lambda_w * math.sqrt(aleph[t]) * omega[t] * torch.sign(w[t]), 0.0)
            wbuf[t] = g if t not in wbuf else h.w_momentum * wbuf[t] + g
            w[t] = w[t] - cosine(h, step // 2, 2) * wbuf[t]
        # update at the new w, the new 𝒲, the same batch
        Zc = [torch.where(alive[t], w[t], torch.zeros_like(w[t])) for t in types]
        H = {t: [] for t in aleph}
        for i, t in enumerate(types):
            def logits_of(zi, i=i):
                return functional_call(ref.model, ref.w, (x,), {"Z": Zc[:i] + [zi] + Zc[i + 1:]})
            J = torch.func.jacrev(logits_of)(Zc[i])  # (B, classes, E, K)
            sm = torch.softmax(logits_of(Zc[i]), -1)
            Hl = torch.diag_embed(sm) - sm[:, :, None] * sm[:, None, :]  # ∂²ℓ_n/∂logits²
            H[t].append(torch.einsum("bcek,bcd,bdek->ek", J, Hl, J) / h.lambda_w)  # Σ_n (summed loss) / λ_w
        for t in aleph:
            Ht = torch.stack(H[t])
            Ci = 1.0 / (1.0 / gamma[t] + Ht)
            info = (Ht > 0).any(0)
            # a switch pruned before has γ = 0: ω = ∞ by nasdiag.bayes.omega's convention (only recorded: s = 0 either way)
            om = torch.where(gamma[t] == 0, math.inf, torch.sqrt(((gamma[t] - Ci) / gamma[t] ** 2).sum(0)))
            omega[t] = torch.where(info, om, omega[t])
            wa = torch.where(alive[t], w[t], 0.0).abs()
            s_new = torch.where(wa == 0, 0.0, math.sqrt(aleph[t]) * wa / om)  # A.2.13: w = 0 is s = 0 (also at ω = 0)
            s_prev[t] = torch.where(info | ~alive[t], s_new, s_prev[t])
        for t in aleph:
            g_new = s_prev[t].clone()
            for e, (i, j) in enumerate(pairs):
                if i >= 2:  # the edges entering node i
                    into = s_prev[t][[f for f, (_, jj) in enumerate(pairs) if jj == i]].sum()
                    g_new[e] = 1.0 / (1.0 / into + 1.0 / s_prev[t][e])
            gamma[t] = g_new
            alive[t] = alive[t] & ~(0.5 * torch.log(2 * math.pi * math.e * gamma[t]) <= 0)
            w[t] = torch.where(alive[t], w[t], 0.0)
            pruned_any |= bool((~alive[t]).any())
        wbuf = {}
        stats = m.step(batch, batch)
        for t in aleph:
            torch.testing.assert_close(stats[f"bayes/{t}/gamma"], gamma[t], **TOL)
            torch.testing.assert_close(stats[f"bayes/{t}/omega"], omega[t], **TOL)
            assert torch.equal(stats[f"bayes/{t}/switch"].cpu(), alive[t]), t
            torch.testing.assert_close(m.network.alphas()[t].detach(), w[t], **TOL)
        for n, p in m.network.model.named_parameters():
            if not n.startswith("alphas_"):
                torch.testing.assert_close(p.detach(), ref.w[n], **TOL, msg=n)
        if step % 2 == 1:
            m.epoch_end(step // 2)
    assert pruned_any and not all(bool(a.any()) is False for a in alive.values())


def test_bayesnas_on_darts_code_whose_mixed_op_cannot_take_per_sample_weights_is_refused_before_any_update():
    """docs/methods.md: any registered method searches an adapted DARTS-code supernet. BayesNAS's default curvature
    (ggn) mixes each sample with its own (B, K) weights, which DARTS's ``zip(weights, self._ops)`` cannot take: the
    first update (the last step of epoch 1) stopped in the curvature's CurvatureError after that step's likelihood update
    had moved w, 𝒲 and the momentum (steps_done not counted), advising a ``mode=`` argument BayesNAS does not have.
    Now the first step refuses in one SearchError line naming the hyperparameter, nothing changed; diag runs on."""
    from conftest import assert_no_module_hooks
    from test_foreign_supernet import batch, foreign_supernet

    net, _ = foreign_supernet(3)
    M = get_method("bayesnas")
    m = M(net, M.Hyperparameters(), schedule=Schedule(epochs=2, steps_per_epoch=2))
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(SearchError, match=r"hessian_mode='ggn'.*pass --hp hessian_mode=diag") as err:
        m.step(batch(1), batch(2))
    assert "\n" not in str(err.value) and m.steps_done == 0
    after = m.state_dict()
    for k, v in before["network"].items():
        assert torch.equal(v, after["network"][k]), k
    assert all(not st for st in (m.w_optimizer.state, m.arch_optimizer.state))
    assert_no_module_hooks(net.model)
    assert all(len(e.module._ops) == len(net.primitives) for e in net.edge_specs())
    net, _ = foreign_supernet(3)
    m = M(net, M.Hyperparameters(hessian_mode="diag", update_every=1), schedule=Schedule(epochs=2, steps_per_epoch=2))
    assert bool(m.step(batch(1), batch(2))["bayes/updated"])


# --------------------------------------------------------------------------------------------------- sampling laws
def test_the_samples_follow_their_laws_snas_gumbel_max_dsnas_categorical_proxyless_pairs_without_replacement():
    """Frequencies over N draws with each method's generator against the laws written here (5 standard errors):
    argmax of SNAS's relaxed sample ~ Cat(softmax(α)) (the Gumbel-max property, at any τ); DSNAS's one-hot ~ Cat(p);
    ProxylessNAS's pair {a, b} with P = p_a p_b (1/(1 − p_a) + 1/(1 − p_b)) (two draws without replacement) and its
    gate a given the pair with p_a/(p_a + p_b)."""
    from nasdiag.search.methods._sampling import sample_two_paths

    N = 6000
    model = tiny(12)
    p = {t: torch.softmax(getattr(model, "alphas_" + t).detach(), -1) for t in ("normal", "reduce")}

    def close(freq, prob):
        se = torch.sqrt(prob * (1 - prob) / N)
        assert bool(((freq - prob).abs() <= 5 * se + 1e-12).all()), (freq, prob)

    for name in ("snas", "dsnas"):
        m = method(name, model, tau0=0.3) if name == "snas" else method(name, model)
        counts = {t: torch.zeros(5, 3, dtype=torch.float64) for t in p}
        for _ in range(N):
            for t, z in m.forward_weights().items():
                counts[t] += torch.zeros_like(z).scatter_(-1, z.argmax(-1, keepdim=True), 1.0)
        for t in p:
            close(counts[t] / N, p[t])
    g = torch.Generator().manual_seed(4)
    q = p["normal"]
    pair_n = torch.zeros(5, 3, 3, dtype=torch.float64)
    gate_n = torch.zeros(5, 3, 3, dtype=torch.float64)
    for _ in range(N):
        pair, gates = sample_two_paths(q, g)
        for e in range(5):
            a, b = pair[e].nonzero()[:, 0].tolist()
            pair_n[e, a, b] += 1
            gate_n[e, a, b] += gates[e, a]
    for e in range(5):
        for a in range(3):
            for b in range(a + 1, 3):
                pa, pb = q[e, a], q[e, b]
                close(pair_n[e, a, b] / N, pa * pb * (1 / (1 - pa) + 1 / (1 - pb)))
                n_ab = pair_n[e, a, b]
                want = pa / (pa + pb)
                assert abs(gate_n[e, a, b] / n_ab - want) <= 5 * torch.sqrt(want * (1 - want) / n_ab)


@pytest.mark.parametrize("derive", ["derive_genotype", "derive_mixed_genotype"])
def test_derive_genotype_refuses_a_cell_layout_that_does_not_exist_in_one_line(derive):
    """nasdiag.supernet's derive_genotype / derive_mixed_genotype (docs/methods.md) took a multiplier past steps
    silently: steps = 2, multiplier = 5 concatenated nodes [-1, 0, 1, 2, 3] (node −1 does not exist, 0 and 1 are the
    cell inputs); multiplier 0 gave a cell with no output, steps = 0 a cell of no node, a float multiplier was range()'s
    TypeError. A DARTS cell (nasdiag.supernet.Cell) takes multiplier in [1, steps]: each is one ValueError line now."""
    import nasdiag.supernet as S

    f = getattr(S, derive)
    w = {"normal": torch.rand(5, 3, dtype=torch.float64)}
    assert f(w, 2, 1, PRIMS).normal_concat == [3] and f(w, 2, 2, PRIMS).normal_concat == [2, 3]
    for steps, mult, what in ((2, 5, "multiplier"), (2, 0, "multiplier"), (2, 2.0, "multiplier"), (2, True, "multiplier"),
                              (0, 1, "steps"), (2.0, 1, "steps")):
        weights = {"normal": torch.rand(0, 3)} if steps == 0 else w
        with pytest.raises(ValueError, match=f"^{what} must be an integer") as err:
            f(weights, steps, mult, PRIMS)
        assert "\n" not in str(err.value)
