"""Audit round 6 of data parallelism: searches launched as a user launches them, 2 gloo ranks on CPU, float64.

Beyond rounds 3 and 5 (test_audit_ddp_round3.py: the reduction, one DARTS/ProxylessNAS step at a time, a resume
interrupted in-process, a rank leaving with exit status 0):

* ``torchrun --standalone --nproc_per_node=2 -m nasdiag search``: one record, rank 0's; ``kill -9`` of one rank and
  of every rank inside epoch 2, then ``--resume`` under the same launch: every step recorded once, every row and the
  checkpointed method state bitwise the uninterrupted launch's; ``--resume`` under 1 or 3 processes refused naming
  ``world_size``, no file touched; the default torch threads of each rank are the usable CPUs divided among the
  launch's processes (at most 4);
* a rank raising an exception inside a step of a launch without torchrun (nobody kills the survivor): the other rank
  ends in bounded time with one error line and exit code 2;
* ``run()`` from ``torch.multiprocessing.spawn`` ranks with a process group of their own: on a LayerNorm supernet
  (samples decouple) 2 ranks × B samples equal one process × 2B samples on the same global batches (every step's
  scalars, α, the rank-averaged cost mean, the ``exact`` Hessian diagonal; weights after every epoch), counts are
  ranks × steps × cells, and every rank's parameters and method state are bitwise the same after every epoch. For
  ASM-NAS this failed: each rank kept the batch-mean attention of its own batch as its architecture, so the first
  epoch end raised ReductionError ('arch/normal/probabilities' differs across ranks) and no DDP ASM-NAS run could
  record anything.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import free_port

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

EPOCHS = 2
SEARCH = ["search", "--epochs", str(EPOCHS), "--C", "2", "--layers", "3", "--steps", "1", "--batch-size", "64",
          "--device", "cpu", "--dtype", "float64", "--no-progress", "--no-figs", "--diagnostics", "cost"]

# DARTS.step of the ranks in DIE_RANKS (comma-separated) kills its process (DIE_HOW=kill: SIGKILL, as kill -9) or
# raises (DIE_HOW=raise) at its DIE_AT-th call; every rank prints its torch thread count once the run is set up.
WRAPPER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import nasdiag.search.runner as runner
    from nasdiag.cli import main
    from nasdiag.search.methods.darts import DARTS

    rank, at = int(os.environ["RANK"]), int(os.environ.get("DIE_AT", "0"))
    if at and str(rank) in os.environ.get("DIE_RANKS", "").split(","):
        original, calls = DARTS.step, []

        def step(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == at:
                if os.environ.get("DIE_HOW", "kill") == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError(f"injected failure on rank {rank}")
            return original(self, *args, **kwargs)

        DARTS.step = step
    if os.environ.get("FIGURES_PROBE"):  # what the ranks hold while rank 0 draws the figures (none drawn here)
        import nasdiag.plot

        def write_figures(record, out, *args, **kwargs):
            print(f"figures drawn inside the process group: {torch.distributed.is_initialized()}", flush=True)
            return []

        nasdiag.plot.write_figures = write_figures
    inner = runner._run

    def spying(*args, **kwargs):
        # one write(2) of the whole line: two ranks' print() calls interleaved text and newline
        os.write(1, f"threads of rank {rank}: {torch.get_num_threads()}\\n".encode())
        return inner(*args, **kwargs)

    runner._run = spying
    sys.exit(main(sys.argv[1:]))
    """
)


def _env(**extra) -> dict:
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                               "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
    return {**env, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), env.get("PYTHONPATH", "")]), **extra}


def _torchrun(folder, nproc: int, *args, timeout: float = 150, drop=(), **env) -> subprocess.CompletedProcess:
    launcher = [shutil.which("torchrun")] if shutil.which("torchrun") else [sys.executable, "-m", "torch.distributed.run"]
    wrapper = folder / "wrapper.py"
    wrapper.write_text(WRAPPER)
    search = [a for a in SEARCH if a not in drop]
    return subprocess.run([*launcher, "--standalone", f"--nproc_per_node={nproc}", str(wrapper), *search, *args],
                          cwd=folder, env=_env(**env), capture_output=True, text=True, timeout=timeout)


