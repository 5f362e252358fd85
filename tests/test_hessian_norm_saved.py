"""The BatchNorm rule reads μ and 1/σ from the forward's autograd node instead of a second pass over the
input. Checked against ``torch.var_mean`` (the definition: biased variance, 1/√(var + eps)) for torch's
native kernels (CPU, and affine-free BN on CUDA) and cuDNN's (affine BN on CUDA); the rules' results
through either route are tested against autograd in tests/test_hessian_weights_*.py."""

import pytest
import torch
from torch import nn

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
