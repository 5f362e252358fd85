"""Audit (round 10) of the XNAS forecaster's state and Algorithm 1 against an own float64 transcription.

Reference written here from xnas.txt, never from nasdiag: Algorithm 1 in log space with Python floats (line 9:
ln v += η R; line 11: θ_t = max_{I_{t−1}} v_t · exp(−2ηL(T − t)ζ); line 12: I_t = {v ≥ θ_t}), Γ_t of eq 28, the
regret of eq 31 with the mixture before each update (line 5), the bound of eq 3.

Found and fixed in this round:

* ``load_state_dict`` of a state with a non-tensor entry missing or malformed (``rounds``, ``uniform_init``,
  ``wipeouts``; a round count that is not an integer in [0, T]; an edge with every expert wiped out) loaded the
  tensors first and then failed with a bare KeyError / ValueError / TypeError, leaving a half-loaded forecaster
  (ln v of the state, the round count of the old one); a negative or past-horizon round count loaded silently.
  docs/regret.md promises one RegretError and nothing loaded.
* η* of eq 4 computed as √(2 ln N / (T L²)): a ZeroDivisionError traceback where T L² underflows (an XNAS search
  with reward_bound = 1e-200), digits lost where it is subnormal, η* = 0 where it overflows (L = 1e200), and an
  OverflowError for T past 1e308. Reference: eq 4 in log space.
* rewards given as Python floats (a list) were rounded to float32 by ``torch.as_tensor`` before a float64
  forecaster played them (ln v = 0.10000000149 for η R = 0.1); a list that is not numbers was a bare ValueError.
  The same float32 rounding in ``normalized_entropy`` and the reward functions of a list.
* ``default_loss_bound(sigma)`` = 3√(1 + σ²) was inf for σ > 1.3e154 (σ² overflowed).
* ``cell_depth(cell, concat)`` with a concat that is not a list of node indices: a bare ValueError / TypeError
  from ``int()``, and 2.5 or True taken for a node.

Checked and found right: Algorithm 1 (weights, survivors, ln γ, regret, eq 3) against the reference above over
random bounded sequences with ζ ∈ {0.3, 1, 2}, resumed half way through a state_dict round trip bit-identically;
float32 and float64 forecasters take the same wipeouts on a long random run; all-zero rewards wipe out nothing
(γ = 1, regret 0); experts exactly on θ_t (±L sequences) are kept, as line 12 says, where a naive float
comparison removes them a round early (the documented slack).
"""

from __future__ import annotations

import math

import pytest
import torch

from nasdiag.regret import Forecaster, RegretError, SoftmaxGD


def algorithm_1(rewards, eta, L, T, zeta):
    """Literal Algorithm 1 in log space (Python floats): (ln v, alive, ln γ_t, regret of eq 31 over all N experts,
    the same over the survivors I_t)."""
    N = len(rewards[0])
    log_v, alive, log_gamma, mixture_total, totals = [0.0] * N, [True] * N, 0.0, 0.0, [0.0] * N
    for t, r in enumerate(rewards, start=1):
        top = max(log_v[i] for i in range(N) if alive[i])
        u = [math.exp(log_v[i] - top) if alive[i] else 0.0 for i in range(N)]
        mixture_total += sum(u[i] * r[i] for i in range(N)) / sum(u)  # line 5: p_t before the update
        totals = [totals[i] + r[i] for i in range(N)]
        log_v = [log_v[i] + eta * r[i] if alive[i] else -math.inf for i in range(N)]  # line 9
        top = max(log_v[i] for i in range(N) if alive[i])
        threshold = top - 2 * eta * L * (T - t) * zeta  # line 11
        wiped = [i for i in range(N) if alive[i] and log_v[i] < threshold]  # line 12
        if wiped:
            kept = [i for i in range(N) if alive[i] and i not in wiped]
            mass = lambda idx: sum(math.exp(log_v[i] - top) for i in idx)  # noqa: E731
            log_gamma += math.log(1 + mass(wiped) / mass(kept))  # eq 28
            for i in wiped:
                alive[i], log_v[i] = False, -math.inf
    survivors = max(totals[i] for i in range(N) if alive[i])
    return log_v, alive, log_gamma, max(totals) - mixture_total, survivors - mixture_total


