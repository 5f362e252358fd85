"""Discovery on a faithful copy of the original DARTS search code (quark0/darts, cnn/operations.py,
cnn/genotypes.py and cnn/model_search.py; `.cuda()` and `Variable` dropped, nothing else changed in
structure), whose Cell *also* has an `_ops` list (of mixed ops) but a forward (s0, s1, weights)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nasdiag
from nasdiag import cost
from nasdiag.probe import ProbeError

from conftest import float64_batch

# ---- cnn/genotypes.py --------------------------------------------------------------------------------
PRIMITIVES = [
    'none',
    'max_pool_3x3',
    'avg_pool_3x3',
    'skip_connect',
    'sep_conv_3x3',
    'sep_conv_5x5',
    'dil_conv_3x3',
    'dil_conv_5x5'
]

# ---- cnn/operations.py -------------------------------------------------------------------------------
OPS = {
  'none' : lambda C, stride, affine: Zero(stride),
  'avg_pool_3x3' : lambda C, stride, affine: nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False),
  'max_pool_3x3' : lambda C, stride, affine: nn.MaxPool2d(3, stride=stride, padding=1),
  'skip_connect' : lambda C, stride, affine: Identity() if stride == 1 else FactorizedReduce(C, C, affine=affine),
  'sep_conv_3x3' : lambda C, stride, affine: SepConv(C, C, 3, stride, 1, affine=affine),
  'sep_conv_5x5' : lambda C, stride, affine: SepConv(C, C, 5, stride, 2, affine=affine),
  'dil_conv_3x3' : lambda C, stride, affine: DilConv(C, C, 3, stride, 2, 2, affine=affine),
  'dil_conv_5x5' : lambda C, stride, affine: DilConv(C, C, 5, stride, 4, 2, affine=affine),
}


class ReLUConvBN(nn.Module):

  def __init__(self, C_in, C_out, kernel_size, stride, padding, affine=True):
    super(ReLUConvBN, self).__init__()
    self.op = nn.Sequential(
      nn.ReLU(inplace=False),
      nn.Conv2d(C_in, C_out, kernel_size, stride=stride, padding=padding, bias=False),
      nn.BatchNorm2d(C_out, affine=affine)
    )

  def forward(self, x):
    return self.op(x)


class DilConv(nn.Module):

  def __init__(self, C_in, C_out, kernel_size, stride, padding, dilation, affine=True):
    super(DilConv, self).__init__()
    self.op = nn.Sequential(
      nn.ReLU(inplace=False),
      nn.Conv2d(C_in, C_in, kernel_size=kernel_size, stride=stride, padding=padding, dilation=dilation, groups=C_in, bias=False),
      nn.Conv2d(C_in, C_out, kernel_size=1, padding=0, bias=False),
      nn.BatchNorm2d(C_out, affine=affine),
      )

  def forward(self, x):
    return self.op(x)


class SepConv(nn.Module):

  def __init__(self, C_in, C_out, kernel_size, stride, padding, affine=True):
    super(SepConv, self).__init__()
    self.op = nn.Sequential(
      nn.ReLU(inplace=False),
      nn.Conv2d(C_in, C_in, kernel_size=kernel_size, stride=stride, padding=padding, groups=C_in, bias=False),
      nn.Conv2d(C_in, C_in, kernel_size=1, padding=0, bias=False),
      nn.BatchNorm2d(C_in, affine=affine),
      nn.ReLU(inplace=False),
      nn.Conv2d(C_in, C_in, kernel_size=kernel_size, stride=1, padding=padding, groups=C_in, bias=False),
      nn.Conv2d(C_in, C_out, kernel_size=1, padding=0, bias=False),
      nn.BatchNorm2d(C_out, affine=affine),
      )

  def forward(self, x):
    return self.op(x)


class Identity(nn.Module):

  def __init__(self):
    super(Identity, self).__init__()

  def forward(self, x):
    return x


class Zero(nn.Module):

  def __init__(self, stride):
    super(Zero, self).__init__()
    self.stride = stride

  def forward(self, x):
    if self.stride == 1:
      return x.mul(0.)
    return x[:,:,::self.stride,::self.stride].mul(0.)


class FactorizedReduce(nn.Module):

  def __init__(self, C_in, C_out, affine=True):
    super(FactorizedReduce, self).__init__()
    assert C_out % 2 == 0
    self.relu = nn.ReLU(inplace=False)
    self.conv_1 = nn.Conv2d(C_in, C_out // 2, 1, stride=2, padding=0, bias=False)
    self.conv_2 = nn.Conv2d(C_in, C_out // 2, 1, stride=2, padding=0, bias=False)
    self.bn = nn.BatchNorm2d(C_out, affine=affine)

  def forward(self, x):
    x = self.relu(x)
    out = torch.cat([self.conv_1(x), self.conv_2(x[:,:,1:,1:])], dim=1)
    out = self.bn(out)
    return out


# ---- cnn/model_search.py ------------------------------------------------------------------------------
class MixedOp(nn.Module):

  def __init__(self, C, stride):
    super(MixedOp, self).__init__()
    self._ops = nn.ModuleList()
    for primitive in PRIMITIVES:
      op = OPS[primitive](C, stride, False)
      if 'pool' in primitive:
        op = nn.Sequential(op, nn.BatchNorm2d(C, affine=False))
      self._ops.append(op)

  def forward(self, x, weights):
    return sum(w * op(x) for w, op in zip(weights, self._ops))


class Cell(nn.Module):

  def __init__(self, steps, multiplier, C_prev_prev, C_prev, C, reduction, reduction_prev):
    super(Cell, self).__init__()
    self.reduction = reduction

    if reduction_prev:
      self.preprocess0 = FactorizedReduce(C_prev_prev, C, affine=False)
    else:
      self.preprocess0 = ReLUConvBN(C_prev_prev, C, 1, 1, 0, affine=False)
    self.preprocess1 = ReLUConvBN(C_prev, C, 1, 1, 0, affine=False)
    self._steps = steps
    self._multiplier = multiplier

    self._ops = nn.ModuleList()
    self._bns = nn.ModuleList()
    for i in range(self._steps):
      for j in range(2+i):
        stride = 2 if reduction and j < 2 else 1
        op = MixedOp(C, stride)
        self._ops.append(op)

  def forward(self, s0, s1, weights):
    s0 = self.preprocess0(s0)
    s1 = self.preprocess1(s1)

    states = [s0, s1]
    offset = 0
    for i in range(self._steps):
      s = sum(self._ops[offset+j](h, weights[offset+j]) for j, h in enumerate(states))
      offset += len(states)
      states.append(s)

    return torch.cat(states[-self._multiplier:], dim=1)


class Network(nn.Module):

  def __init__(self, C, num_classes, layers, criterion, steps=4, multiplier=4, stem_multiplier=3):
    super(Network, self).__init__()
    self._C = C
    self._num_classes = num_classes
    self._layers = layers
    self._criterion = criterion
    self._steps = steps
    self._multiplier = multiplier

    C_curr = stem_multiplier*C
    self.stem = nn.Sequential(
      nn.Conv2d(3, C_curr, 3, padding=1, bias=False),
      nn.BatchNorm2d(C_curr)
    )

    C_prev_prev, C_prev, C_curr = C_curr, C_curr, C
    self.cells = nn.ModuleList()
    reduction_prev = False
    for i in range(layers):
      if i in [layers//3, 2*layers//3]:
        C_curr *= 2
        reduction = True
      else:
        reduction = False
      cell = Cell(steps, multiplier, C_prev_prev, C_prev, C_curr, reduction, reduction_prev)
      reduction_prev = reduction
      self.cells += [cell]
      C_prev_prev, C_prev = C_prev, multiplier*C_curr

    self.global_pooling = nn.AdaptiveAvgPool2d(1)
    self.classifier = nn.Linear(C_prev, num_classes)

    self._initialize_alphas()

  def forward(self, input):
    s0 = s1 = self.stem(input)
    for i, cell in enumerate(self.cells):
      if cell.reduction:
        weights = F.softmax(self.alphas_reduce, dim=-1)
      else:
        weights = F.softmax(self.alphas_normal, dim=-1)
      s0, s1 = s1, cell(s0, s1, weights)
    out = self.global_pooling(s1)
    logits = self.classifier(out.view(out.size(0),-1))
    return logits

  def _loss(self, input, target):
    logits = self(input)
    return self._criterion(logits, target)

  def _initialize_alphas(self):
    k = sum(1 for i in range(self._steps) for n in range(2+i))
    num_ops = len(PRIMITIVES)

    self.alphas_normal = (1e-3*torch.randn(k, num_ops)).requires_grad_(True)
    self.alphas_reduce = (1e-3*torch.randn(k, num_ops)).requires_grad_(True)
    self._arch_parameters = [
      self.alphas_normal,
      self.alphas_reduce,
    ]

  def arch_parameters(self):
    return self._arch_parameters


# ---- tests -------------------------------------------------------------------------------------------

def darts_net(layers=3, steps=2, multiplier=2):
    torch.manual_seed(0)
    net = Network(4, 5, layers, nn.CrossEntropyLoss(), steps=steps, multiplier=multiplier).double()
    net.alphas_normal = net.alphas_normal.detach().double().requires_grad_()
    net.alphas_reduce = net.alphas_reduce.detach().double().requires_grad_()
    return net


def data(B=4):
    return float64_batch(B)


def test_discovery_picks_the_mixed_ops_not_the_cells():
    net = darts_net(layers=3, steps=4, multiplier=4)
    probe = nasdiag.attach(net)
    assert len(probe.edges) == 3 * 14
    assert all(isinstance(e.module, MixedOp) for e in probe.edges)
    assert probe.edge_names[:2] == ["cells.0._ops.0", "cells.0._ops.1"]
    e = probe.edges[3 * 14 - 1]
    assert (e.name, e.cell_type, e.cell_index, e.edge_index, e.src, e.dst) == ("cells.2._ops.13", "reduce", 2, 13, 4, 5)
    assert [c.cell_type for c in probe.cells] == ["normal", "reduce", "reduce"]  # layers//3 = 1, 2*layers//3 = 2
    assert probe.cells[0].output_nodes == (2, 3, 4, 5)
    assert all(len(e.ops) == len(PRIMITIVES) for e in probe.edges)


def _per_cell_leaves(net):
    """Replace each cell's weights argument by a leaf (test-side hooks), so that .grad is ∂L/∂Z per cell."""
    leaves, handles = [], []
    for cell in net.cells:
        a = net.alphas_reduce if cell.reduction else net.alphas_normal
        z = F.softmax(a, dim=-1).detach().clone().requires_grad_()
        leaves.append(z)
        handles.append(cell.register_forward_pre_hook(lambda m, args, z=z: (args[0], args[1], z)))
    return leaves, handles


