"""Audit round 6 of the record <-> statistics-vocabulary contract, end to end: a tiny real `nasdiag.search.run`
(digits cut to 12 search-train and 12 search-val samples, batch 4, so 3 steps in one epoch, float64) and every
recorded path against `nasdiag.vocabulary` and docs/schema.md: its family, row shape and dtype, and its meaning,
recomputed here with float64 autograd on the network states the run went through (the method's ``step`` is wrapped
to snapshot the state and the batches it is given; nothing of nasdiag computes a reference value):

- DARTS step 1: ``scalars/val_loss``/``val_acc`` on the search-val batch at (w0, softmax(α0)); ``alpha_grad_norm`` =
  ‖∂L_val/∂α‖ through the softmax, α shared by a type's cells; ``arch/<cell>/params`` = α after one Adam step
  with weight decay; ``probabilities`` = ``weights`` = softmax of it; ``train_loss``/``train_acc`` on the
  search-train batch at (w0, softmax(α1)); ``w_lr``.
- Step 3 (the epoch's last): ``cost/<cell>/{mean,var,count}`` pooled over the 3 steps × the type's cells, each at
  the state before its step; ``hessian/<cell>/diag`` in mode exact_per_edge (per-cell diagonal blocks summed over
  the cells) at the state after step 3 on its val batch; ``hessian/<cell>/top_eigenvalue`` and the joint
  ``hessian/top_eigenvalue`` against ``eigvalsh`` of the full α-Hessian; ``search_val_loss``/``acc`` on the whole
  search-val split.
- DSNAS: ``search_val_loss`` is taken at the method's evaluation weights (the argmax one-hot), not at
  ``probabilities()``, which the vocabulary said.

Defects these tests found (each fails without its fix): the vocabulary and docs/schema.md said the search-val
evaluation was at ``probabilities()`` (it is at ``eval_weights()``: DSNAS/ProxylessNAS evaluate the argmax child,
SparseNAS and BayesNAS the raw A and w); ``scalars/search_val_loss``, ``search_val_acc`` and ``epoch`` were
recorded as float32 in a float64 run (the vocabulary's float32 means the run's dtype), rounding the float64
evaluation; the cost moments and SNAS's τ are float64 in every run, the vocabulary said the run's dtype;
``--spectrum-every`` recorded the softmax(α)-Hessian's eigenvalue for SparseNAS, BayesNAS, XNAS and ASM-NAS,
which never mix by softmax(α) (now refused in one line); a NaN top eigenvalue at an epoch's last step was
recorded flagged finite (the epoch's diagonal flag replaced the step's); the top eigenvalues were declared
epoch rows but are on every k-th row.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nasdiag import vocabulary as V
from nasdiag.search import SearchConfig, run
from nasdiag.supernet import Network
from test_audit_methods_round3 import _small_digits  # digits cut to 12 search-train and 12 search-val samples

TYPES = ("normal", "reduce")
N, BATCH = 12, 4


def _snapshots(monkeypatch, cls):
    """Wrap ``cls.step`` to keep (network state before the step, train batch, val batch) of every step."""
    seen = []
    step = cls.step

    def wrapped(self, train, val=None):
        seen.append((copy.deepcopy(self.network.state_dict()), train, val))
        return step(self, train, val)

    monkeypatch.setattr(cls, "step", wrapped)
    return seen


def _net(state, primitives=None):
    kwargs = {} if primitives is None else {"primitives": primitives}
    net = Network(2, 10, 3, steps=2, multiplier=2, in_channels=1, **kwargs).double()
    net.load_state_dict(state)
    return net


def _alphas(state):
    return {t: state[f"alphas_{t}"].clone() for t in TYPES}


def _loss_acc(net, x, y, z):
    with torch.no_grad():
        logits = net(x, z)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).double().mean().item()


def _run(tmp_path, method, dtype="float64", **extra):
    out = str(tmp_path / "run.h5")
    # device="cpu": the replays below are CPU float64 autograd on the run's own state; under the default
    # "auto" a machine with CUDA would run the search on the GPU (the GPU-marked tests cover that)
    cfg = SearchConfig(method=method, C=2, layers=3, steps=2, multiplier=2, batch_size=BATCH, epochs=1, dtype=dtype,
                       progress=False, threads=1, record=out, device="cpu", **extra)
    res = run(cfg)
    from nasdiag.record import load

    return cfg, res, load(out)


def _check_vocabulary(rec, float_dtype=np.float64, spectrum_every=0):
    """Every recorded path has a family; its row shape and dtype are the family's (float32 = the run's dtype), its
    rows those its ``when`` names (3 steps, one epoch)."""
    sizes = {"E": 5, "K": len(rec["meta/op_names"])}
    for path in rec:
        if path.startswith(("meta/", "valid/")) or path == "step":
            continue
        fam = V.family_of(path)
        assert fam is not None, f"{path} is of no vocabulary family"
        want = {"float32": float_dtype, "float64": np.float64, "bool": np.bool_, "int64": np.int64}[fam.dtype]
        assert rec[path].dtype == want, (path, rec[path].dtype, fam.dtype)
        dims = [d.strip() for d in fam.shape.strip("()").split(",") if d.strip()]
        if "R" not in dims:
            assert rec[path].shape[1:] == tuple(sizes[d] for d in dims), (path, rec[path].shape, fam.shape)
        epoch_row = [False, False, True]
        spectrum_rows = [bool(spectrum_every) and step % spectrum_every == 0 for step in (1, 2, 3)]
        want = {"epoch": epoch_row, "spectrum": spectrum_rows, "step": [True] * 3}[fam.when]
        if fam is V.HESSIAN_NONFINITE and spectrum_every:
            want = [a or b for a, b in zip(epoch_row, spectrum_rows)]
        assert rec[f"valid/{path}"].tolist() == want, (path, fam.when)


@pytest.mark.slow  # one 3-step run plus full α-Hessians (~15 s on a loaded core)
def test_a_darts_run_records_what_the_vocabulary_says_at_the_steps_and_batches_it_names(tmp_path, monkeypatch):
    from nasdiag.search.methods.darts import DARTS
    from nasdiag.search.runner import epoch_batches

    splits = _small_digits(monkeypatch)("digits", seed=0, dtype=torch.float64)
    seen = _snapshots(monkeypatch, DARTS)
    cfg, res, rec = _run(tmp_path, "darts", diagnostics=("cost", "hessian"), hessian_mode="exact_per_edge",
                         spectrum_every=3)
    _check_vocabulary(rec, spectrum_every=3)
    assert rec["step"].tolist() == [1, 2, 3] and len(seen) == 3
    # the loop hands the search-train and search-val batches in the documented order
    for s, (_, (xt, yt), (xv, yv)) in enumerate(seen):
        ref_t = list(epoch_batches(splits.train, BATCH, cfg.seed, 0))[s]
        ref_v = list(epoch_batches(splits.val, BATCH, cfg.seed + 1, 0))[s]
        assert torch.equal(xt, ref_t[0]) and torch.equal(yv, ref_v[1]) and torch.equal(xv, ref_v[0])
    hp = res.method.hp
    final = copy.deepcopy(res.method.network.state_dict())
    states = [s for s, _, _ in seen] + [final]

    # -- step 1, replayed: α step on val at (w0, softmax α0), then w step on train at (w0, softmax α1)
    s0, (xt, yt), (xv, yv) = seen[0]
    net = _net(s0)
    a0 = {t: a.clone().requires_grad_(True) for t, a in _alphas(s0).items()}
    loss = F.cross_entropy(net(xv, {t: torch.softmax(a, -1) for t, a in a0.items()}), yv)
    grads = dict(zip(a0, torch.autograd.grad(loss, list(a0.values()))))
    val_loss, val_acc = _loss_acc(net, xv, yv, {t: torch.softmax(a.detach(), -1) for t, a in a0.items()})
    np.testing.assert_allclose(rec["scalars/val_loss"][0], val_loss, rtol=1e-10)
    np.testing.assert_allclose(rec["scalars/val_acc"][0], val_acc, rtol=0, atol=0)
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item()
    np.testing.assert_allclose(rec["scalars/alpha_grad_norm"][0], norm, rtol=1e-9)
    a1 = {}
    for t in TYPES:  # Adam's first step: m̂ = g', v̂ = g'², g' = g + wd·α
        g = grads[t] + hp.alpha_weight_decay * a0[t].detach()
        a1[t] = a0[t].detach() - hp.alpha_lr * g / (g.abs() + 1e-8)
        np.testing.assert_allclose(rec[f"arch/{t}/params"][0], a1[t].numpy(), rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(rec[f"arch/{t}/probabilities"][0], torch.softmax(a1[t], -1).numpy(), rtol=1e-10)
        np.testing.assert_allclose(rec[f"arch/{t}/weights"][0], torch.softmax(a1[t], -1).numpy(), rtol=1e-10)
    train_loss, train_acc = _loss_acc(net, xt, yt, {t: torch.softmax(a, -1) for t, a in a1.items()})
    np.testing.assert_allclose(rec["scalars/train_loss"][0], train_loss, rtol=1e-10)
    np.testing.assert_allclose(rec["scalars/train_acc"][0], train_acc, rtol=0, atol=0)
    np.testing.assert_allclose(rec["scalars/w_lr"][0], hp.w_lr, rtol=1e-15)  # lr of epoch 0 (run dtype since round 11)
    # every later row's α and probabilities are the state after its step
    for s in (1, 2):
        for t in TYPES:
            np.testing.assert_allclose(rec[f"arch/{t}/params"][s], _alphas(states[s + 1])[t].numpy(), rtol=0, atol=0)

    # -- step 3 (epoch end): cost pooled over the 3 steps × cells, each at the state before its step
    per_type = {t: [] for t in TYPES}
    for state, _, (xv, yv) in seen:
        net = _net(state)
        cells = [c.cell_type for c in net.cells]
        leaves = [torch.softmax(_alphas(state)[t], -1).requires_grad_(True) for t in cells]
        costs = torch.autograd.grad(F.cross_entropy(net(xv, leaves), yv), leaves)
        for t, c in zip(cells, costs):
            per_type[t].append(c)
    for t in TYPES:
        obs = torch.stack(per_type[t])
        np.testing.assert_allclose(rec[f"cost/{t}/mean"][2], obs.mean(0).numpy(), rtol=1e-8, atol=1e-14)
        np.testing.assert_allclose(rec[f"cost/{t}/var"][2], obs.var(0, unbiased=False).numpy(), rtol=1e-6, atol=1e-16)
        assert (rec[f"cost/{t}/count"][2] == len(obs)).all()

    # hessian/<cell>/diag, mode exact_per_edge: each cell's own ∂²L/∂Z_k², summed over the type's cells, at the
    # state after step 3 and the last α batch (search-val of step 3)
    _, _, (xv, yv) = seen[2]
    net = _net(final)
    z = {t: torch.softmax(a, -1) for t, a in _alphas(final).items()}
    leaves = [z[c.cell_type].clone().requires_grad_(True) for c in net.cells]
    grads = torch.autograd.grad(F.cross_entropy(net(xv, leaves), yv), leaves, create_graph=True)
    diag = {t: torch.zeros(5, 8, dtype=torch.float64) for t in TYPES}
    for cell, leaf, g in zip(net.cells, leaves, grads):
        flat = g.reshape(-1)
        d = torch.stack([torch.autograd.grad(flat[i], leaf, retain_graph=True)[0].reshape(-1)[i] for i in range(40)])
        diag[cell.cell_type] += d.reshape(5, 8).detach()
    for t in TYPES:
        np.testing.assert_allclose(rec[f"hessian/{t}/diag"][2], diag[t].numpy(), rtol=1e-7, atol=1e-12)
        assert not rec[f"hessian/{t}/nonfinite"][2]

    # top eigenvalues of ∂²L_val/∂α² at the state after step 3 (the row's state), α shared by the type's cells
    flat_a = torch.cat([_alphas(final)[t].reshape(-1) for t in TYPES])

    def f(v):
        return F.cross_entropy(net(xv, {t: torch.softmax(v[i * 40:(i + 1) * 40].reshape(5, 8), -1)
                                        for i, t in enumerate(TYPES)}), yv)

    h = torch.autograd.functional.hessian(f, flat_a)
    np.testing.assert_allclose(rec["hessian/top_eigenvalue"][2], torch.linalg.eigvalsh(h)[-1].item(), rtol=1e-7)
    for i, t in enumerate(TYPES):
        block = h[i * 40:(i + 1) * 40, i * 40:(i + 1) * 40]
        np.testing.assert_allclose(rec[f"hessian/{t}/top_eigenvalue"][2], torch.linalg.eigvalsh(block)[-1].item(),
                                   rtol=1e-7)

    # the epoch's evaluation: the whole search-val split at the final softmax(α), mean loss
    xs, ys = splits.val.tensors
    loss, acc = _loss_acc(net, xs, ys, z)
    np.testing.assert_allclose(rec["scalars/search_val_loss"][2], loss, rtol=1e-12)
    np.testing.assert_allclose(rec["scalars/search_val_acc"][2], acc, rtol=0, atol=0)
    assert rec["scalars/epoch"][2] == 0


def test_the_search_val_evaluation_is_at_the_methods_evaluation_weights_as_the_vocabulary_says(tmp_path, monkeypatch):
    """DSNAS evaluates the argmax child of softmax(α) (one-hot), not the distribution ``probabilities()``: the
    vocabulary must name what the run evaluates. Recorded in the run's float64."""
    from nasdiag.search.methods.dsnas import DSNAS

    splits = _small_digits(monkeypatch)("digits", seed=0, dtype=torch.float64)
    seen = _snapshots(monkeypatch, DSNAS)
    cfg, res, rec = _run(tmp_path, "dsnas", diagnostics=("hessian",), hessian_mode="exact_per_edge")
    _check_vocabulary(rec)
    net = _net(res.method.network.state_dict())
    onehot = {t: F.one_hot(a.argmax(-1), 8).double() for t, a in _alphas(net.state_dict()).items()}
    soft = {t: torch.softmax(a, -1) for t, a in _alphas(net.state_dict()).items()}
    xs, ys = splits.val.tensors
    loss, acc = _loss_acc(net, xs, ys, onehot)
    assert abs(loss - _loss_acc(net, xs, ys, soft)[0]) > 1e-6  # the two readings differ here
    np.testing.assert_allclose(rec["scalars/search_val_loss"][2], loss, rtol=1e-12)
    np.testing.assert_allclose(rec["scalars/search_val_acc"][2], acc, rtol=0, atol=0)
    for fam in (V.SEARCH_VAL_LOSS, V.SEARCH_VAL_ACC, V.HESSIAN_DIAG):
        assert "eval_weights()" in fam.meaning and "at `probabilities()`" not in fam.meaning
    # the epoch's Hessian diagonal is at the same one-hot weights, on the last search-train batch (single level)
    _, (xt, yt), _ = seen[-1]
    leaves = [onehot[c.cell_type].clone().requires_grad_(True) for c in net.cells]
    grads = torch.autograd.grad(F.cross_entropy(net(xt, leaves), yt), leaves, create_graph=True)
    entries = [0, 11, 19, 26, 39]
    for t in TYPES:
        want = sum(torch.stack([torch.autograd.grad(g.reshape(-1)[i], leaf, retain_graph=True)[0].reshape(-1)[i]
                                for i in entries])
                   for cell, leaf, g in zip(net.cells, leaves, grads) if cell.cell_type == t)
        np.testing.assert_allclose(rec[f"hessian/{t}/diag"][2].reshape(-1)[entries], want.detach().numpy(), rtol=1e-7,
                                   atol=1e-12)


