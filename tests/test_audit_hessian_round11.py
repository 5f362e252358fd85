"""Round-11 audit of the curvature side (nasdiag.hessian) against the auditor's own float64 references.

References, all written here from scratch: a NAS-Bench-201-like supernet (every node reads all earlier nodes, an op
list per edge: identity/zero/pooling only, K = 1, train-mode BatchNorm inside candidates, the cell output a sum, α in
an ``nn.ParameterList`` of a separate module, flat per cell and split per edge), dense reverse-over-reverse autograd
Hessians (never ``torch.func.hessian`` through train-mode BN, docs/hessian.md), ``torch.linalg.eigvalsh``, the softmax
chain rule of docs/hessian.md "α" written out by hand, and a Gauss-Newton matrix ``Jᵀ H_out J`` from autograd Jacobians.

Defect found (fixed in nasdiag/hessian/arch.py): ``diag``/``approx`` pair the k-th *listed* candidate's output B_k
with the k-th mixing weight; candidate ops listed in another order than the mixed op pairs them with its weights
gave silently permuted Z-curvature and wrong α-curvature (the softmax chain mixed the two orders), while ``exact``
and the GGN modes, which read only the weights, were right.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import (CurvatureError, alpha_diag_hessian, arch_diag_hessian, diag_hessian, hessian_eigenvalues,
                             shared_weights_diag_hessian)
from test_audit_hessian_round9 import Mixed  # Σ_k w_k op_k(x) for (K,) or (B, K) weights

DT = torch.float64


class Zero(nn.Module):
    def forward(self, x):
        return x * 0.0


def conv_bn(C, k=3, affine=False, norm=None):
    """ReLU-conv-norm; ``norm(C, affine)`` replaces the BatchNorm."""
    return nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, k, padding=k // 2, bias=False),
                         (norm or (lambda c, a: nn.BatchNorm2d(c, affine=a)))(C, affine))


def op_lists(C, norm=None):
    return [
        [nn.Identity(), Zero(), nn.AvgPool2d(3, 1, 1, count_include_pad=False)],  # parameter-free ops only
        [conv_bn(C, 1, norm=norm), nn.Identity()],
        [conv_bn(C, 3, norm=norm)],  # K = 1
        [conv_bn(C, 3, norm=norm), nn.MaxPool2d(3, 1, 1), Zero(), nn.Identity()],
        [nn.Identity(), conv_bn(C, 1, affine=True, norm=norm)],
        [nn.AvgPool2d(3, 1, 1), conv_bn(C, 3, norm=norm), nn.Identity()],
    ]


PAIRS = [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]  # NB-201: node j reads every node i < j


class Cell(nn.Module):
    def __init__(self, C, norm=None):
        super().__init__()
        self.edges = nn.ModuleList([Mixed(ops) for ops in op_lists(C, norm)])

    def forward(self, x, ws):
        nodes = [x]
        for j in range(1, 4):
            nodes.append(sum(self.edges[e](nodes[i], ws[e]) for e, (i, jj) in enumerate(PAIRS) if jj == j))
        return nodes[1] + nodes[2] + nodes[3]  # a sum, not a concat


class Arch(nn.Module):
    """α in a separate module: one flat vector per cell (or one shared by all), split per edge."""

    def __init__(self, Ks, shared, cells):
        super().__init__()
        self.Ks = Ks
        self.alphas = nn.ParameterList([nn.Parameter(0.5 * torch.randn(sum(Ks), dtype=DT))
                                        for _ in range(1 if shared else cells)])

    def per_cell(self, c):
        return list(torch.split(self.alphas[0 if len(self.alphas) == 1 else c], self.Ks))


class Net(nn.Module):
    def __init__(self, C=3, cells=2, shared=True, ncls=4, norm=None):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, C, 3, padding=1), nn.BatchNorm2d(C))
        self.cells = nn.ModuleList([Cell(C, norm) for _ in range(cells)])
        self.arch = Arch([len(o) for o in op_lists(C)], shared, cells)
        self.head = nn.Linear(C, ncls)
        self.double()

    def arch_parameters(self):
        return list(self.arch.parameters())

    def forward(self, x, Z=None):
        h = self.stem(x)
        for c, cell in enumerate(self.cells):
            h = cell(h, [F.softmax(a, -1) for a in self.arch.per_cell(c)] if Z is None else Z[c])
        return self.head(h.mean((2, 3)))

    def edges(self):
        return {f"c{c}e{e}": (m, list(m.ops)) for c, cell in enumerate(self.cells) for e, m in enumerate(cell.edges)}


def dense_hessian(f, at):
    """Reverse-over-reverse: one create_graph backward, then one backward per entry."""
    at = at.detach().clone().requires_grad_(True)
    g = torch.autograd.grad(f(at), at, create_graph=True)[0]
    rows = [torch.autograd.grad(g[i], at, retain_graph=True, allow_unused=True)[0] if g[i].requires_grad else None
            for i in range(at.numel())]
    H = torch.stack([torch.zeros_like(at) if r is None else r for r in rows])
    return H.detach(), g.detach()


def frozen(model):
    """State dict, hooks and .grad, to tell that a call left nothing behind."""
    return ({k: v.clone() for k, v in model.state_dict().items()},
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()),
            [p.grad for p in model.parameters()])


def unchanged(model, before):
    state, hooks, grads = before
    now = model.state_dict()
    return (all(torch.equal(state[k], now[k]) for k in state) and hooks == frozen(model)[1]
            and all(g is None for g in grads) and all(p.grad is None for p in model.parameters()))


def setup(cells, shared, seed=0, batch=5, size=4):
    torch.manual_seed(seed)
    net = Net(C=3, cells=cells, shared=shared)
    x = torch.randn(batch, 1, size, size, dtype=DT)
    y = torch.randint(0, 4, (batch,))
    return net, x, y


def own_z_loss(net, x, y, cells):
    """The loss as a function of every cell's Z, each cell its own leaf (flat)."""
    Ks = net.arch.Ks

    def f(flat):
        parts = torch.split(flat, sum(Ks))
        return F.cross_entropy(net(x, [list(torch.split(p, Ks)) for p in parts]), y)

    with torch.no_grad():
        z = torch.cat([torch.cat([F.softmax(a, -1) for a in net.arch.per_cell(c)]) for c in range(cells)])
    return f, z


