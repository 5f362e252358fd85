"""Round-13 audit of nasdiag.hessian against own float64 references.

Every reference is built here from scratch: the dense Hessian of the loss by reverse-over-reverse autograd
(``torch.autograd.grad`` twice, the model called through ``torch.func.functional_call``), never ``torch.func.hessian``
and no nasdiag code on the reference side.

Checked and found right (scratch scripts, not kept as tests; the earlier rounds' files pin most of it): every rule
one layer at a time under a separable loss (``module(x ∘ w)``, diag exact for w and the module's parameters) on
Conv3d grouped/strided/dilated/depthwise, AvgPool3d ceil_mode/count_include_pad=False/divisor_override, overlapping
and ceil-mode MaxPool3d, AdaptiveMaxPool3d, Conv1d padding='same', stride-2 Conv2d whose padding does not divide,
grouped non-depthwise Conv2d, Linear on 3-D and 4-D inputs, Flatten(2) and Unflatten in the middle, ELU/GELU/SiLU/
Softplus chains, Softmax/LogSoftmax/Softmin, F.threshold, pixel shuffle, zero and constant padding, F.unfold, every
norm in eval and train mode, channels_last inputs, train-mode Dropout/Dropout1d/2d/3d/AlphaDropout/
FeatureAlphaDropout with a seeded mask (all 1e-16); Hardswish, CELU, SELU, Softsign, LogSigmoid, LPPool,
ChannelShuffle, ReplicationPad1d, CircularPad2d, LocalResponseNorm, AdaptiveAvgPool3d refused in one line naming
the module (round 23 gave the 1-D/3-D copy pads and nn.CircularPad*d rules: tests/test_audit_models23_round23.py); approx of Conv3d equal to approx of the same Conv2d (depth 1) in four geometries; diag/approx of Linear on
(B, T, D) equal to an own transcription of C.1.4-C.1.5 and its feature mean; the exact chain route (inplace ReLU and
LeakyReLU, a reused Tanh, Identity, bias-free Linear) and diag's last layer for CE with class weights, ignore_index
and label smoothing, CE sum, NLL after log_softmax, BCE with pos_weight, MSE sum, Huber, smooth L1, KL, Gaussian
and Poisson NLL; ggn equal to an own Gauss-Newton and exact to the dense Z-Hessian on round 9's supernet for five of
those losses, ggn_mc within its noise; the Lanczos/power flags on dense spectra (near-degenerate, ±λ, negative
dominant, zero, K = 2, dim 1, clustered): non-convergence is reported; Lanczos's second eigenvalue of a cluster closer
than tol is that documented Krylov limit; exact Embedding/GRU/MultiheadAttention nets equal the dense Hessian.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import diag_hessian, hessian_eigenvalues, hutchinson_trace

from test_audit_hessian_round2 import Scaled  # module(x ∘ w), w one weight per input entry

DT = torch.float64


def dense_diag(net, loss_fn, x, y):
    """``{name: diag ∂²L/∂θ²}`` of every parameter of ``net``, one dense reverse-over-reverse Hessian over all of them."""
    params = dict(net.named_parameters())
    sizes = [p.numel() for p in params.values()]
    flat = torch.cat([p.detach().reshape(-1) for p in params.values()]).requires_grad_(True)
    values = {n: t.view_as(p) for (n, p), t in zip(params.items(), torch.split(flat, sizes))}
    (g,) = torch.autograd.grad(loss_fn(torch.func.functional_call(net, values, (x,)), y), flat, create_graph=True)
    diag = torch.stack([torch.autograd.grad(g[i], flat, retain_graph=True)[0][i] for i in range(flat.numel())])
    return {n: d.view_as(p) for (n, p), d in zip(params.items(), torch.split(diag, sizes))}


def assert_close(got, ref, rtol=1e-10):
    """Entrywise within ``rtol`` of each tensor's largest reference entry."""
    assert list(got) == list(ref)
    for k in ref:
        scale = ref[k].abs().max().item()
        assert scale > 0, k
        err = (got[k] - ref[k]).abs().max().item()
        assert err <= rtol * scale, f"{k}: max error {err:.3e}, scale {scale:.3e}"


