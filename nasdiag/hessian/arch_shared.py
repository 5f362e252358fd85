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
from typing import Callable, Dict, Mapping, Optional

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

__all__ = ["alpha_diag_hessian", "shared_weights_diag_hessian"]


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
    return _exact_parameter_diag(model, loss_fn, inputs, targets, [(by_id[id(p)], p) for _, p in pairs],
                                 chunk_size, max_memory, "alpha_diag_hessian")


def _exact_parameter_diag(model, loss_fn, inputs, targets, pairs, chunk_size, max_memory, what) -> Dict[str, torch.Tensor]:
    """``{name: diag}`` for ``pairs = [(name in model, parameter)]``; ``what`` names the caller in errors."""
    names = [n for n, _ in pairs]
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
        chunk_size = fit_chunk(saved.bytes, max_memory, chunk_size, what, device=primal.device)
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


def shared_weights_diag_hessian(
    network: nn.Module,
    loss_fn: Callable,
    inputs,
    targets,
    weights: Mapping[str, torch.Tensor],
    *,
    chunk_size: int = 64,
    max_memory: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """Exact ``diag ∂²L/∂Z²`` for mixing weights Z that several cells share, cross-cell terms included.

    The loss is ``loss_fn(network(inputs, weights), targets)`` with ``weights = {group: Z_group}`` (nasdiag's
    ``Network``: ``{cell type: (E, K)}``, every cell of a type mixing its edges with the same Z). Each
    ``Z_group[e, k]`` enters every cell of the group, so ``∂²L/∂Z_{e,k}²`` is the sum over cell *pairs*
    ``Σ_{c,c'} ∂²L/∂Z^{(c)}_{e,k}∂Z^{(c')}_{e,k}``; the per-edge route (``arch_diag_hessian(...,
    mode="exact_per_edge")`` summed over the cells) keeps only ``c = c'`` (33% off on the reduce cells of a
    3-cell net). Same route as :func:`alpha_diag_hessian` (forward-over-reverse over chunks of basis vectors,
    train-mode BatchNorm on its batch statistics, buffers untouched), with Z in place of α.

    Args:
        network: called as ``network(inputs, weights)`` (``network(*inputs, weights)`` for a tuple).
        loss_fn, inputs, targets, chunk_size, max_memory: as :func:`alpha_diag_hessian`.
        weights: ``{group: tensor}``, the point at which the curvature is taken (values only: not modified,
            no gradient flows to them).

    Returns:
        ``{group: tensor shaped like weights[group]}``, detached, in the loss's dtype.
    """
    if not isinstance(weights, Mapping) or not weights or not all(isinstance(w, torch.Tensor) for w in weights.values()):
        raise CurvatureError("shared_weights_diag_hessian: weights must be a non-empty {group: tensor} mapping, "
                             f"got {type(weights).__name__}")
    at = _AtWeights(network, weights)
    pairs = [(f"weights.{group}", at.weights[group]) for group in weights]
    diag = _exact_parameter_diag(at, loss_fn, inputs, targets, pairs, chunk_size, max_memory, "shared_weights_diag_hessian")
    return {group: diag[f"weights.{group}"] for group in weights}


class _AtWeights(nn.Module):
    """``network`` with its mixing weights held as parameters, so that they can be differentiated by name."""

    def __init__(self, network: nn.Module, weights: Mapping[str, torch.Tensor]):
        super().__init__()
        self.network = network
        self.weights = nn.ParameterDict({g: nn.Parameter(w.detach().clone()) for g, w in weights.items()})

    def forward(self, *inputs):
        return self.network(*inputs, dict(self.weights))


def _as_args(inputs):
    return inputs if isinstance(inputs, tuple) else (inputs,)
