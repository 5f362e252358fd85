"""Round-20 audit of the FC recursion (bayesnas-appendix C.1.2-C.1.5) behind ``diag_hessian(mode='diag'|'approx'|'exact')``.

References, all built here from scratch in float64 (never nasdiag's recursions): the dense diagonal by
reverse-over-reverse autograd (``torch.autograd.grad`` twice, one row per entry) through
``torch.func.functional_call``; where torch has no second derivative of an op (``nn.Hardsigmoid``), the same dense
diagonal of the net with the activation written out as ``clamp(x / 6 + 1/2, 0, 1)``, its definition.

Theory used for equality: the last Linear's diagonal depends only on the diagonal of the loss Hessian at the
outputs (C.1.2 with ``a aᵀ ⊗ H``'s diagonal), so ``diag`` is exact there under any per-sample loss; and the first
Linear's diagonal (whose input is data) depends only on the diagonal of its pre-activation Hessian, which C.1.5's
``B² Wᵀ²·h + D`` gives exactly when the loss Hessian at the outputs is diagonal (an elementwise loss) and one
elementwise activation sits between the two layers: so ``diag`` is exact on the whole of such a net.

Checked and found right (scratch sweeps; Linear(4, 3|5) → act → Linear, N = 5-6, float64, 1e-15 relative):

* activations, last layer in ``diag`` and every entry in ``exact``: GELU (``'none'`` and ``'tanh'``), SiLU,
  Softplus(beta=2, threshold=0.5), ELU(0.7), LeakyReLU(0.1), Hardtanh(−0.5, 0.5), Sigmoid, Tanh, ReLU6, Threshold,
  eval RReLU, Softmax/Softmin/LogSoftmax (walked as glue); Mish, CELU, SELU, Hardswish, LogSigmoid, Softsign,
  Softshrink, Hardshrink, train RReLU, PReLU (an owned weight), Tanhshrink (a sum of two functions) are refused by
  ``diag``/``approx`` in one ``UnsupportedModuleError`` line naming the module and the ways out (register a rule,
  ``rules=``, ``mode='exact'``), and following the advice (``rules={nn.Mish: ElementwiseRule()}``, likewise CELU,
  SELU, Hardswish, LogSigmoid, Softsign, Tanhshrink, Softshrink) gives the dense diagonal on every entry; PReLU with
  an ``ElementwiseRule`` is refused naming its unhandled ``weight``; ``exact`` gives PReLU's own weight's diagonal.
* losses, each with ``reduction='mean'`` and ``'sum'``, ``diag``/``approx``/``exact`` on Linear → Tanh → Linear:
  cross-entropy with ``label_smoothing``, class ``weight``, both, probability targets (with and without smoothing
  and weights), ``ignore_index``; ``nll_loss`` after ``log_softmax`` with weights; BCE-with-logits with
  ``pos_weight`` and with ``weight``; BCE after sigmoid; MSE; L1 (zero curvature, zeros); SmoothL1(beta=1.5);
  Huber(delta=0.7); KLDiv on log-softmax (``log_target`` both ways, ``batchmean``); Gaussian NLL; Poisson NLL;
  multilabel soft margin; soft margin: ``diag`` and ``exact`` last layer equal the dense diagonal (≤ 2.6e-16),
  ``exact`` every entry, and ``diag`` every entry for the elementwise losses (theory above); the sharpest kept as
  ``test_the_last_layer_is_exact_under_each_per_sample_loss_and_the_whole_net_under_an_elementwise_one``. Also a
  model ending in LogSoftmax (NLL, linear in the outputs: only C.1.5's ``D`` term), Sigmoid (BCE), Softplus, GELU,
  Softmax over classes (MSE), an (N,) output (BCE ``pos_weight``, MSE sum): ``diag`` last layer exact; 130 classes
  (three chunks of loss products) exact; a loss coupling two samples through one class beyond the first chunk is
  refused; no false refusal in float32/bfloat16 at batch 64/512, logits ×30.
* derivatives of every registered activation rule against own closed forms in float64 (GELU both ways, SiLU, ELU,
  Softplus(β, threshold), Sigmoid, Tanh, ReLU6, Hardtanh, LeakyReLU): 1e-15 (Softplus at exactly βx = threshold
  takes torch's branch); a Linear used twice in ``diag`` is the own per-call sum of C.1.4-C.1.5; on the tanh_mlp
  shape of tests/test_curvature_accuracy.py with GELU/SiLU/Softplus/ELU/Sigmoid/ReLU and CE, smoothed CE or MSE,
  ``diag``'s relative error is 0.000-0.099 and ``approx``'s 0.002-0.277, inside its bounds (0.13, 0.35); Spearman ρ
  of ``diag`` with ReLU is 0.911 (the 0.94 bound is for tanh_mlp only, not a general claim). A frozen Embedding
  below the requested Linear layers (``params=`` names or a submodule's parameters) is not visited: ``diag`` runs.
* structure (``exact`` every entry, ``diag`` last layer): a residual add, a concat of two branches, a Linear used twice
  (``diag`` drops the cross-call terms as documented: 190% on its first use, a fan-out), train-mode Dropout under a
  seed (the curvature of the net with the mask the first forward draws: own fixed-mask copy; ``exact`` equal, ``diag``
  last layer equal), LayerNorm/GroupNorm(1, C)/GroupNorm(C, C)/BatchNorm1d on FC features, Linear without bias,
  a bias-only parameter ``x + b``, a per-feature scale ``x * g``; RMSNorm (affine: owns a weight with no rule; not
  affine: a product of two functions of its input) and Embedding refused in one line each, ``exact`` right.

Defects found (each test fails on the library before its fix):

* ``nn.Hardsigmoid``: ``diag``/``approx`` refused it advising ``ElementwiseRule`` or ``mode='exact'``; both ended in
  torch's bare ``RuntimeError: derivative for aten::hardsigmoid_backward is not implemented`` (``exact`` and
  ``hutchinson:<k>`` after a warning promising "same numbers, slower"), even ``ElementwiseRule(piecewise_linear=True)``,
  which declares σ'' ≡ 0 yet asked torch for it. A piecewise-linear rule now takes σ' alone, Hardsigmoid has a
  closed-form rule (beside ReLU6 and Hardtanh; torch's own float64 derivative of it is float32's 1/6), an
  elementwise function without a second derivative in torch is one ``UnsupportedModuleError`` line, and the
  Hessian-vector routes say so in one ``CurvatureRuntimeError`` line —
  ``test_hardsigmoid_has_its_exact_diagonal_and_no_second_derivative_is_one_line``.
* one unbatched sample (``model(x)`` on (features,), cross-entropy over its (C,) logits) was refused by ``diag``/
  ``approx`` as "loss_fn couples different samples", which the user's per-sample loss does not (the (C,) outputs are
  read as C samples of one entry); the line names the shape so read and the batch of one that works —
  ``test_one_unbatched_sample_is_not_refused_as_a_loss_coupling_samples``.
* a float64 model whose loss computes in float32 (``F.cross_entropy(outputs.float(), t)``) was refused by
  ``diag``/``approx`` as coupling samples (the check's tolerance was 1e3 ulp of the outputs' float64, its products
  carry float32 round-off), and ``exact``/``hutchinson:<k>`` returned float32 diagonals of float64 parameters
  (bfloat16 of float32 ones under CPU autocast) where the docstring promises the parameters' dtype; the tolerance
  is of the coarser dtype, results are cast —
  ``test_a_loss_computed_in_float32_on_float64_outputs_is_per_sample_and_every_mode_keeps_the_parameters_dtype``.
* a ``loss_fn`` closing over the model's parameters (weight decay written into the loss) had the Hessian of its
  penalty (2λ per entry) left out by every mode, silently (``exact`` too: the penalty reads the real parameters, the
  products are taken at the substituted values); one ``CurvatureError`` line now —
  ``test_a_loss_reading_the_model_parameters_itself_is_refused_not_its_curvature_left_out``.
* an auxiliary loss on features the model stored (``CE(o, t) + λ‖model.features‖²``) was left out of ``diag``/
  ``approx``, seeded at the outputs only: 110-130% off on the layer below, silently; one ``CurvatureError`` line
  pointing to ``exact`` (which is right) —
  ``test_an_auxiliary_loss_on_stored_features_is_refused_by_the_recursions_and_exact_in_exact``.

Noticed, left alone: ``diag``/``approx`` refuse Mish, CELU, SELU, Hardswish, LogSigmoid, Softsign (smooth elementwise
functions an ``ElementwiseRule()`` handles exactly, as checked above): loud and with the right advice, so not a
defect (tests/test_audit_hessian_round2.py keeps Mish as its refusal example); a train-mode RReLU given an ``ElementwiseRule`` by the user
calls its forward again, drawing another slope (the user's own rule of a random function); ``nn.Softmax(0)`` (over
the batch) after the last Linear couples samples, so ``diag`` is 57% off there and gives its bias 0.028 where the
true value is 0 (the documented drop of terms between samples coupled by later layers, but not zeroed as the
normalizations' are); an op without a rule inside a custom module's forward (``F.gelu``) is refused as "in the
forward code between modules, reached from" the next rule leaf, not naming the custom module it sits in (the tracer
hooks rule leaves only; the parameters named point to it); the mixing-weight routes (``arch_diag_hessian``,
``alpha_diag_hessian``: a Hardsigmoid, a loss reading α or stored features) were not changed or checked (outside
this area).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from nasdiag.hessian import diag_hessian
from nasdiag.hessian.modes import CurvatureRuntimeError
from nasdiag.hessian.rules import ElementwiseRule, UnsupportedModuleError

DT = torch.float64


def _dense_diagonal(model, loss_fn, x, y):
    """Own reference: every parameter's Hessian diagonal by reverse-over-reverse autograd, one row per entry."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    out = {}
    for name, value in params.items():
        leaf = value.clone().requires_grad_(True)
        loss = loss_fn(functional_call(model, {**params, name: leaf}, (x,)), y)
        (g,) = torch.autograd.grad(loss, leaf, create_graph=True)
        g = g.reshape(-1)
        rows = [torch.autograd.grad(g[i], leaf, retain_graph=True)[0].reshape(-1)[i] for i in range(g.numel())]
        out[name] = torch.stack(rows).reshape(value.shape)
    return out


