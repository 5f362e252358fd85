"""Round-12 audit of nasdiag.hessian against own float64 references (dense reverse-over-reverse autograd Hessians).

Every reference here is built from scratch: ``torch.autograd.functional.hessian`` of the loss written out with
``torch.func.functional_call`` (no nasdiag code on the reference side).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.functional import hessian

from nasdiag.hessian import diag_hessian


def _dense_diag(net, loss_fn, x, y, name):
    """The diagonal of the dense float64 Hessian of ``loss_fn(net(x), y)`` w.r.t. the parameter ``name``."""
    params = {n: p.detach() for n, p in net.named_parameters()}

    def loss_of(p):
        return loss_fn(torch.func.functional_call(net, {**params, name: p}, (x,)), y)

    return torch.diagonal(hessian(loss_of, params[name].clone()).reshape(params[name].numel(), -1)).reshape(params[name].shape)


def test_a_bias_before_an_eval_batch_norm_whose_tracking_flag_was_turned_off_keeps_its_curvature():
    # nn.BatchNorm* decides batch statistics by `training or (running buffers are None)`: an eval-mode layer whose
    # track_running_stats was switched off after construction still holds its buffers and normalizes with them, an
    # affine map. The homogeneity analysis read the flag instead, called the layer scale-invariant and gave the bias
    # before it exactly zero curvature in diag/approx (true diagonal 2·(w γ/σ)², nonzero). One output under MSE
    # keeps the output Hessian a scalar, so the recursions are exact on this chain and must equal the dense diagonal.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    net.train()
    with torch.no_grad():
        net(x * 2 + 1)  # running statistics that differ from the batch's
    net.eval()
    net[1].track_running_stats = False
    stats = (net[1].running_mean.clone(), net[1].running_var.clone())
    dense = _dense_diag(net, F.mse_loss, x, y, "0.bias")
    assert dense.abs().min() > 1e-3  # the check below can fail: the true curvature is far from zero
    for mode in ("exact", "diag", "approx"):
        got = diag_hessian(net, F.mse_loss, x, y, mode=mode)["0.bias"]
        torch.testing.assert_close(got, dense, rtol=1e-10, atol=1e-12, msg=f"mode={mode}")
    assert torch.equal(net[1].running_mean, stats[0]) and torch.equal(net[1].running_var, stats[1])
    assert all(p.grad is None for p in net.parameters())
    # the same layer in training mode removes the bias: zero in the recursions, round-off in the dense Hessian
    net.train()
    dense_train = _dense_diag(net, F.mse_loss, x, y, "0.bias")
    assert dense_train.abs().max() < 1e-12
    for mode in ("diag", "approx"):
        assert torch.equal(diag_hessian(net, F.mse_loss, x, y, mode=mode)["0.bias"], torch.zeros(4, dtype=torch.float64))