def _replayed_costs(net, x, y, z, rec, step, split):
    """Per-cell C_k = ∂L/∂Z_k at the mixing weights ``z`` on (x, y); checks the row's ``<split>_loss``/``_acc``."""
    leaves = [z[c.cell_type].clone().requires_grad_(True) for c in net.cells]
    logits = net(x, leaves)
    loss = F.cross_entropy(logits, y)
    per_cell = torch.autograd.grad(loss, leaves)
    np.testing.assert_allclose(rec[f"scalars/{split}_loss"][step], loss.item(), rtol=1e-10)
    np.testing.assert_allclose(rec[f"scalars/{split}_acc"][step], (logits.argmax(1) == y).double().mean().item(), atol=0)
    return per_cell


def _check_observed_moments(rec, observed, row=2):
    """``cost/<cell>/{count,mean,var}`` = the count, mean and population variance of the observed entries only."""
    for t in TYPES:
        c = torch.stack([o for o, _ in observed[t]])
        m = torch.stack([k for _, k in observed[t]])
        n = m.sum(0)
        mean = torch.where(m, c, 0).sum(0) / n
        np.testing.assert_array_equal(rec[f"cost/{t}/count"][row], n.numpy())
        np.testing.assert_allclose(rec[f"cost/{t}/mean"][row], mean.numpy(), rtol=1e-8, atol=1e-14)  # NaN where n = 0
        np.testing.assert_allclose(rec[f"cost/{t}/var"][row], (torch.where(m, (c - mean) ** 2, 0).sum(0) / n).numpy(),
                                   rtol=1e-6, atol=1e-16)


