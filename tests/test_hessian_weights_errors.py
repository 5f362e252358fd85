"""Bad input and side effects of ``diag_hessian``: loud errors that name the culprit, nothing left behind."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import ElementwiseRule, HessianRule, UnsupportedModuleError, diag_hessian, register_rule
from nasdiag.hessian.rules.base import _RULES

from conftest import assert_no_module_hooks
from test_hessian_weights_reference import DT, assert_rel_close, func_diag_hessian


class Scale(nn.Module):
    """A module with a parameter and no rule."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.s * x


class Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


class ExpGlue(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.exp(self.a(x)))


def _data():
    torch.manual_seed(0)
    return torch.randn(5, 3, dtype=DT), torch.randint(0, 2, (5,))


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_unsupported_module_on_path_is_named(mode):
    x, y = _data()
    model = nn.Sequential(nn.Linear(3, 4), Scale(), nn.Linear(4, 2)).to(DT)
    with pytest.raises(UnsupportedModuleError) as err:
        diag_hessian(model, F.cross_entropy, x, y, mode=mode)
    msg = str(err.value)
    assert "'1'" in msg and "Scale" in msg  # qualified name and type
    assert "nn.Conv2d" in msg and "nn.BatchNorm2d" in msg  # the supported ones
    assert "register_rule" in msg
    assert_no_module_hooks(model)
    # not on the path to the requested tensors: fine (and exact on this last layer)
    got = diag_hessian(model, F.cross_entropy, x, y, mode="diag", params=["2.weight"])
    assert_rel_close(got, func_diag_hessian(model, F.cross_entropy, x, y, names=["2.weight"]), 1e-10)


def test_unsupported_glue_op_is_named():
    x, y = _data()
    model = ExpGlue().to(DT)
    with pytest.raises(UnsupportedModuleError, match="ExpBackward0.*register"):
        diag_hessian(model, F.cross_entropy, x, y, mode="diag")
    assert_no_module_hooks(model)


class Halve(nn.Module):
    def forward(self, x):
        return x[:, ::2].mul(0.5)


class FunctionalConv(nn.Module):
    """A container that applies its own weight functionally: the op and the owner are named."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.w = nn.Parameter(torch.randn(2, 4))

    def forward(self, x):
        return F.linear(self.body(x), self.w)


def test_functional_use_of_a_parameter_names_its_owner():
    x, y = _data()
    model = FunctionalConv().to(DT)
    with pytest.raises(UnsupportedModuleError) as err:
        diag_hessian(model, F.cross_entropy, x, y, mode="approx")
    msg = str(err.value)
    assert "MmBackward0" in msg or "AddmmBackward0" in msg, msg
    assert "'w'" in msg and "FunctionalConv" in msg and "register_rule" in msg


def test_parameterless_unknown_module_is_traced_or_named():
    x, _ = _data()
    y = torch.randn(5, 2, dtype=DT)
    # glue-only interior (slice, constant product): traced op by op, exact here (diagonal Hessian)
    fine = nn.Sequential(nn.Linear(3, 4), Halve()).to(DT)
    got = diag_hessian(fine, F.mse_loss, x, y, mode="diag")
    assert_rel_close(got, func_diag_hessian(fine, F.mse_loss, x, y), 1e-10)
    # x * sigmoid(x) inside one module: the product's cross term would be dropped, so it is refused
    swish = nn.Sequential(nn.Linear(3, 4), Swish(), nn.Linear(4, 2)).to(DT)
    with pytest.raises(UnsupportedModuleError) as err:
        diag_hessian(swish, F.mse_loss, x, y, mode="diag", params=["0.weight"])
    assert "'1'" in str(err.value) and "Swish" in str(err.value) and "register_rule" in str(err.value)


def test_registering_a_rule_makes_a_module_supported():
    x, _ = _data()
    y = torch.randn(5, 4, dtype=DT)
    model = nn.Sequential(nn.Linear(3, 4), Swish()).to(DT)
    # per call: last layer before an elementwise activation and MSE stays exact
    rule = ElementwiseRule(lambda t: t * torch.sigmoid(t))
    got = diag_hessian(model, F.mse_loss, x, y, mode="diag", rules={Swish: rule})
    assert_rel_close(got, func_diag_hessian(model, F.mse_loss, x, y), 1e-10)
    register_rule(Swish, rule)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_rule(Swish, rule)
        assert_rel_close(diag_hessian(model, F.mse_loss, x, y, mode="diag"), got, 1e-14)
    finally:
        _RULES.pop(Swish)
    with pytest.raises(TypeError):
        register_rule(Swish, object())


def test_bad_arguments():
    x, y = _data()
    model = nn.Sequential(nn.Linear(3, 2)).to(DT)
    with pytest.raises(ValueError, match="mode"):
        diag_hessian(model, F.cross_entropy, x, y, mode="fast")
    with pytest.raises(ValueError, match="not a parameter"):
        diag_hessian(model, F.cross_entropy, x, y, mode="diag", params=["0.weights"])
    with pytest.raises(TypeError, match="collection"):
        diag_hessian(model, F.cross_entropy, x, y, mode="diag", params="0.weight")
    with pytest.raises(ValueError, match="shape"):
        diag_hessian(model, F.cross_entropy, x, y, mode="diag", params={"0.weight": torch.zeros(3, 3, dtype=DT)})
    with pytest.raises(ValueError, match="rules"):
        diag_hessian(model, F.cross_entropy, x, y, mode="exact", rules={nn.Linear: HessianRule()})
    with pytest.raises(ValueError, match="couples"):  # a loss on the batch mean of the outputs
        diag_hessian(model, lambda o, t: o.mean(0).square().sum(), x, y, mode="diag")
    with pytest.raises(ValueError, match="scalar"):
        diag_hessian(model, lambda o, t: o.sum(1), x, y, mode="approx")
    assert_no_module_hooks(model)


def test_inplace_modification_after_a_call_is_detected():
    class Clobber(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.act, self.b = nn.Linear(3, 4), nn.LeakyReLU(0.1), nn.Linear(4, 2)
            self.b.weight.requires_grad_(False)  # so autograd itself does not need h

        def forward(self, x):
            h = self.act(self.a(x))
            out = self.b(h)
            h.mul_(0)  # overwrites the LeakyReLU output its rule reads, after it was consumed
            return out

    x, y = _data()
    model = Clobber().to(DT)
    with pytest.raises(RuntimeError, match="modified in place"):
        diag_hessian(model, F.cross_entropy, x, y, mode="diag", params=["a.weight"])


@pytest.mark.parametrize("mode", ["exact", "diag", "approx"])
def test_no_side_effects(mode):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 2)).to(DT)
    x, y = torch.randn(3, 1, 4, 4, dtype=DT), torch.randint(0, 2, (3,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):
        out = diag_hessian(model, F.cross_entropy, x, y, mode=mode)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # BN running stats too
    assert all(p.grad is None for p in model.parameters())
    assert_no_module_hooks(model)
    assert all(not t.requires_grad for t in out.values())
    assert list(out) == [n for n, _ in model.named_parameters()]
