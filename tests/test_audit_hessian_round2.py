"""Second audit round of the diagonal Hessians (bayesnas-appendix C.1.x, C.2.x, C.3.x), float64.

Every reference here is built in this file: the dense Hessian of the loss by reverse-over-reverse autograd,
one double backward per entry (:func:`dense_diag`) or ``torch.autograd.functional.hessian`` on a flat vector
(never ``torch.func.hessian`` through train-mode BatchNorm). The models are this file's own. What the earlier
rounds (tests/test_audit_hessian_round.py, tests/test_hessian_*.py, tests/test_curvature_*.py) already cover
is not repeated; this round targets configurations they did not:

* ``exact`` weight diagonals on grouped / depthwise / strided / dilated / bias-free convolutions, reflect and
  circular padding, ``ConvTranspose2d``, pooling with padding and ``ceil_mode``, 1-D convolutions, the norms
  with affine on and off, residual sums, concatenations, a module called twice, ``Flatten`` at several start
  dims, eval dropout and ``Identity`` (round-off);
* ``diag`` equal to the reference where docs/hessian.md claims it ("Exact pieces"): the last ``Linear`` under
  every per-sample loss (CE with label smoothing, NLL of a log-softmax, BCE with logits, MSE and CE with sum or
  mean), every layer whose output Hessian stays diagonal (activations, max pooling, eval BN, slices,
  concatenations, constant factors), and each rule inside a network under a separable loss;
* refusals naming the module and the way out, sum vs mean reduction (N×), repeated calls and side effects;
* the mixing-weight diagonals of a supernet of this file: α shared by two cells, a mixed op used in both cells,
  ``(B, K)`` weights (``alpha_diag_hessian``, ``arch_diag_hessian`` exact / exact_per_edge / diag / approx / ggn).

Defects this round found (each test fails on the library before its fix): ``LeakyReLU`` with a negative slope
(σ' read from the sign of the output: 10% off in ``exact`` on a chain, 18% in ``diag``), the same inplace
(differentiated from its overwritten input), calls under ``torch.inference_mode()`` (all zeros), layers called
with keyword inputs (``diag``/``approx`` zeros), a weight shared by two modules (``exact``'s chain recursion >100%
off, ``diag``/``approx`` dropped the second holder).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from nasdiag.hessian import UnsupportedModuleError, alpha_diag_hessian, arch_diag_hessian, diag_hessian

from conftest import assert_no_module_hooks

DT = torch.float64


def dense_diag(model, loss_fn, x, y, names=None):
    """``{name: diag ∂²L/∂θ²}`` by one double backward per entry of the flattened parameters (float64)."""
    params = dict(model.named_parameters())
    names = list(params) if names is None else list(names)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    sizes = [params[n].numel() for n in names]
    flat = torch.cat([params[n].detach().reshape(-1) for n in names]).requires_grad_(True)
    values = {n: t.view_as(params[n]) for n, t in zip(names, torch.split(flat, sizes))}
    full = {**{k: v.detach() for k, v in params.items()}, **values, **buffers}
    loss = loss_fn(functional_call(model, full, (x,)), y)
    (g,) = torch.autograd.grad(loss, flat, create_graph=True)
    diag = torch.zeros_like(flat)
    for i in range(flat.numel()):
        if g[i].requires_grad:
            (col,) = torch.autograd.grad(g[i], flat, retain_graph=True, allow_unused=True)
            diag[i] = 0.0 if col is None else col[i]
    return {n: t.view_as(params[n]).detach() for n, t in zip(names, torch.split(diag, sizes))}


def assert_close_to(got, ref, rtol=1e-10):
    scale = max(r.abs().max().item() for r in ref.values())
    assert scale > 0
    for k in ref:
        err = (got[k] - ref[k]).abs().max().item()
        assert err <= rtol * scale, f"{k}: max error {err:.3e}, scale {scale:.3e}"


def _lazy(model, x):
    model = model.to(DT)
    with torch.no_grad():
        model(x)  # materialise LazyLinear
    return model


# ---------------------------------------------------------------------------------------------------------- defects


@pytest.mark.parametrize("slope", [-0.5, 2.0])
def test_leaky_relu_with_a_negative_slope_takes_its_derivative_from_the_input(slope):
    """With a negative slope every x ≠ 0 has out > 0, so σ' read from the output's sign was 1 everywhere: the
    chain recursion of ``exact`` (C.1.3) and ``diag`` (C.1.5, exact under an elementwise loss) were wrong."""
    torch.manual_seed(0)
    chain = nn.Sequential(nn.Linear(4, 5), nn.LeakyReLU(slope), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 3)).to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    assert_close_to(diag_hessian(chain, F.cross_entropy, x, y, mode="exact"), dense_diag(chain, F.cross_entropy, x, y))

    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.LeakyReLU(slope), nn.Flatten()).to(DT)
    x = torch.randn(3, 2, 4, 4, dtype=DT)
    t = torch.randn(3, 48, dtype=DT)
    mse = lambda o, t: F.mse_loss(o, t, reduction="sum")  # noqa: E731
    ref = dense_diag(net, mse, x, t)
    for mode in ("exact", "diag"):
        assert_close_to(diag_hessian(net, mse, x, t, mode=mode), ref)


def test_exact_on_a_chain_refuses_an_inplace_leaky_relu_with_a_negative_slope():
    """It overwrites the input that σ' needs (torch's backward refuses it); ``exact``'s chain recursion (C.1.3)
    returned numbers from the overwritten input (up to 2x the out-of-place net's) instead of saying so."""
    net = nn.Sequential(nn.Linear(4, 5), nn.LeakyReLU(-0.5, inplace=True), nn.Linear(5, 3)).to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    for mode in ("exact", "diag"):
        with pytest.raises(UnsupportedModuleError, match="'1'.*inplace=False"):
            diag_hessian(net, F.cross_entropy, x, y, mode=mode)
    assert_no_module_hooks(net)


def test_a_call_under_inference_mode_is_refused_not_answered_with_zeros():
    """``torch.enable_grad()`` does not lift ``torch.inference_mode()``: no graph was recorded and every mode of
    ``diag_hessian``, ``alpha_diag_hessian`` and the spectrum returned all zeros (``arch_diag_hessian`` blamed the
    loss). ``torch.no_grad()`` around the call stays fine."""
    from nasdiag.hessian import CurvatureRuntimeError, hutchinson_trace

    torch.manual_seed(7)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(), nn.Linear(48, 3)).to(DT)
    x, y = _img(2, 4), torch.randint(0, 3, (3,))
    ref = dense_diag(net, F.cross_entropy, x, y)
    with torch.no_grad():
        assert_close_to(diag_hessian(net, F.cross_entropy, x, y, mode="exact"), ref)
    supernet = Supernet().to(DT)
    xs, ys = torch.randn(3, 2, 4, 4, dtype=DT), torch.randint(0, 4, (3,))
    calls = [lambda mode=mode: diag_hessian(net, F.cross_entropy, x, y, mode=mode)
             for mode in ("exact", "diag", "approx", "hutchinson:1")]
    calls += [lambda: alpha_diag_hessian(supernet, F.cross_entropy, xs, ys, params={"alpha": supernet.alpha}),
              lambda: arch_diag_hessian(supernet, F.cross_entropy, xs, ys, supernet.edges(), mode="exact"),
              lambda: arch_diag_hessian(supernet, F.cross_entropy, xs, ys, supernet.edges(), mode="diag"),
              lambda: hutchinson_trace(net, F.cross_entropy, x, y, params=[net[4].weight])]
    for call in calls:
        with torch.inference_mode(), pytest.raises(CurvatureRuntimeError, match="inference_mode"):
            call()
    assert_no_module_hooks(net)
    assert_no_module_hooks(supernet)


