"""Audit round 18 of the wiring paper's theorems (supplement §4 Thm. 1, §5 Cor. 1.2, §6 Thm. 2, §8.1-8.2) and the
structural scale-invariance flag, against references written here in float64 with every normalization at a tiny
eps (1e-14): f(c·x) = f(x) evaluated for c > 0 (the flag's stated contract; c < 0 is not part of it: ReLU, and an
affine-free normalization alone, N(−x) = −N(x), break it), J_f(x)·x by ``torch.func.jvp``, and autograd.

Defects this file found (each test named below fails without its fix):
- a bias before a pointwise transposed convolution with ``output_padding`` (kernel 1, stride 1, dilation 2) and a
  normalization was called removed: the rows ``output_padding`` appends take no input tap, so a constant input
  comes out constant only where a tap lands (0 on the appended rows) and the normalization keeps it; the op was
  flagged scale-invariant (f(0.3·x) off by 12 %) and the bias got exactly zero curvature in diag/approx
  (``test_a_bias_before_a_transposed_convolution_with_output_padding_is_not_removed``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.cost import is_scale_invariant

DT = torch.float64
EPS = 1e-14
SCALES = (0.3, 3.7)


def _randomized(net: nn.Module, seed: int = 0) -> nn.Module:
    """``net`` in float64 with every parameter drawn N(0, 1) (biases and norm shifts non-zero)."""
    torch.manual_seed(seed)
    net = net.to(DT)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()
    return net


def _relative_change(f: nn.Module, x: torch.Tensor, c: float) -> float:
    """max |f(c·x) − f(x)| / max |f(x)|, without touching running statistics (train-mode norms here track none
    or are restored by the caller)."""
    with torch.no_grad():
        y = f(x)
        return float((f(c * x) - y).abs().max() / y.abs().max())


def _numerically_invariant(f: nn.Module, x: torch.Tensor) -> bool:
    # at eps = 1e-14 an invariant composition differs by round-off (≤ 1e-12 relative here), a non-invariant one by
    # whole percents: 1e-8 separates them by four orders of magnitude either side
    return all(_relative_change(f, x, c) < 1e-8 for c in SCALES)


# --- the structural flag against f(c·x) = f(x) ----------------------------------------------------------------

def test_a_bias_before_a_transposed_convolution_with_output_padding_is_not_removed():
    """ConvTranspose2d(k=1, stride=1, dilation=2, output_padding=1) appends a row and a column that no input tap
    reaches: a per-channel bias o entering it comes out as W·o inside and 0 there, not constant over space, so the
    BatchNorm after it keeps it. Without output_padding (or without the bias) the same op is invariant."""
    def body(output_padding, bias):
        return nn.Sequential(nn.Conv2d(3, 3, 1, bias=bias),
                             nn.ConvTranspose2d(3, 3, 1, stride=1, dilation=2, output_padding=output_padding, bias=False),
                             nn.BatchNorm2d(3, eps=EPS, track_running_stats=False))

    x = torch.randn(4, 3, 5, 5, dtype=DT)
    for output_padding, bias in ((1, True), (0, True), (1, False)):
        f = _randomized(body(output_padding, bias))
        same = _numerically_invariant(f, x)
        assert same == (not (output_padding and bias))  # the reference itself
        assert is_scale_invariant(f, x) == same, (output_padding, bias)
        assert is_scale_invariant(f) == same, (output_padding, bias)


# --- the credit maps (supplement §2) ----------------------------------------------------------------------------

def test_the_credit_maps_given_a_list_or_float_for_a_tensor_are_one_cost_error_line():
    """Round 15 made loss_minus_entropy / edge_costs / output_edge_costs refuse a non-tensor in one CostError line;
    the credit maps raised AttributeError ('list' object has no attribute 'shape') or torch's TypeError."""
    from nasdiag.cost import CostError, darts_alpha_grad, dsnas_alpha_grad, proxyless_alpha_grad, snas_alpha_grad
    from nasdiag.cost.credit import softmax_jacobian

    p = torch.softmax(torch.randn(3, dtype=DT), 0)
    calls = {
        "costs": lambda: darts_alpha_grad([1.0, 2.0, 3.0], p),
        "probs": lambda: darts_alpha_grad(p, [0.2, 0.3, 0.5]),
        "gate_costs": lambda: proxyless_alpha_grad(0.5, p),
        "relaxed": lambda: snas_alpha_grad(p, 0.5, 1.0),
        "onehot": lambda: dsnas_alpha_grad(p, [0.0, 1.0, 0.0], p),
        "probs ": lambda: softmax_jacobian([0.5, 0.5]),
    }
    for name, call in calls.items():
        with pytest.raises(CostError, match=rf"{name.strip()} must be a torch.Tensor") as info:
            call()
        assert "\n" not in str(info.value)
    # and the tensors themselves still go through: (diag p − ppᵀ) C against autograd of <C, softmax(α)>
    alpha = torch.randn(3, dtype=DT, requires_grad=True)
    C = torch.randn(3, dtype=DT)
    (g,) = torch.autograd.grad((torch.softmax(alpha, 0) * C).sum(), alpha)
    assert torch.allclose(darts_alpha_grad(C, torch.softmax(alpha, 0).detach()), g, rtol=1e-13, atol=1e-15)


