"""Round-6 audit: a NaN is recorded and flagged, never hidden; bad input gets a clear error.

* ``F.cross_entropy`` with every target equal to ``ignore_index`` is NaN (0/0), yet torch's backward of it is exactly
  zero: every curvature route (``diag_hessian`` all modes, ``arch_diag_hessian`` all modes and ``wrt``,
  ``alpha_diag_hessian``, ``shared_weights_diag_hessian``) returned all zeros with no warning, and the spectrum
  functions a zero spectrum (``test_a_nan_loss_whose_backward_is_zero_is_nan_in_every_route``). Now NaN / a
  ``NonFiniteHessianError``, from one place (``scalar_loss``); a batch with *some* ignored targets (finite loss) is
  checked unchanged against ``torch.autograd.functional.hessian``
  (``test_a_finite_loss_with_ignored_targets_keeps_the_autograd_hessian``). The same for a NaN target of MSE, whose
  output Hessian does not read the targets (``test_a_nan_target_of_mse_is_nan_curvature_though_the_mse_hessian_ignores_targets``).
* A NaN in one row of α made ``arch_diag_hessian(mode="exact", wrt="alpha")`` refuse two edges reading different
  rows as shared α (``test_a_nan_in_one_row_of_alpha_is_nan_curvature_not_a_shared_alpha_refusal``).
* ``EigenvalueEarlyStop.update`` truncated ``epoch=1.5`` and gave bare errors for ``epoch=NaN`` or a non-number
  eigenvalue (``test_the_early_stop_refuses_a_non_int_epoch_and_a_non_number_eigenvalue_in_one_line``).
* The spectrum functions truncated ``seed=1.5`` to 1 where ``arch_diag_hessian`` refuses a non-int seed
  (``test_a_non_int_seed_is_refused_by_every_spectrum_function``).
* ``shared_weights_diag_hessian`` with weights keyed by groups the network does not read raised the network's own
  bare ``KeyError`` (``test_shared_weights_with_wrong_group_keys_is_one_curvature_error``).

Checked and right: the streaming cost moments keep a NaN step flagged (mean, var, E[C²] NaN) through later finite
steps, against the numpy two-pass statistics of the same history (NaN-propagating); the early-stop rule refuses a NaN
eigenvalue; Lanczos and power iteration on an operator that returns NaN raise ``NonFiniteHessianError``.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.cost.streaming import CostMoments
from nasdiag.hessian import (
    CurvatureError,
    CurvatureTypeError,
    alpha_diag_hessian,
    arch_diag_hessian,
    diag_hessian,
    eigenvalues_from_hvp,
    hessian_eigenvalues,
    hutchinson_diagonal,
    hutchinson_trace,
)
from nasdiag.hessian.arch_shared import shared_weights_diag_hessian
from nasdiag.hessian.spectrum import EigenvalueEarlyStop, NonFiniteHessianError, diagonal_from_hvp, trace_from_hvp

DT = torch.float64
K = 3
IGNORE = -100


class Mixed(nn.Module):
    """``Σ_k w_k op_k(x)``; weights (K,) or per sample (B, K)."""

    def __init__(self, d):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(d, d), nn.Sequential(nn.Linear(d, d), nn.Tanh()), nn.Identity()])

    def forward(self, x, weights):
        w = [weights[:, k:k + 1] if weights.dim() == 2 else weights[k] for k in range(len(self.ops))]
        return sum(w_k * op(x) for w_k, op in zip(w, self.ops))


class TinySupernet(nn.Module):
    """Two edges in a row, mixed by softmax(α) of one cell (or by ``weights={"cell": (2, K)}``), then a classifier."""

    def __init__(self, d=4, classes=3):
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.e0, self.e1 = Mixed(d), Mixed(d)
        self.alpha = nn.Parameter(0.3 * torch.randn(2, K))
        self.head = nn.Linear(d, classes)

    def forward(self, x, weights=None):
        z = F.softmax(self.alpha, -1) if weights is None else weights["cell"]
        return self.head(self.e1(self.e0(torch.tanh(self.stem(x)), z[0]), z[1]))


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return TinySupernet().to(DT), torch.randn(5, 4, dtype=DT)


def _edges(model):
    return {"e0": (model.e0, list(model.e0.ops)), "e1": (model.e1, list(model.e1.ops))}


ROUTES = (
    [f"diag_hessian:{m}" for m in ("exact", "diag", "approx", "hutchinson:2")]
    + [f"arch:{m}:{w}" for m in ("exact", "exact_per_edge", "ggn", "ggn_mc", "hutchinson:1", "diag", "approx")
       for w in ("Z", "alpha")]
    + ["alpha_diag_hessian", "shared_weights_diag_hessian"]
)


def _curvature(route, model, x, y):
    if route.startswith("diag_hessian:"):
        return diag_hessian(model, F.cross_entropy, x, y, mode=route.split(":", 1)[1],
                            params=["stem.weight", "e0.ops.0.weight", "head.weight", "head.bias"])
    if route.startswith("arch:"):
        parts = route.split(":")
        mode, wrt = ":".join(parts[1:-1]), parts[-1]
        return arch_diag_hessian(model, F.cross_entropy, x, y, _edges(model), mode=mode, wrt=wrt)
    if route == "alpha_diag_hessian":
        return alpha_diag_hessian(model, F.cross_entropy, x, y, params={"alpha": model.alpha})
    return shared_weights_diag_hessian(model, F.cross_entropy, x, y, {"cell": F.softmax(model.alpha.detach(), -1)})


@pytest.mark.parametrize("route", ROUTES)
def test_a_nan_loss_whose_backward_is_zero_is_nan_in_every_route(net, route):
    """Before: every route returned exact zeros (a flat loss) for a loss whose value is NaN."""
    model, x = net
    y = torch.full((x.shape[0],), IGNORE)
    assert math.isnan(F.cross_entropy(model(x), y).item())  # the premise, by torch itself
    got = _curvature(route, model, x, y)
    for name, value in got.items():
        assert torch.isnan(value).all(), f"{route}: {name} = {value} for a NaN loss"


@pytest.mark.parametrize("call", ["eigenvalues", "trace", "diagonal"])
def test_a_nan_loss_whose_backward_is_zero_raises_in_the_spectrum(net, call):
    model, x = net
    y = torch.full((x.shape[0],), IGNORE)
    fn = {"eigenvalues": lambda: hessian_eigenvalues(model, F.cross_entropy, x, y, params=[model.alpha]),
          "trace": lambda: hutchinson_trace(model, F.cross_entropy, x, y, params=[model.alpha], samples=2),
          "diagonal": lambda: hutchinson_diagonal(model, F.cross_entropy, x, y, params=[model.alpha], samples=2)}[call]
    with pytest.raises(NonFiniteHessianError) as info:
        fn()
    assert "\n" not in str(info.value)


def test_a_finite_loss_with_ignored_targets_keeps_the_autograd_hessian(net):
    """The NaN guard adds exactly nothing to a finite loss: some targets ignored, the exact diagonals equal the
    float64 autograd Hessian of the same loss (round-off of two orders of summation: 1e-10)."""
    model, x = net
    y = torch.tensor([0, IGNORE, 2, IGNORE, 1])
    names = ["stem.weight", "e0.ops.0.weight", "head.weight", "alpha"]
    values = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss_of(name):
        def f(v):
            return F.cross_entropy(torch.func.functional_call(model, {**values, name: v}, (x,)), y)
        return f

    got = diag_hessian(model, F.cross_entropy, x, y, mode="exact", params=names[:-1])
    got_alpha = alpha_diag_hessian(model, F.cross_entropy, x, y, params={"alpha": model.alpha})["alpha"]
    for name in names:
        v = values[name]
        H = torch.autograd.functional.hessian(loss_of(name), v).reshape(v.numel(), v.numel())
        value = got_alpha if name == "alpha" else got[name]
        torch.testing.assert_close(value.reshape(-1), torch.diagonal(H), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("seed", [1.5, 2.0, True, "0"])
def test_a_non_int_seed_is_refused_by_every_spectrum_function(net, seed):
    """Before: seed=1.5 was truncated to 1 (the same probes as seed=1) where arch_diag_hessian refuses it."""
    model, x = net
    y = torch.tensor([0, 1, 2, 0, 1])
    eye = lambda v: v  # noqa: E731
    calls = [lambda: eigenvalues_from_hvp(eye, 4, seed=seed),
             lambda: trace_from_hvp(eye, 4, samples=2, seed=seed),
             lambda: diagonal_from_hvp(eye, 4, samples=2, seed=seed),
             lambda: hessian_eigenvalues(model, F.cross_entropy, x, y, params=[model.alpha], seed=seed),
             lambda: hutchinson_trace(model, F.cross_entropy, x, y, params=[model.alpha], samples=2, seed=seed),
             lambda: hutchinson_diagonal(model, F.cross_entropy, x, y, params=[model.alpha], samples=2, seed=seed),
             lambda: arch_diag_hessian(model, F.cross_entropy, x, y, _edges(model), mode="ggn_mc", seed=seed)]
    for call in calls:
        with pytest.raises(CurvatureTypeError, match="seed must be an int") as info:
            call()
        assert "\n" not in str(info.value)


def test_shared_weights_with_wrong_group_keys_is_one_curvature_error(net):
    """Before: the network's own bare KeyError('cell') from inside the products."""
    model, x = net
    y = torch.tensor([0, 1, 2, 0, 1])
    with pytest.raises(CurvatureError, match=r"weights\['cell'\].*\['normal'\]") as info:
        shared_weights_diag_hessian(model, F.cross_entropy, x, y, {"normal": F.softmax(model.alpha.detach(), -1)})
    assert "\n" not in str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_streaming_moments_keep_a_nan_step_flagged_through_finite_steps():
    """Against numpy on the whole history (np.mean/np.var propagate NaN): a NaN observation at step 2 keeps the
    entry's E[C], E[C²] and variance NaN after finite steps; untouched entries match numpy to 1e-12; an entry whose
    NaN sits under a False mask is unaffected."""
    rng = np.random.default_rng(0)
    steps = [rng.normal(size=(3, 2, 2)) for _ in range(5)]
    steps[1][1, 0, 0] = np.nan
    steps[2][0, 1, 1] = np.nan  # masked out below
    mask = np.ones((3, 2, 2), bool)
    moments = CostMoments((2, 2))
    for i, s in enumerate(steps):
        m = mask.copy()
        if i == 2:
            m[0, 1, 1] = False
        moments.update(torch.from_numpy(s), torch.from_numpy(m))
    hist = np.concatenate(steps)
    keep = np.ones(hist.shape, bool)
    keep[2 * 3 + 0, 1, 1] = False
    for (i, j) in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        col = hist[keep[:, i, j], i, j]
        mean, var = float(np.mean(col)), float(np.var(col))
        for got, want in [(moments.mean[i, j], mean), (moments.var[i, j], var), (moments.second_moment[i, j], var + mean**2)]:
            if math.isnan(want):
                assert math.isnan(float(got))
            else:
                assert math.isclose(float(got), want, rel_tol=1e-12, abs_tol=1e-14)
    assert math.isnan(float(moments.mean[0, 0]))  # the NaN entry is flagged, not averaged away


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_a_nan_operator_raises_and_the_early_stop_refuses_a_nan_eigenvalue(method):
    H = torch.diag(torch.tensor([3.0, 1.0, -2.0, 0.5], dtype=DT))
    H[1, 2] = H[2, 1] = math.nan
    with pytest.raises(NonFiniteHessianError):
        eigenvalues_from_hvp(lambda v: H @ v, 4, method=method)
    stop = EigenvalueEarlyStop()
    with pytest.raises(ValueError):
        stop.update(math.nan)


