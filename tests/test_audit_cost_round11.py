"""Cost audit round 11: the wiring paper's cost C(Z) = ∂L/∂Z = <∂L/∂x_j, O(x_i)> (supplement §2, §2.1) against a
float64 supernet written from scratch here (three DARTS-convention mixed ops on a two-node DAG, leaf mixing weights Z,
plain autograd for ∂L/∂Z; numpy for the streaming moments; f(c·x) = f(x) evaluated directly for the scale-invariance
rules). Never nasdiag against nasdiag.

Defects found (each test fails without its fix):

* A TorchScript model (``torch.jit.trace``) was refused as "no edges found ... pass edges=", and mapping its mixed ops
  with ``edges=`` gave NaN costs with a warning that their forward "never ran" (it ran, in the TorchScript interpreter,
  which calls no Python hooks); a scripted mixed op inside an eager model was silently left out of the discovered edges
  (its ``_ops`` is no ModuleList any more), and a scripted candidate op raised torch's "register_forward_hook is not
  supported on ScriptModules" traceback at the first block; a ``torch.export`` graph got the same "pass edges=" advice,
  whose modules never run there. Now one ProbeError line at ``attach`` saying so
  (test_torchscript_models_edges_and_candidates_are_one_probe_error_line_at_attach).
* docs/probe.md said ``costs()`` "= autograd's ∂L/∂Z" without the condition the equation rests on: a loss term on Z
  or α themselves (a regularizer of the architecture) is in autograd's ∂L/∂Z but never reaches x_j, so not in the
  cost; and that per-sample rows of a mean loss "each carry the 1/B", which reads as sample b's own gradient: under
  train-mode BatchNorm the rows hold the other samples' terms too (a sample dropped by ``ignore_index`` has a non-zero
  row). Both documented now (test_costs_under_other_losses_equal_autograd_and_a_regularizer_on_z_is_left_out_as_documented,
  test_per_sample_rows_are_the_per_sample_weight_gradients_and_couple_under_train_mode_batchnorm).
* A candidate op returning a tuple (output, auxiliary) stopped the step with "candidate op 3 returned tuple, not a
  tensor", naming neither the op nor a way out; the line now says to list the submodule that returns the weighted
  tensor in ``edges=`` (which then costs exactly)
  (test_a_candidate_returning_a_tuple_is_one_line_saying_how_to_map_it_and_the_mapped_inner_module_is_exact).
  docs/probe.md now also says that the streaming statistics take each step's costs unweighted by its batch size.
* Per-sample gradients by ``torch.func.vmap(grad(...))`` inside a block leaked vmap's batched tensors into the costs:
  torch's "INTERNAL ASSERT FAILED ... maybe_level.has_value()" at the end of the block (on a first step, a ``.item()``
  error in the convention check). Now one ProbeError line at the forward
  (test_vmap_inside_a_block_is_one_probe_error_line_and_torch_func_grad_gives_the_costs).
* ``is_scale_invariant(op, example_input)`` (``nasdiag.rules.input_ranks_of``: one forward to learn the ranks) restored
  the buffers but not the global random generator: a train-mode dropout in the op advanced it, so asking the question
  shifted the training's later dropout masks; and an op starting with an in-place ReLU zeroed the negative entries of
  the caller's example tensor (the forward now runs on copies)
  (test_asking_with_an_example_input_leaves_the_buffers_the_random_stream_and_the_input_as_they_were; the fix is in
  nasdiag/rules.py, outside this area, a few lines).
* The per-edge statistics groups (edges of different K, no cell types) are named by the edge, and an edge named
  ``"0->2"`` or ``"cell/a"`` wrote ``cost/cell/a/mean``, a path of no ``cost/<cell>/...`` family: averaged instead of
  pooled across DDP ranks, invisible to ``nasdiag plot``. Such characters become ``_`` in the group name now
  (test_per_edge_statistics_of_edges_named_with_path_characters_stay_in_the_cost_families).
* ``invariance_deviation()`` (norm_deviation=True) took the max of eps/(var + eps) over every grad-enabled call in the
  block, also an eval-mode validation pass (not backwarded), where a BatchNorm is an affine map of its running
  statistics and the op is not invariant: 125x the training forward's value in the test's case
  (test_invariance_deviation_leaves_out_an_eval_mode_pass_with_grad_inside_the_block).
  A block begun in eval mode whose step ran in train mode (``model.train()`` inside it) measured the eval mode's
  normalizations (none) and gave empty rows, read as "no invariant op"; now NaN for the step's invariant ops with a
  warning (test_a_block_begun_in_eval_mode_whose_step_runs_in_train_mode_flags_the_deviation_nan_not_an_empty_row).
* A model forward that runs its batch through the edges in chunks (``torch.cat([f(c) for c in x.chunk(2)])``) gave
  "per-sample" costs of shape (B/2, K), rows of different samples added up as if the edge were tied; now a ProbeError
  line (test_per_sample_costs_of_a_forward_run_in_chunks_are_refused_not_summed_across_samples; its library half was
  committed by the newuser helper, in be5c0ea and 1cf3b3f). Output-cost and path per-sample rows still add up across
  chunks (documented).

Checked and right: costs and per-sample rows (their sum) under label smoothing, class weights, ignore_index,
reduction="sum", MSE and a loss with a regularizer on α (1e-15); per-sample rows = ∂L/∂Z_bk of per-sample weights in
train-mode BatchNorm at B = 1 and B = 5; streaming mean/var/count against numpy over steps of unequal batch size (each
step one observation, unweighted, as documented) with a NaN step kept and flagged; the homogeneity rules on random
compositions of 16 module kinds (train and eval mode) never call an op invariant that f(c·x) refutes; an op output
also consumed outside its edge, one candidate module at two positions of an edge and one shared between edges;
evaluation forwards under no_grad / inference_mode inside and between blocks (exact costs, per-sample rows of the
training forward only, no tensor kept); ``torch.compile`` (eager backend here; inductor checked by hand) gives
autograd's costs.
"""

