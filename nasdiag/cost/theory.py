"""Closed forms of the wiring supplement that diagnostics compare measured costs against."""

from __future__ import annotations

import torch


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
        0-dim tensor L − H (mean over the batch), dtype of ``logits``.
    """
    logp = torch.log_softmax(logits, dim=-1)
    loss = -logp.gather(1, targets.reshape(-1, 1)).mean()
    p = logp.exp()
    # 0·log 0 = 0: a class with logit −inf (masked) has p = 0 and logp = −inf, whose product is NaN; a NaN stays NaN
    entropy = -torch.where(p == 0, torch.zeros_like(p), p * logp).sum(-1).mean()
    return loss - entropy
