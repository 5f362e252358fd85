"""Cost audit round 9: the wiring paper's cost C(Z) = ∂L/∂Z = <∂L/∂x_j, O(x_i)> (supplement §2, §2.1–2.2) under each
search method's own forward, and Thm. 1 / Cor. 1.2 across BatchNorm modes, LayerNorm and GroupNorm, on supernets
written from scratch here in float64. References: a functional re-implementation of nasdiag's DARTS supernet
(``_reference_logits``: F.conv2d / F.batch_norm / F.max_pool2d ... on the module's parameters, the DAG wired here) with
leaf mixing weights Z and plain autograd for ∂L/∂Z; numpy for the streaming moments; never nasdiag against nasdiag.

Defects found (each test fails without its fix):

* A probe passed to a search method (``probe=``) recorded every forward of ``SearchMethod.cost``, also those that are
  not cost observations (``observe=False``): under ProxylessNAS it recorded the w step (search-train batch, one gated
  path) besides the α step, so ``probe.steps_recorded`` was twice the steps and its ``cost/*/count`` and E[C] mixed
  the two batches, where the method's own statistics (and every other method's probe) hold only the α step's costs
  (test_a_probe_on_proxylessnas_records_the_alpha_steps_costs_only).
* A probe with ``statistics="sampled"`` on a DARTS-code supernet adapted by ``nasdiag.search.supernet.adapt`` stopped
  ProxylessNAS's α step in a size-mismatch RuntimeError traceback: the adapter's pre-hook, placed before the probe's,
  handed the mixed op (and so the probe) the entries of Z of the active ops only, which the probe took for the (K,)
  weights (a DSNAS one-op row broadcast over K by luck); the shortening now runs after every other pre-hook
  (test_a_probe_on_an_adapted_darts_code_supernet_sees_the_full_mixing_weights_of_a_two_path_step).
* docs/probe.md claimed Cor. 1.2 (a non-last cell's output-edge costs sum to 0) for every cell, and listed "BatchNorm in
  eval mode" as not invariant without the exception: in eval mode a BatchNorm with running statistics is an affine map,
  the preprocessing is not scale-invariant and the sum is not 0 (a counterexample below), while one with
  ``track_running_stats=False`` keeps batch statistics and the corollary (test_cor_1_2_holds_in_train_mode_and_for_norms
  _with_batch_or_sample_statistics_and_fails_in_eval_mode_as_the_docs_say).

Checked and right: the cost service of darts, snas (Gumbel-softmax Z), dsnas (one-hot Z, only the sampled op run),
proxyless (binary gates, two paths run), xnas (also after wipeouts: alive ops only) and bayesnas equals the
reference's ∂L/∂Z at the weights and active ops the forward used (1e-13 relative), and their
cost/<cell>/{mean,var,count} equal numpy's masked moments of the reference costs (a probe's costs too, checked by
hand); a ``nasdiag search`` run (dsnas, snas; float64, digits) resumed from its epoch-1 checkpoint and replayed step by
step gives the recorded epoch-2 cost rows to 4e-16 and the per-step arch and sample rows exactly (a manual replay, too
slow for this file); darts2's and sparsenas's observed costs at the unrolled w' = w − ξ(∇L_train + μb + λw), rebuilt
by hand, to 2e-15; the adapted DARTS code under darts, snas, dsnas, proxyless and xnas with a probe (costs, path parts
summing to the costs, hooks and ``_ops`` restored after a forward raising halfway, the next step right); the fast
engine's costs against the reference for every stacking order, norm and affine setting (relu-conv-bn with an
affine-free InstanceNorm is §8.1's exact zero); edge names, edge indices and node pairs of a cell whose edge list is
not in DARTS order; costs of an edge whose output feeds two nodes, and the path split's one-line refusal there; a node
with a single incoming edge; LayerNorm and GroupNorm cells; 2000 probed steps keep no tensor.
"""

import gc
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import assert_no_module_hooks, live_tensors

import nasdiag
from nasdiag.probe.discovery import ProbeError
from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network

DT = torch.float64
DOCS = Path(__file__).resolve().parents[1] / "docs"
PRIMS = ("none", "skip_connect", "max_pool_3x3", "avg_pool_3x3", "sep_conv_3x3", "dil_conv_3x3")