# -- exact on a chain of Linear layers whose Sequential has hooks -----------------------------------------------------

HOOKS = {
    "forward_hook_on_the_outer_sequential": lambda net: net.register_forward_hook(lambda m, i, o: 2 * o),
    "pre_hook_on_the_outer_sequential": lambda net: net.register_forward_pre_hook(lambda m, i: (3 * i[0],)),
    "forward_hook_on_a_nested_sequential": lambda net: net[0].register_forward_hook(lambda m, i, o: o.square()),
}


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_exact_on_a_linear_chain_whose_sequential_has_a_hook_runs_the_hook(hook):
    # mode='exact' takes the per-sample C.1.2-C.1.3 chain recursion for an nn.Sequential of Linear layers and
    # activations, calling the layers one by one; it refused hooked layers, but a hook on the Sequential holding them
    # (or on a nested one) never ran there, so the diagonal was that of another net (53-150% off), silently. The
    # dense Hessian of the hooked net is the reference; the hook changes it (checked).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 3)).to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    plain = dense_diag(net, F.cross_entropy, x, y)
    HOOKS[hook](net)
    ref = dense_diag(net, F.cross_entropy, x, y)
    assert any((plain[k] - ref[k]).abs().max() > 0.1 * ref[k].abs().max() for k in ref)
    assert_close(diag_hessian(net, F.cross_entropy, x, y, mode="exact"), ref)


# -- a hooked activation whose rule takes its derivatives from the module ----------------------------------------------


@pytest.mark.parametrize("act", [nn.GELU, nn.ELU, nn.Softplus, nn.Hardtanh])
@pytest.mark.parametrize("hook", ["forward", "pre"])
def test_diag_through_an_activation_with_a_user_hook_differentiates_the_activation_alone(act, hook):
    # docs/hessian.md: a user's pre-hook on a rule leaf runs before the tracer's (the rule sees the input the module
    # saw) and a forward hook after it (what it does is walked as glue). The rule of GELU/ELU/SiLU/Softplus/Hardtanh/
    # ReLU6 (ElementwiseRule() without fn) took σ', σ'' by forward-mode AD of the module *called*, which ran the hooks
    # again inside the derivative: 2·gelu for a doubling forward hook (then doubled once more as glue), gelu(1.5 x)
    # for a pre-hook: 100-340% off, silently. Under a separable loss on the activation's output diag is exact for w.
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, dtype=DT)
    module = act().to(DT)
    if hook == "forward":
        module.register_forward_hook(lambda m, i, o: 2 * o)
    else:
        module.register_forward_pre_hook(lambda m, i: (1.5 * i[0],))
    net = Scaled(module, x.shape)
    out = net(x)
    h, c = torch.randn_like(out), torch.randn_like(out)

    def separable(o, _):
        return (0.5 * h * o * o + c * o).sum()

    ref = dense_diag(net, separable, x, None)
    assert_close(diag_hessian(net, separable, x, None, mode="diag"), ref)


# -- the registry: torch.ao's fused subclass of a registered type -----------------------------------------------------


def test_a_fused_quantization_aware_linear_relu_gets_no_linear_rule():
    # torch.ao.nn.intrinsic.qat.LinearReLU subclasses nn.Linear and computes relu(linear(x)) in one call (here with its
    # fake quantization and observer off, so exactly that in float64). The registry exempted every class defined
    # inside torch from its "a subclass that rewrites forward has no rule by descent" check, so LinearReLU got
    # Linear's rule, which drops the ReLU: diag 77-91% off on its weight and bias, silently. Now it has no rule by
    # descent (refused naming it, one line), and exact equals the dense Hessian.
    import torch.ao.nn.intrinsic.qat as nniqat
    import torch.ao.quantization as tq

    from nasdiag.hessian import UnsupportedModuleError

    torch.manual_seed(0)
    net = nn.Sequential(nniqat.LinearReLU(4, 5, qconfig=tq.get_default_qat_qconfig("fbgemm")), nn.Linear(5, 3)).to(DT)
    net.apply(tq.disable_fake_quant)
    net.apply(tq.disable_observer)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    with torch.no_grad():
        assert torch.equal(net[0](x), F.relu(F.linear(x, net[0].weight, net[0].bias)))
    for mode in ("diag", "approx"):
        with pytest.raises(UnsupportedModuleError, match="LinearReLU") as err:
            diag_hessian(net, F.cross_entropy, x, y, mode=mode)
        assert "\n" not in str(err.value)
    assert_close(diag_hessian(net, F.cross_entropy, x, y, mode="exact"), dense_diag(net, F.cross_entropy, x, y))


