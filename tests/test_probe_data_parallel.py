"""``nn.DataParallel`` and the probe.

On one device (or without CUDA, where it calls the module itself) DataParallel is the model: costs equal autograd's
∂L/∂Z. Over several devices it runs shallow per-device copies of the model in threads, and every copy fires the
original's hooks: on a 2-GPU host the probe reported "its mixed op ran twice in one forward" for a model that runs
each mixed op once. It is now one ProbeError that names DataParallel and what to use instead, at ``attach`` for a
wrapper over several devices and at the step for a model wrapped after ``attach``; no hook is left behind.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.probe import ProbeError

from test_audit_newuser_round8 import _hooks, _max_error, _reference_costs, _setup


def _device_copy(module, memo=None):
    """What ``torch.nn.parallel.replicate`` builds for one device, without its CUDA broadcast: a shallow copy of
    every module (``_replicate_for_data_parallel``: marked a replica, same hook dicts), children rewired to copies."""
    memo = {} if memo is None else memo
    if module in memo:
        return memo[module]
    copy = memo[module] = module._replicate_for_data_parallel()
    copy._parameters = dict(module._parameters)  # replicate() fills these with the device's broadcast copies
    copy._modules = {name: _device_copy(child, memo) for name, child in module._modules.items()}
    return copy


def test_data_parallel_on_one_device_equals_autograd():
    net, x, y = _setup()
    ref = _reference_costs(net, x, y)
    if torch.cuda.is_available():
        net, x, y = net.cuda(), x.cuda(), y.cuda()
        net.alphas = [a.detach().cuda().requires_grad_(True) for a in net.alphas]
        dp = nn.DataParallel(net, device_ids=[0])  # one device: DataParallel calls the module itself
    else:
        dp = nn.DataParallel(net)  # no CUDA: it calls the module itself
    probe = nasdiag.attach(dp)
    assert probe.edge_names == [f"module._ops.{e}" for e in range(3)]
    with probe.record():
        F.cross_entropy(dp(x), y).backward()
    costs = {k: v.cpu() for k, v in probe.costs().items()}
    assert _max_error(costs, ref, "module.") < 1e-12
    assert _hooks(net) == 0


def test_a_wrapper_over_several_devices_is_refused_at_attach():
    net, _, _ = _setup()
    dp = nn.DataParallel(net)
    dp.device_ids = [0, 1]  # what a 2-GPU host gives by default; set by hand where there is none
    with pytest.raises(ProbeError) as info:
        nasdiag.attach(dp)
    line = str(info.value)
    assert "\n" not in line and "nn.DataParallel over 2 devices" in line and "DistributedDataParallel" in line
    assert _hooks(net) == 0


def test_a_per_device_copy_running_the_hooks_is_refused_and_leaves_no_hook():
    net, x, y = _setup()
    probe = nasdiag.attach(net)
    copy = _device_copy(net)
    with pytest.raises(ProbeError, match=r"edge '_ops.0' ran in a copy of the model made by nn.DataParallel.*"
                                         r"DistributedDataParallel") as info:
        with probe.record():
            F.cross_entropy(copy(x), y).backward()
    assert "\n" not in str(info.value)
    assert _hooks(net) == 0
    with probe.record():  # the next step on the model itself is right
        F.cross_entropy(net(x), y).backward()
    assert _max_error(probe.costs(), _reference_costs(net, x, y)) < 1e-12


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_data_parallel_over_two_gpus_is_one_probe_error():
    class Net(nn.Module):  # α a parameter, so DataParallel broadcasts it with the weights
        def __init__(self):
            super().__init__()
            inner, _, _ = _setup()
            self.stem, self._ops, self.head = inner.stem, inner._ops, inner.head
            self.alphas = nn.Parameter(inner.alphas[0].detach().clone())

        def forward(self, x):
            h, w = self.stem(x), F.softmax(self.alphas, -1)
            for e, m in enumerate(self._ops):
                h = m(h, w[e])
            return self.head(h)

    net = Net().cuda()
    x, y = torch.randn(8, 5, dtype=torch.float64, device="cuda"), torch.randint(0, 3, (8,), device="cuda")
    with pytest.raises(ProbeError, match="nn.DataParallel over 2 devices"):
        nasdiag.attach(nn.DataParallel(net, device_ids=[0, 1]))
    probe = nasdiag.attach(net)
    with pytest.raises(ProbeError, match="made by nn.DataParallel"):
        with probe.record():
            F.cross_entropy(nn.DataParallel(net, device_ids=[0, 1])(x), y).backward()
    assert _hooks(net) == 0
