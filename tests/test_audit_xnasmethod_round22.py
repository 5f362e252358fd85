"""Round 22 audit of the XNAS search method (nasdiag/search/methods/xnas.py) end to end.

The step was compared with a float64 transcription of Algorithm 1 on the tiny supernet (rewards
R = −∇_p ℓ_val · f_i from the edge outputs p and op outputs f_i, EG step, wipeout, SGD on w): every
recorded tensor agreed to ≤ 4e-13 (see the round-22 report). Below: the one defect found (the clip fraction's
denominator) and a one-step check of what p and f_i are in the supernet (rewards from the edge outputs)."""

from __future__ import annotations

import math

import torch

from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network

PRIMITIVES = ["none", "skip_connect", "avg_pool_3x3", "sep_conv_3x3"]


def _batch(g):
    return torch.randn(4, 1, 4, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)


def test_reward_clip_fraction_is_over_the_finite_rewards_of_alive_experts():
    """``scalars/reward_clip_fraction`` is documented as the fraction of the step's *finite* rewards of alive
    experts that were clipped; a NaN cost on one edge (that edge sits the round out) must leave the denominator.
    Before the fix the NaN rewards were counted in it: 0.70 (42 of 60) instead of 0.75 (42 of 56)."""
    cls = get_method("xnas")
    L = 1e-3

    class NanEdge(cls):
        def rewards(self, per_cell):
            out = super().rewards(per_cell)
            out["normal"][:, 2] = math.nan  # edge 2 of the normal cell: every op's cost NaN (finite val loss)
            return out

    torch.manual_seed(0)
    net = Network(2, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=PRIMITIVES).double()
    method = NanEdge(net, cls.Hyperparameters(reward_bound=L), schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=4))
    g = torch.Generator().manual_seed(1)
    stats = method.step(_batch(g), _batch(g))
    assert bool(stats["regret/normal/nonfinite"][2]) and int(stats["regret/normal/nonfinite"].sum()) == 1
    clipped = counted = 0
    for t in ("normal", "reduce"):
        r = stats[f"regret/{t}/rewards"]  # (cells, E, K) as the forecaster got them (clipped to [-L, L])
        alive = torch.ones(r.shape[1:], dtype=torch.bool)  # first step: every expert alive, every op computed
        finite = torch.isfinite(r) & alive
        counted += int(finite.sum())
        # clipped to exactly ±L: the reference counts the rewards that sit on the bound (the raw ones are > L here)
        clipped += int((finite & (r.abs() == L)).sum())
    assert counted == 5 * 4 * 1 - 4 + 5 * 4 * 2  # the NaN edge's 4 rewards are not finite rewards
    want = clipped / counted
    assert want > 0.5
    assert float(stats["scalars/reward_clip_fraction"]) == want


def test_rewards_are_minus_the_edge_output_gradient_dotted_with_each_op_output():
    """Algorithm 1 line 8 with eq 1's p and f_i in the supernet: p is an edge's output Σ_i u_i f_i, f_i the output of
    its op i, and R_i = −∇_p ℓ_val · f_i with ℓ_val the val batch's mean loss at the step's u (after the w step).
    Reference: autograd's gradient at the edge outputs of an eager forward (hooks), not the cost's ∂L/∂Z leaves;
    and the first EG step from v_0 = 1 is ln v = η R (eq 4's η with T = steps × cells of the type)."""
    import copy

    cls = get_method("xnas")
    torch.manual_seed(0)
    net = Network(2, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=PRIMITIVES).double()
    method = cls(net, cls.Hyperparameters(reward_bound=1e6), schedule=Schedule(epochs=1, steps_per_epoch=3, batch_size=4))
    g = torch.Generator().manual_seed(1)
    train, (x, y) = _batch(g), _batch(g)
    stats = method.step(train, (x, y))
    ref = copy.deepcopy(method.network).set_engine("eager")
    edge_out, op_out, handles = [], [], []

    def keep_edge_output(t, e):
        def hook(module, inputs, p):
            p.retain_grad()
            edge_out.append((t, e, p))
        return hook

    for cell in ref.cells:
        for e, edge in enumerate(cell.edges):
            handles.append(edge.register_forward_hook(keep_edge_output(cell.cell_type, e)))
            for k, op in enumerate(edge.ops):
                handles.append(op.register_forward_hook(lambda m, i, o, k=k: op_out.append((k, o.detach())) and None))
    try:
        u = {t: stats[f"arch/{t}/weights"] for t in ("normal", "reduce")}  # the step's mixing weights u_{t-1}
        torch.nn.functional.cross_entropy(ref(x, u), y).backward()
    finally:
        for h in handles:
            h.remove()
    K = len(PRIMITIVES)
    assert len(op_out) == K * len(edge_out)  # the ops of an edge run just before its output
    want = {"normal": [], "reduce": []}
    for n, (t, e, p) in enumerate(edge_out):
        fs = [f for _, f in op_out[n * K:(n + 1) * K]]
        want[t].append(torch.stack([-(p.grad * f).sum() for f in fs]))
    for t, r_c in (("normal", 1), ("reduce", 2)):
        R = torch.stack(want[t]).reshape(r_c, -1, K)  # one round per cell of the type, network order
        got = stats[f"regret/{t}/rewards"]
        assert got.abs().max() > 1e-4  # not vacuous
        torch.testing.assert_close(got, R, rtol=1e-10, atol=1e-14)
    eta = math.sqrt(2 * math.log(K) / (3 * 1 * 1e6 ** 2))  # normal: T = 3 steps × 1 cell, L = 1e6
    torch.testing.assert_close(stats["regret/normal/log_weights"], eta * stats["regret/normal/rewards"][0],
                               rtol=1e-12, atol=0.0)
