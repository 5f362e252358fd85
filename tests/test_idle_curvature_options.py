"""An option of ``arch_diag_hessian`` that the chosen mode does not use is refused, not silently ignored:
``samples`` drives only ``ggn_mc``'s draws, ``seed`` those and ``hutchinson:<k>``'s probes, ``max_memory`` only the
modes that batch Hessian-vector products. A mode that uses the option takes it (a different seed gives other draws)."""

import pytest
import torch
import torch.nn.functional as F

from nasdiag.hessian import CurvatureError, arch_diag_hessian
from nasdiag.supernet import Network


@pytest.fixture(scope="module")
def cell():
    torch.manual_seed(0)
    net = Network.minimal(4, 3, 1, in_channels=2).double()
    return net, torch.randn(4, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))


@pytest.mark.parametrize("mode, option, used_by", [
    ("diag", dict(samples=4), "'ggn_mc'"),
    ("approx", dict(seed=1), "'ggn_mc', 'hutchinson:<k>'"),
    ("ggn", dict(samples=2), "'ggn_mc'"),
    ("ggn_mc", dict(max_memory=2**30), "'exact', 'exact_per_edge', 'hutchinson:<k>'"),
    ("exact", dict(seed=3), "'ggn_mc', 'hutchinson:<k>'"),
    ("hutchinson:2", dict(samples=2), "'ggn_mc'"),
])
def test_an_option_the_mode_does_not_use_is_refused(cell, mode, option, used_by):
    net, x, y = cell
    (name, _), = option.items()
    with pytest.raises(CurvatureError, match=rf"{name}= does nothing in mode='{mode}'; it applies to mode {used_by}"):
        arch_diag_hessian(net, F.cross_entropy, x, y, net.edge_specs(), mode=mode, **option)


def test_a_mode_takes_the_options_it_uses(cell):
    net, x, y = cell
    edges = net.edge_specs()
    one = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="ggn_mc", samples=2, seed=1)
    other = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="ggn_mc", samples=2, seed=2)
    assert any(not torch.equal(one[e], other[e]) for e in one)  # the seed reaches the draws
    probes = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="hutchinson:1", seed=1, max_memory=2**32)
    assert set(probes) == set(one)
