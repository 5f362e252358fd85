"""The wiring supplement's statements, checked numerically in float64 against independent autograd
computations (scalar multipliers and detached inputs inserted by test-side hooks) and closed forms.

Tiny eps (1e-12) stands in for "eps -> 0" where a statement needs scale invariance; §8.1's
InstanceNorm case is exact at the real eps (1e-5)."""

import pytest
import torch
import torch.nn.functional as F

import nasdiag
from nasdiag import cost

from conftest import float64_batch, tiny_network

ORDERS = ["relu-conv-bn", "conv-bn-relu", "conv-relu-bn"]
TINY_EPS = 1e-12


def minimal(layers, seed=0, **kw):
    kw.setdefault("classifier_bias", False)  # Thm 2 needs the bias-free classifier
    return tiny_network(layers, seed, **kw)


data = float64_batch


def softmax_leaves(net, seed=2):
    g = torch.Generator().manual_seed(seed)
    E, K = net.num_edges, len(net.primitives)
    return [torch.softmax(torch.randn(E, K, generator=g, dtype=torch.float64), -1) for _ in net.cells]


def one_hot(K, k):
    return F.one_hot(torch.tensor(k), K).double()


def run(net, Z, x, y, probe=None, pre_hooks=()):
    """Forward + backward with Z as leaves per cell and test-side pre-hooks; returns (leaves, loss)."""
    leaves = [z.detach().clone().requires_grad_() for z in Z]
    handles = [m.register_forward_pre_hook(h) for m, h in pre_hooks]
    try:
        if probe is None:
            loss = F.cross_entropy(net(x, leaves), y)
            loss.backward()
        else:
            with probe.record():
                loss = F.cross_entropy(net(x, leaves), y)
                loss.backward()
    finally:
        for h in handles:
            h.remove()
    return leaves, loss


def scale_input(s):
    return lambda m, args: (args[0] * s, args[1])


def detach_input(m, args):
    return (args[0].detach(), args[1])


