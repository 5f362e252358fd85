"""Audit round 11 of the search methods: the "runs and methods" and "search methods" contracts against an auditor's
own float64 arithmetic (references written here from the papers and plain torch; no nasdiag helper computes one).

Defects these tests found (each fails without its fix):

- every method recorded ``scalars/w_lr`` (and SparseNAS ``sparsity/lambda``) as a float32 tensor, so a float64 run
  stored its learning rate rounded to 24 bits (0.013 as 0.013000000268…) and a λ past 3.4e38 as inf, although the
  vocabulary's ``float32`` means the run's float dtype (docs/schema.md).
"""

from __future__ import annotations

import math

import pytest
import torch

from nasdiag.search import Schedule, get_method
from nasdiag.search.registry import available_methods
from nasdiag.supernet import Network

CLASSES = 3
PRIMS = ("none", "skip_connect", "max_pool_3x3", "sep_conv_3x3")


def _net(cls, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    prims = cls.primitives[:4] if cls.primitives else PRIMS
    return Network(4, CLASSES, 3, steps=2, multiplier=2, in_channels=1, primitives=prims).to(dtype)


def _batches(n, seed, B=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, 1, 6, 6, generator=g, dtype=dtype), torch.randint(0, CLASSES, (B,), generator=g))
            for _ in range(n)]


def _cosine(lr0, lr_min, epoch, epochs):
    return lr_min + (lr0 - lr_min) * (1 + math.cos(math.pi * epoch / epochs)) / 2


# -- the recorded host numbers are in the run's dtype -----------------------------------------------------------
@pytest.mark.parametrize("name", sorted(available_methods()))
def test_the_recorded_learning_rate_is_the_rate_of_the_step_in_the_runs_dtype(name):
    """After an epoch end of a 3-epoch run, w's rate is the cosine value lr_min + (lr0 − lr_min)(1 + cos(π/3))/2, which
    float32 cannot hold. The step's ``scalars/w_lr`` is that number in float64 (to the last bits of the cosine's
    recursion, 4 ulp) in a float64 run, and float32 in a float32 run (the vocabulary's float32 = the run's dtype)."""
    cls = get_method(name)
    h = cls.Hyperparameters()
    data = _batches(4, 3)
    net = _net(cls)
    method = cls(net, h, schedule=Schedule(epochs=3, steps_per_epoch=1, batch_size=4))
    method.step(*data[:2])
    method.epoch_end(0)
    stats = method.step(*data[2:])
    want = _cosine(h.w_lr, h.w_lr_min, 1, 3)
    assert float(torch.tensor(want, dtype=torch.float32)) != want  # the comparison below can fail
    assert stats["scalars/w_lr"].dtype == torch.float64
    assert float(stats["scalars/w_lr"]) == pytest.approx(want, rel=1e-15, abs=0)
    small = cls(_net(cls, dtype=torch.float32), h, schedule=Schedule(epochs=3, steps_per_epoch=1, batch_size=4))
    x, y = _batches(1, 4, dtype=torch.float32)[0]
    assert small.step((x, y), (x, y))["scalars/w_lr"].dtype == torch.float32


def test_sparsenas_records_its_progressive_lambda_in_the_runs_dtype():
    """λ = lambda_step · (epochs done + 1) (sparse-supernet "pathwise" λ): after one epoch end, 2·0.03 = 0.06 in float64,
    and a λ beyond float32's range (lambda_step = 1e300) is the finite number it is, not inf."""
    cls = get_method("sparsenas")
    data = _batches(4, 5)
    for step, want in ((0.03, 0.06), (1e300, 2e300)):
        method = cls(_net(cls), cls.Hyperparameters(lambda_step=step, first_order=True),
                     schedule=Schedule(epochs=3, steps_per_epoch=1, batch_size=4))
        method.step(*data[:2])
        method.epoch_end(0)
        lam = method.step(*data[2:])["sparsity/lambda"]
        assert lam.dtype == torch.float64 and float(lam) == want
