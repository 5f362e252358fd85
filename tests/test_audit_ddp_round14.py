"""Audit round 14 of data parallelism: 2 gloo ranks on CPU (one launch, ``ranks``), against references built here in
float64 (numpy on the concatenated samples, logic on the truth values, autograd on the concatenated batch).

Found, in ``nasdiag.distributed.reduce_statistics``:
- ``all``/``any`` ("logical and / or") were the min/max of the values: int flags 0 and -1 gave all = -1, any = 0;
- a rank refusing its statistics alone (a pooled mean without its count, a complex value) raised before the ranks'
  check, leaving the others in that collective, which then paired with its next reduction (a valid step refused
  there, or reduced with another step's values);
- ``rules={"loss/*": "pooled"}`` (the docs' advice for unequal rank batches, as one glob) refused 'loss/count' as
  lacking 'loss/count';
- ``same`` ran ints through float64: 2**60 + 1 came back 2**60, and ranks differing past 2**53 passed;
- ``sum`` of a bool mask came back cast to bool (an 'any', not the number of ranks), of narrow ints wrapped.
In the docs: a DDP search was said to equal one process on the concatenated batch without saying that under
train-mode BatchNorm (``--norm batch``, the default) each rank normalises with its own batch (checked here: LayerNorm
equal to 1e-12, BatchNorm not); a resume under another world size named ``world_size``, which no option sets, without
saying how to launch the recorded number of processes; a RecorderCallback of a process whose RANK is no integer was
int()'s traceback.

Checked and found right (references here or in scratch, not kept where earlier rounds cover them): ProxylessNAS on 2
ranks equals one process on the concatenated batches (weights and α after 4 steps to 1e-16, samples and counts alike:
the one method test_search_ddp_methods.py leaves out); pooled moments with ddof=1 of unequal rank batches against
the hand formula; a NaN on one rank under max; a user callback raising on rank 0 at the last epoch end of ``run``
leaves rank 1 finishing, no hang; the vocabulary's rule of every family against its meaning (counts summed or, drawn
alike on every rank, 'same'; nonfinite flags 'any'; no extreme averaged).
"""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest
import torch

from conftest import free_port, launch_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

B = 4  # samples per rank
NORMS = ("layer", "batch")
# per rank: (int flag, float flag); the logical and/or over the ranks is taken here from the truth values
FLAGS = {"int_all": (np.array([0, -1, 2, 3]), np.array([-1, -1, 2, 0])),
         "float_any": (np.array([0.0, -0.5, 0.0, np.nan]), np.array([-2.0, 0.0, 0.0, 1.0]))}


def samples(rank: int) -> np.ndarray:
    """Rank ``rank``'s (2 or 5, 3) float64 samples, mean 1e3, sd 1: unequal batches, as an epoch's last."""
    return 1e3 + np.random.default_rng(rank).standard_normal((2 + 3 * rank, 3))


def network(norm: str):
    from nasdiag.supernet import Network

    torch.manual_seed(0)
    return Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, norm=norm).double()


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2 * B, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (2 * B,), generator=g)


