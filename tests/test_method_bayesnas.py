"""BayesNAS as a search method: the update on the curvature of nasdiag.hessian, the recorded γ/ω/s/C
against the closed forms of appendix §A recomputed from the record, pruning monotone (an edge may lose every
op), pruned ops not computed, the mixed-path genotype, exact resume, one-line bad hyperparameters, a run()."""

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
    seen = {}
    energy = m.energy_curvature

    def spy(x, y):  # the per-cell curvature the update receives (ℵ, E, K)
        seen.update(energy(x, y))
        return seen

    m.energy_curvature = spy
    w0 = {}
    likelihood = m.likelihood_step

    def keep_w(x, y):  # w after step 1 (the update's w; reset_w then sets survivors to 1)
        out = likelihood(x, y)
        w0.update({t: a.detach().clone() for t, a in m.network.alphas().items()})
        return out

    m.likelihood_step = keep_w
    gamma0 = {t: g.clone() for t, g in m.gamma.items()}
    stats = m.step(train, val)
    assert bool(stats[V.BAYES_UPDATED.path()])
    cells = {t: sum(1 for c in m.network.cells if c.cell_type == t) for t in m.gamma}
    assert cells == {"normal": 1, "reduce": 2}  # a group of one and a group of two (A.3.6)
    for t in m.gamma:
        assert V.family_of(V.BAYES_GAMMA.path(cell=t)) is V.BAYES_GAMMA
        Hc = seen[t]  # (ℵ, E, K)
        assert Hc.shape[0] == cells[t]
        torch.testing.assert_close(stats[V.BAYES_CURVATURE.path(cell=t)], Hc.sum(0))
        w = stats[V.ARCH_PARAMS.path(cell=t)]  # after the reset w = 1 on survivors
        g0 = gamma0[t]
        Ci = 1 / (1 / g0 + Hc)  # A.3.2 per element of the group
        pos = (Hc > 0).any(0)  # elsewhere C, ω, s keep their previous values (Laplace needs H > 0)
        torch.testing.assert_close(stats[V.BAYES_COVARIANCE.path(cell=t)][pos], Ci.mean(0)[pos])
        om = stats[V.BAYES_OMEGA.path(cell=t)]
        want_om = torch.sqrt(((g0 - Ci) / g0**2).sum(0))  # A.3.9 (A.2.8 for ℵ = 1)
        torch.testing.assert_close(om[pos], want_om[pos])
        torch.testing.assert_close(om[~pos], torch.ones_like(om[~pos]))  # ω(0) = 1 kept
        s = stats[V.BAYES_PRIOR_VARIANCE.path(cell=t)]
        want_s = math.sqrt(cells[t]) * w0[t].abs() / want_om  # A.3.8: ‖(w, …, w)‖₂ / ω
        torch.testing.assert_close(s[pos], want_s[pos])
        assert (s >= 0).all() and torch.isfinite(Hc).all()
        alive = stats[V.BAYES_SWITCH.path(cell=t)]
        gamma = stats[V.BAYES_GAMMA.path(cell=t)]
        # A.2.14 by a literal loop over the predecessors of each edge's source node
        for e, (i, _) in enumerate(m.network.edge_nodes):
            up = sum(float(s[f].sum()) for f, (_, j) in enumerate(m.network.edge_nodes) if j == i)
            want = s[e] if up == 0 else 1 / (1 / up + 1 / s[e])
            torch.testing.assert_close(gamma[e], want)
        # entropy rule, and w restarts at 1 on survivors, 0 on pruned ops
        assert torch.equal(alive, 0.5 * torch.log(2 * math.pi * math.e * gamma) > 0)  # step 4, nothing kept
        torch.testing.assert_close(w, alive.double())


