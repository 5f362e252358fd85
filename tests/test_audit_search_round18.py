"""Round-18 audit of what `nasdiag search` writes (nasdiag/search/runner.py, config.py, checkpoint.py; docs/schema.md).

Checked and found right (by hand, on tiny float64 CPU runs of every method, C=2, layers=3, steps=2, 2 epochs):
- every path of every method's record (asmnas, bayesnas, darts, darts2, dsnas, proxyless, snas, sparsenas, xnas,
  diagnostics cost,hessian) is of a documented family, with its row shape (E, K from the meta's edge and op names,
  R = cells of the type for XNAS's rewards), its dtype (``float32`` = the run's dtype; float64 families float64) and
  its rows: ``step`` families on every row, ``epoch`` families on the epoch's last row only;
- the genotype the figures draw from the record (``nasdiag.plot.arch.cell_genes`` at the last row, and its concat)
  is the method's ``genotype()`` for every method; the figures written are the families' registered set;
- the tests below: a record's paths against the schema from the vocabulary's table (no other path; no hessian/
  without the diagnostic), its final genotype against our own transcription of DARTS's rule (two strongest inputs
  per node, strongest op other than none) on the recorded probabilities, a rerun from ``meta["config"]`` alone
  bit-equal in float64, and an interrupt at an epoch boundary then mid-epoch, each resumed, bit-equal to an
  uninterrupted run for two methods round 14 did not interrupt (xnas: forecaster state; darts2: unrolled step).

Defects: the meta held no thread count, on which a CPU run's last bits depend (the second test); the genotype figure
of a pruned SparseNAS/BayesNAS cell drew removed nodes as concatenated outputs (nasdiag/plot/arch.py); a diagnostic
named twice was stored twice and a resume naming it once was refused.

Left alone: the record's meta has no ``genotype`` key (docs/figures.md reads ``meta/genotype`` if a record has one;
docs/schema.md does not promise the search writes it, and the figures derive the same genotype from the rows).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from nasdiag import vocabulary as V
from nasdiag.record import load, load_meta
from nasdiag.search import SearchConfig, run

TINY = dict(dataset="digits", C=2, layers=3, steps=2, batch_size=359, seed=5, dtype="float64", device="cpu",
            progress=False, threads=1)   # 719 digits per split // 359 = 2 steps per epoch
S = 2


def _data(path):
    rec = load(path)
    return {k: v for k, v in rec.items() if not k.startswith("meta/")}


def _assert_same_record(a, b):
    A, B = _data(a), _data(b)
    assert sorted(A) == sorted(B)
    for k in A:
        assert A[k].dtype == B[k].dtype and np.array_equal(A[k], B[k], equal_nan=True), k


def _darts_rule(p: np.ndarray, ops, steps: int):
    """DARTS's genotype rule, transcribed: for node j the two inputs i < j whose strongest op other than none is
    strongest, each with that op; edges in DARTS order (node 2's inputs 0, 1, node 3's 0, 1, 2, ...)."""
    genes, e = [], 0
    for j in range(steps):
        n_in = j + 2
        rows = p[e:e + n_in]
        e += n_in
        keep = [k for k, op in enumerate(ops) if op != "none"]
        best = [(max(rows[i, k] for k in keep), i) for i in range(n_in)]
        for _, i in sorted(best, key=lambda t: -t[0])[:2]:
            k = max(keep, key=lambda k: rows[i, k])
            genes.append((ops[k], i, j + 2))
    return sorted(genes)


def test_a_records_paths_and_genotype_are_the_documented_ones_and_its_meta_alone_reruns_it_bit_equal(tmp_path):
    cfg = SearchConfig(method="snas", epochs=1, diagnostics=("cost",), record=str(tmp_path / "a.h5"), **TINY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run(cfg)
    rec, meta = load(cfg.record), load_meta(cfg.record)
    ops, cells = list(meta["op_names"]), list(meta["cell_types"])
    T = len(rec["step"])
    assert list(rec["step"]) == list(range(1, S + 1))
    paths = [k for k in rec if not k.startswith(("meta/", "valid/")) and k != "step"]
    for path in paths:
        fam = V.family_of(path)
        assert fam is not None, f"{path} is of no documented family"
        assert fam.section in ("core", "cost", "sample"), path      # no hessian/ without the hessian diagnostic
        cell = path.split("/")[1] if path.count("/") == 2 else None
        E = len(meta["edge_names"][cell]) if cell in cells else None
        row = rec[path].shape[1:]
        want = {"scalars": (), "arch": (E, len(ops)), "cost": (E, len(ops))}[path.split("/")[0]]
        assert row == want, (path, row, want)
        want_dtype = {"int64": np.int64, "float64": np.float64, "bool": np.bool_, "float32": np.float64}[str(fam.dtype)]
        assert rec[path].dtype == want_dtype, (path, rec[path].dtype, fam.dtype)
        valid = rec["valid/" + path]
        expected = np.ones(T, bool) if fam.when == "step" else (np.arange(1, T + 1) % S == 0)
        assert np.array_equal(valid, expected), (path, fam.when, valid)
    for cell in cells:
        for name in ("params", "probabilities", "weights"):
            assert f"arch/{cell}/{name}" in paths
        for name in ("mean", "var", "count"):
            assert f"cost/{cell}/{name}" in paths
        mine = _darts_rule(rec[f"arch/{cell}/probabilities"][-1], ops, cfg.steps)
        assert sorted((op, i, 2 + n // 2) for n, (op, i) in enumerate(getattr(result.genotype, cell))) == mine, cell
    for name in ("train_loss", "train_acc", "temperature", "entropy", "epoch", "search_val_loss", "search_val_acc"):
        assert f"scalars/{name}" in paths
    assert meta["method"] == "snas" and meta["seed"] == cfg.seed and meta["hp"]["alpha_lr"] == 0.03  # digits preset
    documented = {"method", "seed", "op_names", "edge_names", "cell_types", "config", "hp", "run", "config_hash",
                  "world_size", "threads"}       # docs/schema.md, the meta of a nasdiag search record
    added = {"schema_version", "nasdiag_version", "torch_version", "h5py_version", "hdf5_version", "run_id", "segments",
             "nonfinite_counts"}                  # what load_meta adds
    assert set(meta) == documented | added
    assert not {"resume", "force", "progress", "threads"} & set(meta["config"])

    again = SearchConfig.from_dict({**meta["config"], "record": str(tmp_path / "b.h5"), "figures": None,
                                    "threads": meta["threads"]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rerun = run(again)
    _assert_same_record(cfg.record, again.record)
    assert rerun.genotype == result.genotype


def test_a_records_meta_keeps_the_thread_count_its_numbers_depend_on(tmp_path):
    """``threads`` is a session field, left out of meta["config"]; but torch's intra-op thread count changes the
    order of its sums: a float64 DSNAS search (this one, --threads 1) rerun from its meta's config alone, with the
    default 2 threads on this box, differed by 1 ulp in arch/normal/params. The meta keeps the count."""
    cfg = SearchConfig(method="dsnas", epochs=1, diagnostics=(), record=str(tmp_path / "a.h5"), **TINY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(cfg)
    assert load_meta(cfg.record)["threads"] == cfg.threads == 1


class _Interrupt:
    """Ctrl-C at the end of epoch 0 (after its checkpoint: the epoch boundary) or in a step's callback (mid-epoch)."""

    def __init__(self, at):
        self.at = at

    @staticmethod
    def _stop_if(condition):
        if condition:
            raise KeyboardInterrupt

    def on_step_end(self, step, stats):
        self._stop_if(step == self.at)

    def on_epoch_end(self, epoch, stats):
        self._stop_if(self.at == "epoch" and epoch == 0)

    def on_exception(self, exc):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("method", ["xnas", "darts2"])
