"""Audit (round 8) of the XNAS forecaster and the BayesNAS closed forms on adversarial magnitudes.

References are written here from the papers, in exact rational arithmetic (``fractions.Fraction``: every float
is a rational), never from nasdiag:

* BayesNAS appendix A.3.2 / A.1.6b: C = (1/γ + H)⁻¹; A.2.8: ω² = (γ − C)/γ² (for a group of one, A.3.9);
  A.2.13: s = |w|/ω; Algorithm 3 B.0.4: α = 1/γ − C/γ².
* XNAS Algorithm 1 line 9: ln v ← ln v + η R; the weights u = v/Σv (eq 1) are then finite or the update must
  refuse (a NaN weight is never to appear silently).

Found and fixed in this round:

* ω computed as √(γ − C)/γ cancelled every digit where γH is below the precision (γ = 1, H = 1e-20: ω = 0,
  not 1e-10, and the switch s = |w|/ω became ∞); float32 lost digits from γH ~ 1e-4 on.
* C = γ/(1 + γH) overflowed to 0 where γH passes the float range (γ = 1e300, H = 1e10: C = 0, not 1e-10).
* a finite reward whose EG step ln v + ηR overflows made every weight NaN from then on, with no error (and the
  same in SoftmaxGD's α + ηR~).
* with clip_rewards (the default) the XNAS search clamped an infinite cost to ±L and played it as a finite
  reward, unflagged, where a NaN sits the round out and is flagged.

Checked and found right (references in parentheses): Γ_t and γ_T (eq 28, Lemma 2) and Lemma 1 / Theorem 1 in
float32 and float64 on adversarial dyadic sequences (exact hindsight totals); float32 and float64 forecasters
take the same wipeouts there; a BayesNAS search in float32 and float64 records the same γ, ω, C to ~1e-6 and the
same switches (own script); the paper's Γ_t (28), I_t (21, v ≥ θ kept), (31) and (4) as the docstrings cite them.
Left alone: the entropy pruning rule ½ ln(2πeγ) ≤ 0 evaluated in floating point prunes γ one or two ulps above
the real threshold 1/(2πe) (ENTROPY_THRESHOLD_GAMMA is itself one ulp above the correctly rounded value).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from nasdiag.bayes import covariance, group_bayes_update, omega, parent_matrix, sparse_bayes_update
from nasdiag.bayes.structured import structured_update
from nasdiag.regret import Forecaster, RegretError


def exact_cov(gamma: float, h: float) -> Fraction:
    g, h = Fraction(gamma), Fraction(max(h, 0.0))
    return 1 / (1 / g + h)


def exact_omega_squared(gamma: float, h: float) -> Fraction:
    """A.2.8: ω² = (γ − C)/γ², with the exact C of A.3.2."""
    g = Fraction(gamma)
    return (g - exact_cov(gamma, h)) / (g * g)


def rel(a: float, b) -> float:
    return abs(Fraction(a) - b) / abs(b) if b != 0 else abs(a)


# (γ, H) with γH from 1e-22 to 1e310 (the cancellation of γ − C, the overflow of γH) and ordinary values
CASES = [(1.0, 1e-20), (1.0, 1e-12), (3.0, 7e-9), (0.25, 1e-5), (2.0, 0.5), (1.0, 1.0), (1e-3, 40.0),
         (1e300, 1e10), (1e200, 1e200), (1e-200, 1e-150), (5e-301, 3.0)]


@pytest.mark.parametrize("gamma, h", CASES)
def test_covariance_and_omega_are_a_3_2_and_a_2_8_to_a_few_ulps_for_any_gamma_h(gamma, h):
    g, hh = torch.tensor([gamma], dtype=torch.float64), torch.tensor([h], dtype=torch.float64)
    C = covariance(g, hh)
    assert rel(float(C), exact_cov(gamma, h)) < 1e-15
    # the update's own path (group of one) gives ω from the curvature; both must be A.2.8 to ~ulps
    u = sparse_bayes_update(torch.tensor([[0.5]], dtype=torch.float64), hh.view(1, 1), g.view(1, 1),
                            parent_matrix([(0, 2)]).double())
    om2 = exact_omega_squared(gamma, h)
    assert rel(float(u.omega) ** 2, om2) < 1e-14
    assert rel(float(omega(g, C, curvature=hh)) ** 2, om2) < 1e-14
    # s = |w|/ω (A.2.13) is finite whenever ω² > 0 exactly
    assert math.isfinite(float(u.switch)) and rel(float(u.switch) ** 2, Fraction(0.25) / om2) < 1e-13


def test_omega_and_the_switch_of_a_tiny_curvature_are_not_cancelled_to_zero_and_infinity():
    # γ = 1, H = 1e-20: C rounds to γ, so √(γ − C)/γ was exactly 0 and s = |w|/0 = ∞; A.2.8 gives ω = 1e-10
    g, h = torch.ones(1, 1, dtype=torch.float64), torch.full((1, 1), 1e-20, dtype=torch.float64)
    u = group_bayes_update(torch.full((2, 1, 1), 0.3, dtype=torch.float64), h.expand(2, 1, 1), g,
                           parent_matrix([(0, 2)]).double())
    # a group of ℵ = 2 equal elements: ω = √2 · ω_1 (A.3.9), s = ‖w‖/ω = √2·0.3/ω (A.3.8)
    om2 = 2 * exact_omega_squared(1.0, 1e-20)
    assert rel(float(u.omega) ** 2, om2) < 1e-14
    assert rel(float(u.switch) ** 2, 2 * Fraction(0.3) ** 2 / om2) < 1e-13


def test_float32_omega_agrees_with_float64_where_gamma_h_is_small():
    gamma = torch.tensor([1.0, 1.0, 0.5, 2.0], dtype=torch.float64)
    h = torch.tensor([1e-4, 1e-6, 3e-7, 1e-9], dtype=torch.float64)
    om64 = omega(gamma, covariance(gamma, h), curvature=h)
    g32, h32 = gamma.float(), h.float()
    om32 = omega(g32, covariance(g32, h32), curvature=h32)
    # a float32 evaluation without cancellation is within a few float32 ulps (1.2e-7) of the float64 one
    torch.testing.assert_close(om32.double(), om64, rtol=1e-6, atol=0)
    for gi, hi, o in zip(gamma.tolist(), h.tolist(), om64.tolist()):
        assert rel(o * o, exact_omega_squared(gi, hi)) < 1e-14


def test_structured_update_alpha_is_b_0_4_without_cancellation():
    # Algorithm 3 B.0.4: α = 1/γ − C/γ² per element; a filter-wise group (0,) of a (2, 3) weight
    w = torch.tensor([[0.3, -0.4, 1.2], [2.0, 0.1, 0.5]], dtype=torch.float64)
    H = torch.tensor([[1e-19, 2e-17, 1e-13], [0.7, 1e-18, 3.0]], dtype=torch.float64)
    om_prev = torch.tensor([1.0, 0.5], dtype=torch.float64)
    out = structured_update(w, H, om_prev, (0,))
    for n in range(2):
        norm2 = sum(Fraction(x) ** 2 for x in w[n].tolist())
        gamma = float(out.gamma[n])  # B.0.2 ‖W_g‖/ω, a single rounding: checked, then used as given
        assert rel(gamma ** 2, norm2 / Fraction(float(om_prev[n])) ** 2) < 1e-15
        total = Fraction(0)
        for k in range(3):
            a = exact_omega_squared(gamma, float(H[n, k]))  # = 1/γ − C/γ²
            assert rel(float(out.alpha[n, k]), a) < 1e-13
            total += a
        assert rel(float(out.omega[n]) ** 2, total) < 1e-13  # B.0.5


@pytest.mark.parametrize("dtype, reward", [(torch.float64, 1e308), (torch.float32, 3e38)])
def test_an_eg_step_that_overflows_ln_v_is_one_regret_error_and_changes_nothing(dtype, reward):
    f = Forecaster(3, 1.0, 1.0, 10, shape=(2,), dtype=dtype)
    first = torch.tensor([[reward, reward, 0.0], [0.1, 0.2, 0.3]], dtype=torch.float64)
    f.update(first)  # ln v = R, finite: allowed (|R| > L is counted as a bound violation, not refused)
    assert torch.isfinite(f.weights).all()
    before = f.state_dict()
    with pytest.raises(RegretError, match=r"overflows .*nothing was changed") as err:
        f.update(first)  # ln v + ηR = 2R: past the dtype's range, u would be NaN
    assert "\n" not in str(err.value)
    after = f.state_dict()
    for key in ("log_weights", "forecaster_reward", "expert_reward", "alive", "log_gamma", "bound_violations"):
        assert torch.equal(before[key], after[key]), key
    assert after["rounds"] == before["rounds"] and len(after["wipeouts"]) == len(before["wipeouts"])
    # the forecaster goes on with bounded rewards, its weights finite
    f.update(torch.zeros(2, 3, dtype=torch.float64))
    assert torch.isfinite(f.weights).all() and f.rounds == 2


def test_a_gd_softmax_step_that_overflows_alpha_is_one_regret_error_and_changes_nothing():
    from nasdiag.regret import SoftmaxGD

    g = SoftmaxGD(2, 10.0, shape=(2,))
    g.update(torch.tensor([[0.05, -0.05], [0.1, 0.2]], dtype=torch.float64))  # α = ±0.25, u = (0.62, 0.38)
    before = g.state_dict()
    # eq 6: R~ = u (R − u.R) = ±u1 u2 · 2e308 = ±4.7e307, α + 10 R~ past the float64 range
    with pytest.raises(RegretError, match="overflows .*nothing was changed"):
        g.update(torch.tensor([[1e308, -1e308], [0.1, 0.2]], dtype=torch.float64))
    after = g.state_dict()
    for key in ("log_weights", "forecaster_reward", "expert_reward"):
        assert torch.equal(before[key], after[key]), key
    assert after["rounds"] == 1 and torch.isfinite(g.weights).all()


def test_large_rewards_within_range_are_still_played_exactly():
    # just inside the range nothing is refused: ln v is the exact sum of the η R (dyadic values, no rounding)
    f = Forecaster(2, 0.5, 1.0, 4, zeta=math.inf)
    for _ in range(3):
        f.update(torch.tensor([2.0 ** 1020, -(2.0 ** 1020)], dtype=torch.float64))
    assert f.log_weights.tolist() == [1.5 * 2.0 ** 1020, -1.5 * 2.0 ** 1020]
    assert f.weights.tolist() == [1.0, 0.0]


# --- the search: an infinite cost is flagged and kept out of the weights, as a NaN is -------------------

def _xnas(cls=None, **hp):
    from nasdiag.search import Schedule, get_method
    from nasdiag.supernet import Network

    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()
    cls = cls or get_method("xnas")
    return cls(net, cls.Hyperparameters(**hp), schedule=Schedule(epochs=1, steps_per_epoch=4, batch_size=6))


def _data(n):
    g = torch.Generator().manual_seed(1)
    b = lambda: (torch.randn(6, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g))  # noqa: E731
    return [(b(), b()) for _ in range(n)]


@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_an_infinite_cost_of_an_alive_op_is_not_clipped_to_l_but_flagged_and_kept_out_of_the_weights(bad):
    """clamp(-L, L) keeps a NaN but turns ±inf into ±L: with clip_rewards (the default) an infinite cost of an
    alive op was played as the finite reward ±L, unflagged (xnas docstring: a NaN/inf cost never reaches the
    weights; vocabulary: NaN/inf kept in ``rewards``). Reference: the same run without the bad cost, where
    that edge's weights and regret simply stay as after the step before (the round sits out)."""
    from nasdiag.search import get_method

    class BadAtStep2(get_method("xnas")):
        def rewards(self, per_cell):
            out = super().rewards(per_cell)
            if self.forecasters["normal"].rounds == 1:
                out["normal"][0, 2, 3] = -bad  # reward = −cost
            return out

    data = _data(3)
    method = _xnas(BadAtStep2)
    rows = [method.step(*b) for b in data]
    twin = _xnas()
    want = [twin.step(*b) for b in data[:2]][1]
    got, prev = rows[1], rows[0]
    assert got["regret/normal/nonfinite"].tolist() == [False, False, True, False, False]
    assert got["regret/normal/rewards"][0, 2, 3] == -bad  # as it came, not ±L
    assert torch.equal(got["regret/normal/log_weights"][2], prev["regret/normal/log_weights"][2])
    assert torch.equal(got["regret/normal/regret"][2], prev["regret/normal/regret"][2])
    others = [0, 1, 3, 4]
    for k in ("log_weights", "regret", "gamma"):
        assert torch.equal(got[f"regret/normal/{k}"][others], want[f"regret/normal/{k}"][others]), k
    assert got["scalars/reward_clip_fraction"] == want["scalars/reward_clip_fraction"]  # an inf is not "clipped"
    assert torch.isfinite(rows[2]["regret/normal/log_weights"]).all() and not rows[2]["regret/normal/nonfinite"].any()


