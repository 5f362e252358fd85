"""Rewards of the experts of a forecaster (XNAS, Nayman et al. 2019).

An edge of a DARTS cell is a forecaster whose experts are its K candidate ops. Every reward here is a
tensor of shape ``(..., K)``: any leading shape (edges, cells, runs), the experts on the last axis.
Batch convention: a reward inherits the one of the loss it is derived from (nasdiag losses are the
mean over the batch), nothing is summed or averaged here.
"""

from __future__ import annotations

import torch

from nasdiag.cost.credit import darts_alpha_grad
from nasdiag.regret.errors import RegretError, RegretTypeError

__all__ = ["xnas_reward", "rewards_from_gradient", "gd_softmax_reward"]


def _as_tensor(value, name: str = "the argument") -> torch.Tensor:
    """``torch.as_tensor``, except that Python floats (lists, tuples) become float64, not torch's default float32,
    which would round them before any arithmetic; what is no tensor of numbers (None, strings, ragged lists) is one
    RegretTypeError naming ``name``, not torch's bare 'Could not infer dtype of NoneType'."""
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise RegretTypeError(f"{name} must be a tensor (or nested lists) of numbers, got {value!r:.80}") from None
    if isinstance(value, (list, tuple, float)) and tensor.is_floating_point():
        tensor = torch.as_tensor(value, dtype=torch.float64)
    return tensor


def _floating(name: str, tensor) -> torch.Tensor:
    tensor = _as_tensor(tensor, name)
    if not tensor.is_floating_point():
        raise RegretTypeError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    if tensor.ndim < 1:
        raise RegretError(f"{name} must have the experts on a last axis, shape (..., K); got a scalar")
    return tensor


def xnas_reward(cost: torch.Tensor) -> torch.Tensor:
    """The XNAS reward of every op of every edge from its cost: ``R = -C`` (Algorithm 1, line 8).

    ``C[..., k] = dL/dZ_k`` is the cost the probe assigns to op ``k`` of an edge, the derivative of
    the loss with respect to the op's linear mixing weight ``Z_k`` in ``x_j = sum_k Z_k o_k(x_i)``.
    Because the edge output ``p`` enters node ``x_j`` additively, ``dL/dZ_k = grad_p L . f_k`` with
    ``f_k = o_k(x_i)``, which is exactly ``-R_k`` of Algorithm 1: the reward is minus the cost.

    Args:
        cost: ``(..., K)`` floating tensor (any leading shape, typically ``(E, K)`` per cell type).

    Returns:
        ``(..., K)`` tensor of rewards, same dtype and device. Non-finite costs stay non-finite, so
        that :meth:`nasdiag.regret.Forecaster.update` can refuse them loudly.
    """
    return -_floating("cost", cost)


def rewards_from_gradient(grad_prediction: torch.Tensor, expert_predictions: torch.Tensor) -> torch.Tensor:
    """``R_i = -grad_p l(p) . f_i``, the reward of Algorithm 1 line 8 (eq 18, eq 35).

    Args:
        grad_prediction: ``(..., D)`` gradient of the loss with respect to the forecaster's
            prediction ``p`` (flatten feature maps to ``D``).
        expert_predictions: ``(..., K, D)`` predictions ``f_i`` of the K experts; leading shape
            broadcast against ``grad_prediction``'s.

    Returns:
        ``(..., K)`` rewards.
    """
    grad_prediction = _floating("grad_prediction", grad_prediction)
    expert_predictions = _floating("expert_predictions", expert_predictions)
    if expert_predictions.ndim < 2 or expert_predictions.shape[-1] != grad_prediction.shape[-1]:
        raise RegretError(
            "expert_predictions must have shape (..., K, D) with D the last dimension of "
            f"grad_prediction; got {tuple(expert_predictions.shape)} and {tuple(grad_prediction.shape)}"
        )
    try:
        torch.broadcast_shapes(expert_predictions.shape[:-2], grad_prediction.shape[:-1])
    except RuntimeError:
        raise RegretError(
            f"the leading shapes of expert_predictions (..., K, D) and grad_prediction (..., D) must broadcast; got "
            f"{tuple(expert_predictions.shape)} and {tuple(grad_prediction.shape)}"
        ) from None
    return -(expert_predictions * grad_prediction.unsqueeze(-2)).sum(-1)


def gd_softmax_reward(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The effective reward of gradient descent on ``alpha = ln v`` through a softmax (eq 6, eq 37).

    ``R~_i = -d l / d alpha_i = -grad_p l . u_i (f_i - p) = u_i (R_i - sum_j u_j R_j)``, where the last
    form uses ``R_i = -grad_p l . f_i`` and ``p = sum_j u_j f_j``. GD with softmax therefore updates
    ``v_i <- v_i exp(eta R~_i)`` (eq 5): the XNAS reward centred on the mixture and attenuated by the
    expert's own weight ``u_i``, which is why late bloomers struggle.

    Args:
        rewards: ``(..., K)`` XNAS rewards ``R`` (see :func:`xnas_reward`).
        weights: ``(..., K)`` mixture weights ``u = softmax(alpha)`` used to form ``p`` (broadcast
            against ``rewards``).

    Returns:
        ``(..., K)`` effective rewards ``R~``, summing to zero over the experts.
    """
    rewards = _floating("rewards", rewards)
    weights = _floating("weights", weights)
    if rewards.shape[-1] != weights.shape[-1]:
        raise RegretError(
            f"rewards and weights need the same number of experts K on the last axis; got "
            f"{tuple(rewards.shape)} and {tuple(weights.shape)}"
        )
    # Eq 37 is DARTS's alpha-gradient (wiring supplement §2.1) with C = -R, negated: the maths lives
    # once, in nasdiag.cost.
    try:
        rewards, weights = torch.broadcast_tensors(rewards, weights)
    except RuntimeError:
        raise RegretError(f"rewards and weights must broadcast, got {tuple(rewards.shape)} and {tuple(weights.shape)}") from None
    return -darts_alpha_grad(-rewards, weights)
