"""Genotype derivation on hand-made weights."""

import pytest
import torch

from nasdiag.supernet import DARTS_PRIMITIVES, Genotype, derive_cell, derive_genotype, derive_mixed_cell, edge_nodes

P = list(DARTS_PRIMITIVES)


def weights_with(entries, steps=2, fill=0.01):
    """(E, K) weights that are ``fill`` except ``entries``: {(i, j, op): value}."""
    nodes = edge_nodes(steps)
    w = torch.full((len(nodes), len(P)), fill)
    for (i, j, op), value in entries.items():
        w[nodes.index((i, j)), P.index(op)] = value
    return w


def test_darts_rule_picks_top2_edges_and_best_non_none_op():
    w = weights_with({
        # node 2: edges from 0 and 1 (both kept, stronger first)
        (0, 2, "sep_conv_3x3"): 0.3, (1, 2, "max_pool_3x3"): 0.5,
        # node 3: the strongest op on edge 0->3 is none, which is ignored; 2->3 and 1->3 win
        (0, 3, "none"): 0.9, (0, 3, "skip_connect"): 0.05,
        (1, 3, "dil_conv_5x5"): 0.2, (2, 3, "avg_pool_3x3"): 0.4,
    })
    assert derive_cell(w, 2, P) == [
        ("max_pool_3x3", 1), ("sep_conv_3x3", 0),
        ("avg_pool_3x3", 2), ("dil_conv_5x5", 1),
    ]


def test_derive_genotype_per_cell_type_and_concat():
    normal = weights_with({(0, 2, "skip_connect"): 1.0, (1, 2, "skip_connect"): 0.9, (2, 3, "sep_conv_5x5"): 1.0, (0, 3, "sep_conv_3x3"): 0.8})
    reduce = weights_with({(0, 2, "max_pool_3x3"): 1.0, (1, 2, "avg_pool_3x3"): 0.9, (1, 3, "max_pool_3x3"): 1.0, (2, 3, "skip_connect"): 0.8})
    g = derive_genotype({"normal": normal, "reduce": reduce}, steps=2, multiplier=2, primitives=P)
    assert isinstance(g, Genotype)
    assert g.normal == [("skip_connect", 0), ("skip_connect", 1), ("sep_conv_5x5", 2), ("sep_conv_3x3", 0)]
    assert g.reduce == [("max_pool_3x3", 0), ("avg_pool_3x3", 1), ("max_pool_3x3", 1), ("skip_connect", 2)]
    assert g.normal_concat == g.reduce_concat == [2, 3]


def test_ties_break_towards_lower_index():
    w = torch.full((5, 8), 0.125)
    assert derive_cell(w, 2, P) == [("skip_connect", 0), ("skip_connect", 1), ("skip_connect", 0), ("skip_connect", 1)]


def test_mixed_path_rule_keeps_nonzero_or_above_threshold():
    w = torch.zeros(5, 8)
    w[0, P.index("sep_conv_3x3")] = 0.7
    w[0, P.index("skip_connect")] = -0.2  # linear weights may be negative: |w| counts
    w[4, P.index("avg_pool_3x3")] = 0.05
    w[3, P.index("none")] = 0.9  # none is never kept
    assert derive_mixed_cell(w, 2, P) == [("skip_connect", 0, 2), ("sep_conv_3x3", 0, 2), ("avg_pool_3x3", 2, 3)]
    assert derive_mixed_cell(w, 2, P, threshold=0.1) == [("skip_connect", 0, 2), ("sep_conv_3x3", 0, 2)]


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="shape"):
        derive_cell(torch.zeros(14, 8), 2, P)
    with pytest.raises(ValueError, match="threshold"):
        derive_mixed_cell(torch.zeros(5, 8), 2, P, threshold=-1)
