"""Curvature of the loss w.r.t. the model outputs: the seed of every recursion.

The diagonal recursions (bayesnas-appendix C.1-C.2) start from the pre-activation Hessian of the
last layer, i.e. ``∂²loss/∂outputs²``. For a loss that is a sum or mean of per-sample terms
(cross-entropy, MSE, ...) this is block diagonal over samples; we get the blocks from ``D``
Hessian-vector products of ``loss_fn`` alone (not the network), D = outputs per sample, and check the
block structure with ``D`` more products on distinctly weighted samples instead of trusting it.
"""

from __future__ import annotations

from typing import Callable

import torch

from nasdiag.hessian._hvp import distinct_weights, scalar_loss
from nasdiag.hessian.modes import CurvatureError, CurvatureTypeError

__all__ = ["LossCouplesSamplesError", "output_hessian_blocks", "output_hessian_diagonal"]


class LossCouplesSamplesError(CurvatureError):
    """The loss has cross-sample second derivatives, so per-sample recursions do not apply (a
    :class:`~nasdiag.hessian.modes.CurvatureError`, hence also the ``ValueError`` it was before)."""


def output_hessian_blocks(
    loss_fn: Callable, outputs: torch.Tensor, targets, *, chunk_size: int = 64, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Per-sample blocks of the Hessian of ``loss_fn(outputs, targets)`` w.r.t. ``outputs``.

    Args:
        loss_fn: ``loss_fn(outputs, targets) -> scalar``; the Hessian is of exactly that scalar (mean
            reduction gives blocks 1/N times those of sum reduction).
        outputs: (N, ...) model outputs; the graph behind them is not used.
        targets: passed through to ``loss_fn``.
        chunk_size: products per vmapped second backward.

    Returns:
        (N, D, D) with ``D = outputs[0].numel()``, in the outputs' dtype: ``blocks[n] = ∂²loss/∂y_n²``
        for the flattened per-sample outputs ``y_n``.

    Raises:
        ValueError: the loss couples different samples (its Hessian has cross-sample blocks), which
            the per-sample recursions cannot represent; use ``mode="exact"`` then.
    """
    parts, zero = _loss_hessian_columns(loss_fn, outputs, targets, chunk_size, generator, lambda start, stop, h: h)
    if zero:
        return parts
    cols, coupled = parts
    cols = torch.cat(cols)  # (D, N, D): [d, n] = H_n[:, d]
    return _refused_if_coupled(coupled, cols, outputs).permute(1, 2, 0).contiguous()


def _loss_hessian_columns(loss_fn, outputs, targets, chunk_size, generator, take):
    """The D Hessian-vector products of the loss w.r.t. ``outputs`` (one per flattened output of a sample, on every
    sample at once), ``chunk_size`` at a time, and the check that the loss does not couple samples: ``D`` more
    products on distinctly weighted samples. ``take(start, stop, H_cols)`` keeps what the caller needs of a chunk's
    columns ``H_cols[d − start, n] = H_n[:, d]`` (c, N, D), so that only the diagonal need be held (N·D numbers, not
    the N·D² of the blocks: 12 GB for 48×48 RGB outputs at batch 8).

    Returns ``((kept parts, coupled), False)``, ``coupled`` a 0-d bool tensor, or ``(zeros (N, D, D), True)`` for a
    loss linear in the outputs."""
    if not isinstance(outputs, torch.Tensor) or outputs.dim() < 1:
        shape = f"a 0-d tensor" if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise CurvatureTypeError(
            f"the model must return one tensor (N, ...) for the diagonal recursions and the GGN modes, got {shape}; "
            "return the per-sample outputs alone, or use mode='exact'"
        )
    if not torch.is_floating_point(outputs):
        raise CurvatureError(
            f"model outputs have dtype {outputs.dtype}; a Hessian needs floating-point outputs: return them before any "
            "argmax or integer cast"
        )
    out = outputs.detach().requires_grad_(True)
    N, D = out.shape[0], out[0].numel()
    with torch.enable_grad():
        loss = scalar_loss(loss_fn, out, targets)
        (grad,) = torch.autograd.grad(loss, out, create_graph=True, allow_unused=True)
    if grad is None:
        raise CurvatureError(
            "loss_fn(outputs, targets) does not depend on the model outputs (its graph does not reach them), so its "
            "Hessian is not one of the model; compute the loss from outputs"
        )
    if not grad.requires_grad:  # loss linear in the outputs
        return out.new_zeros(N, D, D), True
    weights = _sample_weights(N, out, generator)
    # The coupling check compares two products to 1e3 ulp of their magnitudes; in float16/bfloat16 that tolerance is
    # the whole Hessian (a loss coupling samples as strongly as its per-sample terms passed, and diag/approx came out
    # 120% off), so there it is made on a float32 copy of the loss (the diagonal itself stays in the outputs' dtype).
    check = (_float32_copy(loss_fn, outputs, targets) if out.dtype in (torch.float16, torch.bfloat16) else None) or (grad, out, loss.dtype)
    parts = []
    col_max = diff_max = check[1].new_zeros(())
    for start in range(0, D, chunk_size):
        stop = min(start + chunk_size, D)
        basis = torch.zeros(stop - start, D, dtype=out.dtype, device=out.device)
        basis.diagonal(start).fill_(1)  # (c, D): class pattern e_d on every sample (no host indices: CUDA-graph safe)
        ones = basis[:, None, :].expand(-1, N, -1)
        probe = torch.cat([ones, ones * weights[None, :, None]]).reshape(-1, *out.shape)
        hv = torch.autograd.grad(grad, out, probe, retain_graph=True, is_grads_batched=True)[0]
        hv = hv.reshape(2, -1, N, D)
        hc = hv
        if check[1] is not out:
            hc = torch.autograd.grad(check[0], check[1], probe.to(check[1].dtype), retain_graph=True, is_grads_batched=True)[0]
            hc = hc.reshape(2, -1, N, D)
        # running maxima (NaN propagates, as in one max over all columns), compared once at the end
        col_max = torch.maximum(col_max, hc[0].abs().max())
        diff_max = torch.maximum(diff_max, (hc[1] - hc[0] * weights.to(hc.dtype)[None, :, None]).abs().max())
        parts.append(take(start, stop, hv[0]))
    # the products carry the round-off of the dtype the loss is computed in where that is coarser than the outputs'
    # (F.cross_entropy(outputs.float(), t) of a float64 model: 1e3 ulp of float64 refused it as coupling samples); a
    # loss computed in 16 bits whatever its outputs gets 32 ulp, as 1e3 is the whole Hessian there
    eps = max(torch.finfo(check[1].dtype).eps, torch.finfo(check[2]).eps)
    ulps = 1e3 if eps <= torch.finfo(torch.float32).eps else 32
    tol = ulps * eps * col_max * weights.abs().max().to(col_max.dtype)
    return (parts, diff_max > tol), False


def _float32_copy(loss_fn, outputs: torch.Tensor, targets):
    """``(∂loss/∂y, y, the loss's dtype)`` with a graph, for ``y`` a float32 copy of 16-bit ``outputs`` (targets of
    their dtype cast alike), on which the coupling check's products carry float32 round-off; None where it has no
    second derivative."""
    out = outputs.detach().float().requires_grad_(True)
    if isinstance(targets, torch.Tensor) and targets.dtype == outputs.dtype:
        targets = targets.float()
    with torch.enable_grad():
        loss = scalar_loss(loss_fn, out, targets)
        (grad,) = torch.autograd.grad(loss, out, create_graph=True, allow_unused=True)
    if grad is None or not grad.requires_grad:  # no second derivative in float32 (where the 16-bit loss had one)
        return None
    return grad, out, loss.dtype


def _refused_if_coupled(coupled: torch.Tensor, result: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """``result``, or a :class:`LossCouplesSamplesError` where the loss couples samples. 1-D ``outputs`` are N samples
    of one entry each: an unbatched call's logits (``model(x)`` on one (features,) sample, then cross-entropy over
    them) are refused saying so, not as a loss that couples samples (the user's loss does not)."""
    if _capturing(result):
        # Inside a CUDA-graph capture the check cannot reach the host; the capturer ran the same call eagerly
        # first (nasdiag.cuda_graphs.StepGraph does), where it raised. Here a coupling loss turns the
        # result into NaN, which the callers flag, instead of passing as a per-sample Hessian.
        return torch.where(coupled, torch.full_like(result, float("nan")), result)
    if coupled and outputs.dim() == 1:
        raise LossCouplesSamplesError(
            f"the model outputs have shape {tuple(outputs.shape)}, read as {outputs.shape[0]} samples of one entry each, "
            "and loss_fn couples them (as cross-entropy over one sample's logits does); for one sample pass a batch of "
            "one (inputs.unsqueeze(0), targets.unsqueeze(0)), or use mode='exact'"
        )
    if coupled:
        raise LossCouplesSamplesError(
            "loss_fn couples different samples (∂²loss/∂y_n∂y_m ≠ 0 for n ≠ m), so its Hessian w.r.t. the outputs is "
            "not block diagonal and the per-sample recursions do not apply; use a per-sample loss (a sum or mean "
            "of per-sample terms such as cross-entropy or MSE) or mode='exact'"
        )
    return result


def _sample_weights(N: int, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(N,) distinct weights for the coupling check: random from ``generator`` if one is given, else
    :func:`~nasdiag.hessian._hvp.distinct_weights` (nothing drawn from torch's global generator). A coupling
    ``Σ_m H_nm (w_m − w_n)`` vanishes for distinct weights only by accident, as for random ones."""
    if generator is not None:
        return torch.randn(N, dtype=like.dtype, device=like.device, generator=generator)
    return distinct_weights(N, like)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def output_hessian_diagonal(loss_fn: Callable, outputs: torch.Tensor, targets, *, chunk_size: int = 64,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """Diagonal of ``∂²loss/∂outputs²``, in the shape of ``outputs`` (see :func:`output_hessian_blocks`), from the
    same products and check, holding the diagonal only (N·D numbers, not the blocks' N·D²)."""

    def diagonal(start, stop, cols):  # cols[d − start, n, d] = H_n[d, d], as a view (no host indices)
        return cols.diagonal(start, dim1=0, dim2=2).T.clone()  # (c, N), not a view holding the chunk

    parts, zero = _loss_hessian_columns(loss_fn, outputs, targets, chunk_size, generator, diagonal)
    if zero:
        return torch.zeros_like(outputs)
    diag, coupled = parts
    return _refused_if_coupled(coupled, torch.cat(diag).T, outputs).reshape(outputs.shape)
