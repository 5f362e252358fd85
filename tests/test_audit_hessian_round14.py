"""Round-14 audit of the mixing-weight curvature (nasdiag.hessian, C.3) against the auditor's own float64 references.

Every reference is built here from scratch: dense Hessians by reverse-over-reverse autograd (``torch.autograd.grad``
twice; never ``torch.func.hessian`` through train-mode BatchNorm, docs/hessian.md), ``torch.linalg.eigvalsh``, and an
own transcription of bayesnas-appendix C.3.1 (``H_Z,k = Σ_{n,c,p} B_k² h_j``) and C.3.2 (``Σ_c (Σ_{n,p} B_k²)_c ·
E_{n,p}(h_j)_c``) fed the exact ``h_j`` (the diagonal of the dense Hessian of the loss w.r.t. the mixed op's output)
where docs/hessian.md says the mode is exact, with the softmax chain of docs/hessian.md "α" written out per entry.

No defect found this round. Checked and found right (scratch scripts, the sharpest kept below):
a ProxylessNAS-like chain (one mixed op per layer, K = 3/5/2 and 2/3/4/5, α per layer in a ParameterList, train-mode
BN in candidates) under MSE and CE heads: exact/exact_per_edge w.r.t. Z and α and alpha_diag_hessian equal the dense
diagonals (1e-15); diag/approx of the last layer equal own C.3.1/C.3.2 with the exact h_j (1e-16) where the head keeps
h_j exact (flatten → MSE; eval BN → spatial mean → Linear → MSE), with (K,) and per-sample (B, K) weights (exact, ggn,
hutchinson:1 then equal the dense Hessian of a batch-shared shift); under CE the recursion's h_j drops W H Wᵀ's
off-diagonal (documented, 5% here). A DARTS cell taking its weights as a list, one (K,) per edge, two cells sharing α,
train-mode BN: alpha_diag_hessian, shared_weights_diag_hessian, hessian_eigenvalues (top 3, signed largest magnitude)
equal the dense α/Z Hessian and eigvalsh (1e-15); exact w.r.t. α refuses the shared α in one line. float32 copies of
these nets: every arch mode (Z and α), alpha_diag_hessian and the spectrum within 5e-7 relative of float64,
diag_hessian's weight modes within 1e-5 (ggn_mc 3e-4 under CE, round 12's documented √eps draw), float32 out;
no float32 step inside a float64 run (its results equal the dense float64 references to 1e-15). The fast engine's
batched C.3.1/C.3.2 (nasdiag.supernet.engine) equals the eager recursion in float64 (1e-16) and float32 (1e-6).
probe.hessian() in a user's loop whose loss is a sum or a mean, default or given loss_fn, modes exact/diag/ggn, Z and
α: the numbers of arch_diag_hessian on the same batch (bitwise), in the attach loss's convention, running statistics
untouched. BayesNAS after real pruning (active ops not computed in the training forward) still takes and records its
curvature; edges listed with a missing or an extra op are one-line errors in every mode.

Noticed, left alone: torch 2.13's forward-over-reverse of ``F.mse_loss`` raises "ZeroTensors are immutable" (a plain
``jvp(grad(f))`` too), so every exact route on an MSE model warns and takes reverse-over-reverse products (right
numbers, slower), as docs/hessian.md describes for backend="auto".
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.hessian import CurvatureError, alpha_diag_hessian, arch_diag_hessian, hessian_eigenvalues

from test_audit_hessian_round9 import Mixed  # Σ_k w_k op_k(x) for (K,) or (B, K) weights
from test_audit_hessian_round11 import own_softmax_chain  # docs/hessian.md "α" written out per entry

DT = torch.float64


def candidates(C, K):
    make = [lambda: nn.Sequential(nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C), nn.Tanh()),
            nn.Identity,
            lambda: nn.Sequential(nn.Conv2d(C, C, 1), nn.ELU()),
            lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False),
            lambda: nn.Sequential(nn.Conv2d(C, C, 5, padding=2), nn.Softplus())]
    return [make[i]() for i in range(K)]


class Chain(nn.Module):
    """ProxylessNAS-like: one mixed op per layer, its own K and α; head: BN → spatial mean → Linear."""

    def __init__(self, C=3, Ks=(3, 5, 2), out=6):
        super().__init__()
        self.stem = nn.Conv2d(1, C, 3, padding=1)
        self.layers = nn.ModuleList([Mixed(candidates(C, K)) for K in Ks])
        self.alphas = nn.ParameterList([nn.Parameter(0.7 * torch.randn(K)) for K in Ks])
        self.bn = nn.BatchNorm2d(C)
        self.lin = nn.Linear(C, out)

    def forward(self, x, Z=None):
        h = self.stem(x)
        for i, layer in enumerate(self.layers):
            h = layer(h, F.softmax(self.alphas[i], -1) if Z is None else Z[i])
        return self.lin(self.bn(h).mean((2, 3)))

    def edges(self):
        return {f"l{i}": (m, list(m.ops)) for i, m in enumerate(self.layers)}


def dense(f, at):
    """Reverse-over-reverse Hessian of the scalar f at the flat ``at`` (one backward per row), and the gradient."""
    at = at.detach().clone().requires_grad_(True)
    g = torch.autograd.grad(f(at), at, create_graph=True)[0]
    H = torch.stack([torch.autograd.grad(g[i], at, retain_graph=True)[0] for i in range(at.numel())])
    return H.detach(), g.detach()


def rel(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def chain():
    torch.manual_seed(3)
    net = Chain().double()
    with torch.no_grad():
        net.bn.running_mean.normal_()
        net.bn.running_var.uniform_(0.5, 2)
        net.bn.weight.normal_()
    net.eval()  # eval BN → mean → Linear → MSE: h_j at the last mixed op is exact and constant per channel
    return net, torch.randn(4, 1, 5, 5, dtype=DT), torch.randn(4, 6, dtype=DT)


@pytest.mark.filterwarnings("ignore:torch.func products are not usable:RuntimeWarning")  # F.mse_loss, note below
def test_proxyless_chain_exact_is_the_dense_hessian_and_diag_approx_are_own_c31_c32_with_the_exact_h(chain):
    # torch 2.13's forward-over-reverse of F.mse_loss raises "ZeroTensors are immutable" (also in a plain
    # jvp(grad(f))), so the exact routes warn and take reverse-over-reverse products (docs/hessian.md: backend="auto").
    # The spatial mean couples positions, so C.3.1 is not the exact Z diagonal here, but h_j itself is exact.
    net, x, y = chain
    Ks = [len(m.ops) for m in net.layers]
    z = torch.cat([F.softmax(a, -1) for a in net.alphas]).detach()
    Hz, gz = dense(lambda v: F.mse_loss(net(x, list(torch.split(v, Ks))), y), z)
    Ha, _ = dense(lambda v: F.mse_loss(net(x, [F.softmax(a, -1) for a in torch.split(v, Ks)]), y),
                  torch.cat([a.detach() for a in net.alphas]))
    edges = net.edges()
    for wrt, H in (("Z", Hz), ("alpha", Ha)):
        got = torch.cat(list(arch_diag_hessian(net, F.mse_loss, x, y, edges, mode="exact", wrt=wrt).values()))
        assert rel(got, H.diagonal()) < 1e-12, wrt
    got = torch.cat(list(alpha_diag_hessian(net, F.mse_loss, x, y, params=list(net.alphas)).values()))
    assert rel(got, Ha.diagonal()) < 1e-12

    # own C.3.1 / C.3.2 on the last layer, h_j the exact diagonal at its output (constant per channel here, checked)
    last, K = net.layers[-1], Ks[-1]
    seen = {}
    handle = last.register_forward_hook(lambda m, i, o: seen.__setitem__("x", i[0].detach()))
    net(x)
    handle.remove()
    B = torch.stack([op(seen["x"]) for op in last.ops], -1).detach()  # (N, C, H, W, K): the B_k of C.3
    out = (B * z[-K:]).sum(-1)
    Ho, _ = dense(lambda v: F.mse_loss(net.lin(net.bn(v.view_as(out)).mean((2, 3))), y), out.reshape(-1))
    h = Ho.diagonal().view_as(out)
    assert float((h - h.mean((0, 2, 3), keepdim=True)).abs().max()) <= 1e-14 * float(h.abs().max())
    c31 = (B ** 2 * h.unsqueeze(-1)).sum((0, 1, 2, 3))
    c32 = ((B ** 2).sum((0, 2, 3)) * h.mean((0, 2, 3)).unsqueeze(-1)).sum(0)
    for mode, mine in (("diag", c31), ("approx", c32)):
        got_z = arch_diag_hessian(net, F.mse_loss, x, y, edges, mode=mode)["l2"]
        got_a = arch_diag_hessian(net, F.mse_loss, x, y, edges, mode=mode, wrt="alpha")["l2"]
        assert rel(got_z, mine) < 1e-12, mode
        assert rel(got_a, own_softmax_chain(z[-K:], gz[-K:], mine)) < 1e-12, mode


@pytest.mark.filterwarnings("ignore:torch.func products are not usable:RuntimeWarning")
def test_float32_chain_is_float64_to_float32_round_off_in_every_mode_and_float64_loses_nothing(chain):
    # relative to the largest entry; float32 measured ≤ 3e-7 (1e-4 is the float32 round-off bound of the audit); that
    # the float64 run passes through no float32 step is the 1e-12 agreement with the dense float64 references above
    net, x, y = chain
    net32 = copy.deepcopy(net).float()
    edges, edges32 = net.edges(), net32.edges()
    for mode in ("exact", "ggn", "hutchinson:2", "diag", "approx"):
        kw = {"seed": 1} if mode.startswith("hutchinson") else {}
        for wrt in ("Z", "alpha"):
            ref = torch.cat(list(arch_diag_hessian(net, F.mse_loss, x, y, edges, mode=mode, wrt=wrt, **kw).values()))
            got = arch_diag_hessian(net32, F.mse_loss, x.float(), y.float(), edges32, mode=mode, wrt=wrt, **kw)
            assert all(v.dtype == torch.float32 for v in got.values()) and ref.dtype == DT
            assert rel(torch.cat(list(got.values())).double(), ref) < 1e-4, (mode, wrt)
    ev = hessian_eigenvalues(net, F.mse_loss, x, y, k=2, params=list(net.alphas)).eigenvalues
    ev32 = hessian_eigenvalues(net32, F.mse_loss, x.float(), y.float(), k=2, params=list(net32.alphas)).eigenvalues
    assert rel(torch.as_tensor(ev32, dtype=DT), torch.as_tensor(ev, dtype=DT)) < 1e-4


# -- a DARTS cell whose weights come as a list, one (K,) per edge; two cells share α; train-mode BN -------------------


def darts_ops(C):
    return [nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C, affine=False)),
            nn.MaxPool2d(3, 1, 1), nn.Identity(),
            nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 1, bias=False), nn.BatchNorm2d(C, affine=False))]


class DartsCell(nn.Module):
    def __init__(self, C, steps=2):
        super().__init__()
        self.steps = steps
        self.pre0 = nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 1, bias=False), nn.BatchNorm2d(C, affine=False))
        self.pre1 = nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 1, bias=False), nn.BatchNorm2d(C, affine=False))
        self.edges = nn.ModuleList([Mixed(darts_ops(C)) for i in range(steps) for _ in range(2 + i)])
        self.post = nn.Conv2d(steps * C, C, 1)

    def forward(self, s0, s1, weights):  # weights: a list, one (K,) tensor per edge
        states, offset = [self.pre0(s0), self.pre1(s1)], 0
        for _ in range(self.steps):
            states.append(sum(self.edges[offset + j](h, weights[offset + j]) for j, h in enumerate(states)))
            offset += len(states) - 1
        return self.post(torch.cat(states[2:], 1))


class DartsNet(nn.Module):
    def __init__(self, C=2, cells=2):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, C, 3, padding=1, bias=False), nn.BatchNorm2d(C))
        self.cells = nn.ModuleList([DartsCell(C) for _ in range(cells)])
        self.alphas_normal = nn.Parameter(0.8 * torch.randn(len(self.cells[0].edges), 4))
        self.fc = nn.Linear(C, 3)

    def arch_parameters(self):
        return [self.alphas_normal]

    def forward(self, x, weights=None):
        weights = list(F.softmax(self.alphas_normal, -1)) if weights is None else weights
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1, weights)
        return self.fc(s1.mean((2, 3)))


def test_darts_cells_with_list_weights_sharing_alpha_under_train_bn_diagonal_and_spectrum_are_the_dense_ones():
    torch.manual_seed(0)
    net = DartsNet().double()
    x, y = torch.randn(4, 1, 5, 5, dtype=DT), torch.randint(0, 3, (4,))
    state = copy.deepcopy(net.state_dict())
    a0 = net.alphas_normal.detach()
    H, _ = dense(lambda a: F.cross_entropy(net(x, list(F.softmax(a.view_as(a0), -1))), y), a0.reshape(-1))
    net.load_state_dict(state)  # the reference ran train-mode BN with running statistics on
    assert float((H - H.T).abs().max()) <= 1e-12 * float(H.abs().max())

    got = alpha_diag_hessian(net, F.cross_entropy, x, y)["alphas_normal"]
    assert got.shape == a0.shape and rel(got.reshape(-1), H.diagonal()) < 1e-10
    ev = torch.linalg.eigvalsh(H)
    res = hessian_eigenvalues(net, F.cross_entropy, x, y, k=3)
    scale = float(ev.abs().max())
    assert float((torch.as_tensor(res.eigenvalues, dtype=DT) - ev[-3:].flip(0)).abs().max()) <= 1e-8 * scale
    assert abs(res.largest_magnitude - float(ev[ev.abs().argmax()])) <= 1e-8 * scale
    assert abs(res.largest_algebraic - float(ev[-1])) <= 1e-8 * scale
    edges = {f"c{c}e{e}": (m, list(m.ops)) for c, cell in enumerate(net.cells) for e, m in enumerate(cell.edges)}
    with pytest.raises(CurvatureError, match="shared α") as err:
        arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="exact", wrt="alpha")
    assert "\n" not in str(err.value)
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())  # running statistics untouched


def test_probe_hessian_in_a_users_summed_loss_loop_is_arch_diag_hessian_of_the_attach_loss_on_that_batch():
    # the user's loop backwards a *summed* cross-entropy; with the default loss_fn the labels are recovered from it
    # and the curvature is of the batch mean (docs: "batch convention of loss_fn"); with loss_fn= given, of that loss
    torch.manual_seed(1)
    net = DartsNet().double()
    x, y = torch.randn(4, 1, 5, 5, dtype=DT), torch.randint(0, 3, (4,))
    edges = {f"c{c}e{e}": (m, list(m.ops)) for c, cell in enumerate(net.cells) for e, m in enumerate(cell.edges)}

    def summed(o, t):
        return F.cross_entropy(o, t, reduction="sum")

    for loss_fn in (None, summed):
        probe = nasdiag.attach(net, edges, hessian="diag", **({} if loss_fn is None else {"loss_fn": loss_fn}))
        with probe.record(**({} if loss_fn is None else {"targets": y})):
            summed(net(x), y).backward()
        net.zero_grad(set_to_none=True)
        state = copy.deepcopy(net.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = probe.hessian(wrt="Z")
            ref = arch_diag_hessian(net, loss_fn or F.cross_entropy, x, y, edges, mode="diag")
        assert list(got) == list(ref)
        assert all(torch.equal(got[k], ref[k]) for k in ref)
        assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    mean = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="diag")
    assert all(torch.allclose(ref[k], 4 * mean[k], rtol=1e-12, atol=0) for k in ref)  # sum = B · mean
