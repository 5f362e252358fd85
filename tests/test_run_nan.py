"""A diverging search stops with one clear error; the rows before it stay readable and the failing step's
NaN is recorded and flagged (never averaged away or lost with the run)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from nasdiag.record import RecordWarning, load
from nasdiag.search import Hyperparameters, SearchConfig, SearchError, SearchMethod, register, run


@register("nan-at-step-3")
class NanAtStep3(SearchMethod):
    """Uniform mixing weights; the loss 'diverges' at step 3 (its row carries a NaN loss)."""

    @dataclass
    class Hyperparameters(Hyperparameters):
        pass

    def build(self):
        self.steps_done = 0

    def probabilities(self):
        return {t: torch.full_like(a.detach(), 1.0 / a.shape[-1]) for t, a in self.network.alphas().items()}

    def step(self, train_batch, val_batch):
        self.steps_done += 1
        loss = torch.tensor(float("nan") if self.steps_done == 3 else 1.0 / self.steps_done)
        stats = {"scalars/train_loss": loss}
        if not torch.isfinite(loss):
            err = SearchError("the search-train loss is nan at step 3; lower the learning rates")
            err.statistics = stats
            raise err
        return stats


def test_a_nan_loss_stops_the_run_and_its_row_is_recorded_and_flagged(tmp_path):
    path = tmp_path / "nan.h5"
    cfg = SearchConfig(method="nan-at-step-3", dataset="synthetic", epochs=1, batch_size=16, C=4, layers=3, steps=2,
                       record=str(path), figures=None, diagnostics=(), progress=False)
    with pytest.warns(RecordWarning, match="NaN"), pytest.raises(SearchError, match="nan"):  # flagged as written
        run(cfg)
    rec = load(str(path))
    assert list(rec["step"]) == [1, 2, 3]
    loss = rec["scalars/train_loss"]
    assert loss[0] == 1.0 and loss[1] == 0.5 and np.isnan(loss[2])
