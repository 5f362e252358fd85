"""Audit round 4: the public API's cross-cutting guarantees — no hooks left behind, the model as it was after any
failure, no growth across steps, a NaN recorded and flagged (never blamed on the model, never hidden), thread safety.

Every reference is built here in float64: the model's full state snapshotted before a call (module and global hooks,
attributes, parameters and their ``.grad`` objects, buffers, train/eval and BatchNorm flags, grad mode, the global
random stream) and compared after it; ∂L/∂Z by autograd on leaf mixing weights; the same calls run one after the other
as the reference for two threads.

Defects found (each test says which):

* a NaN batch or an inf weight at the first recorded step was a ``ProbeError`` saying the edge's output "is not
  Σ_k w_k·op_k(x) ... (relative deviation nan)" and asking to re-map the edge: the step's NaN costs were lost and the
  model blamed (``test_a_nan_batch_or_inf_weight_at_the_first_step_is_recorded_as_nan_like_autograd``);
* the path split's node check passed on a NaN deviation and was then marked done, so a node that is not the plain sum
  of its edges (PC-DARTS's β) gave silent path parts at every later step
  (``test_checks_skipped_at_a_nan_step_run_at_the_next_finite_step``); the span check's least squares raised torch's
  ``LinAlgError`` on a NaN step (same test);
* a supernet the fast engine cannot batch (LayerNorm, conv-bn-relu, or train-mode BatchNorm while a curvature call
  switches its tracking off) kept every forward's batch, logits and mixing weights alive: the engine raised one cached
  exception object again at each forward, chaining each raise's frames onto its traceback
  (``test_a_supernet_the_fast_engine_cannot_batch_keeps_nothing_across_steps``);
* a model and batch on the meta device: torch's "Tensor.item() cannot be called on meta tensors" from most curvature
  routes, dicts of meta tensors from the exact ones
  (``test_a_model_and_batch_on_the_meta_device_are_one_line_in_every_curvature_route``).

Verified and kept as one test each: every state-touching entry point leaves the model as it was when the user's
forward (first, second or last module), loss or a KeyboardInterrupt fails at any of its calls; two models probed and
curved at once in two threads give bit for bit the numbers of the same calls made one after the other.
"""

import math
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.modules.module as torch_module
from torch import nn

import nasdiag
from nasdiag.probe import ProbeError
from nasdiag.supernet import Network
from nasdiag.supernet.cell import Cell

from conftest import live_tensors

DT = torch.float64
PRIMITIVES = ("none", "skip_connect", "avg_pool_3x3", "sep_conv_3x3")


def supernet(seed=0, steps=1):
    torch.manual_seed(seed)
    net = Network(C=2, num_classes=3, layers=2, steps=steps, multiplier=steps, in_channels=1, stem_multiplier=1,
                  primitives=PRIMITIVES, reductions=(1,)).to(DT).train()
    return net, torch.randn(3, 1, 4, 4, dtype=DT), torch.randint(0, 3, (3,))


def autograd_costs(net, x, y):
    """∂L/∂Z per edge by autograd: each cell's (E, K) weights as a leaf of its own."""
    weights = net.softmax_weights()
    leaves = [weights[c.cell_type].detach().clone().requires_grad_() for c in net.cells]
    grads = torch.autograd.grad(F.cross_entropy(net(x, leaves), y), leaves)
    return {f"cells.{i}.edges.{e}": g[e] for i, g in enumerate(grads) for e in range(g.shape[0])}


# -- NaN: recorded and flagged, never blamed on the model --------------------------------------------------------


@pytest.mark.parametrize("case", ["nan_batch", "inf_weight"])
def test_a_nan_batch_or_inf_weight_at_the_first_step_is_recorded_as_nan_like_autograd(case):
    """Before: ProbeError "its output is not Σ_k w_k·op_k(x) ... (relative deviation nan)": the weighted-sum check
    compared NaN with its tolerance, so a diverged model or a NaN batch was blamed on the edge mapping."""
    net, x, y = supernet()
    if case == "nan_batch":
        x[0, 0, 0, 0] = math.nan
    else:
        with torch.no_grad():
            net.stem[0].weight[0, 0, 0, 0] = math.inf
    want = autograd_costs(net, x, y)
    probe = nasdiag.attach(net)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    with pytest.warns(RuntimeWarning, match="NaN cost"):
        got = probe.costs()
    assert any(bool(torch.isnan(v).any()) for v in want.values())
    for name, value in want.items():  # 'none' (op 0) is left out of the graph: autograd's structural 0 is 0·NaN here
        torch.testing.assert_close(got[name][1:], value[1:], rtol=1e-12, atol=1e-14, equal_nan=True)
    with pytest.warns(RuntimeWarning, match="hold NaN"):
        stats = probe.statistics()
    assert all(bool(torch.from_numpy(stats[f"cost/{t}/count"]).eq(1).all()) for t in ("normal", "reduce"))
    assert torch.from_numpy(stats["cost/normal/mean"]).isnan().any()


