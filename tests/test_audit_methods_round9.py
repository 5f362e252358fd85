"""Audit round 9 of the search methods: the "runs and methods" contract (docs/methods.md, the method docstrings, the
statistics vocabulary) against an auditor's own float64 arithmetic.

Each test names the contract it holds the code to. References are written here from the papers' equations and
plain torch (no nasdiag helper computes a reference); the tiny float64 supernet has 3 cells of 2 nodes.

Checked and found right (scratch scripts, not kept as tests where earlier rounds already hold them): every
hyperparameter of every registered method changes the state of a 2-epoch float64 run (none is a silent no-op; ζ,
clip_rewards, tau_min act only where their regime is reached, as documented); the defaults against the papers'
settings (DARTS §A.1.1, SparseNAS appendix, ASM-NAS §5.1, BayesNAS §D.1, XNAS §3.2.2 and eq 4); each step's record
paths against its docstring; the last recorded arch/<cell>/params and probabilities of a recorded float64 run against
the returned method's, and SearchResult.evaluation against an own pass over the search-val split at eval_weights();
every method built on an odd supernet (one cell, a reduce-only or normal-only network, 3 nodes with multiplier 1) runs
two epochs and derives a genotype; extend_schedule mid-run anneals each cosine schedule (BayesNAS's two, HAPG's to 0)
from the current rate over the remaining epochs, as its docstring's formula.
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


# -- the vocabulary says on which rows a family is written -------------------------------------------------------------
def test_every_family_a_step_writes_off_its_vocabulary_rows_says_so():
    """A family declared for the epoch (or spectrum) rows that a method's step writes on other rows must say so in its
    meaning: BayesNAS wrote `hessian/<cell>/nonfinite` (declared "on the epoch rows and the rows of the top
    eigenvalues") on every update row, which with update_every = 1 is every step, without the vocabulary naming it."""
    from nasdiag import vocabulary as V

    cls = get_method("bayesnas")
    method = cls(_net(cls.primitives), cls.Hyperparameters(update_every=1), schedule=Schedule(epochs=2, steps_per_epoch=2))
    stats = method.step(_batch(1), _batch(2))  # step 1 of 4: not an epoch row, and an update row
    assert bool(stats["bayes/updated"])
    off_rows = {V.family_of(k) for k in stats if V.family_of(k).when != "step"}
    assert off_rows == {V.HESSIAN_NONFINITE}
    assert all("BayesNAS" in f.meaning and "`bayes/updated`" in f.meaning for f in off_rows)


# -- SNAS's temperature schedule ---------------------------------------------------------------------------------------
def test_snas_temperature_is_the_geometric_schedule_held_at_its_floor_and_survives_the_state():
    """SNAS: "τ is multiplied by tau_decay after every epoch", floored at tau_min; scalars/temperature is the τ of the
    step's sample (float64). Own sequence τ_e = max(τ0·d^e, τ_min) written here; the sample of each step is
    softmax((α + G)/τ_e): its τ·log Z − α differs from G by a per-edge constant, so with the noise drawn again from a
    copy of the generator the relaxation is checked at that τ (not only the recorded number)."""
    from nasdiag.search.methods._sampling import gumbel_noise

    cls = get_method("snas")
    h = cls.Hyperparameters(tau0=2.0, tau_decay=0.5, tau_min=0.3, alpha_lr=0.05)
    method = cls(_net(), h, schedule=Schedule(epochs=4, steps_per_epoch=1), seed=5)
    want = [max(2.0 * 0.5 ** e, 0.3) for e in range(4)]  # 2, 1, 0.5, 0.3 (0.25 floored)
    got = []
    for epoch in range(4):
        alpha = {t: a.detach().clone() for t, a in method.network.alphas().items()}
        generator = torch.Generator().set_state(method.generator.get_state())
        noise = {t: gumbel_noise(a.shape, generator, a.dtype, a.device) for t, a in alpha.items()}
        stats = method.step(_batch(epoch))
        tau = stats["scalars/temperature"]
        assert tau.dtype == torch.float64
        got.append(float(tau))
        for t, a in alpha.items():
            z = stats[f"arch/{t}/weights"]
            torch.testing.assert_close(z, torch.softmax((a + noise[t]) / want[epoch], -1), rtol=1e-12, atol=1e-15)
        if epoch == 1:  # the state carries τ: a copy built afresh and loaded continues the same schedule
            twin = cls(_net(seed=9), h, schedule=Schedule(epochs=4, steps_per_epoch=1), seed=6)
            twin.load_state_dict(method.state_dict())
        method.epoch_end(epoch)
        if epoch >= 1:
            twin.epoch_end(epoch)
            assert twin.temperature == method.temperature
    assert got == pytest.approx(want, rel=1e-15)


# -- a seed: the same numbers, and other samples only where the method samples -------------------------------------------
@pytest.mark.parametrize("name, samples", [("darts", False), ("xnas", False), ("snas", True), ("dsnas", True),
                                           ("proxyless", True), ("sparsenas", True)])
def test_a_seed_gives_bitwise_the_same_float64_run_and_another_seed_other_samples(name, samples):
    """docs/methods.md: "Draw every random number from self.generator", seeded by the method's seed. Two methods built
    with one seed on identical supernets give bitwise equal statistics and state over an epoch boundary; another seed
    changes them exactly for the methods that draw (SNAS/DSNAS/ProxylessNAS samples, SparseNAS's A(0) = 1/K + noise),
    and changes nothing for DARTS and XNAS, whose steps draw nothing."""
    cls = get_method(name)

    def run(seed):
        method = cls(_net(cls.primitives), schedule=Schedule(epochs=2, steps_per_epoch=1), seed=seed)
        rows = []
        for epoch in range(2):
            rows.append(method.step(_batch(10 + epoch), _batch(20 + epoch)))
            method.epoch_end(epoch)
        return rows, method.network.state_dict()

    def equal(a, b):
        (rows_a, net_a), (rows_b, net_b) = a, b
        same_rows = all(ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)
                        for ra, rb in zip(rows_a, rows_b))
        return same_rows and all(torch.equal(net_a[k], net_b[k]) for k in net_a)

    first = run(3)
    assert equal(first, run(3))
    assert equal(first, run(4)) is not samples


# -- the registry --------------------------------------------------------------------------------------------------------
def test_a_method_registered_under_a_built_in_name_is_refused_there_and_the_built_ins_stay():
    """docs/methods.md: a method defined anywhere "registers itself when its module is imported", and registering a
    different method under a taken name is refused. In a fresh process, before anything had read the registry, a
    method of the user's registered as 'asmnas' was taken; the next get_method('darts') then stopped in ASM-NAS's own
    registration (a ValueError from inside the import of the built-ins) and, tried again, said "unknown method
    'darts'; available: asmnas": every built-in after it was lost. (A fresh interpreter: this process has read the
    registry long ago.)"""
    import subprocess
    import sys

    script = """
from dataclasses import dataclass
from nasdiag.search import Hyperparameters, SearchMethod, get_method, register
try:
    @register("asmnas")
    class Mine(SearchMethod):
        @dataclass
        class Hyperparameters(Hyperparameters):
            pass
    print("taken")
except ValueError as err:
    print("refused:", err)
for name in ("darts", "asmnas", "xnas"):
    try:
        print(name, get_method(name).__module__)
    except Exception as err:
        print(name, "error:", type(err).__name__, err)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stderr
    assert lines[0].startswith("refused:") and "nasdiag.search.methods.asmnas" in lines[0], lines
    assert lines[1:] == [f"{n} nasdiag.search.methods.{n}" for n in ("darts", "asmnas", "xnas")], lines
