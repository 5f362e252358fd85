"""BayesNAS, SparseNAS and ASM-NAS on CUDA: `run()` of one epoch of 2 steps on synthetic data records every
statistic of the method finite, on the GPU (the record's config names the device), with the per-epoch cost
and Hessian diagnostics on. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# the record families each method must write, finite, at every step (bayes/*: after the update of step 2)
FAMILIES = {
    "bayesnas": ("bayes/normal/gamma", "bayes/reduce/gamma", "bayes/normal/omega", "bayes/normal/curvature",
                 "bayes/normal/covariance", "bayes/normal/prior_variance", "arch/normal/params"),
    "sparsenas": ("arch/normal/weights", "arch/reduce/weights", "sparsity/lambda", "scalars/val_loss"),
    "asmnas": ("attention/normal/mean", "attention/reduce/mean", "arch/normal/probabilities"),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_two_cuda_steps_record_finite_statistics(name, tmp_path):
    from nasdiag.record import load, load_meta
    from nasdiag.search import SearchConfig, run

    out = tmp_path / f"{name}.h5"
    cfg = SearchConfig(method=name, dataset="synthetic", epochs=1, batch_size=128, C=4, layers=3, steps=2, multiplier=2,
                       device="cuda", record=str(out), figures=None, progress=False)
    result = run(cfg)
    rec = load(out)
    assert rec["step"].tolist() == [1, 2]  # 256 synthetic samples per split / batch 128
    assert load_meta(out)["config"]["device"].startswith("cuda")
    assert next(result.method.network.parameters()).is_cuda
    for key in ("scalars/train_loss",) + FAMILIES[name]:
        assert key in rec, key
        assert np.isfinite(np.asarray(rec[key], dtype=np.float64)).all(), key
    if name == "bayesnas":
        assert rec["bayes/updated"].tolist() == [False, True]
        assert (rec["bayes/normal/curvature"][-1] > 0).any()  # the update ran on the GPU's curvature
        assert rec["bayes/normal/switch"].dtype == bool
    if name == "asmnas":
        counts = rec["attention/normal/count"]
        assert np.asarray(counts[rec["valid/attention/normal/count"]][-1]).sum() > 0
    assert np.isfinite(result.evaluation["loss"])


def test_darts_run_on_cuda_records_the_replayed_curvature_of_every_epoch(tmp_path):
    """The search's per-epoch `hessian/<cell>/diag` on CUDA (float64): epoch 1 runs plainly, epoch 2 captures the
    curvature graph, epoch 3 replays it. Every row is recorded finite and non-zero, and the step's graph still replays
    after the curvature's captures (the two share one memory pool). The replay's numbers against plain calls are
    checked in tests/test_hessian_graphed.py."""
    from nasdiag.record import load
    from nasdiag.search import SearchConfig, run

    out = tmp_path / "darts.h5"
    cfg = SearchConfig(method="darts", dataset="synthetic", epochs=3, batch_size=64, C=4, layers=3, steps=2, multiplier=2,
                       device="cuda", dtype="float64", diagnostics=("cost", "hessian"), hessian_mode="approx",
                       record=str(out), figures=None, progress=False)
    result = run(cfg)
    rec = load(out)
    rows = np.asarray(rec["hessian/normal/diag"][rec["valid/hessian/normal/diag"]], dtype=np.float64)
    assert rows.shape[0] == 3 and np.isfinite(rows).all() and (np.abs(rows) > 0).any(axis=(1, 2)).all()
    assert not np.any(rec["hessian/normal/nonfinite"][rec["valid/hessian/normal/nonfinite"]])
    curvature, step = result.method._curvature_graph.counts, result.method.step.counts
    assert curvature["capture"] == 1 and curvature["replay"] >= 1 and curvature["plain"] == 0, curvature
    # 4 steps per epoch; the learning rate changes each epoch, so each epoch steps once plainly, captures, replays twice
    assert step["capture"] == 3 and step["replay"] == 6 and step["plain"] == 0, step
