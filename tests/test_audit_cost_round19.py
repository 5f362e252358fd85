"""Cost audit round 19 (cost19): the per-edge cost C(Z) = ∂L/∂Z = <∂L/∂x_j, O(x_i)> (wiring supplement §2.1) under
execution conditions earlier rounds did not try, against float64 models written from scratch here (leaf mixing
weights Z, per-sample leaf weights Z_b, plain autograd for ∂L/∂Z; numpy for the streaming moments). Never nasdiag
against nasdiag.

Defects found (each test fails without its fix):

* ``dsnas_alpha_grad(C, onehot, p)`` promises that "only the sampled entry is used", but computed (Z·C) as a product
  over all K entries, so the NaN a probe reports for every op that did not run (DSNAS runs only the sampled op, the
  point of the method) made the whole credit NaN: the documented use, the probe's costs of a DSNAS supernet, gave
  NaN for every α (test_dsnas_credit_of_a_probe_on_a_supernet_running_only_the_sampled_op_is_autograds).
* ``proxyless_alpha_grad(C, p')`` of ProxylessNAS's two-path update (p' = softmax of α over the sampled pair S, zero
  outside it; nasdiag's own method and docstring: ``proxyless_alpha_grad(C·1_S, p')``) was NaN in every entry when C
  came from a probe, whose costs of the ops that did not run (all but S) are NaN: 0·NaN in <p', C>, where p'_j = 0
  means op j takes no part (test_proxyless_two_path_credit_of_a_probes_costs_is_the_binaryconnect_gradient).
* ``torch.autograd.grad(..., is_grads_batched=True)`` inside a block (a Jacobian, one vector-Jacobian product per row
  of ``grad_outputs``, run by torch's legacy vmap) handed the probe's backward hooks batched gradients: the costs held
  tensors leaked out of the transform and the block ended in torch's "Batching rule not implemented for aten::detach"
  traceback (``torch.func.jacrev`` of the model: torch's "maybe_level.has_value() INTERNAL ASSERT FAILED" in its
  backward). Now one ProbeError line at that backward, hooks removed, the next step exact
  (test_a_batched_backward_inside_the_block_is_one_probe_error_line_and_the_next_step_is_exact).
* A mixed op that weights its candidates' outputs in place (``sum(op(x).mul_(w) ...)``: exactly Σ_k w_k·O_k, autograd's
  ∂L/∂Z is fine), or a candidate whose in-place first op (``ReLU(inplace=True)``) rewrites an earlier candidate's
  output (an Identity's x_i), was refused at its first step as "its output is not Σ_k w_k·op_k(x) ... map the edge to a
  module whose output is that sum" (or "not in the span of its candidates' outputs" without the weights): the wrong
  reason and advice for the very mixed op it is; the docs promise the in-place error ("a candidate output modified in
  place after its forward raises"), given at later steps. Now that line, naming the op
  (test_a_candidate_output_changed_in_place_inside_the_mixed_op_is_named_as_such_at_the_first_step).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.cost import dsnas_alpha_grad, proxyless_alpha_grad
from nasdiag.probe.discovery import ProbeError

DT = torch.float64
C = 3


class _SampledMixed(nn.Module):
    """A DARTS-convention mixed op that, as DSNAS does, runs only the ops whose weight is non-zero."""

    def __init__(self):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(C, C, bias=False), nn.Tanh(), nn.Identity(), nn.Linear(C, C)])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops) if float(w) != 0.0)


class _Chain(nn.Module):
    def __init__(self, mixed=_SampledMixed):
        super().__init__()
        self.a, self.b = mixed(), mixed()
        self.head = nn.Linear(C, 4)

    def forward(self, x, Z):
        return self.head(self.b(self.a(x, Z[0]), Z[1]))


def test_dsnas_credit_of_a_probe_on_a_supernet_running_only_the_sampled_op_is_autograds():
    torch.manual_seed(0)
    net = _Chain().to(DT)
    x, y = torch.randn(5, C, dtype=DT), torch.randint(0, 4, (5,))
    alpha = torch.randn(2, 4, dtype=DT, requires_grad=True)
    onehot = F.one_hot(torch.tensor([1, 3]), 4).to(DT)
    # DSNAS's Z: value one-hot, gradient ∇_α log p_s (so autograd's α.grad is C(Z^s)·∇ log p_s, the reference)
    lp = torch.log_softmax(alpha, -1)
    lp_s = (lp * onehot).sum(-1, keepdim=True)
    Z = onehot * torch.exp(lp_s - lp_s.detach())
    probe = nasdiag.attach(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ops that did not run are NaN, with a warning saying so
        with probe.record():
            F.cross_entropy(net(x, Z), y).backward()
        costs = probe.costs()
    p = torch.softmax(alpha.detach(), -1)
    for e, name in enumerate(("a", "b")):
        assert torch.isnan(costs[name][onehot[e] == 0]).all()  # the unsampled ops: NaN, not observed
        got = dsnas_alpha_grad(costs[name], onehot[e], p[e])  # was NaN in every entry
        torch.testing.assert_close(got, alpha.grad[e], rtol=1e-12, atol=1e-14)
    # a NaN cost of the sampled op itself is still NaN, never dropped
    nan_sampled = costs["a"].clone()
    nan_sampled[1] = float("nan")
    assert torch.isnan(dsnas_alpha_grad(nan_sampled, onehot[0], p[0])).all()


class _InPlaceWeighted(nn.Module):
    """Σ_k w_k·O_k(x) with the weights applied in place on each candidate output (with ``inner``: weights of its own)."""

    def __init__(self, inner: bool):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(C, C, bias=False), nn.Linear(C, C), nn.Linear(C, C)])  # keep no output
        self.inner = nn.Parameter(torch.tensor([0.5, 0.3, 0.2])) if inner else None

    def forward(self, x, weights):
        w = self.inner if self.inner is not None else weights
        return sum(op(x).mul_(wk) for wk, op in zip(w, self._ops))


class _ReluInPlaceAfterIdentity(nn.Module):
    def __init__(self):
        super().__init__()
        self._ops = nn.ModuleList([nn.Identity(), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(C, C)), nn.Tanh()])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


@pytest.mark.parametrize("mixed", [lambda: _InPlaceWeighted(False), lambda: _InPlaceWeighted(True),
                                   _ReluInPlaceAfterIdentity], ids=["mul_-weights", "mul_-inner-weights", "relu_"])
def test_a_candidate_output_changed_in_place_inside_the_mixed_op_is_named_as_such_at_the_first_step(mixed):
    torch.manual_seed(0)
    net = _Chain(mixed).to(DT)
    x, y = torch.randn(4, C, dtype=DT), torch.randint(0, 4, (4,))
    Z = torch.softmax(torch.randn(2, 3, dtype=DT), -1).requires_grad_()
    if not isinstance(net.a, _ReluInPlaceAfterIdentity):  # a valid mixed op for autograd: ∂L/∂Z exists
        F.cross_entropy(net(x, Z), y).backward()
        assert all(torch.isfinite(t.grad).all() for t in [Z, *net.parameters()] if t.grad is not None)
    probe = nasdiag.attach(net)
    with pytest.raises(ProbeError) as err:
        with probe.record():
            F.cross_entropy(net(x, Z), y).backward()
    msg = str(err.value)
    assert "\n" not in msg and "candidate op 0" in msg and "modified in place" in msg, msg
    assert "not Σ" not in msg and "span" not in msg, msg  # was: not a weighted sum, map another module


class _ActiveMixed(nn.Module):
    """A mixed op computing only the ops of ``active`` (ProxylessNAS: the sampled pair S, the gated-off one times 0)."""

    def __init__(self):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(C, C, bias=False), nn.Tanh(), nn.Identity(), nn.Linear(C, C)])
        self.active = (0, 1, 2, 3)

    def forward(self, x, weights):
        return sum(weights[k] * self._ops[k](x) for k in self.active)


def test_proxyless_two_path_credit_of_a_probes_costs_is_the_binaryconnect_gradient():
    torch.manual_seed(1)
    net = _Chain(_ActiveMixed).to(DT)
    x, y = torch.randn(6, C, dtype=DT), torch.randint(0, 4, (6,))
    alpha = torch.randn(2, 4, dtype=DT)
    pairs, on = [(0, 3), (1, 2)], [3, 1]  # per edge the sampled pair S and the path gated on
    net.a.active, net.b.active = pairs
    gates = torch.zeros(2, 4, dtype=DT)
    gates[0, on[0]] = gates[1, on[1]] = 1.0
    # reference: C_j = ∂L/∂g_j of leaf gates (j ∈ S), then ProxylessNAS's eq. 4 restricted to S, written out
    g_leaf = gates.clone().requires_grad_()
    cost_ref = torch.autograd.grad(F.cross_entropy(net(x, g_leaf), y), g_leaf)[0]
    probe = nasdiag.attach(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ops outside S did not run: NaN, with a warning
        with probe.record():
            F.cross_entropy(net(x, gates.clone().requires_grad_()), y).backward()
        costs = probe.costs()
    for e, name in enumerate(("a", "b")):
        S = list(pairs[e])
        p_pair = torch.zeros(4, dtype=DT)
        p_pair[S] = torch.softmax(alpha[e, S], -1)
        want = torch.zeros(4, dtype=DT)
        for i in S:
            want[i] = sum(cost_ref[e, j] * p_pair[j] * (float(i == j) - p_pair[i]) for j in S)
        assert torch.isnan(costs[name][[k for k in range(4) if k not in S]]).all()
        mask = torch.zeros(4, dtype=DT)
        mask[S] = 1.0
        for c in (costs[name], costs[name] * mask):  # as given, and as C·1_S (the method's docstring)
            torch.testing.assert_close(proxyless_alpha_grad(c, p_pair), want, rtol=1e-12, atol=1e-15)  # was NaN


class _Cell(nn.Module):
    """A declared cell (nodes 0 -> 1, 0 -> 2, 1 -> 2; output the concatenation of nodes 1 and 2): output costs and the
    path split have hooks of their own in the backward."""

    edge_nodes = [(0, 1), (0, 2), (1, 2)]
    output_nodes = [1, 2]
    output_node_slices = {1: (0, C), 2: (C, 2 * C)}

    def __init__(self):
        super().__init__()
        self.edges = nn.ModuleList([_ActiveMixed() for _ in range(3)])

    def forward(self, x, Z):
        x1 = self.edges[0](x, Z[0])
        return torch.cat([x1, self.edges[1](x, Z[1]) + self.edges[2](x1, Z[2])], 1)


class _CellNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell, self.head = _Cell(), nn.Linear(2 * C, 2)

    def forward(self, x, Z):
        return self.head(self.cell(x, Z))


@pytest.mark.parametrize("options", [{}, {"path_split": True}])
def test_a_batched_backward_inside_the_block_is_one_probe_error_line_and_the_next_step_is_exact(options):
    torch.manual_seed(2)
    net = _CellNet().to(DT)
    x, y = torch.randn(5, C, dtype=DT), torch.randint(0, 2, (5,))
    Z = torch.softmax(torch.randn(3, 4, dtype=DT), -1)
    probe = nasdiag.attach(net, **options)
    rows = torch.eye(2, dtype=DT)[:, None, :].expand(2, 5, 2).contiguous()  # ∂(logit c)/∂Z for c = 0, 1
    with pytest.raises(ProbeError, match="is_grads_batched") as err:
        with probe.record():
            Zl = Z.clone().requires_grad_()
            torch.autograd.grad(net(x, Zl), Zl, grad_outputs=rows, is_grads_batched=True)
    assert "\n" not in str(err.value)
    with pytest.raises(ProbeError, match="jacrev"):
        with probe.record():
            torch.func.jacrev(lambda z: net(x, z))(Z)
    modules = list(net.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in modules)
    # the next, plain step: autograd's ∂L/∂Z
    with probe.record():
        Zl = Z.clone().requires_grad_()
        F.cross_entropy(net(x, Zl), y).backward()
    got = probe.costs()
    torch.testing.assert_close(torch.stack([got[f"cell.edges.{e}"] for e in range(3)]), Zl.grad, rtol=1e-12, atol=1e-15)
