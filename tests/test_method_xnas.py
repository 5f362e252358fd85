"""XNAS as a search method: Algorithm 1 re-run by a literal per-edge reference from the recorded rewards,
Lemma 1 (the best expert in hindsight survives) and Theorem 1 (regret ≤ bound) on a real search, wiped-out
ops not computed, no edge ever losing every op, exact resume, NaN handling."""

from __future__ import annotations

import io
import math

import pytest
import torch

from nasdiag.search import Schedule, SearchError, get_method
from nasdiag.supernet import Network

STEPS = 8


def make(seed=0, **hp):
    torch.manual_seed(seed)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()
    cls = get_method("xnas")
    method = cls(net, cls.Hyperparameters(**hp), schedule=Schedule(epochs=2, steps_per_epoch=STEPS // 2, batch_size=6))
    return method


def batches(seed=1, n=STEPS):
    g = torch.Generator().manual_seed(seed)
    b = lambda: (torch.randn(6, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g))  # noqa: E731
    return [(b(), b()) for _ in range(n)]


def algorithm_1(rewards, eta, L, T, zeta):
    """Literal Algorithm 1 for one forecaster: rewards[t][i] of rounds t = 1..T; returns per round
    (ln v, alive set, regret) with the mixture of the previous round predicting (line 5)."""
    N = len(rewards[0])
    log_v, alive = [0.0] * N, set(range(N))
    forecaster_reward, totals, out = 0.0, [0.0] * N, []
    for t, r in enumerate(rewards, start=1):
        z = sum(math.exp(log_v[i]) for i in alive)
        forecaster_reward += sum(math.exp(log_v[i]) / z * r[i] for i in alive)
        totals = [a + b for a, b in zip(totals, r)]
        for i in alive:  # line 9
            log_v[i] += eta * r[i]
        theta = max(log_v[i] for i in alive) - 2 * eta * L * (T - t) * zeta  # line 11, in logs
        alive = {i for i in alive if log_v[i] >= theta}  # line 12
        out.append((list(log_v), set(alive), max(totals) - forecaster_reward))
    return out


def test_recorded_weights_and_alive_masks_are_algorithm_1_on_the_recorded_rewards():
    L = 0.05  # small enough that the rewards reach it, so wipeouts happen within the 8 steps
    method = make(grad_clip=L)
    rows = [method.step(*b) for b in batches()]
    for cell, r in (("normal", 1), ("reduce", 2)):
        T = STEPS * r
        eta = math.sqrt(2 * math.log(8) / (T * L * L))  # eq 4
        rewards = torch.cat([row[f"regret/{cell}/rewards"] for row in rows])  # (T, E, K), one round per cell
        assert rewards.shape == (T, 5, 8) and rewards.abs().max() <= L
        for e in range(5):
            reference = algorithm_1(rewards[:, e].tolist(), eta, L, T, 1.0)
            for step, row in enumerate(rows):
                log_v, alive, regret = reference[(step + 1) * r - 1]  # the state after the step's last round
                recorded_alive = row[f"regret/{cell}/alive"][e]
                assert recorded_alive.tolist() == [i in alive for i in range(8)], (cell, e, step)
                got = row[f"regret/{cell}/log_weights"][e]
                want = torch.tensor(log_v, dtype=torch.float64)
                # wiped-out experts are recorded with the ln v at which they were removed
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
                assert abs(float(row[f"regret/{cell}/regret"][e]) - regret) < 1e-12
            # Lemma 1: the best expert in hindsight is alive at the end; Theorem 1: regret ≤ bound throughout
            best = int(rewards[:, e].sum(0).argmax())
            assert rows[-1][f"regret/{cell}/alive"][e, best]
        for row in rows:
            assert (row[f"regret/{cell}/regret"] <= row[f"regret/{cell}/bound"] + 1e-12).all()
    wiped = sum(int(row[f"regret/{c}/wipeouts"].sum()) for row in rows for c in ("normal", "reduce"))
    assert wiped > 20  # the comparison covered wipeouts
    last = rows[-1]
    masked = last["regret/normal/log_weights"].masked_fill(~last["regret/normal/alive"], -math.inf)
    torch.testing.assert_close(method.probabilities()["normal"], torch.softmax(masked, -1))


def test_wiped_out_ops_are_not_computed_in_later_forwards():
    method = make(grad_clip=0.05)
    data = batches()
    for b in data[:6]:
        method.step(*b)
    alive = method.active_ops()
    assert not alive["normal"].all()
    calls = {}
    handles = []
    for spec in method.network.edge_specs():
        for k, op in enumerate(spec.ops):
            key = (spec.cell_index, spec.cell_type, spec.edge_index, k)
            handles.append(op.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls.get(key, 0) + 1)))
    try:
        stats = method.step(*data[6])
    finally:
        for h in handles:
            h.remove()
    for (_, cell, e, k), n in calls.items():
        assert alive[cell][e, k], f"wiped-out op {k} of {cell} edge {e} was computed"
    assert len(calls) == sum(int(alive[t].sum()) * r for t, r in method.replications.items())
    expected = sum(int(alive[t].sum()) * r for t, r in method.replications.items()) / (3 * 5 * 8)
    assert float(stats["scalars/active_fraction"]) == pytest.approx(expected)


