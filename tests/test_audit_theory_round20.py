"""Audit round 20 of the wiring paper's theorems (supplement §2, §4 Thm. 1, §5 Cor. 1.2, §6 Thm. 2, §8.1-8.2) and
the probe's scale-invariance bookkeeping, against a float64 supernet written here from scratch (the minimal cell of
Fig. 7 with the node protocol: input nodes 0, 1, intermediate nodes 2, 3, edges (0,2) (1,2) (0,3) (1,3) (2,3), the
output the concatenation of nodes 2 and 3; ReLU-conv-norm preprocessing; global average pooling and a bias-free
classifier) whose ∂L/∂Z (leaf Z), output-edge costs (a scalar multiplier on each node's slice of the cell output)
and path parts (a copy of Z per consumer of node 2) come from plain autograd. Never nasdiag against nasdiag.

Defects found (each test fails without its fix):

* ``attach(..., norm_deviation=True)`` measured eps/(var + eps) of the module that makes an op invariant whenever it
  had an ``eps`` and was not the op itself, so an op ``Sequential(conv, RMSNorm)`` with the user's own degree-0 rule
  (registered as the docs say) stopped the user's forward inside a pre-hook with eps_deviation's
  UnsupportedModuleError, where the same norm as a bare op was NaN; and an op ending in a constant module
  (``Sequential(conv, Zero())``, J = 0 exactly) was NaN where a bare ``Zero`` is 0.0. Only torch's normalizations
  are measured; a constant module is 0.0 wherever it sits
  (test_invariance_deviation_of_a_users_degree_0_module_inside_an_op_is_nan_and_a_constant_one_is_0).
* docs/probe.md stated the cost an invariant relu→conv→conv→BN op passes back at the real eps as
  Σ_c eps/(var_c + eps)·<∂L/∂x_m[:, c], f(x_j)[:, c]>, right only for an affine-free norm: with an affine BatchNorm
  it is f(x_j) − β (here the β-less form is off by more than 10 %; the probe's path part is the right one). The doc
  line's fix landed in probe20's commit e022947 (a shared working tree)
  (test_the_cost_passed_through_an_affine_normalized_op_at_the_real_eps_is_the_one_docs_probe_states).

* ``snas_alpha_grad(C, Z, λ)`` given a λ that is no number (None, a string, a per-edge tensor) raised TypeError /
  RuntimeError tracebacks; one CostError line (test_snas_credit_given_a_temperature_that_is_no_number_is_one_cost_error_line).

* ``CostMoments`` given observations or a mask as a list, a shape that is no tuple of non-negative ints, or another
  object to merge raised AttributeError / TypeError / RuntimeError tracebacks; one CostError line each (numpy's
  integers are dims) (test_cost_moments_given_no_tensor_or_a_bad_shape_is_one_cost_error_line_and_numbers_are_numpys).

* ``eps_deviation(norm, x)`` returned eps/(var + eps) of whatever groups x had where torch's forward of the norm
  refuses x (other channel counts with an affine map or running buffers, another rank, other trailing dims for
  LayerNorm): a number of no normalization; one CostError line, checked as torch checks it
  (test_eps_deviation_of_an_input_its_norm_cannot_take_is_one_cost_error_line).

* ``probe.scale_invariant_ops()`` has no input ranks, so an MLP supernet's op Linear(bias) → BatchNorm1d (f(c·x) =
  f(x) on its 2-D input) is flagged False, a missed invariance, and not measured by ``invariance_deviation()``, where
  docs/probe.md promised the flag "from module structure"; the docs and the docstring now say which answer it gives
  and that ``is_scale_invariant(op, x_i)`` decides it (giving the probe the ranks needs a forward of every op
  before the first step's hooks, in files under another auditor's edit this round)
  (test_a_linear_bias_batchnorm1d_op_of_an_mlp_supernet_is_flagged_with_its_input_or_said_to_be_missed).

Checked and right (test_own_minimal_cell_costs_paths_and_theorems_for_each_methods_weights): with DARTS's softmax,
SNAS's Gumbel-softmax and DSNAS's / ProxylessNAS's straight-through one-hot weights (only the sampled op run), in the
orders ReLU-conv-BN, conv-BN-ReLU, conv-ReLU-BN and BN-ReLU-conv, BatchNorm and GroupNorm(1, C): the probe's costs,
per-sample rows, path parts and output-edge costs equal autograd's (1e-9); Thm. 1 holds exactly where the intermediate
edge's active ops are invariant and fails where skip is active (eq. 11); Cor. 1.2 in both forms; Thm. 2 with H the
batch-mean entropy; the flags of none, skip, pool → norm and the conv op. Where a theorem must not hold
(test_in_eval_mode_thm1_and_cor12_hold_only_for_per_sample_statistics_and_the_flags_say_so): eval-mode BatchNorm
with running statistics breaks Thm. 1 and Cor. 1.2 and its ops are not flagged; GroupNorm keeps both and its flags.
By hand: ``darts_alpha_grad`` / ``snas_alpha_grad`` of ``cell_type_costs()`` with α shared by the 3 cells equal
autograd's ∂L/∂α (3e-17); ``statistics()`` (all / sampled, DSNAS steps) equal numpy's masked mean, population
variance and counts; ``is_scale_invariant`` against f(c·x) = f(x) (eps = 1e-14, c = 0.3, 3.7) on 3000 random
compositions of convs (padding modes, groups, strides, transposed with output_padding), Linear on rank 2/3,
Batch/Instance/Group/LayerNorm (affine, tracking, train/eval), ReLU/LeakyReLU/PReLU/ELU, pools (ceil_mode,
count_include_pad), dropout, pads, Flatten and nested Sequentials: no flag claims an invariance f(c·x) = f(x)
denies, and the only invariances it misses are ELU followed by ReLU (relu∘elu = relu) and a negative PReLU slope
before ELU (elu of a non-negative input is the identity). By hand also: path parts of a 3-node cell whose node 2 feeds
two edges and the output, and invariance_deviation() of every op in three orders and norms, equal autograd's and own
eps/(var + eps) exactly.

Noticed and left: is_scale_invariant(f, x) with an example f cannot run raises torch's own one-line error (state
restored); nn.RMSNorm (invariant as eps → 0, removes no bias) has no homogeneity rule: UnsupportedModuleError, not a
wrong flag; the paper's Cor. 1.2 is the Z-weighted sum of a non-last cell's edge costs, docs/probe.md states the
output-edge form: both hold, the paper's only where the intermediate edge is invariant (tested above).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.cost import HOMOGENEITY_RULES, degree_rule, register_homogeneity_rule

DT = torch.float64


class _RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) over the last dim: f(c·x) = f(x) as eps → 0, a user's own normalization."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()


class _Zero(nn.Module):
    """The ``none`` op, a constant 0 of the input's shape."""

    forward = staticmethod(lambda x: x.mul(0.0))


