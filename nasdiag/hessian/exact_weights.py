"""Exact diagonal Hessians of weights: the reference the recursions are measured against.

Two routes, both exact to round-off:

* :func:`chain_exact_diag` (bayesnas-appendix C.1.2-C.1.3, Botev et al. 2017): for a chain of
  ``nn.Linear`` and elementwise activations, the *full* per-sample pre-activation Hessian is carried
  back, ``H_i = B_i Wᵀ H_j W B_i + D_i``, and each weight's diagonal is ``Σ_n a_n² ⊗ diag(H_{j,n})``
  (the diagonal of C.1.2's ``a aᵀ ⊗ H``). Memory O(N·D²) for the widest layer D.
* :func:`hvp_exact_diag`: any model (convolutions, BatchNorm through its batch statistics, DAGs): one
  Hessian-vector product per parameter entry, ``H e_i``, batched through one retained graph. Cost
  grows with the number of parameters, so it is for small nets and for tests.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch import nn

from nasdiag.hessian._hvp import (HessianVectorProduct, SavedBytes, _memory_budget, check_probe_memory, fit_chunk,
                                  functional_forward, preserved_buffers, scalar_loss)
from nasdiag.hessian.loss_curvature import output_hessian_blocks
from nasdiag.hessian.rules import ModuleCall, rule_for
from nasdiag.hessian.rules.elementwise import ElementwiseRule, IdentityRule, ReshapeRule

__all__ = ["ChainDoesNotApply", "chain_exact_diag", "chain_fits", "hvp_exact_diag", "as_linear_chain", "refuse_reentrant_checkpoint"]


class ChainDoesNotApply(ValueError):
    """The per-sample chain recursion cannot represent this call (a ``Linear`` on rows that are not (N, features));
    :func:`hvp_exact_diag` still gives the exact diagonal."""


_CHAIN_TYPES = (nn.Linear, nn.ReLU, nn.LeakyReLU, nn.Sigmoid, nn.Tanh, nn.Identity, nn.Flatten)


def as_linear_chain(model: nn.Module) -> Optional[List[tuple]]:
    """``[(qualified name, module), ...]`` in call order if ``model`` is a (nested) ``nn.Sequential`` of Linear
    layers and elementwise activations (a Flatten allowed before the first Linear), else None.

    A module object may sit at several places (one ``nn.Tanh()`` reused): it is listed at each, as
    ``nn.Sequential`` calls it (``named_children`` would list it once). A ``Linear`` at two places, or two
    ``Linear`` modules sharing a parameter (tied weights), is no chain: its diagonal has cross-call terms the
    per-layer recursion cannot hold. Nor is a layer that does not compute its type's plain function (a subclass with
    its own ``forward``, a pruned or parametrized weight, forward hooks: :func:`_plain`), nor a ``Sequential`` with a
    forward hook or pre-hook of its own (its layers are called one by one here, so the hook would never run)."""
    layers = _chain_layers(model)
    if layers is None:
        return None
    linears = [id(m) for _, m in layers if isinstance(m, nn.Linear)]
    if len(set(linears)) != len(linears):
        return None
    # the same holds of two Linear modules holding one Parameter (``l2.weight = l1.weight``)
    tensors = [id(p) for _, m in layers if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)]
    if len(set(tensors)) != len(tensors):
        return None
    seen_linear = False
    for _, m in layers:
        seen_linear |= isinstance(m, nn.Linear)
        if isinstance(m, nn.Flatten) and seen_linear:
            return None
    return layers if seen_linear else None


def _plain(module: nn.Module) -> bool:
    """Whether ``module`` computes exactly what its chain type computes: the type's own ``forward`` (a subclass
    that overrides it, a scaled or low-rank ``Linear``, does not), its own ``weight`` parameter (a pruned layer holds
    ``weight_orig`` and a forward pre-hook makes ``weight``; a parametrized one computes it in a child), and no forward
    hooks, which may change its input or output. The chain recursion reads the layer's weight and the activation's
    derivatives off the module, so anything else would give a silently wrong diagonal; the HVP route is exact for it."""
    from torch.nn.modules import module as _torch_module

    base = next(t for t in _CHAIN_TYPES if isinstance(module, t))
    if type(module).forward is not base.forward or next(module.children(), None) is not None:
        return False
    if module._forward_hooks or module._forward_pre_hooks or _torch_module._global_forward_hooks \
            or _torch_module._global_forward_pre_hooks:
        return False
    return not isinstance(module, nn.Linear) or isinstance(module._parameters.get("weight"), torch.Tensor)


def _chain_layers(model: nn.Module) -> Optional[List[tuple]]:
    if isinstance(model, _CHAIN_TYPES):
        return [("", model)] if _plain(model) else None
    if type(model) is not nn.Sequential or model._forward_hooks or model._forward_pre_hooks:
        return None  # a hook on a container changes what the layers inside it compute between them, or its output
    layers = []
    for name, child in model._modules.items():  # every place, as nn.Sequential.forward calls them
        sub = _chain_layers(child)
        if sub is None:
            return None
        layers.extend((f"{name}.{n}" if n else name, m) for n, m in sub)
    return layers


def chain_exact_diag(
    layers: List[tuple], loss_fn: Callable, inputs: torch.Tensor, targets, values: Dict[str, torch.Tensor]
) -> Dict[str, torch.Tensor]:
    """Exact diagonal Hessian of the chain's weights by the full pre-activation recursion (C.1.2-C.1.3).

    Args:
        layers: from :func:`as_linear_chain`.
        values: ``{qualified parameter name: value}`` to evaluate at and return.

    Returns:
        ``{name: diagonal}`` for the names in ``values``, of exactly the scalar ``loss_fn`` returns.

    Raises:
        UnsupportedModuleError: an activation whose rule refuses its configuration (an inplace ``LeakyReLU`` with
            a negative slope overwrites the input its derivative needs; torch's own backward refuses it too).
    """
    wanted = set(values)
    for name, m in layers:  # e.g. an inplace LeakyReLU with a negative slope: its input is gone, σ' unknowable
        if not isinstance(m, nn.Linear):
            rule_for(m).check(m, name)
    # forward with the requested values, keeping each layer's input and output
    records = []
    x = inputs
    with torch.enable_grad():
        for name, m in layers:
            params = {k: values.get(f"{name}.{k}" if name else k, p) for k, p in m.named_parameters(recurse=False)}
            if isinstance(m, nn.Linear) and x.dim() != 2:  # checked before the layer runs: nothing wasted
                raise ChainDoesNotApply(f"layer {name!r}: the chain recursion needs (N, features) inputs, got {tuple(x.shape)}")
            y = torch.func.functional_call(m, params, (x,))
            if not y.requires_grad:
                y = y.detach().requires_grad_(True)
            records.append((name, m, params, x, y))
            x = y
        outputs = x
        loss = scalar_loss(loss_fn, outputs, targets)
        grads = torch.autograd.grad(loss, [r[4] for r in records], retain_graph=True, allow_unused=True)
    H = output_hessian_blocks(loss_fn, outputs, targets)  # (N, D, D), full per-sample
    out: Dict[str, torch.Tensor] = {}
    remaining = set(wanted)
    for (name, m, params, x, y), g in zip(reversed(records), reversed(grads)):
        if not remaining:
            break
        x = x.detach()
        if isinstance(m, nn.Linear):
            W = params["weight"].detach()
            h_diag = torch.diagonal(H, dim1=1, dim2=2)  # (N, out)
            for attr, value in (("weight", h_diag.T @ x.square()), ("bias", h_diag.sum(0))):
                key = f"{name}.{attr}" if name else attr
                if key in wanted:
                    out[key] = value
                    remaining.discard(key)
            if not remaining:
                break  # the layers below are not asked for: their (N, D, D) Hessians are not needed
            H = W.T @ H @ W  # C.1.3 without the activation: the next layer's output Hessian
            continue
        rule = rule_for(m)
        if isinstance(rule, (IdentityRule, ReshapeRule)):
            continue  # Identity, or a Flatten before the first Linear (nothing requested below it)
        assert isinstance(rule, ElementwiseRule)
        d1, d2 = rule.derivatives(ModuleCall(name, m, x, y.detach()))
        H = d1[:, :, None] * H * d1[:, None, :]  # B W^T H W B of C.1.3
        if d2 is not None:
            H = H + torch.diag_embed(d2 * (torch.zeros_like(y) if g is None else g))  # + D
    return {k: out.get(k, torch.zeros_like(values[k])).detach() for k in values}


def chain_fits(layers: List[tuple], inputs: torch.Tensor) -> bool:
    """Whether the chain recursion's per-sample Hessians, ``(N, D, D)`` for the widest layer and two temporaries of
    that size, fit the memory cap of the exact modes (half the free memory on the device; ``_hvp.fit_chunk``).
    Where they do not, the Hessian-vector products give the same diagonal in O(chunk · params) memory: before, an
    (N, D, D) of 200 GB was asked of the allocator (its multi-line error, or the kernel's OOM killer)."""
    widths = [m.out_features for _, m in layers if isinstance(m, nn.Linear)]
    if inputs.dim() == 0 or not widths:
        return True
    budget, _ = _memory_budget(None, inputs.device)
    return budget is None or 3 * inputs.shape[0] * max(widths) ** 2 * inputs.element_size() <= budget


def refuse_reentrant_checkpoint(loss: torch.Tensor) -> None:
    """Refuse a graph holding a reentrant activation checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``).

    Its segment runs without a graph in the forward and is recomputed inside ``.backward()``, where the parameters it
    reads get their gradients; ``torch.autograd.grad`` w.r.t. them (every curvature route, with the values substituted
    by ``functional_call``) never reaches them, so their diagonals would come out as zeros, silently."""
    from nasdiag.hessian.modes import CurvatureRuntimeError

    if loss.grad_fn is None:
        return
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            raise CurvatureRuntimeError(
                "the model runs a block under torch.utils.checkpoint(..., use_reentrant=True), whose parameters "
                "torch.autograd.grad cannot reach (they get gradients only inside .backward()), so their curvature "
                "would come out as zeros; pass use_reentrant=False for the call (the same numbers, differentiable twice)"
            )
        stack.extend(n for n, _ in node.next_functions)


def _loss_hvp(model: nn.Module, loss_fn: Callable, inputs, targets, values: Dict[str, torch.Tensor]):
    """Products with the Hessian of the loss w.r.t. ``values`` (by name, in their order), from one forward with
    ``values`` substituted (``functional_call``); train-mode BatchNorm is differentiated through its batch
    statistics and its running statistics are left untouched."""
    names = list(values)
    leaves = {n: v.detach().clone().requires_grad_(True) for n, v in values.items()}
    with preserved_buffers(model), torch.enable_grad(), SavedBytes() as saved:
        outputs = functional_forward(model, leaves, inputs)
        loss = scalar_loss(loss_fn, outputs, targets)
    refuse_reentrant_checkpoint(loss)
    hvp = HessianVectorProduct(loss, [leaves[n] for n in names], names, context=lambda: preserved_buffers(model))
    hvp.saved_bytes = saved.bytes  # what a product's batched second backward multiplies (fit_chunk)
    return hvp


def _fitted_chunk(hvp: HessianVectorProduct, chunk_size: int, mode: str) -> int:
    """``chunk_size`` lowered so that a batch of products fits half the free memory (as the exact mixing-weight
    modes do): a fixed 32 products at once of a net whose forward saves 650 MiB is about 166 GB by that estimate, and
    the kernel's OOM killer ends such a process without a message. One product that does not fit is a one-line ``CurvatureError``."""
    return fit_chunk(hvp.saved_bytes, None, chunk_size, f"diag_hessian(mode={mode!r})", device=hvp.device,
                     instead="use mode='diag' or 'approx', or a smaller batch", settable=False)


@contextmanager
def _second_derivatives_of_torch(mode: str) -> Iterator[None]:
    """Products taken inside: torch's ``RuntimeError`` for an op of the model without a second derivative
    (``derivative for aten::hardsigmoid_backward is not implemented``, after the batched products' fallback warning)
    becomes one ``CurvatureRuntimeError`` line naming the op and the way out (the recursions, which need only σ')."""
    from nasdiag.hessian.modes import CurvatureRuntimeError

    try:
        yield
    except RuntimeError as err:
        first = str(err).splitlines()[0] if str(err) else ""
        if not (first.startswith("derivative for ") and first.endswith("is not implemented")):
            raise
        raise CurvatureRuntimeError(
            f"diag_hessian(mode={mode!r}) takes Hessian-vector products, and torch has no second derivative of an op "
            f"of the model ({first}); use mode='diag' or 'approx' (which need only its first derivative; a module of your "
            "own computing it takes rules={YourModule: ElementwiseRule(piecewise_linear=True)} if piecewise linear), "
            "or replace the op"
        ) from None


def hvp_exact_diag(
    model: nn.Module,
    loss_fn: Callable,
    inputs,
    targets,
    values: Dict[str, torch.Tensor],
    *,
    chunk_size: int = 32,
) -> Dict[str, torch.Tensor]:
    """Exact diagonal Hessian of ``values`` (by name) by ``Σ numel`` Hessian-vector products.

    Train-mode BatchNorm is differentiated through its batch statistics; running statistics are left
    untouched. ``values`` replace the model's tensors of those names (``functional_call``).
    """
    names = list(values)
    hvp = _loss_hvp(model, loss_fn, inputs, targets, values)
    chunk_size = _fitted_chunk(hvp, chunk_size, "exact")
    diag = torch.empty(hvp.dim, dtype=hvp.dtype, device=hvp.device)
    with _second_derivatives_of_torch("exact"):
        for start in range(0, hvp.dim, chunk_size):
            stop = min(start + chunk_size, hvp.dim)
            idx = torch.arange(start, stop, device=hvp.device)
            basis = torch.zeros(stop - start, hvp.dim, dtype=hvp.dtype, device=hvp.device)
            basis[idx - start, idx] = 1
            diag[start:stop] = hvp(basis)[idx - start, idx]
    return {n: part.view_as(values[n]) for n, part in zip(names, torch.split(diag, hvp.sizes))}


def hvp_hutchinson_diag(
    model: nn.Module,
    loss_fn: Callable,
    inputs,
    targets,
    values: Dict[str, torch.Tensor],
    probes: int,
    *,
    seed: int = 0,
    chunk_size: int = 32,
) -> Dict[str, torch.Tensor]:
    """Hutchinson's estimate ``(1/k) Σ_s ε_s ⊙ H ε_s`` of the diagonal Hessian of ``values`` (Bekas et al. 2007).

    ``k = probes`` Rademacher probes over all tensors at once (seeded by ``seed``, a CPU generator),
    products by second backwards through one retained graph (right through train-mode BatchNorm).
    Unbiased; entry i has variance ``Σ_{j≠i} H_ij² / k``. No control variate: nasdiag has no weight
    curvature with an exactly known diagonal and cheap products (the mixing weights have the GGN,
    :mod:`nasdiag.hessian.arch_hutchinson`).
    """
    names = list(values)
    hvp = _loss_hvp(model, loss_fn, inputs, targets, values)
    check_probe_memory(probes * hvp.dim * (8 + hvp.dtype.itemsize), None, hvp.device, f"diag_hessian(mode='hutchinson:{probes}')",
                       "lower k (k products over all weights; mode='exact' takes one per weight and is exact)", settable=False)
    chunk_size = _fitted_chunk(hvp, chunk_size, f"hutchinson:{probes}")
    generator = torch.Generator().manual_seed(int(seed))
    eps = torch.randint(0, 2, (probes, hvp.dim), generator=generator, dtype=torch.int64).mul_(2).sub_(1)
    eps = eps.to(dtype=hvp.dtype, device=hvp.device)
    total = torch.zeros(hvp.dim, dtype=hvp.dtype, device=hvp.device)
    with _second_derivatives_of_torch(f"hutchinson:{probes}"):
        for start in range(0, probes, chunk_size):
            block = eps[start : start + chunk_size]
            total += (block * hvp(block)).sum(0)
    diag = total / probes
    return {n: part.view_as(values[n]).detach() for n, part in zip(names, torch.split(diag, hvp.sizes))}
