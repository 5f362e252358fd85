"""Round-19 audit of the α-Hessian spectrum (RobustDARTS's signal), the exact shared-α diagonal and how a search
records the top eigenvalue, against references built here (float64), never against nasdiag itself.

References: a hand-made supernet of three cells sharing one α (3 edges × 4 candidates: conv → affine-free train-mode
BatchNorm, skip, zero, avg-pool → affine-free BatchNorm; softmax mixing); its dense ∂²L/∂α² by reverse-over-reverse
autograd columns (one ``torch.autograd.grad`` of each gradient entry: right through ``F.batch_norm(training=True)``,
where ``torch.func.hessian``'s mixed derivatives are not, docs/hessian.md), checked symmetric; the per-cell
Hessian (each cell its own copy of α) for the cross-cell terms; ``torch.linalg.eigh``; closed-form operators of
known spectrum.

What was wrong (fixed with this file): ``dim=True`` or ``batch_size=True`` (a bool where an int is asked, as round 16
fixed for ``iters``) reached torch: ``torch.zeros``' / ``randint``'s multi-line TypeError, or a 1-dim operator.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import CurvatureError, alpha_diag_hessian, arch_diag_hessian, diagonal_from_hvp
from nasdiag.hessian import eigenvalues_from_hvp, hessian_eigenvalues, hutchinson_diagonal, hutchinson_trace, trace_from_hvp
from nasdiag.hessian.spectrum import NonFiniteHessianError
from test_audit_hessian_round16 import _Zero as Zero  # the zero op, x · 0
from test_audit_methods_round3 import _small_digits

DT = torch.float64


class Mixed(nn.Module):
    """Σ_k w_k O_k(x): conv → BN, skip, zero, avg-pool → BN (BN affine-free, train mode)."""

    def __init__(self, C):
        super().__init__()
        self.ops = nn.ModuleList([
            nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C, affine=False)),
            nn.Identity(),
            Zero(),
            nn.Sequential(nn.AvgPool2d(3, 1, 1, count_include_pad=False), nn.BatchNorm2d(C, affine=False)),
        ])

    def forward(self, x, w):
        return sum(w[k] * op(x) for k, op in enumerate(self.ops))


class SharedNet(nn.Module):
    """Three cells (n1 = e0(h); out = e1(n1) + e2(h)) mixing with softmax(α), one α (3, 4) shared by all cells;
    ``forward(x, alphas)`` gives each cell its own α (the per-cell blocks)."""

    def __init__(self, C=2, cells=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, C, 3, padding=1, bias=False), nn.BatchNorm2d(C))
        self.cells = nn.ModuleList([nn.ModuleList([Mixed(C) for _ in range(3)]) for _ in range(cells)])
        self.alpha = nn.Parameter(0.5 * torch.randn(3, 4))
        self.head = nn.Linear(C, 5)

    def arch_parameters(self):
        return [self.alpha]

    def forward(self, x, alphas=None):
        h = self.stem(x)
        for c, cell in enumerate(self.cells):
            z = torch.softmax(self.alpha if alphas is None else alphas[c], -1)
            n1 = cell[0](h, z[0])
            h = cell[1](n1, z[1]) + cell[2](h, z[2])
        return self.head(h.mean((2, 3)))

    def edges(self):
        return {f"c{c}.e{e}": (m, list(m.ops)) for c, cell in enumerate(self.cells) for e, m in enumerate(cell)}


def dense(f, at):
    """∂²f/∂a² (n, n) by reverse-over-reverse columns."""
    a = at.detach().clone().requires_grad_(True)
    g = torch.autograd.grad(f(a), a, create_graph=True)[0].reshape(-1)
    return torch.stack([torch.autograd.grad(g[i], a, retain_graph=True)[0].reshape(-1) for i in range(g.numel())])


def _state(net):
    return {k: v.clone() for k, v in net.state_dict(keep_vars=False).items()}, [m.training for m in net.modules()]


def _hooks(net):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in net.modules())


@pytest.fixture(scope="module")
def shared():
    torch.manual_seed(0)
    net = SharedNet().to(DT)
    x, y = torch.randn(4, 1, 4, 4, dtype=DT), torch.randint(0, 5, (4,))
    ref = copy.deepcopy(net)  # its forwards move its own running statistics, not the audited net's
    H = dense(lambda a: F.cross_entropy(torch.func.functional_call(ref, {"alpha": a}, (x,)), y), net.alpha)
    per_cell = dense(lambda A: F.cross_entropy(ref(x, list(A)), y), net.alpha.detach().expand(3, 3, 4))
    return net, x, y, H, per_cell.reshape(3, 12, 3, 12)


def test_shared_alpha_spectrum_and_diagonals_are_the_own_dense_ones_and_leave_the_net_as_it_was(shared):
    net, x, y, H, blocks = shared
    scale = float(H.abs().max())
    assert float((H - H.T).abs().max()) < 1e-12 * scale  # the reference is a Hessian
    # the shared-α Hessian is the sum of every cell pair's block (the chain rule of α entering all cells)
    torch.testing.assert_close(sum(blocks[c, :, d, :] for c in range(3) for d in range(3)), H, rtol=0, atol=1e-12 * scale)
    ev, U = torch.linalg.eigh(H)
    before, modes = _state(net)

    res = hessian_eigenvalues(net, F.cross_entropy, x, y, k=3)
    assert res.converged and res.method == "lanczos"
    torch.testing.assert_close(res.eigenvalues, ev.flip(0)[:3], rtol=0, atol=1e-10 * scale)
    assert abs(res.largest_algebraic - float(ev[-1])) <= 1e-10 * scale  # RobustDARTS's λ_max: largest algebraic
    assert abs(res.smallest_algebraic - float(ev[0])) <= 1e-10 * scale
    assert abs(res.largest_magnitude - float(ev[ev.abs().argmax()])) <= 1e-10 * scale
    # its eigenvector (not returned): the Rayleigh quotient of eigh's top vector is the reported value
    u = U[:, -1]
    assert abs(float(u @ H @ u) - res.largest_algebraic) <= 1e-10 * scale
    # the softmax's shift invariance: one exact zero per edge (H·1_e = 0), which Lanczos' restarts cope with
    for e in range(3):
        ones = torch.zeros(3, 4, dtype=DT)
        ones[e] = 1
        assert float((H @ ones.reshape(-1)).abs().max()) < 1e-12 * scale

    diag = alpha_diag_hessian(net, F.cross_entropy, x, y)["alpha"]
    torch.testing.assert_close(diag.reshape(-1), H.diagonal(), rtol=0, atol=1e-12 * scale)
    # exact_per_edge summed over the cells is the shared diagonal less exactly the cross-cell terms (c ≠ c')
    cross = sum(blocks[c, :, d, :].diagonal() for c in range(3) for d in range(3) if c != d)
    per_edge = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact_per_edge", wrt="alpha")
    summed = torch.stack([sum(per_edge[f"c{c}.e{e}"] for c in range(3)) for e in range(3)]).reshape(-1)
    torch.testing.assert_close(summed, H.diagonal() - cross, rtol=0, atol=1e-12 * scale)
    assert float(cross.abs().max()) > 0.05 * float(H.diagonal().abs().max())  # the terms are not negligible here

    after, modes_after = _state(net)
    assert modes_after == modes and all(torch.equal(before[k], after[k]) for k in before)  # incl. num_batches_tracked
    assert net.alpha.grad is None and all(p.grad is None for p in net.parameters()) and _hooks(net) == 0


def test_hutchinson_on_the_shared_alpha_is_unbiased_within_its_own_variance(shared):
    net, x, y, H, _ = shared
    n = 64
    tr = hutchinson_trace(net, F.cross_entropy, x, y, samples=n, seed=3)
    # one probe's variance 2 Σ_{i≠j} H_ij² (Rademacher); 5 standard deviations of the mean
    sd = math.sqrt(2 * float((H.square().sum() - H.diagonal().square().sum())) / n)
    assert abs(tr.estimate - float(H.trace())) < 5 * sd
    assert 0.5 * sd < tr.stderr < 2 * sd  # the reported standard error estimates that standard deviation
    dg = hutchinson_diagonal(net, F.cross_entropy, x, y, samples=n, seed=3).estimate[0].reshape(-1)
    # entry i is a Rademacher sum of ±H_ij, j ≠ i: Hoeffding with a union bound over the 12 entries (p = 1e-6)
    bound = torch.sqrt(2 * (H.square().sum(1) - H.diagonal().square()) * math.log(2 * 12 / 1e-6) / n)
    assert bool(((dg - H.diagonal()).abs() <= bound).all())


def _op(M):
    return lambda v: v @ M  # M symmetric: H v for a (dim,) vector or a (m, dim) stack


def test_degenerate_spectra_come_back_exact_and_flagged_honestly():
    g = torch.Generator().manual_seed(1)
    Q, _ = torch.linalg.qr(torch.randn(8, 8, dtype=DT, generator=g))
    spectra = {
        "zero": [0.0] * 8,
        "repeated top": [3.0, 3.0, 3.0, 1.0, 0.0, 0.0, -1.0, -2.0],
        "|λ_min| > λ_max": [1.0, 0.5, 0.0, 0.0, -1.0, -2.0, -5.0, -5.0],
        "negative definite": [-1.0, -1.5, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0],
    }
    for name, spectrum in spectra.items():
        M = Q @ torch.diag(torch.tensor(spectrum, dtype=DT)) @ Q.T
        M = (M + M.T) / 2
        ev = torch.linalg.eigvalsh(M)
        tol = 1e-9 * max(float(ev.abs().max()), 1.0)
        for k in (1, 3):
            res = eigenvalues_from_hvp(_op(M), 8, k=k)
            assert res.converged, name
            torch.testing.assert_close(res.eigenvalues, ev.flip(0)[:k], rtol=0, atol=tol, msg=name)
            assert abs(res.largest_magnitude - float(ev[ev.abs().argmax()])) <= tol, name
        power = eigenvalues_from_hvp(_op(M), 8, method="power", iters=5000, tol=1e-10)
        assert power.converged and abs(power.largest_algebraic - float(ev[-1])) <= 1e-6 * max(float(ev.abs().max()), 1), name
    # |λ_max| = |λ_min|: power iteration cannot tell the two apart and must say so, not report a number as converged
    M = Q @ torch.diag(torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0], dtype=DT)) @ Q.T
    assert not eigenvalues_from_hvp(_op((M + M.T) / 2), 8, method="power", iters=300).converged
    # a budget too short for the answer says so (Ritz residual above tol), and never claims a wrong value converged
    M = Q @ torch.diag(torch.linspace(-1, 1, 8, dtype=DT)) @ Q.T
    short = eigenvalues_from_hvp(_op((M + M.T) / 2), 8, iters=3)
    assert not short.converged and short.largest_algebraic < 1 - 1e-6


def test_one_alpha_entry_is_a_one_by_one_hessian_in_every_function():
    class One(nn.Module):  # a scalar α mixing two ops by sigmoid(α), then BatchNorm in train mode
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.tensor(0.3, dtype=DT))
            self.l1, self.bn, self.l2 = nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 3)

        def arch_parameters(self):
            return [self.a]

        def forward(self, x):
            p = torch.sigmoid(self.a)
            return self.l2(self.bn(p * torch.tanh(self.l1(x)) + (1 - p) * x.sum(1, keepdim=True)))

    torch.manual_seed(0)
    m = One().to(DT)
    x, y = torch.randn(5, 3, dtype=DT), torch.randint(0, 3, (5,))
    ref = copy.deepcopy(m)
    h = float(dense(lambda a: F.cross_entropy(torch.func.functional_call(ref, {"a": a}, (x,)), y), m.a)[0, 0])
    assert h != 0
    for method in ("lanczos", "power"):
        res = hessian_eigenvalues(m, F.cross_entropy, x, y, method=method)
        assert res.converged and abs(res.largest_algebraic - h) <= 1e-12 * abs(h)
    assert abs(hutchinson_trace(m, F.cross_entropy, x, y, samples=4).estimate - h) <= 1e-12 * abs(h)  # z² = 1: exact
    assert abs(float(hutchinson_diagonal(m, F.cross_entropy, x, y, samples=4).estimate[0]) - h) <= 1e-12 * abs(h)
    assert abs(float(alpha_diag_hessian(m, F.cross_entropy, x, y)["a"]) - h) <= 1e-12 * abs(h)


def test_a_nan_in_the_batch_is_a_nonfinite_error_in_every_spectrum_function_and_leaves_the_net(shared):
    net, x, y, _, _ = shared
    bad = x.clone()
    bad[1, 0, 2, 2] = float("nan")
    before, modes = _state(net)
    for fn in (hessian_eigenvalues, hutchinson_trace, hutchinson_diagonal):
        with pytest.raises(NonFiniteHessianError):
            fn(net, F.cross_entropy, bad, y)
    assert torch.isnan(alpha_diag_hessian(net, F.cross_entropy, bad, y)["alpha"]).all()  # NaN kept, not a number
    after, modes_after = _state(net)
    assert modes_after == modes and all(torch.equal(before[k], after[k]) for k in before)


def test_a_bool_dimension_or_batch_size_is_one_line_not_torchs_error():
    M = torch.tensor([[2.0, 0.5], [0.5, -1.0]], dtype=DT)
    calls = [
        lambda: eigenvalues_from_hvp(_op(M), True),
        lambda: hessian_eigenvalues(_op(M), True),
        lambda: trace_from_hvp(_op(M), True, samples=4),
        lambda: hutchinson_trace(hvp=_op(M), dim=True, samples=4),
        lambda: trace_from_hvp(_op(M), 2, samples=4, batch_size=True),
        lambda: diagonal_from_hvp(_op(M), 2, samples=4, batch_size=True),
        lambda: hutchinson_diagonal(hvp=_op(M), dim=2, samples=4, batch_size=True),
    ]
    for call in calls:
        with pytest.raises(CurvatureError, match=r"^[^\n]*(dim|batch_size) must be a positive int, got True$"):
            call()


def test_a_single_level_search_records_the_dense_top_eigenvalues_of_its_row_and_is_not_perturbed_by_them(
        tmp_path, monkeypatch):
    """SNAS (single-level: the spectrum is taken on the step's search-train batch), ``spectrum_every=3``: the last
    row's per-type and joint λ_max are eigvalsh of the own dense ∂²L/∂α² at the final state (α shared by the cells of
    a type, Z = softmax(α), train-mode BatchNorm); and the run with the measurement records every other path bitwise
    as the run without it (running statistics, train mode and the random draws untouched by the measurement)."""
    import numpy as np

    from nasdiag.record import load
    from nasdiag.search import SearchConfig, run
    from nasdiag.search.runner import epoch_batches

    cut = _small_digits(monkeypatch)  # digits cut to 12 search-train and 12 search-val samples: 3 steps of 4
    recs, results = {}, {}
    for every in (0, 3):
        cfg = SearchConfig(method="snas", C=2, layers=3, steps=2, multiplier=2, batch_size=4, epochs=1, dtype="float64",
                           progress=False, threads=1, record=str(tmp_path / f"run{every}.h5"), device="cpu",
                           spectrum_every=every, diagnostics=())
        results[every] = run(cfg)
        recs[every] = load(cfg.record)
    for path, values in recs[0].items():
        if path != "meta/config":
            np.testing.assert_array_equal(np.asarray(recs[3][path]), np.asarray(values), err_msg=path)
    assert "hessian/top_eigenvalue" not in recs[0]
    (plain, plain_modes), (measured, measured_modes) = (_state(results[e].method.network) for e in (0, 3))
    assert measured_modes == plain_modes and all(torch.equal(plain[k], measured[k]) for k in plain)  # running stats too

    method = results[3].method
    assert method.single_level
    net = copy.deepcopy(method.network)  # the state after step 3, the row's (the epoch end changes no weight)
    x, y = list(epoch_batches(cut("digits", seed=cfg.seed, dtype=DT).train, 4, cfg.seed, 0))[2]
    alphas = {t: a.detach() for t, a in net.alphas().items()}
    sizes = [a.numel() for a in alphas.values()]

    def loss(flat):
        parts = torch.split(flat, sizes)
        return F.cross_entropy(net(x, {t: torch.softmax(p.reshape(a.shape), -1)
                                       for (t, a), p in zip(alphas.items(), parts)}), y)

    H = dense(loss, torch.cat([a.reshape(-1) for a in alphas.values()]))
    scale = float(H.abs().max())
    assert float((H - H.T).abs().max()) < 1e-12 * scale
    row = recs[3]
    assert row["valid/hessian/top_eigenvalue"].tolist() == [False, False, True]
    assert abs(float(row["hessian/top_eigenvalue"][2]) - float(torch.linalg.eigvalsh(H)[-1])) <= 1e-8 * scale
    start = 0
    for t, n in zip(alphas, sizes):
        block = H[start:start + n, start:start + n]
        assert abs(float(row[f"hessian/{t}/top_eigenvalue"][2]) - float(torch.linalg.eigvalsh(block)[-1])) <= 1e-8 * scale
        assert not row[f"hessian/{t}/nonfinite"][2]
        start += n


def test_an_empty_batch_is_one_line_not_a_zero_spectrum_of_a_nan_loss(shared):
    """x[:0]: the mean loss over no samples is NaN, but nothing carries it into the products (no output entry to
    differentiate through): the spectrum was 0.0 'converged', the trace and the shared diagonal zeros, and
    arch_diag_hessian(mode='diag') torch's amax RuntimeError; diag_hessian refuses such a batch in one line, so do
    these now, before any forward."""
    from nasdiag.hessian import exact_arch_diag_hessian, loss_hvp

    net, x, y, _, _ = shared
    before, modes = _state(net)
    calls = [
        lambda: hessian_eigenvalues(net, F.cross_entropy, x[:0], y[:0]),
        lambda: hutchinson_trace(net, F.cross_entropy, x[:0], y[:0]),
        lambda: hutchinson_diagonal(net, F.cross_entropy, x[:0], y[:0]),
        lambda: loss_hvp(net, F.cross_entropy, x[:0], y[:0]),
        lambda: alpha_diag_hessian(net, F.cross_entropy, x[:0], y[:0]),
        lambda: arch_diag_hessian(net, F.cross_entropy, x[:0], y[:0], net.edges(), mode="diag"),
        lambda: arch_diag_hessian(net, F.cross_entropy, x[:0], y[:0], net.edges(), mode="exact_per_edge", wrt="alpha"),
        lambda: exact_arch_diag_hessian(net, F.cross_entropy, x[:0], y[:0], net.edges()),
    ]
    for call in calls:
        with pytest.raises(CurvatureError, match=r"^inputs hold no samples [^\n]*pass a batch of at least one sample$"):
            call()
    after, modes_after = _state(net)
    assert modes_after == modes and all(torch.equal(before[k], after[k]) for k in before)
