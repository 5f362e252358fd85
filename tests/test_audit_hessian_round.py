"""Audit round of the diagonal Hessians: defects found with independent float64 models.

References are dense autograd Hessians (``torch.autograd.functional.hessian``) of models written here;
nothing is compared with nasdiag's own numbers.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import CurvatureError, UnsupportedModuleError, alpha_diag_hessian, arch_diag_hessian, diag_hessian

from conftest import live_tensors

DT = torch.float64


def dense_param_diag(model, loss_fn, x, y):
    """``{name: diag ∂²L/∂θ²}`` from the dense Hessian over all parameters, flattened together."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])

    def loss_of(v):
        values = dict(zip(names, (part.view(s) for part, s in zip(torch.split(v, [s.numel() for s in shapes]), shapes))))
        return loss_fn(torch.func.functional_call(model, values, (x,)), y)

    diag = torch.autograd.functional.hessian(loss_of, flat).diagonal()
    return dict(zip(names, (part.view(s) for part, s in zip(torch.split(diag, [s.numel() for s in shapes]), shapes))))


# -- exact mode on a Linear chain called on (N, T, F) inputs -------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_exact_on_a_linear_chain_over_sequences_equals_autograd(reduction):
    # Linear acts on the last dim of a (N, T, F) input; the per-sample chain recursion (C.1.2-C.1.3) needs
    # (N, F) rows, so exact must take its other route instead of refusing a model diag handles
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).to(DT)
    x, y = torch.randn(3, 6, 4, dtype=DT), torch.randn(3, 6, 2, dtype=DT)

    def loss_fn(o, t):
        return F.mse_loss(o, t, reduction=reduction)

    expected = dense_param_diag(net, loss_fn, x, y)
    got = diag_hessian(net, loss_fn, x, y, mode="exact")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-14)


# -- no global random numbers drawn --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exact", "diag", "approx"])
def test_weight_curvature_leaves_the_global_random_stream_alone(mode):
    # a diagnostic between training steps must not shift the caller's random stream (dropout masks, data
    # order): the per-sample check of the loss used to draw from torch's global generator
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 3)).to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    before = torch.get_rng_state()
    diag_hessian(net, F.cross_entropy, x, y, mode=mode)
    assert torch.equal(torch.get_rng_state(), before)


# -- shared α detected whatever the rounding of the softmax --------------------------------------------


class Mixed(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.ops = nn.ModuleList([nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.Tanh()), nn.Identity(),
                                  nn.AvgPool2d(3, 1, 1, count_include_pad=False)])

    def forward(self, x, weights):  # weights (K,) or per-sample (B, K)
        w = weights.reshape(*weights.shape[:-1], *(1,) * (x.dim() - weights.dim() + 1), weights.shape[-1])
        return sum(w[..., k] * op(x) for k, op in enumerate(self.ops))


class TwoCells(nn.Module):
    """Two cells of two edges (0→1, 1→2), both mixing with rows of softmax(α): one α shared by the cells."""

    def __init__(self, C=2):
        super().__init__()
        self.stem = nn.Conv2d(1, C, 3, padding=1)
        self.cells = nn.ModuleList([nn.ModuleList([Mixed(C), Mixed(C)]) for _ in range(2)])
        self.alpha = nn.Parameter(torch.zeros(2, 3))  # DARTS starts α at (about) zero
        self.head = nn.Linear(C, 3)

    def forward(self, x):
        h = self.stem(x)
        for cell in self.cells:
            z = torch.softmax(self.alpha, -1)  # each row sums to 1 exactly here
            h = cell[1](cell[0](h, z[0]), z[1])
        return self.head(h.mean((2, 3)))

    def edges(self):
        return {f"c{c}.e{e}": (m, list(m.ops)) for c, cell in enumerate(self.cells) for e, m in enumerate(cell)}


