"""Audit round 3 of data parallelism: 2 gloo ranks on CPU against references built here, float64.

One launch (``ddp``, module fixture) runs every distributed part on both ranks; the tests compare what they
saved with references computed in this process:

* the reduction itself: a NaN on one rank stays NaN under ``min``/``max``/``same`` (gloo's MIN/MAX returned the
  other rank's number, and ``same`` passed), and pooled variances of data far from 0 equal numpy's;
* the statistics of DARTS steps on a BatchNorm supernet (each rank 4 samples of every batch). The batch
  convention (`nasdiag.distributed`): one cost observation per rank, step and cell, C = ∂L_r/∂Z of rank r's
  mean loss on its own batch; ``cost/<cell>/{mean,var,count}`` are numpy's mean, variance (ddof 0) and count
  over all of them, here recomputed by autograd at the saved parameters of every step. ``hessian/<cell>/diag``
  is the mean over ranks of each rank's value on its own last batch: in ``exact`` mode a double-backward
  diagonal built here; architecture parameters and weights are bitwise the same on both ranks after every step
  (DARTS and ProxylessNAS);
* a NaN loss on one rank only stops both ranks at the same step with the NaN row (it stopped one rank, whose
  peer went on into its next collective); a diverged ``run()`` records its rows and the flagged NaN row (it
  recorded nothing under DDP);
* a ``run()`` interrupted inside epoch 2 and resumed equals the uninterrupted run bitwise, and the record
  refuses a resume with another world size;
* a rank that dies during a step: the other rank's ``nasdiag search`` ends with one error line and exit code 2
  (gloo's traceback before).

The launcher's misuse (WORLD_SIZE/RANK/LOCAL_RANK/MASTER_*, CUDA asked on a CPU-only machine) is checked in
this process: one line, exit code 2, no file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import textwrap

import numpy as np
import pytest
import torch

from conftest import free_port, launch_ranks
from test_run import _InterruptAt

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

B = 4  # per rank
STEPS = 3
RUN = dict(C=2, layers=3, steps=1, batch_size=128, device="cpu", dtype="float64", progress=False, threads=1,
           diagnostics=("cost",))
DIGITS_STEPS = 719 // 2 // 128  # steps per epoch of RUN under 2 ranks


# -- shared by the ranks and the references -------------------------------------------------------------------
def _net(norm: str = "batch", primitives=None):
    from nasdiag.supernet import Network

    torch.manual_seed(0)
    return Network(2, 5, 3, steps=1, multiplier=1, in_channels=1, norm=norm,
                   **({"primitives": primitives} if primitives else {})).double()


def _batches(nan_at: int | None = None):
    """STEPS pairs (train, val) of 2B samples; rank r takes samples r·B .. (r+1)·B. ``nan_at``: step whose train
    batch holds a NaN in rank 1's half only."""
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(STEPS):
        pair = [(torch.randn(2 * B, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (2 * B,), generator=g))
                for _ in range(2)]
        if step == nan_at:
            pair[0][0][B + 1, 0, 3, 3] = float("nan")
        out.append(pair)
    return out


def _half(batch, rank):
    x, y = batch
    return x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]


def _method(name: str, norm: str = "batch", hessian_mode=None):
    from nasdiag.search import Schedule, get_method

    cls = get_method(name)
    return cls(_net(norm, getattr(cls, "primitives", None)), schedule=Schedule(epochs=2, steps_per_epoch=STEPS, batch_size=B,
                                                                               world_size=2),
               hessian_mode=hessian_mode, seed=0)


# -- the parts each rank runs ---------------------------------------------------------------------------------
NAN_SAMPLES = {0: np.array([1.0, np.nan, 2.0, 3.0]), 1: np.array([1.0, 1.0, np.nan, 3.0])}


def _offset_samples(rank: int) -> np.ndarray:
    return 1e6 + 1e-2 * np.random.default_rng(rank).standard_normal((3 + 2 * rank, 2))


def reduce_part(rank: int) -> dict:
    from nasdiag.distributed import reduce_statistics

    v = NAN_SAMPLES[rank]
    nan = reduce_statistics({"bayes/normal/gamma": v, "x/lo": v, "x/hi": v}, rules={"x/lo": "min", "x/hi": "max"})
    x = _offset_samples(rank)
    pooled = {ddof: reduce_statistics({"cost/normal/mean": x.mean(0), "cost/normal/var": x.var(0, ddof=ddof),
                                       "cost/normal/count": np.int64(len(x))}, ddof=ddof) for ddof in (0, 1)}
    return {"nan": nan, "pooled": pooled}


