"""Audit (round 17) of nasdiag.regret's primitives (and XNAS's use of them) against an own float64 transcription.

References written here from xnas.txt, never from nasdiag: Algorithm 1 with ln v = η A (A the cumulative rewards, line
9 from v_0 = 1); the wipeout of lines 11-12 decided exactly in rationals (v_i < θ_t ⟺ A_i < max_{I_{t-1}} A − 2L(T − t)ζ:
η > 0 cancels, every float is a rational), so an expert exactly on θ_t is kept (line 12 removes v < θ_t, (21) keeps
v ≥ θ_t); Γ_t and γ_t of eq 28; the linearized regret of eq 31 with the mixture before the round (line 5), the minimum
over all N (eq 2) and over I_t; eq 3 after every round. GD with softmax: α += η u (R − u·R) (eq 6). Eq 54-55 and
Table 4's depth in numpy / plain Python.

Found and fixed in this round:

* a Forecaster's ``lr`` (and ``loss_bound``, ``horizon``, ``zeta``) were plain attributes: an η schedule set mid-run
  (``fc.lr = ...``) was taken silently, the thresholds of line 11 then weighing a gap of ln v summed under the old η
  against the margin of the new one: an η lowered mid-run wiped out the expert that ends best in hindsight (Lemma 1
  broken with every reward within L, ζ = 1, nothing flagged), and ``bound()`` put the last η into eq 3 for every
  round, below the regret. They are fixed for the run now; an assignment is one RegretError and changes nothing.
* ``init_log_weights`` that requires grad (a network's α Parameter as ln v_0) was kept attached: ln v, the weights,
  the regret and the state carried a grad_fn, every round chained onto the graph of the one before (memory growing
  with the rounds) and a loss of the weights backpropagated into the Parameter, although "all tensors are detached
  state; no autograd flows through a forecaster". A state whose tensors require grad loaded the same way.
* the reward functions and the entropy given what is no tensor of numbers (None, a string, a ragged list) failed in
  torch's bare 'Could not infer dtype of NoneType' (RuntimeError) / "too many dimensions 'str'" (ValueError), where
  docs/regret.md promises one RegretError for bad input (round 10 fixed this for Forecaster.update only); the same
  for a Forecaster's / SoftmaxGD's ``init_log_weights`` and ``update``'s ``skip``, and a state whose config is no
  dict ('int' object is not iterable). ``shape=(2.5,)`` made a batch of 2 forecasters (int(2.5)), silently.
  ``simulate_gaussian_experts(generator=0)`` (a seed for the generator) was torch's multi-line randn() overload list.
  SoftmaxGD's lr (settable: a schedule voids no guarantee of GD) took -1 or 'fast' unchecked, failing or ascending
  later; it is checked as the constructor checks it.

Checked and found right: Algorithm 1 (alive sets, ln v, ln γ, both regrets, eq 3) per round against the reference on
adversarial sequences (one expert best early, another late; a leader-penalizing adversary), rewards at ±L, K = 1,
an expert exactly on θ_t (kept, where ≤ would remove it), ζ ∈ {1, 2, 1/4}; eq 3 ≥ the regret after every round
(ζ ≥ 1), ≥ the survivors' regret for every ζ; a 1500-round batched run against a numpy reference; a 10^5-round
float64 run (η*, N = 4) equal to the reference (wipeout rounds, regret and bound to 1e-12; run once in scratch, too
slow for the suite); ``simulate_gaussian_experts`` against an own replay of its draws (XNAS and GD regret, the
no-learning regret, correct selections, bound, γ, survivors, violations); eq 54-55 with 0 ln 0 = 0; Table 4's depth.

Left alone (judgement calls): a float32 Forecaster's slack 8ε(t+1)(|max ln v| + margin + 1) is ~10 % relative after
10^5 rounds, so the last wipeouts (θ_T = max v) may never come (N = 4, T = 10^5: two experts alive at T where
float64 keeps one); docs/regret.md advises float64 (now with this number) and the XNAS search always uses it. A
float32 regret or bound past 3.4e38 (rewards ~1e38) is inf: the value itself is outside float32's range. SoftmaxGD's lr stays
settable (no guarantee rests on it).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from nasdiag.regret import (Forecaster, RegretError, SoftmaxGD, cell_depth, gd_softmax_reward, mean_normalized_entropy,
                            normalized_entropy, rewards_from_gradient, simulate_gaussian_experts, xnas_reward)


def _algorithm_1(R, eta, L, T, zeta=1.0):
    """Own Algorithm 1 (one forecaster, float64, wipeout decided exactly): per round (alive, ln v, ln γ, regret over
    all N, regret over I_t, eq 3). ``eta`` may be a list (one η per round) to show what a schedule does."""
    R = np.asarray(R, dtype=np.float64)
    n_rounds, N = R.shape
    etas = list(eta) if isinstance(eta, (list, tuple)) else [eta] * n_rounds
    exact = [Fraction(0)] * N  # A_i for the exact decision (rewards of alive experts only: they all got every round)
    log_v = np.zeros(N)
    alive = np.ones(N, dtype=bool)
    log_gamma, mixture_reward, totals = 0.0, 0.0, np.zeros(N)
    rows = []
    for t in range(1, n_rounds + 1):
        r, eta_t = R[t - 1], etas[t - 1]
        a = np.where(alive, log_v, -np.inf)
        u = np.exp(a - a.max())
        u /= u.sum()
        mixture_reward += float((u * np.where(alive, r, 0.0)).sum())  # line 5: the mixture before the update
        totals += r
        log_v = log_v + eta_t * r
        for i in range(N):
            exact[i] += Fraction(float(r[i]))
        if len(set(etas)) == 1:  # one η: η cancels, decide in rationals
            best = max(exact[i] for i in range(N) if alive[i])
            margin = 2 * Fraction(L) * (T - t) * Fraction(zeta)
            wiped = np.array([bool(alive[i] and exact[i] < best - margin) for i in range(N)])
        else:  # a schedule: θ_t with the round's η, as nasdiag's line 11 would take it
            top = log_v[alive].max()
            wiped = alive & (log_v < top - 2 * eta_t * L * (T - t) * zeta)
        if wiped.any():
            top = log_v[alive].max()
            gone, kept = np.exp(log_v[wiped] - top).sum(), np.exp(log_v[alive & ~wiped] - top).sum()
            log_gamma += math.log1p(gone / kept)  # eq 28
            alive = alive & ~wiped
        rows.append((alive.copy(), np.where(alive, log_v, -np.inf), log_gamma, totals.max() - mixture_reward,
                     totals[alive].max() - mixture_reward, eta_t * t * L * L / 2 + (math.log(N) - log_gamma) / eta_t))
    return rows


def _play(R, eta, L, T, zeta=1.0):
    f = Forecaster(len(R[0]), eta, L, T, zeta=zeta)
    rows = []
    for r in R:
        f.update(torch.tensor(r, dtype=torch.float64))
        rows.append((f.alive.numpy(), f.log_weights.numpy(), float(f.log_gamma), float(f.regret),
                     float(f.survivor_regret), float(f.bound())))
    return f, rows


def _early_late(T, N, L, switch):
    """Expert 0 best until ``switch``, expert N-1 best after; the rest in between."""
    R = np.full((T, N), -L / 2)
    R[:switch, 0], R[switch:, 0] = L, -L
    R[switch:, -1] = L
    return R


def _leader_penalized(T, N, L):
    """An adversary that gives −L to the current leader in hindsight and +L to the others (ties: lowest index)."""
    R, totals = np.zeros((T, N)), np.zeros(N)
    for t in range(T):
        R[t] = L
        R[t, int(np.argmax(totals))] = -L
        totals += R[t]
    return R


@pytest.mark.parametrize("case", ["early_late", "leader", "bounds", "one_expert", "on_threshold", "zeta_quarter", "zeta_two"])
def test_forecaster_is_algorithm_1_and_eq_3_bounds_the_regret_after_every_round(case):
    rng = np.random.default_rng(17)
    L, eta, zeta = 1.0, 0.25, 1.0
    if case == "early_late":
        T, R = 24, _early_late(24, 4, 1.0, 9)
    elif case == "leader":
        T, R = 20, _leader_penalized(20, 3, 1.0)
    elif case == "bounds":  # every reward at ±L
        T, R = 30, rng.choice([-1.0, 1.0], (30, 5))
    elif case == "one_expert":  # K = 1: nothing to wipe, no regret, eq 3 = η t L² / 2
        T, R = 12, rng.integers(-4, 5, (12, 1)) / 4
    elif case == "on_threshold":  # after round 1 expert 1 is exactly on θ_1 = v_0 exp(-2ηL(T-1)): kept; then ties
        T, R = 2, np.array([[1.0, -1.0], [-1.0, 1.0]])
    else:
        zeta = 0.25 if case == "zeta_quarter" else 2.0
        T, R = 24, _early_late(24, 4, 1.0, 12)
    ref = _algorithm_1(R, eta, L, T, zeta)
    f, got = _play(R, eta, L, T, zeta)
    for t, (mine, theirs) in enumerate(zip(ref, got), start=1):
        assert np.array_equal(mine[0], theirs[0]), (case, t, mine[0], theirs[0])
        np.testing.assert_allclose(theirs[1][mine[0]], mine[1][mine[0]], rtol=1e-13, atol=1e-13)
        assert theirs[2] == pytest.approx(mine[2], rel=1e-12, abs=1e-14)
        assert theirs[3] == pytest.approx(mine[3], rel=1e-12, abs=1e-12)
        assert theirs[4] == pytest.approx(mine[4], rel=1e-12, abs=1e-12)
        assert theirs[5] == pytest.approx(mine[5], rel=1e-12)
        assert mine[4] <= mine[5] + 1e-12  # Theorem 1 over the survivors, every ζ
        if zeta >= 1:
            assert mine[3] <= mine[5] + 1e-12  # Theorem 1 (eq 2, all N), every prefix
    if case == "on_threshold":
        assert got[0][0].all() and got[1][0].all()  # on θ_t is kept (≥), a tie at T is kept
    if case == "one_expert":
        assert got[-1][3] == 0.0 and got[-1][5] == pytest.approx(eta * T * L * L / 2)


def test_an_lr_changed_mid_run_is_refused_not_a_silent_wipeout_of_the_best_expert():
    # Why it must be refused: with η = 1 for 10 rounds expert 0 leads by 20 nats; an η lowered to 0.01 then makes the
    # margin 2ηL(T - t) = 0.58 and wipes out expert 1, which gains L in each of the 30 remaining rounds and ends best in
    # hindsight (Lemma 1 broken with every |R| <= L, ζ = 1); eq 3 with the last η is then below the regret.
    T, L = 40, 1.0
    R = np.zeros((T, 2))
    R[:10] = [L, -L]
    R[10:] = [-L, L]
    scheduled = _algorithm_1(R, [1.0] * 10 + [0.01] * 29 + [1.0], L, T)
    assert not scheduled[10][0][1] and R[:, 1].sum() > R[:, 0].sum()  # the hindsight-best expert, wiped at t = 11
    assert scheduled[-1][3] > scheduled[-1][5]  # the regret past "eq 3"
    f = Forecaster(2, 1.0, L, T)
    for r in R[:10]:
        f.update(torch.tensor(r))
    before = f.state_dict()
    for name, value in (("lr", 0.01), ("loss_bound", 2.0), ("horizon", 80), ("zeta", 0.5)):
        with pytest.raises(RegretError, match=f"{name} is fixed for its run.*create a new Forecaster"):
            setattr(f, name, value)
    assert (f.lr, f.loss_bound, f.horizon, f.zeta) == (1.0, L, T, 1.0)
    after = f.state_dict()
    assert all(torch.equal(torch.as_tensor(before[k]), torch.as_tensor(after[k])) for k in ("log_weights", "alive"))
    for r in R[10:]:
        f.update(torch.tensor(r))
    ref = _algorithm_1(R, 1.0, L, T)[-1]
    assert np.array_equal(f.alive.numpy(), ref[0]) and float(f.regret) == pytest.approx(ref[3], rel=1e-12)
    assert float(f.regret) <= float(f.bound())


def test_a_long_batched_run_is_algorithm_1_and_within_eq_3_at_every_round():
    T, N, L = 1500, 5, 1.0
    rng = np.random.default_rng(5)
    R = rng.uniform(-L, L, (T, 8, N))
    R[:, :, 1] = np.clip(R[:, :, 1] + 0.1, -L, L)
    R[: T // 2, :, 2] = np.clip(R[: T // 2, :, 2] + 0.2, -L, L)  # a leader early, expert 1 late
    eta = Forecaster.optimal_lr(T, L, N) * 3
    f = Forecaster(N, eta, L, T, shape=(8,))
    log_v, alive, mixture, log_gamma = np.zeros((8, N)), np.ones((8, N), bool), np.zeros(8), np.zeros(8)
    totals = np.cumsum(R, 0)
    for t in range(1, T + 1):
        a = np.where(alive, log_v, -np.inf)
        u = np.exp(a - a.max(-1, keepdims=True))
        mixture += (u / u.sum(-1, keepdims=True) * R[t - 1]).sum(-1)
        log_v = np.where(alive, log_v + eta * R[t - 1], -np.inf)
        top = log_v.max(-1, keepdims=True)
        wiped = alive & (log_v < top - 2 * eta * L * (T - t))
        gone = np.where(wiped, np.exp(log_v - top), 0).sum(-1)
        kept = np.where(alive & ~wiped, np.exp(log_v - top), 0).sum(-1)
        log_gamma += np.log1p(gone / kept)
        alive &= ~wiped
        f.update(torch.from_numpy(R[t - 1]))
        if t % 100 == 0 or t == T:
            assert np.array_equal(f.alive.numpy(), alive), t
            regret = totals[t - 1].max(-1) - mixture
            np.testing.assert_allclose(f.regret.numpy(), regret, rtol=1e-10, atol=1e-9)
            np.testing.assert_allclose(f.log_gamma.numpy(), log_gamma, rtol=1e-10, atol=1e-12)
            assert (regret <= eta * t * L * L / 2 + (math.log(N) - log_gamma) / eta).all()
    assert (alive.sum(-1) == 1).all()  # θ_T = max v: one expert at the horizon


def test_the_statistical_setting_is_its_own_replayed_draws_through_algorithm_1_and_gd():
    R_, N, T, sigma, zeta = 6, 3, 40, 1.5, 1.0
    out = simulate_gaussian_experts(N, sigma, R_, T, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    biases = torch.randn(R_, N, generator=g, dtype=torch.float64).numpy()
    draws = np.stack([torch.randn(R_, N, generator=g, dtype=torch.float64).numpy() * sigma + biases for _ in range(T)])
    L = 3 * math.sqrt(1 + sigma ** 2)
    eta = math.sqrt(2 * math.log(N) / (T * L * L))
    assert out.loss_bound == pytest.approx(L, rel=1e-15) and out.lr == pytest.approx(eta, rel=1e-15)
    np.testing.assert_array_equal(out.biases.numpy(), biases)
    totals = draws.sum(0)
    for run in range(R_):
        rows = _algorithm_1(draws[:, run], eta, L, T, zeta)
        ref = rows[-1]
        alive_before = np.stack([np.ones(N, dtype=bool)] + [row[0] for row in rows[:-1]])
        assert out.bound_violations[run].item() == int((alive_before & (np.abs(draws[:, run]) > L)).sum())
        assert out.xnas_regret[run].item() == pytest.approx(ref[3], rel=1e-10, abs=1e-10)
        assert out.xnas_bound[run].item() == pytest.approx(ref[5], rel=1e-12)
        assert out.xnas_gamma[run].item() == pytest.approx(math.exp(ref[2]), rel=1e-12)
        assert out.xnas_alive[run].item() == ref[0].sum()
        assert out.xnas_correct[run].item() == (int(np.argmax(ref[1])) == int(np.argmax(biases[run])))
        alpha, gd_reward = np.zeros(N), 0.0
        for r in draws[:, run]:  # eq 5-6
            u = np.exp(alpha - alpha.max())
            u /= u.sum()
            gd_reward += u @ r
            alpha = alpha + eta * u * (r - u @ r)
        assert out.gd_regret[run].item() == pytest.approx(totals[run].max() - gd_reward, rel=1e-10, abs=1e-10)
        assert out.gd_correct[run].item() == (int(np.argmax(alpha)) == int(np.argmax(biases[run])))
        assert out.uniform_regret[run].item() == pytest.approx(totals[run].max() - totals[run].mean(), rel=1e-12)
    assert (out.xnas_gamma > 1).any()  # wipeouts happened: eq 28 was exercised


def test_entropy_and_depth_are_eq_54_55_and_table_4():
    rng = np.random.default_rng(0)
    u = rng.dirichlet(np.ones(6) * 0.3, size=(14,))
    u[3, :4] = 0.0
    u[3] /= u[3].sum()
    u[5] = [1, 0, 0, 0, 0, 0]
    plogp = np.where(u > 0, u * np.log(np.where(u > 0, u, 1)), 0.0)
    mine = -plogp.sum(-1) / math.log(6)
    np.testing.assert_allclose(normalized_entropy(torch.from_numpy(u)).numpy(), mine, rtol=1e-13, atol=1e-15)
    assert float(mean_normalized_entropy(torch.from_numpy(u))) == pytest.approx(mine.mean(), rel=1e-13)
    assert normalized_entropy(torch.full((4,), 0.25, dtype=torch.float64)).item() == pytest.approx(1.0, rel=1e-15)
    cell = [("sep_conv_3x3", int(rng.integers(0, 2 + k // 2))) for k in range(8)]
    assert cell_depth(cell) == sum(src for _, src in cell) / 8


@pytest.mark.parametrize("cls", ["Forecaster", "SoftmaxGD"])
def test_init_log_weights_of_a_parameter_leave_no_graph_in_the_forecaster(cls):
    import nasdiag.regret as regret
    alpha = torch.nn.Parameter(torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64))
    make = (lambda **kw: regret.Forecaster(3, 0.2, 1.0, 8, **kw)) if cls == "Forecaster" else (
        lambda **kw: regret.SoftmaxGD(3, 0.2, **kw))
    f = make(init_log_weights=alpha)
    for r in ([1.0, 0.0, -1.0], [0.5, 0.5, 0.0], [-1.0, 1.0, 0.0]):
        f.update(torch.tensor(r, dtype=torch.float64))
    state = f.state_dict()
    for name, value in [("log_weights", f.log_weights), ("weights", f.weights), ("regret", f.regret)] + list(state.items()):
        if isinstance(value, torch.Tensor):
            assert value.grad_fn is None and not value.requires_grad, name
    # ln v_0 + η Σ R (+ the wipeouts): the Parameter's values, not a graph of them
    assert alpha.grad is None
    expected = alpha.detach() + 0.2 * torch.tensor([0.5, 1.5, -1.0], dtype=torch.float64)
    if cls == "Forecaster":
        assert torch.equal(f.log_weights.isfinite(), f.alive)
        torch.testing.assert_close(f.log_weights[f.alive], expected[f.alive], rtol=1e-15, atol=1e-15)
    # a state whose tensors require grad loads detached
    attached = {k: (v.clone().requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in state.items()}
    g = make(init_log_weights=alpha)
    g.load_state_dict(attached)
    assert not g.log_weights.requires_grad and not g.regret.requires_grad
    if cls == "Forecaster":
        assert not g.log_gamma.requires_grad and not g.weights.requires_grad


@pytest.mark.parametrize("call, name", [
    (lambda: xnas_reward(None), "cost"),
    (lambda: xnas_reward(["a", "b"]), "cost"),
    (lambda: gd_softmax_reward([1.0, 2.0], None), "weights"),
    (lambda: rewards_from_gradient([1.0], {"a": 1}), "expert_predictions"),
    (lambda: normalized_entropy([[0.5], [0.5, 0.5]]), "weights"),
    (lambda: mean_normalized_entropy("uniform"), "weights"),
])
def test_a_reward_or_entropy_of_what_is_no_tensor_of_numbers_is_one_regret_error(call, name):
    with pytest.raises(RegretError, match=f"^{name} must be a tensor \\(or nested lists\\) of numbers, got [^\\n]*$") as err:
        call()
    assert isinstance(err.value, TypeError)


@pytest.mark.parametrize("call, match", [
    (lambda: Forecaster(3, 0.1, 1.0, 5, init_log_weights="x"), "init_log_weights must be a tensor"),
    (lambda: Forecaster(3, 0.1, 1.0, 5, init_log_weights=[[0, 1], [1]]), "init_log_weights must be a tensor"),
    (lambda: Forecaster(3, 0.1, 1.0, 5, shape=(2,)).update([[0, 0, 0], [1, 1, 1]], skip=[True, None]),
     r"skip must be a bool tensor of the forecasters' shape \(2,\)"),
    (lambda: Forecaster(3, 0.1, 1.0, 5).load_state_dict({"config": 5}), "the state's config is 5, not a Forecaster's"),
    (lambda: Forecaster(3, 0.1, 1.0, 5, shape=(2.5,)), r"shape must be an int or a sequence of ints, got \(2.5,\)"),
    (lambda: Forecaster(3, 0.1, 1.0, 5, shape=(True, 2)), "shape must be an int or a sequence of ints"),
    (lambda: simulate_gaussian_experts(3, 1.0, 2, 3, generator=0), r"generator must be a torch.Generator \(torch"),
])
def test_a_forecaster_given_what_is_no_number_or_no_size_is_one_regret_error(call, match):
    with pytest.raises(RegretError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
    assert Forecaster(3, 0.1, 1.0, 5, shape=(2.0, np.int64(3))).shape == (2, 3)  # integral values are still sizes


def test_softmax_gd_follows_an_lr_schedule_set_between_rounds():
    gd, alpha = SoftmaxGD(3, 0.1), np.zeros(3)
    for eta, r in ((0.1, [1.0, 0.0, -1.0]), (0.7, [0.0, 2.0, -1.0]), (0.05, [-1.0, 0.5, 0.5])):
        gd.lr = eta
        u = np.exp(alpha - alpha.max())
        u /= u.sum()
        alpha = alpha + eta * u * (np.array(r) - u @ np.array(r))  # eq 5-6 with this round's η
        gd.update(torch.tensor(r, dtype=torch.float64))
        np.testing.assert_allclose(gd.log_weights.numpy(), alpha, rtol=1e-15, atol=1e-16)
