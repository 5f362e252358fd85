"""Audit round 6 of the discretization stage of every method, against rules transcribed here from the papers.

References (all in this file, plain Python over float64 lists, never nasdiag):

- the DARTS rule (DARTS §2.4 and its ``_parse``; SNAS/DSNAS derive the same way): per intermediate node the two
  incoming edges whose strongest op other than ``none`` is strongest, each with that op; ties keep the lower
  input node and the lower op index (a stable sort and a strict ``>``);
- XNAS §2.1 "The Discretization Stage": the same rule on the EG weights u, strength max_i u_i; an expert that was
  wiped out (u = 0) is no longer an expert of its forecaster, so it is never named: an edge whose only survivor
  is ``none`` is no candidate input, and a node left with fewer than two candidates takes ``("none", i)`` (no
  connection) for the missing places;
- ASM-NAS Algorithm 1 lines 6-12: the ops selected by the per-sample attention argmax on the validation set,
  counted; an op never selected on its edge is never named (same rule for an edge that ``none`` won outright);
- SparseNAS eq 1 (mixed path: every non-zero weight other than ``none``) with its node sparsity (a node with no
  incoming weight from a kept node is removed, with the ops leaving it and its output place); BayesNAS the same on
  the switches still on.

Defects these tests found (each fails without its fix): an XNAS edge whose only surviving expert was ``none`` put a
wiped-out expert (u = 0) into the genotype; an ASM-NAS edge where ``none`` won every sample put an op the selection
never chose into it; ``derive_cell`` named the excluded ``none`` on an edge whose weights were all -inf; the genotype
``nasdiag report`` shows (``plot.arch.cell_genes``) differed from the one the CLI prints: for XNAS it named wiped-out
experts, for ASM-NAS it came from the previous epoch's selection, and for SparseNAS/BayesNAS it kept the ops leaving
a removed node.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from nasdiag.search import Schedule, get_method
from nasdiag.search.methods.sparsenas import without_removed_nodes
from nasdiag.supernet import DARTS_PRIMITIVES, MixedGenotype, Network, derive_cell, derive_genotype, derive_mixed_cell

P = list(DARTS_PRIMITIVES)
NONE = P.index("none")


# -- references ---------------------------------------------------------------------------------------------------
def ref_edges(steps):
    return [(i, j) for j in range(2, steps + 2) for i in range(j)]


def ref_darts(w, steps, eligible=None, k=2):
    """DARTS's _parse, with an optional (E, K) eligibility mask (XNAS alive, ASM-NAS count > 0); w a list of lists."""
    K = len(w[0])
    ok = [[eligible is None or bool(eligible[e][o]) for o in range(K)] for e in range(len(w))]
    genes, start = [], 0
    for node in range(steps):
        n = node + 2
        best = {}
        for i in range(n):
            kb = None
            for o in range(K):
                if o != NONE and ok[start + i][o] and (kb is None or w[start + i][o] > w[start + i][kb]):
                    kb = o
            if kb is not None:
                best[i] = kb
        chosen = sorted(best, key=lambda i: -w[start + i][best[i]])[:k]  # stable: ties keep the lower input
        genes += [(P[best[i]], i) for i in chosen]
        if len(chosen) < k:  # no other eligible op on the remaining edges: "none" (no connection) where it survived
            rest = [i for i in range(n) if i not in best and ok[start + i][NONE]]
            rest = sorted(rest, key=lambda i: -w[start + i][NONE])[: k - len(chosen)]
            genes += [("none", i) for i in rest]
        start += n
    return genes


def ref_mixed(w, steps):
    """SparseNAS eq 1 with node sparsity: (op, i, j) for every non-zero non-none weight, removed nodes dropped."""
    kept = [(P[o], i, j) for e, (i, j) in enumerate(ref_edges(steps)) for o in range(len(P))
            if o != NONE and w[e][o] != 0]
    live = set()
    for j in range(2, steps + 2):
        if any(t == j and (i < 2 or i in live) for _, i, t in kept):
            live.add(j)
    return [g for g in kept if g[2] in live and (g[1] < 2 or g[1] in live)], [j for j in range(2, steps + 2) if j in live]