def _adam_first_step(alpha, grad, hp):
    g = grad + hp.alpha_weight_decay * alpha
    return alpha - hp.alpha_lr * g / (g.abs() + 1e-8)


@pytest.mark.parametrize("method", ["snas", "dsnas"])
def test_a_single_level_run_records_its_sample_the_state_after_the_step_and_the_cost_of_the_sampled_ops(
        method, tmp_path, monkeypatch):
    """SNAS and DSNAS, one epoch of 3 steps on the search-train batches. Per step, with the step's sample Z (read from
    ``arch/<cell>/weights``: the noise is the method's own generator): ``train_loss``/``train_acc`` at (w before the
    step, Z); ``alpha_grad_norm`` from C = ∂L/∂Z summed over the type's cells seen through Z's map from α (SNAS:
    (1/τ)(diag Z − ZZᵀ)C; DSNAS: the credit (Z·C)(Z − p), p = softmax(α)); ``arch/<cell>/params`` = α after Adam's
    first step; ``scalars/entropy`` = the mean over every edge of every type of H(softmax(α after the step)).
    DSNAS: ``sample/<cell>/onehot`` = Z and ``sample/<cell>/count`` its running sum; ``cost/<cell>/*`` at the epoch
    end the moments over the sampled entries only (count = steps × cells where sampled, NaN mean where never)."""
    from nasdiag.search.methods.dsnas import DSNAS
    from nasdiag.search.methods.snas import SNAS

    _small_digits(monkeypatch)
    seen = _snapshots(monkeypatch, {"snas": SNAS, "dsnas": DSNAS}[method])
    cfg, res, rec = _run(tmp_path, method, diagnostics=("cost",))
    _check_vocabulary(rec)
    hp = res.method.hp
    states = [s for s, _, _ in seen] + [copy.deepcopy(res.method.network.state_dict())]
    counts = {t: np.zeros((5, 8), dtype=np.int64) for t in TYPES}
    observed = {t: [] for t in TYPES}
    for s, (state, (xt, yt), _) in enumerate(seen):
        net = _net(state)
        a0 = _alphas(state)
        z = {t: torch.as_tensor(rec[f"arch/{t}/weights"][s]) for t in TYPES}
        if method == "dsnas":
            for t in TYPES:
                assert ((z[t] == 0) | (z[t] == 1)).all() and (z[t].sum(-1) == 1).all()
                np.testing.assert_array_equal(rec[f"sample/{t}/onehot"][s], z[t].numpy())
                counts[t] += z[t].numpy().astype(np.int64)
                np.testing.assert_array_equal(rec[f"sample/{t}/count"][s], counts[t])
        else:
            assert rec["scalars/temperature"][s] == hp.tau0  # τ of epoch 0
        per_cell = _replayed_costs(net, xt, yt, z, rec, s, "train")
        total = {t: sum(c for c, cell in zip(per_cell, net.cells) if cell.cell_type == t) for t in TYPES}
        grads = {}
        for t in TYPES:
            c, zt = total[t], z[t]
            if method == "snas":
                grads[t] = (zt * c - zt * (zt * c).sum(-1, keepdim=True)) / hp.tau0
            else:
                grads[t] = (zt * c).sum(-1, keepdim=True) * (zt - torch.softmax(a0[t], -1))
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item()
        np.testing.assert_allclose(rec["scalars/alpha_grad_norm"][s], norm, rtol=1e-8)
        after = _alphas(states[s + 1])
        if s == 0:
            for t in TYPES:
                np.testing.assert_allclose(after[t].numpy(), _adam_first_step(a0[t], grads[t], hp).numpy(), rtol=1e-9,
                                           atol=1e-13)
        for t in TYPES:
            np.testing.assert_array_equal(rec[f"arch/{t}/params"][s], after[t].numpy())
            np.testing.assert_allclose(rec[f"arch/{t}/probabilities"][s], torch.softmax(after[t], -1).numpy(), rtol=1e-12)
        p = torch.cat([torch.softmax(after[t], -1) for t in TYPES])
        np.testing.assert_allclose(rec["scalars/entropy"][s], (-(p * p.log()).sum(-1)).mean().item(), rtol=1e-12)
        for cell, c in zip(net.cells, per_cell):
            observed[cell.cell_type].append((c, z[cell.cell_type] > 0 if method == "dsnas" else torch.ones(5, 8, dtype=bool)))
    _check_observed_moments(rec, observed)
    for t in TYPES:
        if method == "dsnas":  # one observation per sample and cell of the type
            cells = sum(1 for c in net.cells if c.cell_type == t)
            np.testing.assert_array_equal(rec[f"cost/{t}/count"][2], cells * rec[f"sample/{t}/count"][2])


