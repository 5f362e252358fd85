"""Audit round 10 of data parallelism: 3 gloo ranks on CPU, each with a batch of ANOTHER size (the last batch of an
epoch of a loop of one's own), against numpy references built here on the concatenated samples, float64.

One launch (``ranks``, module fixture) runs every distributed part on the 3 ranks; the tests compare what they
saved (and the one record rank 0 wrote) with references computed in this process.

Found: following `nasdiag.distributed`'s advice for unequal per-rank batches (log the count beside a mean/var and
reduce them ``pooled``) with paths of no family, ``rules={"<p>/mean": "pooled", "<p>/var": "pooled"}``, an int
``<p>/count`` took the int default 'same' (ReductionError: the ranks' counts differ; a DDP RecorderCallback lost its
batch), a float one the rank mean; with only the mean named, the var was the rank mean of the ranks' variances. A
complex value went through the float64 collectives without its imaginary part (a ComplexWarning only), and in a DDP
RecorderCallback failed its whole batch of rows.

Checked and found right (references here or in scratch, not all kept): pooled mean/var of 3 unequal rank batches far
from 0 equal numpy's on the concatenated samples (cost family too), counts summed, ``scalars/<name>_count`` summed,
a plain scalar the rank mean of the ranks' means (as documented), a NaN on one rank seen by every rank
(``finite_on_every_rank``), only rank 0 writes (ranks given their own paths); the Hessian diagonal of a LayerNorm
supernet in the modes exact, exact_per_edge, ggn and diag is linear in the samples (the mean of two half batches'
equals the whole batch's to 1e-16; approx is not, as documented), which is what the rank mean relies on; a Probe on a
DistributedDataParallel-wrapped supernet records under gloo.
"""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from conftest import launch_ranks

WORLD = 3
SIZES = (2, 3, 6)  # samples of rank r: unequal, as the last batch of an epoch split over ranks
STEPS = 3


def samples(rank: int, step: int) -> np.ndarray:
    """Rank ``rank``'s (SIZES[rank], 4) float64 samples at ``step``, far from 0 (mean 1e3, sd 1)."""
    return 1e3 + np.random.default_rng(100 * step + rank).standard_normal((SIZES[rank], 4))


