"""Cost audit round 13 (cost13): the wiring paper's cost C(Z) = ∂L/∂Z = <∂L/∂x_j, O(x_i)> against float64 supernets
written from scratch here (leaf mixing weights Z, plain autograd for ∂L/∂Z, the eps/(var + eps) factor by hand).
Never nasdiag against nasdiag.

Defects found (each test fails without its fix):

* ``invariance_deviation()`` left out an eval-mode pass inside the block (r11) by reading ``track_running_stats``, but
  a BatchNorm whose flag was switched off after construction keeps its buffers and still normalizes with them in eval
  mode (torch's ``F.batch_norm`` takes batch statistics only in training or without buffers), so the validation pass,
  an affine map there, was measured and its tiny-variance eps/(var + eps) maxed into the training step's
  (test_invariance_deviation_leaves_out_an_eval_pass_of_a_batchnorm_whose_tracking_was_switched_off_after_construction).
* A DARTS-convention cell (``_ops``, ``_steps``, ``_multiplier``, forward ``(s0, s1, weights)``) whose output is a 1x1
  convolution of its nodes' concatenation keeps the width the probe checked, so ``output_costs()`` took the chunks of
  the convolution's output for the nodes and returned numbers of no edge (0.018 off autograd's, no warning); now NaN
  with the warning of a summed output (each chunk is checked once against the span of the outputs of the edges
  ending at its node) (test_output_costs_of_a_darts_cell_with_a_1x1_conv_after_the_concat_are_nan_not_other_numbers).
* ``nasdiag.cost.output_edge_costs(grad, out, slices)`` with a gradient of another shape than the output (a (B, 6)
  gradient of a (B, 5) output) returned <grad[:, a:b], out[:, a:b]> of unrelated channels, silently; a 1-D output
  was an IndexError and a list of slices an AttributeError. One CostError line each
  (test_output_edge_costs_of_a_gradient_not_shaped_as_the_output_is_one_cost_error_line).
  The check is made once, at the first step whose values are finite
  (test_a_first_step_with_nan_leaves_the_concatenation_check_open_for_the_next_finite_step), and only where every edge
  ending at an output node is the probe's (test_a_darts_cell_mapped_in_part_keeps_its_output_costs).

Checked and right (own references): costs and per-sample rows = autograd's ∂L/∂Z (per-sample (B, K) Z too) on
normal + reduction DARTS cells with a node summing edges from a cell input and from an intermediate node, α as an
(E, K) tensor or per-edge rows, K = 1 edges, mean/sum/label-smoothed losses, train and eval mode; output costs =
∂L/∂(scalar on the node); path parts sum to the costs; Thm. 1 through the 2->3 edge (BN, affine BN, GroupNorm,
InstanceNorm-like, eps = 1e-12: ~1e-11 relative in train mode, not 0 in eval mode with running statistics);
Cor. 1.2 and Thm. 2 (L − H); costs under a CPU GradScaler (÷ scale) and clip_grad_norm_; darts_alpha_grad of
cell_type_costs = ∂L/∂α shared by two cells; derive_cell against a transcription of DARTS's _parse.
"""

import warnings

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
    assert got == pytest.approx(expected, rel=1e-12)  # was the 1e-3-scaled validation batch's factor (115x)
    op = net.e._ops[0].eval()  # and the rules agree with f(2x) != f(x) there (docs/probe.md "Which ops are flagged")
    with torch.no_grad():
        assert not torch.allclose(op(2 * x.new_ones(2, 3, 4, 4).cumsum(-1)), op(x.new_ones(2, 3, 4, 4).cumsum(-1)))
    assert not nasdiag.cost.is_scale_invariant(op)


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


# --- DARTS-convention cells written from scratch: concat, sum, 1x1 conv of the concat; a reduction cell ---------------

def _cell_ops(C, stride):
    return [nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, stride, 1, bias=False), nn.BatchNorm2d(C, affine=False)),
            nn.AvgPool2d(3, stride, 1, count_include_pad=False), nn.Sequential(nn.Conv2d(C, C, 1, stride), nn.Tanh())]