class ByKeyword(nn.Module):
    """Layers called with their input as a keyword (``linear(input=x)``), as torch's modules allow."""

    def __init__(self):
        super().__init__()
        self.a, self.act, self.b = nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(input=self.act(input=self.a(input=x)))


def test_layers_called_by_keyword_are_traced_not_reported_as_zero_curvature():
    """The tracer read only positional inputs: every layer called as ``layer(input=x)`` went unrecorded and
    ``diag``/``approx`` returned zeros for all its parameters (the loss "did not depend" on them)."""
    torch.manual_seed(8)
    net = ByKeyword().to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    ref = dense_diag(net, F.cross_entropy, x, y)
    assert_close_to({"b.weight": diag_hessian(net, F.cross_entropy, x, y, mode="diag")["b.weight"]}, {"b.weight": ref["b.weight"]})
    for mode in ("diag", "approx"):
        got = diag_hessian(net, F.cross_entropy, x, y, mode=mode)
        assert all(bool((got[k] != 0).any()) for k in got), mode


class PairOut(nn.Module):
    """A module with a parameter whose forward returns a pair (with a per-call rule that cannot stand in for it)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, dtype=DT))

    def forward(self, x):
        return x * self.w, x


class PairNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair, self.fc = PairOut(), nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.pair(x)[0])


def test_a_ruled_module_whose_call_cannot_be_recorded_is_refused_not_zero():
    from nasdiag.hessian import HessianRule

    class ScaleRule(HessianRule):
        param_names = ("w",)

    net = PairNet().to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    with pytest.raises(UnsupportedModuleError, match="'pair'.*returned a tuple.*mode='exact'"):
        diag_hessian(net, F.cross_entropy, x, y, mode="diag", params=["pair.w"], rules={PairOut: ScaleRule()})
    assert_no_module_hooks(net)


def test_exact_on_a_chain_whose_linear_layers_share_a_weight_equals_the_dense_hessian():
    """``l2.weight = l1.weight`` in an ``nn.Sequential`` of Linear/Tanh: the per-layer chain recursion (C.1.2) took
    only the first layer's term for the shared weight (over 100% off); such a chain goes to the HVP route."""
    torch.manual_seed(9)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    net[2].weight = net[0].weight
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    assert_close_to(diag_hessian(net, F.cross_entropy, x, y, mode="exact"), dense_diag(net, F.cross_entropy, x, y))