# --- the deviation at finite eps: J_N(x)·x = (N(x) − β)·eps/(var + eps) per group -----------------------------------

def test_eps_deviation_of_an_unbatched_instance_norm_is_per_channel_as_its_jvp_says():
    """InstanceNorm1d takes an unbatched (C, L) input and normalizes each channel over L; eps_deviation took the
    variance over no dim (x.var(dim=[]): all entries at once), one number for every channel. Reference: the
    directional derivative d/dc N(c·x)|_{c=1} = J_N(x)·x by torch.func.jvp, which is (N(x) − β)·eps/(var_c + eps)."""
    from torch.func import jvp

    from nasdiag.cost import eps_deviation

    torch.manual_seed(1)
    norm = nn.InstanceNorm1d(3, eps=1e-2, affine=True).to(DT)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    # channels of very different spread, so one global variance is far from each channel's
    x = torch.randn(3, 8, dtype=DT) * torch.tensor([[0.05], [0.3], [2.0]], dtype=DT)
    y, jx = jvp(norm, (x,), (x,))
    factor = (jx / (y - norm.bias.reshape(3, 1))).detach()  # constant along L within a channel
    assert torch.allclose(factor, factor[:, :1].expand(3, 8), rtol=1e-10)
    dev = eps_deviation(norm, x)
    assert dev.shape == (1, 3)
    assert torch.allclose(dev[0], factor[:, 0], rtol=1e-10)
    # batched, the same channels are what it always gave
    assert torch.allclose(eps_deviation(norm, x.unsqueeze(0)), dev, rtol=1e-14)


def test_eps_deviation_and_the_flag_given_a_list_are_one_cost_error_line():
    from nasdiag.cost import CostError, eps_deviation

    with pytest.raises(CostError, match="norm_input must be a torch.Tensor") as info:
        eps_deviation(nn.BatchNorm2d(3), [[1.0, 2.0, 3.0]])
    assert "\n" not in str(info.value)
    op = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    before = [b.clone() for b in op.buffers()]
    with pytest.raises(CostError, match="example_input must be") as info:
        is_scale_invariant(op, [[1.0, 2.0, 3.0]])  # was conv2d's many-line TypeError from the rank-learning forward
    assert "\n" not in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, op.buffers()))


# --- Thm. 2 (supplement §6, eq. 12) -----------------------------------------------------------------------------

@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_thm2_output_cost_of_the_last_cell_is_l_minus_h_for_labels_of_every_integer_dtype(label_dtype):
    """<∂L/∂X4, X4> by autograd for X4 → global average pooling → bias-free linear → batch-mean cross-entropy equals
    loss_minus_entropy(Y, labels). The function's check accepts any integer labels ("integer class labels"), but
    uint8 / int16 ones then stopped in torch's gather (int32/int64 index only) instead of giving L − H."""
    from nasdiag.cost import loss_minus_entropy

    torch.manual_seed(2)
    B, C, N = 6, 5, 4
    X4 = torch.randn(B, C, 3, 3, dtype=DT, requires_grad=True)
    W = torch.randn(C, N, dtype=DT)
    labels = torch.randint(0, N, (B,))
    Y = X4.mean((2, 3)) @ W
    L = F.cross_entropy(Y, labels)
    (g,) = torch.autograd.grad(L, X4)
    cost = (g * X4).sum()
    p = torch.softmax(Y.detach(), -1)
    H = -(p * p.log()).sum(-1).mean()
    assert torch.allclose(cost, L.detach() - H, rtol=1e-12)  # the reference agrees with eq. 12 re-derived
    got = loss_minus_entropy(Y.detach(), labels.to(label_dtype))
    assert torch.allclose(got, cost, rtol=1e-12)


def test_scatter_cells_given_a_list_is_one_cost_error_line():
    """Round 15 gave scatter_cells one-line errors for bad layouts; a list for the costs or the indices still raised
    AttributeError ('list' object has no attribute 'dim' / 'shape')."""
    from nasdiag.cost import CostError, scatter_cells

    costs, slot, index = torch.randn(2, 3), torch.tensor([0, 1]), torch.tensor([0, 0])
    for name, args in (("edge_costs_", (costs.tolist(), slot, index)), ("cell_slot", (costs, [0, 1], index)),
                       ("edge_index", (costs, slot, [0, 0]))):
        with pytest.raises(CostError, match=f"{name} must be a torch.Tensor") as info:
            scatter_cells(*args, 2, 1)
        assert "\n" not in str(info.value)
    assert torch.equal(scatter_cells(costs, slot, index, 2, 1), costs.reshape(2, 1, 3))


