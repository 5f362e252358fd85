"""Rules for elementwise activations and shape-only modules.

An elementwise ``y = σ(x)`` has a diagonal Jacobian, so (bayesnas-appendix C.1.5 / C.2.2)

    H_x = σ'(x)² ∘ h_out + σ''(x) ∘ g,      g = ∂L/∂y,

the ``B² H + D`` of the appendix (its ``B_i = σ'(H_i)`` in C.1.5 is a typo for ``σ'(h_i)``, as C.1.3
has it). The text's ``D_i = σ''(h_i) ∘ ∂L/∂a_i`` is this same second term. With the feature-mean
approximation the next linear layer averages ``H_x`` over rows, which gives C.2.5's ``E(σ'²) E(h) +
E(σ'' g)`` when ``h`` is constant per channel.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from nasdiag.hessian.rules.base import HessianRule, ModuleCall, UnsupportedModuleError, register_rule

__all__ = ["CircularPadRule", "ElementwiseRule", "IdentityRule", "ReshapeRule"]


class ElementwiseRule(HessianRule):
    """Rule for any elementwise module ``y = fn(x)``.

    Args:
        fn: the elementwise function; ``None`` calls the module's ``forward`` (without its hooks). Its first and second
            derivatives are taken by forward-mode autodiff (``torch.func.jvp``), so any function made of
            differentiable elementwise torch ops works, e.g. ``register_rule(nn.GELU, ElementwiseRule())``.
        piecewise_linear: declare ``fn''`` ≡ 0 (ReLU-like), which skips the residual term and the
            gradient it needs.

    Subclasses may override :meth:`derivatives` with closed forms.
    """

    def __init__(self, fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, piecewise_linear: bool = False):
        self.fn = fn
        self.piecewise_linear = piecewise_linear

    def needs_grad_output(self, module: nn.Module) -> bool:
        return not self.piecewise_linear

    def check(self, module: nn.Module, name: str) -> None:
        if getattr(module, "inplace", False):
            raise UnsupportedModuleError(
                f"module {name!r} ({type(module).__name__}) runs inplace, so its input is gone when the rule needs "
                "it; set inplace=False"
            )

    def derivatives(self, call: ModuleCall) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(σ'(x), σ''(x))`` elementwise, ``σ''`` None when identically zero."""
        # the module's own function: its forward, not its __call__, which would run the user's hooks on it again (a
        # pre-hook's change of the input, a forward hook's of the output: already in the traced input, walked as glue)
        fn = self.fn if self.fn is not None else call.module.forward
        x = call.input
        ones = torch.ones_like(x)

        def first(t):
            return torch.func.jvp(fn, (t,), (ones,))[1]

        try:
            if self.piecewise_linear:  # σ'' ≡ 0 is declared: no second derivative asked of torch (Hardsigmoid has none)
                return first(x), None
            d1, d2 = torch.func.jvp(first, (x,), (ones,))
        except NotImplementedError:  # no forward-over-forward AD for an op (torch 2.13, no_grad: aten::silu_backward)
            d1, d2 = _reverse_derivatives(fn, x, call, self.piecewise_linear)
        return d1, (None if self.piecewise_linear else d2)

    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        d1, d2 = self.derivatives(call)
        h_in = d1.square() * h_out
        if d2 is not None:
            h_in = h_in + d2 * call.grad_output
        return h_in


