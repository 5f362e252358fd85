"""Fourth audit round of the weight curvature (``diag_hessian``) on a user's own models, float64, every reference
built in this file: the dense Hessian by ``torch.autograd.functional.hessian`` through ``torch.func.functional_call``,
and this file's own transcription of the diagonal recursion C.1.4-C.1.5 (bayesnas appendix) where ``diag`` is not
exact.

Defects this round found (each test named below fails on the library before its fix):

* ``exact`` on an ``nn.Sequential`` of Linear layers and activations took the per-sample chain recursion C.1.2-C.1.3
  for any ``isinstance`` of ``nn.Linear``/``nn.Tanh``: a Linear subclass with its own forward (``F.linear(x, 2W)``)
  or a Linear with a forward hook (``o * 2``) or pre-hook came out 75% off, silently; a pruned Linear
  (``torch.nn.utils.prune``: ``weight_orig``) or a parametrized one raised a bare ``KeyError: 'weight'``, a Tanh
  subclass with its own forward an ``AttributeError`` — ``test_exact_on_a_sequential_of_layers_that_are_not_plain``;
* ``diag``/``approx`` read a rule leaf's weights from ``module._parameters``: a pruned BatchNorm's γ
  (``weight_orig · mask``) was taken as absent, i.e. γ = 1 (diagonal of the layer below 136% off), a pruned or
  parametrized Linear/Conv raised ``KeyError: 'weight'``; and a user's forward hook that changes a rule leaf's output
  ran before the tracer's, so the rule took the hooked output for its own (74% off) —
  ``test_diag_sees_the_weights_and_output_the_forward_used``;
* in forward code between modules ``x + x`` (and ``x.add(x, alpha=2)``) gave the squared backward ``2h`` instead of
  ``4h`` (9h), and ``F.interpolate`` (nearest), ``F.pixel_shuffle``/``unshuffle``, ``F.unfold``/``F.fold`` were
  refused though their Jacobians are 0/1 — ``test_diag_is_exact_through_elementwise_and_0_1_glue_between_modules``; ``x * x`` / ``x * torch.sigmoid(x)``
  dropped the second derivative of one elementwise function (72% / 48% off on an elementwise tail where ``diag`` is
  exact), refused only inside a module before — ``test_a_product_of_two_elementwise_functions_of_one_tensor_is_refused``;
* a ``params`` value of another dtype than the model's parameter: torch's bare "self and mat2 must have the same
  dtype"; an empty batch: a bare ``IndexError`` (``exact``, ``diag``) or zeros for a NaN loss (``hutchinson``) —
  ``test_a_value_of_another_dtype_and_an_empty_batch_are_one_line`` (also uninitialized lazy parameters: torch's
  RuntimeError from deep inside);
* a block under ``torch.utils.checkpoint(..., use_reentrant=True)`` (its parameters get gradients only inside
  ``.backward()``): zeros for all its weights in every mode — ``test_activation_checkpointing_reentrant_is_refused_not_zero``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize

from nasdiag.hessian import UnsupportedModuleError, diag_hessian

from conftest import assert_no_module_hooks

DT = torch.float64


def dense_diagonals(model, loss_fn, x, y, names=None):
    """{name: diagonal of the dense Hessian block} by reverse-over-reverse autograd on a functional call."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    names = list(names or params)

    def loss(*values):
        return loss_fn(functional_call(model, ({**params, **dict(zip(names, values))}, buffers), (x,)), y)

    blocks = torch.autograd.functional.hessian(loss, tuple(params[n] for n in names))
    return {n: blocks[i][i].reshape(params[n].numel(), -1).diagonal().reshape(params[n].shape) for i, n in enumerate(names)}


def assert_close(got, want, rtol=1e-10):
    assert set(got) == set(want)
    for k in want:
        scale = want[k].abs().max().clamp_min(1e-300)
        assert (got[k] - want[k]).abs().max() <= rtol * scale, (k, got[k], want[k])


