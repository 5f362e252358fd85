"""The probe on nasdiag's supernet and on user models: costs = autograd ∂L/∂Z (float64), scope of the
hooks, no side effects, streaming statistics, bad input."""

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.probe import Probe, ProbeError
from nasdiag.supernet import MixedOp, Network

from conftest import assert_no_module_hooks, live_tensors, float64_batch as batch, tiny_network as tiny_net


def z_leaves(net, kind, B=None, seed=2):
    """One (E, K) (or (E, B, K)) leaf per cell, so that .grad is ∂L/∂Z with Z a leaf per cell."""
    g = torch.Generator().manual_seed(seed)
    E, K = net.num_edges, len(net.primitives)
    shape = (E, K) if B is None else (E, B, K)
    out = []
    for cell in net.cells:
        if kind == "softmax":
            z = torch.softmax(torch.randn(*shape, generator=g, dtype=torch.float64), -1)
        elif kind == "onehot":
            z = F.one_hot(torch.randint(0, K, shape[:-1], generator=g), K).double()
        else:  # linear (SparseNAS-style real weights)
            z = torch.randn(*shape, generator=g, dtype=torch.float64)
        out.append(z.requires_grad_())
    return out


# --- structure -------------------------------------------------------------------------------------

def test_discovery_names_cells_and_node_pairs_of_nasdiag_network():
    net = tiny_net(layers=3)
    probe = nasdiag.attach(net)
    specs = net.edge_specs()
    assert probe.edge_names == [s.name for s in specs]
    for info, s in zip(probe.edges, specs):
        assert info.module is s.module
        assert (info.cell_type, info.cell_index, info.edge_index, info.src, info.dst) == (
            s.cell_type, s.cell_index, s.edge_index, s.src, s.dst)
        assert info.op_names == tuple(net.primitives)
    assert [c.name for c in probe.cells] == [f"cells.{k}" for k in range(3)]
    assert [g.name for g in probe.groups] == net.cell_types
    assert probe.groups[0].edge_labels == tuple(net.edge_labels())


# --- costs = ∂L/∂Z ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["softmax", "onehot", "linear"])
def test_costs_equal_autograd_dL_dZ_for_every_weighting(kind):
    net = tiny_net(layers=3)
    x, y = batch()
    Z = z_leaves(net, kind)
    probe = nasdiag.attach(net)
    with probe.record():
        F.cross_entropy(net(x, Z), y).backward()
    costs = probe.costs()
    for s in net.edge_specs():
        torch.testing.assert_close(costs[s.name], Z[s.cell_index].grad[s.edge_index], rtol=0, atol=1e-10)
    # skip_connect returns its input object; its cost must still be <∂L/∂x_j, x_i>, not 0
    skip = net.primitives.index("skip_connect")
    assert all(costs[s.name][skip].abs() > 1e-8 for s in net.edge_specs() if s.cell_type == "normal")


def test_per_sample_costs_are_dL_dZ_of_per_sample_weights_and_sum_to_costs():
    net = tiny_net(layers=2)
    x, y = batch(B=4)
    Z = z_leaves(net, "softmax", B=4)
    probe = nasdiag.attach(net)
    with probe.record():
        F.cross_entropy(net(x, Z), y).backward()
    per, tot = probe.costs(per_sample=True), probe.costs()
    for s in net.edge_specs():
        torch.testing.assert_close(per[s.name], Z[s.cell_index].grad[s.edge_index], rtol=0, atol=1e-10)
        torch.testing.assert_close(per[s.name].sum(0), tot[s.name], rtol=0, atol=1e-12)


def test_two_forwards_in_one_block_add_up_like_grad():
    net = tiny_net(layers=2)
    (x1, y1), (x2, y2) = batch(seed=1), batch(seed=7)
    Z = z_leaves(net, "softmax")
    probe = nasdiag.attach(net)
    with probe.record():
        (F.cross_entropy(net(x1, Z), y1) + 0.5 * F.cross_entropy(net(x2, Z), y2)).backward()
    for s in net.edge_specs():
        torch.testing.assert_close(probe.costs()[s.name], Z[s.cell_index].grad[s.edge_index], rtol=0, atol=1e-10)