def test_exact_alpha_refuses_shared_alpha_even_when_the_softmax_rows_sum_to_one_exactly():
    # the sharing was found from the gradient of weights.sum(): for softmax weights that gradient is zero
    # (the row sums to 1), so detection hung on round-off and missed this net; per-edge numbers summed over
    # the cells then drop the cross-cell terms, which are large here (checked against the dense Hessian)
    torch.manual_seed(0)
    net = TwoCells().to(DT)
    x, y = torch.randn(3, 1, 4, 4, dtype=DT), torch.randint(0, 3, (3,))
    with pytest.raises(CurvatureError, match="alpha_diag_hessian"):
        arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact", wrt="alpha")

    a0 = net.alpha.detach().clone()
    dense = torch.autograd.functional.hessian(
        lambda a: F.cross_entropy(torch.func.functional_call(net, {"alpha": a}, (x,)), y), a0).reshape(6, 6).diagonal()
    torch.testing.assert_close(alpha_diag_hessian(net, F.cross_entropy, x, y, params=[net.alpha])["alpha"].reshape(-1), dense,
                               rtol=1e-10, atol=1e-14)
    per_edge = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact_per_edge", wrt="alpha")
    summed = torch.stack([per_edge["c0.e0"] + per_edge["c1.e0"], per_edge["c0.e1"] + per_edge["c1.e1"]]).reshape(-1)
    assert (summed - dense).norm() > 0.05 * dense.norm()  # what a silent per-edge answer would have cost


# -- 1-D convolutions refused under their own name ------------------------------------------------------


@pytest.mark.parametrize("conv", [nn.Conv1d(2, 3, 4, padding="same"), nn.Conv1d(2, 3, 3, padding=1, padding_mode="reflect")])
def test_a_refused_conv1d_is_named_by_its_type_and_qualified_name(conv):
    net = nn.Sequential(nn.Identity(), conv, nn.Flatten()).to(DT)
    x = torch.randn(2, 2, 7, dtype=DT)
    with pytest.raises(UnsupportedModuleError) as info:
        diag_hessian(net, F.mse_loss, x, torch.zeros_like(net(x)), mode="diag")
    message = str(info.value)
    assert "'1'" in message and "Conv1d" in message and "Conv2d" not in message


# -- biases a normalization does not remove are not zeroed ---------------------------------------------


def _bias_then(module):
    # a tiny eps: BatchNorm is scale-invariant only as eps → 0 (with the default 1e-5, 6% of random inits of an
    # invariant op moved the output by > 1e-2 at c = 7.3, and the test failed at random)
    return nn.Sequential(nn.Conv2d(2, 3, 1), module, nn.BatchNorm2d(3, affine=False, eps=1e-12)).to(DT)


