"""Closed forms of the wiring supplement that diagnostics compare measured costs against."""

from __future__ import annotations

import torch
from nasdiag.cost.errors import CostError, require_tensors


def loss_minus_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Thm. 2 (supplement §6, eq. 12): the summed output-edge cost of the last cell, when it is followed
    by global average pooling and a bias-free linear classifier and the loss is the batch-mean
    cross-entropy, equals L − H with H the batch-mean entropy of the softmax prediction.

    Eq. 12 as printed sums −Y_{b,n_b} over n as well; re-derived here: <∂L/∂Y, Y> for the mean
    cross-entropy is (1/B) Σ_b [−Y_{b,n_b} + Σ_n p_bn Y_bn] = (1/B) Σ_b [−log p_{b,n_b} + Σ_n p_bn log p_bn]
    (the log-partition terms cancel because Σ_n p_bn = 1), i.e. L − H.

    Args:
        logits: (B, N) classifier outputs Y. targets: (B,) int64 labels.

    Returns:
        0-dim tensor L − H (mean over the batch), dtype of ``logits``, at least float32 (half-precision logits are
        computed in float32, as the costs are).

    Raises:
        CostError: logits not (B, N) floating-point outputs (integer, bool or complex ones have no softmax), or
            targets not B integer labels in [0, N) (fewer labels than rows would average L over some samples and H
            over all of them).
    """
    require_tensors("loss_minus_entropy", logits=logits, targets=targets)
    if logits.dim() != 2:
        raise CostError(f"loss_minus_entropy: logits must be (B, N) classifier outputs, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise CostError(f"loss_minus_entropy: logits must be real floating-point classifier outputs, got a {logits.dtype} "
                        "tensor; pass the model's output (or logits.double())")
    B, N = logits.shape
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool or targets.numel() != B:
        raise CostError(f"loss_minus_entropy: targets must be {B} integer class labels, one per row of the (B, N) = "
                        f"{(B, N)} logits, got a {targets.dtype} tensor of shape {tuple(targets.shape)}")
    if B and not bool(((targets >= 0) & (targets < N)).all()):
        raise CostError(f"loss_minus_entropy: targets must be class labels in [0, {N}), got values from "
                        f"{int(targets.min())} to {int(targets.max())}")
    # at least float32, as the output-edge costs it is compared with: in bfloat16 the log-softmax and the entropy's sum
    # were 0.7 % off L − H of the same logits
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    loss = -logp.gather(1, targets.reshape(-1, 1).long()).mean()  # gather: int32/int64 indices only
    p = logp.exp()
    # 0·log 0 = 0: a class with logit −inf (masked) has p = 0 and logp = −inf, whose product is NaN; a NaN stays NaN
    entropy = -torch.where(p == 0, torch.zeros_like(p), p * logp).sum(-1).mean()
    return loss - entropy
