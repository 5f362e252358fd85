"""Round-7 audit of the curvature API on models the earlier hessian audits did not use: residual blocks, softmax /
log-softmax / LayerNorm heads, depthwise-separable convolutions without bias, GroupNorm on conv features, class
weights and label smoothing, frozen (``requires_grad=False``) architecture parameters, mixing-weight groups keyed by
what the network reads (an int, a dotted name).

Every reference is built here from scratch in float64: dense Hessians by ``torch.autograd.functional.hessian`` over
the flattened parameters (``torch.func.functional_call``), a Gauss-Newton matrix from the Jacobian and the loss
Hessian, never from nasdiag. Where a diagonal recursion is compared with equality, the reason it is exact on that
model is given (the layer's output Hessian is diagonal all the way to the loss).
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import (CurvatureError, alpha_diag_hessian, arch_diag_hessian, diag_hessian,
                             shared_weights_diag_hessian)

DT = torch.float64


# -- independent references ---------------------------------------------------------------------------------------


def dense_param_diag(model, loss_fn, x, y, names=None):
    """``{name: diag ∂²L/∂θ²}`` from the dense autograd Hessian over the flattened parameters ``names``."""
    m = copy.deepcopy(model)  # buffers of a train-mode BN are updated by this forward: on a copy
    params = dict(m.named_parameters())
    names = list(params) if names is None else names
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]

    def loss(flat):
        values = {n: part.view(s) for n, part, s in zip(names, torch.split(flat, sizes), shapes)}
        return loss_fn(torch.func.functional_call(m, values, (x,)), y)

    flat = torch.cat([params[n].detach().reshape(-1) for n in names])
    d = torch.diagonal(torch.autograd.functional.hessian(loss, flat))
    return {n: part.view(s) for n, part, s in zip(names, torch.split(d, sizes), shapes)}


def assert_close(got, ref, rtol=1e-10):
    assert list(got) == list(ref)
    for k in ref:
        assert got[k].shape == ref[k].shape and got[k].dtype == ref[k].dtype, k
        scale = ref[k].abs().max().item() or 1.0
        assert (got[k] - ref[k]).abs().max().item() <= rtol * scale, (k, got[k], ref[k])


class ResBlock(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.act = nn.Tanh()

    def forward(self, x):
        return x + self.conv(self.act(x))


class DWSep(nn.Module):
    """Depthwise-separable convolution, bias off, LayerNorm over (C, H, W) as GroupNorm(1, C)."""

    def __init__(self, C):
        super().__init__()
        self.dw = nn.Conv2d(C, C, 3, padding=1, groups=C, bias=False)
        self.pw = nn.Conv2d(C, C, 1, bias=False)
        self.norm = nn.GroupNorm(1, C)

    def forward(self, x):
        return self.norm(self.pw(self.dw(x)))


class GNOp(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 1)
        self.norm = nn.GroupNorm(2, C)
        self.act = nn.ELU()

    def forward(self, x):
        return self.act(self.norm(self.conv(x)))


class Mixed(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.ops = nn.ModuleList([ResBlock(C), DWSep(C), GNOp(C), nn.AvgPool2d(3, 1, 1)])

    def forward(self, x, weights):
        if weights.dim() == 2:  # (B, K): per-sample weights, as the GGN modes pass them
            return sum(weights[:, k].view(-1, 1, 1, 1) * op(x) for k, op in enumerate(self.ops))
        return sum(w * op(x) for w, op in zip(weights, self.ops))


class TwoCellNet(nn.Module):
    """stem → edge e1 → edge e2 → mean → Linear; the edges mix with softmax(α), one α for both (``shared``) or one
    each. ``forward(x, weights)`` takes the two edges' Z instead."""

    def __init__(self, shared, C=4):
        super().__init__()
        self.stem = nn.Conv2d(2, C, 3, padding=1)
        self.m1, self.m2 = Mixed(C), Mixed(C)
        self.shared = shared
        self.alpha = nn.Parameter(0.5 * torch.randn(4))
        if not shared:
            self.alpha2 = nn.Parameter(0.5 * torch.randn(4))
        self.head = nn.Linear(C, 3)

    def zs(self):
        return torch.softmax(self.alpha, 0), torch.softmax(self.alpha if self.shared else self.alpha2, 0)

    def forward(self, x, weights=None):
        z1, z2 = self.zs() if weights is None else weights
        return self.head(self.m2(self.m1(self.stem(x), z1), z2).mean((2, 3)))

    def edges(self):
        return {"e1": (self.m1, list(self.m1.ops)), "e2": (self.m2, list(self.m2.ops))}


