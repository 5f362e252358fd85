"""Independent float64 audit (round 2) of the probe's per-edge, per-op costs on supernets written here (not
nasdiag's Network): a DAG cell with 3 intermediate nodes and several inputs per node, a different op set on
every edge (BN affine on/off, GroupNorm, LayerNorm, pooling, conv with bias, identity, zero), BN in train and
eval mode, a cell called twice (weight tying) and (B, K) per-sample weights.

References are autograd w.r.t. explicit mixing-weight leaves (C = ∂L/∂Z, wiring supplement §2.1), scalar
taps added to an edge's input along O_k(x_i) (the path split), a direct eps/(var + eps) and the closed form
L − H (Thm. 2, eq. 12). Thm. 1's "eps → 0" is eps = 1e-12.
"""

import contextlib
import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.cost import degree_rule, register_homogeneity_rule
from nasdiag.errors import NasdiagError
from nasdiag.probe import ProbeError

from conftest import assert_no_module_hooks, live_tensors
from test_audit_newuser_round3 import Mixed

C, HW, B, N_CLS = 4, 4, 4, 3
EDGE_NODES = [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3), (0, 4), (2, 4), (3, 4)]


class Zero(nn.Module):
    def forward(self, x):
        return x * 0.0


register_homogeneity_rule(Zero, degree_rule(0.0, "constant zero output"), overwrite=True)


def relu_conv_bn(affine):
    return nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C, affine=affine))


def conv_gn(groups):
    return nn.Sequential(nn.Conv2d(C, C, 3, padding=1, bias=False), nn.GroupNorm(groups, C), nn.ReLU())


def conv_ln():
    return nn.Sequential(nn.Conv2d(C, C, 1, bias=False), nn.LayerNorm([C, HW, HW]))


def conv_bias():
    return nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=1))


def pool():
    return nn.AvgPool2d(3, 1, 1, count_include_pad=False)


def op_sets(affine):
    """A different candidate set on every edge (K = 2, 3 or 4); index 7 is the 3 -> 4 edge, all invariant in train."""
    return [
        [Zero(), nn.Identity(), relu_conv_bn(affine)],
        [relu_conv_bn(not affine), pool(), conv_gn(1), conv_bias()],
        [Zero(), conv_ln()],
        [nn.Identity(), conv_gn(2), relu_conv_bn(affine)],
        [Zero(), nn.Identity(), relu_conv_bn(affine), conv_gn(2)],
        [pool(), conv_bias()],
        [relu_conv_bn(affine), conv_ln(), nn.Identity()],
        [Zero(), relu_conv_bn(affine), conv_gn(1)],
    ]




class DagCell(nn.Module):
    """Inputs 0, 1; intermediate nodes 2, 3, 4 with 2-3 inputs each; output: nodes 2, 3, 4 concatenated.
    ``taps`` (reference runs only): {edge: callable} whose value is added to that edge's input."""

    edge_nodes = EDGE_NODES
    output_nodes = (2, 3, 4)

    def __init__(self, affine=True, cell_type=None, inplace_order=None):
        super().__init__()
        if cell_type is not None:
            self.cell_type = cell_type
        self.edges = nn.ModuleList(Mixed(ops) for ops in op_sets(affine))
        self.output_node_slices = {2: (0, C), 3: (C, 2 * C), 4: (2 * C, 3 * C)}
        self.inplace_order = inplace_order  # {node: edge order}: accumulate the node in place, `s += edge(...)`
        self.taps = None

    def forward(self, s0, s1, weights):
        states = [s0, s1]
        for j in (2, 3, 4):
            order = self.inplace_order[j] if self.inplace_order else [e for e, (_, d) in enumerate(EDGE_NODES) if d == j]
            acc = None
            for e in order:
                x = states[EDGE_NODES[e][0]]
                if self.taps is not None and e in self.taps:
                    x = x + self.taps[e]()
                out = self.edges[e](x, weights[e])
                if acc is None:
                    acc = out if self.inplace_order else 0 + out
                elif self.inplace_order:
                    acc += out
                else:
                    acc = acc + out
            states.append(acc)
        return torch.cat(states[2:], 1)


