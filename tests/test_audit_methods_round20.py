"""Audit round 20 of the search methods (darts2's unrolled step, XNAS with several cells sharing its forecasters):
what rounds 13-19 did not reach, checked against this file's own arithmetic and state comparisons; no nasdiag
helper computes a reference.

Defects these tests found (each fails without its fix):

- darts2 (and SparseNAS's second-order step, which shares ``nasdiag.search.unrolled``) observed the rank MEAN of the
  costs at w' into its ``cost/<cell>/{mean,var,count}`` statistics, where nasdiag.distributed's batch convention (and
  every other method, through ``SearchMethod.cost``) observes each rank's own C_r = ∂L_r/∂Z: under DDP every rank
  pooled the same mean, so the recorded variance silently lost the spread between the ranks' batches (one rank's
  moments off by the other rank's share). ``FunctionalCost.per_cell`` is now this rank's costs; the α step still
  uses their rank mean (test_darts2_cost_statistics_are_each_ranks_own_costs_under_ddp, 2 gloo ranks, each checking
  its moments against its own autograd costs at its own transcription of w').
- darts2's (and SparseNAS's second-order) finite difference on a supernet with train-mode dropout: the forwards at
  w⁺ and w⁻ drew new masks from the global generator, so eq 13's difference was mask noise over 2ε, the
  hypergradient 90-99% off at DARTS's r = 0.01 and changing with r instead of converging; they now take the train
  forward's draws (eager path; docs/darts2.md says what a captured CUDA graph does)
  (test_darts2_finite_difference_differences_one_net_under_train_mode_dropout).

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
- by hand too: SNAS (τ halved per epoch) and DSNAS ``run()`` interrupted mid-epoch 3 and resumed equal the uninterrupted
  record in every path (temperature included); every method on supernets of one or two cells (one cell type only).

Noticed and left alone:

- nasdiag's DARTS Network on a batch of one: every op ends in an affine-free BatchNorm (or is a skip of one), whose
  output has zero spatial mean per channel with one sample, so the global pooling gives 0 and ∂L/∂α ≈ 1e-15 for every
  method: a property of DARTS's network (BatchNorm on one sample), not of the methods.
- α = −inf entries (a user masking ops): DARTS's and SNAS's Adam L2 decay turns them NaN at the first step (the
  DSNAS refusal then says the search diverged); α are real parameters, masking is not a documented use.
- DSNAS's RecordWarning for the NaN ``cost/<cell>/{mean,var}`` of ops never sampled: documented (vocabulary), only noisy.
- darts2's ``arch_gradient`` consumes the global generator's draws of its train and val forwards under dropout (its
  docstring lists weights, BatchNorm statistics and optimizers as the state it keeps).
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


# ------------------------------------------------------------------------------------- darts2's cost statistics
DARTS2_RANK = '''
import datetime, os, sys
import torch, torch.distributed as dist
from torch.func import functional_call
rank, port = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network

torch.manual_seed(0)
net = Network(2, 5, 3, steps=1, multiplier=1, in_channels=1).double()
M = get_method("darts2")
m = M(net, M.Hyperparameters(w_weight_decay=0.01), schedule=Schedule(epochs=1, steps_per_epoch=1, batch_size=3,
                                                                      world_size=2), seed=0)
m.distribute()
g = torch.Generator().manual_seed(11 + rank)  # each rank its own batches
train = torch.randn(3, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (3,), generator=g)
val = torch.randn(3, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (3,), generator=g)

# reference: w' = w - xi (mean over ranks of grad_w L_train + lambda w) (first step: no momentum buffer yet), then this
# rank's own C_r = dL_val,r(w')/dZ_k per cell k, by autograd at Z = softmax(alpha)
arch = {id(a) for a in net.arch_parameters()}
w = {n: p.detach().clone().requires_grad_(True) for n, p in net.named_parameters() if id(p) not in arch}
buffers = {n: b.clone() for n, b in net.named_buffers()}
Z = [torch.softmax(net.alphas()[c.cell_type].detach(), -1) for c in net.cells]
loss = torch.nn.functional.cross_entropy(functional_call(net, {**w, **buffers}, (train[0], Z)), train[1])
grads = torch.autograd.grad(loss, list(w.values()))
for t in grads:
    dist.all_reduce(t)
    t /= 2
xi, lam = m.hp.w_lr, m.hp.w_weight_decay
w1 = {n: (p - xi * (gr + lam * p)).detach() for (n, p), gr in zip(w.items(), grads)}
leaves = [z.clone().requires_grad_(True) for z in Z]
buffers = {n: b.clone() for n, b in net.named_buffers()}
val_loss = torch.nn.functional.cross_entropy(functional_call(net, {**w1, **buffers}, (val[0], leaves)), val[1])
own = torch.autograd.grad(val_loss, leaves)

m.step(train, val)
d = m.diagnostics()
for t in net.cell_types:
    rows = torch.stack([c for c, cell in zip(own, net.cells) if cell.cell_type == t])
    torch.testing.assert_close(d[f"cost/{t}/mean"], rows.mean(0), rtol=1e-9, atol=1e-12, msg=f"rank {rank} {t} mean")
    torch.testing.assert_close(d[f"cost/{t}/var"], rows.var(0, unbiased=False), rtol=1e-7, atol=1e-14,
                               msg=f"rank {rank} {t} var")
    assert (d[f"cost/{t}/count"] == len(rows)).all()
dist.destroy_process_group()
'''


def test_darts2_cost_statistics_are_each_ranks_own_costs_under_ddp(tmp_path):
    """nasdiag.distributed's batch convention: ``cost/<cell>/{mean,var,count}`` pool one observation per rank, step and
    cell, C_r = ∂L_r/∂Z of rank r's own mean loss (the α step uses their rank mean). Each of 2 gloo ranks checks the
    moments darts2 observed in its step against its own C_r at w' = w − ξ(rank-mean ∇_w L_train + λw), by autograd."""
    from conftest import free_port, launch_ranks

    script = tmp_path / "rank.py"
    script.write_text(DARTS2_RANK)
    port = free_port()
    launch_ranks(script, lambda r: [r, port], timeout=120)


