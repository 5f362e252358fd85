"""``diag_hessian`` modes ``diag`` and ``approx``: the parts that must be exact, checked against torch.func.

* The diagonal recursion (C.1.4-C.1.5, C.2.1-C.2.3) is exact for the last FC layer under any per-sample
  loss (only the diagonal of the loss Hessian reaches it), and for every layer whenever the Hessian
  stays diagonal down to it: elementwise ops, slices, concatenations, max pooling and constant
  products between an elementwise (MSE) loss and the layer, on a DAG with fan-outs.
* The feature-mean approximation (C.2.4-C.2.5) is exact for the last layer when the pre-activation
  Hessian is constant per channel (MSE).
Their errors elsewhere are measured in docs/hessian.md, not asserted.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import NormRule, diag_hessian
from test_hessian_weights_reference import DT, assert_rel_close, func_diag_hessian


def mse_to(target):
    return lambda o, t: F.mse_loss(o, t, reduction="mean")


def ce_sum(o, t):
    return F.cross_entropy(o, t, reduction="sum")


class WithBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.AvgPool2d(2))
        self.side = nn.Conv2d(2, 3, 1, stride=2)
        self.fc = nn.Linear(27, 4)

    def forward(self, x):
        return self.fc((self.body(x) + self.side(x)[:, :, :3, :3]).flatten(1))


NETS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)), (5,), "fc", "2"),
    "dag_bn": (WithBN, (2, 6, 6), "fc", "fc"),
    "conv1d_bn": (lambda: nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.BatchNorm1d(3), nn.ReLU(), nn.MaxPool1d(2),
                                        nn.Conv1d(3, 3, 3, padding=2, dilation=2), nn.Tanh(), nn.AdaptiveAvgPool1d(2),
                                        nn.Flatten(), nn.Linear(6, 4)), (2, 8), "fc", "8"),
    "conv3d_bn": (lambda: nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.BatchNorm3d(3), nn.ReLU(), nn.MaxPool3d(2),
                                        nn.AvgPool3d(2, stride=1, padding=1, count_include_pad=False),
                                        nn.Conv3d(3, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3, 4)), (2, 4, 4, 4), "fc", "8"),
}


@pytest.mark.parametrize("loss", ["ce_mean", "ce_sum", "mse"])
@pytest.mark.parametrize("net", sorted(NETS))
def test_diag_exact_on_last_fc_layer(net, loss):
    torch.manual_seed(0)
    make, shape, _, last = NETS[net]
    model = make().to(DT)
    x = torch.randn(5, *shape, dtype=DT)
    if loss == "mse":
        y, loss_fn = torch.randn(5, 4, dtype=DT), F.mse_loss
    else:
        y, loss_fn = torch.randint(0, 4, (5,)), (F.cross_entropy if loss == "ce_mean" else ce_sum)
    names = [f"{last}.weight", f"{last}.bias"]
    got = diag_hessian(model, loss_fn, x, y, mode="diag", params=names)
    assert_rel_close(got, func_diag_hessian(model, loss_fn, x, y, names=names), 1e-10)
    if loss == "mse":  # constant pre-activation Hessian: the feature-mean approximation is exact too
        got = diag_hessian(model, loss_fn, x, y, mode="approx", params=names)
        assert_rel_close(got, func_diag_hessian(model, loss_fn, x, y, names=names), 1e-10)


@pytest.mark.parametrize("dims", [2, 1, 3])
@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_exact_on_last_conv_layer_with_elementwise_loss(mode, dims):
    torch.manual_seed(1)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    model = nn.Sequential(conv(2, 3, 3, padding=1), nn.Tanh(), conv(3, 2, 3, stride=2, padding=2, dilation=2)).to(DT)
    x = torch.randn(3, 2, *(6,) * dims, dtype=DT)
    y = torch.randn_like(model(x))
    names = ["2.weight", "2.bias"]
    got = diag_hessian(model, F.mse_loss, x, y, mode=mode, params=names)
    assert_rel_close(got, func_diag_hessian(model, F.mse_loss, x, y, names=names), 1e-10)


class FanOut(nn.Module):
    """One weight layer, then a DAG of elementwise/structural glue and modules: the Hessian stays
    diagonal, so the diagonal recursion must be exact for every parameter (sums at the fan-out)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(2)
        self.act = nn.Sigmoid()
        self.pool = nn.MaxPool2d(2)
        self.register_buffer("gain", torch.linspace(0.5, 2.0, 3).view(1, 3, 1, 1))

    def forward(self, x):
        h = self.conv(x)
        a = self.act(h) * 0.5
        b = torch.tanh(h) * self.gain
        c = -self.pool(h).relu()
        d = F.max_pool2d(h, 3, 2, 1) / 3.0
        e = self.bn(x)[:, :, 1:, :]  # a branch from the input, with BN in train mode
        f = h[:, :2, :3, :3]
        return torch.cat([a.flatten(1), b.flatten(1), c.flatten(1), d.flatten(1), f.flatten(1), e.flatten(1)], 1)