class Doubled(nn.Module):
    """Not a mixed op of its weights: 2 Σ_k w_k op_k(x)."""

    def __init__(self):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(3, 3), nn.Tanh()])

    def forward(self, x, w):
        return 2 * sum(w[k] * op(x) for k, op in enumerate(self.ops))


class Bent(nn.Module):
    """Not a mixed op of its candidates: relu of their sum lies outside their span."""

    def __init__(self):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(3, 3), nn.Tanh()])

    def forward(self, x):
        return torch.relu(self.ops[0](x) - self.ops[1](x))


class UserNet(nn.Module):
    def __init__(self, edge):
        super().__init__()
        self.edge, self.head = edge, nn.Linear(3, 2)
        self.z = nn.Parameter(torch.tensor([0.4, 0.6]))

    def forward(self, x):
        h = self.edge(x, self.z) if isinstance(self.edge, Doubled) else self.edge(x)
        return self.head(h)


def beta_scaled_cell_forward(cell):
    """DARTS's cell with PC-DARTS's edge normalisation β = 0.5 at every node: no node is the plain sum of its edges."""

    def forward(s0, s1, weights):
        states = [cell.preprocess0(s0), cell.preprocess1(s1)]
        offset = 0
        for _ in range(cell.steps):
            states.append(sum(0.5 * cell.edges[offset + i](h, weights[offset + i]) for i, h in enumerate(states)))
            offset += len(states) - 1
        return torch.cat(states[-cell.multiplier:], dim=1)

    return forward


@pytest.mark.parametrize("model", ["weighted_sum", "span", "path_split_node"])
def test_checks_skipped_at_a_nan_step_run_at_the_next_finite_step(model):
    """A NaN step decides nothing about the model's structure: no error there (its costs are NaN, flagged), and the
    check is made at the next finite step. Before: the weighted-sum and span checks raised at the NaN step; the path
    split's node check passed on the NaN deviation and was never made again (silent parts under β at every step)."""
    torch.manual_seed(0)
    if model == "path_split_node":
        net, x, y = supernet(steps=2)
        for cell in net.cells:
            cell.forward = beta_scaled_cell_forward(cell)
        probe, match = nasdiag.attach(net, path_split=True), "path_split needs node"
    else:
        edge = Doubled() if model == "weighted_sum" else Bent()
        net = UserNet(edge).to(DT)
        x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
        probe = nasdiag.attach(net, edges={"e": (edge, list(edge.ops))})
        match = "is not Σ_k w_k·op_k" if model == "weighted_sum" else "is not a weighted sum"
    bad = x.clone()
    bad.view(-1)[0] = math.nan
    with probe.record():
        F.cross_entropy(net(bad), y).backward()
    with pytest.warns(RuntimeWarning, match="NaN cost"):
        assert any(bool(torch.isnan(v).any()) for v in probe.costs().values())
    with pytest.raises(ProbeError, match=match) as raised:
        with probe.record():
            F.cross_entropy(net(x), y).backward()
    assert "\n" not in str(raised.value)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())


# -- memory: nothing kept across steps ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["layer_norm_training_steps", "batch_norm_curvature_calls"])
def test_a_supernet_the_fast_engine_cannot_batch_keeps_nothing_across_steps(case):
    """Before: the fast engine cached its Unsupported exception and raised that one object at every forward, so each
    raise chained the forward's frames onto its traceback: every step's batch, logits and mixing weights stayed alive
    (5 tensors a step on a LayerNorm or conv-bn-relu supernet; two curvature calls in a row under train-mode BatchNorm,
    whose flag switch the engine does not batch, the same)."""
    from nasdiag.hessian import hessian_eigenvalues

    torch.manual_seed(0)
    if case == "layer_norm_training_steps":
        net = Network(C=2, num_classes=3, layers=2, steps=1, multiplier=1, in_channels=1, stem_multiplier=1,
                      primitives=PRIMITIVES, reductions=(1,), norm="layer").to(DT)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        def step():
            x, y = torch.randn(3, 1, 4, 4, dtype=DT), torch.randint(0, 3, (3,))
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    else:
        net, x, y = supernet()

        def step():
            hessian_eigenvalues(net, F.cross_entropy, x, y, params=net.arch_parameters(), method="power", iters=2)

    for _ in range(3):
        step()
    before = live_tensors()
    for _ in range(10):
        step()
    assert live_tensors() == before


# -- failures at any stage leave the model as it was -------------------------------------------------------------

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOKS = [n for n in dir(torch_module) if n.startswith("_global_") and isinstance(getattr(torch_module, n), dict)]


