"""Closed forms of the BayesNAS hierarchical sparse prior (appendix §A), elementwise on (..., K) tensors.

Notation (appendix §A): w an architecture parameter (here a mixing weight of one op of one edge), s its
switch (prior variance of w, p(w) = N(0, s)), γ the uncertainty with the edge dependency (A.2.14), H the
diagonal curvature ∂²E_D/∂w² at the current w (C.3), C the posterior variance (A.1.6b / A.3.2), ω the
ℓ1 weight of the reweighted lasso (A.2.8 / A.3.9). Everything is per element: H is the *diagonal* of the
curvature (BayesNAS §C), so every "matrix" of §A is a diagonal and its inverse is elementwise.

Re-derived where the PDF text is garbled (comments at each function say which):

* A.1.6a: the posterior mean is m = C·(H w* − g), not C·(g + H w*): it minimises the quadratic model
  ½(w−w*)H(w−w*) + (w−w*)g + ½ w s⁻¹ w (A.1.10–A.1.12 with ĝ = g − H w*, A.1.7d).
* A.2.8: ω² = ∂/∂s [log s + log(1/s + H)] = 1/s − C/s² = (s − C)/s², so ω = √(s − C)/s (the square root
  covers the numerator only, as the second line of A.2.8 prints).
* A.3.9: for a group of ℵ elements ω_group = √(Σ_i (γ_i − C_i)/γ_i²); the text's inner √ is spurious (with
  ℵ = 1 it must reduce to A.2.8).

Groups (A.3.6–A.3.11): ℵ parameters w_1 … w_ℵ that share one switch and one γ (the same op of the same
edge in the ℵ cells of a kind) each have their own curvature H_i and posterior variance C_i (A.3.2), but one
ω_group = √(Σ_i ω_i²) (A.3.9) and one s = ‖w_group‖₂/ω_group (A.3.8); :func:`group_bayes_update` takes
the group along a leading axis, :func:`sparse_bayes_update` is its group of one.

Batch convention: none here; H and g are whatever the caller computed (BayesNAS passes the curvature of
the energy E_D/λ_w, E_D the batch's summed loss: ``nasdiag.search.methods.bayesnas``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from nasdiag.errors import NasdiagError

#: Algorithm 2, step 4 prunes an op when its entropy ½ ln(2πe γ) ≤ 0, i.e. γ ≤ 1/(2πe).
ENTROPY_THRESHOLD_GAMMA = 1.0 / (2.0 * math.pi * math.e)


class BayesError(NasdiagError, ValueError):
    """Inputs of the sparse-Bayesian update that make it undefined (shape mismatch, negative variances)."""


def check_tensors(**named) -> None:
    """`BayesError` naming the first argument that is not a tensor: ``name=(value, "its shape in words")``. A Python
    number (γ(0) = 1 or ω(0) = 1 of Algorithms 2-3 given as 1.0) or a list was "'float' object has no attribute
    'shape'", an AttributeError traceback naming no argument."""
    for name, (value, shape) in named.items():
        if not isinstance(value, torch.Tensor):
            raise BayesError(f"{name} must be a tensor of shape {shape}, got a {type(value).__name__}")


def _check_variance(name: str, t: torch.Tensor) -> None:
    if bool((t < 0).any()):
        raise BayesError(f"{name} must be >= 0 (a variance); got min {float(t.min()):.3g}")


def covariance(gamma_prev: torch.Tensor, curvature: torch.Tensor) -> torch.Tensor:
    """Posterior variance C = (1/γ(t−1) + H(t))⁻¹ (A.3.2; A.1.6b with s → γ), elementwise.

    A Laplace approximation needs a non-negative curvature: negative entries of H (an indefinite exact
    Hessian away from a minimum) are treated as 0, so 0 ≤ C ≤ γ and ω (A.2.8) is real. γ = 0 gives C = 0.

    Shapes: gamma_prev, curvature broadcastable, (..., K); returns their broadcast shape.
    """
    _check_variance("gamma", gamma_prev)
    h = curvature.clamp_min(0)
    # C = γ/(1 + γH) where γH ≤ 1: the same value as (1/γ + H)⁻¹ without dividing by γ = 0; elsewhere (1/γ + H)⁻¹,
    # which does not overflow where γH does (γ = 1e300, H = 1e10: C = 1e-10, not γ/∞ = 0); γ = ∞ gives 1/H.
    gh = gamma_prev * h
    return torch.where(gh <= 1, gamma_prev / (1 + gh), (gamma_prev.reciprocal() + h).reciprocal())


