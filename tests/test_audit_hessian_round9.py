"""Round-9 audit of the curvature API on layer configurations the earlier hessian audits did not use: convolutions
with stride 2, dilation 2 and groups together (with zero, reflect, circular and replicate padding, ``padding='same'``,
``Conv1d``), average pooling with ``count_include_pad=False`` and ``ceil_mode=True``, adaptive average pooling to
sizes that do not divide the input (overlapping windows), overlapping max pooling with ties, every activation with a
second derivative (ELU, GELU both forms, SiLU, Softplus with a threshold, Sigmoid, Tanh) and the piecewise-linear ones,
MSE and cross-entropy with ``reduction='sum'`` and ``'mean'``, batch size 1; and a supernet of its own (2-D and 1-D
candidate ops of those kinds, α per cell or one α shared by the cells) for every mixing-weight mode and the α spectrum.

Every reference is built here from scratch in float64: dense Hessians by reverse-over-reverse autograd (never
``torch.func.hessian``), Gauss-Newton matrices from dense Jacobians and the loss Hessian, an own transcription of the
C.1/C.2 recursions from dense Jacobians of each layer with closed-form activation derivatives, and BackPACK's
DiagHessian. Where a recursion is compared with equality the reason it is exact on that model is given.
"""

import contextlib
import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import (UnsupportedModuleError, alpha_diag_hessian, arch_diag_hessian, diag_hessian,
                             hessian_eigenvalues, shared_weights_diag_hessian)

from test_audit_hessian_round7 import assert_close  # entrywise within rtol of each tensor's largest entry

DT = torch.float64


# -- independent references ---------------------------------------------------------------------------------------


def dense_hessian(f, t):
    """(Dense Hessian, gradient) of the scalar ``f(t)`` at the flat tensor ``t``, by reverse-over-reverse autograd."""
    t = t.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(t), t, create_graph=True)
    rows = [torch.autograd.grad(g[i], t, retain_graph=True)[0] for i in range(g.numel())]
    return torch.stack(rows), g.detach()


def dense_param_diag(model, loss_fn, x, y):
    """``{name: diag ∂²L/∂θ²}`` of every parameter, one dense Hessian over all of them (on a copy of the model)."""
    m = copy.deepcopy(model)
    params = dict(m.named_parameters())
    shapes = [p.shape for p in params.values()]
    sizes = [p.numel() for p in params.values()]

    def loss(flat):
        values = {n: part.view(s) for n, part, s in zip(params, torch.split(flat, sizes), shapes)}
        return loss_fn(torch.func.functional_call(m, values, (x,)), y)

    H, _ = dense_hessian(loss, torch.cat([p.detach().reshape(-1) for p in params.values()]))
    return {n: part.view(s) for n, part, s in zip(params, torch.split(H.diagonal(), sizes), shapes)}


def mse(reduction):
    return lambda o, t: F.mse_loss(o, t, reduction=reduction)


def ce(reduction):
    return lambda o, t: F.cross_entropy(o, t, reduction=reduction)


# -- weights: exact on new layer configurations --------------------------------------------------------------------

