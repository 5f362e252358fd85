"""Round 23, models23: an auditor's own float64 models through the public curvature API.

References are independent of nasdiag: the dense Hessian of autograd (``torch.autograd.functional.hessian``) for
``exact``, and for ``diag``/``approx`` my own transcription of the diagonal recursion (bayesnas-appendix C.1.4-C.1.5,
C.2.1-C.2.3, and the feature-mean C.2.4-C.2.5 as docs/hessian.md states it), module by module with each module's
full Jacobian from autograd: ``h_in = (J∘J)ᵀ h_out + diag ∇²_x <g, f(x)>``, params likewise.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from nasdiag.hessian import diag_hessian

DT = torch.float64


def _diag_of_hessian(fn, v):
    H = torch.autograd.functional.hessian(fn, v)
    return torch.diagonal(H.reshape(v.numel(), v.numel())).reshape(v.shape)


def _jacobian(fn, v):
    J = torch.autograd.functional.jacobian(fn, v)
    return J.reshape(J.numel() // v.numel(), v.numel())


def _channel_mean(m, h):
    if isinstance(m, nn.Linear):
        return h.reshape(-1, h.shape[-1]).mean(0).expand(h.shape)
    return h.mean((0,) + tuple(range(2, h.dim())), keepdim=True).expand(h.shape)


def _own_recursion(mods, x, loss_fn, y, approx=False):
    """The diagonal recursion on a chain of modules, from each module's autograd Jacobian (no nasdiag code).
    ``approx``: at every Linear/Conv the output diagonal is replaced by its mean over batch (and space) per channel
    and the input diagonal by its per-channel mean (C.2.4-C.2.5); train-mode BatchNorm passes on its channel mean."""
    acts, a = [x.detach().requires_grad_(True)], None
    a = acts[0]
    for m in mods:
        a = m(a)
        acts.append(a)
    grads = torch.autograd.grad(loss_fn(a, y), acts[1:])
    h = _diag_of_hessian(lambda o: loss_fn(o, y), acts[-1].detach())
    out = {}
    for i in reversed(range(len(mods))):
        m, xin, g = mods[i], acts[i].detach(), grads[i].detach()
        params = {k: p.detach() for k, p in m.named_parameters()}
        affine = isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
        if approx and affine:
            h = _channel_mean(m, h)

        def f_in(v, m=m, params=params):
            return functional_call(copy.deepcopy(m), params, (v,))

        for name, p in params.items():
            def f_p(t, name=name, m=m, params=params, xin=xin):
                return functional_call(copy.deepcopy(m), {**params, name: t}, (xin,))

            J = _jacobian(f_p, p)
            out[f"{i}.{name}"] = ((J**2).T @ h.reshape(-1)).reshape(p.shape) + _diag_of_hessian(lambda t: (g * f_p(t)).sum(), p)
        J = _jacobian(f_in, xin)
        h = ((J**2).T @ h.reshape(-1)).reshape(xin.shape) + _diag_of_hessian(lambda v: (g * f_in(v)).sum(), xin)
        if approx and affine:
            h = _channel_mean(m, h)
        if approx and isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            h = h.mean((0,) + tuple(range(2, h.dim())), keepdim=True).expand(h.shape)
    return out


def _dense_exact(model, x, loss_fn, y):
    params = {k: p.detach() for k, p in model.named_parameters()}
    return {
        name: _diag_of_hessian(lambda t, name=name: loss_fn(functional_call(model, {**params, name: t}, (x,)), y), p)
        for name, p in params.items()
    }


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _pad_net(kind):
    """conv → tanh → a copy-padding module → conv → tanh → head, in 1, 2 or 3 spatial dims."""
    pad, dims = {
        "ReflectionPad1d": (nn.ReflectionPad1d((2, 1)), 1),
        "ReplicationPad1d": (nn.ReplicationPad1d((2, 1)), 1),
        "CircularPad1d": (nn.CircularPad1d((2, 1)), 1),
        "CircularPad2d": (nn.CircularPad2d((1, 0, 2, 1)), 2),
        "ReflectionPad3d": (nn.ReflectionPad3d(1), 3),
        "ReplicationPad3d": (nn.ReplicationPad3d((1, 0, 1, 1, 0, 1)), 3),
        "CircularPad3d": (nn.CircularPad3d(1), 3),
    }[kind]
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    shape = {1: (3, 2, 5), 2: (3, 2, 3, 3), 3: (3, 2, 2, 3, 2)}[dims]
    torch.manual_seed(0)
    body = nn.Sequential(conv(2, 2, 1), nn.Tanh(), pad, conv(2, 2, 3), nn.Tanh(), nn.Flatten()).to(DT)
    width = body(torch.zeros(shape, dtype=DT)).shape[1]
    model = nn.Sequential(*body, nn.Linear(width, 3)).to(DT)
    return model, torch.randn(shape, dtype=DT), torch.tensor([0, 2, 1])


@pytest.mark.parametrize("kind", ["ReflectionPad1d", "ReplicationPad1d", "CircularPad1d", "CircularPad2d",
                                  "ReflectionPad3d", "ReplicationPad3d", "CircularPad3d"])
def test_copy_padding_modules_of_every_rank_are_crossed_by_the_recursions(kind):
    """docs/hessian.md counts `pad` among the 0/1-Jacobian ops the walk crosses and the nn.ReflectionPad*/
    nn.ReplicationPad*/nn.CircularPad* modules among what carries a bias into a normalization; before round 23 only
    the 2-D reflection/replication pads were crossed: the 1-D and 3-D ones and every circular pad (torch writes it as
    in-place slice copies, `CopySlices`) ended diag/approx in an UnsupportedModuleError."""
    model, x, y = _pad_net(kind)
    exact = diag_hessian(model, F.cross_entropy, x, y, mode="exact")
    ref = _dense_exact(model, x, F.cross_entropy, y)
    for k in ref:
        assert _rel(exact[k], ref[k]) < 1e-12, k
    for approx in (False, True):
        got = diag_hessian(model, F.cross_entropy, x, y, mode="approx" if approx else "diag")
        own = _own_recursion(list(model), x, F.cross_entropy, y, approx=approx)
        for k in own:
            assert _rel(got[k], own[k]) < 1e-12, (approx, k)


def test_a_bias_through_circular_and_1d_copy_padding_into_normalizations_is_exactly_zero():
    """docs/hessian.md: a bias carried by reflect/replicate/circular padding into a normalization whose groups it is
    constant on is removed, and diag/approx report exactly 0 (exact: round-off). Before round 23 these pads were
    refused by both recursions."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 2, 1), nn.CircularPad2d(1), nn.Conv2d(2, 2, 3, bias=False), nn.BatchNorm2d(2), nn.Tanh(),
        nn.Flatten(2), nn.ReplicationPad1d((1, 2)), nn.Conv1d(2, 2, 3), nn.InstanceNorm1d(2), nn.Flatten(),
        nn.Linear(2 * 10, 3),
    ).to(DT)
    x, y = torch.randn(3, 2, 3, 3, dtype=DT), torch.tensor([0, 1, 2])
    exact = diag_hessian(model, F.cross_entropy, x, y, mode="exact")
    ref = _dense_exact(model, x, F.cross_entropy, y)
    for name in ("0.bias", "7.bias"):
        assert ref[name].abs().max() < 1e-12 and exact[name].abs().max() < 1e-12
    for mode in ("diag", "approx"):
        got = diag_hessian(model, F.cross_entropy, x, y, mode=mode)
        assert torch.equal(got["0.bias"].abs(), torch.zeros(2, dtype=DT)), mode
        assert torch.equal(got["7.bias"].abs(), torch.zeros(2, dtype=DT)), mode
        assert got["0.weight"].abs().max() > 1e-6  # the recursion ran through the pads


