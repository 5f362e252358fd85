"""Round-10 new-user audit: a researcher's own supernets and loop, following README.md and docs/probe.md only.

References are written here from scratch in float64: Z a leaf, ∂L/∂Z by torch.autograd.grad and diag ∂²L/∂Z² by
torch.autograd.functional.hessian of the same loss; the recorded statistics are compared with the mean and
population variance of those per-step gradients.

Checked and found right (no test needed beyond the ones below): a DARTS-code supernet (alphas in a plain list,
`_ops` mixed ops in a DARTS cell) wrapped in nn.DataParallel on CPU, two probes attached to it at once, costs
to 1e-16; a model deep-copied, pickled and its state_dict torch.saved inside a block; costs()/hessian() inside an
open block and before any step are one line; a ProxylessNAS gate whose forward runs only the active path (NaN +
one warning for the others, 'sampled' counts); keyword and dict model inputs kept for hessian(); bf16 autocast
costs returned in float32; `nasdiag plot` on the record of the loop below.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.probe import ProbeError
from nasdiag.record import RecordError, RecorderCallback, load

D = torch.float64


class _Mix(nn.Module):
    """A DARTS-convention mixed op of three candidates of different kinds."""

    def __init__(self, d):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(d, d, bias=False), nn.Sequential(nn.Tanh(), nn.Linear(d, d)), nn.Identity()])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class _Arch(nn.Module):
    """α lives in its own module; the supernet asks it for Z."""

    def __init__(self, edges, k):
        super().__init__()
        self.alpha = nn.Parameter(torch.randn(edges, k, dtype=D))

    def forward(self):
        return F.softmax(self.alpha, -1)


class _Net(nn.Module):
    def __init__(self, d=5):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.e = nn.ModuleList([_Mix(d) for _ in range(3)])
        self.arch = _Arch(3, 3)
        self.out = nn.Linear(d, 4)

    def forward(self, x, Z=None):
        Z = self.arch() if Z is None else Z
        h0 = self.inp(x)
        h1 = self.e[0](h0, Z[0])
        return self.out(self.e[1](h0, Z[1]) + self.e[2](h1, Z[2]))


def _net():
    torch.manual_seed(0)
    return _Net().double()


def _reference(net, x, y):
    """(∂L/∂Z, diag ∂²L/∂Z²), each (E, K), Z = the current softmax(α) as a leaf."""
    Z = net.arch().detach().clone().requires_grad_()

    def loss(z):
        return F.cross_entropy(net(x, z), y)

    g, = torch.autograd.grad(loss(Z), Z)
    n = Z.numel()
    H = torch.autograd.functional.hessian(loss, Z).reshape(n, n).diagonal().reshape(Z.shape)
    return g, H


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_own_loop_with_alpha_in_its_own_module_records_costs_and_curvature_equal_to_autograd(tmp_path):
    net = _net()
    probe = nasdiag.attach(net, hessian="exact")  # discovered: `_ops` + forward (x, weights)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    grads, hessians = [], []
    path = tmp_path / "mine.h5"
    with RecorderCallback(path, meta={"op_names": ["linear", "tanh_linear", "skip"]}) as callback:
        for step in range(4):
            x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 4, (6,))
            g, H = _reference(net, x, y)
            grads.append(g)
            hessians.append(H)
            opt.zero_grad()
            with probe.record(targets=y):
                loss = F.cross_entropy(net(x), y)
                loss.backward()
            stats = {**probe.statistics(), "scalars/loss": loss.detach()}
            stats.update({f"hessian/{k}/diag": v for k, v in probe.aggregate(probe.hessian()).items()})
            callback.on_step_end(step, stats)
            opt.step()
        callback.on_epoch_end(0)
    record = load(path)
    G = torch.stack(grads)
    # docs/probe.md: no cell types -> one group "edges", (E, K); mean/var population over steps; count = steps
    assert record["cost/edges/mean"].shape == (4, 3, 3)
    mean = torch.stack([G[: t + 1].mean(0) for t in range(4)])
    var = torch.stack([G[: t + 1].var(0, unbiased=False) for t in range(4)])
    # float64, a handful of products and sums per entry: agreement to rounding
    np.testing.assert_allclose(record["cost/edges/mean"], mean.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(record["cost/edges/var"], var.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(record["cost/edges/count"], np.arange(1, 5)[:, None, None] * np.ones((1, 3, 3)))
    np.testing.assert_allclose(record["hessian/edges/diag"], torch.stack(hessians).numpy(), rtol=0, atol=1e-12)
    assert _hooks(net) == 0


def test_a_ddp_wrapped_user_supernet_on_cpu_equals_autograd_and_leaves_no_hook():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    net = _net()
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 4, (6,))
    g, H = _reference(net, x, y)
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        ddp = nn.parallel.DistributedDataParallel(net)
        probe = nasdiag.attach(ddp, hessian="exact")
        assert probe.edge_names == [f"module.e.{i}" for i in range(3)]  # qualified names in ddp.named_modules()
        with probe.record():  # targets read off the backward (mean cross-entropy)
            F.cross_entropy(ddp(x), y).backward()
        c, h = probe.costs(), probe.hessian()
    finally:
        dist.destroy_process_group()
    for i, name in enumerate(probe.edge_names):
        torch.testing.assert_close(c[name], g[i], rtol=0, atol=1e-12)
        torch.testing.assert_close(h[name], H[i], rtol=0, atol=1e-12)
    assert _hooks(ddp) == 0


@pytest.mark.parametrize("statistics", ["all", "sampled"])
def test_a_candidate_op_added_to_every_mixed_op_after_attach_is_one_line(statistics):
    # growing the search space in place (a new candidate appended, α widened) left the probe costing the old K ops
    # silently (statistics='all': the new op's cost simply missing from an (E, K) record) or failing with
    # "CostError: mask must have the shape of the observations" ('sampled'); all old ops ran, so the replaced/removed
    # check never looked
    net = _net()
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 4, (6,))
    probe = nasdiag.attach(net, statistics=statistics)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    for m in net.e:
        m._ops.append(nn.Linear(5, 5).double())
    net.arch.alpha = nn.Parameter(torch.randn(3, 4, dtype=D))
    with pytest.raises(ProbeError, match="changed since nasdiag.attach") as info:
        with probe.record():
            F.cross_entropy(net(x), y).backward()
    assert "\n" not in str(info.value) and "added" in str(info.value)
    assert _hooks(net) == 0
    fresh = nasdiag.attach(net, statistics=statistics)
    with fresh.record():
        F.cross_entropy(net(x), y).backward()
    g, _ = _reference(net, x, y)
    for i, name in enumerate(fresh.edge_names):
        torch.testing.assert_close(fresh.costs()[name], g[i], rtol=0, atol=1e-12)


def test_sampled_statistics_with_weights_of_another_length_than_the_ops_is_one_line():
    net = _net()
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 4, (6,))
    probe = nasdiag.attach(net, statistics="sampled")
    with probe.record():  # a right first step: the sum convention is checked (and passes) here, once
        F.cross_entropy(net(x), y).backward()
    Z = torch.softmax(torch.randn(3, 4, dtype=D), -1).requires_grad_()  # one weight too many: zip drops it
    with pytest.raises(ProbeError, match="4 mixing weights for its 3 candidate ops") as info:
        with probe.record():
            F.cross_entropy(net(x, Z), y).backward()
    assert "\n" not in str(info.value)
    assert _hooks(net) == 0


class _DropoutNet(_Net):
    """The user's supernet with train-mode dropout after the stem (a random forward)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x, Z=None):
        Z = self.arch() if Z is None else Z
        h0 = self.drop(self.inp(x))
        h1 = self.e[0](h0, Z[0])
        return self.out(self.e[1](h0, Z[1]) + self.e[2](h1, Z[2]))