def test_costs_on_the_darts_code_equal_autograd_dL_dZ():
    net = darts_net()
    x, y = data()
    leaves, handles = _per_cell_leaves(net)
    probe = nasdiag.attach(net)
    try:
        with probe.record():
            net._loss(x, y).backward()
    finally:
        for h in handles:
            h.remove()
    costs = probe.costs()
    for e in probe.edges:
        torch.testing.assert_close(costs[e.name], leaves[e.cell_index].grad[e.edge_index], rtol=0, atol=1e-10)


def test_darts_identity_on_the_darts_code():
    net = darts_net()
    x, y = data()
    probe = nasdiag.attach(net)
    with probe.record():
        net._loss(x, y).backward()
    agg = probe.cell_type_costs()
    for t, alpha in (("normal", net.alphas_normal), ("reduce", net.alphas_reduce)):
        got = cost.darts_alpha_grad(agg[t], F.softmax(alpha, -1).detach())
        torch.testing.assert_close(got, alpha.grad, rtol=0, atol=1e-10)


def test_output_costs_of_darts_convention_cells_match_slice_multipliers():
    net = darts_net()
    x, y = data()
    # independent: multiply each node's slice of each cell output by a scalar leaf s = 1; ∂L/∂s is the cost
    scales, handles = [], []
    for cell in net.cells:
        s = torch.ones(cell._multiplier, dtype=torch.float64, requires_grad=True)
        scales.append(s)

        def hook(m, args, out, s=s):
            return torch.cat([s[i] * c for i, c in enumerate(out.chunk(len(s), dim=1))], dim=1)

        handles.append(cell.register_forward_hook(hook))
    probe = nasdiag.attach(net)
    try:
        with probe.record():
            net._loss(x, y).backward()
    finally:
        for h in handles:
            h.remove()
    oc = probe.output_costs()
    for k, s in enumerate(scales):
        got = torch.stack([oc[f"cells.{k}"][n] for n in (2, 3)])
        torch.testing.assert_close(got, s.grad, rtol=0, atol=1e-10)