class _Mix(nn.Module):
    """A mixed op of my own: Σ_k w_k·op_k(x), weights (K,)."""

    def __init__(self, ops):
        super().__init__()
        self._ops = nn.ModuleList(ops)

    def forward(self, x, w):
        return sum(w[k] * op(x) for k, op in enumerate(self._ops))


def _candidates(c):
    return [
        nn.Sequential(nn.Conv2d(c, c, 3, padding=2, dilation=2, groups=c), nn.GroupNorm(1, c), nn.SiLU()),
        nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.InstanceNorm2d(c, affine=True)),
        nn.Sequential(nn.CircularPad2d(1), nn.Conv2d(c, c, 3), nn.Softplus(beta=3.0)),
        nn.Sequential(nn.LayerNorm([c, 4, 4]), nn.ELU()),
        nn.AvgPool2d(3, 1, 1, count_include_pad=False),
        nn.Identity(),
    ]


def _chain_back(mods, xin, h, g):
    """My recursion through a chain of modules from a given output diagonal h and gradient g."""
    acts = [xin.detach().requires_grad_(True)]
    for m in mods:
        acts.append(m(acts[-1]))
    grads = torch.autograd.grad(acts[-1], acts[1:], g) if mods else ()
    for i in reversed(range(len(mods))):
        m, xi, gi = mods[i], acts[i].detach(), grads[i].detach()
        J = _jacobian(m, xi)
        h = ((J**2).T @ h.reshape(-1)).reshape(xi.shape) + _diag_of_hessian(lambda v: (gi * m(v)).sum(), xi)
    return h