import math
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import assert_no_module_hooks, live_tensors

import nasdiag
from nasdiag.cost import analyse, is_scale_invariant
from nasdiag.probe.discovery import ProbeError
from nasdiag import vocabulary

DT = torch.float64
EDGES = ("e01", "e02", "e12")


class Mix(nn.Module):
    """A DARTS-convention mixed op: x_j += Σ_k w_k·op_k(x_i); weights (K,) or per sample (B, K)."""

    def __init__(self, ops):
        super().__init__()
        self._ops = nn.ModuleList(ops)

    def forward(self, x, weights):
        out = torch.zeros_like(x)
        for k, op in enumerate(self._ops):
            w = weights[k] if weights.dim() == 1 else weights[:, k].reshape(-1, 1, 1, 1)
            out = out + w * op(x)
        return out


def _ops(C):
    return [nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C, affine=False)),
            nn.Identity(), nn.AvgPool2d(3, 1, 1), nn.Sequential(nn.Conv2d(C, C, 1), nn.Tanh())]


class Net(nn.Module):
    """n0 = stem(x); n1 = e01(n0); n2 = e02(n0) + e12(n1); logits = head(GAP(n1 ‖ n2)). Z: (3, K) or (3, B, K)."""

    def __init__(self, C=3, n=5, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Conv2d(2, C, 3, padding=1)
        self.e01, self.e02, self.e12 = Mix(_ops(C)), Mix(_ops(C)), Mix(_ops(C))
        self.head = nn.Linear(2 * C, n)
        self.to(DT)

    def forward(self, x, Z):
        n0 = self.stem(x)
        n1 = self.e01(n0, Z[0])
        n2 = self.e02(n0, Z[1]) + self.e12(n1, Z[2])
        return self.head(torch.cat([n1, n2], 1).mean((2, 3)))


def _with_mixed_op(net, cls):
    """``net`` with each mixed op replaced by a ``cls`` over the same candidate modules."""
    for name in EDGES:
        mixed = cls([])
        mixed._ops = getattr(net, name)._ops
        setattr(net, name, mixed)
    return net


def _batch(B, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 2, 5, 5, generator=g, dtype=DT), torch.randint(0, 5, (B,), generator=g)


def _weights(seed=2, B=None):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 4) if B is None else (3, B, 4)
    return torch.softmax(torch.randn(shape, generator=g, dtype=DT), -1)


def _autograd(net, x, Z, loss):
    """The reference: ∂L/∂Z with Z a leaf, (3, K) or (3, B, K)."""
    Z = Z.detach().clone().requires_grad_()
    return torch.autograd.grad(loss(net(x, Z), Z), Z)[0]


def _probed(probe, net, x, Z, loss, model=None):
    """One recorded step; (costs (3, K), per-sample rows (3, B, K)) in EDGES order."""
    Z = Z.detach().clone().requires_grad_()
    with probe.record():
        loss((net if model is None else model)(x, Z), Z).backward()
    names = probe.edge_names
    costs, rows = probe.costs(), probe.costs(per_sample=True)
    return torch.stack([costs[n] for n in names]), torch.stack([rows[n] for n in names])