class Net(nn.Module):
    """stem -> cell0 -> conv/BN -> cell1, applied twice when ``tied`` -> GAP -> bias-free linear (Thm. 2's head)."""

    def __init__(self, affine=True, tied=True, eps=1e-5, **cell):
        super().__init__()
        self.stem = nn.Conv2d(2, C, 3, padding=1, bias=False)
        self.cell0 = DagCell(affine, **cell)
        self.pre = nn.Sequential(nn.Conv2d(3 * C, C, 1, bias=False), nn.BatchNorm2d(C))
        self.cell1 = DagCell(affine, **cell)
        self.tied = tied
        self.head = nn.Linear(3 * C, N_CLS, bias=False)
        for m in self.modules():
            if hasattr(m, "eps"):
                m.eps = eps

    def forward(self, x, W0, W1):
        s = self.stem(x)
        p = self.pre(self.cell0(s, s, W0))
        o1 = self.cell1(s, p, W1)
        if self.tied:  # the same cell again: each of its mixed ops runs twice per forward
            o1 = self.cell1(p, self.pre(o1), W1)
        return self.head(o1.mean((2, 3)))


def make_net(seed=0, **kw):
    torch.manual_seed(seed)
    return Net(**kw).double()


def data(seed=1, b=B):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, HW, HW, generator=g, dtype=torch.float64), torch.randint(0, N_CLS, (b,), generator=g)


def leaves(net, seed=2, per_sample=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    out = []
    for cell in (net.cell0, net.cell1):
        shape = lambda k: (per_sample, k) if per_sample else (k,)  # noqa: E731
        out.append([torch.softmax(torch.randn(shape(len(m._ops)), generator=g, dtype=torch.float64), -1)
                    .to(dtype).requires_grad_() for m in cell.edges])
    return out


def names():
    return [(c, e, f"cell{c}.edges.{e}") for c in (0, 1) for e in range(len(EDGE_NODES))]


def max_err(a, b):
    return float((a - b).abs().max())


def tap_reference(net, x, y, W0, W1, reduction):
    """{(d, e): ∂L/∂t}: t (K_d,) taps Σ_k t_k O_k^d(x_i) added to the input of edge e of cell 0, which leaves
    d's end node; ∂L/∂t_k = <J_eᵀ ∂L/∂x_m, O_k^d(x_i)>, the part of d's cost that went through e."""
    cell, outs, taps, handles = net.cell0, {}, {}, []
    for d, m in enumerate(cell.edges):
        for k, op in enumerate(m._ops):
            handles.append(op.register_forward_hook(lambda mod, a, o, d=d, k=k: outs.__setitem__((d, k), o.detach())))

    def tap(e):
        def value():
            total = 0
            for d, (_, j) in enumerate(EDGE_NODES):
                if j == EDGE_NODES[e][0]:
                    t = taps[(d, e)] = torch.zeros(len(cell.edges[d]._ops), dtype=torch.float64, requires_grad=True)
                    total = total + sum(t[k] * outs[(d, k)] for k in range(len(t)))
            return total
        return value

    cell.taps = {e: tap(e) for e, (i, _) in enumerate(EDGE_NODES) if i >= 2}
    try:
        F.cross_entropy(net(x, [w.detach() for w in W0], [w.detach() for w in W1]), y, reduction=reduction).backward()
    finally:
        cell.taps = None
        for h in handles:
            h.remove()
    return {key: t.grad for key, t in taps.items()}


# --- costs, per-sample costs and the path split against autograd --------------------------------------------

@pytest.mark.parametrize("per_sample", [None, B])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_costs_per_sample_costs_and_path_parts_on_a_tied_dag_cell_equal_autograd(mode, per_sample):
    net = make_net(affine=(mode == "train")).train(mode == "train")
    ref_net = copy.deepcopy(net)
    x, y = data()
    W0, W1 = leaves(net, per_sample=per_sample)
    probe = nasdiag.attach(net, path_split=True)
    with probe.record():
        F.cross_entropy(net(x, W0, W1), y, reduction="sum").backward()
    costs, rows, parts = probe.costs(), probe.costs(per_sample=True), probe.path_costs()
    for c, e, name in names():
        grad = (W0, W1)[c][e].grad
        if per_sample:  # (B, K) weights: the rows are exactly ∂L/∂Z_bk
            assert max_err(rows[name], grad) < 1e-13, name
            grad = grad.sum(0)
        assert max_err(costs[name], grad) < 1e-13, name
        assert max_err(rows[name].sum(0), costs[name]) < 1e-13, name
        if parts[name]:  # for a declared cell the parts are all the paths out of the end node
            assert max_err(sum(parts[name].values()), costs[name]) < 1e-13, name
    taps = tap_reference(ref_net, x, y, W0, W1, "sum")
    assert len(taps) == 7
    for (d, e), grad in taps.items():
        assert max_err(parts[f"cell0.edges.{d}"][f"cell0.edges.{e}"], grad) < 1e-13, (d, e)


def test_costs_in_float32_and_channels_last_match_the_float64_reference():
    net64 = make_net()
    x, y = data()
    V0, V1 = leaves(net64)
    F.cross_entropy(net64(x, V0, V1), y).backward()
    scale = max(float(w.grad.abs().max()) for W in (V0, V1) for w in W)
    for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 2e-6)):
        net = make_net().to(dtype).to(memory_format=torch.channels_last)
        W0, W1 = leaves(net, dtype=dtype)
        probe = nasdiag.attach(net)
        with probe.record():
            F.cross_entropy(net(x.to(dtype).contiguous(memory_format=torch.channels_last), W0, W1), y).backward()
        costs = probe.costs()
        for c, e, name in names():
            assert costs[name].dtype == dtype
            assert max_err(costs[name].double(), (V0, V1)[c][e].grad) <= tol * scale, (dtype, name)


