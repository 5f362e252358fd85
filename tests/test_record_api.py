"""Recorder / load: API contracts, schema, rows, resume and errors (in-process; faults are in
test_record_faults.py). Every expectation is the data that was logged, read back independently
(plain h5py where the format is the point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder, RecordWarning, load, load_meta

META = {
    "method": "darts",
    "config": {"lr": 0.025, "layers": 5, "nested": {"a": [1, 2]}},
    "seed": 7,
    "op_names": ["none", "skip_connect", "sep_conv_3x3"],
    "edge_names": {"normal": ["0->2", "1->2"], "reduce": ["0->2", "1->2"]},
    "cell_types": ["normal", "reduce"],
    "dataset": "digits",
}


def _row(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "scalars/train_loss": 1.0 / (step + 1),
        "scalars/n_seen": np.int64(step * 64),
        "arch/normal/weights": rng.random((2, 3), dtype=np.float32),
        "arch/reduce/params": rng.standard_normal((2, 3)),
        "cost/normal/mean": rng.standard_normal((2, 3)),
        "regret/normal/alive": rng.random((2, 3)) > 0.3,
    }


def _write(path, steps, flush_every=5, **kwargs):
    with Recorder(path, meta=META, flush_every=flush_every, flush_seconds=None, **kwargs) as rec:
        for s in steps:
            rec.log(s, _row(s))
    return rec


def test_roundtrip_rows_aligned_and_dtypes_kept(tmp_path):
    path = tmp_path / "run.h5"
    steps = list(range(0, 23, 1))
    _write(path, steps)
    out = load(path)
    np.testing.assert_array_equal(out["step"], steps)
    for key in _row(0):
        expected = np.stack([np.asarray(_row(s)[key]) for s in steps])
        np.testing.assert_array_equal(out[key], expected)
        assert out[key].dtype == expected.dtype, key
        assert out[f"valid/{key}"].all()


def test_plain_h5py_reads_the_schema(tmp_path):
    path = tmp_path / "run.h5"
    steps = [3, 4, 9]
    _write(path, steps, flush_every=2)
    with h5py.File(path, "r") as f:
        attrs = f.attrs
        assert attrs["schema_version"] >= 1
        assert attrs["method"] == "darts"
        assert json.loads(attrs["config"]) == META["config"]
        assert attrs["seed"] == 7
        for key in ("nasdiag_version", "torch_version", "h5py_version"):
            assert isinstance(attrs[key], str) and attrs[key]
        assert attrs["h5py_version"] == h5py.__version__
        assert [s.decode() for s in f["meta/op_names"][()]] == META["op_names"]
        assert [s.decode() for s in f["meta/cell_types"][()]] == META["cell_types"]
        assert [s.decode() for s in f["meta/edge_names/reduce"][()]] == META["edge_names"]["reduce"]
        assert json.loads(f["meta"].attrs["dataset"]) == "digits"
        np.testing.assert_array_equal(f["step"][()], steps)
        assert f["arch/normal/weights"].shape == (3, 2, 3)  # (T, E, K)
        np.testing.assert_array_equal(f["arch/normal/weights"][1], _row(4)["arch/normal/weights"])
        assert f["scalars/train_loss"][2] == pytest.approx(1 / 10)
        assert f["scalars/train_loss"].attrs["nonfinite_count"] == 0


def test_meta_through_load_and_load_meta(tmp_path):
    path = tmp_path / "run.h5"
    _write(path, [0])
    out = load(path)
    assert list(out["meta/op_names"]) == META["op_names"]
    assert list(out["meta/cell_types"]) == META["cell_types"]
    assert list(out["meta/edge_names/normal"]) == META["edge_names"]["normal"]
    assert str(out["meta/method"]) == "darts"
    assert int(out["meta/seed"]) == 7
    assert json.loads(str(out["meta/config"])) == META["config"]
    meta = load_meta(path)
    for key, value in META.items():
        assert meta[key] == value, key
    assert meta["h5py_version"] == h5py.__version__


def test_missing_paths_filled_and_flagged(tmp_path):
    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=2, flush_seconds=None) as rec:
        rec.log(0, {"scalars/a": 1.0, "scalars/k": 4})
        rec.log(1, {"scalars/a": 2.0})
        rec.log(2, {"scalars/k": 6, "scalars/late": True})  # a new path after the first flush
        rec.log(3, {"scalars/a": 4.0})
    out = load(path)
    np.testing.assert_array_equal(out["step"], [0, 1, 2, 3])
    np.testing.assert_array_equal(out["valid/scalars/a"], [True, True, False, True])
    np.testing.assert_array_equal(out["scalars/a"], [1.0, 2.0, np.nan, 4.0])
    np.testing.assert_array_equal(out["valid/scalars/k"], [True, False, True, False])
    np.testing.assert_array_equal(out["scalars/k"][out["valid/scalars/k"]], [4, 6])
    assert out["scalars/k"].dtype == np.int64
    np.testing.assert_array_equal(out["valid/scalars/late"], [False, False, True, False])
    assert out["scalars/late"].dtype == bool


def test_shape_or_dtype_change_raises_and_writes_nothing_of_that_row(tmp_path):
    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=3, flush_seconds=None) as rec:
        rec.log(0, {"scalars/a": 0.5, "cost/normal/mean": np.zeros((2, 3))})
        with pytest.raises(RecordError, match=r"shape \(2, 4\)"):
            rec.log(1, {"scalars/a": 1.5, "cost/normal/mean": np.zeros((2, 4))})
        with pytest.raises(RecordError, match="float32"):
            rec.log(1, {"scalars/a": 1.5, "cost/normal/mean": np.zeros((2, 3), np.float32)})
        rec.log(1, {"scalars/a": 1.5, "cost/normal/mean": np.ones((2, 3))})
        rec.log(2, {"scalars/i": 2})
        with pytest.raises(RecordError, match="Python float"):
            rec.log(3, {"scalars/a": 9.0, "scalars/i": 2.5})
        rec.log(3, {"scalars/a": 3.5, "cost/normal/mean": np.ones((2, 3))})
    out = load(path)
    np.testing.assert_array_equal(out["step"], [0, 1, 2, 3])
    np.testing.assert_array_equal(out["scalars/a"], [0.5, 1.5, np.nan, 3.5])
    np.testing.assert_array_equal(out["scalars/i"][out["valid/scalars/i"]], [2])
    np.testing.assert_array_equal(out["cost/normal/mean"][3], np.ones((2, 3)))


def test_python_int_into_float_path_is_accepted(tmp_path):
    path = tmp_path / "run.h5"
    with Recorder(path, flush_seconds=None) as rec:
        rec.log(0, {"scalars/loss": 0.25})
        rec.log(1, {"scalars/loss": 0})
    np.testing.assert_array_equal(load(path)["scalars/loss"], [0.25, 0.0])


def test_torch_tensors_are_converted(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "run.h5"
    weights = torch.softmax(torch.randn(2, 3, requires_grad=True), dim=-1)  # needs detach
    with Recorder(path, flush_seconds=None) as rec:
        rec.log(torch.tensor(5), {"arch/normal/weights": weights, "scalars/loss": torch.tensor(0.5, dtype=torch.float64)})
    out = load(path)
    np.testing.assert_array_equal(out["step"], [5])
    np.testing.assert_allclose(out["arch/normal/weights"][0], weights.detach().numpy())
    assert out["arch/normal/weights"].dtype == np.float32


def test_bad_input_is_refused_with_clear_errors(tmp_path):
    path = tmp_path / "run.h5"
    with Recorder(path, meta=META, flush_seconds=None) as rec:
        for step, values, pattern in [
            (-1, {"scalars/a": 1.0}, "non-negative int"),
            (1.5, {"scalars/a": 1.0}, "non-negative int"),
            (0, {"step": 1.0}, "reserved"),
            (0, {"/abs": 1.0}, "invalid"),
            (0, {"scalars/s": "text"}, "cannot be recorded"),
            (0, {"arch/normal/weights": np.zeros((3, 3))}, r"\(E, K\) = \(2, 3\)"),
            (0, {"arch/other/weights": np.zeros((2, 3))}, "cell_types"),
            (0, [("scalars/a", 1.0)], "dict"),
        ]:
            with pytest.raises(RecordError, match=pattern):
                rec.log(step, values)
        rec.log(4, {"scalars/a": 1.0})
        with pytest.raises(RecordError, match="not after"):
            rec.log(4, {"scalars/a": 2.0})
        with pytest.raises(RecordError, match="clash"):
            rec.log(5, {"scalars/a/b": 2.0})
    np.testing.assert_array_equal(load(path)["step"], [4])
    with pytest.raises(RecordError, match="closed"):
        rec.log(9, {"scalars/a": 1.0})
    for kwargs, pattern in [
        ({"flush_every": 0}, "flush_every"),
        ({"meta": {"seed": "x"}}, "seed"),
        ({"meta": {"config": {"f": object()}}}, "JSON"),
        ({"meta": {"op_names": "abc"}}, "list of strings"),
        ({"resume": True, "overwrite": True}, "contradict"),
    ]:
        with pytest.raises(RecordError, match=pattern):
            Recorder(tmp_path / "other.h5", **kwargs)
    assert not (tmp_path / "other.h5").exists()
    with pytest.raises(RecordError, match="no record"):
        load(tmp_path / "missing.h5")


def test_existing_record_needs_resume_or_overwrite(tmp_path):
    path = tmp_path / "run.h5"
    _write(path, range(4))
    with pytest.raises(RecordError) as info:
        Recorder(path)
    message = str(info.value)
    assert "resume=True" in message and "overwrite=True" in message and "\n" not in message
    np.testing.assert_array_equal(load(path)["step"], range(4))  # refused, not truncated
    _write(path, [10, 11], resume=True)  # adds a segment
    assert len(load_meta(path)["segments"]) == 2
    _write(path, [100], overwrite=True)
    assert load_meta(path)["segments"] == [str(path)]
    np.testing.assert_array_equal(load(path)["step"], [100])


def test_resume_new_segment_later_segment_wins(tmp_path):
    path = tmp_path / "run.h5"
    _write(path, range(0, 10))
    before = path.read_bytes()
    with Recorder(path, resume=True, flush_every=4, flush_seconds=None) as rec:
        assert rec.last_step == 9
        assert rec.segment_file != str(path)
        for s in range(6, 13):
            rec.log(s, {"scalars/train_loss": -float(s)})
        assert rec.last_step == 12
    assert path.read_bytes() == before  # segment 0 untouched
    out = load(path)
    np.testing.assert_array_equal(out["step"], range(13))
    expected = [1.0 / (s + 1) for s in range(6)] + [-float(s) for s in range(6, 13)]
    np.testing.assert_array_equal(out["scalars/train_loss"], expected)
    # Paths not logged after the resume are missing in the winning rows, not taken from the old rows.
    np.testing.assert_array_equal(out["valid/arch/normal/weights"], [True] * 6 + [False] * 7)
    # The resumed session keeps the stored schema: a changed shape is refused.
    with Recorder(path, resume=True, flush_seconds=None) as rec:
        with pytest.raises(RecordError, match="first logged"):
            rec.log(20, {"arch/normal/weights": np.zeros((3, 3), np.float32)})
    with pytest.raises(RecordError, match="search space"):
        Recorder(path, resume=True, meta={"op_names": ["x"]})


def test_resume_of_nothing_starts_a_record_and_empty_recorder_has_no_last_step(tmp_path):
    path = tmp_path / "run.h5"
    with Recorder(path, resume=True, meta=META) as rec:
        assert rec.last_step is None
    out = load(path)
    assert out["step"].shape == (0,) and list(out["meta/op_names"]) == META["op_names"]
    with Recorder(path, resume=True) as rec:
        assert rec.last_step is None
        rec.log(0, {"scalars/x": 1.0})
    assert load_meta(path)["method"] == "darts"  # meta inherited on resume
    with Recorder(tmp_path / "bare.h5") as rec:
        rec.log(0, {"scalars/x": 1.0})
    with h5py.File(tmp_path / "bare.h5", "r") as f:  # every root attribute, even without meta
        assert (f.attrs["method"], f.attrs["config"], f.attrs["seed"]) == ("", "{}", -1)
    assert "seed" not in load_meta(tmp_path / "bare.h5")


def test_nonfinite_recorded_counted_and_warned(tmp_path):
    path = tmp_path / "run.h5"
    values = [1.0, float("nan"), float("inf"), -float("inf"), 2.0]
    with pytest.warns(RecordWarning, match="NaN/inf"):
        with Recorder(path, flush_every=2, flush_seconds=None) as rec:
            for s, v in enumerate(values):
                rec.log(s, {"scalars/loss": v, "hessian/normal/diag": np.array([[v, 0.0, v]])})
    out = load(path)
    np.testing.assert_array_equal(out["scalars/loss"], values)  # NaN == NaN here, inf kept with sign
    with h5py.File(path, "r") as f:
        assert f["scalars/loss"].attrs["nonfinite_count"] == 3
        assert f["hessian/normal/diag"].attrs["nonfinite_count"] == 6
    assert load_meta(path)["nonfinite_counts"]["scalars/loss"] == 3


def test_nonfinite_attribute_counts_its_own_segment(tmp_path):
    path = tmp_path / "run.h5"
    with pytest.warns(RecordWarning):
        with Recorder(path, flush_every=2, flush_seconds=None) as rec:
            rec.log(0, {"scalars/loss": float("nan")})
            rec.log(1, {"scalars/loss": 1.0})  # flush: segment 0 is in SWMR mode now
            rec.log(2, {"scalars/loss": float("inf"), "scalars/new": 0.0})  # a new path: segment 1
            rec.log(3, {"scalars/loss": float("nan")})
            assert rec.nonfinite_counts == {"scalars/loss": 3}
    with h5py.File(path, "r") as f0, h5py.File(tmp_path / "run.seg0001.h5", "r") as f1:
        assert f0["scalars/loss"].attrs["nonfinite_count"] == 1
        assert f1["scalars/loss"].attrs["nonfinite_count"] == 2
    assert load_meta(path)["nonfinite_counts"]["scalars/loss"] == 3


def test_no_memory_growth_across_steps(tmp_path):
    import tracemalloc

    with Recorder(tmp_path / "run.h5", flush_every=8, flush_seconds=None) as rec:
        for s in range(64):
            rec.log(s, _row(s))
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for s in range(64, 640):
            rec.log(s, _row(s))
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
    assert grown < 200_000, grown  # a leak of one row per step would be > 300 kB here


def test_importing_record_does_not_import_torch():
    code = "import sys, nasdiag.record; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_same_process_second_writer_refused(tmp_path):
    path = tmp_path / "run.h5"
    with Recorder(path, flush_seconds=None) as rec:
        rec.log(0, {"scalars/a": 1.0})
        for kwargs in ({}, {"resume": True}, {"overwrite": True}):
            with pytest.raises(RecordError, match="another writer"):
                Recorder(path, **kwargs)
        rec.log(1, {"scalars/a": 2.0})
    np.testing.assert_array_equal(load(path)["scalars/a"], [1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not os.path.exists(str(path) + ".lock")


def test_resume_into_another_run_is_reported_without_parsing_warnings(tmp_path):
    from nasdiag.record import ResumeMismatchError

    path = tmp_path / "run.h5"
    _write(path, [0, 1])
    other = {**META, "seed": 8, "config": {"lr": 0.5}}
    before = path.read_bytes()
    with pytest.raises(ResumeMismatchError) as info:
        Recorder(path, resume=True, meta=other, on_run_change="error")
    assert set(info.value.differences) == {"seed", "config"}
    assert info.value.differences["seed"] == (7, 8)
    assert path.read_bytes() == before and not os.path.exists(f"{path}.lock")
    with pytest.warns(RecordWarning, match="seed"):
        with Recorder(path, resume=True, meta=other) as rec:
            assert set(rec.resume_differences) == {"seed", "config"}
    with Recorder(path, resume=True, meta=other) as rec:  # the record now continues as the other run
        assert rec.resume_differences == {}
        assert rec.last_step == rec.last_committed_step == 1
        rec.log(2, {"scalars/loss": 0.5})
        assert rec.last_step == 2 and rec.last_committed_step == 1  # buffered, not on disk yet
        rec.flush()
        assert rec.last_committed_step == 2
