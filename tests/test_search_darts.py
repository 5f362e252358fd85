"""First-order DARTS against hand-written optimizer steps, and its α-gradient — computed from the cost
C = ∂L/∂Z as ∂L/∂α = Σ_cells (diag(p) − ppᵀ)·C (wiring supplement §2.1) — against autograd through
the softmax."""

import copy

import pytest
import torch
import torch.nn.functional as F

import nasdiag
from nasdiag.errors import NasdiagError
from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network

DARTS = get_method("darts")


def darts(net, epochs=4, probe=None, hessian_mode=None, **hp):
    return DARTS(net, DARTS.Hyperparameters(**hp), schedule=Schedule(epochs=epochs, steps_per_epoch=1), probe=probe,
                 hessian_mode=hessian_mode)


def make(seed=0):
    torch.manual_seed(seed)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()
    with torch.no_grad():
        for a in net.arch_parameters():
            a.normal_(0, 0.5)
    g = torch.Generator().manual_seed(seed + 1)
    batch = lambda: (torch.randn(6, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g))
    return net, batch(), batch()


def test_one_step_equals_manual_adam_on_alpha_then_sgd_on_w():
    net, train, val = make()
    ref = copy.deepcopy(net)
    lr_a, b1, b2, wd_a, eps = 3e-4, 0.5, 0.999, 1e-3, 1e-8
    lr_w, mom, wd_w, clip = 0.025, 0.9, 3e-4, 5.0
    method = darts(net, epochs=4, w_lr=lr_w, w_momentum=mom, w_weight_decay=wd_w, grad_clip=clip,
                   alpha_lr=lr_a, alpha_betas=(b1, b2), alpha_weight_decay=wd_a)
    stats = method.step(train, val)

    # α: one Adam step (bias-corrected, L2 weight decay added to the gradient) on the search-val loss
    alphas = ref.arch_parameters()
    grads = torch.autograd.grad(F.cross_entropy(ref(val[0]), val[1]), alphas)
    with torch.no_grad():
        for a, g in zip(alphas, grads):
            g = g + wd_a * a
            m_hat, v_hat = g, g * g  # (1-b)·x / (1-b) on the first step
            a -= lr_a * m_hat / (v_hat.sqrt() + eps)
    for a, b in zip(net.arch_parameters(), alphas):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)

    # w: one SGD step with momentum (first step: buffer = gradient), clipped, α fixed at its new value
    ws = ref.weight_parameters()
    z = {t: torch.softmax(a, -1).detach() for t, a in ref.alphas().items()}
    loss = F.cross_entropy(ref(train[0], z), train[1])
    grads = torch.autograd.grad(loss, ws, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for w, g in zip(ws, grads)]
    norm = torch.sqrt(sum((g * g).sum() for g in grads))
    scale = min(1.0, clip / (float(norm) + 1e-6))
    with torch.no_grad():
        for w, g in zip(ws, grads):
            w -= lr_w * (g * scale + wd_w * w)
    for a, b in zip(net.weight_parameters(), ws):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stats["scalars/train_loss"], loss.detach())
    # recorded arch statistics are the updated α and their softmax
    torch.testing.assert_close(stats["arch/normal/params"], net.alphas_normal.detach())
    torch.testing.assert_close(stats["arch/reduce/weights"], torch.softmax(net.alphas_reduce.detach(), -1))


def test_alpha_gradient_from_the_costs_equals_autograd_through_the_softmax():
    net, train, val = make(1)
    ref = copy.deepcopy(net)
    method = darts(net, epochs=2)
    method.alpha_optimizer.step = lambda: None  # keep α.grad of this step for inspection
    method.alpha_step(*val)
    # independent reference: the network's own forward mixes with softmax(α); autograd to α
    expected = torch.autograd.grad(F.cross_entropy(ref(val[0]), val[1]), ref.arch_parameters())
    for a, g in zip(net.arch_parameters(), expected):
        torch.testing.assert_close(a.grad, g, rtol=1e-9, atol=1e-13)


def test_diagnostics_hand_out_and_reset_cost_statistics():
    net, train, val = make(2)
    method = darts(net, epochs=2, hessian_mode="approx")
    assert method.diagnostics() == {}
    for _ in range(3):
        method.step(train, val)
    d = method.diagnostics()
    expected = {f"cost/{t}/{s}" for t in ("normal", "reduce") for s in ("mean", "var", "count")}
    assert expected | {"hessian/normal/diag", "hessian/reduce/diag"} <= set(d)
    assert d["cost/normal/mean"].shape == (5, 8)
    # normal cells: 1 of 3 (reductions at 1 and 2), 3 steps -> 3 observations per entry
    assert int(d["cost/normal/count"].min()) == 3 and int(d["cost/reduce/count"].min()) == 6
    assert not any(k.startswith("cost/") for k in method.diagnostics())  # the cost statistics were reset


def test_probe_must_belong_to_the_network():
    net, _, _ = make()
    other, _, _ = make(3)
    with pytest.raises(NasdiagError, match="attached to the method's network"):
        darts(net, epochs=1, probe=nasdiag.attach(other))
