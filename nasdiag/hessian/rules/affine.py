"""Rules for the layers with weights: ``nn.Linear`` (bayesnas-appendix C.1) and ``nn.Conv2d`` (C.2).

Batch convention: the diagonals are of exactly the scalar loss the caller differentiates; the
per-row sums below are *sums* over batch (and spatial) rows. The appendix's C.2.3 averages the
per-row Hessians (1/(b·H·W) Σ_n); that matches a loss averaged over rows, which the mean-reduced loss
already contributes through ``h_out``, so no extra factor appears here.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian.rules.base import HessianRule, ModuleCall, UnsupportedModuleError, channel_mean, register_rule
from nasdiag.rules import BATCH, SPATIAL

__all__ = ["LinearRule", "ConvRule", "Conv2dRule"]


def _bias_is_additive(module: nn.Module) -> Dict[str, frozenset]:
    # the bias adds a per-output-channel term: constant along the batch and the spatial (leading) axes
    return {"bias": frozenset((BATCH, SPATIAL))} if getattr(module, "bias", None) is not None else {}


class LinearRule(HessianRule):
    """``y = x Wᵀ + b`` over rows ``x`` of shape (..., in).

    diag (C.1.4-C.1.5): ``H_W = Σ_rows h_out ⊗ x²``, ``H_b = Σ_rows h_out``, ``H_x = h_out (W∘W)``.
    approx (FC analogue of C.2.4-C.2.5): ``h_out`` replaced by its mean over rows ``E(h)``, so
    ``H_W = E(h) ⊗ Σ_rows x²`` and ``H_x = E(h) (W∘W)`` broadcast to every row.
    """

    param_names = ("weight", "bias")

    def additive_params(self, module: nn.Module) -> Dict[str, frozenset]:
        return _bias_is_additive(module)

    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        return h_out @ call.params["weight"].square()

    def param_diag(self, call: ModuleCall, h_out: torch.Tensor) -> Dict[str, torch.Tensor]:
        x = call.input
        rows_h = h_out.reshape(-1, h_out.shape[-1])
        out = {"weight": rows_h.T @ x.reshape(-1, x.shape[-1]).square()}
        if "bias" in call.params:
            out["bias"] = rows_h.sum(0)
        return out

    def input_approx(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        h_mean = channel_mean(h_out, tuple(range(h_out.dim() - 1)))
        return (h_mean @ call.params["weight"].square()).expand(call.input.shape)

    def param_approx(self, call: ModuleCall, h_out: torch.Tensor) -> Dict[str, torch.Tensor]:
        x = call.input
        h_mean = channel_mean(h_out, tuple(range(h_out.dim() - 1)))
        out = {"weight": torch.outer(h_mean, x.reshape(-1, x.shape[-1]).square().sum(0))}
        if "bias" in call.params:
            out["bias"] = (h_out.numel() // h_out.shape[-1]) * h_mean
        return out


def _conv_padding(module: nn.Conv2d, name: Optional[str] = None, shown: Optional[nn.Module] = None) -> Tuple[int, int]:
    """The zero padding per spatial dim; ``name`` and ``shown`` (the user's module where ``module`` stands in
    for it, a lifted ``Conv1d``) word the refusal of an asymmetric ``padding='same'``."""
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return (0,) * len(module.kernel_size)
        pads = []
        for k, d in zip(module.kernel_size, module.dilation):
            total = d * (k - 1)
            if total % 2:
                shown = module if shown is None else shown
                where = f"module {name!r}: " if name is not None else ""
                raise UnsupportedModuleError(
                    f"{where}{type(shown).__name__} with padding='same' and an even effective kernel pads asymmetrically "
                    f"({shown}); pad explicitly or use mode='exact'"
                )
            pads.append(total // 2)
        return tuple(pads)
    return tuple(module.padding)


def _tap_counts(x: torch.Tensor, kernel, stride, padding, dilation) -> torch.Tensor:
    """``(n_kk,)`` on ``x``'s device and dtype: for each kernel tap kk (row-major), the number of output positions
    whose tap lands on a real input pixel rather than padding. Unfolding an image of ones with the conv's geometry
    marks exactly those (padding unfolds as 0); computed on the device, so the rule never waits for the host."""
    ones = x.new_ones((1, 1) + tuple(x.shape[2:]))
    return F.unfold(ones, kernel, dilation=dilation, padding=padding, stride=stride).sum(-1).view(-1)


class ConvRule(HessianRule):
    """What the convolution rules share: a weight and an optional bias (constant along batch and space), zero
    padding only."""

    param_names = ("weight", "bias")

    def additive_params(self, module: nn.Module) -> Dict[str, frozenset]:
        return _bias_is_additive(module)

    def check(self, module: nn.Module, name: str, shown: Optional[nn.Module] = None) -> None:
        """``shown``: the user's module when ``module`` is its 2-D stand-in (``Conv1d``), named in the message."""
        if module.padding_mode != "zeros":
            raise UnsupportedModuleError(
                f"module {name!r}: {type(module if shown is None else shown).__name__} with padding_mode="
                f"{module.padding_mode!r} has no diagonal-Hessian rule (only zero padding); use mode='exact'"
            )
        _conv_padding(module, name, shown)