def test_energy_curvature_is_the_summed_loss_hessian_over_lambda_w():
    """The update's H (A.3.2) is diag ∇∇(E_D/λ_w) with E_D the batch's summed cross-entropy (Proposition 2,
    A.3.1 vs A.2.12), of each cell's own Z (the elements of the group of A.3.6): against autograd, float64."""
    lam = 0.02
    m = make(hessian_mode="exact_per_edge", lambda_w=lam)
    (train, _), = batches(1)
    x, y = train
    net = m.network
    weights = m.forward_weights()
    leaves = [weights[c.cell_type].clone().requires_grad_(True) for c in net.cells]
    energy = torch.nn.functional.cross_entropy(net(x, leaves), y, reduction="sum") / lam
    grads = torch.autograd.grad(energy, leaves, create_graph=True)
    want = {t: [] for t in weights}
    for cell, leaf, g in zip(net.cells, leaves, grads):
        d = torch.zeros_like(leaf)
        for e in range(g.shape[0]):
            for k in range(g.shape[1]):
                d[e, k] = torch.autograd.grad(g[e, k], leaf, retain_graph=True)[0][e, k]
        want[cell.cell_type].append(d)
    got = m.energy_curvature(x, y)
    for t in want:
        torch.testing.assert_close(got[t], torch.stack(want[t]), rtol=1e-7, atol=1e-9)
        assert got[t].abs().max() > 1  # B/λ_w = 300 times the mean-loss curvature: not a vacuous comparison


def test_tiny_curvature_and_a_near_zero_weight_prune_the_op_and_the_genotype_is_what_survives():
    """An op whose output is scaled to ~0 (its last BatchNorm's weight 1e-4: tiny curvature, H ∝ 1e-8) and
    whose w the ℓ1 term has brought to ~0 gets s = |w|/ω ≪ 1/(2πe) (A.2.8, A.2.13) and is pruned at the next
    update (Algorithm 2, step 4) on every edge; ops with w = 1 survive. The genotype lists exactly the
    surviving (op, i, j) (mixed path)."""
    cls = get_method("bayesnas")
    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1, affine=True, primitives=cls.primitives).double()
    m = cls(net, cls.Hyperparameters(update_every=1, w_lr=1e-12), schedule=Schedule(epochs=1, steps_per_epoch=1, batch_size=B))
    k = net.primitives.index("sep_conv_3x3")
    with torch.no_grad():
        for spec in net.edge_specs():
            if spec.cell_type == "normal":
                bn = [mod for mod in spec.ops[k].modules() if isinstance(mod, torch.nn.BatchNorm2d)][-1]
                bn.weight.fill_(1e-4)
                bn.bias.zero_()
        net.alphas()["normal"][:, k] = 1e-9
    (train, val), = batches(1)
    stats = m.step(train, val)
    H = stats[V.BAYES_CURVATURE.path(cell="normal")]  # the normal cell type has one cell: a group of one
    assert (H[:, k] < 1e-3 * H[:, :k].min()).all()  # the op's curvature is tiny next to the others'
    s = stats[V.BAYES_PRIOR_VARIANCE.path(cell="normal")]
    # A.3.2, A.2.8, A.2.13 from γ(0) = 1: C = 1/(1 + H), ω = √(1 − C) = √(H/(1 + H)), s = |w|/ω (w moved by
    # lr·λ_w ≈ 1e-14 in step 1, hence rtol)
    torch.testing.assert_close(s[:, k], 1e-9 / torch.sqrt(H[:, k] / (1 + H[:, k])), rtol=1e-4, atol=0)
    assert (s[:, k] < 1 / (2 * math.pi * math.e)).all()
    expected = {"normal": torch.ones(5, 7, dtype=torch.bool), "reduce": torch.ones(5, 7, dtype=torch.bool)}
    expected["normal"][:, k] = False
    for t in expected:
        assert torch.equal(stats[V.BAYES_SWITCH.path(cell=t)], expected[t]), t
    g = m.genotype()
    for cell, ops in (("normal", g.normal), ("reduce", g.reduce)):
        want = sorted((p, i, j) for e, (i, j) in enumerate(net.edge_nodes) for o, p in enumerate(net.primitives)
                      if expected[cell][e, o])
        assert sorted(ops) == want