def sum_mse(o, t):
    return F.mse_loss(o, t, reduction="sum")


# ---------------------------------------------------------------------------------------------------------------
# exact: the chain recursion only for layers that compute their type's plain function


class DoubledLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, 2 * self.weight, self.bias)


class SteeperTanh(nn.Tanh):
    def forward(self, x):
        return torch.tanh(2 * x)


class Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


def _mlp(first=None, act=None):
    torch.manual_seed(0)
    return nn.Sequential(first or nn.Linear(4, 5), act or nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _pruned():
    m = _mlp()
    prune.l1_unstructured(m[0], "weight", amount=0.4)
    return m


def _parametrized():
    m = _mlp()
    parametrize.register_parametrization(m[2], "weight", Doubled())
    return m


def _output_hook():
    m = _mlp()
    m[0].register_forward_hook(lambda mod, args, out: out * 2)
    return m


def _input_hook():
    m = _mlp()
    m[2].register_forward_pre_hook(lambda mod, args: (args[0] * 3,))
    return m


@pytest.mark.parametrize("make", [
    lambda: _mlp(first=DoubledLinear(4, 5)), lambda: _mlp(act=SteeperTanh()), _pruned, _parametrized, _output_hook,
    _input_hook,
], ids=["linear-subclass", "tanh-subclass", "pruned", "parametrized", "output-hook", "input-hook"])
def test_exact_on_a_sequential_of_layers_that_are_not_plain(make):
    model = make()
    x, y = torch.randn(6, 4, dtype=DT), torch.tensor([0, 2, 1, 1, 0, 2])
    assert_close(diag_hessian(model, F.cross_entropy, x, y, mode="exact"), dense_diagonals(model, F.cross_entropy, x, y))
    part = [n for n, _ in model.named_parameters()][1:3]  # a subset: the chain route was taken for owned subsets
    assert_close(diag_hessian(model, F.cross_entropy, x, y, mode="exact", params=part),
                 dense_diagonals(model, F.cross_entropy, x, y, part))


# ---------------------------------------------------------------------------------------------------------------
# diag: a rule leaf's weights and output as its forward used them. Tails where the output Hessian stays diagonal
# down to the first convolution (elementwise ops, 1x1 depthwise convs, eval BatchNorm, flatten, a summed MSE), so
# that `diag` is exact there and the dense Hessian is the reference


class Tail(nn.Module):
    def __init__(self, middle):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.middle = middle
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.middle(self.conv(x))).flatten(1)


def _pruned_batch_norm():
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.5, 0.2, 1.3]))
        bn.running_mean.copy_(torch.tensor([0.1, -0.2, 0.3]))
        bn.running_var.copy_(torch.tensor([0.5, 2.0, 1.5]))
    prune.l1_unstructured(bn, "weight", amount=1)  # γ_1 = 0: that channel is dead, not γ = 1
    return bn.eval()


def _parametrized_depthwise():
    conv = nn.Conv2d(3, 3, 1, groups=3)
    parametrize.register_parametrization(conv, "weight", Doubled())
    return conv


def _hooked_identity_conv():
    conv = nn.Conv2d(3, 3, 1, groups=3)
    conv.register_forward_hook(lambda mod, args, out: out * 2)
    conv.register_forward_hook(lambda mod, args, out: out + 1)  # a second one, run after the first
    return conv


@pytest.mark.parametrize("mode", ["diag", "approx"])
@pytest.mark.parametrize("middle", [_pruned_batch_norm, _parametrized_depthwise, _hooked_identity_conv],
                         ids=["pruned-batchnorm", "parametrized-conv", "output-hooks"])
