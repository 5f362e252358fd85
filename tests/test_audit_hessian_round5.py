"""Fifth audit round of the curvature API (``nasdiag.hessian``) with an auditor's own float64 models.

Every reference is built in this file, never from nasdiag:

* this file's own transcription of bayesnas-appendix §C: the FC diagonal recursion C.1.4-C.1.5, the convolution
  as an FC layer on unfolded rows C.2.1-C.2.3 (``F.unfold`` / an explicit strided view for 1-D), the feature-mean
  approximation C.2.4-C.2.5 with the corrections and the folding convention docs/hessian.md states, and C.3.1 for
  the mixing weights;
* dense Hessians by reverse-over-reverse autograd (``torch.autograd.functional.hessian``) through
  ``torch.func.functional_call``, and their ``torch.linalg.eigh`` spectra.

Models earlier rounds did not use: ELU/Softplus/GELU/LeakyReLU nets, average and adaptive average pooling, grouped,
depthwise, strided, dilated, non-square and 1-D convolutions, ``Flatten`` in odd places, residual nets, sum
reductions, NLL on ``log_softmax``, ``BCEWithLogits``, multi-output MSE.

Defects this round found (each test named fails on the library before its fix):

* ``diag``/``approx`` walked a parameter that a ruled module owns only through that module: a use of it in forward
  code as well (``x * self.fc.bias``: 78% off; ``F.linear(x, self.fc.weight)``: 61% off) was skipped silently; now
  summed, or refused naming the op and the parameter —
  ``test_a_ruled_modules_parameter_used_in_forward_code_too_is_counted_or_refused_never_dropped``;
* ``ggn_mc``'s seeded draws met the eigensolver's eigenvector signs, so one seed gave other numbers on a GPU than on
  the CPU (99% apart on an H200) — ``test_ggn_modes_do_not_depend_on_the_eigensolvers_sign_convention``; and the
  canonical sign of both GGN modes was decided by round-off between entries of equal magnitude (two-class
  cross-entropy: ``ggn`` 35%, ``ggn_mc`` 82% apart under train-mode BN) —
  ``test_ggn_signs_of_eigenvectors_with_entries_of_equal_magnitude_are_canonical_too``;
* ``EigenvalueEarlyStop`` took a string or None ``start_epoch`` and failed with a bare TypeError 2·window epochs into
  a search (a string threshold: a bare TypeError) — ``test_early_stop_refuses_bad_settings_when_made_not_at_its_first_decision``;
* docs: ``approx``'s BatchNorm/InstanceNorm pass on the group mean of their input diagonal (1.6% apart from the
  documented recursion through an activation before the norm); the shared-α/Z diagonals come in the dtype of what
  they differentiate, not the loss's — ``test_diag_and_approx_are_the_appendix_recursions_on_conv_and_fc_nets``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from nasdiag.hessian import diag_hessian

from conftest import assert_no_module_hooks
from test_audit_weights_round4 import dense_diagonals as dense_hessian_diagonals  # autograd.functional.hessian

DT = torch.float64


# ---------------------------------------------------------------------------------------------------------------
# references


def loss_output_diagonal(loss_fn, out, y):
    """Diagonal of ∂²loss/∂outputs², from the dense Hessian of the loss alone."""
    o = out.detach()
    H = torch.autograd.functional.hessian(lambda t: loss_fn(t, y), o)
    return H.reshape(o.numel(), o.numel()).diagonal().reshape(o.shape)


def elementwise_derivatives(act, x):
    """σ'(x), σ''(x) of an elementwise module, by two reverse passes of Σσ."""
    t = x.detach().requires_grad_(True)
    (d1,) = torch.autograd.grad(act(t).sum(), t, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), t, allow_unused=True) if d1.requires_grad else (None,)
    return d1.detach(), (torch.zeros_like(x) if d2 is None else d2.detach())


def per_sample_jacobian_sq_T(module, x, h):
    """(J∘J)ᵀ h per sample for a parameter-free module linear in its input (pooling, Flatten), J dense."""
    out = []
    for n in range(x.shape[0]):
        xn = x[n : n + 1].detach()
        J = torch.autograd.functional.jacobian(module, xn)  # (out..., in...)
        J = J.reshape(h[n : n + 1].numel(), xn.numel())
        out.append((J.square().T @ h[n].reshape(-1)).reshape(xn.shape))
    return torch.cat(out)


def batch_step(module, x, h, g):
    """The exact diagonal step through a module that couples entries (a normalization through its statistics), with
    its parameters fixed, over the whole batch: ``diag(Jᵀ diag(h) J) + Σ_o g_o ∂²y_o/∂x²``, J dense."""
    x = x.detach()
    J = torch.autograd.functional.jacobian(module, x).reshape(h.numel(), x.numel())
    R = torch.autograd.functional.hessian(lambda t: (module(t) * g).sum(), x).reshape(x.numel(), x.numel())
    return (J.square().T @ h.reshape(-1) + R.diagonal()).reshape(x.shape)


def norm_step(module, x, h, g, mode):
    """BatchNorm/InstanceNorm through their statistics: the exact step; in ``approx`` passed on as its mean over each
    normalization group (a channel over batch and space; a channel of one sample), as docs/hessian.md states."""
    h = batch_step(module, x, h, g)
    if mode == "approx":
        dims = (0,) + tuple(range(2, x.dim())) if isinstance(module, nn.modules.batchnorm._BatchNorm) else tuple(range(2, x.dim()))
        h = h.mean(dims, keepdim=True).expand(x.shape)
    return h


NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.InstanceNorm1d, nn.InstanceNorm2d)
ELEMENTWISE = (nn.ELU, nn.Softplus, nn.GELU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.ReLU)
PARAM_FREE_LINEAR = (nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.Flatten, nn.Unflatten,
                     nn.MaxPool2d, nn.MaxPool1d, nn.Identity)


def unfold_rows(x, conv):
    """Unfolded input rows M (N, C_in·taps, L) of a Conv1d/Conv2d (Ma & Lu: the conv as an FC layer on rows).

    2-D by ``F.unfold``; 1-D by an explicit strided view of the zero-padded input (no ``F.unfold``)."""
    if isinstance(conv, nn.Conv2d):
        return F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=conv.stride)
    (k,), (s,), (p,), (d,) = conv.kernel_size, conv.stride, conv.padding, conv.dilation
    xp = F.pad(x, (p, p))
    span = d * (k - 1) + 1
    win = xp.unfold(2, span, s)[..., ::d]  # (N, C, L_out, k)
    return win.permute(0, 1, 3, 2).reshape(x.shape[0], x.shape[1] * k, -1)


