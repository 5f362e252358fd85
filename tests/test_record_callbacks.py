"""RecorderCallback hooks in a plain loop, and the Lightning adapter against a stand-in Lightning
module (Lightning is not a dependency and not installed)."""

from __future__ import annotations

import sys
import types
import warnings

import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder, RecorderCallback, RecordWarning, lightning_callback, load


def _step_stats(step):
    return {"scalars/train_loss": 1.0 / step, "arch/normal/weights": np.full((2, 3), step, np.float32)}


def test_loop_rows_per_step_with_epoch_stats_on_last_step(tmp_path):
    """The search loop's pattern: the last step of an epoch carries the epoch's numbers, and
    on_epoch_end receives them again; they must land once, in that step's row."""
    path = tmp_path / "run.h5"
    steps_per_epoch, epochs = 3, 2
    with RecorderCallback(path, meta={"method": "darts"}, flush_every=2, flush_seconds=None) as cb:
        for epoch in range(epochs):
            for i in range(steps_per_epoch):
                step = epoch * steps_per_epoch + i + 1
                stats = _step_stats(step)
                if i == steps_per_epoch - 1:
                    epoch_stats = {"scalars/epoch": np.float32(epoch), "scalars/search_val_acc": 0.5 + epoch}
                    stats.update(epoch_stats)
                cb.on_step_end(step, stats)
            cb.on_epoch_end(epoch, epoch_stats)
    out = load(path)
    np.testing.assert_array_equal(out["step"], range(1, 7))
    np.testing.assert_array_equal(out["scalars/train_loss"], [1.0 / s for s in range(1, 7)])
    np.testing.assert_array_equal(out["valid/scalars/search_val_acc"], [False, False, True] * 2)
    np.testing.assert_array_equal(out["scalars/search_val_acc"][[2, 5]], [0.5, 1.5])
    np.testing.assert_array_equal(out["scalars/epoch"][[2, 5]], [0, 1])
    assert out["scalars/epoch"].dtype == np.float32


def test_epoch_only_stats_join_last_step_row_and_epoch_is_added(tmp_path):
    path = tmp_path / "run.h5"
    with RecorderCallback(path, flush_seconds=None) as cb:
        cb.on_step_end(10, {"scalars/loss": 1.0})
        cb.on_step_end(11, {"scalars/loss": 2.0})
        cb.on_epoch_end(0, {"scalars/val_loss": 3.0})
        cb.on_epoch_end(1, {"scalars/val_loss": 4.0}, step=20)  # an epoch without steps: explicit row
    with RecorderCallback(tmp_path / "other.h5", flush_seconds=None) as fresh:
        with pytest.raises(RecordError, match="before any on_step_end"):
            fresh.on_epoch_end(0, {"scalars/val_loss": 5.0})
    out = load(path)
    np.testing.assert_array_equal(out["step"], [10, 11, 20])
    np.testing.assert_array_equal(out["scalars/val_loss"], [np.nan, 3.0, 4.0])
    np.testing.assert_array_equal(out["scalars/epoch"], [np.nan, 0.0, 1.0])


def test_same_step_twice_merges_into_one_row(tmp_path):
    path = tmp_path / "run.h5"
    with RecorderCallback(path, flush_seconds=None) as cb:
        cb.on_step_end(1, {"scalars/a": 1.0, "scalars/b": 1.0})
        cb.on_step_end(1, {"scalars/a": 2.0})  # gradient accumulation: later values win
        cb.on_step_end(2, {"scalars/a": 3.0})
    out = load(path)
    np.testing.assert_array_equal(out["step"], [1, 2])
    np.testing.assert_array_equal(out["scalars/a"], [2.0, 3.0])
    np.testing.assert_array_equal(out["scalars/b"], [1.0, np.nan])


