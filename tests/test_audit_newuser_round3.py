"""Audit round 3 — a new NAS researcher attaching nasdiag to supernets of their own, as the docs say.

Three supernets written here, in float64, that nasdiag has never seen:

* a NAS-Bench-201 cell (4 nodes, an edge for every pair i < j, ops none / skip / ReLU-Conv1x1-BN /
  ReLU-Conv3x3-BN / avg-pool), two cells sharing α, DARTS-convention mixed ops and the node protocol;
* an MLP supernet whose mixed op is the user's own class (candidates in ``cands``, forward ``(h, mix)``), a
  different op set, K and width on every edge, mapped with ``attach(model, edges=...)``;
* a SNAS-style supernet: (B, K) Gumbel-softmax samples per sample and LayerNorm ops.

References are autograd w.r.t. explicit mixing-weight leaves (C = ∂L/∂Z = <∂L/∂x_j, O(x_i)>, wiring supplement
§2.1), and ``torch.autograd.functional.hessian`` of the loss as a function of one edge's Z (or α, Z = softmax(α))
for the exact mixing-weight curvature (bayesnas-appendix C.3's quantity, computed exactly).

Defects found (each test says which): a mapped module that is not a mixed op of the listed candidates (e.g.
``Sequential(Linear, ReLU)`` with ``[Linear]``, or a mixed op listed with some of its candidates) gave silent
costs; ``statistics="sampled"`` refused a user's mixed op whose forward takes the weights as ``(x, w)``, saying
it did not take them.
"""

import math
import pathlib
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.functional import hessian

import nasdiag
from nasdiag.errors import NasdiagError
from nasdiag.probe import ProbeError

from conftest import assert_no_module_hooks, live_tensors

DT = torch.float64
C, HW, B, N_CLS = 3, 4, 4, 3
NB_EDGES = [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
PROBE_DOC = README.parent / "docs" / "probe.md"


class Zero(nn.Module):
    def forward(self, x):
        return x * 0.0


class Mixed(nn.Module):
    """DARTS convention: candidates ``_ops``, forward(x, weights) = Σ_k w_k op_k(x), weights (K,) or (B, K)."""

    def __init__(self, ops):
        super().__init__()
        self._ops = nn.ModuleList(ops)

    def forward(self, x, weights):
        out = 0
        for k, op in enumerate(self._ops):
            w = weights[..., k]
            out = out + (w.reshape(-1, *[1] * (x.dim() - 1)) if w.dim() == 1 else w) * op(x)
        return out


def rcb(k):
    return nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, k, padding=k // 2, bias=False), nn.BatchNorm2d(C))


class NB201Cell(nn.Module):
    """x_j = Σ_{i<j} edge_ij(x_i), j = 1..3; the output is node 3 (NAS-Bench-201)."""

    edge_nodes = NB_EDGES
    output_nodes = (3,)
    cell_type = "normal"

    def __init__(self):
        super().__init__()
        self.output_node_slices = {3: (0, C)}
        self.edges = nn.ModuleList(
            Mixed([Zero(), nn.Identity(), rcb(1), rcb(3), nn.AvgPool2d(3, 1, 1, count_include_pad=False)])
            for _ in NB_EDGES)

    def forward(self, x, Z, override=None):
        nodes = [x]
        for j in (1, 2, 3):
            acc = 0
            for e, (i, d) in enumerate(NB_EDGES):
                if d == j:
                    acc = acc + self.edges[e](nodes[i], override.get(e, Z[e]) if override else Z[e])
            nodes.append(acc)
        return nodes[3]


class NB201Net(nn.Module):
    """stem -> cells (sharing one α (6, 5)) -> GAP -> linear. ``override`` {cell: {edge: Z_e}} (references only)."""

    def __init__(self, cells=2, fail=False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, C, 3, padding=1, bias=False), nn.BatchNorm2d(C))
        self.cells = nn.ModuleList(NB201Cell() for _ in range(cells))
        self.head = nn.Linear(C, N_CLS)
        self.alpha = nn.Parameter(0.3 * torch.randn(len(NB_EDGES), 5))
        self.fail = fail

    def forward(self, x, override=None):
        Z = torch.softmax(self.alpha, -1)
        s = self.stem(x)
        for c, cell in enumerate(self.cells):
            s = cell(s, Z, override.get(c) if override else None)
            if self.fail:  # the user's own forward raises mid-way (after some edges ran)
                raise RuntimeError("user forward failed")
        return self.head(s.mean((2, 3)))


