"""SNAS: the composed α-gradient (1/τ)(diag Z − ZZᵀ)·C against autograd through the Gumbel-softmax
relaxation Z = softmax((α + G)/τ) itself, in float64, on nasdiag's supernet and on an adapted DARTS-code
supernet; single-level (the same backward gives ∂L/∂w); annealing; exact resume."""

import copy

import pytest
import torch
import torch.nn.functional as F

from nasdiag import vocabulary as V
from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network
from test_foreign_supernet import batch as foreign_batch, foreign_supernet

SCHEDULE = Schedule(epochs=3, steps_per_epoch=2)


def reference_supernet(seed=0):
    torch.manual_seed(seed)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()
    with torch.no_grad():
        for a in net.arch_parameters():
            a.normal_(0, 0.5)
    return net


def reference_batch(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def supernet_and_batches(kind, seed=0):
    if kind == "reference":
        return reference_supernet(seed), reference_batch(seed + 1), reference_batch(seed + 2)
    return foreign_supernet(seed)[0], foreign_batch(seed + 1), foreign_batch(seed + 2)


def frozen(method):
    """Keep this step's α.grad and w.grad for inspection: no optimizer updates, no clipping."""
    method.alpha_optimizer.step = lambda: None
    method.w_optimizer.step = lambda: None
    return method


@pytest.mark.parametrize("kind", ["reference", "foreign"])
def test_alpha_gradient_equals_autograd_through_the_gumbel_softmax(kind):
    net, train, _ = supernet_and_batches(kind)
    method = frozen(get_method("snas")(net, get_method("snas").Hyperparameters(tau0=0.7, grad_clip=1e9), schedule=SCHEDULE))
    stats = method.step(train)
    tau = float(stats["scalars/temperature"])
    assert tau == 0.7
    alphas = {t: a.detach().clone().requires_grad_(True) for t, a in net.alphas().items()}
    # the step's noise, recovered from its recorded sample: G' = τ log Z − α differs from G by a constant per
    # edge, to which softmax is blind, so softmax((α + G')/τ) is the step's relaxation as a function of α
    noise = {t: tau * torch.log(stats[V.ARCH_WEIGHTS.path(cell=t)]) - a.detach() for t, a in alphas.items()}
    z = {t: torch.softmax((a + noise[t]) / tau, -1) for t, a in alphas.items()}
    for t in z:
        torch.testing.assert_close(z[t].detach(), stats[V.ARCH_WEIGHTS.path(cell=t)], rtol=1e-12, atol=1e-14)
    loss = F.cross_entropy(net(train[0], z), train[1])
    weights = net.weight_parameters()
    grads = torch.autograd.grad(loss, list(alphas.values()) + weights, allow_unused=True)
    for (t, a), g in zip(net.alphas().items(), grads):
        torch.testing.assert_close(a.grad, g, rtol=1e-9, atol=1e-13)
    # single level: the same backward gave ∂L/∂w on the same (training) batch
    for w, g in zip(weights, grads[len(alphas):]):
        torch.testing.assert_close(w.grad if w.grad is not None else torch.zeros_like(w),
                                   g if g is not None else torch.zeros_like(w), rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(stats["scalars/train_loss"], loss.detach())


def test_temperature_anneals_and_entropy_is_that_of_p():
    net, train, _ = supernet_and_batches("reference", 1)
    method = get_method("snas")(net, schedule=SCHEDULE)
    assert method.temperature == 1.0  # SNAS default
    stats = method.step(train)
    p = torch.cat([torch.softmax(a.detach(), -1) for a in net.alphas().values()])
    torch.testing.assert_close(stats["scalars/entropy"], -(p * p.log()).sum(-1).mean())
    for epoch in range(3):
        method.epoch_end(epoch)
    assert method.temperature == pytest.approx(0.97 ** 3)
    assert method.step(train)["scalars/temperature"] == pytest.approx(0.97 ** 3)
    assert all(V.family_of(path) is not None for path in stats)


def test_resume_continues_bit_identically():
    batches = [reference_batch(s) for s in range(10, 13)]
    net = reference_supernet(2)
    first = get_method("snas")(net, schedule=SCHEDULE, seed=3)
    first.step(batches[0])
    first.epoch_end(0)
    state = copy.deepcopy(first.state_dict())
    second = get_method("snas")(reference_supernet(9), schedule=SCHEDULE, seed=4)
    second.load_state_dict(state)
    assert second.temperature == first.temperature == 0.97
    for b in batches[1:]:
        s1, s2 = first.step(b), second.step(b)
        for path in s1:
            assert torch.equal(s1[path], s2[path]), path
    for a, b in zip(first.network.state_dict().values(), second.network.state_dict().values()):
        assert torch.equal(a, b)