class TiedBranches(nn.Module):
    """Two Linear modules holding one weight, on disjoint halves of the input into disjoint outputs: under an
    elementwise loss the cross-call terms vanish, so the diagonal recursion is exact for the shared weight."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 3), nn.Linear(4, 3)
        self.l2.weight = self.l1.weight
        self.act = nn.Tanh()

    def forward(self, x):
        return torch.cat([self.l1(x[:, :4]), self.act(self.l2(x[:, 4:]))], 1)


class ReusedBranches(TiedBranches):
    """The same, with one module called twice."""

    def forward(self, x):
        return torch.cat([self.l1(x[:, :4]), self.act(self.l1(x[:, 4:]))], 1)


@pytest.mark.parametrize("model", [TiedBranches, ReusedBranches])
def test_diag_sums_the_calls_of_every_module_holding_a_shared_parameter(model):
    """``named_parameters`` lists a tied weight once, under its first holder; ``diag``/``approx`` counted only
    that module's calls and silently dropped the other's (60% off here). One module called twice was right."""
    torch.manual_seed(10)
    net = model().to(DT)
    x, t = torch.randn(5, 8, dtype=DT), torch.randn(5, 6, dtype=DT)
    mse = lambda o, t: F.mse_loss(o, t, reduction="sum")  # noqa: E731
    ref = dense_diag(net, mse, x, t)
    assert set(ref) == {"l1.weight", "l1.bias", "l2.bias"}
    for mode in ("exact", "diag"):
        assert_close_to(diag_hessian(net, mse, x, t, mode=mode), ref)


# ------------------------------------------------------------------------------------------- exact weight diagonals


class Residual(nn.Module):
    """A conv, a residual sum and a channel concat, then global pooling and a classifier."""

    def __init__(self, c=3):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.b = nn.Conv2d(c, c, 1, bias=False)
        self.act = nn.Tanh()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 4))

    def forward(self, x):
        u = self.act(self.a(x))
        return self.head(torch.cat([u, self.b(u) + x], 1))


class Reused(nn.Module):
    """One conv and one activation module called twice (tied weights)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.act = nn.Softplus()
        self.fc = nn.Linear(48, 4)

    def forward(self, x):
        return self.fc(self.act(self.conv(self.act(self.conv(x)))).flatten(1))


def _img(c=3, s=5, n=3):
    return torch.randn(n, c, s, s, dtype=DT)