def steps_part(rank: int) -> dict:
    """DARTS (exact curvature) and ProxylessNAS, STEPS data-parallel steps each on a BatchNorm supernet."""
    from nasdiag.distributed import reduce_statistics

    out = {}
    for name in ("darts", "proxyless"):
        method = _method(name, hessian_mode="exact" if name == "darts" else None)
        method.distribute()
        states, alphas = [], []
        start = {t: a.detach().clone() for t, a in method.network.alphas().items()}
        for train, val in _batches():
            states.append({k: v.clone() for k, v in method.network.state_dict().items()})
            method.step(_half(train, rank), _half(val, rank))
            alphas.append({t: a.detach().clone() for t, a in method.network.alphas().items()})
        weights = {n: p.detach().clone() for n, p in method.network.named_parameters()}
        out[name] = {"states": states, "start": start, "alphas": alphas, "weights": weights}
        if name == "darts":
            out[name]["diagnostics"] = reduce_statistics(method.diagnostics())
            out[name]["final"] = {k: v.clone() for k, v in method.network.state_dict().items()}
            method.hessian_mode = None  # the top α-Hessian eigenvalues alone, as the run's --spectrum-every asks them
            out[name]["eigen"] = reduce_statistics(method.curvature(*_half(_batches()[-1][1], rank), top_eigenvalue=True))
    return out


def nan_part(rank: int) -> dict:
    """SNAS steps where rank 1's second training batch holds a NaN: both ranks must stop there, with the row."""
    from nasdiag.search import SearchError

    method = _method("snas", norm="layer")
    method.distribute()
    for step, (train, val) in enumerate(_batches(nan_at=1)):
        try:
            method.step(_half(train, rank), _half(val, rank))
        except SearchError as err:
            return {"stopped_at": step, "nonfinite_loss": float(err.statistics["scalars/nonfinite_loss"])}
    return {"stopped_at": None}


def diverged_part(rank: int, out: str) -> dict:
    from nasdiag.search import SearchConfig, SearchError, run

    try:
        run(SearchConfig(method="snas", hp={"w_lr": 1e300}, epochs=2, record=f"{out}/diverged.h5", **RUN))
    except SearchError as err:
        return {"error": str(err)}
    return {"error": None}


def resume_part(rank: int, out: str) -> dict:
    from nasdiag.search import SearchConfig, run

    def params(result):
        return {n: p.detach().clone() for n, p in result.method.network.named_parameters()}

    whole = run(SearchConfig(method="darts", epochs=2, record=f"{out}/whole.h5", **RUN))
    with contextlib.suppress(KeyboardInterrupt):
        run(SearchConfig(method="darts", epochs=2, record=f"{out}/cut.h5", **RUN), callbacks=[_InterruptAt(DIGITS_STEPS + 1)])
    resumed = run(SearchConfig(method="darts", epochs=2, record=f"{out}/cut.h5", resume=True, **RUN))
    return {"whole": params(whole), "resumed": params(resumed), "pid": os.getpid()}


def die_part(rank: int, out: str) -> None:
    """Both ranks run ``nasdiag search``; rank 1 leaves (exit status 0, for the launcher) inside its second step."""
    from nasdiag.cli import main

    if rank == 1:
        from nasdiag.search.methods.darts import DARTS

        original, calls = DARTS.step, []

        def dying(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os._exit(0)
            return original(self, *args, **kwargs)

        DARTS.step = dying
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["search", "--epochs", "1", "--out", f"{out}/died.h5", "--C", "2", "--layers", "3", "--steps", "1",
                   "--batch-size", "128", "--device", "cpu", "--no-progress", "--no-figs", "--threads", "1",
                   "--diagnostics", "cost"])
    with open(f"{out}/died.json", "w") as f:
        json.dump({"rc": rc, "stderr": err.getvalue()}, f)


WORKER = textwrap.dedent(
    """
    import datetime, os, sys
    import torch, torch.distributed as dist
    rank, port, tests, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    sys.path.insert(0, tests)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    import test_audit_ddp_round3 as t
    results = {"reduce": t.reduce_part(rank), "steps": t.steps_part(rank), "nan": t.nan_part(rank),
               "diverged": t.diverged_part(rank, out), "resume": t.resume_part(rank, out)}
    torch.save(results, f"{out}/rank{rank}.pt")
    t.die_part(rank, out)
    """
)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_audit")
    script = out / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    launch_ranks(script, lambda r: [r, port, os.path.dirname(os.path.abspath(__file__)), out], timeout=420)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


# -- references -----------------------------------------------------------------------------------------------
def _loaded(state, norm="batch"):
    net = _net(norm)
    net.load_state_dict(state)
    if hasattr(net, "set_engine"):
        net.set_engine("eager")
    return net


