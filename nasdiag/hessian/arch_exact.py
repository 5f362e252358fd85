"""Exact curvature of the mixing weights Z (and α) of every edge, by Hessian-vector products.

Issue 4 §2, mode ``exact``: the reference that the BayesNAS approximation (bayesnas-appendix C.3.1-C.3.2,
``H ≈ E(Σ B_i² H_j)``) is measured against.

What can be batched, and what cannot. Stack the mixing weights of all edges into one vector
``z = (Z_{e,k})`` of length ``N = Σ_e K_e``. The wanted numbers are the diagonal ``H_{ii}`` of the
``N × N`` Hessian ``H = ∂²L/∂z²``. One HVP with a sum of basis vectors, e.g. ``v = Σ_e e_{(e,k)}`` (one
op index on every edge), returns ``(Hv)_{(e,k)} = H_{(e,k),(e,k)} + Σ_{e'≠e} H_{(e,k),(e',k)}``; the
cross-edge terms do not vanish (two edges interact through every node downstream of both and through
the loss's own curvature), so that is not the diagonal. Nor does any other sparsity pattern help in
general: ``H_{(e,k),(e',k')} = B_{e,k}ᵀ (∂²L/∂x_j∂x_{j'}) B_{e',k'} + [first-order terms when one edge
feeds the other]``, dense in (e, e') for a DAG that ends in one loss. So the exact diagonal costs one
HVP per entry, N in all, and what *can* be batched is the N independent products ``H e_i``:
they run as stacked second backwards (``vmap`` over the backward, ``chunk_size`` at a time) through one
retained forward/backward graph. Each ``H e_i`` is a full column of H, so the within-edge K × K block
that the chain rule to α needs comes for free.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Mapping, Sequence, Tuple

import torch
from torch import nn

from nasdiag.hessian._hvp import HessianVectorProduct, Inputs, call_model, preserved_buffers, scalar_loss

__all__ = ["exact_arch_diag_hessian", "softmax_chain_diag"]

_WRT = ("Z", "alpha")


def exact_arch_diag_hessian(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: Inputs,
    targets,
    edges: Mapping[str, object],
    wrt: str = "Z",
    *,
    chunk_size: int = 64,
) -> Dict[str, torch.Tensor]:
    """Exact diagonal of the Hessian of the loss w.r.t. each edge's mixing weights.

    For edge e with mixing weights ``Z_e = (Z_{e,1}, ..., Z_{e,K})`` (``out = Σ_k Z_{e,k} O_k(x)``),
    returns ``∂²L/∂Z_{e,k}²`` for k = 1..K, with every other edge's weights held fixed: the diagonal of
    the full Hessian over all edges' Z, each edge having its own Z (a leaf per cell, not shared across
    cells). Issue 4 §2 ``exact``; compare BayesNAS appendix C.3.1-C.3.2 for the approximation.

    How: a forward pre-hook on each mixed op replaces its weights ``Z_e`` by ``Z_e + δ_e`` with ``δ_e``
    a zero leaf, so ``∂L/∂δ_e = ∂L/∂Z_e`` and ``∂²L/∂δ_e² = ∂²L/∂Z_e²``; then N = Σ_e K_e exact
    Hessian-vector products ``H e_i`` through one retained graph give the diagonal (see the module
    docstring for why they cannot be merged into fewer). Hooks are removed on every path.

    Args:
        model: the supernet; ``model(inputs)`` (``model(*inputs)`` for a tuple) returns the outputs.
            Train-mode BatchNorm normalizes with the batch statistics and is differentiated through
            them (exact); its running statistics are restored afterwards.
        loss_fn: ``loss_fn(outputs, targets) -> scalar``. The Hessian is the one of exactly this
            scalar: with ``reduction="mean"`` (the nasdiag default) it is the Hessian of the batch mean,
            with ``"sum"`` B times that.
        inputs, targets: one mini-batch.
        edges: ``{edge name: (mixed_op_module, [candidate op modules])}`` (or any value with ``.module``
            and ``.ops``, e.g. ``Network.edge_specs()`` items). The mixed op's forward must be
            ``(x, weights) -> Σ_k weights[..., k] * ops[k](x)`` with ``weights`` the second positional
            argument or the ``weights=`` keyword, shape ``(K,)`` or ``(B, K)``.
        wrt: ``"Z"`` for ``∂²L/∂Z_{e,k}²``; ``"alpha"`` for ``∂²L/∂α_{e,k}²`` with ``Z_e = softmax(α_e)``
            (temperature 1), see :func:`softmax_chain_diag`. The α result is exact for an edge that owns
            its α. When α is shared by several cells (DARTS shares one (E, K) α per cell type) the
            total ``∂²L/∂α_{e,k}²`` also has cross-cell terms ``Σ_{c≠c'} ∂²L/∂α^{(c)}∂α^{(c')}``; they are
            NOT included, so summing these per-cell numbers over cells gives only the block-diagonal
            part of the shared-α curvature.
        chunk_size: Hessian-vector products per vmapped second backward; memory grows with it.

    Returns:
        ``{edge name: tensor (K,)}`` in the loss's dtype and device, in the order of ``edges``.
        With ``(B, K)`` per-sample weights, δ_e is still one ``(K,)`` shift shared by the batch, so the
        entry is ``Σ_{b,b'} ∂²L/∂Z_{b,k}∂Z_{b',k}`` (``wrt="alpha"`` needs ``(K,)`` weights).

    Raises:
        ValueError: ``wrt`` unknown; an edge module not in ``model``; a module listed twice; a mixed op
            that never ran in the forward, or ran without weights of shape (..., K); ``wrt="alpha"`` on
            weights that are not a probability vector.

    An edge that ran but does not influence the loss gets zeros and a ``RuntimeWarning`` naming it.
    """
    if wrt not in _WRT:
        raise ValueError(f"wrt must be one of {_WRT}, got {wrt!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    names, modules, n_ops = _resolve_edges(model, edges)

    deltas: Dict[str, torch.Tensor] = {}
    observed: Dict[str, List[torch.Tensor]] = {name: [] for name in names}
    handles = []
    try:
        for name, module, K in zip(names, modules, n_ops):
            handles.append(
                module.register_forward_pre_hook(_shift_weights(name, K, deltas, observed), with_kwargs=True)
            )
        with preserved_buffers(model):
            loss = scalar_loss(loss_fn, call_model(model, inputs), targets)
    finally:
        for handle in handles:
            handle.remove()

    never_ran = [name for name in names if not observed[name]]
    if never_ran:
        raise ValueError(
            f"mixed op(s) {never_ran} never ran in the forward pass, so their curvature is undefined; "
            "pass only edges that model(inputs) actually uses"
        )
    if wrt == "alpha":
        _check_softmax_weights(observed)

    hvp = HessianVectorProduct(loss, [deltas[n] for n in names], names)
    if hvp.unused:
        warnings.warn(
            f"the loss does not depend on edge(s) {hvp.unused}: their curvature is reported as zeros",
            RuntimeWarning,
            stacklevel=2,
        )
    blocks = _edge_blocks(hvp, n_ops, chunk_size)
    grads = torch.split(hvp.gradient.detach(), n_ops)

    out: Dict[str, torch.Tensor] = {}
    for name, block, grad in zip(names, blocks, grads):
        if wrt == "Z":
            out[name] = torch.diagonal(block).clone()
        else:
            out[name] = softmax_chain_diag(observed[name][0].to(block.dtype), grad, block)
    return out


def softmax_chain_diag(z: torch.Tensor, grad_z: torch.Tensor, hess_z: torch.Tensor) -> torch.Tensor:
    """``∂²L/∂α_k²`` from the derivatives w.r.t. ``z = softmax(α)``.

    With ``J = ∂z/∂α = diag(z) − z zᵀ`` (symmetric) and ``∂²z_i/∂α_k² = z_i (δ_ik − z_k)² − z_i z_k (1 − z_k)``:

        ∂²L/∂α_k² = (J H J)_kk + Σ_i g_i ∂²z_i/∂α_k²

    Args:
        z: (K,) probability vector, the softmax of the edge's α.
        grad_z: (K,) ``g = ∂L/∂z``.
        hess_z: (K, K) ``H = ∂²L/∂z²`` (the edge's own block).

    Returns:
        (K,) in the dtype of ``hess_z``.
    """
    jac = torch.diag(z) - torch.outer(z, z)
    curvature = torch.diagonal(jac @ hess_z @ jac)
    eye = torch.eye(z.numel(), dtype=z.dtype, device=z.device)
    # second[i, k] = ∂²z_i/∂α_k²
    second = z[:, None] * (eye - z[None, :]) ** 2 - z[:, None] * (z * (1 - z))[None, :]
    return curvature + grad_z @ second


def _resolve_edges(model: nn.Module, edges: Mapping[str, object]) -> Tuple[List[str], List[nn.Module], List[int]]:
    if not isinstance(edges, Mapping) or not edges:
        raise ValueError(
            "edges must be a non-empty {edge name: (mixed_op_module, [candidate ops])} mapping, "
            f"got {type(edges).__name__}"
        )
    in_model = {id(m) for m in model.modules()}
    names, modules, n_ops, seen = [], [], [], {}
    for name, value in edges.items():
        if isinstance(value, (tuple, list)) and len(value) == 2:
            module, ops = value
        elif hasattr(value, "module") and hasattr(value, "ops"):
            module, ops = value.module, value.ops
        else:
            raise ValueError(
                f"edges[{name!r}] must be (mixed_op_module, [candidate op modules]), got {type(value).__name__}"
            )
        if not isinstance(module, nn.Module):
            raise ValueError(f"edges[{name!r}]: the mixed op must be an nn.Module, got {type(module).__name__}")
        if id(module) not in in_model:
            raise ValueError(
                f"edges[{name!r}]: module {type(module).__name__} is not a submodule of the model; "
                "pass the mixed-op modules of this model instance (e.g. from model.edge_specs())"
            )
        if id(module) in seen:
            raise ValueError(f"edges[{name!r}] and edges[{seen[id(module)]!r}] are the same module; list each edge once")
        seen[id(module)] = name
        K = len(ops)
        if K < 1:
            raise ValueError(f"edges[{name!r}] has no candidate ops")
        names.append(str(name))
        modules.append(module)
        n_ops.append(K)
    return names, modules, n_ops


def _shift_weights(name: str, K: int, deltas: Dict[str, torch.Tensor], observed: Dict[str, List[torch.Tensor]]):
    """Forward pre-hook: ``weights -> weights + δ`` with δ a (K,) zero leaf, created at the first call
    (so it takes the weights' dtype and device) and reused if the module runs again (tied Z)."""

    def hook(module, args, kwargs):
        if "weights" in kwargs:
            weights = kwargs["weights"]
        elif len(args) >= 2:
            weights = args[1]
        else:
            raise ValueError(
                f"edge {name!r}: the mixed op was called without mixing weights (expected forward(x, weights) "
                "with weights as the second positional argument or weights=)"
            )
        if not isinstance(weights, torch.Tensor) or weights.dim() not in (1, 2) or weights.shape[-1] != K:
            shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise ValueError(f"edge {name!r}: mixing weights must have shape (K,) or (B, K) with K={K}, got {shape}")
        if name not in deltas:
            deltas[name] = torch.zeros(K, dtype=weights.dtype, device=weights.device, requires_grad=True)
        observed[name].append(weights.detach())
        shifted = weights + deltas[name]
        if "weights" in kwargs:
            return args, {**kwargs, "weights": shifted}
        return (args[0], shifted, *args[2:]), kwargs

    return hook


def _check_softmax_weights(observed: Dict[str, List[torch.Tensor]]) -> None:
    for name, calls in observed.items():
        z = calls[0]
        if z.dim() != 1:
            raise ValueError(
                f"edge {name!r}: wrt='alpha' needs (K,) weights softmax(α_e), got per-sample weights "
                f"{tuple(z.shape)}; use wrt='Z'"
            )
        if any(c.shape != z.shape or not torch.equal(c, z) for c in calls[1:]):
            raise ValueError(f"edge {name!r} ran {len(calls)} times with different weights; wrt='alpha' needs one Z per edge")
        tol = 1e3 * torch.finfo(z.dtype).eps
        if bool((z < 0).any()) or abs(float(z.sum()) - 1.0) > tol:
            raise ValueError(
                f"edge {name!r}: wrt='alpha' assumes Z = softmax(α) but the weights {z.tolist()} are not a "
                "probability vector; use wrt='Z' (or chain through your own map)"
            )


def _edge_blocks(hvp: HessianVectorProduct, n_ops: Sequence[int], chunk_size: int) -> List[torch.Tensor]:
    """The K_e × K_e diagonal blocks of the Hessian, from the N columns ``H e_i``, ``chunk_size`` at a time."""
    N = hvp.dim
    offsets = torch.cumsum(torch.tensor([0, *n_ops[:-1]]), 0)
    edge_of = torch.repeat_interleave(torch.arange(len(n_ops)), torch.tensor(n_ops))
    k_max = max(n_ops)
    # cols[i, :] = columns of the block of the edge that owns row i (padded past K_e, masked later)
    cols = (offsets[edge_of][:, None] + torch.arange(k_max)[None, :]).clamp_(max=N - 1)
    rows = torch.empty(N, k_max, dtype=hvp.dtype, device=hvp.device)
    eye = torch.eye(N, dtype=hvp.dtype, device=hvp.device)
    for start in range(0, N, chunk_size):
        stop = min(start + chunk_size, N)
        products = hvp(eye[start:stop])  # (c, N): row i is (H e_i)ᵀ, H symmetric
        rows[start:stop] = torch.gather(products, 1, cols[start:stop].to(hvp.device))
    return [rows[o : o + K, :K] for o, K in zip(offsets.tolist(), n_ops)]
