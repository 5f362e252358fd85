"""Audit round 19 of data parallelism: a rank whose batch is empty (the last batch of its shard with drop_last=False),
against references built here in float64 (autograd of our own mixed-op network with Z as an explicit leaf).

Found: a `Probe` step on an empty batch (every per-rank loop's last batch can be one when a shard is split by hand
with drop_last=False) has a NaN mean loss, yet ∂L/∂Z sums over no sample to 0: once the first steps' mixed-op check
is done, the step was observed as a cost of 0 (count 1 higher, the mean pulled toward 0, no flag: a silently wrong
mean, pooled so across the ranks); at the first step it was torch's ``max(): Expected reduction dim`` traceback from
inside the check. It is one ProbeError line at the forward now, before anything is observed. `reduce_statistics`'s
``ddof`` was not checked: under DDP ``'1'`` or None was numpy's traceback after the collectives and -1 or 1.5 pooled a
variance silently (a single process ignored it), and a RecorderCallback took it until its first reduction; a
ReductionError / RecordError line at the call now.

Checked and found right in scratch, not kept (2 gloo ranks; references numpy on the concatenated samples): pooled
mean/var (ddof 0 and 1, data at 1e6 ± 1) with rank 1 empty (count 0, mean and var NaN) and with rank 1 holding one
sample under ddof 1 (its var NaN) equal numpy's on the concatenated samples exactly or to 1e-16, counts summed, min/max
exact with the empty rank's ±inf; ``rows=True`` with per-row counts, one row empty on a rank, alike; values of zero
size (float, int ``sum``, bool, a pooled triple of zero rows) and an empty mapping come back unreduced, no collective
mismatch. The runner's sharding (rank r takes every R-th sample of the epoch's order, full batches only, S = 0
refused in one line) gives rank batches whose union is the single process's batch of R·B; the spectrum, XNAS's
forecaster and BayesNAS's curvature under DDP are covered by tests/test_audit_ddp_round3.py and
tests/test_search_ddp_methods.py (read, not repeated); unrolled.py averages ∇_w L_train, ∇_{w'} L_val and the costs
over ranks before the finite difference (read). After a refused empty step ``probe.hessian()`` refuses as after any
block whose body raised, and the statistics keep the earlier steps (checked above).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.errors import NasdiagError

D = torch.float64


class Mixed(nn.Module):
    """A DARTS-convention mixed op (candidates ``_ops``, forward ``(x, weights)``), weights (K,)."""

    def __init__(self, d: int):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(d, d), nn.Sequential(nn.Sigmoid(), nn.Linear(d, d, bias=False)), nn.Identity()])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class Net(nn.Module):
    """LayerNorm (samples decouple), two mixed edges in a chain; Z (2, 3) given explicitly or softmax(α)."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.stem, self.norm = nn.Linear(3, d), nn.LayerNorm(d)
        self.edges = nn.ModuleList([Mixed(d), Mixed(d)])
        self.alpha = nn.Parameter(torch.randn(2, 3))
        self.head = nn.Linear(d, 5)

    def forward(self, x, Z=None):
        Z = F.softmax(self.alpha, -1) if Z is None else Z
        h = self.norm(self.stem(x))
        for e, mixed in enumerate(self.edges):
            h = torch.tanh(mixed(h, Z[e]))
        return self.head(h)


def _net() -> Net:
    torch.manual_seed(3)
    return Net().to(D)


def _batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=D), torch.randint(0, 5, (n,), generator=g)


def _own_cost(net: Net, x, y) -> torch.Tensor:
    """C = ∂L/∂Z of the batch-mean cross-entropy at Z = softmax(α), Z a leaf of its own: (E, K)."""
    Z = F.softmax(net.alpha, -1).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(F.cross_entropy(net(x, Z), y), Z)
    return grad


def _hooks(net: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in net.modules())


@pytest.mark.parametrize("first", [False, True], ids=["after_a_step", "first_step"])
def test_a_probe_step_on_an_empty_rank_batch_is_one_line_and_observes_nothing(first):
    net = _net()
    probe = nasdiag.attach(net)
    x, y = _batch(6, seed=1)
    observed = []
    if not first:
        with probe.record():
            F.cross_entropy(net(x), y).backward()
        observed.append(_own_cost(net, x, y))
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()}
    hooks = _hooks(net)
    with pytest.raises(NasdiagError) as err:
        with probe.record():
            F.cross_entropy(net(x[:0]), y[:0]).backward()  # before: NaN loss, costs 0 observed (or a torch traceback)
    message = str(err.value)
    assert "\n" not in message and "no samples" in message, message
    assert _hooks(net) == hooks  # the block's hooks are gone
    for n, p in net.named_parameters():  # no gradient accumulated by the refused step
        assert (p.grad is None) if grads[n] is None else torch.equal(p.grad, grads[n]), n
    # the next step on samples is recorded as if the empty one never was: the mean over the observed steps only
    x2, y2 = _batch(4, seed=2)
    with probe.record():
        F.cross_entropy(net(x2), y2).backward()
    observed.append(_own_cost(net, x2, y2))
    stats = probe.statistics()
    mean = torch.stack(observed).mean(0)
    (group,) = [p.rsplit("/", 1)[0] for p in stats if p.endswith("/mean")]
    assert (stats[f"{group}/count"] == len(observed)).all(), stats[f"{group}/count"]
    # float64, one backward each: round-off only (seen 1e-17)
    torch.testing.assert_close(torch.from_numpy(stats[f"{group}/mean"]), mean, rtol=1e-12, atol=1e-14)
    # an empty batch outside a recorded block (or an evaluation under no_grad inside one) is no step: not refused
    with pytest.warns(RuntimeWarning, match="grad mode off"), torch.no_grad(), probe.record():
        net(x[:0])


@pytest.mark.parametrize("ddof", ["1", None, -1, 1.5, True])
def test_a_ddof_that_is_no_non_negative_int_is_one_line_at_the_call_and_at_the_callback(ddof, tmp_path):
    """Under DDP (2 gloo ranks, scratch) ``ddof='1'`` or None was numpy's UFuncTypeError/TypeError traceback after the
    collectives, -1 and 1.5 pooled a variance silently (1.37 and 0.91 for samples whose ddof-0 variance is 1.24); in a
    single process it was ignored. A RecorderCallback took it and failed only at its first reduction under DDP."""
    from nasdiag.distributed import ReductionError, reduce_statistics
    from nasdiag.record import RecordError, RecorderCallback

    stats = {"x/mean": np.float64(0.5), "x/var": np.float64(1.0), "x/count": np.int64(3)}
    with pytest.raises(ReductionError) as err:
        reduce_statistics(stats, rules={"x/mean": "pooled"}, ddof=ddof)
    assert "\n" not in str(err.value) and "ddof" in str(err.value), err.value
    with pytest.raises(RecordError) as err:
        RecorderCallback(tmp_path / "run.h5", ddof=ddof)
    assert "\n" not in str(err.value) and "ddof" in str(err.value), err.value
    assert list(tmp_path.iterdir()) == []  # no record opened
    for fine in (0, np.int64(1)):  # numpy's ints are ints here
        assert reduce_statistics(stats, rules={"x/mean": "pooled"}, ddof=fine)["x/var"] == 1.0