def test_a_proxyless_run_records_the_alpha_steps_gates_paths_and_the_pair_cost(tmp_path, monkeypatch):
    """ProxylessNAS, one epoch of 3 steps. The α step runs after the w step, so its numbers are at the w of the
    state after the step (α plays no part in a forward at given gates): ``val_loss``/``val_acc`` at the recorded
    gates ``sample/<cell>/onehot`` (= ``arch/<cell>/weights``, one gated path inside the two ``paths``);
    ``alpha_grad_norm`` of the BinaryConnect gradient through p' = softmax of α over the pair; ``arch/<cell>/params``
    = Adam's first step (β1 = 0, no decay) on the pair, then shifted so the pair's logsumexp is kept;
    ``sample/<cell>/count`` the running sum of the gates; ``cost/<cell>/*`` the moments over the paired entries."""
    from nasdiag.search.methods.proxyless import ProxylessNAS

    _small_digits(monkeypatch)
    seen = _snapshots(monkeypatch, ProxylessNAS)
    cfg, res, rec = _run(tmp_path, "proxyless", diagnostics=("cost",))
    _check_vocabulary(rec)
    hp = res.method.hp
    states = [s for s, _, _ in seen] + [copy.deepcopy(res.method.network.state_dict())]
    counts = {t: np.zeros((5, 8), dtype=np.int64) for t in TYPES}
    observed = {t: [] for t in TYPES}
    for s, (state, _, (xv, yv)) in enumerate(seen):
        net = _net(states[s + 1])
        a0, after = _alphas(state), _alphas(states[s + 1])
        gates = {t: torch.as_tensor(rec[f"sample/{t}/onehot"][s]) for t in TYPES}
        pairs = {t: torch.as_tensor(rec[f"sample/{t}/paths"][s]) > 0 for t in TYPES}
        for t in TYPES:
            np.testing.assert_array_equal(rec[f"arch/{t}/weights"][s], gates[t].numpy())
            assert (pairs[t].sum(-1) == 2).all() and (gates[t].sum(-1) == 1).all() and (gates[t][~pairs[t]] == 0).all()
            counts[t] += gates[t].numpy().astype(np.int64)
            np.testing.assert_array_equal(rec[f"sample/{t}/count"][s], counts[t])
        per_cell = _replayed_costs(net, xv, yv, gates, rec, s, "val")
        grads = {}
        for t in TYPES:
            c = sum(g for g, cell in zip(per_cell, net.cells) if cell.cell_type == t)
            a = a0[t].clone().requires_grad_(True)
            p_pair = torch.softmax(a.masked_fill(~pairs[t], -torch.inf), -1)
            grads[t] = torch.autograd.grad((torch.where(pairs[t], c, 0) * p_pair).sum(), a)[0]
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item()
        np.testing.assert_allclose(rec["scalars/alpha_grad_norm"][s], norm, rtol=1e-8)
        for t in TYPES:
            if s == 0:
                new = a0[t] - hp.alpha_lr * grads[t] / (grads[t].abs() + 1e-8)
                lse = lambda v: torch.logsumexp(v.masked_fill(~pairs[t], -torch.inf), -1, keepdim=True)  # noqa: E731
                new = torch.where(pairs[t], new - (lse(new) - lse(a0[t])), a0[t])
                np.testing.assert_allclose(after[t].numpy(), new.numpy(), rtol=1e-9, atol=1e-13)
            np.testing.assert_array_equal(rec[f"arch/{t}/params"][s], after[t].numpy())
        p = torch.cat([torch.softmax(after[t], -1) for t in TYPES])
        np.testing.assert_allclose(rec["scalars/entropy"][s], (-(p * p.log()).sum(-1)).mean().item(), rtol=1e-12)
        for cell, c in zip(net.cells, per_cell):
            observed[cell.cell_type].append((c, pairs[cell.cell_type]))
    _check_observed_moments(rec, observed)


