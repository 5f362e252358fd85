"""Round-19 audit of the weight curvature (``diag_hessian``: rules, graph walk, exact routes, loss curvature).

References, all built here from scratch in float64 (never nasdiag's recursions): the dense diagonal by
reverse-over-reverse autograd (``torch.autograd.grad`` twice, one row per entry) through
``torch.func.functional_call``; and this file's own transcription of the diagonal recursion of bayesnas-appendix
C.1.4-C.1.5 / C.2.1-C.2.3 on an ``nn.Sequential``, made generic: at every module the diagonal w.r.t. its input is
``(J∘J)ᵀ h + diag ∂²(gᵀy)/∂x²`` and w.r.t. its parameters ``(J_θ∘J_θ)ᵀ h``, with J the module's dense Jacobian
(``torch.autograd.functional.jacobian``) and g = ∂L/∂y (C.1.5's ``B² W²ᵀ H + D``, which is this for a Linear
followed by an activation); ``approx`` (C.2.4-C.2.5 as docs/hessian.md states it: the output diagonal of every
Linear/Conv replaced by its mean over batch and space per channel, a convolution's and a batch-statistics norm's
input diagonal by its mean per channel / per group).

Checked and found right (scratch sweeps; the sharpest kept below where not already covered by earlier rounds):

* ``diag`` is exact (1e-10) through one module of every registered type between a per-entry parameter ``p ⊙ x`` and
  a separable loss ``Σ t cos(y)``: AvgPool2d/1d/3d with ``divisor_override``, ``ceil_mode`` with and without
  ``count_include_pad``, unbatched (C, H, W) input; MaxPool with dilation, MaxPool1d with padding; AdaptiveAvg/Max
  pooling that upsamples, ``(None, 2)``, unbatched; LayerNorm with ``bias=False`` and without affine; BatchNorm eval,
  ``track_running_stats=False`` in eval; InstanceNorm tracking (eval and train), InstanceNorm1d; GroupNorm on (N, C);
  BatchNorm1d on (N, C); Softplus(beta, threshold), SiLU, Hardtanh, ReLU6, LeakyReLU(−0.2), ELU, GELU, Sigmoid,
  Tanh; Flatten(0), Unflatten; Conv2d with rectangular kernel/stride/padding/dilation, ``padding='same'`` dilated
  grouped; Conv1d 1×1, Conv3d ``'same'`` grouped; Linear on 3-D and 1-D input. ``exact`` equals the dense diagonal
  on all of them (1e-10).
* ``diag`` and ``approx`` equal the own generic recursion (1e-10) on an MLP through Tanh/Sigmoid/Softplus/ELU/GELU,
  an MLP with LayerNorm/SiLU/train BatchNorm1d (label-smoothed cross-entropy), a conv net with strided/dilated/
  depthwise convs, train BatchNorm, MaxPool ``ceil_mode``, AvgPool ``count_include_pad=False`` (summed
  cross-entropy), a conv net with InstanceNorm/GroupNorm/AdaptiveAvgPool (MSE), a Conv1d and a Conv3d net; the only
  entries apart are biases right before a batch-statistics normalization, which the library reports as exactly 0
  (their true value, ≤ 1e-26 by the dense diagonal in 35 compositions of padding, pooling, norms, dropout, shuffles:
  every bias it zeroed is zero, none it kept is). The conv net is kept as
  ``test_diag_and_approx_are_the_own_recursion_on_a_conv_net_of_strides_dilations_groups_and_ceil_pooling``.
* ``exact``'s C.1.2-C.1.3 chain: inplace ReLU/LeakyReLU after a Flatten, one Tanh reused at two places, nested
  Sequentials, a final Sigmoid, ``Flatten(0)``, a negative LeakyReLU slope, 1-D and 3-D inputs: the dense diagonal.
* Inputs requiring grad get no ``.grad``, nor do the parameters; frozen parameters keep their curvature and stay
  frozen; ``params`` subsets; under ``torch.no_grad()``; ``reduction='sum'`` is N × ``'mean'`` in every mode; bad
  targets (float class indices, out of range, another batch), integer inputs, a per-sample loss vector, a
  ``hutchinson:<k>`` whose probes cannot fit: one ``CurvatureError`` line each. ``hutchinson:<k>`` is reproducible
  and leaves the global RNG; every diag_hessian mode leaves no hook, no tensor and no ``.grad`` across 10 calls.
* Functional ops in forward code (F.relu, sigmoid, tanh, flatten, view, max_pool2d, mean, pad constant/reflect,
  scalar affine, slices, cat, softmax, log_softmax, nearest interpolate, permute, where, sum, expand, threshold, flip,
  roll, repeat, index) give the own recursion; F.leaky_relu/gelu/elu/avg_pool2d/hardtanh/silu/softplus, pow, x * x,
  abs, exp, clamp, max/amax are refused in one line naming the op.

Noticed, left alone: a rule of another family given for a module (``rules={nn.Tanh: NormRule()}``) fails inside it
(AttributeError/KeyError), the user's own mismatch; ``padding_mode='reflect'``/``'circular'`` convolutions are refused
by ``diag``/``approx`` even with ``padding=0``, where they are zero-padded convolutions (loud, not wrong); ``x - x.mean``
in container code drops its cross term as documented (a fan-out).

Defects found (each test fails on the library before its fix):

* ``rules=`` (per-call overrides) was read only by the module's exact type: an override of ``nn.BatchNorm2d`` did
  not hold for a subclass of it that keeps its ``forward`` (which the registry's ``nn.BatchNorm2d`` rule covers),
  nor an override keyed by a base class (``_BatchNorm``): the default rule was used, silently (the conv weight 13%
  off the frozen-statistics curvature asked for); a key that is no type (``"BatchNorm2d"``, a module instance) was
  ignored silently; a rule class instead of an instance, or a list, was a bare ``TypeError``/``AttributeError``
  from inside (``register_rule`` of a name, or of a type that has a rule: the registry's bare ``TypeError``/
  ``ValueError``, no ``NasdiagError``) — ``test_per_call_rules_hold_for_subclasses_and_bases_and_bad_ones_are_one_line``;
* the check that the loss does not couple samples (the per-sample recursions' premise) compared two products to 1e3
  ulp of their magnitudes, which in float16/bfloat16 is the whole Hessian: a loss coupling samples as strongly as its
  per-sample terms passed, so ``diag``/``approx`` came out 120% off on the last layer, where ``diag`` is exact, and
  ``exact`` took the per-sample C.1.2-C.1.3 chain on a Linear net: 370% off, silently (docs/hessian.md: a float16/
  bfloat16 model works in every mode; a coupling loss is detected and refused); the check runs on a float32 copy of
  the loss there — ``test_a_loss_coupling_samples_is_caught_in_half_precision_and_exact_stays_exact``;
* ``params=`` given a submodule (``params=model.fc``, the classifier's curvature) or a number was torch's bare
  ``TypeError: 'Linear' object is not iterable`` (a ``Sequential`` was taken apart into modules); one
  ``CurvatureTypeError`` line saying to pass ``list(module.parameters())`` or names —
  ``test_params_given_a_module_or_a_number_is_one_line_and_its_parameters_work``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from nasdiag.hessian import CurvatureError, CurvatureTypeError, diag_hessian
from nasdiag.hessian.rules import ElementwiseRule, NormRule, register_rule

DT = torch.float64


# --- own references ------------------------------------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _diag_of_grad(grad: torch.Tensor, wrt: torch.Tensor) -> torch.Tensor:
    """diag ∂grad/∂wrt, one reverse pass per entry (grad built with create_graph=True)."""
    flat = grad.reshape(-1)
    out = torch.zeros(flat.numel(), dtype=wrt.dtype)
    if not flat.requires_grad:
        return out.view_as(wrt)
    for i in range(flat.numel()):
        (row,) = torch.autograd.grad(flat[i], wrt, retain_graph=True, allow_unused=True)
        if row is not None:
            out[i] = row.reshape(-1)[i]
    return out.view_as(wrt)


def _channel_mean(h, m):
    dims = tuple(range(h.dim() - 1)) if isinstance(m, nn.Linear) else (0,) + tuple(range(2, h.dim()))
    return h.mean(dims, keepdim=True).expand_as(h)


def _own_diag_recursion(layers, loss_fn, x, t, approx=False):
    """C.1.4-C.1.5 / C.2.1-C.2.3 on a list of modules applied in turn, from each module's dense Jacobians:
    ``h_in = (J∘J)ᵀ h + diag ∂²(gᵀy)/∂x²``, ``H_θ = (J_θ∘J_θ)ᵀ h``. Keys ``"<index>.<param>"``.

    ``approx``: C.2.4-C.2.5 as docs/hessian.md states them: the diagonal at a Linear/Conv output replaced by its mean
    over batch and space per channel (so ``H_W = Σ_rows M² ⊗ E(h)``), and at a convolution's or a train-mode
    BatchNorm's input by its mean per channel over batch and space."""
    xs = [x]
    with torch.no_grad():
        for m in layers:
            xs.append(m(xs[-1]))
    out = xs[-1].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss_fn(out, t), out, create_graph=True)
    h, g = _diag_of_grad(g, out), g.detach()
    found = {}
    for idx in range(len(layers) - 1, -1, -1):
        m, xin = layers[idx], xs[idx]
        params = {k: v.detach() for k, v in m.named_parameters(recurse=False)}
        if approx and isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            h = _channel_mean(h, m)

        def f(inp, params=params, m=m):
            return functional_call(m, params, (inp,))

        J = torch.autograd.functional.jacobian(f, xin).reshape(h.numel(), xin.numel())
        for k, p in params.items():
            Jp = torch.autograd.functional.jacobian(lambda v, k=k: functional_call(m, {**params, k: v}, (xin,)), p)
            found[f"{idx}.{k}"] = (Jp.reshape(h.numel(), -1).square().T @ h.reshape(-1)).view_as(p)
        leaf = xin.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad((f(leaf) * g).sum(), leaf, create_graph=True)
        h = (J.square().T @ h.reshape(-1)).view_as(xin) + _diag_of_grad(gx, leaf)
        g = (J.T @ g.reshape(-1)).view_as(xin)
        if approx and (isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or isinstance(m, nn.modules.batchnorm._BatchNorm)
                       and m.training):
            h = _channel_mean(h, m)
    return found