@pytest.mark.parametrize("pool", [
    nn.AvgPool2d(3, 1, 1, count_include_pad=False, divisor_override=2),  # clipped border windows, fixed divisor
    nn.AvgPool2d(2, ceil_mode=True, divisor_override=3),  # the overhanging last window sums fewer entries
])
def test_a_bias_before_average_pooling_with_a_fixed_divisor_keeps_its_curvature(pool):
    # a fixed divisor turns the constant bias into a border pattern that BatchNorm does not subtract: the loss
    # depends on the bias, so its diagonal is not 0 (it was reported as exactly 0)
    torch.manual_seed(0)
    net = _bias_then(pool)
    x = torch.randn(4, 2, 5, 5, dtype=DT)
    y = torch.randn_like(net(x))
    expected = dense_param_diag(net, F.mse_loss, x, y)["0.bias"]
    assert expected.abs().min() > 1e-3
    for mode in ("diag", "approx"):
        assert diag_hessian(net, F.mse_loss, x, y, mode=mode, params=["0.bias"])["0.bias"].abs().min() > 0
    torch.testing.assert_close(diag_hessian(net, F.mse_loss, x, y, mode="exact", params=["0.bias"])["0.bias"], expected,
                               rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("module, invariant", [
    (nn.AvgPool2d(3, 1, 1, count_include_pad=False, divisor_override=2), False),
    (nn.AvgPool2d(2, ceil_mode=True, divisor_override=3), False),
    (nn.AvgPool2d(2, divisor_override=3), True),  # full windows only: the bias is scaled, still constant
    (nn.ConvTranspose2d(3, 3, 3), False),  # the borders of a transposed convolution sum fewer taps
    (nn.ConvTranspose2d(3, 3, 2, stride=2), False),  # each output pixel takes another tap of the kernel
    (nn.ConvTranspose2d(3, 3, 1), True),  # a 1x1 transposed convolution is a 1x1 convolution
])
def test_scale_invariance_of_a_bias_through_pooling_and_transposed_convolutions(module, invariant):
    # Thm. 1 of the wiring supplement needs f(c·x) = f(x); checked on the op itself at c = 7.3 (BatchNorm's tiny
    # eps leaves round-off on an invariant op, far below the O(1) change of one that is not)
    from nasdiag.cost.scale_invariance import is_scale_invariant

    torch.manual_seed(0)
    op = _bias_then(module)
    x = torch.randn(4, 2, 5, 5, dtype=DT)
    with torch.no_grad():
        change = (op(7.3 * x) - op(x)).abs().max().item()
    assert (change < 1e-2) == invariant  # the reference
    assert is_scale_invariant(op, x) == invariant


# -- an in-place op on a norm's output view -------------------------------------------------------------


class ShiftThen(nn.Module):
    """``tail(tanh(x + P))`` with a per-sample shift P (N, ...): ``diag ∂²L/∂P²`` is the diagonal w.r.t. the
    input of ``tail``, exact in ``diag`` mode when ``tail`` is a norm followed by elementwise ops and MSE."""

    def __init__(self, shape, tail):
        super().__init__()
        self.P = nn.Parameter(torch.randn(shape, dtype=DT))
        self.tail = tail

    def forward(self, x):
        return self.tail(torch.tanh(x + self.P))


@pytest.mark.parametrize("inplace", [False, True])
def test_instance_norm_followed_by_an_inplace_relu_is_exact_or_refused(inplace):
    # F.instance_norm returns a view; ReLU(inplace=True) on it rebases the view's autograd history, so the
    # gradient at the norm's recorded output (its rule's residual term) is gone: it was read as zeros and the
    # diagonal came out silently wrong. Where it cannot be read the call is refused, naming the module.
    torch.manual_seed(0)
    net = ShiftThen((3, 2, 3, 3), nn.Sequential(nn.InstanceNorm2d(2, affine=True), nn.ReLU(inplace=inplace))).to(DT)
    x = torch.randn(3, 2, 3, 3, dtype=DT)
    y = torch.randn(3, 2, 3, 3, dtype=DT)
    expected = dense_param_diag(net, F.mse_loss, x, y)["P"]
    if inplace:
        with pytest.raises(UnsupportedModuleError, match=r"'tail\.0'.*in place"):
            diag_hessian(net, F.mse_loss, x, y, mode="diag", params=["P"])
    else:
        torch.testing.assert_close(diag_hessian(net, F.mse_loss, x, y, mode="diag", params=["P"])["P"], expected,
                                   rtol=1e-10, atol=1e-14)


def test_batch_norm_followed_by_an_inplace_relu_stays_exact():
    # BatchNorm's output is not a view: the in-place ReLU leaves its gradient readable, and the numbers exact
    torch.manual_seed(0)
    net = ShiftThen((3, 2, 3, 3), nn.Sequential(nn.BatchNorm2d(2), nn.ReLU(inplace=True))).to(DT)
    x, y = torch.randn(3, 2, 3, 3, dtype=DT), torch.randn(3, 2, 3, 3, dtype=DT)
    expected = dense_param_diag(net, F.mse_loss, x, y)["P"]
    torch.testing.assert_close(diag_hessian(net, F.mse_loss, x, y, mode="diag", params=["P"])["P"], expected,
                               rtol=1e-10, atol=1e-14)


# -- nothing kept alive between calls -------------------------------------------------------------------



@pytest.mark.parametrize("call", ["exact_z", "exact_alpha_per_edge", "alpha_diag", "eigenvalues"])
def test_exact_curvature_calls_leave_no_tensors_behind(call):
    # the memory estimate's saved-tensor hook returned the tensor itself: for a tensor an op saves as its own
    # output that is a cycle through autograd's C++ graph (tensor -> grad_fn -> saved variable -> tensor),
    # which no garbage collection reclaims, so every call kept its whole forward graph alive
    from nasdiag.hessian import exact_arch_diag_hessian, hessian_eigenvalues

    torch.manual_seed(0)
    net = TwoCells().to(DT)
    x, y = torch.randn(3, 1, 4, 4, dtype=DT), torch.randint(0, 3, (3,))
    run = {
        "exact_z": lambda: arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact"),
        "exact_alpha_per_edge": lambda: exact_arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), wrt="alpha"),
        "alpha_diag": lambda: alpha_diag_hessian(net, F.cross_entropy, x, y, params=[net.alpha]),
        "eigenvalues": lambda: hessian_eigenvalues(net, F.cross_entropy, x, y, params=[net.alpha]),
    }[call]
    run()  # first call: lazily built caches
    before = live_tensors()
    for _ in range(3):
        run()
    assert live_tensors() == before


