"""Exact diagonal of the Hessian w.r.t. architecture parameters shared by several cells (DARTS's α).

DARTS shares one α (E, K) per cell type: every cell of the type mixes its edges with softmax(α). Then
``∂²L/∂α_{e,k}²`` has, besides the per-cell terms that the per-edge route (``exact_per_edge``) sums,
the cross-cell terms ``Σ_{c≠c'} ∂²L/∂α^{(c)}_{e,k}∂α^{(c')}_{e,k}``; leaving them out is net-dependent, 24-80% off
on the 3-cell nets of docs/hessian.md. Here the Hessian-vector products are taken w.r.t. α itself, so nothing is dropped.

Route. ``vmap(jvp(grad(L)))`` (forward-over-reverse, :func:`~nasdiag.hessian._hvp.functional_hvp`) over
chunks of basis vectors, with the model called by ``torch.func.functional_call`` and train-mode
BatchNorm normalizing with the batch statistics (buffers untouched). Forward-over-reverse is right
through ``F.batch_norm(training=True)``; in torch 2.13 on CPU ``torch.func.hessian`` and
``jacrev(jacrev)`` are not (their mixed second derivatives through it come out asymmetric), so neither
this module nor its tests use them (docs/hessian.md).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Callable, Dict, Mapping, Optional

import torch
from torch import nn

from nasdiag.hessian._hvp import (
    HessianVectorProduct,
    INSTEAD_OF_EXACT,
    SavedBytes,
    batch_statistics_only,
    call_model,
    exact_diagonal,
    fit_chunk,
    forward_failures_explained,
    functional_hvp,
    named_tensors,
    preserved_buffers,
    random_state,
    scalar_loss,
    set_random_state,
)
from nasdiag.hessian.modes import CurvatureError, CurvatureTypeError
from nasdiag.hessian.weights import _in_dtypes_of, _outputs_only, _refuse_empty_batch

__all__ = ["alpha_diag_hessian", "shared_weights_diag_hessian"]

#: what to use when one exact product of the shared diagonal does not fit the memory allowed (the arch modes'
#: ``mode='ggn_mc'`` is not an argument of these functions, and per edge it drops the cross-cell terms)
INSTEAD_OF_SHARED_ALPHA = (
    "for this shared-α diagonal use nasdiag.hessian.hutchinson_diagonal(model, loss_fn, inputs, targets, params, "
    "batch_size=1) (unbiased, one product at a time through one retained graph), the per-edge "
    "arch_diag_hessian(..., mode='ggn_mc', wrt='alpha') (cross-cell terms dropped), a smaller batch, or raise max_memory"
)
INSTEAD_OF_SHARED_Z = (
    "for this shared-Z diagonal use the per-edge arch_diag_hessian(..., mode='ggn_mc') summed over the cells "
    "(cross-cell terms dropped; nasdiag search --hessian-mode ggn_mc), a smaller batch, or raise max_memory"
)


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
        ``{name: tensor shaped like the parameter}`` keyed by the model's own parameter names
        (``model.named_parameters()``, e.g. ``"alphas.normal"``), whatever names ``params`` gave; detached, in the
        parameters' dtype.

    Raises:
        CurvatureError: a parameter that is not one of ``model``'s, a ``loss_fn`` that reads a requested parameter
            itself besides the outputs (a penalty on α written into it, whose curvature would be left out), or a net
            too large for ``max_memory`` (naming the estimated size and what to use instead).

    Warns:
        RuntimeWarning: naming the rows (edges) of a parameter whose gradient and diagonal are both exactly zero,
            e.g. an edge that runs but whose output the loss does not use (as :func:`arch_diag_hessian` warns).
    """
    pairs = named_tensors(params, default_owner=model)
    by_id = {id(p): n for n, p in model.named_parameters()}
    missing = [n for n, p in pairs if id(p) not in by_id]
    if missing:
        raise CurvatureError(f"alpha_diag_hessian: {missing} are not parameters of the model; pass the model's own α")
    # a penalty on α written into loss_fn reads the real α, not the values the products substitute: refused, not dropped
    loss_fn = _outputs_only(loss_fn, model, {by_id[id(p)]: p for _, p in pairs}, "alpha_diag_hessian")
    return _exact_parameter_diag(model, loss_fn, inputs, targets, [(by_id[id(p)], p) for _, p in pairs],
                                 chunk_size, max_memory, "alpha_diag_hessian", INSTEAD_OF_SHARED_ALPHA)


