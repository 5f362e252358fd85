"""Round-17 new-user audit: a researcher brings their own supernet, written here from scratch in the styles of public
codebases, attaches nasdiag as docs/probe.md says, runs a first-order DARTS search loop of their own (SGD on the
weights, Adam on α), logs with the recorder callback each step and draws the record with ``nasdiag plot``:

* an NB-201-style cell: every node sums all earlier nodes' mixed ops; one α of shape (6, 5) shared by all cells,
  passed in as softmax weights;
* a ProxylessNAS / once-for-all-style chain: one mixed op per layer, its own α and its own K per layer (MBConv
  candidates of several kernels and expansions, stride 2 on some layers, a zero op where the shape allows).

References are written here from scratch in float64: per cell (per layer) a softmax Z whose gradient autograd retains
in the same backward, ∂L/∂Z compared with the probe's costs at every step; torch.autograd.functional.hessian of the
same loss for the curvature; DARTS's genotype rule by hand.

Checked and found right (beyond the tests below): per-layer exact curvature of the chain, wrt Z and wrt α (4e-16 against
autograd's Hessian diagonal), its diag/approx modes shaped (K_l,) per layer; an OFA elastic kernel (3x3/5x5/7x7 centres
of one shared depthwise weight, a candidate module that is no submodule owner of it) costs and exact curvature as
autograd; a ProxylessNAS mixed op keeping α inside, mapped with edges=; adapt of NB-201's declared cell running a
first-order DARTS step: costs mean/var over the cells and α's gradient equal autograd's; ``nasdiag search`` on its
own supernet still records (4 rows, (E, K) costs); every name docs/probe.md, README, schema.md and figures.md call
is reachable from a public module (``nasdiag.hessian._hvp`` is named once as where a route takes its loss, no call).

Left alone: the record holds one ``op_names`` list (docs/schema.md), so the heatmaps of groups with other ops number
their columns (``op k``) rather than name them: naming them per group is a schema change. An NB-201 net without cell
declarations is one group ``edges`` (12, 5) of per-cell rows (the docs' rule 2): summing a shared α's costs over the
cells needs the node protocol's declared cells. The Lightning adapter was not run (lightning fails to import here:
torchvision built for another torch; its one-line RecordError says so).
"""

import re
import pathlib
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.probe import ProbeError
from nasdiag.record import RecordError, Recorder, RecorderCallback, load

D = torch.float64
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "probe.md"


class Zero(nn.Module):
    def forward(self, x):
        return x.mul(0.0)


def relu_conv_bn(C, k):
    return nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, k, padding=k // 2, bias=False), nn.BatchNorm2d(C))


NB_OPS = ("none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3")


def nb_op(name, C):
    return {"none": Zero, "skip_connect": nn.Identity, "nor_conv_1x1": lambda: relu_conv_bn(C, 1),
            "nor_conv_3x3": lambda: relu_conv_bn(C, 3),
            "avg_pool_3x3": lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False)}[name]()


class NBMixed(nn.Module):
    """DARTS-convention mixed op: candidates in ``_ops``, forward (x, weights)."""

    def __init__(self, C):
        super().__init__()
        self.primitives = list(NB_OPS)
        self._ops = nn.ModuleList(nb_op(n, C) for n in NB_OPS)

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class NBCell(nn.Module):
    """Four nodes; node j sums the mixed ops of every earlier node (edges 1<-0, 2<-0, 2<-1, 3<-0, 3<-1, 3<-2)."""

    def __init__(self, C):
        super().__init__()
        self.edges = nn.ModuleList(NBMixed(C) for _ in range(6))

    def forward(self, x, W):
        nodes, e = [x], 0
        for j in range(1, 4):
            acc = 0
            for i in range(j):
                acc = acc + self.edges[e](nodes[i], W[e])
                e += 1
            nodes.append(acc)
        return nodes[-1]


class NB201(nn.Module):
    def __init__(self, C=4, cells=2, classes=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, C, 3, padding=1, bias=False), nn.BatchNorm2d(C))
        self.cells = nn.ModuleList(NBCell(C) for _ in range(cells))
        self.head = nn.Linear(C, classes)
        self.arch_parameters = nn.Parameter(1e-1 * torch.randn(6, len(NB_OPS)))

    def forward(self, x, Zs=None):
        h = self.stem(x)
        W = F.softmax(self.arch_parameters, -1)
        for c, cell in enumerate(self.cells):
            h = cell(h, W if Zs is None else Zs[c])
        return self.head(h.mean((2, 3)))

    def arch_weights(self):  # one Z per cell, sharing α, for the reference gradient
        W = F.softmax(self.arch_parameters, -1)
        return [W.clone() for _ in self.cells]