# -- a block under a non-reentrant activation checkpoint with a train-mode BatchNorm ----------------------------------


class CheckpointedNet(nn.Module):
    """stem conv -> a block run under ``torch.utils.checkpoint(..., use_reentrant=False)``: ``Σ_k softmax(α)_k op_k``
    with train-mode BatchNorms in the ops -> Linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 2, 3, padding=1)
        self.ops = nn.ModuleList([nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2)),
                                  nn.Sequential(nn.Tanh(), nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2))])
        self.alpha = nn.Parameter(0.5 * torch.randn(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * 16, 3))

    def arch_parameters(self):
        return [self.alpha]

    def block(self, h, z):
        return sum(z[k] * op(h) for k, op in enumerate(self.ops))

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, self.stem(x), F.softmax(self.alpha, 0), use_reentrant=False)
        return self.head(h)


def test_the_hvp_routes_through_a_non_reentrant_checkpoint_with_train_batch_norm_are_exact_and_leave_its_statistics():
    # docs/hessian.md: use_reentrant=False works, and a curvature call leaves BatchNorm running statistics unchanged.
    # The Hessian-vector-product routes (diag_hessian 'exact'/'hutchinson:<k>', hessian_eigenvalues, hutchinson_trace)
    # ran the forward with train-mode BatchNorm's tracking turned off and the backwards after it was back on: the
    # checkpoint's recomputation inside the backward then saw another BatchNorm (torch's multi-line CheckpointError)
    # and updated the real running statistics. Now every backward runs under the forward's settings.
    torch.manual_seed(0)
    net = CheckpointedNet().to(DT)
    x, y = torch.randn(4, 1, 4, 4, dtype=DT), torch.randint(0, 3, (4,))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    got = diag_hessian(net, F.cross_entropy, x, y, mode="exact")
    diag_hessian(net, F.cross_entropy, x, y, mode="hutchinson:2")
    res = hessian_eigenvalues(net, F.cross_entropy, x, y)
    hutchinson_trace(net, F.cross_entropy, x, y, samples=2)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())
    ref = dense_diag(net, F.cross_entropy, x, y)  # the reference updates the running statistics: taken last
    assert_close(got, ref)
    # the α-Hessian (2 × 2, from the dense one of all parameters' rows: its α block) and its top eigenvalue
    params = dict(net.named_parameters())
    alpha = params["alpha"].detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(F.cross_entropy(torch.func.functional_call(net, {**params, "alpha": alpha}, (x,)), y),
                               alpha, create_graph=True)
    H = torch.stack([torch.autograd.grad(g[i], alpha, retain_graph=True)[0] for i in range(2)])
    top = torch.linalg.eigvalsh((H + H.T) / 2)[-1].item()
    assert res.converged and abs(res.largest_algebraic - top) <= 1e-9 * abs(top)


def test_a_full_backward_hook_is_refused_naming_its_module_not_blamed_on_forward_code():
    # A full backward hook (here one that only records, as a gradient monitor does) makes torch wrap the module's call
    # in a BackwardHookFunctionBackward node, which the recursions cannot cross. The refusal said that op sat "in the
    # forward code between modules, on the path reached from module '2' (Linear)" and to wrap it in a module and
    # register a rule; it names the hooked module and the way out, one line, and leaves no hook of its own behind.
    from nasdiag.hessian import UnsupportedModuleError

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    seen = []
    net[1].register_full_backward_hook(lambda m, gi, go: seen.append(1))
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    for mode in ("diag", "approx"):
        with pytest.raises(UnsupportedModuleError, match=r"backward hook .* module '1' \(Tanh\)") as err:
            diag_hessian(net, F.cross_entropy, x, y, mode=mode)
        assert "\n" not in str(err.value) and "Wrap the computation" not in str(err.value)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
    assert len(net[1]._backward_hooks) == 1