WORKER = textwrap.dedent(
    """
    import datetime, sys
    import numpy as np
    import torch, torch.distributed as dist
    from test_audit_ddp_round14 import B, FLAGS, NORMS, batch, network, samples
    from nasdiag.distributed import reduce_statistics
    from nasdiag.search import Schedule, get_method

    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, per_rank in FLAGS.items():
        rule = name.split("_")[1]
        results[name] = reduce_statistics({"x/flag": per_rank[rank]}, rules={"x/flag": rule})["x/flag"]

    def attempt(stats, rules=None):
        try:
            return reduce_statistics(stats, rules=rules)
        except Exception as err:  # recorded for the test, on every rank
            return [type(err).__name__, str(err)]

    # statistics only one rank refuses (a pooled mean without its count, a complex value), then the next step's
    nxt = {"y/value": np.float64(rank + 1)}
    lone = {"x/mean": np.array([1.0, 2.0]), **({"x/count": np.int64(3)} if rank == 0 else {})}
    results["lone_count"] = [attempt(lone, {"x/mean": "pooled"}), attempt(nxt)]
    results["lone_complex"] = [attempt({"z/value": np.array([1.0]) if rank == 0 else np.array([1.0 + 1j])}), attempt(nxt)]
    results["bool_sum"] = attempt({"x/mask": np.array([True, rank == 1, False]), "x/n": np.uint8(200),
                                   "x/m": np.int16(30000)}, {"x/*": "sum"})
    # an int of no family ('same') past 2**53, the float64 of the collectives: alike on the ranks, and differing in bit 0
    results["big_int"] = [attempt({"run/seed": np.int64(2**60 + 1)}), attempt({"run/seed": np.int64(2**60 + rank)})]
    # unequal rank batches far from 0 pooled as the docs advise, the moments named by one glob
    own = samples(rank)
    results["glob"] = attempt({"loss/mean": own.mean(0), "loss/var": own.var(0), "loss/count": np.int64(len(own))},
                              {"loss/*": "pooled"})
    x, y = batch()
    part = slice(rank * B, (rank + 1) * B)
    for norm in NORMS:
        cls = get_method("darts")
        method = cls(network(norm), cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=1, batch_size=B))
        method.distribute()
        result = method.cost(x[part], y[part], method.probabilities(), observe=False)
        results[norm] = {t: c.detach().clone() for t, c in result.costs.items()}
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the 2 ranks of WORKER saved: one launch for every test of this file."""
    out = tmp_path_factory.mktemp("ddp14") / "results.pt"
    script, init = out.with_name("worker.py"), f"tcp://127.0.0.1:{free_port()}"
    script.write_text(WORKER)
    launch_ranks(script, lambda r: [r, init, out], timeout=120)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("name", list(FLAGS))
def test_all_and_any_are_logical_for_flags_of_either_sign(ranks, name):
    a, b = FLAGS[name]
    truth = np.logical_and(a != 0, b != 0) if name.endswith("all") else np.logical_or(a != 0, b != 0)
    want = np.where(np.isnan(a) | np.isnan(b), np.nan, truth.astype(float))  # a NaN on one rank stays visible
    for rank in (0, 1):
        got = ranks[rank][name]
        assert got.dtype == a.dtype, (name, got.dtype)
        np.testing.assert_array_equal(got.astype(float), want, err_msg=f"{name} rank {rank}")


@pytest.mark.parametrize("name", ["lone_count", "lone_complex"])
def test_statistics_one_rank_refuses_are_refused_on_every_rank_and_the_next_step_is_reduced(ranks, name):
    """A rank refusing its statistics before the ranks' check left the others in that collective, which then paired
    with the refusing rank's next reduction: the next step was refused there, or reduced with another step's values."""
    for rank in (0, 1):
        refused, following = ranks[rank][name]
        assert refused[0] == "ReductionError" and "ranks passed different statistics" in refused[1], (rank, refused)
        assert following == {"y/value": np.float64(1.5)}, (rank, following)  # (1 + 2) / 2, the rank mean


def test_moments_pooled_by_one_glob_equal_the_concatenated_samples(ranks):
    """rules={"loss/*": "pooled"} took the count for a pooled path and refused it as lacking 'loss/count' (the count
    it is), on every rank; a count named pooled beside a pooled mean is summed."""
    both = np.concatenate([samples(0), samples(1)])
    for rank in (0, 1):
        got = ranks[rank]["glob"]
        assert isinstance(got, dict), got
        np.testing.assert_allclose(got["loss/mean"], both.mean(0), rtol=1e-15)
        np.testing.assert_allclose(got["loss/var"], both.var(0), rtol=1e-9)  # sd 1 at 1e3: the squares about 1e3 cancel
        assert got["loss/count"] == len(both) and got["loss/count"].dtype == np.int64


def test_a_sum_of_bools_counts_the_ranks_holding_true_and_narrow_ints_do_not_wrap(ranks):
    """rules={...: 'sum'} of a bool mask came back cast to bool (the count of ranks holding True, 2, was True), and a
    sum of narrow ints in their dtype (uint8 200 + 200 was 144, int16 30000 + 30000 was -5536)."""
    for rank in (0, 1):
        got = ranks[rank]["bool_sum"]
        assert got["x/mask"].tolist() == [2, 1, 0] and got["x/mask"].dtype.kind == "i", got
        assert int(got["x/n"]) == 400 and int(got["x/m"]) == 60000, got


def test_an_int_reduced_same_is_compared_and_kept_exactly_past_2_to_the_53(ranks):
    """'same' ran through float64: 2**60 + 1 on every rank was recorded as 2**60, and 2**60 against 2**60 + 1 passed."""
    for rank in (0, 1):
        alike, differing = ranks[rank]["big_int"]
        assert isinstance(alike, dict) and int(alike["run/seed"]) == 2**60 + 1, alike
        assert differing[0] == "ReductionError" and "differs across ranks" in differing[1], differing


def _costs_of_the_concatenated_batch(norm: str) -> dict:
    """C = ∂L/∂Z of the mean loss of all 2B samples, Z = softmax(α) one leaf per cell type (autograd, float64)."""
    net = network(norm).train()
    x, y = batch()
    leaves = {t: torch.softmax(a.detach(), -1).requires_grad_(True) for t, a in net.alphas().items()}
    loss = torch.nn.functional.cross_entropy(net(x, leaves), y)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return dict(zip(leaves, grads))


def test_ranks_costs_are_the_concatenated_batchs_with_layernorm_and_the_docs_say_batchnorm_differs(ranks):
    import nasdiag.distributed
    import nasdiag.search.base

    for norm in NORMS:
        want = _costs_of_the_concatenated_batch(norm)
        for t, c in want.items():
            for rank in (0, 1):
                got = ranks[rank][norm][t]
                if norm == "layer":  # each sample normalised on its own: the rank mean is the global batch's cost
                    torch.testing.assert_close(got, c, rtol=1e-10, atol=1e-12, msg=f"{norm} {t} rank {rank}")
                else:  # train-mode BatchNorm: each rank's own batch statistics, not those of the 2B samples
                    assert (got - c).abs().max() > 1e-3 * c.abs().max(), f"{norm} {t}: expected to differ"
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    launch = readme[readme.index("Data-parallel over several processes"):].split("\n\n")[0]  # its DDP paragraph
    for doc in (nasdiag.distributed.__doc__, nasdiag.search.base.SearchMethod.cost.__doc__, launch):
        text = " ".join(doc.split())
        assert "train-mode BatchNorm" in text and "normalises with its own batch" in text, text[:300]


def test_a_resume_under_another_world_size_says_how_to_launch_the_recorded_one(tmp_path, monkeypatch):
    """world_size is set by no option: the refusal says it is the number of processes and how to launch that many."""
    from nasdiag.errors import ConfigError
    from nasdiag.search import SearchConfig, run
    from nasdiag.search.runner import _resume_point

    for variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    config = SearchConfig(method="darts", epochs=1, C=2, layers=3, steps=1, batch_size=256, device="cpu", threads=1,
                          progress=False, diagnostics=("cost",), record=str(tmp_path / "one.h5"))
    run(config)
    resume = SearchConfig(**{**config.to_dict(), "resume": True, "epochs": 2})
    state = torch.load(config.checkpoint, weights_only=False)
    # a record of one process resumed by 2 torchrun ranks (each would say it; run() finds its world size in the group)
    with pytest.raises(ConfigError, match=r"world_size=2 \(recorded 1\).*resume in one process, without torchrun$"):
        _resume_point(resume, {**state["run"], "world_size": 2})
    # a record of 2 ranks resumed in one process: the checkpoint says the run's world size
    state["run"]["world_size"] = 2
    torch.save(state, config.checkpoint)
    with pytest.raises(ConfigError, match=r"world_size=1 \(recorded 2\).*torchrun --nproc_per_node=2 -m nasdiag search"):
        run(resume)


def test_a_rank_variable_that_is_no_integer_is_one_line_before_any_file(tmp_path, monkeypatch):
    """A RecorderCallback of a process whose RANK is not an integer was int()'s ValueError traceback."""
    from nasdiag.errors import ConfigError
    from nasdiag.record import RecorderCallback

    monkeypatch.setenv("RANK", "first")
    with pytest.raises(ConfigError, match=r"^environment variable RANK='first' is not a process rank .*unset it"):
        RecorderCallback(tmp_path / "run.h5")
    assert list(tmp_path.iterdir()) == []
