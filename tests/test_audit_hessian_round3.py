"""Third audit round of the curvature modes, float64, every reference built in this file.

Targets what rounds 1-2 left: the mixing-weight modes ``ggn``, ``ggn_mc`` and ``hutchinson:<k>`` against Jacobians
and dense Hessians of this file's own supernet with train-mode BatchNorm (samples coupled through the batch
statistics), the shared-α / shared-Z diagonals and the α-Hessian's top eigenvalues on that supernet against
``torch.autograd.functional.hessian`` + ``torch.linalg.eigvalsh``, and bad input.

Defects this round found (each test named below fails on the library before its fix):

* ``ggn`` with train-mode BatchNorm summed sample m's curvature direction c over the samples with the signs eigh
  happens to return: diag G depended on LAPACK's sign convention (0.690 vs 0.749 relative error against ``exact``
  on the accuracy cell of docs/hessian.md, by signs alone) — ``test_ggn_with_coupled_samples_is_the_documented_sum``;
* ``ggn``/``ggn_mc``/``hutchinson:<k>`` on float16/bfloat16 models raised torch's bare NotImplementedError (eigh has
  no half kernels) — ``test_ggn_modes_run_in_half_precision``;
* a NaN batch made the exact routes' cross-checks (forward-over-reverse against reverse-over-reverse, batched against
  plain products) compare NaN with NaN, warn of "a wrong forward-mode rule of torch" / "a wrong vmap rule" and fall
  back to the slower products — ``test_a_nan_sample_is_nan_not_averaged_away``; the same false blame in bfloat16,
  whose two roundings differ by more than the check's 1e-2 — ``test_exact_in_bfloat16_is_not_blamed_on_torch``;
* ``hutchinson:<k>`` with a huge k allocated its k·E probes at once: the allocator's bare RuntimeError, or at
  k = 10⁸ minutes of swapping — ``test_a_huge_hutchinson_k_is_refused_before_its_probes_are_allocated``;
* ``shared_weights_diag_hessian`` on a network whose forward takes no weights: the model's bare TypeError —
  ``test_shared_weights_of_a_network_that_takes_no_weights_is_one_line``;
* ``diag_hessian`` refused every default call on a supernet holding α in an ``nn.ParameterDict`` (taken for a module
  without a rule) — ``test_alpha_in_a_parameter_dict_is_glue_for_the_weight_recursion``;
* parameters on the meta device: torch's bare RuntimeError — ``test_parameters_on_the_meta_device_are_one_line_in_every_route``;
* a complex model whose mixed op failed on (B, K) weights was told to convert its complex inputs to float64 (complex
  parameters were not counted as the model's dtypes) — ``test_complex_features_real_mixing_weights``;
* ``ggn_mc`` with a huge ``samples``: the allocator's bare RuntimeError —
  ``test_a_huge_ggn_mc_sample_count_is_refused_before_its_draws_are_allocated``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.edges import resolve_edges
from nasdiag.hessian import (
    CurvatureError,
    alpha_diag_hessian,
    arch_diag_hessian,
    diag_hessian,
    hessian_eigenvalues,
    shared_weights_diag_hessian,
)
from nasdiag.hessian.arch_hutchinson import hutchinson_arch_diag

from conftest import assert_no_module_hooks

DT = torch.float64
K = 3  # candidate ops per edge
B = 4  # batch
D = 3  # classes
TYPES = ("normal", "reduce")
CELL_TYPES = ("normal", "reduce", "normal")  # two cells share the normal weights
E = 3  # edges per cell


class Mixed(nn.Module):
    """``Σ_k w_k O_k(x)`` with weights (K,) or per sample (B, K); ops: conv-BN (affine-free), tanh-conv, identity."""

    def __init__(self, c):
        super().__init__()
        self.ops = nn.ModuleList([
            nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c, affine=False)),
            nn.Sequential(nn.Tanh(), nn.Conv2d(c, c, 1)),
            nn.Identity(),
        ])

    def forward(self, x, weights):
        w = weights[:, :, None, None, None] if weights.dim() == 2 else weights[:, None, None, None, None]
        return sum(w[:, k] * op(x) if weights.dim() == 2 else w[k] * op(x) for k, op in enumerate(self.ops))


class Cell(nn.Module):
    """A DAG with skip connections: n1 = e0(s), n2 = e1(s) + e2(n1), out = s + n1 + n2."""

    def __init__(self, c):
        super().__init__()
        self.e = nn.ModuleList([Mixed(c) for _ in range(E)])

    def forward(self, s, Z):  # Z: a list of E weights
        n1 = self.e[0](s, Z[0])
        n2 = self.e[1](s, Z[1]) + self.e[2](n1, Z[2])
        return s + n1 + n2


class Supernet(nn.Module):
    """stem → 3 cells (normal, reduce, normal; α shared by the cells of a type) → train-mode BN → head."""

    def __init__(self, c=2):
        super().__init__()
        self.stem = nn.Conv2d(2, c, 3, padding=1)
        self.cells = nn.ModuleList([Cell(c) for _ in CELL_TYPES])
        self.bn = nn.BatchNorm2d(c)
        self.head = nn.Linear(c, D)
        self.alphas = nn.ParameterDict({t: nn.Parameter(0.6 * torch.randn(E, K)) for t in TYPES})

    def forward(self, x, weights=None, per_edge=None):
        """``weights``: {type: (E, K)} (default softmax(α)); ``per_edge``: a list of 9 weights, one per edge."""
        if weights is None:
            weights = {t: F.softmax(a, -1) for t, a in self.alphas.items()}
        h = self.stem(x)
        for i, (cell, t) in enumerate(zip(self.cells, CELL_TYPES)):
            h = cell(h, list(weights[t]) if per_edge is None else per_edge[E * i : E * (i + 1)])
        return self.head(F.relu(self.bn(h)).mean((2, 3)))

    def edges(self):
        return {f"c{i}.e{j}": (m, list(m.ops)) for i, cell in enumerate(self.cells) for j, m in enumerate(cell.e)}


def make(seed=0):
    torch.manual_seed(seed)
    net = Supernet().to(DT)
    x, y = torch.randn(B, 2, 3, 3, dtype=DT), torch.randint(0, D, (B,))
    return net, x, y


def edge_weights(net):
    Z = {t: F.softmax(a.detach(), -1) for t, a in net.alphas.items()}
    return torch.stack([Z[t][j] for t in CELL_TYPES for j in range(E)])  # (9, K)


def restoring(net, f):
    """``f()`` with the BatchNorm running statistics put back afterwards (the references run plain forwards)."""
    state = {k: v.clone() for k, v in net.state_dict().items()}
    try:
        return f()
    finally:
        net.load_state_dict(state)


def per_sample_jacobian(net, x):
    """``J[m, d, e, n, k] = ∂f_{m,d}/∂δ_{e,n,k}``: logits of sample m w.r.t. a per-sample shift of edge e's weights
    seen by sample n (zero for m ≠ n only where samples do not interact)."""
    Z0 = edge_weights(net)

    def logits(delta):  # (9, B, K)
        return net(x, per_edge=[Z0[e] + delta[e] for e in range(3 * E)])

    return restoring(net, lambda: torch.autograd.functional.jacobian(logits, torch.zeros(3 * E, B, K, dtype=DT)))


def ce_blocks(net, x):
    """Per-sample Hessians of the batch-mean cross-entropy w.r.t. the logits, (B, D, D)."""
    p = restoring(net, lambda: F.softmax(net(x).detach(), -1))
    return (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]) / B


def signed_roots(H):
    """``(λ, Uc)``: eigenvalues ascending and eigenvectors each signed so its largest-magnitude entry is positive,
    scaled by √λ (columns)."""
    lam, U = torch.linalg.eigh(H)
    pick = U.abs().argmax(1, keepdim=True)
    U = U * torch.where(torch.gather(U, 1, pick) < 0, -1.0, 1.0)
    return lam, U * lam.clamp_min(0).sqrt()[:, None, :]


def dense_z_hessian(net, x, y):
    """∂²L/∂z² over the 27 per-edge mixing weights z (every edge of every cell its own Z), reverse-over-reverse."""
    Z0 = edge_weights(net)
    f = lambda z: F.cross_entropy(net(x, per_edge=list(z.reshape(3 * E, K))), y)  # noqa: E731
    return restoring(net, lambda: torch.autograd.functional.hessian(f, Z0.reshape(-1)))


def flat(result, net):
    return torch.cat([result[n] for n in net.edges()])


# ------------------------------------------------------------------------------------------------------------ GGN


def test_ggn_with_coupled_samples_is_the_documented_sum():
    """docs/hessian.md, modes table: ``ggn`` = ``Σ_c Σ_n (Σ_m √λ_mc u_mcᵀ J_mn)²`` per weight, u_mc the eigenvectors of
    sample m's loss Hessian signed so their largest-magnitude entry is positive: with train-mode BN a sample's
    shift moves every sample's logits (J_mn ≠ 0), so the rows mix samples and the signs matter. Not the expectation
    of ``ggn_mc`` there (``Σ_{m,n} J_mnᵀ H_m J_mn``), nor the Gauss-Newton matrix of the shared Z."""
    net, x, y = make(1)
    J = per_sample_jacobian(net, x)  # (B, D, 9, B, K)
    assert J[0, :, :, 1].abs().max() > 1e-3  # the samples interact
    lam, root = signed_roots(ce_blocks(net, x))
    rows = torch.einsum("mdc,mdenk->cenk", root, J)  # (D, 9, B, K)
    ref = rows.square().sum((0, 2))
    per_sample_shift = torch.einsum("mdenk,mdq,mqenk->ek", J, ce_blocks(net, x), J)
    got = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="ggn")
    torch.testing.assert_close(flat(got, net), ref.reshape(-1), rtol=1e-9, atol=1e-14)
    assert (ref - per_sample_shift).abs().max() > 0.05 * per_sample_shift.abs().max()
    assert_no_module_hooks(net)


def test_ggn_without_coupling_is_the_gauss_newton_diagonal_and_ggn_mc_its_unbiased_estimate():
    """Eval-mode BN: samples do not interact, so ``ggn`` is ``diag Σ_m J_mᵀ H_m J_m`` exactly, whatever the signs."""
    net, x, y = make(2)
    restoring(net, lambda: None)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    net.eval()
    J = per_sample_jacobian(net, x)
    assert J[0, :, :, 1].abs().max() == 0
    Js = J.sum(3)  # ∂f_m/∂Z (shared by the batch)
    ref = torch.einsum("mdek,mdq,mqek->ek", Js, ce_blocks(net, x), Js)
    got = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="ggn")
    torch.testing.assert_close(flat(got, net), ref.reshape(-1), rtol=1e-9, atol=1e-14)


def test_ggn_mc_is_unbiased_for_the_per_sample_shift_gauss_newton_within_its_own_variance():
    """``ggn_mc`` draws ``v_m = Σ_c ε_mc √λ_mc u_mc`` (Rademacher ε) and reports ``Σ_n (∂/∂δ_n Σ_m ⟨v_m, f_m⟩)²``:
    a quadratic form ``εᵀ A ε`` per weight, ``A = Σ_n a_n a_nᵀ`` over the rows ``a_n[(m, c)] = √λ_mc u_mcᵀ J_mn``,
    with mean ``tr A = Σ_{m,n} J_mnᵀ H_m J_mn`` and variance ``2 Σ_{i≠j} A_ij²`` (signs of u do not enter). The
    mean of 8 seeds × 64 draws lies within 5 standard errors of it on every weight (train-mode BN)."""
    net, x, y = make(3)
    J = per_sample_jacobian(net, x)
    H = ce_blocks(net, x)
    _, root = signed_roots(H)
    a = torch.einsum("mdc,mdenk->enkmc", root, J).reshape(3 * E, B, K, B * D)  # (edge, n, k, (m, c))
    A = torch.einsum("enki,enkj->ekij", a, a)
    mean = torch.diagonal(A, dim1=-2, dim2=-1).sum(-1)
    var1 = 2 * (A.square().sum((-2, -1)) - torch.diagonal(A, dim1=-2, dim2=-1).square().sum(-1))
    seeds, draws = 8, 64
    got = sum(flat(arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="ggn_mc", samples=draws, seed=s), net)
              for s in range(seeds)) / seeds
    stderr = (var1.reshape(-1) / (seeds * draws)).sqrt()
    z = (got - mean.reshape(-1)) / stderr
    assert z.abs().max() < 5, z
    one = flat(arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="ggn_mc", seed=0), net)
    assert (one - mean.reshape(-1)).abs().max() > 5 * stderr.max()  # one draw is noisy: the test can tell


# ----------------------------------------------------------------------------------------------------- Hutchinson


def test_hutchinson_is_unbiased_with_the_documented_variance_under_train_batch_norm():
    """``hutchinson:<k>``: ``diag C + (1/k) Σ_s ε_s ⊙ (H − C) ε_s`` per edge, C the ``ggn`` factor's matrix. Each probe
    of entry i is ``H_ii + Σ_{j≠i in its edge} η_j M_ij`` (M = H − C, η Rademacher): variance ``σ² = Σ_j M_ij²``
    (docs/hessian.md), fourth central moment ``3σ⁴ − 2 Σ_j M_ij⁴``. With k = 48 the estimate lies within 5 σ/√k of
    the dense diagonal and k·stderr² within 5 standard deviations of the sample variance around σ²."""
    net, x, y = make(4)
    H = dense_z_hessian(net, x, y)
    J = per_sample_jacobian(net, x)
    _, root = signed_roots(ce_blocks(net, x))
    R = torch.einsum("mdc,mdenk->cnek", root, J).reshape(D * B, 3 * E * K)  # rows (c, n) of the ggn factor
    M = H - R.T @ R
    edge = torch.arange(3 * E).repeat_interleave(K)
    M = M * (edge[:, None] == edge[None, :])  # per-edge probes: only the own edge's block is noise
    off = M - torch.diag(torch.diagonal(M))
    sigma2 = off.square().sum(1)
    mu4 = 3 * sigma2.square() - 2 * off.pow(4).sum(1)
    k = 48
    specs = resolve_edges(net, net.edges())
    est, stderr, _, _ = hutchinson_arch_diag(net, F.cross_entropy, x, y, specs, k, generator=torch.Generator().manual_seed(0))
    est, stderr = flat(est, net), flat(stderr, net)
    assert sigma2.max() > 1e-3 * torch.diagonal(H).abs().max()  # train BN: C misses part of each edge block
    assert ((est - torch.diagonal(H)).abs() <= 5 * (sigma2 / k).sqrt() + 1e-12).all()
    s2 = k * stderr.square()
    sd_s2 = ((mu4 - sigma2.square() * (k - 3) / (k - 1)) / k).clamp_min(0).sqrt()
    assert ((s2 - sigma2).abs() <= 5 * sd_s2 + 1e-12).all()


# ---------------------------------------------------------------------------------------- shared α, Z, spectrum


def test_shared_alpha_and_z_diagonals_and_the_top_eigenvalues_equal_the_dense_hessian():
    """Train-mode BN, α (and Z) shared by the two normal cells: ``alpha_diag_hessian`` and
    ``shared_weights_diag_hessian`` against the diagonal of the reverse-over-reverse Hessian, the largest algebraic
    eigenvalue per type and jointly (RobustDARTS's signal) against eigvalsh of the same dense Hessian; the
    running statistics and .grad untouched."""
    net, x, y = make(5)
    a0 = torch.cat([net.alphas[t].detach().reshape(-1) for t in TYPES])
    n = E * K

    def loss_alpha(a):
        return F.cross_entropy(net(x, {t: F.softmax(a[i * n:(i + 1) * n].reshape(E, K), -1) for i, t in enumerate(TYPES)}), y)

    Ha = restoring(net, lambda: torch.autograd.functional.hessian(loss_alpha, a0))
    z0 = torch.cat([F.softmax(net.alphas[t].detach(), -1).reshape(-1) for t in TYPES])
    Hz = restoring(net, lambda: torch.autograd.functional.hessian(
        lambda z: F.cross_entropy(net(x, {t: z[i * n:(i + 1) * n].reshape(E, K) for i, t in enumerate(TYPES)}), y), z0))
    state = {k: v.clone() for k, v in net.state_dict().items()}

    got = alpha_diag_hessian(net, F.cross_entropy, x, y, params={t: net.alphas[t] for t in TYPES})
    assert list(got) == [f"alphas.{t}" for t in TYPES]  # the model's own parameter names
    torch.testing.assert_close(torch.cat([got[f"alphas.{t}"].reshape(-1) for t in TYPES]), torch.diagonal(Ha), rtol=1e-9, atol=1e-13)
    Z = {t: F.softmax(net.alphas[t].detach(), -1) for t in TYPES}
    got = shared_weights_diag_hessian(net, F.cross_entropy, x, y, Z)
    torch.testing.assert_close(torch.cat([got[t].reshape(-1) for t in TYPES]), torch.diagonal(Hz), rtol=1e-9, atol=1e-13)

    class Softmaxed(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, inp):
            return self.net(inp)

    for i, t in enumerate(TYPES):
        res = hessian_eigenvalues(Softmaxed(), F.cross_entropy, x, y, params=[(t, net.alphas[t])], k=1, iters=n)
        block = Ha[i * n:(i + 1) * n, i * n:(i + 1) * n]
        assert res.largest_algebraic == pytest.approx(torch.linalg.eigvalsh(block).max().item(), rel=1e-8, abs=1e-12)
    joint = hessian_eigenvalues(Softmaxed(), F.cross_entropy, x, y, params=list(net.alphas.items()), k=2, iters=2 * n)
    ev = torch.linalg.eigvalsh(Ha)
    assert joint.largest_algebraic == pytest.approx(ev.max().item(), rel=1e-8, abs=1e-12)
    assert joint.largest_magnitude == pytest.approx(ev[ev.abs().argmax()].item(), rel=1e-8, abs=1e-12)
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters())
    assert_no_module_hooks(net)


# ----------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["ggn", "ggn_mc", "hutchinson:1"])
def test_ggn_modes_run_in_half_precision(dtype, mode):
    """The GGN modes on a half-precision model: results in its dtype, finite, near the float64 numbers (eigh, which
    has no half kernels, factors the loss blocks in float32)."""
    net, x, y = make(6)
    net.eval()  # running statistics: no cross-sample coupling, so the float64 comparison is sharp
    ref = flat(arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="ggn"), net)
    half = net.to(dtype)
    got = arch_diag_hessian(half, F.cross_entropy, x.to(dtype), y, half.edges(), mode=mode)
    got = flat(got, half)
    assert got.dtype == dtype and torch.isfinite(got).all()
    if mode == "ggn":  # the random modes are unbiased for it, not equal
        eps = torch.finfo(dtype).eps
        assert (got.double() - ref).abs().max() <= 200 * eps * ref.abs().max()


@pytest.mark.parametrize("seed", [0, 1])
def test_exact_in_bfloat16_is_not_blamed_on_torch(seed):
    """The exact routes cross-check forward-over-reverse against reverse-over-reverse products and batched against
    plain ones. In bfloat16 the two roundings differ by up to 4% here: within the check's 32 ulp, so no warning of
    "a wrong forward-mode rule of torch" and no fallback (it allowed 1e-2)."""
    net, x, y = make(seed)
    half = net.to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = flat(arch_diag_hessian(half, F.cross_entropy, x.to(torch.bfloat16), y, half.edges(), mode="exact"), half)
    assert not [str(w.message) for w in caught if "wrong" in str(w.message)]
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()


@pytest.mark.parametrize("mode", ["ggn", "ggn_mc", "hutchinson:2", "diag", "approx", "exact"])
def test_a_nan_sample_is_nan_not_averaged_away(mode):
    """A NaN in one sample of a train-mode-BN batch: every mixing weight it reaches is NaN in every mode, and the
    exact routes' cross-checks do not blame torch for it (they warned of "a wrong forward-mode rule" and "a wrong
    vmap rule" and fell back to slower products, comparing NaN with NaN)."""
    net, x, y = make(7)
    x = x.clone()
    x[2, 0, 1, 1] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = flat(arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode), net)
    assert torch.isnan(got).all()
    blamed = [str(w.message) for w in caught if "wrong" in str(w.message) or "to a scalar" in str(w.message)]
    assert not blamed, blamed