EXACT_NETS = {
    "grouped_strided_dilated_conv": (lambda: nn.Sequential(nn.Conv2d(4, 6, 3, stride=2, dilation=2, padding=2, groups=2),
                                                           nn.GELU(), nn.Flatten(), nn.LazyLinear(4)), lambda: _img(4, 6)),
    "depthwise_no_bias_avgpool_ceil": (lambda: nn.Sequential(nn.Conv2d(3, 3, 3, groups=3, bias=False, padding=1), nn.ELU(),
                                                             nn.AvgPool2d(2, padding=1, ceil_mode=True), nn.Flatten(),
                                                             nn.LazyLinear(4)), _img),
    "reflect_padding": (lambda: nn.Sequential(nn.Conv2d(3, 2, 3, padding=1, padding_mode="reflect"), nn.SiLU(),
                                              nn.Flatten(), nn.LazyLinear(4)), _img),
    "circular_padding": (lambda: nn.Sequential(nn.Conv2d(3, 2, 3, padding=1, padding_mode="circular"), nn.Sigmoid(),
                                               nn.Flatten(), nn.LazyLinear(4)), _img),
    "conv_transpose": (lambda: nn.Sequential(nn.ConvTranspose2d(3, 2, 3, stride=2), nn.Tanh(), nn.Flatten(),
                                             nn.LazyLinear(4)), lambda: _img(s=3)),
    "maxpool_padding_ceil": (lambda: nn.Sequential(nn.Conv2d(3, 2, 3), nn.LeakyReLU(0.1),
                                                   nn.MaxPool2d(2, padding=1, ceil_mode=True), nn.Flatten(),
                                                   nn.LazyLinear(4)), _img),
    "conv1d_grouped_strided": (lambda: nn.Sequential(nn.Conv1d(4, 4, 3, groups=2, stride=2, padding=1), nn.Softplus(),
                                                     nn.Flatten(1), nn.LazyLinear(4)), lambda: torch.randn(3, 4, 7, dtype=DT)),
    "norms_affine_on_and_off": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4, affine=False),
                                                      nn.Tanh(), nn.InstanceNorm2d(4, affine=True), nn.Flatten(),
                                                      nn.LayerNorm(64), nn.LazyLinear(4)), lambda: _img(s=4)),
    "residual_and_concat": (Residual, lambda: _img(s=4)),
    "module_called_twice": (Reused, lambda: _img(s=4)),
    "flatten2_identity_dropout_eval": (lambda: nn.Sequential(nn.Flatten(2), nn.Identity(), nn.Dropout(0.5), nn.Linear(16, 3),
                                                             nn.Flatten(), nn.LazyLinear(4)).eval(), lambda: _img(s=4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(EXACT_NETS))
def test_exact_weight_diagonal_equals_the_dense_hessian(case):
    torch.manual_seed(0)
    make_net, make_x = EXACT_NETS[case]
    x = make_x()
    net = _lazy(make_net(), x)
    y = torch.randint(0, 4, (x.shape[0],))
    got = diag_hessian(net, F.cross_entropy, x, y, mode="exact")
    assert_close_to(got, dense_diag(net, F.cross_entropy, x, y))


# -------------------------------------------------------------------------------- diag where the docs claim exactness

LOSSES = {
    "ce_label_smoothing": lambda o, t: F.cross_entropy(o, t, label_smoothing=0.2),
    "nll_of_log_softmax": lambda o, t: F.nll_loss(F.log_softmax(o, 1), t),
    "bce_with_logits": lambda o, t: F.binary_cross_entropy_with_logits(o, F.one_hot(t, 4).to(DT)),
    "mse_sum": lambda o, t: F.mse_loss(o, F.one_hot(t, 4).to(DT), reduction="sum"),
    "mse_mean": lambda o, t: F.mse_loss(o, F.one_hot(t, 4).to(DT)),
    "ce_sum": lambda o, t: F.cross_entropy(o, t, reduction="sum"),
}


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_diag_is_exact_on_the_last_linear_layer_for_every_per_sample_loss(loss):
    """docs/hessian.md, "Exact pieces": only the diagonal of the loss Hessian reaches an FC last layer."""
    torch.manual_seed(1)
    x = _img(s=4, n=4)
    net = _lazy(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, groups=1), nn.BatchNorm2d(4), nn.GELU(), nn.GroupNorm(2, 4),
                              nn.MaxPool2d(2), nn.Flatten(), nn.LazyLinear(4)), x)
    y = torch.randint(0, 4, (4,))
    names = ["6.weight", "6.bias"]
    ref = dense_diag(net, LOSSES[loss], x, y, names)
    assert_close_to(diag_hessian(net, LOSSES[loss], x, y, mode="diag", params=names), ref)


class Elementwise(nn.Module):
    """A conv, then only ops that keep its output Hessian diagonal under an elementwise loss: activations
    (several branches, concatenated), a slice and a constant factor."""

    def __init__(self, conv, branches):
        super().__init__()
        self.conv = conv
        self.branches = nn.ModuleList(branches)

    def forward(self, x):
        z = self.conv(x)
        return 0.5 * torch.cat([b(z) for b in self.branches], 1)[:, :, :3]


def _eval_bn(c):
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    return bn.eval()