# -- an independent functional forward of nasdiag's DARTS supernet ------------------------------------------------
def _layer(m, x):
    """One module of the supernet, computed with torch.nn.functional on its parameters (train-mode statistics)."""
    kind = type(m).__name__
    if kind == "Sequential":
        for child in m:
            x = _layer(child, x)
        return x
    if kind == "ReLU":
        return F.relu(x)
    if kind == "Conv2d":
        return F.conv2d(x, m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups)
    if kind == "BatchNorm2d":
        return F.batch_norm(x, None, None, m.weight, m.bias, True, 0.0, m.eps)
    if kind == "MaxPool2d":
        return F.max_pool2d(x, 3, m.stride, 1)
    if kind == "AvgPool2d":
        return F.avg_pool2d(x, 3, m.stride, 1, count_include_pad=False)
    if kind == "Identity":
        return x
    if kind == "Zero":
        return torch.zeros_like(x[:, :, :: m.stride, :: m.stride])
    if kind == "FactorizedReduce":  # relu-conv-bn order: relu, two offset stride-2 1x1 convs, concatenated, norm
        x = F.relu(x)
        out = torch.cat([_layer(m.conv_1, x), _layer(m.conv_2, x[:, :, 1:, 1:])], 1)
        return _layer(m.norm, out)
    raise TypeError(f"the functional reference has no rule for {kind}: write one above before using it")


def _reference_logits(net, x, per_cell, active=None):
    """Logits at per-cell mixing weights (E, K); ``active``: per-cell (E, K) bool of the ops computed, or None."""
    s0 = s1 = _layer(net.stem, x)
    for k, cell in enumerate(net.cells):
        states = [_layer(cell.preprocess0, s0), _layer(cell.preprocess1, s1)]
        e = 0
        for j in range(2, 2 + cell.steps):  # node j = Σ_{i<j} Σ_k Z_ijk O_k(x_i)
            node = 0
            for i in range(j):
                for o, op in enumerate(cell.edges[e].ops):
                    if active is None or bool(active[k][e, o]):
                        node = node + per_cell[k][e, o] * _layer(op, states[i])
                e += 1
            states.append(node)
        s0, s1 = s1, torch.cat(states[-cell.multiplier:], 1)
    return F.linear(s1.mean((2, 3)), net.classifier.weight, net.classifier.bias)


def _reference_costs(net, x, y, per_cell, active=None):
    """Autograd's ∂L/∂Z per cell (mean cross-entropy) through the reference forward."""
    leaves = [w.detach().clone().requires_grad_(True) for w in per_cell]
    loss = F.cross_entropy(_reference_logits(net, x, leaves, active), y)
    return list(torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True))


def _supernet(seed=1):
    torch.manual_seed(seed)
    return Network.minimal(4, 3, 3, in_channels=1, primitives=PRIMS).to(DT)


def _batch(seed, B=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, 8, 8, generator=g, dtype=DT), torch.randint(0, 3, (B,), generator=g)


def _masked_moments(rows):
    """numpy mean, population variance and count over (value (E, K), mask (E, K)) observations."""
    values, masks = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    count = masks.sum(0)
    mean = np.where(count > 0, (values * masks).sum(0) / np.maximum(count, 1), np.nan)
    var = np.where(count > 0, ((values - np.nan_to_num(mean)) ** 2 * masks).sum(0) / np.maximum(count, 1), np.nan)
    return mean, var, count


# -- the cost service under each method's forward ---------------------------------------------------------------
#: XNAS with rates that wipe experts out from its second step on (its forwards then compute the alive ones only)
WIPING = {"reward_bound": 0.001, "lr_scale": 3000.0, "zeta": 0.01}


@pytest.mark.parametrize("method, hp", [("darts", {}), ("snas", {}), ("dsnas", {}), ("proxyless", {}), ("xnas", {}),
                                        ("xnas", WIPING), ("bayesnas", {})])