@pytest.mark.parametrize("mode", ["hutchinson:0", "hutchinson", "hutchinson:-1", "hutchinson:2.5", "ggn:2", "GGN-MC", None])
def test_bad_mode_names_are_one_curvature_error(mode):
    net, x, y = make(8)
    with pytest.raises(CurvatureError) as err:
        arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode)
    assert "\n" not in str(err.value) and ("ggn_mc" in str(err.value) or "hutchinson:4" in str(err.value))


def test_max_memory_too_small_names_the_size_for_every_exact_route():
    net, x, y = make(9)
    Z = {t: F.softmax(net.alphas[t].detach(), -1) for t in TYPES}
    calls = [
        lambda: arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact", max_memory=1000),
        lambda: arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="hutchinson:2", max_memory=1000),
        lambda: alpha_diag_hessian(net, F.cross_entropy, x, y, params=dict(net.alphas), max_memory=1000),
        lambda: shared_weights_diag_hessian(net, F.cross_entropy, x, y, Z, max_memory=1000),
    ]
    for call in calls:
        with pytest.raises(CurvatureError, match=r"KiB.*max_memory"):
            call()
    assert_no_module_hooks(net)


def test_frozen_parameters_do_not_change_the_mixing_weight_curvature():
    """requires_grad=False on the weights (and α): the curvature w.r.t. Z is of the same function."""
    net, x, y = make(10)
    ref = flat(arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact"), net)
    for p in net.parameters():
        p.requires_grad_(False)
    for mode in ("exact", "ggn"):
        got = flat(arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode), net)
        if mode == "exact":
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-14)
        assert torch.isfinite(got).all()
    with pytest.raises(CurvatureError, match="requires_grad"):
        alpha_diag_hessian(net, F.cross_entropy, x, y, params=dict(net.alphas))
    assert math.isfinite(ref.abs().max().item())


