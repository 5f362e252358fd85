"""Round-16 audit of the curvature API's spectrum side and its guards, against the auditor's own float64 references.

References are built here from scratch: dense Hessians by reverse-over-reverse autograd (``torch.autograd.grad``
twice, one row per entry; never ``torch.func.hessian`` through train-mode BatchNorm, docs/hessian.md),
``torch.linalg.eigvalsh``, and the Rademacher closed forms ``Var(zᵀHz) = 2 Σ_{i≠j} H_ij²`` (trace) and
``Var((z ⊙ Hz)_i) = Σ_{j≠i} H_ij²`` (diagonal entry i), from ``E z_i z_j z_k z_l`` = 1 on paired indices only.

Checked and found right (the sharpest kept below): on two cells sharing one α (E = 3, K = 3) with train-mode
BatchNorm, whose α-Hessian is negative-dominant (λ_min = −0.043, λ_max = 0.0125): ``hessian_eigenvalues`` Lanczos
top 3, k = dim (the whole spectrum), ``largest_magnitude`` signed (the most negative one, as documented: largest |λ|,
not largest λ), power iteration's λ_max through its shifted second run, all equal to eigvalsh (1e-12 relative);
``converged`` with the reported numbers right; the same seed gives bitwise the same result; the global torch RNG and
the running statistics are left as they were; k = dim + 1 is one ``CurvatureError`` line. Hutchinson's trace and
diagonal averaged over seeds are within 5 standard deviations of the dense trace/diagonal, the deviation taken from
the closed forms above, and their pooled ``stderr`` is the closed form's (within the sampling spread of a variance).
Every arch mode on a net with an edge whose output is unused and a Zero candidate: zeros there, not NaN (clean batch).

Defects found:
* on a NaN batch, ``ggn``, ``ggn_mc`` and ``hutchinson:<k>`` (Z and α) reported NaN for an edge the loss does not
  depend on, while warning "reported as zeros" and unlike ``exact``/``diag``/``approx`` (docs/hessian.md: parameters
  the loss does not depend on keep their zeros): the GGN factor was NaN'ed whole, and the control variate and
  softmax Jacobian were applied as full matrices, multiplying other edges' NaN by zeros;
* ``"hutchinson:²"`` was a bare ``ValueError`` of ``int()`` (``str.isdigit`` takes superscripts);
* ``diag_hessian(mode="exact")`` on a Linear chain too wide for its per-sample ``(N, D, D)`` Hessians asked the
  allocator for them (819 GB here: torch's multi-line error; below the machine's size the kernel's OOM killer),
  even for a layer that needs none; the Hessian-vector products give the same diagonal in little memory;
* the spectrum's ``tol`` given as a string or None was a bare ``TypeError``, ``tol=inf`` reported a random
  Rayleigh quotient as the top eigenvalue with ``converged=True``, ``iters=True`` reached ``torch.zeros``;
* ``hutchinson_diagonal`` holds every probe's product: a ``samples`` whose products cannot fit ran until memory gave
  out; now one line before any product, as ``hutchinson:<k>`` does (and, like ``diag_hessian``'s, without pointing to
  a ``max_memory=`` the function does not take);
* ``max_memory=float("inf")`` (exact, hutchinson:<k>, alpha_diag_hessian) was ``int()``'s ``OverflowError``;
* Lanczos allocated its ``(iters + 1, dim)`` basis whole though it stops at ``dim`` products: ``iters=10**10`` on a
  3 × 3 operator asked for 240 GB;
* ``diag_hessian``'s ``exact`` (Hessian-vector route) and ``hutchinson:<k>`` took a fixed 32 products per batched
  second backward whatever the net, where the mixing-weight modes fit the batch to half the free memory (the main
  job's OOM kill, docs/hessian.md); now fitted the same way, one line where not one product fits;
* ``dim=`` given to the model form of the spectrum functions was ignored silently (refused now, as docs/hessian.md
  refuses options a call does not use).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nasdiag.hessian import (CurvatureError, arch_diag_hessian, diag_hessian, hessian_eigenvalues, hutchinson_diagonal,
                             hutchinson_trace)

DT = torch.float64


# -- own models and references ------------------------------------------------------------------------------------


def _candidates(C):
    return [nn.Sequential(nn.Conv2d(C, C, 1, bias=False, dtype=DT), nn.BatchNorm2d(C, affine=False, dtype=DT)),
            nn.Tanh(), _Zero(), nn.AvgPool2d(3, 1, 1, count_include_pad=False)]


class _Zero(nn.Module):
    def forward(self, x):
        return x.mul(0.0)


class _Mixed(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.ops = nn.ModuleList(ops)

    def forward(self, x, weights):  # (K,) or per-sample (B, K) weights
        return sum((weights[:, k, None, None, None] if weights.dim() == 2 else weights[k]) * op(x)
                   for k, op in enumerate(self.ops))


class _SharedCells(nn.Module):
    """Two cells sharing one α (3 edges × 3 ops): node1 = e0(x), node2 = e1(x) + e2(node1), out = node1 + node2."""

    def __init__(self, C=2):
        super().__init__()
        self.stem = nn.Conv2d(1, C, 3, padding=1, dtype=DT)
        self.cells = nn.ModuleList(nn.ModuleList(_Mixed(_candidates(C)[:2] + _candidates(C)[3:]) for _ in range(3))
                                   for _ in range(2))
        self.alpha = nn.Parameter(0.3 * torch.randn(3, 3, dtype=DT))
        self.fc = nn.Linear(C, 3, dtype=DT)

    def named_arch_parameters(self):
        return [("alpha", self.alpha)]

    def forward(self, x):
        Z = F.softmax(self.alpha, -1)
        h = self.stem(x)
        for e in self.cells:
            n1 = e[0](h, Z[0])
            h = n1 + e[1](h, Z[1]) + e[2](n1, Z[2])
        return self.fc(h.mean((2, 3)))


class _DeadEdge(nn.Module):
    """Four edges of four ops (one a Zero op); edge e3 runs but its output is never used."""

    def __init__(self, C=2):
        super().__init__()
        self.stem = nn.Conv2d(1, C, 3, padding=1, dtype=DT)
        self.e = nn.ModuleList(_Mixed(_candidates(C)) for _ in range(4))
        self.alpha = nn.Parameter(0.3 * torch.randn(4, 4, dtype=DT))
        self.fc = nn.Linear(C, 3, dtype=DT)

    def forward(self, x, Z=None):
        Z = F.softmax(self.alpha, -1) if Z is None else Z
        h = self.stem(x)
        n1 = self.e[0](h, Z[0])
        n2 = self.e[1](h, Z[1]) + self.e[2](n1, Z[2])
        self.e[3](h, Z[3])
        return self.fc(torch.tanh(n2).mean((2, 3)))

    def edges(self):
        return {f"e{i}": (m, list(m.ops)) for i, m in enumerate(self.e)}


def _dense_hessian(loss_of, tensors):
    """Reverse-over-reverse autograd Hessian of ``loss_of()`` w.r.t. the flattened ``tensors``."""
    loss = loss_of()
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, tensors, create_graph=True)])
    rows = []
    for i in range(g.numel()):
        r = torch.autograd.grad(g[i], tensors, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if t is None else t).reshape(-1) for t, p in zip(r, tensors)]))
    return torch.stack(rows).detach()


def _batch_norm_state(net):
    return [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
            for m in net.modules() if isinstance(m, nn.BatchNorm2d)]


def _one_line(err):
    return "\n" not in str(err) and str(err).strip() != ""


@pytest.fixture(scope="module")
def shared():
    torch.manual_seed(5)  # a seed whose α-Hessian is negative-dominant (asserted below)
    net = _SharedCells().train()
    x, y = torch.randn(4, 1, 4, 4, dtype=DT), torch.tensor([0, 1, 2, 0])
    state = _batch_norm_state(net)
    H = _dense_hessian(lambda: F.cross_entropy(net(x), y), [net.alpha])
    for m, (mean, var, count) in zip([m for m in net.modules() if isinstance(m, nn.BatchNorm2d)], state):
        m.running_mean.copy_(mean), m.running_var.copy_(var), m.num_batches_tracked.copy_(count)  # the reference's pass
    return net, x, y, H


# -- checked, no defect -------------------------------------------------------------------------------------------


def test_spectrum_of_shared_alpha_under_train_batch_norm_is_eigvalsh_signed_reproducible_and_leaves_rng_and_stats(shared):
    net, x, y, H = shared
    assert (H - H.T).abs().max() <= 1e-12 * H.abs().max()
    ev = torch.linalg.eigvalsh(H)  # ascending
    scale = ev.abs().max()
    assert ev[0] < 0 and -ev[0] > ev[-1] > 0, "the case wants a negative-dominant spectrum"
    rng, stats = torch.get_rng_state(), _batch_norm_state(net)

    top = hessian_eigenvalues(net, F.cross_entropy, x, y, k=3, seed=3)
    assert top.converged
    torch.testing.assert_close(top.eigenvalues, ev.flip(0)[:3], rtol=0, atol=1e-12 * scale)
    assert abs(top.largest_algebraic - ev[-1]) <= 1e-12 * scale
    assert abs(top.largest_magnitude - ev[0]) <= 1e-12 * scale  # largest |λ|, with its sign: the negative one
    assert abs(top.smallest_algebraic - ev[0]) <= 1e-12 * scale
    again = hessian_eigenvalues(net, F.cross_entropy, x, y, k=3, seed=3)
    assert torch.equal(again.eigenvalues, top.eigenvalues) and again.iterations == top.iterations

    full = hessian_eigenvalues(net, F.cross_entropy, x, y, k=9, iters=9)
    torch.testing.assert_close(full.eigenvalues, ev.flip(0), rtol=0, atol=1e-12 * scale)

    power = hessian_eigenvalues(net, F.cross_entropy, x, y, method="power", tol=1e-10, iters=5000)
    assert power.converged and power.smallest_algebraic is None
    assert abs(power.largest_magnitude - ev[0]) <= 1e-8 * scale  # the dominant one: negative here
    assert abs(power.largest_algebraic - ev[-1]) <= 1e-8 * scale  # from the shifted second run

    with pytest.raises(CurvatureError) as err:
        hessian_eigenvalues(net, F.cross_entropy, x, y, k=10)
    assert _one_line(err.value) and "dim=9" in str(err.value)
    assert torch.equal(torch.get_rng_state(), rng)
    for (m0, v0, c0), (m1, v1, c1) in zip(stats, _batch_norm_state(net)):
        assert torch.equal(m0, m1) and torch.equal(v0, v1) and torch.equal(c0, c1)


def test_hutchinson_trace_and_diagonal_averaged_over_seeds_are_unbiased_with_the_rademacher_variance(shared):
    net, x, y, H = shared
    seeds, n = range(8), 64
    off = H - torch.diag(H.diag())
    var_trace = 2 * off.square().sum()  # Var(zᵀHz) for one Rademacher probe, H symmetric
    var_diag = off.square().sum(1)  # Var((z ⊙ Hz)_i) for one probe
    total = len(seeds) * n
    traces = [hutchinson_trace(net, F.cross_entropy, x, y, samples=n, seed=s) for s in seeds]
    diags = [hutchinson_diagonal(net, F.cross_entropy, x, y, samples=n, seed=s) for s in seeds]
    # the mean over seeds is the mean of `total` independent probes: 5 standard deviations by the CLT
    mean_trace = sum(t.estimate for t in traces) / len(traces)
    assert abs(mean_trace - H.trace()) <= 5 * (var_trace / total).sqrt()
    mean_diag = torch.stack([d.estimate[0].reshape(-1) for d in diags]).mean(0)
    assert ((mean_diag - H.diag()).abs() <= 5 * (var_diag / total).sqrt() + 1e-15).all()
    # stderr² · n is the sample variance of the probes: pooled over the seeds it estimates the closed form; a
    # variance estimated from 504 degrees of freedom of a bounded variable is well within a factor 1.6 here
    pooled_trace = sum(t.stderr ** 2 * n for t in traces) / len(traces)
    assert 1 / 1.6 <= pooled_trace / float(var_trace) <= 1.6
    pooled_diag = torch.stack([d.stderr[0].reshape(-1) ** 2 * n for d in diags]).mean(0)
    assert ((pooled_diag / var_diag - 1).abs() <= 0.6).all()


# -- defects ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wrt", ["Z", "alpha"])
def test_a_nan_batch_leaves_zeros_on_an_edge_the_loss_ignores_in_the_ggn_and_hutchinson_modes(wrt):
    torch.manual_seed(1)
    net = _DeadEdge().train()
    x, y = torch.randn(4, 1, 4, 4, dtype=DT), torch.tensor([0, 1, 2, 0])
    x[0, 0, 0, 0] = float("nan")
    # own reference: the gradient w.r.t. the mixing weights is NaN on the edges the loss reaches, exactly 0 on e3
    Z = F.softmax(net.alpha, -1).detach().requires_grad_(True)
    (g,) = torch.autograd.grad(F.cross_entropy(net(x, Z), y), Z)
    assert torch.equal(g[3], torch.zeros(4, dtype=DT)) and g[:3].isnan().any(1).all()
    for mode in ("ggn", "ggn_mc", "hutchinson:2"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode, wrt=wrt)
        assert any("['e3']" in str(w.message) and "zeros" in str(w.message) for w in caught), mode
        assert torch.equal(out["e3"], torch.zeros(4, dtype=DT)), (mode, out["e3"])
        assert all(out[f"e{i}"].isnan().any() for i in range(3)), mode  # the NaN is flagged where the loss reaches


@pytest.mark.parametrize("mode", ["hutchinson:0", "hutchinson:-1", "hutchinson:1.5", "hutchinson:", "hutchinson:²"])
def test_a_hutchinson_count_that_is_no_whole_number_is_one_curvature_error_line(mode):
    mlp = nn.Sequential(nn.Linear(3, 4, dtype=DT), nn.Tanh(), nn.Linear(4, 2, dtype=DT))
    x, y = torch.randn(5, 3, dtype=DT), torch.tensor([0, 1, 0, 1, 1])
    with pytest.raises(CurvatureError) as err:
        diag_hessian(mlp, F.cross_entropy, x, y, mode=mode)
    assert _one_line(err.value) and "hutchinson:4" in str(err.value)


def test_exact_on_a_chain_too_wide_for_its_per_sample_hessians_takes_the_products():
    torch.manual_seed(2)
    D = 40000  # 3 · N · D² float64 per-sample Hessians: 2.5 TB; the products need a few MB
    mlp = nn.Sequential(nn.Linear(2, 3, dtype=DT), nn.Tanh(), nn.Linear(3, D, dtype=DT), nn.Tanh(),
                        nn.Linear(D, 2, dtype=DT))
    x, y = torch.randn(64, 2, dtype=DT), torch.randint(0, 2, (64,))
    got = diag_hessian(mlp, F.cross_entropy, x, y, mode="exact", params=["0.weight", "0.bias"])
    w, b = mlp[0].weight, mlp[0].bias
    H = _dense_hessian(lambda: F.cross_entropy(mlp(x), y), [w, b])
    want = H.diag()
    torch.testing.assert_close(torch.cat([got["0.weight"].reshape(-1), got["0.bias"]]), want,
                               rtol=1e-10, atol=1e-14 * want.abs().max())


def test_spectrum_tol_and_iters_that_are_no_positive_finite_numbers_are_one_line():
    A = torch.diag(torch.tensor([-5.0, 1.0, 2.0], dtype=DT))
    for bad in (dict(tol="1e-6"), dict(tol=None), dict(tol=float("inf")), dict(tol=float("nan")), dict(iters=True),
                dict(method="power", tol=float("inf"))):
        with pytest.raises(CurvatureError) as err:
            hessian_eigenvalues(lambda v: v @ A, 3, **bad)
        assert _one_line(err.value) and ("tol" in str(err.value) or "iters" in str(err.value)), bad


def test_hutchinson_diagonal_whose_products_cannot_fit_is_one_line_before_any_product():
    calls = []

    def hvp(v):
        calls.append(1)
        if len(calls) > 2:  # without the guard the loop would run 10^8 products before memory gives out
            raise AssertionError("products were taken before the memory check")
        return v

    with pytest.raises(CurvatureError) as err:
        hutchinson_diagonal(hvp=hvp, dim=10**5, samples=10**8)  # 10^13 float64 entries held
    assert _one_line(err.value) and "samples" in str(err.value) and "max_memory" not in str(err.value)
    assert not calls


def test_an_infinite_max_memory_is_one_line():
    torch.manual_seed(3)
    net = _DeadEdge()
    x, y = torch.randn(4, 1, 4, 4, dtype=DT), torch.tensor([0, 1, 2, 0])
    for mode in ("exact", "hutchinson:2"):
        with pytest.raises(CurvatureError) as err:  # was int()'s OverflowError traceback
            arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode, max_memory=float("inf"))
        assert _one_line(err.value) and "max_memory" in str(err.value) and "finite" in str(err.value)


def test_lanczos_given_more_iterations_than_the_dimension_stops_at_it_without_allocating_them():
    A = torch.diag(torch.tensor([-5.0, 1.0, 2.0], dtype=DT))
    # the (iters + 1, dim) Krylov basis was allocated whole: 240 GB here, the allocator's multi-line error
    calls = []

    def hvp(v):
        calls.append(1)
        return v @ A

    res = hessian_eigenvalues(hvp, 3, k=3, iters=10**10)
    assert res.converged and res.iterations == len(calls) <= 3  # iterations: the products taken
    torch.testing.assert_close(res.eigenvalues, torch.tensor([2.0, 1.0, -5.0], dtype=DT), rtol=0, atol=1e-12)
    calls.clear()
    power = hessian_eigenvalues(hvp, 3, method="power", iters=10**10)  # negative dominant: two runs, both counted
    assert power.converged and power.iterations == len(calls) and power.largest_magnitude == pytest.approx(-5, rel=1e-6)
    assert power.largest_algebraic == pytest.approx(2, rel=1e-6)


def test_weight_exact_and_hutchinson_fit_their_batch_of_products_to_the_free_memory(monkeypatch):
    from nasdiag import memory
    from nasdiag.hessian._hvp import HessianVectorProduct

    torch.manual_seed(4)
    net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1, dtype=DT), nn.BatchNorm2d(3, dtype=DT), nn.Tanh(), nn.Flatten(),
                        nn.Linear(48, 2, dtype=DT)).train()
    x, y = torch.randn(4, 1, 4, 4, dtype=DT), torch.tensor([0, 1, 1, 0])
    state = _batch_norm_state(net)
    H = _dense_hessian(lambda: F.cross_entropy(net(x), y), [net[0].weight, net[0].bias])
    for m, (mean, var, count) in zip([net[1]], state):
        m.running_mean.copy_(mean), m.running_var.copy_(var), m.num_batches_tracked.copy_(count)
    rows, call = [], HessianVectorProduct.__call__

    def counted(self, v):
        rows.append(1 if v.dim() == 1 else v.shape[0])
        return call(self, v)

    monkeypatch.setattr(HessianVectorProduct, "__call__", counted)
    # what this forward saves is a few KiB (at most every intermediate, float64: `saved`); a budget of 3 products of
    # that bound by the documented factor 8 is well below the default chunk of 32 products
    saved = 16 * 4 * 3 * 16 * 8
    monkeypatch.setattr(memory, "free_cpu_memory", lambda: 2 * 3 * 8 * saved)
    got = diag_hessian(net, F.cross_entropy, x, y, mode="exact", params=["0.weight", "0.bias"])
    assert max(rows) < 32, rows  # 30 entries were one batch of 30 products
    torch.testing.assert_close(torch.cat([got["0.weight"].reshape(-1), got["0.bias"]]), H.diag(), rtol=1e-10, atol=1e-15)
    rows.clear()
    small = diag_hessian(net, F.cross_entropy, x, y, mode="hutchinson:40", params=["0.weight", "0.bias"])
    assert max(rows) < 32, rows
    monkeypatch.setattr(memory, "free_cpu_memory", lambda: 2**40)
    large = diag_hessian(net, F.cross_entropy, x, y, mode="hutchinson:40", params=["0.weight", "0.bias"])
    for name in large:  # the same probes in other batches: the same estimate
        torch.testing.assert_close(small[name], large[name], rtol=1e-12, atol=1e-15)
    monkeypatch.setattr(memory, "free_cpu_memory", lambda: 128)  # 64 bytes: not one product
    with pytest.raises(CurvatureError) as err:
        diag_hessian(net, F.cross_entropy, x, y, mode="exact", params=["0.weight", "0.bias"])
    assert _one_line(err.value) and "Hessian-vector product needs about" in str(err.value)
    assert "max_memory" not in str(err.value) and "approx" in str(err.value)


def test_a_dimension_given_with_a_model_is_refused_not_ignored(shared):
    net, x, y, _ = shared
    for f in (hessian_eigenvalues, hutchinson_trace, hutchinson_diagonal):
        with pytest.raises(CurvatureError) as err:  # dim=4 was ignored: the spectrum of all 9 entries came back
            f(net, F.cross_entropy, x, y, dim=4)
        assert _one_line(err.value) and "dim=4" in str(err.value), f.__name__