def own_softmax_chain(z, g, h_zdiag):
    """docs/hessian.md "α": Σ_i J_ik² H_Z,i + Σ_i g_i ∂²Z_i/∂α_k², J = diag(Z) − ZZᵀ, written out per entry."""
    K = z.numel()
    out = torch.zeros(K, dtype=z.dtype)
    for k in range(K):
        for i in range(K):
            J = z[i] * (float(i == k) - z[k])
            second = z[i] * (float(i == k) - z[k]) ** 2 - z[i] * z[k] * (1 - z[k])
            out[k] += J * J * h_zdiag[i] + g[i] * second
    return out


def test_nb201_like_supernet_exact_z_and_alpha_and_every_modes_chain_rule_against_own_references():
    """Own α per cell (no sharing): `exact` w.r.t. Z and α and `exact_per_edge` w.r.t. α equal the dense Hessian
    diagonal (1e-10 of its largest entry, float64 round-off); for every cheap mode, `wrt='alpha'` is the hand-written
    softmax chain of its own `wrt='Z'` diagonal with the exact gradient (1e-12). K = 1 edges get exactly 0 w.r.t. α
    (softmax of one logit is constant). The calls leave no state, hooks or .grad behind and repeat bitwise."""
    cells = 2
    net, x, y = setup(cells, shared=False)
    Ks = net.arch.Ks
    before = frozen(net)

    def alpha_loss(flat):
        parts = torch.split(flat, sum(Ks))
        return F.cross_entropy(net(x, [[F.softmax(a, -1) for a in torch.split(p, Ks)] for p in parts]), y)

    f_z, z = own_z_loss(net, x, y, cells)
    Ha, _ = dense_hessian(alpha_loss, torch.cat([a.detach() for a in net.arch.alphas]))
    Hz, gz = dense_hessian(f_z, z)
    net.load_state_dict(before[0])  # the references ran train-mode BN with running statistics on
    before = frozen(net)
    assert (Ha - Ha.T).abs().max() <= 1e-12 * Ha.abs().max()

    edges = net.edges()
    got_z = torch.cat(list(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="exact").values()))
    assert (got_z - Hz.diagonal()).abs().max() <= 1e-10 * Hz.diagonal().abs().max()
    for mode in ("exact", "exact_per_edge"):  # α owned per cell: `exact` does not refuse
        got = torch.cat(list(arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt="alpha").values()))
        assert (got - Ha.diagonal()).abs().max() <= 1e-10 * Ha.diagonal().abs().max(), mode
    k1 = [sum(Ks) * c + sum(Ks[:2]) for c in range(cells)]  # the K = 1 edge of each cell
    assert bool((Ha.diagonal()[k1] == 0).all())

    # hutchinson:<k> probes α itself since round 12 (unbiased for the α diagonal, not the chain of its Z diagonal):
    # tests/test_audit_hessian_round12.py
    for mode in ("diag", "approx", "ggn", "ggn_mc"):
        hz = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode)
        ha = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt="alpha")
        again = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt="alpha")
        offsets = torch.cumsum(torch.tensor([0] + [len(h) for h in hz.values()]), 0)
        for i, name in enumerate(hz):
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            mine = own_softmax_chain(z[lo:hi], gz[lo:hi], hz[name])
            assert torch.allclose(ha[name], mine, rtol=0, atol=1e-12), (mode, name)
            assert torch.equal(ha[name], again[name]), (mode, name)
        assert float(torch.cat([ha[n] for n in ha if n.endswith("e2")]).abs().max()) == 0.0
    assert unchanged(net, before)