# -- a fan-out that rejoins inside one module ------------------------------------------------------------


class PlusTanh(nn.Module):
    """A childless module without a rule: walked op by op."""

    def forward(self, x):
        return x + torch.tanh(x)


@pytest.mark.parametrize("module", [nn.Tanhshrink(), PlusTanh()])
def test_a_module_adding_two_functions_of_its_input_is_refused_naming_it(module):
    # x ± f(x) inside one module: the walk summed 1·h and f'²·h and dropped the cross term ±2 f' h, so even
    # a Linear right before an MSE loss got a wrong diagonal (170% off for Tanhshrink); like a product of two
    # functions of the input, such a module needs a rule
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), module).to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randn(5, 6, dtype=DT)
    with pytest.raises(UnsupportedModuleError, match=rf"'1' \(.*{type(module).__name__}\).*adds two functions"):
        diag_hessian(net, F.mse_loss, x, y, mode="diag")
    from nasdiag.hessian import ElementwiseRule

    exact = dense_param_diag(net, F.mse_loss, x, y)
    got = diag_hessian(net, F.mse_loss, x, y, mode="diag", rules={type(module): ElementwiseRule(module.forward)})
    for name in exact:  # with a rule it is exact: the Linear's output Hessian is diagonal here
        torch.testing.assert_close(got[name], exact[name], rtol=1e-10, atol=1e-14)


# -- exact on Sequentials that reuse a module -------------------------------------------------------------


def _reused_activation():
    act = nn.Tanh()  # one module object at two places, a common way to write a Sequential
    return nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act, nn.Linear(4, 3))


def _tied_linear():
    tied = nn.Linear(4, 4)  # one weight used by two layers
    return nn.Sequential(tied, nn.Tanh(), tied, nn.Sigmoid(), nn.Linear(4, 3))


@pytest.mark.parametrize("make", [_reused_activation, _tied_linear])
def test_exact_on_a_sequential_that_reuses_a_module_equals_autograd(make):
    # named_children() lists a module object once, so the chain recursion skipped its second call (55% and
    # 96% off); a tied weight also has cross-call terms the per-layer recursion cannot hold (HVPs have them)
    torch.manual_seed(0)
    net = make().to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    expected = dense_param_diag(net, F.cross_entropy, x, y)
    got = diag_hessian(net, F.cross_entropy, x, y, mode="exact")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-14)


# -- the per-sample weights of the GGN modes --------------------------------------------------------------


class KOnlyMixed(Mixed):
    """A mixed op that takes only (K,) weights (iterates over them)."""

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self.ops))


@pytest.mark.parametrize("mode", ["ggn", "ggn_mc", "hutchinson:1"])
def test_ggn_modes_on_a_mixed_op_without_per_sample_weights_name_the_edge(mode):
    # the GGN shifts the weights per sample ((B, K)); a mixed op that cannot take them failed with torch's
    # shape error, naming neither the edge nor the contract
    torch.manual_seed(0)
    net = TwoCells().to(DT)
    for cell in net.cells:
        for e, m in enumerate(cell):
            cell[e] = KOnlyMixed(2).to(DT)
    x, y = torch.randn(3, 1, 4, 4, dtype=DT), torch.randint(0, 3, (3,))
    with pytest.raises(CurvatureError, match=r"edge 'c0\.e0'.*\(B, K\)"):
        arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode)
    arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="diag")  # the (K,) modes run