def mbconv(c_in, c_out, k, e, stride):
    mid = c_in * e
    return nn.Sequential(nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
                         nn.Conv2d(mid, mid, k, stride, k // 2, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
                         nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out))


class ChainMixed(nn.Module):
    def __init__(self, c_in, c_out, stride, spec):
        super().__init__()
        same = stride == 1 and c_in == c_out
        self.primitives = [f"mb{k}x{k}_e{e}" for k, e in spec] + (["zero"] if same else [])
        self._ops = nn.ModuleList([mbconv(c_in, c_out, k, e, stride) for k, e in spec] + ([Zero()] if same else []))

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


#: (c_in, c_out, stride, [(kernel, expansion)]): K = 3, 3, 4, 2 per layer, stride 2 on layers 1 and 3
CHAIN = [(4, 4, 1, [(3, 1), (5, 1)]), (4, 6, 2, [(3, 1), (3, 3), (5, 3)]), (6, 6, 1, [(3, 1), (5, 3), (7, 1)]),
         (6, 8, 2, [(3, 3), (5, 1)])]


class Chain(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.first = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4))
        self.blocks = nn.ModuleList(ChainMixed(*c) for c in CHAIN)
        self.alphas = nn.ParameterList(nn.Parameter(1e-1 * torch.randn(len(b._ops))) for b in self.blocks)
        self.head = nn.Linear(8, classes)

    def forward(self, x, Zs=None):
        h = self.first(x)
        for l, block in enumerate(self.blocks):
            h = block(h, F.softmax(self.alphas[l], -1) if Zs is None else Zs[l])
        return self.head(h.mean((2, 3)))

    def arch_weights(self):
        return [F.softmax(a, -1) for a in self.alphas]


def doc_meta(probe):
    """docs/probe.md's meta for the record, run as written there (the lines from ``meta =`` to the recorder)."""
    block = re.search(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M).group(1)
    lines = re.search(r"^meta = .*?(?=^with Recorder)", block, re.S | re.M).group(0)
    namespace = {"probe": probe}
    exec(compile(lines, "docs/probe.md", "exec"), namespace)
    return namespace["meta"]


def one_step(net, probe, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 1, 8, 8, dtype=D, generator=g), torch.randint(0, 3, (6,), generator=g)
    with probe.record():
        F.cross_entropy(net(x), y).backward()


def hooks_on(net):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(m._backward_pre_hooks) for m in net.modules())


class TypedCell(nn.Module):
    """A declared cell of one edge 0 -> 1 whose op set depends on its type (same K = 2, other ops)."""

    def __init__(self, reduction):
        super().__init__()
        self.cell_type = "reduce" if reduction else "normal"
        self.edges = nn.ModuleList([ChainMixed(4, 4, 1, [(5, 1)] if reduction else [(3, 1)])])
        self.edge_nodes = [(0, 1)]
        self.output_nodes = [1]
        self.output_node_slices = {1: (0, 4)}

    def forward(self, x, w):
        return self.edges[0](x, w)


class TypedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(1, 4, 3, padding=1)
        self.cells = nn.ModuleList([TypedCell(False), TypedCell(True)])
        self.alpha = nn.ParameterDict({"normal": nn.Parameter(torch.zeros(2)), "reduce": nn.Parameter(torch.ones(2))})
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.first(x)
        for cell in self.cells:
            h = cell(h, F.softmax(self.alpha[cell.cell_type] * torch.arange(2.0, dtype=h.dtype), -1))
        return self.head(h.mean((2, 3)))


def test_the_probe_docs_meta_records_a_supernet_whose_groups_have_other_ops_and_labels_each_heatmap_with_its_own(tmp_path):
    """Defect (docs): docs/probe.md built the record's meta with ``"op_names": list(probe.groups[0].op_names)``. For a
    chain whose layers have their own candidates and K (one group per edge, (1, K_e)), every row whose group has another
    K was refused by the recorder — at close, after the whole loop: the record held no row at all; for cell types of
    one K with other op sets, the reduce heatmap's columns were named with the normal cell's ops. The recipe gives
    op_names only where every group has the same labels; otherwise the rows are recorded and the columns numbered."""
    from nasdiag.plot import registered

    torch.manual_seed(0)
    for net in (Chain().to(D), TypedNet().to(D)):
        probe = nasdiag.attach(net)
        meta = doc_meta(probe)
        one_step(net, probe)
        path = tmp_path / f"{type(net).__name__}.h5"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unobserved ops' NaN means are recorded as they are
            with Recorder(path, meta=meta) as rec:
                rec.log(0, dict(probe.statistics()))
        record = load(path)
        for group in probe.groups:
            assert record[f"cost/{group.name}/mean"].shape == (1, len(group.edge_labels), len(group.op_names))
            heat = registered()["cost"].draw(record, group.name, 0)
            assert len(heat.cols) == len(group.op_names)
            # each column is labelled with its own op or numbered, never with another group's op
            assert all(col in (name, f"op {k}") for k, (col, name) in enumerate(zip(heat.cols, group.op_names))), \
                (group.name, heat.cols, group.op_names)
            assert list(heat.rows) == list(group.edge_labels)


