"""probe.hessian() without targets: labels are recovered from the block's backward of the default loss."""

import pytest
import torch
import torch.nn.functional as F

import nasdiag
from nasdiag.probe import ProbeError
from nasdiag.probe.probe import _cross_entropy_targets
from nasdiag.supernet import Network

from conftest import assert_no_module_hooks


def setup(seed=0):
    torch.manual_seed(seed)
    net = Network(4, 6, 3, steps=2, multiplier=2, in_channels=1).double()
    x = torch.randn(7, 1, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 6, (7,))
    return net, x, y


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_labels_recovered_from_cross_entropy_gradient(reduction):
    logits = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 5, (9,))
    (g,) = torch.autograd.grad(F.cross_entropy(logits, y, reduction=reduction), logits)
    assert torch.equal(_cross_entropy_targets(logits.detach(), g), y)


def test_no_labels_for_other_losses():
    logits = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 5, (9,))
    (g,) = torch.autograd.grad(F.cross_entropy(logits, y, label_smoothing=0.2), logits)
    assert _cross_entropy_targets(logits.detach(), g) is None
    (g,) = torch.autograd.grad((logits ** 2).mean(), logits)
    assert _cross_entropy_targets(logits.detach(), g) is None


@pytest.mark.parametrize("mode", ["approx", "exact"])
def test_plumbing_hessian_without_targets_equals_hessian_with_targets(mode):
    """Plumbing test (nasdiag against nasdiag): the probe's target-free route reaches the same engine call as the explicit one."""
    net, x, y = setup()
    probe = nasdiag.attach(net, hessian=mode)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    inferred = probe.hessian()
    explicit = probe.hessian(targets=y)
    assert inferred.keys() == explicit.keys()
    for name in inferred:
        torch.testing.assert_close(inferred[name], explicit[name], rtol=0, atol=0)
    assert_no_module_hooks(net)


def test_hessian_without_targets_refuses_a_loss_it_cannot_invert():
    net, x, y = setup(1)
    probe = nasdiag.attach(net, hessian="approx")
    with probe.record():
        F.cross_entropy(net(x), y, label_smoothing=0.1).backward()
    with pytest.raises(ProbeError, match="targets"):
        probe.hessian()
