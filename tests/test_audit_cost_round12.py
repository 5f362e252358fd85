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


class _Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ops = torch.nn.ModuleList([torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.AvgPool2d(3, 1, 1),
                                        torch.nn.Identity()])

    def forward(self, x, w):
        return sum(wk * op(x) for wk, op in zip(w, self.ops))


class _Net(torch.nn.Module):
    """A from-scratch one-edge supernet: stem -> tanh -> mixed op (Z = softmax(α), or a Z passed in) -> GAP -> linear."""

    def __init__(self):
        super().__init__()
        self.stem, self.m, self.fc = torch.nn.Conv2d(1, 3, 3, padding=1), _Mixed(), torch.nn.Linear(3, 4)
        self.alpha = torch.nn.Parameter(torch.randn(3))

    def forward(self, x, Z=None):
        Z = torch.softmax(self.alpha, 0) if Z is None else Z
        self.h_in = torch.tanh(self.stem(x))
        self.h = self.m(self.h_in, Z)
        return self.fc(self.h.mean((2, 3)))


def test_an_autograd_grad_pass_inside_the_block_adds_its_costs_as_the_docs_now_say():
    """Defect (r12, docs): docs/probe.md said backwards in a block add up 'as .grad does', but a torch.autograd.grad
    pass (a gradient norm logged before loss.backward(), a gradient penalty) adds its costs too, which .grad never
    sees: the costs of the logging pattern were 2·∂L/∂Z, silently. Recording autograd.grad passes is needed (nasdiag's
    own cost steps take ∂L/∂Z that way), so the contract is stated; the references here are autograd's ∂L/∂Z with Z a
    leaf and the definition <∂L/∂x_j, O_k(x_i)> computed by hand."""
    torch.manual_seed(0)
    net = _Net().double()
    x, y = torch.randn(5, 1, 6, 6, dtype=torch.float64), torch.randint(0, 4, (5,))
    Z = torch.softmax(net.alpha, 0).detach().requires_grad_()
    (ref,) = torch.autograd.grad(F.cross_entropy(net(x, Z), y), Z)
    probe = nasdiag.attach(net, edges={"e": (net.m, list(net.m.ops))})
    with probe.record():
        loss = F.cross_entropy(net(x), y)
        torch.autograd.grad(loss, list(net.stem.parameters()), retain_graph=True)  # a gradient norm for the log
        loss.backward()
    torch.testing.assert_close(probe.costs()["e"], 2 * ref, rtol=1e-10, atol=1e-12)
    assert_no_module_hooks(net)

    # a gradient penalty: the costs are <g_ce + g_total, O_k> (both passes through the forward), not ∂total/∂Z
    xr = x.clone().requires_grad_()
    Z = torch.softmax(net.alpha, 0).detach().requires_grad_()
    ce = F.cross_entropy(net(xr, Z), y)
    (gx,) = torch.autograd.grad(ce, xr, create_graph=True)
    total = ce + 10 * gx.pow(2).sum()
    outs = [op(net.h_in).detach() for op in net.m.ops]
    g_ce, g_total = (torch.autograd.grad(f, net.h, retain_graph=True)[0].detach() for f in (ce, total))
    expected = torch.stack([((g_ce + g_total) * o).sum() for o in outs])
    (d_total,) = torch.autograd.grad(total, Z)
    with probe.record():
        xr = x.clone().requires_grad_()
        ce = F.cross_entropy(net(xr), y)
        (gx,) = torch.autograd.grad(ce, xr, create_graph=True)
        (ce + 10 * gx.pow(2).sum()).backward()
    torch.testing.assert_close(probe.costs()["e"], expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(expected, d_total, rtol=1e-3)  # the penalty's Z-dependence through the backward is left out
