"""The rule of ``nn.Conv3d``: bayesnas-appendix C.2 on volumes (the 3-D poolings are in ``pooling.py``).

The maths is that of :class:`~nasdiag.hessian.rules.affine.Conv2dRule`; only the kernels differ, because ``F.unfold`` (which the 2-D rule uses for its cheap feature-mean terms) has no 3-D
form. Here every term is a convolution backward: with the output diagonal replaced by its channel mean E(h),
one sample of ``x²`` summed over the batch carries the weight term (``Σ_rows M² ⊗ E(h)`` is the weight-gradient
of ``Σ_n x_n²`` against E(h)), and one sample of E(h) the input term.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from nasdiag.hessian.rules.affine import ConvRule, _conv_padding
from nasdiag.hessian.rules.base import ModuleCall, UnsupportedModuleError, channel_mean, register_rule

__all__ = ["Conv3dRule"]

_SPACE = (2, 3, 4)


class Conv3dRule(ConvRule):
    """``nn.Conv3d`` (grouped, dilated, strided, zero padding): C.2.1-C.2.3 with rows over batch and volume.

    diag: ``H_W`` = the conv3d weight-gradient of ``x²`` against ``h_out``; ``H_x`` = the conv3d input-gradient
    of ``h_out`` through ``W∘W``. approx (C.2.4-C.2.5): the same with ``h_out`` replaced by its per-channel mean
    over batch and volume, and ``H_x`` averaged per input channel and broadcast (as ``Conv2dRule``).
    """

    def _geometry(self, call: ModuleCall):
        if call.input.dim() != 5:
            raise UnsupportedModuleError(
                f"module {call.name!r}: the Conv3d rule needs batched (N, C, D, H, W) input, got {tuple(call.input.shape)}; "
                "add the batch dimension or use mode='exact'"
            )
        m = call.module
        return m.stride, _conv_padding(m), m.dilation, m.groups

    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        geometry = self._geometry(call)
        w2 = call.params["weight"].square()
        return torch.nn.grad.conv3d_input(call.input.shape, w2, h_out.contiguous(), *geometry)

    def param_diag(self, call: ModuleCall, h_out: torch.Tensor) -> Dict[str, torch.Tensor]:
        geometry = self._geometry(call)
        h_out = h_out.contiguous()
        out = {"weight": torch.nn.grad.conv3d_weight(call.input.square(), call.params["weight"].shape, h_out, *geometry)}
        if "bias" in call.params:
            out["bias"] = h_out.sum((0,) + _SPACE)
        return out

    def _mean_sample(self, h_out: torch.Tensor) -> torch.Tensor:
        """E(h) per output channel as one sample (1, C_out, *volume)."""
        return channel_mean(h_out, (0,) + _SPACE).view(1, -1, 1, 1, 1).expand(1, *h_out.shape[1:]).contiguous()

    def input_approx(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        geometry = self._geometry(call)
        x = call.input
        folded = torch.nn.grad.conv3d_input((1,) + tuple(x.shape[1:]), call.params["weight"].square(),
                                            self._mean_sample(h_out), *geometry)
        return folded.mean(_SPACE, keepdim=True).expand(x.shape)

    def param_approx(self, call: ModuleCall, h_out: torch.Tensor) -> Dict[str, torch.Tensor]:
        geometry = self._geometry(call)
        x2 = call.input.square().sum(0, keepdim=True)
        out = {"weight": torch.nn.grad.conv3d_weight(x2, call.params["weight"].shape, self._mean_sample(h_out), *geometry)}
        if "bias" in call.params:
            out["bias"] = channel_mean(h_out, (0,) + _SPACE) * (h_out.numel() // h_out.shape[1])
        return out


register_rule(nn.Conv3d, Conv3dRule())
