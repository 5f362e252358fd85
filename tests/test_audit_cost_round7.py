"""Cost audit round 7: the wiring paper's cost C(Z) = ∂L/∂Z = <∂L/∂x_j, O(x_i)> and its theorems on supernet shapes
the earlier rounds did not use, all written from scratch here in float64: NAS-Bench-201 cells (every node fed by every
earlier node, the last node is the output, no concatenation) stacked around a stride-2 block, one cell module run
twice (weight-tied cells), activation checkpointing around the edges *inside* a cell, DARTS cells with two inputs
(c_{k-2}, c_{k-1}) and stride-2 reduction whose output *sums* their nodes, a candidate op module that also runs inside
another candidate, autocast bfloat16 on the CPU, batch size 1, eval mode, and 1000 steps. References: plain autograd
(leaf mixing weights Z, per-sample leaf Z, scalar multipliers on cell outputs), the paper's L − H transcribed here,
numpy moments; never nasdiag against nasdiag.

Defects found (each test fails without its fix):

* With ``path_split=True`` and ``torch.utils.checkpoint(..., use_reentrant=True)`` around the edges inside a cell,
  ``path_costs()`` was ``{}`` for every edge, silently, though the docs promise parts summing to ``costs()`` (the
  recomputed edge ran outside its cell's forward, so no part could be placed); now one ProbeError line
  (test_checkpointing_inside_a_cell_gives_autograds_costs_and_a_split_it_cannot_make_is_one_line).
* A DARTS-convention cell (``_ops``, ``_steps``, ``_multiplier``) whose output *sums* its last nodes got per-node
  output costs from equal channel chunks of that sum, silently meaningless numbers; they are now NaN with a warning
  saying why, and ``path_split`` is one ProbeError line
  (test_darts_cells_with_two_inputs_stride_and_a_summed_output_cost_as_autograd_and_flag_the_output).
* A candidate op module that also runs inside another candidate of the same edge (weights shared between candidates:
  ``[conv, Sequential(pre, conv)]``) had its output taken from its last call, on the other candidate's input, so
  the probe refused a valid mixed op ("its output is not Σ_k w_k·op_k(x)") when the shared op came first
  (test_a_candidate_op_also_run_inside_another_candidate_is_costed_at_its_own_call).
* NAS-Bench-201's own search cell keeps each edge as a ModuleList of ops and mixes them in the cell's forward; an
  edge mapped to that ModuleList (alone or with its ops) was accepted and gave NaN costs at every step with a warning
  to "run the model's forward inside the block", which did run; now one ProbeError line at attach
  (test_an_edge_mapped_to_a_container_that_is_never_called_is_one_line_at_attach).
* Under autocast bfloat16, a mixed op summing its K = 8 terms in another order than the check (reversed, or stacked
  and summed) deviates from the check's own bfloat16 sum by ~1e-2 of its output, past the 1e-3 half-precision
  tolerance: every step was refused as "not Σ_k w_k·op_k(x)". The check now sums in float32 and allows K roundings
  of the half dtype (test_a_mixed_op_summing_in_its_own_order_under_autocast_is_accepted_and_costed).
* One mixed-op module at two positions of a cell's edge list (tied within the cell) with ``path_split=True`` got the
  node pair of its first position for every call, and the first backward raised "node 2 is not the plain sum of its
  incoming edges" naming another edge; now refused at attach, naming the positions
  (test_one_mixed_op_at_two_positions_of_a_cell_adds_its_costs_and_refuses_the_split_in_one_line).

Checked and right: costs, per-sample costs, output costs, path parts and streaming moments on NB-201 cells (also
channels_last, batch size 1, eval mode), ∂L/∂α of an α shared by two NB-201 cells, Thm. 1 / Cor. 1.2 / Thm. 2 on
NB-201 cells at eps = 1e-12, weight-tied cells, non-reentrant checkpointing inside a cell and reentrant checkpointing
of whole cells (with the split), DARTS cells with two inputs and stride-2 reduction (per-sample Z), autocast
bfloat16 costs in float32 to 1e-5 of a float64 sum of the step's own tensors (backward inside or outside autocast),
hooks gone after a loss raising Boom or KeyboardInterrupt (its graph backwarded later records nothing), 1000 steps
with no live tensor and no Python memory kept.
"""

import contextlib
import gc
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from conftest import assert_no_module_hooks, live_tensors

import nasdiag
from nasdiag.cost import degree_rule, register_homogeneity_rule
from nasdiag.probe.discovery import ProbeError

DT = torch.float64
C, B, K, N_CLASSES = 3, 4, 5, 3
EDGES_201 = [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]


class R7Zero(nn.Module):
    def forward(self, x):
        return x.mul(0.0)