def test_each_methods_costs_and_cost_statistics_equal_the_reference_dL_dZ_of_the_weights_its_forward_used(method, hp,
                                                                                                          monkeypatch):
    from nasdiag.search.base import SearchMethod

    net = _supernet()
    M = get_method(method)
    m = M(net, M.Hyperparameters(**hp), schedule=Schedule(epochs=2, steps_per_epoch=3, batch_size=6), seed=3)
    original, errors, seen = SearchMethod.cost, [], {t: [] for t in net.cell_types}

    def checked(self, x, y, weights, *, active=None, train_weights=False, observe=True, observed=None):
        per_w = [weights[c.cell_type] for c in net.cells]
        per_a = None if active is None else [active[c.cell_type].bool() for c in net.cells]
        ref = _reference_costs(net, x, y, per_w, per_a)  # at w before the step's updates
        result = original(self, x, y, weights, active=active, train_weights=train_weights, observe=observe,
                          observed=observed)
        scale = max(float(r.abs().max()) for r in ref)
        errors.append(max(float((r - g).abs().max()) for r, g in zip(ref, result.per_cell)) / scale)
        if observe:  # the ops whose costs enter the statistics: `observed` (BayesNAS's alive ops), else `active`
            per_o = per_a if observed is None else [observed[c.cell_type].bool() for c in net.cells]
            for k, c in enumerate(net.cells):
                mask = np.ones(tuple(ref[k].shape), bool) if per_o is None else per_o[k].numpy()
                seen[c.cell_type].append((ref[k].numpy(), mask))
        return result

    monkeypatch.setattr(SearchMethod, "cost", checked)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(3):
            m.step(_batch(10 * s), _batch(10 * s + 1))
    stats = m.diagnostics()
    assert errors and max(errors) < 1e-13, errors
    if hp:  # the wiping rates did wipe experts out: some ops were not computed, and are not observed
        assert any(not mask.all() for rows in seen.values() for _, mask in rows)
    for t, rows in seen.items():
        mean, var, count = _masked_moments(rows)
        np.testing.assert_array_equal(stats[f"cost/{t}/count"].numpy(), count)
        np.testing.assert_allclose(stats[f"cost/{t}/mean"].numpy(), mean, rtol=1e-10, atol=1e-13 * np.nanmax(np.abs(mean)))
        np.testing.assert_allclose(stats[f"cost/{t}/var"].numpy(), var, rtol=1e-9, atol=1e-13 * np.nanmax(var))


def test_a_probe_on_proxylessnas_records_the_alpha_steps_costs_only():
    """ProxylessNAS's w step (search-train batch, one gated path, ``cost(observe=False)``) is no cost observation:
    the probe records the α step alone, as the method's own statistics do; its costs are ∂L/∂g at the binary gates
    of the α step for the two paths it ran, NaN for the paths it did not run."""
    net = _supernet()
    probe = nasdiag.attach(net)
    M = get_method("proxyless")
    m = M(net, M.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=3, batch_size=6), seed=3, probe=probe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the paths not sampled did not run: a warning per step, documented
        for s in range(3):
            val = _batch(10 * s + 1)
            stats = m.step(_batch(10 * s), val)
    assert probe.steps_recorded == 3
    ours = m.diagnostics()
    for t in net.cell_types:
        np.testing.assert_array_equal(probe.statistics()[f"cost/{t}/count"], ours[f"cost/{t}/count"].numpy())
    gates = [stats[f"sample/{c.cell_type}/onehot"] for c in net.cells]
    pairs = [stats[f"sample/{c.cell_type}/paths"].bool() for c in net.cells]
    ref = _reference_costs(net, *val, gates, pairs)  # the α step does not move w
    _assert_two_path_costs(probe, pairs, ref)


def _assert_two_path_costs(probe, pairs, ref):
    """Costs of the ops a two-path step ran equal the reference (1e-12 relative); the ops it did not run are NaN."""
    costs = probe.costs()
    for e in probe.edges:
        on = pairs[e.cell_index][e.edge_index]
        got, want = costs[e.name], ref[e.cell_index][e.edge_index]
        assert torch.isnan(got[~on]).all(), e.name
        assert (got[on] - want[on]).abs().max() <= 1e-12 * max(float(want.abs().max()), 1e-12), e.name


