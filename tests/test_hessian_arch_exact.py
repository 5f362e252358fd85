"""exact_arch_diag_hessian against dense autograd Hessians of the loss as a function of per-cell Z (or α)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from nasdiag.hessian.arch_exact import _edge_blocks, exact_arch_diag_hessian
from nasdiag.supernet import Network

# small but varied: a zero op, a parameter-free identity, a non-smooth pool and a conv stack with a norm
PRIMS = ["none", "skip_connect", "max_pool_3x3", "dil_conv_3x3"]


def tiny_net(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("primitives", PRIMS)
    return Network.minimal(2, 3, 2, in_channels=1, reductions=[1], **kw).double()


def batch(seed=1, B=3, S=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, S, S, dtype=torch.float64, generator=g), torch.randint(0, 3, (B,), generator=g)


class PerCell(nn.Module):
    """``net(x, weights=<one (E, K) tensor per cell>)`` with the per-cell weights held fixed."""

    def __init__(self, net, weights):
        super().__init__()
        self.net = net
        self.weights = weights

    def forward(self, x):
        return self.net(x, weights=list(self.weights))


def edges_of(net):
    return {s.name: (s.module, s.ops) for s in net.edge_specs()}


def dense_per_cell_hessian(net, x, y, leaves, to_weights=lambda t: t):
    """∂²L/∂T² with one leaf T_c (E, K) per cell, as an (N, N) matrix over cat(T_c.flatten())."""

    def loss(*per_cell):
        return F.cross_entropy(net(x, weights=[to_weights(t) for t in per_cell]), y)

    blocks = torch.autograd.functional.hessian(loss, tuple(leaves))
    n = [t.numel() for t in leaves]
    return torch.cat([torch.cat([blocks[i][j].reshape(n[i], n[j]) for j in range(len(n))], 1) for i in range(len(n))])


def stack_result(net, result):
    """{edge name: (K,)} -> (N,) in (cell, edge, op) order, matching dense_per_cell_hessian."""
    return torch.cat([result[s.name] for s in net.edge_specs()])


@pytest.fixture(scope="module")
def default_reference():
    """The default tiny net (relu-conv-bn, BatchNorm in train mode) at Z = softmax(α), with its dense
    per-cell Z Hessian; computed once, shared by the tests below."""
    net = tiny_net(seed=3)
    x, y = batch(seed=4)
    Z = [torch.softmax(getattr(net, f"alphas_{c.cell_type}").detach(), -1) for c in net.cells]
    return net, x, y, dense_per_cell_hessian(net, x, y, Z)


def test_default_forward_equals_autograd_per_cell(default_reference):
    # model(x) with its own softmax(α), shared by cells of a type: each cell's edges still get their own δ_e
    net, x, y, H = default_reference
    got = exact_arch_diag_hessian(net, F.cross_entropy, x, y, edges_of(net))
    assert list(got) == [s.name for s in net.edge_specs()]
    from_specs = exact_arch_diag_hessian(net, F.cross_entropy, x, y, net.edge_specs())  # list of EdgeSpec
    torch.testing.assert_close(from_specs, got, rtol=0, atol=0)
    assert all(v.shape == (len(PRIMS),) and v.dtype == torch.float64 for v in got.values())
    torch.testing.assert_close(stack_result(net, got), H.diagonal(), rtol=1e-8, atol=1e-12)
    assert H.diagonal().abs().max() > 1e-3  # the comparison is not between zeros


def test_summing_basis_vectors_across_edges_is_not_the_diagonal(default_reference):
    # Why exact mode pays one HVP per (edge, op): one HVP per op index over all edges picks up
    # cross-edge terms. Checked on the dense reference, independently of the implementation.
    _, _, _, H = default_reference
    K = len(PRIMS)
    op_index = torch.arange(H.shape[0]) % K
    merged = torch.stack([H @ (op_index == k).double() for k in range(K)])  # (K, N)
    merged_diag = merged.gather(0, op_index[None]).squeeze(0)
    assert (merged_diag - H.diagonal()).abs().max() > 1e-3 * H.diagonal().abs().max()


# GroupNorm's double backward has no working vmap rule in some torch versions: the one-at-a-time
# fallback then runs, with a warning (same numbers, which is what this test checks).
@pytest.mark.filterwarnings("ignore:batched Hessian-vector products failed")
@pytest.mark.parametrize(
    "order, norm, chunk_size, backend",
    [("conv-bn-relu", "batch", 3, "func"), ("relu-conv-bn", "layer", 64, "autograd"), ("conv-relu-bn", "batch", 64, "autograd")],
)
def test_z_diagonal_equals_autograd_at_any_per_cell_weights(order, norm, chunk_size, backend):
    net = tiny_net(order=order, norm=norm)
    x, y = batch()
    g = torch.Generator().manual_seed(2)
    Z = [torch.rand(net.num_edges, len(PRIMS), dtype=torch.float64, generator=g) for _ in net.cells]
    got = exact_arch_diag_hessian(
        PerCell(net, Z), F.cross_entropy, x, y, edges_of(net), chunk_size=chunk_size, backend=backend
    )
    H = dense_per_cell_hessian(net, x, y, Z)
    torch.testing.assert_close(stack_result(net, got), H.diagonal(), rtol=1e-8, atol=1e-12)


def test_alpha_diagonal_equals_autograd_through_softmax():
    net = tiny_net(seed=7)
    x, y = batch(seed=8)
    g = torch.Generator().manual_seed(9)
    alphas = [torch.randn(net.num_edges, len(PRIMS), dtype=torch.float64, generator=g) for _ in net.cells]
    Z = [torch.softmax(a, -1) for a in alphas]

    got = exact_arch_diag_hessian(PerCell(net, Z), F.cross_entropy, x, y, edges_of(net), wrt="alpha")
    H = dense_per_cell_hessian(net, x, y, alphas, to_weights=lambda a: torch.softmax(a, -1))
    torch.testing.assert_close(stack_result(net, got), H.diagonal(), rtol=1e-8, atol=1e-12)
    # the softmax second-derivative term matters: without it the numbers differ
    z_only = exact_arch_diag_hessian(PerCell(net, Z), F.cross_entropy, x, y, edges_of(net))
    assert not torch.allclose(stack_result(net, z_only), H.diagonal(), rtol=1e-3)


def test_out_of_memory_halves_the_chunk_and_blocks_stay_exact():
    g = torch.Generator().manual_seed(19)
    A = torch.randn(9, 9, dtype=torch.float64, generator=g)
    H = A + A.T
    calls = []

    def products(V):  # a device that fits at most 2 products at once
        calls.append(V.shape[0])
        if V.shape[0] > 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return V @ H

    with pytest.warns(RuntimeWarning, match="chunk_size=2"):
        blocks = _edge_blocks(products, [4, 3, 2], 8, torch.float64, "cpu")
    for block, (o, K) in zip(blocks, [(0, 4), (4, 3), (7, 2)]):
        assert torch.equal(block, H[o : o + K, o : o + K])
    assert calls[:3] == [8, 4, 2] and max(calls[2:]) <= 2

    def always_oom(V):
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="backend='autograd'"), pytest.warns(RuntimeWarning):
        _edge_blocks(always_oom, [2, 2], 4, torch.float64, "cpu")

    def broken(V):
        raise RuntimeError("some other failure")

    with pytest.raises(RuntimeError, match="some other failure"):
        _edge_blocks(broken, [2, 2], 4, torch.float64, "cpu")


def test_batchnorm_running_stats_grads_and_hooks_untouched():
    net = tiny_net(seed=10).train()
    x, y = batch(seed=11)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert any("running_mean" in k for k in before)
    exact_arch_diag_hessian(net, F.cross_entropy, x, y, edges_of(net), wrt="alpha")
    after = net.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    for module in net.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    assert all(p.grad is None for p in net.parameters())
    # BN kept train mode: the running stats were updated on scratch copies only, so a second call
    # gives the same (batch-statistics) curvature
    first = exact_arch_diag_hessian(net, F.cross_entropy, x, y, edges_of(net))
    second = exact_arch_diag_hessian(net, F.cross_entropy, x, y, edges_of(net))
    torch.testing.assert_close(first, second, rtol=0, atol=0)


# -- a non-convolutional toy supernet: weights= keyword, per-sample weights, unused edges ---------------


class ToyMixed(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(d, d), nn.Sequential(nn.Linear(d, d), nn.Tanh()), nn.Identity()])

    def forward(self, x, weights):
        return sum(weights[..., k, None] * op(x) for k, op in enumerate(self.ops))


class RunningMean(nn.Module):
    """Identity that updates a buffer in place from its input: torch.func cannot trace that."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x):
        self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x