def test_two_backwards_through_one_forward_add_up_like_grad():
    net = tiny_net(layers=2)
    x, y = batch(seed=1)
    Z = z_leaves(net, "softmax")
    probe = nasdiag.attach(net, path_split=True)
    with probe.record():
        loss = F.cross_entropy(net(x, Z), y)
        loss.backward(retain_graph=True)
        (0.5 * loss).backward()
    for s in net.edge_specs():
        torch.testing.assert_close(probe.costs()[s.name], Z[s.cell_index].grad[s.edge_index], rtol=0, atol=1e-10)
    both = {cell: sum(float(v) for v in nodes.values()) for cell, nodes in probe.output_costs().items()}
    with probe.record():
        F.cross_entropy(net(x, [z.detach() for z in Z]), y).backward()
    once = {cell: sum(float(v) for v in nodes.values()) for cell, nodes in probe.output_costs().items()}
    for cell in once:
        assert abs(both[cell] - 1.5 * once[cell]) < 1e-10, cell


def test_a_create_graph_backward_leaves_costs_outside_the_graph():
    net = tiny_net(layers=1, reductions=[])
    x, y = batch()
    Z = z_leaves(net, "softmax")
    probe = nasdiag.attach(net, path_split=True)
    with probe.record():
        net.zero_grad()
        F.cross_entropy(net(x, Z), y).backward(create_graph=True)
    for name, c in probe.costs().items():
        assert not c.requires_grad and c.grad_fn is None, name
    for parts in probe.path_costs().values():
        assert all(not v.requires_grad for v in parts.values())
    assert all(not v.requires_grad for v in probe.output_costs()["cells.0"].values())
    s = net.edge_specs()[3]
    torch.testing.assert_close(probe.costs()[s.name], Z[0].grad[3].detach(), rtol=0, atol=1e-10)


# --- no side effects --------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"path_split": True, "norm_deviation": True}])
def test_losses_gradients_and_buffers_are_bit_identical_with_and_without_probe(options):
    # a probed step runs Network's eager engine (hooks need the per-op modules; docs/probe.md): the probed
    # net keeps the default engine and must equal the eager step bit for bit
    plain = tiny_net(layers=3).set_engine("eager")
    probed = copy.deepcopy(plain).set_engine("auto")
    x, y = batch()
    loss_a = F.cross_entropy(plain(x), y)
    loss_a.backward()
    probe = nasdiag.attach(probed, **options)
    with probe.record():
        loss_b = F.cross_entropy(probed(x), y)
        loss_b.backward()
    assert torch.equal(loss_a, loss_b)
    for (na, pa), (nb, pb) in zip(plain.named_parameters(), probed.named_parameters()):
        assert torch.equal(pa.grad, pb.grad), na
    for (na, ba), (nb, bb) in zip(plain.named_buffers(), probed.named_buffers()):
        assert torch.equal(ba, bb), na


def test_no_hook_is_left_after_the_block_even_when_the_body_raises():
    net = tiny_net(layers=2)
    x, y = batch()
    probe = nasdiag.attach(net, path_split=True, norm_deviation=True, hessian="approx")
    captured = {}
    h = net.cells[0].edges[0].register_forward_hook(lambda m, a, o: captured.setdefault("out", o))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with probe.record():
                loss = F.cross_entropy(net(x), y)
                raise RuntimeError("boom")
    finally:
        h.remove()
    assert_no_module_hooks(net)
    assert not captured["out"]._backward_hooks  # the tensor hook on the edge output is gone too
    loss.backward()  # outside the block: nothing is captured
    with pytest.raises(ProbeError, match="no completed recorded step"):
        probe.costs()
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    assert_no_module_hooks(net)
    assert not captured["out"]._backward_hooks


def test_torch_func_works_on_the_model_outside_the_block():
    net = tiny_net(layers=2)
    x, y = batch()
    probe = nasdiag.attach(net)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    params = {k: v.detach() for k, v in net.named_parameters()}
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    # BN updates its running statistics in place: they must be inputs of the transformed function
    loss_of = lambda p, b: F.cross_entropy(torch.func.functional_call(net, (p, b), (x,)), y)  # noqa: E731
    grads = torch.func.grad(loss_of)(params, buffers)
    net.zero_grad()
    ref = copy.deepcopy(net)
    F.cross_entropy(ref(x), y).backward()
    for k, p in ref.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-10, atol=1e-12)