CONFIGS = {
    "reflect_stride2_dilation2_groups2": (
        lambda: nn.Sequential(nn.Conv2d(4, 6, 3, stride=2, dilation=2, groups=2, padding=2, padding_mode="reflect"),
                              nn.ELU(0.7), nn.Flatten(), nn.Linear(6 * 4 * 4, 3)), (3, 4, 8, 8)),
    "circular_depthwise_gelu_tanh": (
        lambda: nn.Sequential(nn.Conv2d(4, 4, 3, stride=2, dilation=2, groups=4, padding=2, padding_mode="circular"),
                              nn.GELU("tanh"), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)), (2, 4, 8, 8)),
    "replicate_softplus_threshold": (
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, dilation=2, groups=2, padding=1, padding_mode="replicate"),
                              nn.Softplus(beta=2, threshold=1.0), nn.Flatten(), nn.Linear(4 * 3 * 3, 3)), (2, 2, 8, 8)),
    "conv1d_reflect_strided_dilated_grouped": (
        lambda: nn.Sequential(nn.Conv1d(4, 6, 3, stride=2, dilation=2, groups=2, padding=2, padding_mode="reflect"),
                              nn.SiLU(), nn.Flatten(), nn.Linear(6 * 5, 3)), (2, 4, 9)),
    "same_dilated_avgpool_ceil_no_pad_count": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3, dilation=2, padding="same"), nn.LeakyReLU(0.2),
                              nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), nn.Flatten(),
                              nn.Linear(4 * 4 * 4, 3)), (2, 3, 7, 7)),
    "adaptive_avg_non_divisible": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Sigmoid(), nn.AdaptiveAvgPool2d((3, 4)), nn.Flatten(),
                              nn.Linear(3 * 12, 3)), (2, 2, 5, 7)),
    "overlapping_maxpool": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.ReLU6(), nn.MaxPool2d(3, 1, 1), nn.Flatten(), nn.Linear(3 * 25, 3)),
        (2, 2, 5, 5)),
    "batch_of_one": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Softplus(), nn.Flatten(), nn.Linear(3 * 9, 3)),
        (1, 2, 5, 5)),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_exact_weight_diagonal_equals_the_dense_hessian_on_new_layer_configurations(config):
    """``exact`` equals the dense reverse-over-reverse Hessian's diagonal for cross-entropy (mean, sum) and MSE (sum);
    where the diagonal recursions run, they are exact on the last Linear (an FC last layer under a per-sample loss sees
    only the diagonal of the loss Hessian) and ``sum`` is N times ``mean`` in every mode."""
    make, shape = CONFIGS[config]
    torch.manual_seed(1)
    net = make().to(DT)
    x = torch.randn(shape, dtype=DT)
    if config == "overlapping_maxpool":  # ReLU6 saturates: tied maxima inside overlapping windows
        x = 3 * x
    n = shape[0]
    cases = [(ce("mean"), torch.randint(0, 3, (n,))), (ce("sum"), torch.randint(0, 3, (n,))),
             (mse("sum"), torch.randn(n, 3, dtype=DT))]
    for loss_fn, y in cases:
        assert_close(diag_hessian(net, loss_fn, x, y, mode="exact"), dense_param_diag(net, loss_fn, x, y))
    if any(getattr(m, "padding_mode", "zeros") != "zeros" for m in net.modules()):
        return
    y = torch.randint(0, 3, (n,))
    ref = dense_param_diag(net, ce("mean"), x, y)
    last = [k for k in ref][-2:]
    for mode in ("diag", "approx"):
        mean, total = (diag_hessian(net, ce(r), x, y, mode=mode) for r in ("mean", "sum"))
        for k in ref:
            torch.testing.assert_close(total[k], n * mean[k], rtol=1e-12, atol=0)
        if mode == "diag":
            assert_close({k: mean[k] for k in last}, {k: ref[k] for k in last})


@pytest.mark.parametrize("padding_mode", ["reflect", "circular", "replicate"])
def test_a_padding_mode_without_a_rule_is_one_line_naming_the_module_and_leaves_nothing(padding_mode):
    """The recursions refuse a non-zero padding mode (their C.2 rule is for zero padding) in one line that names the
    module and the way out, with no hook, ``.grad`` or BatchNorm statistic left changed."""
    torch.manual_seed(2)
    net = nn.Sequential(nn.BatchNorm2d(2), nn.Conv2d(2, 4, 3, stride=2, dilation=2, groups=2, padding=2,
                                                     padding_mode=padding_mode), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    net = net.to(DT)
    x, y = torch.randn(3, 2, 8, 8, dtype=DT), torch.randint(0, 3, (3,))
    stats = [t.clone() for t in net[0].buffers()]
    for mode in ("diag", "approx"):
        with pytest.raises(UnsupportedModuleError) as err:
            diag_hessian(net, F.cross_entropy, x, y, mode=mode)
        msg = str(err.value)
        assert "\n" not in msg and "'1'" in msg and padding_mode in msg and "mode='exact'" in msg, msg
    assert all(torch.equal(a, b) for a, b in zip(stats, net[0].buffers()))
    assert all(p.grad is None for p in net.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in net.modules())


ACTIVATIONS = [nn.ELU(0.7), nn.GELU(), nn.GELU("tanh"), nn.SiLU(), nn.Softplus(beta=2, threshold=0.5), nn.Sigmoid(),
               nn.LeakyReLU(0.1), nn.Tanh(), nn.Hardtanh(-0.5, 0.5), nn.ReLU6()]


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: repr(a))
def test_diag_is_exact_where_the_output_hessian_stays_diagonal_through_every_activation(act):
    """docs/hessian.md: ``diag`` is exact for a layer whose output Hessian stays diagonal down to it (elementwise ops,
    max pooling, an elementwise loss). A strided, dilated, grouped conv → activation → overlapping max pooling →
    Flatten → MSE is such a layer (each max-pool output reads one input, so ``Jᵀ diag(h) J`` is diagonal; the
    activation's ``σ'' g`` term is diagonal too): its diagonal equals the dense one, mean and sum."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, dilation=2, padding=2, groups=2), act, nn.MaxPool2d(3, 1, 1),
                        nn.Flatten()).to(DT)
    x, y = torch.randn(3, 2, 9, 9, dtype=DT), torch.randn(3, 4 * 5 * 5, dtype=DT)
    for reduction in ("mean", "sum"):
        ref = dense_param_diag(net, mse(reduction), x, y)
        assert_close(diag_hessian(net, mse(reduction), x, y, mode="diag"), ref)


@pytest.mark.parametrize("batch", [1, 4])
def test_exact_on_linear_chains_is_c13_for_every_activation(batch):
    """``exact`` on a chain of Linear layers and elementwise activations (the per-sample full pre-activation recursion
    C.1.2–C.1.3, which carries ``σ'' ∘ g`` on its diagonal) equals the dense Hessian for every activation here, a
    Softplus with a threshold the inputs cross, cross-entropy summed and MSE averaged, batch 1 and 4."""
    torch.manual_seed(14)
    for act in ACTIVATIONS:
        net = nn.Sequential(nn.Linear(5, 6), act, nn.Linear(6, 4), nn.Softplus(beta=3, threshold=0.2), nn.Linear(4, 3))
        net = net.to(DT)
        x = torch.randn(batch, 5, dtype=DT)
        for loss_fn, y in ((ce("sum"), torch.randint(0, 3, (batch,))), (mse("mean"), torch.randn(batch, 3, dtype=DT))):
            assert_close(diag_hessian(net, loss_fn, x, y, mode="exact"), dense_param_diag(net, loss_fn, x, y))


def test_approx_is_exact_for_a_strided_dilated_grouped_conv1d_last_layer_under_mse():
    """``approx`` is exact for the last layer when its pre-activation Hessian is constant per channel (MSE straight
    after it: ``2/(N·D)`` everywhere), also for a Conv1d with stride, dilation, groups and zero padding."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=2, groups=2), nn.Flatten()).to(DT)
    x, y = torch.randn(3, 4, 9, dtype=DT), torch.randn(3, 6 * 5, dtype=DT)
    ref = dense_param_diag(net, F.mse_loss, x, y)
    for mode in ("approx", "diag"):
        assert_close(diag_hessian(net, F.mse_loss, x, y, mode=mode), ref)