def _exact_parameter_diag(model, loss_fn, inputs, targets, pairs, chunk_size, max_memory, what,
                          instead=INSTEAD_OF_EXACT, labels=None) -> Dict[str, torch.Tensor]:
    """``{name: diag}`` for ``pairs = [(name in model, parameter)]``; ``what`` names the caller in errors,
    ``instead`` says what to use when one product does not fit, ``labels`` ``{name: what the warnings call it}``."""
    _refuse_empty_batch(inputs)  # its mean loss is NaN, but no output entry carries that into the products (zeros)
    names = [n for n, _ in pairs]
    shapes = [p.shape for _, p in pairs]
    sizes = [p.numel() for _, p in pairs]
    primal = torch.cat([p.detach().reshape(-1) for _, p in pairs])

    def loss_of(flat):
        values = {n: part.view(shape) for n, part, shape in zip(names, torch.split(flat, sizes), shapes)}
        return scalar_loss(loss_fn, torch.func.functional_call(model, values, _as_args(inputs)), targets)

    with preserved_buffers(model), torch.enable_grad():
        drawn = random_state()  # a fallback's forward draws this one's dropout masks: the products are of one net
        # at copies of the parameters, as the products: a loss_fn reading the real ones itself (a penalty on α) is
        # told from one reading features the forward stored (computed from the copies, as the products' are)
        wrt = [p.detach().requires_grad_(True) for _, p in pairs]
        with SavedBytes() as saved:
            with forward_failures_explained(model, inputs):
                outputs = torch.func.functional_call(model, dict(zip(names, wrt)), _as_args(inputs))
            loss = scalar_loss(loss_fn, outputs, targets)
            del outputs
        # the gradient, to tell the entries the loss does not use (exact zeros of both gradient and curvature)
        grads = (torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else [None] * len(wrt))
        del loss
        chunk_size = fit_chunk(saved.bytes, max_memory, chunk_size, what, device=primal.device, instead=instead)
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
                f"torch.func products are not usable for this model ({type(err).__name__}: {str(err)[:200]}); using "
                "second backwards through a retained graph instead (right numbers, slower)",
                RuntimeWarning,
                stacklevel=2,
            )
            set_random_state(drawn)
            loss = scalar_loss(loss_fn, call_model(model, inputs), targets)
            hvp = HessianVectorProduct(loss, [p for _, p in pairs], names)
            diag = exact_diagonal(hvp, hvp.dim, hvp.dtype, hvp.device, chunk_size)
    # in the parameters' dtypes, as documented (the fallback's products are in the loss's: float32 under a loss
    # computed in float32 on float64 outputs)
    out = _in_dtypes_of(dict(pairs), {n: part.reshape(shape).detach() for n, part, shape in zip(names, torch.split(diag, sizes), shapes)})
    shown = {n: (labels or {}).get(n, n) for n in names}
    _warn_unused(what, {shown[n]: h for n, h in out.items()}, {shown[n]: g for n, g in zip(names, grads)})
    return out