# --- losses other than the plain mean cross-entropy -------------------------------------------------------------------

def test_costs_under_other_losses_equal_autograd_and_a_regularizer_on_z_is_left_out_as_documented():
    net = Net()
    x, y = _batch(6)
    y_ignored = y.clone()
    y_ignored[2] = -100
    class_weights = torch.rand(5, dtype=DT, generator=torch.Generator().manual_seed(3)) + 0.5
    target = torch.randn(6, 5, dtype=DT, generator=torch.Generator().manual_seed(4))
    alpha = torch.randn(3, 4, dtype=DT, generator=torch.Generator().manual_seed(5))
    Z = torch.softmax(alpha, -1)
    losses = {
        "label_smoothing": lambda o, Z: F.cross_entropy(o, y, label_smoothing=0.2),
        "class weights": lambda o, Z: F.cross_entropy(o, y, weight=class_weights),
        "ignore_index": lambda o, Z: F.cross_entropy(o, y_ignored),
        "sum": lambda o, Z: F.cross_entropy(o, y, reduction="sum"),
        "mse": lambda o, Z: F.mse_loss(o, target),
        # α is not Z: a regularizer on α leaves ∂L/∂Z (Z a leaf) alone
        "regularizer on alpha": lambda o, Z: F.cross_entropy(o, y) + 0.3 * (alpha ** 2).sum(),
    }
    probe = nasdiag.attach(net)
    for name, loss in losses.items():
        ref = _autograd(net, x, Z, loss)
        costs, rows = _probed(probe, net, x, Z, loss)
        assert torch.allclose(costs, ref, rtol=1e-10, atol=1e-15), name
        assert torch.allclose(rows.sum(1), costs, rtol=1e-12, atol=1e-16), name
    # ignore_index in eval mode (no batch coupling): the ignored sample's row is exactly 0
    net.eval()
    _, rows = _probed(probe, net, x, Z, losses["ignore_index"])
    assert torch.equal(rows[:, 2], torch.zeros_like(rows[:, 2]))
    net.train()
    # a term on Z itself: autograd's ∂L/∂Z holds its gradient 2λZ, the cost (what reaches x_j) does not
    lam = 0.3
    regularized = lambda o, Z: F.cross_entropy(o, y) + lam * (Z ** 2).sum()  # noqa: E731
    costs, _ = _probed(probe, net, x, Z, regularized)
    ref = _autograd(net, x, Z, regularized)
    assert (costs - ref).abs().max() > 0.1
    assert torch.allclose(costs, ref - 2 * lam * Z, rtol=1e-10, atol=1e-15)
    text = (Path(__file__).resolve().parents[1] / "docs" / "probe.md").read_text(encoding="utf-8")
    assert "A loss term on Z or α themselves" in text and "not in the cost" in text


def test_per_sample_rows_are_the_per_sample_weight_gradients_and_couple_under_train_mode_batchnorm():
    for B in (1, 5):
        net = Net(seed=B)
        x, y = _batch(B, seed=10 + B)
        Z = _weights(seed=20 + B, B=B)
        loss = lambda o, Z: F.cross_entropy(o, y)  # noqa: E731
        ref = _autograd(net, x, Z, loss)  # (3, B, K): ∂L/∂Z_bk, BatchNorm in train mode
        costs, rows = _probed(nasdiag.attach(net), net, x, Z, loss)
        assert rows.shape == (3, B, 4)
        assert torch.allclose(rows, ref, rtol=1e-10, atol=1e-16)
        assert torch.allclose(costs, ref.sum(1), rtol=1e-10, atol=1e-16)
    # shared Z: row b = <∂L/∂x_j[b], O(x_i)[b]>. In eval mode it is the gradient of sample b's own (1/B-scaled) loss;
    # in train mode BatchNorm's batch statistics couple the samples, so it is not (docs/probe.md says so)
    net = Net(seed=7)
    x, y = _batch(4, seed=8)
    Z = _weights(seed=9)
    probe = nasdiag.attach(net)
    for train in (False, True):
        net.train(train)
        _, rows = _probed(probe, net, x, Z, lambda o, Z: F.cross_entropy(o, y))
        own = torch.stack([_autograd(net, x, Z, lambda o, Z, b=b: F.cross_entropy(o, y, reduction="none")[b] / 4)
                           for b in range(4)], 1)
        gap = (rows - own).abs().max()
        assert (gap < 1e-15) if not train else (gap > 1e-4), (train, gap)


