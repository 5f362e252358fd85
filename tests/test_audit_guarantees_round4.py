"""Audit round 4: the public API's cross-cutting guarantees — no hooks left behind, the model as it was after any
failure, no growth across steps, a NaN recorded and flagged (never blamed on the model, never hidden), thread safety.

Every reference is built here in float64: the model's full state snapshotted before a call (module and global hooks,
attributes, parameters and their ``.grad`` objects, buffers, train/eval and BatchNorm flags, grad mode, the global
random stream) and compared after it; ∂L/∂Z by autograd on leaf mixing weights; the same calls run one after the other
as the reference for two threads.

Defects found (each test says which):

* a NaN batch or an inf weight at the first recorded step was a ``ProbeError`` saying the edge's output "is not
  Σ_k w_k·op_k(x) ... (relative deviation nan)" and asking to re-map the edge: the step's NaN costs were lost and the
  model blamed (``test_a_nan_batch_or_inf_weight_at_the_first_step_is_recorded_as_nan_like_autograd``);
* the path split's node check passed on a NaN deviation and was then marked done, so a node that is not the plain sum
  of its edges (PC-DARTS's β) gave silent path parts at every later step
  (``test_checks_skipped_at_a_nan_step_run_at_the_next_finite_step``).
"""

import math
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.modules.module as torch_module
from torch import nn

import nasdiag
from nasdiag.probe import ProbeError
from nasdiag.supernet import Network
from nasdiag.supernet.cell import Cell

DT = torch.float64
PRIMITIVES = ("none", "skip_connect", "avg_pool_3x3", "sep_conv_3x3")


def supernet(seed=0, steps=1):
    torch.manual_seed(seed)
    net = Network(C=2, num_classes=3, layers=2, steps=steps, multiplier=steps, in_channels=1, stem_multiplier=1,
                  primitives=PRIMITIVES, reductions=(1,)).to(DT).train()
    return net, torch.randn(3, 1, 4, 4, dtype=DT), torch.randint(0, 3, (3,))


def autograd_costs(net, x, y):
    """∂L/∂Z per edge by autograd: each cell's (E, K) weights as a leaf of its own."""
    weights = net.softmax_weights()
    leaves = [weights[c.cell_type].detach().clone().requires_grad_() for c in net.cells]
    grads = torch.autograd.grad(F.cross_entropy(net(x, leaves), y), leaves)
    return {f"cells.{i}.edges.{e}": g[e] for i, g in enumerate(grads) for e in range(g.shape[0])}


# -- NaN: recorded and flagged, never blamed on the model --------------------------------------------------------


@pytest.mark.parametrize("case", ["nan_batch", "inf_weight"])
def test_a_nan_batch_or_inf_weight_at_the_first_step_is_recorded_as_nan_like_autograd(case):
    """Before: ProbeError "its output is not Σ_k w_k·op_k(x) ... (relative deviation nan)": the weighted-sum check
    compared NaN with its tolerance, so a diverged model or a NaN batch was blamed on the edge mapping."""
    net, x, y = supernet()
    if case == "nan_batch":
        x[0, 0, 0, 0] = math.nan
    else:
        with torch.no_grad():
            net.stem[0].weight[0, 0, 0, 0] = math.inf
    want = autograd_costs(net, x, y)
    probe = nasdiag.attach(net)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    with pytest.warns(RuntimeWarning, match="NaN cost"):
        got = probe.costs()
    assert any(bool(torch.isnan(v).any()) for v in want.values())
    for name, value in want.items():  # 'none' (op 0) is left out of the graph: autograd's structural 0 is 0·NaN here
        torch.testing.assert_close(got[name][1:], value[1:], rtol=1e-12, atol=1e-14, equal_nan=True)
    with pytest.warns(RuntimeWarning, match="hold NaN"):
        stats = probe.statistics()
    assert all(bool(torch.from_numpy(stats[f"cost/{t}/count"]).eq(1).all()) for t in ("normal", "reduce"))
    assert torch.from_numpy(stats["cost/normal/mean"]).isnan().any()


class Doubled(nn.Module):
    """Not a mixed op of its weights: 2 Σ_k w_k op_k(x)."""

    def __init__(self):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(3, 3), nn.Tanh()])

    def forward(self, x, w):
        return 2 * sum(w[k] * op(x) for k, op in enumerate(self.ops))