def test_mixing_weight_diag_of_an_inner_edge_is_c31_on_my_own_dag_recursion_through_my_candidate_ops():
    """C.3.1, H_Z,k = Σ B_k² h_j, for the first edge of x0 → e01 → x1 → e12 → head: h_j at x1 is the sum over e12's
    candidates (a fan-out) of my chain recursion through each, started from Z_k² h and Z_k g at x2 (grouped dilated
    conv → GroupNorm(1) → SiLU, max pool → affine InstanceNorm, circular pad → conv → Softplus(β), LayerNorm → ELU,
    avg pool without padding counted, identity). Exact Z-diagonals against the dense autograd Hessian in Z."""
    from nasdiag.hessian import arch_diag_hessian

    torch.manual_seed(0)
    c, K = 2, 6
    e01, e12 = _Mix(_candidates(c)).to(DT), _Mix(_candidates(c)).to(DT)
    head = nn.Sequential(nn.AdaptiveAvgPool2d((2, 1)), nn.Flatten(), nn.Linear(2 * c, 3)).to(DT)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.e01, self.e12, self.head, self.Z = e01, e12, head, None

        def forward(self, x):
            return self.head(self.e12(self.e01(x, self.Z[0]), self.Z[1]))

    net = Net()
    x, y = torch.randn(2, c, 4, 4, dtype=DT), torch.tensor([0, 2])
    Z = torch.softmax(torch.randn(2, K, dtype=DT), -1)
    net.Z = Z
    edges = {"e01": (e01, list(e01._ops)), "e12": (e12, list(e12._ops))}
    got = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="diag")

    x1 = e01(x, Z[0]).detach().requires_grad_(True)
    x2 = e12(x1, Z[1])
    out = head(x2)
    g2 = torch.autograd.grad(F.cross_entropy(out, y), x2)[0].detach()
    h_out = _diag_of_hessian(lambda o: F.cross_entropy(o, y), out.detach())
    h2 = _chain_back(list(head), x2.detach(), h_out, torch.zeros_like(out))  # pool, flatten, linear: no residual
    flat = lambda op: list(op) if isinstance(op, nn.Sequential) else [op]  # noqa: E731
    h1 = sum(_chain_back(flat(op), x1.detach(), Z[1, k] ** 2 * h2, Z[1, k] * g2) for k, op in enumerate(e12._ops))
    for name, src, hj, mix in (("e01", x, h1, e01), ("e12", x1.detach(), h2, e12)):
        B = torch.stack([op(src).detach() for op in mix._ops])
        assert _rel(got[name], (B**2 * hj).sum((1, 2, 3, 4))) < 1e-12, name

    exact = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="exact")

    def loss_of(Zv):
        net.Z = Zv
        return F.cross_entropy(net(x), y)

    dense = _diag_of_hessian(loss_of, Z)
    net.Z = Z
    for i, name in enumerate(edges):
        assert _rel(exact[name], dense[i]) < 1e-12, name