class _OwnHardsigmoid(nn.Module):
    """Hardsigmoid by its definition, relu6(x + 3) / 6 = clamp(x / 6 + 1/2, 0, 1), which torch differentiates twice."""

    def forward(self, x):
        return torch.clamp(x / 6 + 0.5, 0.0, 1.0)


def test_hardsigmoid_has_its_exact_diagonal_and_no_second_derivative_is_one_line():
    torch.manual_seed(0)
    x = 6 * torch.randn(6, 4, dtype=DT)  # spread over the three pieces of hardsigmoid
    y = torch.randn(6, 3, dtype=DT)
    net = nn.Sequential(nn.Linear(4, 5), nn.Hardsigmoid(), nn.Linear(5, 3)).to(DT)
    own = nn.Sequential(nn.Linear(4, 5), _OwnHardsigmoid(), nn.Linear(5, 3)).to(DT)
    own.load_state_dict(net.state_dict())
    pre = net[0](x)
    assert ((pre < -3).any() and (pre > 3).any() and (pre.abs() < 3).any())
    ref = _dense_diagonal(own, F.mse_loss, x, y)
    # MSE is elementwise and one activation sits between two Linears: diag is exact on every entry (docstring)
    h = diag_hessian(net, F.mse_loss, x, y, mode="diag")
    for k in ref:
        torch.testing.assert_close(h[k], ref[k], rtol=1e-12, atol=1e-15)
    # the last layer in approx too (MSE: its pre-activation diagonal is constant per output)
    h = diag_hessian(net, F.mse_loss, x, y, mode="approx")
    for k in ("2.weight", "2.bias"):
        torch.testing.assert_close(h[k], ref[k], rtol=1e-12, atol=1e-15)
    # a user's piecewise-linear rule asks torch for no second derivative; its σ' is torch's, whose float64
    # hardsigmoid derivative is float32's 1/6 (3e-8 relative, squared in the diagonal: 6e-8)
    h = diag_hessian(net, F.mse_loss, x, y, mode="diag", rules={nn.Hardsigmoid: ElementwiseRule(piecewise_linear=True)})
    torch.testing.assert_close(h["0.weight"], ref["0.weight"], rtol=1e-6, atol=1e-15)
    # a smooth rule for it cannot have σ'': one line naming the module, not torch's bare RuntimeError
    with pytest.raises(UnsupportedModuleError) as err:
        diag_hessian(net, F.mse_loss, x, y, mode="diag", rules={nn.Hardsigmoid: ElementwiseRule()})
    msg = str(err.value)
    assert "\n" not in msg and "'1'" in msg and "Hardsigmoid" in msg and "piecewise_linear=True" in msg
    # the Hessian-vector routes: one line naming the op and the modes that work
    for mode in ("exact", "hutchinson:2"):
        with pytest.warns(RuntimeWarning), pytest.raises(CurvatureRuntimeError) as err:
            diag_hessian(net, F.mse_loss, x, y, mode=mode)
        msg = str(err.value)
        assert "\n" not in msg and "hardsigmoid_backward" in msg and "mode='diag'" in msg
    assert all(p.grad is None for p in net.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in net.modules())