class Conv2dRule(ConvRule):
    """``nn.Conv2d`` (grouped/depthwise, dilated, strided, zero padding) as an FC layer on unfolded rows.

    diag (C.2.1-C.2.3): each of the ``b·H_out·W_out`` rows of the unfolded input M is an FC input, so
    ``H_W = Σ_rows M² ⊗ h_row`` = the weight-gradient of the convolution evaluated with input ``x²``
    and output-gradient ``h_out`` (unfolding copies entries, so ``unfold(x)² = unfold(x²)``);
    ``H_x = (W∘W)ᵀ h`` per row, folded back = the input-gradient of a convolution with weight ``W∘W``.

    approx (C.2.4-C.2.5): ``h_out`` replaced by its per-channel mean ``E(h)`` over batch and space:
    ``H_W = (Σ_rows M²) ⊗ E(h)`` and ``H_x`` the per-channel mean of ``(W∘W)ᵀ E(h)`` folded back,
    i.e. ``Σ_{c_out, tap} W² E(h) · (rows that use the tap) / (H_in W_in)``, broadcast over batch and
    space. The text copy of C.2.4 prints ``E(M_i)^2``; under the stated independence of M and H the
    factor is the mean of the *square*, ``E(M²)`` (``E(M)²`` would drop the variance), which we use.
    Likewise C.2.5's ``(B_i)²`` with ``B_i = E(σ')`` is applied by the activation rule as ``E(σ'²)``.
    """

    def _geometry(self, call: ModuleCall):
        m = call.module
        if call.input.dim() != 4:
            raise UnsupportedModuleError(
                f"module {call.name!r}: the Conv2d rule needs batched (N, C, H, W) input, got {tuple(call.input.shape)}; "
                "add the batch dimension or use mode='exact'"
            )
        return m.stride, _conv_padding(m), m.dilation, m.groups

    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        stride, padding, dilation, groups = self._geometry(call)
        w2 = call.params["weight"].square()
        return torch.nn.grad.conv2d_input(call.input.shape, w2, h_out.contiguous(), stride, padding, dilation, groups)

    def param_diag(self, call: ModuleCall, h_out: torch.Tensor) -> Dict[str, torch.Tensor]:
        stride, padding, dilation, groups = self._geometry(call)
        w = call.params["weight"]
        h_out = h_out.contiguous()
        out = {"weight": torch.nn.grad.conv2d_weight(call.input.square(), w.shape, h_out, stride, padding, dilation, groups)}
        if "bias" in call.params:
            out["bias"] = h_out.sum((0, 2, 3))
        return out

    def input_approx(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        stride, padding, dilation, groups = self._geometry(call)
        x, w = call.input, call.params["weight"]
        c_out, c_per_group = w.shape[0], w.shape[1]
        h_mean = channel_mean(h_out, (0, 2, 3)).view(groups, c_out // groups, 1)
        taps = _tap_counts(x, w.shape[2:], stride, padding, dilation) / (x.shape[2] * x.shape[3])
        tap_weighted = (w.square().flatten(2) @ taps).view(groups, c_out // groups, c_per_group)
        h_in = (tap_weighted * h_mean).sum(1)  # Σ_{c_out in the group} per input channel
        return h_in.view(1, -1, 1, 1).expand(x.shape)

    def param_approx(self, call: ModuleCall, h_out: torch.Tensor) -> Dict[str, torch.Tensor]:
        stride, padding, dilation, groups = self._geometry(call)
        x, w = call.input, call.params["weight"]
        c_out, c_per_group = w.shape[0], w.shape[1]
        h_mean = channel_mean(h_out, (0, 2, 3))
        # Σ over the b·H_out·W_out rows of the unfolded input squared, per (c_in, tap)
        x2 = x.square().sum(0, keepdim=True)
        rows_m2 = F.unfold(x2, w.shape[2:], dilation=dilation, padding=padding, stride=stride).sum(-1)
        rows_m2 = rows_m2.view(groups, 1, c_per_group, -1)
        h_w = h_mean.view(groups, c_out // groups, 1, 1) * rows_m2
        out = {"weight": h_w.reshape(w.shape)}
        if "bias" in call.params:
            out["bias"] = h_mean * (h_out.numel() // h_out.shape[1])
        return out


register_rule(nn.Linear, LinearRule())
register_rule(nn.Conv2d, Conv2dRule())
