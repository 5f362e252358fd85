"""Spectrum of the α-Hessian: extreme eigenvalues (Lanczos, power iteration), Hutchinson trace and
diagonal, and RobustDARTS's eigenvalue early-stop rule.

None of the five papers in ``../shared/papers`` has this; the rule is from Zela et al. 2020,
"Understanding and Robustifying Differentiable Architecture Search" (RobustDARTS, §5.2, DARTS-ES).

Two layers:

* a functional core on a plain ``hvp(v)`` callable and a dimension (:func:`eigenvalues_from_hvp`,
  :func:`trace_from_hvp`, :func:`diagonal_from_hvp`), testable on dense matrices of known spectrum;
* model wrappers (:func:`hessian_eigenvalues`, :func:`hutchinson_trace`, :func:`hutchinson_diagonal`)
  that build exact HVPs of ``loss_fn(model(inputs), targets)`` w.r.t. ``params`` (default
  ``model.arch_parameters()``) from one retained graph (:func:`loss_hvp`). Train-mode BatchNorm is
  differentiated through its batch statistics; its running statistics are left unchanged.

Batch convention: the Hessian is the one of exactly the scalar ``loss_fn`` returns; with
``reduction="mean"`` (the nasdiag default) that is the Hessian of the batch-mean loss.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

from nasdiag.hessian._hvp import (
    HessianVectorProduct,
    Inputs,
    call_model,
    check_probe_memory,
    named_tensors,
    preserved_buffers,
    scalar_loss,
)
from nasdiag.hessian.modes import CurvatureError, CurvatureTypeError, check_seed
from nasdiag.hessian.weights import _refuse_empty_batch

__all__ = [
    "EarlyStopDecision",
    "NonFiniteHessianError",
    "EigenvalueEarlyStop",
    "HutchinsonEstimate",
    "SpectrumResult",
    "diagonal_from_hvp",
    "eigenvalues_from_hvp",
    "hessian_eigenvalues",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "loss_hvp",
    "trace_from_hvp",
]

HVP = Callable[[torch.Tensor], torch.Tensor]
_METHODS = ("lanczos", "power")


# -- results -------------------------------------------------------------------------------------


class NonFiniteHessianError(CurvatureError, FloatingPointError):
    """A Hessian-vector product came out NaN or inf (a NaN batch, diverged parameters): the eigenvalues and
    Hutchinson estimates do not exist there. A :class:`~nasdiag.hessian.modes.CurvatureError` (so one
    ``NasdiagError`` to catch) and a ``FloatingPointError`` (what callers caught before)."""


@dataclass(frozen=True)
class SpectrumResult:
    """Extreme eigenvalues of a symmetric operator.

    Attributes:
        eigenvalues: (k,) float64, the k largest algebraic eigenvalues, descending.
        largest_algebraic: max λ (can be negative): RobustDARTS's "dominant eigenvalue" λ_max of the α-Hessian,
            the one ``nasdiag search`` records as ``hessian/top_eigenvalue``.
        largest_magnitude: the λ of largest |λ|, with its sign (the power method's dominant eigenvalue in the
            numerical sense); it differs from ``largest_algebraic`` when the most negative eigenvalue is the larger
            in size.
        smallest_algebraic: min λ (Lanczos), or ``None`` when the method does not find it (power).
        iterations: Hessian-vector products used.
        converged: every reported eigenvalue met ``tol`` (see the producing function).
        residuals: (k,) residual norms ``‖H u − λ u‖`` of the reported eigenvalues (Lanczos: the
            Ritz estimate ``|β_m s_{m,i}|``).
        method: ``"lanczos"`` or ``"power"``.
    """

    eigenvalues: torch.Tensor
    largest_algebraic: float
    largest_magnitude: float
    smallest_algebraic: Optional[float]
    iterations: int
    converged: bool
    residuals: torch.Tensor
    method: str


@dataclass(frozen=True)
class HutchinsonEstimate:
    """A Hutchinson estimate with Rademacher probes z: ``mean(zᵀHz)`` (trace) or ``mean(z ⊙ Hz)`` (diagonal).

    Attributes:
        estimate: float (trace) or float64 tensor (diagonal; shaped like the parameters for the model
            wrappers: a tuple of tensors, one per parameter).
        stderr: standard error of ``estimate``: the sample standard deviation over probes / √samples,
            same type and shape.
        samples: number of probes.
    """

    estimate: object
    stderr: object
    samples: int


# -- functional core: eigenvalues ------------------------------------------------------------------


def eigenvalues_from_hvp(
    hvp: HVP,
    dim: int,
    *,
    k: int = 1,
    method: str = "lanczos",
    iters: Optional[int] = None,
    tol: float = 1e-6,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> SpectrumResult:
    """Extreme eigenvalues of a symmetric ``dim × dim`` operator known through ``hvp(v) = H v``.

    ``method="lanczos"``: Lanczos with full reorthogonalization (the Krylov basis is kept in float64, so
    ``dim`` up to ~10⁵ is fine). If the Krylov space becomes invariant before the answer converged, it
    restarts from a fresh random vector orthogonal to the basis, so eigenvalues of multiplicity > 1 are
    found once the space they hide in is exhausted, and ``iters = dim`` reproduces the whole spectrum
    up to rounding. Convergence: the Ritz residual ``|β_m s_{m,i}|`` of each of the k largest algebraic
    Ritz values and of the largest-magnitude one is ``≤ tol · max|θ|``. Like any Krylov method, before
    the space is exhausted it sees one copy of a repeated eigenvalue (with k > 1, ``H = diag(5, 5, 1, …)``
    can report ``[5, next]`` before it reports ``[5, 5]``); exact repeats are rare in Hessians except
    for exact null spaces such as α's softmax shift invariance, which the restart handles.

    ``method="power"`` (k = 1 only): power iteration for the dominant (largest |λ|) eigenvalue; if it is
    negative, a second power iteration on ``H − λ_dom I`` (positive semidefinite) gives the largest
    algebraic one. Convergence: ``‖H u − λ u‖ ≤ tol · |λ|``. Slow when |λ_max| ≈ |λ_min| or the top
    eigenvalues are close; prefer Lanczos.

    Args:
        hvp: maps a (dim,) tensor to H v, H symmetric. Called with ``dtype``/``device`` vectors.
        dim: the operator's dimension.
        k: how many of the largest algebraic eigenvalues to report.
        iters: maximum HVPs per run (default ``min(dim, max(100, 4k))``, and Lanczos never takes more than ``dim``;
            power: 1000).
        tol: relative tolerance, see above.
        seed: seeds the start vector (CPU generator, so results do not depend on the device).
        dtype, device: of the vectors passed to ``hvp``.

    Returns:
        :class:`SpectrumResult`.
    """
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:  # True was a 1-dim operator (torch's errors)
        raise CurvatureError(f"dim must be a positive int, got {dim!r}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= dim:
        raise CurvatureError(f"k must be an int in [1, dim={dim}], got {k!r}")
    if method not in _METHODS:
        raise CurvatureError(f"method must be one of {_METHODS}, got {method!r}")
    if isinstance(iters, bool):  # True was taken as 1 (power) or reached torch.zeros (lanczos: a TypeError traceback)
        raise CurvatureError(f"iters must be an int (the most Hessian-vector products), got {iters!r}")
    _checked_tol(tol)
    generator = torch.Generator().manual_seed(check_seed(seed, "the start vector"))
    if method == "lanczos":
        iters = min(dim, max(100, 4 * k)) if iters is None else iters
        if not isinstance(iters, int) or iters < k:
            raise CurvatureError(f"iters must be an int >= k={k}, got {iters!r}")
        # it stops at dim products (the basis then spans the space); its (iters + 1, dim) basis was allocated whole
        return _lanczos(hvp, dim, k, min(iters, dim), tol, generator, dtype, device)
    if k != 1:
        raise CurvatureError(f"method='power' finds one eigenvalue; for k={k} use method='lanczos'")
    iters = 1000 if iters is None else iters
    if not isinstance(iters, int) or iters < 1:
        raise CurvatureError(f"iters must be a positive int, got {iters!r}")
    return _power(hvp, dim, iters, tol, generator, dtype, device)


def _checked_tol(tol) -> None:
    """A positive finite number: a string or None was a bare ``TypeError`` of ``tol > 0``, and ``inf`` made every
    residual 'converged' (a random Rayleigh quotient reported as the top eigenvalue with ``converged=True``)."""
    if isinstance(tol, (str, bool)) or not isinstance(tol, (numbers.Real, torch.Tensor)):
        raise CurvatureTypeError(f"tol must be a number (a relative residual, e.g. 1e-6), got {tol!r}")
    if isinstance(tol, torch.Tensor) and tol.numel() != 1 or not 0 < float(tol) < math.inf:
        raise CurvatureError(f"tol must be a positive finite number (a relative residual, e.g. 1e-6), got {tol!r}")


def _apply(hvp: HVP, v: torch.Tensor, dtype, device) -> torch.Tensor:
    out = hvp(v.to(dtype=dtype, device=device))
    if not isinstance(out, torch.Tensor) or out.shape != v.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise CurvatureError(f"hvp(v) must return a tensor of shape {tuple(v.shape)}, got {got}")
    out = out.detach().to(torch.float64).cpu()
    if not torch.isfinite(out).all():
        raise NonFiniteHessianError(
            "hvp(v) returned NaN or inf: the Hessian is not finite at this point (a NaN or inf in the batch, the "
            "parameters or the loss); a search records such an eigenvalue as NaN with hessian/<cell>/nonfinite set"
        )
    return out


def _random_unit(dim: int, generator: torch.Generator, basis: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """A random unit vector, orthogonal to the rows of ``basis`` if given; None if they span everything."""
    v = torch.randn(dim, generator=generator, dtype=torch.float64)
    if basis is not None and basis.shape[0]:
        for _ in range(2):
            v = v - basis.T @ (basis @ v)
    norm = v.norm()
    if norm <= 1e-8:
        return None
    return v / norm


def _lanczos(hvp, dim, k, iters, tol, generator, dtype, device) -> SpectrumResult:
    Q = torch.zeros(iters + 1, dim, dtype=torch.float64)
    alpha = torch.zeros(iters, dtype=torch.float64)
    beta = torch.zeros(iters, dtype=torch.float64)  # beta[j] couples q_j and q_{j+1}; 0 at a restart
    Q[0] = _random_unit(dim, generator)
    block_start = 0  # first index of the current Krylov block
    converged = False
    m = 0
    for j in range(iters):
        w = _apply(hvp, Q[j], dtype, device)
        alpha[j] = Q[j] @ w
        for _ in range(2):  # full reorthogonalization; twice is enough (Parlett)
            w = w - Q[: j + 1].T @ (Q[: j + 1] @ w)
        b = w.norm().item()
        m = j + 1
        theta, S = torch.linalg.eigh(_tridiagonal(alpha[:m], beta[: m - 1]))
        scale = max(theta.abs().max().item(), 1e-300)
        invariant = b <= 1e-10 * scale
        residual = torch.zeros(m, dtype=torch.float64) if invariant else (b * S[-1]).abs()
        if m == dim:
            converged = True  # the basis spans the space: T is H in another basis
        elif invariant:
            # Every block is now invariant, so theta is exact. The rest of the space holds only further
            # copies of this block's eigenvalues (a random start vector meets every eigenspace), so the
            # top k are final unless a copy of this block's largest value would enter them.
            last_block = torch.linalg.eigvalsh(_tridiagonal(alpha[block_start:m], beta[block_start : m - 1]))
            converged = m >= k and theta[-k].item() >= last_block[-1].item() - tol * scale
        else:
            converged = m >= k and bool((residual[_watched(theta, k)] <= tol * scale).all())
            if converged and block_start > 0:
                # After a restart the current block may still be climbing towards a copy of a top
                # eigenvalue: accept only once its own largest Ritz value has converged too.
                _, block_S = torch.linalg.eigh(
                    _tridiagonal(alpha[block_start:m], beta[block_start : m - 1])
                )
                converged = b * abs(block_S[-1, -1].item()) <= tol * scale
        if converged or m == iters:
            break
        if invariant:
            fresh = _random_unit(dim, generator, Q[:m])
            if fresh is None:  # rounding left no room: the basis spans the space
                converged = True
                break
            Q[m], block_start = fresh, m
        else:
            beta[j] = b
            Q[m] = w / b
    top = torch.argsort(theta, descending=True)[:k]
    magnitude = int(torch.argmax(theta.abs()))
    return SpectrumResult(
        eigenvalues=theta[top].clone(),
        largest_algebraic=float(theta[-1]),
        largest_magnitude=float(theta[magnitude]),
        smallest_algebraic=float(theta[0]),
        iterations=m,
        converged=converged,
        residuals=residual[top].clone(),
        method="lanczos",
    )


def _tridiagonal(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1)


def _watched(theta: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (into ascending ``theta``) of the k largest Ritz values and the largest-magnitude one."""
    top = torch.arange(max(theta.numel() - k, 0), theta.numel())
    return torch.unique(torch.cat([top, torch.argmax(theta.abs()).reshape(1)]))