def _gelu_derivatives(t):
    """σ', σ'' of GELU σ(t) = t Φ(t) in closed form: Φ + tφ and φ(2 − t²)."""
    phi = torch.exp(-t.square() / 2) / math.sqrt(2 * math.pi)
    Phi = 0.5 * (1 + torch.erf(t / math.sqrt(2)))
    return Phi + t * phi, phi * (2 - t.square())


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_recursions_equal_an_own_transcription_of_c1_c2_on_a_conv_gelu_adaptive_pool_net(mode):
    """C.1.4–C.1.5 / C.2.1–C.2.5 transcribed here from dense per-layer Jacobians: cross-entropy's per-sample Hessian
    diagonal at the logits; the Linear rows (``approx``: the row mean of h, C.2.4 with E(M²)); the adaptive pool's
    ``(J∘J)ᵀ h`` with overlapping windows; GELU's ``σ'² h + σ'' g`` with closed-form derivatives; the conv weight's
    ``Σ_p (∂y_p/∂w)² h_p`` (``approx``: h replaced by its channel mean over batch and space)."""
    torch.manual_seed(5)
    conv = nn.Conv2d(4, 4, 3, stride=2, dilation=2, padding=2, groups=2).to(DT)
    pool, fc = nn.AdaptiveAvgPool2d((3, 2)), nn.Linear(4 * 6, 3).to(DT)
    net = nn.Sequential(conv, nn.GELU(), pool, nn.Flatten(), fc)
    B = 3
    x, y = torch.randn(B, 4, 9, 9, dtype=DT), torch.randint(0, 3, (B,))
    pre = conv(x).detach()  # (B, 4, 5, 5)
    a = F.gelu(pre).requires_grad_(True)
    logits = fc(pool(a).flatten(1))
    (g,) = torch.autograd.grad(F.cross_entropy(logits, y), a)
    p = logits.detach().softmax(-1)
    h = (p - p.square()) / B  # diagonal of the mean cross-entropy's per-sample Hessian
    flat_in = pool(a).detach().flatten(1)
    if mode == "approx":
        h = h.mean(0, keepdim=True).expand_as(h)
    ref = {"4.weight": h.T @ flat_in.square(), "4.bias": h.sum(0)}
    h_flat = h @ fc.weight.detach().square()
    Jp = torch.autograd.functional.jacobian(lambda t: pool(t), torch.zeros(1, 4, 5, 5, dtype=DT)).reshape(4 * 6, 4 * 25)
    h_a = (h_flat @ Jp.square()).view(B, 4, 5, 5)
    d1, d2 = _gelu_derivatives(pre)
    h_pre = d1.square() * h_a + d2 * g
    if mode == "approx":
        h_pre = h_pre.mean((0, 2, 3), keepdim=True).expand_as(h_pre)
    Jw = torch.autograd.functional.jacobian(
        lambda w: F.conv2d(x, w, None, 2, 2, 2, 2), conv.weight.detach())  # (B, 4, 5, 5, *w.shape)
    ref = {"0.weight": (Jw.square() * h_pre[..., None, None, None, None]).sum((0, 1, 2, 3)),
           "0.bias": h_pre.sum((0, 2, 3)), **ref}
    got = diag_hessian(net, F.cross_entropy, x, y, mode=mode)
    assert_close({k: got[k] for k in ref}, ref)