DIAGONAL_NETS = {
    "depthwise_strided_dilated": (lambda: Elementwise(nn.Conv2d(3, 3, 3, stride=2, dilation=2, padding=2, groups=3),
                                                      [nn.Softplus(beta=2.0), nn.GELU(approximate="tanh")]), 3),
    "grouped_no_bias": (lambda: Elementwise(nn.Conv2d(4, 6, 3, groups=2, bias=False, padding=1),
                                            [nn.ELU(0.7), nn.SiLU(), nn.Dropout(0.3).eval()]), 4),
    "max_pooling_with_padding": (lambda: Elementwise(nn.Conv2d(3, 2, 3, padding=1), [
        nn.Sequential(nn.Tanh(), nn.MaxPool2d(3, stride=1, padding=1)),
        nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True), nn.Sigmoid())]), 3),
    "eval_batchnorm": (lambda: Elementwise(nn.Conv2d(3, 2, 3, padding=1), [nn.Sequential(_eval_bn(2), nn.Softplus()),
                                                                            nn.Identity()]), 3),
}


@pytest.mark.parametrize("case", sorted(DIAGONAL_NETS))
def test_diag_is_exact_where_the_output_hessian_stays_diagonal(case):
    """docs/hessian.md, "Exact pieces": exact for every layer whose output Hessian stays diagonal down to it."""
    torch.manual_seed(2)
    make, c_in = DIAGONAL_NETS[case]
    net = make().to(DT)
    x = _img(c_in)
    t = torch.rand_like(net(x))
    for loss in (lambda o, t: F.binary_cross_entropy_with_logits(o, t), lambda o, t: F.mse_loss(o, t, reduction="sum")):
        assert_close_to(diag_hessian(net, loss, x, t, mode="diag"), dense_diag(net, loss, x, t))


class Scaled(nn.Module):
    """``module(x ∘ w)`` with a per-entry weight w: under a separable loss ``diag ∂²L/∂w² = x² ∘ diag ∂²L/∂u²``, so
    w's diagonal is the module rule's input diagonal seen through ``diag_hessian`` end to end."""

    def __init__(self, module, shape):
        super().__init__()
        self.module = module
        self.w = nn.Parameter(1 + 0.3 * torch.randn(shape, dtype=DT))

    def forward(self, x):
        return self.module(x * self.w)


def _seq(n=3, c=4, L=7):
    return torch.randn(n, c, L, dtype=DT)


def _running(norm):
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
    return norm.eval()


RULES_IN_A_NET = {
    "avgpool_divisor_override": (lambda: nn.AvgPool2d(3, stride=2, padding=1, divisor_override=2), lambda: _img(4)),
    "avgpool_ceil_counting_padding": (lambda: nn.AvgPool2d(2, stride=2, padding=1, ceil_mode=True), lambda: _img(4, 6)),
    "avgpool1d_ceil": (lambda: nn.AvgPool1d(2, stride=2, padding=1, ceil_mode=True), lambda: _seq(L=6)),
    "adaptive_avg_one_dim": (lambda: nn.AdaptiveAvgPool2d((3, None)), lambda: _img(4)),
    "adaptive_max_overlapping": (lambda: nn.AdaptiveMaxPool2d(4), lambda: _img(4)),
    "maxpool1d_dilated_ceil": (lambda: nn.MaxPool1d(3, stride=2, dilation=2, padding=1, ceil_mode=True), _seq),
    "eval_batchnorm1d_on_sequences": (lambda: _running(nn.BatchNorm1d(4)), _seq),
    "batchnorm_eval_without_running_stats": (lambda: nn.BatchNorm2d(4, track_running_stats=False).eval(), lambda: _img(4)),
    "instancenorm_tracked_eval": (lambda: _running(nn.InstanceNorm2d(4, affine=True, track_running_stats=True)),
                                  lambda: _img(4)),
    "groupnorm_without_affine": (lambda: nn.GroupNorm(2, 4, affine=False), lambda: _img(4)),
    "layernorm_without_bias": (lambda: nn.LayerNorm(5, bias=False), lambda: _img(4)),
    "layernorm_without_affine": (lambda: nn.LayerNorm((5, 5), elementwise_affine=False), lambda: _img(4)),
    "batchnorm_train_batch_1": (lambda: nn.BatchNorm2d(4), lambda: _img(4, 3, n=1)),
    "flatten0_unflatten": (lambda: nn.Sequential(nn.Flatten(0), nn.Unflatten(0, (3, 100))), lambda: _img(4)),
    "hardtanh_relu6_softplus_threshold": (lambda: nn.Sequential(nn.Hardtanh(-0.5, 0.7), nn.ReLU6(),
                                                                nn.Softplus(beta=3.0, threshold=0.3)), lambda: _img(4)),
    "leaky_relu_negative_slope": (lambda: nn.LeakyReLU(-0.3), lambda: _img(4)),
}