def _net(shared, seed=1):
    torch.manual_seed(seed)
    net = TwoCellNet(shared).to(DT).eval()
    x = torch.randn(5, 2, 5, 5, dtype=DT)
    y = torch.randint(0, 3, (5,))
    return net, x, y


def _alpha_names(net):
    return [n for n, _ in net.named_parameters() if n.startswith("alpha")]


# -- defects found in this round ----------------------------------------------------------------------------------


def test_exact_alpha_refuses_shared_alpha_also_when_frozen():
    """mode='exact' with wrt='alpha' promises to refuse edges that take their weights from one α (no per-edge number
    is the exact ∂²L/∂α² there). With α frozen (``requires_grad_(False)``: a warm-up phase, a fine-tuned supernet)
    its weights had no graph to follow, and the per-edge blocks came back as the exact answer: their sum was up to
    134% off the dense ∂²L/∂α² per entry on this net. Now refused as with a trainable α; flags and .grad left as they were."""
    net, x, y = _net(shared=True)
    net.alpha.requires_grad_(False)
    frozen = {n: p.requires_grad for n, p in net.named_parameters()}
    with pytest.raises(CurvatureError, match="shared α"):
        arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact", wrt="alpha")
    assert {n: p.requires_grad for n, p in net.named_parameters()} == frozen
    assert all(p.grad is None for p in net.parameters())
    # exact_per_edge still gives the per-edge blocks on request
    per_edge = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact_per_edge", wrt="alpha")
    assert per_edge["e1"].shape == (4,)


def test_exact_alpha_of_frozen_own_alpha_matches_dense():
    """A frozen α that each edge owns is not shared: mode='exact' gives the dense ∂²L/∂α² diagonal (α's frozen flag
    leaves the numbers alone), and both α and the network weights stay frozen / trainable as they were."""
    net, x, y = _net(shared=False)
    net.alpha.requires_grad_(False)
    net.stem.weight.requires_grad_(False)
    frozen = {n: p.requires_grad for n, p in net.named_parameters()}
    ref = dense_param_diag(net, F.cross_entropy, x, y, _alpha_names(net))
    got = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact", wrt="alpha")
    assert_close({"alpha": got["e1"], "alpha2": got["e2"]}, ref)
    assert {n: p.requires_grad for n, p in net.named_parameters()} == frozen
    assert all(p.grad is None for p in net.parameters())


class _Tempered(TwoCellNet):
    """Z = softmax(α/τ), τ = 0.5: wrt='alpha' would chain through softmax(α) and be off by the factor 1/τ."""

    def zs(self):
        return torch.softmax(self.alpha / 0.5, 0), torch.softmax(self.alpha2 / 0.5, 0)


@pytest.mark.parametrize("mode", ["ggn", "ggn_mc", "diag", "approx", "exact", "hutchinson:2"])
def test_frozen_alpha_tempered_softmax_refused_in_every_mode(mode):
    """docs/hessian.md: every mode checks ∂Z/∂α against softmax's Jacobian and refuses softmax(α/τ). With α frozen
    the check had no graph to follow: ggn, ggn_mc, diag and approx chained through the wrong map silently. Now
    refused as with a trainable α, the frozen flag left as it was."""
    torch.manual_seed(1)
    net = _Tempered(shared=False).to(DT).eval()
    net.alpha.requires_grad_(False)
    net.alpha2.requires_grad_(False)
    x, y = torch.randn(5, 2, 5, 5, dtype=DT), torch.randint(0, 3, (5,))
    with pytest.raises(CurvatureError, match="softmax"):
        arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode, wrt="alpha")
    assert not net.alpha.requires_grad and not net.alpha2.requires_grad
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("mode", ["ggn", "diag", "approx"])
def test_frozen_alpha_gives_the_numbers_of_a_trainable_one(mode):
    """Freezing α changes no number of the α curvature (the check's extra graph is not differentiated)."""
    net, x, y = _net(shared=False)
    trainable = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode, wrt="alpha")
    net.alpha.requires_grad_(False)
    frozen = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode, wrt="alpha")
    assert_close(frozen, trainable, rtol=1e-13)
    assert not net.alpha.requires_grad