def test_diag_sees_the_weights_and_output_the_forward_used(middle, mode):
    torch.manual_seed(1)
    model = Tail(middle()).to(DT)
    x = torch.randn(3, 2, 5, 5, dtype=DT)
    y = torch.randn(3, 27, dtype=DT)
    names = ["conv.weight", "conv.bias"]
    if mode == "approx":  # the feature mean of an h that differs per position: only the bias (a sum) stays exact
        names = ["conv.bias"]
    order = {n: list(m._forward_hooks) for n, m in model.named_modules()}
    got = diag_hessian(model, sum_mse, x, y, mode=mode, params=names)
    assert_close(got, dense_diagonals(model, sum_mse, x, y, names))
    assert {n: list(m._forward_hooks) for n, m in model.named_modules()} == order  # the user's hooks, in their order


def test_a_global_forward_hook_is_refused_by_the_recursions_and_exact_stays_right():
    from torch.nn.modules.module import register_module_forward_hook

    model = Tail(nn.Identity()).to(DT)
    x, y = torch.randn(2, 2, 5, 5, dtype=DT), torch.randn(2, 27, dtype=DT)
    handle = register_module_forward_hook(lambda mod, args, out: out * 2 if isinstance(mod, nn.Conv2d) else None)
    try:
        with pytest.raises(RuntimeError, match="global forward hooks.*mode='exact'"):
            diag_hessian(model, sum_mse, x, y, mode="diag")
        assert_close(diag_hessian(model, sum_mse, x, y, mode="exact"), dense_diagonals(model, sum_mse, x, y))
    finally:
        handle.remove()
    assert_no_module_hooks(model)


# ---------------------------------------------------------------------------------------------------------------
# glue: forward code between modules


class FunctionalTail(nn.Module):
    def __init__(self, tail):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.tail = tail
        self.sig = nn.Sigmoid()

    def forward(self, x):
        return self.tail(self, self.conv(x)).flatten(1)


EXACT_TAILS = {  # elementwise, views, pads, max pooling, slices, concatenation: diag is exact through them
    "x+x": lambda m, t: t + t,
    "add-alpha": lambda m, t: (lambda u: u.add(u, alpha=2))(torch.tanh(t)),
    "x-x/2": lambda m, t: (lambda u: u.sub(u, alpha=0.5))(F.relu(t)),
    "glu": lambda m, t: (lambda a, b: a * torch.sigmoid(b))(*t[:, :2].chunk(2, 1)),
    "cat-scaled": lambda m, t: torch.cat([F.relu(t), 0.5 * t], 1),
    "permute-pool": lambda m, t: F.max_pool2d(torch.tanh(t), 3, stride=1, padding=1).permute(0, 2, 3, 1),
    "where-leaky": lambda m, t: torch.where(t > 0, t, 0.1 * t),
    # the {0, 1}-Jacobian ops this round registered (refused before)
    "interpolate-nearest": lambda m, t: F.interpolate(torch.tanh(t), scale_factor=2),
    "interpolate-nearest-exact-1d": lambda m, t: F.interpolate(torch.tanh(t)[:, :, 1], scale_factor=1.5,
                                                                mode="nearest-exact"),
    "pixel-shuffle": lambda m, t: F.pixel_shuffle(torch.tanh(t).repeat(1, 4, 1, 1)[:, :8], 2),
    "pixel-unshuffle-unfold": lambda m, t: F.unfold(F.pixel_unshuffle(torch.tanh(t), 2), 2, padding=1),
    "fold": lambda m, t: F.fold(torch.tanh(t).flatten(2)[:, :, :12].reshape(2, 12, 3), (2, 6), (2, 2), stride=2),
}


@pytest.mark.parametrize("tail", EXACT_TAILS.values(), ids=EXACT_TAILS.keys())
def test_diag_is_exact_through_elementwise_and_0_1_glue_between_modules(tail):
    torch.manual_seed(2)
    model = FunctionalTail(tail).to(DT)
    x = torch.randn(2, 2, 4, 4, dtype=DT)
    y = torch.randn_like(model(x)).detach()
    assert_close(diag_hessian(model, sum_mse, x, y, mode="diag"), dense_diagonals(model, sum_mse, x, y))