def _per_cell_costs(net, x, y):
    """{cell type: (cells of the type, E, K)}: C = ∂L/∂Z_k per cell k at Z = softmax(α), L the mean cross-entropy."""
    leaves = [torch.softmax(net.alphas()[c.cell_type].detach(), -1).clone().requires_grad_(True) for c in net.cells]
    loss = torch.nn.functional.cross_entropy(net(x, leaves), y)
    grads = torch.autograd.grad(loss, leaves)
    by_type: dict = {}
    for cell, g in zip(net.cells, grads):
        by_type.setdefault(cell.cell_type, []).append(g)
    return {t: torch.stack(g).numpy() for t, g in by_type.items()}


def _exact_diag(net, x, y):
    """{cell type: (E, K)} diagonal of ∂²L/∂Z² with Z = softmax(α) shared by the cells of the type (double backward)."""
    z = {t: torch.softmax(a.detach(), -1).clone().requires_grad_(True) for t, a in net.alphas().items()}
    loss = torch.nn.functional.cross_entropy(net(x, z), y)
    grads = torch.autograd.grad(loss, list(z.values()), create_graph=True)
    out = {}
    for (t, leaf), g in zip(z.items(), grads):
        diag = torch.zeros_like(leaf)
        for index in np.ndindex(*leaf.shape):
            diag[index] = torch.autograd.grad(g[index], leaf, retain_graph=True)[0][index]
        out[t] = diag.detach().numpy()
    return out


# -- the tests ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_nan_on_one_rank_stays_nan_and_pooled_variance_is_exact(ddp):
    _, ranks = ddp
    either = np.isnan(NAN_SAMPLES[0]) | np.isnan(NAN_SAMPLES[1])
    for rank in (0, 1):
        got = ranks[rank]["reduce"]
        for path in ("bayes/normal/gamma", "x/lo", "x/hi"):  # rule same, min, max
            np.testing.assert_array_equal(np.isnan(got["nan"][path]), either, err_msg=f"rank {rank}: {path}")
            np.testing.assert_array_equal(got["nan"][path][~either], NAN_SAMPLES[0][~either])
        everything = np.concatenate([_offset_samples(0), _offset_samples(1)])  # 3 + 5 samples near 1e6, sd 1e-2
        for ddof in (0, 1):
            pooled = got["pooled"][ddof]
            np.testing.assert_allclose(pooled["cost/normal/mean"], everything.mean(0), rtol=1e-15)
            np.testing.assert_allclose(pooled["cost/normal/var"], everything.var(0, ddof=ddof), rtol=1e-6)
            assert pooled["cost/normal/count"] == 8


def test_pooled_moments_of_parts_far_from_zero():
    """The merge of (count, mean, var) about the pooled mean: Σ n m² − N mean² lost the variance of data at 1e6 ± 1e-2."""
    from nasdiag.vocabulary import pooled_moments

    rng = np.random.default_rng(3)
    parts = [1e6 + 1e-2 * rng.standard_normal((n, 3)) for n in (2, 3, 6)]
    everything = np.concatenate(parts)
    for ddof in (0, 1):
        n, mean, var = pooled_moments(np.array([[len(p)] * 3 for p in parts], float), np.stack([p.mean(0) for p in parts]),
                                      np.stack([p.var(0, ddof=ddof) for p in parts]), ddof=ddof)
        np.testing.assert_allclose(mean, everything.mean(0), rtol=1e-15)
        np.testing.assert_allclose(var, everything.var(0, ddof=ddof), rtol=1e-6)


@pytest.mark.slow
def test_cost_statistics_pool_every_ranks_batch_costs(ddp):
    _, ranks = ddp
    got = ranks[0]["steps"]["darts"]["diagnostics"]
    observations: dict = {}
    for state, (_, val) in zip(ranks[0]["steps"]["darts"]["states"], _batches()):
        net = _loaded(state)
        for rank in (0, 1):
            for t, c in _per_cell_costs(net, *_half(val, rank)).items():
                observations.setdefault(t, []).append(c)
    for t, rows in observations.items():
        obs = np.concatenate(rows)  # (steps × ranks × cells, E, K)
        np.testing.assert_allclose(got[f"cost/{t}/mean"], obs.mean(0), rtol=1e-9, atol=1e-13, err_msg=t)
        np.testing.assert_allclose(got[f"cost/{t}/var"], obs.var(0), rtol=1e-8, atol=1e-16, err_msg=t)
        np.testing.assert_array_equal(got[f"cost/{t}/count"], np.full(obs.shape[1:], len(obs)))
    for rank in (0, 1):  # every rank gets the reduced statistics
        for k, v in got.items():
            np.testing.assert_array_equal(ranks[rank]["steps"]["darts"]["diagnostics"][k], v)


