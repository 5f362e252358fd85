"""Spectrum of the α-Hessian: Lanczos / power iteration and Hutchinson, on dense matrices of known
spectrum and on small supernets against dense autograd Hessians; RobustDARTS's early-stop rule."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from nasdiag.hessian.spectrum import (
    EigenvalueEarlyStop,
    diagonal_from_hvp,
    eigenvalues_from_hvp,
    hessian_eigenvalues,
    hutchinson_diagonal,
    hutchinson_trace,
    trace_from_hvp,
)
from nasdiag.supernet import Network


def symmetric_with_spectrum(eigs, seed=0):
    g = torch.Generator().manual_seed(seed)
    eigs = torch.as_tensor(eigs, dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), dtype=torch.float64, generator=g))
    return Q @ torch.diag(eigs) @ Q.T


SPECTRA = {
    # indefinite, the most negative eigenvalue is the largest in size: algebraic != magnitude
    "indefinite": [-9.0, -3.0, -0.5, 0.0, 0.25, 1.0, 2.0, 4.0] + [0.1 * i for i in range(-10, 12)],
    "psd": [0.0] * 5 + [0.5 * i for i in range(1, 20)] + [12.0],
    "negative_definite": [-1.0 - i for i in range(25)],
    # a top eigenvalue of multiplicity 2 and a large null space (as α's softmax shift invariance gives)
    "repeated": [5.0, 5.0, 3.0, 2.0] + [0.0] * 10 + [-1.0],
}


@pytest.mark.parametrize("name", sorted(SPECTRA))
@pytest.mark.parametrize("k", [1, 3])
def test_lanczos_matches_eigvalsh(name, k):
    A = symmetric_with_spectrum(SPECTRA[name])
    truth = torch.linalg.eigvalsh(A)
    res = eigenvalues_from_hvp(lambda v: A @ v, A.shape[0], k=k, tol=1e-12, seed=1)
    assert res.converged and res.method == "lanczos"
    torch.testing.assert_close(res.eigenvalues, truth.flip(0)[:k], rtol=0, atol=1e-9)
    assert res.largest_algebraic == pytest.approx(truth[-1].item(), abs=1e-9)
    assert res.smallest_algebraic == pytest.approx(truth[0].item(), abs=1e-9)
    magnitude = truth[truth.abs().argmax()].item()
    assert res.largest_magnitude == pytest.approx(magnitude, abs=1e-9)
    assert res.iterations <= A.shape[0]


def test_largest_algebraic_and_magnitude_are_reported_separately():
    A = symmetric_with_spectrum(SPECTRA["indefinite"])
    for method in ("lanczos", "power"):
        res = eigenvalues_from_hvp(lambda v: A @ v, A.shape[0], method=method, tol=1e-10, iters=5000)
        assert res.converged
        assert res.largest_algebraic == pytest.approx(4.0, abs=1e-6)
        assert res.largest_magnitude == pytest.approx(-9.0, abs=1e-6)


@pytest.mark.parametrize("name", ["psd", "negative_definite", "indefinite"])
def test_power_iteration_matches_eigvalsh(name):
    A = symmetric_with_spectrum(SPECTRA[name], seed=2)
    truth = torch.linalg.eigvalsh(A)
    res = eigenvalues_from_hvp(lambda v: A @ v, A.shape[0], method="power", tol=1e-10, iters=20000)
    assert res.converged and res.method == "power"
    # residual tol·|λ| bounds the eigenvalue error by (tol·|λ|)²/gap for the Rayleigh quotient
    assert res.largest_algebraic == pytest.approx(truth[-1].item(), abs=1e-7)
    assert res.largest_magnitude == pytest.approx(truth[truth.abs().argmax()].item(), abs=1e-7)


def test_lanczos_stops_early_when_converged_and_flags_a_short_budget():
    eigs = [100.0] + [1.0 + 0.01 * i for i in range(200)]  # well separated top eigenvalue
    A = symmetric_with_spectrum(eigs, seed=3)
    res = eigenvalues_from_hvp(lambda v: A @ v, A.shape[0], tol=1e-8)
    assert res.converged and res.iterations < 40
    assert res.largest_algebraic == pytest.approx(100.0, abs=1e-6)
    clustered = symmetric_with_spectrum([1.0 + 1e-3 * i for i in range(200)], seed=4)
    short = eigenvalues_from_hvp(lambda v: clustered @ v, 200, tol=1e-12, iters=5)
    assert not short.converged and short.iterations == 5


def test_model_level_functions_also_take_a_plain_operator():
    A = symmetric_with_spectrum(SPECTRA["indefinite"], seed=8)
    n = A.shape[0]
    truth = torch.linalg.eigvalsh(A)
    for res in (hessian_eigenvalues(lambda v: A @ v, n, k=2, tol=1e-12), hessian_eigenvalues(hvp=lambda v: A @ v, dim=n, k=2, tol=1e-12)):
        torch.testing.assert_close(res.eigenvalues, truth.flip(0)[:2], rtol=0, atol=1e-9)
    core = trace_from_hvp(lambda v: A @ v, n, samples=50, seed=2)
    assert hutchinson_trace(lambda v: A @ v, n, samples=50, seed=2).estimate == pytest.approx(core.estimate, abs=1e-12)
    diag = hutchinson_diagonal(hvp=lambda v: A @ v, dim=n, samples=50, seed=2)
    torch.testing.assert_close(diag.estimate, diagonal_from_hvp(lambda v: A @ v, n, samples=50, seed=2).estimate)
    with pytest.raises(ValueError, match="dim"):
        hessian_eigenvalues(hvp=lambda v: A @ v)
    with pytest.raises(ValueError, match="not both"):
        hessian_eigenvalues(nn.Linear(2, 2), hvp=lambda v: A @ v, dim=n)
    with pytest.raises(ValueError, match="loss_fn, inputs and targets"):
        hessian_eigenvalues(nn.Linear(2, 2))


def test_core_rejects_bad_arguments():
    A = torch.eye(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="k must be"):
        eigenvalues_from_hvp(lambda v: A @ v, 4, k=5)
    with pytest.raises(ValueError, match="method='power' finds one"):
        eigenvalues_from_hvp(lambda v: A @ v, 4, k=2, method="power")
    with pytest.raises(ValueError, match="method must be"):
        eigenvalues_from_hvp(lambda v: A @ v, 4, method="arnoldi")
    with pytest.raises(ValueError, match="shape"):
        eigenvalues_from_hvp(lambda v: v[:2], 4)
    with pytest.raises(FloatingPointError, match="NaN"):
        eigenvalues_from_hvp(lambda v: v * float("nan"), 4)
    with pytest.raises(ValueError, match="samples"):
        trace_from_hvp(lambda v: A @ v, 4, samples=1)


# -- Hutchinson on a dense matrix: tolerances from the estimator's variance -------------------------


def test_hutchinson_trace_within_clt_bound_and_stderr_matches_theory():
    A = symmetric_with_spectrum([float(i) for i in range(-10, 30)], seed=5)
    n = 2000
    est = trace_from_hvp(lambda V: V @ A, A.shape[0], samples=n, seed=0, batch_size=100)
    # one probe: Var(zᵀAz) = 2 Σ_{i≠j} A_ij² for Rademacher z
    sigma = math.sqrt(2 * ((A**2).sum() - (A.diagonal() ** 2).sum()).item())
    # CLT, 5 standard errors (two-sided p ≈ 6e-7); seeded, so the outcome is fixed
    assert abs(est.estimate - A.trace().item()) <= 5 * sigma / math.sqrt(n)
    # the reported standard error estimates σ/√n. zᵀAz is a degree-2 Rademacher chaos, so by
    # hypercontractivity E X⁴ ≤ 81 σ⁴ and the sample sd has relative sd ≤ √(80 / 4n) = 0.1: allow 4 of those
    assert est.stderr == pytest.approx(sigma / math.sqrt(n), rel=0.4)
    assert est.samples == n


def test_hutchinson_trace_is_exact_for_a_diagonal_matrix():
    # z ⊙ z = 1, so every probe returns the trace exactly: zero variance, zero standard error
    D = torch.diag(torch.linspace(-3, 7, 12, dtype=torch.float64))
    est = trace_from_hvp(lambda v: D @ v, 12, samples=5, seed=3)
    assert est.estimate == pytest.approx(D.trace().item(), abs=1e-12)
    assert est.stderr == pytest.approx(0.0, abs=1e-12)


def test_hutchinson_diagonal_within_hoeffding_bound():
    A = symmetric_with_spectrum([float(i) for i in range(-10, 30)], seed=6)
    dim, n, delta = A.shape[0], 1500, 1e-6
    est = diagonal_from_hvp(lambda v: A @ v, dim, samples=n, seed=1)
    # entry i of one probe is A_ii + Σ_{j≠i} A_ij z_i z_j: a Rademacher sum with variance proxy
    # σ_i² = Σ_{j≠i} A_ij². Hoeffding + a union bound over the dim entries: failure probability ≤ delta.
    sigma = ((A**2).sum(1) - A.diagonal() ** 2).sqrt()
    bound = sigma * math.sqrt(2 * math.log(2 * dim / delta) / n)
    assert bool(((est.estimate - A.diagonal()).abs() <= bound).all())
    assert est.stderr == pytest.approx(sigma / math.sqrt(n), rel=0.25)
    # the error shrinks with the number of probes (same probes, the first 100 of them)
    few = diagonal_from_hvp(lambda v: A @ v, dim, samples=100, seed=1)
    assert (few.estimate - A.diagonal()).norm() > (est.estimate - A.diagonal()).norm()


def test_hutchinson_is_reproducible_per_seed_and_batch_size_does_not_change_probes():
    A = symmetric_with_spectrum([float(i) for i in range(8)], seed=7)
    a = trace_from_hvp(lambda v: A @ v, 8, samples=30, seed=4)
    b = trace_from_hvp(lambda V: V @ A, 8, samples=30, seed=4, batch_size=7)
    c = trace_from_hvp(lambda v: A @ v, 8, samples=30, seed=5)
    assert a.estimate == pytest.approx(b.estimate, abs=1e-12) and a.estimate != c.estimate


# -- on models: against the dense autograd Hessian -------------------------------------------------


PRIMS = ["none", "skip_connect", "max_pool_3x3", "dil_conv_3x3"]


@pytest.fixture(scope="module")
def supernet_case():
    """A tiny float64 DARTS supernet (BatchNorm in train mode), a batch, and the dense Hessian of the
    loss w.r.t. (alphas_normal, alphas_reduce), joint, as autograd computes it."""
    torch.manual_seed(0)
    net = Network.minimal(2, 3, 2, in_channels=1, reductions=[1], primitives=PRIMS, alpha_init_scale=1.0).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 1, 4, 4, dtype=torch.float64, generator=g), torch.randint(0, 3, (3,), generator=g)

    def loss(a_normal, a_reduce):
        weights = {"normal": torch.softmax(a_normal, -1), "reduce": torch.softmax(a_reduce, -1)}
        return F.cross_entropy(net(x, weights=weights), y)

    alphas = tuple(a.detach() for a in net.arch_parameters())
    blocks = torch.autograd.functional.hessian(loss, alphas)
    n = [a.numel() for a in alphas]
    H = torch.cat([torch.cat([blocks[i][j].reshape(n[i], n[j]) for j in range(2)], 1) for i in range(2)])
    return net, x, y, H


def test_hessian_eigenvalues_of_supernet_alpha_match_eigvalsh(supernet_case):
    net, x, y, H = supernet_case
    truth = torch.linalg.eigvalsh(H)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    res = hessian_eigenvalues(net, F.cross_entropy, x, y, k=3, tol=1e-10)
    assert res.converged
    torch.testing.assert_close(res.eigenvalues, truth.flip(0)[:3], rtol=1e-7, atol=1e-10)
    assert res.largest_magnitude == pytest.approx(truth[truth.abs().argmax()].item(), rel=1e-7, abs=1e-10)
    for key, value in before.items():  # BatchNorm running statistics untouched
        assert torch.equal(net.state_dict()[key], value), key
    assert all(p.grad is None for p in net.parameters())
    with torch.no_grad():  # e.g. from an evaluation loop
        again = hessian_eigenvalues(net, F.cross_entropy, x, y, k=3, tol=1e-10)
    torch.testing.assert_close(again.eigenvalues, res.eigenvalues, rtol=1e-9, atol=1e-12)


def test_hutchinson_on_supernet_alpha_within_variance_bounds(supernet_case):
    net, x, y, H = supernet_case
    n = 200
    before = {k: v.clone() for k, v in net.state_dict().items()}
    trace = hutchinson_trace(net, F.cross_entropy, x, y, samples=n, seed=0, batch_size=100)
    sigma = math.sqrt(2 * ((H**2).sum() - (H.diagonal() ** 2).sum()).item())
    assert abs(trace.estimate - H.trace().item()) <= 5 * sigma / math.sqrt(n)

    diag = hutchinson_diagonal(net, F.cross_entropy, x, y, samples=n, seed=0, batch_size=100)
    shapes = [tuple(a.shape) for a in net.arch_parameters()]
    assert [tuple(t.shape) for t in diag.estimate] == shapes == [tuple(t.shape) for t in diag.stderr]
    flat = torch.cat([t.flatten() for t in diag.estimate])
    sigma_i = ((H**2).sum(1) - H.diagonal() ** 2).sqrt()
    bound = sigma_i * math.sqrt(2 * math.log(2 * H.shape[0] / 1e-6) / n)
    assert bool(((flat - H.diagonal()).abs() <= bound + 1e-12).all())
    for key, value in before.items():
        assert torch.equal(net.state_dict()[key], value), key


def test_params_can_be_any_tensors_of_any_model():
    torch.manual_seed(3)
    mlp = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    with pytest.raises(ValueError, match="arch_parameters"):
        hessian_eigenvalues(mlp, F.cross_entropy, x, y)
    params = dict(mlp.named_parameters())

    def loss(*flat):
        out = torch.func.functional_call(mlp, dict(zip(params, flat)), (x,))
        return F.cross_entropy(out, y)

    blocks = torch.autograd.functional.hessian(loss, tuple(p.detach() for p in params.values()))
    n = [p.numel() for p in params.values()]
    H = torch.cat([torch.cat([blocks[i][j].reshape(n[i], n[j]) for j in range(len(n))], 1) for i in range(len(n))])
    truth = torch.linalg.eigvalsh(H)
    res = hessian_eigenvalues(mlp, F.cross_entropy, x, y, params=params, k=2, tol=1e-10)
    torch.testing.assert_close(res.eigenvalues, truth.flip(0)[:2], rtol=1e-7, atol=1e-10)
    assert res.smallest_algebraic == pytest.approx(truth[0].item(), abs=1e-7)  # a weight Hessian is indefinite here
    frozen = [p.detach() for p in mlp.parameters()]
    with pytest.raises(ValueError, match="does not require grad"):
        hessian_eigenvalues(mlp, F.cross_entropy, x, y, params=frozen)


# -- RobustDARTS early stop ------------------------------------------------------------------------


def test_early_stop_fires_on_growth_and_rolls_back_k_epochs():
    rule = EigenvalueEarlyStop()  # threshold 0.75, window 5
    values = [1.0] * 10 + [2.0] * 10
    decisions = [rule.update(v) for v in values]
    # λ̄(i) = mean over epochs i-4..i. i = 10: λ̄(10) = 1.2, λ̄(5) = 1 -> 1 < 0.75·1.2 = 0.9? no.
    # i = 11: λ̄(11) = (3·1 + 2·2)/5 = 1.4, λ̄(6) = 1 -> 1 < 1.05 -> stop, roll back to epoch 6.
    first = next(d for d in decisions if d.stop)
    assert first.epoch == 11 and first.rollback_epoch == 6
    assert first.previous_mean == pytest.approx(1.0) and first.current_mean == pytest.approx(1.4)
    assert "roll back to epoch 6" in first.reason
    assert all(not d.stop for d in decisions[:11]) and all(d.stop for d in decisions[11:])
    assert rule.stopped and rule.stop_epoch == 11 and rule.rollback_epoch == 6
    assert "collecting" in decisions[0].reason


def test_early_stop_does_not_fire_on_flat_decreasing_or_slow_growth():
    for values in ([3.0] * 40, [10.0 - 0.2 * i for i in range(40)], [1.0 * 1.02**i for i in range(40)]):
        rule = EigenvalueEarlyStop()
        assert not any(rule.update(v).stop for v in values)
    # 1.02 per epoch: the 5-epoch ratio is 1.02^-5 ≈ 0.906; a threshold of 0.95 catches it
    strict = EigenvalueEarlyStop(threshold=0.95)
    assert any(strict.update(1.02**i).stop for i in range(40))


def test_early_stop_window_threshold_start_epoch_and_epoch_labels():
    values = [1.0] * 4 + [3.0] * 4
    rule = EigenvalueEarlyStop(window=2)
    stops = [rule.update(v, epoch=2 * i).stop for i, v in enumerate(values)]  # an eigenvalue every 2 epochs
    # value 4 (epoch 8): λ̄ = mean(1, 3) = 2 vs the window before, mean(1, 1) = 1 -> 1 < 1.5: stop,
    # roll back 2 values (4 epochs) to epoch 4
    assert stops.index(True) == 4 and rule.stop_epoch == 8 and rule.rollback_epoch == 4
    late = EigenvalueEarlyStop(window=2, start_epoch=5)  # the rule fires at epoch 4, but is not asked yet
    stops = [late.update(v).stop for v in values]
    assert stops.index(True) == 5 and late.rollback_epoch == 3
    too_late = EigenvalueEarlyStop(window=2, start_epoch=7)  # by epoch 7 both windows are at 3: no growth
    assert not any(too_late.update(v).stop for v in values)
    # growth from a non-positive mean is growth (the ratio form would flip its sign)
    signed = EigenvalueEarlyStop(window=1)
    assert not signed.update(-1.0).stop and signed.update(0.5).stop
    shrinking_negative = EigenvalueEarlyStop(window=1)
    assert not shrinking_negative.update(-1.0).stop and not shrinking_negative.update(-2.0).stop


def test_early_stop_rejects_bad_input_and_resets():
    with pytest.raises(ValueError, match="threshold"):
        EigenvalueEarlyStop(threshold=1.5)
    with pytest.raises(ValueError, match="window"):
        EigenvalueEarlyStop(window=0)
    rule = EigenvalueEarlyStop(window=1)
    with pytest.raises(ValueError, match="not finite"):
        rule.update(float("nan"))
    rule.update(1.0, epoch=3)
    with pytest.raises(ValueError, match="increase"):
        rule.update(1.0, epoch=3)
    assert rule.update(5.0).stop
    rule.reset()
    assert not rule.stopped and rule.history == [] and not rule.update(5.0).stop
