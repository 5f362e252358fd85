"""The probe on CUDA (the batched cost kernel path); skipped cleanly without a GPU."""

import copy

import pytest
import torch
import torch.nn.functional as F

import nasdiag
from nasdiag.supernet import Network

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_costs_on_cuda_equal_autograd_and_leave_the_step_unchanged(dtype):
    torch.manual_seed(0)
    net = Network.minimal(4, 5, 3, reductions=[1]).to("cuda", dtype)
    plain = copy.deepcopy(net)
    plain.set_engine("eager")  # a probed step runs on the eager engine (docs/probe.md): compare like with like
    x = torch.randn(4, 3, 8, 8, device="cuda", dtype=dtype)
    y = torch.randint(0, 5, (4,), device="cuda")
    Z = [torch.softmax(torch.randn(net.num_edges, len(net.primitives), device="cuda", dtype=dtype), -1).requires_grad_()
         for _ in net.cells]
    Zp = [z.detach().clone().requires_grad_() for z in Z]
    probe = nasdiag.attach(net, path_split=True)
    with probe.record():
        loss = F.cross_entropy(net(x, Z), y)
        loss.backward()
    loss_p = F.cross_entropy(plain(x, Zp), y)
    loss_p.backward()
    assert torch.equal(loss, loss_p)
    for (n, a), (_, b) in zip(net.named_weight_parameters(), plain.named_weight_parameters()):
        assert torch.equal(a.grad, b.grad), n
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    costs, per = probe.costs(), probe.costs(per_sample=True)
    for s in net.edge_specs():
        torch.testing.assert_close(costs[s.name], Z[s.cell_index].grad[s.edge_index], rtol=tol, atol=tol)
        torch.testing.assert_close(per[s.name].sum(0), costs[s.name], rtol=tol, atol=tol)
    stats = probe.statistics()
    assert stats["cost/normal/count"].min() == 2
    for name, parts in probe.path_costs().items():
        if parts:
            torch.testing.assert_close(sum(parts.values()), costs[name], rtol=tol, atol=tol)
