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
* The same 0·NaN in ``darts_alpha_grad``: a supernet with pruned ops (α_j = −inf, p_j = 0, not run) got NaN for every
  α of the edge from the probe's costs, where autograd gives finite numbers
  (test_darts_credit_of_a_probe_on_a_supernet_with_pruned_ops_is_autograds).
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

Checked and right (test_costs_and_per_sample_rows_under_execution_conditions_are_autograds, against ∂L/∂Z of leaf Z
and ∂L/∂Z_bk of per-sample leaves): an in-place ReLU as the first op of a candidate (on a stem output, and on the
previous edge's hooked output that is read again after it), candidates returning views of their input (a slice, a
double transpose), dropout inside candidates (the captured output carries the step's mask), channels_last and
transposed (non-contiguous) inputs, eval mode, a loss summing two forwards of the model (costs add, rows concatenated),
micro-batches accumulated, a mixed op called twice in one forward (tied Z), a candidate module shared by two edges and
by two candidates. By hand: per-sample (B, K) Gumbel weights (exactly ∂L/∂Z_bk); CostMoments over random masked
batches with NaN steps and merges of split halves (Chan) and ``vocabulary.pooled_moments`` against numpy (1e-15);
torch.func.grad / vjp / functional_call, ``save_on_cpu``, ``backward(inputs=...)``, forward-over-reverse HVP,
forward-mode dual numbers with a backward, a user's full backward hooks and output-replacing forward hooks (also with
``path_split``), ``torch.compile(backend="eager")``: costs as autograd; autocast bfloat16/float16 with channels_last
convolutions and BatchNorm: float32 costs within the half-precision rounding of autograd's own ∂L/∂Z.

Noticed and left: path_split refuses a node rewritten by a downstream candidate's in-place ReLU with the generic "not
the plain sum of its incoming edges" line (right refusal, names no in-place op); a mixed op run under
``torch.func.jvp`` alone (no backward) gets the "did not require grad" warning, NaN flagged.
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


class _View(nn.Module):
    def forward(self, x):
        return x[:, :, :, :]


class _Transposed(nn.Module):
    def forward(self, x):
        return x.transpose(2, 3).transpose(2, 3)