def test_on_exception_writes_and_flushes_held_rows(tmp_path):
    path = tmp_path / "run.h5"
    cb = RecorderCallback(path, flush_every=64, flush_seconds=None)
    try:
        for step in range(1, 6):
            cb.on_step_end(step, _step_stats(step))
        cb.on_exception(RuntimeError("diverged"), {"scalars/diverged": True}, step=5)
        out = load(path)  # read live, while the recorder is still open
        np.testing.assert_array_equal(out["step"], range(1, 6))
        np.testing.assert_array_equal(out["valid/scalars/diverged"], [False] * 4 + [True])
        cb.on_step_end(6, _step_stats(6))  # a loop that recovers goes on recording
    finally:
        cb.close()
    np.testing.assert_array_equal(load(path)["step"], range(1, 7))


def test_recorder_flush_writes_the_held_row(tmp_path):
    path = tmp_path / "run.h5"
    recorder = Recorder(path, flush_every=64, flush_seconds=None)
    cb = RecorderCallback(recorder)
    cb.on_step_end(1, {"scalars/a": 1.0})
    cb.on_step_end(2, {"scalars/a": 2.0})
    recorder.flush()
    np.testing.assert_array_equal(load(path)["scalars/a"], [1.0, 2.0])  # live, before close
    cb.on_step_end(3, {"scalars/a": 3.0})
    cb.close()
    np.testing.assert_array_equal(load(path)["step"], [1, 2, 3])


def test_callback_accepts_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "run.h5"
    alpha = torch.randn(2, 3, requires_grad=True)
    with RecorderCallback(path, flush_seconds=None) as cb:
        cb.on_step_end(1, {"arch/normal/params": alpha, "scalars/loss": torch.tensor(0.5)})
    out = load(path)
    np.testing.assert_array_equal(out["arch/normal/params"][0], alpha.detach().numpy())


def test_targets_recorder_and_none(tmp_path):
    path = tmp_path / "run.h5"
    recorder = Recorder(path, flush_seconds=None)
    with RecorderCallback(recorder) as cb:
        assert cb.is_writer
        cb.on_step_end(1, {"scalars/a": 1.0})
    assert recorder.closed
    np.testing.assert_array_equal(load(path)["scalars/a"], [1.0])
    silent = RecorderCallback(None)
    assert not silent.is_writer
    silent.on_step_end(1, {"scalars/a": 1.0})
    silent.on_epoch_end(0)
    silent.close()
    with pytest.raises(RecordError, match="statistics must be a mapping"):
        silent.on_step_end(2, [1.0])
    with pytest.raises(RecordError, match="target"):
        RecorderCallback(3.5)


# --- Lightning adapter ---------------------------------------------------------------------------


class _FakeCallback:
    """Stand-in for lightning.pytorch.Callback: the adapter only needs a base class with hooks."""

    def setup(self, trainer, pl_module, stage=None):
        pass


@pytest.fixture
def fake_lightning(monkeypatch):
    lightning = types.ModuleType("lightning")
    pytorch = types.ModuleType("lightning.pytorch")
    pytorch.Callback = _FakeCallback
    lightning.pytorch = pytorch
    monkeypatch.setitem(sys.modules, "lightning", lightning)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", pytorch)
    return pytorch


class _Trainer:
    def __init__(self, rank):
        self.global_rank = rank
        self.global_step = 0
        self.current_epoch = 0


class _Module:
    def __init__(self):
        self.value = 0.0

    def nasdiag_statistics(self):
        return {"scalars/loss": self.value}


def _fit(callback, trainer, module, batches, epochs, accumulate=1):
    callback.setup(trainer, module, stage="fit")
    for epoch in range(epochs):
        trainer.current_epoch = epoch
        for batch_idx in range(batches):
            module.value = 100 * epoch + batch_idx
            if batch_idx % accumulate == accumulate - 1:
                trainer.global_step += 1
            callback.on_train_batch_end(trainer, module, None, None, batch_idx)
        callback.on_train_epoch_end(trainer, module)
    callback.teardown(trainer, module, stage="fit")


