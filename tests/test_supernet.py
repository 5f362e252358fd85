"""Reference supernet: shapes for every variant and dtype, the arch/weight split, mixing-weight forms."""

import itertools

import pytest
import torch

from nasdiag.supernet import DARTS_PRIMITIVES, ORDERS, MixedOp, Network, OpConfig, edge_nodes, register_op
from nasdiag.supernet.ops import OPS

NORMS = [("batch", False), ("batch", True), ("layer", False), ("layer", True), ("instance", False), ("instance", True)]


def small(**kw):
    kw.setdefault("in_channels", 1)
    return Network(4, 10, kw.pop("layers", 3), **kw)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("norm,affine", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_output_shape_every_order_norm_dtype(order, norm, affine, dtype):
    torch.manual_seed(0)
    net = small(order=order, norm=norm, affine=affine).to(dtype)
    x = torch.randn(3, 1, 8, 8, dtype=dtype)
    y = net(x)
    assert y.shape == (3, 10) and y.dtype == dtype
    assert torch.isfinite(y).all()
    y.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in net.arch_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("minimal", [False, True])
def test_cell_variants_shapes(minimal, dtype):
    net = (Network.minimal(4, 7, 3, in_channels=3) if minimal else Network(4, 7, 3, in_channels=3)).to(dtype)
    E = 5 if minimal else 14
    assert net.num_edges == E == len(net.edge_labels())
    for cell in net.cells:
        assert len(cell.edges) == E
    x = torch.randn(2, 3, 16, 16, dtype=dtype)
    s0 = s1 = net.stem(x)
    sizes = []
    for cell in net.cells:
        s0, s1 = s1, cell(s0, s1, torch.full((E, len(DARTS_PRIMITIVES)), 1.0 / 8, dtype=dtype))
        sizes.append(tuple(s1.shape))
    # channels double and space halves at each reduction cell (indices 1 and 2 for 3 layers)
    m = net.multiplier
    assert sizes == [(2, m * 4, 16, 16), (2, m * 8, 8, 8), (2, m * 16, 4, 4)]
    assert net(x).shape == (2, 7)


def test_minimal_cell_structure():
    net = Network.minimal(4, 10, 2, in_channels=1, reductions=[])
    assert net.cells[0].edge_nodes == [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    assert net.cells[0].output_nodes == [2, 3]
    assert net.cells[0].output_node_slices == {2: (0, 4), 3: (4, 8)}


def test_edge_nodes_order_matches_darts():
    assert edge_nodes(4) == [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3), (0, 4), (1, 4), (2, 4), (3, 4),
                             (0, 5), (1, 5), (2, 5), (3, 5), (4, 5)]


def test_arch_weight_split_partitions_parameters():
    net = small()
    arch = {id(p) for p in net.arch_parameters()}
    weights = {id(p) for p in net.weight_parameters()}
    everything = {id(p) for p in net.parameters()}
    assert arch and weights
    assert arch.isdisjoint(weights) and arch | weights == everything
    assert [n for n, _ in net.named_arch_parameters()] == ["alphas_normal", "alphas_reduce"]
    assert all(p.shape == (14, 8) for p in net.arch_parameters())
    # the split is by identity, not by name: the classifier's parameters are weights
    assert id(net.classifier.weight) in weights
    # α receives no gradient from a weights-only forward, w receives none through α
    y = net(torch.randn(2, 1, 8, 8), {t: torch.softmax(a.detach(), -1) for t, a in net.alphas().items()})
    y.sum().backward()
    assert all(p.grad is None for p in net.arch_parameters())


def test_cell_types_follow_reductions():
    assert small(layers=1, reductions=[]).cell_types == ["normal"]
    net = small(layers=2, reductions=[])
    assert [n for n, _ in net.named_arch_parameters()] == ["alphas_normal"]
    assert small(layers=5).reductions == [1, 3]


def test_default_weights_are_softmax_alpha():
    torch.manual_seed(1)
    net = small().double()
    with torch.no_grad():
        for a in net.arch_parameters():
            a.normal_()
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    explicit = net(x, {t: torch.softmax(a, -1) for t, a in net.alphas().items()})
    per_cell = net(x, [torch.softmax(net.alphas()[c.cell_type], -1) for c in net.cells])
    torch.testing.assert_close(net(x), explicit, rtol=0, atol=0)
    torch.testing.assert_close(per_cell, explicit, rtol=0, atol=0)


def test_mixed_op_is_weighted_sum_of_ops():
    torch.manual_seed(2)
    op = MixedOp(4, 1, DARTS_PRIMITIVES, OpConfig()).double()
    x = torch.randn(3, 4, 6, 6, dtype=torch.float64)
    w = torch.randn(8, dtype=torch.float64)
    reference = sum(w[k] * op.ops[k](x) for k in range(8))
    torch.testing.assert_close(op(x, w), reference)
    per_sample = torch.randn(3, 8, dtype=torch.float64)
    rows = torch.stack([op(x[b : b + 1], per_sample[b])[0] for b in range(3)])
    # BN statistics depend on the batch, so compare in eval mode where samples are independent
    op.eval()
    rows = torch.stack([op(x[b : b + 1], per_sample[b])[0] for b in range(3)])
    torch.testing.assert_close(op(x, per_sample), rows)


def test_one_hot_weights_select_a_single_op():
    torch.manual_seed(3)
    op = MixedOp(4, 1, DARTS_PRIMITIVES).double().eval()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    for k in range(8):
        torch.testing.assert_close(op(x, torch.nn.functional.one_hot(torch.tensor(k), 8).double()), op.ops[k](x) * 1.0)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="stacking order"):
        small(order="bn-relu-conv")
    with pytest.raises(ValueError, match="normalization"):
        small(norm="group")
    with pytest.raises(KeyError, match="register_op"):
        Network(4, 10, 1, primitives=["none", "conv_7x7"])
    net = small()
    with pytest.raises(ValueError, match="one \\(E, K\\) tensor per cell"):
        net(torch.randn(2, 1, 8, 8), [torch.zeros(14, 8)])
    with pytest.raises(ValueError, match="missing for cell types"):
        net(torch.randn(2, 1, 8, 8), {"normal": torch.zeros(14, 8)})
    with pytest.raises(ValueError, match="shape \\(K,\\) or \\(B, K\\)"):
        net.cells[0].edges[0](torch.randn(2, 4, 8, 8), torch.zeros(7))


