"""ProxylessNAS two-path mode: the composed α-gradient against autograd through BinaryConnect's
straight-through surrogate restricted to the sampled pair, Z(α) = g + p'(α) − sg(p'(α)) with
p' = softmax of α over the two sampled paths (ProxylessNAS eq 4 on the pair; wiring supplement §2.2), in
float64, on nasdiag's supernet and on an adapted DARTS-code supernet; only the sampled paths computed;
the rescaling keeps the unsampled paths' probabilities; exact resume."""

import copy

import pytest
import torch
import torch.nn.functional as F

from nasdiag import vocabulary as V
from nasdiag.search import get_method
from test_method_snas import SCHEDULE, frozen, reference_batch, reference_supernet, supernet_and_batches


@pytest.mark.parametrize("kind", ["reference", "foreign"])
def test_alpha_gradient_equals_autograd_through_the_two_path_binary_connect(kind):
    net, train, val = supernet_and_batches(kind, 7)
    method = frozen(get_method("proxyless")(net, get_method("proxyless").Hyperparameters(grad_clip=1e9), schedule=SCHEDULE))
    stats = method.step(train, val)
    alphas = {t: a.detach().clone().requires_grad_(True) for t, a in net.alphas().items()}
    z = {}
    for t, a in alphas.items():
        gates, pair = stats[V.SAMPLE_ONEHOT.path(cell=t)], stats[V.SAMPLE_PATHS.path(cell=t)].bool()
        assert torch.equal(pair.sum(-1), torch.full((net.num_edges,), 2)) and (gates[~pair] == 0).all()
        assert torch.equal(gates.sum(-1), torch.ones(net.num_edges, dtype=gates.dtype))
        p_pair = torch.softmax(a.masked_fill(~pair, float("-inf")), -1)
        z[t] = gates + p_pair - p_pair.detach()
    loss = F.cross_entropy(net(val[0], z), val[1])  # dense forward: every op computed, zero weight off the gate
    grads = torch.autograd.grad(loss, list(alphas.values()))
    for (t, a), g in zip(net.alphas().items(), grads):
        torch.testing.assert_close(a.grad, g, rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(stats["scalars/val_loss"], loss.detach())


def test_only_sampled_paths_are_computed_and_rescaling_keeps_unsampled_probabilities():
    net, train, val = supernet_and_batches("reference", 8)
    method = get_method("proxyless")(net, schedule=SCHEDULE)
    a_before = {t: a.detach().clone() for t, a in net.alphas().items()}
    p_before = {t: torch.softmax(a, -1) for t, a in a_before.items()}
    calls = []
    handles = [op.register_forward_hook(lambda m, i, o, key=(s.cell_index, s.edge_index, k): calls.append(key))
               for s in net.edge_specs() for k, op in enumerate(s.module.ops)]
    try:
        stats = method.step(train, val)
    finally:
        for h in handles:
            h.remove()
    # w step: one path per edge; α step: the two sampled paths per edge
    assert len(calls) == 3 * len(net.edge_specs())
    alpha_calls = set(calls[len(net.edge_specs()):])
    assert alpha_calls == {(s.cell_index, s.edge_index, k) for s in net.edge_specs()
                           for k in stats[V.SAMPLE_PATHS.path(cell=s.cell_type)][s.edge_index].nonzero().flatten().tolist()}
    for t, a in net.alphas().items():
        pair = stats[V.SAMPLE_PATHS.path(cell=t)].bool()
        p = torch.softmax(a.detach(), -1)
        assert not torch.allclose(p[pair], p_before[t][pair])
        torch.testing.assert_close(p[~pair], p_before[t][~pair], rtol=1e-12, atol=1e-15)
        # β1 = 0, no weight decay: α of unsampled paths does not move at all
        assert torch.equal(a.detach()[~pair], a_before[t][~pair])


def test_resume_continues_bit_identically():
    batches = [(reference_batch(s), reference_batch(s + 50)) for s in range(30, 33)]
    first = get_method("proxyless")(reference_supernet(10), schedule=SCHEDULE, seed=1)
    first.step(*batches[0])
    state = copy.deepcopy(first.state_dict())
    second = get_method("proxyless")(reference_supernet(11), schedule=SCHEDULE, seed=2)
    second.load_state_dict(state)
    for b in batches[1:]:
        s1, s2 = first.step(*b), second.step(*b)
        for path in s1:
            assert torch.equal(s1[path], s2[path]), path
    assert all(V.family_of(path) is not None for path in s1)
