"""Round-19 audit of the NaN/inf path end to end: a NaN is recorded and flagged, never hidden (never averaged away).

Defect found: first-order DARTS, which stops at the epoch end's search-val check, had its checkpoint written at that
epoch end first, NaN weights and all: ``--resume`` continued the NaN state, wrote one more epoch of NaN rows per resume
("after epoch 1", "after epoch 2", ...), and a run that diverged in its last epoch was "already finished"; the
checkpoint now stays the one before the divergence
(``test_a_resumed_diverged_first_order_darts_run_stops_where_it_stopped_and_writes_nothing``).

Defect found: under DDP a rank stopped by another rank's NaN loss (every rank stops at that step) said its own finite
loss was not finite ('the search-val loss is 2.3874398620832817 (not finite)', rank 0 of a 2-rank gloo run with a NaN
pixel in rank 1's batch); the message says the loss is finite on this rank and not on another
(``test_a_rank_stopped_by_another_ranks_nan_does_not_call_its_own_finite_loss_not_finite``).

Checked by hand on the landed code (scratch scripts, tiny digits searches, float64):

* a NaN in one sample of the search-train or search-val batch, at the first step and at an epoch's last step, for
  every built-in method: every method but first-order DARTS stops at that step with one SearchError line naming the
  loss, the step's row holds the NaN loss and ``scalars/nonfinite_loss`` = 1 (also at an epoch's last step), the
  RecordWarning line names the path and the step; first-order DARTS records its NaN rows (α, losses, the top
  eigenvalues with ``hessian/<cell>/nonfinite`` set, the epoch's cost moments NaN) and stops at the epoch end's
  search-val check, as docs/methods.md says;
* a resume of such a run from its checkpoint before the NaN replays the same NaN, stops at the same step and leaves
  the record's rows (one per step) as they were;
* ``nasdiag plot`` counts the NaNs per path in its line and ``nasdiag report`` lists the record's NaN/inf counts;
  every non-finite flag has its NaN value recorded beside it (the loss, the diagonal, the top eigenvalue, XNAS's
  rewards, BayesNAS's ``bayes/<cell>/curvature``), so the counts cover the flags; DSNAS's cost means are NaN exactly
  where their count is 0;
* the epoch-end diagonal in the modes exact, exact_per_edge, ggn, diag and approx of a diverged DARTS run: NaN and
  flagged in each (diag/approx give the structural 0 of the 'none' op, exact and ggn NaN there);
* a 2-rank gloo run (first-order DARTS; ProxylessNAS) with a NaN pixel in rank 1's search-val batch only: both ranks
  stop at the same place, the one record holds the NaN (rank mean) and the flag, and a resume stops there again;
* XNAS with a NaN reward of one op of one edge through a whole run: that edge's ``regret/<cell>/nonfinite`` is set
  at that step only, its regret stays as before the round, the reward is kept NaN in the record.

The tests below pin the streaming moments (what ``cost/<cell>/{mean,var}`` are made of) against numpy's
NaN-propagating statistics of the raw values injected: a NaN or inf at the first, a middle and the last step, in
one micro-batch of a step, and on one DDP rank only (``merge``).
"""

import math

import numpy as np
import pytest
import torch

from nasdiag.cost.streaming import CostMoments

SHAPE = (3, 4)


def _history(seed, steps=5, micro=2, n=3):
    """``steps`` steps, each ``micro`` micro-batches of ``n`` observations of SHAPE, float64."""
    g = np.random.default_rng(seed)
    return g.normal(0.3, 2.0, size=(steps, micro, n) + SHAPE)


def _numpy(history):
    """numpy's two-pass population statistics of every observation (NaN/inf propagate as numpy gives them)."""
    flat = history.reshape((-1,) + SHAPE)
    with np.errstate(invalid="ignore"):
        return flat.mean(0), flat.var(0)


def _stream(history):
    m = CostMoments(SHAPE)
    for step in history:
        for batch in step:
            m.update(torch.from_numpy(batch))
    return m