@pytest.mark.parametrize("cells", [2, 3])
def test_shared_alpha_and_shared_z_diagonals_and_spectrum_of_a_sum_cell_supernet_under_train_bn(cells):
    """One α (a flat vector in a ParameterList of a separate module) shared by 2 and 3 NB-201-like cells with
    train-mode BN: `alpha_diag_hessian` and `shared_weights_diag_hessian` equal the dense reverse-over-reverse
    diagonals, `hessian_eigenvalues` the eigvalsh spectrum (largest algebraic, signed largest magnitude, top 2),
    `exact` w.r.t. α refuses the shared α in one line; running statistics, hooks and .grad unchanged."""
    net, x, y = setup(cells, shared=True, seed=cells)
    Ks = net.arch.Ks
    before = frozen(net)

    def alpha_loss(a):
        return F.cross_entropy(net(x, [[F.softmax(p, -1) for p in torch.split(a, Ks)]] * cells), y)

    H, _ = dense_hessian(alpha_loss, net.arch.alphas[0])

    class AtZ(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, inputs, weights):
            return self.net(inputs, [list(torch.split(weights["z"], Ks))] * cells)

    wrapped = AtZ()
    with torch.no_grad():
        z = torch.cat([F.softmax(p, -1) for p in torch.split(net.arch.alphas[0], Ks)])
    Hz, _ = dense_hessian(lambda v: F.cross_entropy(wrapped(x, {"z": v}), y), z)
    net.load_state_dict(before[0])
    before = frozen(net)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the K = 1 entry and the Zero ops: exactly flat, named
        got = alpha_diag_hessian(net, F.cross_entropy, x, y)
        got_z = shared_weights_diag_hessian(wrapped, F.cross_entropy, x, y, {"z": z})
    assert list(got) == ["arch.alphas.0"]
    assert (got["arch.alphas.0"] - H.diagonal()).abs().max() <= 1e-10 * H.diagonal().abs().max()
    assert (got_z["z"] - Hz.diagonal()).abs().max() <= 1e-10 * Hz.diagonal().abs().max()

    ev = torch.linalg.eigvalsh(H)
    res = hessian_eigenvalues(net, F.cross_entropy, x, y, k=2)
    scale = float(ev.abs().max())
    assert abs(res.largest_algebraic - float(ev[-1])) <= 1e-8 * scale
    assert abs(res.largest_magnitude - float(ev[ev.abs().argmax()])) <= 1e-8 * scale
    assert torch.allclose(torch.as_tensor(res.eigenvalues, dtype=DT), ev[-2:].flip(0), rtol=0, atol=1e-8 * scale)
    with pytest.raises(CurvatureError, match="shared α") as err:
        arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact", wrt="alpha")
    assert "\n" not in str(err.value)
    assert unchanged(net, before)