# ------------------------------------------------------------------------------------- BayesNAS C.1 / C.3 on a DAG


class FCMixed(nn.Module):
    """``Σ_k w_{n,k} O_k(x)`` over features, per-sample weights (B, K): Linear, Tanh, Identity."""

    def __init__(self, f):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(f, f, bias=False), nn.Tanh(), nn.Identity()])

    def forward(self, x, weights):
        return sum(weights[:, k, None] * op(x) for k, op in enumerate(self.ops))


class FCDag(nn.Module):
    """a = stem(x); n1 = e1(a); n3 = e2(n1); logits = head(tanh(n3 + n1)): a skip around e2, fan-outs at n1."""

    def __init__(self, f=4):
        super().__init__()
        self.stem, self.e1, self.e2, self.head = nn.Linear(3, f), FCMixed(f), FCMixed(f), nn.Linear(f, D)
        self.w1, self.w2 = torch.rand(B, K, dtype=DT), torch.rand(B, K, dtype=DT)

    def forward(self, x):
        a = self.stem(x)
        n1 = self.e1(a, self.w1)
        n3 = self.e2(n1, self.w2)
        return self.head(torch.tanh(n3 + n1))


def test_c1_and_c3_recursions_on_a_dag_with_a_skip_and_per_sample_weights():
    """Own transcription of bayesnas-appendix C.1.4-C.1.5 (FC diagonal recursion: ``h_in = (W∘W)ᵀ h_out`` at a
    Linear, ``σ'² h + σ'' ∂L/∂a`` at an activation, contributions summed at a fan-out) and C.3: the mixed op passes
    ``Σ_k w_k² J_kᵀ∘² h_j`` (plus ``w_k σ'' g`` for the tanh op) to its input and ``H_Z,k = Σ_{n,f} B_k² h_j`` (diag,
    C.3.1), ``Σ_f (Σ_n B_k²)_f E_n(h_j)_f`` with every Linear's output diagonal replaced by its batch mean (approx,
    C.3.2 on C.2.4-C.2.5's feature mean). (B, K) weights: the curvature of a (K,) shift shared by the batch."""
    torch.manual_seed(12)
    net = FCDag().to(DT)
    x, y = torch.randn(B, 3, dtype=DT), torch.randint(0, D, (B,))
    a = net.stem(x).detach()
    n1 = net.e1(a, net.w1).detach()
    n3 = net.e2(n1, net.w2).detach()
    s = n3 + n1
    t = torch.tanh(s)
    p = F.softmax(net.head(t), -1).detach()
    h_f, g_f = (p - p.square()) / B, (p - F.one_hot(y, D)) / B
    W_head, W2, W1 = net.head.weight.detach(), net.e2.ops[0].weight.detach(), net.e1.ops[0].weight.detach()
    d1, d2 = 1 - t.square(), -2 * t * (1 - t.square())  # tanh' and tanh'' at s
    g_t = g_f @ W_head
    g_s = d1 * g_t

    def ops_out(m, x_in):
        return [x_in @ m.ops[0].weight.detach().T, torch.tanh(x_in), x_in]

    def edge_back(h_j, g_j, x_in, w, W):  # diagonal at the mixed op's input, one term per op (fan-out: summed)
        u = 1 - torch.tanh(x_in).square()
        return (w[:, :1] ** 2 * (h_j @ W.square()) + w[:, 1:2] ** 2 * u.square() * h_j
                + w[:, 1:2] * (-2 * torch.tanh(x_in) * u) * g_j + w[:, 2:] ** 2 * h_j)

    def recursion(mean_at_linear):
        fm = (lambda h: h.mean(0, keepdim=True).expand_as(h)) if mean_at_linear else (lambda h: h)
        h_t = fm(h_f) @ W_head.square()
        h_s = d1.square() * h_t + d2 * g_t
        h_n3 = h_s
        # the Linear op of e2: its output's diagonal is w_{n,0}² h_n3 (the mixing product), batch-meaned in approx
        lin = fm(net.w2[:, :1] ** 2 * h_n3) @ W2.square()
        h_n1 = h_s + edge_back(h_n3, g_s, n1, net.w2, W2) - net.w2[:, :1] ** 2 * (h_n3 @ W2.square()) + lin
        out = {}
        for name, x_in, h_j, m in (("e1", a, h_n1, net.e1), ("e2", n1, h_n3, net.e2)):
            B2 = torch.stack([o.square() for o in ops_out(m, x_in)])  # (K, B, F)
            if mean_at_linear:
                out[name] = (B2.sum(1) * h_j.mean(0)).sum(-1)
            else:
                out[name] = (B2 * h_j).sum((1, 2))
        return out

    edges = {"e1": (net.e1, list(net.e1.ops)), "e2": (net.e2, list(net.e2.ops))}
    for mode, mean in (("diag", False), ("approx", True)):
        got = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode)
        ref = recursion(mean)
        for name in edges:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-14, msg=f"{mode} {name}")
    # not the exact curvature: the test can tell the recursion from the Hessian
    W = [net.w1.clone(), net.w2.clone()]

    def loss(d):
        net.w1, net.w2 = W[0] + d[0], W[1] + d[1]
        return F.cross_entropy(net(x), y)

    dense = torch.diagonal(torch.autograd.functional.hessian(loss, torch.zeros(2, K, dtype=DT)).reshape(2 * K, 2 * K))
    net.w1, net.w2 = W
    diag = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="diag")
    assert (torch.cat([diag["e1"], diag["e2"]]) - dense).abs().max() > 1e-3 * dense.abs().max()