@pytest.mark.parametrize("kind", ["nb201", "chain"])
def test_a_users_first_order_darts_loop_costs_as_autograd_records_plots_and_detaches(tmp_path, kind):
    """Checked right: the user's own supernet, discovered; each α step's costs equal the autograd ∂L/∂Z of per-cell
    (per-layer) Z leaves of the same backward (float64, to 1e-12 relative); the callback's rows have the shapes of
    docs/schema.md (one group (12, 5) for the NB-201 cells of one K without cell declarations; one (1, K_e) group per
    layer for the chain); ``nasdiag plot`` draws the cost maps with the ops' names; no hook is left after the loop."""
    from nasdiag.cli import main
    from nasdiag.plot import registered

    torch.manual_seed(1)
    net = (NB201() if kind == "nb201" else Chain()).to(D)
    arch = [p for n, p in net.named_parameters() if "alpha" in n or "arch" in n]
    weights = [p for n, p in net.named_parameters() if not ("alpha" in n or "arch" in n)]
    opt_w, opt_a = torch.optim.SGD(weights, lr=0.05, momentum=0.9), torch.optim.Adam(arch, lr=3e-3)
    probe = nasdiag.attach(net)
    if kind == "nb201":
        names = [f"cells.{c}.edges.{e}" for c in range(2) for e in range(6)]
        assert [g.name for g in probe.groups] == ["edges"] and probe.groups[0].op_names == NB_OPS
    else:
        names = [f"blocks.{l}" for l in range(4)]
        assert [g.name for g in probe.groups] == names
        assert [len(g.op_names) for g in probe.groups] == [3, 3, 4, 2]
    assert [e.name for e in probe.edges] == names
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(6, 1, 8, 8, dtype=D, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(6)]
    seen = []
    with RecorderCallback(tmp_path / "run.h5", meta=doc_meta(probe)) as callback:
        for step in range(3):
            (xt, yt), (xv, yv) = data[2 * step], data[2 * step + 1]
            opt_w.zero_grad()
            F.cross_entropy(net(xt), yt).backward()
            opt_w.step()
            opt_a.zero_grad()
            Zs = net.arch_weights()
            for z in Zs:
                z.retain_grad()
            with probe.record():
                loss = F.cross_entropy(net(xv, Zs), yv)
                loss.backward()
            opt_a.step()
            costs = probe.costs()
            reference = {n: Zs[int(n.split(".")[1])].grad[int(n.split(".")[3])] if kind == "nb201"
                         else Zs[int(n.split(".")[1])].grad for n in names}
            for n in names:
                torch.testing.assert_close(costs[n], reference[n], rtol=1e-12, atol=1e-17)
            seen.append(reference)
            stats = dict(probe.statistics())
            stats["scalars/val_loss"] = loss.detach()
            callback.on_step_end(step, stats)
            probe.reset_statistics()
    assert hooks_on(net) == 0
    record = load(tmp_path / "run.h5")
    assert list(record["step"]) == [0, 1, 2]
    for group in probe.groups:
        mean = record[f"cost/{group.name}/mean"]
        assert mean.dtype == np.float64 and record[f"cost/{group.name}/count"].dtype == np.int64
        expected = np.stack([[s[e].numpy() for e in group.edge_labels] for s in seen])
        np.testing.assert_allclose(mean, expected, rtol=1e-12, atol=1e-17)
        np.testing.assert_array_equal(record[f"cost/{group.name}/var"], 0.0)  # one observation per row
        heat = registered()["cost"].draw(record, group.name, 2)
        if len({g.op_names for g in probe.groups}) == 1:
            assert list(heat.cols) == list(group.op_names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["plot", str(tmp_path / "run.h5"), "--out", str(tmp_path / "figs")]) == 0
    drawn = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert sum(name.startswith("cost_") and "heatmap" in name for name in drawn) == len(probe.groups), drawn