@pytest.mark.parametrize("case", sorted(RULES_IN_A_NET))
def test_each_rule_inside_a_network_is_exact_under_a_separable_loss(case):
    torch.manual_seed(3)
    make, make_x = RULES_IN_A_NET[case]
    x = make_x()
    module = make().to(DT)
    for p in module.parameters():
        nn.init.normal_(p)
    net = Scaled(module, x.shape)
    out = net(x)
    h, c = torch.randn_like(out), torch.randn_like(out)

    def separable(o, _):
        return (0.5 * h * o * o + c * o).sum()

    buffers = {k: v.clone() for k, v in net.named_buffers()}
    assert_close_to(diag_hessian(net, separable, x, None, mode="diag"), dense_diag(net, separable, x, None))
    assert all(torch.equal(buffers[k], v) for k, v in net.named_buffers())


# ------------------------------------------------------------------------------------------------------- refusals

REFUSED = {
    "conv_transpose": (nn.ConvTranspose2d(2, 2, 3), "ConvTranspose2d"),
    "prelu": (nn.PReLU(2), "PReLU"),
    "rms_norm": (nn.RMSNorm(5), "RMSNorm"),
    "reflect_padding": (nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), "padding_mode='reflect'"),
    "mish": (nn.Mish(), "Mish"),
    "upsample": (nn.Upsample(scale_factor=2, mode="bilinear"), "Upsample"),  # nearest is a {0, 1} Jacobian: supported
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_module_without_a_rule_is_refused_naming_it_and_the_way_out(case):
    module, named = REFUSED[case]
    net = nn.Sequential(nn.Conv2d(2, 2, 1), nn.Sequential(module)).to(DT)
    x = _img(2)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    for mode in ("diag", "approx"):
        with pytest.raises(UnsupportedModuleError) as err:
            diag_hessian(net, lambda o, t: o.square().sum(), x, None, mode=mode)
        msg = str(err.value)
        assert "'1.0'" in msg and named in msg and "mode='exact'" in msg and "\n" not in msg, msg
    assert_no_module_hooks(net)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("module,shape", [(nn.Conv2d(2, 2, 3), (2, 5, 5)), (nn.InstanceNorm1d(2, affine=True), (2, 7))])
def test_an_unbatched_input_is_refused_saying_what_to_do(module, shape):
    """torch runs these modules on unbatched inputs; their rules need the batch dim (the message now says so)."""
    net = nn.Sequential(nn.Identity(), module).to(DT)
    with pytest.raises(UnsupportedModuleError, match=r"'1'.*add the batch dimension or use mode='exact'"):
        diag_hessian(net, lambda o, t: o.square().sum(), torch.randn(*shape, dtype=DT), None, mode="diag")


# ----------------------------------------------------------------------- batch convention, repeat calls, side effects


