"""Audit round 23, lifecycle of the curvature modes on every exit path, and NaN in curvature results.

Round 22 checked diag_hessian (diag, approx), arch_diag_hessian (exact_per_edge), alpha_diag_hessian and the
spectrum functions. This round covers the rest: arch_diag_hessian in every mode (exact, exact_per_edge, ggn, ggn_mc,
hutchinson:2, diag, approx) with wrt="Z" and wrt="alpha", diag_hessian in exact and hutchinson:2, alpha_diag_hessian
and probe.hessian(), each on four exit paths of the loss (raises, raises KeyboardInterrupt, raises on its 2nd call,
returns NaN). The state compared before and after is read from the model and torch directly (every hook dict of
every module, torch's global module hooks, parameters, .grad, requires_grad, BN buffers, training flags, grad mode,
default dtype, deterministic flag, threads, the CPU RNG, the saved-tensor hook stack, functorch's level, autocast,
forward-AD mode).

Lifecycle and NaN: nothing to fix, all state is restored on every path. Found, while checking NaN under CPU bfloat16
autocast (fixed): the GGN modes and hutchinson:<k> refused nasdiag's own MixedOp as pairing batch rows with ops (its
(K,) and (B, K) calls round differently there), and diag_hessian's diag/approx stopped in torch's raw dtype error on
a float32 conv before a Linear or an AvgPool2d after a bfloat16 conv (the last two tests). The same held, in scratch runs, for a KeyboardInterrupt at
each call of the loss, of the forward and of a tensor hook in each backward of every mode (up to 7 loss calls and
10 backwards in hutchinson); for warnings turned into errors at the unused-edge warning of every mode; and no call
(returning, NaN, raising) leaves a reference cycle holding the traced forward. NaN: a NaN loss, a NaN in one input
sample (train and eval mode), a NaN parameter, a NaN α entry, cross-entropy with every target ignored and MSE with
a NaN target give NaN in every entry the loss reaches, in every mode and wrt, and exact zeros for an edge whose output
the loss does not use (docs/hessian.md, "A NaN or infinite loss").
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

import nasdiag
from nasdiag.hessian import alpha_diag_hessian, arch_diag_hessian, diag_hessian


class _Mixed(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.ops = nn.ModuleList(ops)

    def forward(self, x, weights):
        out = 0
        for k, op in enumerate(self.ops):
            w = weights[..., k]
            if w.dim() == 1:  # (B,) per-sample weights of the GGN modes
                w = w.view(-1, *([1] * (x.dim() - 1)))
            out = out + w * op(x)
        return out


class _Supernet(nn.Module):
    """Two mixed edges in a chain (train-mode BN inside and around them), α (2, 3) through softmax; with
    ``unused=True`` the second edge runs but its output is dropped."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.unused = unused
        self.stem = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, bias=False), nn.BatchNorm2d(2))

        def edge():
            return _Mixed([nn.Sequential(nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1, bias=False), nn.BatchNorm2d(2)),
                           nn.Identity(), nn.AvgPool2d(3, 1, 1)])

        self.e0, self.e1 = edge(), edge()
        self.alpha = nn.Parameter(0.1 * torch.randn(2, 3))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 3))

    def forward(self, x):
        z = torch.softmax(self.alpha, -1)
        a = self.e0(self.stem(x), z[0])
        b = self.e1(a, z[1])
        return self.head(a if self.unused else a + b)

    def edges(self):
        return {"e0": (self.e0, list(self.e0.ops)), "e1": (self.e1, list(self.e1.ops))}


