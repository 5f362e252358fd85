"""Bad input to the curvature API, as a new user makes it: one line, a ``NasdiagError`` (also the builtin the
check raised before), and nothing left behind (the user's own hooks kept, no nasdiag hook, BatchNorm running
statistics and the parameters as they were).

The references are the contract itself (error type, the line naming what to fix) and, for the two misuses that
now compute instead of failing, an independent value: a frozen model's mixing-weight curvature equals the
unfrozen one's, and a model that ignores its parameters has exactly zero curvature.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
import torch.nn.modules.module as torch_module

import nasdiag
from nasdiag.errors import NasdiagError
from nasdiag.hessian import (
    CurvatureError,
    CurvatureRuntimeError,
    CurvatureTypeError,
    ElementwiseRule,
    alpha_diag_hessian,
    arch_diag_hessian,
    diag_hessian,
    exact_arch_diag_hessian,
    hessian_eigenvalues,
    register_rule,
)
from nasdiag.hessian.glue import register_glue_rule
from nasdiag.supernet import Network

DT = torch.float64
WEIGHT_MODES = ["exact", "diag", "approx", "hutchinson:2"]
ARCH_MODES = ["exact", "exact_per_edge", "ggn", "ggn_mc", "hutchinson:1", "diag", "approx"]
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOKS = [n for n in dir(torch_module) if n.startswith("_global_") and isinstance(getattr(torch_module, n), dict)]


def snapshot(model):
    """Everything a failed call must leave as it was."""
    hooks = {(n, d): tuple(getattr(m, d)) for n, m in model.named_modules() for d in HOOK_DICTS if getattr(m, d)}
    return (hooks, {n: tuple(getattr(torch_module, n)) for n in GLOBAL_HOOKS},
            {n: b.clone() for n, b in model.named_buffers()},
            {n: (p.detach().clone(), p.requires_grad, p.grad) for n, p in model.named_parameters()},
            {n: (m.training, getattr(m, "track_running_stats", None)) for n, m in model.named_modules()})


def assert_untouched(model, before):
    after = snapshot(model)
    assert after[0] == before[0], "module hooks changed"
    assert after[1] == before[1], "global module hooks changed"
    for name, buf in before[2].items():
        assert torch.equal(after[2][name], buf), f"buffer {name} changed"
    for name, (value, requires_grad, grad) in before[3].items():
        assert torch.equal(after[3][name][0], value) and after[3][name][1] == requires_grad and after[3][name][2] is grad
    assert after[4] == before[4]


def refused(model, call, error=CurvatureError, match=None):
    """``call()`` raises ``error`` (a NasdiagError) with a one-line message, and leaves ``model`` untouched."""
    before = snapshot(model)
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, NasdiagError)
    assert "\n" not in str(info.value)
    assert_untouched(model, before)
    return str(info.value)


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).to(DT).train()
    calls = []
    net[0].register_forward_pre_hook(lambda m, a: calls.append(1))  # the user's own hook stays in place
    net.user_calls = calls
    return net, torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))


@pytest.fixture(scope="module")
def supernet():
    torch.manual_seed(0)
    net = Network(C=2, num_classes=3, layers=2, steps=2, multiplier=2, in_channels=1, stem_multiplier=1).to(DT).train()
    net.cells[0].register_forward_pre_hook(lambda m, a: None)
    edges = {s.name: s for s in net.edge_specs()[:2]}
    return net, torch.randn(3, 1, 6, 6, dtype=DT), torch.randint(0, 3, (3,)), edges


def test_the_error_classes_are_nasdiag_errors_and_keep_their_builtin():
    assert issubclass(CurvatureTypeError, CurvatureError) and issubclass(CurvatureTypeError, TypeError)
    assert issubclass(CurvatureRuntimeError, CurvatureError) and issubclass(CurvatureRuntimeError, RuntimeError)
    assert issubclass(CurvatureError, NasdiagError) and issubclass(CurvatureError, ValueError)


# -- mode names -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, meant", [("Exact", "exact"), ("approximate", "approx"), ("diag ", "diag")])
def test_a_near_miss_weight_mode_names_the_mode_meant(mlp, mode, meant):
    net, x, y = mlp
    refused(net, lambda: diag_hessian(net, F.cross_entropy, x, y, mode=mode), match=f"did you mean '{meant}'")


@pytest.mark.parametrize("mode", ["ggn", "ggn_mc", "exact_per_edge"])
def test_a_mixing_weight_mode_given_to_diag_hessian_says_whose_mode_it_is(mlp, mode):
    net, x, y = mlp
    refused(net, lambda: diag_hessian(net, F.cross_entropy, x, y, mode=mode), match=r"arch_diag_hessian")


@pytest.mark.parametrize("mode, meant", [("ggn-mc", "ggn_mc"), ("EXACT_PER_EDGE", "exact_per_edge"), ("Hutchinson:2", "hutchinson:2")])
def test_a_near_miss_arch_mode_names_the_mode_meant(supernet, mode, meant):
    net, x, y, edges = supernet
    refused(net, lambda: arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode), match=f"did you mean '{meant}'")


# -- params -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", WEIGHT_MODES)
@pytest.mark.parametrize("params, error, match", [
    (["nope"], CurvatureError, "not a parameter of the model"),
    ("0.weight", CurvatureTypeError, r"params=\['0.weight'\]"),
    ([5], CurvatureTypeError, "names, \\(name, tensor\\) pairs"),
    ([], CurvatureError, "params=None for all"),
    ({"0.weight": torch.zeros(2)}, CurvatureError, r"shape \(6, 4\)"),
])
def test_weight_params_that_do_not_exist_are_refused(mlp, mode, params, error, match):
    net, x, y = mlp
    refused(net, lambda: diag_hessian(net, F.cross_entropy, x, y, mode=mode, params=params), error, match)


@pytest.mark.parametrize("mode", WEIGHT_MODES)
def test_a_model_without_parameters_is_refused_saying_so(mode):
    net = nn.Sequential(nn.Tanh())
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 3, (4,))
    refused(net, lambda: diag_hessian(net, F.cross_entropy, x, y, mode=mode), match="has no parameters")


def test_alpha_params_by_name_or_as_a_bare_tensor_are_refused(supernet):
    net, x, y, _ = supernet
    name, alpha = next(net.named_arch_parameters())
    refused(net, lambda: hessian_eigenvalues(net, F.cross_entropy, x, y, params=[name], k=1),
            CurvatureTypeError, "pass the tensor itself")
    # a bare tensor was iterated row by row: rows are not what the loss uses, so the spectrum was silently zero
    refused(net, lambda: hessian_eigenvalues(net, F.cross_entropy, x, y, params=alpha, k=1),
            CurvatureTypeError, "wrap it in a list")
    refused(net, lambda: alpha_diag_hessian(net, F.cross_entropy, x, y, params=[]), CurvatureError, "params is empty")


def test_a_model_that_is_not_a_module_or_a_loss_that_is_not_callable(mlp, supernet):
    net, x, y = mlp
    refused(net, lambda: diag_hessian(lambda t: t, F.cross_entropy, x, y), CurvatureTypeError, "nn.Module")
    refused(net, lambda: diag_hessian(net, "cross_entropy", x, y), CurvatureTypeError, "loss_fn must be callable")
    snet, sx, sy, edges = supernet
    refused(snet, lambda: arch_diag_hessian(snet, "ce", sx, sy, edges), CurvatureTypeError, "loss_fn must be callable")


# -- inputs and targets -----------------------------------------------------------------------------------


def cast(dtype):
    return lambda x: x.to(dtype) if dtype.is_floating_point else (x * 4).to(dtype)


@pytest.mark.parametrize("mode", WEIGHT_MODES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.float16, torch.float32])
def test_weight_inputs_of_another_dtype_name_the_conversion(mlp, mode, dtype):
    net, x, y = mlp
    calls = len(net.user_calls)
    refused(net, lambda: diag_hessian(net, F.cross_entropy, cast(dtype)(x), y, mode=mode), CurvatureTypeError,
            r"inputs.to\(torch.float64\)")
    assert len(net.user_calls) > calls  # the user's hook ran (it was kept in place)


@pytest.mark.parametrize("mode", ARCH_MODES)
def test_arch_inputs_of_another_dtype_name_the_conversion(supernet, mode):
    net, x, y, edges = supernet
    for dtype in (torch.int64, torch.float16):
        refused(net, lambda: arch_diag_hessian(net, F.cross_entropy, cast(dtype)(x), y, edges, mode=mode),
                CurvatureTypeError, r"inputs.to\(torch.float64\)")


def test_alpha_and_spectrum_inputs_of_another_dtype(supernet):
    net, x, y, _ = supernet
    refused(net, lambda: alpha_diag_hessian(net, F.cross_entropy, x.float(), y), CurvatureTypeError, "dtype torch.float32")
    refused(net, lambda: hessian_eigenvalues(net, F.cross_entropy, x.long(), y, k=1), CurvatureTypeError, "dtype torch.int64")


def test_inputs_on_another_device_name_the_move(mlp):
    net, x, y = mlp
    refused(net, lambda: diag_hessian(net, F.cross_entropy, x.to("meta"), y, mode="diag"), CurvatureTypeError, r"inputs.to\('cpu'\)")


@pytest.mark.parametrize("mode", WEIGHT_MODES)
def test_a_batch_of_one_through_train_mode_batch_norm(mlp, mode):
    net, x, y = mlp
    refused(net, lambda: diag_hessian(net, F.cross_entropy, x[:1], y[:1], mode=mode), match="batch of one sample.*model.eval")


@pytest.mark.parametrize("mode", WEIGHT_MODES)
def test_weight_targets_of_another_batch_or_shape(mlp, mode):
    net, x, y = mlp
    refused(net, lambda: diag_hessian(net, F.cross_entropy, x, y[:3], mode=mode), match="targets hold 3 samples but the model returned 5")
    refused(net, lambda: diag_hessian(net, F.cross_entropy, x, torch.randn(5, 7, dtype=DT), mode=mode),
            match=r"targets \(5, 7\) torch.float64 .*class indices")


@pytest.mark.parametrize("mode", ARCH_MODES)
def test_arch_targets_of_another_batch(supernet, mode):
    net, x, y, edges = supernet
    refused(net, lambda: arch_diag_hessian(net, F.cross_entropy, x, y[:2], edges, mode=mode), match="targets hold 2 samples")


def test_alpha_and_spectrum_targets_of_another_batch(supernet):
    net, x, y, _ = supernet
    refused(net, lambda: alpha_diag_hessian(net, F.cross_entropy, x, y[:2]), match="targets hold 2 samples")
    refused(net, lambda: hessian_eigenvalues(net, F.cross_entropy, x, y[:2], k=1), match="targets hold 2 samples")


def test_probe_hessian_with_integer_inputs(supernet):
    net, x, y, _ = supernet
    probe = nasdiag.attach(net, hessian="approx")
    with probe.record(targets=y):
        F.cross_entropy(net(x), y).backward()
    net.zero_grad(set_to_none=True)
    refused(net, lambda: probe.hessian(inputs=x.long(), targets=y), CurvatureTypeError, "dtype torch.int64")
    refused(net, lambda: probe.hessian(mode="approx", wrt="Alpha"), CurvatureError, "wrt must be 'Z'")


# -- the loss ---------------------------------------------------------------------------------------------


def per_sample(o, t):
    return F.cross_entropy(o, t, reduction="none")


def constant(o, t):
    return torch.tensor(1.0, dtype=DT, requires_grad=True)


@pytest.mark.parametrize("mode", WEIGHT_MODES)
def test_weight_losses_that_are_no_scalar_of_the_outputs(mlp, mode):
    net, x, y = mlp
    refused(net, lambda: diag_hessian(net, per_sample, x, y, mode=mode), match="reduction='mean'")
    # a loss that ignores the outputs: diag/approx blamed an in-place op, exact returned zeros silently
    refused(net, lambda: diag_hessian(net, constant, x, y, mode=mode), match="does not depend on the model outputs")


@pytest.mark.parametrize("mode", ARCH_MODES)
def test_arch_losses_that_are_no_scalar_of_the_outputs(supernet, mode):
    net, x, y, edges = supernet
    refused(net, lambda: arch_diag_hessian(net, per_sample, x, y, edges, mode=mode), match="reduction='mean'")
    refused(net, lambda: arch_diag_hessian(net, constant, x, y, edges, mode=mode), match="does not depend on the model outputs")


def test_spectrum_of_a_loss_that_ignores_the_outputs(supernet):
    net, x, y, _ = supernet
    refused(net, lambda: hessian_eigenvalues(net, constant, x, y, k=1), match="does not depend on the model outputs")


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_a_loss_coupling_samples_is_a_curvature_error(mlp, mode):
    net, x, y = mlp
    refused(net, lambda: diag_hessian(net, lambda o, t: o.sum() ** 2, x, y, mode=mode), match="mode='exact'")


# -- edges and the knobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ARCH_MODES)
def test_edges_listing_fewer_ops_than_the_mixed_op_mixes(supernet, mode):
    # raised inside nasdiag's forward pre-hook, half-way through the forward: every hook must still go
    net, x, y, edges = supernet
    spec = next(iter(edges.values()))
    short = {"short": (spec.module, list(spec.ops)[:2])}
    refused(net, lambda: arch_diag_hessian(net, F.cross_entropy, x, y, short, mode=mode), match="K=2")


@pytest.mark.parametrize("chunk_size, error", [(0, CurvatureError), (-1, CurvatureError), ("8", CurvatureTypeError),
                                               (2.0, CurvatureTypeError), (True, CurvatureTypeError)])
def test_chunk_sizes_that_are_not_positive_ints(supernet, chunk_size, error):
    net, x, y, edges = supernet
    refused(net, lambda: exact_arch_diag_hessian(net, F.cross_entropy, x, y, edges, chunk_size=chunk_size), error, "chunk_size")
    # alpha_diag_hessian returned uninitialized memory for chunk_size=-1 (an empty loop over the chunks)
    refused(net, lambda: alpha_diag_hessian(net, F.cross_entropy, x, y, chunk_size=chunk_size), error, "chunk_size")


@pytest.mark.parametrize("max_memory, error", [("1GB", CurvatureTypeError), (-1, CurvatureError), (0, CurvatureError)])
def test_max_memory_that_is_not_a_positive_size(supernet, max_memory, error):
    net, x, y, edges = supernet
    for mode in ARCH_MODES:
        refused(net, lambda: arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, max_memory=max_memory), error,
                "max_memory")
    refused(net, lambda: alpha_diag_hessian(net, F.cross_entropy, x, y, max_memory=max_memory), error, "max_memory")


@pytest.mark.parametrize("mode", ARCH_MODES)
def test_samples_and_seed_of_the_wrong_kind(supernet, mode):
    net, x, y, edges = supernet
    refused(net, lambda: arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, samples=0), CurvatureError, "samples")
    refused(net, lambda: arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode, seed="a"), CurvatureTypeError, "seed")


def test_registering_a_rule_class_instead_of_an_instance():
    with pytest.raises(CurvatureTypeError, match="not a class"):
        register_rule(nn.Tanh, ElementwiseRule)
    with pytest.raises(CurvatureTypeError, match="GlueRule instance"):
        register_glue_rule("CumsumBackward0", object())


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_an_input_modified_in_place_after_its_module_is_a_curvature_error(mode):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.ReLU(inplace=True), nn.Linear(6, 3)).to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    refused(net, lambda: diag_hessian(net, F.cross_entropy, x, y, mode=mode), CurvatureRuntimeError, "inplace=False")


# -- misuses that now compute -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["diag", "approx"])
def test_a_frozen_supernet_has_the_mixing_weight_curvature_of_the_unfrozen_one(mode):
    # the curvature w.r.t. Z does not depend on which tensors require grad; diag/approx refused a frozen
    # model with a bare ValueError ("the model output does not require grad") while exact and ggn computed
    torch.manual_seed(0)
    net = Network(C=2, num_classes=3, layers=2, steps=2, multiplier=2, in_channels=1, stem_multiplier=1).to(DT)
    x, y = torch.randn(3, 1, 6, 6, dtype=DT), torch.randint(0, 3, (3,))
    edges = {s.name: s for s in net.edge_specs()}
    expected = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode)
    for p in net.parameters():
        p.requires_grad_(False)
    got = arch_diag_hessian(net, F.cross_entropy, x, y, edges, mode=mode)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


class IgnoresItsParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return 2 * x[:, :3]


@pytest.mark.parametrize("mode", WEIGHT_MODES)
def test_a_model_that_ignores_its_parameters_has_zero_curvature(mode):
    # the outputs carry no graph: exact and hutchinson failed in autograd, diag/approx with a bare ValueError
    net = IgnoresItsParameters().to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    got = diag_hessian(net, F.cross_entropy, x, y, mode=mode)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in got.values())


class EmbeddingThenFails(nn.Module):
    """Takes token ids (integer inputs are right) and fails for a reason of its own."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, ids):
        raise RuntimeError("a bug of the model")


def test_integer_inputs_of_an_embedding_model_are_not_blamed_for_its_own_failure():
    net = EmbeddingThenFails().to(DT)
    with pytest.raises(RuntimeError, match="a bug of the model") as info:
        diag_hessian(net, F.cross_entropy, torch.randint(0, 10, (5, 3)), torch.randint(0, 3, (5,)), mode="exact")
    assert not isinstance(info.value, NasdiagError)
