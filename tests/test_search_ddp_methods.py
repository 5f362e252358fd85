"""Data parallelism of BayesNAS, SparseNAS, ASM-NAS, SNAS, DSNAS and XNAS: a few steps on 2 gloo ranks (each on
half of every batch) equal the same steps in one process on the concatenated batches, float64.

The supernet uses LayerNorm (each sample normalised on its own), so the mean loss of the concatenated batch
is the mean of the ranks' mean losses and every quantity below must agree to rounding: the network weights,
the architecture parameters, and each method's own statistics — BayesNAS's curvature, C, ω, s, γ and
switches (two updates, one of them pruning); SparseNAS's A after its proximal steps, its non-zero pattern
and λ; ASM-NAS's attention (the ranks' batch means, averaged) and its selection counts; XNAS's forecaster
(log-weights, wipeouts, regret, bound, γ). SNAS and DSNAS sample: their one sample per step and edge is
shared by the batch and drawn from the method's own generator, seeded alike on every rank and in the single
process, so the ranks draw the same samples as the single process (checked: ``sample/<cell>/onehot``) and
everything downstream is comparable. The ranks' mean training losses average to the single-process loss.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from conftest import free_port, launch_ranks

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

B = 4  # per rank
STEPS = 4
METHODS = {
    # an update every 2 steps (w set small on some ops by `build`, so it prunes); w_lr 0.01: at 0.1 the 8 samples are
    # fitted to one-hot predictions within 2 steps and the second update would compare curvatures of exactly 0
    "bayesnas": {"update_every": 2, "w_lr": 0.01},
    "sparsenas": {},  # AdamHAPG on the second-order hypergradient (the defaults)
    "asmnas": {},
    "snas": {},
    "dsnas": {},
    "xnas": {},
}
# per-step statistics that must be equal on every rank and to the single process
SHARED = ("bayes/", "sparsity/", "arch/normal/params", "arch/reduce/params", "sample/", "regret/", "scalars/temperature")
# per-step statistics of the local batch: their mean over the ranks equals the single process's value
LOCAL = ("scalars/train_loss", "attention/normal/mean", "attention/reduce/mean")


def build(name: str):
    from nasdiag.search import Schedule, get_method
    from nasdiag.supernet import Network

    cls = get_method(name)
    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, norm="layer", affine=True,
                  **({"primitives": cls.primitives} if getattr(cls, "primitives", None) else {})).double()
    method = cls(net, cls.Hyperparameters(**METHODS[name]), schedule=Schedule(epochs=2, steps_per_epoch=STEPS,
                                                                              batch_size=B), seed=0)
    if name == "bayesnas":
        with torch.no_grad():  # as if the ℓ1 term had shrunk them: op 1 of every normal edge, all ops of reduce edge 0
            net.alphas()["normal"][:, 1] = 1e-4
            net.alphas()["reduce"][0] = 1e-4 * torch.arange(1, net.alphas()["reduce"].shape[1] + 1)
    return method


def data():
    g = torch.Generator().manual_seed(1)
    batch = lambda: (torch.randn(2 * B, 1, 8, 8, generator=g, dtype=torch.float64),  # noqa: E731
                     torch.randint(0, 5, (2 * B,), generator=g))
    return [(batch(), batch()) for _ in range(STEPS)]


def run_steps(method, part=slice(None)):
    """The steps on ``part`` of every batch; returns (parameters, per-step statistics, selection counts)."""
    stats = []
    for (xt, yt), (xv, yv) in data():
        out = method.step((xt[part], yt[part]), (xv[part], yv[part]))
        stats.append({k: v.detach().clone() for k, v in out.items() if k.startswith(SHARED + LOCAL)})
    extra = {}
    if method.name == "asmnas":  # the selection pass sees the whole validation set on every rank
        method.evaluate([v for _, v in data()])
        extra = {k: v.clone() for k, v in method.selection_counts.items()}
    return {n: p.detach().clone() for n, p in method.network.named_parameters()}, stats, extra


WORKER = textwrap.dedent(
    """
    import datetime, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[3])
    from test_search_ddp_methods import B, METHODS, build, run_steps

    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    results = {}
    for name in METHODS:
        method = build(name)
        method.distribute()
        results[name] = run_steps(method, slice(rank * B, (rank + 1) * B))
        dist.barrier()
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_methods")
    script = tmp / "worker.py"
    script.write_text(WORKER)
    out = tmp / "results.pt"
    init = f"tcp://127.0.0.1:{free_port()}"
    launch_ranks(script, lambda r: [r, init, os.path.dirname(os.path.abspath(__file__)), out], timeout=300)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1)]


def _close(a, b, what):
    if a.dtype == torch.bool or not a.is_floating_point():
        assert torch.equal(a, b), what
    else:
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, equal_nan=True, msg=what)


@pytest.mark.parametrize("name", list(METHODS))
def test_two_ranks_equal_one_process_on_the_whole_batch(name, distributed):
    single = build(name)
    params, stats, extra = run_steps(single)
    start = {n: p.detach() for n, p in build(name).network.named_parameters()}
    for rank in (0, 1):
        r_params, r_stats, r_extra = distributed[rank][name]
        for n, p in params.items():
            _close(r_params[n], p, f"{name} rank {rank}: parameter {n}")
        for step, (want, got) in enumerate(zip(stats, r_stats)):
            for k in want:
                if k.startswith(SHARED):
                    _close(got[k], want[k], f"{name} rank {rank} step {step}: {k}")
        for t, c in extra.items():
            _close(r_extra[t], c, f"{name} rank {rank}: selection counts {t}")
    for step, want in enumerate(stats):
        for k in want:
            if k.startswith(LOCAL):
                mean = (distributed[0][name][1][step][k] + distributed[1][name][1][step][k]) / 2
                _close(mean, want[k], f"{name} step {step}: rank mean of {k}")
    # not vacuous: the steps moved the weights (and the architecture, where the method has one)
    moved = [n for n, p in params.items() if not torch.equal(p, start[n])]
    assert any("alphas" not in n for n in moved)
    if name not in ("asmnas", "xnas"):  # ASM-NAS has no α; XNAS keeps its weights in the forecaster
        assert any("alphas" in n for n in moved)
    if name == "xnas":
        assert not torch.equal(stats[-1]["regret/normal/log_weights"], stats[0]["regret/normal/log_weights"])
    if name == "bayesnas":
        last = stats[-1]
        assert not last["bayes/normal/switch"][:, 1].any(), "the small ops were not pruned"
        assert not last["bayes/reduce/switch"][0].any(), "reduce edge 0 (every w small) was not removed"
        assert (last["bayes/normal/curvature"] > 0).any()