REFUSED_TAILS = {
    "x*x": lambda m, t: t * t,
    "swish": lambda m, t: t * torch.sigmoid(t),
    "swish-module": lambda m, t: t * m.sig(t),
    "through-view": lambda m, t: torch.tanh(t) * (t * 0.5 + 1).view(t.shape),
}


@pytest.mark.parametrize("tail", REFUSED_TAILS.values(), ids=REFUSED_TAILS.keys())
@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_a_product_of_two_elementwise_functions_of_one_tensor_is_refused(tail, mode):
    model = FunctionalTail(tail).to(DT)
    x = torch.randn(2, 2, 4, 4, dtype=DT)
    y = torch.randn_like(model(x)).detach()
    with pytest.raises(UnsupportedModuleError, match=r"MulBackward0.*multiplies two elementwise functions of one tensor"
                                                     r".*nn\.SiLU.*mode='exact'"):
        diag_hessian(model, sum_mse, x, y, mode=mode)
    assert_no_module_hooks(model)
    assert_close(diag_hessian(model, sum_mse, x, y, mode="exact"), dense_diagonals(model, sum_mse, x, y))


# ---------------------------------------------------------------------------------------------------------------
# verified right this round (kept as independent checks)


class NestedResidual(nn.Module):
    """Flatten → [Linear(no bias) → ReLU(inplace)] + skip → [Linear → tanh] + skip → ModuleDict head via Identity."""

    def __init__(self):
        super().__init__()
        self.flat = nn.Flatten()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4, bias=False), nn.ReLU(inplace=True)),
                                     nn.Sequential(nn.Linear(4, 4), nn.Tanh())])
        self.heads = nn.ModuleDict({"out": nn.Linear(4, 3), "pass": nn.Identity()})

    def forward(self, x):
        x = self.flat(x)
        for block in self.blocks:
            x = block(x) + x
        return self.heads["out"](self.heads["pass"](x))


def _recursion_on_nested_residual(m, x, y, loss_fn):
    """C.1.4-C.1.5 on this DAG, summing the two branches at each skip (the DAG recursion's fan-out rule)."""
    W1 = m.blocks[0][0].weight.detach()
    W2, b2 = m.blocks[1][0].weight.detach(), m.blocks[1][0].bias.detach()
    Wo, bo = m.heads["out"].weight.detach(), m.heads["out"].bias.detach()
    x0 = x.flatten(1)
    z1 = x0 @ W1.T
    x1 = z1.clamp_min(0) + x0
    z2 = x1 @ W2.T + b2
    a2 = torch.tanh(z2).requires_grad_(True)
    x2 = a2 + x1
    out = (x2 @ Wo.T + bo).detach().requires_grad_(True)
    g_out = torch.autograd.grad(loss_fn(out, y), out, create_graph=True)[0]
    h_out = torch.stack([torch.autograd.grad(g_out[:, c].sum(), out, retain_graph=True)[0][:, c] for c in range(3)], 1)
    g_a2 = torch.autograd.grad(loss_fn(x2 @ Wo.T + bo, y), a2)[0]
    t = a2.detach()
    h_x2 = h_out @ Wo.square()
    h_z2 = (1 - t.square()).square() * h_x2 - 2 * t * (1 - t.square()) * g_a2  # B² h + σ'' ∂L/∂a (C.1.5)
    h_x1 = h_x2 + h_z2 @ W2.square()
    h_z1 = h_x1 * (z1 > 0)
    return {"heads.out.weight": h_out.T @ x2.detach().square(), "heads.out.bias": h_out.sum(0),
            "blocks.1.0.weight": h_z2.T @ x1.square(), "blocks.1.0.bias": h_z2.sum(0),
            "blocks.0.0.weight": h_z1.T @ x0.square()}