class _Mixed(nn.Module):
    """A DARTS-convention mixed op: Σ_k w_k·op_k(x), its candidates the list ``_ops``."""

    def __init__(self, ops):
        super().__init__()
        self._ops = nn.ModuleList(ops)

    def forward(self, x, weights):
        return torch.stack([op(x) for op in self._ops], -1) @ weights


class _Head(nn.Module):
    def __init__(self, edge):
        super().__init__()
        self.edge, self.head = edge, nn.Linear(4, 3)

    def forward(self, x, w):
        return self.head(self.edge(x, w))


def test_invariance_deviation_of_a_users_degree_0_module_inside_an_op_is_nan_and_a_constant_one_is_0():
    """Reference: J_f(x)·x by torch.func.jvp: 0 exactly for the ops ending in a constant module; for the RMSNorm ops
    eps_deviation has no formula (it names the four torch normalizations), so the probe's answer is NaN, as it
    already was for the bare RMSNorm op. The LayerNorm op is measured: eps/(var + eps) of its input."""
    register_homogeneity_rule(_RMSNorm, degree_rule(0.0, "x / rms(x)"))
    register_homogeneity_rule(_Zero, degree_rule(0.0, "constant zero"))
    try:
        torch.manual_seed(0)
        ln = nn.LayerNorm(4, elementwise_affine=False, eps=1e-3)
        ops = [nn.Sequential(nn.Linear(4, 4, bias=False), _RMSNorm()), _RMSNorm(),
               nn.Sequential(nn.Linear(4, 4), _Zero()), _Zero(), nn.Sequential(nn.Linear(4, 4, bias=False), ln)]
        edge = _Mixed(ops)
        net = _Head(edge).to(DT)

        x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
        w = torch.softmax(torch.randn(len(ops), dtype=DT), 0)
        for k in (2, 3):  # the reference: J·x = d/dc f(c·x) at c = 1 is exactly 0 for a constant output
            _, jx = torch.func.jvp(ops[k], (x,), (x,))
            assert bool((jx == 0).all())
        probe = nasdiag.attach(net, edges={"e": (edge, list(ops))}, norm_deviation=True)
        with probe.record():
            F.cross_entropy(net(x, w), y).backward()
        dev = probe.invariance_deviation()["e"]
        names = probe.edges[0].op_names
        assert math.isnan(dev[names[0]]) and math.isnan(dev[names[1]])
        assert dev[names[2]] == 0.0 and dev[names[3]] == 0.0
        h = ops[4][0](x).detach()
        expected = (1e-3 / (h.var(-1, unbiased=False) + 1e-3)).max()
        assert dev[names[4]] == pytest.approx(float(expected), rel=1e-12)
    finally:
        HOMOGENEITY_RULES.pop(_RMSNorm, None)
        HOMOGENEITY_RULES.pop(_Zero, None)