def test_approx_input_rule_of_a_strided_dilated_grouped_conv_is_c25_folded_as_documented():
    """docs/hessian.md: ``approx`` folds a conv's per-channel input diagonal as ``Σ_{c_out, tap} W² E(h) · (rows using
    the tap) / (H_in W_in)``, i.e. the mean over input positions of ``Σ_{o,p} J_{o p, c q}² E(h)_o`` with J the conv's
    dense Jacobian (stride 2, dilation 2, groups 2, zero padding that some taps fall into); through GELU's
    ``σ'² h + σ'' g`` and the first conv's channel mean this gives its weight and bias diagonals."""
    torch.manual_seed(13)
    c1, c2 = nn.Conv2d(2, 4, 3, padding=1).to(DT), nn.Conv2d(4, 6, 3, stride=2, dilation=2, padding=1, groups=2).to(DT)
    fc = nn.Linear(6 * 3 * 3, 3).to(DT)
    net = nn.Sequential(c1, nn.GELU(), c2, nn.Flatten(), fc)
    B = 3
    x, y = torch.randn(B, 2, 7, 7, dtype=DT), torch.randint(0, 3, (B,))
    pre = c1(x).detach()
    a = F.gelu(pre).requires_grad_(True)
    logits = fc(c2(a).flatten(1))
    (g,) = torch.autograd.grad(F.cross_entropy(logits, y), a)
    p = logits.detach().softmax(-1)
    h = ((p - p.square()) / B).mean(0)  # the Linear's row mean of the loss diagonal
    Eh = (h @ fc.weight.detach().square()).view(6, 9).mean(1)  # c2's output diagonal, its channel mean
    J = torch.autograd.functional.jacobian(c2, torch.zeros(1, 4, 7, 7, dtype=DT)).reshape(6, 9, 4, 49)
    h_a = (J.square() * Eh.view(6, 1, 1, 1)).sum((0, 1)).mean(-1).view(1, 4, 1, 1)
    d1, d2 = _gelu_derivatives(pre)
    h_pre = (d1.square() * h_a + d2 * g).mean((0, 2, 3))
    Jw1 = torch.autograd.functional.jacobian(lambda w: F.conv2d(x, w, None, 1, 1), c1.weight.detach())
    Jw2 = torch.autograd.functional.jacobian(lambda w: F.conv2d(a.detach(), w, None, 2, 1, 2, 2), c2.weight.detach())
    ref = {"0.weight": (Jw1.square() * h_pre.view(1, 4, 1, 1, 1, 1, 1, 1)).sum((0, 1, 2, 3)), "0.bias": h_pre * B * 49,
           "2.weight": (Jw2.square() * Eh.view(1, 6, 1, 1, 1, 1, 1, 1)).sum((0, 1, 2, 3))}
    got = diag_hessian(net, F.cross_entropy, x, y, mode="approx")
    assert_close({k: got[k] for k in ref}, ref)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_exact_weights_equal_backpack_on_strided_dilated_grouped_convs_and_pools(reduction):
    """BackPACK's DiagHessian (a Sequential without BatchNorm) as a second reference: a strided, dilated, grouped
    conv, Sigmoid, overlapping max pooling, a dilated conv padded to keep its size, ELU, strided average pooling with
    padding: ``exact`` equals it (BackPACK itself fails on ``ceil_mode`` pooling, so none here)."""
    backpack = pytest.importorskip("backpack")
    from backpack.extensions import DiagHessian

    torch.manual_seed(6)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, dilation=2, padding=2, groups=2), nn.Sigmoid(),
                        nn.MaxPool2d(3, 1, 1), nn.Conv2d(4, 2, 3, padding=2, dilation=2), nn.ELU(0.5),
                        nn.AvgPool2d(3, 2, 1), nn.Flatten(), nn.Linear(2 * 3 * 3, 3)).to(DT)
    x, y = torch.randn(3, 2, 9, 9, dtype=DT), torch.randint(0, 3, (3,))
    bp = backpack.extend(copy.deepcopy(net))
    loss = backpack.extend(nn.CrossEntropyLoss(reduction=reduction))(bp(x), y)
    restore = contextlib.ExitStack()  # BackPACK makes helper tensors in the default dtype: float64 for its backward
    restore.callback(torch.set_default_dtype, torch.get_default_dtype())
    torch.set_default_dtype(DT)
    with restore, backpack.backpack(DiagHessian()):
        loss.backward()
    ref = {n: p.diag_h for n, p in bp.named_parameters()}
    assert_close(diag_hessian(net, ce(reduction), x, y, mode="exact"), ref, rtol=1e-9)


