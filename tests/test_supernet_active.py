"""Active ops: only the ops of an active-op mask are computed, and the forward equals the dense one with
the inactive ops' mixing weights set to zero (float64, autograd for the gradients)."""

import pytest
import torch

from nasdiag.supernet import Network


def make(seed=0):
    torch.manual_seed(seed)
    return Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()


def random_mask(net, g, k=2):
    """k random active ops per edge."""
    masks = {}
    for t in net.cell_types:
        scores = torch.rand(net.num_edges, len(net.primitives), generator=g)
        idx = scores.topk(k, dim=-1).indices
        masks[t] = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)
    return masks


@pytest.mark.parametrize("per_sample", [False, True])
def test_active_forward_equals_dense_forward_with_zero_weights(per_sample):
    net = make()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1, 8, 8, generator=g, dtype=torch.float64)
    active = random_mask(net, g)
    E, K = net.num_edges, len(net.primitives)
    shape = (E, 4, K) if per_sample else (E, K)
    z = {t: torch.rand(*shape, generator=g, dtype=torch.float64).requires_grad_(True) for t in net.cell_types}
    masked = {t: z[t] * (active[t].unsqueeze(1) if per_sample else active[t]) for t in net.cell_types}
    dense = net(x, masked)
    sparse = net(x, z, active=active)
    torch.testing.assert_close(sparse, dense, rtol=1e-12, atol=1e-12)
    # ∂L/∂Z: equal on active ops; exactly zero (not computed) on inactive ones
    gd = torch.autograd.grad(dense.square().sum(), list(z.values()))
    gs = torch.autograd.grad(sparse.square().sum(), list(z.values()))
    for t, a, b in zip(net.cell_types, gd, gs):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
        off = ~(active[t].unsqueeze(1).expand_as(b) if per_sample else active[t])
        assert (b[off] == 0).all()


def test_inactive_op_modules_are_not_called():
    net = make(1)
    g = torch.Generator().manual_seed(4)
    active = random_mask(net, g, k=1)
    calls = {}
    handles = []
    try:
        for spec in net.edge_specs():
            for k, op in enumerate(spec.module.ops):
                key = (spec.cell_index, spec.edge_index, k)
                handles.append(op.register_forward_hook(lambda m, i, o, key=key: calls.__setitem__(key, calls.get(key, 0) + 1)))
        net(torch.randn(2, 1, 8, 8, dtype=torch.float64), net.softmax_weights(), active=active)
    finally:
        for h in handles:
            h.remove()
    expected = {(s.cell_index, s.edge_index, k): 1 for s in net.edge_specs()
                for k in active[s.cell_type][s.edge_index].nonzero().flatten().tolist()}
    assert calls == expected


def test_per_cell_masks_and_bad_masks():
    net = make(2)
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    E, K = net.num_edges, len(net.primitives)
    on = torch.ones(E, K, dtype=torch.bool)
    torch.testing.assert_close(net(x, active=[on] * net.layers), net(x), rtol=1e-12, atol=1e-12)
    off = on.clone()
    off[3] = False
    with pytest.raises(ValueError, match="every candidate op of this edge is inactive"):
        net(x, active={t: off for t in net.cell_types})
    with pytest.raises(ValueError, match="one flag per candidate op"):
        net(x, active={t: on[:, :3] for t in net.cell_types})
    with pytest.raises(ValueError, match="missing for cell types"):
        net(x, active={"normal": on})
