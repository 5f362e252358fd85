"""Round 22 audit of the XNAS search method (nasdiag/search/methods/xnas.py) end to end.

The step was compared with a float64 transcription of Algorithm 1 on the tiny supernet (rewards
R = −∇_p ℓ_val · f_i from the edge outputs p and op outputs f_i, EG step, wipeout, SGD on w): every
recorded tensor agreed to ≤ 3e-13 (see the round-22 report). What follows is a defect found on the way."""

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