class _Mixed(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self._ops = nn.ModuleList(ops)

    def forward(self, x, weights):
        if weights.dim() == 1:
            return sum(w * op(x) for w, op in zip(weights, self._ops))
        return sum(weights[:, k, None, None, None] * op(x) for k, op in enumerate(self._ops))


def _conv(k=1, bias=True):
    return nn.Conv2d(C, C, k, padding=k // 2, bias=bias)


class _ConvNet(nn.Module):
    """stem -> edge a -> edge b (+ the output of a, read after b's candidates ran) -> GAP -> linear; ``tied`` runs b
    twice; ``shared`` puts one conv module in both edges and in two candidates of b."""

    def __init__(self, a_ops, tied=False, shared=False):
        super().__init__()
        self.stem = nn.Conv2d(1, C, 3, padding=1)
        self.a = _Mixed(a_ops)
        one = a_ops[-1] if shared else _conv()
        b_first = nn.Sequential(nn.ReLU(inplace=True), _conv(3, False)) if not shared else nn.Sequential(nn.ReLU(), one)
        self.b = _Mixed([b_first, one, nn.Sequential(_conv(), nn.BatchNorm2d(C))])
        self.head, self.tied = nn.Linear(C, 4), tied

    def forward(self, x, Z):
        h1 = self.a(self.stem(x), Z[:, 0] if Z.dim() == 3 else Z[0])
        zb = Z[:, 1] if Z.dim() == 3 else Z[1]
        h2 = self.b(h1, zb)
        if self.tied:
            h2 = self.b(h2, zb)
        return self.head((h2 + h1).mean((2, 3)))


_CONDITIONS = {
    "inplace-relu-first": (lambda: [nn.Sequential(nn.ReLU(inplace=True), _conv(3, False)), nn.Identity(), _conv()], {}),
    "views": (lambda: [_View(), _Transposed(), _conv()], {}),
    "dropout": (lambda: [nn.Sequential(_conv(), nn.Dropout(0.5)), nn.Dropout2d(0.3), _conv()], {}),
    "channels_last": (lambda: [_conv(3, False), nn.Identity(), nn.Sequential(nn.ReLU(), _conv())], {"layout": "cl"}),
    "transposed-input": (lambda: [_conv(3, False), _Transposed(), nn.Sequential(nn.ReLU(), _conv())], {"layout": "t"}),
    "eval": (lambda: [nn.Sequential(_conv(), nn.Dropout(0.5)), nn.Identity(), _conv()], {"eval": True}),
    "tied-and-shared": (lambda: [_conv(3, False), nn.Identity(), _conv()], {"tied": True, "shared": True}),
}


@pytest.mark.parametrize("condition", list(_CONDITIONS))
def test_costs_and_per_sample_rows_under_execution_conditions_are_autograds(condition):
    a_ops, how = _CONDITIONS[condition]
    torch.manual_seed(3)
    net = _ConvNet(a_ops(), tied=how.get("tied", False), shared=how.get("shared", False)).to(DT)
    net.train(not how.get("eval", False))
    x1, x2 = torch.randn(4, 1, 5, 5, dtype=DT), torch.randn(3, 1, 5, 5, dtype=DT)
    if how.get("layout") == "cl":
        net = net.to(memory_format=torch.channels_last)
        x1, x2 = (t.contiguous(memory_format=torch.channels_last) for t in (x1, x2))
    elif how.get("layout") == "t":
        x1, x2 = (t.transpose(2, 3) for t in (x1, x2))
    y1, y2 = torch.randint(0, 4, (4,)), torch.randint(0, 4, (3,))
    Z = torch.softmax(torch.randn(2, 3, dtype=DT), -1)
    state = {k: v.clone() for k, v in net.state_dict().items()}

    def loss(z1, z2):  # two forwards of the model in one loss, each drawing its dropout masks from seed 11, 12
        torch.manual_seed(11)
        first = F.cross_entropy(net(x1, z1), y1)
        torch.manual_seed(12)
        return first + F.cross_entropy(net(x2, z2), y2)

    # reference: per-sample leaves Z_b (one per sample of each forward); their sum over b is ∂L/∂Z
    leaves = [Z.expand(n, 2, 3).clone().requires_grad_() for n in (4, 3)]
    ref_rows = torch.cat(torch.autograd.grad(loss(*leaves), leaves))  # (7, 2, 3)
    net.load_state_dict(state)
    probe = nasdiag.attach(net)
    with probe.record():
        Zl = Z.clone().requires_grad_()
        loss(Zl, Zl).backward()
    costs, rows = probe.costs(), probe.costs(per_sample=True)
    torch.testing.assert_close(Zl.grad, ref_rows.sum(0), rtol=1e-10, atol=1e-13)  # the (K,) and (B, K) Z agree
    torch.testing.assert_close(torch.stack([costs["a"], costs["b"]]), Zl.grad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(torch.stack([rows["a"], rows["b"]], 1), ref_rows, rtol=1e-10, atol=1e-13)


def test_darts_credit_of_a_probe_on_a_supernet_with_pruned_ops_is_autograds():
    from nasdiag.cost import darts_alpha_grad

    torch.manual_seed(4)
    net = _Chain(_ActiveMixed).to(DT)
    net.a.active, net.b.active = (0, 2, 3), (1, 3)  # the others pruned: α = −inf, p = 0, not run
    x, y = torch.randn(6, C, dtype=DT), torch.randint(0, 4, (6,))
    alpha = torch.randn(2, 4, dtype=DT)
    alpha[0, 1] = alpha[1, 0] = alpha[1, 2] = -float("inf")
    alpha.requires_grad_()
    probe = nasdiag.attach(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pruned ops did not run: NaN, with a warning
        with probe.record():
            F.cross_entropy(net(x, torch.softmax(alpha, -1)), y).backward()
        costs = probe.costs()
    p = torch.softmax(alpha.detach(), -1)
    assert torch.isfinite(alpha.grad).all()
    for e, name in enumerate(("a", "b")):
        assert torch.isnan(costs[name][p[e] == 0]).all()
        torch.testing.assert_close(darts_alpha_grad(costs[name], p[e]), alpha.grad[e], rtol=1e-12, atol=1e-15)  # was NaN