@pytest.mark.parametrize("method", ["sparsenas", "bayesnas", "xnas", "asmnas"])
def test_the_alpha_hessian_spectrum_is_refused_for_a_method_that_does_not_mix_by_softmax_alpha(method, tmp_path,
                                                                                              monkeypatch):
    """``hessian/<cell>/top_eigenvalue`` is ∂²L/∂α² through Z = softmax(α) (docs/spectrum.md). SparseNAS mixes by
    A itself, BayesNAS by w, XNAS by its EG weights and ASM-NAS by attention: their α are never passed through a
    softmax (XNAS's and ASM-NAS's are never even trained), so the number described another supernet; it was
    recorded silently. Now one ConfigError line, before any file is made."""
    from nasdiag.errors import ConfigError

    _small_digits(monkeypatch)
    with pytest.raises(ConfigError, match=r"^spectrum_every .* does not mix by softmax\(α\)[^\n]*--spectrum-every 0$"):
        _run(tmp_path, method, diagnostics=(), spectrum_every=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("method", ["darts", "snas"])
def test_a_float32_run_records_every_path_in_the_dtype_its_family_states(method, tmp_path, monkeypatch):
    """In a float32 run the vocabulary's float32 is float32; the cost moments (accumulated in float64, Welford) and
    SNAS's τ are float64 whatever the run's dtype, and the vocabulary and docs/schema.md said float32 for them."""
    _small_digits(monkeypatch)
    _, _, rec = _run(tmp_path, method, dtype="float32", diagnostics=("cost", "hessian"))
    _check_vocabulary(rec, float_dtype=np.float32)


def test_a_darts2_run_records_the_unrolled_step_of_its_first_step(tmp_path, monkeypatch):
    """Second-order DARTS, step 1 (no momentum yet), replayed with torch.func on the state before it:
    ``unrolled_train_loss`` = L_train(w, α) on the search-train batch; w' = w − ξ(∇_w L_train + λw), ξ the lr of w;
    ``val_loss``/``val_acc`` at (w', α) on the search-val batch; ``fd_eps`` = r/‖∇_w' L_val‖;
    ``implicit_grad_norm`` = ‖ξ[∇_α L_train(w⁺) − ∇_α L_train(w⁻)]/(2ε)‖ with w± = w ± ε∇_w' L_val;
    ``alpha_grad_norm`` the norm of ∇_α L_val(w') minus that term; ``arch/<cell>/params`` Adam's first step on it."""
    from torch.func import functional_call

    from nasdiag.search.methods.darts2 import DARTS2

    _small_digits(monkeypatch)
    seen = _snapshots(monkeypatch, DARTS2)
    cfg, res, rec = _run(tmp_path, "darts2", diagnostics=())
    _check_vocabulary(rec)
    hp = res.method.hp
    state, (xt, yt), (xv, yv) = seen[0]
    net = _net(state)
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    w = {k: p.detach() for k, p in net.named_parameters() if not k.startswith("alphas_")}
    a0 = _alphas(state)

    def loss(weights, alphas, x, y, logits=False):
        params = {**weights, **{f"alphas_{t}": a for t, a in alphas.items()}}
        out = functional_call(net, (params, {k: v.clone() for k, v in buffers.items()}),
                              (x, {t: torch.softmax(a, -1) for t, a in alphas.items()}))
        return (F.cross_entropy(out, y), out) if logits else F.cross_entropy(out, y)

    def grad(f, wrt):
        keys = list(wrt)
        leaves = {k: wrt[k].clone().requires_grad_(True) for k in keys}
        return dict(zip(keys, torch.autograd.grad(f(leaves), [leaves[k] for k in keys], allow_unused=True)))

    xi, lam = hp.w_lr, hp.w_weight_decay
    np.testing.assert_allclose(rec["scalars/unrolled_train_loss"][0], loss(w, a0, xt, yt).item(), rtol=1e-10)
    dw = grad(lambda ws: loss(ws, a0, xt, yt), w)
    w1 = {k: w[k] - xi * ((0 if dw[k] is None else dw[k]) + lam * w[k]) for k in w}
    val_loss, logits = loss(w1, a0, xv, yv, logits=True)
    np.testing.assert_allclose(rec["scalars/val_loss"][0], val_loss.item(), rtol=1e-10)
    np.testing.assert_allclose(rec["scalars/val_acc"][0], (logits.argmax(1) == yv).double().mean().item(), atol=0)
    v = {k: (torch.zeros_like(g) if g is None else g) for k, g in grad(lambda ws: loss(ws, a0, xv, yv), w1).items()}
    eps = hp.fd_eps_scale / torch.sqrt(sum((g ** 2).sum() for g in v.values()))
    np.testing.assert_allclose(rec["scalars/fd_eps"][0], eps.item(), rtol=1e-10)
    plus = grad(lambda al: loss({k: w[k] + eps * v[k] for k in w}, al, xt, yt), a0)
    minus = grad(lambda al: loss({k: w[k] - eps * v[k] for k in w}, al, xt, yt), a0)
    implicit = {t: xi * (plus[t] - minus[t]) / (2 * eps) for t in TYPES}
    np.testing.assert_allclose(rec["scalars/implicit_grad_norm"][0],
                               torch.sqrt(sum((g ** 2).sum() for g in implicit.values())).item(), rtol=1e-6)
    direct = grad(lambda al: loss(w1, al, xv, yv), a0)
    g = {t: direct[t] - implicit[t] for t in TYPES}
    np.testing.assert_allclose(rec["scalars/alpha_grad_norm"][0], torch.sqrt(sum((x ** 2).sum() for x in g.values())).item(),
                               rtol=1e-6)
    for t in TYPES:
        np.testing.assert_allclose(rec[f"arch/{t}/params"][0], _adam_first_step(a0[t], g[t], hp).numpy(), rtol=1e-8,
                                   atol=1e-12)


def _families_agree(method, rec, hp):
    """What one family's rows say about another's, per the vocabulary's meanings (no nasdiag code involved)."""
    last = 2
    if method == "sparsenas":
        assert (rec["sparsity/lambda"] == hp.lambda_step).all()  # epoch 0: λ = lambda_step (the run's dtype since round 11)
        for t in TYPES:
            A = rec[f"arch/{t}/params"]
            np.testing.assert_array_equal(rec[f"sparsity/{t}/nonzero"], A != 0)
            np.testing.assert_array_equal(rec[f"arch/{t}/weights"], A)  # the linear mixing weight is A itself
            m = np.abs(A)
            np.testing.assert_allclose(rec[f"arch/{t}/probabilities"], m / m.sum(-1, keepdims=True), rtol=1e-12)
    elif method == "xnas":
        for t in TYPES:
            logv, alive = rec[f"regret/{t}/log_weights"], rec[f"regret/{t}/alive"]
            v = np.where(alive, np.exp(logv - np.where(alive, logv, -np.inf).max(-1, keepdims=True)), 0)
            np.testing.assert_allclose(rec[f"arch/{t}/probabilities"], v / v.sum(-1, keepdims=True), rtol=1e-10)
            gone = np.logical_or.accumulate(rec[f"regret/{t}/wipeouts"], axis=0)
            np.testing.assert_array_equal(alive, ~gone)
            cells = 1 if t == "normal" else 2  # 3 layers: one normal cell, two reduction cells
            assert rec[f"regret/{t}/rewards"].shape[1] == cells
    elif method == "bayesnas":
        for t in TYPES:
            s, w = rec[f"bayes/{t}/switch"], rec[f"arch/{t}/params"]
            # the Z of the step's forward: w(0) = 1 at the first step, then the previous step's w on its switched-on ops
            used = np.concatenate([np.ones_like(w[:1]), np.where(s[:-1], w[:-1], 0)])
            np.testing.assert_array_equal(rec[f"arch/{t}/weights"], used)
    elif method == "asmnas":
        for t in TYPES:
            counts = rec[f"attention/{t}/count"][last]
            cells = 1 if t == "normal" else 2
            assert (counts.sum(-1) == N * cells).all()  # one argmax per sample, edge and cell of the whole val split
            np.testing.assert_array_equal(rec[f"arch/{t}/weights"], rec[f"attention/{t}/mean"])
            a = rec[f"attention/{t}/mean"]
            np.testing.assert_allclose(a.sum(-1), 1, rtol=1e-12)


@pytest.mark.parametrize("method", ["sparsenas", "xnas", "bayesnas", "asmnas"])
def test_the_families_of_a_run_agree_with_one_another_as_their_meanings_say(method, tmp_path, monkeypatch):
    """SparseNAS: ``nonzero`` = A ≠ 0, ``weights`` = A, ``probabilities`` = |A| normalised, λ of epoch 0. XNAS:
    ``probabilities`` = the EG weights v normalised over the alive experts, ``alive`` = never wiped out so far,
    one reward round per cell. BayesNAS: ``weights`` = the Z of the step's forward, the w before the step on
    switched-on ops, 0 elsewhere. ASM-NAS: the epoch's ``attention/count`` holds one argmax per val sample, edge and
    cell; ``weights`` = ``attention/mean``."""
    _small_digits(monkeypatch)
    _, res, rec = _run(tmp_path, method, diagnostics=("cost",))
    _check_vocabulary(rec)
    _families_agree(method, rec, res.method.hp)


def test_the_recorded_ggn_diagonal_is_the_gauss_newton_diagonal_of_each_cells_weights_summed_over_the_type(
        tmp_path, monkeypatch):
    """Mode ggn, instance norm (samples do not interact, where docs/hessian.md says ggn is Σ_n J_nᵀ H_n J_n): the
    epoch row's ``hessian/<cell>/diag`` against Σ_k diag(J_kᵀ H J_k) built here from the full Jacobian of the
    logits in each cell's own Z_k, H = (diag p_b − p_b p_bᵀ)/B the Hessian of the batch-mean cross-entropy in the
    logits, at the state after the last step, its softmax(α) and its search-val batch."""
    from nasdiag.search.methods.darts import DARTS

    _small_digits(monkeypatch)
    seen = _snapshots(monkeypatch, DARTS)
    _, res, rec = _run(tmp_path, "darts", diagnostics=("hessian",), hessian_mode="ggn", norm="instance")
    _check_vocabulary(rec)
    _, _, (xv, yv) = seen[-1]
    net = Network(2, 10, 3, steps=2, multiplier=2, in_channels=1, norm="instance").double()
    net.load_state_dict(res.method.network.state_dict())
    z = {t: torch.softmax(a, -1) for t, a in _alphas(net.state_dict()).items()}
    leaves = [z[c.cell_type].clone() for c in net.cells]
    with torch.no_grad():
        p = torch.softmax(net(xv, leaves), -1)
    H = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]) / len(yv)  # (B, classes, classes)
    ggn = {t: torch.zeros(5, 8, dtype=torch.float64) for t in TYPES}
    for k, cell in enumerate(net.cells):
        def logits(zk, k=k):
            return net(xv, [zk if i == k else leaf for i, leaf in enumerate(leaves)])
        J = torch.autograd.functional.jacobian(logits, leaves[k]).reshape(len(yv), 10, 40)  # (B, classes, E·K)
        ggn[cell.cell_type] += torch.einsum("bci,bcd,bdi->i", J, H, J).reshape(5, 8)
    for t in TYPES:
        np.testing.assert_allclose(rec[f"hessian/{t}/diag"][2], ggn[t].numpy(), rtol=1e-8, atol=1e-14)