def fold_rows(rows, conv, x_shape):
    """Adjoint of :func:`unfold_rows`: sum each unfolded entry back onto the input entry it copies."""
    if isinstance(conv, nn.Conv2d):
        return F.fold(rows, x_shape[2:], conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=conv.stride)
    x = torch.zeros(x_shape, dtype=rows.dtype).requires_grad_(True)
    with torch.enable_grad():
        (back,) = torch.autograd.grad(unfold_rows(x, conv), x, rows)
    return back


def conv_recursion(conv, x, h_out, mode):
    """C.2.1-C.2.3 (``diag``) or C.2.4-C.2.5 (``approx``) for one convolution, groups included.

    Returns (h_in, {"weight": ..., "bias": ...})."""
    G, W = conv.groups, conv.weight.detach()
    N, C_out = h_out.shape[:2]
    M = unfold_rows(x, conv)  # (N, C_in·taps, L)
    taps = W[0, 0].numel()
    L = M.shape[-1]
    h = h_out.reshape(N, C_out, L)
    Mg = M.reshape(N, G, -1, L)  # (N, G, C_in/G·taps, L)
    hg = h.reshape(N, G, C_out // G, L)
    Wg = W.reshape(G, C_out // G, -1)  # (G, C_out/G, C_in/G·taps)
    if mode == "diag":
        HW = torch.einsum("ngol,ngjl->goj", hg, Mg.square())  # C.2.1 summed over rows (C.2.3 without 1/bHW)
        rows_in = torch.einsum("goj,ngol->ngjl", Wg.square(), hg)  # (W^M)ᵀ² h per row
        h_in = fold_rows(rows_in.reshape(N, -1, L), conv, x.shape)  # C.2.2, back to conv shape
        hb = h.sum((0, 2))
    else:
        hbar = hg.mean((0, 3))  # E(H_j) per output channel, (G, C_out/G)
        HW = hbar[:, :, None] * Mg.square().sum((0, 3))[:, None, :]  # E(h) ⊗ Σ_rows M² (C.2.4 with E(M²))
        vec = torch.einsum("goj,go->gj", Wg.square(), hbar)  # Ĥ of C.2.5 before the activation
        rows_in = vec.reshape(1, -1, 1).expand(N, -1, L)  # repeated over the b·H_out·W_out rows
        folded = fold_rows(rows_in.contiguous(), conv, x.shape)  # folded back ...
        dims = tuple(d for d in range(x.dim()) if d != 1)
        h_in = folded.mean(dims, keepdim=True).expand(x.shape)  # ... and its per-channel mean (docs/hessian.md)
        hb = hbar.reshape(-1) * (N * L)
    out = {"weight": HW.reshape(W.shape)}
    if conv.bias is not None:
        out["bias"] = hb
    return h_in, out


def linear_recursion(lin, x, h_out, mode):
    """C.1.4-C.1.5 (``diag``) or its feature-mean analogue (``approx``) over rows (..., in)."""
    W = lin.weight.detach()
    rows_x = x.reshape(-1, x.shape[-1])
    rows_h = h_out.reshape(-1, h_out.shape[-1])
    if mode == "diag":
        HW = rows_h.T @ rows_x.square()
        h_in = h_out @ W.square()
        hb = rows_h.sum(0)
    else:
        hbar = rows_h.mean(0)
        HW = torch.outer(hbar, rows_x.square().sum(0))
        h_in = (hbar @ W.square()).expand(x.shape)
        hb = hbar * rows_h.shape[0]
    out = {"weight": HW}
    if lin.bias is not None:
        out["bias"] = hb
    return h_in, out


def _loss_grad(loss_fn, logits, y):
    o = logits.detach().requires_grad_(True)
    with torch.enable_grad():
        return torch.autograd.grad(loss_fn(o, y), o)[0]


def seq_backward(seq, x, h_out, g_out, mode):
    """This file's recursion through ``seq`` from a given diagonal ``h_out`` and gradient ``g_out`` at its output.
    Returns (h_in, {param: diagonal})."""
    mods = list(seq) if isinstance(seq, nn.Sequential) else [seq]
    ins, outs = [], []
    with torch.enable_grad():
        t = x.detach().requires_grad_(True)
        for m in mods:
            ins.append(t)
            t = m(t)
            outs.append(t)
        grads = torch.autograd.grad(t, outs, g_out, allow_unused=True)
    h, found = h_out, {}
    for i in reversed(range(len(mods))):
        m, xin, g = mods[i], ins[i].detach(), grads[i]
        if isinstance(m, (nn.Conv1d, nn.Conv2d)):
            h, ps = conv_recursion(m, xin, h, mode)
        elif isinstance(m, nn.Linear):
            h, ps = linear_recursion(m, xin, h, mode)
        elif isinstance(m, ELEMENTWISE):
            d1, d2 = elementwise_derivatives(m, xin)
            h, ps = d1.square() * h + (0 if g is None else d2 * g), {}
        elif isinstance(m, PARAM_FREE_LINEAR):
            h, ps = per_sample_jacobian_sq_T(m, xin, h), {}
        elif isinstance(m, NORMS) and not m.affine and m.training:
            h, ps = norm_step(m, xin, h, g, mode), {}
        else:
            raise AssertionError(f"no reference for {type(m).__name__}")
        found.update({f"{i}.{k}": v for k, v in ps.items()})
    return h, found


def reference_recursion(seq: nn.Sequential, loss_fn, x, y, mode):
    """This file's own ``diag``/``approx`` on a Sequential of Linear, Conv1d/2d, elementwise activations,
    parameter-free linear modules and affine-free train-mode norms. Returns {param name: diagonal}."""
    with torch.enable_grad():
        logits = seq(x)
    return seq_backward(seq, x, loss_output_diagonal(loss_fn, logits, y), _loss_grad(loss_fn, logits, y), mode)[1]


def assert_close(got, want, rtol=1e-10):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        scale = want[k].abs().max().clamp_min(1e-300)
        err = (got[k] - want[k]).abs().max()
        assert err <= rtol * scale, (k, float(err / scale), got[k], want[k])


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ---------------------------------------------------------------------------------------------------------------
# diag / approx against this file's transcription (they implement the recursion, so they must agree to round-off)


def conv2d_net():
    return nn.Sequential(
        nn.Conv2d(3, 6, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        nn.ELU(alpha=0.7),
        nn.Conv2d(6, 6, 3, padding=1, groups=3, bias=False),
        nn.Softplus(beta=2.0),
        nn.Conv2d(6, 6, (1, 3), padding=(0, 1), groups=6),
        nn.GELU(),
        nn.AvgPool2d(2, padding=1, ceil_mode=True, count_include_pad=False),
        nn.Conv2d(6, 4, 1, stride=(1, 2)),
        nn.LeakyReLU(0.2),
        nn.AdaptiveAvgPool2d((2, 1)),
        nn.Flatten(),
        nn.Linear(8, 5),
    )


def conv1d_net():
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, stride=2, padding=2, dilation=2, groups=2),
        nn.GELU(approximate="tanh"),
        nn.AvgPool1d(3, stride=2, padding=1, count_include_pad=False),
        nn.Conv1d(4, 4, 2, groups=4, bias=False),
        nn.ELU(),
        nn.AdaptiveAvgPool1d(3),
        nn.Flatten(),
        nn.Linear(12, 3),
        nn.Softplus(),
    )


def conv_norm_net(norm):
    # an activation *before* the normalization: there approx's group mean at the norm's input is not the mean the
    # next convolution takes anyway (E(σ'²)·E(h) instead of E(σ'² h))
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ELU(),
        norm,
        nn.Conv2d(4, 3, 3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(12, 3),
    )


def seq_mlp():
    # Linear on (N, T, F) rows, Flatten in the middle, a Linear on the flattened features
    return nn.Sequential(
        nn.Linear(4, 5),
        nn.SiLU(),
        nn.Linear(5, 3, bias=False),
        nn.Flatten(),
        nn.LeakyReLU(0.3),
        nn.Linear(9, 4),
    )


def sum_mse(o, t):
    return F.mse_loss(o, t, reduction="sum")


def bce_sum(o, t):
    return F.binary_cross_entropy_with_logits(o, t, reduction="sum")


def ce_sum(o, t):
    return F.cross_entropy(o, t, reduction="sum")


def nll_of_log_softmax(o, t):
    return F.nll_loss(F.log_softmax(o, dim=1), t)


CASES = {
    "conv2d_ce": (conv2d_net, lambda g: (torch.randn(4, 3, 7, 6, generator=g, dtype=DT), torch.randint(0, 5, (4,), generator=g)),
                  F.cross_entropy),
    "conv2d_ce_sum": (conv2d_net, lambda g: (torch.randn(3, 3, 5, 5, generator=g, dtype=DT), torch.randint(0, 5, (3,), generator=g)),
                      ce_sum),
    "conv2d_nll_log_softmax": (conv2d_net, lambda g: (torch.randn(3, 3, 6, 5, generator=g, dtype=DT),
                                                      torch.randint(0, 5, (3,), generator=g)), nll_of_log_softmax),
    "conv1d_mse_sum": (conv1d_net, lambda g: (torch.randn(3, 2, 11, generator=g, dtype=DT), torch.randn(3, 3, generator=g, dtype=DT)),
                       sum_mse),
    "conv_elu_batchnorm": (lambda: conv_norm_net(nn.BatchNorm2d(4, affine=False)),
                           lambda g: (torch.randn(3, 2, 4, 4, generator=g, dtype=DT), torch.randint(0, 3, (3,), generator=g)),
                           F.cross_entropy),
    "conv_elu_instancenorm": (lambda: conv_norm_net(nn.InstanceNorm2d(4)),
                              lambda g: (torch.randn(3, 2, 4, 4, generator=g, dtype=DT), torch.randint(0, 3, (3,), generator=g)),
                              F.cross_entropy),
    "seq_mlp_bce": (seq_mlp, lambda g: (torch.randn(5, 3, 4, generator=g, dtype=DT), torch.rand(5, 4, generator=g, dtype=DT)),
                    bce_sum),
}


@pytest.mark.parametrize("mode", ["diag", "approx"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_diag_and_approx_are_the_appendix_recursions_on_conv_and_fc_nets(case, mode):
    make, data, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = make().double()
    x, y = data(torch.Generator().manual_seed(1))
    want = reference_recursion(model, loss_fn, x, y, mode)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = diag_hessian(model, loss_fn, x, y, mode=mode)
    for v in got.values():
        assert v.dtype == DT and v.device == x.device and not v.requires_grad
    assert_close(got, want)
    # nothing behind: no hooks, no .grad, parameters and training flags unchanged
    assert_no_module_hooks(model)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(m.training for m in model.modules())


# ---------------------------------------------------------------------------------------------------------------
# exact against the dense autograd Hessian


class Residual(nn.Module):
    """Conv → ELU → (conv + skip) → AvgPool → Flatten → Linear, with a Softplus branch added to the skip."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.act = nn.ELU()
        self.inner = nn.Conv2d(3, 3, (3, 1), padding=(1, 0), groups=3)
        self.soft = nn.Softplus()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.flat = nn.Flatten()
        self.head = nn.Linear(12, 4)

    def forward(self, x):
        a = self.act(self.conv(x))
        a = a + self.soft(self.inner(a))
        return self.head(self.flat(self.pool(a)))


def mlp(act):
    return nn.Sequential(nn.Linear(3, 4), act, nn.Linear(4, 4), nn.LeakyReLU(0.1), nn.Linear(4, 3))


EXACT_CASES = {
    "elu_chain_ce_sum": (lambda: mlp(nn.ELU(0.5)), (6, 3), "ce_sum"),
    "softplus_chain_bce": (lambda: mlp(nn.Softplus(beta=3.0)), (5, 3), "bce"),
    "gelu_chain_mse_multi": (lambda: mlp(nn.GELU()), (5, 3), "mse"),
    "gelu_chain_nll": (lambda: mlp(nn.GELU(approximate="tanh")), (5, 3), "nll"),
    "residual_conv_ce": (Residual, (3, 2, 4, 4), "ce"),
    "conv1d_mse_sum": (conv1d_net, (2, 2, 9), "mse_sum"),
}
LOSSES = {"ce_sum": ce_sum, "bce": F.binary_cross_entropy_with_logits, "mse": F.mse_loss, "nll": nll_of_log_softmax,
          "ce": F.cross_entropy, "mse_sum": sum_mse}


def targets_for(loss, out_shape, g):
    if loss in ("ce", "ce_sum", "nll"):
        return torch.randint(0, out_shape[1], out_shape[:1], generator=g)
    if loss == "bce":
        return torch.rand(out_shape, generator=g, dtype=DT)
    return torch.randn(out_shape, generator=g, dtype=DT)


@pytest.mark.parametrize("case", sorted(EXACT_CASES))
def test_exact_equals_the_dense_autograd_hessian_on_new_models(case):
    make, shape, loss = EXACT_CASES[case]
    torch.manual_seed(2)
    model = make().double()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g, dtype=DT)
    with torch.no_grad():
        out_shape = model(x).shape
    y = targets_for(loss, out_shape, g)
    want = dense_hessian_diagonals(model, LOSSES[loss], x, y)
    got = diag_hessian(model, LOSSES[loss], x, y, mode="exact")
    assert_close(got, want, rtol=1e-9)
    assert all(p.grad is None for p in model.parameters())
    assert_no_module_hooks(model)


class WithLogSoftmax(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body, self.out = body, nn.LogSoftmax(dim=1)

    def forward(self, x):
        return self.out(self.body(x))


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_a_log_softmax_in_the_model_with_nll_is_cross_entropy_on_the_logits(mode):
    """Only the diagonal of the loss Hessian at the logits seeds C.1.5, and that diagonal is the same whether the
    model ends in LogSoftmax (NLL: a loss linear in its outputs, the curvature all in the glue's residual term) or the
    loss takes the logits (cross-entropy)."""
    torch.manual_seed(4)
    body = conv2d_net().double()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(3, 3, 6, 6, generator=g, dtype=DT), torch.randint(0, 5, (3,), generator=g)
    want = diag_hessian(body, F.cross_entropy, x, y, mode=mode)
    got = diag_hessian(WithLogSoftmax(body), F.nll_loss, x, y, mode=mode)
    assert_close({k.removeprefix("body."): v for k, v in got.items()}, want, rtol=1e-10)
    assert_close(want, reference_recursion(body, F.cross_entropy, x, y, mode))


# ---------------------------------------------------------------------------------------------------------------
# mixing weights: a 1-D supernet of two edges in a chain, (K,) or (B, K) weights, each edge owning its α


class Mixed1d(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ops = nn.ModuleList([
            nn.Sequential(nn.Conv1d(c, c, 3, padding=1, groups=c), nn.ELU()),
            nn.Sequential(nn.Softplus(), nn.Conv1d(c, c, 1)),
            nn.AvgPool1d(3, stride=1, padding=1),
            nn.Sequential(nn.GELU(), nn.Conv1d(c, c, 3, padding=2, dilation=2, groups=2, bias=False)),
        ])

    def forward(self, x, weights):
        if weights.dim() == 2:
            return sum(weights[:, k, None, None] * op(x) for k, op in enumerate(self.ops))
        return sum(weights[k] * op(x) for k, op in enumerate(self.ops))


class Chain1d(nn.Module):
    """stem → e0 → e1 → tail; each edge owns its α (2, K); ``per_sample`` mixes with (B, K) weights."""

    def __init__(self, c=4, per_sample=False):
        super().__init__()
        self.stem = nn.Conv1d(2, c, 3, padding=1)
        self.e = nn.ModuleList([Mixed1d(c), Mixed1d(c)])
        self.tail = nn.Sequential(nn.Softplus(), nn.AdaptiveAvgPool1d(2), nn.Flatten(), nn.Linear(2 * c, 3))
        self.alpha = nn.Parameter(0.7 * torch.randn(2, 4))
        self.per_sample = per_sample

    def weights(self, batch):
        Z = F.softmax(self.alpha, -1)
        if self.per_sample:  # a per-sample gate on top of softmax(α): (B, K) weights, not a softmax
            gate = 1 + 0.3 * torch.sin(torch.arange(batch, dtype=Z.dtype, device=Z.device))[:, None, None] * \
                torch.arange(1, 5, dtype=Z.dtype, device=Z.device)
            return [gate[:, 0] * Z[0], gate[:, 0].flip(0) * Z[1]]
        return [Z[0], Z[1]]

    def forward(self, x, Zs=None):
        Zs = self.weights(x.shape[0]) if Zs is None else Zs
        h = self.stem(x)
        for e, z in zip(self.e, Zs):
            h = e(h, z)
        return self.tail(h)

    def edges(self):
        return {f"e{i}": (m, list(m.ops)) for i, m in enumerate(self.e)}


def chain1d(per_sample=False, seed=6, B=3, L=7):
    torch.manual_seed(seed)
    net = Chain1d(per_sample=per_sample).double()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(B, 2, L, generator=g, dtype=DT)
    y = torch.randint(0, 3, (B,), generator=g)
    return net, x, y


def reference_c3(net, loss_fn, x, y, mode):
    """C.3.1 (``diag``) / C.3.2 (``approx``) on this file's recursion: {edge: (K,)} w.r.t. Z, and ∂L/∂Z."""
    with torch.no_grad():
        Zs = [z.detach() for z in net.weights(x.shape[0])]
    with torch.enable_grad():
        s = net.stem(x).detach()
        xs, op_out, outs = [], [], []
        h = s
        for e, z in zip(net.e, Zs):
            xs.append(h)
            op_out.append([op(h).detach() for op in e.ops])
            h = e(h, z)
            outs.append(h)
        logits = net.tail(h)
        loss = loss_fn(logits, y)
        grads = torch.autograd.grad(loss, outs)
    h_tail, _ = seq_backward(net.tail, outs[-1].detach(), loss_output_diagonal(loss_fn, logits, y),
                             _loss_grad(loss_fn, logits, y), mode)
    result, dLdZ = {}, {}
    h_j = h_tail
    for i in reversed(range(len(net.e))):
        B = torch.stack(op_out[i])  # (K, N, C, L)
        if mode == "diag":
            H = (B.square() * h_j).flatten(1).sum(1)
        else:
            H = B.square().sum((1, 3)) @ h_j.mean((0, 2))
        result[f"e{i}"] = H
        dLdZ[f"e{i}"] = (B * grads[i]).flatten(1).sum(1)
        # C.3.1 through the mixed op to its input: Σ_k Z_k² (op_k's recursion of h_j), summed at the fan-out
        z = Zs[i]
        h_in = 0
        for k, op in enumerate(net.e[i].ops):
            zk = z[:, k].reshape(-1, 1, 1) if z.dim() == 2 else z[k]
            h_in = h_in + seq_backward(op, xs[i], zk * zk * h_j, zk * grads[i], mode)[0]
        h_j = h_in
    return result, dLdZ


def softmax_chain(z_alpha, dLdZ, hz):
    """Σ_k J_ki² H_Z,k + Σ_k g_k ∂²Z_k/∂α_i², ∂²Z_k/∂α_i² from the dense Hessian of softmax itself."""
    a = z_alpha.detach()
    J = torch.autograd.functional.jacobian(lambda t: F.softmax(t, -1), a)  # [k, i]
    d2 = torch.stack([torch.autograd.functional.hessian(lambda t, k=k: F.softmax(t, -1)[k], a).diagonal()
                      for k in range(a.numel())])  # [k, i]
    return (J.square() * hz[:, None]).sum(0) + (dLdZ[:, None] * d2).sum(0)


ARCH_LOSSES = {"ce": F.cross_entropy, "ce_sum": ce_sum}


@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_mixing_weight_recursions_are_c31_and_c32_on_a_1d_supernet(mode, per_sample):
    from nasdiag.hessian import arch_diag_hessian

    net, x, y = chain1d(per_sample)
    loss_fn = ce_sum if per_sample else F.cross_entropy
    want, dLdZ = reference_c3(net, loss_fn, x, y, mode)
    got = arch_diag_hessian(net, loss_fn, x, y, net.edges(), mode=mode)
    assert_close(got, want, rtol=1e-10)
    for v in got.values():
        assert v.dtype == DT and v.shape == (4,)
    if not per_sample:
        got_a = arch_diag_hessian(net, loss_fn, x, y, net.edges(), mode=mode, wrt="alpha")
        want_a = {f"e{i}": softmax_chain(net.alpha[i], dLdZ[f"e{i}"], want[f"e{i}"]) for i in range(2)}
        assert_close(got_a, want_a, rtol=1e-10)
    assert net.alpha.grad is None and all(p.grad is None for p in net.parameters())
    assert_no_module_hooks(net)


def shift_hessian_and_ggn(net, loss_fn, x, y):
    """Dense ∂²L/∂δ² and the dense Gauss-Newton matrix Jᵀ H_f J for one (K,) shift δ_e per edge added to its
    weights (shared by the batch), each (2K, 2K) over [δ_0, δ_1]."""
    with torch.no_grad():
        Zs = [z.detach() for z in net.weights(x.shape[0])]
    K = Zs[0].shape[-1]

    def logits(d):
        return net(x, [Zs[0] + d[:K], Zs[1] + d[K:]])

    d0 = torch.zeros(2 * K, dtype=DT)
    H = torch.autograd.functional.hessian(lambda d: loss_fn(logits(d), y), d0)
    J = torch.autograd.functional.jacobian(logits, d0).reshape(-1, 2 * K)
    with torch.no_grad():
        out = logits(d0)
    Hf = torch.autograd.functional.hessian(lambda o: loss_fn(o, y), out).reshape(out.numel(), out.numel())
    return H, J.T @ Hf @ J


def per_edge(v, K=4):
    return {"e0": v[:K], "e1": v[K:]}


@pytest.mark.parametrize("per_sample", [False, True])
def test_exact_and_ggn_mixing_weights_equal_the_dense_shift_hessian_and_gauss_newton(per_sample):
    from nasdiag.hessian import arch_diag_hessian

    net, x, y = chain1d(per_sample)
    loss_fn = ce_sum if per_sample else F.cross_entropy
    H, G = shift_hessian_and_ggn(net, loss_fn, x, y)
    assert_close(arch_diag_hessian(net, loss_fn, x, y, net.edges(), mode="exact"), per_edge(H.diagonal()), rtol=1e-9)
    assert_close(arch_diag_hessian(net, loss_fn, x, y, net.edges(), mode="ggn"), per_edge(G.diagonal()), rtol=1e-9)
    assert rel(G.diagonal(), H.diagonal()) > 0.05  # the residual the GGN drops is not small here
    if not per_sample:  # each edge owns its α: the exact α diagonal is the dense one
        alpha = net.alpha.detach()

        def loss_of(a):
            return loss_fn(net(x, [F.softmax(a[0], -1), F.softmax(a[1], -1)]), y)

        Ha = torch.autograd.functional.hessian(loss_of, alpha).reshape(8, 8)
        got = arch_diag_hessian(net, loss_fn, x, y, net.edges(), mode="exact", wrt="alpha")
        assert_close(got, per_edge(Ha.diagonal()), rtol=1e-9)


def test_ggn_mc_is_unbiased_for_the_gauss_newton_diagonal_where_samples_do_not_interact():
    """E[ggn_mc] = diag G: one draw is (aᵀε)² with E = aᵀa = G_ii and variance ≤ 2 G_ii², so the mean of S draws
    lies within 6·√(2/S)·G_ii of G_ii (normal approximation of a mean of 4000 draws; a wrong factor 2 or a missing
    sample would be 20+ standard deviations off)."""
    from nasdiag.hessian import arch_diag_hessian

    net, x, y = chain1d(True)
    _, G = shift_hessian_and_ggn(net, ce_sum, x, y)
    S = 4000
    got = arch_diag_hessian(net, ce_sum, x, y, net.edges(), mode="ggn_mc", samples=S, seed=3)
    want = per_edge(G.diagonal())
    for e in want:
        bound = 6 * math.sqrt(2 / S) * want[e]
        assert ((got[e] - want[e]).abs() <= bound).all(), (e, got[e], want[e])


@pytest.mark.parametrize("seed", [0, 1])
def test_hutchinson_mixing_weights_stay_within_their_own_noise_of_the_dense_diagonal(seed):
    """Per-edge probes with the GGN as control variate: entry i's error is (1/k) Σ_s Σ_{j≠i} ε_si ε_sj (H−C)_ij
    over the edge's block, a Rademacher sum given ε_si, so Hoeffding with a union bound over the entries
    (failure 1e-6) bounds it by √(2 ln(2·8/1e-6) Σ_{j≠i}(H−C)_ij² / k)."""
    from nasdiag.hessian import arch_diag_hessian

    net, x, y = chain1d(False)
    H, G = shift_hessian_and_ggn(net, F.cross_entropy, x, y)
    k = 3
    got = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=f"hutchinson:{k}", seed=seed)
    R = H - G
    for i, e in enumerate(("e0", "e1")):
        block = R[4 * i : 4 * i + 4, 4 * i : 4 * i + 4]
        off = (block.square().sum(1) - block.diagonal().square())
        bound = torch.sqrt(2 * math.log(2 * 8 / 1e-6) * off / k) + 1e-12 * H.abs().max()
        err = (got[e] - H.diagonal()[4 * i : 4 * i + 4]).abs()
        assert (err <= bound).all(), (e, err, bound)
    assert float(R.abs().max()) > 1e-3 * float(H.abs().max())  # the control variate leaves work for the probes
    # wrt α: probed in α since round 12 (tests/test_audit_hessian_round12.py), so the same bound holds for the α block
    # J (H − C) J around the α diagonal diag(J H J) + Σ_k g_k ∂²Z_k/∂α² (this file's own softmax derivatives)
    dLdZ = reference_c3(net, F.cross_entropy, x, y, "diag")[1]
    got_a = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=f"hutchinson:{k}", seed=seed, wrt="alpha")
    for i, e in enumerate(("e0", "e1")):
        a = net.alpha[i].detach()
        J = torch.autograd.functional.jacobian(lambda t: F.softmax(t, -1), a)
        block = J @ R[4 * i : 4 * i + 4, 4 * i : 4 * i + 4] @ J
        off = (block.square().sum(1) - block.diagonal().square())
        bound = torch.sqrt(2 * math.log(2 * 8 / 1e-6) * off / k) + 1e-12 * H.abs().max()
        want = softmax_chain(a, dLdZ[e], torch.zeros(4, dtype=a.dtype)) + (J @ H[4 * i : 4 * i + 4, 4 * i : 4 * i + 4] @ J).diagonal()
        assert ((got_a[e] - want).abs() <= bound).all(), (e, got_a[e] - want, bound)


# ---------------------------------------------------------------------------------------------------------------
# shared α, train-mode BatchNorm: alpha_diag_hessian, shared_weights_diag_hessian, the spectrum


class SharedBN1d(nn.Module):
    """stem → three 1-D mixed ops in a chain, the 1st and 3rd mixing with one shared Z_a = softmax(α_a), the 2nd
    with Z_b → train-mode BatchNorm1d → Flatten → Linear. ``forward(x, weights)`` takes {"a": Z_a, "b": Z_b}."""

    def __init__(self, c=4):
        super().__init__()
        self.stem = nn.Conv1d(2, c, 3, padding=1)
        self.e = nn.ModuleList([Mixed1d(c) for _ in range(3)])
        self.bn = nn.BatchNorm1d(c)
        self.tail = nn.Sequential(nn.ELU(), nn.AvgPool1d(2), nn.Flatten(), nn.Linear(c * 3, 3))
        self.alpha_a = nn.Parameter(0.8 * torch.randn(4))
        self.alpha_b = nn.Parameter(0.8 * torch.randn(4))

    def arch_parameters(self):
        return [self.alpha_a, self.alpha_b]

    def forward(self, x, weights=None):
        if weights is None:
            weights = {"a": F.softmax(self.alpha_a, -1), "b": F.softmax(self.alpha_b, -1)}
        h = self.stem(x)
        for e, t in zip(self.e, "aba"):
            h = e(h, weights[t])
        return self.tail(self.bn(h))


def shared_bn(seed=8, B=4):
    torch.manual_seed(seed)
    net = SharedBN1d().double()
    g = torch.Generator().manual_seed(seed + 1)
    return net, torch.randn(B, 2, 6, generator=g, dtype=DT), torch.randint(0, 3, (B,), generator=g)


def dense_alpha_hessian(net, loss_fn, x, y):
    """Dense (8, 8) ∂²L/∂[α_a, α_b]² by reverse-over-reverse autograd, BN on buffer copies (batch statistics)."""
    params = {n: p.detach() for n, p in net.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in net.named_buffers()}

    def loss(a):
        return loss_fn(functional_call(net, ({**params, "alpha_a": a[:4], "alpha_b": a[4:]}, buffers), (x,)), y)

    return torch.autograd.functional.hessian(loss, torch.cat([net.alpha_a.detach(), net.alpha_b.detach()]))


def snapshot(net):
    return ({n: b.clone() for n, b in net.named_buffers()}, [m.training for m in net.modules()])


def assert_untouched(net, snap):
    buffers, flags = snap
    assert all(torch.equal(b, buffers[n]) for n, b in net.named_buffers())
    assert [m.training for m in net.modules()] == flags
    assert all(p.grad is None for p in net.parameters())
    assert_no_module_hooks(net)


@pytest.mark.parametrize("loss_name", ["ce", "ce_sum"])
def test_shared_alpha_and_shared_z_diagonals_and_spectrum_equal_the_dense_hessian_under_train_bn(loss_name):
    from nasdiag.hessian import alpha_diag_hessian, hessian_eigenvalues, shared_weights_diag_hessian

    loss_fn = ARCH_LOSSES[loss_name]
    net, x, y = shared_bn()
    snap = snapshot(net)
    H = dense_alpha_hessian(net, loss_fn, x, y)
    assert torch.allclose(H, H.T, rtol=0, atol=1e-12 * H.abs().max())
    got = alpha_diag_hessian(net, loss_fn, x, y)
    assert_close(got, {"alpha_a": H.diagonal()[:4], "alpha_b": H.diagonal()[4:]}, rtol=1e-9)

    # the shared Z: dense Hessian w.r.t. {"a": Z_a, "b": Z_b} as the network's argument
    Z = {"a": F.softmax(net.alpha_a.detach(), -1), "b": F.softmax(net.alpha_b.detach(), -1)}
    buffers = {n: b.detach().clone() for n, b in net.named_buffers()}
    params = {n: p.detach() for n, p in net.named_parameters()}
    HZ = torch.autograd.functional.hessian(
        lambda z: loss_fn(functional_call(net, (params, buffers), (x, {"a": z[:4], "b": z[4:]})), y), torch.cat([Z["a"], Z["b"]]))
    got_z = shared_weights_diag_hessian(net, loss_fn, x, y, Z)
    assert_close(got_z, {"a": HZ.diagonal()[:4], "b": HZ.diagonal()[4:]}, rtol=1e-9)

    # spectrum: the joint α-Hessian, Lanczos (k = 3) and power iteration against eigvalsh
    ev = torch.linalg.eigvalsh(H)
    res = hessian_eigenvalues(net, loss_fn, x, y, k=3, iters=8)
    scale = float(ev.abs().max())
    assert res.eigenvalues.dtype == torch.float64
    assert torch.allclose(torch.as_tensor(res.eigenvalues, dtype=DT), ev.flip(0)[:3], rtol=0, atol=1e-8 * scale)
    assert abs(res.largest_algebraic - float(ev[-1])) <= 1e-8 * scale
    assert abs(res.smallest_algebraic - float(ev[0])) <= 1e-8 * scale
    dominant = float(ev[ev.abs().argmax()])
    assert abs(res.largest_magnitude - dominant) <= 1e-8 * scale
    power = hessian_eigenvalues(net, loss_fn, x, y, method="power", iters=5000, tol=1e-10)
    assert abs(power.largest_magnitude - dominant) <= 1e-5 * scale
    assert_untouched(net, snap)


def test_sum_reduction_scales_every_alpha_curvature_by_the_batch_size():
    """'Hessian of exactly the scalar the loss returns': with train-mode BN the sum-reduced loss is N times the mean."""
    from nasdiag.hessian import alpha_diag_hessian, arch_diag_hessian, hessian_eigenvalues

    net, x, y = shared_bn()
    N = x.shape[0]
    edges = {f"e{i}": (m, list(m.ops)) for i, m in enumerate(net.e)}
    for call in (lambda f: alpha_diag_hessian(net, f, x, y),
                 lambda f: arch_diag_hessian(net, f, x, y, edges, mode="exact_per_edge"),
                 lambda f: arch_diag_hessian(net, f, x, y, edges, mode="diag"),
                 lambda f: arch_diag_hessian(net, f, x, y, edges, mode="approx", wrt="alpha"),
                 lambda f: arch_diag_hessian(net, f, x, y, edges, mode="ggn"),
                 lambda f: diag_hessian(net, f, x, y, mode="approx")):
        mean, total = call(F.cross_entropy), call(ce_sum)
        assert_close(total, {k: N * v for k, v in mean.items()}, rtol=1e-9)
    top = hessian_eigenvalues(net, F.cross_entropy, x, y, iters=8).largest_algebraic
    assert abs(hessian_eigenvalues(net, ce_sum, x, y, iters=8).largest_algebraic - N * top) <= 1e-9 * abs(N * top)


def dense_full_hessian(model, loss_fn, x, y, names):
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    sizes = [params[n].numel() for n in names]

    def loss(flat):
        parts = dict(zip(names, (t.reshape(params[n].shape) for t, n in zip(torch.split(flat, sizes), names))))
        return loss_fn(functional_call(model, ({**params, **parts}, buffers), (x,)), y)

    return torch.autograd.functional.hessian(loss, torch.cat([params[n].reshape(-1) for n in names]))


def hoeffding(H, k, failure=1e-6):
    """Per-entry bound on |(1/k) Σ_s ε_si (Hε_s)_i − H_ii| for Rademacher ε: given ε_si the error is a Rademacher
    sum with variance proxy Σ_{j≠i} H_ij² / k; union bound over the entries."""
    off = H.square().sum(1) - H.diagonal().square()
    return torch.sqrt(2 * math.log(2 * H.shape[0] / failure) * off / k)


@pytest.mark.parametrize("names", [None, ["inner.weight", "head.bias"]])
def test_weight_hutchinson_stays_within_its_own_noise_of_the_dense_diagonal(names):
    """Probes over the requested weights only: asking for two tensors must not draw noise from the others."""
    torch.manual_seed(9)
    model = Residual().double()
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(3, 2, 4, 4, generator=g, dtype=DT), torch.randint(0, 4, (3,), generator=g)
    keys = names or [n for n, _ in model.named_parameters()]
    H = dense_full_hessian(model, F.cross_entropy, x, y, keys)
    k = 6
    got = diag_hessian(model, F.cross_entropy, x, y, mode=f"hutchinson:{k}", params=names)
    flat = torch.cat([got[n].reshape(-1) for n in keys])
    err = (flat - H.diagonal()).abs()
    assert (err <= hoeffding(H, k) + 1e-12 * H.abs().max()).all()
    assert float(err.max()) > 1e-8 * float(H.abs().max())  # it is an estimate, not the exact diagonal
    assert all(p.grad is None for p in model.parameters())


def test_alpha_hutchinson_trace_and_diagonal_within_their_noise_under_train_bn():
    from nasdiag.hessian import hutchinson_diagonal, hutchinson_trace

    net, x, y = shared_bn()
    snap = snapshot(net)
    H = dense_alpha_hessian(net, F.cross_entropy, x, y)
    n = 64
    tr = hutchinson_trace(net, F.cross_entropy, x, y, samples=n, seed=2)
    sd = math.sqrt(2 * float(H.square().sum() - H.diagonal().square().sum()) / n)
    assert abs(tr.estimate - float(H.trace())) <= 5 * sd
    dg = hutchinson_diagonal(net, F.cross_entropy, x, y, samples=n, seed=2)
    assert [tuple(t.shape) for t in dg.estimate] == [(4,), (4,)]
    err = (torch.cat(dg.estimate) - H.diagonal()).abs()
    assert (err <= hoeffding(H, n) + 1e-12 * H.abs().max()).all()
    assert_untouched(net, snap)


@pytest.mark.parametrize("mode", ["ggn_mc", "ggn"])
def test_ggn_modes_do_not_depend_on_the_eigensolvers_sign_convention(mode, monkeypatch):
    """An eigensolver may return any sign per eigenvector (LAPACK builds, cuSOLVER: on an H200 ggn_mc came out 99%
    apart from the CPU's numbers at the same seed). ``ggn_mc`` multiplies each draw ε_nc with u_nc, so the seeded
    draws must meet a canonical u; ``ggn`` under train-mode BN pairs directions across samples (docs/hessian.md)."""
    from nasdiag.hessian import arch_diag_hessian

    net, x, y = chain1d(True)
    options = {"samples": 3, "seed": 4} if mode == "ggn_mc" else {}
    want = arch_diag_hessian(net, ce_sum, x, y, net.edges(), mode=mode, **options)
    eigh = torch.linalg.eigh

    def flipped(a, *args, **kwargs):
        lam, U = eigh(a, *args, **kwargs)
        signs = torch.where(torch.arange(U.shape[-1]) % 2 == 0, -1.0, 1.0).to(U.dtype)
        return lam, U * signs  # another valid eigendecomposition
    monkeypatch.setattr(torch.linalg, "eigh", flipped)
    got = arch_diag_hessian(net, ce_sum, x, y, net.edges(), mode=mode, **options)
    assert_close(got, want, rtol=1e-12)
    # under train-mode BatchNorm too (samples coupled: the documented sum over the pairs of samples' directions)
    net, x, y = shared_bn()
    edges = {f"e{i}": (m, list(m.ops)) for i, m in enumerate(net.e)}
    got = arch_diag_hessian(net, ce_sum, x, y, edges, mode=mode, **options)
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    assert_close(got, arch_diag_hessian(net, ce_sum, x, y, edges, mode=mode, **options), rtol=1e-12)


@pytest.mark.parametrize("mode", ["ggn_mc", "ggn"])
def test_ggn_signs_of_eigenvectors_with_entries_of_equal_magnitude_are_canonical_too(mode, monkeypatch):
    """Two-class cross-entropy: each per-sample block's curvature direction is (1, −1)/√2, whose two entries are equal
    in magnitude, so 'the largest-magnitude entry' is decided by round-off. An eigensolver answer that differs from
    another by a sign and an ulp must not change the numbers (under train-mode BN, where ggn pairs directions)."""
    from nasdiag.hessian import arch_diag_hessian

    net, x, _ = shared_bn()
    torch.manual_seed(11)
    net.tail[-1] = nn.Linear(12, 2).double()
    y = torch.tensor([0, 1, 1, 0])
    edges = {f"e{i}": (m, list(m.ops)) for i, m in enumerate(net.e)}
    options = {"samples": 2, "seed": 1} if mode == "ggn_mc" else {}
    eigh = torch.linalg.eigh
    results = []
    for alternate in (False, True):
        def perturbed(a, *args, alternate=alternate, **kwargs):
            lam, U = eigh(a, *args, **kwargs)  # (N, 2, 2)
            order = torch.ones(U.shape[0], dtype=U.dtype)
            if alternate:
                order[1::2] = -1
            ramp = torch.linspace(-1, 1, U.shape[-2], dtype=U.dtype)
            ulp = 1 + 4 * torch.finfo(U.dtype).eps * order[:, None, None] * ramp[:, None]
            return lam, U * ulp  # two eigensolvers' answers: entries of equal magnitude an ulp apart, per sample either way
        monkeypatch.setattr(torch.linalg, "eigh", perturbed)
        results.append(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, **options))
    # rtol: √λ of the null direction's round-off eigenvalue (~1e-17) enters at ~1e-8 relative
    assert_close(results[0], results[1], rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# a parameter a ruled module owns, used in forward code too


class GatedByOwnBias(nn.Module):
    """``head(tanh(fc(x)) · fc.bias)``: fc's bias is also a gate in forward code."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)) * self.fc.bias)


class ReusedWeightInForwardCode(GatedByOwnBias):
    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)) + torch.tanh(F.linear(x, self.fc.weight)))


def test_a_ruled_modules_parameter_used_in_forward_code_too_is_counted_or_refused_never_dropped():
    """The recursion took the rule's part of fc.bias and dropped the product's (78% off on this net), and took only
    the module call of fc.weight when F.linear used it as well (61% off the dense diagonal on another seed), silently."""
    from nasdiag.hessian import UnsupportedModuleError

    torch.manual_seed(12)
    model = GatedByOwnBias().double()
    g = torch.Generator().manual_seed(13)
    x, y = torch.randn(5, 3, generator=g, dtype=DT), torch.randint(0, 2, (5,), generator=g)
    # this file's recursion: u = t·b with t = tanh(fc(x)); the product sends b² h_u to t and t² h_u to b (their
    # cross term, a fan-out's, dropped), so b's diagonal is the rule's Σ_rows h_pre plus the gate's Σ_rows t² h_u
    b, W2 = model.fc.bias.detach(), model.head.weight.detach().square()
    with torch.enable_grad():
        pre = model.fc(x).detach().requires_grad_(True)
        t = torch.tanh(pre)
        u = t * b
        out = model.head(u)
        (g_u,) = torch.autograd.grad(F.cross_entropy(out, y), u)
    h_u = loss_output_diagonal(F.cross_entropy, out, y) @ W2
    d1, d2 = elementwise_derivatives(nn.Tanh(), pre)
    h_pre = d1.square() * b.square() * h_u + d2 * g_u * b
    want = {"fc.weight": h_pre.T @ x.square(), "fc.bias": h_pre.sum(0) + (t.detach().square() * h_u).sum(0)}
    got = diag_hessian(model, F.cross_entropy, x, y, mode="diag", params=["fc.weight", "fc.bias"])
    assert_close(got, want)
    # a use the recursion has no glue rule for (a matrix product with the weight) is refused, naming the parameter
    model = ReusedWeightInForwardCode().double()
    for mode in ("diag", "approx"):
        with pytest.raises(UnsupportedModuleError, match=r"MmBackward0.*'fc\.weight'"):
            diag_hessian(model, F.cross_entropy, x, y, mode=mode)
        assert_no_module_hooks(model)


@pytest.mark.parametrize("kwargs", [{"start_epoch": "10"}, {"start_epoch": None}, {"threshold": "0.75"},
                                    {"threshold": None}, {"window": True}, {"threshold": True}])
def test_early_stop_refuses_bad_settings_when_made_not_at_its_first_decision(kwargs):
    """A string start_epoch was accepted and raised a bare TypeError ('>=') only 2·window epochs into a search;
    a string threshold a bare TypeError; window=True counted as 1."""
    from nasdiag.hessian import CurvatureError, EigenvalueEarlyStop

    with pytest.raises(CurvatureError, match=next(iter(kwargs))) as err:
        EigenvalueEarlyStop(**kwargs)
    assert "\n" not in str(err.value)
    rule = EigenvalueEarlyStop(window=1, start_epoch=1)  # valid settings still decide as RobustDARTS's rule says
    assert [rule.update(v).stop for v in (1.0, 1.0, 2.0)] == [False, False, True] and rule.rollback_epoch == 1


def conv_by_dense_jacobians(conv, x, h, mode):
    """One convolution's step of the recursion from its dense Jacobians (any dimension, no unfolding): C.2.1-C.2.3 is
    ``diag(J_Wᵀ diag(h) J_W)`` and ``(J_x∘J_x)ᵀ h``; C.2.4-C.2.5 the same with h replaced by its per-channel mean,
    the input diagonal then averaged per channel (docs/hessian.md's folding)."""
    spatial = (0,) + tuple(range(2, h.dim()))
    if mode == "approx":
        h = h.mean(spatial, keepdim=True).expand_as(h)
    W, b = conv.weight.detach(), conv.bias
    Jw = torch.autograd.functional.jacobian(
        lambda w: functional_call(conv, {"weight": w, **({"bias": b} if b is not None else {})}, (x,)), W)
    out = {"weight": (Jw.reshape(h.numel(), -1).square().T @ h.reshape(-1)).view_as(W)}
    if b is not None:
        out["bias"] = h.sum(spatial)
    Jx = torch.autograd.functional.jacobian(conv, x).reshape(h.numel(), -1)
    h_in = (Jx.square().T @ h.reshape(-1)).view_as(x)
    if mode == "approx":
        h_in = h_in.mean(spatial, keepdim=True).expand_as(x)
    return h_in, out


@pytest.mark.parametrize("mode", ["diag", "approx"])
@pytest.mark.parametrize("conv", [
    lambda: nn.Conv3d(4, 4, (2, 3, 1), stride=(1, 2, 1), padding=(1, 1, 0), dilation=(2, 1, 1), groups=2),
    lambda: nn.Conv2d(4, 6, (3, 2), stride=2, padding=(2, 1), dilation=(1, 2), groups=2, bias=False),
    lambda: nn.Conv1d(4, 4, 3, stride=3, padding=1, groups=4),
], ids=["conv3d", "conv2d", "conv1d"])
def test_convolutions_of_every_dimension_against_their_dense_jacobians(conv, mode):
    torch.manual_seed(14)
    conv = conv().double()
    d = conv.weight.dim() - 2
    pre = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[d](3, 4, 1).double()
    g = torch.Generator().manual_seed(15)
    x, y = torch.randn((2, 3) + (5,) * d, generator=g, dtype=DT), torch.randint(0, 3, (2,), generator=g)
    with torch.no_grad():
        n_out = conv(pre(x))[0].numel()
    model = nn.Sequential(pre, nn.Tanh(), conv, nn.ELU(), nn.Flatten(), nn.Linear(n_out, 3)).double()
    with torch.enable_grad():
        p = pre(x)
        a = torch.tanh(p)
        c = conv(a)
        e = F.elu(c)
        out = model[5](e.flatten(1))
        g_a, g_e = torch.autograd.grad(F.cross_entropy(out, y), [a, e])
    h_lin, W2 = loss_output_diagonal(F.cross_entropy, out, y), model[5].weight.detach().square()
    h_e = (h_lin @ W2 if mode == "diag" else (h_lin.mean(0) @ W2).expand(h_lin.shape[0], -1)).reshape(e.shape)
    d1, d2 = elementwise_derivatives(nn.ELU(), c)
    h_a, want_conv = conv_by_dense_jacobians(conv, a.detach(), d1.square() * h_e + d2 * g_e, mode)
    d1, d2 = elementwise_derivatives(nn.Tanh(), p)
    _, want_pre = conv_by_dense_jacobians(pre, x, d1.square() * h_a + d2 * g_a, mode)
    want = {**{f"0.{k}": v for k, v in want_pre.items()}, **{f"2.{k}": v for k, v in want_conv.items()}}
    assert_close(diag_hessian(model, F.cross_entropy, x, y, mode=mode, params=list(want)), want)
