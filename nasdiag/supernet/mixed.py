"""The mixed op: a weighted sum of candidate ops with the weights passed in explicitly."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
from torch import nn

from nasdiag.supernet.ops import OpConfig, build_op

#: a (K,) bool mask of the ops to compute: a CPU bool tensor or a sequence of bools
ActiveOps = Union[torch.Tensor, Sequence[bool]]


def active_indices(active: ActiveOps, K: int) -> List[int]:
    """Indices of the True entries of a (K,) mask (read on the host; a device tensor costs one sync)."""
    flags = active.tolist() if isinstance(active, torch.Tensor) else list(active)
    if len(flags) != K:
        raise ValueError(f"an active-op mask needs one flag per candidate op (K={K}), got {len(flags)}")
    chosen = [k for k, on in enumerate(flags) if on]
    if not chosen:
        raise ValueError("every candidate op of this edge is inactive; keep at least one op per edge active")
    return chosen


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

    Raises:
        ValueError: (one line) no primitives, a stride other than 1 or 2; KeyError: an op name not in ``OPS``.
    """

    def __init__(self, C: int, stride: int, primitives: Sequence[str], cfg: OpConfig | None = None):
        super().__init__()
        cfg = cfg or OpConfig()
        names = [] if isinstance(primitives, str) else list(primitives)  # a str was taken letter by letter
        if not names:  # [] mixed nothing: forward returned the int 0
            raise ValueError(f"primitives must be a non-empty list of candidate op names (nasdiag.supernet.OPS), got {primitives!r}")
        if stride not in (1, 2):  # skip_connect's FactorizedReduce halves whatever the stride: other ops' shapes differed
            raise ValueError(f"stride must be 1, or 2 for edges leaving the inputs of a reduction cell, got {stride!r}")
        self.primitives = names
        self.stride = stride
        self.ops = nn.ModuleList(build_op(name, C, stride, cfg) for name in self.primitives)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, active: Optional[ActiveOps] = None) -> torch.Tensor:
        """Args:
            x: (B, C, H, W).
            weights: (K,) shared by the batch, or (B, K) per sample.
            active: optional (K,) bool mask (a CPU tensor or a sequence of bools) of the ops to
                **compute**; the others are never called and contribute nothing (as if their weight
                were 0, but without their cost). None: every op. Masks are read on the host, because
                which modules run is a host decision: pass CPU masks (``Network.forward`` converts
                once per forward) to avoid a device sync per edge.

        Returns:
            (B, C, H/stride, W/stride).

        Raises:
            ValueError: wrong weight shape (also per-sample weights of another batch than x), a mask of the wrong
                length, or a mask with no active op.
        """
        K = len(self.ops)
        if weights.shape[-1] != K or weights.dim() not in (1, 2):
            raise ValueError(
                f"mixing weights must have shape (K,) or (B, K) with K={K} candidate ops, got {tuple(weights.shape)}"
            )
        if weights.dim() == 2 and weights.shape[0] not in (1, x.shape[0]):  # was torch's broadcasting error
            raise ValueError(f"per-sample mixing weights (B, K) must have a row per sample of x: got {tuple(weights.shape)} "
                             f"for x of batch {x.shape[0]}")
        chosen = range(K) if active is None else active_indices(active, K)
        if weights.dim() == 2:
            weights = weights.reshape(weights.shape[0], K, *([1] * (x.dim() - 1)))
            return sum(weights[:, k] * self.ops[k](x) for k in chosen)
        return sum(weights[k] * self.ops[k](x) for k in chosen)

    def extra_repr(self) -> str:
        return f"stride={self.stride}, primitives={self.primitives}"
