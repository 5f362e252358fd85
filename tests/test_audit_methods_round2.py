"""Audit round 2 of the search methods against their papers, in float64: each test writes its OWN transcription
of one step (architecture and weight step) from the papers' equations and compares it with what the method does.

References are written here, independently of the library: Adam, momentum SGD (weight decay, no dampening) and
the gradient-norm clip as the papers' optimizers define them; gradients by autograd through the relaxation the
paper defines (softmax for DARTS, Gumbel-softmax for SNAS, the score function for DSNAS, BinaryConnect on the
sampled pair for ProxylessNAS, linear mixing for SparseNAS and BayesNAS); the proximal operators of
sparse-supernet eq 9-10 written out; the second-order hypergradient of eq 11-12 by autograd through w'(α).
The supernet's forward is nasdiag's (a tiny float64 `Network`), used as a function of (w, Z). Sampling methods
get the same samples by patching the sampler they call with draws made here.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from nasdiag import vocabulary as V
from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network
from test_run import _InterruptAt

B = 4
PRIMS = ("none", "skip_connect", "max_pool_3x3", "avg_pool_3x3", "sep_conv_3x3")


def supernet(seed, primitives=PRIMS, alpha_scale=0.5, smooth=False):
    """Network(C=4, 3 classes, 3 layers: one normal cell and two reduction cells sharing α), float64."""
    torch.manual_seed(seed)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=primitives).double()
    with torch.no_grad():
        for a in net.arch_parameters():
            a.normal_(0, alpha_scale)
    if smooth:  # tanh for ReLU: finite differences of ∇_α L_train converge (no kinks)
        for module in list(net.modules()):
            for name, child in module.named_children():
                if isinstance(child, nn.ReLU):
                    setattr(module, name, nn.Tanh())
    return net


def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g))
            for _ in range(n)]


# -- the optimizers as the papers define them -----------------------------------------------------------
class Adam:
    """Kingma & Ba with L2 weight decay added to the gradient (DARTS's Adam(weight_decay=...))."""

    def __init__(self, lr, betas, wd=0.0, eps=1e-8):
        self.lr, self.b1, self.b2, self.wd, self.eps, self.state = lr, betas[0], betas[1], wd, eps, {}

    def step(self, key, p, g):
        g = g + self.wd * p
        m, v, t = self.state.get(key, (torch.zeros_like(p), torch.zeros_like(p), 0))
        t += 1
        m = self.b1 * m + (1 - self.b1) * g
        v = self.b2 * v + (1 - self.b2) * g * g
        self.state[key] = (m, v, t)
        return p - self.lr * (m / (1 - self.b1 ** t)) / ((v / (1 - self.b2 ** t)).sqrt() + self.eps)


class SGD:
    """Momentum SGD, d = g + λp, b = μb + d (b = d at first), p − lr·b; a parameter without gradient is skipped."""

    def __init__(self, momentum, wd):
        self.mu, self.wd, self.buf = momentum, wd, {}

    def step(self, key, p, g, lr):
        if g is None:
            return p
        d = g + self.wd * p
        b = d if key not in self.buf else self.mu * self.buf[key] + d
        self.buf[key] = b
        return p - lr * b


def clipped(grads, max_norm):
    """grads scaled by min(1, max_norm / (‖g‖ + 1e-6)), ‖g‖ the norm of all of them (torch's clip rule)."""
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads if g is not None))
    scale = min(1.0, float(max_norm / (norm + 1e-6)))
    return [None if g is None else g * scale for g in grads]


def cosine(lr0, lr_min, epoch, epochs):
    return lr_min + (lr0 - lr_min) * (1 + math.cos(math.pi * epoch / epochs)) / 2


class Reference:
    """The supernet as a function of its weights w and mixing weights Z (a copy of the method's network)."""

    def __init__(self, net):
        self.net = copy.deepcopy(net)
        arch = {id(a) for a in self.net.arch_parameters()}
        self.names = [n for n, p in self.net.named_parameters() if id(p) not in arch]
        self.w = {n: p.detach().clone() for n, p in self.net.named_parameters() if id(p) not in arch}
        self.alpha = {t: a.detach().clone() for t, a in self.net.alphas().items()}

    def loss(self, w, x, y, z, active=None):
        kwargs = {} if active is None else {"active": active}
        buffers = {n: b.clone() for n, b in self.net.named_buffers()}
        return F.cross_entropy(functional_call(self.net, {**w, **buffers}, (x, z), kwargs), y)

    def weight_step(self, sgd, lr, clip, x, y, z, active=None):
        """One momentum-SGD step of w on L_train(w, Z) (mean over the batch), clipped; returns the loss."""
        w = {n: t.clone().requires_grad_(True) for n, t in self.w.items()}
        loss = self.loss(w, x, y, z, active)
        grads = torch.autograd.grad(loss, list(w.values()), allow_unused=True)
        grads = clipped(grads, clip)
        self.w = {n: sgd.step(n, self.w[n], g, lr) for n, g in zip(self.names, grads)}
        return loss.detach()


def assert_same_state(method, ref, rtol=1e-10, atol=1e-12):
    net = method.network
    for t, a in net.alphas().items():
        torch.testing.assert_close(a.detach(), ref.alpha[t], rtol=rtol, atol=atol, msg=lambda m: f"alpha {t}: {m}")
    for n, p in net.named_parameters():
        if n in ref.w:
            torch.testing.assert_close(p.detach(), ref.w[n], rtol=rtol, atol=atol, msg=n)


def alternating(name, seed, **hp):
    """A method of the DARTS family on ``supernet(seed)`` over 3 one-step epochs, with this file's own reference
    copy of the supernet and own Adam (α) and SGD (w) transcriptions set up from the same hyperparameters."""
    h = get_method(name).Hyperparameters(**hp)
    net = supernet(seed)
    method = get_method(name)(net, h, schedule=Schedule(epochs=3, steps_per_epoch=1, batch_size=B))
    adam, sgd = Adam(h.alpha_lr, h.alpha_betas, h.alpha_weight_decay), SGD(h.w_momentum, h.w_weight_decay)
    return net, method, h, Reference(net), adam, sgd