@pytest.mark.slow
def test_exact_hessian_diag_is_the_rank_mean_of_each_ranks_batch(ddp):
    _, ranks = ddp
    got = ranks[0]["steps"]["darts"]["diagnostics"]
    net = _loaded(ranks[0]["steps"]["darts"]["final"])
    _, val = _batches()[-1]
    per_rank = [_exact_diag(net, *_half(val, rank)) for rank in (0, 1)]
    for t in per_rank[0]:
        want = (per_rank[0][t] + per_rank[1][t]) / 2
        np.testing.assert_allclose(got[f"hessian/{t}/diag"], want, rtol=1e-8, atol=1e-12, err_msg=t)
        assert not got[f"hessian/{t}/nonfinite"]
        assert np.abs(want).max() > 1e-6  # not vacuous


def _dense_alpha_hessian(net, x, y):
    """(dim, dim) Hessian of the mean cross-entropy in (α_normal, α_reduce) flattened, Z = softmax(α), by double backward."""
    alphas = [a.detach().clone().requires_grad_(True) for a in net.alphas().values()]
    weights = {t: torch.softmax(a, -1) for t, a in zip(net.alphas(), alphas)}
    loss = torch.nn.functional.cross_entropy(net(x, weights), y)
    g = torch.cat([d.reshape(-1) for d in torch.autograd.grad(loss, alphas, create_graph=True)])
    rows = [torch.cat([d.reshape(-1) for d in torch.autograd.grad(g[i], alphas, retain_graph=True)]) for i in range(len(g))]
    return torch.stack(rows).detach().numpy()


@pytest.mark.slow
def test_top_eigenvalue_is_the_global_batchs_not_a_rank_mean(ddp):
    """--spectrum-every under DDP: λ_max of the rank-mean α-Hessian (the global batch's where samples decouple), per cell
    type and joint; the rank mean of the ranks' λ_max (recorded before) is an upper bound of it, 20-25% above here."""
    _, ranks = ddp
    got = ranks[0]["steps"]["darts"]["eigen"]
    net = _loaded(ranks[0]["steps"]["darts"]["final"])
    _, val = _batches()[-1]
    per_rank = [_dense_alpha_hessian(net, *_half(val, rank)) for rank in (0, 1)]
    H = (per_rank[0] + per_rank[1]) / 2
    n = net.alphas()["normal"].numel()
    blocks = {"hessian/normal/top_eigenvalue": H[:n, :n], "hessian/reduce/top_eigenvalue": H[n:, n:], "hessian/top_eigenvalue": H}
    for path, block in blocks.items():
        want = np.linalg.eigvalsh(block).max()
        rank_mean = np.mean([np.linalg.eigvalsh(p[:n, :n] if "normal" in path else p[n:, n:] if "reduce" in path else p).max()
                             for p in per_rank])
        assert abs(rank_mean - want) > 1e-3 * abs(want)  # the two conventions differ on this batch
        np.testing.assert_allclose(got[path], want, rtol=1e-7, err_msg=path)
    assert not got["hessian/normal/nonfinite"] and not got["hessian/reduce/nonfinite"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["darts", "proxyless"])
def test_architecture_and_weights_identical_on_every_rank_after_every_step(ddp, name):
    _, ranks = ddp
    a, b = ranks[0]["steps"][name], ranks[1]["steps"][name]
    for step, (pa, pb) in enumerate(zip(a["alphas"], b["alphas"])):
        for t in pa:
            assert torch.equal(pa[t], pb[t]), f"{name}: α of {t} differs between the ranks after step {step + 1}"
    for n, p in a["weights"].items():
        assert torch.equal(p, b["weights"][n]), f"{name}: {n} differs between the ranks"
    assert any(not torch.equal(a["alphas"][-1][t], a["start"][t]) for t in a["start"])  # the steps moved α


@pytest.mark.slow
def test_nan_on_one_rank_stops_every_rank_at_that_step(ddp):
    _, ranks = ddp
    for rank in (0, 1):
        assert ranks[rank]["nan"] == {"stopped_at": 1, "nonfinite_loss": 1.0}, rank