def test_hessian_of_a_step_with_dropout_is_that_of_the_recorded_masks_and_leaves_the_callers_generator():
    # probe.hessian() re-ran the recorded batch drawing new dropout masks: the curvature of another net than the step
    # whose costs it sits next to, silently (measured: off by half of max |H|)
    torch.manual_seed(0)
    net = _DropoutNet().double()
    x, y = torch.randn(6, 3, dtype=D), torch.randint(0, 4, (6,))
    probe = nasdiag.attach(net, hessian="exact")
    torch.manual_seed(5)
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    torch.manual_seed(11)
    expected_next = torch.rand(3)
    torch.manual_seed(11)
    with pytest.warns(RuntimeWarning, match="torch.func products are not usable"):  # vmap refuses dropout
        h = probe.hessian()
    assert torch.equal(torch.rand(3), expected_next)  # the caller's generator is where it was
    Z = net.arch().detach().clone().requires_grad_()

    def loss(z):
        torch.manual_seed(5)  # the recorded step's masks
        return F.cross_entropy(net(x, z), y)

    g, = torch.autograd.grad(loss(Z), Z)
    H = torch.autograd.functional.hessian(loss, Z).reshape(9, 9).diagonal().reshape(3, 3)
    for i, name in enumerate(probe.edge_names):
        torch.testing.assert_close(probe.costs()[name], g[i], rtol=0, atol=1e-12)
        torch.testing.assert_close(h[name], H[i], rtol=0, atol=1e-12)  # float64 Hessian-vector products: rounding


def test_a_recorder_callback_hook_after_close_is_one_line_not_a_silently_dropped_row(tmp_path):
    path = tmp_path / "run.h5"
    callback = RecorderCallback(path)
    callback.on_step_end(0, {"scalars/loss": torch.tensor(1.0)})
    callback.close()
    for hook in (lambda: callback.on_step_end(1, {"scalars/loss": torch.tensor(2.0)}),
                 lambda: callback.on_epoch_end(0, step=1)):
        with pytest.raises(RecordError, match="after close") as info:
            hook()
        assert "\n" not in str(info.value) and "resume=True" in str(info.value)
    np.testing.assert_array_equal(load(path)["step"], [0])


class _Base:
    """Stands in for lightning's Callback (lightning cannot be imported on this box): the adapter only subclasses it."""


class _Trainer:
    global_rank, global_step, current_epoch = 0, 0, 0


class _Module:
    def __init__(self, trainer):
        self.trainer = trainer

    def nasdiag_statistics(self):
        return {"scalars/loss": torch.tensor(float(self.trainer.global_step))}


def test_a_second_fit_with_the_same_lightning_callback_continues_the_record(tmp_path):
    # teardown closed the RecorderCallback; the second fit's setup kept the closed one and every row of that fit was
    # dropped silently (the record ended at the first fit's last step)
    from nasdiag.record.lightning import _adapter_class, _statistics_from_module

    path = tmp_path / "fit.h5"
    callback = _adapter_class(_Base)(path, None, _statistics_from_module, None, {})
    trainer = _Trainer()
    module = _Module(trainer)
    for _ in range(2):  # the hook order of Trainer.fit
        callback.setup(trainer, module, "fit")
        for batch in range(3):
            callback.on_train_batch_end(trainer, module, None, None, batch)
            trainer.global_step += 1
        callback.on_train_epoch_end(trainer, module)
        trainer.current_epoch += 1
        callback.teardown(trainer, module, "fit")
    record = load(path)
    np.testing.assert_array_equal(record["step"], np.arange(6))
    np.testing.assert_array_equal(record["scalars/loss"], np.arange(6, dtype=np.float32))
