"""Round-12 audit of nasdiag.hessian against own float64 references (dense reverse-over-reverse autograd Hessians).

Every reference here is built from scratch: ``torch.autograd.functional.hessian`` of the loss written out with
``torch.func.functional_call`` (no nasdiag code on the reference side).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.functional import hessian

from nasdiag.hessian import alpha_diag_hessian, arch_diag_hessian, diag_hessian, hessian_eigenvalues


def _dense_diag(net, loss_fn, x, y, name):
    """The diagonal of the dense float64 Hessian of ``loss_fn(net(x), y)`` w.r.t. the parameter ``name``."""
    params = {n: p.detach() for n, p in net.named_parameters()}

    def loss_of(p):
        return loss_fn(torch.func.functional_call(net, {**params, name: p}, (x,)), y)

    return torch.diagonal(hessian(loss_of, params[name].clone()).reshape(params[name].numel(), -1)).reshape(params[name].shape)


def test_a_bias_before_an_eval_batch_norm_whose_tracking_flag_was_turned_off_keeps_its_curvature():
    # nn.BatchNorm* decides batch statistics by `training or (running buffers are None)`: an eval-mode layer whose
    # track_running_stats was switched off after construction still holds its buffers and normalizes with them, an
    # affine map. The homogeneity analysis read the flag instead, called the layer scale-invariant and gave the bias
    # before it exactly zero curvature in diag/approx (true diagonal 2·(w γ/σ)², nonzero). One output under MSE
    # keeps the output Hessian a scalar, so the recursions are exact on this chain and must equal the dense diagonal.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    net.train()
    with torch.no_grad():
        net(x * 2 + 1)  # running statistics that differ from the batch's
    net.eval()
    net[1].track_running_stats = False
    stats = (net[1].running_mean.clone(), net[1].running_var.clone())
    dense = _dense_diag(net, F.mse_loss, x, y, "0.bias")
    assert dense.abs().min() > 1e-3  # the check below can fail: the true curvature is far from zero
    for mode in ("exact", "diag", "approx"):
        got = diag_hessian(net, F.mse_loss, x, y, mode=mode)["0.bias"]
        torch.testing.assert_close(got, dense, rtol=1e-10, atol=1e-12, msg=f"mode={mode}")
    assert torch.equal(net[1].running_mean, stats[0]) and torch.equal(net[1].running_var, stats[1])
    assert all(p.grad is None for p in net.parameters())
    # the same layer in training mode removes the bias: zero in the recursions, round-off in the dense Hessian
    net.train()
    dense_train = _dense_diag(net, F.mse_loss, x, y, "0.bias")
    assert dense_train.abs().max() < 1e-12
    for mode in ("diag", "approx"):
        assert torch.equal(diag_hessian(net, F.mse_loss, x, y, mode=mode)["0.bias"], torch.zeros(4, dtype=torch.float64))


# --- an own supernet of another shape than DARTS's -------------------------------------------------------------------
# Edges with different op lists (a conv op, identity, zero; pooling and identity only; a single op, K = 1; identity and
# zero), a node fed by three edges, the cell's output a sum (not a concat), α held in an nn.ParameterList of a separate
# module. The network can be run at given Z (the dense reference's variable) or at softmax(α).

class _Zero(nn.Module):
    def forward(self, x):
        return x * 0.0


class _Mixed(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.ops = nn.ModuleList(ops)

    def forward(self, x, weights):
        if weights.dim() == 1:
            return sum(w * op(x) for w, op in zip(weights, self.ops))
        return sum(weights[:, k].view(-1, *([1] * (x.dim() - 1))) * op(x) for k, op in enumerate(self.ops))


class _Arch(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.alphas = nn.ParameterList([nn.Parameter(0.1 * torch.randn(k, dtype=torch.float64)) for k in sizes])


class _SumCellNet(nn.Module):
    sizes = (3, 3, 1, 2)

    def __init__(self, C=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, C, 3, padding=1), nn.BatchNorm2d(C))
        self.e0 = _Mixed([nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C)),
                          nn.Identity(), _Zero()])
        self.e1 = _Mixed([nn.AvgPool2d(3, 1, 1, count_include_pad=False), nn.MaxPool2d(3, 1, 1), nn.Identity()])
        self.e2 = _Mixed([nn.Sequential(nn.Tanh(), nn.Conv2d(C, C, 1))])
        self.e3 = _Mixed([nn.Identity(), _Zero()])
        self.arch = _Arch(self.sizes)
        self.head = nn.Linear(C, 4)
        self.Z = None  # set by the reference: the mixing weights to run at

    def forward(self, x):
        w = [F.softmax(a, -1) for a in self.arch.alphas] if self.Z is None else self.Z
        s0 = self.stem(x)
        n1 = self.e0(s0, w[0])
        n2 = self.e1(s0, w[1]) + self.e2(n1, w[2]) + self.e3(n1, w[3])
        return self.head((n1 + n2).mean((2, 3)))


def _sum_cell_setup():
    torch.manual_seed(3)
    net = _SumCellNet().double()
    x, y = torch.randn(5, 1, 6, 6, dtype=torch.float64), torch.randint(0, 4, (5,))
    edges = {f"e{i}": (getattr(net, f"e{i}"), list(getattr(net, f"e{i}").ops)) for i in range(4)}
    return net, x, y, edges


def _sum_cell_dense(net, x, y):
    """Dense float64 Hessians and gradient of the train-mode loss w.r.t. the stacked Z and the stacked α."""
    sizes = list(net.sizes)
    stats = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
             for m in net.modules() if isinstance(m, nn.BatchNorm2d)]

    def loss_z(flat):
        net.Z = list(torch.split(flat, sizes))
        try:
            return F.cross_entropy(net(x), y)
        finally:
            net.Z = None

    def loss_a(flat):
        return loss_z(torch.cat([F.softmax(a, -1) for a in torch.split(flat, sizes)]))

    alpha = torch.cat([a.detach() for a in net.arch.alphas])
    z = torch.cat([F.softmax(a.detach(), -1) for a in net.arch.alphas])
    out = hessian(loss_z, z), hessian(loss_a, alpha), torch.autograd.functional.jacobian(loss_z, z), z
    for m, (mean, var, count) in zip([m for m in net.modules() if isinstance(m, nn.BatchNorm2d)], stats):
        m.running_mean.copy_(mean), m.running_var.copy_(var), m.num_batches_tracked.copy_(count)
    return out


def _own_softmax_chain(hz, g, z):
    """Σ_k (∂Z_k/∂α_i)² hz_k + Σ_k g_k ∂²Z_k/∂α_i², the softmax derivatives by autograd at α = log z."""
    a = torch.log(z)
    J = torch.autograd.functional.jacobian(lambda a: F.softmax(a, -1), a)
    second = torch.stack([torch.diagonal(hessian(lambda a, k=k: F.softmax(a, -1)[k], a)) for k in range(len(z))])
    return (J ** 2 * hz[:, None]).sum(0) + (g[:, None] * second).sum(0)


def test_every_mode_on_a_sum_cell_with_per_edge_op_lists_k1_and_zero_ops_is_exact_or_its_documented_chain():
    # exact/exact_per_edge (each edge owns its α row) equal the dense diagonals for Z and α; every mode's wrt='alpha'
    # (but hutchinson's) is its own wrt='Z' diagonal chained through softmax as docs/hessian.md states it (Σ J_ki² H_Z,k + Σ g_k ∂²Z_k/∂α_i²,
    # g the exact gradient); a zero op and the K = 1 edge's α get exactly 0; diag_hessian through the model's own
    # softmax (glue) on the ParameterList gives diag's numbers; buffers, .grad untouched and repeated calls identical.
    net, x, y, edges = _sum_cell_setup()
    HZ, HA, gZ, z = _sum_cell_dense(net, x, y)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    split = lambda v: dict(zip(edges, torch.split(v, list(net.sizes))))  # noqa: E731
    dz, da, g, zs = split(torch.diagonal(HZ)), split(torch.diagonal(HA)), split(gZ), split(z)
    assert torch.diagonal(HZ).abs().max() > 1e-2 and torch.diagonal(HA).abs().max() > 1e-3
    for mode in ("exact", "exact_per_edge", "ggn", "ggn_mc", "hutchinson:3", "diag", "approx"):
        kw = {"seed": 1} if mode in ("ggn_mc", "hutchinson:3") else {}
        hz = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt="Z", **kw)
        ha = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt="alpha", **kw)
        again = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt="alpha", **kw)
        assert all(torch.equal(ha[n], again[n]) for n in edges), mode
        for n in edges:
            if mode.startswith("exact"):
                torch.testing.assert_close(hz[n], dz[n], rtol=1e-9, atol=1e-13, msg=f"{mode} Z {n}")
                torch.testing.assert_close(ha[n], da[n], rtol=1e-9, atol=1e-13, msg=f"{mode} alpha {n}")
            elif not mode.startswith("hutchinson"):  # hutchinson probes α itself (the last test of this file)
                torch.testing.assert_close(ha[n], _own_softmax_chain(hz[n], g[n], zs[n]), rtol=1e-9, atol=1e-15,
                                           msg=f"{mode} chain {n}")
        assert hz["e0"][2] == 0 and hz["e3"][1] == 0 and ha["e2"][0] == 0, mode  # zero ops; softmax of one entry
    glue = diag_hessian(net, F.cross_entropy, x, y, mode="diag", params=[f"arch.alphas.{i}" for i in range(4)])
    ha = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="diag", wrt="alpha")
    for i, n in enumerate(edges):
        torch.testing.assert_close(glue[f"arch.alphas.{i}"], ha[n], rtol=1e-9, atol=1e-15)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is None for p in net.parameters())


def test_spectrum_and_shared_diagonal_of_a_parameter_list_alpha_with_a_negative_dominant_eigenvalue():
    # docs/spectrum.md: eigenvalues are the k largest algebraic, largest_magnitude is signed, and the power method's
    # dominant eigenvalue is followed by a shifted run for the largest algebraic one. At this α the dense α-Hessian
    # (train-mode BN, null directions from each edge's softmax shift and the K = 1 edge) has its largest-magnitude
    # eigenvalue negative, so the two differ; checked against torch.linalg.eigvalsh of the own dense Hessian.
    net, x, y, _ = _sum_cell_setup()
    torch.manual_seed(3)
    with torch.no_grad():
        for a in net.arch.alphas:
            a.copy_(2 * torch.randn_like(a))
    _, HA, _, _ = _sum_cell_dense(net, x, y)
    ev = torch.linalg.eigvalsh(HA)
    assert -ev[0] > 1.1 * ev[-1] > 0  # a negative dominant eigenvalue: the test tells the two conventions apart
    params = list(net.arch.alphas)
    scale = ev.abs().max().item()
    res = hessian_eigenvalues(net, F.cross_entropy, x, y, params=params, k=3, iters=HA.shape[0])
    assert res.converged
    for got, want in ((res.largest_algebraic, ev[-1]), (res.smallest_algebraic, ev[0]), (res.largest_magnitude, ev[0])):
        assert abs(got - want.item()) <= 1e-8 * scale
    torch.testing.assert_close(torch.as_tensor(res.eigenvalues, dtype=torch.float64), ev.flip(0)[:3], rtol=0, atol=1e-8 * scale)
    power = hessian_eigenvalues(net, F.cross_entropy, x, y, params=params, k=1, method="power", iters=2000, tol=1e-10)
    assert power.converged and abs(power.largest_algebraic - ev[-1].item()) <= 1e-6 * scale
    assert abs(power.largest_magnitude - ev[0].item()) <= 1e-6 * scale
    shared = alpha_diag_hessian(net, F.cross_entropy, x, y, params=params)
    torch.testing.assert_close(torch.cat([v.reshape(-1) for v in shared.values()]), torch.diagonal(HA), rtol=1e-9, atol=1e-14)


def test_float32_supernet_gives_the_float64_numbers_in_every_arch_mode():
    # the same net and batch in float32: every mode's numbers within float32 round-off of the float64 ones (relative
    # to the largest entry; measured a few 1e-7), in float32. ggn_mc draws ε on √λ of each loss block, and the zero
    # eigenvalue of a cross-entropy block comes out as round-off, ~eps·λ_max, whose square root puts a direction of
    # relative size √eps (3e-4 in float32, 1e-8 in float64) into the draw: measured 4.7e-4 apart
    import copy

    net, x, y, edges = _sum_cell_setup()
    net32 = copy.deepcopy(net).float()
    edges32 = {n: (getattr(net32, n), list(getattr(net32, n).ops)) for n in edges}
    for mode in ("exact", "ggn", "ggn_mc", "hutchinson:3", "diag", "approx"):
        kw = {"seed": 1} if mode in ("ggn_mc", "hutchinson:3") else {}
        for wrt in ("Z", "alpha"):
            ref = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt=wrt, **kw)
            got = arch_diag_hessian(net32, F.cross_entropy, x.float(), y, edges32, mode=mode, wrt=wrt, **kw)
            scale = max(v.abs().max().item() for v in ref.values())
            for n in edges:
                assert got[n].dtype == torch.float32
                tol = 3e-3 if mode == "ggn_mc" else 1e-5
                torch.testing.assert_close(got[n].double(), ref[n], rtol=0, atol=tol * scale, msg=f"{mode} {wrt} {n}")


def test_a_mixed_op_called_twice_with_one_z_is_exact_and_its_ggn_is_the_own_gauss_newton_of_the_shared_z():
    # one mixed op (one Z) applied twice in a row: exact (Z and α) is the dense diagonal of the shared Z, cross-call
    # terms included, and ggn is Σ_n diag(J_nᵀ H_n J_n) with J_n the Jacobian of sample n's logits w.r.t. the shared Z
    # (both calls) and H_n its own cross-entropy block, all by own autograd
    torch.manual_seed(0)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.head = nn.Linear(3, 4), nn.Linear(4, 3)
            self.e = _Mixed([nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Identity(), nn.ELU()])
            self.alpha = nn.Parameter(0.3 * torch.randn(3))
            self.Z = None

        def forward(self, x):
            w = F.softmax(self.alpha, -1) if self.Z is None else self.Z
            return self.head(self.e(self.e(self.stem(x), w), w))

    net = Twice().double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 3, (5,))

    def logits(z):
        net.Z = z
        try:
            return net(x)
        finally:
            net.Z = None

    z = F.softmax(net.alpha.detach(), -1)
    HZ = hessian(lambda z: F.cross_entropy(logits(z), y), z)
    HA = hessian(lambda a: F.cross_entropy(logits(F.softmax(a, -1)), y), net.alpha.detach().clone())
    J = torch.autograd.functional.jacobian(logits, z)  # (N, classes, K)
    out = logits(z).detach()
    G = sum(J[n].T @ hessian(lambda o, n=n: F.cross_entropy(o[None], y[n:n + 1]) / len(y), out[n]) @ J[n] for n in range(len(y)))
    edges = {"e": (net.e, list(net.e.ops))}
    for mode in ("exact", "exact_per_edge"):
        torch.testing.assert_close(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode)["e"], torch.diagonal(HZ),
                                   rtol=1e-9, atol=1e-14)
        torch.testing.assert_close(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt="alpha")["e"],
                                   torch.diagonal(HA), rtol=1e-9, atol=1e-14)
    ggn = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="ggn")["e"]
    torch.testing.assert_close(ggn, torch.diagonal(G), rtol=1e-9, atol=1e-14)
    assert (torch.diagonal(HZ) - ggn).abs().max() > 1e-2  # the residual is not negligible here: the two are told apart


def test_hutchinson_wrt_alpha_is_unbiased_for_the_alpha_diagonal_not_the_chained_z_diagonal():
    # docs/hessian.md: hutchinson:<k> drops "nothing in expectation". W.r.t. α it chained the estimated Z-diagonal
    # through softmax, dropping the within-edge k ≠ k' entries of ∂²L/∂Z² whatever k: its own table showed the same
    # 0.012 α error at k = 1, 4, 16 on an eval-mode cell where the Z estimate is exact. Here the logits are linear in Z
    # (no normalization, the edge feeds a linear head), so the ggn control variate is the whole Z-Hessian and one
    # probe must give the exact α diagonal; the chained Z diagonal is far from it (checked, so the test can fail).
    torch.manual_seed(3)

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.head = nn.Linear(3, 4), nn.Linear(4, 3)
            self.e = _Mixed([nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Identity(), nn.Tanh(), _Zero()])
            self.alpha = nn.Parameter(1.5 * torch.randn(4))
            self.Z = None

        def forward(self, x):
            return self.head(self.e(torch.tanh(self.stem(x)), F.softmax(self.alpha, -1) if self.Z is None else self.Z))

    net = Flat().double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 3, (6,))

    def loss_z(z):
        net.Z = z
        try:
            return F.cross_entropy(net(x), y)
        finally:
            net.Z = None

    alpha = net.alpha.detach().clone()
    z = F.softmax(alpha, -1)
    exact = torch.diagonal(hessian(lambda a: loss_z(F.softmax(a, -1)), alpha))
    chained = _own_softmax_chain(torch.diagonal(hessian(loss_z, z)), torch.autograd.functional.jacobian(loss_z, z), z)
    assert (chained - exact).abs().max() > 0.5 * exact.abs().max()  # measured 0.81
    edges = {"e": (net.e, list(net.e.ops))}
    for k in (1, 3):
        for seed in (0, 5):
            got = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=f"hutchinson:{k}", wrt="alpha", seed=seed)["e"]
            torch.testing.assert_close(got, exact, rtol=1e-9, atol=1e-14, msg=f"k={k} seed={seed}")
    # and it still is Hutchinson's estimate where H differs from its control: unbiased, so many probes approach exact
    net_bn, xb, yb, edges_bn = _sum_cell_setup()
    _, HA, _, _ = _sum_cell_dense(net_bn, xb, yb)
    few, many = (torch.cat(list(arch_diag_hessian(net_bn, F.cross_entropy, xb, yb, edges_bn, mode=f"hutchinson:{k}",
                                                   wrt="alpha").values())) for k in (1, 512))
    assert (many - torch.diagonal(HA)).abs().max() < 0.1 * (few - torch.diagonal(HA)).abs().max()