WORKER = textwrap.dedent(
    """
    import datetime, json, os, sys
    import numpy as np
    import torch, torch.distributed as dist
    from test_audit_ddp_round10 import STEPS, WORLD, samples
    from nasdiag.distributed import finite_on_every_rank, reduce_statistics
    from nasdiag.record import RecorderCallback

    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    results = {}

    def attempt(name, fn):
        try:
            results[name] = {k: np.asarray(v).tolist() for k, v in fn().items()}
        except Exception as err:  # recorded for the test, on every rank
            results[name] = {"error": [type(err).__name__, str(err)]}

    def moments(x, prefix, count_dtype):
        return {f"{prefix}/mean": x.mean(0), f"{prefix}/var": x.var(0), f"{prefix}/count": count_dtype(len(x))}

    # the docstring's advice for unequal per-rank batches: log the count next to the mean/var and reduce them pooled
    pooled = {"loss/mean": "pooled", "loss/var": "pooled"}
    attempt("own_int_count", lambda: reduce_statistics(moments(samples(rank, 1), "loss", np.int64), rules=pooled))
    attempt("own_float_count", lambda: reduce_statistics(moments(samples(rank, 1), "loss", np.float64), rules=pooled))
    attempt("own_mean_rule_only", lambda: reduce_statistics(moments(samples(rank, 1), "loss", np.int64),
                                                            rules={"loss/mean": "pooled"}))
    attempt("cost_family", lambda: reduce_statistics(moments(samples(rank, 1), "cost/normal", np.int64)))
    attempt("complex", lambda: reduce_statistics({"x/eig": np.array([1.0 + 2.0j, -1.0j])}))
    # a NaN loss on the last rank only: every rank must decide alike
    results["finite"] = [finite_on_every_rank(torch.tensor([1.0, float("nan") if r == WORLD - 1 and rank == r else 2.0]))
                         for r in range(WORLD)]

    # a recorder callback over the steps (rank r passes its own path: only rank 0 may write one)
    callback = RecorderCallback(f"{out}/run{rank}.h5", flush_every=2, flush_seconds=None, rules=pooled)
    for step in range(1, STEPS + 1):
        x = samples(rank, step)
        callback.on_step_end(step, {**moments(x, "loss", np.int64), **moments(x, "cost/normal", np.int64),
                                    "scalars/seen_count": np.float32(len(x)), "scalars/rank_mean": np.float64(x.mean())})
    callback.close()
    # a complex value at step 2: refused at its call, alone (the batch's reduction failed with it, every row of it lost)
    callback = RecorderCallback(f"{out}/complex{rank}.h5", flush_every=4, flush_seconds=None)
    for step in range(1, 4):
        try:
            callback.on_step_end(step, {"x/eig": np.array([1.0 + 2.0j]) if step == 2 else np.array([float(step)])})
        except Exception as err:
            results.setdefault("complex_row", []).append([step, type(err).__name__, str(err)])
    try:
        callback.close()
    except Exception as err:
        results.setdefault("complex_row", []).append(["close", type(err).__name__, str(err)])
    dist.barrier()
    dist.destroy_process_group()
    json.dump(results, open(f"{out}/results{rank}.json", "w"))
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Runs the worker on WORLD ranks (conftest.launch_ranks puts this folder on their path)."""
    out = tmp_path_factory.mktemp("ddp10")
    (out / "worker.py").write_text(WORKER)
    launch_ranks(out / "worker.py", lambda rank: [rank, f"file://{out}/pg", out], nprocs=WORLD)
    return out, [json.loads((out / f"results{rank}.json").read_text()) for rank in range(WORLD)]


def _everything(step: int) -> np.ndarray:
    return np.concatenate([samples(rank, step) for rank in range(WORLD)])


@pytest.mark.parametrize("name", ["own_int_count", "own_float_count", "own_mean_rule_only", "cost_family"])
def test_pooled_moments_of_unequal_rank_batches_equal_the_concatenated_batchs(ranks, name):
    """A ``<prefix>/count`` beside a pooled mean/var counts the samples of every rank: summed. A count of a path of no
    family took the default rule of its dtype: an int count 'same' (ReductionError: the ranks' counts differ), a float
    count 'mean' (the rank mean 11/3 recorded as the number of samples behind the pooled moments). So is a var beside
    a mean that ``rules`` pools: it was the rank mean of the ranks' variances (the spread of their means lost)."""
    _, results = ranks
    prefix = "cost/normal" if name == "cost_family" else "loss"
    everything = _everything(1)
    for rank in range(WORLD):
        got = results[rank][name]
        assert "error" not in got, got
        np.testing.assert_allclose(got[f"{prefix}/mean"], everything.mean(0), rtol=1e-14)
        np.testing.assert_allclose(got[f"{prefix}/var"], everything.var(0), rtol=1e-9)
        assert got[f"{prefix}/count"] == len(everything)


def test_a_nan_on_one_rank_is_seen_by_every_rank(ranks):
    _, results = ranks
    for rank in range(WORLD):
        assert results[rank]["finite"] == [True] * (WORLD - 1) + [False]


def test_only_rank_0_writes_and_its_record_holds_the_global_statistics(ranks):
    from nasdiag.record import load

    out, _ = ranks
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("run")) == ["run0.h5"]
    record = load(out / "run0.h5")
    assert list(record["step"]) == list(range(1, STEPS + 1))
    for i, step in enumerate(range(1, STEPS + 1)):
        everything = _everything(step)
        for prefix in ("loss", "cost/normal"):
            np.testing.assert_allclose(record[f"{prefix}/mean"][i], everything.mean(0), rtol=1e-14)
            np.testing.assert_allclose(record[f"{prefix}/var"][i], everything.var(0), rtol=1e-9)
            assert record[f"{prefix}/count"][i] == len(everything)
        assert record["scalars/seen_count"][i] == len(everything)  # the family's rule: sum
        # a plain scalar is the rank mean of the ranks' means (documented): not the global mean here
        want = np.mean([samples(rank, step).mean() for rank in range(WORLD)])
        np.testing.assert_allclose(record["scalars/rank_mean"][i], want, rtol=1e-14)


def test_a_complex_value_is_refused_in_one_line_not_stripped_of_its_imaginary_part(ranks):
    """The collectives run in float64: (1+2j, -1j) came back as (1, 0) (only a ComplexWarning said so); a single
    process handed it back unchanged. Refused alike on every rank and in one process."""
    from nasdiag.distributed import ReductionError, reduce_statistics

    _, results = ranks
    for rank in range(WORLD):
        kind, message = results[rank]["complex"]["error"]
        assert kind == "ReductionError" and "'x/eig' has dtype complex128" in message and "\n" not in message
    with pytest.raises(ReductionError, match="'x/eig' has dtype complex128"):
        reduce_statistics({"x/eig": np.array([1.0 + 2.0j])})
    with pytest.raises(ReductionError, match="'x/name' has dtype <U"):
        reduce_statistics({"x/name": "abc"})


def test_a_complex_row_of_a_ddp_callback_is_refused_at_its_call_and_costs_no_other_row(ranks):
    from nasdiag.record import load

    out, results = ranks
    for rank in range(WORLD):
        (step, kind, message), = results[rank]["complex_row"]
        assert (step, kind) == (2, "RecordError") and "dtype complex128 cannot be recorded" in message
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("complex")) == ["complex0.h5"]
    record = load(out / "complex0.h5")
    assert list(record["step"]) == [1, 3]
    np.testing.assert_array_equal(record["x/eig"][:, 0], [1.0, 3.0])
