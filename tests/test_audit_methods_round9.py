"""Audit round 9 of the search methods: the "runs and methods" contract (docs/methods.md, the method docstrings, the
statistics vocabulary) against an auditor's own float64 arithmetic.

Each test names the contract it holds the code to. References are written here from the papers' equations and
plain torch (no nasdiag helper computes a reference); the tiny float64 supernet has 3 cells of 2 nodes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nasdiag.errors import ConfigError, NasdiagError
from nasdiag.search import Schedule, SearchConfig, get_method
from nasdiag.supernet import Network
from test_audit_methods_round7 import _batch  # (B, 1, 8, 8) float64 inputs, labels in [0, 10)

CLASSES = 10


def _net(primitives=None, seed=0):
    torch.manual_seed(seed)
    return Network(2, CLASSES, 3, steps=2, multiplier=2, in_channels=1,
                   **({} if primitives is None else {"primitives": primitives})).double()


def _state(method):
    return copy.deepcopy({"net": method.network.state_dict(),
                          "objects": {k: v.state_dict() for k, v in method._stateful().items()}})


# -- a method built by hand refuses what run() refuses ----------------------------------------------------------------
def test_a_hand_built_method_refuses_a_steps_hyperparameter_its_schedule_never_reaches():
    """docs/methods.md: "a field declared hp(..., steps=True) (a number of steps between actions) may not exceed the
    run's steps". run() refused it, but BayesNAS built on a Schedule of 2 steps with update_every=100 was accepted and
    never ran Algorithm 2's steps 2-4 (no γ, ω, C, s update, no pruning): a silent no-op of the hyperparameter."""
    cls = get_method("bayesnas")
    with pytest.raises(NasdiagError) as info:
        cls(_net(cls.primitives), cls.Hyperparameters(update_every=3), schedule=Schedule(epochs=1, steps_per_epoch=2))
    message = str(info.value)
    assert "\n" not in message and "update_every=3" in message and "2 steps" in message, message
    # at the schedule's length it is taken, and the update runs at that step (own count: step 2 of 2)
    method = cls(_net(cls.primitives), cls.Hyperparameters(update_every=2), schedule=Schedule(epochs=1, steps_per_epoch=2))
    updated = [bool(method.step(_batch(1), _batch(2))["bayes/updated"]) for _ in range(2)]
    assert updated == [False, True]


@pytest.mark.parametrize("seed", [2 ** 64 - 7919, 2 ** 64, 2 ** 70])
def test_a_seed_the_generator_cannot_take_is_one_line_when_the_method_is_built(seed):
    """The constructor "refuses a negative or non-integer seed" in one line; a seed past 2⁶⁴ − 7920 (the generator is
    seeded with seed + 7919) was torch's "Overflow when unpacking long long" ValueError traceback."""
    cls = get_method("snas")
    with pytest.raises(NasdiagError) as info:
        cls(_net(), schedule=Schedule(epochs=1, steps_per_epoch=2), seed=seed)
    assert "\n" not in str(info.value) and "seed" in str(info.value)
    cls(_net(), schedule=Schedule(epochs=1, steps_per_epoch=2), seed=2 ** 64 - 7920)  # the largest it takes


def test_a_search_config_seed_the_batch_order_cannot_take_is_one_config_error():
    """run() "validates the SearchConfig (one-line ConfigErrors)" before anything is written. The CLI bounds --seed
    (the batch order seeds torch with (seed + 1)·100003 + epoch, which must fit 64 bits), but SearchConfig took any
    seed: run(SearchConfig(seed=2**50)) stopped in torch's ValueError traceback."""
    from nasdiag.search import run

    with pytest.raises(ConfigError) as info:
        run(SearchConfig(seed=2 ** 50, record=None))
    assert "\n" not in str(info.value) and "seed" in str(info.value)
    # the bound is what the batch order needs: (seed + 1)·100003 + epoch fits 64 bits for the largest seed taken
    from nasdiag.search.config import MAX_SEED

    assert (MAX_SEED + 1) * 100_003 + 10 ** 6 < 2 ** 64
    SearchConfig(seed=MAX_SEED).validate()