# -- DARTS, first order -----------------------------------------------------------------------------------
def test_darts_first_order_two_steps_equal_the_papers_alternation():
    """DARTS Alg. 1 with ξ = 0: α ← Adam(∇_α L_val(w, α) + λ_α α) on search-val at Z = softmax(α), then w ← SGD
    on search-train at the UPDATED α; cosine lr of w per epoch; the record's scalars are those of this step."""
    # a clip that binds (‖∇w‖ ≈ 1 here)
    net, method, h, ref, adam, sgd = alternating("darts", 0, alpha_lr=0.05, grad_clip=0.3)
    data = batches(4, 1)
    for epoch in range(2):
        (xt, yt), (xv, yv) = data[2 * epoch], data[2 * epoch + 1]
        lr = cosine(h.w_lr, h.w_lr_min, epoch, 3)
        stats = method.step((xt, yt), (xv, yv))
        alpha = {t: a.clone().requires_grad_(True) for t, a in ref.alpha.items()}
        val_loss = ref.loss(ref.w, xv, yv, {t: torch.softmax(a, -1) for t, a in alpha.items()})
        grads = torch.autograd.grad(val_loss, list(alpha.values()))
        grad_norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        ref.alpha = {t: adam.step(t, ref.alpha[t], g) for t, g in zip(alpha, grads)}
        z = {t: torch.softmax(a, -1) for t, a in ref.alpha.items()}
        train_loss = ref.weight_step(sgd, lr, h.grad_clip, xt, yt, z)
        assert_same_state(method, ref)
        assert float(stats["scalars/w_lr"]) == pytest.approx(lr, rel=1e-7)  # scalars are float32 (vocabulary)
        torch.testing.assert_close(stats["scalars/val_loss"], val_loss.detach(), rtol=1e-12, atol=0)
        torch.testing.assert_close(stats["scalars/train_loss"], train_loss, rtol=1e-12, atol=0)
        torch.testing.assert_close(stats["scalars/alpha_grad_norm"], grad_norm, rtol=1e-10, atol=0)
        for t in z:
            torch.testing.assert_close(stats[V.ARCH_PROBABILITIES.path(cell=t)], z[t], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(stats[V.ARCH_WEIGHTS.path(cell=t)], z[t], rtol=1e-12, atol=1e-14)
        method.epoch_end(epoch)


def test_darts_genotype_is_the_darts_rule_with_none_excluded():
    """For every node: the 2 incoming edges whose strongest non-'none' op is strongest, each with that op; 'none'
    is never chosen even where it dominates (here it is the largest weight on every edge)."""
    cls = get_method("darts")
    net = supernet(3, primitives=PRIMS)
    with torch.no_grad():
        for a in net.arch_parameters():
            a[:, 0] += 5.0
    method = cls(net, schedule=Schedule(epochs=1, steps_per_epoch=1))
    got = method.genotype()
    for t, genes in (("normal", got.normal), ("reduce", got.reduce)):
        p = torch.softmax(net.alphas()[t].detach(), -1)
        want, start = [], 0
        for node in range(2):
            n_in = node + 2
            rows = p[start:start + n_in, 1:]  # 'none' (index 0) excluded
            best, op = rows.max(-1)
            order = sorted(range(n_in), key=lambda i: -float(best[i]))[:2]
            want += [(PRIMS[1 + int(op[i])], i) for i in order]
            start += n_in
        assert genes == want, t
    assert got.normal_concat == [2, 3]


# -- DARTS, second order ----------------------------------------------------------------------------------
def exact_hypergradient(net, w_opt, train, val):
    """d/dα L_val(w'(α), α), w'(α) = w − ξ(∇_w L_train(w, α) + μ b + λ w) (DARTS eq 6-7, sparse-supernet eq 11-12)
    by autograd through the unrolled step; ξ, μ, λ and b read from the optimizer."""
    group = w_opt.param_groups[0]
    ref = Reference(net)
    alpha = {t: a.clone().requires_grad_(True) for t, a in ref.alpha.items()}
    z = {t: torch.softmax(a, -1) for t, a in alpha.items()}
    w = {n: t.clone().requires_grad_(True) for n, t in ref.w.items()}
    grads = torch.autograd.grad(ref.loss(w, *train, z), list(w.values()), create_graph=True, allow_unused=True)
    params = dict((n, p) for n, p in net.named_parameters())
    unrolled = {}
    for (n, wn), g in zip(w.items(), grads):
        state = w_opt.state.get(params[n], {})
        b = state.get("momentum_buffer", torch.zeros_like(wn))
        unrolled[n] = wn.detach() - group["lr"] * ((torch.zeros_like(wn) if g is None else g)
                                                  + group["momentum"] * b + group["weight_decay"] * wn.detach())
    val_loss = ref.loss(unrolled, *val, z)
    return dict(zip(alpha, torch.autograd.grad(val_loss, list(alpha.values()))))


def test_darts2_applies_the_hypergradient_with_xi_the_scheduled_lr_and_train_val_in_their_places():
    """The α.grad a second-order step applies is the exact eq 12 hypergradient (to the O(ε²) of eq 13's central
    difference) with ξ the w learning rate of the CURRENT epoch (cosine) and b w's momentum buffers; swapping the
    train and val batches gives a different gradient (each split is used where eq 12 puts it)."""
    cls = get_method("darts2")
    h = cls.Hyperparameters(w_lr=0.5, w_lr_min=0.01, fd_eps_scale=1e-4)
    net = supernet(4, primitives=("none", "skip_connect", "avg_pool_3x3", "sep_conv_3x3"), smooth=True)
    method = cls(net, h, schedule=Schedule(epochs=2, steps_per_epoch=1, batch_size=B))
    data = batches(4, 5)
    method.step(*data[:2])
    method.epoch_end(0)
    xi = cosine(h.w_lr, h.w_lr_min, 1, 2)
    assert method.w_optimizer.param_groups[0]["lr"] == pytest.approx(xi, rel=1e-12)
    train, val = data[2], data[3]
    exact = exact_hypergradient(net, method.w_optimizer, train, val)
    swapped = exact_hypergradient(net, method.w_optimizer, val, train)
    ref = Reference(net)
    alpha = {t: a.clone().requires_grad_(True) for t, a in ref.alpha.items()}
    loss = ref.loss(ref.w, *val, {t: torch.softmax(a, -1) for t, a in alpha.items()})
    first_order = dict(zip(alpha, torch.autograd.grad(loss, list(alpha.values()))))
    alpha_before = {t: a.detach().clone() for t, a in net.alphas().items()}
    adam = {t: {k: v.clone() for k, v in method.alpha_optimizer.state[a].items()} for t, a in net.alphas().items()}
    method.step(train, val)

    def rel(a, b):
        return float(torch.sqrt(sum(((a[t] - b[t]) ** 2).sum() for t in b)) / torch.sqrt(sum((b[t] ** 2).sum() for t in b)))

    applied = {t: a.grad for t, a in net.alphas().items()}
    assert rel(applied, exact) < 1e-6
    assert rel(first_order, exact) > 1e-2 and rel(swapped, exact) > 1e-2  # both comparisons can fail
    # the applied gradient went through DARTS's Adam (second step: bias corrections at t = 2)
    lr, (b1, b2), wd = h.alpha_lr, h.alpha_betas, h.alpha_weight_decay
    for t, a in net.alphas().items():
        state = adam[t]
        g = applied[t] + wd * alpha_before[t]
        m = b1 * state["exp_avg"] + (1 - b1) * g
        v = b2 * state["exp_avg_sq"] + (1 - b2) * g * g
        want = alpha_before[t] - lr * (m / (1 - b1 ** 2)) / ((v / (1 - b2 ** 2)).sqrt() + 1e-8)
        torch.testing.assert_close(a.detach(), want, rtol=1e-12, atol=1e-14)


# -- SNAS, DSNAS, ProxylessNAS: the same samples, drawn here ------------------------------------------------
class Draws:
    """Samples drawn here with a generator of our own, handed to the method through the sampler it calls."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.log = []

    def gumbel(self, shape, generator, dtype, device):
        u = torch.rand(shape, generator=self.g, dtype=dtype)
        out = -torch.log(-torch.log(u))
        self.log.append(out)
        return out

    def onehot(self, probs, generator):
        idx = torch.multinomial(probs, 1, generator=self.g)
        out = torch.zeros_like(probs).scatter_(-1, idx, 1.0)
        self.log.append(out)
        return out

    def two_paths(self, probs, generator):
        pair = torch.zeros_like(probs, dtype=torch.bool)
        gates = torch.zeros_like(probs)
        for e in range(probs.shape[0]):  # ProxylessNAS 'two' mode, edge by edge as its binarize() does
            a, b = torch.multinomial(probs[e], 2, replacement=False, generator=self.g).tolist()
            pa, pb = torch.softmax(torch.stack([probs[e, a].log(), probs[e, b].log()]), 0)
            pick = a if torch.rand((), generator=self.g, dtype=probs.dtype) < pa else b
            pair[e, a] = pair[e, b] = True
            gates[e, pick] = 1.0
        self.log.append((pair, gates))
        return pair, gates


def test_snas_two_steps_equal_the_gumbel_softmax_relaxation_with_the_same_noise(monkeypatch):
    """SNAS: Z = softmax((α + G)/τ) (α the logits of p), ONE forward/backward on the training batch gives ∂L/∂w and
    ∂L/∂α through Z (single level); α ← Adam, w ← clipped SGD; τ ← 0.97 τ after the epoch; the record's weights are
    the relaxed sample and its temperature the τ used."""
    import nasdiag.search.methods.snas as snas

    draws = Draws(11)
    monkeypatch.setattr(snas, "gumbel_noise", draws.gumbel)
    net, method, h, ref, adam, sgd = alternating("snas", 6, alpha_lr=0.05, tau0=0.8, grad_clip=0.3)
    tau = h.tau0
    for epoch, (x, y) in enumerate(batches(2, 12)):
        stats = method.step((x, y))
        noise = dict(zip(ref.alpha, draws.log[-len(ref.alpha):]))
        alpha = {t: a.clone().requires_grad_(True) for t, a in ref.alpha.items()}
        w = {n: t.clone().requires_grad_(True) for n, t in ref.w.items()}
        z = {t: torch.softmax((a + noise[t]) / tau, -1) for t, a in alpha.items()}
        loss = ref.loss(w, x, y, z)
        grads = torch.autograd.grad(loss, list(alpha.values()) + list(w.values()), allow_unused=True)
        ref.alpha = {t: adam.step(t, ref.alpha[t], g) for t, g in zip(alpha, grads)}
        lr = cosine(h.w_lr, h.w_lr_min, epoch, 3)
        wg = clipped(grads[len(alpha):], h.grad_clip)
        ref.w = {n: sgd.step(n, ref.w[n], g, lr) for n, g in zip(ref.names, wg)}
        assert_same_state(method, ref)
        assert float(stats["scalars/temperature"]) == pytest.approx(tau, rel=1e-7)
        torch.testing.assert_close(stats["scalars/train_loss"], loss.detach(), rtol=1e-12, atol=0)
        for t in z:
            torch.testing.assert_close(stats[V.ARCH_WEIGHTS.path(cell=t)], z[t].detach(), rtol=1e-12, atol=1e-15)
        method.epoch_end(epoch)
        tau *= 0.97
        assert method.temperature == pytest.approx(tau, rel=1e-15)


def test_dsnas_two_steps_equal_the_score_function_estimator_with_the_same_samples(monkeypatch):
    """DSNAS: one-hot Z ~ Cat(softmax(α)), only the sampled ops computed; ∂L/∂α = C_s ∇_α log p_s with the credit
    C_s = ∂L/∂Z_s of the ONE training forward (single level, same backward as ∂L/∂w); unsampled weights are not
    touched by SGD (no gradient: no decay, no momentum)."""
    import nasdiag.search.methods.dsnas as dsnas

    draws = Draws(21)
    monkeypatch.setattr(dsnas, "sample_onehot", draws.onehot)
    net, method, h, ref, adam, sgd = alternating("dsnas", 7, alpha_lr=0.05, grad_clip=0.3)
    counts = {t: torch.zeros_like(a, dtype=torch.int64) for t, a in ref.alpha.items()}
    for epoch, (x, y) in enumerate(batches(2, 22)):
        stats = method.step((x, y))
        onehot = dict(zip(ref.alpha, draws.log[-len(ref.alpha):]))
        z = {t: o.clone().requires_grad_(True) for t, o in onehot.items()}
        w = {n: t.clone().requires_grad_(True) for n, t in ref.w.items()}
        loss = ref.loss(w, x, y, z, active={t: o.bool() for t, o in onehot.items()})
        grads = torch.autograd.grad(loss, list(z.values()) + list(w.values()), allow_unused=True)
        for (t, a), c in zip(ref.alpha.items(), grads):
            p = torch.softmax(a, -1)
            credit = (c * onehot[t]).sum(-1, keepdim=True)  # C(Z^s), the sampled op's cost
            ref.alpha[t] = adam.step(t, a, credit * (onehot[t] - p))  # ∇_α log p_s = Z − p
            counts[t] += onehot[t].long()
        lr = cosine(h.w_lr, h.w_lr_min, epoch, 3)
        wg = clipped(grads[len(z):], h.grad_clip)
        assert any(g is None for g in wg)  # some weights belong to unsampled ops only
        ref.w = {n: sgd.step(n, ref.w[n], g, lr) for n, g in zip(ref.names, wg)}
        assert_same_state(method, ref)
        for t in onehot:
            assert torch.equal(stats[V.SAMPLE_ONEHOT.path(cell=t)], onehot[t])
            assert torch.equal(stats[V.SAMPLE_COUNT.path(cell=t)], counts[t])
        method.epoch_end(epoch)
    # the supernet evaluation runs the most likely child
    for t, zt in method.eval_weights().items():
        assert torch.equal(zt.argmax(-1), ref.alpha[t].argmax(-1)) and torch.equal(zt.sum(-1), torch.ones(zt.shape[0], dtype=zt.dtype))


def test_proxyless_step_equals_binary_connect_on_the_sampled_pair_with_the_same_samples(monkeypatch):
    """ProxylessNAS (gradient mode, 'two'): w step at one gated path per edge (search-train); α step (search-val)
    with two paths computed, ∂L/∂α_i = Σ_j ∂L/∂g_j p'_j (δ_ij − p'_i) on the pair (its set_arch_param_grad, a double
    loop here), Adam(β1 = 0, no weight decay), then both α of the pair shifted by log(Σ exp α_new / Σ exp α_old)."""
    import nasdiag.search.methods.proxyless as proxyless

    draws = Draws(31)
    monkeypatch.setattr(proxyless, "sample_onehot", draws.onehot)
    monkeypatch.setattr(proxyless, "sample_two_paths", draws.two_paths)
    net, method, h, ref, adam, sgd = alternating("proxyless", 8, alpha_lr=0.05, grad_clip=0.3)
    data = batches(4, 32)
    for epoch in range(2):
        (xt, yt), (xv, yv) = data[2 * epoch], data[2 * epoch + 1]
        stats = method.step((xt, yt), (xv, yv))
        n = len(ref.alpha)
        onehot = dict(zip(ref.alpha, draws.log[-2 * n:-n]))
        pairs = dict(zip(ref.alpha, draws.log[-n:]))
        lr = cosine(h.w_lr, h.w_lr_min, epoch, 3)
        ref.weight_step(sgd, lr, h.grad_clip, xt, yt, onehot, active={t: o.bool() for t, o in onehot.items()})
        gates = {t: g.clone().requires_grad_(True) for t, (_, g) in pairs.items()}
        loss = ref.loss(ref.w, xv, yv, gates, active={t: pr for t, (pr, _) in pairs.items()})
        binary_grads = dict(zip(gates, torch.autograd.grad(loss, list(gates.values()))))
        for t, a in list(ref.alpha.items()):
            pair, _ = pairs[t]
            grad = torch.zeros_like(a)
            for e in range(a.shape[0]):
                idx = pair[e].nonzero().flatten().tolist()
                p = torch.softmax(a[e, idx], 0)
                for i in range(2):
                    for j in range(2):
                        grad[e, idx[i]] += binary_grads[t][e, idx[j]] * p[j] * (float(i == j) - p[i])
            new = adam.step(t, a, grad)
            for e in range(a.shape[0]):
                idx = pair[e].nonzero().flatten().tolist()
                offset = torch.log(new[e, idx].exp().sum() / a[e, idx].exp().sum())
                new[e, idx] -= offset
            ref.alpha[t] = new
        assert_same_state(method, ref)
        torch.testing.assert_close(stats["scalars/val_loss"], loss.detach(), rtol=1e-12, atol=0)
        for t, (pair, g) in pairs.items():
            assert torch.equal(stats[V.SAMPLE_PATHS.path(cell=t)].bool(), pair)
            assert torch.equal(stats[V.SAMPLE_ONEHOT.path(cell=t)], g)
        method.epoch_end(epoch)


def test_samplers_draw_from_p():
    """The library's samplers against their distributions (20000 draws, 5σ): a one-hot sample ~ Cat(p); the
    argmax of a Gumbel-perturbed logit ~ Cat(p) (the SNAS relaxation's τ → 0 limit); ProxylessNAS's pair is two
    draws from p without replacement and its gate picks a ∈ {a, b} with probability p_a/(p_a + p_b)."""
    from nasdiag.search.methods._sampling import gumbel_noise, sample_onehot, sample_two_paths

    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    N = 20000
    probs = p.expand(N, 4).contiguous()
    g = torch.Generator().manual_seed(0)
    sigma = lambda q: 5 * math.sqrt(q * (1 - q) / N)  # noqa: E731
    freq = sample_onehot(probs, g).mean(0)
    assert ((freq - p).abs() <= torch.tensor([sigma(q) for q in p.tolist()])).all(), freq
    gumbel_argmax = (p.log() + gumbel_noise((N, 4), g, torch.float64, "cpu")).argmax(-1)
    freq = torch.bincount(gumbel_argmax, minlength=4).double() / N
    assert ((freq - p).abs() <= torch.tensor([sigma(q) for q in p.tolist()])).all(), freq
    pair, gates = sample_two_paths(probs, g)
    assert (pair.sum(-1) == 2).all() and (gates.sum(-1) == 1).all() and (gates.bool() <= pair).all()
    # P(a and b drawn) = p_a p_b/(1 − p_a) + p_b p_a/(1 − p_b); P(gate a | {a, b}) = p_a/(p_a + p_b)
    for a, b in ((0, 1), (0, 3), (2, 3)):
        both = pair[:, a] & pair[:, b]
        want = float(p[a] * p[b] / (1 - p[a]) + p[b] * p[a] / (1 - p[b]))
        assert abs(float(both.double().mean()) - want) <= sigma(want)
        share = float(p[a] / (p[a] + p[b]))
        n_ab = int(both.sum())
        assert abs(float(gates[both, a].mean()) - share) <= 5 * math.sqrt(share * (1 - share) / n_ab)


# -- SparseNAS ----------------------------------------------------------------------------------------------
SPARSE_PRIMS = ("skip_connect", "max_pool_3x3", "avg_pool_3x3", "sep_conv_3x3")


def soft_threshold(z, t):
    """Eq 9, elementwise: sgn(z)(|z| − t)₊."""
    return torch.where(z.abs() > t, z - torch.sign(z) * t, torch.zeros_like(z))


def node_prox(z, thresholds, edge_nodes):
    """Eq 10 on every node group A_(n) (all weights of all edges entering node n): (1 − √|A_(n)| t_n/‖z_(n)‖)₊ z_(n)."""
    out = z.clone()
    for n, node in enumerate(sorted({j for _, j in edge_nodes})):
        rows = [e for e, (_, j) in enumerate(edge_nodes) if j == node]
        block = z[rows]
        norm = float(block.norm())
        scale = max(0.0, 1 - math.sqrt(block.numel()) * float(thresholds[n]) / norm) if norm > 0 else 0.0
        out[rows] = block * scale
    return out


def sparsenas_method(seed, **hp):
    cls = get_method("sparsenas")
    torch.manual_seed(seed)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=SPARSE_PRIMS).double()
    return cls(net, cls.Hyperparameters(**hp), schedule=Schedule(epochs=3, steps_per_epoch=1, batch_size=B), seed=seed)


@pytest.mark.parametrize("optimizer", ["hapg", "adamhapg"])
def test_sparsenas_two_steps_equal_eq_6_to_10_with_progressive_lambda(optimizer):
    """SparseNAS Alg. 1 (first order): A ← HAPG/AdamHAPG on ∇_A l_val (linear mixing, eq 1: Z = A) with the
    hierarchical prox of eq 5, 9, 10 and the momentum of eq 7-8 (u_t = (t − 2)/(t + 1), the first step counted as
    t = 2); then w ← DARTS's SGD on l_train at the new A. λ = lambda_step·(epoch + 1); HAPG's η cosine-annealed to 0;
    AdamHAPG: per-weight η_i in the ℓ1 prox, the group's (lower) median η_i in the group prox. Zeros are exact."""
    # A starts at 1/K + 0.1·N(0, 1), so the thresholds zero some weights, shrink the rest, and (AdamHAPG) one node
    hp = dict(first_order=True, optimizer=optimizer, lambda_step=0.3, sgl_alpha=0.5, grad_clip=0.3, init_scale=0.1)
    if optimizer == "hapg":
        hp.update(hapg_lr=0.5, lambda_step=0.6)
    else:
        hp["alpha_lr"] = 0.04
    method = sparsenas_method(9, **hp)
    h, net = method.hp, method.network
    ref = Reference(net)
    sgd = SGD(h.w_momentum, h.w_weight_decay)
    adam_m = {t: torch.zeros_like(a) for t, a in ref.alpha.items()}
    adam_v = {t: torch.zeros_like(a) for t, a in ref.alpha.items()}
    v_prev = {t: torch.zeros_like(a) for t, a in ref.alpha.items()}
    u = lambda t: (t - 2) / (t + 1)  # noqa: E731
    edge_nodes = net.edge_nodes
    data = batches(4, 41)
    zeros_seen = 0
    for epoch in range(2):
        (xt, yt), (xv, yv) = data[2 * epoch], data[2 * epoch + 1]
        stats = method.step((xt, yt), (xv, yv))
        lam = h.lambda_step * (epoch + 1)
        t_step = epoch + 2  # the first step counts as t = 2
        A = {t: a.clone().requires_grad_(True) for t, a in ref.alpha.items()}
        grads = dict(zip(A, torch.autograd.grad(ref.loss(ref.w, xv, yv, A), list(A.values()))))
        for t, a in ref.alpha.items():
            g = grads[t]
            if optimizer == "hapg":
                eta = cosine(h.hapg_lr, 0.0, epoch, 3) * torch.ones_like(a)
                z = a - eta * g  # eq 6
            else:
                b1, b2 = h.alpha_betas
                n = epoch + 1
                adam_m[t] = b1 * adam_m[t] + (1 - b1) * g
                adam_v[t] = b2 * adam_v[t] + (1 - b2) * g * g
                eta = h.alpha_lr / (1 - b1 ** n) / ((adam_v[t] / (1 - b2 ** n)).sqrt() + 1e-8)
                z = a - eta * adam_m[t]
            l1 = soft_threshold(z, eta * lam * h.sgl_alpha)  # eq 9
            group_eta = []
            for node in sorted({j for _, j in edge_nodes}):
                rows = [e for e, (_, j) in enumerate(edge_nodes) if j == node]
                values = eta[rows].flatten().sort().values
                group_eta.append(values[(values.numel() - 1) // 2])  # the (lower) median step size of the group
            prox = node_prox(l1, [ge * lam * (1 - h.sgl_alpha) for ge in group_eta], edge_nodes)  # eq 10
            v = prox - a + u(t_step - 1) * v_prev[t]  # eq 7
            ref.alpha[t] = prox + u(t_step) * v  # eq 8
            v_prev[t] = v
            zeros_seen += int((ref.alpha[t] == 0).sum())
        lr = cosine(h.w_lr, h.w_lr_min, epoch, 3)
        ref.weight_step(sgd, lr, h.grad_clip, xt, yt, dict(ref.alpha))
        assert_same_state(method, ref)
        assert float(stats[V.SPARSITY_LAMBDA.path()]) == pytest.approx(lam, rel=1e-7)
        for t, a in ref.alpha.items():
            assert torch.equal(stats[V.SPARSITY_NONZERO.path(cell=t)], a != 0)
            assert torch.equal(stats[V.ARCH_WEIGHTS.path(cell=t)], net.alphas()[t].detach())
        method.epoch_end(epoch)
    assert zeros_seen > 0  # the soft thresholds acted
    # the mixed-path genotype keeps exactly the non-zero weights, except those leaving a removed node (round 5: a node
    # without incoming weight, x_j = 0, is removed with the ops leaving it)
    genes = method.genotype()
    for t, cell in (("normal", genes.normal), ("reduce", genes.reduce)):
        want = [(SPARSE_PRIMS[k], i, j) for e, (i, j) in enumerate(edge_nodes) for k in range(len(SPARSE_PRIMS))
                if ref.alpha[t][e, k] != 0]
        live = set()
        for node in sorted({j for _, _, j in want}):
            if any(j == node and (i < 2 or i in live) for _, i, j in want):
                live.add(node)
        want = [(op, i, j) for op, i, j in want if j in live and (i < 2 or i in live)]
        assert cell == want
        assert getattr(genes, f"{t}_concat") == sorted(live)  # nodes without an incoming weight are removed


def test_sparsenas_node_sparsity_of_eq_10_is_kept():
    """Eq 10 zeroes a whole node group when ‖z_(n)‖ ≤ √|z_(n)| t_n: the paper's node sparsity ("removes some useless
    nodes"; "the nodes with all zero incoming weights" are removed from the derived cell). The step keeps that zero
    (restoring an op on each emptied edge made the removal of a node impossible), and the genotype drops the node
    from the cell's output. First AdamHAPG step: η_i = lr/(|g_i| + ε)·(1 − β1)/(1 − β1) so z = A − lr·g/(|g| + ε)."""
    lam, lr = 0.15, 0.04
    method = sparsenas_method(9, first_order=True, optimizer="adamhapg", alpha_lr=lr, lambda_step=lam, sgl_alpha=0.5)
    net = method.network
    (xt, yt), (xv, yv) = batches(2, 41)
    ref = Reference(net)
    A = {t: a.clone().requires_grad_(True) for t, a in ref.alpha.items()}
    grads = dict(zip(A, torch.autograd.grad(ref.loss(ref.w, xv, yv, A), list(A.values()))))
    want = {}
    for t, a in ref.alpha.items():
        g = grads[t]
        eta = lr / (1 - 0.5) / ((g * g).sqrt() + 1e-8)  # first Adam step: m̂ = g, √v̂ = |g|
        z = a - eta * (1 - 0.5) * g
        group_eta = []
        for node in (2, 3):
            rows = [e for e, (_, j) in enumerate(net.edge_nodes) if j == node]
            values = eta[rows].flatten().sort().values
            group_eta.append(values[(values.numel() - 1) // 2])
        want[t] = node_prox(soft_threshold(z, eta * lam * 0.5), [ge * lam * 0.5 for ge in group_eta], net.edge_nodes)
    emptied = {t: [node for node in (2, 3) if bool((w[[e for e, (_, j) in enumerate(net.edge_nodes) if j == node]] == 0).all())]
               for t, w in want.items()}
    assert any(emptied.values())  # eq 9-10 remove a node here
    method.step((xt, yt), (xv, yv))
    for t, a in net.alphas().items():
        torch.testing.assert_close(a.detach(), want[t], rtol=1e-12, atol=1e-15)
    genes = method.genotype()
    for t in want:
        assert getattr(genes, f"{t}_concat") == [n for n in (2, 3) if n not in emptied[t]]
        assert not any(j in emptied[t] for _, _, j in getattr(genes, t))


# -- BayesNAS: step 1 of Algorithm 2 ---------------------------------------------------------------------------
def test_bayesnas_likelihood_step_is_a_3_1():
    """Algorithm 2 step 1 (A.3.1) on the training batch: one momentum-SGD step of the network weights 𝒲 (weight
    decay λ, clipped) and of w (no decay, not clipped) on E_D/B + λ_w Σ_g ω ‖w_group‖₂, where the group of an op is
    its ℵ copies in the cells of a kind (one shared w here, so ∂/∂w = √ℵ ω sign(w)); Z = w (linear mixing). Both
    learning rates follow the cosine schedule. No update of γ, ω, s before the epoch's last step."""
    cls = get_method("bayesnas")
    h = cls.Hyperparameters(lambda_w=0.3, grad_clip=0.3)
    torch.manual_seed(12)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=cls.primitives[:4]).double()
    method = cls(net, h, schedule=Schedule(epochs=3, steps_per_epoch=3, batch_size=B))
    g = torch.Generator().manual_seed(1)
    omega = {t: 0.5 + torch.rand(a.shape, generator=g, dtype=torch.float64) for t, a in net.alphas().items()}
    method.omega = {t: o.clone() for t, o in omega.items()}  # a state after some update: ω ≠ 1
    with torch.no_grad():
        for a in net.arch_parameters():
            a.mul_(torch.where(torch.rand(a.shape, generator=g) < 0.3, -1.0, 1.0).double())  # signs of both kinds
    aleph = {"normal": 1, "reduce": 2}
    ref = Reference(net)
    sgd_w, sgd_a = SGD(h.w_momentum, h.w_weight_decay), SGD(h.w_momentum, 0.0)
    data = batches(4, 13)
    for step in range(2):
        x, y = data[2 * step]
        stats = method.step((x, y), data[2 * step + 1])
        assert not bool(stats[V.BAYES_UPDATED.path()])
        lr = cosine(h.w_lr, h.w_lr_min, 0, 3)
        A = {t: a.clone().requires_grad_(True) for t, a in ref.alpha.items()}
        w = {n: t.clone().requires_grad_(True) for n, t in ref.w.items()}
        loss = ref.loss(w, x, y, A)
        grads = torch.autograd.grad(loss, list(A.values()) + list(w.values()), allow_unused=True)
        for (t, a), ga in zip(ref.alpha.items(), grads):
            penalty = h.lambda_w * math.sqrt(aleph[t]) * omega[t] * torch.sign(a)
            ref.alpha[t] = sgd_a.step(t, a, ga + penalty, lr)
        wg = clipped(grads[len(A):], h.grad_clip)
        ref.w = {n: sgd_w.step(n, ref.w[n], gw, lr) for n, gw in zip(ref.names, wg)}
        assert_same_state(method, ref)
        torch.testing.assert_close(stats["scalars/train_loss"], loss.detach(), rtol=1e-12, atol=0)


# -- ASM-NAS: one step ------------------------------------------------------------------------------------------
def test_asmnas_step_is_single_level_sgd_on_w_and_theta_with_the_training_batch():
    """Algorithm 1 line 4: (w, Θ) take one momentum-SGD step (weight decay, clipped) on L_train of the attention-
    mixed supernet (eq 4.2-4.5); the validation batch plays no part in a step; no architecture parameter moves."""
    cls = get_method("asmnas")
    h = cls.Hyperparameters(grad_clip=0.3, attention_hidden=5)
    net = supernet(14)
    method = cls(net, h, schedule=Schedule(epochs=2, steps_per_epoch=1, batch_size=B))
    twin = copy.deepcopy(method)
    ref = Reference(net)
    from nasdiag.supernet.attention import attention_weights

    (x, y), val, other = batches(3, 15)
    w = {n: t.clone().requires_grad_(True) for n, t in ref.w.items()}
    buffers = {n: b.clone() for n, b in ref.net.named_buffers()}
    loss = F.cross_entropy(functional_call(ref.net, {**w, **buffers}, (x, attention_weights(ref.net))), y)
    grads = clipped(torch.autograd.grad(loss, list(w.values()), allow_unused=True), h.grad_clip)
    assert sum(1 for n in ref.names if ".attention." in n) > 0  # Θ are among the trained weights
    sgd = SGD(h.w_momentum, h.w_weight_decay)
    ref.w = {n: sgd.step(n, ref.w[n], g, h.w_lr) for n, g in zip(ref.names, grads)}
    stats = method.step((x, y), val)
    twin_stats = twin.step((x, y), other)
    assert_same_state(method, ref)
    torch.testing.assert_close(stats["scalars/train_loss"], loss.detach(), rtol=1e-12, atol=0)
    for a, b in zip(method.network.parameters(), twin.network.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(stats["scalars/train_loss"], twin_stats["scalars/train_loss"])


# -- resume inside an epoch ---------------------------------------------------------------------------------------
RESUMABLE = {
    "darts": {}, "darts2": {}, "snas": {"tau0": 0.7}, "dsnas": {}, "proxyless": {},
    "sparsenas": {"first_order": True, "optimizer": "hapg", "lambda_step": 0.3},
    "bayesnas": {"lambda_w": 0.05}, "asmnas": {"attention_hidden": 4},
}


@pytest.mark.parametrize("name", sorted(RESUMABLE))
def test_a_state_saved_inside_an_epoch_continues_bit_identically(name):
    """state_dict() after step 1 of a 3-step epoch, through bytes as a checkpoint is, loaded into a method built
    from other weights and another seed: steps 2-3, the epoch end (schedules, τ, λ, BayesNAS's update at the
    epoch's last step) and step 4 give the same statistics and parameters, bit for bit."""
    cls = get_method(name)
    prims = cls.primitives[:4] if cls.primitives else PRIMS
    schedule = Schedule(epochs=2, steps_per_epoch=3, batch_size=B)

    def build(seed):
        torch.manual_seed(seed)
        net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=prims).double()
        return cls(net, cls.Hyperparameters(**RESUMABLE[name]), schedule=schedule, seed=seed)

    data = batches(8, 50)
    pairs = list(zip(data[::2], data[1::2]))
    first = build(1)
    first.step(*pairs[0])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = build(2)
    second.load_state_dict(torch.load(buffer, weights_only=False))
    for i, pair in enumerate(pairs[1:]):
        if i == 2:
            first.epoch_end(0)
            second.epoch_end(0)
        s1, s2 = first.step(*pair), second.step(*pair)
        assert s1.keys() == s2.keys()
        for path in s1:
            assert torch.equal(s1[path], s2[path]), (name, i, path)
    for (n, a), b in zip(first.network.named_parameters(), second.network.parameters()):
        assert torch.equal(a, b), (name, n)
    assert first.genotype() == second.genotype()


# -- what the record says against what happened -------------------------------------------------------------------
@pytest.mark.slow  # a short run() on digits (~10 s)
def test_a_recorded_snas_run_holds_the_schedules_and_the_final_state_of_the_method(tmp_path):
    """run() of SNAS on digits, read back with nasdiag's reader: one row per step; w_lr of each row is the cosine
    value of its epoch and τ = τ0·0.97^epoch; arch/<cell>/probabilities = softmax(arch/<cell>/params) per row; the
    last row's α and the checkpoint's (the state the run ended in) are the same numbers; the genotype recorded is
    the DARTS rule on that α."""
    import numpy as np

    from nasdiag.record import load
    from nasdiag.search import SearchConfig, run
    from nasdiag.search.checkpoint import load_checkpoint

    cfg = SearchConfig(method="snas", C=2, layers=3, steps=2, multiplier=2, batch_size=240, epochs=2, dtype="float64",
                       diagnostics=(), progress=False, threads=1, record=str(tmp_path / "snas.h5"), hp={"tau0": 0.9})
    result = run(cfg)
    rec = load(str(tmp_path / "snas.h5"))
    S = 719 // 240
    assert rec["step"].tolist() == list(range(1, 2 * S + 1))
    epoch_of_row = np.arange(2 * S) // S
    h = get_method("snas").Hyperparameters()
    want_lr = [cosine(h.w_lr, h.w_lr_min, int(e), 2) for e in epoch_of_row]
    np.testing.assert_allclose(rec["scalars/w_lr"], want_lr, rtol=1e-7)
    np.testing.assert_allclose(rec["scalars/temperature"], 0.9 * 0.97 ** epoch_of_row, rtol=1e-7)
    state = load_checkpoint(cfg.checkpoint)["method"]["network"]
    for t in ("normal", "reduce"):
        params = rec[V.ARCH_PARAMS.path(cell=t)]
        probs = torch.softmax(torch.as_tensor(params, dtype=torch.float64), -1).numpy()
        np.testing.assert_allclose(rec[V.ARCH_PROBABILITIES.path(cell=t)], probs, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(params[-1], state[f"alphas_{t}"].numpy(), rtol=1e-6, atol=1e-7)
    net = Network(2, 10, 3, steps=2, multiplier=2, in_channels=1)
    with torch.no_grad():
        for t, a in net.alphas().items():
            a.copy_(state[f"alphas_{t}"].float())
    assert result.genotype == get_method("snas")(net, schedule=Schedule(epochs=1, steps_per_epoch=1)).genotype()


def test_bayesnas_pruning_removes_edges_and_through_a_2_14_the_node_they_feed():
    """Algorithm 2 step 4 prunes every op with ½ ln(2πe γ) ≤ 0 and keeps nothing else: the edges into node 2, whose
    w the ℓ1 term has shrunk to ~0, lose every op (an op put back on each emptied edge kept every node alive, and
    the edge dependency of A.2.14 could never remove one). Through A.2.14, γ of the edge (2, 3) is
    (1/Σ_parents s + 1/s)⁻¹ ≤ Σ_parents s ≈ 0, so it goes in the same update: node 2 is gone from the cell and from
    its output. The next step runs with the empty edges; their switches are then exactly 0 (w = 0, A.2.13) and
    the γ of (2, 3) exactly 0."""
    cls = get_method("bayesnas")
    torch.manual_seed(16)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=cls.primitives[:4]).double()
    method = cls(net, cls.Hyperparameters(update_every=1, w_lr=1e-9), schedule=Schedule(epochs=1, steps_per_epoch=2,
                                                                                        batch_size=B))
    with torch.no_grad():
        net.alphas()["normal"][:2] = 1e-4  # edges (0, 2) and (1, 2)
    into_2 = [e for e, (_, j) in enumerate(net.edge_nodes) if j == 2]
    out_of_2 = [e for e, (i, _) in enumerate(net.edge_nodes) if i == 2]
    others = [e for e in range(len(net.edge_nodes)) if e not in into_2 + out_of_2]
    threshold = 1 / (2 * math.pi * math.e)
    for step, (train, val) in enumerate((batches(2, 17), batches(2, 18))):
        stats = method.step(train, val)
        s = stats[V.BAYES_PRIOR_VARIANCE.path(cell="normal")]
        gamma = stats[V.BAYES_GAMMA.path(cell="normal")]
        alive = stats[V.BAYES_SWITCH.path(cell="normal")]
        upstream = float(s[into_2].sum())
        for e in out_of_2:  # A.2.14, written out
            want = torch.zeros_like(s[e]) if upstream == 0 else 1 / (1 / upstream + 1 / s[e])
            torch.testing.assert_close(gamma[e], want, rtol=1e-12, atol=0)
        assert (gamma[into_2 + out_of_2] <= threshold).all() and not alive[into_2 + out_of_2].any()
        assert alive[others].any(-1).all()
        if step == 1:
            assert upstream == 0.0 and (gamma[out_of_2] == 0).all()
    genes = method.genotype()
    assert genes.normal_concat == [3] and all(2 not in (i, j) for _, i, j in genes.normal)


@pytest.mark.slow  # three short run()s on digits
def test_bayesnas_run_interrupted_inside_an_epoch_and_resumed_equals_the_uninterrupted_run(tmp_path):
    """run() of BayesNAS (an update, with pruning, at each epoch's last step) stopped after the first step of the
    second epoch and resumed: every recorded row and the final state equal those of the uninterrupted run."""
    import numpy as np

    from nasdiag.record import load
    from nasdiag.search import SearchConfig, run
    from nasdiag.search.checkpoint import load_checkpoint

    def config(name, **kw):
        # float64, compared to 1e-9 relative rather than bitwise: on a 16-core Xeon host (torch 2.11 CPU) two
        # identical uninterrupted runs in one process already differed by 8e-17 (float64) / one ulp (float32) in
        # γ and α, so that host's kernels do not sum in one fixed order; a resume that lost state (optimizer,
        # random stream, γ, the prune mask) differs by far more. λ_w = 3 prunes
        return SearchConfig(method="bayesnas", C=2, layers=3, steps=2, multiplier=2, batch_size=240, epochs=2,
                            dtype="float64", diagnostics=(), progress=False, threads=1, record=str(tmp_path / name),
                            hp={"lambda_w": 3.0}, **kw)

    run(config("whole.h5"))
    with pytest.raises(KeyboardInterrupt):
        run(config("resumed.h5"), callbacks=[_InterruptAt(719 // 240 + 1)])
    run(config("resumed.h5", resume=True))
    whole, resumed = load(str(tmp_path / "whole.h5")), load(str(tmp_path / "resumed.h5"))
    assert whole["step"].tolist() == resumed["step"].tolist() == list(range(1, 2 * (719 // 240) + 1))
    for key in ("scalars/train_loss", "bayes/normal/gamma", "bayes/reduce/switch", "arch/normal/params"):
        # atol 0: an entry pruned to zero in one run must be exactly zero in the other
        np.testing.assert_allclose(resumed[key], whole[key], rtol=1e-9, atol=0, err_msg=key)
    assert not whole["bayes/normal/switch"][-1].all()  # the updates pruned: the comparison covers the pruned state
    a = load_checkpoint(config("whole.h5").checkpoint)["method"]
    b = load_checkpoint(config("resumed.h5").checkpoint)["method"]
    for k, v in a["network"].items():
        # plus 1e-12 absolute: a BatchNorm behind a pooling of normalized features has a running mean that is 0 up
        # to round-off (±5e-17 on the torch 2.11 host, signs differing between two runs); a lost prune mask or
        # optimizer state moves the O(0.1) weights by far more
        assert _equal_to_rounding(v, b["network"][k], atol=1e-12), k
    for k in ("gamma", "prior_variance", "alive"):
        for t in a["attributes"][k]:
            assert _equal_to_rounding(a["attributes"][k][t], b["attributes"][k][t]), (k, t)


def _equal_to_rounding(a: torch.Tensor, b: torch.Tensor, atol: float = 0.0) -> bool:
    """Bitwise for integer and bool tensors (counters, masks), to 1e-9 relative (+ ``atol``) for floating ones (see above)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=atol, equal_nan=True)
