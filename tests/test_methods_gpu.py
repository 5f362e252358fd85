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
