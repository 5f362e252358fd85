"""Audit round 20 of the search methods (darts2's unrolled step, XNAS with several cells sharing its forecasters):
what rounds 13-19 did not reach, checked against this file's own arithmetic and state comparisons; no nasdiag
helper computes a reference.

Checked and found right (no defect):

- XNAS saved mid-epoch after wipeouts (two cells per type, so two EG rounds per step; L = 1e-4 so experts part and
  are removed inside the run, ζ = 0.3) and loaded by a fresh method on other initial weights continues bit-equal:
  weights, every recorded row (alive, wipeouts, log-weights, regret, bound), the genotype
  (test_xnas_saved_mid_epoch_after_wipeouts_continues_bit_equal). Round 19's resume test left XNAS out.
- darts2's ``arch_gradient`` (docs/darts2.md: "without changing any state") leaves the whole method state
  (weights, BatchNorm buffers, SGD momentum, Adam moments, generator, schedule) as it was, and the next step's row is
  bit-equal to that of a twin that never called it; its result is the hypergradient that step applies
  (test_darts2_arch_gradient_changes_no_state_and_is_what_the_next_step_applies).
- by hand on a scratch script (not kept, as earlier rounds test them): every method on a batch of one; a NaN in one
  search-train or search-val batch (darts2, snas, dsnas, proxyless, xnas raise SearchError with
  scalars/nonfinite_loss = 1 before the update that would use it; first-order DARTS lets α and w go NaN and stops at
  the epoch end's check, as docs/methods.md says); DSNAS and ProxylessNAS where every edge samples ``none``.

Noticed and left alone:

- nasdiag's DARTS Network on a batch of one: every op ends in an affine-free BatchNorm (or is a skip of one), whose
  output has zero spatial mean per channel with one sample, so the global pooling gives 0 and ∂L/∂α ≈ 1e-15 for every
  method: a property of DARTS's network (BatchNorm on one sample), not of the methods.
"""

from __future__ import annotations

import copy

import torch

from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network


def _net(seed, layers=3):
    torch.manual_seed(seed)
    return Network(4, 5, layers, steps=2, multiplier=2, in_channels=1).double()


def _batch(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def _assert_same(x, y, path="state"):
    """Bit-equality of nested state dicts (tensors, numbers, lists, dicts)."""
    if isinstance(x, dict):
        assert x.keys() == y.keys(), path
        for k in x:
            _assert_same(x[k], y[k], f"{path}/{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), path
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_same(u, v, f"{path}[{i}]")
    elif torch.is_tensor(x):
        assert torch.equal(x, y) or (x.is_floating_point() and x.isnan().all() and y.isnan().all()), path
    else:
        assert x == y, path


def test_xnas_saved_mid_epoch_after_wipeouts_continues_bit_equal():
    M = get_method("xnas")
    sched = Schedule(epochs=3, steps_per_epoch=3)
    h = M.Hyperparameters(reward_bound=1e-4, lr_scale=3.0, zeta=0.3)
    data = [(_batch(2 * k), _batch(2 * k + 1)) for k in range(9)]

    def run(m, steps):
        rows = []
        for k in steps:
            rows.append(m.step(*data[k]))
            if k % 3 == 2:
                m.epoch_end(k // 3)
        return rows

    a = M(_net(0, layers=4), h, schedule=sched, seed=3)
    assert a.replications == {"normal": 2, "reduce": 2}  # two rounds per step for each type
    run(a, range(4))  # mid-epoch 2
    wiped = sum(int((~f.alive).sum()) for f in a.forecasters.values())
    assert wiped > 0  # the state saved holds wiped-out experts
    state = copy.deepcopy(a.state_dict())
    rows_a = run(a, range(4, 9))
    assert sum(int((~f.alive).sum()) for f in a.forecasters.values()) > wiped  # and more go after the save
    b = M(_net(1, layers=4), h, schedule=sched, seed=3)  # other weights: everything must come from the state
    b.load_state_dict(state)
    rows_b = run(b, range(4, 9))
    for (n, p), (n2, q) in zip(a.network.named_parameters(), b.network.named_parameters()):
        assert n == n2 and torch.equal(p, q), n
    for ra, rb in zip(rows_a, rows_b):
        _assert_same(ra, rb, "row")
    assert a.genotype() == b.genotype()


def test_darts2_arch_gradient_changes_no_state_and_is_what_the_next_step_applies():
    M = get_method("darts2")

    def make():
        m = M(_net(0), M.Hyperparameters(w_weight_decay=0.05), schedule=Schedule(epochs=2, steps_per_epoch=2), seed=1)
        m.step(_batch(0), _batch(1))  # momentum buffers and Adam moments exist
        m.epoch_end(0)
        return m

    a, twin = make(), make()
    before = copy.deepcopy(a.state_dict())
    buffers = [t.clone() for t in a.network.buffers()]
    grads = [None if p.grad is None else p.grad.clone() for p in a.network.parameters()]
    g = a.arch_gradient(_batch(2), _batch(3))
    _assert_same(before, a.state_dict())
    assert all(torch.equal(u, v) for u, v in zip(buffers, a.network.buffers()))
    for old, p in zip(grads, a.network.parameters()):
        assert (old is None and p.grad is None) or torch.equal(old, p.grad)
    row_a, row_twin = a.step(_batch(2), _batch(3)), twin.step(_batch(2), _batch(3))
    _assert_same(row_a, row_twin, "row")
    # the α.grad the step applied (alpha_step sets it, the w step leaves α's alone) is the hypergradient returned
    for t, alpha in twin.network.alphas().items():
        torch.testing.assert_close(alpha.grad, g[t].to(alpha.dtype), rtol=0, atol=0)