register_homogeneity_rule(R7Zero, degree_rule(0.0, "constant zero output"), overwrite=True)


def _rcb(k, eps, dtype=DT, stride=1):
    return nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, k, stride, k // 2, bias=False, dtype=dtype),
                         nn.BatchNorm2d(C, eps=eps, dtype=dtype))


def _ops(kind, eps, dtype=DT):
    """NB-201's op set (none, skip, conv 1x1, conv 3x3, avg pool) or one whose every op is scale-invariant."""
    if kind == "nb201":
        return [R7Zero(), nn.Identity(), _rcb(1, eps, dtype), _rcb(3, eps, dtype),
                nn.AvgPool2d(3, 1, 1, count_include_pad=False)]
    return [R7Zero(), _rcb(1, eps, dtype), _rcb(3, eps, dtype),
            nn.Sequential(nn.AvgPool2d(3, 1, 1), nn.BatchNorm2d(C, eps=eps, dtype=dtype))]


class R7Mixed(nn.Module):
    """DARTS convention: candidates in ``_ops``, forward (x, w) with w (K,) or (B, K). ``keep`` (a list) collects the
    candidate outputs and the output of each call, for the autocast reference."""

    def __init__(self, ops):
        super().__init__()
        self._ops = nn.ModuleList(ops)
        self.keep = None

    def forward(self, x, w):
        outs = [op(x) for op in self._ops]
        if w.dim() == 2:
            out = sum(w[:, k].reshape(-1, 1, 1, 1) * o for k, o in enumerate(outs))
        else:
            out = sum(w[k] * o for k, o in enumerate(outs))
        if self.keep is not None:
            out.retain_grad()
            self.keep.append((outs, out))
        return out


class NB201Cell(nn.Module):
    """Node j = Σ_{i<j} edge_ij(node i), node 0 the cell input, node 3 the output (declared by the node protocol).
    ``ckpt``: None, or checkpoint each edge call with use_reentrant=ckpt."""

    cell_type = "nb201"
    edge_nodes = EDGES_201
    output_nodes = [3]

    def __init__(self, kind="nb201", eps=1e-5, dtype=DT, ckpt=None):
        super().__init__()
        self.edges = nn.ModuleList(R7Mixed(_ops(kind, eps, dtype)) for _ in EDGES_201)
        self.output_node_slices = {3: (0, C)}
        self.ckpt = ckpt

    def forward(self, x, Z):
        nodes = [x]
        for j in (1, 2, 3):
            terms = []
            for e, (i, jj) in enumerate(EDGES_201):
                if jj != j:
                    continue
                if self.ckpt is None:
                    terms.append(self.edges[e](nodes[i], Z[e]))
                else:
                    terms.append(checkpoint(self.edges[e], nodes[i], Z[e], use_reentrant=self.ckpt))
            nodes.append(sum(terms))
        return nodes[3]


class NB201Net(nn.Module):
    """stem → cell → ReLU-conv(stride 2)-BN → cell → GAP → bias-free linear. ``tied``: one cell module run twice
    (same Z); ``scales``: multipliers on each cell call's output (autograd's reference for output costs)."""

    def __init__(self, kind="nb201", eps=1e-5, dtype=DT, ckpt=None, tied=False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, C, 3, padding=1, bias=False, dtype=dtype), nn.BatchNorm2d(C, dtype=dtype))
        self.cells = nn.ModuleList(NB201Cell(kind, eps, dtype, ckpt) for _ in range(1 if tied else 2))
        self.reduce = _rcb(3, eps, dtype, stride=2)
        self.fc = nn.Linear(C, N_CLASSES, bias=False, dtype=dtype)
        self.tied = tied
        self.ckpt_cells = False  # checkpoint each cell call whole (reentrant)

    def forward(self, x, Z, scales=None):
        s = self.stem(x)
        for c in range(2):
            cell = self.cells[0 if self.tied else c]
            if self.ckpt_cells:
                s = checkpoint(cell, s, Z[0 if self.tied else c], use_reentrant=True)
            else:
                s = cell(s, Z[0 if self.tied else c])
            if scales is not None:
                s = s * scales[c]
            if c == 0:
                s = self.reduce(s)
        return self.fc(F.adaptive_avg_pool2d(s, 1).flatten(1))


def _batch(seed=0, b=B, hw=6, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 1, hw, hw, generator=g, dtype=dtype), torch.randint(0, N_CLASSES, (b,), generator=g)


def _z(n_cells=2, seed=0, k=K, dtype=DT):
    g = torch.Generator().manual_seed(100 + seed)
    return [torch.softmax(torch.randn(6, k, generator=g, dtype=dtype), -1).requires_grad_() for _ in range(n_cells)]


