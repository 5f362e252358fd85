"""DDP: statistics reduced across 2 gloo ranks on CPU equal the statistics of all ranks' samples
computed in one process with numpy; rules come from the statistics vocabulary; a recorder callback
reduces a whole batch of buffered rows at once; only rank 0 writes the record."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest

from nasdiag.distributed import ReductionError, plan_rules, reduce_statistics
from nasdiag.record import load

from conftest import launch_ranks

E, K = 3, 4
SAMPLES = {0: 3, 1: 5}  # per rank, unequal on purpose: pooling must weight by count


def _samples(rank: int) -> np.ndarray:
    return np.random.default_rng(100 + rank).standard_normal((SAMPLES[rank], E, K))


def _rank_statistics(rank: int, ddof: int) -> dict:
    x = _samples(rank)
    return {
        "scalars/train_loss": float(x.mean()),
        "cost/normal/mean": x.mean(0),
        "cost/normal/var": x.var(0, ddof=ddof),
        "cost/normal/count": np.int64(x.shape[0]),
        "hessian/normal/diag": x[0].astype(np.float32),
        "hessian/normal/nonfinite": x[0, 0] > 0.7,  # vocabulary rule: any (ranks differ here)
        "regret/normal/alive": x[0] > -1.0,  # vocabulary rule: same, overridden to all below
        "scalars/epoch": np.int64(4),
    }


def _step_samples(rank: int, step: int) -> np.ndarray:
    """Cost observations of one rank at one step (unequal counts per rank and step)."""
    return np.random.default_rng(1000 * step + rank).standard_normal((2 + rank + step % 3, E, K))


def _step_statistics(rank: int, step: int) -> dict:
    x = _step_samples(rank, step)
    return {
        "cost/normal/mean": x.mean(0),
        "cost/normal/var": x.var(0),
        "cost/normal/count": np.full((E, K), x.shape[0], np.int64),
        "scalars/train_loss": np.float32(x.mean()),
    }


WORKER = textwrap.dedent(
    """
    import datetime, json, os, sys
    import numpy as np
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from test_distributed import _rank_statistics
    import torch
    from nasdiag.distributed import ReductionError, reduce_statistics
    from test_distributed import _step_statistics
    from nasdiag.record import RecorderCallback

    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    result = {}
    for ddof in (0, 1):
        reduced = reduce_statistics(_rank_statistics(rank, ddof), ddof=ddof, rules={"regret/*/alive": "all"})
        np.savez(f"{out}/reduced_ddof{ddof}_rank{rank}.npz", **{k.replace("/", "|"): v for k, v in reduced.items()})
    errors = []
    try:  # ranks disagree on a path whose vocabulary rule is "same"
        reduce_statistics({"arch/normal/params": np.full((2, 2), float(rank))})
    except ReductionError as err:
        errors.append(str(err))
    try:  # ranks pass different paths: refused on every rank, no hang
        reduce_statistics({"scalars/a": 1.0} if rank == 0 else {"scalars/b": 1.0})
    except ReductionError as err:
        errors.append(str(err))
    summed = reduce_statistics({"scalars/seen": np.int64(rank + 1)}, rules={"scalars/*": "sum"})
    # A batch of rows as tensors: reduced once, when the callback hands the batch over.
    batched = RecorderCallback(f"{out}/batched.h5", flush_every=3, flush_seconds=None)
    for step in range(1, 6):
        batched.on_step_end(step, {k: torch.from_numpy(np.asarray(v)) for k, v in _step_statistics(rank, step).items()})
    batched.close()
    # An epoch end settles every row: rank 0 alone (a checkpoint) can then commit them all.
    epoch_cb = RecorderCallback(f"{out}/epoch.h5", flush_every=64, flush_seconds=None)
    for step in range(1, 4):
        epoch_cb.on_step_end(step, {"scalars/loss": torch.tensor(float(step * (rank + 1)))})
    epoch_cb.on_epoch_end(0)
    if epoch_cb.is_writer:
        epoch_cb.recorder.flush()
        from nasdiag.record import load
        result["after_epoch"] = load(f"{out}/epoch.h5")["scalars/loss"].tolist()
        result["committed_after_epoch"] = epoch_cb.recorder.last_committed_step
    epoch_cb.close()
    callback = RecorderCallback(f"{out}/run.h5", meta={"method": "ddp"}, flush_every=2, flush_seconds=None)
    for step in range(1, 4):
        callback.on_step_end(step, {"scalars/loss": float(step * (rank + 1)), "cost/normal/count": np.int64(rank + step)})
    callback.on_epoch_end(0, {"scalars/val": float(10 * rank)})
    callback.close()
    result.update(errors=errors, summed=int(summed["scalars/seen"]), writer=callback.is_writer, pid=os.getpid())
    json.dump(result, open(f"{out}/rank{rank}.json", "w"))
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    script = out / "worker.py"
    script.write_text(WORKER)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    launch_ranks(script, lambda rank: [rank, f"file://{out}/pg", out, tests_dir])
    return out


def _reduced(out, ddof, rank):
    with np.load(out / f"reduced_ddof{ddof}_rank{rank}.npz") as data:
        return {k.replace("|", "/"): data[k] for k in data.files}