class _ByKey(nn.Module):
    """A network that reads its shared mixing weights under a key of its choosing."""

    def __init__(self, key):
        super().__init__()
        self.key = key
        torch.manual_seed(2)
        self.net = TwoCellNet(shared=True).to(DT).eval()

    def forward(self, x, weights):
        z = weights[self.key]
        return self.net(x, (z, z))


@pytest.mark.parametrize("key", [0, "cell.normal", ""])
def test_shared_weights_groups_keyed_as_the_network_reads_them(key):
    """``weights = {group: Z}`` is handed to ``network(x, weights)``, so a group is whatever key the network looks up.
    Keys that are no ParameterDict name (an int, a dotted or empty string) raised torch's bare TypeError/KeyError
    ("Index given to ParameterDict cannot be used as a key ..."); now they work, equal to the dense Hessian w.r.t. the
    shared Z (both cells, cross terms included)."""
    net = _ByKey(key)
    x = torch.randn(5, 2, 5, 5, dtype=DT)
    y = torch.randint(0, 3, (5,))
    z = net.net.zs()[0].detach()
    ref = torch.diagonal(torch.autograd.functional.hessian(lambda v: F.cross_entropy(net(x, {key: v}), y), z))
    got = shared_weights_diag_hessian(net, F.cross_entropy, x, y, {key: z})
    assert list(got) == [key]
    assert_close(got, {key: ref})


# -- checked right (kept as regression tests) ---------------------------------------------------------------------


def test_exact_and_alpha_diag_on_residual_groupnorm_supernet():
    """Z-exact per edge, α-exact per edge (own α) and alpha_diag_hessian (shared α) against dense autograd Hessians on
    a supernet of residual blocks, depthwise-separable convs without bias, GroupNorm on conv features."""
    net, x, y = _net(shared=False)
    z1, z2 = (z.detach() for z in net.zs())
    Hz = torch.autograd.functional.hessian(lambda v: F.cross_entropy(net(x, (v[:4], v[4:])), y), torch.cat([z1, z2]))
    got = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact")
    assert_close({"e": torch.cat([got["e1"], got["e2"]])}, {"e": torch.diagonal(Hz)})
    shared, xs, ys = _net(shared=True)
    ref = dense_param_diag(shared, F.cross_entropy, xs, ys, ["alpha"])
    assert_close(alpha_diag_hessian(shared, F.cross_entropy, xs, ys, params=[shared.alpha]), ref)


def test_ggn_equals_own_gauss_newton_on_residual_supernet():
    """``ggn`` w.r.t. Z is ``diag Σ_n J_nᵀ H_n J_n`` where samples do not interact (eval mode): J from
    ``torch.autograd.functional.jacobian`` of the logits w.r.t. the stacked Z, H from the loss alone."""
    net, x, y = _net(shared=False)
    z = torch.cat([t.detach() for t in net.zs()])
    out = net(x, (z[:4], z[4:])).detach()
    J = torch.autograd.functional.jacobian(lambda v: net(x, (v[:4], v[4:])), z)  # (N, D, 8)
    HL = torch.autograd.functional.hessian(lambda o: F.cross_entropy(o, y), out)  # (N, D, N, D)
    G = torch.diagonal(torch.einsum("ndk,ndme,mel->kl", J, HL, J))
    got = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="ggn")
    assert_close({"e": torch.cat([got["e1"], got["e2"]])}, {"e": G})


