"""Audit round 3 of the search methods: what a whole `nasdiag.search.run` records and how the methods behave over
several steps, against references written here in float64.

- The diagnostics a run records at an epoch end (``cost/<cell>/{mean,var,count}``, ``hessian/<cell>/diag`` in
  ``exact`` mode) against autograd on the network restored from the run's own checkpoint, at the batch the method
  must have used (search-val for the bilevel DARTS, search-train for the single-level SNAS) and the mixing weights
  of the step (softmax(α) for DARTS, the recorded Gumbel-softmax sample for SNAS).
- A non-finite loss in the middle of a run: the failing step's row is in the record with
  ``scalars/nonfinite_loss`` = 1, and the method's parameters are those of the last finite step.
- Genotypes derived from mixing weights built here: ties, edges whose only strong op is ``none``, NaN weights.
- Resume right after an epoch end; BayesNAS over several updates once pruned ops have γ = 0.

Defects these tests found (each fails without its fix): ASM-NAS updated (w, Θ) with a NaN gradient and raised without
the step's row; darts2 and sparsenas raised without the row; BayesNAS never checked its loss and ran to the epoch end
on NaN weights; DARTS's rule derived a genotype from NaN weights (SparseNAS's mixed path dropped NaN ops as pruned);
BayesNAS turned every pruned w into NaN one update after pruning (∞·0 in A.3.1's masked gradient).
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nasdiag import vocabulary as V
from nasdiag.search import SearchConfig, run
from nasdiag.supernet import Network

TYPES = ("normal", "reduce")


class _CopyCheckpointAfterEpoch:
    """Copies the run's checkpoint (the state after the epoch's last step) once epoch ``epoch`` has ended."""

    def __init__(self, config, epoch, to):
        self.config, self.epoch, self.to = config, epoch, to

    def on_step_end(self, step, stats):
        pass

    def on_epoch_end(self, epoch, stats):
        if epoch == self.epoch:
            shutil.copy(self.config.checkpoint, self.to)

    def on_exception(self, exc):
        pass


def _restored(path, primitives=None):
    """The run's supernet (C=2, 3 layers, 2 steps, digits) in float64 with the checkpoint's weights, α and buffers."""
    from nasdiag.search.checkpoint import load_checkpoint

    kwargs = {} if primitives is None else {"primitives": primitives}
    net = Network(2, 10, 3, steps=2, multiplier=2, in_channels=1, **kwargs).double()
    net.load_state_dict(load_checkpoint(path)["method"]["network"])
    return net


def _per_cell_costs(net, x, y, z):
    """C_k = ∂L/∂Z_k (E, K) for every cell k, each cell its own leaf at Z_k = z[type of cell k]; L the batch mean."""
    leaves = [z[c.cell_type].clone().requires_grad_(True) for c in net.cells]
    loss = F.cross_entropy(net(x, leaves), y)
    return list(torch.autograd.grad(loss, leaves))


def _shared_diag_hessian(net, x, y, z, entries):
    """{type: ∂²L/∂Z_t[e, k]² at the flat indices ``entries`` of (E, K)} with Z_t shared by the cells of the type
    (cross-cell terms in), one double backward per entry."""
    leaves = {t: w.clone().requires_grad_(True) for t, w in z.items()}
    loss = F.cross_entropy(net(x, leaves), y)
    grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=True)
    out = {}
    for (t, leaf), g in zip(leaves.items(), grads):
        flat = g.reshape(-1)
        out[t] = torch.stack([torch.autograd.grad(flat[i], leaf, retain_graph=True)[0].reshape(-1)[i] for i in entries])
    return out


def _small_digits(monkeypatch, n=12):
    """run() reads digits cut to its first ``n`` search-train and search-val samples (so a step is cheap)."""
    import nasdiag.data
    from torch.utils.data import TensorDataset

    full = nasdiag.data.load_dataset

    def cut(name, **kwargs):
        s = full(name, **kwargs)
        return dataclasses.replace(s, train=TensorDataset(*s.train[:n]), val=TensorDataset(*s.val[:n]))

    monkeypatch.setattr(nasdiag.data, "load_dataset", cut)
    return cut


@pytest.mark.slow  # two short run()s with the exact mixing-weight Hessian (~12 s each on an idle core)
@pytest.mark.parametrize("method", ["darts", "snas"])
def test_recorded_epoch_diagnostics_equal_autograd_on_the_checkpointed_state(method, tmp_path, monkeypatch):
    """One step per epoch (batch 8 of 12 search samples of digits), 2 epochs, cost + exact Hessian recorded.
    The row of step 2 holds the statistics of that one step: per cell type, the mean and population variance over
    its cells of C_k = ∂L/∂Z_k at the state after step 1 (the checkpoint copied at the end of epoch 0), count = the
    cells of the type; and diag ∂²L/∂Z² at the final state and the same batch, Z shared by the type's cells. DARTS's
    batch is epoch 1's search-val batch and Z = softmax(α); SNAS's the search-train batch and Z its recorded sample
    (a cost taken on the other split, or at the other state, differs by far more than 1e-8)."""
    from nasdiag.record import load
    from nasdiag.search.runner import epoch_batches

    load_dataset = _small_digits(monkeypatch)
    out = str(tmp_path / "run.h5")
    cfg = SearchConfig(method=method, C=2, layers=3, steps=2, multiplier=2, batch_size=8, epochs=2, dtype="float64",
                       diagnostics=("cost", "hessian"), hessian_mode="exact", progress=False, threads=1, record=out)
    after_step_1 = str(tmp_path / "after1.ckpt")
    run(cfg, callbacks=[_CopyCheckpointAfterEpoch(cfg, 0, after_step_1)])
    rec = load(out)
    assert rec["step"].tolist() == [1, 2]
    splits = load_dataset("digits", seed=0, dtype=torch.float64)
    split, seed = (splits.val, cfg.seed + 1) if method == "darts" else (splits.train, cfg.seed)
    x, y = next(epoch_batches(split, 8, seed, 1))
    before = _restored(after_step_1)
    if method == "darts":
        z = {t: torch.softmax(a.detach(), -1) for t, a in before.alphas().items()}
    else:
        z = {t: torch.as_tensor(rec[V.ARCH_WEIGHTS.path(cell=t)][1], dtype=torch.float64) for t in TYPES}
    costs = _per_cell_costs(before, x, y, z)
    final = _restored(cfg.checkpoint)
    entries = [0, 9, 14, 23, 31, 39]  # a few (edge, op) entries of the 5 × 8: none, convolutions, pools, skip
    hessian = _shared_diag_hessian(final, x, y, {t: torch.softmax(a.detach(), -1) for t, a in final.alphas().items()},
                                   entries)
    for t in TYPES:
        rows = torch.stack([c for c, cell in zip(costs, before.cells) if cell.cell_type == t])
        np.testing.assert_allclose(rec[V.COST_MEAN.path(cell=t)][1], rows.mean(0).numpy(), rtol=1e-7, atol=1e-12)
        np.testing.assert_allclose(rec[V.COST_VAR.path(cell=t)][1], rows.var(0, unbiased=False).numpy(), rtol=1e-6,
                                   atol=1e-14)
        assert (rec[V.COST_COUNT.path(cell=t)][1] == len(rows)).all()
        recorded = rec[V.HESSIAN_DIAG.path(cell=t)][1].reshape(-1)[entries]
        np.testing.assert_allclose(recorded, hessian[t].numpy(), rtol=1e-7, atol=1e-12)
        assert not rec[V.HESSIAN_NONFINITE.path(cell=t)][1]


# -- a NaN/inf loss in the middle of a search ----------------------------------------------------------------------
def _tiny_method(name, seed=0):
    """A float64 method on Network(C=4, 3 classes, 3 layers, 2 steps) of its own primitives (the first 4)."""
    from nasdiag.search import Schedule, get_method

    cls = get_method(name)
    prims = (cls.primitives or ("none", "skip_connect", "max_pool_3x3", "avg_pool_3x3", "sep_conv_3x3"))[:4]
    torch.manual_seed(seed)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=prims).double()
    return cls(net, schedule=Schedule(epochs=2, steps_per_epoch=2, batch_size=4), seed=seed)


def _batch(seed, nan=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 1, 6, 6, generator=g, dtype=torch.float64)
    if nan:
        x[1, 0, 2, 3] = math.nan  # one pixel of one sample: its loss, so the batch mean, is NaN
    return x, torch.randint(0, 3, (4,), generator=g)


def _state(method):
    """Every number a step may change: the network's parameters, the optimizers' and the plain state. (Not BatchNorm's
    running statistics: the NaN batch's forward updates them before any loss exists, and no search reads them.)"""
    import copy

    state = method.state_dict()
    state.pop("generator")
    state["network"] = {k: v for k, v in state["network"].items() if "running_" not in k and "num_batches" not in k}
    return copy.deepcopy(state)


def _assert_same(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


NAN_SPLITS = [("darts2", "train"), ("darts2", "val"), ("sparsenas", "train"), ("sparsenas", "val"), ("snas", "train"),
              ("dsnas", "train"), ("proxyless", "train"), ("bayesnas", "train"), ("asmnas", "train"), ("xnas", "train")]


@pytest.mark.parametrize("name, split", NAN_SPLITS)
def test_a_nan_loss_raises_before_the_update_and_carries_its_flagged_row(name, split):
    """After one finite step, a batch with one NaN pixel: the step raises `SearchError` whose ``statistics`` (the row
    the run records before it stops) hold ``scalars/nonfinite_loss`` = 1 and the NaN loss, and the method's state
    (weights, α/A/w, optimizer moments, switches, counts) is the one after the finite step. ASM-NAS updated (w, Θ)
    with the NaN gradient and then raised without a row; darts2, sparsenas and bayesnas raised without a row (or
    not at all: bayesnas went on to the epoch end with NaN weights)."""
    from nasdiag.search import SearchError

    method = _tiny_method(name)
    method.step(_batch(1), _batch(2))
    before = _state(method)
    train, val = (_batch(3, nan=True), _batch(4)) if split == "train" else (_batch(3), _batch(4, nan=True))
    with pytest.raises(SearchError) as info:
        method.step(train, val)
    row = getattr(info.value, "statistics", None)
    assert row is not None, f"{name}: the NaN step's row is lost"
    assert float(row["scalars/nonfinite_loss"]) == 1.0
    losses = [k for k in row if k.endswith("loss") and k != "scalars/nonfinite_loss"]
    assert losses and any(not torch.isfinite(row[k]).all() for k in losses), (name, sorted(row))
    assert "scalars/w_lr" in row  # what the step knew is kept with it
    _assert_same(before, _state(method), name)


@pytest.mark.slow  # a short run() (~4 s)
def test_a_run_that_meets_a_nan_loss_records_the_rows_before_it_and_the_flagged_row(tmp_path, monkeypatch):
    """ASM-NAS on 24 search samples (3 steps per epoch), one training sample NaN: the run stops with one
    `SearchError` at the step whose batch holds it; the record holds every earlier step with a finite loss and,
    as its last row, that step with ``scalars/nonfinite_loss`` = 1 and the NaN loss (before: no row, the NaN
    hidden from the record)."""
    import nasdiag.data
    from torch.utils.data import TensorDataset

    from nasdiag.record import load
    from nasdiag.search import SearchError
    from nasdiag.search.runner import epoch_batches

    cut = _small_digits(monkeypatch, n=24)

    def poisoned(name, **kwargs):
        s = cut(name, **kwargs)
        x, y = s.train.tensors
        x = x.clone()
        x[17, 0, 3, 3] = math.nan
        return dataclasses.replace(s, train=TensorDataset(x, y))

    monkeypatch.setattr(nasdiag.data, "load_dataset", poisoned)
    out = str(tmp_path / "nan.h5")
    cfg = SearchConfig(method="asmnas", C=2, layers=3, steps=2, multiplier=2, batch_size=8, epochs=2, dtype="float64",
                       diagnostics=(), progress=False, threads=1, record=out)
    with pytest.raises(SearchError, match="training loss is nan"):
        run(cfg)
    splits = poisoned("digits", seed=0, dtype=torch.float64)
    hit = next(i + 1 for i, (x, _) in enumerate(epoch_batches(splits.train, 8, cfg.seed, 0)) if torch.isnan(x).any())
    rec = load(out)
    assert rec["step"].tolist() == list(range(1, hit + 1))
    assert np.isfinite(rec["scalars/train_loss"][:-1]).all() and np.isnan(rec["scalars/train_loss"][-1])
    assert rec["scalars/nonfinite_loss"][-1] == 1


# -- genotypes from weights built here -----------------------------------------------------------------------------
def _darts_parse(weights, primitives, steps):
    """DARTS's ``genotype()._parse`` (model_search.py), transcribed: per node, the 2 incoming edges with the largest
    non-'none' weight (``sorted`` is stable: ties keep the lower edge), each with its first strictly largest
    non-'none' op."""
    gene, start, n = [], 0, 2
    none = primitives.index("none")
    for _ in range(steps):
        W = weights[start:start + n].tolist()
        edges = sorted(range(n), key=lambda x: -max(W[x][k] for k in range(len(W[x])) if k != none))[:2]
        for j in edges:
            k_best = None
            for k in range(len(W[j])):
                if k != none and (k_best is None or W[j][k] > W[j][k_best]):
                    k_best = k
            gene.append((primitives[k_best], j))
        start, n = start + n, n + 1
    return gene


def test_darts_genotype_breaks_exact_ties_as_darts_and_refuses_nan_weights():
    """Rows with exact ties (two ops of an edge equal; three edges of node 3 identical), 'none' dominant on an
    edge: the genotype is DARTS's own rule, transcribed. A NaN α on one edge: one `SearchError` naming the cell
    type and the edge (the rule picked an op of the NaN edge as if nothing were wrong)."""
    from nasdiag.search import SearchError

    method = _tiny_method("darts")
    prims = list(method.network.primitives)
    assert prims[0] == "none"
    rows = {"normal": [[3.0, 1.0, 1.0, 0.0], [0.0, 1.0, 2.0, 2.0], [0.0, 0.5, 0.5, 0.5], [0.0, 0.5, 0.5, 0.5],
                       [0.0, 0.5, 0.5, 0.5]],
            "reduce": [[0.0, 0.0, 0.0, 0.0], [9.0, 0.0, 0.0, 0.0], [0.0, 2.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0],
                       [0.0, 2.0, 1.0, 2.0]]}
    with torch.no_grad():
        for t, a in method.network.alphas().items():
            a.copy_(torch.tensor(rows[t], dtype=torch.float64))
    got = method.genotype()
    for t, genes in (("normal", got.normal), ("reduce", got.reduce)):
        assert genes == _darts_parse(torch.softmax(torch.tensor(rows[t], dtype=torch.float64), -1), prims, 2), t
    with torch.no_grad():
        method.network.alphas()["reduce"][3, 2] = math.nan
    with pytest.raises(SearchError, match=r"reduce architecture weights are NaN or inf on edge\(s\) \[3\]"):
        method.genotype()


def test_sparsenas_mixed_genotype_refuses_nan_weights():
    """SparseNAS's mixed path keeps every op with a non-zero weight: a NaN weight compared false and its op was
    silently dropped (an edge of NaNs looked pruned)."""
    from nasdiag.search import SearchError

    method = _tiny_method("sparsenas")
    with torch.no_grad():
        method.network.alphas()["normal"][1] = math.nan
    with pytest.raises(SearchError, match=r"normal architecture weights are NaN or inf on edge\(s\) \[1\]"):
        method.genotype()


# -- resume at an epoch boundary -----------------------------------------------------------------------------------
@pytest.mark.slow  # three short run()s (~6 s)
@pytest.mark.parametrize("name", ["snas", "sparsenas"])
def test_a_run_interrupted_right_after_an_epoch_end_resumes_to_the_uninterrupted_run(name, tmp_path, monkeypatch):
    """Interrupted when the first epoch's last step reaches the user's callbacks (after the epoch end: the record
    flushed, the checkpoint written with the annealed τ or the raised λ), then resumed: every recorded path and the
    final checkpointed state equal those of an uninterrupted run, bit for bit."""
    from nasdiag.record import load
    from nasdiag.search.checkpoint import load_checkpoint
    from test_run import _InterruptAt

    _small_digits(monkeypatch, n=24)

    def config(out, **kw):
        return SearchConfig(method=name, C=2, layers=3, steps=2, multiplier=2, batch_size=8, epochs=2, dtype="float64",
                            diagnostics=("cost",), progress=False, threads=1, record=str(tmp_path / out), **kw)

    run(config("whole.h5"))
    with pytest.raises(KeyboardInterrupt):
        run(config("cut.h5"), callbacks=[_InterruptAt(3)])
    assert load(str(tmp_path / "cut.h5"))["step"].tolist() == [1, 2, 3]
    run(config("cut.h5", resume=True))
    whole, cut = load(str(tmp_path / "whole.h5")), load(str(tmp_path / "cut.h5"))
    assert whole["step"].tolist() == cut["step"].tolist() == list(range(1, 7))
    for path in whole:
        if not path.startswith("meta/"):
            np.testing.assert_array_equal(whole[path], cut[path], err_msg=path)
    a = load_checkpoint(str(tmp_path / "whole.h5.ckpt"))["method"]
    b = load_checkpoint(str(tmp_path / "cut.h5.ckpt"))["method"]
    _assert_same(a["network"], b["network"], "network")
    _assert_same(a["attributes"], b["attributes"], "attributes")
    _assert_same(a["objects"], b["objects"], "objects")


def test_bayesnas_stays_finite_once_pruned_ops_have_zero_gamma(monkeypatch):
    """Algorithm 2 with an update every step and a large curvature (1e6, standing in for the engine's): after the
    first pruning a pruned op has γ = 0, so ω = ∞ (A.3.9); the next A.3.1 step formed its gradient as
    (C + λ_w √ℵ ω sign(w))·mask = (0 + ∞·0)·0 = NaN, which turned every pruned w, then γ, s and the whole forward,
    into NaN (a run went on with NaN losses). Every step's loss and every w stay finite, pruned w exactly 0."""
    from nasdiag.search import Schedule, get_method

    cls = get_method("bayesnas")
    torch.manual_seed(0)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=cls.primitives[:4]).double()
    method = cls(net, cls.Hyperparameters(update_every=1, w_lr=1e-9), schedule=Schedule(2, 2, 4))
    with torch.no_grad():
        for a in net.arch_parameters():
            a[:, 1:3] = 1e-4  # these ops' s = |w|/ω is tiny at H = 1e6: pruned at the first update

    def large_curvature(x, y):
        return {t: torch.full((sum(1 for c in net.cells if c.cell_type == t), *a.shape), 1e6, dtype=a.dtype)
                for t, a in net.alphas().items()}

    monkeypatch.setattr(method, "cell_curvatures", large_curvature)
    for i in range(4):
        stats = method.step(_batch(30 + i), _batch(40 + i))
        assert torch.isfinite(stats["scalars/train_loss"]), i
    for t, a in net.alphas().items():
        assert not method.alive[t][:, 1:3].any(), t
        assert torch.isfinite(a).all(), t
        assert (a.detach()[~method.alive[t]] == 0).all(), t