def _setup(unused: bool = False):
    torch.manual_seed(0)
    net = _Supernet(unused).double().train()
    x = torch.randn(4, 1, 4, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    F.cross_entropy(net(x), y).backward()  # existing .grad values, moved BN statistics
    return net, x, y


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_hooks", "_load_state_dict_pre_hooks")


def _snapshot(model: nn.Module) -> dict:
    s = {}
    for n, m in model.named_modules():
        for d in _HOOK_DICTS:
            v = getattr(m, d, None)
            if v:
                s[(n, d)] = tuple(v.keys())
        s[(n, "training")] = m.training
        for bn, b in m.named_buffers(recurse=False):
            s[(n, "buf", bn)] = None if b is None else b.detach().clone()
    for n, p in model.named_parameters():
        s[(n, "p")] = p.detach().clone()
        s[(n, "requires_grad")] = p.requires_grad
        s[(n, "grad")] = None if p.grad is None else p.grad.detach().clone()
        s[(n, "tensor hooks")] = tuple((getattr(p, "_backward_hooks", None) or {}).keys())
    s["global hooks"] = (len(_module._global_forward_hooks), len(_module._global_forward_pre_hooks),
                         len(_module._global_backward_hooks), len(getattr(_module, "_global_backward_pre_hooks", {})))
    s["grad mode"] = torch.is_grad_enabled()
    s["inference mode"] = torch.is_inference_mode_enabled()
    s["anomaly"] = torch.is_anomaly_enabled()
    s["default dtype"] = torch.get_default_dtype()
    s["deterministic"] = torch.are_deterministic_algorithms_enabled()
    s["threads"] = torch.get_num_threads()
    s["rng"] = torch.get_rng_state().clone()
    s["saved-tensor hooks"] = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    s["functorch level"] = torch._C._functorch.maybe_current_level()
    s["autocast"] = torch.is_autocast_enabled("cpu")
    s["forward AD"] = torch._C._is_fwd_grad_enabled()
    return s


def _changed(before: dict, after: dict) -> list:
    out = []
    for k in set(before) | set(after):
        a, b = before.get(k, "missing"), after.get(k, "missing")
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            same = a.shape == b.shape and torch.equal(a, b)
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            same = False
        else:
            same = a == b
        if not same:
            out.append(str(k))
    return sorted(out)


class _Boom(Exception):
    pass


def _losses():
    calls = {"n": 0}

    def raising(o, t):
        raise _Boom("the loss raised")

    def interrupted(o, t):
        raise KeyboardInterrupt

    def second(o, t):
        calls["n"] += 1
        if calls["n"] == 2:
            raise _Boom("the loss raised on its 2nd call")
        return F.cross_entropy(o, t)

    def nan(o, t):
        return F.cross_entropy(o, t) * float("nan")

    return {"returns": F.cross_entropy, "raises": raising, "interrupt": interrupted, "second": second, "nan": nan}


_ROUTES = [f"arch {m} {w}" for m in ("exact", "exact_per_edge", "ggn", "ggn_mc", "hutchinson:2", "diag", "approx")
           for w in ("Z", "alpha")] + ["weights exact", "weights hutchinson:2", "alpha_diag_hessian",
                                       "probe ggn_mc", "probe exact"]


def _call(route: str, net, loss_fn, x, y):
    kind, _, rest = route.partition(" ")
    if kind == "arch":
        mode, wrt = rest.split()
        return arch_diag_hessian(net, loss_fn, x, y, net.edges(), mode=mode, wrt=wrt)
    if kind == "weights":
        return diag_hessian(net, loss_fn, x, y, mode=rest)
    if kind == "alpha_diag_hessian":
        return alpha_diag_hessian(net, loss_fn, x, y, params={"alpha": net.alpha})
    probe = nasdiag.attach(net, net.edges(), hessian=rest, loss_fn=loss_fn)
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    return probe


@pytest.mark.parametrize("route", _ROUTES)
def test_every_curvature_route_leaves_the_model_and_torch_as_they_were_on_every_exit_of_the_loss(route):
    """Each exit path of the loss (return, raise, KeyboardInterrupt, raise on its 2nd call, NaN) leaves hooks,
    parameters, .grad, BN buffers, flags and torch's global state as they were; a NaN loss gives all-NaN curvature."""
    net, x, y = _setup()
    probe = None
    for name, loss_fn in _losses().items():
        if route.startswith("probe"):
            probe = _call(route, net, loss_fn, x, y)  # the block itself is round 19's; here hessian() after it
            net.zero_grad(set_to_none=False)
        before = _snapshot(net)
        try:
            out = probe.hessian() if probe is not None else _call(route, net, loss_fn, x, y)
        except (_Boom, KeyboardInterrupt):
            out = None
        after = _snapshot(net)
        assert not _changed(before, after), f"{route}, loss {name}: changed {_changed(before, after)}"
        if name in ("raises", "interrupt"):
            assert out is None, f"{route}: the loss raised but the call returned"
        if name == "nan":
            assert out is not None and all(bool(torch.isnan(v).all()) for v in out.values()), (
                f"{route}: a NaN loss gave non-NaN curvature {out}")
        if name == "returns":
            assert all(bool(torch.isfinite(v).all()) for v in out.values())


def test_ggn_modes_take_nasdiags_own_supernet_under_cpu_bfloat16_autocast():
    """Under CPU bfloat16 autocast, nasdiag's MixedOp returns bfloat16 for (K,) weights (a 0-dim weight times a bfloat16
    op output) and float32 for (B, K) (a (B, 1, 1, 1) weight promotes it): 0.4% of the largest entry apart. The GGN
    modes' check of (B, K) against (K,) weights asked 1e-5 and refused every such call as "a mixed op pairing the batch
    rows with its ops" (ggn, ggn_mc, hutchinson:<k>), though docs/hessian.md says the mixing-weight curvature works
    under CPU autocast in every mode. Reference: the GGN diagonal Σ_n J_nᵀ H_n J_n written out in float64 (eval-mode
    BatchNorm: no sample couples, so the per-sample shift's J_n is ∂f_n/∂Z of each cell's Z), H_n = (diag p − p pᵀ)/N."""
    from conftest import tiny_network

    net = tiny_network(2, C=2).float().eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    specs = net.edge_specs()
    edges = {s.name: s for s in specs}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = {m: arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=m) for m in ("ggn", "ggn_mc", "hutchinson:1")}

    net64, x64 = net.double(), x.double()
    Z = torch.softmax(net64.alphas()["reduce"].detach(), -1)
    Zs = tuple(Z.clone() for _ in net64.cells)
    J = torch.autograd.functional.jacobian(lambda *zs: net64(x64, list(zs)), Zs)  # per cell: (N, D, E, K)
    with torch.no_grad():
        p = torch.softmax(net64(x64, list(Zs)), -1)
    H = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]) / x.shape[0]  # (N, D, D) of the batch mean
    for s in specs:
        Jc = J[s.cell_index][:, :, s.edge_index, :]  # (N, D, K)
        want = torch.einsum("ndk,nde,nek->k", Jc, H, Jc)
        for mode, out in got.items():
            assert out[s.name].dtype == torch.float32
            if mode == "ggn":  # ggn_mc and hutchinson:1 are one draw: finite is what the refusal took away
                assert torch.allclose(out[s.name].double(), want, rtol=0.1, atol=0.05 * float(want.abs().max())), (
                    s.name, out[s.name], want)
            assert bool(torch.isfinite(out[s.name]).all())