@pytest.mark.parametrize("ddof", [0, 1])
def test_reduction_equals_statistics_of_all_samples(ddp_run, ddof):
    everything = np.concatenate([_samples(0), _samples(1)])
    reduced = [_reduced(ddp_run, ddof, rank) for rank in (0, 1)]
    for rank in (0, 1):
        got = reduced[rank]
        # pooled: exactly the mean / variance over all 8 samples
        np.testing.assert_allclose(got["cost/normal/mean"], everything.mean(0), rtol=1e-12)
        np.testing.assert_allclose(got["cost/normal/var"], everything.var(0, ddof=ddof), rtol=1e-10)
        assert got["cost/normal/count"] == everything.shape[0]
        # mean over ranks, dtype kept
        np.testing.assert_allclose(got["scalars/train_loss"], (_samples(0).mean() + _samples(1).mean()) / 2, rtol=1e-12)
        expected_diag = ((_samples(0)[0].astype(np.float32) + _samples(1)[0].astype(np.float32)) / 2)
        np.testing.assert_allclose(got["hessian/normal/diag"], expected_diag, rtol=1e-6)
        assert got["hessian/normal/diag"].dtype == np.float32
        # bools: "any" from the vocabulary, "all" by an explicit rule
        np.testing.assert_array_equal(got["hessian/normal/nonfinite"], (_samples(0)[0, 0] > 0.7) | (_samples(1)[0, 0] > 0.7))
        np.testing.assert_array_equal(got["regret/normal/alive"], (_samples(0)[0] > -1) & (_samples(1)[0] > -1))
        assert got["scalars/epoch"] == 4 and got["scalars/epoch"].dtype == np.int64
    for key in reduced[0]:  # every rank gets the same answer
        np.testing.assert_array_equal(reduced[0][key], reduced[1][key])


def test_disagreeing_ranks_get_clear_errors_and_rules_apply(ddp_run):
    for rank in (0, 1):
        result = json.loads((ddp_run / f"rank{rank}.json").read_text())
        assert len(result["errors"]) == 2, result
        assert "'arch/normal/params' differs across ranks" in result["errors"][0]
        assert "different statistics" in result["errors"][1]
        assert result["summed"] == 1 + 2
        assert result["writer"] == (rank == 0)
        if rank == 0:  # every row of the epoch, reduced, committed by rank 0's flush alone
            assert result["committed_after_epoch"] == 3
            np.testing.assert_allclose(result["after_epoch"], [s * (1 + 2) / 2 for s in (1, 2, 3)])


def test_only_rank_zero_writes_reduced_rows(ddp_run):
    out = load(ddp_run / "run.h5")
    steps = np.arange(1, 4)
    np.testing.assert_array_equal(out["step"], steps)
    np.testing.assert_array_equal(out["scalars/loss"], steps * (1 + 2) / 2)  # mean over ranks
    np.testing.assert_array_equal(out["cost/normal/count"], (0 + steps) + (1 + steps))  # counts add up
    np.testing.assert_array_equal(out["scalars/val"], [np.nan, np.nan, 5.0])
    # Every segment (scalars/val, new at epoch end, opens a second one) was written by rank 0.
    import h5py

    writer_pid = json.loads((ddp_run / "rank0.json").read_text())["pid"]
    segments = sorted(p for p in ddp_run.iterdir() if p.name.startswith("run") and p.suffix == ".h5")
    assert [p.name for p in segments] == ["run.h5", "run.seg0001.h5"]
    for segment in segments:
        with h5py.File(segment, "r") as f:
            assert f.attrs["pid"] == writer_pid


def test_batched_rows_reduced_to_statistics_of_all_samples(ddp_run):
    """Five steps of tensors, handed over in batches of 3 and 2 rows: every row's pooled cost equals
    numpy's mean and variance over both ranks' observations of that step."""
    out = load(ddp_run / "batched.h5")
    np.testing.assert_array_equal(out["step"], range(1, 6))
    for i, step in enumerate(range(1, 6)):
        everything = np.concatenate([_step_samples(0, step), _step_samples(1, step)])
        np.testing.assert_allclose(out["cost/normal/mean"][i], everything.mean(0), rtol=1e-12)
        np.testing.assert_allclose(out["cost/normal/var"][i], everything.var(0), rtol=1e-10)
        np.testing.assert_array_equal(out["cost/normal/count"][i], np.full((E, K), everything.shape[0]))
        expected_loss = (np.float32(_step_samples(0, step).mean()) + np.float32(_step_samples(1, step).mean())) / 2
        np.testing.assert_allclose(out["scalars/train_loss"][i], expected_loss, rtol=1e-6)


def test_without_process_group_statistics_pass_through():
    stats = {"scalars/a": 1.5, "cost/normal/mean": np.ones((2, 2)), "cost/normal/count": np.int64(3)}
    out = reduce_statistics(stats)
    assert out["scalars/a"] == 1.5
    np.testing.assert_array_equal(out["cost/normal/mean"], np.ones((2, 2)))
    assert plan_rules(out) == {"scalars/a": "mean", "cost/normal/mean": "pooled", "cost/normal/count": "sum"}
    # Rules come from the vocabulary, not from guessing at names: a float count of no family is a mean,
    # a family's rule holds whatever the dtype.
    assert plan_rules({"other/count": np.ones(2), "regret/normal/alive": np.ones(2, bool)}) == {
        "other/count": "mean", "regret/normal/alive": "same"}
    with pytest.raises(ReductionError, match="unknown reduction rule"):
        plan_rules(out, {"scalars/a": "median"})
    with pytest.raises(ReductionError, match="needs"):
        plan_rules({"cost/normal/var": np.ones(2), "cost/normal/count": np.ones(2)})