def _name(c, e):
    return f"cells.{c}.edges.{e}"


#: output costs of a cell followed only by invariant ops cancel to ~1e-5 of their terms (Cor. 1.2 at eps = 1e-5), so
#: float64 rounding of the terms is ~1e-11 of the sum
OUT_RTOL = 1e-9


def _max_rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _loss_minus_entropy(logits, y):
    """Thm. 2 transcribed: L = −(1/B) Σ_b log p_{b,n_b}, H = −(1/B) Σ_b Σ_n p_bn log p_bn."""
    logp = logits.log_softmax(1)
    loss = -logp[torch.arange(len(y)), y].mean()
    entropy = -(logp.exp() * logp).sum(1).mean()
    return loss - entropy


# --- NAS-Bench-201 cells ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_nb201_cells_costs_per_sample_output_costs_path_parts_and_statistics_equal_autograd(layout):
    torch.manual_seed(0)
    net = NB201Net()
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    net = net.to(memory_format=fmt)
    probe = nasdiag.attach(net, path_split=True)
    assert [e.label for e in probe.edges[:6]] == [f"{i}->{j}" for i, j in EDGES_201]
    rows = []
    for step in range(3):
        x, y = _batch(step)
        x = x.to(memory_format=fmt)
        Z = _z(seed=step)
        s = [torch.ones(B, 1, 1, 1, dtype=DT, requires_grad=True) for _ in range(2)]
        with probe.record():
            F.cross_entropy(net(x, Z, s), y).backward()
        costs, parts, out = probe.costs(), probe.path_costs(), probe.output_costs(per_sample=True)
        for c in range(2):
            for e in range(6):
                assert _max_rel(costs[_name(c, e)], Z[c].grad[e]) < 1e-12
                # every edge's cost splits into the paths leaving its end node (node 3: the output only)
                assert set(parts[_name(c, e)]) == ({"output"} if EDGES_201[e][1] == 3 else
                                                   {_name(c, f) for f, (i, _) in enumerate(EDGES_201) if i == EDGES_201[e][1]})
                assert _max_rel(sum(parts[_name(c, e)].values()), Z[c].grad[e]) < 1e-12
            assert _max_rel(out[f"cells.{c}"][3], s[c].grad.flatten()) < OUT_RTOL
        rows.append(torch.stack([z.grad for z in Z]).numpy())
    # per-sample costs: per-sample leaf weights Z_b (B, K) at the same values, ∂L/∂Z_bk
    x, y = _batch(7)
    x = x.to(memory_format=fmt)
    Zs = [z.detach().unsqueeze(1).expand(6, B, K).clone().requires_grad_() for z in _z(seed=7)]
    with probe.record():
        F.cross_entropy(net(x, Zs), y).backward()
    per_sample = probe.costs(per_sample=True)
    for c in range(2):
        for e in range(6):
            assert per_sample[_name(c, e)].shape == (B, K)
            assert _max_rel(per_sample[_name(c, e)], Zs[c].grad[e]) < 1e-12
    rows.append(torch.stack([z.grad.sum(1) for z in Zs]).numpy())
    R = np.concatenate(rows)  # (steps × cells, E, K): each cell of the type is one observation per step
    st = probe.statistics()
    assert (st["cost/nb201/count"] == 8).all()
    np.testing.assert_allclose(st["cost/nb201/mean"], R.mean(0), rtol=1e-10, atol=1e-16)
    np.testing.assert_allclose(st["cost/nb201/var"], R.var(0), rtol=1e-8, atol=1e-18)


def test_nb201_alpha_shared_by_both_cells_gets_its_gradient_from_the_cell_type_costs():
    """§2.1 summed over the cells using α: darts_alpha_grad(cell_type_costs(), softmax(α)) = ∂L/∂α (autograd)."""
    torch.manual_seed(12)
    net = NB201Net()
    probe = nasdiag.attach(net)
    x, y = _batch(9)
    alpha = (1e-1 * torch.randn(6, K, generator=torch.Generator().manual_seed(9), dtype=DT)).requires_grad_()
    with probe.record():
        p = alpha.softmax(-1)
        F.cross_entropy(net(x, [p, p]), y).backward()
    summed = probe.cell_type_costs()["nb201"]
    p = p.detach()
    mine = p * (summed - (p * summed).sum(-1, keepdim=True))  # (diag p − ppᵀ) C, written out
    assert _max_rel(mine, alpha.grad) < 1e-12
    assert _max_rel(nasdiag.cost.darts_alpha_grad(summed, p), alpha.grad) < 1e-12