def tables(steps, seed, n=60):
    """Random and adversarial (E, K) weight tables: ties, all equal, zeros, -inf rows, only none non-zero, integers."""
    rng = random.Random(seed)
    E = len(ref_edges(steps))
    out = [[[0.0] * len(P) for _ in range(E)], [[1.0 / len(P)] * len(P) for _ in range(E)],
           [[-math.inf] * len(P) for _ in range(E)]]
    for _ in range(n):
        kind = rng.randrange(5)
        if kind == 0:
            w = [[rng.random() for _ in P] for _ in range(E)]
        elif kind == 1:  # few levels: ties between ops and between edges
            w = [[float(rng.randrange(3)) for _ in P] for _ in range(E)]
        elif kind == 2:  # one-hot rows, often on none
            w = [[1.0 if o == rng.choice([NONE, rng.randrange(len(P))]) else 0.0 for o in range(len(P))] for _ in range(E)]
        elif kind == 3:  # -inf sprinkled
            w = [[-math.inf if rng.random() < 0.5 else rng.random() for _ in P] for _ in range(E)]
        else:  # counts
            w = [[float(rng.randrange(4)) * (rng.random() < 0.4) for _ in P] for _ in range(E)]
        out.append(w)
    return out


# -- the DARTS rule (DARTS / SNAS / DSNAS, and the base of XNAS / ASM-NAS) ----------------------------------------
@pytest.mark.parametrize("steps", [1, 2, 4])
def test_derive_cell_is_the_darts_rule_on_random_and_adversarial_tables_and_never_names_none(steps):
    """Including rows of all -inf, where derive_cell took torch's argmax over the masked row and named ``none``."""
    for t, w in enumerate(tables(steps, seed=steps)):
        got = derive_cell(torch.tensor(w, dtype=torch.float64), steps, P)
        assert got == ref_darts(w, steps), (t, w)
        assert all(op != "none" for op, _ in got)


@pytest.mark.parametrize("steps", [2, 3])
def test_derive_cell_with_an_eligibility_mask_never_names_an_ineligible_op(steps):
    rng = random.Random(7)
    E = len(ref_edges(steps))
    for t, w in enumerate(tables(steps, seed=10 + steps)):
        # every edge keeps at least one op (an XNAS forecaster always has a survivor); none survives often alone
        mask = []
        for _ in range(E):
            row = [rng.random() < 0.3 for _ in P]
            if rng.random() < 0.4:
                row = [o == NONE for o in range(len(P))]
            if not any(row):
                row[rng.randrange(len(P))] = True
            mask.append(row)
        got = derive_cell(torch.tensor(w, dtype=torch.float64), steps, P, eligible=torch.tensor(mask))
        assert got == ref_darts(w, steps, mask), (t, w, mask)
        start = {j: sum(n + 2 for n in range(j - 2)) for j in range(2, steps + 2)}
        for g, (op, i) in enumerate(got):
            assert mask[start[2 + g // 2] + i][P.index(op)], (op, i)


def test_derive_cell_says_so_in_one_line_when_a_node_has_nothing_it_may_name():
    w = torch.rand(2, len(P), dtype=torch.float64)
    mask = torch.zeros(2, len(P), dtype=torch.bool)
    mask[0, 3] = True  # node 2: one edge with an op, the other with nothing eligible (not even none)
    with pytest.raises(ValueError, match="node 2 has 1 incoming edge") as info:
        derive_cell(w, 1, P, eligible=mask)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="eligible must have the shape"):
        derive_cell(w, 1, P, eligible=mask[:, :3])


# -- XNAS ----------------------------------------------------------------------------------------------------------
def _xnas(steps=3):
    torch.manual_seed(0)
    net = Network(4, 3, 3, steps=steps, multiplier=steps, in_channels=1).double()
    cls = get_method("xnas")
    return cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=4))