def omega(gamma_prev: torch.Tensor, cov: torch.Tensor, *, curvature: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ω = √(γ(t−1) − C(t)) / γ(t−1) (A.2.8, A.3.9 for a group of one), elementwise, shape of the inputs.

    ω² is the gradient in s of the concave part log s + log(1/s + H) of the cost A.2.1 at s = γ(t−1)
    (A.2.7). γ = 0 (a dead switch) gives ω = ∞, so the switch stays 0 (A.2.13); γ = ∞ gives the limit
    ω = 0 (√(γ − C)/γ ~ 1/√γ); a NaN γ gives NaN (kept, never taken for a dead switch).

    With the ``curvature`` H that gave C = (1/γ + H)⁻¹ (:func:`covariance`), ω is computed as the same value
    1/√(γ + 1/H) (γ − C = γ²H/(1 + γH)), which has no cancellation: γ − C loses every digit where γH is below
    the precision (γ = 1, H = 1e-20 gives ω = 0 instead of 1e-10, and the switch s = |w|/ω = ∞).
    """
    _check_variance("gamma", gamma_prev)
    if curvature is None:
        diff = (gamma_prev - cov).clamp_min(0)  # ≥ 0 up to rounding, since C ≤ γ for H ≥ 0
        value = diff.sqrt() / gamma_prev
    else:
        value = (gamma_prev + curvature.clamp_min(0).reciprocal()).rsqrt()
    # γ = 0 selects ∞ (not "γ > 0" selects the formula: a NaN γ must give a NaN ω, never the ∞ of a dead switch,
    # which would make s = 0 and prune the op on a NaN)
    out = torch.where(gamma_prev == 0, torch.full_like(value, math.inf), value)
    return torch.where(torch.isinf(gamma_prev), torch.zeros_like(out), out)


def switch(w: torch.Tensor, om: torch.Tensor) -> torch.Tensor:
    """Switch (prior variance) s = |w|/ω (A.2.11, A.2.13; A.3.8 for a group of one), elementwise.

    It minimises w²/s + ω² s over s > 0 (the bound w²/s + ω²s ≥ 2|ω w| of A.2.10 holds with equality).
    ω = 0 (zero curvature: the data say nothing) gives s = ∞ for w ≠ 0 and 0 for w = 0. A NaN ω (of a NaN γ or
    curvature) gives NaN also for w = 0: s = 0 would make γ = 0 (A.2.14) and prune the op on a NaN.
    """
    a = w.abs()
    return torch.where((a == 0) & ~om.isnan(), torch.zeros_like(a), a / om)


def group_omega(gamma_prev: torch.Tensor, cov: torch.Tensor, *, curvature: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ω of a group (A.3.9, the inner √ of the text dropped so that ℵ = 1 is A.2.8): √(Σ_i ω_i²) with
    ω_i = √(γ(t−1) − C_i)/γ(t−1) of each element i (from the elements' ``curvature`` H_i, (ℵ, ...), when given:
    see :func:`omega`).

    Shapes: gamma_prev (...) (one γ per group, A.3.5), cov (ℵ, ...); returns (...).
    """
    return omega(gamma_prev, cov, curvature=curvature).square().sum(0).sqrt()


def group_switch(w: torch.Tensor, om: torch.Tensor) -> torch.Tensor:
    """Switch of a group s = ‖w_group‖₂ / ω_group (A.3.8): it minimises Σ_i (w_i²/s + ω_i² s) over s > 0,
    the bound of A.3.7 holding with equality. Shapes: w (ℵ, ...), om (...); returns (...)."""
    return switch(torch.linalg.vector_norm(w, dim=0), om)


def lasso_weights(w_star: torch.Tensor, grad: torch.Tensor, curvature: torch.Tensor, om: torch.Tensor) -> torch.Tensor:
    """w(t) = argmin_w ½ H w² + w (g − H w*) + ω|w| (A.2.12) for a diagonal H, elementwise.

    Soft thresholding: with b = H w* − g, w = sign(b)·max(|b| − ω, 0)/H. Where H < 0 the problem has no
    minimum (½ H w² wins); such H is taken as 0, as in :func:`covariance` and :func:`posterior_mean` (the same
    Laplace model). Where H = 0 the objective −b w + ω|w| is bounded only if |b| ≤ ω (then w = 0): such entries are
    returned as 0 when |b| ≤ ω and NaN otherwise (recorded, never hidden).
    """
    curvature = curvature.clamp_min(0)
    b = curvature * w_star - grad
    shrunk = torch.sign(b) * (b.abs() - om).clamp_min(0)
    safe = torch.where(curvature > 0, curvature, torch.ones_like(curvature))
    return torch.where(curvature > 0, shrunk / safe,
                       torch.where(b.abs() <= om, torch.zeros_like(b), torch.full_like(b, math.nan)))


def posterior_mean(w_star: torch.Tensor, grad: torch.Tensor, curvature: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Posterior mean m = C·(H w* − g) with C = (1/s + H)⁻¹ (A.1.6a re-derived; see module docstring)."""
    return covariance(s, curvature) * (curvature.clamp_min(0) * w_star - grad)


def parent_matrix(edge_nodes: Sequence[Tuple[int, int]], device=None) -> torch.Tensor:
    """(E, E) float 0/1 matrix P with P[e, f] = 1 when edge f = (i, j) enters the source node j of edge
    e = (j, k): the predecessors Σ_{i<j} e_ij of A.2.14. Edges leaving a cell input have no predecessor."""
    edge_nodes = list(edge_nodes)
    if not all(isinstance(e, (tuple, list)) and len(e) == 2 for e in edge_nodes):
        raise BayesError(f"edge_nodes must be (source node, target node) pairs, got {edge_nodes!r}")
    E = len(edge_nodes)
    P = torch.zeros(E, E, device=device)
    src = torch.tensor([i for i, _ in edge_nodes], device=device)
    dst = torch.tensor([j for _, j in edge_nodes], device=device)
    P[:] = (dst.unsqueeze(0) == src.unsqueeze(1)).to(P.dtype)
    return P


def dependent_gamma(s: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """γ_jk^o' = (1/Σ_{i<j} Σ_o s_ij^o + 1/s_jk^o')⁻¹ (A.2.14): the switch in series with the total switch of
    the edges entering the source node. No predecessor (the sum is empty) means 1/Σ = 0, so γ = s.

    Shapes: s (E, K), parents (E, E) from :func:`parent_matrix`; returns (E, K).
    """
    if parents.shape != (s.shape[0], s.shape[0]):
        raise BayesError(f"parents must be ({s.shape[0]}, {s.shape[0]}) for {s.shape[0]} edges, got {tuple(parents.shape)}")
    _check_variance("s", s)
    # masked sum, not a matmul: 0·∞ would be NaN where a non-parent edge has s = ∞
    upstream = torch.where(parents > 0, s.sum(-1).unsqueeze(0), torch.zeros((), dtype=s.dtype, device=s.device)).sum(-1)
    upstream = upstream.unsqueeze(-1)  # (E, 1)
    has_parent = parents.sum(-1).unsqueeze(-1) > 0
    # 1/(1/a + 1/b) with IEEE reciprocals: a or b = 0 gives 0, b = ∞ gives a (and a = ∞ gives b).
    inv_upstream = torch.where(has_parent, upstream.reciprocal(), torch.zeros_like(upstream))
    return (inv_upstream + s.reciprocal()).reciprocal()


def entropy(gamma: torch.Tensor) -> torch.Tensor:
    """Differential entropy ½ ln(2πe γ) of N(0, γ) (Algorithm 2, step 4); −∞ at γ = 0."""
    return 0.5 * torch.log(2 * math.pi * math.e * gamma)


def prune(alive: torch.Tensor, gamma: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 2, step 4: an op stays alive while its entropy ½ ln(2πe γ) > 0; a pruned op never returns.

    Nothing else is kept: an edge whose every op is pruned is removed, and once every edge entering a node is
    removed, A.2.14 gives the edges leaving it γ = 0 (their predecessors' switches sum to 0), so they are
    pruned at the next update: the node is removed, the dependency the hierarchical prior encodes.
    Shapes: alive (E, K) bool, gamma (E, K); returns (alive (E, K) bool, emptied (E,) bool — edges whose last
    alive ops this update pruned). NaN γ prunes nothing (the op stays; the caller records the NaN).
    """
    if alive.shape != gamma.shape or alive.dtype != torch.bool:
        raise BayesError(f"alive must be a bool tensor of gamma's shape {tuple(gamma.shape)}, got {alive.dtype} "
                         f"{tuple(alive.shape)}")
    keep = alive & ~(entropy(gamma) <= 0)
    return keep, alive.any(-1) & ~keep.any(-1)


@dataclass
class BayesUpdate:
    """One update of the variables associated with w (Algorithm 2, step 3), all (E, K) except ``cov``:
    ``cov`` C (A.3.2) per element of the group (ℵ, E, K) (from :func:`sparse_bayes_update`: (E, K)),
    ``omega`` ω (A.2.8/A.3.9), ``switch`` s (A.2.13/A.3.8), ``gamma`` γ (A.2.14)."""

    cov: torch.Tensor
    omega: torch.Tensor
    switch: torch.Tensor
    gamma: torch.Tensor


def sparse_bayes_update(w: torch.Tensor, curvature: torch.Tensor, gamma_prev: torch.Tensor,
                        parents: torch.Tensor) -> BayesUpdate:
    """Algorithm 2, step 3 for one cell type: C (A.3.2), ω (A.2.8), s = |w|/ω (A.2.13), γ (A.2.14).

    Args:
        w: (E, K) architecture parameters after step 1 (the regularised ML of A.3.1: Corollary 1's w*).
        curvature: (E, K) diagonal ∂²E_D/∂w² at w (C.3), of the same loss as step 1.
        gamma_prev: (E, K) γ(t−1).
        parents: (E, E) from :func:`parent_matrix`.
    """
    check_tensors(w=(w, "(E, K)"), curvature=(curvature, "(E, K)"),
                  gamma_prev=(gamma_prev, "(E, K) (γ(0) = 1: torch.ones(E, K))"), parents=(parents, "(E, E)"))
    if not (w.shape == curvature.shape == gamma_prev.shape):
        raise BayesError(f"w, curvature and gamma must have one shape, got {tuple(w.shape)}, {tuple(curvature.shape)}, "
                         f"{tuple(gamma_prev.shape)}")
    u = group_bayes_update(w.unsqueeze(0), curvature.unsqueeze(0), gamma_prev, parents)
    return BayesUpdate(cov=u.cov.squeeze(0), omega=u.omega, switch=u.switch, gamma=u.gamma)


def group_bayes_update(w: torch.Tensor, curvature: torch.Tensor, gamma_prev: torch.Tensor,
                       parents: torch.Tensor) -> BayesUpdate:
    """Algorithm 2, step 3 for groups of ℵ parameters (A.3.6): C_i (A.3.2), ω (A.3.9), s (A.3.8), γ (A.2.14).

    Args:
        w: (ℵ, E, K) the group's parameters after step 1 (ℵ equal rows where the cells of a kind share one w).
        curvature: (ℵ, E, K) each element's diagonal curvature (C.3).
        gamma_prev: (E, K) γ(t−1), one per group (A.3.5).
        parents: (E, E) from :func:`parent_matrix`.

    Returns a :class:`BayesUpdate` with ``cov`` (ℵ, E, K) and the rest (E, K).
    """
    check_tensors(w=(w, "(ℵ, E, K)"), curvature=(curvature, "(ℵ, E, K)"),
                  gamma_prev=(gamma_prev, "(E, K) (γ(0) = 1: torch.ones(E, K))"), parents=(parents, "(E, E)"))
    if w.dim() != 3 or w.shape != curvature.shape or w.shape[1:] != gamma_prev.shape:
        raise BayesError(f"w and curvature must be (ℵ, E, K) and gamma (E, K) of the same E, K; got {tuple(w.shape)}, "
                         f"{tuple(curvature.shape)}, {tuple(gamma_prev.shape)}")
    cov = covariance(gamma_prev, curvature)
    om = group_omega(gamma_prev, cov, curvature=curvature)
    s = group_switch(w, om)
    return BayesUpdate(cov=cov, omega=om, switch=s, gamma=dependent_gamma(s, parents))