@pytest.mark.parametrize("route", [r for r in ROUTES if r.startswith("arch:exact") or r == "alpha_diag_hessian"])
def test_a_nan_in_one_row_of_alpha_is_nan_curvature_not_a_shared_alpha_refusal(route):
    """Edges e0 and e1 read different rows of one α (2, K). Before: a NaN in row 0 made the softmax backward NaN over
    row 0 for e1's probe too, so the shared-α check saw e1 depend on row 0 and refused "edges 'e0' and 'e1' take
    their mixing weights from the same entries" (a NaN turned into a wrong diagnosis). Reference: torch's forward of
    the same model is NaN, so every entry must be NaN."""
    torch.manual_seed(0)
    model, x = TinySupernet().to(DT), torch.randn(5, 4, dtype=DT)
    with torch.no_grad():
        model.alpha[0, 1] = math.nan
    y = torch.tensor([0, 1, 2, 0, 1])
    assert math.isnan(F.cross_entropy(model(x), y).item())
    got = _curvature(route, model, x, y)
    for name, value in got.items():
        assert torch.isnan(value).all(), f"{route}: {name} = {value}"


@pytest.mark.parametrize("epoch, eigenvalue", [(1.5, 1.0), (math.nan, 1.0), ("1", 1.0), (True, 1.0), (1, "abc"),
                                               (1, torch.ones(2))])