@pytest.mark.parametrize("loss", ["mean", "sum"])
def test_diag_exact_on_dag_with_diagonal_hessian(loss):
    torch.manual_seed(2)
    model = FanOut().to(DT)
    with torch.no_grad():
        model.bn.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 2, 6, 6, dtype=DT)
    y = torch.randn_like(model(x))
    loss_fn = lambda o, t: F.mse_loss(o, t, reduction=loss)
    got = diag_hessian(model, loss_fn, x, y, mode="diag")
    assert_rel_close(got, func_diag_hessian(model, loss_fn, x, y), 1e-9)


class SoftMix(nn.Module):
    """``Σ_k softmax(α)_k · op_k(x)`` with op outputs on disjoint features, so ∂²L/∂Z² is diagonal under
    MSE and the chain rule through softmax (glue) is exact in the diagonal recursion."""

    def __init__(self, K=3, d=4, width=2):
        super().__init__()
        self.alpha = nn.Parameter(torch.randn(K))
        self.ops = nn.ModuleList(nn.Linear(d, K * width) for _ in range(K))
        with torch.no_grad():
            for k, op in enumerate(self.ops):
                mask = torch.zeros(K * width, 1)
                mask[k * width : (k + 1) * width] = 1
                op.weight.mul_(mask)
                op.bias.mul_(mask[:, 0])

    def forward(self, x):
        z = torch.softmax(self.alpha, dim=0)
        return sum(z[k] * op(x) for k, op in enumerate(self.ops))


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_softmax_mixing_weights_exact_when_ops_disjoint(mode):
    torch.manual_seed(3)
    model = SoftMix().to(DT)
    x = torch.randn(6, 4, dtype=DT)
    y = torch.randn(6, 6, dtype=DT)
    got = diag_hessian(model, F.mse_loss, x, y, mode=mode, params=["alpha"])
    assert_rel_close(got, func_diag_hessian(model, F.mse_loss, x, y, names=["alpha"]), 1e-10)
    if mode == "diag":
        got = diag_hessian(model, F.mse_loss, x, y, mode=mode)
        assert_rel_close(got, func_diag_hessian(model, F.mse_loss, x, y), 1e-10)


def test_bn_as_affine_map_equals_hessian_with_frozen_statistics():
    """``NormRule(through_statistics=False)`` is the exact diagonal of the net whose BN statistics are
    frozen at this batch's values (an eval-mode BN with running stats = batch stats)."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Sigmoid()).to(DT)
    x = torch.randn(4, 2, 5, 5, dtype=DT)
    y = torch.randn(4, 3, 5, 5, dtype=DT)
    names = ["0.weight", "0.bias"]
    got = diag_hessian(model, F.mse_loss, x, y, mode="diag", params=names, rules={nn.BatchNorm2d: NormRule(False)})
    frozen = nn.Sequential(model[0], nn.BatchNorm2d(3), model[2]).to(DT)
    with torch.no_grad():
        h = model[0](x)
        frozen[1].running_mean.copy_(h.mean((0, 2, 3)))
        frozen[1].running_var.copy_(h.var((0, 2, 3), unbiased=False))
    frozen[1].load_state_dict({**frozen[1].state_dict(), "weight": model[1].weight, "bias": model[1].bias})
    frozen.eval()
    assert_rel_close(got, func_diag_hessian(frozen, F.mse_loss, x, y, names=names), 1e-10)
    through = diag_hessian(model, F.mse_loss, x, y, mode="diag", params=names)
    assert not torch.allclose(through["0.weight"], got["0.weight"])  # the option changes the number