TEARDOWN_ABORT = "terminate called without an active exception"


def _fresh_launch(folder, *args, **env) -> subprocess.CompletedProcess:
    """A launch into a folder holding only the wrapper, retried once from scratch when a rank aborted with gloo's
    teardown signature. With every rank leaving together (barrier, then destroy_process_group) that abort fell from
    2 in 6 launches to about 1 in 30 on the 2-core dev box (torch 2.13); it is torch's, after a complete run, and
    stays a known issue (closing note). Any other failure, and a second abort, fail the test."""
    done = _torchrun(folder, 2, *args, **env)
    if done.returncode != 0 and TEARDOWN_ABORT in done.stderr:
        for path in folder.iterdir():
            if path.name != "wrapper.py":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        done = _torchrun(folder, 2, *args, **env)
    return done


def _nasdiag_lines(stderr: str, kind: str = "error") -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"nasdiag: {kind}:")]


def _equal(a, b, where: str = "") -> list[str]:
    """Paths where two nested checkpoint payloads differ (tensors and arrays bitwise, NaN equal to NaN)."""
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in _equal(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _equal(x, y, f"{where}[{i}]")]
    if torch.is_tensor(a) or isinstance(a, np.ndarray):
        x, y = np.asarray(torch.as_tensor(a).cpu()), np.asarray(torch.as_tensor(b).cpu())
        same = x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind in "fc")
        return [] if same else [where]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def _rows(path) -> dict:
    from nasdiag.record import load

    return {k: np.asarray(v) for k, v in load(path).items() if not k.startswith("meta/")}


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted launch: its record, checkpoint and output."""
    folder = tmp_path_factory.mktemp("ddp6_torchrun")
    done = _fresh_launch(folder, "--out", "whole.h5")
    assert done.returncode == 0, done.stderr[-3000:]
    return folder, done


@pytest.mark.slow
def test_torchrun_launch_writes_one_record_with_threads_divided_among_the_ranks(whole):
    folder, done = whole
    files = sorted(p.name for p in folder.iterdir())  # a later segment of the record: a time-based flush, loaded host
    assert [f for f in files if not re.fullmatch(r"whole\.seg\d{4}\.h5", f)] == ["whole.h5", "whole.h5.ckpt", "wrapper.py"]
    assert _nasdiag_lines(done.stderr) == []
    steps = _rows(folder / "whole.h5")["step"]
    S = len(steps) // EPOCHS
    assert S >= 4 and steps.tolist() == list(range(1, EPOCHS * S + 1))
    # reference: the usable CPUs divided among the 2 processes of this host, at least 1, at most 4 (README)
    want = max(1, min(len(os.sched_getaffinity(0)) // 2, 4))
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("threads")) == [
        f"threads of rank {r}: {want}" for r in (0, 1)]


@pytest.mark.slow
def test_rank_0_draws_the_figures_after_every_rank_left_the_process_group(tmp_path):
    """Without --no-figs rank 0 drew the figures inside the process group while the other ranks left it and exited;
    a rank exiting so at times aborted ("terminate called without an active exception", SIGABRT, 2 of 6 launches
    here), and torchrun then killed rank 0 amid its figures: the plain README launch failed with the run complete."""
    done = _fresh_launch(tmp_path, "--out", "r.h5", "--figs", "figs", FIGURES_PROBE="1",
                     drop=("--no-figs",))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line for line in done.stdout.splitlines() if line.startswith("figures drawn")] == [
        "figures drawn inside the process group: False"]  # rank 0 only, once the group is gone


@pytest.mark.slow
@pytest.mark.parametrize("die_ranks", ["1", "0,1"])
def test_kill_9_of_ranks_under_torchrun_then_resume_equals_the_uninterrupted_launch(whole, die_ranks, tmp_path):
    folder, _ = whole
    reference = _rows(folder / "whole.h5")
    S = len(reference["step"]) // EPOCHS
    cut = _torchrun(tmp_path, 2, "--out", "cut.h5", DIE_RANKS=die_ranks, DIE_AT=str(S + 3))  # inside epoch 2
    assert cut.returncode != 0
    kept = _rows(tmp_path / "cut.h5")["step"]
    assert kept.tolist() == list(range(1, S + 1)), kept  # epoch 1, committed with its checkpoint
    resumed = _torchrun(tmp_path, 2, "--out", "cut.h5", "--resume")
    # gloo's teardown abort (see _fresh_launch; seen once here in .ci/run) comes after a complete run: the checks
    # below still hold the record and the checkpoint to the uninterrupted launch's, so the run is judged by them
    aborted_at_teardown = resumed.returncode != 0 and TEARDOWN_ABORT in resumed.stderr
    assert resumed.returncode == 0 or aborted_at_teardown, resumed.stderr[-3000:]
    assert _nasdiag_lines(resumed.stderr) == []
    rows = _rows(tmp_path / "cut.h5")
    assert rows["step"].tolist() == list(range(1, EPOCHS * S + 1))  # every step once
    assert sorted(rows) == sorted(reference)
    for k, v in reference.items():
        np.testing.assert_array_equal(rows[k], v, err_msg=k)
    a = torch.load(folder / "whole.h5.ckpt", weights_only=False)
    b = torch.load(tmp_path / "cut.h5.ckpt", weights_only=False)
    assert _equal(a["method"], b["method"]) == []
    assert (a["step"], a["epoch"], a["position"]) == (b["step"], b["epoch"], b["position"])
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 3])
def test_resume_under_another_world_size_is_refused_naming_it(whole, nproc, tmp_path):
    folder, _ = whole
    for path in [folder / "whole.h5", *sorted(folder.glob("whole.seg*.h5")), folder / "whole.h5.ckpt"]:  # every file
        shutil.copy(path, tmp_path / path.name)  # of the record: run.h5 alone is refused as missing its later segments
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    done = _torchrun(tmp_path, nproc, "--out", "whole.h5", "--resume", "--epochs", str(EPOCHS + 1))
    assert done.returncode != 0
    errors = _nasdiag_lines(done.stderr)
    assert len(errors) == nproc and len(set(errors)) == 1, done.stderr[-3000:]  # one line per process, the same
    assert f"world_size={nproc} (recorded 2)" in errors[0]
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir() if p.name != "wrapper.py"}
    assert after == before


@pytest.mark.slow
def test_a_rank_raising_ends_the_other_in_bounded_time_with_one_line(tmp_path):
    """Launched without torchrun, so no launcher kills the surviving rank: rank 1 raises inside its 3rd step, rank 0
    must not wait in its next collective for the 30-minute default timeout."""
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(wrapper), *SEARCH, "--out", "x.h5"], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_env(WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DIE_RANKS="1", DIE_AT="3",
                                       DIE_HOW="raise"))
             for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    (_, err0), (_, err1) = outputs
    assert procs[1].returncode != 0 and "injected failure on rank 1" in err1
    assert procs[0].returncode == 2, err0[-3000:]
    errors = _nasdiag_lines(err0)
    assert len(errors) == 1 and errors[0].startswith("nasdiag: error: rank 0 of 2 stops"), err0[-3000:]
    assert "Traceback" not in err0


# -- the Python API from torch.multiprocessing.spawn -------------------------------------------------------------
B = 64  # per rank; the single process takes 2B
RUNS = {
    "darts": dict(diagnostics=("cost", "hessian"), hessian_mode="exact"),
    "asmnas": dict(diagnostics=("cost",)),
}


def _config(name: str, batch_size: int, record: str):
    from nasdiag.search import SearchConfig

    return SearchConfig(method=name, norm="layer", dtype="float64", epochs=EPOCHS, C=2, layers=3, steps=1,
                        batch_size=batch_size, device="cpu", threads=1, progress=False, record=record, **RUNS[name])


def _flat_state(method) -> dict:
    """Parameters and the method's state (α, optimizer moments, ASM-NAS's attention means, ...), BatchNorm running
    statistics left out (each rank's own, documented in SearchMethod.distribute)."""
    from torch.utils._pytree import tree_flatten_with_path, keystr

    leaves, _ = tree_flatten_with_path(method.state_dict())
    out = {keystr(path): leaf for path, leaf in leaves
           if not any(s in keystr(path) for s in ("running_mean", "running_var", "num_batches_tracked"))}
    out.update({f"param {n}": p for n, p in method.network.named_parameters()})
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in out.items()}