_CW = torch.tensor([0.5, 2.0, 1.3], dtype=DT)


def _losses():
    """(name, loss_fn(outputs, targets, reduction), target kind): the losses of the round's brief."""
    return [
        ("ce_smoothed_weighted", lambda o, t, r: F.cross_entropy(o, t, weight=_CW, label_smoothing=0.2, reduction=r), "class"),
        ("ce_probabilities", lambda o, t, r: F.cross_entropy(o, t, label_smoothing=0.1, reduction=r), "prob"),
        ("nll_after_log_softmax", lambda o, t, r: F.nll_loss(F.log_softmax(o, 1), t, weight=_CW, reduction=r), "class"),
        ("bce_pos_weight", lambda o, t, r: F.binary_cross_entropy_with_logits(o, t, pos_weight=3 * _CW, reduction=r), "unit"),
        ("smooth_l1", lambda o, t, r: F.smooth_l1_loss(o, t, beta=1.5, reduction=r), "real"),
        ("huber", lambda o, t, r: F.huber_loss(o, t, delta=0.7, reduction=r), "real"),
        ("kl_div", lambda o, t, r: F.kl_div(F.log_softmax(o, 1), t, reduction=r), "prob"),
    ]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_last_layer_is_exact_under_each_per_sample_loss_and_the_whole_net_under_an_elementwise_one(reduction):
    """C.1.2: the last Linear sees only the diagonal of the loss Hessian at the outputs (exact for a per-sample loss),
    so ``diag`` equals the own dense diagonal there; ``exact`` everywhere; and with an elementwise loss (BCE, Huber,
    SmoothL1) the first Linear's input is data, so ``diag`` is exact on every entry (module docstring)."""
    torch.manual_seed(3)
    x = torch.randn(6, 4, dtype=DT)
    targets = {"class": torch.tensor([0, 1, 2, 2, 1, 0]), "prob": torch.softmax(torch.randn(6, 3, dtype=DT), 1),
               "unit": torch.rand(6, 3, dtype=DT), "real": 2 * torch.randn(6, 3, dtype=DT)}
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    for name, loss, kind in _losses():
        loss_fn = lambda o, t, loss=loss: loss(o, t, reduction)
        t = targets[kind]
        ref = _dense_diagonal(net, loss_fn, x, t)
        elementwise = kind in ("unit", "real")
        h = diag_hessian(net, loss_fn, x, t, mode="diag")
        for k in (ref if elementwise else ("2.weight", "2.bias")):
            torch.testing.assert_close(h[k], ref[k], rtol=1e-12, atol=1e-15, msg=lambda m, k=k: f"{name} {k}: {m}")
        h = diag_hessian(net, loss_fn, x, t, mode="exact")
        for k in ref:
            torch.testing.assert_close(h[k], ref[k], rtol=1e-12, atol=1e-15, msg=lambda m, k=k: f"{name} {k}: {m}")