def _power(hvp, dim, iters, tol, generator, dtype, device) -> SpectrumResult:
    dominant, res_dom, used, ok = _power_run(hvp, dim, iters, tol, generator, dtype, device, shift=0.0)
    largest, res_top, ok_top = dominant, res_dom, ok
    if dominant < 0:
        # H − λ_dom I has eigenvalues λ − λ_dom ∈ [0, λ_max − λ_dom]: its dominant one is λ_max − λ_dom.
        shifted, res_top, used_top, ok_top = _power_run(hvp, dim, iters, tol, generator, dtype, device, shift=dominant)
        largest = shifted + dominant
        used += used_top
    return SpectrumResult(
        eigenvalues=torch.tensor([largest], dtype=torch.float64),
        largest_algebraic=largest,
        largest_magnitude=dominant,
        smallest_algebraic=None,
        iterations=used,
        converged=ok and ok_top,
        residuals=torch.tensor([res_top], dtype=torch.float64),
        method="power",
    )


def _power_run(hvp, dim, iters, tol, generator, dtype, device, shift: float) -> Tuple[float, float, int, bool]:
    v = _random_unit(dim, generator)
    lam, residual = 0.0, math.inf
    for it in range(1, iters + 1):
        w = _apply(hvp, v, dtype, device) - shift * v
        lam = float(v @ w)
        residual = float((w - lam * v).norm())
        # the shifted problem's tolerance is relative to the original scale, |shift| included
        if residual <= tol * max(abs(lam), abs(shift), 1e-300):
            return lam, residual, it, True
        norm = w.norm()
        if norm == 0:  # v in the null space: H − shift·I vanishes on it, λ = 0 is exact
            return 0.0, 0.0, it, True
        v = w / norm
    return lam, residual, iters, False