@pytest.mark.parametrize("call", ["arch", "weights"])
def test_a_huge_hutchinson_k_is_refused_before_its_probes_are_allocated(call):
    """``hutchinson:<k>`` holds its k (·E) probes and products at once: a k whose arrays cannot fit is one
    CurvatureError naming the size (it was the allocator's RuntimeError, or, at k = 10⁸, minutes of swapping)."""
    net, x, y = make(11)
    mode = "hutchinson:10000000000"
    with pytest.raises(CurvatureError, match=r"hutchinson:10000000000.*GiB at once.*lower k"):
        if call == "arch":
            arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode)
        else:
            diag_hessian(net, F.cross_entropy, x, y, mode=mode)
    assert_no_module_hooks(net)


def test_shared_weights_of_a_network_that_takes_no_weights_is_one_line():
    """shared_weights_diag_hessian calls network(inputs, weights): a forward without that argument raised the model's
    bare TypeError from inside the products."""

    class NoWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, D)

        def forward(self, x):
            return self.lin(x)

    net = NoWeights().to(DT)
    with pytest.raises(CurvatureError, match=r"network\(inputs, weights\).*forward\(x\) does not take them") as err:
        shared_weights_diag_hessian(net, F.cross_entropy, torch.randn(B, 3, dtype=DT), torch.randint(0, D, (B,)),
                                    {"normal": torch.full((K,), 1 / K, dtype=DT)})
    assert isinstance(err.value, TypeError) and "\n" not in str(err.value)