def _set_forecaster(f, log_v, alive):
    f._log_v = log_v.masked_fill(~alive, -math.inf).to(f._log_v.dtype)
    f._alive = alive.clone()


def test_xnas_genotype_never_names_a_wiped_out_expert():
    """XNAS §2.1: each kept forecaster is replaced by its strongest expert; an expert that was wiped out is gone.
    Edge 0 of the normal cell keeps only ``none`` (the pre-fix genotype named max_pool_3x3 there, u = 0, wiped out);
    node 3 keeps one eligible edge only (its other places are "none"); the rest random with random wipeouts."""
    method = _xnas()
    E = method.network.num_edges
    g = torch.Generator().manual_seed(5)
    for trial in range(25):
        expected = {}
        for t, f in method.forecasters.items():
            alive = torch.rand(E, len(P), generator=g) < 0.35
            alive[~alive.any(1), NONE] = True
            if t == "normal":
                alive[0] = False
                alive[0, NONE] = True  # edge (0, 2): only none survives
                alive[2:5] = False
                alive[2:5, NONE] = True
                alive[3, 4] = True  # node 3: edges (0,3), (1,3), (2,3); only (1,3) has an eligible op
            log_v = torch.randn(E, len(P), generator=g, dtype=torch.float64) * 3
            _set_forecaster(f, log_v, alive)
            u = torch.softmax(log_v.masked_fill(~alive, -math.inf), -1)
            expected[t] = ref_darts(u.tolist(), 3, alive.tolist())
        genotype = method.genotype()
        assert genotype.normal == expected["normal"], trial
        assert genotype.reduce == expected["reduce"], trial
        for t in ("normal", "reduce"):
            alive = method.forecasters[t].alive
            start = {2: 0, 3: 2, 4: 5}
            for n, (op, i) in enumerate(getattr(genotype, t)):
                assert alive[start[2 + n // 2] + i, P.index(op)], (trial, t, op, i)


def test_xnas_genotype_reads_u_in_float64_so_a_tiny_surviving_weight_still_decides():
    """u is float64 in the forecasters; the network's float32 probabilities() would round a survivor's 1e-50 to 0
    and tie it with the wiped-out experts."""
    torch.manual_seed(0)
    net = Network(4, 3, 3, steps=1, multiplier=1, in_channels=1)  # float32 network
    cls = get_method("xnas")
    method = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=4))
    for f in method.forecasters.values():
        alive = torch.zeros(2, len(P), dtype=torch.bool)
        alive[:, NONE] = True
        alive[:, 5] = True  # sep_conv_5x5 survives on both edges with u ~ 1e-50 (edge 0) and 1e-60 (edge 1)
        alive[:, 2] = True  # max_pool_3x3 survives too, smaller still
        log_v = torch.zeros(2, len(P), dtype=torch.float64)
        log_v[:, 5] = torch.tensor([-115.0, -138.0])
        log_v[:, 2] = -200.0
        _set_forecaster(f, log_v, alive)
    assert method.genotype().normal == [("sep_conv_5x5", 0), ("sep_conv_5x5", 1)]


# -- ASM-NAS -------------------------------------------------------------------------------------------------------
def test_asmnas_genotype_never_names_an_op_the_selection_never_chose():
    """Algorithm 1 line 10 keeps the op with the most argmax counts; where ``none`` won every sample of an edge, the
    other ops have count 0 and the pre-fix genotype named the first of them (max_pool_3x3)."""
    torch.manual_seed(0)
    net = Network(4, 3, 3, steps=3, multiplier=3, in_channels=1).double()
    cls = get_method("asmnas")
    method = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=4))
    E = net.num_edges
    rng = random.Random(3)
    for trial in range(25):
        counts = {}
        for t in net.cell_types:
            c = [[0] * len(P) for _ in range(E)]
            for e in range(E):  # 12 validation samples × 2 cells per edge, spread over a few ops (ties likely)
                ops = [NONE] if rng.random() < 0.35 else rng.sample(range(len(P)), rng.randrange(1, 4))
                for _ in range(24):
                    c[e][rng.choice(ops)] += 1
            counts[t] = c
        method.selection_counts = {t: torch.tensor(c, dtype=torch.int64) for t, c in counts.items()}
        genotype = method.genotype()
        for t in net.cell_types:
            freq = [[x / sum(row) for x in row] for row in counts[t]]
            assert getattr(genotype, t) == ref_darts(freq, 3, [[x > 0 for x in row] for row in counts[t]]), trial