# --- streaming moments ------------------------------------------------------------------------------------------------

def test_streaming_statistics_over_unequal_batches_and_a_nan_step_equal_numpy_per_step():
    net = Net(seed=3)
    probe = nasdiag.attach(net)
    seen = []
    for step in range(24):
        B = (1, 3, 8, 2)[step % 4]
        x, y = _batch(B, seed=100 + step)
        x = x * 10.0 ** (step % 3)
        if step == 20:
            x[0, 0, 0, 0] = math.nan
        Z = _weights(seed=200 + step)
        loss = lambda o, Z: F.cross_entropy(o, y)  # noqa: E731
        seen.append(_autograd(net, x, Z, loss).numpy())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _probed(probe, net, x, Z, loss)
        assert any("NaN" in str(w.message) for w in caught) == (step == 20)
        if step == 19:
            stats, obs = probe.statistics(), np.array(seen)
            # one observation per step, not weighted by its batch size
            np.testing.assert_allclose(stats["cost/edges/mean"], obs.mean(0), rtol=1e-12, atol=1e-18)
            np.testing.assert_allclose(stats["cost/edges/var"], obs.var(0), rtol=1e-10, atol=1e-30)
            assert (stats["cost/edges/count"] == 20).all()
    with pytest.warns(RuntimeWarning, match="NaN"):
        stats = probe.statistics()
    obs = np.array(seen)
    assert np.isnan(obs.mean(0)).all() and np.isnan(stats["cost/edges/mean"]).all()
    assert np.isnan(stats["cost/edges/var"]).all() and (stats["cost/edges/count"] == 24).all()


# --- the homogeneity rules against f(c·x) = f(x) ----------------------------------------------------------------------

C_FUZZ = 4


def _fuzz_module(kind, r):
    rng = random.Random(r)
    C = C_FUZZ
    makers = [
        lambda: nn.ReLU(), lambda: nn.LeakyReLU(0.2), lambda: nn.PReLU(C),
        lambda: nn.Conv2d(C, C, rng.choice([1, 3]), padding=rng.choice([0, 1]), bias=rng.random() < .5,
                          groups=rng.choice([1, C]), padding_mode=rng.choice(["zeros", "reflect", "circular"])),
        lambda: nn.BatchNorm2d(C, affine=rng.random() < .5, track_running_stats=rng.random() < .7),
        lambda: nn.InstanceNorm2d(C, affine=rng.random() < .5, track_running_stats=rng.random() < .3),
        lambda: nn.GroupNorm(rng.choice([1, 2, 4]), C, affine=rng.random() < .5),
        lambda: nn.AvgPool2d(3, 1, rng.choice([0, 1]), count_include_pad=rng.random() < .5),
        lambda: nn.MaxPool2d(3, 1, rng.choice([0, 1])),
        lambda: nn.AdaptiveAvgPool2d(rng.choice([2, 3])),  # not 1: a norm of one pixel is 0/0 rounding noise
        lambda: nn.Dropout(0.3), lambda: nn.Dropout2d(0.3),
        lambda: nn.ZeroPad2d(1), lambda: nn.ConstantPad2d(1, rng.choice([0.0, 0.5])),
        lambda: nn.Tanh(), lambda: nn.Identity(),
    ]
    return makers[kind % len(makers)]()


def _fuzz_op(kinds, seed, train):
    op = nn.Sequential(*[_fuzz_module(k, seed * 31 + i) for i, k in enumerate(kinds)]).to(DT)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in op.modules():
            if hasattr(m, "eps"):
                m.eps = 1e-14  # "as eps → 0"
            if getattr(m, "running_var", None) is not None:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g, dtype=DT))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g, dtype=DT) + 0.5)
            for p in m.parameters(recurse=False):
                p.copy_(torch.randn(p.shape, generator=g, dtype=DT))
    return op.train(train)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kinds=st.lists(st.integers(0, 16), min_size=1, max_size=5), seed=st.integers(0, 10 ** 6),
       train=st.booleans(), shift=st.sampled_from([0.0, 1.5]))