def test_ggn_hutchinson_and_exact_equal_own_gauss_newton_in_eval_mode_and_alpha_glue_sums_the_cells():
    """Eval-mode BN and piecewise-linear ops: the Z-curvature is the Gauss-Newton matrix on the diagonal (docs),
    so `ggn`, `hutchinson:2` and `exact` equal the diagonal of own `Jᵀ H_out J` (autograd Jacobian of the logits
    w.r.t. every cell's Z, dense output Hessian of the loss) to 1e-12 relative. And (train mode)
    `diag_hessian(params=[α])` in mode `diag` is the per-cell sum of `arch_diag_hessian(wrt='alpha', mode='diag')`
    (docs/hessian.md "α"), for α in a ParameterList of a separate module."""
    cells = 2
    net, x, y = setup(cells, shared=True, seed=3)
    a = diag_hessian(net, F.cross_entropy, x, y, mode="diag", params=["arch.alphas.0"])["arch.alphas.0"]
    per_edge = arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="diag", wrt="alpha")
    summed = torch.stack([torch.cat([per_edge[f"c{c}e{e}"] for e in range(6)]) for c in range(cells)]).sum(0)
    assert (a - summed).abs().max() <= 1e-12 * summed.abs().max()

    net.eval()
    f_z, z = own_z_loss(net, x, y, cells)
    Ks = net.arch.Ks

    def logits(flat):
        return net(x, [list(torch.split(p, Ks)) for p in torch.split(flat, sum(Ks))])

    J = torch.autograd.functional.jacobian(logits, z)  # (B, classes, N)
    H_out = torch.autograd.functional.hessian(lambda o: F.cross_entropy(o, y), logits(z).detach())
    G = torch.einsum("bin,bicj,cjm->nm", J, H_out, J).diagonal()
    for mode in ("ggn", "hutchinson:2", "exact"):
        got = torch.cat(list(arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode=mode).values()))
        assert (got - G).abs().max() <= 1e-12 * G.abs().max(), mode


CANDIDATE_NORMS = {
    "batchnorm_eval": lambda C, affine: nn.BatchNorm2d(C, affine=affine),
    "none": lambda C, affine: nn.Identity(),
    "instancenorm": lambda C, affine: nn.InstanceNorm2d(C, affine=affine),
    "layernorm_as_groupnorm": lambda C, affine: nn.GroupNorm(1, C, affine=affine),
}