# --- an own supernet: the minimal cell of Fig. 7 ---------------------------------------------------------------

def _norm(kind: str, C: int, eps: float, affine: bool = False) -> nn.Module:
    if kind == "bn":
        return nn.BatchNorm2d(C, eps=eps, affine=affine)
    if kind == "gn":
        return nn.GroupNorm(1, C, eps=eps, affine=affine)
    return nn.InstanceNorm2d(C, eps=eps, affine=affine)


def _conv_op(C: int, order: str, kind: str, eps: float, affine: bool) -> nn.Sequential:
    """§8.2's stacking orders, and BN-ReLU-conv (the normalization first), none of them nasdiag's supernet's."""
    conv, norm, relu = nn.Conv2d(C, C, 3, padding=1, bias=False), _norm(kind, C, eps, affine), nn.ReLU()
    layers = {"relu-conv-bn": [relu, conv, norm], "conv-bn-relu": [conv, norm, relu],
              "conv-relu-bn": [conv, relu, norm], "bn-relu-conv": [norm, relu, conv]}[order]
    return nn.Sequential(*layers)


class _Sampled(_Mixed):
    """A mixed op that runs only the ops of non-zero weight (DSNAS, ProxylessNAS: the sampled op alone)."""

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops) if bool(w.detach() != 0))


class _MinimalCell(nn.Module):
    """Fig. 7: input nodes 0, 1 (ReLU-conv-norm preprocessing of the two previous cells' outputs), intermediate
    nodes 2, 3, edges (0,2) (1,2) (0,3) (1,3) and the intermediate edge (2,3); output cat(x_2, x_3). Candidates:
    none, skip, max pool → norm, a conv op. ``copies``: the reference's own Z per consumer of node 2."""

    cell_type = "normal"
    edge_nodes = [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    output_nodes = [2, 3]

    def __init__(self, C_pp, C_p, C, order, kind, eps, affine, mixed):
        super().__init__()
        self.pre0 = nn.Sequential(nn.ReLU(), nn.Conv2d(C_pp, C, 1, bias=False), _norm(kind, C, eps))
        self.pre1 = nn.Sequential(nn.ReLU(), nn.Conv2d(C_p, C, 1, bias=False), _norm(kind, C, eps))
        self.edges = nn.ModuleList(
            mixed([_Zero(), nn.Identity(), nn.Sequential(nn.MaxPool2d(3, 1, 1), _norm(kind, C, eps)),
                   _conv_op(C, order, kind, eps, affine)]) for _ in range(5))
        self.output_node_slices = {2: (0, C), 3: (C, 2 * C)}

    def forward(self, s0, s1, Z, copies=None):
        (Za, Zb), E = copies or (Z, Z), self.edges
        x0, x1 = self.pre0(s0), self.pre1(s1)
        x2_in4 = E[0](x0, Za[0]) + E[1](x1, Za[1])  # node 2 as edge (2,3) reads it
        x2_out = x2_in4 if copies is None else E[0](x0, Zb[0]) + E[1](x1, Zb[1])  # as the output reads it
        x3 = E[2](x0, Z[2]) + E[3](x1, Z[3]) + E[4](x2_in4, Z[4])
        return torch.cat([x2_out, x3], 1)


class _Net(nn.Module):
    """Stem, ``layers`` minimal cells, global average pooling and a linear classifier (bias-free: Thm. 2's)."""

    def __init__(self, C=4, layers=3, classes=5, order="relu-conv-bn", kind="bn", eps=1e-12, affine=False,
                 mixed=_Mixed, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Sequential(nn.Conv2d(3, C, 3, padding=1, bias=False), _norm(kind, C, eps))
        self.cells = nn.ModuleList(_MinimalCell(C if i < 2 else 2 * C, C if i < 1 else 2 * C, C, order, kind, eps,
                                                affine, mixed) for i in range(layers))
        self.classifier = nn.Linear(2 * C, classes, bias=False)
        self.to(DT)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.InstanceNorm2d)) and m.weight is not None:
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.normal_()
        self.Z = None  # (cells, 5, K) mixing weights

    def forward(self, x, copies=None):
        s0 = s1 = self.stem(x)
        for c, cell in enumerate(self.cells):
            s0, s1 = s1, cell(s0, s1, self.Z[c], None if copies is None else (copies[0][c], copies[1][c]))
        return self.classifier(s1.mean((2, 3)))


