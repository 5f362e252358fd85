"""Summary statistics: normalized entropy (eq 54-55) and cell depth (Table 4)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nasdiag.regret import cell_depth, mean_normalized_entropy, normalized_entropy
from nasdiag.supernet.genotype import Genotype, MixedGenotype


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 9), st.booleans())
def test_normalized_entropy_matches_categorical_entropy(seed, n, with_zeros):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.softmax(4 * torch.randn(6, n, generator=gen, dtype=torch.float64), -1)
    if with_zeros:  # wiped-out experts: zero weight, still counted in N
        weights[:, 0] = 0.0
        weights = weights / weights.sum(-1, keepdim=True)
    reference = torch.distributions.Categorical(probs=weights).entropy() / math.log(n)
    torch.testing.assert_close(normalized_entropy(weights), reference, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(mean_normalized_entropy(weights), reference.mean(), rtol=1e-12, atol=1e-14)


def test_normalized_entropy_extremes_and_nan():
    n = 7
    f64 = dict(dtype=torch.float64)
    weights = torch.stack([torch.full((n,), 1.0 / n, **f64), torch.eye(n, **f64)[3], torch.full((n,), math.nan, **f64)])
    h = normalized_entropy(weights)
    assert h[0] == pytest.approx(1.0, abs=1e-15) and h[1] == 0.0 and math.isnan(h[2])
    assert math.isnan(mean_normalized_entropy(weights))  # a NaN is flagged, never averaged away


def test_normalized_entropy_rejects_what_is_not_a_mixture():
    with pytest.raises(ValueError, match="softmax"):
        normalized_entropy(torch.randn(3, 5))  # alpha passed by mistake
    with pytest.raises(ValueError, match="N >= 2"):
        normalized_entropy(torch.ones(4, 1))


# Normal cells as published (the DARTS repository's genotypes.py and XNAS's released genotype).
DARTS_V2 = Genotype(
    normal=[("sep_conv_3x3", 0), ("sep_conv_3x3", 1), ("sep_conv_3x3", 0), ("sep_conv_3x3", 1),
            ("sep_conv_3x3", 1), ("skip_connect", 0), ("skip_connect", 0), ("dil_conv_3x3", 2)],
    normal_concat=[2, 3, 4, 5],
    reduce=[("max_pool_3x3", 0), ("max_pool_3x3", 1), ("skip_connect", 2), ("max_pool_3x3", 1),
            ("max_pool_3x3", 0), ("skip_connect", 2), ("skip_connect", 2), ("max_pool_3x3", 1)],
    reduce_concat=[2, 3, 4, 5],
)
XNAS_NORMAL = [("sep_conv_3x3", 1), ("skip_connect", 0), ("sep_conv_3x3", 0), ("sep_conv_3x3", 2),
               ("sep_conv_3x3", 3), ("sep_conv_3x3", 1), ("dil_conv_5x5", 4), ("sep_conv_3x3", 0)]
NASNET_NORMAL = [("sep_conv_5x5", 1), ("sep_conv_3x3", 0), ("sep_conv_5x5", 0), ("sep_conv_3x3", 0),
                 ("avg_pool_3x3", 1), ("skip_connect", 0), ("avg_pool_3x3", 0), ("avg_pool_3x3", 0),
                 ("sep_conv_3x3", 1), ("skip_connect", 1)]
AMOEBA_NORMAL = [("avg_pool_3x3", 0), ("max_pool_3x3", 1), ("sep_conv_3x3", 0), ("sep_conv_5x5", 2),
                 ("sep_conv_3x3", 0), ("avg_pool_3x3", 3), ("sep_conv_3x3", 1), ("skip_connect", 1),
                 ("skip_connect", 0), ("avg_pool_3x3", 1)]


@pytest.mark.parametrize(
    "cell, concat, table4",
    [(DARTS_V2.normal, DARTS_V2.normal_concat, 0.625), (XNAS_NORMAL, range(2, 6), 1.375),
     (NASNET_NORMAL, [2, 3, 4, 5, 6], 0.4), (AMOEBA_NORMAL, [4, 5, 6], 0.9)],
)
def test_cell_depth_reproduces_table4(cell, concat, table4):
    assert cell_depth(cell, concat) == pytest.approx(table4, abs=1e-12)


def test_cell_depth_of_genotypes():
    assert cell_depth(DARTS_V2) == pytest.approx({"normal": 0.625, "reduce": 1.125})  # (0+1+2+1+0+2+2+1) / 8
    mixed = MixedGenotype(normal=[("sep_conv_3x3", 0, 2), ("skip_connect", 2, 3), ("avg_pool_3x3", 1, 3)],
                          normal_concat=[2, 3], reduce=[], reduce_concat=[2, 3])
    assert cell_depth(mixed) == {"normal": 1.0}


def test_cell_depth_rejects_malformed_cells():
    with pytest.raises(ValueError, match=r"input node must be an integer in \[0, 2\)"):
        cell_depth([("sep_conv_3x3", 2), ("skip_connect", 0)])
    with pytest.raises(ValueError, match="concat names nodes"):
        cell_depth(DARTS_V2.normal, [2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="empty"):
        cell_depth([])


def test_regret_is_a_primitive_layer():
    """CONTRIBUTING's layers: nasdiag.regret imports neither probe, search, record, plot nor cli."""
    import subprocess
    import sys

    code = ("import sys, nasdiag.regret; "
            "print(sorted(m for m in sys.modules if m.split('.')[1:2] in "
            "(['probe'], ['search'], ['record'], ['plot'], ['cli']) and m.startswith('nasdiag.')))")
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert out.stdout.strip() == "[]"
