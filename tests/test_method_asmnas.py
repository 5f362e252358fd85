"""ASM-NAS: the attention module (eq 4.3-4.5) against a hand-written reference, C = ∂L/∂a against autograd
through an explicit re-implementation of eq 4.2 (float64), the probe's costs on the attention supernet,
selection counts on a hand-made case, exact resume and a short search run."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nasdiag import vocabulary as V
from nasdiag.errors import ConfigError
from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network
from nasdiag.supernet.attention import (ArchitectureAttention, attach_attention, attention_weights, collect_attention,
                                        mean_embedding)

SCHEDULE = Schedule(epochs=3, steps_per_epoch=2)


def supernet(seed=0):
    torch.manual_seed(seed)
    return Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()


def batch(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def test_attention_module_is_eq_4_4_and_4_5():
    torch.manual_seed(0)
    module = ArchitectureAttention(8, (5, 6, 7)).double()
    e = torch.randn(3, 8, dtype=torch.float64)
    lin = [m for m in module.net if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in lin] == [(5, 8), (6, 5), (7, 6), (8, 7)]
    h = e
    for m in lin[:3]:
        h = torch.relu(h @ m.weight.T + m.bias)
    z = torch.sigmoid(h @ lin[3].weight.T + lin[3].bias)
    expected = torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)
    a = module(e)
    torch.testing.assert_close(a, expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(a.sum(-1), torch.ones(3, dtype=torch.float64))
    # eq 4.3: the mean over (C, H, W) per sample
    ys = [torch.randn(3, 2, 4, 4, dtype=torch.float64) for _ in range(8)]
    torch.testing.assert_close(mean_embedding(ys)[:, 5], ys[5].sum((1, 2, 3)) / 32)
    with pytest.raises(ValueError, match="3 positive hidden widths"):
        ArchitectureAttention(8, (4, 4))


def test_theta_are_network_weights_not_architecture_parameters():
    net = supernet()
    method = get_method("asmnas")(net, schedule=SCHEDULE)
    theta = {id(p) for n, p in net.named_parameters() if ".attention." in n}
    assert theta and theta <= {id(p) for p in net.weight_parameters()}
    assert not theta & {id(p) for p in net.arch_parameters()}
    assert theta <= {id(p) for g in method.w_optimizer.param_groups for p in g["params"]}


def test_cost_of_the_attention_equals_autograd_through_a_perturbation_of_a():
    """C = ∂L/∂a per sample: autograd of L(a + δ) at δ = 0, δ (B, K) added to every edge's attention output.

    a of later edges depends on earlier nodes, so this is the total derivative (the wiring cost
    <∂L/∂x_j, o^k(x_i)> with the downstream attention responding), not the one at frozen later a."""
    net = supernet(1)
    method = get_method("asmnas")(net, schedule=SCHEDULE)
    x, y = batch(3)
    loss, _, attn, costs = method.attention_cost(x, y, train_weights=False)
    deltas = [torch.zeros(net.num_edges, 6, 8, dtype=torch.float64, requires_grad=True) for _ in net.cells]
    try:
        for k, cell in enumerate(net.cells):
            for e, mixed in enumerate(cell.edges):
                mixed.attention.forward = (lambda emb, f=mixed.attention.forward, d=deltas[k][e]: f(emb) + d)
        ref_loss = F.cross_entropy(net(x, attention_weights(net)), y)
    finally:
        for cell in net.cells:
            for mixed in cell.edges:
                del mixed.attention.forward
    grads = torch.autograd.grad(ref_loss, deltas)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-13, atol=0)
    for a, c, g in zip(attn, costs, grads):
        assert c.shape == a.shape == (net.num_edges, 6, 8)
        torch.testing.assert_close(a.sum(-1), torch.ones(net.num_edges, 6, dtype=torch.float64))
        torch.testing.assert_close(c, g, rtol=1e-10, atol=1e-15)
    assert max(float(c.abs().max()) for c in costs) > 1e-6  # not trivially zero


def test_the_probe_costs_on_the_attention_supernet_are_dL_da():
    import nasdiag

    net = supernet(2)
    method = get_method("asmnas")(net, schedule=SCHEDULE)
    method.probe = nasdiag.attach(net)
    x, y = batch(4)
    _, _, _, costs = method.attention_cost(x, y, train_weights=False, observe=False)
    probed = method.probe.costs(per_sample=True)
    for k, c in enumerate(costs):
        for e in range(net.num_edges):
            torch.testing.assert_close(probed[f"cells.{k}.edges.{e}"], c[e], rtol=1e-9, atol=1e-14)


def test_selection_counts_per_sample_argmax_on_a_hand_made_case():
    net = supernet(3)
    method = get_method("asmnas")(net, schedule=SCHEDULE)
    K, E = len(net.primitives), net.num_edges
    # hand-made attention: all FC weights zero, so z = σ(bias of the last layer): op 2 wins on every sample
    for cell in net.cells:
        for mixed in cell.edges:
            lin = [m for m in mixed.attention.net if isinstance(m, torch.nn.Linear)]
            with torch.no_grad():
                for m in lin:
                    m.weight.zero_()
                    m.bias.zero_()
                lin[3].bias[2] = 5.0
                lin[3].bias[5] = 4.0
    x, y = batch(5, n=7)
    counts = method.evaluate([(x[:4], y[:4]), (x[4:], y[4:])])
    c = method.selection_counts
    n_normal = sum(ce.cell_type == "normal" for ce in net.cells)
    expected = torch.zeros(E, K, dtype=torch.int64)
    expected[:, 2] = 7 * n_normal
    torch.testing.assert_close(c["normal"], expected)
    assert 0 <= counts["acc"] <= 1
    p = method.probabilities()["normal"]
    torch.testing.assert_close(p, (expected / expected.sum(-1, keepdim=True)).double())
    stats = method.epoch_statistics()
    n_reduce = len(net.cells) - n_normal
    assert torch.equal(stats[V.ATTENTION_COUNT.path(cell="reduce")].sum(-1), torch.full((E,), 7 * n_reduce))
    # the genotype is the DARTS rule on these frequencies: op 2 on every kept edge
    assert {op for op, _ in method.genotype().normal} == {net.primitives[2]}


def test_counts_are_per_sample_argmaxes_summed_over_samples_and_cells():
    net = supernet(4)
    method = get_method("asmnas")(net, schedule=SCHEDULE)
    torch.manual_seed(1)
    with torch.no_grad():  # a sharp, sample-dependent attention, so that samples disagree
        for name, p in net.named_parameters():
            if ".attention." in name:
                p.normal_(0, 3.0)
    x, y = batch(6, n=9)
    batches = [(x[:5], y[:5]), (x[5:], y[5:])]  # BatchNorm uses batch statistics: the same batches on both sides
    winners = []
    for xb, _ in batches:
        with collect_attention(net) as store, torch.no_grad():
            net(xb, attention_weights(net))
            winners.append([[a.argmax(-1) for a in row] for row in store])
    method.evaluate(batches)
    K = len(net.primitives)
    for t in ("normal", "reduce"):
        expected = sum(torch.stack([torch.bincount(w, minlength=K) for w in wb[k]])
                       for wb in winners for k, cell in enumerate(net.cells) if cell.cell_type == t)
        assert torch.equal(method.selection_counts[t], expected), t
    assert ((method.selection_counts["normal"] > 0).sum(-1) > 1).any()  # some edge split by sample


def test_resume_continues_bit_identically():
    batches = [batch(s) for s in range(10, 13)]
    first = get_method("asmnas")(supernet(2), schedule=SCHEDULE, seed=3)
    first.step(batches[0])
    first.evaluate([batches[0]])
    first.epoch_end(0)
    state = copy.deepcopy(first.state_dict())
    second = get_method("asmnas")(supernet(9), schedule=SCHEDULE, seed=4)
    second.load_state_dict(state)
    for b in batches[1:]:
        s1, s2 = first.step(b), second.step(b)
        for path in s1:
            assert torch.equal(s1[path], s2[path]), path
    for a, b in zip(first.network.state_dict().values(), second.network.state_dict().values()):
        assert torch.equal(a, b)


def test_hyperparameters_give_one_line_errors():
    cls = get_method("asmnas")
    with pytest.raises(ConfigError) as err:
        cls.Hyperparameters.parse(["w_lr=-1"], "asmnas")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        cls.Hyperparameters.parse(["attention_hidden=0"], "asmnas")
    assert "\n" not in str(err.value)
    assert cls.Hyperparameters.parse(["attention_hidden=4"], "asmnas").attention_hidden == 4
    assert cls.Hyperparameters().w_lr == 0.025


@pytest.mark.slow
def test_search_run_records_attention_and_counts(tmp_path):
    from nasdiag.record import load
    from nasdiag.search import SearchConfig, run

    result = run(SearchConfig(method="asmnas", C=2, layers=3, steps=2, batch_size=240, epochs=1, diagnostics=("cost",),
                              progress=False, record=str(tmp_path / "asm.h5")))
    rec = load(str(tmp_path / "asm.h5"))
    S = 719 // 240
    mean = rec[V.ATTENTION_MEAN.path(cell="normal")]
    assert mean.shape == (S, 5, 8)
    np.testing.assert_allclose(mean.sum(-1), 1.0, rtol=1e-5)
    counts = rec[V.ATTENTION_COUNT.path(cell="normal")]
    last = np.flatnonzero(rec[f"valid/{V.ATTENTION_COUNT.path(cell='normal')}"])[-1]
    assert (counts[last].sum(-1) == counts[last].sum(-1)[0]).all() and counts[last].sum() > 0
    assert len(result.genotype.normal) == 4