# -- functional core: Hutchinson ----------------------------------------------------------------------


def trace_from_hvp(
    hvp: HVP,
    dim: int,
    *,
    samples: int = 100,
    seed: int = 0,
    batch_size: int = 1,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> HutchinsonEstimate:
    """Hutchinson's trace estimate ``tr H ≈ (1/n) Σ_s z_sᵀ H z_s`` with Rademacher ``z_s ∈ {±1}^dim``.

    Unbiased; one probe has variance ``2 Σ_{i≠j} H_ij²`` (zero for a diagonal H). The returned
    ``stderr`` is the sample standard deviation of ``z_sᵀ H z_s`` over probes divided by √n.

    Args:
        hvp: H v for a (dim,) vector, or for a (batch_size, dim) stack when ``batch_size > 1``.
        dim: dimension of H.
        samples: number of probes n (>= 2, for a standard error).
        seed: seeds the probes (CPU generator: the same probes on any device).
        batch_size: probes per ``hvp`` call.
        dtype, device: of the probes passed to ``hvp``.

    Returns:
        :class:`HutchinsonEstimate` with float ``estimate`` and ``stderr``.
    """
    quad = _probe_products(hvp, dim, samples, seed, batch_size, dtype, device, reduce_to_scalar=True)
    return HutchinsonEstimate(float(quad.mean()), float(quad.std(unbiased=True) / math.sqrt(samples)), samples)


def diagonal_from_hvp(
    hvp: HVP,
    dim: int,
    *,
    samples: int = 100,
    seed: int = 0,
    batch_size: int = 1,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> HutchinsonEstimate:
    """Hutchinson-type diagonal estimate ``diag H ≈ (1/n) Σ_s z_s ⊙ H z_s`` (Rademacher z; Bekas et al. 2007).

    Unbiased; entry i of one probe has variance ``Σ_{j≠i} H_ij²``. Arguments as :func:`trace_from_hvp`.

    Returns:
        :class:`HutchinsonEstimate` with (dim,) float64 ``estimate`` and ``stderr``.
    """
    prod = _probe_products(hvp, dim, samples, seed, batch_size, dtype, device, reduce_to_scalar=False)
    return HutchinsonEstimate(prod.mean(0), prod.std(0, unbiased=True) / math.sqrt(samples), samples)


def _probe_products(hvp, dim, samples, seed, batch_size, dtype, device, reduce_to_scalar: bool) -> torch.Tensor:
    """Per probe: ``zᵀHz`` (n,) or ``z ⊙ Hz`` (n, dim), float64 on the CPU."""
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise CurvatureError(f"dim must be a positive int, got {dim!r}")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 2:
        raise CurvatureError(f"samples must be an int >= 2 (a standard error needs two probes), got {samples!r}")
    # batch_size=True reached torch.randint as a size (its multi-line TypeError)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise CurvatureError(f"batch_size must be a positive int, got {batch_size!r}")
    if not reduce_to_scalar:  # every probe's (dim,) product is held (float64, CPU), then concatenated
        check_probe_memory(2 * samples * dim * 8, None, "cpu", f"hutchinson_diagonal(samples={samples})",
                           "lower samples (the error falls as 1/sqrt(samples))", settable=False)
    generator = torch.Generator().manual_seed(check_seed(seed, "the probes"))
    out = []
    for start in range(0, samples, batch_size):
        m = min(batch_size, samples - start)
        Z = torch.randint(0, 2, (m, dim), generator=generator, dtype=torch.float64).mul_(2).sub_(1)
        if batch_size == 1:
            HZ = _apply(hvp, Z[0], dtype, device).unsqueeze(0)
        else:
            HZ = _apply(hvp, Z, dtype, device)
        prod = Z * HZ
        out.append(prod.sum(1) if reduce_to_scalar else prod)
    return torch.cat(out)


# -- model wrappers -------------------------------------------------------------------------------


def loss_hvp(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: Inputs,
    targets,
    params=None,
) -> HessianVectorProduct:
    """Exact HVPs of ``loss_fn(model(inputs), targets)`` w.r.t. ``params``, from one retained graph.

    Runs one forward (on scratch copies of the buffers, so BatchNorm running statistics are unchanged)
    and one ``create_graph`` backward; each call of the returned operator is one second backward
    (a stack ``(m, dim)`` is one vmapped backward). The graph lives as long as the operator.

    Args:
        params: tensors (requires_grad), ``(name, tensor)`` pairs, or ``{name: tensor}``; default
            ``model.named_arch_parameters()`` / ``model.arch_parameters()``, else a ``ValueError``.

    Returns:
        :class:`~nasdiag.hessian._hvp.HessianVectorProduct` acting on the flattened concatenation of
        ``params`` (attributes ``dim``, ``sizes``, ``names``, ``gradient``).
    """
    pairs = named_tensors(params, default_owner=model)
    own = dict(model.named_parameters())
    # diag_hessian takes {name: value} as the point to evaluate at; these products run through the tensors the model
    # uses, so another tensor under a parameter's name was not differentiated: zero rows, λ = 0 'converged'
    other = [n for n, p in pairs if isinstance(n, str) and n in own and own[n] is not p]
    if other:
        raise CurvatureError(
            f"params {other} name parameters of the model but give other tensors: the spectrum differentiates the loss "
            "w.r.t. the tensors the model uses, not values put in their place (as diag_hessian's params do); pass the "
            f"model's own (dict(model.named_parameters())[{other[0]!r}]), after loading the values to evaluate at into it"
        )
    _refuse_empty_batch(inputs)  # its mean loss is NaN, but no output entry carries that into the products (zeros)
    with preserved_buffers(model), torch.enable_grad():
        loss = scalar_loss(loss_fn, call_model(model, inputs), targets)
    hvp = HessianVectorProduct(loss, [p for _, p in pairs], [n for n, _ in pairs],
                               context=lambda: preserved_buffers(model))  # a checkpoint's recompute in the backwards
    if hvp.unused:
        warnings.warn(
            f"the loss does not depend on {hvp.unused}: their Hessian rows and columns are zero",
            RuntimeWarning,
            stacklevel=2,
        )
    return hvp


def _operator(model, loss_fn, inputs, targets, params, hvp, dim):
    """(hvp callable, dim, dtype, device, parameter-shaped split or None) for either calling style."""
    if hvp is None and not isinstance(model, nn.Module) and callable(model):
        hvp, model = model, None  # hessian_eigenvalues(hvp, dim, ...)
        if dim is None and isinstance(loss_fn, int):
            dim, loss_fn = loss_fn, None
    if hvp is not None:
        if model is not None or loss_fn is not None or inputs is not None or targets is not None or params is not None:
            raise CurvatureError("pass either a model with loss_fn, inputs, targets (and params), or hvp= and dim=, not both")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise CurvatureError(f"with a plain hvp callable, give its dimension: dim must be a positive int, got {dim!r}")
        return hvp, dim, torch.float64, None, None
    if not isinstance(model, nn.Module):
        raise CurvatureError(f"model must be an nn.Module (or pass hvp= and dim=), got {type(model).__name__}")
    if loss_fn is None or inputs is None or targets is None:
        raise CurvatureError("a model needs loss_fn, inputs and targets: the Hessian is of loss_fn(model(inputs), targets)")
    if dim is not None:  # it was ignored: the dimension is the number of entries of params
        raise CurvatureError(f"dim={dim!r} is for a plain hvp callable; with a model the dimension is the number of entries "
                             "of params, so leave dim out (or pass params= to choose them)")
    op = loss_hvp(model, loss_fn, inputs, targets, params)
    shapes = [t.shape for t in op.wrt]

    def split(v):
        return tuple(part.reshape(shape) for part, shape in zip(torch.split(v, op.sizes), shapes))

    return op, op.dim, op.dtype, op.device, split


def hessian_eigenvalues(
    model: Optional[nn.Module] = None,
    loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    inputs: Optional[Inputs] = None,
    targets=None,
    params=None,
    k: int = 1,
    method: str = "lanczos",
    iters: Optional[int] = None,
    tol: float = 1e-6,
    seed: int = 0,
    *,
    hvp: Optional[HVP] = None,
    dim: Optional[int] = None,
) -> SpectrumResult:
    """Extreme eigenvalues of the Hessian of the mini-batch loss w.r.t. ``params`` (default: α).

    RobustDARTS (Zela et al. 2020) tracks the dominant eigenvalue of the validation-loss α-Hessian to
    detect collapse: that is ``result.largest_algebraic`` (λ_max, as ``nasdiag search`` records it); feed it (or,
    consistently, ``largest_magnitude``) to an :class:`EigenvalueEarlyStop` once per epoch. The Hessian is the one of exactly ``loss_fn``'s scalar
    (batch mean for ``reduction="mean"``), joint over all ``params`` (for a DARTS ``Network``: both
    ``alphas_normal`` and ``alphas_reduce``, shared across cells, cross-cell terms included).

    Also callable on a plain operator: ``hessian_eigenvalues(hvp, dim, k=...)`` or
    ``hessian_eigenvalues(hvp=..., dim=...)``, as :func:`eigenvalues_from_hvp`.

    Args: as :func:`loss_hvp` and :func:`eigenvalues_from_hvp`.

    Returns:
        :class:`SpectrumResult`; eigenvalues in float64 whatever the model's dtype.
    """
    check_seed(seed, "the start vector")  # before the forward
    op, n, dtype, device, _ = _operator(model, loss_fn, inputs, targets, params, hvp, dim)
    return eigenvalues_from_hvp(op, n, k=k, method=method, iters=iters, tol=tol, seed=seed, dtype=dtype, device=device)


def hutchinson_trace(
    model: Optional[nn.Module] = None,
    loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    inputs: Optional[Inputs] = None,
    targets=None,
    params=None,
    samples: int = 100,
    seed: int = 0,
    batch_size: Optional[int] = None,
    *,
    hvp: Optional[HVP] = None,
    dim: Optional[int] = None,
) -> HutchinsonEstimate:
    """Hutchinson estimate of ``tr ∂²L/∂θ²`` for θ = ``params`` (default: α), Rademacher probes.

    See :func:`trace_from_hvp`. ``batch_size`` probes share one batched second backward (default 16
    for a model; 1 for a plain ``hvp``, which then only sees (dim,) vectors). Also callable as
    ``hutchinson_trace(hvp, dim, ...)``.

    Returns:
        :class:`HutchinsonEstimate` with float ``estimate`` and ``stderr``.
    """
    check_seed(seed, "the probes")  # before the forward
    op, n, dtype, device, split = _operator(model, loss_fn, inputs, targets, params, hvp, dim)
    batch_size = (16 if split is not None else 1) if batch_size is None else batch_size
    return trace_from_hvp(op, n, samples=samples, seed=seed, batch_size=batch_size, dtype=dtype, device=device)


def hutchinson_diagonal(
    model: Optional[nn.Module] = None,
    loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    inputs: Optional[Inputs] = None,
    targets=None,
    params=None,
    samples: int = 100,
    seed: int = 0,
    batch_size: Optional[int] = None,
    *,
    hvp: Optional[HVP] = None,
    dim: Optional[int] = None,
) -> HutchinsonEstimate:
    """Hutchinson estimate of ``diag ∂²L/∂θ²`` for θ = ``params`` (default: α), Rademacher probes.

    See :func:`diagonal_from_hvp` and :func:`hutchinson_trace` for ``batch_size`` and the ``hvp`` form.

    Returns:
        :class:`HutchinsonEstimate`: for a model, ``estimate`` and ``stderr`` are tuples of float64
        tensors shaped like ``params``, in their order; for a plain ``hvp``, (dim,) tensors.
    """
    check_seed(seed, "the probes")  # before the forward
    op, n, dtype, device, split = _operator(model, loss_fn, inputs, targets, params, hvp, dim)
    batch_size = (16 if split is not None else 1) if batch_size is None else batch_size
    flat = diagonal_from_hvp(op, n, samples=samples, seed=seed, batch_size=batch_size, dtype=dtype, device=device)
    if split is None:
        return flat
    return HutchinsonEstimate(split(flat.estimate), split(flat.stderr), samples)


# -- RobustDARTS early stop ------------------------------------------------------------------------


@dataclass(frozen=True)
class EarlyStopDecision:
    """The answer of :class:`EigenvalueEarlyStop` for one epoch.

    Attributes:
        stop: stop the search now (and stays True once triggered).
        reason: why, in words.
        epoch: the epoch this decision is for.
        rollback_epoch: the epoch whose architecture to return (``i − k`` in RobustDARTS), or None.
        previous_mean, current_mean: ``λ̄(i−k)`` and ``λ̄(i)``, None until both windows are full.
    """

    stop: bool
    reason: str
    epoch: int
    rollback_epoch: Optional[int] = None
    previous_mean: Optional[float] = None
    current_mean: Optional[float] = None


@dataclass
class EigenvalueEarlyStop:
    """RobustDARTS's early-stop rule (DARTS-ES; Zela et al. 2020, §5.2) on the dominant α-Hessian eigenvalue.

    Feed one eigenvalue per epoch with :meth:`update`. With ``λ̄(i)`` the mean of the last ``window``
    values fed up to epoch i (a trailing window, so the rule is causal), the search stops at epoch i
    when ``λ̄(i−k)/λ̄(i) < threshold`` with ``k = window``: the curvature grew by more than
    1/threshold (4/3 by default) within k epochs. The architecture to keep is the one of epoch i−k.

    The rule is evaluated as ``λ̄(i−k) < threshold · λ̄(i)``, identical to the ratio when ``λ̄(i) > 0``
    and still meaning "grew too much" when the means are zero or negative (where the ratio would flip).
    The first decision needs ``2·window`` values. ``window`` counts values fed, not epochs: if you feed
    an eigenvalue every ``f`` epochs, pass the epoch numbers to :meth:`update` and the window spans
    ``window·f`` epochs (RobustDARTS's code computes the eigenvalue every 2 epochs).

    Args:
        threshold: 0.75 in RobustDARTS; in (0, 1].
        window: k, 5 in RobustDARTS.
        start_epoch: no stop is declared before this epoch (RobustDARTS's code waits for epoch 10).

    Attributes:
        history: (epoch, eigenvalue) pairs fed so far.
        stopped: the rule has fired; ``stop_epoch`` and ``rollback_epoch`` tell when and where to.
    """

    threshold: float = 0.75
    window: int = 5
    start_epoch: int = 0
    history: List[Tuple[int, float]] = field(default_factory=list, init=False)
    stop_epoch: Optional[int] = field(default=None, init=False)
    rollback_epoch: Optional[int] = field(default=None, init=False)

    def __post_init__(self):
        # checked here, not at the first decision 2·window epochs into a search
        if not isinstance(self.threshold, numbers.Real) or isinstance(self.threshold, bool) or not 0 < self.threshold <= 1:
            raise CurvatureError(f"threshold must be a number in (0, 1] (RobustDARTS uses 0.75), got {self.threshold!r}")
        if not isinstance(self.window, numbers.Integral) or isinstance(self.window, bool) or self.window < 1:
            raise CurvatureError(f"window must be a positive int (RobustDARTS uses 5), got {self.window!r}")
        if not isinstance(self.start_epoch, numbers.Integral) or isinstance(self.start_epoch, bool):
            raise CurvatureError(f"start_epoch must be an int (the first epoch a stop may be declared; RobustDARTS's code "
                                 f"waits for 10), got {self.start_epoch!r}")

    @property
    def stopped(self) -> bool:
        return self.stop_epoch is not None

    def update(self, eigenvalue: float, epoch: Optional[int] = None) -> EarlyStopDecision:
        """Record the dominant eigenvalue of ``epoch`` (default: one past the last epoch fed, from 0)
        and answer stop or continue."""
        try:
            value = float(eigenvalue)
        except (TypeError, ValueError, RuntimeError):  # float('abc'), a tensor of several values: torch's bare error
            raise CurvatureTypeError(
                f"eigenvalue must be a number (the dominant eigenvalue of this epoch), got {eigenvalue!r}"
            ) from None
        if not math.isfinite(value):
            raise CurvatureError(
                f"eigenvalue {value} is not finite; the Hessian at this epoch is broken, fix it before early stopping"
            )
        if epoch is None:
            epoch = self.history[-1][0] + 1 if self.history else 0
        if not isinstance(epoch, numbers.Integral) or isinstance(epoch, bool):  # 1.5 was truncated, NaN a bare ValueError
            raise CurvatureTypeError(f"epoch must be an int (the epoch this eigenvalue belongs to), got {epoch!r}")
        epoch = int(epoch)
        if self.history and epoch <= self.history[-1][0]:
            raise CurvatureError(f"epochs must increase: got {epoch} after {self.history[-1][0]}")
        self.history.append((epoch, value))

        if self.stopped:
            return EarlyStopDecision(
                True, f"already stopped at epoch {self.stop_epoch}", epoch, self.rollback_epoch
            )
        k = self.window
        if len(self.history) < 2 * k:
            return EarlyStopDecision(False, f"collecting: {len(self.history)} of {2 * k} values needed", epoch)
        values = [v for _, v in self.history]
        current = sum(values[-k:]) / k
        previous = sum(values[-2 * k : -k]) / k
        rollback = self.history[-k - 1][0]
        grew = previous < self.threshold * current
        if grew and epoch >= self.start_epoch:
            self.stop_epoch, self.rollback_epoch = epoch, rollback
            reason = (
                f"dominant eigenvalue grew: mean {current:.4g} over the last {k} values vs {previous:.4g} over the "
                f"{k} before, ratio {previous / current if current else float('-inf'):.3g} < {self.threshold}; "
                f"roll back to epoch {rollback}"
            )
            return EarlyStopDecision(True, reason, epoch, rollback, previous, current)
        if grew:
            reason = f"rule fired but epoch {epoch} < start_epoch {self.start_epoch}"
        else:
            reason = f"λ̄(i−k)={previous:.4g} >= {self.threshold}·λ̄(i)={self.threshold * current:.4g}"
        return EarlyStopDecision(False, reason, epoch, None, previous, current)

    def reset(self) -> None:
        """Forget everything (e.g. after rolling back, as DARTS-ADA does)."""
        self.history.clear()
        self.stop_epoch = self.rollback_epoch = None