# -- SparseNAS / BayesNAS mixed path -------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [2, 4])
def test_mixed_genotype_is_eq_1_with_the_removed_nodes_dropped(steps):
    rng = random.Random(steps)
    E = len(ref_edges(steps))
    for trial in range(60):
        density = rng.choice([0.0, 0.05, 0.15, 0.5, 1.0])
        w = [[(rng.random() - 0.5) if rng.random() < density else 0.0 for _ in P] for _ in range(E)]
        if trial % 5 == 0:  # only none alive on some edges
            for e in rng.sample(range(E), E // 2):
                w[e] = [1.0 if o == NONE else 0.0 for o in range(len(P))]
        cell = derive_mixed_cell(torch.tensor(w, dtype=torch.float64), steps, P)
        concat = list(range(2, steps + 2))
        got = without_removed_nodes(MixedGenotype(cell, concat, cell, concat))
        genes, live = ref_mixed(w, steps)
        assert got.normal == genes and got.normal_concat == live, (trial, w)


def test_bayesnas_genotype_is_the_switches_still_on_with_removed_nodes_dropped():
    torch.manual_seed(0)
    net = Network(4, 3, 3, steps=3, multiplier=3, in_channels=1).double()
    cls = get_method("bayesnas")
    method = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=4))
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        on = {t: torch.rand(net.num_edges, len(P), generator=g) < [0.05, 0.2, 0.6][trial % 3] for t in net.cell_types}
        for t in on:
            method.alive[t].copy_(on[t])
        genotype = method.genotype()
        for t in net.cell_types:
            genes, live = ref_mixed(on[t].double().tolist(), 3)
            assert getattr(genotype, t) == genes and getattr(genotype, f"{t}_concat") == live, trial


def test_derive_genotype_of_each_cell_type_takes_its_own_mask():
    steps = 2
    E = len(ref_edges(steps))
    w = {t: torch.rand(E, len(P), dtype=torch.float64) for t in ("normal", "reduce")}
    masks = {"normal": torch.ones(E, len(P), dtype=torch.bool), "reduce": torch.zeros(E, len(P), dtype=torch.bool)}
    masks["reduce"][:, NONE] = True
    masks["reduce"][4, 6] = True
    got = derive_genotype(w, steps, steps, P, eligible=masks)
    for t in w:
        assert getattr(got, t) == ref_darts(w[t].tolist(), steps, masks[t].tolist())
    partial = derive_genotype(w, steps, steps, P, eligible={"normal": masks["reduce"]})  # reduce: no mask, DARTS rule
    assert partial.normal == ref_darts(w["normal"].tolist(), steps, masks["reduce"].tolist())
    assert partial.reduce == ref_darts(w["reduce"].tolist(), steps)
    assert got.normal_concat == got.reduce_concat == [2, 3]


# -- the genotype `nasdiag report` shows is the method's ---------------------------------------------------------------
def _report_genes(tmp_path, method, rows, name="run.h5"):
    """Record ``rows`` (a list of statistics dicts, one per step) and read back the genotype the report shows."""
    from nasdiag.plot.arch import cell_genes
    from nasdiag.record import RecorderCallback, load

    path = tmp_path / name
    meta = {"op_names": list(method.network.primitives), "cell_types": list(method.network.cell_types)}
    with RecorderCallback(path, meta=meta) as cb:
        for step, stats in enumerate(rows, start=1):
            cb.on_step_end(step, stats)
    record = load(path)
    return {t: cell_genes(record, t, len(rows) - 1) for t in method.network.cell_types}