def test_random_compositions_flagged_invariant_satisfy_f_of_cx_equal_f_of_x(kinds, seed, train, shift):
    op = _fuzz_op(kinds, seed, train)
    x = torch.randn(5, C_FUZZ, 7, 7, generator=torch.Generator().manual_seed(seed), dtype=DT) + shift
    outs = []
    for c in (1.0, 0.31, 2.9):
        torch.manual_seed(5)  # the same dropout masks at every scale
        with torch.no_grad():
            outs.append(op(c * x))
    scale = max(outs[0].abs().max().item(), 1e-8)
    deviation = max((o - outs[0]).abs().max().item() for o in outs[1:]) / scale
    flags = (analyse(op).invariant, is_scale_invariant(op, x))
    if any(flags):
        assert deviation < 1e-7, (flags, deviation, op)
    if flags[0]:
        assert flags[1]  # an example input only adds knowledge (ranks): never withdraws an invariance


# --- reuse and sharing --------------------------------------------------------------------------------------------------

class MixKeeps(Mix):
    """A mixed op that keeps its candidates' outputs for another consumer (an auxiliary loss)."""

    def forward(self, x, weights):
        self.last = [op(x) for op in self._ops]
        return sum(w * o for w, o in zip(weights, self.last))


def test_an_op_output_consumed_outside_its_edge_and_shared_candidate_modules_cost_as_autograd():
    net = _with_mixed_op(Net(seed=4), MixKeeps)
    identity = nn.Identity()
    net.e12._ops[1] = identity
    net.e12._ops.append(identity)  # one module at two positions of an edge: K = 5 there
    net.e01._ops[2] = net.e02._ops[2]  # one pool module in two edges
    x, y = _batch(4, seed=5)
    Zs = [_weights(seed=6)[0], _weights(seed=7)[1], torch.softmax(torch.randn(5, dtype=DT), 0)]

    def loss(Zl):
        out = net(x, Zl)
        return F.cross_entropy(out, y) + 0.7 * (net.e01.last[0] ** 2).mean() + 0.003 * net.e12.last[1].sum()

    leaves = [z.clone().requires_grad_() for z in Zs]
    ref = torch.autograd.grad(loss(leaves), leaves)
    probe = nasdiag.attach(net)
    leaves = [z.clone().requires_grad_() for z in Zs]
    with probe.record():
        loss(leaves).backward()
    for name, r in zip(EDGES, ref):
        assert torch.allclose(probe.costs()[name], r, rtol=1e-10, atol=1e-16), name
    assert_no_module_hooks(net)


# --- evaluation forwards interleaved with training steps ----------------------------------------------------------------

def test_no_grad_evaluation_forwards_inside_and_between_blocks_record_nothing_and_keep_nothing():
    net = Net(seed=6)
    probe = nasdiag.attach(net)
    x_val, _ = _batch(7, seed=50)
    seen, before = [], None
    for step in range(16):
        B = 2 + step % 3
        x, y = _batch(B, seed=60 + step)
        Z = _weights(seed=70 + step)
        loss = lambda o, Z: F.cross_entropy(o, y)  # noqa: E731
        net.train()
        seen.append(_autograd(net, x, Z, loss).numpy())
        Zl = Z.clone().requires_grad_()
        with probe.record():
            net.eval()
            with torch.no_grad():
                net(x_val, Z)
            net.train()
            loss(net(x, Zl), Zl).backward()
            net.eval()
            with torch.inference_mode():
                net(x_val, Z)
        net.train()
        costs, rows = probe.costs(), probe.costs(per_sample=True)
        assert torch.allclose(torch.stack([costs[n] for n in EDGES]), torch.from_numpy(seen[-1]), rtol=1e-10, atol=1e-16)
        assert all(rows[n].shape == (B, 4) for n in EDGES)  # the training forward's rows only
        with torch.no_grad():
            net.eval()
            net(x_val, Z)  # an evaluation loop between steps
            net.train()
        del costs, rows, Zl
        if step == 3:
            before = live_tensors()
    assert live_tensors() <= before + len(seen) - 4  # only the reference arrays kept here grow (numpy, not tensors)
    stats = probe.statistics()
    np.testing.assert_allclose(stats["cost/edges/mean"], np.array(seen).mean(0), rtol=1e-12, atol=1e-18)
    assert (stats["cost/edges/count"] == 16).all()
    assert_no_module_hooks(net)


# --- scripted, traced and compiled models -------------------------------------------------------------------------------

