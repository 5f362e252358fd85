"""BayesNAS as a search method: the update on the curvature of nasdiag.hessian, the recorded γ/ω/s/C
against the closed forms of appendix §A recomputed from the record, pruning monotone and never emptying an
edge, pruned ops not computed, the mixed-path genotype, exact resume, one-line bad hyperparameters, a run()."""

from __future__ import annotations

import io
import math

import pytest
import torch

from nasdiag import vocabulary as V
from nasdiag.errors import ConfigError
from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network

B = 6


def make(seed=0, **hp):
    cls = get_method("bayesnas")
    torch.manual_seed(seed)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, primitives=cls.primitives).double()
    return cls(net, cls.Hyperparameters(**hp), schedule=Schedule(epochs=2, steps_per_epoch=2, batch_size=B))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    b = lambda: (torch.randn(B, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (B,), generator=g))  # noqa: E731
    return [(b(), b()) for _ in range(n)]


def test_update_follows_the_closed_forms_on_the_engines_curvature():
    m = make(update_every=1, init_gamma=0.5, reset_w=True)
    (train, val), = batches(1)
    # the curvature the update will use: nasdiag.hessian through SearchMethod.curvature at the same Z
    m.hessian_mode = "approx"
    gamma0 = {t: g.clone() for t, g in m.gamma.items()}
    stats = m.step(train, val)
    assert bool(stats[V.BAYES_UPDATED.path()])
    for t in m.gamma:
        assert V.family_of(V.BAYES_GAMMA.path(cell=t)) is V.BAYES_GAMMA
        H = stats[V.BAYES_CURVATURE.path(cell=t)]
        w = stats[V.ARCH_PARAMS.path(cell=t)]  # after the reset w = 1 on survivors
        C = stats[V.BAYES_COVARIANCE.path(cell=t)]
        pos = H > 0  # elsewhere C, ω, s keep their previous values (Laplace needs H > 0)
        torch.testing.assert_close(C[pos], (1 / (1 / gamma0[t] + H))[pos])  # A.3.2
        om = stats[V.BAYES_OMEGA.path(cell=t)]
        torch.testing.assert_close(om[pos], (torch.sqrt(gamma0[t] - C) / gamma0[t])[pos])  # A.2.8
        torch.testing.assert_close(om[~pos], torch.ones_like(om[~pos]))  # ω(0) = 1 kept
        s = stats[V.BAYES_PRIOR_VARIANCE.path(cell=t)]
        assert (s >= 0).all() and torch.isfinite(H).all()
        alive = stats[V.BAYES_SWITCH.path(cell=t)]
        gamma = stats[V.BAYES_GAMMA.path(cell=t)]
        # A.2.14 by a literal loop over the predecessors of each edge's source node
        for e, (i, _) in enumerate(m.network.edge_nodes):
            up = sum(float(s[f].sum()) for f, (_, j) in enumerate(m.network.edge_nodes) if j == i)
            want = s[e] if up == 0 else 1 / (1 / up + 1 / s[e])
            torch.testing.assert_close(gamma[e], want)
        # entropy rule, and w restarts at 1 on survivors, 0 on pruned ops
        expect = (0.5 * torch.log(2 * math.pi * math.e * gamma) > 0) | stats[V.BAYES_KEPT.path(cell=t)].unsqueeze(-1)
        assert torch.equal(alive & ~expect, torch.zeros_like(alive))
        torch.testing.assert_close(w, alive.double())


def test_mixing_curvature_is_the_engines():
    m = make()
    (train, _), = batches(1)
    m.hessian_mode = "approx"
    ref = m.curvature(*train)  # SearchMethod.curvature: arch_diag_hessian at eval_weights, summed over cells
    ours = m.mixing_curvature(*train)
    for t in ours:
        torch.testing.assert_close(ours[t], ref[V.HESSIAN_DIAG.path(cell=t)])


