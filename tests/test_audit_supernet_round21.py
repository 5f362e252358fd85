"""Round-21 audit of the reference supernet and the genotype derivation (nasdiag/supernet/, nasdiag/edges.py) against
DARTS (Liu et al. 2019, ``model_search.py`` / ``operations.py`` / ``genotypes.py`` conventions), transcribed here.

Checked and found right, against references written in this file (float64):

- every candidate op's parameter count against its formula (sep k×k: 2(C·k² + C²), dil k×k: C·k² + C², a strided
  skip's FactorizedReduce: 2·C·C/2, pools and none 0: affine-free normalisation in search) and its output size on odd
  inputs (7×7, 5×5, 3×3, 1×1 at stride 2: ⌈H/2⌉, as each conv's (H + 2p − d(k − 1) − 1)//s + 1 gives);
- each op's output against our own functional transcription (F.conv2d with the op's kernels, batch-statistics
  normalisation by formula, F.max_pool2d / avg_pool2d without the padding in the count, FactorizedReduce's two offset
  1×1 convolutions), and the mixed op = Σ_k w_k O_k(x) for shared (K,) and per-sample (B, K) weights;
- the supernet's structure: reductions at layers//3 and 2·layers//3, stride 2 exactly on the edges leaving a reduction
  cell's inputs, s0 preprocessed by FactorizedReduce after a reduction cell, every normalisation inside the cells
  without parameters, α of (Σ_s (2 + s), K) per cell type;
- the edge order: edge e of a cell (Network.edge_specs, edge_labels, the cell's forward, the genotype) is the same
  node pair (i, j): a one-hot skip on edge e makes node j the preprocessed node i and nothing else;
- the genotype against our own transcription of DARTS's ``_parse`` (two inputs per node by their strongest non-none
  weight, the argmax non-none op, stable ties towards the lower input and op) on hand-set α with ties, none the
  strongest, −inf rows and several cell types, and its repr / JSON round trips.

Defects (each test names its own): a genotype of a cell type other than normal/reduce (an adapted supernet's) was
derived and dropped without a word; a node count of 0 was blamed on the multiplier, non-integer sizes were torch's or
range()'s TypeErrors (a reduction index 1.5 silently cell 1); a mixed op of no candidate returned the int 0, a
string of op names was taken letter by letter, and a stride other than 1 or 2 built ops of different output sizes; a
bool mask of the kept ops was torch's traceback in derive_mixed_cell and derive_cell.

Left alone: an unknown op name is a KeyError (tests/test_supernet.py pins it; its one line names the registered ops);
derive_cell refuses more inputs per node than node 2 has (DARTS's parse would keep both) with one line. (Reported
here and fixed by the lead: a genotype of edges_per_node=1 was drawn by nasdiag.plot.cells.genes_from_pairs as two genes
per node; see tests/test_audit_lead_round21.py.)
"""

from __future__ import annotations

import ast
import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.supernet import (DARTS_PRIMITIVES, Cell, FactorizedReduce, Genotype, MixedGenotype, MixedOp, Network,
                              OpConfig, derive_cell, derive_genotype, derive_mixed_genotype)

P = list(DARTS_PRIMITIVES)


def _one_line(exc_info):
    text = str(exc_info.value)
    assert "\n" not in text and text, text
    return text


# -- own references ------------------------------------------------------------------------------------------------

def _bn(x, eps):
    """Affine-free batch normalisation on the batch's statistics (biased variance), as in search (train mode)."""
    m = x.mean((0, 2, 3), keepdim=True)
    v = ((x - m) ** 2).mean((0, 2, 3), keepdim=True)
    return (x - m) / torch.sqrt(v + eps)


def _dil(seq, x, k, s, p, d, eps):
    """relu -> depthwise k×k (stride s, padding p, dilation d) -> pointwise 1×1 -> bn, DARTS's DilConv."""
    dw, pw = seq[1].weight, seq[2].weight
    y = F.conv2d(torch.relu(x), dw, stride=s, padding=p, dilation=d, groups=x.shape[1])
    return _bn(F.conv2d(y, pw), eps)