def test_adversarial_rewards_never_wipe_out_every_op_of_an_edge():
    cls = get_method("xnas")

    class Adversarial(cls):
        """Rewards ±L with one leader that rotates every round, and ties: the harshest case for the wipeout."""

        def rewards(self, per_cell):
            out = {}
            for t, r in self.replications.items():
                k = self.forecasters[t].rounds
                R = torch.full((r, 5, 8), -self.hp.grad_clip, dtype=torch.float64)
                R[:, :, k % 8] = self.hp.grad_clip
                R[:, 0, :] = self.hp.grad_clip  # edge 0: all tied
                out[t] = R
            return out

    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()
    method = Adversarial(net, cls.Hyperparameters(zeta=1e-6), schedule=Schedule(epochs=1, steps_per_epoch=STEPS))
    for b in batches():
        stats = method.step(*b)
        for t in ("normal", "reduce"):
            assert stats[f"regret/{t}/alive"].any(-1).all()
    assert stats["regret/normal/alive"][0].all()  # ties survive
    assert stats["regret/normal/alive"][1:].sum(-1).eq(1).all()  # ζ → 0 keeps only the leader


def test_state_dict_resumes_bit_identically():
    method = make(grad_clip=0.05)
    data = batches()
    for b in data[:4]:
        method.step(*b)
    buffer = io.BytesIO()
    torch.save(method.state_dict(), buffer)
    buffer.seek(0)
    fresh = make(seed=123, grad_clip=0.05)
    fresh.load_state_dict(torch.load(buffer, weights_only=False))
    for b in data[4:6]:
        a, f = method.step(*b), fresh.step(*b)
        assert a.keys() == f.keys()
        for k in a:
            assert torch.equal(a[k], f[k]), k
    for (n, p), (_, q) in zip(method.network.named_parameters(), fresh.network.named_parameters()):
        assert torch.equal(p, q), n
    assert method.forecasters["normal"].wipeout_log.round.tolist() == fresh.forecasters["normal"].wipeout_log.round.tolist()


def test_nan_losses_raise_a_search_error_and_leave_the_forecasters_alone():
    method = make()
    (train, val), = batches(n=1)
    before = method.forecasters.state_dict()
    bad = val[0].clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(SearchError, match="search-val loss is nan"):
        method.step(train, (bad, val[1]))
    after = method.forecasters.state_dict()
    assert torch.equal(after["normal"]["log_weights"], before["normal"]["log_weights"]) and after["normal"]["rounds"] == 0
    with pytest.raises(SearchError, match="search-train loss is nan"):
        method.step((bad, train[1]), val)


def test_learning_rates_are_eq_4_per_cell_type_with_horizon_steps_times_cells():
    method = make()
    for t, r in (("normal", 1), ("reduce", 2)):
        f = method.forecasters[t]
        assert f.horizon == STEPS * r
        assert f.lr == pytest.approx(math.sqrt(2 * math.log(8) / (STEPS * r * 25.0)))


@pytest.mark.slow  # draws with matplotlib
def test_regret_figures_draw_from_a_record_of_the_steps(tmp_path):
    from nasdiag import vocabulary as V
    from nasdiag.plot import write_figures
    from nasdiag.record import Recorder, load

    method = make(grad_clip=0.05)
    path = tmp_path / "run.h5"
    with Recorder(str(path), meta={"method": "xnas", "op_names": method.network.primitives}) as rec:
        for step, b in enumerate(batches(), start=1):
            stats = method.step(*b)
            assert all(V.family_of(p) is not None for p in stats), [p for p in stats if V.family_of(p) is None]
            rec.log(step, {k: v.cpu().numpy() for k, v in stats.items()})
    record = load(path)
    assert record["regret/reduce/rewards"].shape == (STEPS, 2, 5, 8)
    assert record["regret/normal/alive"][-1].sum() < 5 * 8  # wipeouts were recorded
    written = write_figures(path, tmp_path / "figs", figures=["regret"], dpi=40)
    assert {p.name for p in written} == {f"{name}_{cell}.png" for name in ("regret_bound", "alive_experts", "wipeouts")
                                         for cell in ("normal", "reduce")}


@pytest.mark.slow  # a short search on digits
def test_search_run_records_regret_every_step(tmp_path):
    import numpy as np

    from nasdiag.record import load
    from nasdiag.search import SearchConfig, run

    run(SearchConfig(method="xnas", C=4, layers=3, steps=2, batch_size=240, diagnostics=(), progress=False,
                     hp={"reward_bound": 0.01}, epochs=2, record=str(tmp_path / "x.h5")))
    rec = load(str(tmp_path / "x.h5"))
    S = 719 // 240
    assert rec["step"].tolist() == list(range(1, 2 * S + 1))
    assert rec["regret/reduce/rewards"].shape == (2 * S, 2, 5, 8)
    assert (rec["regret/normal/regret"] <= rec["regret/normal/bound"] + 1e-6).all()
    assert rec["regret/normal/alive"][-1].sum(-1).min() >= 1
    assert np.isfinite(rec["scalars/search_val_acc"][np.flatnonzero(rec["valid/scalars/search_val_acc"])]).all()