def _line(exc):
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_torchscript_models_edges_and_candidates_are_one_probe_error_line_at_attach():
    net = Net(seed=8)
    x, _ = _batch(3, seed=9)
    Z = _weights(seed=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(net, (x, Z))
    with pytest.raises(ProbeError) as exc:
        nasdiag.attach(traced)
    assert "TorchScript" in _line(exc) and "eager" in _line(exc)
    # its mixed ops mapped by hand inside an eager wrapper: their hooks would never fire (NaN, "never ran")
    wrapper = nn.ModuleDict({"inner": traced})
    with pytest.raises(ProbeError) as exc:
        nasdiag.attach(wrapper, edges={"a": (traced.e01, [getattr(traced.e01._ops, str(k)) for k in range(4)])})
    assert "TorchScript" in _line(exc)
    # a torch.export graph: its mixed ops are traced operations (the line pointed to edges=, whose modules never run)
    with pytest.raises(ProbeError) as exc:
        nasdiag.attach(torch.export.export(net, (x, Z)).module())
    assert "torch.fx" in _line(exc) and "eager" in _line(exc)
    # a scripted mixed op inside an eager model would be left out of the discovered edges
    net.e12 = torch.jit.script(net.e12)
    with pytest.raises(ProbeError) as exc:
        nasdiag.attach(net)
    assert "'e12'" in _line(exc) and "TorchScript" in _line(exc)
    # a scripted candidate op of an eager mixed op: hooks cannot be placed on it
    net = Net(seed=8)
    net.e01._ops[1] = torch.jit.script(nn.Identity())
    with pytest.raises(ProbeError) as exc:
        nasdiag.attach(net)
    assert "'e01'" in _line(exc) and "TorchScript" in _line(exc)
    assert_no_module_hooks(net)
    # a scripted module inside an eager candidate op is never hooked: costs as autograd's
    net = Net(seed=8)
    net.e01._ops[3][1] = torch.jit.script(nn.Tanh())
    y = torch.randint(0, 5, (3,))
    loss = lambda o, Z: F.cross_entropy(o, y)  # noqa: E731
    costs, _ = _probed(nasdiag.attach(net), net, x, Z, loss)
    assert torch.allclose(costs, _autograd(net, x, Z, loss), rtol=1e-10, atol=1e-16)


def test_a_compiled_model_gives_autograds_costs():
    net = Net(seed=11)
    x, y = _batch(4, seed=12)
    Z = _weights(seed=13)
    loss = lambda o, Z: F.cross_entropy(o, y)  # noqa: E731
    ref = _autograd(net, x, Z, loss)
    compiled = torch.compile(net, backend="eager")
    compiled(x, Z)  # compiled without the hooks first
    for probe in (nasdiag.attach(compiled), nasdiag.attach(net)):
        for _ in range(2):  # a compiled forward outside the block between steps
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                costs, rows = _probed(probe, net, x, Z, loss, model=compiled)
                with torch.no_grad():
                    compiled(x, Z)
            assert torch.allclose(costs, ref, rtol=1e-10, atol=1e-16)
            assert torch.allclose(rows.sum(1), ref, rtol=1e-10, atol=1e-16)
    assert_no_module_hooks(net)


# --- a candidate op returning a tuple -----------------------------------------------------------------------------------

class ConvWithAux(nn.Module):
    """A candidate op returning (output, auxiliary scalar); its mixed op weights the output."""

    def __init__(self, C):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 1, bias=False)

    def forward(self, x):
        y = self.conv(x)
        return y, y.abs().mean()


class MixFirst(Mix):
    def forward(self, x, weights):
        out = torch.zeros_like(x)
        for w, op in zip(weights, self._ops):
            o = op(x)
            out = out + w * (o[0] if isinstance(o, tuple) else o)
        return out


def test_a_candidate_returning_a_tuple_is_one_line_saying_how_to_map_it_and_the_mapped_inner_module_is_exact():
    net = _with_mixed_op(Net(seed=14), MixFirst)
    net.e02._ops[3] = ConvWithAux(3).to(DT)
    x, y = _batch(4, seed=15)
    Z = _weights(seed=16)
    loss = lambda o, Z: F.cross_entropy(o, y)  # noqa: E731
    with pytest.raises(ProbeError) as exc:
        _probed(nasdiag.attach(net), net, x, Z, loss)
    msg = _line(exc)
    assert "'e02'" in msg and "tuple" in msg and "edges=" in msg
    assert_no_module_hooks(net)
    # mapped as the message says: the submodule returning the weighted tensor
    ops = {name: list(getattr(net, name)._ops) for name in EDGES}
    ops["e02"][3] = net.e02._ops[3].conv
    probe = nasdiag.attach(net, edges={name: (getattr(net, name), ops[name]) for name in EDGES})
    costs, _ = _probed(probe, net, x, Z, loss)
    assert torch.allclose(costs, _autograd(net, x, Z, loss), rtol=1e-10, atol=1e-16)