@pytest.mark.parametrize("where", ["first step", "middle step", "last step"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_cost_at_any_step_or_micro_batch_stays_in_the_streamed_moments(where, value):
    history = _history(0)
    step = {"first step": 0, "middle step": 2, "last step": -1}[where]
    history[step, 1, 2, 1, 3] = value  # one sample of the second micro-batch, one (edge, op)
    want_mean, want_var = _numpy(history)
    m = _stream(history)
    np.testing.assert_allclose(m.mean.numpy(), want_mean, rtol=1e-12, atol=1e-12, equal_nan=True)
    np.testing.assert_allclose(m.var.numpy(), want_var, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert not torch.isfinite(m.mean[1, 3]) and torch.isnan(m.var[1, 3])  # kept, never skipped
    assert np.isfinite(m.mean.numpy()).sum() == m.mean.numel() - 1  # and only there
    assert (m.count.numpy() == history.shape[0] * history.shape[1] * history.shape[2]).all()  # counted, not dropped


def test_opposite_infinities_in_one_entry_are_a_nan_mean_as_numpys():
    history = _history(1)
    history[0, 0, 0, 2, 2] = math.inf
    history[3, 1, 1, 2, 2] = -math.inf
    want_mean, want_var = _numpy(history)
    m = _stream(history)
    assert np.isnan(want_mean[2, 2]) and torch.isnan(m.mean[2, 2]) and torch.isnan(m.var[2, 2])
    np.testing.assert_allclose(m.mean.numpy(), want_mean, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_a_nan_on_one_rank_only_is_nan_in_the_merged_moments_and_the_others_are_the_union():
    ranks = [_history(2), _history(3, steps=4)]
    ranks[1][1, 0, 0, 0, 1] = math.nan  # rank 1 only
    union = np.concatenate([r.reshape((-1,) + SHAPE) for r in ranks])
    want_mean, want_var = union.mean(0), union.var(0)
    merged = _stream(ranks[0])
    merged.merge(_stream(ranks[1]))
    assert torch.isnan(merged.mean[0, 1]) and torch.isnan(merged.var[0, 1])
    np.testing.assert_allclose(merged.mean.numpy(), want_mean, rtol=1e-12, atol=1e-12, equal_nan=True)
    np.testing.assert_allclose(merged.var.numpy(), want_var, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert (merged.count.numpy() == len(union)).all()


def test_an_unselected_nan_under_a_sampling_mask_is_not_an_observation():
    """Under one-hot sampling only the sampled op counts: a NaN of an op that did not run (DSNAS's probe) is masked
    out, a NaN of the sampled one is kept."""
    history = _history(4, steps=3, micro=1)
    mask = np.zeros(history.shape, bool)
    mask[..., 0] = True  # op 0 sampled on every edge
    history[1, 0, 0, 0, 2] = math.nan  # an unsampled op: not observed
    history[2, 0, 1, 1, 0] = math.nan  # the sampled op: observed
    m = CostMoments(SHAPE)
    for step, sel in zip(history, mask):
        m.update(torch.from_numpy(step[0]), torch.from_numpy(sel[0]))
    flat = history[..., 0].reshape(-1, SHAPE[0])
    # never observed: count 0 and no variance (the search's diagnostics and the probe write NaN means there)
    assert (m.count.numpy()[:, 1:] == 0).all() and np.isnan(m.var.numpy()[:, 1:]).all()
    np.testing.assert_allclose(m.mean.numpy()[:, 0], flat.mean(0), rtol=1e-12, atol=1e-12, equal_nan=True)
    assert torch.isnan(m.mean[1, 0]) and torch.isfinite(m.mean[[0, 2], 0]).all()


# -- a diverged first-order DARTS run resumed ---------------------------------------------------------------------
from nasdiag.record import load  # noqa: E402
from nasdiag.search import SearchConfig, SearchError, get_method, register, run  # noqa: E402

_DARTS = get_method("darts")


@register("darts-nan-val-at-step-1-r19")
class _DartsNanValAtStep1(_DARTS):
    """First-order DARTS given a search-val batch with one NaN pixel at the first step of each session: α takes a NaN
    gradient there, so the run diverges in epoch 0 (a deterministic divergence: each session starts at step 1)."""

    Hyperparameters = _DARTS.Hyperparameters

    def step(self, train_batch, val_batch):
        self._session_steps = getattr(self, "_session_steps", 0) + 1
        if self._session_steps == 1:
            x = val_batch[0].clone()
            x[0].view(-1)[0] = math.nan
            val_batch = (x, val_batch[1])
        return super().step(train_batch, val_batch)


def _rows(path):
    rec = load(str(path))
    return {k: np.asarray(v) for k, v in rec.items() if isinstance(v, np.ndarray) and v.dtype.kind in "fiub"}


@pytest.mark.filterwarnings("ignore::nasdiag.record.RecordWarning")
def test_a_resumed_diverged_first_order_darts_run_stops_where_it_stopped_and_writes_nothing(tmp_path):
    """First-order DARTS records its NaN rows and stops at the epoch end's search-val check (docs/methods.md). The
    checkpoint was written at that epoch end first, NaN weights and all: --resume continued the NaN state, adding an
    epoch of NaN rows and stopping 'after epoch 1' (then 2, ...), and a run that diverged in its last epoch was
    'already finished'. An uninterrupted run stops after epoch 0; a resume must stop there too, writing nothing
    (as a method's NaN-loss step replays to the same stop)."""
    cfg = dict(method="darts-nan-val-at-step-1-r19", dataset="digits", epochs=2, batch_size=359, C=2, layers=3,
               steps=2, dtype="float64", record=str(tmp_path / "run.h5"), figures=None, diagnostics=(), progress=False,
               threads=1)  # 719 digits per split // 359: 2 steps per epoch
    with pytest.raises(SearchError, match="after epoch 0") as first:
        run(SearchConfig(**cfg))
    before = _rows(tmp_path / "run.h5")
    S = len(before["step"])
    assert S >= 1 and np.isnan(before["scalars/train_loss"]).all()  # the injected NaN spread to every later row
    with pytest.raises(SearchError) as again:
        run(SearchConfig(**cfg, resume=True))
    assert str(again.value) == str(first.value)
    after = _rows(tmp_path / "run.h5")
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)  # NaN-equal: not one row more
    with pytest.raises(SearchError, match="after epoch 0"):  # a run whose last epoch diverged is not 'finished'
        run(SearchConfig(**{**cfg, "epochs": 1, "record": str(tmp_path / "one.h5")}))
    with pytest.raises(SearchError, match="after epoch 0"):
        run(SearchConfig(**{**cfg, "epochs": 1, "record": str(tmp_path / "one.h5")}, resume=True))


# -- a NaN on another DDP rank only ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method, module", [("snas", "nasdiag.search.methods._sampling"),
                                            ("xnas", "nasdiag.search.methods.xnas"),
                                            ("darts2", "nasdiag.search.unrolled")])
def test_a_rank_stopped_by_another_ranks_nan_does_not_call_its_own_finite_loss_not_finite(method, module, monkeypatch):
    """Under DDP every rank stops at the step where any rank's loss is NaN (`finite_on_every_rank`). A rank whose own
    loss was finite said 'the search-val loss is 2.3874398620832817 (not finite)' (seen on rank 0 of a 2-rank gloo
    run with a NaN pixel in rank 1's search-val batch): a finite number called not finite, nothing of another rank.
    Here the collective's answer is that of a NaN on another rank; this rank's batch is finite."""
    import importlib

    from nasdiag.search import Schedule
    from nasdiag.supernet import Network

    monkeypatch.setattr(importlib.import_module(module), "finite_on_every_rank", lambda value: False)
    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()
    cls = get_method(method)
    m = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=6))
    g = torch.Generator().manual_seed(1)
    batch = lambda: (torch.randn(6, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g))  # noqa: E731
    with pytest.raises(SearchError) as err:
        m.step(batch(), batch())
    text = str(err.value)
    assert len(text.splitlines()) == 1 and "nan" not in text.lower().replace("nan/inf", "")
    assert "on this rank, not finite on another DDP rank" in text
    assert err.value.statistics["scalars/nonfinite_loss"] == 1  # the row is still recorded and flagged

