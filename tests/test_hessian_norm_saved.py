"""The BatchNorm rule reads μ and 1/σ from the forward's autograd node instead of a second pass over the
input. Checked against ``torch.var_mean`` (the definition: biased variance, 1/√(var + eps)) for torch's
native kernels (CPU, and affine-free BN on CUDA) and cuDNN's (affine BN on CUDA); the rules' results
through either route are tested against autograd in tests/test_hessian_weights_*.py."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import NormRule, diag_hessian
from nasdiag.hessian.rules.base import ModuleCall
from nasdiag.hessian.rules.norm import _saved_batch_statistics


def _check(device, affine):
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(5, affine=affine, eps=1e-3).to(device, torch.float64)
    x = torch.randn(6, 5, 4, 3, dtype=torch.float64, device=device, requires_grad=True)
    out = bn(x * 2 + 1)
    inp = (x * 2 + 1).detach()
    saved = _saved_batch_statistics(ModuleCall("bn", bn, inp, out))
    assert saved is not None, type(out.grad_fn).__name__
    var, mean = torch.var_mean(inp, (0, 2, 3), unbiased=False)
    assert torch.allclose(saved[0], mean, rtol=1e-12, atol=0)
    assert torch.allclose(saved[1], torch.rsqrt(var + bn.eps), rtol=1e-12, atol=0)
    # no autograd graph: nothing saved, the rule recomputes
    with torch.no_grad():
        assert _saved_batch_statistics(ModuleCall("bn", bn, inp, bn(inp))) is None


@pytest.mark.parametrize("affine", [False, True])
def test_saved_statistics_are_the_batch_mean_and_inverse_std_cpu(affine):
    _check("cpu", affine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("affine", [False, True])  # True takes cuDNN's kernels
def test_saved_statistics_are_the_batch_mean_and_inverse_std_cuda(affine):
    _check("cuda", affine)


def test_other_norms_are_not_read():
    ln = nn.GroupNorm(1, 4).double()
    x = torch.randn(3, 4, 2, 2, dtype=torch.float64, requires_grad=True)
    assert _saved_batch_statistics(ModuleCall("gn", ln, x.detach(), ln(x))) is None


class _OwnForwardBatchNorm(nn.BatchNorm2d):
    """A BatchNorm subclass whose forward passes its running statistics regardless of track_running_stats."""

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, 0.1, self.eps)


@pytest.mark.parametrize("norm", [nn.BatchNorm2d, _OwnForwardBatchNorm])
def test_curvature_calls_leave_every_buffer_as_it_was(norm):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), norm(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).double()
    x, y = torch.randn(6, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    net(x)  # running statistics away from their initial values
    before = {k: v.clone() for k, v in net.state_dict().items() if k.startswith("1.")}
    for mode in ("diag", "approx", "exact", "hutchinson:2"):
        rules = {norm: NormRule()} if mode in ("diag", "approx") else None  # the subclass has no registered rule
        diag_hessian(net, F.cross_entropy, x, y, mode=mode, rules=rules)
        after = {k: v for k, v in net.state_dict().items() if k.startswith("1.")}
        assert all(torch.equal(before[k], after[k]) for k in before), mode
    assert net[1].track_running_stats
