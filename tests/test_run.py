"""`SearchConfig` and `run`: serialisation and the run-defining hash, the data order, the commit gate,
and an interrupted run resumed to the record and state of an uninterrupted one (in-process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nasdiag.errors import ConfigError
from nasdiag.record import load
from nasdiag.search import SearchConfig, run
from nasdiag.search.config import NORMS, ORDERS
from nasdiag.search.runner import Committed, epoch_batches

TINY = dict(C=4, layers=3, steps=2, batch_size=240, diagnostics=("cost",), progress=False, threads=1,
            device="cpu")  # bitwise comparisons: CUDA kernels differ run to run (docs/methods.md)


def test_config_round_trip_and_the_run_defining_hash():
    config = SearchConfig(method="darts", hp={"alpha_lr": 0.01}, epochs=3, record="r.h5", seed=2)
    assert SearchConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="unknown SearchConfig field"):
        SearchConfig.from_dict({**config.to_dict(), "bogus": 1})
    digest = config.config_hash()
    # session settings do not define the run ...
    for change in ({"epochs": 9}, {"record": "other.h5"}, {"progress": False}, {"threads": 2}, {"figures": "f"},
                   {"resume": True}):
        assert SearchConfig(**{**config.to_dict(), **change}).config_hash() == digest, change
    # ... these do
    for change in ({"seed": 3}, {"hp": {"alpha_lr": 0.02}}, {"batch_size": 32}, {"dtype": "float64"}, {"C": 6},
                   {"method": "snas"}, {"dataset": "synthetic"}):
        assert SearchConfig(**{**config.to_dict(), **change}).config_hash() != digest, change
    assert config.config_hash(world_size=2) != digest


def test_fixed_choices_agree_with_the_supernet():
    from nasdiag.supernet import ops

    assert ORDERS == tuple(ops.ORDERS)
    assert set(NORMS) == set(ops.NORM_KINDS)


def test_data_order_depends_only_on_seed_and_epoch_and_shards_disjointly():
    data = torch.utils.data.TensorDataset(torch.arange(50.0), torch.arange(50))
    order = lambda **kw: torch.cat([y for _, y in epoch_batches(data, 5, seed=3, epoch=1, **kw)])
    full = order()
    assert sorted(full.tolist()) == list(range(50)) and not torch.equal(full, torch.arange(50))
    assert torch.equal(order(), full)  # the same (seed, epoch): the same order
    assert not torch.equal(torch.cat([y for _, y in epoch_batches(data, 5, seed=3, epoch=2)]), full)
    assert torch.equal(order(start=4), full[20:])  # skipping batches inside an epoch
    shards = [order(rank=r, world_size=3) for r in range(3)]
    union = torch.cat(shards)
    assert len(union) == 3 * 15 and len(set(union.tolist())) == 45  # disjoint, full batches only


class _Log:
    def __init__(self):
        self.calls = []

    def on_step_end(self, step, stats):
        self.calls.append(("step", step))

    def on_epoch_end(self, epoch, stats):
        self.calls.append(("epoch", epoch))

    def on_exception(self, exc):
        self.calls.append(("exception",))


def test_commit_gate_skips_recorded_steps_and_keeps_epoch_ends_whole():
    log = _Log()
    gate = Committed(log, steps_per_epoch=3, after_step=4)
    for step in range(1, 7):
        gate.on_step_end(step, {})
        if step % 3 == 0:
            gate.on_epoch_end(step // 3 - 1, {})
    assert log.calls == [("step", 5), ("step", 6), ("epoch", 1)]
    log.calls.clear()
    gate.on_step_end(9, {})  # an epoch's last step, then an interruption before its epoch end
    gate.on_exception(KeyboardInterrupt())
    assert log.calls == [("exception",)]  # no row without its epoch statistics


class _InterruptAt:
    def __init__(self, step):
        self.step = step

    def on_step_end(self, step, stats):
        if step == self.step:
            raise KeyboardInterrupt

    def on_epoch_end(self, epoch, stats):
        pass

    def on_exception(self, exc):
        pass


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_uninterrupted_record_and_state(tmp_path):
    reference = run(SearchConfig(epochs=2, record=str(tmp_path / "ref.h5"), **TINY))
    out = str(tmp_path / "cut.h5")
    with pytest.raises(KeyboardInterrupt):
        run(SearchConfig(epochs=2, record=out, **TINY), callbacks=[_InterruptAt(3)])
    assert load(out)["step"].tolist() == [1, 2, 3]  # step 3 is recorded, the checkpoint is at step 2
    resumed = run(SearchConfig(epochs=2, record=out, resume=True, **TINY))
    a, b = load(out), load(reference.record)
    assert a["step"].tolist() == b["step"].tolist() == [1, 2, 3, 4]
    for key in sorted(set(b) - {"meta/config"}):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    for (name, p), q in zip(resumed.method.network.state_dict().items(), reference.method.network.state_dict().values()):
        assert torch.equal(p, q), name
    assert resumed.genotype == reference.genotype and resumed.evaluation == reference.evaluation


def test_a_failed_checkpoint_write_leaves_the_old_checkpoint_and_no_temporary_file(tmp_path, monkeypatch):
    import errno

    from nasdiag.search import checkpoint

    path = tmp_path / "run.h5.ckpt"
    checkpoint.save_checkpoint(path, {"step": 1})
    before = path.read_bytes()

    def full_disk(obj, fh):
        fh.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointError, match="disk full"):
        checkpoint.save_checkpoint(path, {"step": 2})
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["run.h5.ckpt"]
    monkeypatch.undo()
    assert checkpoint.load_checkpoint(path)["step"] == 1
    path.write_bytes(b"\x00garbage")
    with pytest.raises(checkpoint.CheckpointError, match="unreadable"):
        checkpoint.load_checkpoint(path)


def test_the_default_curvature_tells_the_ops_of_an_edge_apart(tmp_path):
    """The search records the mixing-weight curvature in a mode that gives the ops of an edge different values
    (docs/hessian.md, "The search's default is diag"): C.3.2 (`approx`) gave every op that ends in an affine-free
    BatchNorm one value per edge, so the heatmap could not say which op of an edge is most curved."""
    from nasdiag.supernet.ops import DARTS_PRIMITIVES as PRIMITIVES

    config = dict(TINY, diagnostics=("hessian",))
    rows = load(run(SearchConfig(epochs=1, record=str(tmp_path / "r.h5"), **config)).record)["hessian/normal/diag"][-1]
    ops = [k for k, name in enumerate(PRIMITIVES) if name not in ("none", "skip_connect")]  # those ending in BatchNorm
    spread = np.ptp(rows[:, ops], axis=1) / np.abs(rows[:, ops]).max(axis=1)
    assert (spread > 1e-3).all(), spread


def test_a_spectrum_interval_longer_than_the_run_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "r.h5"
    with pytest.raises(ConfigError, match=r"spectrum_every 100 is more than the run's 2 steps \(1 × 2 per epoch\)"):
        run(SearchConfig(epochs=1, record=str(out), spectrum_every=100, **dict(TINY, diagnostics=("hessian",))))
    assert not out.exists() and list(tmp_path.iterdir()) == []
    run(SearchConfig(epochs=1, record=str(out), spectrum_every=2, **dict(TINY, diagnostics=("hessian",))))
    assert np.isfinite(load(str(out))["hessian/normal/top_eigenvalue"][-1])  # recorded at step 2