@pytest.mark.parametrize("seed", range(6))
def test_forecaster_is_a_literal_algorithm_1_and_resumes_bit_identically_half_way(seed):
    gen = torch.Generator().manual_seed(seed)
    for trial in range(12):
        N, T = int(torch.randint(2, 6, (), generator=gen)), int(torch.randint(2, 40, (), generator=gen))
        L = 0.1 + 3 * float(torch.rand((), generator=gen))
        eta = Forecaster.optimal_lr(T, L, N) * (0.1 + 10 * float(torch.rand((), generator=gen)))
        zeta = (0.3, 1.0, 2.0)[trial % 3]
        # uniform in (−L, L): no expert lands on θ_t exactly, so a plain float comparison is the reference
        R = (torch.rand(T, N, generator=gen, dtype=torch.float64) * 2 - 1) * L
        log_v, alive, log_gamma, regret, survivor_regret = algorithm_1(R.tolist(), eta, L, T, zeta)
        f = Forecaster(N, eta, L, T, zeta=zeta)
        for r in R[: T // 2]:
            f.update(r)
        g = Forecaster(N, eta, L, T, zeta=zeta)
        g.load_state_dict(f.state_dict())
        for r in R[T // 2:]:
            f.update(r)
            g.update(r)
        assert torch.equal(f.log_weights, g.log_weights) and torch.equal(f.survivor_regret, g.survivor_regret)
        assert torch.equal(f.log_gamma, g.log_gamma) and torch.equal(f.alive, g.alive)
        assert f.alive.tolist() == alive
        torch.testing.assert_close(f.log_weights, torch.tensor(log_v, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        assert float(f.log_gamma) == pytest.approx(log_gamma, rel=1e-10, abs=1e-12)
        assert float(f.regret) == pytest.approx(regret, rel=1e-10, abs=1e-10)
        assert float(f.survivor_regret) == pytest.approx(survivor_regret, rel=1e-10, abs=1e-10)
        if zeta >= 1:  # Lemma 1: the best expert in hindsight survives, eq 3 bounds eq 2 over all N
            assert float(f.regret) <= float(f.bound()) + 1e-9
        assert float(f.survivor_regret) <= float(f.bound()) + 1e-9


def test_all_zero_rewards_wipe_out_nothing_and_leave_no_regret():
    f = Forecaster(3, 0.1, 1.0, 10, shape=(2,))
    for _ in range(10):  # including t = T, where θ_t = max v: every expert sits on it and is kept (line 12: v ≥ θ)
        assert not f.update(torch.zeros(2, 3)).any()
    assert f.alive.all() and torch.equal(f.gamma, torch.ones(2, dtype=torch.float64))
    assert torch.equal(f.regret, torch.zeros(2, dtype=torch.float64))


def _fresh(kind):
    return Forecaster(3, 0.4, 1.0, 10, shape=(2,)) if kind == "xnas" else SoftmaxGD(3, 0.4, shape=(2,))


def _played(kind):
    f = _fresh(kind)
    for _ in range(3):
        f.update(torch.tensor([[1.0, -1.0, 0.5], [0.0, 0.25, -0.75]], dtype=torch.float64))
    return f


CORRUPTIONS = [
    ("xnas", "rounds", None), ("xnas", "uniform_init", None), ("xnas", "wipeouts", None),
    ("xnas", "rounds", "3"), ("xnas", "rounds", -1), ("xnas", "rounds", 11), ("xnas", "rounds", 2.5),
    ("xnas", "wipeouts", "none"), ("xnas", "wipeouts", [{"round": torch.tensor([1])}]),
    ("xnas", "alive", torch.tensor([[True, False, True], [False, False, False]])),
    ("gd", "rounds", None), ("gd", "uniform_init", None), ("gd", "rounds", -2),
]


@pytest.mark.parametrize("kind, key, value", CORRUPTIONS)
def test_a_state_with_an_entry_missing_or_malformed_is_one_regret_error_and_loads_nothing(kind, key, value):
    state = _played(kind).state_dict()
    if value is None:
        del state[key]
    else:
        state[key] = value
    f = _fresh(kind)
    before = f.state_dict()
    with pytest.raises(RegretError, match=key if key != "alive" else "every expert wiped out") as err:
        f.load_state_dict(state)
    assert "\n" not in str(err.value)
    after = f.state_dict()
    assert after["rounds"] == before["rounds"] == 0
    assert all(torch.equal(after[k], before[k]) for k in after if isinstance(after[k], torch.Tensor))
    f.update(torch.zeros(2, 3, dtype=torch.float64))  # still a working fresh forecaster


def test_a_state_that_is_not_a_dict_is_one_regret_error():
    with pytest.raises(RegretError, match="state_dict"):
        _fresh("xnas").load_state_dict([("rounds", 1)])


def test_a_round_count_saved_as_an_integer_tensor_still_loads():
    state = _played("xnas").state_dict()
    state["rounds"] = torch.tensor(state["rounds"])
    f = _fresh("xnas")
    f.load_state_dict(state)
    assert f.rounds == 3


def test_float32_and_float64_forecasters_take_the_same_wipeouts_on_a_long_random_run():
    gen = torch.Generator().manual_seed(3)
    R = torch.rand(400, 8, 4, generator=gen, dtype=torch.float64) * 2 - 1
    a = Forecaster(4, 0.05, 1.0, 400, shape=(8,))
    b = Forecaster(4, 0.05, 1.0, 400, shape=(8,), dtype=torch.float32)
    for r in R:
        a.update(r)
        b.update(r.float())
    assert torch.equal(a.alive, b.alive)
    torch.testing.assert_close(b.regret.double(), a.regret, rtol=1e-4, atol=1e-4)


def eta_star(T, L, N):
    """Eq 4 in log space: ln η* = ½(ln(2 ln N) − ln T) − ln L (no product T L² to underflow or overflow)."""
    return math.exp(0.5 * (math.log(2 * math.log(N)) - math.log(T)) - math.log(L))


@pytest.mark.parametrize("T, L, N", [(100, 1e-200, 4), (100, 1e-160, 8), (40, 1e200, 2), (10**5, 1e300, 2),
                                     (10**400, 1.0, 4), (50, 1.0, 5)], ids=lambda v: f"1e{len(str(v)) - 1}" if isinstance(v, int) and v > 10**6 else None)
def test_eta_star_is_eq_4_where_t_l_squared_leaves_the_float_range(T, L, N):
    # before: L = 1e-200 divided by T L² = 0 (ZeroDivisionError), L = 1e-160 lost digits in a subnormal T L²,
    # L = 1e200 gave η* = 0 (T L² = inf), and T = 10^400 an OverflowError
    assert Forecaster.optimal_lr(T, L, N) == pytest.approx(eta_star(T, L, N), rel=1e-14, abs=0)


@pytest.mark.parametrize("L", [1e-320, 1e-310, 5e-324])
def test_an_eta_star_outside_the_float_range_is_one_regret_error(L):
    with pytest.raises(RegretError, match="outside the float range") as err:
        Forecaster.optimal_lr(100, L, 4)
    assert "\n" not in str(err.value)


def test_an_xnas_search_whose_reward_bound_makes_eta_star_overflow_is_one_nasdiag_error():
    from nasdiag.errors import NasdiagError
    from nasdiag.search import Schedule, get_method
    from nasdiag.supernet import Network

    cls = get_method("xnas")
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1)
    with pytest.raises(NasdiagError, match="eta"):
        cls(net, cls.Hyperparameters(reward_bound=1e-320), schedule=Schedule(epochs=1, steps_per_epoch=2, batch_size=4))


@pytest.mark.parametrize("concat", [["a"], [2.5], [None], 5, [True]])
def test_a_cell_depth_concat_that_is_not_a_list_of_node_indices_is_one_regret_error(concat):
    from nasdiag.regret import cell_depth

    cell = [("sep_conv_3x3", 0), ("sep_conv_3x3", 1), ("skip_connect", 0), ("sep_conv_3x3", 2)]
    assert cell_depth(cell, [2, 3]) == (0 + 1 + 0 + 2) / 4  # Table 4: the mean input-node index
    with pytest.raises(RegretError, match="concat") as err:
        cell_depth(cell, concat)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["xnas", "gd"])
def test_rewards_given_as_python_floats_are_played_in_float64_not_rounded_to_float32(kind):
    # before: torch.as_tensor([0.1, ...]) made float32 first, so ln v = 0.10000000149 in a float64 forecaster
    rewards = [[0.1, 0.2, 0.3], [-0.7, 1 / 3, 0.9]]
    f, g = _fresh(kind), _fresh(kind)
    f.update(rewards)
    g.update(torch.tensor(rewards, dtype=torch.float64))
    assert torch.equal(f.log_weights, g.log_weights) and torch.equal(f.regret, g.regret)
    if kind == "xnas":
        assert f.log_weights[0, 0].item() == 0.4 * 0.1  # line 9: ln v = η R, the float64 product
    with pytest.raises(RegretError, match="rewards must be"):
        f.update([["a", 1, 2], [0, 1, 2]])


def test_entropy_and_rewards_of_python_floats_are_float64_not_rounded_to_float32():
    from nasdiag.regret import normalized_entropy, xnas_reward

    u = [0.1, 0.2, 0.7]
    reference = -sum(p * math.log(p) for p in u) / math.log(3)  # eq 54 in Python floats
    assert normalized_entropy(u).item() == pytest.approx(reference, rel=1e-15, abs=0)
    assert xnas_reward([0.1, -0.3]).tolist() == [-0.1, 0.3]  # R = −C exactly


@pytest.mark.parametrize("sigma", [0.0, 1.0, 16.0, 1e160, 1e300])
def test_default_loss_bound_is_three_sqrt_one_plus_sigma_squared_without_overflow(sigma):
    from fractions import Fraction

    from nasdiag.regret import default_loss_bound

    # before: sigma^2 overflowed for sigma > 1.3e154 and L came out inf
    exact = 9 * (1 + Fraction(sigma) ** 2)  # L^2, exactly
    got = default_loss_bound(sigma)
    assert math.isfinite(got) and abs(Fraction(got) ** 2 / exact - 1) < 1e-15
