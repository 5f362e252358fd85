"""The recursions give the same numbers on CUDA as on CPU (float64); skipped without CUDA."""

import pytest
import torch
import torch.nn.functional as F

from nasdiag.hessian import arch_diag_hessian, diag_hessian
from nasdiag.supernet import Network

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_cuda_matches_cpu(mode):
    torch.manual_seed(0)
    net = Network.minimal(4, 5, 3, in_channels=3).double()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (4,))
    results = []
    for device in ("cpu", "cuda"):
        net = net.to(device)
        edges = {s.name: s for s in net.edge_specs()}
        w = diag_hessian(net, F.cross_entropy, x.to(device), y.to(device), mode=mode)
        a = arch_diag_hessian(net, F.cross_entropy, x.to(device), y.to(device), edges, mode=mode, wrt="alpha")
        results.append({**{k: v.cpu() for k, v in w.items()}, **{k: v.cpu() for k, v in a.items()}})
    cpu, cuda = results
    for k in cpu:
        torch.testing.assert_close(cuda[k], cpu[k], rtol=1e-7, atol=1e-9 * cpu[k].abs().max().item())