# --- Thm 1 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm", ["batch", "layer"])  # §8.1: LayerNorm behaves like BN
@pytest.mark.parametrize("order", ORDERS)  # §8.2: every stacking order
def test_thm1_no_cost_passes_through_a_normalized_intermediate_edge(order, norm):
    net = minimal(2, order=order, norm=norm, norm_eps=TINY_EPS, reductions=[])
    x, y = data()
    K = len(net.primitives)
    mid = net.cells[0].edges[4]  # edge (2, 3) of the minimal cell: the intermediate edge
    probe = nasdiag.attach(net, path_split=True)
    invariant = probe.scale_invariant_ops()["cells.0.edges.4"]
    assert invariant.tolist() == [p != "skip_connect" for p in net.primitives]
    for k in range(K):
        Z = softmax_leaves(net)
        Z[0][4] = one_hot(K, k)  # the intermediate edge runs op k alone (a DSNAS-style sample)
        s = torch.ones((), dtype=torch.float64, requires_grad=True)
        leaves, _ = run(net, Z, x, y, probe, [(mid, scale_input(s))])
        # ∂L/∂s = <J_eᵀ ∂L/∂x_3, x_2>: the cost node 2 receives back through the intermediate edge
        ref = max(float(leaves[0].grad[:4].abs().max()), 1e-12)
        if invariant[k]:
            assert abs(float(s.grad)) <= 1e-8 * ref, (net.primitives[k], float(s.grad), ref)
        else:  # skip_connect passes cost: Thm 1 is about normalized ops only (eq. 11)
            assert abs(float(s.grad)) > 1e-4 * ref
        # the probe's split, weighted by Z over everything entering node 2, is that same quantity
        split = probe.path_costs()
        through = sum((Z[0][i] * split[f"cells.0.edges.{i}"]["cells.0.edges.4"]).sum() for i in (0, 1))
        torch.testing.assert_close(through, s.grad, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("order", ORDERS)
def test_thm1_per_op_when_the_sampled_op_is_all_of_node_2(order):
    """Exact per op when x_2 is the sampled op's output alone: edge (1, 2) samples `none`."""
    net = minimal(2, order=order, norm_eps=TINY_EPS, reductions=[])
    x, y = data()
    P = net.primitives
    K, k_in, k_mid = len(P), P.index("sep_conv_3x3"), P.index("avg_pool_3x3")
    Z = softmax_leaves(net)
    Z[0][0], Z[0][1], Z[0][4] = one_hot(K, k_in), one_hot(K, P.index("none")), one_hot(K, k_mid)
    mid = net.cells[0].edges[4]
    probe = nasdiag.attach(net, path_split=True)
    full, _ = run(net, Z, x, y, probe)
    cut, _ = run(net, Z, x, y, None, [(mid, detach_input)])  # node 2 reaches the loss only via the output
    passed = full[0].grad[0] - cut[0].grad[0]  # independent: the part of ∂L/∂Z_02 that went through edge 4
    split = probe.path_costs()["cells.0.edges.0"]
    torch.testing.assert_close(split["cells.0.edges.4"], passed, rtol=0, atol=1e-10)
    torch.testing.assert_close(split["output"], cut[0].grad[0], rtol=0, atol=1e-10)
    scale = float(full[0].grad[0].abs().max())
    assert abs(float(passed[k_in])) <= 1e-8 * scale  # the sampled op: Thm 1
    assert float(passed.abs().max()) > 1e-4 * scale  # the other ops' outputs are not x_2: not 0


def test_thm1_deviation_at_the_real_eps_is_eps_over_var():
    net = minimal(2, norm_eps=1e-5, reductions=[])
    x, y = data()
    P = net.primitives
    K, k = len(P), P.index("dil_conv_3x3")  # relu -> conv -> conv -> BN: one BN at the end
    Z = softmax_leaves(net)
    Z[0][4] = one_hot(K, k)
    mid = net.cells[0].edges[4]
    op, bn = mid.ops[k], mid.ops[k][-1]
    seen = {}
    def grab_grad(m, a, o):
        o.register_hook(lambda g: seen.setdefault("g3", g))

    def grab(key, t):
        seen.setdefault(key, t.detach())

    hooks = [bn.register_forward_pre_hook(lambda m, a: grab("bn_in", a[0])),
             op.register_forward_hook(lambda m, a, o: grab("f", o)),
             mid.register_forward_hook(grab_grad)]
    s = torch.ones((), dtype=torch.float64, requires_grad=True)
    probe = nasdiag.attach(net, norm_deviation=True)
    try:
        run(net, Z, x, y, probe, [(mid, scale_input(s))])
    finally:
        for h in hooks:
            h.remove()
    var = seen["bn_in"].var(dim=(0, 2, 3), unbiased=False)
    r = 1e-5 / (var + 1e-5)
    # J_f(x)·x = f(x)·eps/(var + eps) per channel, so the passed cost is Σ_c r_c <g_3[:, c], f[:, c]>
    predicted = (r[None, :, None, None] * seen["g3"] * seen["f"]).sum()
    torch.testing.assert_close(s.grad, predicted, rtol=1e-8, atol=1e-15)
    assert float(s.grad) != 0.0
    assert probe.invariance_deviation()["cells.0.edges.4"]["dil_conv_3x3"] == pytest.approx(float(r.max()), rel=1e-12)


# --- Cor 1.2 and Thm 2 -----------------------------------------------------------------------------------

def slice_multipliers(net):
    scales, hooks = [], []
    for cell in net.cells:
        s = torch.ones(len(cell.output_nodes), dtype=torch.float64, requires_grad=True)
        scales.append(s)

        def hook(m, args, out, s=s, sl=cell.output_node_slices):
            return torch.cat([s[i] * out[:, a:b] for i, (a, b) in enumerate(sl.values())], dim=1)

        hooks.append((cell, hook))
    return scales, hooks


@pytest.mark.parametrize("norm", ["batch", "layer"])
@pytest.mark.parametrize("order", ORDERS)
def test_cor12_output_costs_of_every_cell_but_the_last_sum_to_zero(order, norm):
    net = minimal(3, order=order, norm=norm, norm_eps=TINY_EPS, reductions=[1])
    x, y = data()
    scales, hooks = slice_multipliers(net)
    probe = nasdiag.attach(net)
    handles = [c.register_forward_hook(h) for c, h in hooks]
    try:
        with probe.record():
            F.cross_entropy(net(x), y).backward()
    finally:
        for h in handles:
            h.remove()
    oc = probe.output_costs()
    for k, cell in enumerate(net.cells):
        nodes = torch.stack([oc[f"cells.{k}"][n] for n in cell.output_nodes])
        torch.testing.assert_close(nodes, scales[k].grad, rtol=0, atol=1e-10)  # independent: ∂L/∂s per slice
        size = float(nodes.abs().sum())
        if k < len(net.cells) - 1:
            assert abs(float(nodes.sum())) <= 1e-8 * size, (k, nodes)
            assert size > 1e-6  # each node's cost is not 0, only their sum
        else:
            assert abs(float(nodes.sum())) > 1e-6


@pytest.mark.parametrize("order", ORDERS)
def test_thm2_last_cell_output_cost_is_loss_minus_entropy(order):
    net = minimal(2, order=order, reductions=[1])
    x, y = data()
    probe = nasdiag.attach(net)
    with probe.record():
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
    p = torch.softmax(logits.detach(), -1)
    H = -(p * torch.log(p)).sum(1).mean()
    total = sum(probe.output_costs()["cells.1"].values())
    torch.testing.assert_close(total, loss.detach() - H, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(total, cost.loss_minus_entropy(logits.detach(), y), rtol=1e-10, atol=1e-12)


def test_thm2_needs_the_bias_free_classifier():
    net = minimal(2, reductions=[1], classifier_bias=True)
    with torch.no_grad():
        net.classifier.bias.normal_()
    x, y = data()
    probe = nasdiag.attach(net)
    with probe.record():
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
    total = sum(probe.output_costs()["cells.1"].values())
    assert abs(float(total - cost.loss_minus_entropy(logits.detach(), y))) > 1e-4


# --- §8.1 affine-free InstanceNorm ------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["relu-conv-bn", "conv-relu-bn"])
def test_affine_free_instance_norm_gives_zero_costs(order):
    """The exact case (any eps, every cell, every op): the last cell feeds global average pooling directly and
    every candidate op and every cell-input preprocessing ends in an affine-free InstanceNorm (orders
    relu-conv-bn and conv-relu-bn; pools -> IN; skip = identity or FactorizedReduce -> IN). Each node of the
    last cell is then a sum of maps with zero spatial mean per (sample, channel), so GAP(last cell) ≡ 0 and
    the logits are the classifier bias whatever Z is: ∂L/∂Z = 0 exactly (eq. 16's Σ_d = 0, for all paths)."""
    net = minimal(3, order=order, norm="instance", affine=False, norm_eps=1e-5, reductions=[1], classifier_bias=True)
    with torch.no_grad():
        net.classifier.bias.normal_()
    x, y = data()
    Z = softmax_leaves(net)
    probe = nasdiag.attach(net)
    leaves, _ = run(net, Z, x, y, probe)
    with torch.no_grad():
        logits = net(x, Z)
    torch.testing.assert_close(logits, net.classifier.bias.expand_as(logits), rtol=0, atol=1e-12)
    costs = probe.costs()
    for k, z in enumerate(leaves):
        assert float(z.grad.abs().max()) <= 1e-14  # autograd ∂L/∂Z
        for e in range(net.num_edges):
            assert float(costs[f"cells.{k}.edges.{e}"].abs().max()) <= 1e-14


@pytest.mark.parametrize("variant", ["conv-bn-relu", "affine"])
def test_instance_norm_costs_are_not_zero_outside_that_case(variant):
    kw = dict(order="conv-bn-relu") if variant == "conv-bn-relu" else dict(affine=True)
    net = minimal(3, norm="instance", norm_eps=1e-5, reductions=[1], **kw)
    if variant == "affine":
        with torch.no_grad():
            for m in net.modules():
                if isinstance(m, torch.nn.InstanceNorm2d) and m.affine:
                    m.bias.normal_()
    x, y = data()
    leaves, _ = run(net, softmax_leaves(net), x, y)
    assert float(leaves[-1].grad.abs().max()) > 1e-6


# --- architecture gradients from costs (§2) ------------------------------------------------------------------

def three_cells():
    return minimal(3, reductions=[1], classifier_bias=True)  # normal cells 0 and 2 share alphas_normal


def test_darts_identity_summed_over_the_cells_sharing_alpha():
    net = three_cells()
    x, y = data()
    probe = nasdiag.attach(net)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    agg = probe.cell_type_costs()
    for t, alpha in net.alphas().items():
        got = cost.darts_alpha_grad(agg[t], torch.softmax(alpha.detach(), -1))
        torch.testing.assert_close(got, alpha.grad, rtol=0, atol=1e-10)


def _sample(net, seed=4):
    g = torch.Generator().manual_seed(seed)
    K = len(net.primitives)
    return {t: F.one_hot(torch.randint(0, K, (net.num_edges,), generator=g), K).double() for t in net.cell_types}


def test_proxylessnas_form_with_binary_gates():
    net = three_cells()
    x, y = data()
    gates = _sample(net)
    p = {t: torch.softmax(a, -1) for t, a in net.alphas().items()}
    probe = nasdiag.attach(net)
    with probe.record():
        # BinaryConnect: forward with the binary gates, gradient as if through p
        F.cross_entropy(net(x, {t: gates[t] + p[t] - p[t].detach() for t in p}), y).backward()
    agg = probe.cell_type_costs()
    for t, alpha in net.alphas().items():
        torch.testing.assert_close(cost.proxyless_alpha_grad(agg[t], p[t].detach()), alpha.grad, rtol=0, atol=1e-10)


def test_snas_credit_with_gumbel_softmax_weights():
    net = three_cells()
    x, y = data()
    g = torch.Generator().manual_seed(5)
    lam = 0.5
    Z = {t: torch.softmax((a - torch.log(-torch.log(torch.rand(a.shape, generator=g, dtype=torch.float64)))) / lam, -1)
         for t, a in net.alphas().items()}
    probe = nasdiag.attach(net)
    with probe.record():
        F.cross_entropy(net(x, Z), y).backward()
    agg = probe.cell_type_costs()
    for t, alpha in net.alphas().items():
        torch.testing.assert_close(cost.snas_alpha_grad(agg[t], Z[t].detach(), lam), alpha.grad, rtol=0, atol=1e-10)


def test_dsnas_credit_with_one_hot_samples():
    net = three_cells()
    x, y = data()
    onehot = _sample(net)
    Z = {}
    for t, a in net.alphas().items():
        lp = torch.log_softmax(a, -1)
        lp_s = (lp * onehot[t]).sum(-1, keepdim=True)
        Z[t] = onehot[t] * torch.exp(lp_s - lp_s.detach())  # value one-hot, gradient ∇ log p_s
    probe = nasdiag.attach(net, statistics="sampled")
    with probe.record():
        F.cross_entropy(net(x, Z), y).backward()
    agg = probe.cell_type_costs()
    for t, alpha in net.alphas().items():
        p = torch.softmax(alpha.detach(), -1)
        torch.testing.assert_close(cost.dsnas_alpha_grad(agg[t], onehot[t], p), alpha.grad, rtol=0, atol=1e-10)
    counts = probe.statistics()["cost/normal/count"]
    assert (counts == 2 * onehot["normal"].numpy()).all()  # two normal cells, each sampled op counted once