def test_lightning_adapter_records_on_rank_zero(tmp_path, fake_lightning):
    path = tmp_path / "run.h5"
    callback = lightning_callback(path, meta={"method": "darts"}, flush_every=4, flush_seconds=None)
    assert isinstance(callback, fake_lightning.Callback)
    _fit(callback, _Trainer(rank=0), _Module(), batches=4, epochs=2, accumulate=2)
    out = load(path)
    # A row per global step as seen at batch end; batches sharing it merge, the later value winning
    # (the first batch of epoch 1 still sees the global step of epoch 0's last batch).
    np.testing.assert_array_equal(out["step"], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(out["scalars/loss"], [0, 2, 100, 102, 103])
    np.testing.assert_array_equal(out["scalars/epoch"], [np.nan, np.nan, 0, np.nan, 1])
    assert callback.callback.recorder.closed

    other = tmp_path / "rank1.h5"
    callback = lightning_callback(other, flush_seconds=None)
    _fit(callback, _Trainer(rank=1), _Module(), batches=2, epochs=1)
    assert not callback.callback.is_writer
    assert not other.exists() and not (tmp_path / "rank1.h5.lock").exists()


def test_lightning_adapter_pickles_before_setup(tmp_path, fake_lightning):
    import pickle

    callback = lightning_callback(tmp_path / "run.h5", meta={"method": "darts"}, flush_every=4, flush_seconds=None)
    clone = pickle.loads(pickle.dumps(callback))  # as ddp_spawn does with a trainer's callbacks
    assert isinstance(clone, fake_lightning.Callback)
    _fit(clone, _Trainer(rank=0), _Module(), batches=2, epochs=1)
    np.testing.assert_array_equal(load(tmp_path / "run.h5")["scalars/loss"], [0, 1])


def test_lightning_adapter_statistics_sources(tmp_path, fake_lightning):
    path = tmp_path / "run.h5"
    callback = lightning_callback(path, statistics=lambda trainer, module, outputs: outputs["stats"], flush_seconds=None)
    trainer = _Trainer(rank=0)
    callback.setup(trainer, object())
    trainer.global_step = 1
    callback.on_train_batch_end(trainer, object(), {"stats": {"scalars/x": 2.5}}, None, 0)
    callback.on_exception(trainer, object(), RuntimeError("boom"))
    np.testing.assert_array_equal(load(path)["scalars/x"], [2.5])
    callback = lightning_callback(tmp_path / "two.h5", flush_seconds=None)
    callback.setup(trainer, object())
    callback.on_train_batch_end(trainer, object(), {"nasdiag": {"scalars/y": 1.0}}, None, 0)
    with pytest.raises(RecordError, match="nasdiag_statistics"):
        callback.on_train_batch_end(trainer, object(), None, None, 1)
    callback.teardown(trainer, object())
    np.testing.assert_array_equal(load(tmp_path / "two.h5")["scalars/y"], [1.0])


def test_lightning_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    with pytest.raises(RecordError, match="pip install lightning"):
        lightning_callback(tmp_path / "run.h5")
    assert not (tmp_path / "run.h5").exists()


# --- batching, device tensors, public recorder hooks ----------------------------------------------

_HOST = {"cpu", "item", "numpy", "tolist", "__float__", "__int__", "__bool__", "__index__", "__array__", "to"}


def _counting_tensor_class():
    torch = pytest.importorskip("torch")

    class Counting(torch.Tensor):
        """Records every host conversion (what would synchronise a GPU) made on it."""

        host_calls: list = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in _HOST:
                cls.host_calls.append(name)
            return super().__torch_function__(func, types, args, kwargs or {})

    return torch, Counting


def test_steps_keep_tensors_on_device_and_a_flush_converts_each_path_once(tmp_path):
    torch, Counting = _counting_tensor_class()
    path = tmp_path / "run.h5"
    alpha = torch.zeros(2, 3, requires_grad=True)
    expected = []
    with RecorderCallback(path, flush_every=64, flush_seconds=None) as cb:
        for step in range(1, 11):
            with torch.no_grad():
                alpha += 1.0  # in place, as an optimizer does: the row must keep the value at its step
            loss = torch.tensor(1.0 / step).as_subclass(Counting)
            cb.on_step_end(step, {"arch/normal/params": alpha.as_subclass(Counting), "scalars/loss": loss})
            expected.append(alpha.detach().clone())
        assert Counting.host_calls == [], Counting.host_calls  # nothing left the device per step
        assert cb.rows_held == 10 and cb.recorder.rows_buffered == 0
        cb.on_epoch_end(0, {"scalars/val": torch.tensor(0.5).as_subclass(Counting)})  # settles the batch
        conversions = Counting.host_calls.count("cpu")
        assert 1 <= conversions <= 3, Counting.host_calls  # one per path for the whole batch, not per step
        cb.recorder.flush()  # what a checkpoint at the epoch boundary does: commits every row, the open one too
        assert cb.recorder.last_committed_step == 10 and cb.rows_held == 0
    out = load(path)
    np.testing.assert_array_equal(out["step"], range(1, 11))
    np.testing.assert_array_equal(out["arch/normal/params"], torch.stack(expected).numpy())
    np.testing.assert_allclose(out["scalars/loss"], [1.0 / s for s in range(1, 11)], rtol=1e-7)
    np.testing.assert_array_equal(out["scalars/val"], [np.nan] * 9 + [0.5])


def test_a_full_batch_is_handed_over_and_a_bad_row_costs_only_itself(tmp_path):
    path = tmp_path / "run.h5"
    with RecorderCallback(path, flush_every=4, flush_seconds=None) as cb:
        for step in range(1, 6):
            cb.on_step_end(step, {"scalars/a": float(step)})
        assert load(path)["step"].tolist() == [1, 2, 3, 4]  # four finished rows: handed over and flushed
        cb.on_step_end(6, {"scalars/a": np.zeros(3)})  # another shape: refused when the row is written
        cb.on_step_end(7, {"scalars/a": 7.0})
        with pytest.raises(RecordError, match="'scalars/a' at step 6"):
            cb.flush()
    np.testing.assert_array_equal(load(path)["step"], [1, 2, 3, 4, 5, 7])


def test_flush_listener_api(tmp_path):
    calls = []
    with Recorder(tmp_path / "run.h5", flush_seconds=None) as rec:
        listener = lambda closing: calls.append(closing)  # noqa: E731
        rec.add_flush_listener(listener)
        rec.flush()
        rec.remove_flush_listener(listener)
        rec.flush()
        rec.add_flush_listener(listener)
        with pytest.raises(RecordError, match="callable"):
            rec.add_flush_listener(3)
    assert calls == [False, True]  # one flush, then the close


def test_a_step_that_goes_back_is_refused_at_its_call_and_loses_nothing(tmp_path):
    """The refused call records nothing; the merge into the current step, the epoch's statistics
    and close() that come after it all work, and no row is dropped."""
    path = tmp_path / "run.h5"
    cb = RecorderCallback(path, flush_seconds=None)
    cb.on_step_end(0, {"scalars/x": 1.0})
    cb.on_step_end(1, {"scalars/x": 2.0})
    with pytest.raises(RecordError, match=r"^on_step_end: step 0 is before the current step 1; .*nothing of this call"):
        cb.on_step_end(0, {"scalars/x": 9.0})
    for bad in (1.5, -1, True, "2"):
        with pytest.raises(RecordError, match="step must be a non-negative int"):
            cb.on_step_end(bad, {"scalars/x": 9.0})
    with pytest.raises(RecordError, match="on_epoch_end: step 0 is before the current step 1"):
        cb.on_epoch_end(0, {"scalars/z": 9.0}, step=0)
    cb.on_step_end(1, {"scalars/y": 3.0})  # a valid merge into the current step
    cb.on_epoch_end(0, {"scalars/z": 1.0})
    cb.on_step_end(2, {"scalars/x": 4.0})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cb.close()
    assert not [w for w in seen if issubclass(w.category, RecordWarning)], [str(w.message) for w in seen]
    out = load(path)
    np.testing.assert_array_equal(out["step"], [0, 1, 2])
    np.testing.assert_array_equal(out["scalars/x"], [1.0, 2.0, 4.0])
    np.testing.assert_array_equal(out["scalars/y"], [np.nan, 3.0, np.nan])
    np.testing.assert_array_equal(out["scalars/z"], [np.nan, 1.0, np.nan])


def test_the_step_of_a_written_row_is_refused_and_on_exception_writes_first(tmp_path):
    """After a flush the row of the last step is on disk: the same step can no longer merge. An
    exception hook with a step that goes back still writes every held row, then raises."""
    path = tmp_path / "run.h5"
    cb = RecorderCallback(path, flush_seconds=None)
    cb.on_step_end(1, {"scalars/x": 1.0})
    cb.flush()
    with pytest.raises(RecordError, match=r"step 1 is not after step 1, whose row is already written"):
        cb.on_step_end(1, {"scalars/y": 2.0})
    with pytest.raises(RecordError, match=r"row of step 1 is already written.*pass step= a step after 1"):
        cb.on_epoch_end(0, {"scalars/z": 1.0})
    cb.on_step_end(2, {"scalars/x": 2.0})
    cb.on_step_end(3, {"scalars/x": 3.0})
    with pytest.raises(RecordError, match="on_exception: step 2 is before the current step 3"):
        cb.on_exception(RuntimeError("diverged"), {"scalars/diverged": True}, step=2)
    np.testing.assert_array_equal(load(path)["step"], [1, 2, 3])  # held rows written before the error
    with pytest.raises(RecordError, match="on_exception: the row of step 3 is already written"):
        cb.on_exception(RuntimeError("again"), {"scalars/diverged": True})
    cb.on_step_end(4, {"scalars/x": 4.0})  # still usable
    cb.close()
    out = load(path)
    np.testing.assert_array_equal(out["step"], [1, 2, 3, 4])
    np.testing.assert_array_equal(out["scalars/x"], [1.0, 2.0, 3.0, 4.0])
    assert "scalars/y" not in out and "scalars/diverged" not in out


def test_a_step_logged_directly_to_an_open_recorder_bounds_the_callback(tmp_path):
    recorder = Recorder(tmp_path / "run.h5", flush_seconds=None)
    recorder.log(5, {"scalars/x": 5.0})
    with RecorderCallback(recorder) as cb:
        with pytest.raises(RecordError, match="step 3 is not after step 5"):
            cb.on_step_end(3, {"scalars/x": 3.0})
        cb.on_step_end(6, {"scalars/x": 6.0})
    np.testing.assert_array_equal(load(tmp_path / "run.h5")["step"], [5, 6])


def test_an_unknown_reduction_rule_is_refused_before_a_file_is_opened(tmp_path):
    path = tmp_path / "run.h5"
    with pytest.raises(RecordError, match=r"'median' is not a reduction rule; use one of mean, sum, pooled, same, all, any, min, max$"):
        RecorderCallback(path, rules={"scalars/*": "median"})
    with pytest.raises(RecordError, match="rules must be a mapping"):
        RecorderCallback(path, rules=["scalars/*"])
    assert not any(tmp_path.iterdir())  # nothing created, no lock held
    RecorderCallback(path, rules={"scalars/*": "max", "cost/*/count": "sum"}).close()  # valid rules pass


def test_an_unknown_keyword_is_a_record_error_naming_the_valid_ones(tmp_path):
    with pytest.raises(RecordError, match=r"unknown keyword argument\(s\) bogus_option; .*flush_every, resume, overwrite"):
        RecorderCallback(tmp_path / "run.h5", bogus_option=3)
    assert not any(tmp_path.iterdir())



def test_a_lightning_install_that_fails_at_import_is_one_record_error(monkeypatch, tmp_path):
    """torchmetrics imports torchvision when it is installed, and a torchvision built for another torch fails with
    a RuntimeError (this box: "operator torchvision::nms does not exist"): one line naming it, not a traceback."""
    import importlib

    real = importlib.import_module

    def import_module(name, *args, **kwargs):
        if name in ("lightning.pytorch", "pytorch_lightning"):
            raise RuntimeError("operator torchvision::nms does not exist")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", import_module)
    with pytest.raises(RecordError, match=r"^PyTorch Lightning is installed but 'import lightning.pytorch' fails "
                                          r"\(RuntimeError: operator torchvision::nms does not exist\); repair"):
        lightning_callback(tmp_path / "run.h5")
    assert not list(tmp_path.iterdir())