class DartsCell(nn.Module):
    """The DARTS search cell: two preprocessed inputs, `_steps` nodes each summing a mixed op on every earlier state
    (the cell inputs too), output = the last `_multiplier` nodes concatenated, summed, or a 1x1 conv of the concat.
    A reduction cell has stride 2 on the edges leaving the two inputs only. ``mults``: a scalar per output node, the
    reference's handle on <∂L/∂(node's chunk), x_node>."""

    def __init__(self, C_in0, C_in1, C, out="concat", reduction=False, steps=2, multiplier=2):
        super().__init__()
        self.reduction, self._steps, self._multiplier, self.out, self.mults = reduction, steps, multiplier, out, None
        self.pre0 = nn.Sequential(nn.ReLU(), nn.Conv2d(C_in0, C, 1, bias=False), nn.BatchNorm2d(C, affine=False))
        self.pre1 = nn.Sequential(nn.ReLU(), nn.Conv2d(C_in1, C, 1, bias=False), nn.BatchNorm2d(C, affine=False))
        self._ops = nn.ModuleList(Mix(_cell_ops(C, 2 if reduction and j < 2 else 1))
                                  for i in range(steps) for j in range(2 + i))
        self.post = nn.Conv2d(multiplier * C, multiplier * C, 1) if out == "conv" else None
        self.C_out = C if out == "sum" else multiplier * C

    def forward(self, s0, s1, weights):
        states, offset = [self.pre0(s0), self.pre1(s1)], 0
        for _ in range(self._steps):
            states.append(sum(self._ops[offset + j](h, weights[offset + j]) for j, h in enumerate(states)))
            offset += len(states) - 1
        nodes = states[-self._multiplier:]
        if self.mults is not None:
            nodes = [m * n for m, n in zip(self.mults, nodes)]
        if self.out == "sum":
            return sum(nodes)
        out = torch.cat(nodes, 1)
        return out if self.post is None else self.post(out)