# ------------------------------------------------------------------------------------- darts2 with dropout
def test_darts2_finite_difference_differences_one_net_under_train_mode_dropout():
    """A supernet with train-mode dropout (here after the stem) draws new masks in every forward. Eq 13's central
    difference [∇_α L_train(w⁺) − ∇_α L_train(w⁻)]/(2ε) is a derivative only if both forwards are the same net (the
    train forward's masks): with other masks it is mask noise over 2ε, and the hypergradient changes with r instead of
    converging. On a smooth net (every ReLU module tanh, eager engine) the second-order central difference converges as
    r², so g at r = 1e-2 and 1e-3 must agree with g at r = 1e-4 to about the docs/darts2.md smooth row (1.9e-4, 1.9e-6
    relative); 1e-2 and 1e-4 leave room for another net. Before the fix they differed by 90-99%."""
    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, affine=True,
                  primitives=("none", "skip_connect", "avg_pool_3x3")).double()
    for module in list(net.modules()):
        for name, child in module.named_children():
            if isinstance(child, torch.nn.ReLU):
                setattr(module, name, torch.nn.Tanh())
    net.set_engine("eager")
    net.stem = torch.nn.Sequential(*net.stem, torch.nn.Dropout(0.3))
    train, val = _batch(1, 6), _batch(2, 6)
    M = get_method("darts2")
    g = {}
    for r in (1e-2, 1e-3, 1e-4):
        m = M(copy.deepcopy(net), M.Hyperparameters(fd_eps_scale=r, w_lr=0.5),
              schedule=Schedule(epochs=2, steps_per_epoch=2))
        torch.manual_seed(5)  # the same masks for each r
        g[r] = m.arch_gradient(train, val)

    def rel(a, b):
        return float(torch.sqrt(sum(((a[t] - b[t]) ** 2).sum() for t in b)) / torch.sqrt(sum((b[t] ** 2).sum() for t in b)))

    assert rel(g[1e-2], g[1e-4]) < 1e-2
    assert rel(g[1e-3], g[1e-4]) < 1e-4