def _weights(method: str, cells: int, seed: int, samples=None) -> torch.Tensor:
    """Each method's Z (supplement §2), (cells, 5, 4): DARTS softmax(α); SNAS Gumbel-softmax at λ = 0.7;
    DSNAS and ProxylessNAS a one-hot sample in the straight-through form onehot − p.detach() + p (value one-hot,
    its gradient p's), ``samples`` (cells, 5) the op indices."""
    g = torch.Generator().manual_seed(seed)
    alpha = torch.randn(cells, 5, 4, generator=g, dtype=DT)
    p = torch.softmax(alpha, -1)
    if method == "darts":
        return p
    if method == "snas":
        gumbel = -torch.log(-torch.log(torch.rand(alpha.shape, generator=g, dtype=DT)))
        return torch.softmax((alpha + gumbel) / 0.7, -1)
    return F.one_hot(samples, 4).to(DT) - p.detach() + p


def _reference(net: _Net, Z: torch.Tensor, x, y):
    """Plain autograd: ∂L/∂Z of leaf copies (the part of edges (0,2), (1,2) through edge (2,3), through the output,
    and the other edges' costs), the cell outputs' <∂L/∂out, out> per node slice, the logits."""
    Z0, Za, Zb = (Z.detach().clone().requires_grad_(True) for _ in range(3))
    outs = []
    hooks = [cell.register_forward_hook(lambda m, a, o: outs.append(o)) for cell in net.cells]
    try:
        net.Z = Z0
        logits = net(x, copies=(Za, Zb))
    finally:
        for h in hooks:
            h.remove()
    loss = F.cross_entropy(logits, y)
    g0, ga, gb, *gouts = torch.autograd.grad(loss, [Z0, Za, Zb, *outs])
    C = outs[0].shape[1] // 2
    node_costs = [[float((g[:, :C] * o[:, :C]).sum()), float((g[:, C:] * o[:, C:]).sum())]
                  for g, o in zip(gouts, (o.detach() for o in outs))]
    return g0, ga, gb, node_costs, logits.detach()


_CASES = {  # method: (order, norm, mixed op, DSNAS/ProxylessNAS samples of edge (2,3) per cell)
    "darts": ("relu-conv-bn", "bn", _Mixed, None),
    "snas": ("bn-relu-conv", "gn", _Mixed, None),
    "dsnas": ("conv-bn-relu", "bn", _Sampled, (3, 2, 1)),
    "proxyless": ("conv-relu-bn", "gn", _Sampled, (2, 3, 1)),
}