def _as_triples(genes, steps=3):
    return [(op, i, 2 + n // 2) for n, (op, i) in enumerate(genes)]


def test_report_genotype_of_xnas_is_the_methods_with_wiped_out_experts_recorded_at_their_removal_weight(tmp_path):
    """``regret/<cell>/log_weights`` keeps a wiped-out expert's ln v at removal (often larger than a survivor's); the
    report must still name only the survivors, as XNAS.genotype does (also from a record without the log weights)."""
    method = _xnas()
    E = method.network.num_edges
    g = torch.Generator().manual_seed(11)
    stats = {}
    for t, f in method.forecasters.items():
        alive = torch.rand(E, len(P), generator=g) < 0.3
        alive[~alive.any(1), NONE] = True
        alive[0] = False
        alive[0, NONE] = True
        log_v = torch.randn(E, len(P), generator=g, dtype=torch.float64)
        _set_forecaster(f, log_v, alive)
        at_removal = torch.where(alive, log_v, log_v + 5.0)  # the recorded ln v: finite, wiped ones at removal
        stats.update({f"arch/{t}/probabilities": method.probabilities()[t], f"regret/{t}/alive": alive,
                      f"regret/{t}/log_weights": at_removal})
    genotype = method.genotype()
    genes = _report_genes(tmp_path, method, [stats])
    without_log_v = _report_genes(tmp_path, method, [{k: v for k, v in stats.items() if "log_weights" not in k}], "old.h5")
    for t in ("normal", "reduce"):
        assert genes[t] == _as_triples(getattr(genotype, t)), t
        assert without_log_v[t] == _as_triples(getattr(genotype, t)), t


def test_report_genotype_of_asmnas_is_the_last_selections(tmp_path):
    """The step rows' ``arch/<cell>/probabilities`` come from the previous epoch's selection; the final genotype is the
    last selection's (``attention/<cell>/count`` on the epoch row), with ops never chosen not named."""
    torch.manual_seed(0)
    net = Network(4, 3, 3, steps=3, multiplier=3, in_channels=1).double()
    cls = get_method("asmnas")
    method = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=4))
    g = torch.Generator().manual_seed(2)
    stale = {f"arch/{t}/probabilities": torch.rand(net.num_edges, len(P), generator=g, dtype=torch.float64)
             for t in net.cell_types}
    counts = {}
    for t in net.cell_types:
        c = torch.randint(0, 3, (net.num_edges, len(P)), generator=g) * (torch.rand(net.num_edges, len(P), generator=g) < 0.3)
        c[:3] = 0
        c[:3, NONE] = 24  # none won edges (0,2), (1,2), (0,3)
        c[c.sum(1) == 0, 4] = 1
        counts[t] = c
    method.selection_counts = counts
    genes = _report_genes(tmp_path, method, [stale, {**stale, **method.epoch_statistics()}])
    genotype = method.genotype()
    for t in net.cell_types:
        assert genes[t] == _as_triples(getattr(genotype, t)), t
        assert getattr(genotype, t)[:2] == [("none", 0), ("none", 1)]


@pytest.mark.parametrize("name", ["sparsenas", "bayesnas"])
def test_report_genotype_of_the_mixed_path_methods_drops_the_removed_nodes_as_the_method_does(tmp_path, name):
    """Node 2 gets no op: the ops leaving it are not in the method's genotype, and must not be in the report's."""
    from nasdiag import vocabulary as V

    torch.manual_seed(0)
    net = Network(4, 3, 3, steps=3, multiplier=3, in_channels=1).double()
    cls = get_method(name)
    method = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=4))
    E = net.num_edges
    on = torch.ones(E, len(P), dtype=torch.bool)
    on[:2] = False  # node 2 removed; edges (2,3) and (2,4) leave it
    stats = {}
    fam = V.BAYES_SWITCH if name == "bayesnas" else V.SPARSITY_NONZERO
    for t in net.cell_types:
        if name == "bayesnas":
            method.alive[t].copy_(on)
        else:
            with torch.no_grad():
                net.alphas()[t].copy_(on.double())
        stats[f"arch/{t}/probabilities"] = method.probabilities()[t]
        stats[fam.path(cell=t)] = on
    genes = _report_genes(tmp_path, method, [stats])
    genotype = method.genotype()
    for t in net.cell_types:
        assert genes[t] == getattr(genotype, t), t
        assert not any(i == 2 or j == 2 for _, i, j in genes[t])