def test_register_op_extends_the_space():
    name = "test_conv_1x1"
    try:
        register_op(name, lambda C, stride, cfg: torch.nn.Conv2d(C, C, 1, stride=stride, bias=False))
        with pytest.raises(ValueError, match="already registered"):
            register_op(name, lambda C, stride, cfg: torch.nn.Identity())
        net = Network(4, 10, 2, in_channels=1, primitives=["none", "skip_connect", name])
        assert net(torch.randn(2, 1, 8, 8)).shape == (2, 10)
        assert net.arch_parameters()[0].shape == (14, 3)
    finally:
        OPS.pop(name, None)


def test_bias_free_classifier():
    assert small(classifier_bias=False).classifier.bias is None
    assert small().classifier.bias is not None


@pytest.mark.parametrize("order,norm", list(itertools.product(ORDERS, ["batch", "layer", "instance"])))
def test_op_ends_in_configured_norm_order(order, norm):
    """The stacking order switch really reorders the modules of conv ops (wiring paper §8.2)."""
    net = small(order=order, norm=norm)
    seq = net.cells[0].edges[0].ops[DARTS_PRIMITIVES.index("dil_conv_3x3")]
    kinds = [type(m).__name__ for m in seq]
    expected_norm = {"batch": "BatchNorm2d", "layer": "GroupNorm", "instance": "InstanceNorm2d"}[norm]
    expected = {
        "relu-conv-bn": ["ReLU", "Conv2d", "Conv2d", expected_norm],
        "conv-bn-relu": ["Conv2d", "Conv2d", expected_norm, "ReLU"],
        "conv-relu-bn": ["Conv2d", "Conv2d", "ReLU", expected_norm],
    }[order]
    assert kinds == expected