def test_diag_on_nested_containers_with_residuals_is_the_dag_recursion():
    torch.manual_seed(3)
    model = NestedResidual().to(DT)
    x, y = torch.randn(5, 2, 2, dtype=DT), torch.tensor([0, 2, 1, 1, 0])
    assert_close(diag_hessian(model, F.cross_entropy, x, y, mode="diag"),
                 _recursion_on_nested_residual(model, x, y, F.cross_entropy))
    assert_close(diag_hessian(model, F.cross_entropy, x, y, mode="exact"), dense_diagonals(model, F.cross_entropy, x, y))


LOSSES = {
    "ce-smoothing-weight-ignore": lambda o, t: F.cross_entropy(o, t, weight=torch.tensor([0.2, 1.0, 3.0], dtype=DT),
                                                               ignore_index=1, label_smoothing=0.2),
    "nll-after-log-softmax": lambda o, t: F.nll_loss(F.log_softmax(o, 1), t),
    "bce-logits-pos-weight": lambda o, t: F.binary_cross_entropy_with_logits(
        o, F.one_hot(t, 3).to(DT), pos_weight=torch.tensor([1.0, 2.0, 3.0], dtype=DT)),
    "huber": lambda o, t: F.huber_loss(o, F.one_hot(t, 3).to(DT), delta=0.3),
    "mse-float32-targets": lambda o, t: F.mse_loss(o, F.one_hot(t, 3).to(torch.float32)),
    "kl-batchmean": lambda o, t: F.kl_div(F.log_softmax(o, 1), torch.softmax(t[:, None] * 1.0 + torch.arange(3), 1),
                                          reduction="batchmean"),
}


@pytest.mark.parametrize("loss_fn", LOSSES.values(), ids=LOSSES.keys())
def test_losses_beyond_the_papers_exact_and_diag_on_the_last_layer(loss_fn):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 3)).to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.tensor([0, 2, 1, 1, 0, 2])
    try:
        want = dense_diagonals(model, loss_fn, x, y)
    except RuntimeError as err:
        # torch 2.11's own double backward of mse_loss with float32 targets on float64 outputs raises this
        # (seen on the GPU host, torch 2.11.0 CPU); torch 2.13 computes it. No reference, so nothing to compare.
        if "Found dtype" not in str(err):
            raise
        pytest.skip(f"torch {torch.__version__} cannot differentiate this loss twice itself: {err}")
    assert_close(diag_hessian(model, loss_fn, x, y, mode="exact"), want)
    last = diag_hessian(model, loss_fn, x, y, mode="diag", params=["2.weight", "2.bias"])  # C.1.4 is exact here
    assert_close(last, {k: want[k] for k in last})


@pytest.mark.parametrize("dropout", [nn.Dropout(0.4), nn.Dropout2d(0.4), nn.AlphaDropout(0.3)],
                         ids=["dropout", "dropout2d", "alpha-dropout"])
def test_train_mode_dropout_each_mode_is_the_net_of_its_one_mask(dropout):
    # one forward per call, so every mode differentiates one sampled net; seeding before each call makes it the
    # reference's net (the tail keeps the output Hessian diagonal down to the conv, where diag is exact)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(4, 3, 1), nn.Tanh(), dropout, nn.Flatten()).to(DT).train()
    x, y = torch.randn(4, 4, 3, 3, dtype=DT), torch.randn(4, 27, dtype=DT)
    for mode in ("exact", "diag"):
        torch.manual_seed(7)
        want = dense_diagonals(model, sum_mse, x, y)
        torch.manual_seed(7)
        assert_close(diag_hessian(model, sum_mse, x, y, mode=mode), want)


class Boom(Exception):
    pass


class FailsOnCall(nn.Module):
    def __init__(self, fail_at):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Linear(3, 3)
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x):
        self.calls += 1
        h = F.relu(self.bn(self.conv(x)))  # BatchNorm has run (train mode) when the forward raises
        if self.calls == self.fail_at:
            raise Boom("in the forward")
        return self.fc(h.mean((2, 3)))


