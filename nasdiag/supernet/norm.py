"""Normalization layers selectable by name (wiring paper §8.1)."""

from __future__ import annotations

from torch import nn

NORM_KINDS = ("batch", "layer", "instance")


def make_norm(kind: str, channels: int, affine: bool, eps: float) -> nn.Module:
    """Build the normalization of a candidate op.

    - ``"batch"``: ``nn.BatchNorm2d`` (statistics over batch and space, per channel);
    - ``"layer"``: ``nn.GroupNorm(1, C)``, i.e. LayerNorm over (C, H, W) per sample with a per-channel affine;
    - ``"instance"``: ``nn.InstanceNorm2d`` without running statistics (per sample, per channel, over space).

    Every kind is invariant to a positive rescaling of its input as ``eps -> 0``, which is what
    Thm 1 of the wiring paper rests on; tests that check theorems therefore pass a tiny ``eps``.
    """
    if kind == "batch":
        return nn.BatchNorm2d(channels, affine=affine, eps=eps)
    if kind == "layer":
        return nn.GroupNorm(1, channels, affine=affine, eps=eps)
    if kind == "instance":
        return nn.InstanceNorm2d(channels, affine=affine, eps=eps, track_running_stats=False)
    raise ValueError(f"unknown normalization {kind!r}: choose one of {', '.join(NORM_KINDS)}")