def test_alpha_in_a_parameter_dict_is_glue_for_the_weight_recursion():
    """α held in an ``nn.ParameterDict`` (read by the supernet's forward through softmax): ``diag_hessian`` took the
    never-called ParameterDict for a module without a rule and refused every default call. Now its α is glue, and in
    mode ``diag`` its diagonal is the per-edge α chain of ``arch_diag_hessian`` summed over the cells of each type
    (docs/hessian.md, α)."""
    net, x, y = make(13)
    w = diag_hessian(net, F.cross_entropy, x, y, mode="diag")
    per_edge = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="diag", wrt="alpha")
    for t in TYPES:
        summed = sum(torch.stack([per_edge[f"c{i}.e{j}"] for j in range(E)]) for i, c in enumerate(CELL_TYPES) if c == t)
        torch.testing.assert_close(w[f"alphas.{t}"], summed, rtol=1e-10, atol=1e-15)


def test_parameters_on_the_meta_device_are_one_line_in_every_route():
    net, x, y = make(14)
    net.head.to("meta")
    calls = [lambda m=m: arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=m) for m in ("exact", "ggn", "diag")]
    calls += [lambda: diag_hessian(net, F.cross_entropy, x, y, mode="exact"),
              lambda: alpha_diag_hessian(net, F.cross_entropy, x, y, params=dict(net.alphas))]
    for call in calls:
        with pytest.raises(CurvatureError, match=r"head\.bias, head\.weight of the model are on the meta device"):
            call()
    assert_no_module_hooks(net)


