"""Hutchinson's diagonal of the mixing-weight Hessian, probed per edge, with the Gauss-Newton matrix as control variate.

Mode ``"hutchinson:<k>"`` of :func:`~nasdiag.hessian.arch_diag_hessian`. Stack the mixing weights of all
edges into one vector z (length N = Σ_e K_e, as in :mod:`nasdiag.hessian.arch_exact`) and let
H = ∂²L/∂z². For Rademacher probes ε (E[ε εᵀ] = I), ``E[ε ⊙ A ε] = diag A`` for any fixed matrix A
(Bekas, Kokiopoulou & Saad 2007). With a matrix C whose diagonal is known exactly,

    d̂ = diag C + (1/k) Σ_{s=1..k} ε_s ⊙ (H ε_s − C ε_s)

is unbiased for diag H, and entry i of one probe has variance ``Σ_{j≠i} (H − C)_ij²`` instead of
``Σ_{j≠i} H_ij²``: the control variate removes the off-diagonal mass that C shares with H (the
control-variate form of deflation: Hutch++, Meyer et al. 2021; Diag++, Baston & Nakatsukasa 2022,
with C taken from the model rather than from a sketch of H).

C is the generalized Gauss-Newton matrix of :mod:`nasdiag.hessian.arch_ggn` in factored form
``C = Rᵀ R``: R stacks, over the D directions ``√λ_c u_c`` of each per-sample loss Hessian, the
per-sample rows ``∂/∂δ_n Σ_m ⟨v_m, f_m⟩`` (D batched backwards). So ``diag C`` is the ``ggn`` mode's
result and ``C v = Rᵀ(R v)`` costs two small matrix products.

Probed per edge. H − C is not small across edges: an edge feeds the edges downstream of it, and
``∂²L/∂Z_e∂Z_e'`` then has a first-order term ``⟨∂L/∂x, ∂O_{e'}/∂x · B_e⟩`` that no Gauss-Newton matrix
has. On the one-cell supernet of docs/hessian.md its norm is 15× that of diag H (eval-mode BN), and
probes spanning all edges (k HVPs) reach only ρ ≈ 0.4-0.5 at k = 16. So each probe ε_s is split into
one probe per edge, ε_s restricted to that edge's K entries: an entry then sees only the noise of its
own edge's K × K block of H − C. Cost: k·E products (E edges) against exact's N = Σ_e K_e, i.e. k/K of
``exact``: below K it is cheaper, from K on ``exact`` is cheaper and exact. With BatchNorm in eval mode
(or no normalization) and piecewise-linear ops, each edge block of C equals that of H and the estimate is
exact for any k (not with LayerNorm/GroupNorm/InstanceNorm: they couple no samples but are not linear, so
H − C keeps their residual); with train-mode BatchNorm the probes estimate the residual of the
downstream normalizations that C lacks (docs/hessian.md has the measurements).

The products come from :func:`~nasdiag.hessian.arch_exact.edge_hessian_products`: forward-over-reverse
``vmap(jvp(grad))`` over stacks of probes (right through train-mode BatchNorm in torch 2.13, unlike
``torch.func.hessian``/``jacrev∘jacrev``; docs/hessian.md), or reverse-over-reverse where the model
cannot be traced. Memory: as ``exact``, ``chunk_size`` products at once.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from nasdiag.hessian._hvp import check_probe_memory, random_state, set_random_state
from nasdiag.hessian.arch_exact import edge_hessian_products
from nasdiag.hessian.arch_ggn import ggn_factor_rows
from nasdiag.hessian.modes import CurvatureError

__all__ = ["CONTROLS", "hutchinson_arch_diag"]

#: control variates: the exact GGN (D backwards), its one-draw Monte-Carlo estimate, none (plain Hutchinson)
CONTROLS = ("ggn", "ggn_mc", "none")


def hutchinson_arch_diag(
    model: nn.Module,
    loss_fn: Callable,
    inputs,
    targets,
    specs: List,
    probes: int,
    *,
    control: str = "ggn",
    generator: Optional[torch.Generator] = None,
    chunk_size: int = 64,
    max_memory: Optional[int] = None,
    wrt: str = "Z",
    per_edge: bool = True,
    through_softmax: bool = False,
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor], Dict[str, torch.Tensor], Dict[str, List[torch.Tensor]]]:
    """Unbiased estimate of ``diag ∂²L/∂Z²`` per edge from ``probes`` Hessian-vector products (module docstring).

    Args:
        model, loss_fn, inputs, targets: as :func:`~nasdiag.hessian.arch_diag_hessian`; the Hessian is of
            exactly ``loss_fn``'s scalar (mean reduction: of the batch mean).
        specs: resolved edges (``nasdiag.edges.resolve_edges``).
        probes: k ≥ 1, the number of Rademacher probes (k·E Hessian-vector products per edge-wise probing, k otherwise).
        control: ``"ggn"`` (shipped: ``mode="hutchinson:<k>"``), ``"ggn_mc"`` (one backward instead of D,
            noisier) or ``"none"`` (plain Hutchinson).
        generator: seeds the probes (and the Monte-Carlo control); CPU generator, same probes on any device.
        chunk_size, max_memory: products per vmapped pass, and the memory cap of the exact modes.
        wrt: ``"alpha"`` also checks that the weights are a softmax (the chain rule is the caller's).
        per_edge: probe each edge on its own (k·E products, shipped) or all edges at once (k products;
            measured far noisier on supernets, module docstring).
        through_softmax: estimate ``diag(J H J)`` instead, ``J = diag(z) − z zᵀ`` = ∂Z/∂α per edge, by probes in α
            (products with ``J ε``, control ``J C J``): unbiased for the curvature part of ``∂²L/∂α²``, to which the
            caller adds ``Σ_k g_k ∂²Z_k/∂α²``. Chaining the Z-diagonal instead drops the within-edge ``k ≠ k'``
            entries of H, a bias no k removes (``mode='hutchinson:<k>', wrt='alpha'``).

    Returns:
        ``(estimate, stderr, ∂L/∂Z, observed weights)``, the first three ``{edge: (K,)}`` in the loss's dtype:
        ``stderr`` is the sample standard deviation of the k per-probe estimates / √k (NaN for k = 1).
    """
    if not isinstance(probes, int) or isinstance(probes, bool) or probes < 1:
        raise CurvatureError(f"probes must be an int >= 1 (the k of mode='hutchinson:<k>'), got {probes!r}; pass e.g. probes=4")
    if control not in CONTROLS:
        raise CurvatureError(f"control must be one of {', '.join(CONTROLS)}, got {control!r}; 'ggn' is what mode='hutchinson:<k>' uses")
    names, modules, n_ops = [s.name for s in specs], [s.module for s in specs], [s.n_ops for s in specs]
    drawn = random_state()  # C and H of the one net: the products' forward draws the control's dropout masks
    if control != "none":
        rows, _, _ = ggn_factor_rows(
            model, loss_fn, inputs, targets, names, modules, n_ops, monte_carlo=control == "ggn_mc", generator=generator,
            warn_unused=False,  # the products above said it
            # a refusal names the mode asked for (a non-convex loss was 'mode ggn/ggn_mc needs ...' of hutchinson:<k>)
            what=f"mode='hutchinson:{probes}' (its control variate, the ggn matrix,)",
        )
        R = torch.cat([rows[n].flatten(0, 1) for n in names], dim=1)  # (R·B, N): C = Rᵀ R over all edges
        set_random_state(drawn)
    with edge_hessian_products(
        model, loss_fn, inputs, targets, specs, wrt=wrt, chunk_size=min(chunk_size, probes * (len(specs) if per_edge else 1)),
        max_memory=max_memory,
        what=f"arch_diag_hessian(mode='hutchinson:{probes}')",
    ) as ep:
        N, E = sum(n_ops), len(n_ops)
        rows = probes * (E if per_edge else 1)  # V and its products (rows, N), the probes (k, N) in int64 and as floats
        check_probe_memory((2 * rows + 3 * probes) * N * ep.dtype.itemsize + probes * N * 8, max_memory, ep.device,
                           f"arch_diag_hessian(mode='hutchinson:{probes}')",
                           f"lower k (k·E products; from k = {max(n_ops)} on, mode='exact' takes fewer and is exact)")
        eps = torch.randint(0, 2, (probes, N), generator=generator, dtype=torch.int64).mul_(2).sub_(1)
        eps = eps.to(dtype=ep.dtype, device=ep.device)
        if per_edge:  # probe s of edge e: ε_s on e's entries, 0 elsewhere (k·E products)
            edge = torch.repeat_interleave(torch.arange(E, device=ep.device), torch.tensor(n_ops, device=ep.device))
            mask = (edge[None, :] == torch.arange(E, device=ep.device)[:, None]).to(ep.dtype)  # (E, N)
            V = (eps[:, None, :] * mask[None]).reshape(probes * E, N)
        else:
            V = eps
        if through_softmax:  # probes ε in α: products with J ε, read back through J (J symmetric, block diagonal)
            J = [_softmax_jacobian(ep.shift.observed[n][0].to(ep.dtype)) for n in names]
            V = _by_blocks(V, J, n_ops)
        step = max(1, ep.chunk_size)
        HV = torch.cat([ep.products(V[s : s + step]).detach() for s in range(0, V.shape[0], step)])
        if control != "none":  # (H − C) v; per edge, only the probe's own block of C is read below
            R = R.to(ep.dtype)
            HV = HV - (_own_blocks(V, R, n_ops) if per_edge else (V @ R.T) @ R)
        if through_softmax:
            HV = _by_blocks(HV, J, n_ops)  # J (H − C) J ε
            if control != "none":
                R = _by_blocks(R, J, n_ops)  # diag(J C J) below
        if per_edge:  # entry i reads the product of its own edge's probe
            HV = HV.reshape(probes, E, N).gather(1, edge[None, None, :].expand(probes, 1, N)).squeeze(1)
    base = torch.zeros(N, dtype=ep.dtype, device=ep.device) if control == "none" else R.to(ep.dtype).square().sum(0)
    per_probe = base + eps * HV  # (k, N): k independent unbiased estimates of diag H (base = diag C)
    estimate = per_probe.mean(0)
    stderr = per_probe.std(0, unbiased=True) / probes**0.5 if probes > 1 else torch.full_like(estimate, float("nan"))
    return _per_edge(estimate, names, n_ops), _per_edge(stderr, names, n_ops), dict(zip(names, ep.grad_z)), ep.shift.observed


def _by_blocks(A: torch.Tensor, blocks: List[torch.Tensor], n_ops: List[int]) -> torch.Tensor:
    """``A @ block_diag(*blocks)``, taken edge by edge (see :func:`_own_blocks`)."""
    return torch.cat([a @ b for a, b in zip(torch.split(A, n_ops, dim=1), blocks)], dim=1)


def _own_blocks(V: torch.Tensor, R: torch.Tensor, n_ops: List[int]) -> torch.Tensor:
    """``V_e R_eᵀ R_e`` for each edge e (``V_e``, ``R_e`` its columns): the block-diagonal part of ``C = Rᵀ R`` applied
    to V. For a probe of one edge the entries it is read at are the same as ``(V Rᵀ) R``'s, but a product with the whole
    matrix multiplies another edge's NaN columns (a NaN batch) by the zeros outside the probe: an edge the loss does not
    depend on came out NaN instead of zeros."""
    return torch.cat([(v @ r.T) @ r for v, r in zip(torch.split(V, n_ops, dim=1), torch.split(R, n_ops, dim=1))], dim=1)


def _softmax_jacobian(z: torch.Tensor) -> torch.Tensor:
    """``∂z/∂α = diag(z) − z zᵀ`` of ``z = softmax(α)`` (symmetric)."""
    return torch.diag(z) - torch.outer(z, z)


def _per_edge(flat: torch.Tensor, names: List[str], n_ops: List[int]) -> Dict[str, torch.Tensor]:
    return dict(zip(names, torch.split(flat, n_ops)))