def test_a_nan_top_eigenvalue_at_an_epochs_last_step_stays_flagged_beside_a_finite_diagonal(tmp_path, monkeypatch):
    """--spectrum-every landing on the epoch's last step: the step's ``hessian/<cell>/nonfinite`` (True: its top
    eigenvalue is NaN) and the epoch's (False: the diagonal is finite) go to one row. The epoch's flag replaced the
    step's, so the row held a NaN ``hessian/top_eigenvalue`` flagged finite: the flag must be their logical or."""
    import nasdiag.hessian

    def nan_products(*args, **kwargs):
        raise FloatingPointError("a Hessian-vector product is not finite")

    monkeypatch.setattr(nasdiag.hessian, "eigenvalues_from_hvp", nan_products)
    _small_digits(monkeypatch)
    _, _, rec = _run(tmp_path, "darts", diagnostics=("hessian",), hessian_mode="diag", spectrum_every=3)
    assert np.isnan(rec["hessian/top_eigenvalue"][2])
    for t in TYPES:
        assert np.isnan(rec[f"hessian/{t}/top_eigenvalue"][2]) and np.isfinite(rec[f"hessian/{t}/diag"][2]).all()
        assert rec[f"hessian/{t}/nonfinite"][2]


def test_the_top_eigenvalues_are_on_the_rows_the_spectrum_interval_names_as_the_vocabulary_says(tmp_path, monkeypatch):
    """--spectrum-every 1 over 3 steps: the top eigenvalues (and their nonfinite flags) are on every row, not on the
    epoch row the vocabulary's ``when="epoch"`` named; now ``when="spectrum"``, described in docs/schema.md."""
    _small_digits(monkeypatch)
    _, _, rec = _run(tmp_path, "snas", diagnostics=(), spectrum_every=1)
    _check_vocabulary(rec, spectrum_every=1)
    assert rec["valid/hessian/top_eigenvalue"].all()
    text = open(pathlib.Path(__file__).resolve().parents[1] / "docs" / "schema.md", encoding="utf-8").read()
    assert "`spectrum` (the" in text