def test_diag_recursion_runs_under_cpu_bfloat16_autocast_and_matches_the_papers_conv_recursion():
    """Under CPU bfloat16 autocast a float32 Conv2d fed float32 data gets back a bfloat16 diagonal from the Linear after
    it (its h_out @ W² runs in bfloat16), and ``conv2d_weight`` takes one dtype: diag_hessian(mode="diag") stopped in
    torch's raw oneDNN error ("could not create a primitive descriptor"), as did an AvgPool2d after a bfloat16 conv
    (approx: "expected dtype BFloat16 for gradOutput"). Reference: C.1.4-C.1.5 and C.2.1 written out in float64 with
    unfold, h_o = p(1 − p)/N the diagonal of the mean cross-entropy's Hessian in the logits."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(32, 3)).train()
    x, y = torch.randn(4, 1, 4, 4), torch.randint(0, 3, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = diag_hessian(net, F.cross_entropy, x, y, mode="diag")

    conv, lin = (m.double() for m in (net[0], net[2]))
    x64 = x.double()
    with torch.no_grad():
        a = conv(x64)
        f = a.flatten(1)
        p = torch.softmax(lin(f), -1)
        h_o = p * (1 - p) / x.shape[0]  # (N, 3)
        h_a = (h_o @ lin.weight.square()).view_as(a)  # C.1.5: the diagonal at the Linear's input
        x2 = F.unfold(x64.square(), 3, padding=1)  # (N, 1·9, 16): C.2.1 on the unfolded rows
        want = {"0.weight": torch.einsum("ncp,nkp->ck", h_a.flatten(2), x2).view_as(conv.weight),
                "0.bias": h_a.sum((0, 2, 3)), "2.weight": h_o.T @ f.square(), "2.bias": h_o.sum(0)}
    for name, w in want.items():
        assert got[name].dtype == torch.float32
        assert torch.allclose(got[name].double(), w, rtol=0.05, atol=0.02 * float(w.abs().max())), (name, got[name], w)
