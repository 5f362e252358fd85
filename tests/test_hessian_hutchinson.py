"""Mode ``hutchinson:<k>``: unbiased, exact where its control variate is, and spelled with an explicit k.

References are dense Hessians from reverse-over-reverse autograd (``torch.autograd.functional.hessian``,
right through train-mode BatchNorm), float64; statistical bounds come from the estimator's theory
(variance of one Rademacher probe of entry i: ``Σ_{j≠i} A_ij²``).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.edges import resolve_edges
from nasdiag.hessian import ARCH_MODES, WEIGHT_MODES, CurvatureError, arch_diag_hessian, diag_hessian
from nasdiag.hessian.arch_hutchinson import hutchinson_arch_diag
from nasdiag.supernet import Network

DT = torch.float64


def one_cell(train: bool):
    """One minimal cell of the reference supernet (5 edges × 8 ops, BatchNorm ending every op)."""
    torch.manual_seed(2)
    net = Network.minimal(4, 3, 1, in_channels=2, reductions=[]).to(DT)
    with torch.no_grad():
        for a in net.arch_parameters():
            a.normal_(0, 0.5)
    x, y = torch.randn(6, 2, 6, 6, dtype=DT), torch.randint(0, 3, (6,))
    if not train:
        net(x)
        net.eval()
    return net, x, y


def dense_z_hessian(net, x, y):
    """∂²L/∂Z² (40 × 40) over the cell's (E, K) mixing weights, Z = softmax(α), each edge its own Z."""
    z = net.softmax_weights()["normal"].detach()
    return torch.autograd.functional.hessian(lambda w: F.cross_entropy(net(x, [w]), y), z).reshape(z.numel(), z.numel())


def _flat(result, net):
    return torch.cat([result[e.name] for e in net.edge_specs()])


def test_exact_with_eval_batchnorm_for_any_k():
    # Eval-mode BN and piecewise-linear ops: each edge block of ∂²L/∂Z² is its Gauss-Newton block (the mixed op
    # is linear in Z_e and nothing downstream curves), so the control variate leaves no noise within an edge
    net, x, y = one_cell(train=False)
    dense = dense_z_hessian(net, x, y)
    got = arch_diag_hessian(net, F.cross_entropy, x, y, net.edge_specs(), mode="hutchinson:1", seed=5)
    torch.testing.assert_close(_flat(got, net), torch.diagonal(dense), rtol=1e-9, atol=1e-12)


def test_unbiased_with_train_batchnorm():
    # Train-mode BN: C misses the downstream normalizations' curvature, so each probe is noisy; the mean over
    # many probes must reach the exact diagonal within its standard error
    net, x, y = one_cell(train=True)
    exact = torch.diagonal(dense_z_hessian(net, x, y))
    specs = resolve_edges(net, net.edge_specs())
    est, stderr, _, _ = hutchinson_arch_diag(net, F.cross_entropy, x, y, specs, 48, generator=torch.Generator().manual_seed(0))
    est, stderr = _flat(est, net), _flat(stderr, net)
    scale = stderr.clamp_min(1e-12 * exact.abs().max())
    z = (est - exact).abs() / scale
    assert float(z.max()) < 5.0, float(z.max())  # 40 entries at |z| < 5: a false alarm has odds ~1e-5
    # the bound has power: the control variate's own diagonal (the GGN, biased here) fails it by far
    ggn = _flat(arch_diag_hessian(net, F.cross_entropy, x, y, net.edge_specs(), mode="ggn"), net)
    assert float(((ggn - exact).abs() / scale).max()) > 10  # measured 13


def test_weight_mode_is_unbiased_within_its_theoretical_error():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    x, y = torch.randn(10, 3, dtype=DT), torch.randint(0, 3, (10,))
    params = {n: p.detach() for n, p in net.named_parameters()}
    names = list(params)

    def loss(*flat):
        return F.cross_entropy(torch.func.functional_call(net, dict(zip(names, flat)), (x,)), y)

    blocks = torch.autograd.functional.hessian(loss, tuple(params.values()))
    H = torch.cat([torch.cat([blocks[i][j].reshape(params[names[i]].numel(), -1) for j in range(len(names))], 1)
                   for i in range(len(names))])
    k = 4000
    got = torch.cat([v.reshape(-1) for v in diag_hessian(net, F.cross_entropy, x, y, mode=f"hutchinson:{k}").values()])
    sd = ((H.square().sum(1) - torch.diagonal(H).square()) / k).sqrt()  # one probe: Σ_{j≠i} H_ij², over k probes
    z = (got - torch.diagonal(H)).abs() / sd
    assert float(z.max()) < 5.0, float(z.max())


def test_k_is_explicit_in_the_mode_name():
    assert "hutchinson:4" in ARCH_MODES and "hutchinson:16" in WEIGHT_MODES
    for bad in ("hutchinson", "hutchinson:0", "hutchinson:<k>", "hutchinson:x"):
        assert bad not in ARCH_MODES, bad
    net, x, y = one_cell(train=True)
    with pytest.raises(CurvatureError, match=r"needs k.*hutchinson:4") as err:
        arch_diag_hessian(net, F.cross_entropy, x, y, net.edge_specs(), mode="hutchinson")
    assert "\n" not in str(err.value)
    for bad in ("hutchinson:0", "hutchinson:-2", "hutchinson:x"):
        with pytest.raises(CurvatureError, match=rf"'{bad}' needs k.*>= 1"):
            diag_hessian(net, F.cross_entropy, x, y, mode=bad)


def test_k_has_one_spelling_so_a_resumed_record_compares_its_mode():
    """A record's ``hessian_mode`` is compared as a string on resume: "hutchinson:01" must not be a second
    name of "hutchinson:1"; it is refused, naming the spelling."""
    for other in ("hutchinson:01", " hutchinson:1", "Hutchinson:1", "hutchinson: 1"):
        assert other not in ARCH_MODES and other not in WEIGHT_MODES, other
    net, x, y = one_cell(train=False)
    with pytest.raises(CurvatureError, match=r"'hutchinson:01'; did you mean 'hutchinson:1'") as err:
        diag_hessian(net, F.cross_entropy, x, y, mode="hutchinson:01")
    assert "\n" not in str(err.value)


def test_search_config_and_probe_accept_the_mode():
    import nasdiag
    from nasdiag.search import SearchConfig

    SearchConfig(method="darts", dataset="digits", hessian_mode="hutchinson:2").validate()
    net, x, y = one_cell(train=False)
    probe = nasdiag.attach(net, hessian="hutchinson:1")
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    got = probe.hessian()
    torch.testing.assert_close(_flat(got, net), torch.diagonal(dense_z_hessian(net, x, y)), rtol=1e-9, atol=1e-12)