@pytest.mark.parametrize("head", ["softmax", "log_softmax", "layer_norm"])
def test_diag_exact_for_linear_before_softmax_logsoftmax_layernorm_heads(head):
    """A Linear layer whose output goes through one softmax / log-softmax / LayerNorm into a per-sample loss: its
    weight W_oi moves only output o of each sample, so ``∂²L/∂W_oi² = Σ_n x_ni² (H_z)_n,oo`` needs just the diagonal
    of the Hessian at its output, which the glue rules (Softmax, LogSoftmax) and the LayerNorm rule give exactly when
    the loss Hessian above them is diagonal. So ``diag`` equals the dense diagonal for every parameter here."""
    torch.manual_seed(3)
    x = torch.randn(6, 5, dtype=DT)
    if head == "softmax":
        model, loss_fn, y = nn.Sequential(nn.Linear(5, 4), nn.Softmax(dim=1)), F.mse_loss, torch.rand(6, 4, dtype=DT)
    elif head == "log_softmax":
        model, loss_fn, y = nn.Sequential(nn.Linear(5, 4), nn.LogSoftmax(dim=1)), F.nll_loss, torch.randint(0, 4, (6,))
    else:
        model, loss_fn, y = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4)), F.mse_loss, torch.rand(6, 4, dtype=DT)
        with torch.no_grad():
            model[1].weight.uniform_(0.5, 1.5)
            model[1].bias.normal_()
    model = model.to(DT)
    assert_close(diag_hessian(model, loss_fn, x, y, mode="diag"), dense_param_diag(model, loss_fn, x, y))


def test_class_weights_label_smoothing_sum_and_mean():
    """Cross-entropy with class weights and label smoothing: ``exact`` and the last layer's ``diag`` are the dense
    Hessian of exactly the scalar returned, for both reductions. The weighted mean divides by Σ_n w_{y_n}, not N, so
    'sum' is (Σ_n w_{y_n}) times 'mean' here: checked against that factor, computed from the targets."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    x, y = torch.randn(6, 5, dtype=DT), torch.randint(0, 3, (6,))
    cw = torch.tensor([0.2, 1.0, 3.0], dtype=DT)
    got = {}
    for reduction in ("mean", "sum"):
        def loss_fn(o, t, reduction=reduction):
            return F.cross_entropy(o, t, weight=cw, label_smoothing=0.2, reduction=reduction)
        ref = dense_param_diag(model, loss_fn, x, y)
        got[reduction] = diag_hessian(model, loss_fn, x, y, mode="exact")
        assert_close(got[reduction], ref)
        last = diag_hessian(model, loss_fn, x, y, mode="diag", params=["2.weight", "2.bias"])
        assert_close(last, {k: ref[k] for k in last})
    # with label smoothing torch's weighted mean divides by Σ_n w_{y_n}
    factor = cw[y].sum()
    assert_close({k: v / factor for k, v in got["sum"].items()}, got["mean"], rtol=1e-12)


def test_depthwise_separable_without_bias_diag_exact():
    """Depthwise 3×3 (groups = C, no bias) → pointwise 1×1 (no bias) → tanh → MSE: the pointwise layer mixes channels
    only within one position, so the Hessian at the depthwise output couples channels of one position, never two
    positions of one channel; a depthwise weight reads one channel, so ``diag`` is exact for both layers."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), nn.Conv2d(4, 6, 1, bias=False),
                          nn.Tanh()).to(DT)
    x, y = torch.randn(3, 4, 5, 5, dtype=DT), torch.rand(3, 6, 5, 5, dtype=DT)
    assert_close(diag_hessian(model, F.mse_loss, x, y, mode="diag"), dense_param_diag(model, F.mse_loss, x, y))


