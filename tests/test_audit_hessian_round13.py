"""Round-13 audit of nasdiag.hessian against own float64 references.

Every reference is built here from scratch: the dense Hessian of the loss by reverse-over-reverse autograd
(``torch.autograd.grad`` twice, the model called through ``torch.func.functional_call``), never ``torch.func.hessian``
and no nasdiag code on the reference side.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import diag_hessian

DT = torch.float64


def dense_diag(net, loss_fn, x, y):
    """``{name: diag ∂²L/∂θ²}`` of every parameter of ``net``, one dense reverse-over-reverse Hessian over all of them."""
    params = dict(net.named_parameters())
    sizes = [p.numel() for p in params.values()]
    flat = torch.cat([p.detach().reshape(-1) for p in params.values()]).requires_grad_(True)
    values = {n: t.view_as(p) for (n, p), t in zip(params.items(), torch.split(flat, sizes))}
    (g,) = torch.autograd.grad(loss_fn(torch.func.functional_call(net, values, (x,)), y), flat, create_graph=True)
    diag = torch.stack([torch.autograd.grad(g[i], flat, retain_graph=True)[0][i] for i in range(flat.numel())])
    return {n: d.view_as(p) for (n, p), d in zip(params.items(), torch.split(diag, sizes))}


def assert_close(got, ref, rtol=1e-10):
    """Entrywise within ``rtol`` of each tensor's largest reference entry."""
    assert list(got) == list(ref)
    for k in ref:
        scale = ref[k].abs().max().item()
        assert scale > 0, k
        err = (got[k] - ref[k]).abs().max().item()
        assert err <= rtol * scale, f"{k}: max error {err:.3e}, scale {scale:.3e}"


# -- exact on a chain of Linear layers whose Sequential has hooks -----------------------------------------------------

HOOKS = {
    "forward_hook_on_the_outer_sequential": lambda net: net.register_forward_hook(lambda m, i, o: 2 * o),
    "pre_hook_on_the_outer_sequential": lambda net: net.register_forward_pre_hook(lambda m, i: (3 * i[0],)),
    "forward_hook_on_a_nested_sequential": lambda net: net[0].register_forward_hook(lambda m, i, o: o.square()),
}


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_exact_on_a_linear_chain_whose_sequential_has_a_hook_runs_the_hook(hook):
    # mode='exact' takes the per-sample C.1.2-C.1.3 chain recursion for an nn.Sequential of Linear layers and
    # activations, calling the layers one by one; it refused hooked layers, but a hook on the Sequential holding them
    # (or on a nested one) never ran there, so the diagonal was that of another net (53-150% off), silently. The
    # dense Hessian of the hooked net is the reference; the hook changes it (checked).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 3)).to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    plain = dense_diag(net, F.cross_entropy, x, y)
    HOOKS[hook](net)
    ref = dense_diag(net, F.cross_entropy, x, y)
    assert any((plain[k] - ref[k]).abs().max() > 0.1 * ref[k].abs().max() for k in ref)
    assert_close(diag_hessian(net, F.cross_entropy, x, y, mode="exact"), ref)
