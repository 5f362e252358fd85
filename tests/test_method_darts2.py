"""Second-order DARTS: the finite-difference hypergradient (sparse-supernet eq 13) against the exact one by
autograd through the unrolled weights w' (eq 12, float64, smooth supernet), its convergence as ε shrinks,
no side effects of `arch_gradient`, the applied step, NaN handling and DDP over 2 gloo ranks."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from nasdiag.search import Schedule, SearchError, get_method
from nasdiag.supernet import Network

SMOOTH_PRIMITIVES = ("none", "skip_connect", "avg_pool_3x3", "sep_conv_3x3")


def smooth(net: nn.Module) -> nn.Module:
    """Replace every ReLU by tanh and max by average pooling, so that finite differences of ∇_α L_train
    converge (no kinks)."""
    for module in list(net.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.ReLU):
                setattr(module, name, nn.Tanh())
            elif isinstance(child, nn.MaxPool2d):
                setattr(module, name, nn.AvgPool2d(child.kernel_size, child.stride, child.padding, count_include_pad=False))
    return net


def make(seed=0, norm="batch", B=6):
    torch.manual_seed(seed)
    net = smooth(Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, norm=norm, affine=True,
                         primitives=SMOOTH_PRIMITIVES).double())
    with torch.no_grad():
        for a in net.arch_parameters():
            a.normal_(0, 0.5)
    g = torch.Generator().manual_seed(seed + 1)
    batch = lambda: (torch.randn(B, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (B,), generator=g))
    return net, batch(), batch()


def method_for(net, **hp):
    cls = get_method("darts2")
    return cls(net, cls.Hyperparameters(**hp), schedule=Schedule(epochs=4, steps_per_epoch=10, batch_size=6))


def exact_hypergradient(method, train, val):
    """d/dα L_val(w'(α), α) by autograd through w'(α) = w − ξ(∇_w L_train(w, α) + μ b + λ w) (eq 11–12)."""
    net, opt = method.network, method.w_optimizer
    group = opt.param_groups[0]
    xi, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
    arch = {id(a) for a in net.arch_parameters()}
    named = [(n, p) for n, p in net.named_parameters() if id(p) not in arch]
    buffers = lambda: {n: b.clone() for n, b in net.named_buffers()}  # noqa: E731
    w = [p.detach().clone().requires_grad_(True) for _, p in named]
    alphas = {t: a.detach().clone().requires_grad_(True) for t, a in net.alphas().items()}
    z = {t: torch.softmax(a, -1) for t, a in alphas.items()}
    names = [n for n, _ in named]
    loss_t = F.cross_entropy(functional_call(net, {**dict(zip(names, w)), **buffers()}, (train[0], z)), train[1])
    grads = torch.autograd.grad(loss_t, w, create_graph=True, allow_unused=True)
    unrolled = []
    for (_, p), wi, g in zip(named, w, grads):
        g = torch.zeros_like(wi) if g is None else g
        buf = opt.state[p]["momentum_buffer"] if p in opt.state else torch.zeros_like(wi)
        unrolled.append(wi.detach() - xi * (g + mu * buf + wd * wi.detach()))
    loss_v = F.cross_entropy(functional_call(net, {**dict(zip(names, unrolled)), **buffers()}, (val[0], z)), val[1])
    out = torch.autograd.grad(loss_v, list(alphas.values()))
    return dict(zip(alphas, out))


def rel_err(a, b):
    num = torch.sqrt(sum(((a[t] - b[t]) ** 2).sum() for t in b))
    return float(num / torch.sqrt(sum((b[t] ** 2).sum() for t in b)))


def test_hypergradient_matches_autograd_through_the_unrolled_step_and_converges_quadratically():
    net, train, val = make()
    method = method_for(net, w_lr=0.5, w_lr_min=0.5)  # a large ξ makes the second-order term dominant
    method.step(train, val)  # fills w's momentum buffers, so the unrolled step uses them
    train, val = make(seed=3)[1:]
    exact = exact_hypergradient(method, train, val)
    first_order = method._unrolled(train, val).val_grad
    errors = []
    for r in (1e-2, 1e-3, 1e-4):
        method.hp.fd_eps_scale = r
        errors.append(rel_err(method.arch_gradient(train, val), exact))
    # the second-order term is not negligible here, so the comparison tests it
    assert rel_err(first_order, exact) > 1e-2
    assert errors[0] < 1e-3
    # central differences: the error falls ~100× per decade of ε, down to round-off
    assert errors[1] < errors[0] / 30 and errors[2] < max(errors[1] / 30, 1e-10), errors


def test_hypergradient_on_an_adapted_darts_code_supernet_matches_autograd():
    from test_foreign_supernet import batch, foreign_supernet

    net = smooth(foreign_supernet(seed=2)[0])
    method = method_for(net, w_lr=0.5, w_lr_min=0.5)
    method.step(batch(3), batch(4))
    train, val = batch(5), batch(6)
    exact = exact_hypergradient(method, train, val)
    method.hp.fd_eps_scale = 1e-3
    assert rel_err(method.arch_gradient(train, val), exact) < 1e-5
    assert rel_err(method._unrolled(train, val).val_grad, exact) > 1e-2


def test_arch_gradient_changes_no_state_and_step_applies_it_through_adam():
    net, train, val = make(seed=5)
    method = method_for(net)
    before = copy.deepcopy(net.state_dict())
    g = method.arch_gradient(train, val)
    for k, v in net.state_dict().items():  # weights, α and BatchNorm running statistics untouched
        assert torch.equal(v, before[k]), k
    ref = copy.deepcopy(net)
    stats = method.step(train, val)
    h = method.hp
    lr, (b1, b2), wd = h.alpha_lr, h.alpha_betas, h.alpha_weight_decay
    for t, a in ref.alphas().items():
        grad = g[t] + wd * a.detach()  # first Adam step: m̂ = g, v̂ = g²
        expected = a.detach() - lr * grad / (grad.abs() + 1e-8)
        torch.testing.assert_close(net.alphas()[t].detach(), expected, rtol=1e-12, atol=1e-14)
    assert stats["scalars/fd_eps"] > 0 and torch.isfinite(stats["scalars/implicit_grad_norm"])
    assert "arch/normal/probabilities" in stats


def test_nan_loss_raises_a_search_error_before_changing_anything():
    net, train, val = make(seed=7)
    method = method_for(net)
    before = copy.deepcopy(net.state_dict())
    bad = (train[0].clone(), train[1])
    bad[0][0, 0, 0, 0] = float("nan")
    with pytest.raises(SearchError, match="loss is nan"):
        method.step(bad, val)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


# -- DDP ---------------------------------------------------------------------------------------------
B = 4  # per rank


def _rank(rank: int, init: str, out: str) -> None:
    """One of 2 gloo ranks: two darts2 steps on its half of the batch (run by torch.multiprocessing.spawn)."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        net, (xt, yt), (xv, yv) = make(seed=11, norm="layer", B=2 * B)
        method = method_for(net, w_lr=0.3)
        method.distribute()
        part = slice(rank * B, (rank + 1) * B)
        for _ in range(2):
            grad = method.arch_gradient((xt[part], yt[part]), (xv[part], yv[part]))
            method.step((xt[part], yt[part]), (xv[part], yv[part]))
        if rank == 0:
            torch.save({"grad": grad, "params": {n: p.detach() for n, p in net.named_parameters()}}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_two_gloo_ranks_equal_one_process_on_the_concatenated_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result.pt"
    torch.multiprocessing.spawn(_rank, args=(f"tcp://127.0.0.1:{port}", str(out)), nprocs=2, join=True)

    # LayerNorm: samples are independent, so the global-batch mean losses are the means of the ranks'
    net, train, val = make(seed=11, norm="layer", B=2 * B)
    method = method_for(net, w_lr=0.3)
    for _ in range(2):  # the second step's unrolled step uses the momentum buffers of the first
        grad = method.arch_gradient(train, val)
        method.step(train, val)
    distributed = torch.load(out)
    for t, g in grad.items():
        torch.testing.assert_close(distributed["grad"][t], g, rtol=1e-9, atol=1e-12)
    for name, p in net.named_parameters():
        torch.testing.assert_close(distributed["params"][name], p.detach(), rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.slow  # a short search on digits
def test_search_run_records_the_second_order_step(tmp_path):
    import numpy as np

    from nasdiag.record import load
    from nasdiag.search import SearchConfig, run

    run(SearchConfig(method="darts2", C=4, layers=3, steps=2, batch_size=240, diagnostics=("cost",), progress=False,
                     epochs=1, record=str(tmp_path / "d2.h5")))
    rec = load(str(tmp_path / "d2.h5"))
    S = 719 // 240
    assert rec["step"].tolist() == list(range(1, S + 1))
    assert (rec["scalars/fd_eps"] > 0).all() and np.isfinite(rec["scalars/implicit_grad_norm"]).all()
    last = np.flatnonzero(rec["valid/cost/normal/count"])[-1]
    assert (rec["cost/normal/count"][last] == S).all()  # the val costs at w' feed the cost statistics


def test_unrolled_step_reads_no_device_value_while_a_graph_is_captured(monkeypatch):
    """The hypergradient can be captured as a CUDA graph: with the host-side checks off (as during a
    capture), no op copies a device scalar to the host (``aten._local_scalar_dense``: ``float(t)``,
    ``if t:``, ``t.item()``), and the result is bit-identical to the checked one (ε is a device tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import nasdiag.search.unrolled as unrolled

    torch.manual_seed(3)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, alpha_init_scale=1.0).double()  # fast engine
    g = torch.Generator().manual_seed(4)
    batch = lambda: (torch.randn(6, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g))
    train, val = batch(), batch()
    method = method_for(net)
    method.step(train, val)  # the momentum buffers exist, as at any capture (the first step runs uncaptured)
    checked = method.arch_gradient(train, val)

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    with HostReads() as reads:  # the same call with the checks on reads the device (the test can fail)
        method.arch_gradient(train, val)
    assert reads.count > 0
    monkeypatch.setattr(unrolled, "host_checks_allowed", lambda: False)
    with HostReads() as reads:
        captured = method.arch_gradient(train, val)
    assert reads.count == 0
    for t in checked:
        assert torch.equal(captured[t], checked[t]), t