@pytest.mark.parametrize("norm", sorted(CANDIDATE_NORMS))
def test_without_sample_coupling_ggn_is_own_gauss_newton_and_exact_only_where_the_net_is_piecewise_linear(norm):
    """docs/hessian.md said that with BatchNorm in eval mode "(or LayerNorm/InstanceNorm, or none)" and piecewise-
    linear ops `ggn` equals `exact` and `hutchinson:<k>` is exact for any k. Per-sample normalizations couple no
    samples, so `ggn` is the Gauss-Newton diagonal there too (own `Jᵀ H_out J`, 1e-12), but they are not linear in
    their input: their residual `Σ g ∂²f/∂Z²` stays, and `exact` (= own dense diagonal) is > 1% away from it.
    With eval-mode BN or no norm, ggn = exact = own Gauss-Newton (1e-12)."""
    torch.manual_seed(12)
    net = Net(C=3, cells=1, shared=True, norm=CANDIDATE_NORMS[norm])
    with torch.no_grad():  # running statistics that are not the initial ones
        net(torch.randn(8, 1, 4, 4, dtype=DT))
    net.eval()
    x, y = torch.randn(5, 1, 4, 4, dtype=DT), torch.randint(0, 4, (5,))
    Ks = net.arch.Ks
    with torch.no_grad():
        z = torch.cat([F.softmax(a, -1) for a in net.arch.per_cell(0)])

    def logits(v):
        return net(x, [list(torch.split(v, Ks))])

    J = torch.autograd.functional.jacobian(logits, z)
    H_out = torch.autograd.functional.hessian(lambda o: F.cross_entropy(o, y), logits(z).detach())
    G = torch.einsum("bin,bicj,cjm->nm", J, H_out, J).diagonal()
    H, _ = dense_hessian(lambda v: F.cross_entropy(logits(v), y), z)
    ggn = torch.cat(list(arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="ggn").values()))
    exact = torch.cat(list(arch_diag_hessian(net, F.cross_entropy, x, y, net.edges(), mode="exact").values()))
    assert (ggn - G).abs().max() <= 1e-12 * G.abs().max()
    assert (exact - H.diagonal()).abs().max() <= 1e-10 * H.diagonal().abs().max()
    apart = float((exact - ggn).norm() / exact.norm())
    if norm in ("batchnorm_eval", "none"):
        assert apart <= 1e-12
    else:
        assert apart > 1e-2


NORMS = {
    "batchnorm": lambda C: nn.BatchNorm2d(C),
    "batchnorm_untracked_in_eval": lambda C: nn.BatchNorm2d(C, track_running_stats=False),
    "batchnorm_momentum_none": lambda C: nn.BatchNorm2d(C, momentum=None),
    "batchnorm_no_affine": lambda C: nn.BatchNorm2d(C, affine=False),
    "instancenorm_affine": lambda C: nn.InstanceNorm2d(C, affine=True),
    "instancenorm": lambda C: nn.InstanceNorm2d(C),
    "groupnorm_per_channel": lambda C: nn.GroupNorm(C, C),
    "groupnorm_per_channel_no_affine": lambda C: nn.GroupNorm(C, C, affine=False),
    "layernorm_spatial": lambda C: nn.LayerNorm([5, 5]),
    "layernorm_spatial_no_affine": lambda C: nn.LayerNorm([5, 5], elementwise_affine=False),
    "layernorm_spatial_no_bias": lambda C: nn.LayerNorm([5, 5], bias=False),
}


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_a_bias_the_next_normalization_removes_has_zero_curvature_in_every_weight_mode(norm):
    """A conv bias followed by a normalization whose groups it is constant on: the loss does not depend on it
    (own check: its autograd gradient is round-off), `diag`/`approx` report exactly 0 (docs/hessian.md "Biases a
    normalization removes"), `exact` and `hutchinson:2` round-off (≤ 1e-12 of the largest entry of the net);
    BN with track_running_stats=False also in eval mode (it normalizes with the batch statistics there)."""
    torch.manual_seed(7)
    C = 3
    net = nn.Sequential(nn.Conv2d(2, C, 3, padding=1), NORMS[norm](C), nn.Tanh(), nn.Conv2d(C, C, 3), nn.Flatten(),
                        nn.Linear(C * 9, 3)).double()
    if norm == "batchnorm_untracked_in_eval":
        net.eval()
    x, y = torch.randn(4, 2, 5, 5, dtype=DT), torch.randint(0, 3, (4,))
    before = frozen(net)
    g = torch.autograd.grad(F.cross_entropy(net(x), y), net[0].bias)[0]
    scale = max(float(p.abs().max()) for p in diag_hessian(net, F.cross_entropy, x, y, mode="exact").values())
    assert float(g.abs().max()) <= 1e-12 and scale > 1e-3
    for mode in ("diag", "approx", "exact", "hutchinson:2"):
        h = diag_hessian(net, F.cross_entropy, x, y, mode=mode, params=["0.bias"])["0.bias"]
        if mode in ("diag", "approx"):
            assert bool((h == 0).all()), (mode, h)
        else:
            assert float(h.abs().max()) <= 1e-12 * scale, (mode, h)
    net.load_state_dict(before[0])