class Scaled(nn.Module):
    """The user's own mixed op: candidates in ``cands``, forward(h, mix) = Σ_k mix_k cand_k(h)."""

    def __init__(self, *ops):
        super().__init__()
        self.cands = nn.ModuleList(ops)

    def forward(self, h, mix):
        return sum(mix[..., k:k + 1] * op(h) for k, op in enumerate(self.cands))


class MLPSuper(nn.Module):
    """Nodes 0 (6) -> 1 (5) -> 2 (5) -> 3 (7), plus 0 -> 2 and 1 -> 3; a different op set and K on every edge."""

    K = {"a01": 3, "a12": 4, "a02": 2, "a23": 3, "a13": 1}

    def __init__(self):
        super().__init__()
        self.a01 = Scaled(nn.Linear(6, 5), nn.Sequential(nn.Linear(6, 5), nn.ReLU()),
                          nn.Sequential(nn.Linear(6, 5, bias=False), nn.Tanh()))
        self.a12 = Scaled(nn.Identity(), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.LayerNorm(5)), Zero())
        self.a02 = Scaled(nn.Sequential(nn.Linear(6, 5), nn.Sigmoid()), nn.Linear(6, 5, bias=False))
        self.a23 = Scaled(nn.Linear(5, 7), nn.Sequential(nn.ReLU(), nn.Linear(5, 7)),
                          nn.Sequential(nn.Linear(5, 7), nn.GELU()))
        self.a13 = Scaled(nn.Linear(5, 7))
        self.head = nn.Linear(7, N_CLS)
        self.logits = nn.ParameterDict({k: nn.Parameter(0.3 * torch.randn(K)) for k, K in self.K.items()})

    def forward(self, x, override=None):
        W = {k: torch.softmax(v, -1) for k, v in self.logits.items()}
        W.update(override or {})
        h1 = self.a01(x, W["a01"])
        h2 = self.a12(h1, W["a12"]) + self.a02(x, W["a02"])
        h3 = self.a23(h2, W["a23"]) + self.a13(h1, W["a13"])
        return self.head(torch.tanh(h3))

    def edge_map(self):
        return {k: (getattr(self, k), list(getattr(self, k).cands)) for k in self.K}


class SNASNet(nn.Module):
    """Sequences (B, 5, 4) through two chained edges with LayerNorm ops; forward(x, Z) with Z (B, 2, K) samples."""

    D = 4

    def __init__(self):
        super().__init__()
        D = self.D
        mk = lambda: Mixed([nn.Sequential(nn.Linear(D, D, bias=False), nn.LayerNorm(D)), nn.Identity(),  # noqa: E731
                            nn.Sequential(nn.ReLU(), nn.Linear(D, D), nn.LayerNorm(D, elementwise_affine=False)), Zero()])
        self.e1, self.e2 = mk(), mk()
        self.alpha = nn.Parameter(0.3 * torch.randn(2, 4))
        self.head = nn.Linear(D, N_CLS)

    def sample(self, b, gen, tau=0.7):
        """SNAS's relaxed sample per sample: softmax((log p + Gumbel) / τ), (B, 2, K), differentiable in α."""
        g = -torch.log(-torch.log(torch.rand(b, 2, 4, generator=gen, dtype=DT)))
        return torch.softmax((torch.log_softmax(self.alpha, -1) + g) / tau, -1)

    def forward(self, x, Z):
        h = self.e1(x, Z[:, 0])
        return self.head((self.e2(h, Z[:, 1]) + h).mean(1))


