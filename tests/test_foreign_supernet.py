"""`nasdiag.search.supernet.adapt` on a supernet nasdiag did not build: the faithful copy of the DARTS
search code (quark0/darts cnn/model_search.py) in tests/test_probe_darts.py, α kept as plain tensors
outside the module as DARTS does. Checked against the model's own forward and autograd (float64)."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.errors import ConfigError
from nasdiag.search import Schedule, get_method
from nasdiag.search.supernet import AdaptedSupernet, adapt, as_supernet

from conftest import assert_no_module_hooks
from test_probe_darts import PRIMITIVES, Network as DartsNetwork


def darts_model(seed=0, layers=3):
    """A small DARTS search network in float64 (minimal 2-step cells), α non-uniform."""
    torch.manual_seed(seed)
    net = DartsNetwork(4, 5, layers, nn.CrossEntropyLoss(), steps=2, multiplier=2).double()
    g = torch.Generator().manual_seed(seed + 10)
    for a in net.arch_parameters():
        with torch.no_grad():
            a.data = (0.5 * torch.randn(a.shape, generator=g)).double()
    return net


def batch(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def foreign_supernet(seed=0):
    """(adapted supernet, the DARTS model) — the shape every method test uses."""
    model = darts_model(seed)
    return adapt(model, primitives=PRIMITIVES), model


def test_interface_and_alpha_registration():
    model = darts_model()
    plain = list(model.arch_parameters())
    net = adapt(model, primitives=PRIMITIVES)
    assert net.cell_types == ["normal", "reduce"] and [c.cell_type for c in net.cells] == ["normal", "reduce", "reduce"]
    assert (net.steps, net.multiplier, net.num_edges, net.primitives) == (2, 2, 5, PRIMITIVES)
    # α became parameters of the model sharing storage with DARTS's own list; arch and weights partition parameters
    for t, a in net.alphas().items():
        assert isinstance(a, nn.Parameter) and a is getattr(model, f"alphas_{t}")
        assert any(a.data_ptr() == p.data_ptr() for p in plain)
    ids = {id(p) for p in net.arch_parameters()} | {id(p) for p in net.weight_parameters()}
    assert ids == {id(p) for p in model.parameters()} and len(net.arch_parameters()) == 2
    assert "model.alphas_normal" in net.state_dict()
    assert as_supernet(model) is not model and isinstance(as_supernet(net), AdaptedSupernet)
    assert [e.name for e in net.edge_specs()][:2] == ["cells.0._ops.0", "cells.0._ops.1"]


def test_forward_at_softmax_equals_the_models_own_forward_and_gradient():
    model = darts_model(1)
    x, y = batch(1)
    ref = copy.deepcopy(model)
    own = F.cross_entropy(ref(x), y)
    own_grads = torch.autograd.grad(own, [ref.alphas_normal, ref.alphas_reduce])
    net = adapt(model, primitives=PRIMITIVES)
    alphas = list(net.alphas().values())
    z = {t: torch.softmax(a, -1) for t, a in net.alphas().items()}
    loss = F.cross_entropy(net(x, z), y)
    torch.testing.assert_close(loss, own, rtol=1e-13, atol=1e-13)
    for g, r in zip(torch.autograd.grad(loss, alphas), own_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-13)
    # no hooks left behind on any module, no swapped op lists
    assert_no_module_hooks(model)
    assert all(len(e.module._ops) == len(PRIMITIVES) for e in net.edge_specs())


def test_per_cell_leaves_give_the_cost_and_active_ops_are_skipped():
    net, model = foreign_supernet(2)
    x, y = batch(2)
    g = torch.Generator().manual_seed(5)
    leaves = [torch.rand(5, len(PRIMITIVES), generator=g, dtype=torch.float64).requires_grad_(True) for _ in net.cells]
    active = [torch.rand(5, len(PRIMITIVES), generator=g) < 0.4 for _ in net.cells]
    for m in active:
        m[:, 3] = True  # at least one op per edge
    calls = {}
    handles = []
    try:
        for e in net.edge_specs():
            for k, op in enumerate(e.ops):
                handles.append(op.register_forward_hook(
                    lambda m, i, o, key=(e.cell_index, e.edge_index, k): calls.__setitem__(key, calls.get(key, 0) + 1)))
        sparse = F.cross_entropy(net(x, leaves, active=active), y)
    finally:
        for h in handles:
            h.remove()
    expected = {(e.cell_index, e.edge_index, k): 1 for e in net.edge_specs()
                for k in active[e.cell_index][e.edge_index].nonzero().flatten().tolist()}
    assert calls == expected
    gs = torch.autograd.grad(sparse, leaves)
    masked = [z * m for z, m in zip(leaves, active)]
    dense = F.cross_entropy(net(x, masked), y)
    torch.testing.assert_close(sparse, dense, rtol=1e-12, atol=1e-12)
    for gsp, gd, m in zip(gs, torch.autograd.grad(dense, leaves), active):
        torch.testing.assert_close(gsp, gd, rtol=1e-10, atol=1e-13)
        assert (gsp[~m] == 0).all()
    assert all(len(e.module._ops) == len(PRIMITIVES) for e in net.edge_specs())


def test_dense_fallback_warns_once_and_equals_skipping():
    model = darts_model(3)
    x, _ = batch(3)
    skip = adapt(copy.deepcopy(model), primitives=PRIMITIVES)
    dense = adapt(model, primitives=PRIMITIVES, skip_inactive=False)
    mask = torch.zeros(5, len(PRIMITIVES), dtype=torch.bool)
    mask[torch.arange(5), torch.arange(5)] = True  # op e and sep_conv_3x3 on edge e
    mask[:, 4] = True
    on = {t: mask for t in dense.cell_types}
    z = dense.softmax_weights()
    with pytest.warns(UserWarning, match="computes every op"):
        out = dense(x, z, active=on)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense(x, z, active=on)
    torch.testing.assert_close(out, skip(x, skip.softmax_weights(), active=on), rtol=1e-12, atol=1e-12)


def test_bad_models_get_one_line_errors():
    with pytest.raises(ConfigError, match="cannot adapt Linear"):
        adapt(nn.Linear(2, 2))
    model = darts_model()
    del model.alphas_reduce
    with pytest.raises(ConfigError, match="alphas_reduce"):
        adapt(model)
    with pytest.raises(ConfigError, match=r"must be a \(5, 8\) tensor"):
        adapt(darts_model(), alphas={"normal": torch.zeros(5, 8), "reduce": torch.zeros(4, 8)})
    with pytest.raises(ConfigError, match="primitives names 2 ops"):
        adapt(darts_model(), primitives=["none", "skip"])


@pytest.mark.parametrize("method", ["snas", "dsnas", "proxyless"])
def test_methods_step_on_the_adapted_supernet_and_stay_hook_free(method):
    net, model = foreign_supernet(4)
    m = get_method(method)(net, schedule=Schedule(epochs=2, steps_per_epoch=2))
    before = {t: a.detach().clone() for t, a in net.alphas().items()}
    stats = m.step(batch(5), batch(6))
    assert torch.isfinite(stats["scalars/train_loss"])
    assert any(not torch.equal(before[t], a) for t, a in net.alphas().items())
    assert all(not mod._forward_pre_hooks for mod in model.modules())
    assert m.genotype().normal  # derived from probabilities(), "none" excluded by name