class Toy(nn.Module):
    """Three stacked nasdiag MixedOps on 4x4 maps: fast enough for 1000 steps."""

    def __init__(self):
        super().__init__()
        self.edges = nn.ModuleList(MixedOp(2, 1, ["none", "skip_connect", "avg_pool_3x3"]) for _ in range(3))
        self.alpha = nn.Parameter(torch.zeros(3, 3))
        self.head = nn.Linear(32, 2)

    def forward(self, x):
        w = torch.softmax(self.alpha, -1)
        for i, m in enumerate(self.edges):
            x = torch.relu(m(x, w[i])) + x
        return self.head(x.flatten(1))


def test_memory_stays_flat_over_1000_steps():
    torch.manual_seed(0)
    model = Toy()
    probe = nasdiag.attach(model)
    x, y = torch.randn(2, 2, 4, 4), torch.tensor([0, 1])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        with probe.record():
            F.cross_entropy(model(x), y).backward()
        opt.step()
        probe.costs()

    for _ in range(20):
        step()
    before = live_tensors()
    for _ in range(1000):
        step()
    after = live_tensors()
    assert after <= before, f"{after - before} tensors leaked over 1000 steps"
    assert probe.statistics()["cost/edges/count"].min() == 1020
    assert_no_module_hooks(model)


# --- statistics -------------------------------------------------------------------------------------

