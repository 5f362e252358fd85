"""Recorder audit round: values that change when they are stored, and rows refused half-way.

Expectations are what IEEE float32 makes of the value (numpy's own cast, independent of the
recorder) and the rows that were logged, read back with plain h5py."""

from __future__ import annotations

import warnings

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder, RecordWarning, load


def test_a_finite_python_number_that_overflows_its_float32_path_is_counted_as_inf(tmp_path):
    path = tmp_path / "run.h5"
    big = 1e39  # finite as a Python float, inf as a float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's own cast warning, used as the reference
        assert np.isinf(np.float32(big))
    with pytest.warns(RecordWarning, match="NaN/inf"):
        with Recorder(path, flush_every=2, flush_seconds=None) as rec:
            rec.log(1, {"scalars/a": np.float32(1.0), "arch/w": np.ones(3, np.float32)})
            rec.log(2, {"scalars/a": big, "arch/w": np.ones(3, np.float32)})
            rec.log(3, {"scalars/a": 10**39, "arch/w": np.ones(3, np.float32)})  # a Python int, too
            assert rec.nonfinite_counts == {"scalars/a": 2}
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["scalars/a"][()], [1.0, np.inf, np.inf])
        assert f["scalars/a"].attrs["nonfinite_count"] == 2


def test_a_value_that_cannot_be_stored_is_a_record_error_and_leaves_no_part_of_its_row(tmp_path):
    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=4, flush_seconds=None) as rec:
        rec.log(1, {"scalars/a": 1.0, "scalars/b": 1.0})
        with pytest.raises(RecordError, match="scalars/b"):
            rec.log(2, {"scalars/a": 5.0, "scalars/b": 10**400})  # no float holds it
        rec.log(3, {"scalars/b": 3.0})  # scalars/a is not in this row
    out = load(path)
    np.testing.assert_array_equal(out["step"], [1, 3])
    np.testing.assert_array_equal(out["valid/scalars/a"], [True, False])
    np.testing.assert_array_equal(out["scalars/b"], [1.0, 3.0])


def test_a_checkpoint_that_hits_the_file_size_limit_is_one_checkpoint_error_and_leaves_no_file(tmp_path):
    """torch.save reports a failed write as a RuntimeError ("unexpected pos") raised while handling the
    OSError; the OSError (EFBIG here, ENOSPC on a full disk) is what the user must see."""
    import resource

    import torch

    from nasdiag.search.checkpoint import CheckpointError, save_checkpoint

    path = tmp_path / "run.h5.ckpt"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))  # Python ignores SIGXFSZ: writes fail with EFBIG
    try:
        with pytest.raises(CheckpointError, match="disk full or file-size limit"):
            save_checkpoint(str(path), {"weights": torch.zeros(1 << 16)})  # 256 KiB of data
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_resume_that_extends_the_run_says_so(tmp_path):
    """``--epochs`` defaults to 8: a plain ``--resume`` of a shorter run extends it (another schedule than the
    uninterrupted run's), which must not happen unannounced."""
    from nasdiag.cli import main

    out = tmp_path / "run.h5"
    small = ["--C", "4", "--layers", "3", "--steps", "2", "--batch-size", "240", "--no-progress", "--no-figs", "--threads", "1",
             "--diagnostics", "none", "--out", str(out)]
    assert main(["search", "--epochs", "1", *small]) == 0
    with pytest.warns(UserWarning, match=r"extends the run from 1 to 2 epochs \(it had finished"):
        assert main(["search", "--resume", "--epochs", "2", *small]) == 0
    assert load(out)["scalars/epoch"][-1] == 1.0


def test_a_row_interrupted_half_way_leaves_no_presence_flags_to_the_next_row(tmp_path, monkeypatch):
    """Ctrl-C lands between two bytecodes: here between buffering one value of a row and the next."""
    path = tmp_path / "run.h5"

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    with Recorder(path, flush_every=4, flush_seconds=None) as rec:
        rec.log(1, {"scalars/a": 1.0, "scalars/b": 1.0})
        with monkeypatch.context() as patch:
            patch.setattr(rec, "_count_nonfinite", interrupt)
            with pytest.raises(KeyboardInterrupt):
                rec.log(2, {"scalars/a": float("nan"), "scalars/b": 2.0})
        rec.log(3, {"scalars/b": 3.0})
    out = load(path)
    np.testing.assert_array_equal(out["step"], [1, 3])
    np.testing.assert_array_equal(out["valid/scalars/a"], [True, False])


def test_ctrl_c_while_the_callback_hands_rows_over_loses_no_row(tmp_path, monkeypatch):
    """The rows of a batch are handed to the recorder one by one; Ctrl-C landing between two of them, and the
    loop's on_exception that follows, must leave every step in the record exactly once (no gap)."""
    from nasdiag.record import RecorderCallback

    path = tmp_path / "run.h5"
    with RecorderCallback(path, flush_every=4, flush_seconds=None) as cb:
        log = cb.recorder.log
        calls = []

        def interrupted_log(step, values):
            calls.append(step)
            if step == 2 and calls.count(2) == 1:
                raise KeyboardInterrupt  # arrives before the recorder saw step 2
            log(step, values)

        monkeypatch.setattr(cb.recorder, "log", interrupted_log)
        try:
            for step in range(1, 7):
                cb.on_step_end(step, {"scalars/a": float(step)})
        except KeyboardInterrupt as exc:
            cb.on_exception(exc)
    out = load(path)
    np.testing.assert_array_equal(out["step"], np.arange(1, out["step"].size + 1))
    assert out["step"].size >= 4  # the batch of steps 1-4 was being handed over
    np.testing.assert_array_equal(out["scalars/a"], out["step"].astype(float))