@pytest.mark.slow
def test_diverged_run_records_its_rows_and_the_nan_row(ddp):
    from nasdiag.record import load

    out, ranks = ddp
    for rank in (0, 1):
        assert "not finite" in ranks[rank]["diverged"]["error"]
    rec = load(out / "diverged.h5")
    steps = rec["step"]
    assert len(steps) >= 2 and steps.tolist() == list(range(1, len(steps) + 1))
    assert rec["scalars/nonfinite_loss"][-1] == 1 and np.isnan(rec["scalars/train_loss"][-1])
    assert np.isfinite(rec["scalars/train_loss"][:-1]).all()


@pytest.mark.slow
def test_resumed_ddp_run_equals_the_uninterrupted_one(ddp):
    import h5py

    from nasdiag.record import load

    out, ranks = ddp
    for rank in (0, 1):
        got = ranks[rank]["resume"]
        for n, p in got["whole"].items():
            assert torch.equal(got["resumed"][n], p), f"rank {rank}: {n}"
    whole, cut = load(out / "whole.h5"), load(out / "cut.h5")
    assert cut["step"].tolist() == list(range(1, 2 * DIGITS_STEPS + 1))
    for k, v in whole.items():
        if not k.startswith("meta/"):
            np.testing.assert_array_equal(cut[k], v, err_msg=k)
    for f in out.glob("cut*.h5"):  # only rank 0 wrote
        with h5py.File(f, "r") as h5:
            assert h5.attrs["pid"] == ranks[0]["resume"]["pid"]


@pytest.mark.slow
def test_resume_with_another_world_size_is_refused(ddp, monkeypatch):
    from nasdiag.errors import ConfigError
    from nasdiag.search import SearchConfig, run

    out, _ = ddp
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    digest = hashlib.sha256((out / "cut.h5").read_bytes()).hexdigest()
    with pytest.raises(ConfigError, match=r"world_size=1 \(recorded 2\)"):
        run(SearchConfig(method="darts", epochs=3, record=str(out / "cut.h5"), resume=True, **RUN))
    assert hashlib.sha256((out / "cut.h5").read_bytes()).hexdigest() == digest


@pytest.mark.slow
def test_a_rank_that_dies_stops_the_other_with_one_line(ddp):
    out, _ = ddp
    died = json.loads((out / "died.json").read_text())
    errors = [line for line in died["stderr"].splitlines() if not line.startswith("nasdiag: warning:")]
    assert died["rc"] == 2, died["stderr"]
    assert len(errors) == 1 and errors[0].startswith("nasdiag: error: rank 0 of 2 stops"), died["stderr"]
    assert "lost another rank" in errors[0]
    # the record resumes only with its world size: the command given is the torchrun launch, not one process
    assert errors[0].endswith("--resume") and ": torchrun --nproc_per_node=2 -m nasdiag search --epochs 1" in errors[0]


def test_resume_command_of_a_ddp_run_is_its_torchrun_launch(monkeypatch):
    from nasdiag.cli import _resume_command

    argv = ["search", "--out", "r.h5", "--force"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _resume_command(argv) == "nasdiag search --out r.h5 --resume"
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _resume_command(argv).startswith("torchrun --nnodes=2 ")
    assert _resume_command(argv).endswith("--nproc_per_node=4 -m nasdiag search --out r.h5 --resume")


# -- the launcher's misuse, in this process -------------------------------------------------------------------
LAUNCH = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, said", [
    ({"WORLD_SIZE": "0", "RANK": "", "LOCAL_RANK": "", "MASTER_ADDR": "", "MASTER_PORT": ""}, "WORLD_SIZE=0"),
    ({**LAUNCH, "MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a TCP port"),
    ({**LAUNCH, "MASTER_PORT": "0"}, "MASTER_PORT=0 is not a TCP port"),
    ({**LAUNCH, "MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR='no-such-host.invalid'"),
    ({**LAUNCH, "RANK": "1", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2"),
    ({**LAUNCH, "LOCAL_RANK": "2"}, "LOCAL_RANK=2"),
])
def test_launch_variables_that_cannot_work_are_one_line(tmp_path, monkeypatch, capsys, env, said):
    from nasdiag.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "x.h5"
    assert main(["search", "--out", str(out), "--device", "cpu", "--no-progress", "--no-figs"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("gpus, said", [(0, "CUDA is not available"), (1, "LOCAL_RANK=1 but this machine has 1 CUDA device")])
def test_cuda_ranks_the_machine_cannot_hold_are_one_line(tmp_path, monkeypatch, capsys, gpus, said):
    """--device cuda (NCCL) on a CPU-only machine, and more ranks per host than GPUs."""
    from nasdiag.cli import main

    for name, value in {**LAUNCH, "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert main(["search", "--out", str(tmp_path / "x.h5"), "--device", "cuda", "--no-progress", "--no-figs"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
    assert list(tmp_path.iterdir()) == []
