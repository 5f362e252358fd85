"""The mixed op: a weighted sum of candidate ops with the weights passed in explicitly."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from nasdiag.supernet.ops import OpConfig, build_op


class MixedOp(nn.Module):
    """``out = Σ_k Z_k · O_k(x)`` over the candidate ops ``self.ops``.

    The mixing weights Z are an argument of ``forward`` rather than state, so one module serves
    softmax weights (DARTS), one-hot or Gumbel samples (SNAS, DSNAS), linear weights A (SparseNAS),
    EG weights u (XNAS) and attention a (ASM-NAS).

    Args:
        C: channels of input and output.
        stride: 1, or 2 for edges leaving the inputs of a reduction cell.
        primitives: candidate op names (see ``nasdiag.supernet.OPS``).
        cfg: how ops are built (stacking order, normalization).
    """

    def __init__(self, C: int, stride: int, primitives: Sequence[str], cfg: OpConfig | None = None):
        super().__init__()
        cfg = cfg or OpConfig()
        self.primitives = list(primitives)
        self.stride = stride
        self.ops = nn.ModuleList(build_op(name, C, stride, cfg) for name in self.primitives)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Args:
            x: (B, C, H, W).
            weights: (K,) shared by the batch, or (B, K) per sample.

        Returns:
            (B, C, H/stride, W/stride).
        """
        K = len(self.ops)
        if weights.shape[-1] != K or weights.dim() not in (1, 2):
            raise ValueError(
                f"mixing weights must have shape (K,) or (B, K) with K={K} candidate ops, got {tuple(weights.shape)}"
            )
        if weights.dim() == 2:
            weights = weights.reshape(weights.shape[0], K, *([1] * (x.dim() - 1)))
            return sum(weights[:, k] * op(x) for k, op in enumerate(self.ops))
        return sum(weights[k] * op(x) for k, op in enumerate(self.ops))

    def extra_repr(self) -> str:
        return f"stride={self.stride}, primitives={self.primitives}"