@pytest.mark.parametrize("method", sorted(_CASES))
def test_own_minimal_cell_costs_paths_and_theorems_for_each_methods_weights(method):
    """On the minimal-cell supernet above (3 cells, eps = 1e-12 for "eps → 0"), with each method's Z: the probe's
    costs, per-sample rows, path parts and output-edge costs against plain autograd; Thm. 1 (the Z-weighted part
    of node 2's incoming edges through edge (2,3) is 0 where (2,3)'s active ops are all invariant, not 0 where skip
    is active, eq. 11), Cor. 1.2 in both forms (a non-last cell's output-edge costs sum to 0; with an invariant
    intermediate edge its Z-weighted edge costs do too: d/dt L(t·Z) = <∂L/∂out, out> there), Thm. 2 (the last
    cell's sum is L − H, own transcription and ``loss_minus_entropy``), and the flags against f(c·x) = f(x)."""
    from nasdiag.cost import loss_minus_entropy

    order, kind, mixed, edge4 = _CASES[method]
    register_homogeneity_rule(_Zero, degree_rule(0.0, "constant zero"))
    try:
        net = _Net(order=order, kind=kind, mixed=mixed, seed=1)
        samples = None
        if edge4 is not None:
            samples = torch.randint(0, 4, (3, 5), generator=torch.Generator().manual_seed(2))
            samples[:, 1] = 0  # edge (1,2) none: the op of (0,2) is the whole of x_2
            samples[:, 4] = torch.tensor(edge4)
        Z = _weights(method, 3, seed=3, samples=samples)
        x, y = torch.randn(6, 3, 6, 6, dtype=DT), torch.randint(0, 5, (6,))
        g0, ga, gb, node_costs, logits = _reference(net, Z, x, y)

        net.Z = Z.detach()
        probe = nasdiag.attach(net, path_split=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the ops a sampled Z did not run: NaN by design
            with probe.record():
                F.cross_entropy(net(x), y).backward()
            costs, rows = probe.costs(), probe.costs(per_sample=True)
            paths, outputs, flags = probe.path_costs(), probe.output_costs(), probe.scale_invariant_ops()
        ran = Z.detach() != 0
        for c in range(3):
            for e in range(5):
                name, k = f"cells.{c}.edges.{e}", ran[c, e]
                ref = ga[c, e] + gb[c, e] if e < 2 else g0[c, e]
                torch.testing.assert_close(costs[name][k], ref[k], rtol=1e-9, atol=1e-14)
                assert bool(torch.isnan(costs[name][~k]).all())
                torch.testing.assert_close(rows[name].sum(0)[k], costs[name][k], rtol=1e-9, atol=1e-14)
                parts = paths[name]
                torch.testing.assert_close(parts["output"][k], (gb if e < 2 else g0)[c, e][k], rtol=1e-9, atol=1e-14)
                if e < 2:
                    torch.testing.assert_close(parts[f"cells.{c}.edges.4"][k], ga[c, e][k], rtol=1e-9, atol=1e-14)
            for n, ref in zip((2, 3), node_costs[c]):
                assert float(outputs[f"cells.{c}"][n]) == pytest.approx(ref, rel=1e-9, abs=1e-14)
            # the flags: none, pool → norm and the conv op invariant in train mode, skip not (own knowledge)
            assert flags[f"cells.{c}.edges.4"].tolist() == [True, False, True, True]

            # Thm. 1: Σ over node 2's incoming edges and their ops of Z · (part through edge (2,3))
            through = sum((Z[c, e].detach()[ran[c, e]] * ga[c, e][ran[c, e]]).sum() for e in (0, 1))
            skip_active = bool(Z[c, 4, 1].detach() != 0)
            assert (abs(float(through)) > 1e-8) if skip_active else (abs(float(through)) < 1e-10), (c, float(through))
            if c < 2:  # Cor. 1.2
                assert abs(sum(node_costs[c])) < 1e-10
                if not skip_active:
                    weighted = sum((Z[c, e].detach()[ran[c, e]] * costs[f"cells.{c}.edges.{e}"][ran[c, e]]).sum()
                                   for e in range(5))
                    assert abs(float(weighted)) < 1e-10
        # Thm. 2: own L − H (H the batch-mean entropy of softmax(logits), natural log)
        logp = torch.log_softmax(logits, 1)
        l_minus_h = float(-logp.gather(1, y[:, None]).mean() + (logp.exp() * logp).sum(1).mean())
        assert sum(node_costs[2]) == pytest.approx(l_minus_h, rel=1e-9)
        assert float(sum(outputs["cells.2"].values())) == pytest.approx(l_minus_h, rel=1e-9)
        assert float(loss_minus_entropy(logits, y)) == pytest.approx(l_minus_h, rel=1e-12)
    finally:
        HOMOGENEITY_RULES.pop(_Zero, None)


def test_the_cost_passed_through_an_affine_normalized_op_at_the_real_eps_is_the_one_docs_probe_states():
    """docs/probe.md: at finite eps the cost an invariant op f = norm ∘ (positively homogeneous part) passes back
    onto its input x_j is <J_fᵀ g, x_j> = Σ_c eps/(var_c + eps)·<g[:, c], f(x_j)[:, c] − β_c> (differentiate
    γ (c·y − c·μ)/sqrt(c²·var + eps) + β at c = 1), g = ∂L/∂x_m. The docs wrote f(x_j) without − β: right only for
    an affine-free norm; with the affine BatchNorm here (β ~ N(0, 1), eps = 0.1) that form is off by far. The
    probe's path part of the one op making up x_2 (edge (1,2) samples none) through edge (2,3) is the reference."""
    register_homogeneity_rule(_Zero, degree_rule(0.0, "constant zero"))
    try:
        net = _Net(layers=1, order="relu-conv-bn", kind="bn", eps=0.1, affine=True, mixed=_Sampled, seed=4)
        samples = torch.tensor([[3, 0, 2, 1, 3]])  # (0,2) the conv op alone is x_2; (2,3) the affine-BN conv op
        Z = _weights("dsnas", 1, seed=5, samples=samples).detach()
        x, y = torch.randn(6, 3, 6, 6, dtype=DT), torch.randint(0, 5, (6,))
        op = net.cells[0].edges[4]._ops[3]
        seen = {}
        hooks = [op.register_forward_hook(lambda m, a, o: seen.update(x2=a[0], f=o)),
                 op[2].register_forward_pre_hook(lambda m, a: seen.update(y=a[0])),
                 net.cells[0].register_forward_hook(lambda m, a, o: seen.update(out=o))]
        try:
            net.Z = Z
            loss = F.cross_entropy(net(x), y)
            g = torch.autograd.grad(loss, seen["out"])[0][:, 4:]  # ∂L/∂x_3: x_3 is the output's second half
        finally:
            for h in hooks:
                h.remove()
        eps, beta = op[2].eps, op[2].bias.detach().view(1, -1, 1, 1)
        factor = eps / (seen["y"].detach().var((0, 2, 3), unbiased=False).view(1, -1, 1, 1) + eps)
        with_beta = float((g * (seen["f"].detach() - beta) * factor).sum())
        without_beta = float((g * seen["f"].detach() * factor).sum())
        assert abs(with_beta - without_beta) > 0.1 * abs(with_beta)  # the case tells the two forms apart

        probe = nasdiag.attach(net, path_split=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the ops the sample did not run: NaN by design
            with probe.record():
                F.cross_entropy(net(x), y).backward()
            part = probe.path_costs()["cells.0.edges.0"]["cells.0.edges.4"][3]
        assert float(part) == pytest.approx(with_beta, rel=1e-9)

        from pathlib import Path
        doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "probe.md").read_text().split())
        assert "Σ_c eps/(var_c + eps)·<∂L/∂x_m[:, c], f(x_j)[:, c] − β_c>" in doc
    finally:
        HOMOGENEITY_RULES.pop(_Zero, None)