def test_epoch_scoped_values_belong_to_the_epoch_of_their_row(tmp_path, monkeypatch):
    """SNAS over 2 epochs of 3 steps: the rows of epoch 1 hold τ0·decay and the cosine lr of epoch 1 (the ones its
    steps used, not epoch 0's or epoch 2's), ``scalars/epoch`` names the epoch that ended at the row, and the epoch-1
    cost counts are that epoch's 3 steps × the type's cells (the moments restart each epoch)."""
    import math

    _small_digits(monkeypatch)
    out = str(tmp_path / "run.h5")
    cfg = SearchConfig(method="snas", C=2, layers=3, steps=2, multiplier=2, batch_size=BATCH, epochs=2, dtype="float64",
                       progress=False, threads=1, record=out, diagnostics=("cost",), device="cpu")
    hp = run(cfg).method.hp
    from nasdiag.record import load

    rec = load(out)
    assert rec["step"].tolist() == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(rec["scalars/temperature"], [hp.tau0] * 3 + [hp.tau0 * hp.tau_decay] * 3, rtol=1e-15)
    lr1 = hp.w_lr_min + (hp.w_lr - hp.w_lr_min) * (1 + math.cos(math.pi / 2)) / 2  # cosine over 2 epochs, after 1
    np.testing.assert_allclose(rec["scalars/w_lr"], [hp.w_lr] * 3 + [lr1] * 3, rtol=1e-15)  # the run's dtype (round 11)
    assert rec["valid/scalars/epoch"].tolist() == [False, False, True, False, False, True]
    assert rec["scalars/epoch"][[2, 5]].tolist() == [0, 1]
    assert (rec["cost/normal/count"][5] == 3).all() and (rec["cost/reduce/count"][5] == 6).all()
