"""Audit round 4 — supernets written the way NAS researchers write them, attached through the public API.

Written here, in float64, after the published search code (not imported from nasdiag):

* the original DARTS ``model_search.py``: ``MixedOp.forward(x, weights) = sum(w * op(x) for w, op in zip(weights,
  self._ops))``, ``Cell.forward(s0, s1, weights)`` indexing ``weights[offset + j]``, ``alphas_normal`` /
  ``alphas_reduce`` parameters, ReLUConvBN / FactorizedReduce preprocessing, cells concatenating their last nodes;
* PC-DARTS: the partial-channel mixed op (ops on C/k channels, the rest bypassed, channel shuffle) and the edge
  normalization β (a second set of architecture parameters, ``weights2[offset + j] * edge``);
* GDAS: a hard one-hot straight-through weight (``one_hot - probs.detach() + probs``), only the argmax op computed;
* a one-shot cell where one op module is shared by two edges (a shared candidate), and where one mixed op module
  serves two edges.

References are autograd w.r.t. explicit leaves put in place of the mixing weights (C(Z) = ∂L/∂Z =
<∂L/∂x_j, O(x_i)>, wiring supplement §2.1), scalar multipliers on the cell-output slices (§5-6), and
``torch.autograd.functional.hessian`` of L in one edge's Z or α (the exact mixing-weight curvature).

Defects found (each test says which): path_split on a node that is not the plain sum of its edges (PC-DARTS's β)
gave silent path parts (they summed to costs()/β; off by 0.03 on costs of 0.03), and with partial channels stopped
in a CostError that named no edge; one mixed op module serving two edges with different weights gave one edge's
"costs" = the sum of both edges' (off by 0.075) and dropped the other edge; ``probe.hessian()`` on a GDAS edge
(only the sampled op computed) returned numbers for the ops that never ran (1ᵀ∇²L 1 of the node, e.g. 0.0436);
the PC-DARTS refusal said "relative deviation inf".
"""

import tracemalloc
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.functional import hessian

import nasdiag
from nasdiag import cost
from nasdiag.errors import NasdiagError
from nasdiag.probe import ProbeError

from conftest import assert_no_module_hooks, live_tensors

DT = torch.float64
PRIMS = ["none", "max_pool_3x3", "skip_connect", "sep_conv_3x3", "dil_conv_3x3"]
K = len(PRIMS)
N_CLS = 3


# -- the DARTS search code (operations.py / model_search.py), small ------------------------------------------------
class ReLUConvBN(nn.Module):
    def __init__(self, C_in, C_out, k, stride, pad, affine=True):
        super().__init__()
        self.op = nn.Sequential(nn.ReLU(inplace=False), nn.Conv2d(C_in, C_out, k, stride, pad, bias=False),
                                nn.BatchNorm2d(C_out, affine=affine))

    def forward(self, x):
        return self.op(x)


class FactorizedReduce(nn.Module):
    def __init__(self, C_in, C_out, affine=True):
        super().__init__()
        self.relu = nn.ReLU(inplace=False)
        self.conv_1 = nn.Conv2d(C_in, C_out // 2, 1, stride=2, bias=False)
        self.conv_2 = nn.Conv2d(C_in, C_out // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(C_out, affine=affine)

    def forward(self, x):
        x = self.relu(x)
        return self.bn(torch.cat([self.conv_1(x), self.conv_2(x[:, :, 1:, 1:])], dim=1))


class Zero(nn.Module):
    def __init__(self, stride):
        super().__init__()
        self.stride = stride

    def forward(self, x):
        return x.mul(0.) if self.stride == 1 else x[:, :, ::self.stride, ::self.stride].mul(0.)


class Identity(nn.Module):
    def forward(self, x):
        return x


def sep_conv(C, stride):
    return nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, stride, 1, groups=C, bias=False), nn.Conv2d(C, C, 1, bias=False),
                         nn.BatchNorm2d(C, affine=False))


def dil_conv(C, stride):
    return nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, stride, 2, dilation=2, groups=C, bias=False),
                         nn.Conv2d(C, C, 1, bias=False), nn.BatchNorm2d(C, affine=False))


OPS = {
    "none": lambda C, s: Zero(s),
    "max_pool_3x3": lambda C, s: nn.Sequential(nn.MaxPool2d(3, s, 1), nn.BatchNorm2d(C, affine=False)),
    "skip_connect": lambda C, s: Identity() if s == 1 else FactorizedReduce(C, C, affine=False),
    "sep_conv_3x3": sep_conv,
    "dil_conv_3x3": dil_conv,
}