def _fr(mod, x, eps):
    """DARTS's FactorizedReduce: relu, two 1×1 stride-2 convolutions on x and x shifted by one pixel, cat, bn; the
    shifted branch padded at the far edge on odd sizes so that both halves are ⌈H/2⌉ × ⌈W/2⌉."""
    x = torch.relu(x)
    sh = x[:, :, 1:, 1:]
    sh = F.pad(sh, (0, x.shape[-1] % 2, 0, x.shape[-2] % 2))
    return _bn(torch.cat([F.conv2d(x, mod.conv_1.weight, stride=2), F.conv2d(sh, mod.conv_2.weight, stride=2)], 1), eps)


def _op_ref(name, op, x, stride, eps):
    if name == "none":
        return torch.zeros_like(x[:, :, ::stride, ::stride])
    if name == "skip_connect":
        return x if stride == 1 else _fr(op, x, eps)
    if name == "max_pool_3x3":
        return _bn(F.max_pool2d(x, 3, stride, 1), eps)
    if name == "avg_pool_3x3":
        return _bn(F.avg_pool2d(x, 3, stride, 1, count_include_pad=False), eps)
    kind, k = name.split("_")[0], int(name[-1])
    if kind == "sep":
        return _dil(op[1], _dil(op[0], x, k, stride, k // 2, 1, eps), k, 1, k // 2, 1, eps)
    return _dil(op, x, k, stride, 2 * (k // 2), 2, eps)


def _params(name, C, stride):
    """Parameters of a DARTS candidate by formula (affine-free normalisation: none)."""
    if name in ("none", "max_pool_3x3", "avg_pool_3x3"):
        return 0
    if name == "skip_connect":
        return 0 if stride == 1 else 2 * C * (C // 2)
    k = int(name[-1])
    return (2 if name.startswith("sep") else 1) * (C * k * k + C * C)


def _parse(W, steps, prims, k=2):
    """DARTS genotypes parse (model_search.py ``genotype()._parse``), transcribed."""
    none = prims.index("none") if "none" in prims else None
    gene, start, n = [], 0, 2
    for _ in range(steps):
        w = W[start:start + n]
        edges = sorted(range(n), key=lambda x: -max(w[x][j] for j in range(len(w[x])) if j != none))[:k]
        for e in edges:
            best = None
            for j in range(len(w[e])):
                if j != none and (best is None or w[e][j] > w[e][best]):
                    best = j
            gene.append((prims[best], e))
        start, n = start + n, n + 1
    return gene


# -- checked and right ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stride", [1, 2])
def test_every_op_has_its_formulas_parameters_odd_size_shape_and_output(stride):
    torch.manual_seed(0)
    C, eps = 4, 1e-5
    mixed = MixedOp(C, stride, P, OpConfig(eps=eps)).double().train()
    for H, W in ((7, 5), (5, 7), (3, 3), (1, 2)):
        x = torch.randn(3, C, H, W, dtype=torch.float64)
        for name, op in zip(P, mixed.ops):
            assert sum(p.numel() for p in op.parameters()) == _params(name, C, stride), name
            y = op(x)
            assert y.shape == (3, C, -(-H // stride), -(-W // stride)), (name, H, W)
            if H * W > 1 or stride == 2:  # a 1×1 map's batch norm of 3 samples is fine; 1×2 at stride 1 too
                torch.testing.assert_close(y, _op_ref(name, op, x, stride, eps), rtol=1e-10, atol=1e-10, msg=name)
        # the mixed op: Σ_k w_k O_k(x), shared and per sample (own loop on our own op outputs)
        w = torch.randn(len(P), dtype=torch.float64)
        ref = sum(w[k] * _op_ref(n, o, x, stride, eps) for k, (n, o) in enumerate(zip(P, mixed.ops)))
        torch.testing.assert_close(mixed(x, w), ref, rtol=1e-10, atol=1e-10)
        wb = torch.randn(3, len(P), dtype=torch.float64)
        ref = sum(wb[:, k, None, None, None] * _op_ref(n, o, x, stride, eps) for k, (n, o) in enumerate(zip(P, mixed.ops)))
        torch.testing.assert_close(mixed(x, wb), ref, rtol=1e-10, atol=1e-10)


def test_the_supernet_is_darts_search_network_in_structure():
    for layers in (1, 2, 5, 8):
        net = Network(4, 10, layers, steps=3, multiplier=2)
        want = sorted({layers // 3, 2 * layers // 3})
        assert [k for k, c in enumerate(net.cells) if c.reduction] == want
        for k, cell in enumerate(net.cells):
            pairs = [(i, j) for j in range(2, 5) for i in range(j)]
            assert [m.stride for m in cell.edges] == [2 if cell.reduction and i < 2 else 1 for i, _ in pairs]
            prev_red = k > 0 and net.cells[k - 1].reduction
            assert isinstance(cell.preprocess0, FactorizedReduce) == prev_red
            norms = [m for m in cell.modules() if isinstance(m, nn.BatchNorm2d)]
            assert norms and all(not m.affine and sum(p.numel() for p in m.parameters()) == 0 for m in norms)
        assert {t: tuple(a.shape) for t, a in net.alphas().items()} == {
            t: (2 + 3 + 4, len(P)) for t in (["normal"] if len(want) < layers else []) + ["reduce"]}
        assert net.classifier.in_features == 2 * 4 * 2 ** len(want)
        # the whole network's weights by formula, with DARTS's channel bookkeeping (C_prev = multiplier · C_curr)
        total, (cpp, cp, c, red_prev) = 3 * 9 * 12 + 2 * 12, (12, 12, 4, False)  # stem conv + its affine BN
        for k in range(layers):
            red = k in want
            c = 2 * c if red else c
            total += (2 * cpp * (c // 2) if red_prev else cpp * c) + cp * c
            total += sum(_params(n, c, 2 if red and i < 2 else 1) for i, _ in pairs for n in P)
            cpp, cp, red_prev = cp, 2 * c, red
        total += cp * 10 + 10
        assert sum(p.numel() for p in net.weight_parameters()) == total
    x = torch.randn(2, 3, 7, 7)
    assert Network(4, 10, 3, steps=2, multiplier=2).set_engine("eager")(x).shape == (2, 10)  # 7 -> 4 -> 2


def test_edge_e_is_the_same_node_pair_in_the_cell_forward_the_specs_and_the_genotype():
    torch.manual_seed(1)
    net = Network(4, 10, 3, steps=3, multiplier=3).double()
    cell = net.cells[0]
    specs = [s for s in net.edge_specs() if s.cell_index == 0]
    pairs = [(i, j) for j in range(2, 5) for i in range(j)]
    assert [(s.src, s.dst) for s in specs] == pairs == cell.edge_nodes
    assert net.edge_labels() == [f"{i}->{j}" for i, j in pairs]
    s0, s1 = torch.randn(2, 12, 6, 6, dtype=torch.float64), torch.randn(2, 12, 6, 6, dtype=torch.float64)
    for e, (i, j) in enumerate(pairs):
        if i >= 2:
            continue
        W = torch.zeros(len(pairs), len(P), dtype=torch.float64)
        W[:, P.index("none")] = 1.0
        W[e] = 0.0
        W[e, P.index("skip_connect")] = 1.0
        with torch.no_grad():
            out = cell(s0, s1, W)
            src = (cell.preprocess0 if i == 0 else cell.preprocess1)(s0 if i == 0 else s1)
        for node in (2, 3, 4):
            part = out[:, (node - 2) * 4:(node - 1) * 4]
            torch.testing.assert_close(part, src if node == j else torch.zeros_like(src), rtol=0, atol=0)
        genes = derive_cell(W, 3, P)
        assert genes[2 * (j - 2)] == ("skip_connect", i)


def test_the_genotype_is_dartss_parse_on_hand_set_alphas_with_ties_none_strongest_and_minus_inf():
    g = torch.Generator().manual_seed(2)
    cases = []
    for steps in (1, 2, 4):
        E = sum(2 + s for s in range(steps))
        cases.append((steps, torch.randint(0, 3, (E, len(P)), generator=g).double() / 2))  # many ties
        W = torch.softmax(torch.randn(E, len(P), generator=g, dtype=torch.float64), 1)
        W[:, 0] = 0.9  # none the strongest everywhere: never named
        W[E // 2] = float("-inf")  # a pruned edge: every op −inf
        cases.append((steps, W))
    for steps, W in cases:
        for k in (1, 2):
            assert derive_cell(W, steps, P, edges_per_node=k) == _parse(W.tolist(), steps, P, k)
    W = torch.zeros(5, len(P), dtype=torch.float64)  # every weight tied: lower input, lower non-none op
    assert derive_cell(W, 2, P) == [("skip_connect", 0), ("skip_connect", 1)] * 2
    Wn, Wr = cases[2][1], cases[3][1]
    geno = derive_genotype({"normal": Wn, "reduce": Wr}, 2, 2, P)
    assert geno == Genotype(_parse(Wn.tolist(), 2, P), [2, 3], _parse(Wr.tolist(), 2, P), [2, 3])
    assert derive_genotype({"reduce": Wr}, 2, 1, P) == Genotype([], [3], _parse(Wr.tolist(), 2, P), [3])
    with pytest.raises(ValueError) as e:
        derive_cell(Wn, 2, P, edges_per_node=3)
    assert "node 2" in _one_line(e)


def test_a_genotype_round_trips_through_its_repr_and_json():
    from nasdiag.plot.cells import parse_genotype

    W = torch.softmax(torch.randn(14, len(P), generator=torch.Generator().manual_seed(3)), 1)
    geno = derive_genotype({"normal": W, "reduce": W.flip(1)}, 4, 4, P)
    assert eval(repr(geno), {"Genotype": Genotype}) == geno  # DARTS's genotypes.py keeps them as this text
    back = Genotype(*[[tuple(x) if isinstance(x, list) else x for x in f] for f in json.loads(json.dumps(geno))])
    assert back == geno
    parsed = parse_genotype(repr(geno))
    assert {k: [tuple(x) if isinstance(x, (list, tuple)) else x for x in v] for k, v in parsed.items()} == geno._asdict()
    mixed = derive_mixed_genotype({"normal": W}, 4, 2, P, threshold=0.13)
    assert eval(repr(mixed), {"MixedGenotype": MixedGenotype}) == mixed
    assert ast.literal_eval(repr(mixed.normal)) == mixed.normal


# -- defects -------------------------------------------------------------------------------------------------------

def test_a_genotype_of_a_cell_type_other_than_normal_and_reduce_is_one_line_not_a_dropped_cell():
    """An adapted supernet may have cells of other types (its cells' ``cell_type``); derive_genotype derived them and
    returned a Genotype without them, so a DARTS search's genotype() of a normal and an "up" cell had no up cell."""
    from nasdiag.search import Schedule
    from nasdiag.search.methods.darts import DARTS
    from nasdiag.search.supernet import adapt

    W = torch.softmax(torch.randn(5, len(P)), 1)
    for call in (lambda: derive_genotype({"normal": W, "up": W}, 2, 2, P),
                 lambda: derive_genotype({"normal": W}, 2, 2, P, eligible={"reduction": W > 0}),
                 lambda: derive_mixed_genotype({"Normal": W}, 2, 2, P)):
        with pytest.raises(ValueError) as e:
            call()
        assert "derive_cell" in _one_line(e)

    ops = ["none", "skip_connect"]

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self._ops = nn.ModuleList([nn.Identity(), nn.Identity()])
            self.primitives = ops

        def forward(self, x, weights):
            return sum(w * op(x) * (k > 0) for k, (w, op) in enumerate(zip(weights, self._ops)))

    class DartsCell(nn.Module):
        def __init__(self, t):
            super().__init__()
            self._steps, self._multiplier, self.cell_type, self.reduction = 2, 1, t, False
            self._ops = nn.ModuleList(Mixed() for _ in range(5))

        def forward(self, s0, s1, weights):
            states, off = [s0, s1], 0
            for _ in range(2):
                states.append(sum(self._ops[off + j](h, weights[off + j]) for j, h in enumerate(states)))
                off += len(states) - 1
            return states[-1]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.fc = nn.Conv2d(1, 2, 3, padding=1), nn.Linear(2, 3)
            self.cells = nn.ModuleList([DartsCell("normal"), DartsCell("up")])
            self.alphas_normal = nn.Parameter(torch.zeros(5, 2))
            self.alphas_up = nn.Parameter(torch.zeros(5, 2))

        def forward(self, x):
            s0 = s1 = self.stem(x)
            for c in self.cells:
                s0, s1 = s1, c(s0, s1, torch.softmax(getattr(self, f"alphas_{c.cell_type}"), -1))
            return self.fc(s1.mean((2, 3)))

    net = adapt(Net())
    assert net.cell_types == ["normal", "up"]
    method = DARTS(net, DARTS.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=1))
    with pytest.raises(ValueError) as e:
        method.genotype()
    assert "'up'" in _one_line(e)


def test_a_supernet_of_no_node_or_non_integer_sizes_is_one_line_naming_what_was_wrong():
    """steps = 0 was "multiplier must be in [1, steps=0], got 4" whatever the multiplier; 2.5 steps or layers
    range()'s TypeError, C = 4.0 torch's "empty(): argument 'size'" TypeError; reductions=[1.5] made cell 1 a reduction
    cell without a word."""
    cfg = OpConfig()
    for kwargs, word in [(dict(steps=0, multiplier=0), "steps"), (dict(steps=0), "steps"), (dict(steps=2.5), "steps"),
                         (dict(steps=True, multiplier=1), "steps"), (dict(C=4.0), "C must"), (dict(layers=2.0), "layers"),
                         (dict(reductions=[1.5]), "reduction indices"), (dict(steps=2, multiplier=1.0), "multiplier")]:
        args = dict(C=4, num_classes=10, layers=3)
        args.update(kwargs)
        with pytest.raises(ValueError) as e:
            Network(**args)
        assert word in _one_line(e), kwargs
    with pytest.raises(ValueError) as e:
        Cell(0, 0, 4, 4, 4, False, False, P, cfg)
    assert "steps" in _one_line(e) and "multiplier" not in str(e.value)


def test_a_mixed_op_of_no_candidate_a_string_of_names_or_another_stride_is_one_line():
    """MixedOp(C, 1, []) was built and its forward returned the int 0 (a Cell of no primitives too); a string was
    taken letter by letter ("unknown candidate op 'n'"); stride 3 built a FactorizedReduce skip that halves beside
    ops that divide by 3, a shape error at the forward or a silently wrong size."""
    cfg = OpConfig()
    for call, word in [(lambda: MixedOp(4, 1, []), "primitives"), (lambda: MixedOp(4, 1, "none"), "primitives"),
                       (lambda: Cell(2, 2, 4, 4, 4, False, False, [], cfg), "primitives"),
                       (lambda: Network(4, 10, 3, primitives="skip_connect"), "primitives"),
                       (lambda: MixedOp(4, 3, ["skip_connect"]), "stride"), (lambda: MixedOp(4, 0, P), "stride")]:
        with pytest.raises(ValueError) as e:
            call()
        assert word in _one_line(e)
    with pytest.raises(ValueError) as e:  # channels a strided skip cannot halve: one line too (was right)
        MixedOp(3, 2, ["skip_connect"])
    assert "even" in _one_line(e)


def test_a_bool_mask_of_the_kept_ops_derives_the_genotype_of_its_zero_one_weights():
    """A mask of the ops kept (a switch, an alive set) was torch's NotImplementedError ("abs_cpu" not implemented for
    'Bool') in derive_mixed_cell and argmax's RuntimeError in derive_cell; it is its 0/1 weights."""
    mask = torch.rand(9, len(P), generator=torch.Generator().manual_seed(4)) > 0.6
    mask[4] = False  # an edge with no op kept
    ones = mask.to(torch.float64)
    kept = [(P[k], i, j) for e, (i, j) in enumerate((i, j) for j in range(2, 5) for i in range(j))
            for k in range(len(P)) if mask[e, k] and P[k] != "none"]
    assert derive_mixed_genotype({"normal": mask}, 3, 3, P).normal == kept
    assert derive_cell(mask, 3, P) == _parse(ones.tolist(), 3, P)