class _Functional(nn.Module):
    """Forward code that calls a torch function (no rule leaf: the walk crosses its autograd op as glue)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("fn,shape", [
    (lambda x: F.max_pool3d(x, 2, stride=1, padding=1, dilation=(1, 2, 1), ceil_mode=True), (3, 2, 2, 2, 4)),
    (lambda x: F.adaptive_max_pool2d(x, (2, 3)), (3, 2, 3, 5)),
    (lambda x: F.adaptive_max_pool3d(x, (1, 2, 3)), (3, 2, 2, 3, 5)),
    (lambda x: F.pad(x, (2, 1), mode="reflect"), (3, 2, 5)),
    (lambda x: F.pad(x, (1, 1, 0, 1, 1, 0), mode="replicate"), (3, 2, 2, 2, 3)),
], ids=["max_pool3d", "adaptive_max_pool2d", "adaptive_max_pool3d", "pad_reflect_1d", "pad_replicate_3d"])
def test_max_pooling_and_copy_padding_in_forward_code_are_0_1_glue_at_every_rank(fn, shape):
    """docs/hessian.md: max-pool indices and pad are 0/1-Jacobian glue; before round 23 only F.max_pool2d (and 1-D,
    which torch runs as 2-D) and the 2-D reflection/replication pads were: F.max_pool3d, F.adaptive_max_pool2d/3d and
    the 1-D/3-D pads in forward code ended diag/approx in an UnsupportedModuleError."""
    torch.manual_seed(0)
    conv = {3: nn.Conv1d, 4: nn.Conv2d, 5: nn.Conv3d}[len(shape)]
    width = fn(torch.zeros(shape, dtype=DT)).numel() // shape[0]
    model = nn.Sequential(conv(2, 2, 1), nn.Tanh(), _Functional(fn), nn.Flatten(), nn.Linear(width, 3)).to(DT)
    x, y = torch.randn(shape, dtype=DT), torch.tensor([0, 2, 1])
    for approx in (False, True):
        got = diag_hessian(model, F.cross_entropy, x, y, mode="approx" if approx else "diag")
        own = _own_recursion(list(model), x, F.cross_entropy, y, approx=approx)
        for k in own:
            assert _rel(got[k], own[k]) < 1e-12, (approx, k)


def test_circular_padding_in_forward_code_is_one_line_pointing_to_the_circular_pad_modules():
    """F.pad(mode='circular') is written by torch as in-place slice copies (autograd's CopySlices), which the walk
    cannot cross; the refusal names that and the modules that work (before round 23 it named only 'CopySlices')."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 2, 1), nn.Tanh(), _Functional(lambda x: F.pad(x, (1, 1, 1, 1), mode="circular")),
                          nn.Conv2d(2, 2, 3), nn.Flatten(), nn.Linear(18, 3)).to(DT)
    x, y = torch.randn(3, 2, 3, 3, dtype=DT), torch.tensor([0, 2, 1])
    from nasdiag.hessian import UnsupportedModuleError

    for mode in ("diag", "approx"):
        with pytest.raises(UnsupportedModuleError) as err:
            diag_hessian(model, F.cross_entropy, x, y, mode=mode)
        text = str(err.value)
        assert "\n" not in text and "CopySlices" in text and "nn.CircularPad1d/2d/3d" in text, text
    exact = diag_hessian(model, F.cross_entropy, x, y, mode="exact")  # the way out the line names
    ref = _dense_exact(model, x, F.cross_entropy, y)
    assert max(_rel(exact[k], ref[k]) for k in ref) < 1e-12