class MixedOp(nn.Module):
    def __init__(self, C, stride):
        super().__init__()
        self._ops = nn.ModuleList(OPS[p](C, stride) for p in PRIMS)

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class Cell(nn.Module):
    def __init__(self, steps, multiplier, C_pp, C_p, C, reduction, reduction_prev, mixed=MixedOp):
        super().__init__()
        self.reduction = reduction
        self.preprocess0 = FactorizedReduce(C_pp, C, affine=False) if reduction_prev else ReLUConvBN(C_pp, C, 1, 1, 0, False)
        self.preprocess1 = ReLUConvBN(C_p, C, 1, 1, 0, affine=False)
        self._steps, self._multiplier = steps, multiplier
        self._ops = nn.ModuleList(mixed(C, 2 if reduction and j < 2 else 1) for i in range(steps) for j in range(2 + i))

    def forward(self, s0, s1, weights):
        s0, s1 = self.preprocess0(s0), self.preprocess1(s1)
        states, offset = [s0, s1], 0
        for i in range(self._steps):
            s = sum(self._ops[offset + j](h, weights[offset + j]) for j, h in enumerate(states))
            offset += len(states)
            states.append(s)
        return torch.cat(states[-self._multiplier:], dim=1)


class Network(nn.Module):
    """stem -> cells (reductions at layers//3 and 2·layers//3 as DARTS, never the first) -> GAP -> classifier."""

    def __init__(self, C=4, layers=3, steps=2, multiplier=2, cell=Cell):
        super().__init__()
        self._steps = steps
        self.stem = nn.Sequential(nn.Conv2d(2, 2 * C, 3, padding=1, bias=False), nn.BatchNorm2d(2 * C))
        C_pp, C_p, C_curr, red_prev = 2 * C, 2 * C, C, False
        self.cells = nn.ModuleList()
        for i in range(layers):
            red = i > 0 and i in (layers // 3, 2 * layers // 3)
            C_curr *= 2 if red else 1
            self.cells.append(cell(steps, multiplier, C_pp, C_p, C_curr, red, red_prev))
            red_prev, C_pp, C_p = red, C_p, multiplier * C_curr
        self.global_pooling = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(C_p, N_CLS)
        E = sum(2 + i for i in range(steps))
        self.alphas_normal = nn.Parameter(0.3 * torch.randn(E, K))
        self.alphas_reduce = nn.Parameter(0.3 * torch.randn(E, K))

    def cell_weights(self, cell):
        return F.softmax(self.alphas_reduce if cell.reduction else self.alphas_normal, dim=-1)

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1, self.cell_weights(cell))
        return self.classifier(self.global_pooling(s1).view(s1.size(0), -1))


def darts_net(seed=0, **kw):
    torch.manual_seed(seed)
    return Network(**kw).to(DT)


def batch(seed=1, b=3, hw=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, hw, hw, generator=g, dtype=DT), torch.randint(0, N_CLS, (b,), generator=g)


def err(a, b):
    return float((a - b).abs().max())


class Replaced:
    """Test-side pre-hooks putting ``{module: tensor}`` in place of each mixed op's weights (the references)."""

    def __init__(self, weights):
        self.handles = [m.register_forward_pre_hook(lambda mod, args, w=w: (args[0], w)) for m, w in weights.items()]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def per_sample_reference(net, x, y):
    """{mixed op: (B, K) ∂L/∂Z_bk} with a (B, K) leaf of equal rows Z_e per edge and cell; the DARTS forward zips over
    dim 0 of the weights, so the leaf goes in as (K, B, 1, 1, 1): w_k · op_k(x) then weighs each sample by Z_bk."""
    leaves = {}
    for cell in net.cells:
        Z = net.cell_weights(cell).detach()
        for e, m in enumerate(cell._ops):
            leaves[m] = Z[e].expand(len(x), K).clone().requires_grad_()
    with Replaced({m: z.t().reshape(K, len(x), 1, 1, 1) for m, z in leaves.items()}):
        grads = torch.autograd.grad(F.cross_entropy(net(x), y), list(leaves.values()))
    return dict(zip(leaves, grads))