# -- mixing weights on an own supernet -----------------------------------------------------------------------------


class Mixed(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.ops = nn.ModuleList(ops)

    def forward(self, x, weights):
        out = 0
        for k, op in enumerate(self.ops):
            w = weights[..., k]
            if w.dim() == 1:  # per-sample (B, K) weights: one number per sample
                w = w.view(-1, *([1] * (x.dim() - 1)))
            out = out + w * op(x)
        return out


def candidate_ops(C, dims):
    if dims == 2:
        return [nn.Sequential(nn.Conv2d(C, C, 3, dilation=2, padding=2, groups=C), nn.ELU(0.6)),
                nn.AvgPool2d(3, 1, 1, count_include_pad=False), nn.MaxPool2d(3, 1, 1),
                nn.Sequential(nn.SiLU(), nn.Conv2d(C, C, 1, bias=False)),
                nn.Sequential(nn.Conv2d(C, C, 3, padding="same", groups=2), nn.Softplus(beta=1.5))]
    return [nn.Sequential(nn.Conv1d(C, C, 3, dilation=2, padding=2, groups=C), nn.GELU()),
            nn.AvgPool1d(3, 1, 1, count_include_pad=False), nn.Sequential(nn.Sigmoid(), nn.Conv1d(C, C, 1)),
            nn.Sequential(nn.LeakyReLU(0.2), nn.Conv1d(C, C, 3, padding=1, groups=2))]


class Cell(nn.Module):
    """node 0 = input; node 1 = e0(node 0); node 2 = e1(node 0) + e2(node 1), the output."""

    def __init__(self, C, dims):
        super().__init__()
        self.edges = nn.ModuleList([Mixed(candidate_ops(C, dims)) for _ in range(3)])

    def forward(self, x, Z):
        return self.edges[1](x, Z[1]) + self.edges[2](self.edges[0](x, Z[0]), Z[2])


class Supernet(nn.Module):
    """Two cells; α per cell (``own_alpha``) or one α shared by both. Head: adaptive pooling to a size that does not
    divide the input, a Linear. ``forward(x, weights)`` takes ``[Z per cell]`` or ``{cell index: Z}``."""

    def __init__(self, dims=2, own_alpha=True, C=4, cells=2):
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv1d
        self.stem = conv(1, C, 3, padding=1)
        self.cells = nn.ModuleList([Cell(C, dims) for _ in range(cells)])
        self.K = len(candidate_ops(C, dims))
        self.alphas = nn.ParameterList([nn.Parameter(0.1 * torch.randn(3, self.K)) for _ in range(cells if own_alpha else 1)])
        pool = nn.AdaptiveAvgPool2d((2, 3)) if dims == 2 else nn.AdaptiveAvgPool1d(3)
        self.head = nn.Sequential(pool, nn.Flatten(), nn.Linear(C * (6 if dims == 2 else 3), 3))

    def arch_parameters(self):
        return list(self.alphas)

    def named_arch_parameters(self):
        return [(f"alphas.{i}", a) for i, a in enumerate(self.alphas)]

    def probabilities(self):
        return [F.softmax(self.alphas[min(i, len(self.alphas) - 1)], -1) for i in range(len(self.cells))]

    def forward(self, x, weights=None):
        weights = self.probabilities() if weights is None else weights
        if isinstance(weights, dict):
            weights = [weights[i] for i in range(len(self.cells))]
        h = self.stem(x)
        for cell, Z in zip(self.cells, weights):
            h = cell(h, Z)
        return self.head(h)

    def edges(self):
        return {f"c{c}.e{e}": (m, list(m.ops)) for c, cell in enumerate(self.cells) for e, m in enumerate(cell.edges)}


class AtWeights(nn.Module):
    """The supernet at fixed mixing weights ``Zs`` ((K,) or (B, K) per edge): ``model(x)`` for the arch functions."""

    def __init__(self, net, Zs):
        super().__init__()
        self.net, self.Zs = net, Zs

    def forward(self, inp):
        return self.net(inp, self.Zs)


def _stack(result, cells=2):
    return torch.stack([result[f"c{c}.e{e}"] for c in range(cells) for e in range(3)]).view(cells, 3, -1)


def _batch(dims, B=3):
    return (torch.randn(B, 1, 5, 5, dtype=DT) if dims == 2 else torch.randn(B, 1, 7, dtype=DT)), torch.randint(0, 3, (B,))


@pytest.mark.parametrize("dims", [2, 1])
def test_every_mixing_weight_mode_against_dense_references_on_an_own_supernet(dims):
    """On the own supernet (α per cell, eval-free: no BatchNorm, samples independent):

    * ``exact`` / ``exact_per_edge`` (Z and α) equal the diagonal of the dense Hessian w.r.t. the per-cell Z, α;
    * ``ggn`` equals ``Σ_n diag(J_nᵀ H_n J_n)`` from the dense Jacobian of the logits w.r.t. Z and each sample's loss
      Hessian;
    * ``alpha_diag_hessian`` equals the dense α-Hessian's diagonal, ``shared_weights_diag_hessian`` the dense Z one;
    * the top eigenvalues, the largest-magnitude one, of the α-Hessian equal ``torch.linalg.eigvalsh`` of it."""
    torch.manual_seed(7)
    net = Supernet(dims=dims).to(DT)
    K, edges = net.K, net.edges()
    x, y = _batch(dims)
    Zs = [z.detach() for z in net.probabilities()]

    def loss_of_z(t):
        return F.cross_entropy(net(x, list(t.view(2, 3, K))), y)

    H, _ = dense_hessian(loss_of_z, torch.cat([z.reshape(-1) for z in Zs]))
    ref_z = H.diagonal().view(2, 3, K)
    for mode in ("exact", "exact_per_edge"):
        torch.testing.assert_close(_stack(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode)), ref_z,
                                   rtol=1e-10, atol=1e-14)
    flat_z = torch.cat([z.reshape(-1) for z in Zs])
    J = torch.autograd.functional.jacobian(lambda t: net(x, list(t.view(2, 3, K))), flat_z)  # (B, 3, N)
    out = net(x, Zs).detach()

    def loss_of_row(n):
        return lambda o: F.cross_entropy(torch.cat([out[:n], o[None], out[n + 1:]]), y)

    Hl = torch.stack([torch.autograd.functional.hessian(loss_of_row(n), out[n]) for n in range(len(y))])
    ggn = torch.einsum("bci,bcd,bdi->i", J, Hl, J).view(2, 3, K)
    torch.testing.assert_close(_stack(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="ggn")), ggn,
                               rtol=1e-10, atol=1e-14)

    def loss_of_alpha(t):
        return F.cross_entropy(net(x, [F.softmax(a, -1) for a in t.view(2, 3, K)]), y)

    HA, _ = dense_hessian(loss_of_alpha, torch.cat([a.detach().reshape(-1) for a in net.alphas]))
    ref_a = HA.diagonal().view(2, 3, K)
    torch.testing.assert_close(_stack(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="exact", wrt="alpha")),
                               ref_a, rtol=1e-10, atol=1e-14)
    got = alpha_diag_hessian(net, F.cross_entropy, x, y)
    torch.testing.assert_close(torch.stack([got["alphas.0"], got["alphas.1"]]), ref_a, rtol=1e-10, atol=1e-14)
    got = shared_weights_diag_hessian(net, F.cross_entropy, x, y, {0: Zs[0], 1: Zs[1]})
    torch.testing.assert_close(torch.stack([got[0], got[1]]), ref_z, rtol=1e-10, atol=1e-14)
    ev = torch.linalg.eigvalsh(HA)
    res = hessian_eigenvalues(net, F.cross_entropy, x, y, k=2)
    scale = ev.abs().max().item()
    assert res.converged
    assert abs(res.largest_algebraic - ev[-1].item()) <= 1e-8 * scale
    assert torch.allclose(torch.as_tensor(res.eigenvalues, dtype=DT), ev[-2:].flip(0), rtol=0, atol=1e-8 * scale)
    assert abs(res.largest_magnitude - ev[ev.abs().argmax()].item()) <= 1e-8 * scale