def test_a_mean_loss_gives_the_sum_loss_costs_over_b():
    net = make_net()
    x, y = data()
    got = {}
    for reduction in ("sum", "mean"):
        W0, W1 = leaves(net)
        probe = nasdiag.attach(net)
        with probe.record():
            F.cross_entropy(net(x, W0, W1), y, reduction=reduction).backward()
        got[reduction] = probe.costs()
        for c, e, name in names():
            assert max_err(got[reduction][name], (W0, W1)[c][e].grad) < 1e-13
    for _, _, name in names():
        assert max_err(got["sum"][name], B * got["mean"][name]) < 1e-12


@pytest.mark.parametrize("statistics", ["all", "sampled"])
def test_streaming_statistics_over_steps_equal_numpy_over_the_autograd_costs(statistics):
    net = make_net()
    probe = nasdiag.attach(net, statistics=statistics)
    history = {name: [] for _, _, name in names()}
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        x, y = data(seed=10 + step)
        W0, W1 = leaves(net, seed=20 + step)
        if statistics == "sampled":  # one-hot samples (DSNAS-style): only the sampled op is observed
            W0, W1 = ([F.one_hot(torch.randint(len(w), (), generator=g), len(w)).double().requires_grad_() for w in W]
                      for W in (W0, W1))
        with probe.record():
            F.cross_entropy(net(x, W0, W1), y).backward()
        for c, e, name in names():
            w = (W0, W1)[c][e]
            history[name].append(torch.where(w.detach() != 0, w.grad, math.nan) if statistics == "sampled" else w.grad)
    stats = probe.statistics()
    for _, _, name in names():
        h = torch.stack(history[name])  # (steps, K), NaN where not observed
        seen = ~torch.isnan(h)
        count = seen.sum(0)
        mean = torch.where(seen, h, 0).sum(0) / count
        var = torch.where(seen, (h - mean) ** 2, 0).sum(0) / count
        assert stats[f"cost/{name}/count"][0].tolist() == count.tolist()
        torch.testing.assert_close(torch.from_numpy(stats[f"cost/{name}/mean"][0]), mean, rtol=0, atol=1e-15, equal_nan=True)
        torch.testing.assert_close(torch.from_numpy(stats[f"cost/{name}/var"][0]), var, rtol=0, atol=1e-15, equal_nan=True)