def test_pruning_is_monotone_keeps_one_op_and_pruned_ops_are_not_computed(monkeypatch):
    # w barely moves (tiny lr, no reset); a large curvature makes ω ≈ 1/√γ, so s ≈ |w|√γ: the ops whose w
    # is set small below are pruned at the next update; on edge 0 every op is small (one must be kept)
    m = make(update_every=1, w_lr=1e-9, reset_w=False)
    K = len(m.network.primitives)
    calls = iter(range(100))

    def fake_curvature(x, y):
        k = next(calls)
        with torch.no_grad():
            for a in m.network.arch_parameters():
                a[:, (k % (K - 1)) + 1] *= 1e-3
                if k == 0:
                    a[0] *= 1e-3
        return {t: torch.full_like(a, 1e6) for t, a in m.network.alphas().items()}

    monkeypatch.setattr(m, "mixing_curvature", fake_curvature)
    prev = {t: torch.ones_like(a, dtype=torch.bool) for t, a in m.alive.items()}
    for n, (train, val) in enumerate(batches(4)):
        stats = m.step(train, val)
        if n == 0:
            assert all(bool(stats[V.BAYES_KEPT.path(cell=t)][0]) for t in prev)
        for t in prev:
            alive = stats[V.BAYES_SWITCH.path(cell=t)]
            assert not (alive & ~prev[t]).any(), "a pruned op returned"
            assert alive.any(-1).all()
            assert alive[0].sum() == 1
            prev[t] = alive
    assert all((~a).any() for a in prev.values()), "the large curvature pruned nothing"
    # pruned ops are not computed: a forward with their modules broken still works
    net = m.network
    spec = next(e for e in net.edge_specs() if not m.alive[e.cell_type][e.edge_index].all())
    dead = int((~m.alive[spec.cell_type][spec.edge_index]).nonzero()[0])

    class Boom(torch.nn.Module):
        def forward(self, *args, **kw):
            raise AssertionError("a pruned op was computed")

    spec.ops[dead].forward = Boom().forward
    m.step(*batches(1, seed=9)[0])
    g = m.genotype()
    n_alive = sum(int(a.sum()) for a in m.alive.values())
    assert len(g.normal) + len(g.reduce) == n_alive


def test_resume_is_bitwise():
    data = batches(4)
    a = make(update_every=2)
    for tr, va in data[:2]:
        a.step(tr, va)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = make(seed=5, update_every=2)
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    for tr, va in data[2:]:
        sa, sb = a.step(tr, va), b.step(tr, va)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    assert bool(sa[V.BAYES_UPDATED.path()])


def test_bad_hyperparameters_are_one_line():
    cls = get_method("bayesnas")
    for bad in (["lambda_w=-1"], ["hessian_mode=magic"], ["init_gamma=0"], ["update_every=-2"]):
        with pytest.raises(ConfigError) as err:
            cls.Hyperparameters.parse(bad, "bayesnas")
        assert "\n" not in str(err.value)


def test_a_short_run(tmp_path):
    # one torch thread: two spinning threads on the shared 2-core box made this run 500 s instead of 7 s
    from nasdiag.record import load
    from nasdiag.search.config import SearchConfig
    from nasdiag.search.runner import run

    cfg = SearchConfig(method="bayesnas", dataset="synthetic", epochs=1, batch_size=16, C=4, layers=3, steps=2,
                       multiplier=2, record=str(tmp_path / "b.h5"), figures=None, diagnostics=(), progress=False, threads=1)
    result = run(cfg)
    rec = load(result.record)
    assert rec["bayes/normal/gamma"].shape[1:] == (5, 7) and rec["bayes/updated"][-1]
    assert rec["bayes/reduce/switch"].dtype == bool
    assert result.genotype.normal


def test_bayes_figures_are_drawn_from_a_record(tmp_path):
    """The four BayesNAS figures are registered for their families and drawn (γ = 0 of a pruned op and a
    NaN curvature do not break them); a record without bayes paths skips them."""
    import numpy as np
    from plot_records import EDGES, OPS, write_record

    from nasdiag.plot import write_figures

    E, K = len(EDGES), len(OPS)
    extra = {}
    for s in range(1, 5):
        gamma = np.full((E, K), 1.0 / s)
        gamma[0, 1] = 0.0
        alive = gamma > 0.06
        alive[np.arange(E), 0] = True
        curv = np.full((E, K), 0.1 * s)
        curv[1, 2] = np.nan
        extra[s] = {V.BAYES_GAMMA.path(cell="normal"): gamma, V.BAYES_OMEGA.path(cell="normal"): np.sqrt(curv),
                    V.BAYES_CURVATURE.path(cell="normal"): curv, V.BAYES_SWITCH.path(cell="normal"): alive}
    path = write_record(tmp_path / "b.h5", epochs=1, cells=("normal",), extra=extra)
    names = ["bayes_gamma", "bayes_omega", "bayes_curvature", "bayes_switches"]
    written = write_figures(str(path), tmp_path / "fig", figures=names)
    assert sorted(p.name for p in map(__import__("pathlib").Path, written)) == sorted(f"{n}_normal.png" for n in names)
    plain = write_record(tmp_path / "plain.h5", epochs=1, cells=("normal",))
    assert not write_figures(str(plain), tmp_path / "fig2", figures=names)