def nb_net(seed=0, **kw):
    torch.manual_seed(seed)
    return NB201Net(**kw).to(DT)


def image_batch(seed=1, b=B):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, HW, HW, generator=g, dtype=DT), torch.randint(0, N_CLS, (b,), generator=g)


def mlp_batch(seed=3, b=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 6, generator=g, dtype=DT), torch.randint(0, N_CLS, (b,), generator=g)


def err(a, b):
    return float((a - b).abs().max())


# -- the docs, run as a new user pastes them ----------------------------------------------------------------------
def python_blocks(path):
    text = path.read_text()
    return [m.group(1) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def test_readme_and_probe_doc_snippets_run_as_written(tmp_path, monkeypatch):
    """Before: the README's costs, regret and records snippets stopped at NameError (x, y, T, costs, step) and at
    RecordError (meta op_names ``[...]``), and docs/probe.md's loop used an undefined net, loader and recorder.
    Runs them as written, in one session (the README's order), and checks what their comments say."""
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(README)
    wanted = [b for b in blocks if "probe.costs()" in b or "Forecaster(" in b or "Recorder(" in b]
    assert len(wanted) == 3
    ns = {}
    for code in wanted:
        exec(compile(code, str(README), "exec"), ns)
    probe, net = ns["probe"], ns["net"]
    costs, ps = probe.costs(), probe.costs(per_sample=True)
    assert len(costs) == 14 * 3 and all(c.shape == (8,) for c in costs.values())
    assert all(err(ps[n].sum(0), costs[n]) < 1e-6 and ps[n].shape == (8, 8) for n in costs)
    assert ns["record"]["cost/normal/mean"].shape == (1, 14, 8) and ns["record"]["scalars/val_loss"].shape == (1,)
    assert ns["fc"].weights.shape == (14, 8)

    doc = python_blocks(PROBE_DOC)
    assert len(doc) == 2
    ns = {}
    for code in doc:
        exec(compile(code, str(PROBE_DOC), "exec"), ns)
    from nasdiag.record import load

    rec = load(tmp_path / "costs.h5")
    normal_cells = sum(c.cell_type == "normal" for c in ns["probe"].cells)
    logged = rec["valid/cost/normal/count"]  # at each epoch's last step, reset after (round 13), of its 3 steps
    assert list(rec["step"][logged]) == [2, 5] and (rec["cost/normal/count"][logged] == 3 * normal_cells).all()
    assert ns["probe"].edges[0].name == "cells.0.edges.0"


# -- NAS-Bench-201 cell: costs, per-sample rows, paths, statistics, exact curvature ----------------------------------
def nb_leaves(net, per_sample=None):
    Z = torch.softmax(net.alpha.detach(), -1)
    shape = (lambda z: z.expand(per_sample, -1).clone()) if per_sample else (lambda z: z.clone())
    return {c: {e: shape(Z[e]).requires_grad_() for e in range(len(NB_EDGES))} for c in range(len(net.cells))}


def nb_reference(net, x, y, per_sample=None):
    """{edge name: ∂L/∂Z_e} with a leaf Z per cell and edge (per sample: (B, K) leaves of equal rows)."""
    ov = nb_leaves(net, per_sample)
    flat = [(f"cells.{c}.edges.{e}", z) for c, row in ov.items() for e, z in row.items()]
    grads = torch.autograd.grad(F.cross_entropy(net(x, ov), y), [z for _, z in flat])
    return {n: g for (n, _), g in zip(flat, grads)}


def test_nb201_costs_per_sample_rows_paths_and_statistics_equal_autograd():
    net = nb_net()
    probe = nasdiag.attach(net, path_split=True)
    assert [(e.src, e.dst, e.cell_type) for e in probe.edges[:6]] == [(i, j, "normal") for i, j in NB_EDGES]
    steps = []
    for s in range(3):
        x, y = image_batch(seed=10 + s)
        with torch.no_grad():
            net.alpha.add_(0.1 * torch.randn_like(net.alpha))  # α moves between steps, as in a search
        ref, ref_ps = nb_reference(net, x, y), nb_reference(net, x, y, per_sample=B)
        with probe.record():
            F.cross_entropy(net(x), y).backward()
        costs, ps, paths = probe.costs(), probe.costs(per_sample=True), probe.path_costs()
        assert max(err(costs[n], ref[n]) for n in ref) < 1e-14
        assert max(err(ps[n], ref_ps[n]) for n in ref) < 1e-14
        for n, parts in paths.items():  # node 3 is the only output node; nodes 1, 2 feed edges only
            j = probe.edges[probe.edge_names.index(n)].dst
            expected = {"output"} if j == 3 else {f"{n.rsplit('.', 1)[0]}.{e}" for e, (i, _) in enumerate(NB_EDGES) if i == j}
            assert set(parts) == expected, n
            assert err(sum(parts.values()), costs[n]) < 1e-14, n
        steps.append(np.stack([np.stack([ref[f"cells.{c}.edges.{e}"].numpy() for e in range(6)]) for c in range(2)]))
    # output-edge costs (§5-6): <∂L/∂out, out> of node 3 = d/ds_b L(s_b · cell output) at s = 1, per sample
    s = torch.ones(2, B, dtype=DT, requires_grad=True)
    handles = [net.cells[c].register_forward_hook(lambda m, a, o, c=c: o * s[c].view(-1, 1, 1, 1)) for c in range(2)]
    try:
        g = torch.autograd.grad(F.cross_entropy(net(x), y), s)[0]
    finally:
        for h in handles:
            h.remove()
    out_costs = probe.output_costs(per_sample=True)
    assert max(err(out_costs[f"cells.{c}"][3], g[c]) for c in range(2)) < 1e-14
    obs = np.concatenate(steps)  # (steps × cells, E, K): each cell of the type is one observation
    stats = probe.statistics()
    assert np.abs(stats["cost/normal/mean"] - obs.mean(0)).max() < 1e-14
    assert np.abs(stats["cost/normal/var"] - obs.var(0)).max() < 1e-14
    assert (stats["cost/normal/count"] == 6).all()
    assert err(probe.cell_type_costs()["normal"], sum(torch.stack([ref[f"cells.{c}.edges.{e}"] for e in range(6)])
                                                       for c in range(2))) < 1e-14
    assert_no_module_hooks(net)


def test_nb201_exact_curvature_wrt_z_and_alpha_equals_autograd_hessian():
    """probe.hessian(mode='exact') against torch.autograd.functional.hessian of L as a function of one edge's Z (other
    edges fixed, train-mode BN differentiated through its batch statistics), and of α_e with Z_e = softmax(α_e) where
    each edge owns its α (one cell); with α shared by two cells the per-edge α question is one line."""
    x, y = image_batch()
    shared = nb_net()
    probe = nasdiag.attach(shared, hessian="exact")
    with probe.record(targets=y):
        F.cross_entropy(shared(x), y).backward()
    with pytest.raises(NasdiagError, match="shared") as raised:
        probe.hessian(wrt="alpha")
    assert "\n" not in str(raised.value)

    one = nb_net(cells=1)
    probe = nasdiag.attach(one, hessian="exact")
    with probe.record():  # no targets: read off the block's cross-entropy backward
        F.cross_entropy(one(x), y).backward()
    running = one.stem[1].running_mean.clone()
    hz, ha = probe.hessian(), probe.hessian(wrt="alpha")
    assert torch.equal(running, one.stem[1].running_mean)
    Z = torch.softmax(one.alpha.detach(), -1)
    for e in (0, 5):
        H = hessian(lambda z: F.cross_entropy(one(x, {0: {e: z}}), y), Z[e].clone())
        assert err(hz[f"cells.0.edges.{e}"], H.diagonal()) < 1e-12 * H.abs().max()
        H = hessian(lambda a: F.cross_entropy(one(x, {0: {e: torch.softmax(a, -1)}}), y), one.alpha.detach()[e].clone())
        assert err(ha[f"cells.0.edges.{e}"], H.diagonal()) < 1e-12 * H.abs().max()
    assert_no_module_hooks(one)


# -- the user's own MLP mixed op, mapped with edges= ------------------------------------------------------------------
def test_mlp_supernet_with_its_own_mixed_op_equals_autograd_in_costs_and_exact_curvature():
    torch.manual_seed(0)
    net = MLPSuper().to(DT)
    x, y = mlp_batch()
    with pytest.raises(ProbeError, match="edges="):  # nothing discoverable: says how to map
        nasdiag.attach(net)
    probe = nasdiag.attach(net, edges=net.edge_map(), hessian="exact")
    assert [(g.name, g.n_edges, g.n_ops) for g in probe.groups] == [(k, 1, K) for k, K in MLPSuper.K.items()]
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    W = {k: torch.softmax(v.detach(), -1).requires_grad_() for k, v in net.logits.items()}
    Wb = {k: w.detach().expand(len(y), -1).clone().requires_grad_() for k, w in W.items()}
    ref = dict(zip(W, torch.autograd.grad(F.cross_entropy(net(x, W), y), list(W.values()))))
    ref_ps = dict(zip(W, torch.autograd.grad(F.cross_entropy(net(x, Wb), y), list(Wb.values()))))
    costs, ps = probe.costs(), probe.costs(per_sample=True)
    assert max(err(costs[k], ref[k]) for k in W) < 1e-15 and max(err(ps[k], ref_ps[k]) for k in W) < 1e-15
    stats = probe.statistics()
    assert all(stats[f"cost/{k}/mean"].shape == (1, K) for k, K in MLPSuper.K.items())
    hz, ha = probe.hessian(), probe.hessian(wrt="alpha")
    for k in W:
        Hz = hessian(lambda z: F.cross_entropy(net(x, {k: z}), y), W[k].detach())
        Ha = hessian(lambda a: F.cross_entropy(net(x, {k: torch.softmax(a, -1)}), y), net.logits[k].detach().clone())
        assert err(hz[k], Hz.diagonal()) < 1e-14 and err(ha[k], Ha.diagonal()) < 1e-14, k
    assert_no_module_hooks(net)


def test_a_mapped_module_that_is_not_a_mixed_op_of_its_candidates_is_one_line():
    """Before: silent numbers. ``Sequential(Linear, ReLU)`` mapped with ``[Linear]`` gave <∂L/∂relu, linear(x)> as a
    'cost' (0.0101), and a mixed op listed with 2 of its 3 candidates gave 2 costs, neither an error. Now the output
    of an edge whose forward does not receive (K,)/(B, K) weights must lie in the per-sample span of its candidates'
    outputs; a real mixed op with its weights inside passes."""
    torch.manual_seed(0)
    net = MLPSuper().to(DT)
    x, y = mlp_batch()
    for bad in ({"s": (net.a01.cands[1], [net.a01.cands[1][0]])}, {"a01": (net.a01, list(net.a01.cands)[:2])}):
        probe = nasdiag.attach(net, edges=bad)
        with pytest.raises(ProbeError, match="not a weighted sum") as raised:
            with probe.record():
                F.cross_entropy(net(x), y).backward()
        assert "\n" not in str(raised.value)
        assert_no_module_hooks(net)

    class Inside(nn.Module):  # weights held inside the mixed op, per sample: the span check must pass it
        def __init__(self):
            super().__init__()
            self.ops = nn.ModuleList([nn.Linear(6, 5), nn.Sequential(nn.Linear(6, 5), nn.Tanh())])
            self.gate = nn.Linear(6, 2)

        def forward(self, h):
            w = torch.softmax(self.gate(h), -1)
            return w[:, :1] * self.ops[0](h) + w[:, 1:] * self.ops[1](h)

    torch.manual_seed(1)
    inside = nn.Sequential(Inside(), nn.Linear(5, N_CLS)).to(DT)
    probe = nasdiag.attach(inside, edges={"e": (inside[0], list(inside[0].ops))})
    with probe.record():
        F.cross_entropy(inside(x), y).backward()
    h = inside[0].gate(x).detach()
    Zb = torch.softmax(h, -1).requires_grad_()
    out = Zb[:, :1] * inside[0].ops[0](x) + Zb[:, 1:] * inside[0].ops[1](x)
    assert err(probe.costs(per_sample=True)["e"], torch.autograd.grad(F.cross_entropy(inside[1](out), y), Zb)[0]) < 1e-15


# -- SNAS: (B, K) Gumbel samples and LayerNorm ------------------------------------------------------------------------
def test_snas_per_sample_gumbel_weights_costs_sampled_statistics_and_curvature_equal_autograd():
    """Per-sample costs are exactly ∂L/∂Z_bk of the (B, K) samples; the user's own mixed op (Scaled-style forward
    (x, w) mapped with edges=) now takes statistics='sampled' (before: refused, 'do not take them'); the exact
    curvature of a (B, K) edge is that of one (K,) shift shared by the batch, Σ_{b,b'} ∂²L/∂Z_bk∂Z_b'k."""
    torch.manual_seed(0)
    net = SNASNet().to(DT)
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(B, 5, SNASNet.D, generator=gen, dtype=DT), torch.randint(0, N_CLS, (B,), generator=gen)
    probe = nasdiag.attach(net, statistics="sampled", hessian="exact")
    mapped = nasdiag.attach(net, edges={"first": (net.e1, list(net.e1._ops)), "second": (net.e2, list(net.e2._ops))},
                            statistics="sampled")
    for s in range(2):
        Z = net.sample(B, gen)
        Zl = Z.detach().requires_grad_()
        ref = torch.autograd.grad(F.cross_entropy(net(x, Zl), y), Zl)[0]
        with probe.record(targets=y), mapped.record():
            F.cross_entropy(net(x, Z), y).backward()
        ps = probe.costs(per_sample=True)
        assert err(ps["e1"], ref[:, 0]) < 1e-15 and err(ps["e2"], ref[:, 1]) < 1e-15
        assert err(mapped.costs(per_sample=True)["second"], ref[:, 1]) < 1e-15
    assert (probe.statistics()["cost/edges/count"] == 2).all() and (mapped.statistics()["cost/edges/count"] == 2).all()
    hz = probe.hessian(inputs=(x, Z.detach()), targets=y)
    for e, name in enumerate(("e1", "e2")):
        def shifted(d, e=e):
            Zs = Z.detach().clone()
            Zs[:, e] = Zs[:, e] + d
            return F.cross_entropy(net(x, Zs), y)
        H = hessian(shifted, torch.zeros(4, dtype=DT))
        assert err(hz[name], H.diagonal()) < 1e-13, name
    with pytest.raises(NasdiagError, match="per-sample") as raised:
        probe.hessian(inputs=(x, Z.detach()), targets=y, wrt="alpha")
    assert "\n" not in str(raised.value)
    assert_no_module_hooks(net)


# -- hooks, memory, misuse -------------------------------------------------------------------------------------------
def test_hooks_are_gone_after_an_exception_in_the_users_forward_and_the_next_step_is_exact():
    net = nb_net(cells=1)
    x, y = image_batch()
    probe = nasdiag.attach(net, path_split=True, hessian="exact")
    for exc in (RuntimeError, KeyboardInterrupt):
        net.fail = exc is RuntimeError
        with pytest.raises(exc):
            with probe.record():
                loss = F.cross_entropy(net(x), y)
                raise KeyboardInterrupt  # (the forward raised first when net.fail)
        assert_no_module_hooks(net)
        with pytest.raises(ProbeError, match="no completed"):
            probe.costs()
    net.fail = False
    ref = nb_reference(net, x, y)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    assert max(err(probe.costs()[n], ref[n]) for n in ref) < 1e-14
    assert_no_module_hooks(net)
    with pytest.raises(ProbeError):  # the probe's own error inside the block (a nested block) leaves nothing either
        with probe.record():
            with probe.record():
                pass
    assert_no_module_hooks(net)
    del loss


def test_no_tensor_is_kept_across_200_steps_of_a_user_supernet_with_sampled_statistics_and_curvature_io():
    torch.manual_seed(0)
    net = SNASNet().to(DT)
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(B, 5, SNASNet.D, generator=gen, dtype=DT), torch.randint(0, N_CLS, (B,), generator=gen)
    probe = nasdiag.attach(net, statistics="sampled", hessian="exact")

    def step():
        net.zero_grad(set_to_none=True)
        with probe.record():
            F.cross_entropy(net(x, net.sample(B, gen)), y).backward()
        probe.costs(per_sample=True), probe.statistics()

    for _ in range(5):
        step()
    before = live_tensors()
    for _ in range(200):
        step()
    assert live_tensors() <= before
    assert (probe.statistics()["cost/edges/count"] == 205).all()
    assert_no_module_hooks(net)


def test_misuse_of_the_public_api_on_a_user_supernet_is_one_nasdiag_error_line():
    torch.manual_seed(0)
    net = MLPSuper().to(DT)
    x, y = mlp_batch()

    def recorded(probe, **kw):
        with probe.record(**kw):
            F.cross_entropy(net(x), y).backward()
        return probe

    cases = [
        lambda: nasdiag.attach(net, edges={"a01": net.a01}),                 # a mixed op whose candidates cannot be told
        lambda: nasdiag.attach(net, edges={"h": net.head}),                  # a module that is not a mixed op
        lambda: nasdiag.attach(net, edges=[net.a01, net.a12]),               # a list of modules, not a mapping
        lambda: nasdiag.attach(net, edges=net.edge_map(), statistics="mean"),
        lambda: nasdiag.attach(net, edges=net.edge_map(), hessian="Exact"),
        lambda: nasdiag.attach(net, edges=net.edge_map(), path_split=True),  # no cells declared
        lambda: nasdiag.attach(net, edges=net.edge_map(), hessian="exact").hessian(),  # before any record block
        lambda: nasdiag.attach(net, edges=net.edge_map()).statistics(),
        lambda: recorded(nasdiag.attach(net, edges=net.edge_map())).hessian(),  # no hessian mode
        lambda: recorded(nasdiag.attach(net, edges=net.edge_map())).output_costs(),
        lambda: recorded(nasdiag.attach(net, edges=net.edge_map(), hessian="exact")).hessian(wrt="z"),
        lambda: recorded(nasdiag.attach(net, edges=net.edge_map(), hessian="exact")).hessian(targets=y[:3]),
        # before: torch's 'mat1 and mat2 shapes cannot be multiplied' from deep inside the curvature engine
        lambda: recorded(nasdiag.attach(net, edges=net.edge_map(), hessian="exact")).hessian(inputs=x[:, :5], targets=y),
    ]
    for i, case in enumerate(cases):
        with pytest.raises(NasdiagError) as raised:
            case()
        assert "\n" not in str(raised.value), i
        assert_no_module_hooks(net)
    probe = nasdiag.attach(net, edges=net.edge_map(), hessian="exact")
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
        with pytest.raises(ProbeError, match="after the probe.record"):
            probe.hessian()

    nb = nb_net(cells=1)
    probe = nasdiag.attach(nb)
    wrong_k = {0: {e: torch.full((6,), 1 / 6, dtype=DT, requires_grad=True) for e in range(6)}}  # 6 weights, 5 ops
    with pytest.raises(ProbeError, match=r"weights of shape \(6,\) for 5 candidate ops") as raised:
        with probe.record():
            F.cross_entropy(nb(image_batch()[0], wrong_k), image_batch()[1]).backward()
    assert "\n" not in str(raised.value)
    assert_no_module_hooks(nb)