def test_frozen_eval_batchnorm_in_train_model_exact_and_state():
    """A frozen (eval-mode) BatchNorm inside a train-mode model next to a train-mode one: ``exact`` equals the dense
    Hessian (the eval BN an affine map on its running statistics, the train BN through its batch statistics), the
    parameters' ``requires_grad`` flags do not matter, repeated calls give the same numbers, and no buffer, .grad or
    hook is left changed, in every weight mode."""
    torch.manual_seed(6)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4),
                      nn.Tanh(), nn.Flatten(), nn.Linear(4, 3)).to(DT)
    with torch.no_grad():
        for bn in (m[1], m[4]):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_()
    m.train()
    m[1].eval()
    m[7].weight.requires_grad_(False)
    x, y = torch.randn(4, 3, 5, 5, dtype=DT), torch.randint(0, 3, (4,))
    state = copy.deepcopy(m.state_dict())
    ref = dense_param_diag(m, F.cross_entropy, x, y)
    assert_close(diag_hessian(m, F.cross_entropy, x, y, mode="exact"), ref)
    for mode in ("diag", "approx", "hutchinson:2"):
        first = diag_hessian(m, F.cross_entropy, x, y, mode=mode)
        again = diag_hessian(m, F.cross_entropy, x, y, mode=mode)
        assert all(torch.equal(first[k], again[k]) for k in first), mode
        assert {k: v.shape for k, v in first.items()} == {k: v.shape for k, v in ref.items()}
        # the last layer's diagonal is exact in 'diag' (an FC last layer under a per-sample loss)
        if mode == "diag":
            assert_close({"7.weight": first["7.weight"]}, {"7.weight": ref["7.weight"]})
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    assert all(p.grad is None for p in m.parameters())
    assert not any(mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks for mod in m.modules())


def test_unruled_modules_fail_naming_them():
    """ConvTranspose2d and Embedding have no rule: ``diag`` names the module (never a silent zero), whether its own
    parameters are asked for or it only lies on the path to the requested ones."""
    from nasdiag.hessian import UnsupportedModuleError

    torch.manual_seed(7)
    m = nn.Sequential(nn.Conv2d(4, 3, 3), nn.ConvTranspose2d(3, 2, 3)).to(DT)
    x, y = torch.randn(3, 4, 5, 5, dtype=DT), torch.rand(3, 2, 5, 5, dtype=DT)
    for params in (None, ["0.weight"]):
        with pytest.raises(UnsupportedModuleError, match="ConvTranspose2d"):
            diag_hessian(m, F.mse_loss, x, y, mode="diag", params=params)

    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(10, 4)
            self.l = nn.Linear(4, 3)

        def forward(self, i):
            return self.l(self.e(i)).mean(1)

    emb = Emb().to(DT)
    with pytest.raises(UnsupportedModuleError, match="Embedding"):
        diag_hessian(emb, F.cross_entropy, torch.randint(0, 10, (5, 7)), torch.randint(0, 3, (5,)), mode="approx")


def test_frozen_tensor_refusal_names_the_models_parameter():
    """``alpha_diag_hessian(net, ..., params=[net.alpha])`` with α frozen: the refusal named the tensor 'param.0',
    a name the user never gave; it now also says which of the model's parameters that is."""
    net, x, y = _net(shared=True)
    net.alpha.requires_grad_(False)
    with pytest.raises(CurvatureError, match=r"params\['param\.0'\] \(the model's 'alpha'\) does not require grad"):
        alpha_diag_hessian(net, F.cross_entropy, x, y, params=[net.alpha])


