"""Lead's round-19 finding (reported by the methods auditor): a learning-rate schedule past the run's end.

DARTS §A.1.1 anneals w's learning rate by a cosine over the run's epochs, never rising. torch's `CosineAnnealingLR`
is periodic: a hand-written loop calling ``epoch_end`` more often than ``schedule.epochs`` made the rate climb back
up (0.001 → 0.013 → 0.025). Past its end a schedule now stays at its minimum, as ``extend_schedule``'s docstring
promises of a finished run; the reference is the closed-form cosine of the paper.
"""
from __future__ import annotations

import warnings

import pytest

from nasdiag.search import get_method
from test_audit_methods_round14 import _net
from test_audit_methods_round16 import _cosine, _method, _prims

COSINE_METHODS = ("asmnas", "bayesnas", "darts", "darts2", "sparsenas", "xnas")


@pytest.mark.parametrize("name", COSINE_METHODS)
def test_a_cosine_schedule_called_past_its_end_stays_at_its_minimum(name):
    method = _method(name, _net(7, _prims(name)), epochs=2, steps=2)
    h = method.hp
    schedulers = [s for s in (getattr(method, "scheduler", None), getattr(method, "arch_scheduler", None)) if s]
    starts = [s.optimizer.param_groups[0]["lr"] for s in schedulers]
    minima = [s.eta_min for s in schedulers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "scheduler step before optimizer step": no step is taken here
        for epoch in range(5):
            method.epoch_end(epoch)
            for s, lr0, lr_min in zip(schedulers, starts, minima):
                assert s.optimizer.param_groups[0]["lr"] == pytest.approx(
                    _cosine(lr0, lr_min, min(epoch + 1, 2), 2), rel=1e-12, abs=1e-15), (epoch, s)
    assert get_method(name) is type(method)
    if name in ("darts", "darts2"):
        assert method.w_optimizer.param_groups[0]["lr"] == pytest.approx(h.w_lr_min, abs=1e-15)