def test_a_probe_on_an_adapted_darts_code_supernet_sees_the_full_mixing_weights_of_a_two_path_step():
    """``adapt`` computes only the active ops by handing the mixed op its active candidates and their entries of Z;
    a probe with ``statistics="sampled"`` read that shortened row as the (K,) weights and the ProxylessNAS α step
    stopped in "The size of tensor a (8) must match the size of tensor b (2)". The probe sees the (K,) row: costs
    equal the reference for the two paths run, NaN for the rest, and "sampled" counts the gated op."""
    from test_foreign_supernet import PRIMITIVES, batch, darts_model

    from nasdiag.search.supernet import adapt

    model = darts_model(0)
    net = adapt(model, primitives=PRIMITIVES)
    probe = nasdiag.attach(net, statistics="sampled")
    M = get_method("proxyless")
    m = M(net, M.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=6), seed=3, probe=probe)
    counts = {t: 0 for t in net.cell_types}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the paths not sampled did not run: a warning per step, documented
        for s in range(2):
            val = batch(10 * s + 1)
            stats = m.step(batch(10 * s), val)
            for cell in net.cells:
                counts[cell.cell_type] = counts[cell.cell_type] + stats[f"sample/{cell.cell_type}/onehot"].numpy()
    for t in net.cell_types:
        np.testing.assert_array_equal(probe.statistics()[f"cost/{t}/count"], counts[t])
    # reference: Z as leaves, fed to the DARTS model's own mixed ops by pre-hooks written here; ops off the pair
    # weighed by 0 (their ∂L/∂Z is not compared)
    gates = [stats[f"sample/{c.cell_type}/onehot"] for c in net.cells]
    pairs = [stats[f"sample/{c.cell_type}/paths"].bool() for c in net.cells]
    leaves = [g.clone().requires_grad_(True) for g in gates]
    handles = [mixed.register_forward_pre_hook(lambda mod, args, k=k, e=e: (args[0], leaves[k][e] * pairs[k][e]))
               for k, c in enumerate(net.cells) for e, mixed in enumerate(c.module._ops)]
    try:
        ref = torch.autograd.grad(F.cross_entropy(model(val[0]), val[1]), leaves)
    finally:
        for h in handles:
            h.remove()
    _assert_two_path_costs(probe, pairs, ref)
    assert_no_module_hooks(model)


# -- Thm. 1 / Cor. 1.2 across normalization modes, on a cell written here ------------------------------------------
C = 3


def _norm(kind, eps):
    return {"batch": lambda: nn.BatchNorm2d(C, eps=eps, dtype=DT),
            "batch_affine": lambda: nn.BatchNorm2d(C, eps=eps, affine=True, dtype=DT),
            "batch_no_running": lambda: nn.BatchNorm2d(C, eps=eps, track_running_stats=False, dtype=DT),
            "layer": lambda: nn.LayerNorm([C, 6, 6], eps=eps, dtype=DT),
            "group": lambda: nn.GroupNorm(3, C, eps=eps, dtype=DT)}[kind]()


class R9Mixed(nn.Module):
    def __init__(self, kind, eps):
        super().__init__()
        self._ops = nn.ModuleList([
            nn.Identity(),
            nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, 1, 1, bias=False, dtype=DT), _norm(kind, eps)),
            nn.Sequential(nn.AvgPool2d(3, 1, 1), _norm(kind, eps)),
        ])

    def forward(self, x, w):
        return sum(wk * op(x) for wk, op in zip(w, self._ops))


class R9Cell(nn.Module):
    """Edges listed out of DARTS order; node 4 has a single incoming edge; with ``shared_edge`` the output of edge
    (1, 3) is added to node 4 too (an edge feeding two nodes)."""

    cell_type = "normal"
    edge_nodes = [(1, 3), (0, 2), (2, 3), (2, 4), (1, 2)]
    output_nodes = [3, 4]
    output_node_slices = {3: (0, C), 4: (C, 2 * C)}

    def __init__(self, kind, eps, shared_edge=False):
        super().__init__()
        self.shared_edge = shared_edge
        self.pre0 = nn.Sequential(nn.ReLU(), nn.Conv2d(2 * C, C, 1, bias=False, dtype=DT), _norm(kind, eps))
        self.pre1 = nn.Sequential(nn.ReLU(), nn.Conv2d(2 * C, C, 1, bias=False, dtype=DT), _norm(kind, eps))
        self.edges = nn.ModuleList(R9Mixed(kind, eps) for _ in self.edge_nodes)

    def forward(self, s0, s1, W):
        x0, x1 = self.pre0(s0), self.pre1(s1)
        x2 = self.edges[1](x0, W[1]) + self.edges[4](x1, W[4])
        e13 = self.edges[0](x1, W[0])
        x3 = e13 + self.edges[2](x2, W[2])
        x4 = self.edges[3](x2, W[3]) + (e13 if self.shared_edge else 0)
        return torch.cat([x3, x4], 1)


