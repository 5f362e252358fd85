"""Cost audit round 21 (cost21): the per-edge cost C(Z) = ∂L/∂Z = <∂L/∂x_j, O(x_i)> (wiring supplement §2.1) and its
derived statistics on float64 supernets written from scratch here (not nasdiag's reference supernet), against plain
autograd (leaf mixing weights Z per cell, a scalar multiplier per output node, a copy of a node per consumer for the
path parts), numpy and exact rational arithmetic (``fractions.Fraction``). Never nasdiag against nasdiag.

Defects found (each test fails without its fix):

* A candidate op whose output the mixed op's weighted sum broadcasts (a ``none`` op returning a 0-dim zero, a learned
  (1, C, 1, 1) map) was refused at the first recorded step as "its output is not Σ_k w_k·op_k(x) ... its candidate
  ops return shape (1, C, 1, 1) but it returns (B, C, H, W)", though the output is exactly that sum and
  ∂L/∂Z_k = <∂L/∂x_j, O_k(x_i) broadcast> is well defined; the probe takes such an output as its expansion (a view)
  (test_a_candidate_whose_output_the_sum_broadcasts_costs_as_autograd).
* ``CostMoments`` promises that costs of any finite magnitude keep a finite mean and variance where numpy's two-pass
  does (a variance beyond range inf, never NaN); a chunk of the other sign than the shift (the first chunk's mean)
  near the float64 limit ([1e308] then [-1e308]) overflowed in the shifted frame (|C − K| up to twice the largest
  float): mean −inf and variance NaN where numpy gives 0 and inf, in one stream and in a merge of two. Such an entry
  drops its shift (test_finite_costs_of_both_signs_near_the_float64_limit_keep_a_finite_mean_in_one_stream_and_merged).

Checked and right (test_own_two_type_supernet_costs_paths_outputs_and_statistics_are_autograds_and_numpys): a supernet
of two cell types with their own α (normal: identity, ReLU-conv-BatchNorm in train mode, conv(bias)-GroupNorm,
avgpool-conv; reduce: conv-tanh, conv-GroupNorm(1, C), maxpool-affine-free BatchNorm), cells of three intermediate
nodes where node 2 feeds nodes 3 and 4 and the output, under reduction 'mean' and 'sum' (sum = B·mean exactly): costs
and per-sample rows (summing to them) = ∂L/∂Z of leaf Z (1e-12), ``darts_alpha_grad(cell_type_costs()[t], p_t)`` =
autograd's ∂L/∂α_t for each type, output-edge costs and ``path_costs`` (a part per consumer of each node) = autograd,
``statistics()`` over steps of unequal batch sizes = numpy's mean and population variance of the steps' costs with
count = steps × cells, BatchNorm buffers and every .grad bit-identical to an unprobed twin. By hand: per-sample rows
of the same net with GroupNorm in place of BatchNorm (no coupling) under a class-weighted mean cross-entropy are each
sample's own ∂L_b/∂Z (1e-17); costs when a node accumulates its edges in place (``node += edge(...)``), with and
without path_split; the credit maps (softmax, SNAS, DSNAS, ProxylessNAS) against §2.1-2.2 transcribed.
Streaming (test_cost_moments_over_unequal_chunks_and_merged_streams_are_exact_where_numpy_cancels): rows of mean 1e8
and std 1e-3 in chunks of 1 to 30 rows, with and without masks, and two streams merged as DDP would: count, mean and
variance against exact rational arithmetic (relative 1e-14 on the variance, where numpy's two-pass is ~1e-10 off).
By hand: 3000 random streams (magnitudes 1e-300 to 1e308, both signs, empty chunks, split and merged at random) against
exact rational mean and variance: after the fix the only differences are subnormal variances (< 1e-307, rounding),
a variance whose per-sample squares overflow (inf; numpy's two-pass too) and a first chunk of three values equal to
±float64 max (its mean rounds past the limit; numpy's mean is inf too).

Noticed and left: ``nasdiag.vocabulary.pooled_moments`` (how DDP pools the ranks' (count, mean, var) rows) is ~1e-5
relative off on the variance at mean/std = 1e11 (numpy: 2e-10): each rank's mean rounded to float64 (ulp 1.5e-8 at
1e8) enters n_p·(m_p − m)²; the loss is in the (count, mean, var) float64 triples the record schema carries, not in the
formula (outside this area). Ops of a mixed op without ``primitives`` are labelled ``"<k>:<class>"`` as documented. An
edge run on a batch flattened with another dim (tokens: (B·N, D)) gives (B·N, K) rows, one per token, without a word:
docs/probe.md says dim 0 of an edge's output is taken as the batch (only chunks of fewer samples are refused). A mixed
op weighting with (K, 1, 1, 1, 1) weights (``(w * torch.stack(outs)).sum(0)``) is refused in one line asking for (K,)
or (B, K) weights, the documented form. A bare mixed op attached as the model is the edge named ``""`` (its qualified
name in named_modules(), as documented), its costs ``costs()[""]``. ``edge_costs(g, <generator>)`` is Python's one-line
TypeError "object of type 'generator' has no len()" (the docstring asks for a sequence). The per-op path of
``edge_costs`` (outputs above 2**17 elements on a CPU) with a broadcast candidate: autograd's (1e-16 relative).
"""