def _search_with_snapshots(config) -> tuple[list[dict], object]:
    """run(config) and the flat state after every epoch."""
    import nasdiag.search.runner as runner
    from nasdiag.search import run

    seen, snapshots, inner = {}, [], runner.search_loop

    def spying(method, *args, **kwargs):
        seen["method"] = method
        return inner(method, *args, **kwargs)

    class Snapshot:
        def on_step_end(self, step, stats):
            pass

        def on_epoch_end(self, epoch, stats):
            snapshots.append(_flat_state(seen["method"]))

        def on_exception(self, exc):
            pass

    runner.search_loop = spying
    try:
        result = run(config, callbacks=[Snapshot()])
    finally:
        runner.search_loop = inner
    return snapshots, result


def spawned_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for name in RUNS:
            snapshots, _ = _search_with_snapshots(_config(name, B, f"{out}/{name}_ddp.h5"))
            torch.save(snapshots, f"{out}/{name}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ddp6_spawn")
    mp.spawn(spawned_rank, args=(free_port(), str(out)), nprocs=2, join=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_spawned_ranks_equal_one_process_on_the_concatenated_batches(spawned, name, monkeypatch):
    for variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    out = spawned
    # one record (rank 0's) and its checkpoint; a later segment is the record's own when a time-based flush (10 s, on a
    # loaded box) came before the epoch end's first paths (seen once in .ci/run)
    files = sorted(p.name for p in out.glob(f"{name}_ddp*"))
    assert files[:2] == [f"{name}_ddp.h5", f"{name}_ddp.h5.ckpt"], files
    assert all(re.fullmatch(rf"{name}_ddp\.seg\d{{4}}\.h5", f) for f in files[2:]), files
    per_rank = [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == EPOCHS
    for epoch, (a, b) in enumerate(zip(*per_rank)):  # every rank takes the same steps: bitwise equal states
        assert _equal(a, b) == [], f"{name}: ranks differ after epoch {epoch}"
    # the reference: one process, batches of 2B; rank r's batch i holds every 2nd sample of the same 2B (epoch_batches)
    single, result = _search_with_snapshots(_config(name, 2 * B, str(out / f"{name}_one.h5")))
    for epoch, (a, b) in enumerate(zip(per_rank[0], single)):
        for k, v in b.items():
            if torch.is_tensor(v) and v.is_floating_point():
                # float64, the same sums in another order: round-off of a few steps (seen: 1e-15)
                np.testing.assert_allclose(a[k].numpy(), v.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"{name} epoch {epoch}: {k}")
            elif torch.is_tensor(v):  # counts (ASM-NAS's selections over the whole validation set), switches, steps
                assert torch.equal(a[k], v), f"{name} epoch {epoch}: {k}"
    ddp, one = _rows(out / f"{name}_ddp.h5"), _rows(out / f"{name}_one.h5")
    assert ddp["step"].tolist() == one["step"].tolist()
    cells = {}
    for cell in result.method.network.cells:
        cells[cell.cell_type] = cells.get(cell.cell_type, 0) + 1
    steps_per_epoch = len(one["step"]) // EPOCHS
    checked = 0
    for k, v in one.items():
        if k.startswith("valid/"):
            continue
        if k.startswith("cost/") and k.endswith("/var"):
            continue  # one observation per rank's batch under DDP, per the whole batch here (documented)
        if k.startswith("cost/") and k.endswith("/count"):
            t = k.split("/")[1]
            got = ddp[k][ddp["valid/" + k].astype(bool)]  # the epoch ends' rows
            assert got.size and np.all(got == 2 * steps_per_epoch * cells[t]), (k, np.unique(got))  # ranks × steps × cells
            continue
        np.testing.assert_allclose(ddp[k].astype(float), v.astype(float), rtol=1e-9, atol=1e-12, err_msg=f"{name}: {k}")
        checked += 1
    assert checked >= 8
