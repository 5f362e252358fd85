"""Round-20 audit of the mixing-weight curvature routes (``arch_diag_hessian`` in every mode, ``alpha_diag_hessian``)
against the five defects the weight-side audit (tests/test_audit_fcrules_round20.py) fixed in ``diag_hessian``.

Reference, built here from scratch in float64 (never nasdiag's routes): the loss written out as a function of the
mixing weights Z (or of α, with Z = softmax(α)) of an own one-edge FC supernet — Linear → tanh → edge
{Linear → act, Linear → tanh, identity} → Linear — with the candidates' functions written out (Hardsigmoid as its
definition ``clamp(x / 6 + 1/2, 0, 1)``), and ``torch.autograd.functional.hessian`` of it; its diagonal.

Checked and found right (scratch sweeps, float64, ≤ 1e-15 relative): ``nn.Hardsigmoid`` and ``nn.Hardswish``
candidates: ``exact``, ``exact_per_edge``, ``hutchinson:4`` (K = 3 probes span the edge) and ``alpha_diag_hessian``
equal the reference (the products differentiate twice in Z, which enters linearly, never through the activation's
second derivative), ``ggn`` equals the own GGN for Z (cross-entropy with no second-order term in Z); ``diag``/
``approx`` run (the weight-side closed-form rule). A float32 loss on float64 outputs: ``arch_diag_hessian`` returns
float64 in every mode that runs. One unbatched sample: ``diag``/``approx`` give the weight side's one line naming
the batch of one; ``exact`` equals the reference. A loss reading α with ``wrt="Z"`` (zero Z-curvature: the penalty
does not depend on Z): every mode runs and equals its own penalty-free number; a penalty on a weight (not α) with
``wrt="alpha"``: accepted, unchanged numbers. ``probe.hessian`` hands the user's ``loss_fn`` to ``arch_diag_hessian``
unchanged, so its routes refuse and accept as above (checked: an auxiliary loss in ``diag``, a penalty on α in
``exact``, a float32 loss in ``ggn``). A model returning a dict of outputs: the α-penalty check stops at its values.

Noticed, left alone: the fast engine's mixing-weight recursion on nasdiag's own ``Network``
(``nasdiag.supernet.engine.curvature``, outside this area) was not probed with these five cases; ``hutchinson:<k>``
refuses one unbatched sample through its GGN control variate (pointing to the batch of one and ``exact``), though
its products alone would take it.

Defects found (each test fails on the library before its fix):

* an auxiliary loss on features the model stored downstream of an edge (``CE(o, t) + λ‖model.features‖²``) was left
  out by ``diag``/``approx`` (seeded at the loss curvature in the outputs) and ``ggn``/``ggn_mc`` (the GGN of the loss
  in the outputs), silently: 85-95% off the reference; one ``CurvatureError`` line pointing to ``exact``/
  ``hutchinson:<k>``, which are right — ``test_an_auxiliary_loss_on_stored_features_is_refused_where_left_out``;
* a penalty on α written into the loss (``CE(o, t) + λ‖model.alpha‖²``) with ``wrt="alpha"`` had its 2λ per entry left
  out by every mode (the chain through Z = softmax(α) takes the curvature in Z), and by ``alpha_diag_hessian`` (the
  penalty reads the real α, the products substitute another), silently; one ``CurvatureError`` line each, while an
  auxiliary loss on stored features stays right in ``alpha_diag_hessian`` —
  ``test_a_penalty_on_alpha_in_the_loss_is_refused_not_left_out``;
* a loss computed in float32 on float64 outputs (``F.cross_entropy(outputs.float(), t)``) was refused by ``ggn``/
  ``ggn_mc``/``hutchinson:<k>`` as "needs a loss with non-negative curvature" (the eigenvalue check allowed 1e3 ulp of
  float64 against blocks carrying float32 round-off), and ``alpha_diag_hessian`` returned float32 diagonals of a
  float64 α where its docstring promises the parameters' dtype —
  ``test_a_loss_computed_in_float32_on_float64_outputs_is_not_refused_and_keeps_the_alpha_dtype``;
* one unbatched sample (``model(x)`` on (features,)): ``ggn``/``ggn_mc``/``hutchinson:<k>`` refused it saying the mixed
  op "returned another output" for (B, K) weights, "e.g. zip(weights, self._ops) pairs the batch rows with the ops",
  which a correct mixed op does not (its (5,) input was read as 5 samples); the line names the shape so read and
  the batch of one, which then gives the reference —
  ``test_one_unbatched_sample_is_not_refused_as_a_mixed_op_pairing_rows_with_ops``;
* under CPU autocast (bfloat16) a float32 net's mixing-weight curvature came back in bfloat16 from ``diag``/
  ``approx`` (both ``wrt``) and from every ``wrt="alpha"`` mode but ``hutchinson:<k>`` (the chain through softmax ran
  its matmuls under the caller's autocast), where the docstring promises the model's dtype; the chain runs outside
  autocast in ``hess_z``'s dtype, the recursions' results are cast to the weights' —
  ``test_under_cpu_autocast_every_mode_keeps_the_mixing_weights_dtype``.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.functional import hessian

from nasdiag.hessian import alpha_diag_hessian, arch_diag_hessian

DT = torch.float64
MODES = ("exact", "exact_per_edge", "diag", "approx", "ggn", "ggn_mc", "hutchinson:4")


class _Mixed(nn.Module):
    """``Σ_k weights[..., k] · ops[k](x)`` for (K,) or (B, K) weights."""

    def __init__(self, ops):
        super().__init__()
        self.ops = nn.ModuleList(ops)

    def forward(self, x, weights):
        return sum(weights[..., k : k + 1] * op(x) for k, op in enumerate(self.ops))


class _Net(nn.Module):
    """Linear → tanh → edge → Linear, Z = softmax(α); stores the edge output as ``features``."""

    def __init__(self, act=nn.Tanh):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 5), nn.Linear(5, 3)
        self.edge = _Mixed([nn.Sequential(nn.Linear(5, 5), act()), nn.Sequential(nn.Linear(5, 5), nn.Tanh()), nn.Identity()])
        self.alpha = nn.Parameter(0.5 * torch.randn(3))

    def forward(self, x):
        self.features = self.edge(torch.tanh(self.fc1(x)), torch.softmax(self.alpha, 0))
        return self.fc2(self.features)

    def edges(self):
        return {"e": (self.edge, list(self.edge.ops))}


def _own_diagonal(net, x, y, loss, wrt, act=torch.tanh):
    """The loss written out in Z (or α) from the net's values, ``loss(outputs, targets, features, v)``; its Hessian's
    diagonal by autograd."""
    p = {k: v.detach() for k, v in net.named_parameters()}

    def L(v):
        z = torch.softmax(v, 0) if wrt == "alpha" else v
        h = torch.tanh(x @ p["fc1.weight"].T + p["fc1.bias"])
        f = (z[0] * act(h @ p["edge.ops.0.0.weight"].T + p["edge.ops.0.0.bias"])
             + z[1] * torch.tanh(h @ p["edge.ops.1.0.weight"].T + p["edge.ops.1.0.bias"]) + z[2] * h)
        return loss(f @ p["fc2.weight"].T + p["fc2.bias"], y, f, v)

    at = p["alpha"].clone() if wrt == "alpha" else torch.softmax(p["alpha"], 0)
    return torch.diagonal(hessian(L, at))


def _batch(seed):
    torch.manual_seed(seed)
    net = _Net().to(DT)
    return net, torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))


def test_an_auxiliary_loss_on_stored_features_is_refused_where_left_out():
    """``CE(o, t) + ½‖features‖²/n`` on the edge's stored output: the reference's diagonal in Z and α includes the
    auxiliary term (the penalty-free one is 85-95% lower); ``diag``/``approx``/``ggn``/``ggn_mc`` returned about the
    penalty-free numbers, silently. Now one line naming the edge and the modes that are right; ``exact`` and
    ``exact_per_edge`` equal the reference, ``hutchinson:4`` (3 probes, K = 3: unbiased, not exact) is finite."""
    net, x, y = _batch(0)
    aux = lambda o, t: F.cross_entropy(o, t) + 0.5 * net.features.square().mean()
    for wrt in ("Z", "alpha"):
        ref = _own_diagonal(net, x, y, lambda o, t, f, v: F.cross_entropy(o, t) + 0.5 * f.square().mean(), wrt)
        plain = _own_diagonal(net, x, y, lambda o, t, f, v: F.cross_entropy(o, t), wrt)
        assert (ref - plain).abs().max() > 0.1 * ref.abs().max()  # the auxiliary term matters here
        for mode in MODES:
            if mode in ("diag", "approx", "ggn", "ggn_mc"):
                with pytest.raises(ValueError) as err:
                    arch_diag_hessian(net, aux, x, y, net.edges(), mode=mode, wrt=wrt)
                msg = str(err.value)
                assert "\n" not in msg and "'e'" in msg and "auxiliary loss" in msg and "mode='exact'" in msg, (mode, msg)
                continue
            got = arch_diag_hessian(net, aux, x, y, net.edges(), mode=mode, wrt=wrt)["e"]
            if mode.startswith("hutchinson"):
                assert torch.isfinite(got).all()
            else:
                torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-14)
    got = alpha_diag_hessian(net, aux, x, y, [net.alpha])["alpha"]
    torch.testing.assert_close(got, _own_diagonal(net, x, y, lambda o, t, f, v: F.cross_entropy(o, t) + 0.5 * f.square().mean(), "alpha"),
                               rtol=1e-10, atol=1e-14)


def test_a_penalty_on_alpha_in_the_loss_is_refused_not_left_out():
    """``CE(o, t) + λ‖α‖²`` closing over ``net.alpha``: ∂²/∂α² of it is the reference plus 2λ per entry, which every
    ``wrt="alpha"`` mode and ``alpha_diag_hessian`` left out (their numbers were the penalty-free reference). Now one
    ``CurvatureError`` line; with ``wrt="Z"`` (the penalty has no curvature in Z) every mode still runs and equals its
    penalty-free number."""
    net, x, y = _batch(1)
    lam = 0.3
    decay = lambda o, t: F.cross_entropy(o, t) + lam * net.alpha.square().sum()
    ref = _own_diagonal(net, x, y, lambda o, t, f, v: F.cross_entropy(o, t) + lam * v.square().sum(), "alpha")
    plain = _own_diagonal(net, x, y, lambda o, t, f, v: F.cross_entropy(o, t), "alpha")
    torch.testing.assert_close(ref - plain, torch.full_like(ref, 2 * lam))  # own check of the reference
    for mode in MODES:
        with pytest.raises(ValueError) as err:
            arch_diag_hessian(net, decay, x, y, net.edges(), mode=mode, wrt="alpha")
        msg = str(err.value)
        assert "\n" not in msg and "'e'" in msg and "penalty" in msg, (mode, msg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z = arch_diag_hessian(net, decay, x, y, net.edges(), mode=mode, wrt="Z")["e"]
            z0 = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode, wrt="Z")["e"]
        torch.testing.assert_close(z, z0, rtol=1e-12, atol=0)
    other = lambda o, t: F.cross_entropy(o, t) + lam * net.fc2.weight.square().sum()  # no curvature in α: accepted
    for mode in ("exact", "diag", "ggn"):
        torch.testing.assert_close(arch_diag_hessian(net, other, x, y, net.edges(), mode=mode, wrt="alpha")["e"],
                                   arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode, wrt="alpha")["e"])
    torch.testing.assert_close(alpha_diag_hessian(net, other, x, y, [net.alpha])["alpha"], plain, rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError) as err:
        alpha_diag_hessian(net, decay, x, y, [net.alpha])
    msg = str(err.value)
    assert "\n" not in msg and "'alpha'" in msg and "alpha_diag_hessian" in msg, msg


def test_a_loss_computed_in_float32_on_float64_outputs_is_not_refused_and_keeps_the_alpha_dtype():
    """``F.cross_entropy(outputs.float(), t)`` of the float64 net: Z enters the outputs linearly, so the GGN in Z is the
    exact Hessian (the reference); ``ggn`` and ``hutchinson:4`` (whose GGN control is then exact) give it to float32
    round-off, in float64, and ``alpha_diag_hessian`` gives the α reference in α's float64."""
    net, x, y = _batch(2)
    f32 = lambda o, t: F.cross_entropy(o.float(), t)
    for wrt in ("Z", "alpha"):
        ref = _own_diagonal(net, x, y, lambda o, t, f, v: F.cross_entropy(o, t), wrt)
        for mode in ("ggn", "ggn_mc", "hutchinson:4"):
            got = arch_diag_hessian(net, f32, x, y, net.edges(), mode=mode, wrt=wrt)["e"]
            assert got.dtype == DT, (mode, got.dtype)
            if mode != "ggn_mc" and wrt == "Z":
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)
    got = alpha_diag_hessian(net, f32, x, y, [net.alpha])["alpha"]
    assert got.dtype == DT, got.dtype
    torch.testing.assert_close(got, _own_diagonal(net, x, y, lambda o, t, f, v: F.cross_entropy(o, t), "alpha"), rtol=1e-5, atol=1e-8)