class _FrozenStatistics(nn.Module):
    """A BatchNorm's per-batch affine map with its batch statistics held as constants: ``γ (x − μ)/σ + β``."""

    def __init__(self, bn: nn.BatchNorm2d, x: torch.Tensor):
        super().__init__()
        var, mean = torch.var_mean(x, (0, 2, 3), unbiased=False, keepdim=True)
        self.register_buffer("mean", mean)
        self.register_buffer("inv_std", torch.rsqrt(var + bn.eps))
        self.weight, self.bias = nn.Parameter(bn.weight.detach().clone()), nn.Parameter(bn.bias.detach().clone())

    def forward(self, x):
        return (x - self.mean) * self.inv_std * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


# --- defects -------------------------------------------------------------------------------------------------------

class _MyBatchNorm(nn.BatchNorm2d):
    """A user's BatchNorm2d that keeps its forward (the registry's nn.BatchNorm2d rule covers it)."""


def test_per_call_rules_hold_for_subclasses_and_bases_and_bad_ones_are_one_line():
    torch.manual_seed(0)
    x = torch.randn(4, 2, 5, 5, dtype=DT)
    y = torch.randint(0, 3, (4,))
    conv, lin = nn.Conv2d(2, 3, 3).to(DT), nn.Linear(27, 3).to(DT)
    bn = _MyBatchNorm(3).to(DT)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    net = nn.Sequential(conv, bn, nn.Tanh(), nn.Flatten(), lin)
    # own reference: the recursion on the same net with the statistics of this batch frozen into constants
    with torch.no_grad():
        frozen = _FrozenStatistics(bn, conv(x))
    ref = _own_diag_recursion([conv, frozen, nn.Tanh(), nn.Flatten(), lin], F.cross_entropy, x, y)
    stats_before = (bn.running_mean.clone(), bn.running_var.clone())
    for key in (nn.BatchNorm2d, nn.modules.batchnorm._BatchNorm):
        got = diag_hessian(net, F.cross_entropy, x, y, mode="diag", rules={key: NormRule(through_statistics=False)})
        for name in ("0.weight", "0.bias", "1.weight", "1.bias", "4.weight"):
            assert _rel(got[name], ref[name]) < 1e-10, (key, name, _rel(got[name], ref[name]))
    assert torch.equal(bn.running_mean, stats_before[0]) and torch.equal(bn.running_var, stats_before[1])
    # a key that is no module type matched nothing (silently the default rule); a rule class, a list: from inside
    for rules, words in (
        ({"BatchNorm2d": NormRule(False)}, "nn.BatchNorm2d"),
        ({bn: NormRule(False)}, "module type"),
        ({nn.BatchNorm2d: NormRule}, "HessianRule instance"),
        ({nn.Tanh: None}, "HessianRule instance"),
        ([NormRule(False)], "mapping"),
    ):
        with pytest.raises(CurvatureTypeError) as err:
            diag_hessian(net, F.cross_entropy, x, y, mode="diag", rules=rules)
        assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CurvatureTypeError, match="module type") as err:
        register_rule("Swish", ElementwiseRule())
    assert "\n" not in str(err.value)
    with pytest.raises(CurvatureError, match="already registered.*overwrite=True") as err:  # was the registry's bare ValueError
        register_rule(nn.Tanh, ElementwiseRule())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_loss_coupling_samples_is_caught_in_half_precision_and_exact_stays_exact(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    ref_net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    ref_net.load_state_dict({k: v.to(DT) for k, v in net.state_dict().items()})  # the same (rounded) weights
    x, t = torch.randn(8, 4).to(dtype), torch.randn(8, 3).to(dtype)

    def coupling(o, t):  # ∂²/∂y_n∂y_m = 2/N for every pair of samples: not block diagonal over samples
        return F.mse_loss(o, t) + o.sum(0).square().sum() / o.shape[0]

    def dense(loss_fn, target):
        out = {}
        for name, p in ref_net.named_parameters():
            leaf = p.detach().clone().requires_grad_(True)
            params = {**{k: v.detach() for k, v in ref_net.named_parameters()}, name: leaf}
            (g,) = torch.autograd.grad(loss_fn(functional_call(ref_net, params, (x.to(DT),)), target), leaf, create_graph=True)
            out[name] = _diag_of_grad(g, leaf)
        return out

    # tolerance: the net runs in 16 bits (bfloat16 keeps 8 bits: 0.4% per rounding); measured ≤ 0.7% on every entry
    ref = dense(coupling, t.to(DT))
    got = diag_hessian(net, coupling, x, t, mode="exact")
    for name in ref:
        assert got[name].dtype == dtype and _rel(got[name].to(DT), ref[name]) < 3e-2, (name, _rel(got[name].to(DT), ref[name]))
    for mode in ("diag", "approx"):
        with pytest.raises(CurvatureError, match="couples different samples") as err:
            diag_hessian(net, coupling, x, t, mode=mode)
        assert "\n" not in str(err.value)
    # a per-sample loss is not refused (the float32 check sees no coupling): diag on the last layer is its dense diagonal
    y = torch.randint(0, 3, (8,))
    got = diag_hessian(net, F.cross_entropy, x, y, mode="diag")["2.weight"]
    assert _rel(got.to(DT), dense(F.cross_entropy, y)["2.weight"]) < 3e-2


def test_params_given_a_module_or_a_number_is_one_line_and_its_parameters_work():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    for params, words in ((net[2], "list(module.parameters())"), (net, "list(module.parameters())"), (5, "params=['fc.weight']"),
                          (True, "params=None")):
        with pytest.raises(CurvatureTypeError) as err:
            diag_hessian(net, F.cross_entropy, x, y, mode="diag", params=params)
        assert words in str(err.value) and "\n" not in str(err.value)
    # what the line says to do: the module's parameters, keyed by their names in the model; the last layer's diag is
    # its dense diagonal (only the loss Hessian's diagonal reaches an FC last layer)
    got = diag_hessian(net, F.cross_entropy, x, y, mode="diag", params=list(net[2].parameters()))
    assert list(got) == ["2.weight", "2.bias"]
    for name, p in net[2].named_parameters():
        leaf = p.detach().clone().requires_grad_(True)
        params = {**{k: v.detach() for k, v in net.named_parameters()}, f"2.{name}": leaf}
        (g,) = torch.autograd.grad(F.cross_entropy(functional_call(net, params, (x,)), y), leaf, create_graph=True)
        assert _rel(got[f"2.{name}"], _diag_of_grad(g, leaf)) < 1e-12


def test_diag_and_approx_are_the_own_recursion_on_a_conv_net_of_strides_dilations_groups_and_ceil_pooling():
    """C.2.1-C.2.5 through every kind of geometry at once; the own recursion knows nothing of unfolding, taps or
    folding back (dense module Jacobians), so the conv rules' unfold/fold bookkeeping is checked entry by entry."""
    torch.manual_seed(2)
    layers = [nn.Conv2d(2, 3, 3, padding=1, stride=2, bias=False), nn.BatchNorm2d(3), nn.Tanh(),
              nn.Conv2d(3, 4, 3, padding=2, dilation=2), nn.ELU(), nn.Conv2d(4, 4, 3, padding=1, groups=4),
              nn.MaxPool2d(2, ceil_mode=True), nn.Softplus(), nn.AvgPool2d(2, padding=1, count_include_pad=False),
              nn.Flatten(), nn.Linear(16, 3)]
    layers = [m.to(DT) for m in layers]
    net = nn.Sequential(*layers)
    x, y = torch.randn(3, 2, 7, 7, dtype=DT), torch.randint(0, 3, (3,))
    loss = lambda o, t: F.cross_entropy(o, t, reduction="sum")  # noqa: E731
    for mode in ("diag", "approx"):
        ref = _own_diag_recursion(layers, loss, x, y, approx=mode == "approx")
        got = diag_hessian(net, loss, x, y, mode=mode)
        for name in ref:
            assert _rel(got[name], ref[name]) < 1e-10, (mode, name, _rel(got[name], ref[name]))
