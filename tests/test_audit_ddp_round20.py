"""Audit round 20 of data parallelism: 2 gloo ranks on CPU (one launch, ``ranks``), each with a batch of another size
(5 and 3 samples: an epoch's last batches of a loop of one's own), against references built here in float64 (autograd of
our own mixed-op network with Z as an explicit leaf, numpy on the concatenated observations).

Found, in `RecorderCallback` (nasdiag/record/callbacks.py): only rank 0's `Recorder` checked the ``meta`` and the rows'
shapes against it. A meta it refuses (``edge_names`` a list) was taken by rank 1, which went on into its loop alone;
a row whose (E, K) the meta contradicts was refused by rank 0 alone, at the epoch end's hand-over, while rank 1 went
on into its next epoch's collectives (gloo's 'Connection closed by peer' traceback as rank 0 left, a hang where rank
0 goes on). Every rank now checks the meta it was given as rank 0's Recorder does and refuses such a row at the call.
A record rank 0's Recorder refuses to open (one already at the path, a rerun without ``resume=True``; a full disk)
stopped rank 0 in one line while rank 1 went on into its loop, its first reduction waiting for rank 0 until gloo's
timeout (30 minutes by default); every rank now learns at the construction (one collective) and raises alike. A row
of another dtype than a resumed record's float path was refused by rank 0's Recorder alone at the hand-over; rank 0
now shares the record's float layouts in that collective and every rank refuses such a row alike (int and bool paths
are left to the first row as before: their reduced dtype is not the raw rows' under some rules).

Checked and found right: a `Probe` on each rank and one `RecorderCallback` reducing its ``statistics()`` at the epoch
end: the one record rank 0 writes holds ``cost/<group>/{mean,var,count}`` equal to numpy's mean, population variance
and count of every rank's per-step observations C_{r,t} = ∂L_{r,t}/∂Z (one per rank and step, each rank's own mean
loss, as docs/probe.md and `nasdiag.distributed` say: steps and ranks not weighted by their batch size), and
``scalars/loss`` the plain rank mean of the ranks' batch means (the ``mean`` rule, documented as weighing every rank
alike); a NaN loss on rank 1 only at one step is NaN in the record's row of that step, not averaged away.

Read and found right (earlier rounds keep tests of them): the top eigenvalue under DDP (Lanczos on rank-averaged
Hessian-vector products; the NaN check follows the all-reduce, so every rank stops alike), XNAS's rewards from
rank-averaged costs (its regret families 'same', its nonfinite flags 'any'), BayesNAS's energy curvature (local batch ×
world size, equal batches as the runner takes them), the runner's sharding, the search-val evaluation (every rank the
whole split, batch statistics, so the same number and the same divergence check on every rank), a resume's RNG and
checkpoint (rank 0's, loaded by every rank). In scratch: `SearchMethod.curvature`'s ``hessian/<cell>/diag`` of a
LayerNorm supernet (float64) in the modes exact, exact_per_edge, ggn, diag and hutchinson:4, on the fast and eager
engines, is linear in the samples (the mean of two half batches' equals the whole batch's to 2e-16), which the rank
mean of the docs' batch convention relies on (round 10 checked it through the eager per-edge path only).

Left alone: a rank without a path target (``None`` beside rank 0's open `Recorder`, as `lightning_callback` makes its
non-writing ranks, meta None) has no meta to check rows against, so there only rank 0 refuses a row whose (E, K) the
meta contradicts (at the call now, at the hand-over before): nasdiag/record/lightning.py could pass its meta to every
rank, untestable here (lightning does not import on this box); a resumed record's int and bool paths are not shared
(see above). Judgement calls, documented: ``SearchMethod.cost`` averages the ranks' C_r unweighted, the global mean
loss's cost only for equal rank batches, which the runner always takes (a method stepped by a loop of one's own with a
last partial batch per rank would step α with the unweighted mean).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import free_port, launch_ranks
from test_audit_ddp_round19 import _net as network  # LayerNorm, two mixed edges, Z given or softmax(α); seeded
from test_audit_ddp_round19 import _own_cost as own_cost  # C = ∂L/∂Z of the batch-mean loss, Z a leaf of its own

D = torch.float64
SIZES = (5, 3)  # samples of rank 0 and rank 1 at every step
STEPS = 2  # probed steps
NAN_STEP = 3  # one more step, not probed: rank 1's loss is NaN there


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(SIZES[rank], 3, generator=g, dtype=D)
    if rank == 1 and step == NAN_STEP:
        x[0, 0] = float("nan")
    return x, torch.randint(0, 5, (SIZES[rank],), generator=g)


WORKER = textwrap.dedent(
    """
    import datetime, sys, warnings
    import torch, torch.distributed as dist, torch.nn.functional as F
    from test_audit_ddp_round20 import NAN_STEP, STEPS, batch, network
    import nasdiag
    from nasdiag.record import RecorderCallback

    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    net = network()
    probe = nasdiag.attach(net)  # no weight step: every step at the same parameters, so the reference needs no replay
    with RecorderCallback(out, meta={"run": "ddp20"}) as callback:
        for step in range(1, STEPS + 1):
            x, y = batch(rank, step)
            with probe.record():
                loss = F.cross_entropy(net(x), y)
                loss.backward()
            net.zero_grad()
            callback.on_step_end(step, {"scalars/loss": loss.detach()})
        with torch.no_grad():  # a NaN pixel on rank 1 only
            x, y = batch(rank, NAN_STEP)
            callback.on_step_end(NAN_STEP, {"scalars/loss": F.cross_entropy(net(x), y)})
        callback.on_epoch_end(0, probe.statistics())
    res = {}
    try:  # a meta rank 0's Recorder refuses: refused alike on rank 1, which opens no recorder
        RecorderCallback(out + ".bad", meta={"run": "ddp20", "edge_names": ["e0", "e1"]})
    except Exception as err:
        res["bad_meta"] = f"{type(err).__name__}: {err}"
    meta = {"run": "ddp20", "op_names": ["a", "b", "c"], "edge_names": {"normal": ["e0", "e1"]}, "cell_types": ["normal"]}
    with RecorderCallback(out + ".meta.h5", meta=meta, flush_every=2) as callback:
        for step in (1, 2, 3):
            try:  # a row meta contradicts, then the loop goes on with the callback
                callback.on_step_end(step, {"arch/normal/weights": torch.zeros(2, 4 if step == 2 else 3), "scalars/s": float(step)})
            except Exception as err:
                res[step] = f"{type(err).__name__}: {err}"
            callback.on_epoch_end(step - 1)
    try:  # the record is there: rank 0's Recorder refuses to replace it, and rank 1 must not go on alone
        callback = RecorderCallback(out + ".meta.h5", meta=meta)
        callback.on_step_end(9, {"scalars/s": 9.0})
        callback.close()  # a reduction: rank 1 alone waited here for rank 0 until gloo's timeout
        res["exists"] = "went on"
    except Exception as err:
        res["exists"] = f"{type(err).__name__}: {err}"
    res["resumed"] = []  # a record whose scalars/s is float32 (written before the launch), resumed with float64 rows
    with RecorderCallback(out + ".resumed.h5", meta={"run": "ddp20"}, flush_every=2, resume=True) as callback:
        for step in (10, 11):
            try:
                callback.on_step_end(step, {"scalars/s": torch.tensor(float(step), dtype=torch.float64)})
                callback.on_epoch_end(step)
            except Exception as err:
                res["resumed"].append(f"{type(err).__name__}: {err}")
    torch.save(res, f"{out}.{rank}")
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The record rank 0 wrote (loaded), what each rank saved, and the folder: one launch (at most 60 s) for every
    test here."""
    from nasdiag.record import load

    folder, port = tmp_path_factory.mktemp("ddp20"), free_port()
    (folder / "worker.py").write_text(WORKER)
    out = folder / "run.h5"
    from nasdiag.record import Recorder

    with Recorder(folder / "run.h5.resumed.h5", meta={"run": "ddp20"}) as recorder:
        recorder.log(1, {"scalars/s": np.float32(1.0)})
    launch_ranks(folder / "worker.py", lambda r: [r, f"tcp://127.0.0.1:{port}", out], timeout=60)
    return load(out), [torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1)], folder


def _observations():
    net = network()
    return {(r, t): own_cost(net, *batch(r, t)) for r in (0, 1) for t in range(1, STEPS + 1)}


def test_probe_cost_statistics_pooled_over_unequal_ranks_are_numpys_over_every_ranks_observations(ranks):
    record = ranks[0]
    obs = _observations()
    stacked = torch.stack(list(obs.values())).numpy()  # (ranks × steps, E, K)
    (group,) = {p.split("/")[1] for p in record if p.startswith("cost/")}
    count = record[f"cost/{group}/count"][-1]
    assert (count == len(obs)).all(), count  # one observation per rank and step, summed over the ranks
    # the batch-size-weighted mean (the global batch's cost) differs from the plain one by far more than the tolerance
    weights = np.array([SIZES[r] for r, _ in obs], dtype=float)[:, None, None]
    assert np.abs((stacked * weights).sum(0) / weights.sum() - stacked.mean(0)).max() > 1e-4
    for name, want in (("mean", stacked.mean(0)), ("var", stacked.var(0))):
        # float64, four backwards pooled from two ranks' moments: round-off only (the var is about 1e-3)
        np.testing.assert_allclose(record[f"cost/{group}/{name}"][-1], want, rtol=1e-10, atol=1e-14, err_msg=name)


def test_the_loss_scalar_is_the_rank_mean_of_batch_means_and_a_nan_on_one_rank_stays_nan(ranks):
    record = ranks[0]
    net = network()
    losses = record["scalars/loss"]
    assert losses.shape == (NAN_STEP,), losses
    for t in range(1, NAN_STEP + 1):
        with torch.no_grad():
            want = np.mean([float(F.cross_entropy(net(batch(r, t)[0]), batch(r, t)[1])) for r in (0, 1)])
        if t == NAN_STEP:
            assert np.isnan(losses[t - 1]) and np.isnan(want), losses
        else:
            np.testing.assert_allclose(losses[t - 1], want, rtol=1e-12)


def test_a_meta_or_a_row_shape_rank_0_refuses_is_refused_alike_on_every_rank(ranks):
    """Only rank 0's Recorder checked the meta and the rows' shapes against it: a meta it refused (edge_names a list)
    was taken by rank 1, and a row whose (E, K) the meta contradicts was refused by rank 0 alone, at the epoch end's
    hand-over, while rank 1 went on into its next epoch's collectives ('epoch 0 done' on rank 1, then gloo's
    'Connection closed by peer' traceback as rank 0 left; a hang where rank 0 goes on). Now every rank refuses at the
    call, in one line, and the loop goes on on both ranks with the callback."""
    from nasdiag.record import load

    _, saved, folder = ranks
    for rank in (0, 1):
        res = saved[rank]
        assert res.get("bad_meta", "").startswith("RecordError: meta['edge_names']"), (rank, res)
        assert "\n" not in res["bad_meta"]
        assert sorted(k for k in res if isinstance(k, int)) == [2], (rank, res)
        assert res[2].startswith("RecordError: 'arch/normal/weights'") and "(2, 3)" in res[2] and "\n" not in res[2], res[2]
    assert not (folder / "run.h5.bad").exists()
    written = load(folder / "run.h5.meta.h5")
    # the refused step left no row (its epoch end joined the open row of step 1); the rows around it are recorded
    assert list(written["step"]) == [1, 3] and list(written["scalars/s"]) == [1.0, 3.0], written


def test_a_record_rank_0_refuses_to_open_stops_every_rank_at_construction_in_one_line(ranks):
    """A RecorderCallback(path) whose record exists (a rerun without resume=True): rank 0's Recorder refused it in
    one line, rank 1 opened nothing and went on into its loop, where its first reduction waited for rank 0 until
    gloo's timeout (30 minutes by default; 'Timed out waiting ... for send operation' with a short one). Every rank
    now raises at the construction, rank 1 naming rank 0's reason."""
    _, saved, folder = ranks
    for rank in (0, 1):
        message = saved[rank]["exists"]
        assert message.startswith("RecordError: ") and "already exists" in message and "\n" not in message, (rank, message)
    assert "rank 0" in saved[1]["exists"], saved[1]["exists"]


def test_a_row_a_resumed_record_refuses_is_refused_alike_on_every_rank(ranks):
    """Resumed under DDP, a record's float32 path given float64 rows: rank 0's Recorder refused each row alone at the
    epoch end's hand-over (rank 1 saw nothing and went on, into collectives rank 0 had left where it stopped). Rank 0
    shares the resumed record's float layouts at the construction, so every rank refuses alike, in one line."""
    from nasdiag.record import load

    _, saved, folder = ranks
    for rank in (0, 1):
        refused = saved[rank]["resumed"]
        assert len(refused) == 2 and all(m.startswith("RecordError: 'scalars/s'") and "float32" in m and "\n" not in m
                                         for m in refused), (rank, refused)
    assert list(load(folder / "run.h5.resumed.h5")["step"]) == [1]