# --- the theorems on this supernet ------------------------------------------------------------------------------

def test_thm1_cor12_and_thm2_on_the_dag_supernet():
    net = make_net(eps=1e-12)
    x, y = data()
    W0, W1 = leaves(net)
    probe = nasdiag.attach(net, path_split=True)
    with probe.record():
        logits = net(x, W0, W1)
        F.cross_entropy(logits, y).backward()
    flags = probe.scale_invariant_ops()
    assert flags["cell0.edges.7"].all() and not flags["cell0.edges.6"].all()
    parts = probe.path_costs()
    scale = max(float(w.grad.abs().max()) for w in W0)

    def through(e):  # Σ over the edges entering e's source node, weighted by Z: <J_eᵀ ∂L/∂x_m, x_src> (Thm. 1)
        src = EDGE_NODES[e][0]
        return float(sum((W0[d].detach() * parts[f"cell0.edges.{d}"][f"cell0.edges.{e}"]).sum()
                         for d, (_, j) in enumerate(EDGE_NODES) if j == src))

    assert abs(through(7)) < 1e-9 * scale  # every op on 3 -> 4 normalizes last: nullified
    assert abs(through(6)) > 1e-3 * scale  # identity on 2 -> 4 passes cost (eq. 11)
    out = {cell: sum(float(v) for v in nodes.values()) for cell, nodes in probe.output_costs().items()}
    # Cor. 1.2: cell 0 feeds only conv -> BN; Thm. 2: the tied cell's first output feeds conv -> BN (0), its second
    # GAP and the bias-free classifier, so its output edges carry L − H of the mean cross-entropy
    assert abs(out["cell0"]) < 1e-9
    logp = torch.log_softmax(logits.detach(), -1)
    loss_minus_entropy = -logp.gather(1, y[:, None]).mean() + (logp.exp() * logp).sum(-1).mean()
    assert abs(out["cell1"] - float(loss_minus_entropy)) < 1e-9
    assert abs(float(loss_minus_entropy)) > 1e-2


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_invariance_flags_and_deviation_agree_with_direct_evaluation(mode):
    net = make_net().train(mode == "train")
    x, y = data()
    W0, W1 = leaves(net)
    inputs, handles = {}, []
    for e, m in enumerate(net.cell0.edges):
        for k, op in enumerate(m._ops):
            norms = [n for n in op.modules() if isinstance(n, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm))]
            if norms:
                handles.append(norms[0].register_forward_pre_hook(
                    lambda n, a, e=e, k=k: inputs.__setitem__((e, k), (n, a[0].detach()))))
    probe = nasdiag.attach(net, norm_deviation=True)
    with probe.record():
        F.cross_entropy(net(x, W0, W1), y).backward()
    for h in handles:
        h.remove()
    flags, deviation = probe.scale_invariant_ops(), probe.invariance_deviation()
    z = torch.randn(B, C, HW, HW, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for e, m in enumerate(net.cell0.edges):
        name = f"cell0.edges.{e}"
        for k, op in enumerate(m._ops):
            tiny = copy.deepcopy(op)
            for n in tiny.modules():
                if hasattr(n, "eps"):
                    n.eps = 1e-14
            with torch.no_grad():  # f(c·x) = f(x) as eps -> 0, evaluated (a copy: running stats untouched)
                invariant = max_err(tiny(2.5 * z), tiny(z)) < 1e-9 * float(tiny(z).abs().max().clamp(min=1))
            assert bool(flags[name][k]) == invariant, (mode, name, k)
            label = probe.edges[e].op_names[k]
            if not invariant:
                assert label not in deviation[name]
            elif (e, k) in inputs:
                norm, v = inputs[(e, k)]
                dims = {nn.BatchNorm2d: (0, 2, 3), nn.GroupNorm: None, nn.LayerNorm: (1, 2, 3)}[type(norm)]
                var = (v.reshape(B, norm.num_groups, -1).var(-1, unbiased=False) if dims is None
                       else v.var(dims, unbiased=False))
                want = float((norm.eps / (var + norm.eps)).max())
                assert abs(deviation[name][label] - want) <= 1e-12 * want, (name, label)
            else:
                assert deviation[name][label] == 0.0  # the zero op: J = 0 exactly


# --- defects found by this audit: each test fails without its fix ------------------------------------------------

def test_path_split_of_nodes_accumulated_in_place_equals_the_taps():
    """`s = edge(...); s += edge(...)` gives the first edge's output another grad_fn; the split must still
    differentiate through that edge alone (before: 'backward through the graph a second time')."""
    order = {2: [0, 1], 3: [4, 2, 3], 4: [6, 7, 5]}  # 2 -> 4 first, then 3 -> 4, whose input depends on node 2
    net = make_net(tied=False, inplace_order=order)
    ref_net = copy.deepcopy(net)
    x, y = data()
    W0, W1 = leaves(net)
    probe = nasdiag.attach(net, path_split=True)
    with probe.record():
        F.cross_entropy(net(x, W0, W1), y).backward()
    costs, parts = probe.costs(), probe.path_costs()
    for c, e, name in names():
        assert max_err(costs[name], (W0, W1)[c][e].grad) < 1e-13
        if parts[name]:
            assert max_err(sum(parts[name].values()), costs[name]) < 1e-13, name
    for (d, e), grad in tap_reference(ref_net, x, y, W0, W1, "mean").items():
        assert max_err(parts[f"cell0.edges.{d}"][f"cell0.edges.{e}"], grad) < 1e-13, (d, e)


class KeywordMixed(nn.Module):
    def __init__(self, scale=1.0):
        super().__init__()
        self._ops = nn.ModuleList([Zero(), nn.Identity(), nn.Conv2d(2, 2, 1, bias=False)])
        self.scale = scale

    def forward(self, x, w):  # the weights go by `w`, not `weights`
        return self.scale * sum(w[k] * op(x) for k, op in enumerate(self._ops))


class KeywordNet(nn.Module):
    def __init__(self, scale=1.0):
        super().__init__()
        self.mixed = KeywordMixed(scale)
        self.head = nn.Linear(2, N_CLS)

    def forward(self, x, w):
        return self.head(self.mixed(x, w=w).mean((2, 3)))


def test_weights_passed_by_the_forwards_own_keyword_are_seen():
    x, y = data()
    torch.manual_seed(0)
    net = KeywordNet().double()
    probe = nasdiag.attach(net, statistics="sampled")
    for k in (1, 2, 2):
        w = F.one_hot(torch.tensor(k), 3).double().requires_grad_()
        with probe.record():
            F.cross_entropy(net(x, w), y).backward()
        assert max_err(probe.costs()["mixed"], w.grad) < 1e-14
    assert probe.statistics()["cost/edges/count"].tolist() == [[0, 1, 2]]  # before: [[0, 0, 0]]
    torch.manual_seed(0)
    scaled = KeywordNet(scale=2.0).double()  # not Σ_k w_k op_k(x): its costs would be half of ∂L/∂w
    probe = nasdiag.attach(scaled)
    with pytest.raises(ProbeError, match="not Σ_k w_k·op_k"):
        with probe.record():
            F.cross_entropy(scaled(x, torch.full((3,), 1 / 3, dtype=torch.float64)), y).backward()
    assert_no_module_hooks(scaled)


def test_sampled_statistics_without_weights_in_a_forward_is_one_line():
    net = make_net(tied=False)
    x, y = data()
    W0, W1 = leaves(net)
    own = net.cell0.edges[3]  # a mixed op falling back on weights of its own when given none
    own.forward = lambda x, weights=None: Mixed.forward(own, x, torch.full((3,), 1 / 3, dtype=x.dtype)
                                                          if weights is None else weights)
    probe = nasdiag.attach(net, statistics="sampled")
    W0[3] = None  # such a forward cannot say which op was sampled (before: never observed, silently)
    with pytest.raises(ProbeError, match="statistics='sampled' needs the mixing weights"):
        with probe.record():
            net(x, W0, W1)
    assert_no_module_hooks(net)


@pytest.mark.parametrize("off", [torch.no_grad, torch.inference_mode])
def test_an_evaluation_forward_inside_the_block_is_left_alone(off):
    """Before: an inference_mode forward inside probe.record() raised torch's 'Inference tensors do not track
    version counter' from the probe's hook, a forward that runs fine without the probe."""
    net = make_net(tied=False).eval()
    x, y = data()
    W0, W1 = leaves(net)
    probe = nasdiag.attach(net)
    with probe.record():
        with off():
            net(x, W0, W1)  # e.g. validation accuracy
        F.cross_entropy(net(x, W0, W1), y).backward()
    for c, e, name in names():
        assert max_err(probe.costs()[name], (W0, W1)[c][e].grad) < 1e-13
    with pytest.warns(RuntimeWarning, match="grad mode off"):
        with probe.record(), off():
            net(x, W0, W1)
    assert all(torch.isnan(v).all() for v in probe.costs().values())
    assert_no_module_hooks(net)


def test_a_model_on_the_meta_device_is_one_probe_error_line():
    with torch.device("meta"):
        net = Net(tied=False)
        x = torch.randn(B, 2, HW, HW)
        W = [[torch.full((len(m._ops),), 0.5, requires_grad=True) for m in cell.edges] for cell in (net.cell0, net.cell1)]
    probe = nasdiag.attach(net)  # attaching is fine (the model may be materialized later)
    with pytest.raises(ProbeError, match="meta device") as err:
        with probe.record():
            net(x, *W)
    assert "\n" not in str(err.value)
    assert_no_module_hooks(net)


def test_a_cell_type_with_a_different_op_set_per_edge_is_probed_edge_by_edge():
    """Before: attach refused ('α cannot be shared'), although every cost is defined."""
    net = make_net(cell_type="normal")
    x, y = data()
    W0, W1 = leaves(net)
    probe = nasdiag.attach(net, path_split=True)
    assert [g.name for g in probe.groups] == [name for _, _, name in names()]  # the per-edge fallback
    with probe.record():
        F.cross_entropy(net(x, W0, W1), y).backward()
    for c, e, name in names():
        assert max_err(probe.costs()[name], (W0, W1)[c][e].grad) < 1e-13
        assert probe.statistics()[f"cost/{name}/count"].tolist() == [[1] * len(W0[e])]


def test_micro_batches_accumulated_in_one_block_keep_each_samples_row():
    """Gradient accumulation over 3 forwards + backwards: before, the (2, K) rows of different micro-batches
    were added up as if they were the same samples."""
    net = make_net()
    x, y = data(b=6)
    Z = leaves(net, per_sample=6)  # ∂L/∂Z_bk is then the reference row of sample b
    probe = nasdiag.attach(net)
    with probe.record():
        for part in range(3):
            rows = slice(2 * part, 2 * part + 2)
            W0, W1 = ([w[rows] for w in Zc] for Zc in Z)
            F.cross_entropy(net(x[rows], W0, W1), y[rows], reduction="sum").backward()
    per_sample = probe.costs(per_sample=True)
    for c, e, name in names():
        assert per_sample[name].shape == Z[c][e].shape == (6, len(net.cell0.edges[e]._ops))
        assert max_err(per_sample[name], Z[c][e].grad) < 1e-13, name
        assert max_err(probe.costs()[name], Z[c][e].grad.sum(0)) < 1e-13


def test_nan_of_an_edge_the_backward_never_reached_has_the_models_dtype():
    class Unused(Net):
        def forward(self, x, W0, W1):
            s = self.stem(x)
            self.cell1(s, s, W1)  # its output never reaches the loss
            return self.head(self.cell0(s, s, W0).mean((2, 3)))

    torch.manual_seed(0)
    net = Unused(tied=False).double()
    x, y = data()
    W0, W1 = leaves(net)
    probe = nasdiag.attach(net)
    with pytest.warns(RuntimeWarning, match="backward never reached 8 edge"):
        with probe.record():
            F.cross_entropy(net(x, W0, W1), y).backward()
    rows = probe.costs(per_sample=True)
    assert rows["cell1.edges.0"].dtype == torch.float64 and torch.isnan(rows["cell1.edges.0"]).all()
    with pytest.warns(RuntimeWarning, match="no gradient reached the output"):
        out = probe.output_costs(per_sample=True)
    assert out["cell1"][2].dtype == torch.float64
    assert probe.statistics()["cost/cell1.edges.0/count"].tolist() == [[0, 0, 0]]


# --- hooks are removed on every path, memory stays flat, misuse is one line ------------------------------------

class Boom(Exception):
    pass


def _raise_in_candidate(net):
    def hook(m, a, o):
        raise Boom("in forward")
    return net.cell0.edges[4]._ops[2].register_forward_hook(hook)


def _raiser(exc):
    def hook(grad):
        raise exc("in backward")
    return hook


@pytest.mark.parametrize("where", ["forward", "backward", "keyboard", "generator"])
def test_hooks_are_removed_on_every_exit_path_and_the_next_step_is_exact(where):
    net = make_net(tied=False)
    x, y = data()
    W0, W1 = leaves(net)
    probe = nasdiag.attach(net, path_split=True, norm_deviation=True, hessian="approx")
    if where == "generator":
        def steps():
            with probe.record():
                out = net(x, W0, W1)
                yield out
                F.cross_entropy(out, y).backward()
        gen = steps()
        next(gen)
        gen.close()  # GeneratorExit inside the block
    else:
        exc = {"forward": Boom, "backward": Boom, "keyboard": KeyboardInterrupt}[where]
        handle = _raise_in_candidate(net) if where == "forward" else None
        try:
            with pytest.raises(exc):
                with probe.record():
                    out = net(x, W0, W1)
                    out.register_hook(_raiser(exc))
                    F.cross_entropy(out, y).backward()
        finally:
            if handle is not None:
                handle.remove()
    assert_no_module_hooks(net)
    with pytest.raises(ProbeError, match="no completed recorded step"):
        probe.costs()
    W0, W1 = leaves(net)
    with probe.record():
        F.cross_entropy(net(x, W0, W1), y).backward()
    for c, e, name in names():
        assert max_err(probe.costs()[name], (W0, W1)[c][e].grad) < 1e-13
    assert_no_module_hooks(net)


class TinyCell(nn.Module):
    """Two intermediate nodes, 3 edges, on (B, 2, 2, 2) maps: cheap enough for 200 steps."""

    edge_nodes = [(0, 1), (0, 2), (1, 2)]
    output_nodes = (1, 2)
    output_node_slices = {1: (0, 2), 2: (2, 4)}

    def __init__(self):
        super().__init__()
        conv = lambda: nn.Sequential(nn.Conv2d(2, 2, 1, bias=False), nn.BatchNorm2d(2))  # noqa: E731
        self.edges = nn.ModuleList(Mixed([nn.Identity(), conv()]) for _ in self.edge_nodes)

    def forward(self, x, w):
        n1 = self.edges[0](x, w[0])
        return torch.cat([n1, self.edges[1](x, w[1]) + self.edges[2](n1, w[2])], 1)



def test_the_path_split_leaves_other_hooks_alone():
    """Before: the split ran a nested autograd.grad inside the backward, which fired every hook between an edge's
    output and its input with a partial gradient: a second probe added a spurious cost, and a retain_grad on a
    node (here node 1, the input of edge 1 -> 2) was overwritten."""
    torch.manual_seed(0)
    cell = TinyCell().double()
    x = torch.randn(2, 2, 2, 2, dtype=torch.float64)
    alpha = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    node1 = {}

    def keep(m, args, out):
        out.retain_grad()
        node1["x"] = out

    def step(*probes):
        w = torch.softmax(alpha, -1).requires_grad_()
        handle = cell.edges[0].register_forward_hook(keep)
        try:
            with contextlib.ExitStack() as stack:
                for p in probes:
                    stack.enter_context(p.record())
                (cell(x, w) ** 2).sum().backward()
        finally:
            handle.remove()
        return w.grad, node1["x"].grad

    w_ref, node_ref = step()
    split, plain = nasdiag.attach(cell, path_split=True), nasdiag.attach(cell)
    w_grad, node_grad = step(split, plain)
    assert torch.equal(node_grad, node_ref) and torch.equal(w_grad, w_ref)
    for probe in (split, plain):
        for i, name in enumerate(probe.edge_names):
            assert max_err(probe.costs()[name], w_ref[i]) < 1e-13, name
    parts = split.path_costs()["edges.0"]
    assert max_err(parts["output"] + parts["edges.2"], w_ref[0]) < 1e-13
    assert_no_module_hooks(cell)


def test_no_tensor_is_kept_across_200_steps_with_every_option():
    torch.manual_seed(0)
    cell = TinyCell().double()
    x = torch.randn(2, 2, 2, 2, dtype=torch.float64)
    alpha = torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
    probe = nasdiag.attach(cell, path_split=True, norm_deviation=True)

    def step():
        alpha.grad = None
        with probe.record():
            (cell(x, torch.softmax(alpha, -1)) ** 2).sum().backward()
        probe.costs(per_sample=True), probe.path_costs(), probe.output_costs(), probe.invariance_deviation()
        probe.statistics()

    for _ in range(5):
        step()
    before = live_tensors()
    for _ in range(200):
        step()
    assert live_tensors() <= before
    assert probe.statistics()["cost/edges/count"].min() == 205
    assert_no_module_hooks(cell)


def test_misuse_is_one_nasdiag_error_line():
    net = make_net(tied=False)
    x, y = data()
    W0, W1 = leaves(net)
    for bad in ({"a": net.stem}, {"a": (net.cell0.edges[0], [net.stem])}, {"a": "cell0.edges.0"}, ["cell0.edges.0"],
                {"a": net.cell0.edges[0], "b": net.cell0.edges[0]},
                {"a": (net.cell0.edges[0], [net.cell0.edges[0], *net.cell0.edges[0]._ops[1:]])}):  # before: accepted,
        # then its cost was NaN with a warning that the candidate "did not run"
        with pytest.raises(NasdiagError) as err:
            nasdiag.attach(net, edges=bad)
        assert "\n" not in str(err.value)
    probe = nasdiag.attach(net)
    with pytest.raises(ProbeError, match="cannot be nested"):
        with probe.record():
            with probe.record():
                pass
    assert_no_module_hooks(net)
    block = probe.record()  # one block object entered at every step (before: contextlib's AttributeError 'args')
    for step in range(2):
        W0, W1 = leaves(net, seed=10 + step)
        with block as entered:
            F.cross_entropy(net(x, W0, W1), y).backward()
        assert entered is probe and probe.steps_recorded == step + 1
        assert max_err(probe.costs()["cell1.edges.4"], W1[4].grad) < 1e-13
    with pytest.raises(ProbeError, match="cannot be nested"):
        with block:
            with block:
                pass
    assert_no_module_hooks(net)
    W0, W1 = leaves(net)
    # detached weights are fine: the costs are ∂L/∂Z at those values, as for a leaf holding them
    with probe.record():
        F.cross_entropy(net(x, [w.detach() for w in W0], [w.detach() for w in W1]), y).backward()
    F.cross_entropy(net(x, W0, W1), y).backward()
    for c, e, name in names():
        assert max_err(probe.costs()[name], (W0, W1)[c][e].grad) < 1e-13
    assert not math.isnan(float(probe.costs()["cell0.edges.0"][1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        probe.statistics()