from __future__ import annotations

import copy
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.cost import CostMoments, darts_alpha_grad

DT = torch.float64


class _Mixed(nn.Module):
    """DARTS-convention mixed op: Σ_k w_k·op_k(x)."""

    def __init__(self, ops):
        super().__init__()
        self._ops = nn.ModuleList(ops)

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


def _normal_ops(C):
    return [nn.Identity(),
            nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C)),
            nn.Sequential(nn.Conv2d(C, C, 1), nn.GroupNorm(2, C)),
            nn.Sequential(nn.AvgPool2d(3, 1, 1), nn.Conv2d(C, C, 1))]


def _reduce_ops(C):
    return [nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.Tanh()),
            nn.Sequential(nn.Conv2d(C, C, 1, bias=False), nn.GroupNorm(1, C)),
            nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.BatchNorm2d(C, affine=False))]


class _Cell(nn.Module):
    """Inputs 0, 1; node 2 feeds nodes 3, 4 and the output; output = concat(2, 3, 4) (the node protocol)."""

    edge_nodes = [(0, 2), (1, 2), (0, 3), (2, 3), (1, 4), (2, 4), (3, 4)]
    output_nodes = [2, 3, 4]

    def __init__(self, C, cell_type):
        super().__init__()
        self.cell_type = cell_type
        make = _normal_ops if cell_type == "normal" else _reduce_ops
        self.edges = nn.ModuleList(_Mixed(make(C)) for _ in self.edge_nodes)
        self.pre0 = nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 1, bias=False), nn.BatchNorm2d(C))
        self.pre1 = nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 1, bias=False), nn.BatchNorm2d(C))
        self.output_node_slices = {2: (0, C), 3: (C, 2 * C), 4: (2 * C, 3 * C)}

    def forward(self, s0, s1, Z, trace=None):
        """``trace`` (the reference's): {e: candidate outputs}, a copy of each node per consumer, a multiplier per
        output node; the copies and multipliers are identities of the value."""
        nodes, copies = [self.pre0(s0), self.pre1(s1)], {}
        for j in (2, 3, 4):
            terms = []
            for e, (i, jj) in enumerate(self.edge_nodes):
                if jj == j:
                    x = copies[(i, e)] if trace is not None and i >= 2 else nodes[i]
                    if trace is None:
                        terms.append(self.edges[e](x, Z[e]))
                    else:
                        trace["O"][e] = [op(x) for op in self.edges[e]._ops]
                        terms.append(sum(w * o for w, o in zip(Z[e], trace["O"][e])))
            nodes.append(sum(terms))
            if trace is not None:
                for e, (i, _) in enumerate(self.edge_nodes):
                    if i == j:
                        copies[(j, e)] = nodes[j] * 1.0
                copies[(j, "output")] = nodes[j] * 1.0
        if trace is None:
            return torch.cat(nodes[2:], 1)
        trace["copies"], trace["m"] = copies, {j: torch.ones((), dtype=DT, requires_grad=True) for j in (2, 3, 4)}
        return torch.cat([copies[(j, "output")] * trace["m"][j] for j in (2, 3, 4)], 1)