def _own_recursion(model, x, y, approx):
    """bayesnas-appendix C.1.4-C.1.5 (FC) and C.2.1-C.2.5 (conv, by F.unfold / F.fold) transcribed here, with
    docs/hessian.md's corrections (E(M²), E(σ'²) through the per-element activation rule, the consistent fold):
    h at the logits is the mean-CE loss Hessian's diagonal (p − p²)/N; an activation maps h to σ'² h + σ'' g."""
    h = x.detach().requires_grad_(True)
    acts = [h]
    for layer in model:
        h = layer(h)
        h.retain_grad()
        acts.append(h)
    F.cross_entropy(h, y).backward()
    p = torch.softmax(h.detach(), 1)
    hd, res = (p - p * p) / x.shape[0], {}
    for i in range(len(model) - 1, -1, -1):
        layer, inp, out = model[i], acts[i].detach(), acts[i + 1]
        if isinstance(layer, nn.Linear):
            w2 = layer.weight.detach().square()
            if approx:
                hm = hd.mean(0)
                res[f"{i}.weight"], res[f"{i}.bias"] = torch.outer(hm, inp.square().sum(0)), hd.shape[0] * hm
                hd = (hm @ w2).expand(inp.shape)
            else:
                res[f"{i}.weight"], res[f"{i}.bias"], hd = hd.T @ inp.square(), hd.sum(0), hd @ w2
        elif isinstance(layer, nn.Conv2d):
            k, s, pd = layer.kernel_size, layer.stride, layer.padding
            M = F.unfold(inp, k, padding=pd, stride=s)  # (N, C·taps, rows)
            hr = hd.reshape(hd.shape[0], hd.shape[1], -1)  # (N, O, rows)
            w2 = layer.weight.detach().reshape(layer.out_channels, -1).square()
            if approx:  # C.2.4-C.2.5: the per-channel mean E(h)
                eh = hr.mean((0, 2))
                res[f"{i}.weight"] = torch.outer(eh, M.square().sum((0, 2))).view_as(layer.weight)
                res[f"{i}.bias"] = eh * hr.shape[0] * hr.shape[2]
                cols = torch.einsum("oi,o->i", w2, eh)[None, :, None].expand(hr.shape[0], -1, hr.shape[2])
                hd = F.fold(cols.contiguous(), inp.shape[2:], k, padding=pd, stride=s).mean((0, 2, 3), keepdim=True)
                hd = hd.expand(inp.shape)
            else:  # C.2.1-C.2.3: every unfolded row an FC input
                res[f"{i}.weight"] = torch.einsum("nol,nil->oi", hr, M.square()).view_as(layer.weight)
                res[f"{i}.bias"] = hr.sum((0, 2))
                hd = F.fold(torch.einsum("oi,nol->nil", w2, hr), inp.shape[2:], k, padding=pd, stride=s)
        elif isinstance(layer, nn.Flatten):
            hd = hd.reshape(inp.shape)
        else:
            t = out.detach()
            d1, d2 = (t * (1 - t), t * (1 - t) * (1 - 2 * t)) if isinstance(layer, nn.Sigmoid) else \
                (1 - t * t, -2 * t * (1 - t * t))
            hd = d1.square() * hd + d2 * out.grad
    return res


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_recursions_equal_own_transcription_of_the_appendix(mode):
    """``diag`` and ``approx`` on an MLP (sigmoid, tanh) and a strided, padded conv net equal this file's own
    transcription of C.1.4-C.1.5 / C.2.1-C.2.5 (to round-off: the same sums in another order)."""
    torch.manual_seed(8)
    mlp = nn.Sequential(nn.Linear(5, 6), nn.Sigmoid(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    conv = nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Sigmoid(), nn.Conv2d(3, 4, 2, padding=1),
                         nn.Tanh(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3)).to(DT)
    for model, x in ((mlp, torch.randn(7, 5, dtype=DT)), (conv, torch.randn(5, 2, 8, 8, dtype=DT))):
        y = torch.randint(0, 3, (x.shape[0],))
        ref = _own_recursion(copy.deepcopy(model), x, y, approx=mode == "approx")
        got = diag_hessian(model, F.cross_entropy, x, y, mode=mode)
        assert_close({k: got[k] for k in ref}, ref, rtol=1e-12)


def test_one_tensor_listed_twice_is_refused_not_counted_twice():
    """``hessian_eigenvalues(params=[α, α])`` (or a model whose ``named_arch_parameters()`` lists a shared α once per
    cell) took products w.r.t. [α, α], the operator [[H, H], [H, H]]: the top eigenvalue and the trace came out twice
    the α block's, silently. Now one line; a list of distinct tensors still gives
    the dense α-block spectrum."""
    from nasdiag.hessian import hessian_eigenvalues, hutchinson_trace, loss_hvp

    net, x, y = _net(shared=False)
    for fn in (hessian_eigenvalues, hutchinson_trace, loss_hvp):
        with pytest.raises(CurvatureError, match="one tensor twice"):
            fn(net, F.cross_entropy, x, y, params=[net.alpha, net.alpha])

    class Listed(TwoCellNet):
        def named_arch_parameters(self):
            return [("cell0.alpha", self.alpha), ("cell1.alpha", self.alpha)]

    torch.manual_seed(1)
    listed = Listed(shared=True).to(DT).eval()
    with pytest.raises(CurvatureError, match=r"'cell0\.alpha' and 'cell1\.alpha'"):
        hessian_eigenvalues(listed, F.cross_entropy, x, y)
    names = _alpha_names(net)
    flat = torch.cat([p.detach() for p in (net.alpha, net.alpha2)])

    def loss(v):
        return F.cross_entropy(torch.func.functional_call(net, dict(zip(names, (v[:4], v[4:]))), (x,)), y)

    dense = torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss, flat))
    got = hessian_eigenvalues(net, F.cross_entropy, x, y, params=[net.alpha, net.alpha2], k=2)
    assert torch.allclose(got.eigenvalues, dense.flip(0)[:2], rtol=1e-8, atol=1e-12)