class Bent(nn.Module):
    """Not a mixed op of its candidates: relu of their sum lies outside their span."""

    def __init__(self):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(3, 3), nn.Tanh()])

    def forward(self, x):
        return torch.relu(self.ops[0](x) - self.ops[1](x))


class UserNet(nn.Module):
    def __init__(self, edge):
        super().__init__()
        self.edge, self.head = edge, nn.Linear(3, 2)
        self.z = nn.Parameter(torch.tensor([0.4, 0.6]))

    def forward(self, x):
        h = self.edge(x, self.z) if isinstance(self.edge, Doubled) else self.edge(x)
        return self.head(h)


def beta_scaled_cell_forward(cell):
    """DARTS's cell with PC-DARTS's edge normalisation β = 0.5 at every node: no node is the plain sum of its edges."""

    def forward(s0, s1, weights):
        states = [cell.preprocess0(s0), cell.preprocess1(s1)]
        offset = 0
        for _ in range(cell.steps):
            states.append(sum(0.5 * cell.edges[offset + i](h, weights[offset + i]) for i, h in enumerate(states)))
            offset += len(states) - 1
        return torch.cat(states[-cell.multiplier:], dim=1)

    return forward


@pytest.mark.parametrize("model", ["weighted_sum", "span", "path_split_node"])
def test_checks_skipped_at_a_nan_step_run_at_the_next_finite_step(model):
    """A NaN step decides nothing about the model's structure: no error there (its costs are NaN, flagged), and the
    check is made at the next finite step. Before: the weighted-sum and span checks raised at the NaN step; the path
    split's node check passed on the NaN deviation and was never made again (silent parts under β at every step)."""
    torch.manual_seed(0)
    if model == "path_split_node":
        net, x, y = supernet(steps=2)
        for cell in net.cells:
            cell.forward = beta_scaled_cell_forward(cell)
        probe, match = nasdiag.attach(net, path_split=True), "path_split needs node"
    else:
        edge = Doubled() if model == "weighted_sum" else Bent()
        net = UserNet(edge).to(DT)
        x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
        probe = nasdiag.attach(net, edges={"e": (edge, list(edge.ops))})
        match = "is not Σ_k w_k·op_k" if model == "weighted_sum" else "is not a weighted sum"
    bad = x.clone()
    bad.view(-1)[0] = math.nan
    with probe.record():
        F.cross_entropy(net(bad), y).backward()
    with pytest.warns(RuntimeWarning, match="NaN cost"):
        assert any(bool(torch.isnan(v).any()) for v in probe.costs().values())
    with pytest.raises(ProbeError, match=match) as raised:
        with probe.record():
            F.cross_entropy(net(x), y).backward()
    assert "\n" not in str(raised.value)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())


# -- memory: nothing kept across steps ---------------------------------------------------------------------------


def live_tensors() -> int:
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))  # type(): no proxy lookups


@pytest.mark.parametrize("case", ["layer_norm_training_steps", "batch_norm_curvature_calls"])
def test_a_supernet_the_fast_engine_cannot_batch_keeps_nothing_across_steps(case):
    """Before: the fast engine cached its Unsupported exception and raised that one object at every forward, so each
    raise chained the forward's frames onto its traceback: every step's batch, logits and mixing weights stayed alive
    (5 tensors a step on a LayerNorm or conv-bn-relu supernet; two curvature calls in a row under train-mode BatchNorm,
    whose flag switch the engine does not batch, the same)."""
    from nasdiag.hessian import hessian_eigenvalues

    torch.manual_seed(0)
    if case == "layer_norm_training_steps":
        net = Network(C=2, num_classes=3, layers=2, steps=1, multiplier=1, in_channels=1, stem_multiplier=1,
                      primitives=PRIMITIVES, reductions=(1,), norm="layer").to(DT)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        def step():
            x, y = torch.randn(3, 1, 4, 4, dtype=DT), torch.randint(0, 3, (3,))
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    else:
        net, x, y = supernet()

        def step():
            hessian_eigenvalues(net, F.cross_entropy, x, y, params=net.arch_parameters(), method="power", iters=2)

    for _ in range(3):
        step()
    before = live_tensors()
    for _ in range(10):
        step()
    assert live_tensors() == before