def test_one_unbatched_sample_is_not_refused_as_a_loss_coupling_samples():
    """``diag_hessian`` reads the outputs' first dim as the batch. One unbatched sample, ``model(x)`` on (features,)
    with cross-entropy over its (C,) logits, was refused as "loss_fn couples different samples", which the user's
    per-sample loss does not: the line names the shape read as C samples and the batch of one that works, whose
    ``diag`` is the own dense diagonal on the last layer."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    x, y = torch.randn(4, dtype=DT), torch.tensor(1)
    for mode in ("diag", "approx"):
        with pytest.raises(ValueError) as err:
            diag_hessian(net, F.cross_entropy, x, y, mode=mode)
        msg = str(err.value)
        assert "\n" not in msg and "(3,)" in msg and "unsqueeze(0)" in msg, msg
    h = diag_hessian(net, F.cross_entropy, x.unsqueeze(0), y.unsqueeze(0), mode="diag")
    ref = _dense_diagonal(net, F.cross_entropy, x.unsqueeze(0), y.unsqueeze(0))
    for k in ("2.weight", "2.bias"):
        torch.testing.assert_close(h[k], ref[k], rtol=1e-12, atol=1e-15)


def test_a_loss_computed_in_float32_on_float64_outputs_is_per_sample_and_every_mode_keeps_the_parameters_dtype():
    """A float64 model whose loss casts its outputs (``F.cross_entropy(outputs.float(), t)``): the check that the loss
    does not couple samples compared products carrying float32 round-off to 1e3 ulp of float64 and refused this
    per-sample loss as coupling samples (``diag``/``approx``); ``exact`` and ``hutchinson:<k>`` returned the loss's
    dtype, float32 diagonals of float64 parameters (under CPU autocast, bfloat16 of float32 ones), where the docstring
    promises the parameters' dtype. The last layer's ``diag`` is the own float64 dense diagonal to float32's round-off;
    a float32 loss that does couple samples is still refused."""
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 10)).to(DT)
    x, y = torch.randn(64, 6, dtype=DT), torch.randint(0, 10, (64,))
    ref = _dense_diagonal(net, F.cross_entropy, x, y)
    in_float32 = lambda o, t: F.cross_entropy(o.float(), t)
    for mode in ("diag", "approx", "exact", "hutchinson:1"):
        h = diag_hessian(net, in_float32, x, y, mode=mode)
        assert all(h[k].dtype == DT for k in h), mode
    h = diag_hessian(net, in_float32, x, y, mode="diag")
    for k in ("2.weight", "2.bias"):
        torch.testing.assert_close(h[k], ref[k], rtol=1e-5, atol=1e-6 * ref[k].abs().max().item())
    with pytest.raises(ValueError, match="couples different samples"):
        diag_hessian(net, lambda o, t: in_float32(o, t) + 0.01 * o.float().sum() ** 2, x, y, mode="diag")
    small = nn.Sequential(nn.Linear(6, 3)).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for mode in ("exact", "hutchinson:1", "diag"):
            h = diag_hessian(small, F.cross_entropy, x[:8].float(), y[:8] % 3, mode=mode)
            assert all(v.dtype == torch.float32 for v in h.values()), mode


def test_a_loss_reading_the_model_parameters_itself_is_refused_not_its_curvature_left_out():
    """Weight decay written into the loss, ``loss_fn = CE(o, t) + λ Σ‖θ‖²`` closing over ``model.parameters()``: the
    Hessian of that scalar has 2λ more on every entry, but every mode differentiates the loss in the outputs (or at the
    values substituted into the forward) and returned the CE diagonal alone, silently (own dense reference: 0.1 per
    entry missing here). One ``CurvatureError`` line in every mode; a penalty on a parameter that is not requested does
    not change the requested diagonal and is taken."""
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    decayed = lambda o, t: F.cross_entropy(o, t) + 0.05 * sum(p.square().sum() for p in net.parameters())
    for mode in ("diag", "approx", "exact", "hutchinson:1"):
        with pytest.raises(ValueError) as err:
            diag_hessian(net, decayed, x, y, mode=mode)
        msg = str(err.value)
        assert "\n" not in msg and "weight decay" in msg and "2.bias" in msg, (mode, msg)
    first_only = lambda o, t: F.cross_entropy(o, t) + 0.05 * net[0].weight.square().sum()
    ref = _dense_diagonal(net, F.cross_entropy, x, y)
    h = diag_hessian(net, first_only, x, y, mode="diag", params=["2.weight", "2.bias"])
    for k in h:
        torch.testing.assert_close(h[k], ref[k], rtol=1e-12, atol=1e-15)
    assert all(p.grad is None for p in net.parameters())


class _StoresFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.features = nn.Linear(4, 5), nn.Linear(5, 3), None

    def forward(self, x):
        self.features = torch.tanh(self.a(x))
        return self.b(self.features)


def test_an_auxiliary_loss_on_stored_features_is_refused_by_the_recursions_and_exact_in_exact():
    """An auxiliary loss on features the model stored (``CE(o, t) + λ‖model.features‖²``, center-loss style): ``diag``
    and ``approx`` seed their recursion at the outputs, so the term's curvature on the layer below was left out,
    silently (110-130% off the own dense diagonal on ``a``); one ``CurvatureError`` line pointing to ``exact``, which
    equals the dense diagonal. A requested parameter the features do not depend on is still taken."""
    torch.manual_seed(7)
    net = _StoresFeatures().to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    aux = lambda o, t: F.cross_entropy(o, t) + 0.1 * net.features.square().sum()
    for mode in ("diag", "approx"):
        with pytest.raises(ValueError) as err:
            diag_hessian(net, aux, x, y, mode=mode)
        msg = str(err.value)
        assert "\n" not in msg and "'a.weight'" in msg and "mode='exact'" in msg, (mode, msg)
    ref = _dense_diagonal(net, aux, x, y)
    h = diag_hessian(net, aux, x, y, mode="exact")
    for k in ref:
        torch.testing.assert_close(h[k], ref[k], rtol=1e-12, atol=1e-15)
    h = diag_hessian(net, aux, x, y, mode="diag", params=["b.weight", "b.bias"])
    for k in h:
        torch.testing.assert_close(h[k], ref[k], rtol=1e-12, atol=1e-15)