def test_registering_a_rule_that_is_not_callable_is_refused_and_leaves_the_registry_as_it_was():
    """register_homogeneity_rule(MyOp, "degree 1") was stored: every later flag of a model holding a MyOp then
    stopped in "'str' object is not callable", and fixing it needed overwrite=True."""
    from nasdiag.cost import HOMOGENEITY_RULES, degree_rule, register_homogeneity_rule

    class Doubling(nn.Module):
        def forward(self, x):
            return 2 * x

    with pytest.raises(TypeError, match="rule must be callable") as info:
        register_homogeneity_rule(Doubling, "positively homogeneous of degree 1")
    assert "\n" not in str(info.value)
    assert Doubling not in HOMOGENEITY_RULES
    register_homogeneity_rule(Doubling, degree_rule(1.0, "2·x", mixes=frozenset()))  # no overwrite needed
    try:
        op = nn.Sequential(Doubling(), nn.Conv2d(2, 2, 1, bias=False), nn.BatchNorm2d(2))
        assert is_scale_invariant(op)
    finally:
        HOMOGENEITY_RULES.pop(Doubling)


def _conv_bias(C=4):
    return nn.Conv2d(C, C, 3, bias=True)


_NAMED = {  # name: (op, invariant as the numbers say it, for the record)
    "conv(bias)->GroupNorm(2, 4): the per-channel bias varies inside a group":
        (lambda: nn.Sequential(_conv_bias(), nn.GroupNorm(2, 4, eps=EPS)), False),
    "conv(bias)->GroupNorm(4, 4) (instance norm): removed":
        (lambda: nn.Sequential(_conv_bias(), nn.GroupNorm(4, 4, eps=EPS)), True),
    "conv(bias)->LayerNorm(C, H, W): the bias varies along the channel":
        (lambda: nn.Sequential(_conv_bias(), nn.LayerNorm([4, 4, 4], eps=EPS)), False),
    "conv(bias)->LayerNorm(H, W): removed per (sample, channel)":
        (lambda: nn.Sequential(_conv_bias(), nn.LayerNorm([4, 4], eps=EPS)), True),
    "conv->InstanceNorm(track_running_stats) in eval mode: affine":
        (lambda: nn.Sequential(_conv_bias(), nn.InstanceNorm2d(4, eps=EPS, track_running_stats=True)).eval(), False),
    "conv->BatchNorm in eval mode: affine":
        (lambda: nn.Sequential(nn.Conv2d(4, 4, 3, bias=False), nn.BatchNorm2d(4, eps=EPS)).eval(), False),
    "conv(bias)->GroupNorm(1, 4)->InstanceNorm: the factor and the term go":
        (lambda: nn.Sequential(_conv_bias(), nn.GroupNorm(1, 4, eps=EPS), nn.InstanceNorm2d(4, eps=EPS)), True),
    "conv(bias)->GroupNorm(1, 4)->ReLU->InstanceNorm: the ReLU breaks it":
        (lambda: nn.Sequential(_conv_bias(), nn.GroupNorm(1, 4, eps=EPS), nn.ReLU(), nn.InstanceNorm2d(4, eps=EPS)),
         False),
    "tanh->conv->BatchNorm": (lambda: nn.Sequential(nn.Tanh(), _conv_bias(), nn.BatchNorm2d(4, eps=EPS)), False),
}


@pytest.mark.parametrize("name", list(_NAMED))
def test_named_compositions_flag_as_f_of_scaled_input_says(name):
    """The compositions the brief names, in float64 at eps = 1e-14 (train mode unless said): the flag (with and,
    more cautious, without an example) against f(c·x) = f(x) for c = 0.3, 3.7. The table's expectation is the
    reference's, asserted first, so a wrong row fails instead of testing nothing."""
    make, invariant = _NAMED[name]
    f = _randomized(make())
    x = torch.randn(3, 4, 6, 6, dtype=DT)
    state = {k: v.clone() for k, v in f.state_dict().items()}
    assert _numerically_invariant(f, x) == invariant
    f.load_state_dict(state)
    assert is_scale_invariant(f, x) == invariant
    assert not is_scale_invariant(f) or invariant


def test_the_flag_is_about_c_greater_than_0_relu_conv_bn_is_not_invariant_for_negative_c():
    """Thm. 1's J_f(x)·x = 0 needs f(c·x) = f(x) only near c = 1; the flag's contract says c > 0. For c < 0 the
    invariant DARTS op ReLU→conv→BN changes (relu(−x) is another input), which is why the docs say c > 0."""
    f = _randomized(nn.Sequential(nn.ReLU(), nn.Conv2d(4, 4, 3, bias=False), nn.BatchNorm2d(4, eps=EPS)))
    x = torch.randn(3, 4, 6, 6, dtype=DT)
    assert is_scale_invariant(f, x) and _numerically_invariant(f, x)
    assert _relative_change(f, x, -1.0) > 0.1