def test_scale_invariance_of_darts_classes_needs_registered_rules():
    net = darts_net(layers=1)
    probe = nasdiag.attach(net)
    with pytest.raises(cost.UnsupportedModuleError, match="Zero"):
        probe.scale_invariant_ops()
    rules = {Zero: cost.degree_rule(0.0, "zero"), Identity: cost.degree_rule(1.0, "identity"),
             SepConv: cost.delegate_rule("op"), DilConv: cost.delegate_rule("op"), FactorizedReduce: None}

    def fr_rule(m, analyse):
        return cost.compose([("relu", analyse(m.relu)), ("convs", analyse(m.conv_1)), ("bn", analyse(m.bn))])

    rules[FactorizedReduce] = fr_rule
    for t, r in rules.items():
        cost.register_homogeneity_rule(t, r)
    try:
        flags = probe.scale_invariant_ops()
    finally:
        for t in rules:
            del cost.HOMOGENEITY_RULES[t]
    # layers=1: the cell is a reduction cell; stride-2 skip is FactorizedReduce (invariant), stride-1 skip is Identity
    e_in, e_mid = flags["cells.0._ops.0"], flags["cells.0._ops.4"]
    assert e_in.all()
    assert e_mid.tolist() == [p != "skip_connect" for p in PRIMITIVES]


def test_non_darts_signature_is_not_discovered():
    class NotMixed(nn.Module):
        def __init__(self):
            super().__init__()
            self._ops = nn.ModuleList([nn.Identity()])

        def forward(self, a, b, c):
            return a

    with pytest.raises(ProbeError, match="no edges found"):
        nasdiag.attach(nn.Sequential(NotMixed()))