def test_streaming_statistics_match_numpy_over_steps_and_cells():
    net = tiny_net(layers=3)  # cells 0, 1 reduce? minimal(…, 3): reductions at 1, 2
    probe = nasdiag.attach(net)
    hist = []
    for seed in range(4):
        x, y = batch(seed=seed)
        with probe.record():
            F.cross_entropy(net(x), y).backward()
        hist.append({k: v.clone() for k, v in probe.costs().items()})
    stats = probe.statistics()
    for t in net.cell_types:
        cells = [k for k, c in enumerate(net.cells) if c.cell_type == t]
        obs = np.stack([
            np.stack([np.stack([h[f"cells.{k}.edges.{e}"].numpy() for e in range(net.num_edges)]) for k in cells])
            for h in hist]).reshape(-1, net.num_edges, len(net.primitives))
        np.testing.assert_allclose(stats[f"cost/{t}/mean"], obs.mean(0), rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(stats[f"cost/{t}/var"], obs.var(0), rtol=1e-8, atol=1e-14)
        assert (stats[f"cost/{t}/count"] == len(hist) * len(cells)).all()
        assert stats[f"cost/{t}/mean"].shape == (net.num_edges, len(net.primitives))
    probe.reset_statistics()
    assert (probe.statistics()["cost/normal/count"] == 0).all()
    assert np.isnan(probe.statistics()["cost/normal/mean"]).all()


def test_sampled_statistics_count_one_hot_samples_and_average_only_them():
    net = tiny_net(layers=1, reductions=[])
    probe = nasdiag.attach(net, statistics="sampled")
    E, K = net.num_edges, len(net.primitives)
    g = torch.Generator().manual_seed(3)
    samples, seen = [], []
    for step in range(6):
        s = torch.randint(0, K, (E,), generator=g)
        onehot = F.one_hot(s, K).double()
        x, y = batch(seed=step)
        with probe.record():
            F.cross_entropy(net(x, {"normal": onehot}), y).backward()
        samples.append(onehot.numpy())
        seen.append(np.stack([probe.costs()[f"cells.0.edges.{e}"].numpy() for e in range(E)]))
    S, C = np.stack(samples), np.stack(seen)
    stats = probe.statistics()
    np.testing.assert_array_equal(stats["cost/normal/count"], S.sum(0))
    hit = S.sum(0) > 0
    mean = (S * C).sum(0) / np.maximum(S.sum(0), 1)
    np.testing.assert_allclose(stats["cost/normal/mean"][hit], mean[hit], rtol=1e-10, atol=1e-14)
    assert np.isnan(stats["cost/normal/mean"][~hit]).all()


def test_cell_type_costs_sum_the_cells_sharing_alpha():
    net = tiny_net(layers=3, reductions=[1])
    x, y = batch()
    probe = nasdiag.attach(net)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    costs, agg = probe.costs(), probe.cell_type_costs()
    for t in ("normal", "reduce"):
        cells = [k for k, c in enumerate(net.cells) if c.cell_type == t]
        for e in range(net.num_edges):
            torch.testing.assert_close(agg[t][e], sum(costs[f"cells.{k}.edges.{e}"] for k in cells))


# --- user models through an explicit edge map ----------------------------------------------------------

class Mixer(nn.Module):
    """A mixed op of another convention: weights are set on the module, not passed to forward."""

    def __init__(self, cands):
        super().__init__()
        self.cands = nn.ModuleList(cands)
        self.w = None

    def forward(self, x):
        return sum(self.w[k] * c(x) for k, c in enumerate(self.cands))


class UserNet(nn.Module):
    def __init__(self, k2=3):
        super().__init__()
        self.a = Mixer([nn.Identity(), nn.Tanh(), nn.Linear(3, 3, bias=False)])
        self.b = Mixer([nn.Linear(3, 3), nn.Identity(), nn.Softplus()][:k2])
        self.unused = Mixer([nn.Identity(), nn.Identity(), nn.Identity()])

    def forward(self, x):
        h = self.a(x)
        return self.b(h) + h


def test_edge_map_on_a_user_model_gives_dL_dZ_and_the_fallback_group():
    torch.manual_seed(0)
    net = UserNet().double()
    x = torch.randn(6, 3, dtype=torch.float64)
    wa, wb = torch.randn(3, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64, requires_grad=True)
    net.a.w, net.b.w = wa, wb
    probe = nasdiag.attach(net, edges={"a": (net.a, list(net.a.cands)), "b": (net.b, list(net.b.cands))})
    with probe.record():
        (net(x) ** 2).mean().backward()
    torch.testing.assert_close(probe.costs()["a"], wa.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(probe.costs()["b"], wb.grad, rtol=0, atol=1e-12)
    assert probe.edges[0].cell_type is None and probe.edges[0].src is None
    assert probe.statistics()["cost/edges/mean"].shape == (2, 3)
    with pytest.raises(ProbeError, match="output_node_slices"):
        probe.output_costs()
    with pytest.raises(ProbeError, match="statistics='all'"):
        nasdiag.attach(net, edges={"a": (net.a, list(net.a.cands))}, statistics="sampled")
    with pytest.raises(ProbeError, match="node pair"):
        nasdiag.attach(net, edges={"a": (net.a, list(net.a.cands))}, path_split=True)


def test_edges_with_different_numbers_of_ops_get_one_group_each():
    net = UserNet(k2=2).double()
    net.a.w = torch.ones(3, dtype=torch.float64)
    net.b.w = torch.ones(2, dtype=torch.float64)
    probe = nasdiag.attach(net, edges={"a": (net.a, list(net.a.cands)), "b": (net.b, list(net.b.cands))})
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with probe.record():
        net(x).sum().backward()
    stats = probe.statistics()
    assert stats["cost/a/mean"].shape == (1, 3) and stats["cost/b/mean"].shape == (1, 2)


# --- bad input ----------------------------------------------------------------------------------------

def test_a_model_without_discoverable_edges_is_refused():
    with pytest.raises(ProbeError, match="no edges found"):
        nasdiag.attach(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(ProbeError, match="nn.Module"):
        nasdiag.attach("not a model")


def test_an_edge_map_naming_a_module_outside_the_model_is_refused():
    net = tiny_net(layers=1)
    stranger = MixedOp(4, 1, net.primitives)
    with pytest.raises(ProbeError, match="not a submodule"):
        nasdiag.attach(net, edges={"e": stranger})
    with pytest.raises(ProbeError, match="not a submodule"):
        nasdiag.attach(net, edges={"e": (net.cells[0].edges[0], [nn.Identity()])})
    with pytest.raises(ProbeError, match="candidate ops"):
        nasdiag.attach(net, edges={"e": net.cells[0].preprocess0})
    with pytest.raises(ProbeError, match="two edges"):
        nasdiag.attach(net, edges={"e": net.cells[0].edges[0], "f": net.cells[0].edges[0]})
    with pytest.raises(ProbeError, match="statistics"):
        nasdiag.attach(net, statistics="median")


def test_an_edge_whose_forward_never_ran_gets_nan_and_a_warning():
    net = UserNet().double()
    for m in (net.a, net.b, net.unused):
        m.w = torch.ones(3, dtype=torch.float64)
    edges = {n: (getattr(net, n), list(getattr(net, n).cands)) for n in ("a", "b", "unused")}
    probe = nasdiag.attach(net, edges=edges)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="never ran.*'unused'"):
        with probe.record():
            net(x).sum().backward()
    assert torch.isnan(probe.costs()["unused"]).all()
    assert not torch.isnan(probe.costs()["a"]).any()
    counts = probe.statistics()["cost/edges/count"]
    assert counts[2].tolist() == [0, 0, 0] and counts[0].tolist() == [1, 1, 1]


def test_a_backward_that_never_reached_the_edges_gives_nan_and_a_warning():
    net = tiny_net(layers=1, reductions=[])
    x, y = batch()
    probe = nasdiag.attach(net)
    with pytest.warns(RuntimeWarning, match="backward never reached"):
        with probe.record():
            loss = F.cross_entropy(net(x), y)
    assert all(torch.isnan(c).all() for c in probe.costs().values())
    loss.backward()  # after the block: not captured, no error
    with pytest.warns(RuntimeWarning, match="backward never reached"):
        with probe.record(), torch.no_grad():
            net(x)
    assert (probe.statistics()["cost/normal/count"] == 0).all()


def test_an_edge_nothing_before_which_carries_a_gradient_is_named_as_such():
    """Weights, input and candidates without gradient: autograd never computes ∂L/∂x_j there (NaN, flagged),
    and the warning says how to observe it rather than blaming the backward."""
    torch.manual_seed(0)
    mixer = Mixer([nn.Identity(), nn.Tanh()])
    head = nn.Linear(3, 2).double()
    mixer.w = torch.tensor([0.3, 0.7], dtype=torch.float64)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    probe = nasdiag.attach(nn.ModuleDict({"m": mixer, "head": head}), edges={"m": (mixer, list(mixer.cands))})
    with pytest.warns(RuntimeWarning, match=r"did not require grad.*requires_grad_"):
        with probe.record():
            F.cross_entropy(head(mixer(x)), y).backward()
    assert torch.isnan(probe.costs()["m"]).all()


def test_a_candidate_op_that_is_not_part_of_its_mixed_op_is_refused_at_attach():
    net = UserNet().double()
    with pytest.raises(ProbeError, match=r"candidate op\(s\) \[1\].*not submodules of the mixed op"):
        nasdiag.attach(net, edges={"a": (net.a, [net.a.cands[0], net.b.cands[0]])})


def test_hessian_targets_of_another_batch_are_refused():
    net = tiny_net(layers=1, reductions=[])
    x, y = batch()
    probe = nasdiag.attach(net, hessian="approx")
    with probe.record(targets=y[:3]):
        F.cross_entropy(net(x), y).backward()
    with pytest.raises(ProbeError, match=r"3 labels but the batch has 4 samples"):
        probe.hessian()


def test_misuse_of_record_and_results_is_explained():
    net = tiny_net(layers=1)
    probe = nasdiag.attach(net)
    with pytest.raises(ProbeError, match="no completed recorded step"):
        probe.costs()
    with pytest.raises(ProbeError, match="no completed recorded step") as err:
        probe.statistics()  # docs/probe.md: results before any completed step raise
    assert "\n" not in str(err.value)
    with pytest.raises(ProbeError, match="nested"):
        with probe.record():
            with probe.record():
                pass
    assert_no_module_hooks(net)
    with pytest.raises(ProbeError, match="no completed recorded step"):
        probe.statistics()  # the failed block completed nothing
    with pytest.raises(ProbeError, match="path_split=True"):
        probe.path_costs()
    with pytest.raises(ProbeError, match="norm_deviation=True"):
        probe.invariance_deviation()


class PartialChannelMixedOp(nn.Module):
    """PC-DARTS-like: DARTS signature, but only half the channels are mixed."""

    def __init__(self):
        super().__init__()
        self._ops = nn.ModuleList([nn.Identity(), nn.Tanh()])

    def forward(self, x, weights):
        a, b = x.chunk(2, dim=1)
        return torch.cat([sum(w * op(a) for w, op in zip(weights, self._ops)), b], dim=1)


def test_a_mixed_op_that_is_not_a_weighted_sum_is_refused_at_the_first_step():
    m = PartialChannelMixedOp()
    probe = nasdiag.attach(m)
    with pytest.raises(ProbeError, match="not Σ_k w_k·op_k"):
        with probe.record():
            m(torch.randn(2, 4), torch.tensor([0.3, 0.7]))
    assert_no_module_hooks(m)
