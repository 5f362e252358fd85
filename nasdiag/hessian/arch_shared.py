"""Exact diagonal of the Hessian w.r.t. architecture parameters shared by several cells (DARTS's α).

DARTS shares one α (E, K) per cell type: every cell of the type mixes its edges with softmax(α). Then
``∂²L/∂α_{e,k}²`` has, besides the per-cell terms that the per-edge route (``exact_per_edge``) sums,
the cross-cell terms ``Σ_{c≠c'} ∂²L/∂α^{(c)}_{e,k}∂α^{(c')}_{e,k}``; on a 3-cell net leaving them out is
25% off. Here the Hessian-vector products are taken w.r.t. α itself, so nothing is dropped.

Route. ``vmap(jvp(grad(L)))`` (forward-over-reverse, :func:`~nasdiag.hessian._hvp.functional_hvp`) over
chunks of basis vectors, with the model called by ``torch.func.functional_call`` and train-mode
BatchNorm normalizing with the batch statistics (buffers untouched). Forward-over-reverse is right
through ``F.batch_norm(training=True)``; in torch 2.13 on CPU ``torch.func.hessian`` and
``jacrev(jacrev)`` are not (their mixed second derivatives through it come out asymmetric), so neither
this module nor its tests use them (docs/hessian.md).
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional

import torch
from torch import nn

from nasdiag.hessian._hvp import (
    HessianVectorProduct,
    SavedBytes,
    batch_statistics_only,
    call_model,
    exact_diagonal,
    fit_chunk,
    functional_hvp,
    named_tensors,
    preserved_buffers,
    scalar_loss,
)
from nasdiag.hessian.modes import CurvatureError

__all__ = ["alpha_diag_hessian"]


def alpha_diag_hessian(
    model: nn.Module,
    loss_fn: Callable,
    inputs,
    targets,
    params=None,
    *,
    chunk_size: int = 64,
    max_memory: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """Exact ``diag ∂²L/∂θ²`` for θ = the model's architecture parameters (shared α included).

    Args:
        model: ``model(inputs)`` computes the loss's outputs from the parameters ``params`` (for nasdiag's
            ``Network``: its default forward, Z = softmax(α) per cell type, shared by the cells of a type).
        loss_fn: ``loss_fn(outputs, targets) -> scalar``; the Hessian is of exactly that scalar (mean
            reduction: of the batch mean).
        inputs, targets: one mini-batch.
        params: parameters of ``model`` (tensors, ``(name, tensor)`` pairs or ``{name: tensor}``); default
            ``model.named_arch_parameters()``.
        chunk_size: basis vectors per vmapped product.
        max_memory: bytes one chunk may use (estimated from the forward's saved tensors; default: half the
            memory free on the device at the call); a model whose
            single product does not fit is refused with the estimate and what to use instead.

    Returns:
        ``{name: tensor shaped like the parameter}``, detached, in the loss's dtype.

    Raises:
        CurvatureError: a parameter that is not one of ``model``'s, or a net too large for ``max_memory``.
    """
    pairs = named_tensors(params, default_owner=model)
    by_id = {id(p): n for n, p in model.named_parameters()}
    missing = [n for n, p in pairs if id(p) not in by_id]
    if missing:
        raise CurvatureError(f"alpha_diag_hessian: {missing} are not parameters of the model; pass the model's own α")
    names = [by_id[id(p)] for _, p in pairs]
    shapes = [p.shape for _, p in pairs]
    sizes = [p.numel() for _, p in pairs]
    primal = torch.cat([p.detach().reshape(-1) for _, p in pairs])

    def loss_of(flat):
        values = {n: part.view(shape) for n, part, shape in zip(names, torch.split(flat, sizes), shapes)}
        return scalar_loss(loss_fn, torch.func.functional_call(model, values, _as_args(inputs)), targets)

    with preserved_buffers(model), torch.enable_grad():
        with SavedBytes() as saved:
            loss = scalar_loss(loss_fn, call_model(model, inputs), targets)
        del loss
        chunk_size = fit_chunk(saved.bytes, max_memory, chunk_size, "alpha_diag_hessian", device=primal.device)
        columns = functional_hvp(loss_of, primal)

        def products(V):
            with batch_statistics_only(model):
                return columns(V)

        try:
            diag = exact_diagonal(products, primal.numel(), primal.dtype, primal.device, chunk_size)
        except (RuntimeError, NotImplementedError, TypeError) as err:  # TypeError: a forward that breaks under vmap
            if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err):
                raise
            warnings.warn(
                f"torch.func could not trace the model ({type(err).__name__}: {str(err)[:200]}); using second "
                "backwards through a retained graph instead (same numbers, slower)",
                RuntimeWarning,
                stacklevel=2,
            )
            loss = scalar_loss(loss_fn, call_model(model, inputs), targets)
            hvp = HessianVectorProduct(loss, [p for _, p in pairs], names)
            diag = exact_diagonal(hvp, hvp.dim, hvp.dtype, hvp.device, chunk_size)
    return {n: part.reshape(shape).detach() for n, part, shape in zip(names, torch.split(diag, sizes), shapes)}


def _as_args(inputs):
    return inputs if isinstance(inputs, tuple) else (inputs,)