def test_shared_alpha_exact_diagonal_and_spectrum_equal_the_dense_hessian_and_exact_is_refused_per_edge():
    """One α shared by both cells: ``alpha_diag_hessian`` and the spectrum equal the dense α-Hessian (cross-cell terms
    included); per-edge ``exact`` w.r.t. α is refused naming ``alpha_diag_hessian``; ``exact_per_edge`` summed over
    the cells is the block-diagonal part (the dense diagonal minus the cross-cell terms, computed here)."""
    torch.manual_seed(8)
    net = Supernet(dims=1, own_alpha=False).to(DT)
    K, edges = net.K, net.edges()
    x, y = _batch(1, B=4)

    def loss_of_alpha(t):
        Z = F.softmax(t.view(3, K), -1)
        return F.cross_entropy(net(x, [Z, Z]), y)

    HA, _ = dense_hessian(loss_of_alpha, net.alphas[0].detach().reshape(-1))
    torch.testing.assert_close(alpha_diag_hessian(net, F.cross_entropy, x, y)["alphas.0"], HA.diagonal().view(3, K),
                               rtol=1e-10, atol=1e-14)
    ev = torch.linalg.eigvalsh(HA)
    res = hessian_eigenvalues(net, F.cross_entropy, x, y, k=1)
    assert abs(res.largest_algebraic - ev[-1].item()) <= 1e-8 * ev.abs().max().item()
    with pytest.raises(ValueError, match="alpha_diag_hessian"):
        arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="exact", wrt="alpha")

    def loss_per_cell(t):  # each cell its own copy of α: the per-cell blocks
        a0, a1 = t.view(2, 3, K)
        return F.cross_entropy(net(x, [F.softmax(a0, -1), F.softmax(a1, -1)]), y)

    a = net.alphas[0].detach()
    Hc, _ = dense_hessian(loss_per_cell, torch.cat([a.reshape(-1), a.reshape(-1)]))
    per_cell = Hc.diagonal().view(2, 3, K)
    got = _stack(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="exact_per_edge", wrt="alpha"))
    torch.testing.assert_close(got, per_cell, rtol=1e-10, atol=1e-14)
    assert not torch.allclose(got.sum(0), HA.diagonal().view(3, K), rtol=1e-3)