def test_one_unbatched_sample_is_not_refused_as_a_mixed_op_pairing_rows_with_ops():
    """``net(x)`` on one (4,) sample with cross-entropy over its (3,) logits: the GGN modes' line names the (5,) input
    read as 5 samples and the batch of one, not a mixed op that pairs the batch rows with its ops; the batch of one
    gives the reference in ``ggn`` (Z enters linearly: the GGN is the Hessian); ``exact`` takes the unbatched call."""
    net, x, y = _batch(3)
    ref = _own_diagonal(net, x[:1], y[:1], lambda o, t, f, v: F.cross_entropy(o, t), "Z")
    for mode in ("ggn", "ggn_mc", "hutchinson:4"):
        with pytest.raises(ValueError) as err:
            arch_diag_hessian(net, F.cross_entropy, x[0], y[0], net.edges(), mode=mode)
        msg = str(err.value)
        assert "\n" not in msg and "(5,)" in msg and "unsqueeze(0)" in msg and "zip(" not in msg, (mode, msg)
    torch.testing.assert_close(arch_diag_hessian(net, F.cross_entropy, x[:1], y[:1], net.edges(), mode="ggn")["e"], ref,
                               rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(arch_diag_hessian(net, F.cross_entropy, x[0], y[0], net.edges(), mode="exact")["e"], ref,
                               rtol=1e-10, atol=1e-14)


def test_under_cpu_autocast_every_mode_keeps_the_mixing_weights_dtype():
    """A float32 net under ``torch.autocast("cpu", dtype=torch.bfloat16)``: softmax(α) is float32 there, and every mode
    and ``wrt`` returns float32; ``exact`` with ``wrt="alpha"`` is the own float64 reference to bfloat16 round-off of the
    forward (5% of its largest entry)."""
    net, x, y = _batch(4)
    ref = _own_diagonal(net, x, y, lambda o, t, f, v: F.cross_entropy(o, t), "alpha")
    net, x = net.float(), x.float()
    for wrt in ("Z", "alpha"):
        for mode in MODES:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode, wrt=wrt)["e"]
            assert got.dtype == torch.float32, (wrt, mode, got.dtype)
            if wrt == "alpha" and mode == "exact":
                assert (got.double() - ref).abs().max() <= 0.05 * ref.abs().max(), (got, ref)
