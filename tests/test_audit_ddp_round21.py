"""Audit round 21 of data parallelism: 2 gloo ranks on CPU (one launch, ``ranks``), float64, against references built
here (autograd on the concatenated batch with the mixing weights Z as explicit leaves; one process on the
concatenated batches).

Found, in ``SearchMethod.cost`` (nasdiag/search/base.py, the methods' DDP part): given per-sample mixing weights
(E, B, K), which its contract takes, the per-sample costs were averaged over the ranks like the (E, K) ones, so sample
b of rank 0 was mixed with sample b of rank 1 (a silently wrong cost, neither sample's), and ranks of unequal batches
met in one all-reduce of different sizes. They are now this rank's samples' costs of the global mean loss, ∂L_r/∂Z / R,
the concatenated batch's rows, as its docstring says of the costs (the (E, K) ones are still the rank mean).
In `RecorderCallback` (nasdiag/record/callbacks.py): an open `Recorder` target "must live on rank 0 only", yet one given
on every rank (each of its own path) was taken: rank 1 wrote a second record of the reduced rows. It is one
RecordError line on every rank at the construction now (docs/schema.md says so). The record rank 0 writes for a
loop of one's own (a path target, no ``world_size`` in the meta given) did not say over how many ranks its rows were
reduced, and ``nasdiag report`` showed it as world size 1; the callback adds ``world_size`` to the meta under DDP
unless the meta names one (the runner's records had it already).

Checked and found right: second-order DARTS (``darts2``, the unrolled hypergradient of nasdiag/search/unrolled.py) on 2
ranks of B samples equals one process on the concatenated 2B samples to 1e-12 over 3 steps: weights, α, the
hypergradient's norm and its implicit term, ε, and the rank mean of the losses (no earlier round ran it under DDP).
Read and found right: every family's reduction rule against what each rank holds (``same`` only for values drawn or
averaged alike on every rank: XNAS's rewards are of the rank-mean costs, SNAS/DSNAS samples of one seeded generator,
ASM-NAS's selection counts of the whole split); weight-gradient clipping after the ranks' averaging in every method
(DARTS/darts2 average before ``clip_grad_norm_``, the others average in DDP's backward); the first-order cost
statistics' observations stay each rank's own (darts2, SparseNAS second order: ``per_cell``); ``on_exception`` runs no
collective; the runner's sharding gives the single process's batches of R·B (round 19/20).

Left alone: a rank that refuses its RecorderCallback makes rank 0 close the Recorder it was given open (no rank
records, as documented, but the caller's object is closed); a record a DDP RecorderCallback started before this round
(no ``world_size`` in its meta), resumed under DDP, now differs in its meta: the Recorder's run-change warning, by
default; ``nasdiag report`` shows world size 1 for a record of no ``world_size`` (a single process's RecorderCallback
record; nasdiag/plot/report.py, outside this area); ``SearchMethod.cost``/``curvature`` called on one rank alone under a
process group of several all-reduce and wait for the others (the methods are documented for every rank, under
``run``; ``Probe.hessian`` alone was made collective-free in round 17).
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from conftest import free_port, launch_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

B = 3  # per rank
STEPS = 3


def build(name: str, **hp):
    from nasdiag.search import Schedule, get_method
    from nasdiag.supernet import Network

    cls = get_method(name)
    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, norm="layer", affine=True).double()
    return cls(net, cls.Hyperparameters(**hp), schedule=Schedule(epochs=2, steps_per_epoch=STEPS, batch_size=B), seed=0)


def data():
    g = torch.Generator().manual_seed(1)
    batch = lambda: (torch.randn(2 * B, 1, 8, 8, generator=g, dtype=torch.float64),  # noqa: E731
                     torch.randint(0, 5, (2 * B,), generator=g))
    return [(batch(), batch()) for _ in range(STEPS)]


def darts2_steps(method, part=slice(None)):
    stats = []
    for (xt, yt), (xv, yv) in data():
        out = method.step((xt[part], yt[part]), (xv[part], yv[part]))
        stats.append({k: v.detach().clone() for k, v in out.items()})
    return {n: p.detach().clone() for n, p in method.network.named_parameters()}, stats


def per_sample_weights(net, batch):
    """(E, batch, K) mixing weights of every cell type, a softmax of fixed random logits per sample."""
    g = torch.Generator().manual_seed(3)
    return {t: torch.softmax(torch.randn(a.shape[0], batch, a.shape[1], generator=g, dtype=torch.float64), -1)
            for t, a in net.alphas().items()}


WORKER = textwrap.dedent(
    """
    import datetime, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[3])
    from test_audit_ddp_round21 import B, build, darts2_steps, data, per_sample_weights

    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    part = slice(rank * B, (rank + 1) * B)
    results = {}
    method = build("darts2")
    method.distribute()
    results["darts2"] = darts2_steps(method, part)
    dist.barrier()
    method = build("darts")
    (x, y), _ = data()[0]
    weights = {t: w[:, part] for t, w in per_sample_weights(method.network, 2 * B).items()}
    try:
        step = method.cost(x[part], y[part], weights)
        results["per_sample"] = {t: c.detach().clone() for t, c in step.costs.items()}
    except Exception as exc:
        results["per_sample"] = f"{type(exc).__name__}: {exc}"
    from nasdiag.record import Recorder, RecorderCallback
    with RecorderCallback(f"{out}.shared.h5") as callback:  # every rank the path, no meta: rank 0 writes the record
        callback.on_step_end(1, {"scalars/loss": torch.tensor(float(rank + 1), dtype=torch.float64)})
    recorder = Recorder(f"{out}.own{rank}.h5")  # misuse: an open Recorder on every rank, each of its own path
    try:
        callback = RecorderCallback(recorder)
        callback.on_step_end(1, {"scalars/loss": torch.tensor(float(rank), dtype=torch.float64)})
        callback.close()
        results["own_recorders"] = None
    except Exception as exc:
        results["own_recorders"] = (type(exc).__name__, str(exc))
    finally:
        recorder.close()
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each rank of one 2-rank launch saved (the worker above)."""
    tmp = tmp_path_factory.mktemp("ddp21")
    (tmp / "worker.py").write_text(WORKER)
    here, init = os.path.dirname(os.path.abspath(__file__)), f"tcp://127.0.0.1:{free_port()}"
    launch_ranks(tmp / "worker.py", lambda r: [r, init, here, tmp / "out.pt"], timeout=300)
    return [torch.load(tmp / f"out.pt.{r}", weights_only=False) for r in (0, 1)] + [tmp / "out.pt.shared.h5"]


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, equal_nan=True, msg=what)


def test_second_order_darts_on_two_ranks_equals_one_process_on_the_concatenated_batches(ranks):
    single = build("darts2")
    params, stats = darts2_steps(single)
    for rank in (0, 1):
        r_params, r_stats = ranks[rank]["darts2"]
        for n, p in params.items():
            _close(r_params[n], p, f"rank {rank}: parameter {n}")
        for step, (want, got) in enumerate(zip(stats, r_stats)):
            for k in ("arch/normal/params", "arch/reduce/params", "scalars/alpha_grad_norm", "scalars/implicit_grad_norm",
                      "scalars/fd_eps", "scalars/w_lr"):
                _close(got[k], want[k], f"rank {rank} step {step}: {k}")
    for step, want in enumerate(stats):
        for k in ("scalars/val_loss", "scalars/unrolled_train_loss", "scalars/train_loss"):
            _close((ranks[0]["darts2"][1][step][k] + ranks[1]["darts2"][1][step][k]) / 2, want[k], f"step {step}: {k}")
    start = dict(build("darts2").network.named_parameters())
    moved = [n for n, p in params.items() if not torch.equal(p, start[n])]
    assert any("alpha" in n for n in moved) and any("alpha" not in n for n in moved), moved  # not vacuous

def test_per_sample_mixing_weights_cost_is_the_global_mean_loss_cost_of_this_ranks_samples(ranks):
    method = build("darts")
    net = method.network
    (x, y), _ = data()[0]
    weights = per_sample_weights(net, 2 * B)
    leaves = [weights[c.cell_type].clone().requires_grad_(True) for c in net.cells]
    loss = torch.nn.functional.cross_entropy(net(x, leaves), y)
    grads = torch.autograd.grad(loss, leaves)
    want = {}
    for cell, g in zip(net.cells, grads):
        want[cell.cell_type] = want[cell.cell_type] + g if cell.cell_type in want else g
    for rank in (0, 1):
        got = ranks[rank]["per_sample"]
        assert isinstance(got, dict), got
        for t, c in want.items():
            _close(got[t], c[:, rank * B:(rank + 1) * B], f"rank {rank}: per-sample cost of {t}")


def test_an_open_recorder_on_a_rank_other_than_0_is_one_line_on_every_rank_not_a_second_record(ranks, tmp_path):
    """The callback's contract: an open `Recorder` target "must live on rank 0 only". Given one on every rank (each of
    its own path), rank 1 wrote a second record of the reduced rows, the one record of a run being rank 0's."""
    for rank in (0, 1):
        got = ranks[rank]["own_recorders"]
        assert got is not None and got[0] == "RecordError", got
        assert "rank 1" in got[1] and "\n" not in got[1] and "None" in got[1], got[1]


def test_the_record_of_a_ddp_recorder_callback_says_its_world_size(ranks):
    """Rank 0's record of rows reduced over 2 ranks held no world size (the meta given was None): ``nasdiag report``
    read it as world size 1. The runner writes its own ``world_size``; a loop of one's own now has it too."""
    from nasdiag.record import load, load_meta

    path = ranks[2]
    assert load_meta(path).get("world_size") == 2
    assert load(path)["scalars/loss"].tolist() == [1.5]  # the rank mean of 1 and 2, written once
