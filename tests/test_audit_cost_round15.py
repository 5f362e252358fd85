"""Round-15 audit of nasdiag.cost's pure-tensor functions and the probe's skipped-edge rows.

References are written here from the wiring supplement (§2.1: C_k = <∂L/∂x_j, O_k(x_i)>; §5-6: output edges;
eq. 12 re-derived: <∂L/∂Y, Y> = L − H for the batch-mean cross-entropy), checked with torch.autograd in float64.

Checked and right (no test added, a sketch in the report): the README's cost snippet run literally on
``Network(C=8, layers=3)`` against autograd ∂L/∂Z of a float64 copy with per-cell Z leaves (costs, per-sample sums,
output costs per node chunk); edge_costs (sum / per-sample) and output_edge_costs against plain dot products;
loss_minus_entropy against autograd <∂L/∂Y, Y>; a supernet with α (E, K) whose forward skips an edge: NaN row in
costs() and cell_type_costs(), a warning, and the skipped steps left out of statistics' count; Network with
`active` masks (ops not run NaN, not counted); per-sample Z (E, B, K) leaves with a summed loss (exactly ∂L/∂Z_bk);
path_costs() on Network against autograd VJPs through each downstream mixed op and the output slice (90 parts,
1e-6 relative in float32); Thm 2 on Network with a zeroed classifier bias (L − H to 1e-15); darts/proxyless/snas/
dsnas_alpha_grad and softmax_jacobian against autograd; CostMoments with masks and merge against numpy; the
docs/probe.md Recorder snippet run literally, statistics' mean/var per epoch against autograd costs per cell.
(docs/cost.md named in the round-15 brief does not exist; the cost contract is docs/probe.md.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nasdiag.cost import CostError, edge_costs, loss_minus_entropy, output_edge_costs, scatter_cells


def _edge_ref(g, outs):
    return torch.stack([(g * o).sum() for o in outs])


def test_edge_and_output_costs_of_an_empty_batch_are_zero_costs_not_a_reshape_error():
    # B = 0 (e.g. the last, empty micro-batch of a split): Σ over no samples is 0, and (0, K) per-sample terms
    g, outs = torch.zeros(0, 3, 2, dtype=torch.float64), [torch.zeros(0, 3, 2, dtype=torch.float64)] * 4
    assert torch.equal(edge_costs(g, outs), torch.zeros(4, dtype=torch.float64))
    assert edge_costs(g, outs, per_sample=True).shape == (0, 4)
    assert torch.equal(output_edge_costs(g, g, {2: (0, 1), 3: (1, 3)}), torch.zeros(2, dtype=torch.float64))
    # and a non-empty batch still matches the plain dot products (the reshape now names N explicitly)
    torch.manual_seed(0)
    g = torch.randn(3, 2, 5, dtype=torch.float64)
    outs = [torch.randn(3, 2, 5, dtype=torch.float64) for _ in range(3)]
    torch.testing.assert_close(edge_costs(g, outs), _edge_ref(g, outs), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(edge_costs(g[0, 0], [o[0, 0] for o in outs]), _edge_ref(g[0, 0], [o[0, 0] for o in outs]))


@pytest.mark.parametrize("bounds", [(0, 3, 1), (0.0, 3.0), 3, "03"])
def test_output_edge_costs_of_a_malformed_channel_range_is_one_cost_error_line(bounds):
    out = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(CostError, match=r"give each node a \(start, stop\) pair of ints") as info:
        output_edge_costs(out, out, {2: bounds})
    assert "\n" not in str(info.value)


def test_output_edge_costs_takes_index_like_bounds():
    import numpy as np
    out, g = torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
    got = output_edge_costs(g, out, {2: (np.int64(0), np.int64(2)), 3: [2, torch.tensor(6)]})
    torch.testing.assert_close(got, torch.stack([(g[:, :2] * out[:, :2]).sum(), (g[:, 2:] * out[:, 2:]).sum()]))


@pytest.mark.parametrize("case, match", [
    ("duplicate", "same \\(cell_slot, edge_index\\)"),
    ("negative", "cell_slot must lie in \\[0, 2\\)"),
    ("out_of_range", "edge_index must lie in \\[0, 2\\)"),
    ("one_dim", "must be \\(N, K\\)"),
    ("length", "cell_slot must be 3 integer indices"),
    ("float_index", "edge_index must be 3 integer indices"),
])
def test_scatter_cells_refuses_a_bad_layout_in_one_line_instead_of_overwriting_or_wrapping(case, match):
    # A duplicate (cell, edge) slot overwrote one edge's cost with another's and a negative slot wrapped round to
    # the last cell: both silent wrong (n_cells, E, K) layouts; the shape errors were IndexError / ValueError tracebacks.
    costs, slot, eidx = torch.randn(3, 2, dtype=torch.float64), torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0])
    if case == "duplicate":
        slot = torch.tensor([0, 0, 0]); eidx = torch.tensor([0, 1, 0])
    elif case == "negative":
        slot = torch.tensor([0, 0, -1])
    elif case == "out_of_range":
        eidx = torch.tensor([0, 2, 0])
    elif case == "one_dim":
        costs = costs[:, 0]
    elif case == "length":
        slot = slot[:2]
    elif case == "float_index":
        eidx = eidx.double()
    with pytest.raises(CostError, match=match) as info:
        scatter_cells(costs, slot, eidx, 2, 2)
    assert "\n" not in str(info.value)


def test_scatter_cells_lays_out_costs_with_nan_where_a_cell_lacks_the_edge():
    costs = torch.randn(3, 2, dtype=torch.float64)
    out = scatter_cells(costs, torch.tensor([1, 0, 1]), torch.tensor([0, 1, 1]), 2, 2)
    ref = torch.full((2, 2, 2), float("nan"), dtype=torch.float64)
    ref[1, 0], ref[0, 1], ref[1, 1] = costs[0], costs[1], costs[2]
    torch.testing.assert_close(out, ref, equal_nan=True)


def test_loss_minus_entropy_is_the_autograd_output_cost_of_mean_cross_entropy():
    torch.manual_seed(1)
    Y = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 5, (6,))
    (gY,) = torch.autograd.grad(F.cross_entropy(Y, t), Y)
    torch.testing.assert_close(loss_minus_entropy(Y.detach(), t), (gY * Y.detach()).sum(), rtol=1e-12, atol=1e-14)


class _Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._ops = torch.nn.ModuleList([torch.nn.Linear(4, 4, bias=False), torch.nn.Identity(), torch.nn.Tanh()])

    def forward(self, x, w):
        return sum(wk * op(x) for wk, op in zip(w, self._ops))


class _ChainWithSkips(torch.nn.Module):
    """α (E, K) = (3, 3), a chain of mixed ops whose forward skips the edges in ``skip`` (rows of α unused)."""

    def __init__(self):
        super().__init__()
        self.edges = torch.nn.ModuleList([_Mixed() for _ in range(3)])
        self.alpha = torch.nn.Parameter(torch.randn(3, 3))
        self.head = torch.nn.Linear(4, 2)
        self.skip = set()

    def forward(self, x, Z=None):
        Z = torch.softmax(self.alpha, -1) if Z is None else Z
        for e, m in enumerate(self.edges):
            if e not in self.skip:
                x = m(x, Z[e])
        return self.head(x)


def test_an_edge_skipped_this_step_is_nan_in_b_rows_of_per_sample_costs_and_not_counted():
    import nasdiag
    torch.manual_seed(2)
    net = _ChainWithSkips().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    probe = nasdiag.attach(net)
    for skip in (set(), {1}):
        net.skip = skip
        with pytest.warns(RuntimeWarning, match="never ran") if skip else _no_warning():
            with probe.record():
                F.cross_entropy(net(x), y).backward()
        Z = torch.softmax(net.alpha, -1).detach().requires_grad_()
        (gZ,) = torch.autograd.grad(F.cross_entropy(net(x, Z), y), Z)
        costs, per = probe.costs(), probe.costs(per_sample=True)
        for e in range(3):
            if e in skip:  # autograd says 0 (the row is unused): the probe must say NaN, never 0
                assert torch.isnan(costs[f"edges.{e}"]).all()
                # (B, K) as documented, so that row b is sample b at every edge (it was a (1, K) row)
                assert per[f"edges.{e}"].shape == (5, 3) and torch.isnan(per[f"edges.{e}"]).all()
            else:
                torch.testing.assert_close(costs[f"edges.{e}"], gZ[e], rtol=1e-10, atol=1e-14)
                torch.testing.assert_close(per[f"edges.{e}"].sum(0), gZ[e], rtol=1e-10, atol=1e-14)
    assert probe.statistics()["cost/edges/count"][:, 0].tolist() == [2, 1, 2]


def _no_warning():
    import contextlib
    import warnings
    cm = contextlib.ExitStack()
    cm.enter_context(warnings.catch_warnings())
    warnings.simplefilter("error", RuntimeWarning)
    return cm


@pytest.mark.parametrize("call, named", [
    (lambda: loss_minus_entropy(torch.zeros(2, 3), [0, 1]), "loss_minus_entropy: targets must be a torch.Tensor"),
    (lambda: loss_minus_entropy([[0.0, 1.0]], torch.tensor([0])), "loss_minus_entropy: logits must be a torch.Tensor"),
    (lambda: edge_costs(torch.zeros(2, 3), [torch.zeros(2, 3), 1.0]), r"edge_costs: candidate_outputs\[1\] must be"),
    (lambda: output_edge_costs([[0.0]], torch.zeros(1, 1), {0: (0, 1)}), "output_edge_costs: grad_cell_output must be"),
])
def test_a_list_or_float_where_a_tensor_is_expected_is_one_cost_error_line_not_an_attribute_error(call, named):
    with pytest.raises(CostError, match=named) as info:
        call()
    assert "\n" not in str(info.value)