# --- torch.func inside a block --------------------------------------------------------------------------------------------

def test_vmap_inside_a_block_is_one_probe_error_line_and_torch_func_grad_gives_the_costs():
    from torch.func import functional_call, grad, vmap

    net = Net(seed=17).eval()
    x, y = _batch(4, seed=18)
    Z = _weights(seed=19)
    loss = lambda o, Z: F.cross_entropy(o, y)  # noqa: E731
    ref = _autograd(net, x, Z, loss)
    probe = nasdiag.attach(net)
    # torch.func.grad (no vmap) of the step's loss: the tensor hooks see ∂L/∂x_j as in a backward
    with probe.record():
        grad(lambda Zl: loss(net(x, Zl), Zl))(Z)
    assert torch.allclose(torch.stack([probe.costs()[n] for n in EDGES]), ref, rtol=1e-10, atol=1e-16)
    params = {k: v.detach() for k, v in net.named_parameters()}
    buffers = dict(net.named_buffers())

    def sample_loss(p, xb, yb):
        return F.cross_entropy(functional_call(net, (p, buffers), (xb[None], Z)), yb[None])

    # per-sample gradients by vmap inside the block: batched tensors leaked into the costs (torch's internal assert
    # "maybe_level.has_value()" at the end of the block, or a .item() error on the first step)
    for _ in range(2):
        with pytest.raises(ProbeError) as exc:
            with probe.record():
                vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
        assert "vmap" in _line(exc) and "outside the block" in _line(exc)
        assert_no_module_hooks(net)
    costs, _ = _probed(probe, net, x, Z, loss)  # the probe still records the next plain step
    assert torch.allclose(costs, ref, rtol=1e-10, atol=1e-16)


def test_asking_with_an_example_input_leaves_the_buffers_the_random_stream_and_the_input_as_they_were():
    op = nn.Sequential(nn.Conv2d(3, 3, 1, bias=False), nn.Dropout(0.5), nn.BatchNorm2d(3)).to(DT).train()
    x = torch.randn(4, 3, 5, 5, dtype=DT)
    buffers = [b.clone() for b in op.buffers()]
    torch.manual_seed(0)
    expected = torch.rand(5)
    torch.manual_seed(0)
    assert is_scale_invariant(op, x)
    assert torch.equal(torch.rand(5), expected)  # a diagnostic query must not shift the training's dropout masks
    assert all(torch.equal(a, b) for a, b in zip(buffers, op.buffers()))
    assert_no_module_hooks(op)
    # an in-place ReLU first: the caller's example batch is theirs (its negative entries were zeroed)
    op = nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)).to(DT)
    before = x.clone()
    assert is_scale_invariant(op, x) and is_scale_invariant(op, (x,))
    assert torch.equal(x, before)



# --- statistics group names are record path parts -----------------------------------------------------------------------

def test_per_edge_statistics_of_edges_named_with_path_characters_stay_in_the_cost_families():
    net = Net(seed=20)
    net.e12._ops.append(nn.Identity())  # K differs: one statistics group per edge, named by the edge
    x, y = _batch(3, seed=21)
    Zs = [_weights(seed=22)[0], _weights(seed=22)[1], torch.softmax(torch.randn(5, dtype=DT), 0)]
    probe = nasdiag.attach(net, edges={"0->1": net.e01, "cell/b": net.e02, "x y": net.e12})
    leaves = [z.clone().requires_grad_() for z in Zs]
    with probe.record():
        F.cross_entropy(net(x, leaves), y).backward()
    stats = probe.statistics()
    # "cost/cell/b/mean" was no path of the cost/<cell>/mean family: averaged, not pooled, across DDP ranks and
    # invisible to the plots
    fams = {vocabulary.family_of(p) for p in stats}
    assert fams == {vocabulary.COST_MEAN, vocabulary.COST_VAR, vocabulary.COST_COUNT}, sorted(stats)
    assert vocabulary.cells_with(stats, vocabulary.COST_MEAN) == [g.name for g in probe.groups] == ["0-_1", "cell_b", "x_y"]
    for name, group in zip(("0->1", "cell/b", "x y"), probe.groups):
        np.testing.assert_array_equal(stats[f"cost/{group.name}/mean"][0], probe.costs()[name].numpy())
    with pytest.raises(ProbeError) as exc:
        nasdiag.attach(net, edges={"a/b": net.e01, "a_b": net.e02, "c": net.e12})
    assert "'a/b'" in _line(exc) and "'a_b'" in _line(exc)