COPY_PADS = {
    "reflection2d": lambda: nn.ReflectionPad2d(1),
    "replication2d": lambda: nn.ReplicationPad2d((1, 2, 0, 1)),
    "reflection_then_conv": lambda: nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(3, 3, 3)),
}


@pytest.mark.parametrize("pad", sorted(COPY_PADS))
def test_a_bias_before_reflect_or_replicate_padding_and_a_batch_norm_is_removed_and_zero(pad):
    """docs/hessian.md lists reflect/replicate padding among what carries a bias into a normalization that removes
    it; the padding *modules* had no homogeneity rule, so `diag`/`approx` kept the recursion's value (0.25 where
    the own gradient and `exact` are round-off). Now exactly 0, and an op padding by reflection before a conv and BN
    is scale-invariant (own check: f(c·x) = f(x) for c = 3 and 0.1, train-mode BN)."""
    from nasdiag.cost import is_scale_invariant

    torch.manual_seed(13)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), COPY_PADS[pad](), nn.BatchNorm2d(3), nn.Tanh(),
                        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(12, 3)).double()
    x, y = torch.randn(4, 2, 6, 6, dtype=DT), torch.randint(0, 3, (4,))
    before = frozen(net)
    g = torch.autograd.grad(F.cross_entropy(net(x), y), net[0].bias)[0]
    assert float(g.abs().max()) <= 1e-12
    scale = max(float(h.abs().max()) for h in diag_hessian(net, F.cross_entropy, x, y, mode="exact").values())
    assert float(diag_hessian(net, F.cross_entropy, x, y, mode="exact", params=["0.bias"])["0.bias"].abs().max()) <= 1e-12 * scale
    for mode in ("diag", "approx"):
        assert bool((diag_hessian(net, F.cross_entropy, x, y, mode=mode, params=["0.bias"])["0.bias"] == 0).all()), mode
    net.load_state_dict(before[0])
    # eps of BN tiny: the invariance holds as eps → 0 (is_scale_invariant's contract)
    op = nn.Sequential(nn.ReLU(), COPY_PADS[pad](), nn.Conv2d(3, 3, 3, bias=True), nn.BatchNorm2d(3, eps=1e-14)).double()
    h = torch.randn(4, 3, 6, 6, dtype=DT)
    with torch.no_grad():
        out = op(h)
        assert all(torch.allclose(op(c * h), out, rtol=0, atol=1e-8) for c in (3.0, 0.1))
    assert is_scale_invariant(op, h)


