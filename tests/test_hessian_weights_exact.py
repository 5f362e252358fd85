"""``diag_hessian(mode="exact")`` equals the diagonal of ``torch.func.hessian`` (float64, 1e-8 relative).

MLP chains go through the full per-sample pre-activation recursion (bayesnas-appendix C.1.2-C.1.3);
conv nets, BatchNorm in train mode and DAGs through Hessian-vector products.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import diag_hessian
from test_hessian_weights_reference import DT, assert_rel_close, func_diag_hessian

LOSSES = {
    "ce_mean": F.cross_entropy,
    "ce_sum": lambda o, t: F.cross_entropy(o, t, reduction="sum"),
    "mse_mean": lambda o, t: F.mse_loss(o, F.one_hot(t, o.shape[-1]).to(o.dtype)),
    "mse_sum": lambda o, t: F.mse_loss(o, F.one_hot(t, o.shape[-1]).to(o.dtype), reduction="sum"),
}
ACTS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "leaky": lambda: nn.LeakyReLU(0.2), "gelu": nn.GELU}


@pytest.mark.parametrize(
    "act,loss", [("relu", "ce_mean"), ("tanh", "ce_sum"), ("sigmoid", "mse_mean"), ("leaky", "mse_sum"), ("gelu", "ce_mean")]
)
def test_exact_mlp_chain(act, loss):
    torch.manual_seed(hash((act, loss)) % 1000)
    net = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), ACTS[act](), nn.Linear(5, 4), ACTS[act](), nn.Linear(4, 3)).to(DT)
    x, y = torch.randn(7, 2, 3, dtype=DT), torch.randint(0, 3, (7,))
    got = diag_hessian(net, LOSSES[loss], x, y, mode="exact")
    assert_rel_close(got, func_diag_hessian(net, LOSSES[loss], x, y), 1e-8)


class Branchy(nn.Module):
    """A DAG: fan-out, a sum of two branches, a channel concat, a weighted sum, BN in train mode."""

    def __init__(self, norm, C=3):
        super().__init__()
        self.stem = nn.Conv2d(2, C, 3, padding=1)
        self.a = nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=2, dilation=2, groups=C), norm(C))
        self.b = nn.Sequential(nn.Tanh(), nn.AvgPool2d(3, 1, 1, count_include_pad=False), nn.Conv2d(C, C, 1))
        self.c = nn.Sequential(nn.MaxPool2d(3, 2, 1), nn.Conv2d(2 * C, 2, 3, stride=1, padding=1), nn.Sigmoid())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 3))

    def forward(self, x):
        s = self.stem(x)
        node = self.a(s) + 0.5 * self.b(s)
        return self.head(self.c(torch.cat([node, s], dim=1)))


CONVNETS = {
    "sigmoid_convnet": lambda: nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Sigmoid(), nn.AvgPool2d(2), nn.Conv2d(3, 3, 3, stride=2, padding=1),
        nn.Sigmoid(), nn.Flatten(), nn.Linear(12, 3)
    ),
    "bn_train": lambda: nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(27, 3)
    ),
    "dag_bn": lambda: Branchy(nn.BatchNorm2d),
    "dag_layernorm": lambda: Branchy(lambda c: nn.GroupNorm(1, c)),
    "dag_instancenorm": lambda: Branchy(lambda c: nn.InstanceNorm2d(c, affine=True)),
}


@pytest.mark.parametrize(
    "net,loss",
    [
        ("sigmoid_convnet", "ce_mean"),
        ("bn_train", "mse_sum"),
        ("dag_bn", "ce_mean"),
        ("dag_layernorm", "mse_mean"),
        ("dag_instancenorm", "ce_sum"),
    ],
)
def test_exact_conv_and_dag(net, loss):
    torch.manual_seed(3)
    model = CONVNETS[net]().to(DT)
    x, y = torch.randn(3, 2, 6, 6, dtype=DT), torch.randint(0, 3, (3,))
    got = diag_hessian(model, LOSSES[loss], x, y, mode="exact")
    assert_rel_close(got, func_diag_hessian(model, LOSSES[loss], x, y), 1e-8)


def test_exact_params_by_name_and_value():
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    net[0].weight.requires_grad_(False)  # frozen parameters are fine
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    other = torch.randn(3, 5, dtype=DT)
    got = diag_hessian(net, F.cross_entropy, x, y, mode="exact", params={"2.weight": other, "0.weight": net[0].weight})
    ref = func_diag_hessian(net, F.cross_entropy, x, y, names=["2.weight", "0.weight"], values={"2.weight": other})
    assert_rel_close(got, ref, 1e-8)
    by_names = diag_hessian(net, F.cross_entropy, x, y, mode="exact", params=["0.bias"])
    assert list(by_names) == ["0.bias"]
    assert_rel_close(by_names, func_diag_hessian(net, F.cross_entropy, x, y, names=["0.bias"]), 1e-8)


def test_exact_with_a_loss_coupling_samples():
    """The per-sample chain recursion does not apply; the HVP route still gives the true diagonal."""
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 2, (5,))

    def batch_coupled(o, t):
        return F.cross_entropy(o, t) + o.mean(0).square().sum()

    got = diag_hessian(net, batch_coupled, x, y, mode="exact")
    assert_rel_close(got, func_diag_hessian(net, batch_coupled, x, y), 1e-8)