def test_the_early_stop_refuses_a_non_int_epoch_and_a_non_number_eigenvalue_in_one_line(epoch, eigenvalue):
    """Before: epoch=1.5 was truncated to 1 (as seed=1.5 was), epoch=NaN was Python's bare "cannot convert float NaN
    to integer", eigenvalue='abc' float()'s bare error; nothing is recorded by a refused update."""
    stop = EigenvalueEarlyStop()
    stop.update(2.0, epoch=0)
    with pytest.raises(CurvatureTypeError, match="must be") as info:
        stop.update(eigenvalue, epoch=epoch)
    assert "\n" not in str(info.value)
    assert stop.history == [(0, 2.0)]


@pytest.mark.parametrize("mode", ["exact", "diag", "approx", "hutchinson:2"])
def test_a_nan_target_of_mse_is_nan_curvature_though_the_mse_hessian_ignores_targets(mode):
    """∂²MSE/∂y² = 2/(N·D)·I whatever the targets, so one NaN target (a NaN loss, by torch itself) gave a fully finite
    curvature in every mode before: the NaN of the loss was dropped without a trace."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(DT)
    x, t = torch.randn(5, 4, dtype=DT), torch.randn(5, 2, dtype=DT)
    t[3, 1] = math.nan
    assert math.isnan(F.mse_loss(model(x), t).item())
    got = diag_hessian(model, F.mse_loss, x, t, mode=mode)
    for name, value in got.items():
        assert torch.isnan(value).all(), f"{mode}: {name} = {value}"
