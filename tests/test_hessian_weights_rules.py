"""Per-module rules of the diagonal recursions, checked one layer at a time against torch.func.

With a loss that is *separable* in the module's output, ``L(y) = Σ_q (h_q/2) y_q² + c_q y_q``, the
Hessian w.r.t. the output is ``diag(h)`` and the gradient is ``g = h∘y + c``. Then the diagonal
recursion is exact (bayesnas-appendix C.1.4-C.1.5, C.2.1-C.2.3 lose nothing when H is diagonal):

    diag ∂²L/∂x² = (J∘J)ᵀ h + Σ_q g_q ∂²y_q/∂x²     and     diag ∂²L/∂θ² = rule.param_diag

so every rule must match ``torch.func.hessian`` to float64 round-off, for any h (also negative).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian.rules import ModuleCall, UnsupportedModuleError, rule_for

DT = torch.float64


def _separable_loss(h, c):
    return lambda y: (0.5 * h * y.square() + c * y).sum()


def _dense_hessian(f, x):
    """The dense Hessian of the scalar ``f`` at ``x``: torch.func (forward-over-reverse), or two reverse passes
    for an op torch.func cannot take forward derivatives of twice (``aten::silu_backward`` in torch 2.13)."""
    try:
        return torch.func.hessian(f)(x)
    except NotImplementedError:
        return torch.autograd.functional.hessian(f, x)


def _check(module, x, seed=0, rtol=1e-9):
    torch.manual_seed(seed)
    module = module.to(DT)
    x = x.to(DT)
    y = module(x)
    h = torch.randn_like(y)
    c = torch.randn_like(y)
    loss = _separable_loss(h, c)
    rule = rule_for(module)
    assert rule is not None, type(module)
    rule.check(module, "m")
    call = ModuleCall("m", module, x, y, grad_output=h * y.detach() + c)
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())

    def loss_of_input(inp):
        return loss(torch.func.functional_call(module, (params, {k: b.clone() for k, b in buffers.items()}), (inp,)))

    expected = _dense_hessian(loss_of_input, x)
    expected = torch.diagonal(expected.reshape(x.numel(), x.numel())).reshape(x.shape)
    with torch.no_grad():  # as the recursion's walk calls the rules
        got = rule.input_diag(call, h)
    assert got.shape == x.shape
    torch.testing.assert_close(got, expected, rtol=rtol, atol=rtol * expected.abs().max().item())

    for name, p in params.items():
        def loss_of_param(value, name=name):
            return loss(torch.func.functional_call(module, ({**params, name: value}, {k: b.clone() for k, b in buffers.items()}), (x,)))

        full = _dense_hessian(loss_of_param, p.detach())
        exp_p = torch.diagonal(full.reshape(p.numel(), p.numel())).reshape(p.shape)
        with torch.no_grad():
            got_p = rule.param_diag(call, h)[name]
        torch.testing.assert_close(got_p, exp_p, rtol=rtol, atol=rtol * exp_p.abs().max().item())


def _img(n=2, c=4, s=6):
    return torch.randn(n, c, s, s, dtype=DT)


def _seq(n=2, c=4, L=6):
    return torch.randn(n, c, L, dtype=DT)


def _vol(n=2, c=2, s=4):
    return torch.randn(n, c, s, s, s, dtype=DT)


CASES = {
    "linear": (lambda: nn.Linear(5, 3), lambda: torch.randn(4, 5)),
    "linear_nobias_3d": (lambda: nn.Linear(5, 3, bias=False), lambda: torch.randn(2, 3, 5)),
    "conv": (lambda: nn.Conv2d(4, 3, 3, padding=1), _img),
    "conv_strided": (lambda: nn.Conv2d(4, 2, 3, stride=2, padding=1, bias=False), _img),
    "conv_depthwise_dilated": (lambda: nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=4, bias=False), _img),
    "conv_grouped_5x5": (lambda: nn.Conv2d(4, 6, 5, stride=2, padding=2, groups=2), lambda: _img(s=7)),
    "conv_same": (lambda: nn.Conv2d(4, 2, 3, padding="same"), _img),
    "relu": (nn.ReLU, _img),
    "leaky_relu": (lambda: nn.LeakyReLU(0.1), _img),
    "sigmoid": (nn.Sigmoid, _img),
    "tanh": (nn.Tanh, _img),
    "gelu": (nn.GELU, _img),
    "softplus": (nn.Softplus, _img),
    "silu": (nn.SiLU, _img),
    "elu": (lambda: nn.ELU(alpha=0.7), _img),
    "gelu_tanh": (lambda: nn.GELU(approximate="tanh"), _img),
    "identity": (nn.Identity, _img),
    "flatten": (nn.Flatten, _img),
    "maxpool": (lambda: nn.MaxPool2d(3, stride=1, padding=1), _img),
    "maxpool_s2_ceil": (lambda: nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True), lambda: _img(s=6)),
    "avgpool_nopad": (lambda: nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False), _img),
    "avgpool_pad": (lambda: nn.AvgPool2d(3, stride=2, padding=1), lambda: _img(s=7)),
    "avgpool_ceil": (lambda: nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False), _img),
    "adaptive_avg": (lambda: nn.AdaptiveAvgPool2d((2, 3)), lambda: _img(s=7)),
    "adaptive_avg_1": (lambda: nn.AdaptiveAvgPool2d(1), _img),
    "adaptive_max": (lambda: nn.AdaptiveMaxPool2d(2), lambda: _img(s=5)),
    "bn_train": (lambda: nn.BatchNorm2d(4), lambda: _img(n=3, s=3)),
    "bn_train_noaffine": (lambda: nn.BatchNorm2d(4, affine=False), lambda: _img(n=3, s=3)),
    "bn1d_train": (lambda: nn.BatchNorm1d(5), lambda: torch.randn(6, 5)),
    "bn_eval": (lambda: _eval_bn(), lambda: _img(n=3, s=3)),
    "groupnorm_as_layernorm": (lambda: nn.GroupNorm(1, 4), lambda: _img(s=3)),
    "groupnorm_2": (lambda: nn.GroupNorm(2, 4, eps=1e-3), lambda: _img(s=3)),
    "instancenorm": (lambda: nn.InstanceNorm2d(4, affine=True), lambda: _img(s=3)),
    "instancenorm_noaffine": (lambda: nn.InstanceNorm2d(4), lambda: _img(s=3)),
    "layernorm": (lambda: nn.LayerNorm((3, 3)), lambda: _img(s=3)),
    # 1-D layers, through their 2-D rules on (N, C, 1, L) (rules/lifted.py)
    "conv1d": (lambda: nn.Conv1d(4, 3, 3, padding=1), _seq),
    "conv1d_strided_dilated_grouped": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), lambda: _seq(L=9)),
    "conv1d_depthwise_same": (lambda: nn.Conv1d(4, 4, 5, padding="same", groups=4, bias=False), _seq),
    "maxpool1d": (lambda: nn.MaxPool1d(3, stride=2, padding=1, ceil_mode=True), lambda: _seq(L=8)),
    "avgpool1d": (lambda: nn.AvgPool1d(3, stride=2, padding=1, count_include_pad=False), lambda: _seq(L=9)),
    "adaptive_avg1d": (lambda: nn.AdaptiveAvgPool1d(3), lambda: _seq(L=7)),
    "adaptive_max1d": (lambda: nn.AdaptiveMaxPool1d(2), lambda: _seq(L=5)),
    "bn1d_train_3d": (lambda: nn.BatchNorm1d(4), lambda: _seq(n=3, L=3)),
    # 3-D layers (rules/volumetric.py)
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, padding=1), _vol),
    "conv3d_strided_dilated_grouped": (lambda: nn.Conv3d(2, 4, 2, stride=2, padding=1, dilation=(1, 2, 1), groups=2),
                                       lambda: _vol(s=5)),
    "conv3d_valid_nobias": (lambda: nn.Conv3d(2, 2, (1, 2, 3), padding="valid", bias=False), _vol),
    "maxpool3d": (lambda: nn.MaxPool3d(2, stride=1, padding=1), _vol),
    "maxpool3d_ceil": (lambda: nn.MaxPool3d(3, stride=2, padding=1, ceil_mode=True), lambda: _vol(s=4)),
    "avgpool3d_nopad_count": (lambda: nn.AvgPool3d(3, stride=2, padding=1, count_include_pad=False), lambda: _vol(s=5)),
    "avgpool3d_pad": (lambda: nn.AvgPool3d(2, stride=1, padding=1), _vol),
    "adaptive_max3d": (lambda: nn.AdaptiveMaxPool3d((2, 1, 2)), lambda: _vol(s=3)),
    "bn3d_train": (lambda: nn.BatchNorm3d(2), lambda: _vol(n=2, s=2)),
}


def _eval_bn():
    bn = nn.BatchNorm2d(4)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    return bn.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_exact_for_separable_loss(case):
    make_module, make_x = CASES[case]
    torch.manual_seed(1)
    module = make_module()
    for p in module.parameters():  # non-trivial affine parameters
        nn.init.normal_(p)
    _check(module, make_x())


@pytest.mark.parametrize("case", ["bn_train", "bn_train_noaffine", "instancenorm", "bn1d_train"])
def test_norm_approx_is_the_group_mean_of_the_exact_rule(case):
    """``NormRule.input_approx`` (feature means) = the per-group mean of the exact diagonal (torch.func)."""
    make_module, make_x = CASES[case]
    torch.manual_seed(2)
    module = make_module().to(DT)
    for p in module.parameters():
        nn.init.normal_(p)
    x = make_x().to(DT)
    y = module(x)
    h, c = torch.randn_like(y), torch.randn_like(y)
    loss = _separable_loss(h, c)
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    full = torch.func.hessian(lambda i: loss(torch.func.functional_call(module, (params, {k: b.clone() for k, b in buffers.items()}), (i,))))(x)
    exact = torch.diagonal(full.reshape(x.numel(), x.numel())).reshape(x.shape)
    dims = (0, 2, 3) if case.startswith("bn") and x.dim() == 4 else ((0,) if x.dim() == 2 else (2, 3))
    call = ModuleCall("m", module, x, y, grad_output=h * y.detach() + c)
    got = rule_for(module).input_approx(call, h)
    torch.testing.assert_close(got, exact.mean(dims, keepdim=True).expand_as(x), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["conv", "conv_strided", "conv_depthwise_dilated", "conv_grouped_5x5", "conv_same"])
def test_conv_approx_is_the_channel_mean_of_the_folded_diagonal(case):
    """C.2.4-C.2.5: with the output diagonal replaced by its channel mean E(h), the input diagonal of
    ``Conv2dRule.input_approx`` is the channel mean of ``(W∘W)ᵀ E(h)`` folded back (torch's conv backward),
    and the weight diagonal is ``Σ_rows M² ⊗ E(h)`` (the conv weight-gradient of x² against E(h))."""
    make_module, make_x = CASES[case]
    torch.manual_seed(3)
    module, x = make_module().to(DT), make_x().to(DT)
    y = module(x)
    h = torch.randn_like(y)
    h_mean = h.mean((0, 2, 3), keepdim=True).expand_as(h)
    call = ModuleCall("m", module, x, y)
    rule = rule_for(module)
    pad = module.padding if not isinstance(module.padding, str) else (module.dilation[0] * (module.kernel_size[0] - 1) // 2,) * 2
    folded = torch.nn.grad.conv2d_input(x.shape, module.weight.detach().square(), h_mean.contiguous(), module.stride, pad, module.dilation, module.groups)
    got = rule.input_approx(call, h)
    torch.testing.assert_close(got, folded.mean((0, 2, 3), keepdim=True).expand_as(x), rtol=1e-10, atol=1e-14)
    weight = torch.nn.grad.conv2d_weight(x.square(), module.weight.shape, h_mean.contiguous(), module.stride, pad, module.dilation, module.groups)
    torch.testing.assert_close(rule.param_approx(call, h)["weight"], weight, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("case", ["conv1d", "conv1d_strided_dilated_grouped", "conv1d_depthwise_same"])
def test_conv1d_approx_is_the_channel_mean_of_the_folded_diagonal(case):
    """C.2.4-C.2.5 for ``nn.Conv1d``, against torch's own 1-D convolution backward: the input diagonal is the
    channel mean (over batch and length) of ``(W∘W)ᵀ E(h)`` folded back, the weight diagonal the conv1d
    weight-gradient of x² against E(h)."""
    make_module, make_x = CASES[case]
    torch.manual_seed(4)
    module, x = make_module().to(DT), make_x().to(DT)
    y = module(x)
    h = torch.randn_like(y)
    h_mean = h.mean((0, 2), keepdim=True).expand_as(h).contiguous()
    pad = module.padding[0] if not isinstance(module.padding, str) else module.dilation[0] * (module.kernel_size[0] - 1) // 2
    geometry = (module.stride, pad, module.dilation, module.groups)
    call = ModuleCall("m", module, x, y)
    rule = rule_for(module)
    folded = torch.nn.grad.conv1d_input(x.shape, module.weight.detach().square(), h_mean, *geometry)
    torch.testing.assert_close(rule.input_approx(call, h), folded.mean((0, 2), keepdim=True).expand_as(x), rtol=1e-10, atol=1e-14)
    weight = torch.nn.grad.conv1d_weight(x.square(), module.weight.shape, h_mean, *geometry)
    torch.testing.assert_close(rule.param_approx(call, h)["weight"], weight, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("case", ["conv3d", "conv3d_strided_dilated_grouped", "conv3d_valid_nobias"])
def test_conv3d_approx_is_the_channel_mean_of_the_folded_diagonal(case):
    """C.2.4-C.2.5 for ``nn.Conv3d``, against torch's 3-D convolution backward applied to the whole batch: the
    input diagonal is the channel mean (over batch and volume) of ``(W∘W)ᵀ E(h)`` folded back, the weight
    diagonal the conv3d weight-gradient of x² against E(h)."""
    make_module, make_x = CASES[case]
    torch.manual_seed(5)
    module, x = make_module().to(DT), make_x().to(DT)
    y = module(x)
    h = torch.randn_like(y)
    h_mean = h.mean((0, 2, 3, 4), keepdim=True).expand_as(h).contiguous()
    pad = module.padding if not isinstance(module.padding, str) else (0, 0, 0)
    geometry = (module.stride, pad, module.dilation, module.groups)
    call = ModuleCall("m", module, x, y)
    rule = rule_for(module)
    folded = torch.nn.grad.conv3d_input(x.shape, module.weight.detach().square(), h_mean, *geometry)
    torch.testing.assert_close(rule.input_approx(call, h), folded.mean((0, 2, 3, 4), keepdim=True).expand_as(x),
                               rtol=1e-10, atol=1e-14)
    weight = torch.nn.grad.conv3d_weight(x.square(), module.weight.shape, h_mean, *geometry)
    torch.testing.assert_close(rule.param_approx(call, h)["weight"], weight, rtol=1e-10, atol=1e-14)
    if module.bias is not None:
        torch.testing.assert_close(rule.param_approx(call, h)["bias"], h_mean.sum((0, 2, 3, 4)), rtol=1e-10, atol=1e-14)


def test_unbatched_1d_input_is_refused_with_what_to_do():
    module = nn.Conv1d(4, 3, 3).to(DT)
    x = torch.randn(4, 6, dtype=DT)
    call = ModuleCall("conv", module, x, module(x))
    with pytest.raises(UnsupportedModuleError, match=r"'conv'.*\(N, C, L\).*\(4, 6\).*mode='exact'"):
        rule_for(module).input_diag(call, torch.ones(3, 4, dtype=DT))


def test_linear_approx_is_the_exact_hessian_under_the_row_mean_curvature():
    """The FC feature-mean approximation (C.2.4-C.2.5 analogue) is, by its definition, the exact diagonal
    for a loss whose output curvature is the row mean E(h) at every row: check it against autograd's
    Hessian of ½ Σ_rows E(h)_c y_{r,c}², for the weight, the bias and (one input row at a time) the input."""
    torch.manual_seed(4)
    module, x = nn.Linear(5, 3).to(DT), torch.randn(2, 4, 5, dtype=DT)
    y = module(x)
    h = torch.randn_like(y)
    call = ModuleCall("m", module, x, y)
    rule = rule_for(module)
    h_mean = h.reshape(-1, 3).mean(0)
    W, b = module.weight.detach(), module.bias.detach()

    def quadratic(w, bias, inp):
        return 0.5 * (h_mean * F.linear(inp, w, bias).square()).sum()

    hw, hb, hx = (torch.autograd.functional.hessian(quadratic, (W, b, x))[i][i] for i in range(3))
    got = rule.param_approx(call, h)
    torch.testing.assert_close(got["weight"], torch.diagonal(hw.reshape(15, 15)).reshape(3, 5))
    torch.testing.assert_close(got["bias"], torch.diagonal(hb))
    # the input Hessian is block diagonal over rows; its diagonal is what the recursion passes on
    torch.testing.assert_close(rule.input_approx(call, h), torch.diagonal(hx.reshape(40, 40)).reshape(x.shape))