class DartsNet(nn.Module):
    """stem -> normal cell (s0 = s1 = stem) -> reduction cell (stem, cell 0) -> GAP -> linear; Z: one (5, 3) per cell."""

    def __init__(self, C=3, n=4, out="concat", seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Conv2d(1, C, 3, padding=1)
        self.c0 = DartsCell(C, C, C, out)
        self.c1 = DartsCell(C, self.c0.C_out, C, out, reduction=True)
        self.head = nn.Linear(self.c1.C_out, n)
        self.to(DT)

    def forward(self, x, Z):
        s = self.stem(x)
        return self.head(self.c1(s, self.c0(s, s, Z[0]), Z[1]).mean((2, 3)))


def _darts_step(out, seed):
    net = DartsNet(out=out, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(5, 1, 6, 6, generator=g, dtype=DT), torch.randint(0, 4, (5,), generator=g)
    Z = [torch.softmax(torch.randn(5, 3, generator=g, dtype=DT), -1).requires_grad_() for _ in range(2)]
    cost_ref = torch.autograd.grad(F.cross_entropy(net(x, Z), y), Z)
    for cell in (net.c0, net.c1):
        cell.mults = [torch.ones((), dtype=DT, requires_grad=True) for _ in range(2)]
    out_ref = torch.autograd.grad(F.cross_entropy(net(x, Z), y), net.c0.mults + net.c1.mults)
    net.c0.mults = net.c1.mults = None
    probe = nasdiag.attach(net)
    with probe.record():
        F.cross_entropy(net(x, [z.detach().clone().requires_grad_() for z in Z]), y).backward()
    costs = probe.costs()
    for c, ref in enumerate(cost_ref):  # the edge costs are autograd's ∂L/∂Z in every layout of the cell output
        torch.testing.assert_close(torch.stack([costs[f"c{c}._ops.{e}"] for e in range(5)]), ref, rtol=0, atol=1e-13)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = probe.output_costs()
    step = lambda: F.cross_entropy(net(x, [z.detach() for z in Z]), y).backward()  # noqa: E731
    return (torch.tensor([float(got[c][n]) for c in ("c0", "c1") for n in (2, 3)], dtype=DT), torch.stack(out_ref),
            caught, probe, step)


def test_output_costs_of_a_darts_cell_with_a_1x1_conv_after_the_concat_are_nan_not_other_numbers():
    """Defect (r13): the output costs of a DARTS-convention cell whose output is conv1x1(concat(nodes)) (same width)
    were <∂L/∂(chunk of the conv output), chunk>, numbers of no node (0.018 off here, no warning)."""
    got, ref, caught, _, _ = _darts_step("concat", seed=7)  # the concatenation (reduction cell included): autograd's
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)
    assert not caught
    got, ref, caught, probe, step = _darts_step("conv", seed=7)
    assert torch.isnan(got).all()
    assert any("not the concatenation" in str(w.message) and "1x1 convolution" in str(w.message) for w in caught)
    with probe.record():  # checked once, flagged at every step
        step()
    with pytest.warns(RuntimeWarning, match="not the concatenation"):
        assert all(torch.isnan(v).all() for cell in probe.output_costs().values() for v in cell.values())


@pytest.mark.parametrize("grad,out,slices", [
    (torch.ones(4, 6), torch.ones(4, 5), {2: (0, 3)}),  # was a silent number
    (torch.ones(4), torch.ones(4), {2: (0, 1)}),  # was IndexError
    (torch.ones(4, 6), torch.ones(4, 6), [(0, 3)]),  # was AttributeError
])
def test_output_edge_costs_of_a_gradient_not_shaped_as_the_output_is_one_cost_error_line(grad, out, slices):
    with pytest.raises(nasdiag.cost.CostError) as info:
        nasdiag.cost.output_edge_costs(grad, out, slices)
    assert "\n" not in str(info.value)


def test_a_first_step_with_nan_leaves_the_concatenation_check_open_for_the_next_finite_step():
    """The check of a cell output against its nodes is a least-squares fit over the first samples: a NaN batch (a
    diverged step) fits nothing and must not pass the check, or the next finite step's chunks of a 1x1 conv would
    be read as nodes again, silently."""
    net = DartsNet(out="conv", seed=9)
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(5, 1, 6, 6, generator=g, dtype=DT), torch.randint(0, 4, (5,), generator=g)
    Z = [torch.softmax(torch.randn(5, 3, generator=g, dtype=DT), -1).requires_grad_() for _ in range(2)]
    probe = nasdiag.attach(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the NaN step's own warnings
        with probe.record():
            F.cross_entropy(net(torch.full_like(x, float("nan")), Z), y).backward()
        net.zero_grad(set_to_none=True)
    with probe.record():
        F.cross_entropy(net(x, Z), y).backward()
    with pytest.warns(RuntimeWarning, match="not the concatenation"):
        assert all(torch.isnan(v).all() for cell in probe.output_costs().values() for v in cell.values())


def test_a_darts_cell_mapped_in_part_keeps_its_output_costs():
    """The concatenation check compares each chunk with the outputs of the probe's edges ending at its node; where the
    caller maps only some mixed ops of a cell (edges=), a node also sums an unmapped one, so the check cannot be made
    and the output costs stay those of the chunks (autograd's here), not NaN."""
    net = DartsNet(seed=11)
    g = torch.Generator().manual_seed(12)
    x, y = torch.randn(5, 1, 6, 6, generator=g, dtype=DT), torch.randint(0, 4, (5,), generator=g)
    Z = [torch.softmax(torch.randn(5, 3, generator=g, dtype=DT), -1) for _ in range(2)]
    for cell in (net.c0, net.c1):
        cell.mults = [torch.ones((), dtype=DT, requires_grad=True) for _ in range(2)]
    ref = torch.autograd.grad(F.cross_entropy(net(x, Z), y), net.c0.mults + net.c1.mults)
    net.c0.mults = net.c1.mults = None
    edges = {f"c{c}.{e}": getattr(net, f"c{c}")._ops[e] for c in (0, 1) for e in range(5) if (c, e) != (0, 4)}
    probe = nasdiag.attach(net, edges=edges)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with probe.record():
            F.cross_entropy(net(x, [z.clone().requires_grad_() for z in Z]), y).backward()
        got = probe.output_costs()
    torch.testing.assert_close(torch.stack([got[c][n] for c in ("c0", "c1") for n in (2, 3)]), torch.stack(ref),
                               rtol=0, atol=1e-13)