class R9Net(nn.Module):
    def __init__(self, kind, eps=1e-12, shared_edge=False):
        super().__init__()
        self.stem = nn.Conv2d(1, 2 * C, 3, padding=1, bias=False, dtype=DT)
        self.cells = nn.ModuleList([R9Cell(kind, eps, shared_edge), R9Cell(kind, eps, shared_edge)])
        self.fc = nn.Linear(2 * C, 4, bias=False, dtype=DT)

    def forward(self, x, Ws):
        s0 = s1 = self.stem(x)
        for cell, W in zip(self.cells, Ws):
            s0, s1 = s1, cell(s0, s1, W)
        return self.fc(s1.mean((2, 3)))


def _leaves(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(torch.randn(5, 3, generator=g, dtype=DT), -1).requires_grad_(True) for _ in range(2)]


def _r9_batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(5, 1, 6, 6, generator=g, dtype=DT), torch.randint(0, 4, (5,), generator=g)


def _output_cost_sum(kind, mode):
    torch.manual_seed(0)
    net = R9Net(kind)
    x, y = _r9_batch()
    net.train()
    with torch.no_grad():
        net(x * 2 + 1, _leaves(1))  # running statistics unlike this batch's
    net.train(mode == "train")
    probe = nasdiag.attach(net)
    W = _leaves(2)
    with probe.record():
        loss = F.cross_entropy(net(x, W), y)
        loss.backward()
    costs = probe.costs()
    assert max(float((costs[e.name] - W[e.cell_index].grad[e.edge_index]).abs().max()) for e in probe.edges) < 1e-15
    first = probe.output_costs()["cells.0"]
    return float(sum(first.values())), float(loss.detach()), bool(probe.scale_invariant_ops()["cells.0.edges.0"][1])


@pytest.mark.parametrize("kind", ["batch", "batch_affine", "batch_no_running", "layer", "group"])
def test_cor_1_2_holds_in_train_mode_and_for_norms_with_batch_or_sample_statistics_and_fails_in_eval_mode_as_the_docs_say(kind):
    for mode in ("train", "eval"):
        total, loss, invariant = _output_cost_sum(kind, mode)
        running = kind in ("batch", "batch_affine") and mode == "eval"  # an affine map: not scale-invariant
        assert invariant is not running, (kind, mode)
        if running:
            assert abs(total) > 1e-4 * loss, (kind, mode, total)  # the counterexample: Cor. 1.2 does not hold
        else:
            assert abs(total) < 1e-10 * loss, (kind, mode, total)  # 0 as eps → 0 (eps = 1e-12)
    text = " ".join((DOCS / "probe.md").read_text().split())
    cor = text[text.index("Cor. 1.2: in every cell"):]
    cor = cor[:cor.index("Thm. 2:")]
    assert "eval mode" in cor and "running statistics" in cor, cor
    flagged = text[text.index("**Which ops are flagged.**"):text.index("**The deviation at the real eps.**")]
    assert re.search(r"BatchNorm in eval mode with running statistics", flagged), flagged


