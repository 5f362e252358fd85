"""Round-12 audit of the cost / probe area (cost12): independent float64 / autograd references, no nasdiag-vs-nasdiag."""

import pytest
import torch
import torch.nn.functional as F

import nasdiag
from nasdiag.probe import ProbeError
from nasdiag.probe.probe import _cross_entropy_targets
from nasdiag.supernet import Network

from conftest import assert_no_module_hooks


@pytest.mark.parametrize("B,N", [(8, 10), (256, 1000), (4096, 10)])
def test_float32_labels_are_read_off_plain_cross_entropy_and_a_slightly_smoothed_one_is_refused(B, N):
    """Defect (r12): the recovery of labels from a float32 backward accepted rows 1e-3 off one-hot (the floor meant
    for half-precision gradients), so a cross-entropy with label_smoothing=5e-4 (rows 5e-4 off) gave labels and
    hessian() the curvature of another loss, where docs/probe.md promises an error for label smoothing. A float32
    gradient of the plain loss is one-hot to ~3e-7 (measured), so the recovery keeps working at 1e-5."""
    g32 = torch.Generator().manual_seed(B + N)
    z = (3 * torch.randn(B, N, generator=g32)).requires_grad_()
    y = torch.randint(0, N, (B,), generator=g32)
    for reduction in ("mean", "sum"):
        (g,) = torch.autograd.grad(F.cross_entropy(z, y, reduction=reduction), z)
        assert torch.equal(_cross_entropy_targets(z.detach(), g), y)
        (g,) = torch.autograd.grad(F.cross_entropy(z, y, reduction=reduction, label_smoothing=5e-4), z)
        # own reference: the smoothed gradient is (p − (1−ε)e − ε/N)/B, ε(1 − 1/N) ≈ 5e-4 off one-hot at the label
        assert _cross_entropy_targets(z.detach(), g) is None


def test_hessian_without_targets_of_a_float32_step_with_slight_label_smoothing_is_one_line_asking_for_targets():
    torch.manual_seed(0)
    net = Network(4, 6, 3, steps=2, multiplier=2, in_channels=1)
    x, y = torch.randn(7, 1, 8, 8), torch.randint(0, 6, (7,))
    probe = nasdiag.attach(net, hessian="approx")
    with probe.record():
        F.cross_entropy(net(x), y, label_smoothing=5e-4).backward()
    with pytest.raises(ProbeError, match="targets") as info:
        probe.hessian()
    assert "\n" not in str(info.value)
    net.zero_grad(set_to_none=True)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    assert set(probe.hessian()) == set(probe.edge_names)  # the plain loss's labels are still recovered in float32
    assert_no_module_hooks(net)