def _reverse_derivatives(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, call: ModuleCall,
                         piecewise_linear: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(σ'(x), σ''(x))`` by two reverse passes: for an elementwise σ the gradient of ``Σ σ(x)`` is σ'(x), and
    that of ``Σ σ'(x)`` is σ''(x) (not taken for a ``piecewise_linear`` σ). An op without a second derivative in
    torch (``aten::hardsigmoid_backward``) is one line naming the module, not torch's bare ``RuntimeError``."""
    with torch.enable_grad():
        t = x.detach().requires_grad_(True)
        (d1,) = torch.autograd.grad(fn(t).sum(), t, create_graph=not piecewise_linear)
        try:
            d2 = None if piecewise_linear or not d1.requires_grad else torch.autograd.grad(d1.sum(), t, allow_unused=True)[0]
        except RuntimeError as err:
            if "is not implemented" not in str(err):
                raise
            raise UnsupportedModuleError(
                f"module {call.name!r} ({type(call.module).__name__}): torch has no second derivative of its function "
                f"({str(err).splitlines()[0]}); if it is piecewise linear, give it ElementwiseRule(piecewise_linear=True) "
                "(rules= or register_rule), else a rule whose derivatives() returns σ'' in closed form"
            ) from None
    return d1.detach(), (torch.zeros_like(x) if d2 is None else d2)


class ReLURule(ElementwiseRule):
    def __init__(self):
        super().__init__(piecewise_linear=True)

    def check(self, module, name):
        pass  # inplace is fine: the rule reads the output

    def derivatives(self, call):
        # From the output: an inplace ReLU overwrote its input, and out > 0 ⇔ x > 0.
        return (call.output > 0).to(call.output.dtype), None

    def input_diag(self, call, h_out):
        return h_out * (call.output > 0)  # σ' ∈ {0, 1}: σ'² h = mask · h, one pass


class LeakyReLURule(ElementwiseRule):
    def __init__(self):
        super().__init__(piecewise_linear=True)

    def check(self, module, name):
        if module.inplace and module.negative_slope < 0:
            raise UnsupportedModuleError(
                f"module {name!r}: inplace LeakyReLU with a negative slope loses the sign of its input; set inplace=False"
            )

    def derivatives(self, call):
        slope = call.module.negative_slope
        # σ'(x) = 1 for x > 0, else the slope. With a slope ≥ 0, out > 0 ⇔ x > 0 (an inplace call has only its
        # output); with a negative slope every x ≠ 0 gives out > 0, so the sign must come from the input (the
        # check refuses an inplace call there).
        x = call.output if slope >= 0 else call.input
        return torch.where(x > 0, torch.ones_like(x), torch.full_like(x, slope)), None


class SigmoidRule(ElementwiseRule):
    def derivatives(self, call):
        s = call.output
        d1 = s * (1 - s)
        return d1, d1 * (1 - 2 * s)


class TanhRule(ElementwiseRule):
    def derivatives(self, call):
        t = call.output
        d1 = 1 - t.square()
        return d1, -2 * t * d1


class HardsigmoidRule(ElementwiseRule):
    """``relu6(x + 3) / 6``: σ' = 1/6 on (−3, 3), σ'' ≡ 0. In closed form: torch has no second derivative of it, and
    its first derivative in float64 is float32's 1/6 (3e-8 off)."""

    def __init__(self):
        super().__init__(piecewise_linear=True)

    def derivatives(self, call):
        x = call.input
        return ((x > -3) & (x < 3)).to(x.dtype) / 6, None


class IdentityRule(HessianRule):
    """``y = x`` (also a no-op ``nn.Dropout`` in eval mode is traced through, not ruled)."""

    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        return h_out


class ReshapeRule(HessianRule):
    """``nn.Flatten`` / ``nn.Unflatten``: a permutation-free reshape, Jacobian entries 0/1."""

    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        return h_out.reshape(call.input.shape)


class CircularPadRule(HessianRule):
    """``nn.CircularPad{1,2,3}d``: every output entry is a copy of one input entry (Jacobian entries 0/1, an input
    entry copied to one or more outputs), so ``(J∘J)ᵀ h = Jᵀ h``, the pad's own backward applied to ``h``; no
    residual (the map is linear). torch writes circular padding as in-place copies into a new tensor (autograd's
    ``CopySlices``, which the glue walk cannot cross), so it is a rule leaf; the reflection/replication pads, one
    autograd op each, are crossed as glue."""

    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x = call.input.detach().requires_grad_(True)
            y = torch.nn.functional.pad(x, call.module.padding, "circular")
            return torch.autograd.grad(y, x, h_out)[0]


register_rule(nn.ReLU, ReLURule())
for _circular in (nn.CircularPad1d, nn.CircularPad2d, nn.CircularPad3d):
    register_rule(_circular, CircularPadRule())
register_rule(nn.LeakyReLU, LeakyReLURule())
register_rule(nn.Sigmoid, SigmoidRule())
register_rule(nn.Tanh, TanhRule())
register_rule(nn.Identity, IdentityRule())
register_rule(nn.Flatten, ReshapeRule())
register_rule(nn.Unflatten, ReshapeRule())
for _smooth in (nn.GELU, nn.SiLU, nn.ELU, nn.Softplus):
    register_rule(_smooth, ElementwiseRule())
register_rule(nn.Hardsigmoid, HardsigmoidRule())
for _kinked in (nn.ReLU6, nn.Hardtanh):
    register_rule(_kinked, ElementwiseRule(piecewise_linear=True))
