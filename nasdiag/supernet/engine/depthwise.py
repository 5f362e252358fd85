"""Depthwise convolutions of the fast engine on CUDA, with a faster input gradient.

For a stride-1 depthwise convolution with "same" zero padding, the gradient w.r.t. the input is itself a
depthwise convolution of the output gradient with the spatially flipped kernel (correlation ↔ convolution):

    ∂L/∂x = conv(∂L/∂y, flip(w)),   same padding and dilation, groups = channels.

torch's native depthwise backward-input kernel for float32 NCHW is slow: on an H100 (torch 2.11, batch 64,
128 channels at 32×32, 3×3) it takes 142 µs where the flipped forward takes 79 µs (native) or 48 µs
(cuDNN's forward); cuDNN's forward also beats the native one there (48 vs 79 µs). For 5×5 kernels the
native forward is the faster one (133 vs 177 µs) and the flipped forward only matches the native input
gradient, so 5×5 keeps torch's kernels for both. The weight gradient stays torch's (the fastest of the
measured routes at these sizes). Measured in CUDA graphs: BENCHMARKS.md, "Search engine".

The result equals ``F.conv2d`` (the same sums, in another order: float32 round-off; the CPU tests check
the formula in float64). Used only on CUDA, for float32/float64 stride-1 square kernels with same padding;
anything else calls ``F.conv2d`` directly.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

__all__ = ["depthwise_conv2d", "DepthwiseSame"]

#: kernel sizes whose forward and input gradient go through cuDNN's forward on CUDA (measured faster)
CUDNN_KERNEL_SIZES = (3,)


def _forward(x: torch.Tensor, w: torch.Tensor, padding: int, dilation: int) -> torch.Tensor:
    if x.is_cuda and w.shape[-1] in CUDNN_KERNEL_SIZES and torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled:
        # TF32 off: torch's own depthwise kernels (the eager modules' route) compute in full float32, and a
        # bandwidth-bound depthwise convolution gains nothing from it
        return torch.cudnn_convolution(x, w, [padding, padding], [1, 1], [dilation, dilation], x.shape[1], False, False, False)
    return F.conv2d(x, w, None, 1, padding, dilation, x.shape[1])


class DepthwiseSame(torch.autograd.Function):
    """``F.conv2d(x, w, padding=p, dilation=d, groups=C)`` for w (C, 1, k, k), stride 1, ``p = d(k−1)/2``;
    the input gradient as the flipped-kernel forward (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, padding: int, dilation: int) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.padding, ctx.dilation = padding, dilation
        return _forward(x, w, padding, dilation)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, None, None]:
        x, w = ctx.saved_tensors
        p, d = ctx.padding, ctx.dilation
        grad_x = grad_w = None
        grad_out = grad_out.contiguous()
        if ctx.needs_input_grad[0]:
            grad_x = _forward(grad_out, w.flip(-1, -2).contiguous(), p, d)
        if ctx.needs_input_grad[1]:
            grad_w = torch.ops.aten.convolution_backward(grad_out, x, w, None, [1, 1], [p, p], [d, d], False, [0, 0],
                                                         x.shape[1], [False, True, False])[1]
        return grad_x, grad_w, None, None


def depthwise_conv2d(x: torch.Tensor, w: torch.Tensor, stride, padding, dilation) -> torch.Tensor:
    """Depthwise convolution ``F.conv2d(x, w, None, stride, padding, dilation, groups=C)``, x (B, C, H, W),
    w (C, 1, k, k): through :class:`DepthwiseSame` on CUDA where it applies (stride 1, square kernel, same
    padding), else ``F.conv2d``."""
    s, p, d = _pair(stride), _pair(padding), _pair(dilation)
    k = w.shape[-2:]
    if (x.is_cuda and s == (1, 1) and k[0] == k[1] and p[0] == p[1] and d[0] == d[1] and p[0] == d[0] * (k[0] - 1) // 2
            and k[0] % 2 == 1 and w.shape[0] == x.shape[1] and w.shape[1] == 1 and x.dtype in (torch.float32, torch.float64)):
        return DepthwiseSame.apply(x, w, p[0], d[0])
    return F.conv2d(x, w, None, stride, padding, dilation, x.shape[1])


def _pair(v) -> Tuple[int, int]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)