class _Net(nn.Module):
    types = ("normal", "reduce", "normal")

    def __init__(self, C=4, n_classes=5):
        super().__init__()
        self.stem = nn.Conv2d(2, C, 3, padding=1)
        self.cells = nn.ModuleList(_Cell(C, t) for t in self.types)
        self.mix = nn.ModuleList(nn.Conv2d(3 * C, C, 1, bias=False) for _ in self.types)
        self.alpha = nn.ParameterDict({"normal": nn.Parameter(0.3 * torch.randn(7, 4)),
                                       "reduce": nn.Parameter(0.3 * torch.randn(7, 3))})
        self.head = nn.Linear(C, n_classes)

    def forward(self, x, Z=None, traces=None):
        s0 = s1 = self.stem(x)
        for c, (cell, mix) in enumerate(zip(self.cells, self.mix)):
            z = Z[c] if Z is not None else F.softmax(self.alpha[cell.cell_type], -1)
            s0, s1 = s1, mix(cell(s0, s1, z, None if traces is None else traces[c]))
        return self.head(s1.mean((2, 3)))


def _edge(c, e):
    return f"cells.{c}.edges.{e}"


def _reference(net, x, y, reduction):
    """Autograd's ∂L/∂Z per cell, ∂L/∂α per type, output-edge costs and path parts, from leaves made here."""
    p = {t: F.softmax(net.alpha[t], -1).detach() for t in net.alpha}
    Z = [p[t].clone().requires_grad_() for t in net.types]
    traces = [{"O": {}} for _ in net.types]
    loss = F.cross_entropy(net(x, Z, traces), y, reduction=reduction)
    keys = [(c, k) for c, tr in enumerate(traces) for k in tr["copies"]]
    leaves = Z + [traces[c]["m"][j] for c in range(3) for j in (2, 3, 4)] + [traces[c]["copies"][k] for c, k in keys]
    grads = torch.autograd.grad(loss, leaves)
    dZ, dm, dcopy = grads[:3], grads[3:12], dict(zip(keys, grads[12:]))
    paths = {}
    for c, tr in enumerate(traces):
        for e, (_, j) in enumerate(_Cell.edge_nodes):
            paths[_edge(c, e)] = {("output" if cons == "output" else _edge(c, cons)):
                                  torch.stack([(dcopy[(c, (jj, cons))] * o).sum() for o in tr["O"][e]])
                                  for (cc, (jj, cons)) in keys if cc == c and jj == j}
    alpha = list(net.alpha.values())
    d_alpha = dict(zip(net.alpha, torch.autograd.grad(F.cross_entropy(net(x), y, reduction=reduction), alpha)))
    outputs = {f"cells.{c}": {j: dm[3 * c + n] for n, j in enumerate((2, 3, 4))} for c in range(3)}
    return dZ, d_alpha, outputs, paths, p


