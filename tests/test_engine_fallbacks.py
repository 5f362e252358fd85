"""The fast engine falls back to the eager modules where its plan does not apply, instead of crashing.

References are the eager modules of a deep copy (``set_engine("eager")``), float64.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian._hvp import batch_statistics_only
from nasdiag.supernet import Network
from nasdiag.supernet.engine import why_not_fast

DT = torch.float64


def _pair():
    torch.manual_seed(0)
    eager = Network(4, 3, 3, in_channels=1, steps=2, multiplier=2, alpha_init_scale=1.0).to(DT).set_engine("eager")
    return eager, copy.deepcopy(eager).set_engine("fast")


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 1, 8, 8, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)


def test_per_edge_weight_lists_run_on_the_eager_modules():
    eager, fast = _pair()
    x, y = _batch()
    z = fast.softmax_weights()
    per_edge = [[z[c.cell_type][e].detach().clone().requires_grad_(True) for e in range(len(c.edges))] for c in fast.cells]
    reason = why_not_fast(fast, x, per_edge)  # crashed on list.dim() before
    assert reason is not None and "per edge" in reason
    ref = [[w.detach().clone().requires_grad_(True) for w in cell] for cell in per_edge]
    F.cross_entropy(fast(x, per_edge), y).backward()
    F.cross_entropy(eager(x, ref), y).backward()
    for got, want in zip(sum(per_edge, []), sum(ref, [])):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


def test_batchnorm_switched_to_batch_statistics_after_the_plan_runs_eager():
    eager, fast = _pair()
    x, y = _batch()
    fast(x), eager(x)  # the fast plan is built and cached with running statistics on
    before = {k: v.clone() for k, v in fast.named_buffers()}
    with batch_statistics_only(fast), batch_statistics_only(eager):
        assert "running statistics are off" in why_not_fast(fast, x, list(fast.softmax_weights().values()))
        out = fast(x)  # crashed in the stale plan (a BatchNorm it no longer recognised) before
        torch.testing.assert_close(out, eager(x), rtol=1e-10, atol=1e-12)
        # and the same forward differentiated by torch.func (what the exact Hessian products run)
        alpha = {n: p.detach() for n, p in fast.named_parameters() if n.startswith("alphas")}

        def loss(net):
            return lambda a: F.cross_entropy(torch.func.functional_call(net, a, (x,)), y)

        got, want = torch.func.grad(loss(fast))(alpha), torch.func.grad(loss(eager))(alpha)
        for n in alpha:
            torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)
    for k, v in fast.named_buffers():
        assert torch.equal(v, before[k]), k  # nothing was updated while the statistics were off
    assert all(m.track_running_stats for m in fast.modules() if isinstance(m, nn.BatchNorm2d))
