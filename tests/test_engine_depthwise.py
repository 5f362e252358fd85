"""The fast engine's depthwise convolution (nasdiag.supernet.engine.depthwise) against torch's conv2d.

The custom backward computes the input gradient as a forward convolution with the flipped kernel; checked
in float64 against autograd through ``F.conv2d`` (and by gradcheck) for the DARTS kernel sizes and dilations.
"""

import pytest
import torch
import torch.nn.functional as F

from nasdiag.supernet.engine.depthwise import DepthwiseSame, depthwise_conv2d


@pytest.mark.parametrize("k,d", [(3, 1), (5, 1), (3, 2), (5, 2)])
def test_gradients_equal_autograd_through_conv2d_float64(k, d):
    g = torch.Generator().manual_seed(k * 10 + d)
    x = torch.randn(3, 4, 7, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 1, k, k, generator=g, dtype=torch.float64, requires_grad=True)
    go = torch.randn(3, 4, 7, 6, generator=g, dtype=torch.float64)
    p = d * (k - 1) // 2
    y = DepthwiseSame.apply(x, w, p, d)
    ref = F.conv2d(x, w, None, 1, p, d, 4)
    assert torch.allclose(y, ref, rtol=0, atol=1e-12)
    got = torch.autograd.grad(y, (x, w), go)
    want = torch.autograd.grad(ref, (x, w), go)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=1e-11)
    assert torch.autograd.gradcheck(lambda a, b: DepthwiseSame.apply(a, b, p, d), (x[:1, :2, :5, :5].detach().requires_grad_(),
                                                                                 w[:2].detach().requires_grad_()))


def test_other_convolutions_and_the_cpu_go_to_conv2d():
    x = torch.randn(2, 4, 8, 8)
    w = torch.randn(4, 1, 3, 3)
    # on the CPU always conv2d; strided or valid-padded ones too (same values either way)
    for stride, pad in ((1, 1), (2, 1), (1, 0)):
        assert torch.equal(depthwise_conv2d(x, w, stride, pad, 1), F.conv2d(x, w, None, stride, pad, 1, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k,d", [(3, 1), (5, 1), (3, 2), (5, 2)])
def test_on_cuda_equals_conv2d(k, d):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, 12, 12, generator=g, dtype=torch.float64).cuda().requires_grad_()
    w = torch.randn(16, 1, k, k, generator=g, dtype=torch.float64).cuda().requires_grad_()
    go = torch.randn(8, 16, 12, 12, generator=g, dtype=torch.float64).cuda()
    p = d * (k - 1) // 2
    y = depthwise_conv2d(x, w, 1, p, d)
    assert y.grad_fn is not None and "DepthwiseSame" in type(y.grad_fn).__name__
    ref = F.conv2d(x, w, None, 1, p, d, 16)
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-12
    for a, b in zip(torch.autograd.grad(y, (x, w), go), torch.autograd.grad(ref, (x, w), go)):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-12