class ComplexMixed(nn.Module):
    """A mixed op whose first candidate is a complex linear map (real weights Z, complex features)."""

    def __init__(self, per_sample=True):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(3, 3).to(torch.complex128), nn.Identity()])
        self.per_sample = per_sample

    def forward(self, x, weights):
        if self.per_sample and weights.dim() == 2:
            return sum(weights[:, k, None] * op(x) for k, op in enumerate(self.ops))
        return sum(weights[k] * op(x) for k, op in enumerate(self.ops))


class ComplexNet(nn.Module):
    def __init__(self, per_sample=True):
        super().__init__()
        self.e, self.head = ComplexMixed(per_sample), nn.Linear(3, D).to(DT)
        self.z = torch.tensor([0.3, 0.7], dtype=DT)

    def forward(self, x, z=None):
        return self.head(self.e(x, self.z if z is None else z).abs())


def test_complex_features_real_mixing_weights():
    """Complex inputs and parameters with real mixing weights: ``exact`` is the dense Hessian, ``ggn`` the Gauss-Newton
    diagonal ``Σ_m J_mᵀ H_m J_m`` (no coupling); a mixed op that cannot take (B, K) weights gets the GGN modes' own
    message (the complex inputs were blamed: "convert them with inputs.to(torch.float64)")."""
    torch.manual_seed(15)
    net = ComplexNet()
    x, y = torch.randn(B, 3, dtype=torch.complex128), torch.randint(0, D, (B,))
    edges = {"e": (net.e, list(net.e.ops))}
    dense = torch.autograd.functional.hessian(lambda z: F.cross_entropy(net(x, z), y), net.z)
    torch.testing.assert_close(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="exact")["e"],
                               torch.diagonal(dense), rtol=1e-9, atol=1e-14)
    J = torch.autograd.functional.jacobian(lambda z: net(x, z), net.z)  # (B, D, 2)
    p = F.softmax(net(x), -1).detach()
    Hb = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]) / B
    ggn = torch.einsum("mdk,mdq,mqk->k", J, Hb, J)
    torch.testing.assert_close(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="ggn")["e"], ggn,
                               rtol=1e-9, atol=1e-14)
    plain = ComplexNet(per_sample=False)
    with pytest.raises(CurvatureError, match=r"edge 'e': the GGN modes .*\(B, K\)"):
        arch_diag_hessian(plain, F.cross_entropy, x, y, {"e": (plain.e, list(plain.e.ops))}, mode="ggn")


def test_a_huge_ggn_mc_sample_count_is_refused_before_its_draws_are_allocated():
    net, x, y = make(16)
    with pytest.raises(CurvatureError, match=r"samples=10000000000: .*GiB at once.*lower samples"):
        arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="ggn_mc", samples=10**10)
    assert_no_module_hooks(net)