def test_nb201_cells_obey_thm1_cor12_and_thm2_at_tiny_eps():
    """All ops scale-invariant, eps = 1e-12: node 1 is fed by edge 0->1 alone and read by edges 1->2, 1->3 only, so
    Σ_k Z_k part_k through each of them is 0 (Thm. 1); the first cell feeds only the ReLU-conv-BN block, so its
    output cost is 0 (Cor. 1.2); the last feeds GAP and a bias-free classifier, so its output cost is L − H (Thm. 2)."""
    torch.manual_seed(1)
    net = NB201Net(kind="invariant", eps=1e-12)
    Kinv = 4
    probe = nasdiag.attach(net, path_split=True)
    assert all(bool(v.all()) for v in probe.scale_invariant_ops().values())
    x, y = _batch(3)
    Z = _z(seed=3, k=Kinv)
    with probe.record():
        logits = net(x, Z)
        F.cross_entropy(logits, y).backward()
    costs, parts, out = probe.costs(), probe.path_costs(), probe.output_costs()
    scale = max(float(v.abs().max()) for v in costs.values())
    for c in range(2):
        for leaving in (2, 4):
            passed = (Z[c][0].detach() * parts[_name(c, 0)][_name(c, leaving)]).sum()
            assert abs(float(passed)) < 1e-8 * scale
        # the parts themselves are not zero: the check above is not vacuous
        assert float(parts[_name(c, 0)][_name(c, 2)].abs().max()) > 1e-3 * scale
    assert abs(float(out["cells.0"][3])) < 1e-8 * scale
    lh = float(_loss_minus_entropy(logits.detach(), y))
    assert abs(float(out["cells.1"][3]) - lh) < 1e-10 * abs(lh)


def test_weight_tied_cell_costs_output_costs_and_path_parts_add_up_over_its_calls():
    torch.manual_seed(2)
    net = NB201Net(tied=True)
    probe = nasdiag.attach(net, path_split=True)
    x, y = _batch(4)
    Z = _z(1, seed=4)
    s = [torch.ones(B, 1, 1, 1, dtype=DT, requires_grad=True) for _ in range(2)]
    with probe.record():
        F.cross_entropy(net(x, Z, s), y).backward()
    costs, per_sample, parts = probe.costs(), probe.costs(per_sample=True), probe.path_costs()
    for e in range(6):
        assert _max_rel(costs[_name(0, e)], Z[0].grad[e]) < 1e-12
        assert per_sample[_name(0, e)].shape == (B, K)
        assert _max_rel(per_sample[_name(0, e)].sum(0), Z[0].grad[e]) < 1e-12
        assert _max_rel(sum(parts[_name(0, e)].values()), Z[0].grad[e]) < 1e-12
    out = probe.output_costs(per_sample=True)["cells.0"][3]
    assert _max_rel(out, (s[0].grad + s[1].grad).flatten()) < OUT_RTOL
    st = probe.statistics()
    assert (st["cost/nb201/count"] == 1).all()  # one cell, one observation of the tied Z
    np.testing.assert_allclose(st["cost/nb201/mean"], Z[0].grad.numpy(), rtol=1e-12, atol=1e-16)


def _assert_parts_sum_to_autograd(probe, Z):
    parts = probe.path_costs()
    for c in range(2):
        for e in range(6):
            assert parts[_name(c, e)]
            assert _max_rel(sum(parts[_name(c, e)].values()), Z[c].grad[e]) < 1e-12


def test_one_mixed_op_at_two_positions_of_a_cell_adds_its_costs_and_refuses_the_split_in_one_line():
    """One module for 1->2 and 2->3 with the same Z row (tied within the cell): costs() add up both calls, as for
    tied cells; path_split cannot tell the calls apart by node pair (before: a ProbeError blaming node 2 as "not
    the plain sum of its incoming edges", naming another edge, in the first backward)."""
    torch.manual_seed(13)
    net = NB201Net()
    for cell in net.cells:
        cell.edges[5] = cell.edges[2]
    x, y = _batch(10)
    Z = [z.detach() for z in _z(seed=10)]
    for z in Z:
        z[5] = z[2]
    Z = [z.requires_grad_() for z in Z]
    probe = nasdiag.attach(net)
    assert len(probe.edges) == 10
    with probe.record():
        F.cross_entropy(net(x, Z), y).backward()
    for c in range(2):
        assert _max_rel(probe.costs()[_name(c, 2)], Z[c].grad[2] + Z[c].grad[5]) < 1e-12
    with pytest.raises(ProbeError, match=r"positions \[2, 5\]") as err:
        nasdiag.attach(net, path_split=True)
    assert "\n" not in str(err.value)