def test_snas_credit_given_a_temperature_that_is_no_number_is_one_cost_error_line():
    """snas_alpha_grad(C, Z, λ): λ None or a string was '>' not supported's TypeError, a per-edge tensor torch's
    "Boolean value of Tensor with more than one value is ambiguous"; one CostError line naming the argument. A number
    (Python's, numpy's, a tensor or array of one element) is the credit (1/λ)(diag Z − ZZᵀ)C, autograd's through Z = softmax((α + G)/λ)."""
    from nasdiag.cost import CostError, snas_alpha_grad

    alpha, gumbel = torch.randn(3, 4, dtype=DT, requires_grad=True), torch.rand(3, 4, dtype=DT)
    C = torch.randn(3, 4, dtype=DT)
    for bad in (None, "0.5", torch.full((3, 1), 0.5, dtype=DT), True):
        with pytest.raises(CostError, match="temperature") as err:
            snas_alpha_grad(C, torch.softmax(alpha.detach(), -1), bad)
        assert "\n" not in str(err.value)
    import numpy as np

    for lam in (0.7, np.float32(0.7), np.array(0.7), torch.tensor(0.7, dtype=DT), torch.tensor([[0.7]], dtype=DT)):
        Z = torch.softmax((alpha + gumbel) / float(lam), -1)
        (reference,) = torch.autograd.grad(Z, alpha, C)  # ∂(C·Z)/∂α with C held constant
        torch.testing.assert_close(snas_alpha_grad(C, Z.detach(), lam), reference, rtol=1e-12, atol=1e-15)