def snapshot(model):
    """What no call may change: hooks (module, global, tensor), module attributes, parameter objects, values, flags
    and .grad objects, buffers, train/eval and BatchNorm flags, grad mode, the global random stream."""
    modules = dict(model.named_modules())
    return {
        "hooks": {(n, d): tuple(getattr(m, d, None) or ()) for n, m in modules.items() for d in HOOK_DICTS},
        "global": {n: tuple(getattr(torch_module, n)) for n in GLOBAL_HOOKS},
        "attributes": {n: sorted(vars(m)) for n, m in modules.items()},
        "flags": {n: (m.training, getattr(m, "track_running_stats", None), getattr(m, "momentum", None))
                  for n, m in modules.items()},
        "parameters": {n: (id(p), p.requires_grad, id(p.grad), tuple(p._backward_hooks or ())) for n, p in model.named_parameters()},
        "values": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "modes": (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_anomaly_enabled()),
        "rng": torch.get_rng_state(),
    }


def assert_same_state(before, after, what):
    for key in ("hooks", "global", "attributes", "flags", "parameters", "modes"):
        assert after[key] == before[key], f"{what}: {key} changed"
    for key in ("values", "grads", "buffers"):
        for name, t in before[key].items():
            assert torch.equal(after[key][name], t), f"{what}: {key} {name} changed"
    assert torch.equal(after["rng"], before["rng"]), f"{what}: the global random stream moved"


class Boom(Exception):
    pass


class Trap:
    """Counts calls; raises ``exc`` at call ``at``."""

    def __init__(self):
        self.calls, self.at, self.exc = 0, None, Boom

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.at:
            raise self.exc(f"injected at call {self.calls}")


def mlp():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).to(DT).train()
    return net, torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))


def _edges(net):
    return {s.name: s for s in net.edge_specs()}


def _probe_step(net, x, y, loss):
    probe = nasdiag.attach(net, path_split=True, norm_deviation=True, hessian="approx", loss_fn=loss)
    with probe.record(targets=y):
        loss(net(x), y).backward()
    probe.path_costs(), probe.output_costs(), probe.invariance_deviation(), probe.statistics()
    probe.hessian()


ENTRY_POINTS = {
    "probe.record+hessian": (supernet, _probe_step),
    "arch_diag_hessian[ggn_mc]": (supernet, lambda net, x, y, loss: nasdiag.hessian.arch_diag_hessian(
        net, loss, x, y, _edges(net), mode="ggn_mc", seed=0)),
    "exact_arch_diag_hessian[alpha, autograd]": (supernet, lambda net, x, y, loss: nasdiag.hessian.exact_arch_diag_hessian(
        net, loss, x, y, _edges(net), wrt="alpha", shared_alpha="per_edge", backend="autograd")),
    "diag_hessian[approx]": (mlp, lambda net, x, y, loss: nasdiag.hessian.diag_hessian(net, loss, x, y, mode="approx")),
    "diag_hessian[exact]": (mlp, lambda net, x, y, loss: nasdiag.hessian.diag_hessian(net, loss, x, y, mode="exact")),
    "alpha_diag_hessian": (mlp, lambda net, x, y, loss: nasdiag.hessian.alpha_diag_hessian(net, loss, x, y, params=[net[3].weight])),
    "hessian_eigenvalues": (mlp, lambda net, x, y, loss: nasdiag.hessian.hessian_eigenvalues(
        net, loss, x, y, params=list(net.parameters()), k=2)),
    "input_ranks_of": (mlp, lambda net, x, y, loss: nasdiag.cost.input_ranks_of(net, x)),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_failure_at_any_stage_leaves_the_model_as_it_was(entry):
    """The user's forward (a pre-hook of the first, second and last leaf module), loss or a KeyboardInterrupt fails at
    the first and at the last of that site's calls in the entry point: the exception comes out unchanged, and hooks,
    attributes, parameters (objects, values, requires_grad, .grad), buffers, modes and the random stream are as before
    (the probe's own step changes .grad and BatchNorm's statistics, as the user's backward does: only the rest there)."""
    make, call = ENTRY_POINTS[entry]
    net, x, y = make()
    F.cross_entropy(net(x), y).backward()  # every parameter has a .grad that must stay put
    leaves = [m for m in net.modules() if not list(m.children())]
    traps = {"first": leaves[0], "second": leaves[1], "last": leaves[-1]}
    for name, module in list(traps.items()):
        traps[name] = trap = Trap()
        module.register_forward_pre_hook(lambda m, a, trap=trap: trap())
    traps["loss"] = loss_trap = Trap()

    def loss(out, t):
        loss_trap()
        return F.cross_entropy(out, t)

    user_step = entry.startswith("probe")
    call(net, x, y, loss)  # a clean call: how often each site runs
    counts = {name: trap.calls for name, trap in traps.items()}
    assert all(counts.values()) or entry == "input_ranks_of"
    for site, trap in traps.items():
        for at in sorted({1, counts[site]}) if counts[site] else ():
            for exc in (Boom, KeyboardInterrupt):
                for t in traps.values():
                    t.calls, t.at = 0, None
                trap.at, trap.exc = at, exc
                before = snapshot(net)
                with pytest.raises(exc, match="injected"):
                    call(net, x, y, loss)
                after = snapshot(net)
                if user_step:
                    for key in ("values", "grads", "buffers", "rng"):
                        after[key] = before[key]
                assert_same_state(before, after, f"{entry}: {exc.__name__} at call {at} of {site}")
        trap.at = None


# -- threads -------------------------------------------------------------------------------------------------------


def _probe_and_curve(made, steps, out, key):
    net, x, y = made
    probe = nasdiag.attach(net, path_split=True, hessian="approx")
    results = []
    for step in range(steps):
        xs = x + 0.1 * step
        with probe.record(targets=y):
            F.cross_entropy(net(xs), y).backward()
        results.append((probe.costs(), probe.path_costs(), probe.hessian(),
                        nasdiag.hessian.diag_hessian(net, F.cross_entropy, xs, y, mode="approx")))
        net.zero_grad()
    out[key] = (results, {k: torch.from_numpy(v) for k, v in probe.statistics().items()})


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree) for t in _tensors(tree[k])]
    return [t for v in tree for t in _tensors(v)]


