"""1-D layers through the rules of their 2-D counterparts.

A 1-D convolution or pooling over (N, C, L) is the 2-D one over (N, C, 1, L) with kernel, stride, padding and
dilation (1, ·) on the added axis, entry for entry: the same outputs, Jacobians and second derivatives. So
``nn.Conv1d`` gets C.2.1-C.2.5 (bayesnas-appendix) from :class:`~nasdiag.hessian.rules.affine.Conv2dRule`, and the
1-D poolings their exact rules from :mod:`nasdiag.hessian.rules.pooling`, without a second copy of the maths:
:class:`Lifted1dRule` reshapes the call (input, output, weight, ``h_out``) and the results, and hands the 2-D rule
an equivalent module that carries only the geometry (on the meta device: no memory, the parameters travel in the
call).
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
from torch import nn

from nasdiag.hessian.rules.affine import Conv2dRule, ConvRule
from nasdiag.hessian.rules.base import HessianRule, ModuleCall, UnsupportedModuleError, register_rule
from nasdiag.hessian.rules.pooling import AdaptiveAvgPool2dRule, AdaptiveMaxPool2dRule, AvgPool2dRule, MaxPool2dRule, _MaxPoolRule

__all__ = ["Lifted1dRule"]


def _one(v) -> int:
    return v[0] if isinstance(v, (tuple, list)) else v


def _conv2d(m: nn.Conv1d) -> nn.Conv2d:
    padding = m.padding if isinstance(m.padding, str) else (0, _one(m.padding))
    return nn.Conv2d(m.in_channels, m.out_channels, (1, _one(m.kernel_size)), stride=(1, _one(m.stride)),
                     padding=padding, dilation=(1, _one(m.dilation)), groups=m.groups, bias=m.bias is not None,
                     padding_mode=m.padding_mode, device="meta")


def _max_pool2d(m: nn.MaxPool1d) -> nn.MaxPool2d:
    stride = m.stride if m.stride is not None else m.kernel_size
    return nn.MaxPool2d((1, _one(m.kernel_size)), (1, _one(stride)), (0, _one(m.padding)), (1, _one(m.dilation)),
                        return_indices=m.return_indices, ceil_mode=m.ceil_mode)


def _avg_pool2d(m: nn.AvgPool1d) -> nn.AvgPool2d:
    stride = m.stride if m.stride is not None else m.kernel_size
    return nn.AvgPool2d((1, _one(m.kernel_size)), (1, _one(stride)), (0, _one(m.padding)), ceil_mode=m.ceil_mode,
                        count_include_pad=m.count_include_pad)


class Lifted1dRule(HessianRule):
    """The rule of a 1-D layer as the 2-D rule ``rule2d`` on the input viewed as (N, C, 1, L).

    Args:
        rule2d: the 2-D rule (e.g. ``Conv2dRule()``).
        to_2d: ``module -> equivalent 2-D module`` (geometry only; its parameters are never read).
    """

    def __init__(self, rule2d: HessianRule, to_2d: Callable[[nn.Module], nn.Module]):
        self.rule2d = rule2d
        self.to_2d = to_2d
        self.param_names = rule2d.param_names

    def _lift(self, call: ModuleCall) -> ModuleCall:
        x = call.input
        if x.dim() != 3:
            raise UnsupportedModuleError(
                f"module {call.name!r}: the {type(call.module).__name__} rule needs batched (N, C, L) input, got "
                f"{tuple(x.shape)}; add the batch dimension or use mode='exact'"
            )
        params = {k: (v.unsqueeze(-2) if k == "weight" else v) for k, v in call.params.items()}
        grad = None if call.grad_output is None else call.grad_output.unsqueeze(-2)
        return ModuleCall(call.name, self.to_2d(call.module), x.unsqueeze(-2), call.output.unsqueeze(-2), params, grad)

    @staticmethod
    def _lower(diags: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {k: (v.squeeze(-2) if k == "weight" else v) for k, v in diags.items()}

    def needs_grad_output(self, module: nn.Module) -> bool:
        return self.rule2d.needs_grad_output(self.to_2d(module))

    def check(self, module: nn.Module, name: str) -> None:
        if isinstance(self.rule2d, (ConvRule, _MaxPoolRule)):  # their refusals name the user's 1-D module
            self.rule2d.check(self.to_2d(module), name, shown=module)
        else:
            self.rule2d.check(self.to_2d(module), name)

    def additive_params(self, module: nn.Module) -> Dict[str, frozenset]:
        return self.rule2d.additive_params(module)  # a bias adds a term constant along batch and length alike

    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        return self.rule2d.input_diag(self._lift(call), h_out.unsqueeze(-2)).squeeze(-2)

    def param_diag(self, call: ModuleCall, h_out: torch.Tensor) -> Dict[str, torch.Tensor]:
        return self._lower(self.rule2d.param_diag(self._lift(call), h_out.unsqueeze(-2)))

    def input_approx(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        return self.rule2d.input_approx(self._lift(call), h_out.unsqueeze(-2)).squeeze(-2)

    def param_approx(self, call: ModuleCall, h_out: torch.Tensor) -> Dict[str, torch.Tensor]:
        return self._lower(self.rule2d.param_approx(self._lift(call), h_out.unsqueeze(-2)))


register_rule(nn.Conv1d, Lifted1dRule(Conv2dRule(), _conv2d))
register_rule(nn.MaxPool1d, Lifted1dRule(MaxPool2dRule(), _max_pool2d))
register_rule(nn.AvgPool1d, Lifted1dRule(AvgPool2dRule(), _avg_pool2d))
register_rule(nn.AdaptiveAvgPool1d, Lifted1dRule(AdaptiveAvgPool2dRule(), lambda m: nn.AdaptiveAvgPool2d((1, _one(m.output_size)))))
register_rule(nn.AdaptiveMaxPool1d, Lifted1dRule(AdaptiveMaxPool2dRule(), lambda m: nn.AdaptiveMaxPool2d((1, _one(m.output_size)), m.return_indices)))