@pytest.mark.parametrize("batch", [1, 4, 5])
def test_sum_is_batch_times_mean_and_repeated_calls_change_nothing(batch):
    """docs/hessian.md, "Batch convention": the Hessian of exactly the returned scalar; ``sum`` is N × ``mean``.
    Batch 1 runs the net in eval mode (train-mode BN needs two samples); batch 4 equals the channels of its
    ``GroupNorm(1, 4)``, where torch's stacked double backward is wrong (docs/hessian.md)."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Softplus(), nn.GroupNorm(1, 4),
                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 3)).to(DT)
    if batch == 1:
        _running(net[1])
    x, y = _img(s=4, n=batch), torch.randint(0, 3, (batch,))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    training = [m.training for m in net.modules()]
    ref = dense_diag(net, F.cross_entropy, x, y)
    summed = lambda o, t: F.cross_entropy(o, t, reduction="sum")  # noqa: E731
    for mode in ("exact", "diag", "approx", "hutchinson:2"):
        mean = diag_hessian(net, F.cross_entropy, x, y, mode=mode)
        again = diag_hessian(net, F.cross_entropy, x, y, mode=mode)
        total = diag_hessian(net, summed, x, y, mode=mode)
        assert all(torch.equal(mean[k], again[k]) for k in mean), mode
        assert_close_to(total, {k: batch * v for k, v in mean.items()}, rtol=1e-12)
        if mode == "exact":
            assert_close_to(mean, ref)
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    assert [m.training for m in net.modules()] == training
    assert all(p.grad is None for p in net.parameters())
    assert_no_module_hooks(net)


# --------------------------------------------------------------------------------------------- mixing weights (C.3)

K = 3


class Mixed(nn.Module):
    """``Σ_k w_k O_k(x)``, weights (K,) or (B, K); conv→train-mode BN, average pooling, identity."""

    def __init__(self, c):
        super().__init__()
        self.ops = nn.ModuleList([nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c, affine=False)),
                                  nn.AvgPool2d(3, 1, 1, count_include_pad=False), nn.Identity()])

    def forward(self, x, weights):
        w = weights if weights.dim() == 1 else weights[:, :, None, None, None].unbind(1)
        return sum(wk * op(x) for wk, op in zip(w, self.ops))


class Cell(nn.Module):
    """Nodes n1 = e0(x), n2 = e1(x) + shared(n1); out = n1 + softplus(n2). ``shared`` is one module for all cells."""

    def __init__(self, c, shared):
        super().__init__()
        self.e = nn.ModuleList([Mixed(c), Mixed(c)])
        self.shared = shared
        self.act = nn.Softplus()

    def forward(self, x, Z):
        n1 = self.e[0](x, Z[0])
        return n1 + self.act(self.e[1](x, Z[1]) + self.shared(n1, Z[2]))


class Supernet(nn.Module):
    """Two cells mixing with one shared α (3, K), DARTS-style; ``forward(x, Zs)`` takes per-cell weights instead."""

    def __init__(self, c=2):
        super().__init__()
        self.stem = nn.Conv2d(2, c, 3, padding=1)
        shared = Mixed(c)
        self.cells = nn.ModuleList([Cell(c, shared), Cell(c, shared)])
        self.head = nn.Linear(c, 4)
        self.alpha = nn.Parameter(0.5 * torch.randn(3, K))

    def forward(self, x, Zs=None):
        h = self.stem(x)
        for i, cell in enumerate(self.cells):
            h = cell(h, F.softmax(self.alpha, -1) if Zs is None else Zs[i])
        return self.head(h.mean((2, 3)))

    def edges(self):
        out = {}
        for i, cell in enumerate(self.cells):
            for j, e in enumerate(cell.e):
                out[f"c{i}.e{j}"] = (e, list(e.ops))
        out["shared"] = (self.cells[0].shared, list(self.cells[0].shared.ops))
        return out


def _dense(f, n):
    return torch.diagonal(torch.autograd.functional.hessian(f, torch.zeros(n, K, dtype=DT)).reshape(n * K, n * K)).reshape(n, K)


@pytest.mark.slow
def test_mixing_weight_curvature_of_a_supernet_with_shared_alpha_and_a_mixed_op_in_two_cells():
    """C.3 exact modes against dense autograd Hessians: ``alpha_diag_hessian`` (shared α, cross-cell terms in),
    ``exact`` / ``exact_per_edge`` w.r.t. Z (a zero shift per edge, one for both calls of the tied op), and
    ``exact_per_edge`` w.r.t. α owned per edge; ``exact`` w.r.t. α refuses the shared α."""
    torch.manual_seed(5)
    net = Supernet().to(DT)
    x, y = torch.randn(3, 2, 4, 4, dtype=DT), torch.randint(0, 4, (3,))
    a0 = net.alpha.detach().clone()
    Z0 = F.softmax(a0, -1)
    order = ["c0.e0", "c0.e1", "c1.e0", "c1.e1", "shared"]

    def per_edge(Z):  # Z (5, K) in `order`: the tied op gets one row for both of its calls
        return F.cross_entropy(net(x, [[Z[0], Z[1], Z[4]], [Z[2], Z[3], Z[4]]]), y)

    ref_alpha = _dense(lambda d: F.cross_entropy(net(x, [F.softmax(a0 + d, -1)] * 2), y), 3)
    ref_z = _dense(lambda d: per_edge(Z0[[0, 1, 0, 1, 2]] + d), 5)
    ref_a = _dense(lambda d: per_edge(F.softmax(a0[[0, 1, 0, 1, 2]] + d, -1)), 5)
    state = {k: v.clone() for k, v in net.state_dict().items()}  # the references moved the running statistics

    assert_close_to(alpha_diag_hessian(net, F.cross_entropy, x, y, params={"alpha": net.alpha}), {"alpha": ref_alpha}, 1e-9)
    for mode in ("exact", "exact_per_edge"):
        got = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode, wrt="Z")
        assert_close_to(got, dict(zip(order, ref_z)), 1e-9)
    got = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact_per_edge", wrt="alpha")
    assert_close_to(got, dict(zip(order, ref_a)), 1e-9)
    with pytest.raises(ValueError, match="alpha_diag_hessian"):
        arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact", wrt="alpha")
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters())
    assert_no_module_hooks(net)


class TwoEdges(nn.Module):
    """stem → edge a → edge b → tail, each edge with (B, K) weights."""

    def __init__(self, tail, n=3, c=2):
        super().__init__()
        self.stem = nn.Conv2d(2, c, 3, padding=1)
        self.a, self.b, self.tail = Mixed(c), Mixed(c), tail
        self.register_buffer("za", torch.rand(n, K, dtype=DT))
        self.register_buffer("zb", torch.rand(n, K, dtype=DT))

    def forward(self, x, shift=None):
        da, db = (0, 0) if shift is None else shift
        return self.tail(self.b(self.a(self.stem(x), self.za + da), self.zb + db))


@pytest.mark.parametrize("tail", ["none", "tanh"])
def test_per_sample_weights_last_edge_exactness_as_documented(tail):
    """(B, K) weights: the entry is the curvature of one (K,) shift shared by the batch. ``exact`` always; for the
    last edge ``diag`` also through an elementwise op, ``approx`` only where that diagonal is constant per channel
    (docs/hessian.md, "Exact pieces")."""
    torch.manual_seed(6)
    net = TwoEdges(nn.Identity() if tail == "none" else nn.Tanh()).to(DT)
    x = torch.randn(3, 2, 4, 4, dtype=DT)
    t = torch.randn_like(net(x))
    loss = lambda o, t: F.mse_loss(o, t, reduction="sum")  # noqa: E731
    ref = _dense(lambda d: loss(net(x, (d[0], d[1])), t), 2)
    edges = {"a": (net.a, list(net.a.ops)), "b": (net.b, list(net.b.ops))}
    assert_close_to(arch_diag_hessian(net, loss, x, t, edges, mode="exact"), {"a": ref[0], "b": ref[1]}, 1e-9)
    assert_close_to({"b": arch_diag_hessian(net, loss, x, t, edges, mode="diag")["b"]}, {"b": ref[1]})
    approx = arch_diag_hessian(net, loss, x, t, edges, mode="approx")["b"]
    if tail == "none":
        assert_close_to({"b": approx}, {"b": ref[1]})
    else:  # the tanh's σ'² h + σ'' g varies within a channel: the feature mean is not exact there
        assert (approx - ref[1]).abs().max() > 1e-3 * ref[1].abs().max()


def test_ggn_mode_equals_the_dense_gauss_newton_diagonal_in_eval_mode_with_a_tied_mixed_op():
    """Modes table, ``ggn``: ``Σ_n J_nᵀ H_n J_n`` with J the Jacobian of the logits w.r.t. each edge's Z (one shift
    for both calls of the tied op), H_n the per-sample cross-entropy Hessian; exact with eval-mode BatchNorm, where
    samples do not interact. It is not the Hessian here (the Softplus leaves a residual)."""
    torch.manual_seed(11)
    net = Supernet().to(DT)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            _running(m)
    net.eval()
    x, y = torch.randn(3, 2, 4, 4, dtype=DT), torch.randint(0, 4, (3,))
    Z0 = F.softmax(net.alpha.detach(), -1)[[0, 1, 0, 1, 2]]

    def logits(d):
        Z = Z0 + d
        return net(x, [[Z[0], Z[1], Z[4]], [Z[2], Z[3], Z[4]]])

    J = torch.autograd.functional.jacobian(logits, torch.zeros(5, K, dtype=DT)).reshape(3, 4, 5 * K)
    p = F.softmax(logits(torch.zeros(5, K, dtype=DT)).detach(), -1)
    H = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]) / 3  # mean reduction
    ggn = torch.diagonal(torch.einsum("nda,nde,neb->ab", J, H, J)).reshape(5, K)
    order = ["c0.e0", "c0.e1", "c1.e0", "c1.e1", "shared"]
    got = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="ggn")
    assert_close_to(got, dict(zip(order, ggn)), 1e-9)
    exact = _dense(lambda d: F.cross_entropy(logits(d), y), 5)
    assert max((got[n] - exact[i]).abs().max().item() for i, n in enumerate(order)) > 1e-3 * exact.abs().max().item()