# --- activation checkpointing inside a cell --------------------------------------------------------------------------
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_inside_a_cell_gives_autograds_costs_and_a_split_it_cannot_make_is_one_line(reentrant):
    torch.manual_seed(3)
    net = NB201Net(ckpt=reentrant)
    x, y = _batch(5)
    probe = nasdiag.attach(net)
    Z = _z(seed=5)
    s = [torch.ones((), dtype=DT, requires_grad=True) for _ in range(2)]
    with probe.record():
        F.cross_entropy(net(x, Z, s), y).backward()
    costs, out = probe.costs(), probe.output_costs()
    for c in range(2):
        for e in range(6):
            assert _max_rel(costs[_name(c, e)], Z[c].grad[e]) < 1e-12
        assert _max_rel(out[f"cells.{c}"][3], s[c].grad) < OUT_RTOL
    split = nasdiag.attach(net, path_split=True)
    Z = _z(seed=6)
    if reentrant:
        # the edges are recomputed in the backward, after their cell's forward ended: no part can be placed
        with pytest.raises(ProbeError, match="outside") as err:
            with split.record():
                F.cross_entropy(net(x, Z), y).backward()
        assert "\n" not in str(err.value) and "use_reentrant" in str(err.value)
        assert_no_module_hooks(net)
    else:
        with split.record():
            F.cross_entropy(net(x, Z), y).backward()
        _assert_parts_sum_to_autograd(split, Z)


def test_whole_cells_checkpointed_reentrantly_split_their_costs_exactly():
    """Round 5 checked costs() under whole-cell checkpointing; the path parts too must sum to autograd's ∂L/∂Z."""
    torch.manual_seed(4)
    net = NB201Net()
    net.ckpt_cells = True
    probe = nasdiag.attach(net, path_split=True)
    x, y = _batch(6)
    Z = _z(seed=7)
    with probe.record():
        F.cross_entropy(net(x, Z), y).backward()
    _assert_parts_sum_to_autograd(probe, Z)
    assert_no_module_hooks(net)