def test_default_ggn_curvature_on_near_one_hot_predictions_and_refusal_of_a_concave_loss():
    """The default mode on a fitted batch: with near one-hot predictions every output-Hessian block is ~0 and its
    eigenvalues are round-off (±1e-18); that is not a non-convex loss, so the update gets a finite H ≥ 0. A
    loss that is concave in the outputs (−CE) is still refused."""
    from nasdiag.hessian import CurvatureError, arch_diag_hessian
    from nasdiag.search.methods.bayesnas import _AtFixedWeights

    m = make()
    (train, _), = batches(1)
    with torch.no_grad():
        m.network.classifier.weight.mul_(1e3)  # logits ~1e3: softmax one-hot to round-off
    H = m.cell_curvatures(*train)
    for h in H.values():
        assert torch.isfinite(h).all() and (h >= 0).all()
    m = make()  # not fitted: −CE has clearly negative output curvature
    net = m.network
    edges = {f"net.{e.name}": e for e in net.edge_specs()}
    with pytest.raises(CurvatureError, match="non-negative curvature"):
        arch_diag_hessian(_AtFixedWeights(net, m.forward_weights()), lambda o, t: -torch.nn.functional.cross_entropy(o, t),
                          *batches(1, seed=3)[0][0], edges, mode="ggn")


def test_mixing_curvature_is_the_engines():
    m = make()
    (train, _), = batches(1)
    m.hessian_mode = m.hp.hessian_mode
    ref = m.curvature(*train)  # SearchMethod.curvature: arch_diag_hessian at eval_weights, summed over cells
    ours = m.mixing_curvature(*train)
    for t in ours:
        torch.testing.assert_close(ours[t], ref[V.HESSIAN_DIAG.path(cell=t)])


def test_pruning_is_monotone_may_empty_an_edge_and_pruned_ops_are_not_computed(monkeypatch):
    # w barely moves (tiny lr, no reset); a large curvature makes ω ≈ 1/√γ, so s ≈ |w|√γ: the ops whose w
    # is set small below are pruned at the next update; on edge 0 every op is small (the edge is removed)
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
        return {t: torch.full((sum(1 for c in m.network.cells if c.cell_type == t), *a.shape), 1e6, dtype=a.dtype)
                for t, a in m.network.alphas().items()}

    monkeypatch.setattr(m, "cell_curvatures", fake_curvature)
    prev = {t: torch.ones_like(a, dtype=torch.bool) for t, a in m.alive.items()}
    for n, (train, val) in enumerate(batches(4)):
        stats = m.step(train, val)
        for t in prev:
            alive = stats[V.BAYES_SWITCH.path(cell=t)]
            assert not (alive & ~prev[t]).any(), "a pruned op returned"
            assert not alive[0].any()  # edge 0 is removed (Algorithm 2 step 4 keeps nothing)
            prev[t] = alive
    assert all((~a).any() for a in prev.values()), "the large curvature pruned nothing"
    # pruned ops are not computed: a forward with their modules broken still works
    net = m.network
    spec = next(e for e in net.edge_specs() if not m.alive[e.cell_type][e.edge_index].all()
                and m.alive[e.cell_type][e.edge_index].any())
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


def test_a_state_loaded_on_the_cpu_goes_to_the_devices_the_run_keeps_its_state_on():
    """A checkpoint is loaded on the CPU; a resumed CUDA run crashed in its next update ('Expected all tensors
    to be on the same device': γ, ω, s, C are {cell type: tensor} on the GPU). The meta device stands in for
    CUDA; the pruning masks stay on the CPU, where the run keeps them."""
    a = make()
    state = a.state_dict()
    b = make(seed=5)
    for name in ("gamma", "omega", "prior_variance", "covariance"):
        setattr(b, name, {t: v.to("meta") for t, v in getattr(b, name).items()})
    b.load_state_dict(state)
    for name in ("gamma", "omega", "prior_variance", "covariance"):
        assert {v.device.type for v in getattr(b, name).values()} == {"meta"}, name
    assert {v.device.type for v in b.alive.values()} == {"cpu"}
    assert all(torch.equal(b.alive[t], a.alive[t]) for t in a.alive)


def test_bad_hyperparameters_are_one_line():
    cls = get_method("bayesnas")
    for bad in (["lambda_w=-1"], ["lambda_w=0"], ["hessian_mode=magic"], ["init_gamma=0"], ["update_every=-2"]):
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