@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("dims", [2, 1])
def test_last_edges_are_exact_in_diag_and_approx_under_mse_with_k_or_per_sample_weights(dims, per_sample):
    """docs/hessian.md: ``arch_diag_hessian`` is exact for an edge whose output reaches an elementwise loss with a
    diagonal Hessian, (K,) or (B, K) weights, ``diag`` always and ``approx`` where that diagonal is constant per
    channel. The last cell's edges e1, e2 feed MSE directly (constant ``2/(N·D)``): both modes equal the dense
    Hessian of a (K,) shift shared by the batch, mean and sum; sum is N times mean in every mode."""
    torch.manual_seed(9)
    net = Supernet(dims=dims).to(DT)
    net.head = nn.Flatten()
    K, B = net.K, 3
    x, _ = _batch(dims, B)
    y = torch.randn_like(net(x))
    shift = 0.3 * torch.randn(B, 1, 1, dtype=DT) if per_sample else 0
    Zs = [F.softmax(a.detach() + shift, -1) for a in net.alphas]
    if per_sample:
        Zs = [z.transpose(0, 1) for z in Zs]  # edge e gets (B, K)

    model, edges = AtWeights(net, Zs), net.edges()
    results = {}
    for reduction in ("mean", "sum"):
        def loss_of_shift(t):
            d = t.view(2, 3, K)
            return mse(reduction)(net(x, [[Zs[c][e] + d[c, e] for e in range(3)] for c in range(2)]), y)

        H, _ = dense_hessian(loss_of_shift, torch.zeros(2 * 3 * K, dtype=DT))
        ref = H.diagonal().view(2, 3, K)
        for mode in ("diag", "approx", "exact"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # exact's func route may fall back to autograd here
                got = _stack(arch_diag_hessian(model, mse(reduction), x, y, edges, mode=mode))
            results[reduction, mode] = got
            tol = 1e-10 * ref[1, 1:].abs().max().item()
            assert (got[1, 1:] - ref[1, 1:]).abs().max().item() <= tol, (mode, got[1, 1:], ref[1, 1:])
            if mode == "exact":
                torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-14)
    n = y.numel()
    for mode in ("diag", "approx", "exact"):
        torch.testing.assert_close(results["sum", mode], n * results["mean", mode], rtol=1e-10, atol=1e-14)


