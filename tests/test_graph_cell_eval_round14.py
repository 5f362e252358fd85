"""A captured search step must not be replayed once a cell module was switched to eval on its own.

cost14 (round 14) made the fast engine run such a forward eager (a frozen BatchNorm normalizes with its running
statistics); the captured CUDA graph of the step, keyed by the network's own mode only, would still have replayed the
batched forward captured before. CPU: the fake graph backend of tests/test_engine.py tells a replay from a new
capture. GPU (skipped without CUDA): the graphed method's losses and parameters equal a plain eager method's, float64.
"""

import pytest
import torch

from test_engine import FakeGraphs, _batches, _graphed, _max_diff, _method, _state


def _freeze_first_cell(method):
    method.network.cells[0].eval()  # frozen BatchNorms of one cell, the network still in train mode


def test_a_cell_switched_to_eval_drops_the_captured_step():
    method = _method("fast", steps=2, multiplier=2)
    runner = _graphed(method, FakeGraphs())
    batches = _batches([6] * 5)
    for b in batches[:3]:  # eager, capture, replay
        runner(*b)
    replays = runner.counts["replay"]
    assert replays >= 1, runner.counts
    _freeze_first_cell(method)
    runner(*batches[3])
    assert runner.counts["replay"] == replays, f"replayed the step captured with the cell in train mode: {runner.counts}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_steps_with_a_frozen_cell_equal_plain_eager_steps_on_cuda():
    from nasdiag.search.base import Schedule
    from nasdiag.search.methods.darts import DARTS
    from test_engine import _net

    methods = []
    for engine in ("eager", "fast"):  # float64: the two engines agree to round-off, so 1e-10 holds on the card
        net = _net(steps=2, multiplier=2).cuda().set_engine(engine)
        methods.append(DARTS(net, schedule=Schedule(epochs=2, steps_per_epoch=4), hessian_mode="approx"))
    plain, graphed = methods
    batches = [tuple(tuple(t.cuda() for t in pair) for pair in b) for b in _batches([6] * 6)]
    for i, b in enumerate(batches):
        if i == 3:
            _freeze_first_cell(plain)
            _freeze_first_cell(graphed)
        a, g = plain.step(*b), graphed.step(*b)
        assert _max_diff(list(a.values()), list(g.values())) < 1e-10, i
    assert graphed.step.counts["replay"] >= 1, graphed.step.counts  # the step was graphed before the freeze
    assert _max_diff(_state(plain), _state(graphed)) < 1e-10