# --- checked and right: float32 forecasters keep Lemma 1 and Theorem 1 ---------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_float32_and_float64_forecasters_keep_lemma_1_and_theorem_1_on_adversarial_dyadic_sequences(seed):
    """Rewards k/4·L (dyadic): the hindsight totals S_i = Σ_t R_t,i are exact in float64, so the best expert is
    known exactly. A late bloomer (−L for T/2 rounds, then +L: it ends tied with the leader's equality case of
    Lemma 1) sits in a quarter of the forecasters. In float32 and float64 the best expert in hindsight is never
    wiped out (Lemma 1), the regret stays within eq 3 (Theorem 1; tolerance: float32 rounding of T terms of size
    L), and both dtypes take the same wipeout decisions."""
    g = torch.Generator().manual_seed(seed)
    N, T, L = 5, 240, 1.5
    eta = Forecaster.optimal_lr(T, L, N) * (0.5 + 10 * seed)
    R = torch.randint(-4, 5, (T, 32, N), generator=g).double() / 4 * L
    R[: T // 2, :8, 0], R[T // 2:, :8, 0] = -L, L
    fs = {dt: Forecaster(N, eta, L, T, shape=(32,), dtype=dt) for dt in (torch.float32, torch.float64)}
    for t in range(T):
        for f in fs.values():
            f.update(R[t])
    S = R.sum(0)
    best = S == S.amax(-1, keepdim=True)
    for dt, f in fs.items():
        assert (f.alive & best).any(-1).all(), dt  # some best expert survives (Lemma 1)
        tol = 1e-9 if dt == torch.float64 else 1e-4 * T * L
        assert (f.regret.double() <= f.bound().double() + tol).all(), dt
        assert (f.gamma.double() >= 1).all() and (f.gamma.double() < N).all(), dt  # Lemma 2
    assert torch.equal(fs[torch.float32].alive, fs[torch.float64].alive)


def test_covariance_and_omega_keep_their_documented_limits_at_zero_infinite_and_nan_gamma():
    inf, nan = math.inf, math.nan
    g = torch.tensor([0.0, 0.0, inf, inf, nan, 2.0, 2.0], dtype=torch.float64)
    h = torch.tensor([0.0, inf, 4.0, 0.0, 1.0, 0.0, inf], dtype=torch.float64)
    C = covariance(g, h)
    # C = (1/γ + H)⁻¹: γ = 0 gives 0; γ = ∞ gives 1/H; H = ∞ gives 0; H = 0 gives γ
    assert C[:4].tolist() == [0.0, 0.0, 0.25, inf] and math.isnan(C[4]) and C[5:].tolist() == [2.0, 0.0]
    for om in (omega(g, C, curvature=h), omega(g, C)):
        # A.2.8 limits (docstring): dead switch ∞, γ = ∞ gives 0, NaN kept, H = 0 gives 0, H = ∞ gives 1/√γ
        assert om[:4].tolist() == [inf, inf, 0.0, 0.0] and math.isnan(om[4]) and om[5] == 0.0
        assert om[6] == pytest.approx(1 / math.sqrt(2.0), rel=1e-15)