@pytest.mark.parametrize("name", ["darts", "snas", "dsnas"])
def test_darts_snas_dsnas_genotype_is_the_darts_rule_on_softmax_alpha(name):
    """Random α, α with every op tied, α where none is strongest everywhere, α with ties between edges; NaN refused."""
    from nasdiag.search.base import SearchError

    torch.manual_seed(0)
    net = Network(4, 3, 3, steps=3, multiplier=3, in_channels=1).double()
    cls = get_method(name)
    method = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=4))
    E = net.num_edges
    g = torch.Generator().manual_seed(4)
    cases = [torch.randn(E, len(P), generator=g, dtype=torch.float64) for _ in range(5)]
    cases += [torch.zeros(E, len(P), dtype=torch.float64)]
    strong_none = torch.randn(E, len(P), generator=g, dtype=torch.float64)
    strong_none[:, NONE] = 50.0
    cases += [strong_none, torch.randint(0, 2, (E, len(P)), generator=g).double()]
    for c, a in enumerate(cases):
        with torch.no_grad():
            for t, alpha in net.alphas().items():
                alpha.copy_(a if t == "normal" else a.flip(0))
        genotype = method.genotype()
        for t in net.cell_types:
            a_t = a if t == "normal" else a.flip(0)
            p = [[math.exp(x) / sum(math.exp(y) for y in row) for x in row] for row in a_t.tolist()]
            assert getattr(genotype, t) == ref_darts(p, 3), (c, t)
            assert genotype.normal_concat == genotype.reduce_concat == [2, 3, 4]
    with torch.no_grad():
        net.alphas()["reduce"][3, 2] = math.nan
    with pytest.raises(SearchError, match=r"reduce architecture weights are NaN or inf on edge\(s\) \[3\]"):
        method.genotype()


def test_a_nonsense_edges_per_node_or_threshold_is_refused_in_one_line_not_a_silent_architecture():
    """edges_per_node=-1 kept all but the weakest input of each node ([:-1]); threshold=NaN kept no op at all."""
    w = torch.rand(5, len(P), dtype=torch.float64)
    for bad in (-1, 0, 1.5, True):
        with pytest.raises(ValueError, match="edges_per_node must be an integer >= 1") as info:
            derive_cell(w, 2, P, edges_per_node=bad)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="threshold must be >= 0, got nan"):
        derive_mixed_cell(w, 2, P, threshold=math.nan)
    assert derive_cell(w, 2, P, edges_per_node=1) == [g for n, g in enumerate(ref_darts(w.tolist(), 2)) if n % 2 == 0]


def test_report_genotype_of_a_record_with_an_edge_where_nothing_is_alive_says_so_instead_of_a_traceback(tmp_path):
    from nasdiag.plot.registry import NothingToDraw

    method = _xnas()
    E = method.network.num_edges
    stats = {}
    for t in method.network.cell_types:
        alive = torch.ones(E, len(P), dtype=torch.bool)
        alive[0:2] = False  # node 2: nothing alive on either input (a corrupt record; XNAS never writes it)
        stats.update({f"arch/{t}/probabilities": torch.full((E, len(P)), 1.0 / len(P), dtype=torch.float64),
                      f"regret/{t}/alive": alive})
    with pytest.raises(NothingToDraw, match="node 2 has 0 incoming edge"):
        _report_genes(tmp_path, method, [stats])