def test_names_indices_and_node_pairs_follow_the_cells_own_edge_list_and_a_shared_edge_output_is_costed():
    torch.manual_seed(0)
    net = R9Net("batch", 1e-5, shared_edge=True)
    x, y = _r9_batch()
    probe = nasdiag.attach(net)
    assert [(e.name, e.cell_index, e.edge_index, e.src, e.dst) for e in probe.edges[:5]] == [
        (f"cells.0.edges.{i}", 0, i, *pair) for i, pair in enumerate(R9Cell.edge_nodes)]
    W = _leaves(3)
    with probe.record():
        F.cross_entropy(net(x, W), y).backward()
    costs = probe.costs()
    for e in probe.edges:  # (1, 3) feeds nodes 3 and 4: its cost is still ∂L/∂Z, rows in the cell's own order
        torch.testing.assert_close(costs[e.name], W[e.cell_index].grad[e.edge_index], rtol=1e-12, atol=1e-16)
    rows = probe.statistics()["cost/normal/mean"]
    np.testing.assert_allclose(rows, np.stack([w.grad.numpy() for w in W]).mean(0), rtol=1e-12, atol=1e-16)
    split = nasdiag.attach(net, path_split=True)
    with pytest.raises(ProbeError, match=r"edge .cells\.[01]\.edges\.0.: path_split needs node 3 .*plain sum") as err:
        with split.record():
            F.cross_entropy(net(x, _leaves(4)), y).backward()
    assert "\n" not in str(err.value)
    assert_no_module_hooks(net)


def test_a_node_with_a_single_edge_splits_its_cost_exactly():
    """Node 4 has one incoming edge (2, 4): its cost goes to the output alone; the cost of edge (0, 2) splits between
    the two edges leaving node 2. The part through (2, 4) is <J_eᵀ ∂L/∂x_4, O_k(x_0)>, J_eᵀ ∂L/∂x_4 read by autograd
    as the gradient of a copy of x_2 that only edge (2, 4) reads."""
    torch.manual_seed(0)
    net = R9Net("layer", 1e-5)
    x, y = _r9_batch()
    probe = nasdiag.attach(net, path_split=True)
    W = _leaves(5)
    with probe.record():
        F.cross_entropy(net(x, W), y).backward()
    parts = probe.path_costs()
    assert set(parts["cells.0.edges.3"]) == {"output"}
    assert set(parts["cells.0.edges.1"]) == {"cells.0.edges.2", "cells.0.edges.3"}
    cell, Wd = net.cells[0], [w.detach() for w in W]
    s = net.stem(x)
    x0, x1 = cell.pre0(s), cell.pre1(s)
    x2 = cell.edges[1](x0, Wd[0][1]) + cell.edges[4](x1, Wd[0][4])
    copy = x2.detach().requires_grad_(True)
    x3 = cell.edges[0](x1, Wd[0][0]) + cell.edges[2](x2, Wd[0][2])
    out0 = torch.cat([x3, cell.edges[3](copy, Wd[0][3])], 1)
    loss = F.cross_entropy(net.fc(net.cells[1](s, out0, Wd[1]).mean((2, 3))), y)
    (through,) = torch.autograd.grad(loss, copy)
    with torch.no_grad():
        want = torch.stack([(through * op(x0)).sum() for op in cell.edges[1]._ops])
    torch.testing.assert_close(parts["cells.0.edges.1"]["cells.0.edges.3"], want, rtol=1e-10, atol=1e-15)
    total = sum(parts["cells.0.edges.1"].values())
    torch.testing.assert_close(total, W[0].grad[1], rtol=1e-10, atol=1e-15)


@pytest.mark.slow
def test_2000_probed_steps_keep_no_tensor_and_leave_no_hook():
    torch.manual_seed(0)
    net = R9Net("batch", 1e-5)
    x, y = torch.randn(2, 1, 3, 3, dtype=DT), torch.tensor([0, 3])  # small maps: 2000 steps in a few seconds
    probe = nasdiag.attach(net, path_split=True, norm_deviation=True)
    W = _leaves(6)

    def step():
        for w in W:
            w.grad = None
        with probe.record():
            F.cross_entropy(net(x, W), y).backward()
        probe.costs(), probe.path_costs(), probe.output_costs(), probe.invariance_deviation()

    for _ in range(50):
        step()
    gc.collect()
    before, objects = live_tensors(), len(gc.get_objects())
    for _ in range(1950):
        step()
    assert live_tensors() == before
    assert len(gc.get_objects()) <= objects + 50  # one object kept per step would be +1950
    assert int(probe.statistics()["cost/normal/count"].min()) == 2 * 2000
    assert_no_module_hooks(net)
