"""Maps from the cost C = ∂L/∂Z to each method's architecture gradient (wiring supplement §2).

DARTS, ProxylessNAS, SNAS and DSNAS differ only in how Z depends on α, so each map is the Jacobian
∂Z/∂α (or a score-function factor) applied to the same C. The XNAS reward R = −C lives in
``nasdiag.regret``. All functions work on the last dim (K ops) and broadcast over leading dims, e.g.
(E, K) for one cell type. For α shared across cells, pass C summed over those cells (§2.1 sums the
chain rule over every use of α); ``nasdiag.cost.scatter_cells(...).sum(0)`` gives that sum when every cell
has every edge (a missing edge is NaN there).
"""

from __future__ import annotations

import math
import numbers

import torch
from nasdiag.cost.errors import CostError, require_tensors


def _check_pair(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise CostError(f"{name}: costs have shape {tuple(a.shape)} but the weights have {tuple(b.shape)}; both must be (..., K)")


def softmax_jacobian(probs: torch.Tensor) -> torch.Tensor:
    """∂softmax(α)/∂α = diag(p) − ppᵀ, shape (..., K, K) for probs (..., K). Symmetric."""
    require_tensors("softmax_jacobian", probs=probs)
    return torch.diag_embed(probs) - probs.unsqueeze(-1) * probs.unsqueeze(-2)


def _softmax_vjp(probs: torch.Tensor, costs: torch.Tensor) -> torch.Tensor:
    # (diag p − ppᵀ) C without forming the K×K matrix: p ⊙ (C − <p, C>). An op with p_j = 0 (pruned: α_j = −inf; outside
    # ProxylessNAS's sampled pair) takes no part, p_j·C_j = 0 whatever C_j is: a probe's cost of an op that did not run
    # is NaN, and 0·NaN in <p, C> made every entry NaN
    costs = torch.where(probs != 0, costs, torch.zeros_like(costs))
    return probs * (costs - (probs * costs).sum(-1, keepdim=True))


def darts_alpha_grad(costs: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """DARTS, supplement §2.1: ∂L/∂α = (∂Ẑ/∂α)ᵀ C(Ẑ) = (diag(p) − ppᵀ) C, with Ẑ = p = softmax(α).

    Args:
        costs: (..., K) costs C(Ẑ) measured at the softmax weights (summed over cells sharing α); entries where
            p = 0 (an op pruned with α = −inf) are not used, so they may be NaN (a probe's, of an op that did not run).
        probs: (..., K) softmax(α).

    Returns:
        (..., K) ∂L/∂α, same batch convention as the costs (the loss's reduction).
    """
    require_tensors("darts_alpha_grad", costs=costs, probs=probs)
    _check_pair("darts_alpha_grad", costs, probs)
    return _softmax_vjp(probs, costs)


def proxyless_alpha_grad(gate_costs: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """ProxylessNAS, supplement §2.2: ∂L/∂α ≈ Σ_k [∂L/∂Z^k]_c ∂Z^k/∂α with binary gates Z sampled
    from p = softmax(α); i.e. (diag(p) − ppᵀ) C(Z) with C measured at the **binary** gates, where DARTS
    measures it at the softmax weights. The gradient of a gate is treated as the gradient of its
    probability (BinaryConnect), which is the approximation of §2.2.

    Args:
        gate_costs: (..., K) costs C(Z) of a forward with one-hot gates Z.
        probs: (..., K) softmax(α), or, for ProxylessNAS's two-path update, softmax over the sampled pair S and 0
            outside it: an op with probability 0 takes no part, so its cost may be NaN (a probe's, of an op that did
            not run).
    """
    require_tensors("proxyless_alpha_grad", gate_costs=gate_costs, probs=probs)
    _check_pair("proxyless_alpha_grad", gate_costs, probs)
    return _softmax_vjp(probs, gate_costs)


def snas_alpha_grad(costs: torch.Tensor, relaxed: torch.Tensor, temperature: float) -> torch.Tensor:
    """SNAS credit: with Z = softmax((α + G)/λ) (α logits, G Gumbel noise, λ the temperature),
    ∂L/∂α = (∂Z/∂α)ᵀ C(Z) = (1/λ)(diag(Z) − ZZᵀ) C(Z), the cost being measured at the relaxed sample Z.

    Args:
        costs: (..., K) C(Z) at the relaxed sample. relaxed: (..., K) the sample Z. temperature: λ > 0.
    """
    shape = getattr(temperature, "shape", None)  # a tensor or numpy array holding one number is that number
    if shape is not None and math.prod(shape) == 1 and hasattr(temperature, "item"):
        temperature = temperature.item()
    if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool):
        # None or a string was '>' not supported's TypeError, a per-edge tensor "Boolean value ... is ambiguous"
        raise CostError(f"snas_alpha_grad: temperature must be one number λ > 0 (the Gumbel-softmax temperature), got "
                        f"{type(temperature).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else ""))
    if not temperature > 0:
        raise CostError(f"temperature must be > 0, got {temperature}")
    require_tensors("snas_alpha_grad", costs=costs, relaxed=relaxed)
    _check_pair("snas_alpha_grad", costs, relaxed)
    return _softmax_vjp(relaxed, costs) / temperature


def dsnas_alpha_grad(costs: torch.Tensor, onehot: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """DSNAS credit for a one-hot sample Z (op s): ∂L/∂α = C(Z^s) ∇_α log p_s = (Z·C)(Z − p).

    The sampled op's cost C(Z^s) = ⟨∂L/∂x_j, O_s(x_i)⟩ is the only cost DSNAS computes; it scales the
    score function ∇_α log p(Z) = Z − p of the categorical sample.

    Args:
        costs: (..., K) costs at the one-hot forward (only the sampled entry is used: the others may be NaN, as a
            probe reports the ops that did not run).
        onehot: (..., K) the one-hot sample Z. probs: (..., K) softmax(α).
    """
    require_tensors("dsnas_alpha_grad", costs=costs, onehot=onehot, probs=probs)
    _check_pair("dsnas_alpha_grad", costs, onehot)
    _check_pair("dsnas_alpha_grad", costs, probs)
    # the sampled entry only: a probe's costs are NaN for the ops that did not run (all but the sampled one under
    # DSNAS), and 0·NaN would make every entry NaN; a NaN cost of the sampled op itself stays NaN
    sampled = torch.where(onehot != 0, onehot * costs, torch.zeros_like(costs))
    return sampled.sum(-1, keepdim=True) * (onehot - probs)