@pytest.mark.parametrize("mode", ["exact", "diag", "approx", "hutchinson:2"])
@pytest.mark.parametrize("where", ["forward", "loss"])
def test_an_exception_in_the_users_forward_or_loss_leaves_the_model_as_it_was(mode, where):
    model = FailsOnCall(1 if where == "forward" else 0).to(DT)
    model.conv.bias.requires_grad_(False)
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    before = ({k: v.clone() for k, v in model.state_dict().items()}, [p.requires_grad for p in model.parameters()],
              [id(p) for p in model.parameters()])
    calls = []

    def loss_fn(o, t):
        calls.append(1)
        if len(calls) == 2:  # diag/approx call the loss twice: fail in the second, after the traced forward
            raise Boom("in the loss")
        return F.cross_entropy(o, t)

    x, y = torch.randn(4, 2, 5, 5, dtype=DT), torch.tensor([0, 1, 2, 0])
    try:
        diag_hessian(model, loss_fn if where == "loss" else F.cross_entropy, x, y, mode=mode)
    except Boom:
        pass
    assert_no_module_hooks(model)
    assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
    assert [p.requires_grad for p in model.parameters()] == before[1] and [id(p) for p in model.parameters()] == before[2]
    assert torch.equal(model.fc.weight.grad, torch.ones_like(model.fc.weight)) and model.conv.weight.grad is None
    assert model.training


@pytest.mark.parametrize("mode", ["exact", "diag", "hutchinson:2"])
def test_a_value_of_another_dtype_and_an_empty_batch_are_one_line(mode):
    from nasdiag.hessian import CurvatureError, CurvatureTypeError

    model = _mlp()
    x, y = torch.randn(6, 4, dtype=DT), torch.tensor([0, 2, 1, 1, 0, 2])
    with pytest.raises(CurvatureTypeError, match=r"params\['0.weight'\] is torch.float32 .* model's parameter is "
                                                 r"torch.float64.*value.to\(dtype=torch.float64"):
        diag_hessian(model, F.cross_entropy, x, y, mode=mode, params={"0.weight": model[0].weight.detach().float()})
    with pytest.raises(CurvatureError, match=r"inputs hold no samples \(shape \(0, 4\)"):
        diag_hessian(model, F.cross_entropy, x[:0], y[:0], mode=mode)  # was an IndexError, or zeros for a NaN loss
    lazy = nn.Sequential(nn.LazyLinear(5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    with pytest.raises(CurvatureError, match="'0.weight', '0.bias' of the model are not initialized yet.*run one forward"):
        diag_hessian(lazy, F.cross_entropy, x, y, mode=mode)


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.first = nn.Conv2d(2, 2, 1)
        self.conv, self.act = nn.Conv2d(2, 3, 3, padding=1), nn.Tanh()
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda t: self.act(self.conv(t)), self.first(x), use_reentrant=self.reentrant).flatten(1)


@pytest.mark.parametrize("mode", ["exact", "diag", "approx", "hutchinson:2"])
def test_activation_checkpointing_reentrant_is_refused_not_zero(mode):
    from nasdiag.hessian import CurvatureRuntimeError

    torch.manual_seed(6)
    x, y = torch.randn(2, 2, 4, 4, dtype=DT), torch.randn(2, 48, dtype=DT)
    with pytest.raises(CurvatureRuntimeError, match="use_reentrant=True.*zeros.*use_reentrant=False"):
        diag_hessian(Checkpointed(True).to(DT), sum_mse, x, y, mode=mode)  # was zeros for every weight in the block
    if mode in ("exact", "diag"):  # non-reentrant: the graph is whole (diag exact on conv.* behind this tail)
        model = Checkpointed(False).to(DT)
        names = ["conv.weight", "conv.bias"]
        assert_close(diag_hessian(model, sum_mse, x, y, mode=mode, params=names), dense_diagonals(model, sum_mse, x, y, names))