class ToyNet(nn.Module):
    """h1 = e0(x); h2 = e1(x) + e2(h1); logits = head(tanh(h2)). Mixed ops called with weights=."""

    def __init__(self, d=4, classes=3, with_unused=False, with_running_mean=False, dropout=0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.tracker = RunningMean(d) if with_running_mean else nn.Identity()
        self.e0, self.e1, self.e2 = ToyMixed(d), ToyMixed(d), ToyMixed(d)
        self.head = nn.Linear(d, classes)
        self.unused = ToyMixed(d) if with_unused else None
        self.call_unused = True
        self.Z = None

    def forward(self, x, Z=None):
        Z = self.Z if Z is None else Z
        h1 = self.tracker(self.e0(x, weights=Z[0]))
        h2 = self.e1(x, weights=Z[1]) + self.e2(h1, weights=Z[2])
        if self.unused is not None and self.call_unused:
            self.unused(x, weights=Z[0])  # runs, but the loss never sees it
        return self.head(self.dropout(torch.tanh(h2)))


def toy_edges(net):
    names = ["e0", "e1", "e2"] + (["unused"] if net.unused is not None else [])
    return {n: (getattr(net, n), list(getattr(net, n).ops)) for n in names}


@pytest.mark.parametrize("per_sample", [False, True])
def test_toy_keyword_weights_match_autograd(per_sample):
    torch.manual_seed(12)
    net = ToyNet().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    shape = (5, 3) if per_sample else (3,)
    net.Z = [torch.rand(*shape, dtype=torch.float64) for _ in range(3)]  # any weights, not only softmax
    got = exact_arch_diag_hessian(net, F.cross_entropy, x, y, toy_edges(net))

    # reference: a (3,) shift per edge added to its weights, shared by the batch (the documented meaning)
    def loss(*shifts):
        return F.cross_entropy(net(x, Z=[z + s for z, s in zip(net.Z, shifts)]), y)

    zeros = tuple(torch.zeros(3, dtype=torch.float64) for _ in range(3))
    H = torch.autograd.functional.hessian(loss, zeros)
    for i, name in enumerate(["e0", "e1", "e2"]):
        torch.testing.assert_close(got[name], H[i][i].diagonal(), rtol=1e-8, atol=1e-12)


def test_untraceable_model_falls_back_to_autograd_with_a_warning():
    torch.manual_seed(17)
    net = ToyNet(with_running_mean=True).double()
    net.Z = [torch.rand(3, dtype=torch.float64) for _ in range(3)]
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(RuntimeError):
        exact_arch_diag_hessian(net, F.cross_entropy, x, y, toy_edges(net), backend="func")
    with pytest.warns(RuntimeWarning, match="products are not usable"):
        got = exact_arch_diag_hessian(net, F.cross_entropy, x, y, toy_edges(net))
    assert torch.equal(net.tracker.mean, torch.zeros(4, dtype=torch.float64))  # buffer restored

    def loss(*shifts):
        return F.cross_entropy(net(x, Z=[z + s for z, s in zip(net.Z, shifts)]), y)

    H = torch.autograd.functional.hessian(loss, tuple(torch.zeros(3, dtype=torch.float64) for _ in range(3)))
    for i, name in enumerate(["e0", "e1", "e2"]):
        torch.testing.assert_close(got[name], H[i][i].diagonal(), rtol=1e-8, atol=1e-12)


def test_random_forward_is_never_mixed_across_passes():
    # Dropout: the Hessian is the one of the forward with one dropout mask. torch.func refuses random
    # ops under vmap, so "auto" falls back to one retained graph; g and H then come from that forward.
    torch.manual_seed(20)
    net = ToyNet(dropout=0.5).double().train()
    net.Z = [torch.softmax(torch.randn(3, dtype=torch.float64), -1) for _ in range(3)]
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    with pytest.raises(RuntimeError):
        exact_arch_diag_hessian(net, F.cross_entropy, x, y, toy_edges(net), backend="func")
    torch.manual_seed(21)
    with pytest.warns(RuntimeWarning, match="products are not usable"):
        got = exact_arch_diag_hessian(net, F.cross_entropy, x, y, toy_edges(net), wrt="alpha")
    # reference with the same mask: the fallback's forward draws pass 1's, the one the seed gives (round 9)
    torch.manual_seed(21)
    logits = [z.log() for z in net.Z]

    def loss(*alphas):
        return F.cross_entropy(net(x, Z=[torch.softmax(a, -1) for a in alphas]), y)

    H = torch.autograd.functional.hessian(loss, tuple(logits))
    for i, name in enumerate(["e0", "e1", "e2"]):
        torch.testing.assert_close(got[name], H[i][i].diagonal(), rtol=1e-8, atol=1e-12)


def test_no_grad_context_does_not_matter():
    torch.manual_seed(18)
    net = ToyNet().double()
    net.Z = [torch.rand(3, dtype=torch.float64) for _ in range(3)]
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    expected = exact_arch_diag_hessian(net, F.cross_entropy, x, y, toy_edges(net))
    with torch.no_grad():  # e.g. called from an evaluation loop
        got = exact_arch_diag_hessian(net, F.cross_entropy, x, y, toy_edges(net))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


def test_unused_edge_gets_zeros_and_a_warning():
    torch.manual_seed(13)
    net = ToyNet(with_unused=True).double()
    net.Z = [torch.rand(3, dtype=torch.float64) for _ in range(3)]
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.warns(RuntimeWarning, match="unused"):
        got = exact_arch_diag_hessian(net, F.cross_entropy, x, y, toy_edges(net))
    assert torch.equal(got["unused"], torch.zeros(3, dtype=torch.float64))
    assert got["e1"].abs().max() > 0


# -- bad input ---------------------------------------------------------------------------------------


def test_bad_input_raises_clear_errors():
    net = tiny_net(seed=14)
    x, y = batch()
    edges = edges_of(net)
    stranger = tiny_net(seed=15).cells[0].edges[0]

    with pytest.raises(ValueError, match="not a submodule"):
        exact_arch_diag_hessian(net, F.cross_entropy, x, y, {**edges, "stranger": (stranger, list(stranger.ops))})
    with pytest.raises(ValueError, match="wrt"):
        exact_arch_diag_hessian(net, F.cross_entropy, x, y, edges, wrt="beta")
    with pytest.raises(ValueError, match="backend"):
        exact_arch_diag_hessian(net, F.cross_entropy, x, y, edges, backend="jax")
    with pytest.raises(ValueError, match="chunk_size"):
        exact_arch_diag_hessian(net, F.cross_entropy, x, y, edges, chunk_size=0)
    with pytest.raises(ValueError, match="same module"):
        first = next(iter(edges.values()))
        exact_arch_diag_hessian(net, F.cross_entropy, x, y, {"a": first, "b": first})
    with pytest.raises(ValueError, match="scalar"):
        exact_arch_diag_hessian(net, lambda out, t: F.cross_entropy(out, t, reduction="none"), x, y, edges)
    with pytest.raises(ValueError, match="edges must be"):
        exact_arch_diag_hessian(net, F.cross_entropy, x, y, [])

    toy = ToyNet().double()
    toy.Z = [torch.rand(3, dtype=torch.float64) for _ in range(3)]
    xt, yt = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match="probability vector"):
        exact_arch_diag_hessian(toy, F.cross_entropy, xt, yt, toy_edges(toy), wrt="alpha")
    toy.Z = [torch.softmax(torch.randn(5, 3, dtype=torch.float64), -1) for _ in range(3)]
    with pytest.raises(ValueError, match="per-sample"):
        exact_arch_diag_hessian(toy, F.cross_entropy, xt, yt, toy_edges(toy), wrt="alpha")
    toy.Z = [torch.rand(4, dtype=torch.float64) for _ in range(3)]
    with pytest.raises(ValueError, match="K=3"):
        exact_arch_diag_hessian(toy, F.cross_entropy, xt, yt, toy_edges(toy))
    for module in toy.modules():  # the failing forward left no hook behind
        assert not module._forward_pre_hooks


def test_mixed_op_that_never_ran_is_an_error():
    torch.manual_seed(16)
    toy = ToyNet(with_unused=True).double()
    toy.Z = [torch.rand(3, dtype=torch.float64) for _ in range(3)]
    toy.call_unused = False
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match=r"unused.*never ran"):
        exact_arch_diag_hessian(toy, F.cross_entropy, x, y, toy_edges(toy))
    for module in toy.modules():
        assert not module._forward_pre_hooks