def test_ops_listed_in_another_order_than_the_mixed_op_pairs_them_are_refused_not_permuted_silently():
    """`diag`/`approx` take B_k from the k-th *listed* candidate op and pair it with the k-th weight. Listed in
    another order (here reversed) than the mixed op mixes them, the Z-curvature came out permuted against `exact`
    and the α-curvature wrong (the softmax chain mixed the weights' order with the listing's), silently; `exact`
    and `ggn`, which read only the weights, were right. Now one CurvatureError line naming the edge, nothing left
    behind; in order, `diag` w.r.t. α is own chain rule of its Z numbers, and a NaN batch stays NaN, not refused."""
    net, x, y = setup(1, shared=True, seed=5)
    edges = net.edges()
    reversed_ops = {n: (m, list(reversed(ops))) for n, (m, ops) in edges.items()}
    exact = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode="exact")
    assert torch.equal(exact["c0e3"], arch_diag_hessian(net, F.cross_entropy, x, y, reversed_ops, mode="exact")["c0e3"])
    before = frozen(net)
    for mode in ("diag", "approx"):
        for wrt in ("Z", "alpha"):
            with pytest.raises(CurvatureError, match="c0e0.*as listed.*order") as err:
                arch_diag_hessian(net, F.cross_entropy, x, y, reversed_ops, mode=mode, wrt=wrt)
            assert "\n" not in str(err.value)
            assert unchanged(net, before)
    # in order: accepted (the sum of the listed ops is the output, to round-off)
    for mode in ("diag", "approx"):
        arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, wrt="alpha")
    net32 = copy.deepcopy(net).float()  # float32: checked to 1e-2 of the terms (TF32 mixes on a GPU), still refused
    edges32 = net32.edges()
    with pytest.raises(CurvatureError, match="c0e0.*as listed"):
        arch_diag_hessian(net32, F.cross_entropy, x.float(), y, {n: (m, ops[::-1]) for n, (m, ops) in edges32.items()},
                          mode="diag")
    arch_diag_hessian(net32, F.cross_entropy, x.float(), y, edges32, mode="diag")
    x_nan = x.clone()
    x_nan[0, 0, 0, 0] = float("nan")
    nan = arch_diag_hessian(net, F.cross_entropy, x_nan, y, edges, mode="diag")
    assert bool(torch.isnan(nan["c0e3"]).any())
    assert unchanged(net, before)


class NormalizedMix(nn.Module):
    """A mixed op that normalizes its sum: ∂out/∂Z_k is not ops[k](x), so the recursions' B_k would be wrong."""

    def __init__(self, C):
        super().__init__()
        self.ops = nn.ModuleList([nn.Conv2d(C, C, 1, bias=False), nn.AvgPool2d(3, 1, 1)])
        self.norm = nn.InstanceNorm2d(C)

    def forward(self, x, weights):
        return self.norm(sum(w * op(x) for w, op in zip(weights, self.ops)))


def test_a_mixed_op_that_changes_its_sum_is_refused_by_the_recursions_and_exact_stays_right():
    """Outside the contract Σ_k w_k ops[k](x): a mixed op that normalizes its sum. `diag` used B_k = ops[k](x) as
    ∂out/∂Z_k (wrong); now refused in one line. `exact` (weights only) equals the own dense Hessian w.r.t. Z."""
    torch.manual_seed(11)
    C = 2
    mix = NormalizedMix(C)
    net = nn.Sequential(nn.Conv2d(1, C, 3, padding=1), mix, nn.Flatten(), nn.Linear(C * 16, 3)).double()
    z = torch.tensor([0.3, 0.7], dtype=DT)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, inputs, weights=z):
            h = self.net[0](inputs)
            return self.net[3](self.net[2](self.net[1](h, weights)))

    model = Model()
    x, y = torch.randn(3, 1, 4, 4, dtype=DT), torch.randint(0, 3, (3,))
    edges = {"e": (mix, list(mix.ops))}
    with pytest.raises(CurvatureError, match="'e'.*not Σ"):
        arch_diag_hessian(model, F.cross_entropy, x, y, edges, mode="diag")
    H, _ = dense_hessian(lambda v: F.cross_entropy(model(x, v), y), z)
    got = arch_diag_hessian(model, F.cross_entropy, x, y, edges, mode="exact")["e"]
    assert (got - H.diagonal()).abs().max() <= 1e-10 * H.diagonal().abs().max()