def test_supernets_nasdiag_cannot_read_are_refused_in_one_line_at_attach():
    """Checked right: NAS-Bench-201's own search cell (a ModuleDict of ModuleLists mixed in the cell's forward) and a
    ProxylessNAS mixed op keeping α inside (forward(x)) are one ProbeError line at attach; the latter mapped with
    ``edges={name: (op, list(op.candidate_ops))}`` costs as autograd."""

    class SearchCell(nn.Module):
        def __init__(self, C=4):
            super().__init__()
            self.edges = nn.ModuleDict({f"{i}<-{j}": nn.ModuleList(nb_op(n, C) for n in NB_OPS)
                                        for i in range(1, 4) for j in range(i)})

        def forward(self, x, W):
            nodes = [x]
            for i in range(1, 4):
                nodes.append(sum(sum(op(nodes[j]) * w for op, w in zip(self.edges[f"{i}<-{j}"], W[i * (i - 1) // 2 + j]))
                                 for j in range(i)))
            return nodes[-1]

    class Proxyless(nn.Module):
        def __init__(self, ops):
            super().__init__()
            self.candidate_ops = nn.ModuleList(ops)
            self.AP_path_alpha = nn.Parameter(torch.zeros(len(ops)))

        def forward(self, x):
            return sum(w * op(x) for w, op in zip(F.softmax(self.AP_path_alpha, -1), self.candidate_ops))

    cell = SearchCell()
    for edges in (None, dict(cell.edges.items())):
        with pytest.raises(ProbeError) as info:
            nasdiag.attach(cell, edges=edges)
        assert "\n" not in str(info.value)
    net = nn.Sequential(Proxyless([mbconv(1, 4, 3, 1, 1), mbconv(1, 4, 5, 1, 1)]),
                        Proxyless([mbconv(4, 6, 3, 3, 2), mbconv(4, 6, 5, 1, 2), mbconv(4, 6, 7, 3, 2)])).to(D)
    with pytest.raises(ProbeError, match="pass edges=") as info:
        nasdiag.attach(net)
    assert "\n" not in str(info.value)
    probe = nasdiag.attach(net, edges={f"layer{l}": (b, list(b.candidate_ops)) for l, b in enumerate(net)})
    x, y = torch.randn(4, 1, 8, 8, dtype=D), torch.randint(0, 4, (4,))
    Zs = [F.softmax(b.AP_path_alpha, -1).detach().requires_grad_() for b in net]
    h = x
    for b, z in zip(net, Zs):
        h = sum(w * op(h) for w, op in zip(z, b.candidate_ops))
    reference = torch.autograd.grad(F.cross_entropy(h.mean((2, 3)), y), Zs)
    with probe.record():
        F.cross_entropy(net(x).mean((2, 3)), y).backward()
    for l, r in enumerate(reference):
        torch.testing.assert_close(probe.costs()[f"layer{l}"], r, rtol=1e-12, atol=1e-17)
    assert hooks_on(net) == 0


class DeclaredNBCell(NBCell):
    """The NB-201 cell declaring its nodes (docs/probe.md's node protocol): node 1 has one input, node 0."""

    cell_type = "nb201"
    edge_nodes = [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    output_nodes = [3]
    output_node_slices = {3: (0, 4)}


class DeclaredDartsCell(nn.Module):
    """A declared cell in DARTS's layout (inputs 0 and 1, nodes 2 and 3 fed by every earlier node), no `_steps`."""

    cell_type = "normal"
    edge_nodes = [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    output_nodes = [2, 3]
    output_node_slices = {2: (0, 4), 3: (4, 8)}

    def __init__(self):
        super().__init__()
        self.edges = nn.ModuleList(NBMixed(4) for _ in range(5))

    def forward(self, s0, s1, W):
        n2 = self.edges[0](s0, W[0]) + self.edges[1](s1, W[1])
        n3 = self.edges[2](s0, W[2]) + self.edges[3](s1, W[3]) + self.edges[4](n2, W[4])
        return torch.cat([n2, n3], 1)


class DeclaredDartsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.cell = DeclaredDartsCell()
        self.head = nn.Linear(8, 3)
        self.alphas_normal = nn.Parameter(1e-1 * torch.randn(5, len(NB_OPS)))

    def forward(self, x):
        h = self.stem(x)
        return self.head(self.cell(h, h, F.softmax(self.alphas_normal, -1)).mean((2, 3)))


def test_adapt_refuses_a_cell_that_is_not_in_darts_layout_in_one_line_and_reads_a_declared_darts_cell():
    """Defect: ``adapt`` took a cell declaring its nodes (docs/probe.md's protocol) but without ``_steps`` as one of 0
    nodes and 0 concatenated outputs: on NB-201's cell a DARTS search ran, then ``method.genotype()`` (docs/methods.md's
    fragment) stopped in derive_genotype's ValueError "(E, K) = (0, 5) for steps=0", SparseNAS's first step in torch's
    "expanded size ... (6) must match ... (0)" and BayesNAS built its edge dependencies from no node pairs. A cell
    whose edges are not DARTS's layout is one ConfigError line at ``adapt``; a declared cell that is (edges in DARTS
    order, the last nodes its output) gets its steps and multiplier from its nodes and derives a genotype."""
    from nasdiag.errors import ConfigError
    from nasdiag.search import Schedule, get_method
    from nasdiag.search.supernet import adapt

    net = NB201().to(D)
    net.cells = nn.ModuleList(DeclaredNBCell(4) for _ in range(2)).to(D)
    with pytest.raises(ConfigError, match="not a DARTS cell") as info:
        adapt(net, alphas={"nb201": net.arch_parameters})
    assert "\n" not in str(info.value)

    torch.manual_seed(0)
    model = DeclaredDartsNet().to(D)
    supernet = adapt(model)
    assert (supernet.steps, supernet.multiplier) == (2, 2)
    DARTS = get_method("darts")
    method = DARTS(supernet, DARTS.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=1))
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 1, 8, 8, dtype=D, generator=g), torch.randint(0, 3, (4,), generator=g))
    method.step(batch, batch)
    genotype = method.genotype()
    p = F.softmax(model.alphas_normal.detach(), -1)
    # DARTS's rule by hand: node 2 takes both inputs; node 3 its 2 strongest of 3; each edge its strongest op but none
    strength, best = p[:, 1:].max(1)
    node3 = sorted(range(2, 5), key=lambda e: -strength[e].item())[:2]
    gene = lambda e: (NB_OPS[1 + best[e].item()], model.cell.edge_nodes[e][0])  # noqa: E731
    genes = list(genotype.normal)  # per node, in any order within it
    assert sorted(genes[:2]) == sorted(map(gene, [0, 1])) and sorted(genes[2:]) == sorted(map(gene, node3))
    assert list(genotype.normal_concat) == [2, 3]


def test_a_row_the_records_meta_refuses_is_refused_at_its_callback_call_not_with_every_row_at_close(tmp_path):
    """Defect: RecorderCallback checked a row against the record's meta (docs/schema.md: (E, K) rows with
    E = len(edge_names[cell]), K = len(op_names)) only at the hand-over, flush_every rows or the close later: the
    per-layer chain's cost rows under one op_names list were refused there, each row with the path, so a loop that
    logged them every step ended with a record of no row and the error after the loop. In a single process the call
    that brings such a value raises, nothing of it recorded, and the rows before and after it are kept."""
    torch.manual_seed(0)
    net = Chain().to(D)
    probe = nasdiag.attach(net)
    one_step(net, probe)
    meta = {"op_names": list(probe.groups[0].op_names), "edge_names": {g.name: list(g.edge_labels) for g in probe.groups}}
    stats = dict(probe.statistics())
    good = {p: v for p, v in stats.items() if p.split("/")[1] in ("blocks.0", "blocks.1")}  # K = 3, as op_names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NaN means of unobserved ops
        with RecorderCallback(tmp_path / "run.h5", meta=meta) as callback:
            callback.on_step_end(0, {"scalars/loss": 1.0, **good})
            with pytest.raises(RecordError, match=r"'cost/blocks\.2/mean'.*\(1, 3\).*got \(1, 4\).*nothing of this call") as info:
                callback.on_step_end(1, {"scalars/loss": 2.0, **stats})
            assert "\n" not in str(info.value)
            with pytest.raises(RecordError, match="blocks.3"):
                callback.on_epoch_end(0, {"cost/blocks.3/mean": stats["cost/blocks.3/mean"]}, step=1)
            callback.on_step_end(1, {"scalars/loss": 3.0, **good})
    record = load(tmp_path / "run.h5")
    assert list(record["step"]) == [0, 1] and list(record["scalars/loss"]) == [1.0, 3.0]
    np.testing.assert_array_equal(record["cost/blocks.1/mean"][1], good["cost/blocks.1/mean"])