def test_two_models_probed_and_curved_at_once_in_two_threads_match_the_calls_made_in_turn():
    """The hook plans, captures and curvature calls of two models in two threads do not see each other: every number
    equals, bit for bit, the one of the same calls made one after the other, and no hook is left on either model."""
    alone, together = {}, {}
    for seed in (1, 2):
        _probe_and_curve(supernet(seed), 2, alone, seed)
    models = {seed: supernet(seed) for seed in (1, 2)}  # built here: torch.manual_seed is global
    threads = [threading.Thread(target=_probe_and_curve, args=(models[seed], 2, together, seed)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed in (1, 2):
        a, b = _tensors(alone[seed]), _tensors(together[seed])
        assert len(a) == len(b) > 0
        assert all(torch.equal(u, v) for u, v in zip(a, b)), f"model {seed}"
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in models[seed][0].modules())


# -- device of the results ---------------------------------------------------------------------------------------

META_CALLS = {
    "diag_hessian[approx]": (mlp, lambda net, x, y: nasdiag.hessian.diag_hessian(net, F.cross_entropy, x, y, mode="approx")),
    "diag_hessian[exact]": (mlp, lambda net, x, y: nasdiag.hessian.diag_hessian(net, F.cross_entropy, x, y, mode="exact")),
    "diag_hessian[hutchinson:2]": (mlp, lambda net, x, y: nasdiag.hessian.diag_hessian(
        net, F.cross_entropy, x, y, mode="hutchinson:2")),
    "hessian_eigenvalues": (mlp, lambda net, x, y: nasdiag.hessian.hessian_eigenvalues(
        net, F.cross_entropy, x, y, params=list(net.parameters()))),
    "hutchinson_trace": (mlp, lambda net, x, y: nasdiag.hessian.hutchinson_trace(
        net, F.cross_entropy, x, y, params=list(net.parameters()), samples=2)),
    "arch_diag_hessian[diag, alpha]": (supernet, lambda net, x, y: nasdiag.hessian.arch_diag_hessian(
        net, F.cross_entropy, x, y, _edges(net), mode="diag", wrt="alpha")),
    "arch_diag_hessian[ggn]": (supernet, lambda net, x, y: nasdiag.hessian.arch_diag_hessian(
        net, F.cross_entropy, x, y, _edges(net), mode="ggn")),
    "arch_diag_hessian[exact]": (supernet, lambda net, x, y: nasdiag.hessian.arch_diag_hessian(
        net, F.cross_entropy, x, y, _edges(net), mode="exact")),
    "alpha_diag_hessian": (supernet, lambda net, x, y: nasdiag.hessian.alpha_diag_hessian(net, F.cross_entropy, x, y)),
}


@pytest.mark.parametrize("call", list(META_CALLS))
def test_a_model_and_batch_on_the_meta_device_are_one_line_in_every_curvature_route(call):
    """Before: torch's "Tensor.item() cannot be called on meta tensors" or "Cannot copy out of meta tensor" from deep
    inside most routes, while the exact routes returned dicts of meta tensors (numbers without values); the probe
    already refused a meta step in one line."""
    make, run = META_CALLS[call]
    net, x, y = make()
    net, x, y = net.to("meta"), x.to("meta"), y.to("meta")
    with pytest.raises(nasdiag.hessian.CurvatureError, match="meta device") as raised:
        run(net, x, y)
    assert "\n" not in str(raised.value)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())