# --- DARTS cells with two inputs, stride 2 and a summed output -----------------------------------------------------
class R7FactorizedReduce(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(C, C // 2 + 1, 1, 2, bias=False, dtype=DT)
        self.c2 = nn.Conv2d(C, C // 2, 1, 2, bias=False, dtype=DT)
        self.bn = nn.BatchNorm2d(C, dtype=DT)

    def forward(self, x):
        x = F.relu(x)
        return self.bn(torch.cat([self.c1(x), self.c2(x[:, :, 1:, 1:])], 1))


class SumCell(nn.Module):
    """DARTS convention (``_ops``, ``_steps``, ``_multiplier``, forward (s0, s1, weights)) with stride-2 edges from
    both inputs in a reduction cell, but the output is the **sum** of the last ``_multiplier`` nodes."""

    def __init__(self, reduction, reduction_prev):
        super().__init__()
        self.reduction, self._steps, self._multiplier = reduction, 3, 2
        self.pre0 = R7FactorizedReduce() if reduction_prev else _rcb(1, 1e-5)
        self.pre1 = _rcb(1, 1e-5)
        self._ops = nn.ModuleList(
            R7Mixed([R7Zero() if not (reduction and i < 2) else nn.MaxPool2d(3, 2, 1), _rcb(3, 1e-5, stride=2 if reduction and i < 2 else 1),
                     nn.AvgPool2d(3, 2 if reduction and i < 2 else 1, 1, count_include_pad=False)])
            for j in range(3) for i in range(2 + j))

    def forward(self, s0, s1, weights):
        states, offset = [self.pre0(s0), self.pre1(s1)], 0
        for _ in range(self._steps):
            states.append(sum(self._ops[offset + i](h, weights[offset + i]) for i, h in enumerate(states)))
            offset += len(states) - 1
        return sum(states[-self._multiplier:])


class SumNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, C, 3, padding=1, bias=False, dtype=DT), nn.BatchNorm2d(C, dtype=DT))
        self.cells = nn.ModuleList([SumCell(False, False), SumCell(True, False), SumCell(False, True)])
        self.fc = nn.Linear(C, N_CLASSES, dtype=DT)

    def forward(self, x, Z):
        s0 = s1 = self.stem(x)
        for cell, z in zip(self.cells, Z):
            s0, s1 = s1, cell(s0, s1, z)
        return self.fc(F.adaptive_avg_pool2d(s1, 1).flatten(1))


def test_darts_cells_with_two_inputs_stride_and_a_summed_output_cost_as_autograd_and_flag_the_output():
    torch.manual_seed(5)
    net = SumNet()
    probe = nasdiag.attach(net)
    assert [c.cell_type for c in probe.cells] == ["normal", "reduce", "normal"]
    x, y = _batch(8, hw=8)
    g = torch.Generator().manual_seed(8)
    Z = [torch.softmax(torch.randn(9, B, 3, generator=g, dtype=DT), -1).requires_grad_() for _ in range(3)]
    with probe.record():
        F.cross_entropy(net(x, Z), y).backward()
    per_sample = probe.costs(per_sample=True)
    for c in range(3):
        for e in range(9):
            assert _max_rel(per_sample[f"cells.{c}._ops.{e}"], Z[c].grad[e]) < 1e-12
    # the output is the nodes' sum: there is no channel slice per node, so no per-node output cost (it was the cost of
    # half of the sum's channels, per "node"); NaN and said so
    with pytest.warns(RuntimeWarning, match="not the concatenation") as rec:
        out = probe.output_costs()
    assert all(bool(torch.isnan(v)) for cell in out.values() for v in cell.values())
    assert all("\n" not in str(w.message) for w in rec)
    split = nasdiag.attach(net, path_split=True)
    with pytest.raises(ProbeError, match="not their concatenation") as err:
        with split.record():
            F.cross_entropy(net(x, Z), y).backward()
    assert "\n" not in str(err.value)
    assert_no_module_hooks(net)


# --- a candidate op module that also runs inside another candidate ------------------------------------------------
class SharedCandidates(nn.Module):
    """K = 3: conv, pre → conv (the same conv module: weights shared between candidates), identity."""

    def __init__(self, nested_first):
        super().__init__()
        conv = nn.Conv2d(C, C, 3, padding=1, bias=False, dtype=DT)
        ops = [conv, nn.Sequential(nn.Conv2d(C, C, 1, bias=False, dtype=DT), conv), nn.Identity()]
        self._ops = nn.ModuleList([ops[1], ops[0], ops[2]] if nested_first else ops)

    def forward(self, x, w):
        return sum(w[k] * op(x) for k, op in enumerate(self._ops))


class SharedNet(nn.Module):
    def __init__(self, nested_first):
        super().__init__()
        self.edge = SharedCandidates(nested_first)
        self.fc = nn.Linear(C, N_CLASSES, dtype=DT)

    def forward(self, x, w):
        return self.fc(torch.tanh(self.edge(x, w)).mean((2, 3)))


@pytest.mark.parametrize("nested_first", [False, True])
def test_a_candidate_op_also_run_inside_another_candidate_is_costed_at_its_own_call(nested_first):
    torch.manual_seed(6)
    net = SharedNet(nested_first)
    probe = nasdiag.attach(net)
    g = torch.Generator().manual_seed(9)
    for step in range(2):
        x = torch.randn(B, C, 5, 5, generator=g, dtype=DT)
        y = torch.randint(0, N_CLASSES, (B,), generator=g)
        w = torch.softmax(torch.randn(3, generator=g, dtype=DT), 0).requires_grad_()
        with probe.record():
            F.cross_entropy(net(x, w), y).backward()
        assert _max_rel(probe.costs()["edge"], w.grad) < 1e-12


class NB201SearchCell(nn.Module):
    """NAS-Bench-201's own search cell: each edge is a ModuleList of ops, mixed in the cell's forward."""

    def __init__(self):
        super().__init__()
        self.edges = nn.ModuleDict({f"{j}<-{i}": nn.ModuleList([nn.Identity(), _rcb(1, 1e-5)]) for i, j in EDGES_201})

    def forward(self, x, W):
        nodes = [x]
        for j in (1, 2, 3):
            nodes.append(sum(sum(op(nodes[i]) * w for op, w in zip(self.edges[f"{j}<-{i}"], W[e]))
                             for e, (i, jj) in enumerate(EDGES_201) if jj == j))
        return nodes[-1]


@pytest.mark.parametrize("form", ["bare", "pair"])
def test_an_edge_mapped_to_a_container_that_is_never_called_is_one_line_at_attach(form):
    """The ModuleList of an NB-201 edge has no forward: mapped as the mixed op, it gave NaN costs at every step with
    a warning to run the forward (which did run)."""
    cell = NB201SearchCell()
    edges = {k: (m if form == "bare" else (m, list(m))) for k, m in cell.edges.items()}
    with pytest.raises(ProbeError, match="ModuleList, which has no forward") as err:
        nasdiag.attach(cell, edges)
    assert "\n" not in str(err.value)
    assert_no_module_hooks(cell)


# --- precision, batch size 1, eval mode ------------------------------------------------------------------------------
@pytest.mark.parametrize("backward_in_autocast", [False, True])
def test_autocast_bfloat16_costs_come_back_in_float32_accumulated_from_the_half_tensors(backward_in_autocast):
    """The costs of a bfloat16 autocast step are float32 sums of the step's own bfloat16 products: against a float64
    sum of <∂L/∂out, O_k> over the tensors the forward made (kept by the model itself), to float32 rounding.
    (autograd's Z.grad is no reference here: w_k·O_k of a 0-dim float32 w_k and a bfloat16 O_k is bfloat16.)"""
    torch.manual_seed(7)
    net = NB201Net(dtype=torch.float32)
    for cell in net.cells:
        for edge in cell.edges:
            edge.keep = []
    probe = nasdiag.attach(net)
    x, y = _batch(10, dtype=torch.float32)
    Z = _z(seed=10, dtype=torch.float32)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with probe.record():
        with autocast:
            loss = F.cross_entropy(net(x, Z).float(), y)
        with autocast if backward_in_autocast else contextlib.nullcontext():
            loss.backward()
    costs, per_sample = probe.costs(), probe.costs(per_sample=True)
    assert any(o.dtype == torch.bfloat16 for cell in net.cells for e in cell.edges for o in e.keep[0][0])
    for c, cell in enumerate(net.cells):
        for e, edge in enumerate(cell.edges):
            (outs, out), = edge.keep
            ref = torch.stack([(out.grad.double() * o.detach().double()).flatten(1).sum(1) for o in outs], -1)  # (B, K)
            assert costs[_name(c, e)].dtype == per_sample[_name(c, e)].dtype == torch.float32
            assert _max_rel(per_sample[_name(c, e)].double(), ref) < 1e-5
            assert _max_rel(costs[_name(c, e)].double(), ref.sum(0)) < 1e-5
    assert probe.output_costs()["cells.1"][3].dtype == torch.float32


class OrderedMixed(nn.Module):
    """K = 8 convolutions summed in another order than Σ_k w_k·O_k (reversed, or stacked and summed), as mixed ops
    are written; ``relu`` makes it no mixed op at all (the negative control)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self._ops = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1, bias=False) for _ in range(8))
        self.keep = []

    def forward(self, x, w):
        outs = [op(x) for op in self._ops]
        if self.how == "stack":
            out = (w.reshape(-1, 1, 1, 1, 1) * torch.stack(outs)).sum(0)
        else:
            out = sum(w[k] * outs[k] for k in reversed(range(8)))
        out = F.relu(out) if self.how == "relu" else out
        out.retain_grad()
        self.keep.append((outs, out))
        return out


@pytest.mark.parametrize("how", ["reversed", "stack", "relu"])
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_a_mixed_op_summing_in_its_own_order_under_autocast_is_accepted_and_costed(how, half):
    """bfloat16 rounds each of the K partial sums to 2⁻⁸: the weighted-sum check at 1e-3 refused every such step."""
    torch.manual_seed(11)
    edge, fc = OrderedMixed(how), nn.Linear(8, N_CLASSES)
    net = nn.ModuleDict({"edge": edge, "fc": fc})
    probe = nasdiag.attach(net)
    g = torch.Generator().manual_seed(15)
    x, y = torch.randn(4, 8, 6, 6, generator=g), torch.randint(0, N_CLASSES, (4,), generator=g)
    w = torch.softmax(torch.randn(8, generator=g), 0).requires_grad_()
    block = contextlib.ExitStack()
    if how == "relu":
        block.enter_context(pytest.raises(ProbeError, match="not Σ_k w_k·op_k"))
    with block:
        with probe.record():
            with torch.autocast("cpu", dtype=half):
                out = fc(edge(x, w).mean((2, 3)))
            F.cross_entropy(out.float(), y).backward()
    if how == "relu":
        return
    (outs, out), = edge.keep
    assert all(o.dtype == half for o in outs)  # (stacked with a (K, 1, ...) float32 w, the sum is float32)
    ref = torch.stack([(out.grad.double() * o.detach().double()).sum() for o in outs])
    assert _max_rel(probe.costs()["edge"].double(), ref) < 1e-5


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batch_size_one_and_eval_mode_costs_equal_autograd_and_leave_the_buffers_as_without_the_probe(mode):
    torch.manual_seed(8)
    net = NB201Net()
    twin = NB201Net()
    twin.load_state_dict(net.state_dict())
    for m in (net, twin):
        m.train(mode == "train")
    probe = nasdiag.attach(net, path_split=True, norm_deviation=True)
    x, y = _batch(11, b=1)
    Z, Zt = _z(seed=11), _z(seed=11)
    s = [torch.ones((), dtype=DT, requires_grad=True) for _ in range(2)]
    with probe.record():
        F.cross_entropy(net(x, Z, s), y).backward()
    F.cross_entropy(twin(x, Zt), y).backward()
    costs, per_sample, parts, out = probe.costs(), probe.costs(per_sample=True), probe.path_costs(), probe.output_costs()
    for c in range(2):
        for e in range(6):
            assert _max_rel(costs[_name(c, e)], Z[c].grad[e]) < 1e-12
            assert torch.equal(Z[c].grad[e], Zt[c].grad[e])  # the probe changes no value
            assert per_sample[_name(c, e)].shape == (1, K)
            assert _max_rel(sum(parts[_name(c, e)].values()), Z[c].grad[e]) < 1e-12
        assert _max_rel(out[f"cells.{c}"][3], s[c].grad) < OUT_RTOL
    for (k, a), b in zip(net.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), k
    # BatchNorm with running statistics is not a normalization of its input: no conv op is invariant in eval mode
    flags = probe.scale_invariant_ops()[_name(0, 0)].tolist()
    assert flags == [True, False, mode == "train", mode == "train", False]
    assert set(probe.invariance_deviation()[_name(0, 0)]) == ({"0:R7Zero", "2:Sequential", "3:Sequential"}
                                                              if mode == "train" else {"0:R7Zero"})


# --- lifecycle ------------------------------------------------------------------------------------------------------
class Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_a_loss_that_raises_leaves_nothing_and_its_graph_backwarded_later_records_nothing(exc):
    torch.manual_seed(9)
    net = NB201Net()
    probe = nasdiag.attach(net, path_split=True, norm_deviation=True)
    x, y = _batch(12)
    Z = _z(seed=12)

    def loss_fn(logits, y):
        raise exc("in the loss")

    kept = {}
    with pytest.raises(exc):
        with probe.record():
            kept["logits"] = net(x, Z)
            loss_fn(kept["logits"], y)
    assert_no_module_hooks(net)
    # the graph built in the failed block is backwarded after it: no hook fires, nothing is recorded
    F.cross_entropy(kept.pop("logits"), y).backward()
    with pytest.raises(ProbeError, match="no completed recorded step"):
        probe.costs()
    Z = _z(seed=13)
    with probe.record():
        F.cross_entropy(net(x, Z), y).backward()
    for c in range(2):
        for e in range(6):
            assert _max_rel(probe.costs()[_name(c, e)], Z[c].grad[e]) < 1e-12
    assert probe.steps_recorded == 1


class VecCell(NB201Cell):
    """The NB-201 cell on feature vectors (B, C): ops none, skip, Linear-BatchNorm1d (invariant in train mode)."""

    def __init__(self):
        nn.Module.__init__(self)
        self.edges = nn.ModuleList(
            R7Mixed([R7Zero(), nn.Identity(), nn.Sequential(nn.Linear(C, C, bias=False, dtype=DT), nn.BatchNorm1d(C, dtype=DT))])
            for _ in EDGES_201)
        self.output_node_slices = {3: (0, C)}
        self.ckpt = None


def test_1000_steps_keep_no_tensor_and_no_python_memory():
    torch.manual_seed(10)
    net = nn.ModuleDict({"cell": VecCell(), "fc": nn.Linear(C, N_CLASSES, dtype=DT)})
    probe = nasdiag.attach(net, path_split=True, norm_deviation=True)
    g = torch.Generator().manual_seed(14)
    x, y = torch.randn(2, C, generator=g, dtype=DT), torch.randint(0, N_CLASSES, (2,), generator=g)
    Z = torch.softmax(torch.randn(6, 3, generator=g, dtype=DT), -1).requires_grad_()

    def step():
        Z.grad = None
        with probe.record():
            F.cross_entropy(net["fc"](net["cell"](x, Z)), y).backward()

    for _ in range(20):
        step()
    tensors = live_tensors()
    for _ in range(700):
        step()
    tracemalloc.start()
    try:
        for _ in range(30):
            step()
        grown = []
        for _ in range(2):  # two windows: a leak grows in both, torch's wobble of a few kB need not
            gc.collect()
            first, _ = tracemalloc.get_traced_memory()
            for _ in range(125):
                step()
            gc.collect()
            grown.append(tracemalloc.get_traced_memory()[0] - first)
    finally:
        tracemalloc.stop()
    assert live_tensors() <= tensors
    # torch's own backward hooks wobble by a few kB (measured ±3 kB per 400 steps); a kept per-step object of the
    # probe (its step result, a capture, a hook) would be ≥ 100 B a step, ≥ 12 kB in each window
    assert min(grown) < 8 * 1024, grown
    assert probe.steps_recorded == 1000
    assert probe.statistics()["cost/nb201/count"].tolist() == [[1000] * 3] * 6
    assert _max_rel(probe.costs()["cell.edges.0"], Z.grad[0]) < 1e-12