def test_own_two_type_supernet_costs_paths_outputs_and_statistics_are_autograds_and_numpys():
    torch.manual_seed(0)
    net = _Net().to(DT)
    twin, ref = copy.deepcopy(net), copy.deepcopy(net)  # twin: the unprobed step; ref: the references' forwards
    probe = nasdiag.attach(net, path_split=True)
    assert {g.name: (g.n_edges, g.n_ops) for g in probe.groups} == {"normal": (7, 4), "reduce": (7, 3)}
    history = {"normal": [], "reduce": []}
    for step, B in enumerate([5, 3, 7, 2]):
        x, y = torch.randn(B, 2, 5, 5, dtype=DT), torch.randint(0, 5, (B,))
        reduction = "mean" if step % 2 == 0 else "sum"
        with probe.record():
            loss = F.cross_entropy(net(x), y, reduction=reduction)
            loss.backward()
        F.cross_entropy(twin(x), y, reduction=reduction).backward()
        costs, rows, per_type = probe.costs(), probe.costs(per_sample=True), probe.cell_type_costs()
        outputs, paths = probe.output_costs(), probe.path_costs()
        for (name, a), b in zip(net.named_parameters(), twin.parameters()):
            assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), name
        dZ, d_alpha, ref_outputs, ref_paths, p = _reference(ref, x, y, reduction)
        for c in range(3):
            for e in range(7):
                name = _edge(c, e)
                torch.testing.assert_close(costs[name], dZ[c][e], rtol=0, atol=1e-12)
                assert rows[name].shape == (B, len(dZ[c][e]))
                torch.testing.assert_close(rows[name].sum(0), costs[name], rtol=0, atol=1e-13)
                assert set(paths[name]) == set(ref_paths[name]), name
                for part, v in ref_paths[name].items():
                    torch.testing.assert_close(paths[name][part], v, rtol=0, atol=1e-12)
            for j in (2, 3, 4):
                torch.testing.assert_close(outputs[f"cells.{c}"][j], ref_outputs[f"cells.{c}"][j], rtol=0, atol=1e-12)
        for t in ("normal", "reduce"):
            torch.testing.assert_close(darts_alpha_grad(per_type[t], p[t]), d_alpha[t], rtol=0, atol=1e-12)
        for t, cells in (("normal", (0, 2)), ("reduce", (1,))):
            history[t] += [np.stack([costs[_edge(c, e)].numpy() for e in range(7)]) for c in cells]
        if reduction == "sum":  # the summed loss is B times the mean one: so are its costs
            mean_dZ = _reference(ref, x, y, "mean")[0]
            torch.testing.assert_close(costs[_edge(1, 3)], B * mean_dZ[1][3], rtol=1e-12, atol=1e-14)
        net.zero_grad(), twin.zero_grad()
    for (name, a), b in zip(net.named_buffers(), twin.buffers()):
        assert torch.equal(a, b), name  # the probe runs no extra forward: BatchNorm's running statistics are the twin's
    stats = probe.statistics()
    for t, rows in history.items():
        H = np.stack(rows)
        np.testing.assert_array_equal(stats[f"cost/{t}/count"], np.full(H.shape[1:], len(H)))
        np.testing.assert_allclose(stats[f"cost/{t}/mean"], H.mean(0), rtol=1e-13, atol=1e-16)
        np.testing.assert_allclose(stats[f"cost/{t}/var"], H.var(0), rtol=1e-11)


class _Bias(nn.Module):
    """A learned (1, C, 1, 1) map: its output is broadcast by the weighted sum."""

    def __init__(self, C):
        super().__init__()
        self.b = nn.Parameter(torch.randn(1, C, 1, 1, dtype=DT))

    def forward(self, x):
        return self.b


class _Zero(nn.Module):
    """A `none` op returning a 0-dim zero."""

    def forward(self, x):
        return x.new_zeros(())


class _BroadcastCell(nn.Module):
    edge_nodes = [(0, 1), (1, 2), (0, 2)]
    output_nodes = [2]

    def __init__(self, C):
        super().__init__()
        self.edges = nn.ModuleList(
            _Mixed([nn.Conv2d(C, C, 3, padding=1, dtype=DT), _Bias(C), _Zero(), nn.Identity()]) for _ in range(3))
        self.output_node_slices = {2: (0, C)}

    def forward(self, x, Z):
        n1 = self.edges[0](x, Z[0])
        return self.edges[1](n1, Z[1]) + self.edges[2](x, Z[2])


