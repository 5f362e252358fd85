"""Independent references for the Hessian tests (torch.func, autograd), and a check of them against BackPACK.

Imported by the other ``test_hessian_*`` files; nothing here uses nasdiag's recursions.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

DT = torch.float64


def functional_copy(model: nn.Module) -> nn.Module:
    """A deep copy whose train-mode norms keep no running statistics, so torch.func can trace it
    (same outputs: train-mode BN normalizes with the batch statistics either way)."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training:
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None
    return model


def func_diag_hessian(model, loss_fn, inputs, targets, names=None, values=None):
    """``{name: diag ∂²L/∂θ²}`` by ``torch.func.hessian`` of each parameter block (dense, float64)."""
    model = functional_copy(model)
    params = {k: p.detach() for k, p in model.named_parameters()}
    params.update(values or {})
    out = {}
    for name in names or list(params):
        def loss_of(v, name=name):
            return loss_fn(torch.func.functional_call(model, {**params, name: v}, (inputs,)), targets)

        p = params[name]
        full = torch.func.hessian(loss_of)(p)
        out[name] = torch.diagonal(full.reshape(p.numel(), p.numel())).reshape(p.shape)
    return out


def delta_arch_hessian(model, loss_fn, inputs, targets, edges):
    """``{edge: (K, K) ∂²L/∂Z²}`` of each edge's own block, by autograd: a forward pre-hook adds a zero
    leaf δ to the mixing weights (a leaf per edge), then double backward."""
    deltas, handles = {}, []

    def make_hook(name):
        def hook(module, args, kwargs):
            w = kwargs["weights"] if "weights" in kwargs else args[1]
            if name not in deltas:
                deltas[name] = torch.zeros(w.shape[-1], dtype=w.dtype, requires_grad=True)
            w = w + deltas[name]
            if "weights" in kwargs:
                return args, {**kwargs, "weights": w}
            return (args[0], w, *args[2:]), kwargs

        return hook

    qualified = {id(m): n for n, m in model.named_modules()}
    model_copy = functional_copy(model)
    copy_modules = dict(model_copy.named_modules())
    try:
        for name, (module, _) in edges.items():
            target = copy_modules[qualified[id(module)]]
            handles.append(target.register_forward_pre_hook(make_hook(name), with_kwargs=True))
        loss = loss_fn(model_copy(inputs), targets)
    finally:
        for h in handles:
            h.remove()
    blocks = {}
    for name, d in deltas.items():
        (g,) = torch.autograd.grad(loss, d, create_graph=True)
        rows = [torch.autograd.grad(g[k], d, retain_graph=True)[0] for k in range(d.numel())]
        blocks[name] = torch.stack(rows)
    return blocks


def assert_rel_close(got: dict, expected: dict, rtol: float):
    """Each tensor within ``rtol`` of the expected one, relative to its largest entry (floored at 1e-6 of
    the largest entry overall, for blocks that are zero in exact arithmetic, e.g. a bias before BN)."""
    assert set(got) == set(expected)
    overall = max(e.abs().max().item() for e in expected.values()) or 1.0
    for k in expected:
        scale = max(expected[k].abs().max().item(), 1e-6 * overall)
        err = (got[k] - expected[k]).abs().max().item()
        assert err <= rtol * scale, f"{k}: max error {err:.3e} vs scale {scale:.3e}"


def test_func_reference_matches_backpack_diag_hessian():
    # a test extra (pyproject.toml), so CI has it; a bare GPU host may not
    pytest.importorskip("backpack")
    from backpack import backpack, extend
    from backpack.extensions import DiagHessian

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Sigmoid(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(27, 4), nn.Tanh(), nn.Linear(4, 3)
    ).to(DT)
    x, y = torch.randn(5, 2, 6, 6, dtype=DT), torch.randint(0, 3, (5,))
    ref = func_diag_hessian(net, F.cross_entropy, x, y)
    bp_net = extend(copy.deepcopy(net))
    loss = extend(nn.CrossEntropyLoss())(bp_net(x), y)
    with backpack(DiagHessian()):
        loss.backward()
    got = {n: p.diag_h for n, p in bp_net.named_parameters()}
    assert_rel_close(got, ref, 1e-8)
