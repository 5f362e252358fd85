"""Stacked Hessian-vector products are checked against a plain one before they are trusted.

torch's legacy vmap behind ``autograd.grad(..., is_grads_batched=True)`` has a wrong double-backward rule for
``F.group_norm(x, 1)`` when the batch size equals the channel count (torch 2.13): the stacked products come out
about 100% off, without an error. The exact modes must still return the true diagonal, which is checked here
against products taken one at a time with plain autograd (float64)."""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import diag_hessian
from nasdiag.hessian._hvp import HessianVectorProduct

DT = torch.float64


def _one_at_a_time_diagonal(loss_of, p):
    p = p.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss_of(p), p, create_graph=True)
    flat = g.reshape(-1)
    return torch.stack([torch.autograd.grad(flat[i], p, retain_graph=True)[0].reshape(-1)[i] for i in range(flat.numel())])


def test_stacked_products_through_a_one_group_norm_are_the_plain_ones():
    torch.manual_seed(0)
    z, w = torch.randn(6, 6, 5, 5, dtype=DT), torch.randn(6, 6, 5, 5, dtype=DT)
    b = torch.randn(6, dtype=DT, requires_grad=True)
    loss = (torch.tanh(F.group_norm(z + b[None, :, None, None], 1)) * w).sum()
    # torch's own stacked double backward (wrong here in torch 2.13): what the check guards against
    raw = torch.autograd.grad(torch.autograd.grad(loss, b, create_graph=True)[0], b, torch.eye(6, dtype=DT),
                              retain_graph=True, is_grads_batched=True)[0]
    hvp = HessianVectorProduct(loss, [b])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stacked = hvp(torch.eye(6, dtype=DT))
    plain = torch.stack([hvp(e) for e in torch.eye(6, dtype=DT)])
    torch.testing.assert_close(stacked, plain, rtol=1e-12, atol=1e-14)
    if not torch.allclose(raw, plain, rtol=1e-8, atol=1e-10):  # where torch is wrong, the fallback says so
        assert any("disagree with a plain one" in str(w.message) for w in caught)


def test_the_exact_weight_diagonal_through_a_one_group_norm():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(1, 4), nn.Tanh(), nn.Flatten(),
                        nn.Linear(4 * 25, 3)).to(DT)
    x, y = torch.randn(4, 3, 5, 5, dtype=DT), torch.randint(0, 3, (4,))  # batch size = channel count
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = diag_hessian(net, F.cross_entropy, x, y, mode="exact", params=["1.weight", "1.bias", "0.bias"])
    for name in ("1.weight", "1.bias", "0.bias"):
        def loss_of(p, name=name):
            return F.cross_entropy(torch.func.functional_call(net, {name: p}, (x,)), y)

        want = _one_at_a_time_diagonal(loss_of, net.get_parameter(name))
        torch.testing.assert_close(got[name].reshape(-1), want, rtol=1e-9, atol=1e-12, msg=name)