def test_a_search_interrupted_at_an_epoch_boundary_then_mid_epoch_resumes_bit_equal(tmp_path, method):
    base = dict(method=method, epochs=2, diagnostics=("cost",), **TINY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = run(SearchConfig(**base, record=str(tmp_path / "ref.h5")))
        path = str(tmp_path / "cut.h5")
        with pytest.raises(KeyboardInterrupt):
            run(SearchConfig(**base, record=path), callbacks=[_Interrupt("epoch")])
        with pytest.raises(KeyboardInterrupt):   # mid-epoch 1: its first step ran, the checkpoint is epoch 0's
            run(SearchConfig(**base, record=path, resume=True), callbacks=[_Interrupt(S + 1)])
        assert load(path)["step"][-1] >= S      # the epoch boundary's rows were committed
        resumed = run(SearchConfig(**base, record=path, resume=True))
    _assert_same_record(ref.record, path)
    assert len(load_meta(path)["segments"]) >= 2
    assert resumed.genotype == ref.genotype


def _surviving_nodes(mask: np.ndarray, steps: int):
    """The paper's node sparsity, transcribed: node j (2 ..) survives when a kept op enters it from a cell input (0, 1)
    or from a surviving node; edges in DARTS order."""
    live, e = set(), 0
    for j in range(2, steps + 2):
        for i in range(j):
            if mask[e].any() and (i < 2 or i in live):
                live.add(j)
            e += 1
    return live


def test_the_genotype_figure_of_a_pruned_cell_concatenates_only_the_nodes_the_methods_genotype_keeps(tmp_path,
                                                                                                     monkeypatch):
    """A SparseNAS search (steps 3, hapg, lambda_step 0.1, 2 epochs on digits) kept reduce_concat=[3] (nodes 2 and 4
    removed), while the genotype figure drew nodes 2, 3 and 4 as the cell's concatenated outputs (the config's
    multiplier), so the record's drawn genotype was not the method's. (nasdiag/plot/arch.py, outside this area.)"""
    from nasdiag.plot import arch
    from nasdiag.record import Recorder

    steps, ops = 3, ["skip_connect", "max_pool_3x3", "sep_conv_3x3"]
    edges = [f"{j}<-{i}" for j in range(2, steps + 2) for i in range(j)]           # 2+3+4 = 9
    mask = np.zeros((len(edges), len(ops)), bool)
    mask[2, 0] = mask[3, 2] = True        # 0->3, 1->3: node 3 kept; node 2 gets nothing
    mask[7, 1] = True                     # 2->4 only: node 4 fed by the removed node 2 alone
    path = str(tmp_path / "r.h5")
    meta = {"method": "sparsenas", "config": {"steps": steps, "multiplier": steps}, "op_names": ops,
            "edge_names": {"normal": edges}, "cell_types": ["normal"]}
    with Recorder(path, meta=meta) as rec:
        rec.log(1, {"arch/normal/probabilities": np.where(mask, 0.5, 0.0), "sparsity/normal/nonzero": mask})
    record = load(path)
    drawn = {}
    real = arch.C.cell_figure
    monkeypatch.setattr(arch.C, "cell_figure", lambda genes, s, concat, title: drawn.update(genes=genes, concat=concat)
                        or real(genes, s, concat, title))
    arch.genotype_cell(record, "normal", 0)
    live = _surviving_nodes(mask, steps)
    assert sorted(drawn["concat"]) == sorted(live) == [3]
    assert all(j in live and (i < 2 or i in live) for _, i, j in drawn["genes"])


def test_a_diagnostic_named_twice_records_as_once_and_resumes_with_it_named_once(tmp_path):
    """--diagnostics cost,cost records what cost does, but was stored as ['cost', 'cost']: the resume of the run with
    --diagnostics cost was refused as another setting ("diagnostics=['cost'] (recorded ['cost', 'cost'])")."""
    path = str(tmp_path / "r.h5")
    base = dict(method="darts", record=path, **{**TINY, "steps": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(SearchConfig(epochs=1, diagnostics="cost,cost", **base))
        assert load_meta(path)["config"]["diagnostics"] == ["cost"]
        run(SearchConfig(epochs=2, diagnostics="cost", resume=True, **base))
    assert list(load(path)["step"]) == list(range(1, 2 * S + 1))
