"""Rules for normalization layers: BatchNorm, InstanceNorm, GroupNorm (incl. ``GroupNorm(1, C)`` as
LayerNorm over (C, H, W)) and LayerNorm.

Treatment of the statistics. With batch (or instance / group) statistics, ``y = γ x̂ + β`` with
``x̂_q = (x_q − μ)/σ`` and ``σ = sqrt(var + eps)`` (biased variance) over a group of M elements, so
every output of a group depends on every input of it. The diagonal rule is *exact through the
statistics*: with ``h̃ = γ² h_out`` and ``g̃ = γ g`` (γ folded in),

    (J∘J)ᵀ h̃ |_p = σ⁻² [ h̃_p (1 − 2(1 + x̂_p²)/M) + (S0 + 2 x̂_p S1 + x̂_p² S2)/M² ],   S_k = Σ_q x̂_q^k h̃_q
    Σ_q g̃_q ∂²x̂_q/∂x_p² = −σ⁻²/M [ 2 x̂_p (g̃_p − G0/M − x̂_p G1/M) + (1 − 1/M − x̂_p²/M) G1 ],
                                                                  G0 = Σ_q g̃_q,  G1 = Σ_q g̃_q x̂_q

(derived from ``∂x̂_q/∂x_p = (δ_qp − 1/M − x̂_q x̂_p/M)/σ``; costs a few elementwise passes). The
alternative, ``NormRule(through_statistics=False)``, treats the layer as the per-batch affine map
``x ↦ γ (x − μ)/σ + β`` with μ, σ frozen: ``H_x = (γ/σ)² h_out``, no residual. docs/hessian.md
measures the difference. In eval mode with running statistics the layer *is* affine, and both agree.

Parameters (diagonal, exact when ``h_out`` is diagonal): ``H_γ = Σ x̂² h_out``, ``H_β = Σ h_out`` over
everything but the affine axes.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import nn

from nasdiag.hessian.rules.base import HessianRule, ModuleCall, UnsupportedModuleError, register_rule
from nasdiag.rules import BATCH, SPATIAL

__all__ = ["NormRule"]


class NormRule(HessianRule):
    """Rule for ``nn.BatchNorm{1,2,3}d``, ``nn.InstanceNorm{1,2,3}d``, ``nn.GroupNorm``, ``nn.LayerNorm``.

    Args:
        through_statistics: True (default): exact diagonal through the batch/instance/group statistics.
            False: the per-batch affine map (statistics held constant), for comparison.
    """

    param_names = ("weight", "bias")

    def __init__(self, through_statistics: bool = True):
        self.through_statistics = through_statistics

    def needs_grad_output(self, module: nn.Module) -> bool:
        return self.through_statistics and _uses_batch_statistics(module)

    def additive_params(self, module: nn.Module) -> Dict[str, frozenset]:
        if getattr(module, "bias", None) is None:
            return {}
        # β is per channel (BatchNorm, InstanceNorm, GroupNorm), per normalized element (LayerNorm)
        return {"bias": frozenset((BATCH,)) if isinstance(module, nn.LayerNorm) else frozenset((BATCH, SPATIAL))}

    def check(self, module: nn.Module, name: str) -> None:
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
            module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
        ):
            raise UnsupportedModuleError(f"module {name!r}: {type(module).__name__} (synchronized BN) is not supported")

    # -- geometry ---------------------------------------------------------------------------
    def _layout(self, call: ModuleCall, t: torch.Tensor) -> torch.Tensor:
        """``t`` reshaped so that each normalization group is a reduction over ``dims``."""
        m = call.module
        if isinstance(m, nn.GroupNorm):
            return t.reshape(t.shape[0], m.num_groups, -1)
        return t

    def _dims(self, call: ModuleCall) -> Tuple[int, ...]:
        m, x = call.module, call.input
        if isinstance(m, nn.GroupNorm):
            return (2,)
        if isinstance(m, nn.LayerNorm):
            return tuple(range(x.dim() - len(m.normalized_shape), x.dim()))
        if isinstance(m, nn.modules.instancenorm._InstanceNorm):
            if x.dim() != m._get_no_batch_dim() + 1:
                raise UnsupportedModuleError(
                    f"module {call.name!r}: the {type(m).__name__} rule needs a batched input, got {tuple(x.shape)}; "
                    "add the batch dimension or use mode='exact'"
                )
            return tuple(range(2, x.dim()))
        return (0,) + tuple(range(2, x.dim()))  # BatchNorm: per channel over batch and space

    def _affine_shape(self, call: ModuleCall) -> Tuple[int, ...]:
        m, x = call.module, call.input
        if isinstance(m, nn.LayerNorm):
            return tuple(m.normalized_shape)
        return (1, x.shape[1]) + (1,) * (x.dim() - 2)

    def _gamma(self, call: ModuleCall):
        w = call.params.get("weight")
        return None if w is None else w.reshape(self._affine_shape(call))

    def _param_sum_dims(self, call: ModuleCall) -> Tuple[int, ...]:
        m, x = call.module, call.input
        if isinstance(m, nn.LayerNorm):
            return tuple(range(x.dim() - len(m.normalized_shape)))
        return (0,) + tuple(range(2, x.dim()))

    def _normalized(self, call: ModuleCall) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(x̂, 1/σ)``, x̂ in the input's shape, 1/σ in the grouped layout (keepdim)."""
        m, x = call.module, call.input
        if _uses_batch_statistics(m):
            xs, dims = self._layout(call, x), self._dims(call)
            saved = _saved_batch_statistics(call)
            if saved is not None:  # the forward's own μ and 1/σ: no second pass over the input
                shape = self._affine_shape(call)
                mean, inv_std = saved[0].reshape(shape), saved[1].reshape(shape)
            else:
                var, mean = torch.var_mean(xs, dims, unbiased=False, keepdim=True)
                inv_std = torch.rsqrt(var + m.eps)
            return ((xs - mean) * inv_std).reshape(x.shape), inv_std
        shape = self._affine_shape(call)
        inv_std = torch.rsqrt(m.running_var.reshape(shape) + m.eps)
        return (x - m.running_mean.reshape(shape)) * inv_std, inv_std

    # -- rules ------------------------------------------------------------------------------
    def input_diag(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        m = call.module
        x_hat, inv_std = self._normalized(call)
        gamma = self._gamma(call)
        h_t = h_out if gamma is None else gamma.square() * h_out
        if not _uses_batch_statistics(m):
            return inv_std.square() * h_t  # running statistics: an affine map, exactly
        if not self.through_statistics:
            return (inv_std.square() * self._layout(call, h_t)).reshape(x_hat.shape)
        dims = self._dims(call)
        xs, hs = self._layout(call, x_hat), self._layout(call, h_t)
        M = xs.numel() // _numel_outside(xs, dims)
        x2 = xs.square()
        s0, s1, s2 = (hs.sum(dims, keepdim=True), (xs * hs).sum(dims, keepdim=True), (x2 * hs).sum(dims, keepdim=True))
        h_in = hs * (1 - 2 * (1 + x2) / M) + (s0 + 2 * xs * s1 + x2 * s2) / M**2
        g = call.grad_output
        g_t = self._layout(call, g if gamma is None else gamma * g)
        g0, g1 = g_t.sum(dims, keepdim=True), (g_t * xs).sum(dims, keepdim=True)
        h_in = h_in - (2 * xs * (g_t - g0 / M - xs * g1 / M) + (1 - 1 / M - x2 / M) * g1) / M
        return (inv_std.square() * h_in).reshape(x_hat.shape)

    def input_approx(self, call: ModuleCall, h_out: torch.Tensor) -> torch.Tensor:
        """Feature-mean version for BatchNorm/InstanceNorm through their statistics: the mean over each
        normalization group (a channel, or a channel of one sample) of :meth:`input_diag`, from five
        sums per group instead of the full elementwise formula; broadcast back over the group. Where a
        linear layer produced the norm's input, its feature mean takes this same mean anyway; through an
        activation in between, the activation then sees C.2.5's ``E(σ'²) E(h)`` instead of ``E(σ'² h)``
        (docs/hessian.md, the ``approx`` row)."""
        m = call.module
        if not (self.through_statistics and _uses_batch_statistics(m)) or isinstance(m, (nn.GroupNorm, nn.LayerNorm)):
            return self.input_diag(call, h_out)
        x_hat, inv_std = self._normalized(call)
        gamma = self._gamma(call)
        h_t = h_out if gamma is None else gamma.square() * h_out
        g_t = call.grad_output if gamma is None else gamma * call.grad_output
        dims = self._dims(call)
        M = x_hat.numel() // _numel_outside(x_hat, dims)
        x2 = x_hat.square()
        s0, s2 = h_t.sum(dims, keepdim=True), (x2 * h_t).sum(dims, keepdim=True)
        g1 = (g_t * x_hat).sum(dims, keepdim=True)
        a = inv_std.square()
        m2 = 1 - m.eps * a  # = mean of x̂² = var/(var + eps) (the mean of x̂ is 0), without a pass
        # mean over the group of the through-statistics term  s0/M − 2(s0 + s2)/M² + (s0 + m2·s2)/M²  plus the
        # residual  −[2g1/M − 2·m2·g1/M + (1 − 1/M − m2/M)·g1]/M, collected as  A + m2·B  (few kernels on (C,)):
        A = torch.add(s0 * (1 / M - 1 / M**2), s2, alpha=-2 / M**2).add_(g1, alpha=-(1 + 1 / M) / M)
        B = torch.add(s2 * (1 / M**2), g1, alpha=3 / M**2)
        return (a * torch.addcmul(A, m2, B)).expand(x_hat.shape)

    def param_diag(self, call: ModuleCall, h_out: torch.Tensor) -> Dict[str, torch.Tensor]:
        out = {}
        dims = self._param_sum_dims(call)
        if "weight" in call.params:
            x_hat, _ = self._normalized(call)
            out["weight"] = (x_hat.square() * h_out).sum(dims).reshape(call.params["weight"].shape)
        if "bias" in call.params:
            out["bias"] = h_out.sum(dims).reshape(call.params["bias"].shape)
        return out


def _numel_outside(t: torch.Tensor, dims: Tuple[int, ...]) -> int:
    n = 1
    for d in range(t.dim()):
        if d not in dims:
            n *= t.shape[d]
    return n


#: autograd nodes of ``F.batch_norm`` in training mode and the names of their saved batch mean and 1/σ
#: (torch's native kernels save ``invstd``; cuDNN's ``save_var`` is its "saved inverse variance", 1/σ too)
_SAVED_BATCH_STATISTICS = {
    "NativeBatchNormBackward0": ("_saved_result1", "_saved_result2"),
    "CudnnBatchNormBackward0": ("_saved_result1", "_saved_result2"),
}


def _saved_batch_statistics(call: ModuleCall):
    """``(μ, 1/σ)`` (C,) that a BatchNorm's training forward saved for its backward, or None (another norm,
    no autograd graph, an unknown kernel): read from the output's autograd node instead of recomputed."""
    m = call.module
    if not isinstance(m, nn.modules.batchnorm._BatchNorm):
        return None
    fn = getattr(call._output, "grad_fn", None)
    names = _SAVED_BATCH_STATISTICS.get(type(fn).__name__) if fn is not None else None
    if names is None:
        return None
    try:
        mean, inv_std = getattr(fn, names[0]), getattr(fn, names[1])
    except (AttributeError, RuntimeError):  # freed (backward already ran without retain_graph) or renamed
        return None
    C = call._input.shape[1]
    if not all(isinstance(t, torch.Tensor) and t.shape == (C,) and t.dtype == call._input.dtype for t in (mean, inv_std)):
        return None
    return mean, inv_std


def _uses_batch_statistics(m: nn.Module) -> bool:
    """Whether the forward normalizes with statistics of the current input (as ``F.batch_norm`` /
    ``F.instance_norm`` decide it)."""
    if isinstance(m, (nn.GroupNorm, nn.LayerNorm)):
        return True
    if isinstance(m, nn.modules.instancenorm._InstanceNorm):
        return m.training or not m.track_running_stats
    return m.training or m.running_mean is None


for _norm in (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.GroupNorm,
    nn.LayerNorm,
):
    register_rule(_norm, NormRule())
