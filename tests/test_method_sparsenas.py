"""SparseNAS (sparse-supernet eq 1–13): the A-gradient against autograd through the linear mixing (first
order) and through the unrolled weights w' (second order, smooth supernet, float64); the proximal step's
exact zeros against the optimality conditions; λ's schedule; exact resume; a run."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network

PRIMS = ("skip_connect", "avg_pool_3x3", "sep_conv_3x3")


def smooth(net):
    for module in list(net.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.ReLU):
                setattr(module, name, nn.Tanh())
    return net


def make(seed=0, B=6, **hp):
    torch.manual_seed(seed)
    net = smooth(Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, affine=True, primitives=PRIMS).double())
    cls = get_method("sparsenas")
    method = cls(net, cls.Hyperparameters(**hp), schedule=Schedule(epochs=3, steps_per_epoch=4, batch_size=B), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    batch = lambda: (torch.randn(B, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (B,), generator=g))  # noqa: E731
    return method, batch(), batch()


def test_first_order_gradient_is_autograd_through_the_linear_mixing():
    method, train, val = make(first_order=True)
    net = method.network
    net.zero_grad()
    F.cross_entropy(net(val[0], {t: a for t, a in net.alphas().items()}), val[1]).backward()
    ours = method.arch_gradient(train, val)
    for t, a in net.alphas().items():
        assert torch.allclose(ours[t], a.grad, rtol=1e-10, atol=1e-13)


def exact_hypergradient(method, train, val):
    """d/dA l_val(w'(A), A) by autograd through w'(A) = w − ξ(∇_w l_train(w, A) + μ b + λ w) (eq 11–12)."""
    net, opt = method.network, method.w_optimizer
    group = opt.param_groups[0]
    arch = {id(a) for a in net.arch_parameters()}
    named = [(n, p) for n, p in net.named_parameters() if id(p) not in arch]
    names = [n for n, _ in named]
    buffers = lambda: {n: b.clone() for n, b in net.named_buffers()}  # noqa: E731
    w = [p.detach().clone().requires_grad_(True) for _, p in named]
    A = {t: a.detach().clone().requires_grad_(True) for t, a in net.alphas().items()}
    loss_t = F.cross_entropy(functional_call(net, {**dict(zip(names, w)), **buffers()}, (train[0], A)), train[1])
    grads = torch.autograd.grad(loss_t, w, create_graph=True, allow_unused=True)
    unrolled = [wi.detach() - group["lr"] * ((torch.zeros_like(wi) if g is None else g) + group["weight_decay"] * wi.detach())
                for wi, g in zip(w, grads)]
    loss_v = F.cross_entropy(functional_call(net, {**dict(zip(names, unrolled)), **buffers()}, (val[0], A)), val[1])
    return dict(zip(A, torch.autograd.grad(loss_v, list(A.values()))))


def test_second_order_gradient_converges_to_autograd_through_the_unrolled_step():
    errors = []
    for scale in (1e-1, 1e-2, 1e-3):
        method, train, val = make(fd_eps_scale=scale)
        exact = exact_hypergradient(method, train, val)
        ours = method.arch_gradient(train, val)
        num = sum(((ours[t] - exact[t]) ** 2).sum() for t in exact) ** 0.5
        errors.append(float(num / sum((exact[t] ** 2).sum() for t in exact) ** 0.5))
    assert errors[-1] < 1e-4
    # the central difference converges quadratically: ε 10× smaller, error ~100× smaller
    assert errors[0] / errors[1] > 20 and errors[1] / errors[2] > 20


def test_proximal_step_zeros_what_the_conditions_say():
    method, train, val = make(first_order=True, optimizer="hapg", hapg_lr=0.5, lambda_step=0.5)
    net = method.network
    before = {t: a.detach().clone() for t, a in net.alphas().items()}
    grads = method.arch_gradient(train, val)
    stats = method.step(train, val)
    h = method.hp
    zeros = 0
    for t, a in net.alphas().items():
        z = before[t] - h.hapg_lr * grads[t]  # eq 6 (first step: no momentum)
        # eq 9: an element with |z| <= η λ α is exactly 0 after the ℓ1 prox (before the group step)
        small = z.abs() <= h.hapg_lr * method.lam * h.sgl_alpha
        assert bool((a[small] == 0).all())  # zeros of eq 9 stay zero, also where they empty an edge or a node
        zeros += int(small.sum())
        assert torch.equal(stats[f"sparsity/{t}/nonzero"], a != 0)
    assert zeros > 0


def test_lambda_rises_linearly_per_epoch_and_bad_values_are_refused():
    from nasdiag.errors import ConfigError

    method, _, _ = make(lambda_step=0.02)
    assert method.lam == pytest.approx(0.02)
    method.epoch_end(0)
    method.epoch_end(1)
    assert method.lam == pytest.approx(0.06)
    cls = get_method("sparsenas")
    for bad in (["sgl_alpha=1.5"], ["lambda_step=-1"], ["optimizer=sgd"]):
        with pytest.raises(ConfigError):
            cls.Hyperparameters.parse(bad, "sparsenas")


def test_state_dict_resumes_bit_identically():
    method, train, val = make()
    method.step(train, val)
    buffer = io.BytesIO()  # through bytes, as a checkpoint is (in memory, optimizers would share state tensors)
    torch.save(method.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    fresh, _, _ = make(seed=5)
    fresh.load_state_dict(state)
    for m in (method, fresh):
        m.step(train, val)
        m.step(val, train)
    for a, b in zip(method.network.parameters(), fresh.network.parameters()):
        assert torch.equal(a, b)


def test_a_search_run_records_sparsity_and_a_mixed_genotype(tmp_path):
    from nasdiag.record import load
    from nasdiag.search.config import SearchConfig
    from nasdiag.search.runner import run

    cfg = SearchConfig(method="sparsenas", dataset="synthetic", epochs=2, batch_size=16, C=4, layers=3, steps=2,
                       multiplier=2, record=str(tmp_path / "s.h5"), figures=None, diagnostics=(), progress=False,
                       hp={"first_order": True})
    result = run(cfg)
    rec = load(result.record)
    assert rec["sparsity/normal/nonzero"].dtype == bool and rec["sparsity/lambda"][-1] > 0
    assert "none" not in list(rec["meta/op_names"])
    assert result.genotype.normal, "λ = 0.01, 0.02 over two epochs leaves the mixed path ops"
