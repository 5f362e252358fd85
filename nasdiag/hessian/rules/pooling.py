"""Rules for pooling. All are (piecewise) linear, so there is no residual term, and
``H_x = (J∘J)ᵀ h_out``:

* max pooling routes each output to one input (J entries 0/1): ``H_x`` scatters ``h_out`` to the argmax;
* average pooling has ``J_{p,q} = c_p`` (the reciprocal divisor of window p) on its window, so
  ``(J∘J)ᵀ h = Jᵀ (c ∘ h)``: the ordinary average-pooling backward applied to ``c ∘ h``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian.rules.base import HessianRule, ModuleCall, UnsupportedModuleError, register_rule

__all__ = ["MaxPool2dRule", "MaxPool3dRule", "AvgPool2dRule", "AvgPool3dRule", "AdaptiveAvgPool2dRule", "AdaptiveMaxPool2dRule",
           "AdaptiveMaxPool3dRule"]


def _scatter_to_argmax(x: torch.Tensor, indices: torch.Tensor, h_out: torch.Tensor, dims: int) -> torch.Tensor:
    h_in = torch.zeros_like(x).flatten(-dims)
    h_in.scatter_add_(-1, indices.flatten(-dims), h_out.reshape(indices.shape).flatten(-dims))
    return h_in.view_as(x)


class _MaxPoolRule(HessianRule):
    dims = 2

    def check(self, module: nn.Module, name: str, shown: Optional[nn.Module] = None) -> None:
        """``shown``: the user's module when ``module`` is its 2-D stand-in (``MaxPool1d``), named in the message."""
        if module.return_indices:
            raise UnsupportedModuleError(
                f"module {name!r}: {type(module if shown is None else shown).__name__}(return_indices=True) returns a "
                "tuple; not supported"
            )

    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        m = call.module
        pool = F.max_pool2d if self.dims == 2 else F.max_pool3d
        _, idx = pool(call.input, m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode, return_indices=True)
        return _scatter_to_argmax(call.input, idx, h_out, self.dims)


class _AdaptiveMaxPoolRule(_MaxPoolRule):
    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        pool = F.adaptive_max_pool2d if self.dims == 2 else F.adaptive_max_pool3d
        _, idx = pool(call.input, call.output.shape[-self.dims:], return_indices=True)
        return _scatter_to_argmax(call.input, idx, h_out, self.dims)


class MaxPool2dRule(_MaxPoolRule):
    dims = 2


class MaxPool3dRule(_MaxPoolRule):
    dims = 3


class AdaptiveMaxPool2dRule(_AdaptiveMaxPoolRule):
    dims = 2


class AdaptiveMaxPool3dRule(_AdaptiveMaxPoolRule):
    dims = 3


class _AvgPoolRule(HessianRule):
    dims = 2

    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        m, d = call.module, self.dims
        x = call.input if call.input.dim() == d + 2 else call.input.unsqueeze(0)
        h = h_out.reshape(x.shape[0], *h_out.shape[-(d + 1):])
        k = _ntuple(m.kernel_size, d)
        s = _ntuple(m.stride if m.stride is not None else m.kernel_size, d)
        p = _ntuple(m.padding, d)
        pool = F.avg_pool2d if d == 2 else F.avg_pool3d
        backward = torch.ops.aten.avg_pool2d_backward if d == 2 else torch.ops.aten.avg_pool3d_backward
        ones = x.new_ones((1, 1) + tuple(x.shape[2:]))
        mean_of_ones = pool(ones, k, s, p, m.ceil_mode, m.count_include_pad, m.divisor_override)
        window_count = pool(ones, k, s, p, m.ceil_mode, True, 1)  # non-padding entries per window
        coeff = torch.where(window_count > 0, mean_of_ones / window_count.clamp(min=1), torch.zeros_like(window_count))
        h_in = backward((coeff * h).contiguous(), x, list(k), list(s), list(p), m.ceil_mode, m.count_include_pad, m.divisor_override)
        return h_in.view_as(call.input)


class AvgPool2dRule(_AvgPoolRule):
    dims = 2


class AvgPool3dRule(_AvgPoolRule):
    dims = 3


def _window_sizes(n_in: int, n_out: int, like: torch.Tensor) -> torch.Tensor:
    """(n_out,) sizes of adaptive pooling's windows, ``⌈(i+1)·n_in/n_out⌉ − ⌊i·n_in/n_out⌋``, on ``like``'s device."""
    i = torch.arange(n_out, device=like.device)
    return ((i + 1) * n_in + n_out - 1).div(n_out, rounding_mode="floor").sub_((i * n_in).div(n_out, rounding_mode="floor")).to(like.dtype)


class AdaptiveAvgPool2dRule(HessianRule):
    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        x = call.input if call.input.dim() == 4 else call.input.unsqueeze(0)
        h = h_out.reshape(x.shape[0], *h_out.shape[-3:])
        (h_in_, w_in), (h_o, w_o) = x.shape[-2:], h.shape[-2:]
        # window sizes built on the device: a host tensor copied per call would synchronise (and break a CUDA-graph capture)
        rows = _window_sizes(h_in_, h_o, x)
        cols = _window_sizes(w_in, w_o, x)
        coeff = 1.0 / torch.outer(rows, cols)
        h_in = torch.ops.aten._adaptive_avg_pool2d_backward((coeff * h).contiguous(), x)
        return h_in.view_as(call.input)


def _ntuple(v, n: int):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


register_rule(nn.MaxPool2d, MaxPool2dRule())
register_rule(nn.AdaptiveMaxPool2d, AdaptiveMaxPool2dRule())
register_rule(nn.AvgPool2d, AvgPool2dRule())
register_rule(nn.AdaptiveAvgPool2d, AdaptiveAvgPool2dRule())
register_rule(nn.MaxPool3d, MaxPool3dRule())
register_rule(nn.AdaptiveMaxPool3d, AdaptiveMaxPool3dRule())
register_rule(nn.AvgPool3d, AvgPool3dRule())