def test_cost_moments_given_no_tensor_or_a_bad_shape_is_one_cost_error_line_and_numbers_are_numpys():
    """CostMoments (the streaming E[C], E[C²] of nasdiag.cost): observations or a mask given as a list were
    AttributeError tracebacks, a shape given as an int "'int' object is not iterable", a float or negative dim
    torch.zeros' TypeError / RuntimeError, merge of another object an AttributeError; one CostError line each, the
    accumulator unchanged. Then the moments of masked observations are numpy's (population variance)."""
    import numpy as np
    from nasdiag.cost import CostError, CostMoments

    for shape in (5, "ab", (2.5,), (-1,), (True,)):
        with pytest.raises(CostError, match="shape") as err:
            CostMoments(shape)
        assert "\n" not in str(err.value)
    m = CostMoments((np.int64(2), 3))
    for args in (([[1.0] * 3] * 2,), (torch.ones(2, 3), [[True] * 3] * 2)):
        with pytest.raises(CostError, match="must be a torch.Tensor") as err:
            m.update(*args)
        assert "\n" not in str(err.value)
    with pytest.raises(CostError, match="CostMoments"):
        m.merge({"count": torch.ones(2, 3)})
    assert m.shape == (2, 3) and int(m.count.sum()) == 0

    obs = torch.randn(7, 2, 3, dtype=DT) * 1e3 + 5e4
    mask = torch.rand(7, 2, 3, generator=torch.Generator().manual_seed(0)) < 0.6
    m.update(obs[:4], mask[:4])
    m.update(obs[4:], mask[4:])
    o, k = obs.numpy(), mask.numpy()
    for e in range(2):
        for j in range(3):
            sel = o[k[:, e, j], e, j]
            assert int(m.count[e, j]) == sel.size
            if sel.size:
                assert float(m.mean[e, j]) == pytest.approx(sel.mean(), rel=1e-14)
                assert float(m.var[e, j]) == pytest.approx(sel.var(), rel=1e-9, abs=1e-9)


def test_eps_deviation_of_an_input_its_norm_cannot_take_is_one_cost_error_line():
    """eps_deviation(norm, x) returned eps/(var + eps) of whatever groups x had where torch's forward of the norm
    refuses x (3 channels for BatchNorm2d(4), a 3-D input to BatchNorm2d, (B, 6) for GroupNorm(2, 4) with an affine
    map, trailing dims (4,) for LayerNorm(8)): a number of no normalization. Now one CostError line; what torch's
    forward takes (an affine-free, untracked BatchNorm or an affine-free GroupNorm of other channel counts) is still
    measured, as J_N(x)·x = N(x)·eps/(var + eps) by torch.func.jvp says."""
    from nasdiag.cost import CostError, eps_deviation

    refused = [(nn.BatchNorm2d(4), (2, 3, 5, 5)), (nn.BatchNorm2d(4), (2, 4, 5)), (nn.GroupNorm(2, 4), (2, 6, 5)),
               (nn.LayerNorm(8), (2, 4)), (nn.InstanceNorm2d(4, affine=True), (2, 3, 5, 5)),
               (nn.GroupNorm(2, 4, affine=False), (2, 5, 5))]
    for norm, shape in refused:
        x = torch.randn(shape, dtype=DT)
        with pytest.raises(Exception):  # the reference: torch's own forward refuses it
            norm.to(DT)(x)
        with pytest.raises(CostError, match="cannot normalize") as err:
            eps_deviation(norm, x)
        assert "\n" not in str(err.value)
    taken = [(nn.BatchNorm2d(4, affine=False, track_running_stats=False, eps=0.5), (3, 3, 4, 4), (0, 2, 3)),
             (nn.GroupNorm(2, 4, affine=False, eps=0.5), (3, 6, 4), None)]
    for norm, shape, dims in taken:
        x = torch.randn(shape, dtype=DT)
        out, jx = torch.func.jvp(norm.to(DT), (x,), (x,))
        dev = eps_deviation(norm, x)
        if dims is not None:  # per channel
            torch.testing.assert_close((jx / out).mean(dims), dev, rtol=1e-10, atol=0)
        else:  # per (sample, group)
            torch.testing.assert_close((jx / out).reshape(3, 2, -1).mean(-1), dev, rtol=1e-10, atol=0)