def test_multihead_attention_refusal_names_it():
    """``nn.MultiheadAttention`` has no rule, and its forward reads ``out_proj.weight`` directly (F.linear inside
    ``F.multi_head_attention_forward``), never calling ``out_proj``, a Linear that has one. The refusal named only
    'a.out_proj' (NonDynamicallyQuantizableLinear), a module with a rule, not the module type that lacks one; it now
    names 'a' (MultiheadAttention)."""
    from nasdiag.hessian import UnsupportedModuleError

    class Att(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.MultiheadAttention(4, 2, batch_first=True)
            self.l = nn.Linear(4, 3)

        def forward(self, x):
            return self.l(self.a(x, x, x)[0].mean(1))

    torch.manual_seed(9)
    model = Att().to(DT)
    x, y = torch.randn(3, 5, 4, dtype=DT), torch.randint(0, 3, (3,))
    with pytest.raises(UnsupportedModuleError, match=r"'a' \(MultiheadAttention\)") as err:
        diag_hessian(model, F.cross_entropy, x, y, mode="diag")
    assert "\n" not in str(err.value)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    # the head alone is reachable without crossing the attention: exact there (an FC last layer)
    ref = dense_param_diag(model, F.cross_entropy, x, y, ["l.weight", "l.bias"])
    assert_close(diag_hessian(model, F.cross_entropy, x, y, mode="diag", params=["l.weight", "l.bias"]), ref)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_exact_weights_equal_backpack_diag_hessian(reduction):
    """BackPACK's DiagHessian (Sequential, no BatchNorm) as a second independent reference: ``exact`` on a net of a
    depthwise conv without bias, ELU, a ConvTranspose2d (no diagonal rule: ``exact`` only), leaky ReLU and average
    pooling equals it for both reductions (BackPACK follows the loss module's reduction)."""
    backpack = pytest.importorskip("backpack")
    from backpack.extensions import DiagHessian

    torch.manual_seed(10)
    net = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1, groups=3, bias=False), nn.ELU(), nn.Conv2d(3, 2, 3, stride=2),
                        nn.Tanh(), nn.ConvTranspose2d(2, 3, 3, stride=2), nn.LeakyReLU(0.1), nn.AvgPool2d(2),
                        nn.Flatten(), nn.Linear(3 * 2 * 2, 3)).to(DT)
    x, y = torch.randn(4, 3, 6, 6, dtype=DT), torch.randint(0, 3, (4,))
    bp = backpack.extend(copy.deepcopy(net))
    loss = backpack.extend(nn.CrossEntropyLoss(reduction=reduction))(bp(x), y)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DT)  # BackPACK's ConvTranspose2d extension makes helper tensors in the default dtype
    try:
        with backpack.backpack(DiagHessian()):
            loss.backward()
    finally:
        torch.set_default_dtype(default)
    ref = {n: p.diag_h for n, p in bp.named_parameters()}
    got = diag_hessian(net, lambda o, t: F.cross_entropy(o, t, reduction=reduction), x, y, mode="exact")
    assert_close(got, ref, rtol=1e-9)