# --- the measured deviation from invariance ------------------------------------------------------------------------------

def test_invariance_deviation_leaves_out_an_eval_mode_pass_with_grad_inside_the_block():
    net = Net(seed=23)
    x, y = _batch(4, seed=24)
    Z = _weights(seed=25)
    conv_outputs = []
    hook = net.e01._ops[0][1].register_forward_hook(lambda m, a, o: conv_outputs.append((m.training, o.detach())))
    probe = nasdiag.attach(net, norm_deviation=True)
    with probe.record():
        net.eval()
        net(x * 1e-3, Z)  # a validation pass with grad on (never backwarded): BatchNorm on its running statistics
        net.train()
        F.cross_entropy(net(x, Z.clone().requires_grad_()), y).backward()
    hook.remove()
    # eps/(var + eps) of the BatchNorm input of the training forward, per channel, by hand (§8 "the real eps")
    bn_input = next(o for training, o in conv_outputs if training)
    eps = net.e01._ops[0][2].eps
    expected = (eps / (bn_input.var(dim=(0, 2, 3), unbiased=False) + eps)).max().item()
    got = probe.invariance_deviation()["e01"]["0:Sequential"]
    assert got == pytest.approx(expected, rel=1e-12)  # was 125x that: the validation batch's tiny variance



def test_a_block_begun_in_eval_mode_whose_step_runs_in_train_mode_flags_the_deviation_nan_not_an_empty_row():
    net = Net(seed=26)
    x, y = _batch(4, seed=27)
    Z = _weights(seed=28)
    probe = nasdiag.attach(net, norm_deviation=True)
    net.eval()  # e.g. after a validation pass
    with pytest.warns(RuntimeWarning, match="train mode inside this probe.record"):
        with probe.record():
            net.train()
            F.cross_entropy(net(x, Z.clone().requires_grad_()), y).backward()
    deviation = probe.invariance_deviation()
    # the relu-conv-BatchNorm op is invariant in the train mode the step ran in: listed, NaN (not measured), where
    # the row was empty (read as "no invariant op")
    assert all(list(deviation[n]) == ["0:Sequential"] and math.isnan(deviation[n]["0:Sequential"]) for n in EDGES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next step, begun in train mode, is measured
        with probe.record():
            F.cross_entropy(net(x, Z.clone().requires_grad_()), y).backward()
    assert all(0 < probe.invariance_deviation()[n]["0:Sequential"] < 1 for n in EDGES)


# --- a model forward that runs its batch through the edges in chunks ----------------------------------------------------

class ChunkedNet(Net):
    """A forward running the batch in two chunks (to save memory): each edge is called twice in one model forward,
    on different samples."""

    def forward(self, x, Z):
        return torch.cat([super(ChunkedNet, self).forward(chunk, Z) for chunk in x.chunk(2)])


def test_per_sample_costs_of_a_forward_run_in_chunks_are_refused_not_summed_across_samples():
    net = ChunkedNet(seed=29)
    x, y = _batch(4, seed=30)
    Z = _weights(seed=31)
    loss = lambda o, Z: F.cross_entropy(o, y)  # noqa: E731
    probe = nasdiag.attach(net)
    Zl = Z.clone().requires_grad_()
    with probe.record():
        loss(net(x, Zl), Zl).backward()
    assert torch.allclose(torch.stack([probe.costs()[n] for n in EDGES]), _autograd(net, x, Z, loss), rtol=1e-10, atol=1e-16)
    # the rows of samples 0 and 2 (1 and 3) added up to a (2, K) "per-sample" result of a batch of 4
    with pytest.raises(ProbeError) as exc:
        probe.costs(per_sample=True)
    assert "chunks" in _line(exc)
    # tying within one forward (every call on the whole batch) still adds up per sample, as documented
    tied = Net(seed=29)
    tied.forward = lambda x, Z: Net.forward(tied, x, Z) + Net.forward(tied, x, Z)
    probe = nasdiag.attach(tied)
    costs, rows = _probed(probe, tied, x, Z, loss)
    assert rows.shape == (3, 4, 4) and torch.allclose(rows.sum(1), costs, rtol=1e-12, atol=1e-16)