def test_curvature_calls_leave_no_state_and_repeat_bitwise_on_a_shared_alpha_supernet_with_batch_norm():
    """Every mode of ``arch_diag_hessian`` (Z and α), of ``diag_hessian``, ``alpha_diag_hessian`` and the spectrum,
    called twice on a supernet with a train-mode BatchNorm in its stem and one α shared by the cells: the global RNG
    state, the running statistics, hooks, ``.grad`` and ``requires_grad`` are as before, and the two calls are
    bitwise equal (the random modes draw from their own seeded generators)."""
    torch.manual_seed(10)
    net = Supernet(dims=2, own_alpha=False).to(DT)
    net.stem = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)).to(DT)
    x, y = _batch(2)
    bn = net.stem[1]

    def state():
        return ([torch.get_rng_state()] + [t.clone() for t in bn.buffers()],
                sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in net.modules()),
                [p.requires_grad for p in net.parameters()])

    calls = {f"arch {m} {w}": (lambda m=m, w=w: arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=m, wrt=w))
             for m in ("exact_per_edge", "diag", "approx", "ggn", "ggn_mc", "hutchinson:2") for w in ("Z", "alpha")}
    calls.update({f"weights {m}": (lambda m=m: diag_hessian(net, F.cross_entropy, x, y, mode=m))
                  for m in ("exact", "diag", "approx", "hutchinson:2")})
    calls["alpha_diag_hessian"] = lambda: alpha_diag_hessian(net, F.cross_entropy, x, y)
    calls["eigenvalues"] = lambda: hessian_eigenvalues(net, F.cross_entropy, x, y, k=2).eigenvalues
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name, call in calls.items():
            before = state()
            first, second = call(), call()
            after = state()
            assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and before[1:] == after[1:], name
            assert all(p.grad is None for p in net.parameters()), name
            if isinstance(first, dict):
                assert all(torch.equal(first[k], second[k]) for k in first), name
            else:
                assert torch.equal(torch.as_tensor(first), torch.as_tensor(second)), name


def _with_dropout(net):
    """Train-mode dropout in front of candidate op 2 of every edge: a random forward (and one that ``torch.func``'s
    vmap refuses, so the exact routes fall back to reverse-over-reverse products)."""
    for cell in net.cells:
        for edge in cell.edges:
            edge.ops[2] = nn.Sequential(nn.Dropout(0.5), *edge.ops[2])
    return net.train()


def test_a_seeded_random_forward_is_one_net_in_the_exact_routes_and_hutchinson():
    """docs/hessian.md: a train-mode dropout draws its masks in every forward; seeding before each call makes each
    call differentiate the net of the masks its seed gives, so modes can be compared. The exact routes ran a second
    forward when ``torch.func`` could not trace the model (``backend='auto'``'s fallback) and ``hutchinson:<k>`` ran
    its control variate and its products on two forwards: each drew other masks, so ``exact`` (Z and α) and
    ``alpha_diag_hessian`` were the curvature of another net than the seeded one (5% apart here) and
    ``hutchinson:<k>`` mixed two nets (biased: 5% off at k = 64 and k = 256 alike). Reference: the dense Hessian of
    the net whose masks the seed's first forward draws."""
    torch.manual_seed(11)
    net = _with_dropout(Supernet(dims=1).to(DT))
    K, edges = net.K, net.edges()
    x, y = _batch(1)
    Zs = [z.detach() for z in net.probabilities()]
    torch.manual_seed(12)
    H, _ = dense_hessian(lambda t: F.cross_entropy(net(x, list(t.view(2, 3, K))), y), torch.cat([z.reshape(-1) for z in Zs]))
    torch.manual_seed(12)
    HA, _ = dense_hessian(lambda t: F.cross_entropy(net(x, [F.softmax(a, -1) for a in t.view(2, 3, K)]), y),
                          torch.cat([a.detach().reshape(-1) for a in net.alphas]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's warning
        for wrt, ref in (("Z", H), ("alpha", HA)):
            torch.manual_seed(12)
            got = _stack(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="exact", wrt=wrt))
            torch.testing.assert_close(got, ref.diagonal().view(2, 3, K), rtol=1e-10, atol=1e-14)
        torch.manual_seed(12)
        got = alpha_diag_hessian(net, F.cross_entropy, x, y)
        torch.testing.assert_close(torch.stack([got["alphas.0"], got["alphas.1"]]), HA.diagonal().view(2, 3, K),
                                   rtol=1e-10, atol=1e-14)
    # hutchinson:<k> with its GGN control variate: on the last cell's edges e1, e2 before an MSE head the output is
    # linear in their Z and the loss quadratic, so H = C within each edge and the estimate is exact for any probes,
    # provided C and H are of one net
    net.head = nn.Flatten()
    y = torch.randn_like(net(x))

    def loss_of_shift(t):
        d = t.view(2, 3, K)
        return F.mse_loss(net(x, [[Zs[c][e] + d[c, e] for e in range(3)] for c in range(2)]), y)

    torch.manual_seed(12)
    H, _ = dense_hessian(loss_of_shift, torch.zeros(2 * 3 * K, dtype=DT))
    ref = H.diagonal().view(2, 3, K)[1, 1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        torch.manual_seed(12)
        got = _stack(arch_diag_hessian(AtWeights(net, Zs), F.mse_loss, x, y, edges, mode="hutchinson:2"))[1, 1:]
    assert (got - ref).abs().max().item() <= 1e-10 * ref.abs().max().item(), (got, ref)