def test_loss_diagonal_equals_dense_and_still_refuses_coupling():
    """The seed of ``diag``/``approx``, ``output_hessian_diagonal``, now holds only the diagonal: it equals the diagonal
    of the dense autograd Hessian of the loss w.r.t. the outputs (per-pixel cross-entropy with class weights over
    (N, C, H, W), MSE with reduction='sum'), and a loss that couples samples is still refused."""
    from nasdiag.hessian.loss_curvature import LossCouplesSamplesError, output_hessian_diagonal

    torch.manual_seed(11)
    out = torch.randn(3, 4, 2, 3, dtype=DT)
    cls = torch.randint(0, 4, (3, 2, 3))
    cw = torch.tensor([0.5, 1.0, 2.0, 0.1], dtype=DT)
    cases = [(lambda o, t: F.cross_entropy(o, t, weight=cw), cls, 5),
             (lambda o, t: F.mse_loss(o, t, reduction="sum"), torch.randn_like(out), 7)]
    for loss_fn, target, chunk in cases:
        dense = torch.autograd.functional.hessian(lambda o: loss_fn(o, target), out)
        ref = torch.diagonal(dense.reshape(out.numel(), out.numel())).reshape(out.shape)
        got = output_hessian_diagonal(loss_fn, out, target, chunk_size=chunk)  # chunks that split a sample's outputs
        assert_close({"h": got}, {"h": ref}, rtol=1e-12)
    with pytest.raises(LossCouplesSamplesError):
        output_hessian_diagonal(lambda o, t: (o.sum(0) ** 2).sum(), out, None)


def test_loss_diagonal_holds_no_per_sample_blocks():
    """``diag``/``approx`` took the loss seed as the diagonal of the full per-sample blocks, (N, D, D) plus two (D, N, D)
    arrays of products: N·D² numbers for D outputs per sample (11.8 GB of peak memory for a two-layer conv net on
    48×48 RGB outputs at batch 8, MSE). It now keeps N·D. Peak memory of the seed alone for D = 3072, N = 2 in
    float64, in a fresh process: about 1.2 GB before, well under that now."""
    import subprocess
    import sys

    script = (
        "import resource, torch, torch.nn.functional as F\n"
        "from nasdiag.hessian.loss_curvature import output_hessian_diagonal\n"
        "out = torch.randn(2, 3, 32, 32, dtype=torch.float64); y = torch.randn_like(out)\n"
        "output_hessian_diagonal(F.mse_loss, out[:, :, :2, :2], y[:, :, :2, :2])\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "d = output_hessian_diagonal(F.mse_loss, out, y)\n"
        "assert torch.allclose(d, torch.full_like(d, 2 / out.numel()))\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    grown_mb = int(run.stdout.strip().splitlines()[-1])
    # the blocks and products of D = 3072 alone are 2·3072²·8 B · 3 ≈ 450 MB; the old route peaked at ~1.2 GB, a
    # diagonal kept as a view of each chunk's products at ~0.5 GB, the diagonal alone at ~0.15-0.3 GB (allocator)
    assert grown_mb < 400, grown_mb


def test_conv_subclass_rewriting_conv_forward_gets_no_inherited_rule():
    """A Conv2d subclass that keeps ``forward`` but rewrites ``_conv_forward`` (the weight standardization pattern; here
    the weight doubled) computes another function; the registry gave it Conv2d's rule, which reads the raw weight: its
    ``diag`` was a quarter of the true diagonal on a last conv layer, where ``diag`` is exact, silently. Now it has no
    rule by descent: ``diag`` refuses it naming it, ``exact`` gives the dense diagonal, and a plain subclass keeps the
    rule."""
    from nasdiag.hessian import UnsupportedModuleError

    class Doubled(nn.Conv2d):
        def _conv_forward(self, input, weight, bias):
            return super()._conv_forward(input, 2.0 * weight, bias)

    class Plain(nn.Conv2d):
        pass

    torch.manual_seed(12)
    x, y = torch.randn(4, 2, 4, 4, dtype=DT), torch.randn(4, 3, 2, 2, dtype=DT)
    model = nn.Sequential(Doubled(2, 3, 3), nn.Tanh()).to(DT)
    with pytest.raises(UnsupportedModuleError, match="Doubled"):
        diag_hessian(model, F.mse_loss, x, y, mode="diag")
    assert_close(diag_hessian(model, F.mse_loss, x, y, mode="exact"), dense_param_diag(model, F.mse_loss, x, y))
    plain = nn.Sequential(Plain(2, 3, 3), nn.Tanh()).to(DT)
    assert_close(diag_hessian(plain, F.mse_loss, x, y, mode="diag"), dense_param_diag(plain, F.mse_loss, x, y))