@pytest.mark.parametrize("kind", ["bn", "gn"])
def test_in_eval_mode_thm1_and_cor12_hold_only_for_per_sample_statistics_and_the_flags_say_so(kind):
    """Where a theorem must NOT hold: in eval mode a BatchNorm with running statistics is an affine map, so the
    cost the conv op of edge (2,3) passes back onto x_2 (edge (0,2)'s sampled conv op is all of x_2) and a non-last
    cell's output-edge costs are not 0, and the flags of the BN ops are False; GroupNorm keeps per-sample statistics,
    so both are 0 (eps = 1e-12) and its ops stay flagged. Autograd is the reference; the flags come from the probe."""
    register_homogeneity_rule(_Zero, degree_rule(0.0, "constant zero"))
    try:
        net = _Net(kind=kind, mixed=_Sampled, seed=1)
        with torch.no_grad():  # running statistics of a few batches
            net.Z = torch.full((3, 5, 4), 0.25, dtype=DT)
            for _ in range(3):
                net(torch.randn(6, 3, 6, 6, dtype=DT))
        net.eval()
        Z = _weights("dsnas", 3, seed=3, samples=torch.tensor([[3, 0, 2, 1, 3]] * 3))
        x, y = torch.randn(6, 3, 6, 6, dtype=DT), torch.randint(0, 5, (6,))
        g0, ga, gb, node_costs, logits = _reference(net, Z, x, y)
        through = [abs(float(Z[c, 0, 3].detach() * ga[c, 0, 3])) for c in range(3)]
        cor12 = [abs(sum(node_costs[c])) for c in range(2)]
        flags = nasdiag.attach(net).scale_invariant_ops()["cells.0.edges.4"].tolist()
        if kind == "bn":
            assert min(through) > 1e-6 and min(cor12) > 1e-6
            assert flags == [True, False, False, False]
        else:
            assert max(through) < 1e-10 and max(cor12) < 1e-10
            assert flags == [True, False, True, True]
    finally:
        HOMOGENEITY_RULES.pop(_Zero, None)


def test_a_linear_bias_batchnorm1d_op_of_an_mlp_supernet_is_flagged_with_its_input_or_said_to_be_missed():
    """A non-DARTS supernet: an MLP whose candidate is Linear(6, 6) (bias on, torch's default) → BatchNorm1d. On its
    2-D input the per-feature bias is removed by the batch mean, f(c·x) = f(x) (eps = 1e-14); on a (B, C, L) input
    (the Linear acting on L) it is not. is_scale_invariant with an example tells the two apart; the probe's
    scale_invariant_ops() has no input ranks and answers what holds at every rank: where it misses the 2-D
    invariance, docs/probe.md must say so and point to is_scale_invariant(op, x_i) (it said only "from module
    structure", which promised f(c·x) = f(x) ⇔ flag)."""
    from pathlib import Path

    from nasdiag.cost import is_scale_invariant

    class _MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.edge = _Mixed([nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6, eps=1e-14)), nn.Identity()])
            self.head = nn.Linear(6, 3)

        def forward(self, x, w):
            return self.head(self.edge(x, w))

    torch.manual_seed(0)
    net = _MLP().to(DT)
    op = net.edge._ops[0]
    x2, x3 = torch.randn(8, 6, dtype=DT), torch.randn(8, 6, 6, dtype=DT)
    state = {k: v.clone() for k, v in op.state_dict().items()}
    with torch.no_grad():
        for x, invariant in ((x2, True), (x3, False)):
            change = max(float((op(c * x) - op(x)).abs().max() / op(x).abs().max()) for c in (0.3, 3.7))
            assert (change < 1e-8) if invariant else (change > 1e-3)
            assert is_scale_invariant(op, x) == invariant
    op.load_state_dict(state)
    flag = bool(nasdiag.attach(net).scale_invariant_ops()["edge"][0])
    if not flag:
        doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "probe.md").read_text().split())
        start = doc.index("| `scale_invariant_ops()` |")
        row = doc[start:doc.index("| `invariance_deviation()` |", start)]
        assert "Linear(bias) → BatchNorm1d" in row and "is_scale_invariant(op, x_i)" in row