@pytest.mark.parametrize("path_split", [False, True])
def test_a_candidate_whose_output_the_sum_broadcasts_costs_as_autograd(path_split):
    torch.manual_seed(1)
    cell, head = _BroadcastCell(3), nn.Linear(3, 4, dtype=DT)
    alpha = torch.randn(3, 4, dtype=DT)
    x, y = torch.randn(6, 3, 5, 5, dtype=DT), torch.randint(0, 4, (6,))

    def loss_of(Z):
        return F.cross_entropy(head(cell(x, Z).mean((2, 3))), y)

    probe = nasdiag.attach(cell, path_split=path_split)
    with probe.record():
        loss_of(F.softmax(alpha, -1)).backward()
    Z = F.softmax(alpha, -1).requires_grad_()
    (want,) = torch.autograd.grad(loss_of(Z), Z)
    costs, rows = probe.costs(), probe.costs(per_sample=True)
    for e in range(3):
        torch.testing.assert_close(costs[f"edges.{e}"], want[e], rtol=0, atol=1e-13)
        torch.testing.assert_close(rows[f"edges.{e}"].sum(0), want[e], rtol=0, atol=1e-13)
        assert rows[f"edges.{e}"].shape == (6, 4)
    if path_split:  # node 1's edge passes all of its cost through edge 1
        torch.testing.assert_close(probe.path_costs()["edges.0"]["edges.1"], want[0], rtol=0, atol=1e-13)


def _exact_moments(values):
    v = [Fraction(float(t)) for t in values]
    mean = sum(v) / len(v)
    return len(v), mean, sum((t - mean) ** 2 for t in v) / len(v)


def test_cost_moments_over_unequal_chunks_and_merged_streams_are_exact_where_numpy_cancels():
    rng = np.random.default_rng(0)
    shape = (2, 3)
    sizes = [1, 7, 2, 13, 1, 30, 5, 3, 1, 19]
    chunks = [rng.normal(1e8, 1e-3, size=(n,) + shape) for n in sizes]
    chunks[6] += 4e-3  # the second stream starts elsewhere: its shift is not the first's
    masks = [rng.random((n,) + shape) < 0.6 for n in sizes]
    for masked in (False, True):
        one, first, second = CostMoments(shape), CostMoments(shape), CostMoments(shape)
        for i, (d, m) in enumerate(zip(chunks, masks)):
            args = (torch.from_numpy(d),) + ((torch.from_numpy(m),) if masked else ())
            one.update(*args)
            (first if i < 6 else second).update(*args)
        first.merge(second)  # as a DDP gather would fold rank 1's accumulator into rank 0's
        X, M = np.concatenate(chunks), np.concatenate(masks)
        for acc in (one, first):
            for idx in np.ndindex(*shape):
                values = X[(slice(None),) + idx][M[(slice(None),) + idx]] if masked else X[(slice(None),) + idx]
                n, mean, var = _exact_moments(values)
                assert acc.count[idx].item() == n
                assert abs(Fraction(acc.mean[idx].item()) - mean) <= 2 * np.spacing(1e8)
                assert abs(acc.var[idx].item() / float(var) - 1) < 1e-14


@pytest.mark.parametrize("chunks", [[[1e308], [-1e308]], [[1.5e308], [-1.5e308], [1e308]], [[-1.7e308], [1.7e308, 1.7e308]],
                                    [[1e308, 1.7e308], [-1e308]]])
def test_finite_costs_of_both_signs_near_the_float64_limit_keep_a_finite_mean_in_one_stream_and_merged(chunks):
    """The docstring: costs of any finite magnitude keep a finite mean and variance where numpy's two-pass does (a
    variance beyond float64 range is inf, never NaN). A chunk of the other sign than the first chunk's mean (the
    shift) overflowed in the shifted frame: mean ∓inf, variance NaN."""
    values = [v for c in chunks for v in c]
    n, mean, _ = _exact_moments(values)
    one, first, second = CostMoments(()), CostMoments(()), CostMoments(())
    for i, c in enumerate(chunks):
        one.update(torch.tensor(c, dtype=DT))
        (first if i == 0 else second).update(torch.tensor(c, dtype=DT))
    first.merge(second)
    for acc in (one, first):
        assert acc.count.item() == n
        assert abs(Fraction(acc.mean.item()) - mean) <= 1e-15 * 1.8e308, acc.mean.item()
        assert acc.var.item() == np.inf  # the spread is beyond float64's square: numpy's var is inf too
