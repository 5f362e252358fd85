"""Cost audit round 13 (cost13): the wiring paper's cost C(Z) = ∂L/∂Z = <∂L/∂x_j, O(x_i)> against float64 supernets
written from scratch here (leaf mixing weights Z, plain autograd for ∂L/∂Z, the eps/(var + eps) factor by hand).
Never nasdiag against nasdiag.

Defects found (each test fails without its fix):

* ``invariance_deviation()`` left out an eval-mode pass inside the block (r11) by reading ``track_running_stats``, but
  a BatchNorm whose flag was switched off after construction keeps its buffers and still normalizes with them in eval
  mode (torch's ``F.batch_norm`` takes batch statistics only in training or without buffers), so the validation pass,
  an affine map there, was measured and its tiny-variance eps/(var + eps) maxed into the training step's
  (test_invariance_deviation_leaves_out_an_eval_pass_of_a_batchnorm_whose_tracking_was_switched_off_after_construction).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag

DT = torch.float64


class Mix(nn.Module):
    """A DARTS-convention mixed op: Σ_k w_k·op_k(x)."""

    def __init__(self, ops):
        super().__init__()
        self._ops = nn.ModuleList(ops)

    def forward(self, x, w):
        return sum(w[k] * op(x) for k, op in enumerate(self._ops))


class OneEdge(nn.Module):
    """stem -> one mixed op {relu-conv-BN, identity, avg-pool} -> GAP -> linear."""

    def __init__(self, C=3, n=4, seed=0, bn=None):
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Conv2d(2, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C, affine=False) if bn is None else bn
        self.e = Mix([nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=1, bias=False), self.bn),
                      nn.Identity(), nn.AvgPool2d(3, 1, 1)])
        self.head = nn.Linear(C, n)
        self.to(DT)

    def forward(self, x, Z):
        return self.head(self.e(self.stem(x), Z).mean((2, 3)))


def _batch(B, seed=1, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 2, 5, 5, generator=g, dtype=DT), torch.randint(0, n, (B,), generator=g)


def _z(K=3, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(K, generator=g, dtype=DT), -1)


# --- the measured deviation from invariance (BatchNorm's buffers decide, InstanceNorm's flag) ---------------------------

def _deviation_with_an_eval_pass(net, x, y, Z):
    """invariance_deviation() of a block whose training step is preceded by an eval-mode validation pass with grad on,
    and the reference eps/(var + eps) of the training forward's BatchNorm input, per channel, by hand (§8)."""
    seen = []
    hook = net.bn.register_forward_pre_hook(lambda m, a: seen.append((m.training, a[0].detach())))
    probe = nasdiag.attach(net, norm_deviation=True)
    with probe.record():
        net.eval()
        net(x * 1e-3, Z)  # a validation pass with grad on, never backwarded
        net.train()
        F.cross_entropy(net(x, Z.clone().requires_grad_()), y).backward()
    hook.remove()
    bn_input = next(a for training, a in seen if training)
    dims = [0] + list(range(2, bn_input.dim()))
    expected = (net.bn.eps / (bn_input.var(dim=dims, unbiased=False) + net.bn.eps)).max().item()
    return probe.invariance_deviation()["e"]["0:Sequential"], expected


def test_invariance_deviation_leaves_out_an_eval_pass_of_a_batchnorm_whose_tracking_was_switched_off_after_construction():
    """Defect (r13): the eval pass was left out by ``track_running_stats and not training``; a BatchNorm whose flag was
    turned off after construction keeps its buffers and normalizes with them in eval mode (an affine map, as
    nasdiag.rules says for the curvature), so the validation batch's eps/(var + eps) was maxed in."""
    net = OneEdge(seed=3)
    net.bn.track_running_stats = False  # after construction: running_mean / running_var stay
    x, y = _batch(6, seed=4)
    with torch.no_grad():  # own check of torch's behaviour the fix rests on: eval mode reads the buffers
        net.bn.running_mean.fill_(0.5)
        net.bn.eval()
        probe_in = torch.randn(2, 3, 4, 4, dtype=DT)
        assert torch.allclose(net.bn(probe_in), (probe_in - 0.5) / (1 + net.bn.eps) ** 0.5, atol=1e-14)
        net.bn.train()
    got, expected = _deviation_with_an_eval_pass(net, x, y, _z(seed=5))
    assert got == pytest.approx(expected, rel=1e-12)  # was the 1e-3-scaled validation batch's factor (~1e6 x)


def test_invariance_deviation_of_an_instancenorm_op_with_tracking_switched_off_keeps_its_per_sample_eval_pass():
    """InstanceNorm reads the flag: with it off, an eval-mode pass normalizes with its own statistics (invariant), and
    is measured as before (the max over the block's grad-enabled calls of the op, by hand here)."""
    C = 3
    norm = nn.InstanceNorm2d(C, affine=False, track_running_stats=True)
    norm.track_running_stats = False  # buffers kept, ignored by F.instance_norm
    net = OneEdge(seed=6, bn=norm)
    x, y = _batch(6, seed=7)
    got, _ = _deviation_with_an_eval_pass(net, x, y, _z(seed=8))
    # both passes normalize per sample: the max over both inputs' eps/(var + eps) per (sample, channel)
    with torch.no_grad():
        stem_eval = net.e._ops[0][1](torch.relu(net.stem(x * 1e-3)))
        stem_train = net.e._ops[0][1](torch.relu(net.stem(x)))
    expected = max((norm.eps / (s.var(dim=(2, 3), unbiased=False) + norm.eps)).max().item()
                   for s in (stem_eval, stem_train))
    assert got == pytest.approx(expected, rel=1e-12)