# -- 1. the DARTS code ---------------------------------------------------------------------------------------------
def test_darts_code_costs_per_sample_output_costs_and_statistics_over_search_steps_equal_autograd():
    net = darts_net()
    probe = nasdiag.attach(net)
    # the same edges mapped explicitly, recorded by a second probe in the same blocks
    mapped = nasdiag.attach(net, edges={f"{c}/{e}": (m, list(m._ops)) for c, cell in enumerate(net.cells)
                                        for e, m in enumerate(cell._ops)})
    assert [(e.cell_type, e.edge_index, e.src, e.dst) for e in mapped.edges] == \
        [(e.cell_type, e.edge_index, e.src, e.dst) for e in probe.edges]
    assert [c.cell_type for c in probe.cells] == ["normal", "reduce", "reduce"]
    assert [(e.name, e.src, e.dst) for e in probe.edges[3:5]] == [("cells.0._ops.3", 1, 3), ("cells.0._ops.4", 2, 3)]
    opt = torch.optim.SGD([net.alphas_normal, net.alphas_reduce], lr=0.5)
    observed = {"normal": [], "reduce": []}
    for step in range(3):
        x, y = batch(seed=10 + step)
        ref = per_sample_reference(net, x, y)
        # output-edge costs: a per-sample scalar on each node's slice of every cell output, ∂L/∂s at s = 1
        s = torch.ones(len(net.cells), 2, len(x), dtype=DT, requires_grad=True)
        handles = [cell.register_forward_hook(
            lambda m, a, o, c=c: torch.cat([s[c, n].view(-1, 1, 1, 1) * h for n, h in enumerate(o.chunk(2, 1))], 1))
            for c, cell in enumerate(net.cells)]
        try:
            out_ref = torch.autograd.grad(F.cross_entropy(net(x), y), s)[0]
        finally:
            for h in handles:
                h.remove()
        opt.zero_grad()
        with probe.record(), mapped.record():
            F.cross_entropy(net(x), y).backward()
        costs, ps, oc = probe.costs(), probe.costs(per_sample=True), probe.output_costs(per_sample=True)
        for e in probe.edges:
            assert err(ps[e.name], ref[e.module]) < 1e-15 and err(costs[e.name], ref[e.module].sum(0)) < 1e-15, e.name
        assert max(err(mapped.costs(per_sample=True)[e.name], ref[e.module]) for e in mapped.edges) < 1e-15
        assert max(err(oc[f"cells.{c}"][n], out_ref[c, n - 2]) for c in range(3) for n in (2, 3)) < 1e-15
        # DARTS's α gradient is the cost mapped through softmax, summed over the cells of a type (§2.1)
        for t, alpha in (("normal", net.alphas_normal), ("reduce", net.alphas_reduce)):
            p = torch.softmax(alpha.detach(), -1)
            Ct = probe.cell_type_costs()[t]
            assert err((torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)) @ Ct.unsqueeze(-1), alpha.grad.unsqueeze(-1)) < 1e-15
        for e in probe.edges:
            observed[e.cell_type].append((e.cell_index, e.edge_index, ref[e.module].sum(0).numpy()))
        opt.step()  # α moves between steps, as in a search
    stats = probe.statistics()
    for t, n_cells in (("normal", 1), ("reduce", 2)):
        obs = np.zeros((3 * n_cells, 5, K))
        for i, (c, e, v) in enumerate(observed[t]):
            obs[(i // (5 * n_cells)) * n_cells + (c - (0 if t == "normal" else 1)), e] = v
        assert np.abs(stats[f"cost/{t}/mean"] - obs.mean(0)).max() < 1e-15
        assert np.abs(stats[f"cost/{t}/var"] - obs.var(0)).max() < 1e-15
        assert (stats[f"cost/{t}/count"] == 3 * n_cells).all()
        assert np.array_equal(mapped.statistics()[f"cost/{t}/mean"], stats[f"cost/{t}/mean"])
    assert_no_module_hooks(net)


def edge_hessian(net, x, y, module, z, through_softmax=False):
    """∂²L/∂z² (autograd) with ``z`` (or softmax(z)) in place of one mixed op's weights, every other edge fixed."""
    def loss(v):
        with Replaced({module: torch.softmax(v, -1) if through_softmax else v}):
            return F.cross_entropy(net(x), y)
    return hessian(loss, z.clone()).diagonal()


def test_darts_code_exact_curvature_in_z_and_in_an_owned_alpha_equals_autograd_and_a_shared_alpha_is_one_line():
    x, y = batch()
    net = darts_net()
    probe = nasdiag.attach(net, hessian="exact")
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    with pytest.raises(NasdiagError, match="shared") as raised:  # alphas_reduce feeds two cells: no per-edge α answer
        probe.hessian(wrt="alpha")
    assert "\n" not in str(raised.value)

    one = darts_net(layers=1)  # one normal cell: each row of alphas_normal is owned by one edge
    probe = nasdiag.attach(one, hessian="exact")
    with probe.record():  # no targets: read off the block's cross-entropy backward
        F.cross_entropy(one(x), y).backward()
    running = one.stem[1].running_mean.clone()
    hz, ha = probe.hessian(), probe.hessian(wrt="alpha")
    assert torch.equal(running, one.stem[1].running_mean)
    for e in (0, 4):
        m, Z = one.cells[0]._ops[e], one.alphas_normal.detach()[e]
        ref = edge_hessian(one, x, y, m, torch.softmax(Z, -1))
        assert err(hz[f"cells.0._ops.{e}"], ref) < 1e-12 * ref.abs().max()
        ref = edge_hessian(one, x, y, m, Z, through_softmax=True)
        assert err(ha[f"cells.0._ops.{e}"], ref) < 1e-12 * ref.abs().max()
    assert_no_module_hooks(net)
    assert_no_module_hooks(one)


# -- 2. PC-DARTS: partial channels and the edge normalization β ---------------------------------------------------------
def channel_shuffle(x, groups):
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).contiguous().view(b, -1, h, w)


class PCMixedOp(nn.Module):
    """PC-DARTS model_search.py: the ops see the first C/k channels, the others bypass them, then a channel shuffle."""

    def __init__(self, C, stride, k=2):
        super().__init__()
        self.k, self.mp = k, nn.MaxPool2d(2, 2)
        self._ops = nn.ModuleList(OPS[p](C // k, stride) for p in PRIMS)

    def forward(self, x, weights):
        dim_2 = x.shape[1]
        xtemp, xtemp2 = x[:, :dim_2 // self.k], x[:, dim_2 // self.k:]
        temp1 = sum(w * op(xtemp) for w, op in zip(weights, self._ops))
        ans = torch.cat([temp1, xtemp2], 1) if temp1.shape[2] == x.shape[2] else torch.cat([temp1, self.mp(xtemp2)], 1)
        return channel_shuffle(ans, self.k)


class PartialChannels(PCMixedOp):
    """The same partial-channel edge written so that nasdiag can cost it: the sum over the ops is its own DARTS mixed
    op (``self.mixed``), the split, concatenation and shuffle stay outside it."""

    def __init__(self, C, stride, k=2):
        super().__init__(C, stride, k)
        self.mixed = MixedOp(C // k, stride)
        del self._ops

    def forward(self, x, weights):
        xtemp, xtemp2 = x[:, :x.shape[1] // self.k], x[:, x.shape[1] // self.k:]
        temp1 = self.mixed(xtemp, weights)
        ans = torch.cat([temp1, xtemp2], 1) if temp1.shape[2] == x.shape[2] else torch.cat([temp1, self.mp(xtemp2)], 1)
        return channel_shuffle(ans, self.k)


class PCCell(Cell):
    """PC-DARTS's cell: node j = Σ_i β_ij · edge_ij(x_i, w_ij); forward(s0, s1, weights, weights2)."""

    def forward(self, s0, s1, weights, weights2):
        s0, s1 = self.preprocess0(s0), self.preprocess1(s1)
        states, offset = [s0, s1], 0
        for i in range(self._steps):
            s = sum(weights2[offset + j] * self._ops[offset + j](h, weights[offset + j]) for j, h in enumerate(states))
            offset += len(states)
            states.append(s)
        return torch.cat(states[-self._multiplier:], dim=1)


class PCNetwork(Network):
    def __init__(self, mixed, layers=2):
        super().__init__(layers=layers, cell=lambda *a: PCCell(*a, mixed=mixed))
        self.betas_normal = nn.Parameter(0.5 * torch.randn(5))
        self.betas_reduce = nn.Parameter(0.5 * torch.randn(5))
        for cell in self.cells:  # the node protocol, declared: output nodes 2, 3 of C channels each
            C = cell.preprocess1.op[1].out_channels
            cell.output_node_slices = {2: (0, C), 3: (C, 2 * C)}

    def edge_weights(self, betas):  # PC-DARTS: a softmax over the edges entering each node
        return torch.cat([F.softmax(betas[0:2], -1), F.softmax(betas[2:5], -1)])

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            b = self.betas_reduce if cell.reduction else self.betas_normal
            s0, s1 = s1, cell(s0, s1, self.cell_weights(cell), self.edge_weights(b))
        return self.classifier(self.global_pooling(s1).view(s1.size(0), -1))


def pc_net(mixed, seed=0):
    torch.manual_seed(seed)
    return PCNetwork(mixed).to(DT)


def test_pc_darts_partial_channel_mixed_op_is_one_line_naming_the_shapes_and_its_costed_form_equals_autograd():
    """Before: the refusal said "relative deviation inf". Written with its ops' sum as a mixed op of its own, the
    partial-channel edge is costed exactly, β and all (∂L/∂Z of the sum over the channel slice)."""
    x, y = batch(hw=8)
    net = pc_net(PCMixedOp)
    probe = nasdiag.attach(net)  # discovered: `_ops` and forward(x, weights)
    with pytest.raises(ProbeError, match=r"'cells\.0\._ops\.0'.*shape \(3, 2, 8, 8\) but it returns \(3, 4, 8, 8\).*PC-DARTS") as raised:
        with probe.record():
            F.cross_entropy(net(x), y).backward()
    assert "\n" not in str(raised.value)
    assert_no_module_hooks(net)

    net = pc_net(PartialChannels)
    probe = nasdiag.attach(net)
    assert probe.edge_names[:2] == ["cells.0._ops.0.mixed", "cells.0._ops.1.mixed"]
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    leaves = {m.mixed: net.cell_weights(c).detach()[e].clone().requires_grad_() for c in net.cells for e, m in enumerate(c._ops)}
    with Replaced(leaves):
        grads = dict(zip(leaves, torch.autograd.grad(F.cross_entropy(net(x), y), list(leaves.values()))))
    assert max(err(probe.costs()[e.name], grads[e.module]) for e in probe.edges) < 1e-15


def test_path_split_where_a_node_is_not_the_plain_sum_of_its_edges_is_one_line_naming_the_edge():
    """Before: PC-DARTS's β_ij · edge at a declared node gave silent path parts (∂L/∂x_j where the edge sees
    β·∂L/∂x_j: the parts summed to costs()/β, off by 0.03 on costs of 0.03); with partial channels a CostError that
    named no edge. Now the gradient the split gathers at node j is checked against ∂L/∂(edge output) once per edge.
    With β folded into the mixing weights (node = plain sum) the parts sum to costs() again."""
    x, y = batch(hw=8)
    for mixed, match in ((MixedOp, "relative deviation"), (PartialChannels, r"shape \(3, \d, \d, \d\)")):
        net = pc_net(mixed)
        if mixed is PartialChannels:  # declared as the cells' edges, so that the split knows their nodes
            for cell in net.cells:
                cell.edges = [m.mixed for m in cell._ops]
        probe = nasdiag.attach(net, path_split=True)
        with pytest.raises(ProbeError, match=f"path_split needs node.*{match}.*PC-DARTS") as raised:
            with probe.record():
                F.cross_entropy(net(x), y).backward()
        assert "\n" not in str(raised.value) and "'cells." in str(raised.value)
        assert_no_module_hooks(net)

    net = pc_net(MixedOp)
    for cell in net.cells:  # β folded into the mixing weights: node j is the plain sum of its edges again
        cell.forward = (lambda c: lambda s0, s1, w, w2: Cell.forward(c, s0, s1, w2.unsqueeze(-1) * w))(cell)
    probe = nasdiag.attach(net, path_split=True)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    costs, paths = probe.costs(), probe.path_costs()
    assert max(err(sum(paths[n].values()), costs[n]) for n in costs) < 1e-15
    assert_no_module_hooks(net)


# -- 3. GDAS: a hard one-hot straight-through weight, only the sampled op computed ----------------------------------------
class GDASMixedOp(MixedOp):
    """GDAS (search_cells.py, forward_gdas): the argmax op is computed and weighted, the other weights are added bare
    (their value is 0, their gradient the sum of ∂L/∂x_j)."""

    def forward(self, x, hardwts):
        index = int(hardwts.max(-1)[1].item())
        return sum(hardwts[k] * op(x) if k == index else hardwts[k] for k, op in enumerate(self._ops))


class GDASNet(nn.Module):
    """One DARTS cell whose weights are GDAS's Gumbel hard one-hot sample, drawn inside forward from ``self.gen``
    (reseeded with ``self.seed`` at every forward when set: a repeatable draw)."""

    def __init__(self, mixed=GDASMixedOp, C=4, tau=1.0):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, C, 3, padding=1, bias=False), nn.BatchNorm2d(C))
        self.cell = Cell(2, 2, C, C, C, False, False, mixed=mixed)
        self.classifier = nn.Linear(2 * C, N_CLS)
        self.arch = nn.Parameter(0.3 * torch.randn(5, K))
        self.tau, self.gen, self.seed = tau, torch.Generator(), None

    def hardwts(self):
        if self.seed is not None:
            self.gen.manual_seed(self.seed)
        gumbels = -torch.empty_like(self.arch).exponential_(generator=self.gen).log()
        probs = ((self.arch.log_softmax(-1) + gumbels) / self.tau).softmax(-1)
        one_h = torch.zeros_like(probs).scatter_(-1, probs.max(-1, keepdim=True)[1], 1.0)
        return one_h - probs.detach() + probs

    def forward(self, x):
        s = self.stem(x)
        return self.classifier(self.cell(s, s, self.hardwts()).mean((2, 3)))


def test_gdas_one_op_computed_costs_the_sampled_op_exactly_flags_the_rest_and_refuses_curvature_in_one_line():
    """Before: probe.hessian() returned numbers for the ops that never ran (1ᵀ∇²L 1 at the node, 0.0436 on every
    unsampled op), and, where every op ran, the curvature of a forward that draws its Z anew at another sample (0.0407
    for 0.0516); now one ProbeError naming the edge for each. With every op computed under the same one-hot Z (the
    warning's advice) and a repeatable draw, all costs and the exact curvature equal autograd."""
    torch.manual_seed(0)
    net = GDASNet().to(DT)
    x, y = batch()
    probe = nasdiag.attach(net, statistics="sampled", hessian="exact")
    counts = np.zeros((5, K), dtype=np.int64)
    for seed in (3, 4):
        net.seed = seed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            with probe.record(targets=y):
                F.cross_entropy(net(x), y).backward()
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1 and "cell._ops.0 ops" in msgs[0] and "Run every candidate op" in msgs[0]
        H = net.hardwts().detach()
        leaves = {m: H[e].clone().requires_grad_() for e, m in enumerate(net.cell._ops)}
        with Replaced(leaves):
            grads = torch.autograd.grad(F.cross_entropy(net(x), y), list(leaves.values()))
        costs = probe.costs()
        for e, g in enumerate(grads):
            k = int(H[e].argmax())
            c = costs[f"cell._ops.{e}"]
            assert err(c[k], g[k]) < 1e-15 and torch.isnan(c).sum() == K - 1
            counts[e, k] += 1
    assert (probe.statistics()["cost/normal/count"] == counts).all()
    with pytest.raises(ProbeError, match=r"candidate op\(s\) \[.*\] of edge 'cell\._ops\.0' \(and 4 more") as raised:
        probe.hessian()
    assert "\n" not in str(raised.value)

    torch.manual_seed(0)
    full = GDASNet(mixed=MixedOp).to(DT)  # the same one-hot Z multiplying every op (DSNAS-style)
    probe = nasdiag.attach(full, hessian="exact")
    full.gen.manual_seed(3)  # a draw that is not repeated: the re-run forward mixes with another sample
    with probe.record(targets=y):
        F.cross_entropy(full(x), y).backward()
    with pytest.raises(ProbeError, match="other mixing weights when the recorded batch was re-run") as raised:
        probe.hessian()
    assert "\n" not in str(raised.value)
    full.seed = 3
    with probe.record(targets=y):
        F.cross_entropy(full(x), y).backward()
    H = full.hardwts().detach()
    hz = probe.hessian()
    for e in (0, 4):
        m = full.cell._ops[e]
        leaf = H[e].clone().requires_grad_()
        with Replaced({m: leaf}):
            grad = torch.autograd.grad(F.cross_entropy(full(x), y), leaf)[0]
        assert err(probe.costs()[f"cell._ops.{e}"], grad) < 1e-15
        ref = edge_hessian(full, x, y, m, H[e])
        assert err(hz[f"cell._ops.{e}"], ref) < 1e-12 * ref.abs().max()
    assert_no_module_hooks(net)
    assert_no_module_hooks(full)


# -- 4. one-shot weight sharing: an op module shared by two edges, a mixed op serving two edges --------------------------
class OneShotNet(nn.Module):
    """One DARTS cell (steps 2); ``share="op"``: edges 0->2 and 1->2 share their sep_conv module (one weight set);
    ``share="mixed"``: one mixed op module sits at positions 0 and 1 of the cell's ``_ops`` (two edges, one module)."""

    def __init__(self, share, C=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, C, 3, padding=1, bias=False), nn.BatchNorm2d(C))
        self.cell = Cell(2, 2, C, C, C, False, False)
        if share == "op":
            self.cell._ops[1]._ops[3] = self.cell._ops[0]._ops[3]
        else:
            self.cell._ops[1] = self.cell._ops[0]
        self.classifier = nn.Linear(2 * C, N_CLS)
        self.alphas_normal = nn.Parameter(0.3 * torch.randn(5, K))

    def forward(self, x):
        s = self.stem(x)
        return self.classifier(self.cell(s, s, F.softmax(self.alphas_normal, -1)).mean((2, 3)))


def test_an_op_module_shared_by_two_edges_is_costed_split_and_curved_per_edge_exactly():
    """Costs, path parts and exact curvature per edge equal autograd. Before: the BatchNorm of the shared op was
    measured for invariance_deviation() at every call, so edge 1 reported edge 0's input (5.02e-4 for 3.86e-4)."""
    torch.manual_seed(0)
    net = OneShotNet("op").to(DT)
    x, y = batch(hw=6)
    rules = {Zero: cost.degree_rule(0.0, "zero"), Identity: cost.degree_rule(1.0, "identity"),
             FactorizedReduce: cost.delegate_rule("bn")}
    for t, rule in rules.items():
        cost.register_homogeneity_rule(t, rule)
    try:
        probe = nasdiag.attach(net, path_split=True, hessian="exact", norm_deviation=True)
        assert probe.edges[0].ops[3] is probe.edges[1].ops[3]
        bn, seen = net.cell._ops[0]._ops[3][3], []
        handle = bn.register_forward_pre_hook(lambda m, a: seen.append(m.eps / (a[0].var((0, 2, 3), unbiased=False) + m.eps)))
        try:
            with probe.record(targets=y):
                F.cross_entropy(net(x), y).backward()
        finally:
            handle.remove()
        deviation = probe.invariance_deviation()
    finally:
        for t in rules:
            del cost.HOMOGENEITY_RULES[t]
    for e in (0, 1):  # the shared op's BN ran once in each edge, in edge order
        assert deviation[f"cell._ops.{e}"]["3:Sequential"] == pytest.approx(float(seen[e].max()), rel=1e-12)
    Z = F.softmax(net.alphas_normal.detach(), -1)
    leaves = {m: Z[e].clone().requires_grad_() for e, m in enumerate(net.cell._ops)}
    with Replaced(leaves):
        grads = torch.autograd.grad(F.cross_entropy(net(x), y), list(leaves.values()))
    costs, paths, hz = probe.costs(), probe.path_costs(), probe.hessian()
    for e, g in enumerate(grads):
        assert err(costs[f"cell._ops.{e}"], g) < 1e-15
        assert err(sum(paths[f"cell._ops.{e}"].values()), g) < 1e-15
    for e in (0, 1):
        ref = edge_hessian(net, x, y, net.cell._ops[e], Z[e])
        assert err(hz[f"cell._ops.{e}"], ref) < 1e-12 * ref.abs().max()
    assert_no_module_hooks(net)


def test_one_mixed_op_module_serving_two_edges_with_different_weights_is_one_line_naming_it():
    """Before: the module was discovered once ('cell._ops.0'), its "costs" were the sum of both edges' ∂L/∂Z (off by
    0.075 from edge 0's) and edge 1 was missing, silently; the exact curvature added both edges' too. Calls of one
    module with the same weights (tied Z) still add up to ∂L/∂Z of that Z."""
    torch.manual_seed(0)
    net = OneShotNet("mixed").to(DT)
    x, y = batch(hw=6)
    probe = nasdiag.attach(net)
    assert probe.edge_names == ["cell._ops.0", "cell._ops.2", "cell._ops.3", "cell._ops.4"]
    with pytest.raises(ProbeError, match=r"edge 'cell\._ops\.0': its mixed op ran twice .* different mixing weights") as raised:
        with probe.record():
            F.cross_entropy(net(x), y).backward()
    assert "\n" not in str(raised.value)
    assert_no_module_hooks(net)

    tied = Cell.forward  # the same row of α for both uses of the module: one Z, and its cost is their sum
    net.cell.forward = lambda s0, s1, w: tied(net.cell, s0, s1, w[[0, 0, 2, 3, 4]])
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    z = F.softmax(net.alphas_normal.detach(), -1)[0].clone().requires_grad_()
    with Replaced({net.cell._ops[0]: z}):
        grad = torch.autograd.grad(F.cross_entropy(net(x), y), z)[0]
    assert err(probe.costs()["cell._ops.0"], grad) < 1e-15
    assert_no_module_hooks(net)


# -- 5. grad modes, autocast, hooks on every exit path, memory --------------------------------------------------------
def test_validation_forwards_under_no_grad_and_inference_mode_a_block_under_no_grad_and_autocast():
    """Before: with a validation forward under no_grad before the training forward in the block, probe.hessian()
    re-ran the *validation* batch (with the training targets): -0.0906 for 0.0898 on the conv op of edge 0."""
    x, y = batch()
    xv, _ = batch(seed=5)
    net = darts_net(layers=1)
    probe = nasdiag.attach(net, hessian="exact")
    with probe.record(targets=y):
        with torch.no_grad():
            net(xv)
        with torch.inference_mode():
            net(xv)
        F.cross_entropy(net(x), y).backward()
    ref = per_sample_reference(net, x, y)
    ps = probe.costs(per_sample=True)
    assert max(err(ps[e.name], ref[e.module]) for e in probe.edges) < 1e-15
    m = net.cells[0]._ops[0]
    ref = edge_hessian(net, x, y, m, net.cell_weights(net.cells[0]).detach()[0])
    assert err(probe.hessian()["cells.0._ops.0"], ref) < 1e-12 * ref.abs().max()

    with warnings.catch_warnings(record=True) as caught:  # the whole block under no_grad: nothing to cost, said once
        warnings.simplefilter("always", RuntimeWarning)
        with torch.no_grad(), probe.record():
            net(x)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "grad mode off" in msgs[0]
    assert all(torch.isnan(c).all() for c in probe.costs().values())
    assert (probe.statistics()["cost/normal/count"] == 1).all()
    assert_no_module_hooks(net)

    # autocast (CPU, bfloat16): the costs are <∂L/∂x_j, O_k(x_i)> of the step's own bf16 tensors, accumulated in float32
    # (before: the bmm in the backward hook was autocast too, so the costs came back in bfloat16, off by ~2^-9 relative).
    # Reference: the same tensors, caught by the test's own hooks in the same step, multiplied out in float64.
    torch.manual_seed(0)
    net32 = Network(layers=1)
    grads, outs, handles = {}, {}, []
    for e, m in enumerate(net32.cells[0]._ops):
        handles.append(m.register_forward_hook(
            lambda mod, a, o, e=e: [o.register_hook(lambda g: grads.__setitem__(e, g.double())), None][1]))
        for k, op in enumerate(m._ops):
            handles.append(op.register_forward_hook(lambda mod, a, o, e=e, k=k: outs.__setitem__((e, k), o.detach().double())))
    probe = nasdiag.attach(net32)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), probe.record():
            F.cross_entropy(net32(x.float()), y).backward()
    finally:
        for h in handles:
            h.remove()
    costs = probe.costs()
    for e, edge in enumerate(probe.edges):
        terms = torch.stack([grads[e] * outs[(e, k)] for k in range(K)])
        ref, scale = terms.flatten(1).sum(1), terms.abs().flatten(1).sum(1)
        assert costs[edge.name].dtype == torch.float32
        assert ((costs[edge.name].double() - ref).abs() <= 1e-5 * scale + 1e-12).all(), edge.name
    assert_no_module_hooks(net32)


def test_hooks_are_gone_after_every_exit_path_and_the_next_step_is_exact():
    """Exit paths round 3 did not take: a KeyboardInterrupt raised in the backward (a tensor hook), one raised inside a
    candidate op while its edge is open, an error in the user's loss after the forward."""
    x, y = batch()
    net = darts_net(layers=1)
    probe = nasdiag.attach(net, path_split=True, hessian="exact", statistics="sampled")

    def interrupt(*_):
        raise KeyboardInterrupt

    def in_backward():
        out = net(x)
        out.register_hook(interrupt)
        F.cross_entropy(out, y).backward()

    def in_candidate():
        handle = net.cells[0]._ops[2]._ops[3].register_forward_pre_hook(interrupt)
        try:
            net(x)
        finally:
            handle.remove()

    def in_loss():
        F.cross_entropy(net(x), y[:2]).backward()  # the user's batch-size mistake: torch's ValueError

    for body, exc in ((in_backward, KeyboardInterrupt), (in_candidate, KeyboardInterrupt), (in_loss, ValueError)):
        with pytest.raises(exc):
            with probe.record():
                body()
        assert_no_module_hooks(net)
        with pytest.raises(ProbeError, match="no completed"):
            probe.costs()
    ref = per_sample_reference(net, x, y)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    assert max(err(probe.costs(per_sample=True)[e.name], ref[e.module]) for e in probe.edges) < 1e-15
    assert (probe.statistics()["cost/normal/count"] == 1).all()
    assert_no_module_hooks(net)


@pytest.mark.slow
def test_300_search_steps_keep_no_tensor_and_no_python_memory():
    """300 steps with the path split (node hooks), the curvature's kept batch and weights, and every result read. Python
    memory settles within ~100 steps (torch's and CPython's caches: +18 KB, then +3 KB, then +0.3 KB per 100 steps);
    a leak of one small object per step would add ≥ 10 KB over the last 180. torch 2.13 itself keeps ~48 B per plain
    forward+backward of a conv in tracemalloc's count (for thousands of steps, with no nasdiag imported), which put
    the measured growth at 9–21 KB from run to run: the bound is on the growth beyond 180 plain steps of the same net
    and batch without the probe, measured in the same window."""
    net = darts_net(layers=1, C=2)
    x, y = batch(b=2)
    probe = nasdiag.attach(net, path_split=True, hessian="exact")

    def step():
        net.zero_grad(set_to_none=True)
        with probe.record(targets=y):
            F.cross_entropy(net(x), y).backward()
        probe.costs(per_sample=True), probe.path_costs(), probe.output_costs(), probe.statistics()

    def plain_step():
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()

    for _ in range(20):
        step()
        plain_step()
    before = live_tensors()
    tracemalloc.start()
    try:
        for _ in range(100):
            step()
            plain_step()
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(180):
            plain_step()
        torch_own = tracemalloc.get_traced_memory()[0] - start
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(180):
            step()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert live_tensors() <= before
    assert grown - max(torch_own, 0) < 10 * 1024, (grown, torch_own)
    assert (probe.statistics()["cost/normal/count"] == 300).all()
    assert_no_module_hooks(net)
