"""Round-21 audit of the NaN/inf path end to end: a NaN (or inf) is recorded and flagged, never hidden.

Defect found: the probe flagged only NaN costs. An inf cost (∂L/∂Z past the range of its dtype, with a finite loss)
was returned by ``costs()`` with no warning, and ``statistics()`` then held a mean of inf and a variance of NaN without
its 'hold NaN' warning; both warnings now cover ±inf
(``test_an_inf_cost_of_a_finite_loss_is_flagged_by_the_probe_as_a_nan_one``).
"""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import nasdiag


# -- the probe's flags of an inf cost -------------------------------------------------------------------------------
class _Scale(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x):
        return x * self.c


class _Mixed(nn.Module):
    """A DARTS-convention mixed op (``_ops``, forward ``(x, weights)``) of two candidates."""

    def __init__(self, scales):
        super().__init__()
        self._ops = nn.ModuleList([_Scale(c) for c in scales])

    def forward(self, x, w):
        return sum(wk * op(x) for wk, op in zip(w, self._ops))


class _OneEdge(nn.Module):
    def __init__(self, scales, z):
        super().__init__()
        self.m = _Mixed(scales)
        self.z = nn.Parameter(torch.tensor(z))

    def forward(self, x):
        return self.m(x, self.z)


def test_an_inf_cost_of_a_finite_loss_is_flagged_by_the_probe_as_a_nan_one():
    """L = Σ g·(z0·1e30·x + z1·x) with g = 1e10, x = 1 (3 samples, 4 features), float32: by hand C_0 = ∂L/∂z0 =
    Σ g·1e30·x = 1.2e41, past float32's 3.4e38, so inf, while L = 1.2e11 (z0 = 1e-30) is finite. The probe returned
    that inf with no warning and its statistics a mean of inf and a variance of NaN (inf − inf), again without a
    warning (both flags looked at NaN only)."""
    net = _OneEdge((1e30, 1.0), [1e-30, 1.0])
    x = torch.ones(3, 4)
    probe = nasdiag.attach(net, {"e": net.m})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.record():
            loss = (net(x) * 1e10).sum()
            loss.backward()
        assert math.isfinite(float(loss.detach()))
        cost = probe.costs()["e"]
        stats = probe.statistics()
    assert cost[0] == math.inf and cost[1] == pytest.approx(1.2e11, rel=1e-6)  # recorded as it is
    assert np.isposinf(stats["cost/edges/mean"][0, 0]) and np.isnan(stats["cost/edges/var"][0, 0])
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("NaN cost at edge(s) 'e'" in m for m in said), said
    assert any("cost statistics of 'edges' hold NaN" in m for m in said), said


def test_a_finite_cost_gives_no_nonfinite_warning():
    """The control of the test above: the same edge with a cost inside float32's range warns of nothing."""
    net = _OneEdge((1e3, 1.0), [1e-3, 1.0])
    probe = nasdiag.attach(net, {"e": net.m})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with probe.record():
            (net(torch.ones(3, 4)) * 1e10).sum().backward()
        assert torch.isfinite(probe.costs()["e"]).all()
        probe.statistics()
