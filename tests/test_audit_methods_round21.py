"""Audit round 21 of the search methods (BayesNAS, SparseNAS, ASM-NAS, the step contract of nasdiag/search/base.py):
several consecutive steps of nasdiag's methods checked against the docs' stated contracts and this file's own
arithmetic; no nasdiag helper computes a reference.

Defects these tests found (each fails without its fix):

- BayesNAS observed the cost of the first op of a removed edge (every op pruned; the supernet computes that op at
  Z = 0 so that the edge's output is defined) into ``cost/<cell>/{mean,var,count}``: the pruned op was recorded with a
  count and a mean where docs/bayesnas.md says a pruned op's cost statistics have count 0 and mean NaN. The cost
  service takes the ops to observe (``observed=``, default ``active``) and BayesNAS passes its switches
  (test_bayesnas_records_no_cost_of_the_pruned_first_op_of_a_removed_edge).
"""

from __future__ import annotations

import math

import torch

from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network

B = 6


def _batches(n, seed=1, classes=5):
    g = torch.Generator().manual_seed(seed)
    one = lambda: (torch.randn(B, 1, 8, 8, generator=g, dtype=torch.float64),  # noqa: E731
                   torch.randint(0, classes, (B,), generator=g))
    return [(one(), one()) for _ in range(n)]


def _bayesnas(steps_per_epoch=3, **hp):
    cls = get_method("bayesnas")
    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, primitives=cls.primitives).double()
    return cls(net, cls.Hyperparameters(**hp), schedule=Schedule(epochs=2, steps_per_epoch=steps_per_epoch, batch_size=B))


def test_bayesnas_records_no_cost_of_the_pruned_first_op_of_a_removed_edge():
    m = _bayesnas()
    # a state with edge 1 of the normal cell removed (every op switched off) and one more op pruned, as an earlier
    # update leaves it: switches off, w = 0 (step 5)
    alive = m.alive["normal"].clone()
    alive[1] = False
    alive[3, 2] = False
    m.alive = {**m.alive, "normal": alive}
    with torch.no_grad():
        m.network.alphas()["normal"][~alive] = 0
    steps = 2
    for train, val in _batches(steps):
        m.step(train, val)
    d = m.diagnostics()
    count, mean = d["cost/normal/count"], d["cost/normal/mean"]
    # docs/bayesnas.md: "A pruned op is not computed, so its per-epoch cost statistics have count 0 and mean NaN"
    assert count[~alive].tolist() == [0] * int((~alive).sum())
    assert bool(torch.isnan(mean[~alive]).all())
    assert count[alive].tolist() == [steps] * int(alive.sum())  # the normal cell is one cell: one observation a step
    assert bool(torch.isfinite(mean[alive]).all())
    assert d["cost/reduce/count"].eq(2 * steps).all()  # nothing pruned there (2 cells)