def _warn_unused(what: str, diag: Dict[str, torch.Tensor], grads: Dict[str, Optional[torch.Tensor]]) -> None:
    """One ``RuntimeWarning`` naming the rows (edges, along dim 0) of each parameter whose gradient and diagonal
    are both exactly zero: the loss does not use them (an edge that runs but whose output is dropped), so
    their zeros are not a flat loss. A NaN is neither zero nor hidden: it stays in the result."""
    unused = []
    for name, h in diag.items():
        g = grads[name]
        silent = (h == 0) if g is None else (h == 0) & (g.detach() == 0)
        if h.dim() == 0 or bool(silent.all()):
            if bool(silent.all()):
                unused.append(f"{name} (all of it)")
            continue
        rows = silent.reshape(h.shape[0], -1).all(1).nonzero().reshape(-1).tolist()
        if rows:
            unused.append(f"{name} rows {rows}")
    if unused:
        warnings.warn(
            f"{what}: the loss does not depend on {', '.join(unused)} (gradient and curvature exactly zero: an edge "
            "whose output is unused?); reported as zeros",
            RuntimeWarning,
            stacklevel=4,  # the caller of alpha_diag_hessian / shared_weights_diag_hessian
        )


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
        ``{group: tensor shaped like weights[group]}``, detached, in the dtype of ``weights[group]`` (the products are
        taken w.r.t. the weights as given: pass them in the network's dtype for its precision).
    """
    if not isinstance(weights, Mapping) or not weights or not all(isinstance(w, torch.Tensor) for w in weights.values()):
        raise CurvatureError("shared_weights_diag_hessian: weights must be a non-empty {group: tensor} mapping, "
                             f"got {type(weights).__name__}")
    _check_takes_weights(network, inputs, weights)
    at = _AtWeights(network, weights)
    pairs = [(f"weights.{i}", p) for i, p in enumerate(at.weights)]
    try:
        diag = _exact_parameter_diag(at, loss_fn, inputs, targets, pairs, chunk_size, max_memory,
                                     "shared_weights_diag_hessian", INSTEAD_OF_SHARED_Z,
                                     labels={f"weights.{i}": f"weights[{group!r}]" for i, group in enumerate(weights)})
    except KeyError as err:  # the network looked up a group the mapping lacks: its bare KeyError named neither side
        missing = err.args[0] if len(err.args) == 1 else None
        if isinstance(missing, str) and missing not in weights:
            raise CurvatureError(
                f"shared_weights_diag_hessian: network(inputs, weights) looked up weights[{missing!r}], but weights has "
                f"keys {list(weights)}; pass {{group: Z}} keyed as the network reads them (it expects {missing!r})"
            ) from err
        raise
    return {group: diag[f"weights.{i}"] for i, group in enumerate(weights)}


def _check_takes_weights(network: nn.Module, inputs, weights) -> None:
    """A one-line :class:`CurvatureTypeError` if ``network.forward`` cannot be called as ``(*inputs, weights)`` (the
    model's own TypeError, raised from inside the products, would not say what this function needs)."""
    try:
        signature = inspect.signature(network.forward)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself will tell
        return
    try:
        signature.bind(*_as_args(inputs), dict(weights))
    except TypeError as err:
        raise CurvatureTypeError(
            f"shared_weights_diag_hessian calls network(inputs, weights) with weights = {{group: Z}} ({list(weights)}), "
            f"but {type(network).__name__}.forward{signature} does not take them ({err}); give the network a weights "
            "argument, or use alpha_diag_hessian (α inside the model) or arch_diag_hessian(mode='exact') per edge"
        ) from None


class _AtWeights(nn.Module):
    """``network`` with its mixing weights held as parameters, so that they can be differentiated by name."""

    def __init__(self, network: nn.Module, weights: Mapping[str, torch.Tensor]):
        super().__init__()
        self.network = network
        # held by position: a group key is whatever the network looks up (an int, "cell.0"), not always a name that a
        # ParameterDict takes (it raised torch's TypeError/KeyError on those)
        self.groups = list(weights)
        self.weights = nn.ParameterList([nn.Parameter(w.detach().clone()) for w in weights.values()])

    def forward(self, *inputs):
        return self.network(*inputs, dict(zip(self.groups, self.weights)))


def _as_args(inputs):
    return inputs if isinstance(inputs, tuple) else (inputs,)
