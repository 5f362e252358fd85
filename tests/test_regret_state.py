"""Forecaster checkpoints: state_dict → fresh forecaster → load continues Algorithm 1 bit-identically."""

import io

import pytest
import torch

from nasdiag.regret import Forecaster, SoftmaxGD


def _rounds(f, g, n):
    for _ in range(n):
        f.update(torch.randn(f.shape + (f.n_experts,), generator=g, dtype=torch.float64))


def test_forecaster_state_round_trip_continues_bit_identically():
    g = torch.Generator().manual_seed(0)
    a = Forecaster(6, 0.3, 2.0, 40, zeta=0.02, shape=(3, 2))
    _rounds(a, g, 15)
    assert len(a.wipeout_log) > 0  # the saved state includes removals
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b = Forecaster(6, 0.3, 2.0, 40, zeta=0.02, shape=(3, 2))
    b.load_state_dict(torch.load(buffer))
    state = g.get_state()
    _rounds(a, g, 10)
    g.set_state(state)
    _rounds(b, g, 10)
    for name in ("log_weights", "alive", "regret", "gamma", "bound_violations", "forecaster_loss", "expert_losses"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.bound(), b.bound()) and a.rounds == b.rounds == 25
    assert list(a.wipeout_log) == list(b.wipeout_log)


def test_state_is_a_copy_and_mismatched_configurations_are_refused():
    a = Forecaster(4, 0.1, 1.0, 10, shape=(2,))
    state = a.state_dict()
    a.update(torch.ones(2, 4))
    assert state["rounds"] == 0 and torch.equal(state["log_weights"], torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="configured differently"):
        Forecaster(4, 0.1, 1.0, 11, shape=(2,)).load_state_dict(state)
    with pytest.raises(ValueError, match="configured differently"):
        SoftmaxGD(4, 0.1, shape=(2,)).load_state_dict(state)
    gd = SoftmaxGD(4, 0.1, shape=(2,))
    gd.update(torch.randn(2, 4, dtype=torch.float64))
    copy = SoftmaxGD(4, 0.1, shape=(2,))
    copy.load_state_dict(gd.state_dict())
    assert torch.equal(copy.log_weights, gd.log_weights) and torch.equal(copy.regret, gd.regret)
