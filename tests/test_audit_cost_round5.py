"""Cost audit round 5: per-edge costs and the wiring-paper theorems on supernets written from scratch here
(a DARTS-convention cell, the minimal cell of Fig. 7, a declared cell with its own edge order and output layout),
checked against plain autograd (leaf mixing weights Z, zero taps on edge inputs, scalar multipliers on node slices)
and against exact rational arithmetic for the streaming moments. Never nasdiag against nasdiag.

Defects found (each test fails without its fix):

* ``loss_minus_entropy`` with fewer labels than logit rows returned a number (L averaged over the labelled rows,
  H over all of them); labels of the wrong dtype or out of range were torch tracebacks
  (test_loss_minus_entropy_refuses_labels_that_do_not_match_the_logits).
* ``invariance_deviation()`` was NaN, never measured, for a candidate op that is itself a normalization (a bare
  ``BatchNorm2d`` op), though ``scale_invariant_ops()`` flags it
  (test_a_bare_normalization_candidate_op_gets_its_measured_deviation).
* A model deep-copied inside a ``record()`` block (second-order DARTS's unrolled twin) took copies of the probe's
  router and of the step's captures along with the installed hooks, and every later forward and backward of the
  twin appended to them: ~30 tensors a step, forever; the same for a model saved whole (``torch.save(model)``) inside
  the block and loaded (test_a_twin_deep_copied_inside_the_block_is_inert).
* ``invariance_deviation()`` chose its ops by the model's train/eval mode when read, not the step's: read after a
  validation pass in eval mode it dropped every BatchNorm op measured in the training step, and after an eval-mode
  step read in train mode it gave NaN for ops that were not invariant in that step
  (test_invariance_deviation_is_that_of_the_steps_mode_whatever_the_mode_when_read).
* Results read inside the ``record()`` block said "no completed recorded step: run `with probe.record(): ...`
  first", inside that very block (test_results_read_inside_the_block_say_to_read_them_after_it).
* A cell whose forward returns a tuple (output, auxiliary loss) got NaN output costs with "no gradient reached the
  output of cell(s)", and with path_split a ProbeError "no gradient reached the node", though the gradient did reach
  the cell's output (test_a_cell_returning_a_tuple_is_named_as_such_not_as_unreached).
* An edge mapped with its candidate ops in another order than its weights passed the weighted-sum check when the
  first step's weights were equal (α initialised to zeros) and was never checked again: every later step's costs
  were reported under the wrong ops (test_a_misordered_candidate_list_is_caught_after_a_uniform_first_step).

Checked and right (references in the tests): costs, per-sample costs (per-sample leaf Z), output costs (node
multipliers), path parts (zero taps) on the minimal cell; Thm. 1 / Cor. 1.2 / Thm. 2 for three stacking orders and
BatchNorm, affine BatchNorm and LayerNorm (GroupNorm(1, C)) at eps = 1e-12, L and H written out from eq. 3 and the
entropy; streaming moments against fractions at |mean|/std up to 1e15 with masks and a merge; two probes at once;
activation checkpointing (reentrant or not); sampled statistics of per-sample one-hot gates; a float32 model moved
to float64 after attach; train/eval flags against f(c·x) = f(x).
"""

import copy
import io

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from conftest import live_tensors

import nasdiag
from nasdiag.cost import CostError, CostMoments, degree_rule, loss_minus_entropy, register_homogeneity_rule

DT = torch.float64
C, B, K = 4, 5, 5


# --- the reference supernet (DARTS convention, written here) ------------------------------------------------------
def _norm(kind, eps):
    return {"bn": lambda: nn.BatchNorm2d(C, affine=False, eps=eps, dtype=DT),
            "bn_affine": lambda: nn.BatchNorm2d(C, affine=True, eps=eps, dtype=DT),
            "ln": lambda: nn.GroupNorm(1, C, eps=eps, affine=False, dtype=DT),
            "in": lambda: nn.InstanceNorm2d(C, affine=False, eps=eps)}[kind]()


def _conv_op(order, kind, eps, k):
    conv = nn.Conv2d(C, C, k, padding=k // 2, bias=False, dtype=DT)
    return {"relu-conv-bn": lambda: nn.Sequential(nn.ReLU(), conv, _norm(kind, eps)),
            "conv-bn-relu": lambda: nn.Sequential(conv, _norm(kind, eps), nn.ReLU()),
            "conv-relu-bn": lambda: nn.Sequential(conv, nn.ReLU(), _norm(kind, eps))}[order]()


class R5Zero(nn.Module):
    def forward(self, x):
        return x.mul(0.0)


register_homogeneity_rule(R5Zero, degree_rule(0.0, "constant zero output"), overwrite=True)


class R5Mixed(nn.Module):
    """DARTS mixed op: candidates in ``_ops``, forward (x, weights) with (K,) or per-sample (B, K) weights."""

    def __init__(self, order, kind, eps):
        super().__init__()
        self._ops = nn.ModuleList([R5Zero(), nn.Identity(), _conv_op(order, kind, eps, 3),
                                   nn.Sequential(nn.AvgPool2d(3, 1, 1, count_include_pad=False), _norm(kind, eps)),
                                   _conv_op(order, kind, eps, 1)])

    def forward(self, x, weights):
        if weights.dim() == 2:
            return sum(weights[:, k].reshape(-1, 1, 1, 1) * op(x) for k, op in enumerate(self._ops))
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class R5Cell(nn.Module):
    """The minimal cell of Fig. 7 (two intermediate nodes, edges 0-3 input edges, edge 4 intermediate) in the
    DARTS convention; ``taps`` (zero leaves added to each edge's input) and ``node_scale`` (multipliers on each
    node's slice of the output) are the autograd references."""

    def __init__(self, Cin, order, kind, eps):
        super().__init__()
        self.reduction = False
        self.pre0 = nn.Sequential(nn.ReLU(), nn.Conv2d(Cin, C, 1, bias=False, dtype=DT), _norm(kind, eps))
        self.pre1 = nn.Sequential(nn.ReLU(), nn.Conv2d(Cin, C, 1, bias=False, dtype=DT), _norm(kind, eps))
        self._steps = self._multiplier = 2
        self._ops = nn.ModuleList(R5Mixed(order, kind, eps) for _ in range(5))
        self.taps = self.node_scale = None

    def forward(self, s0, s1, weights):
        states, off = [self.pre0(s0), self.pre1(s1)], 0
        for _ in range(self._steps):
            s = 0
            for j, h in enumerate(states):
                h = h if self.taps is None else h + self.taps[off + j]
                s = s + self._ops[off + j](h, weights[off + j] if weights.dim() == 2 else weights[:, off + j])
            off += len(states)
            states.append(s)
        outs = states[-self._multiplier:]
        if self.node_scale is not None:
            outs = [o * self.node_scale[n] for n, o in enumerate(outs)]
        return torch.cat(outs, 1)


class R5Net(nn.Module):
    """Stem, cells, global average pooling, bias-free linear classifier (the setting of Thm. 2)."""

    def __init__(self, layers=3, order="relu-conv-bn", kind="bn", eps=1e-5, bias=False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 2 * C, 3, padding=1, bias=False, dtype=DT), nn.BatchNorm2d(2 * C, dtype=DT))
        self.cells = nn.ModuleList(R5Cell(2 * C, order, kind, eps) for _ in range(layers))
        self.classifier = nn.Linear(2 * C, 5, bias=bias, dtype=DT)
        self.Z = None  # one (E, K) or (B, E, K) tensor per cell

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for c, z in zip(self.cells, self.Z):
            s0, s1 = s1, c(s0, s1, z)
        return self.classifier(F.adaptive_avg_pool2d(s1, 1).flatten(1))


def _batch(seed=0, hw=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, hw, hw, generator=g, dtype=DT), torch.randint(0, 5, (B,), generator=g)


def _softmax_z(net, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(torch.randn(5, K, generator=g, dtype=DT), -1).requires_grad_() for _ in net.cells]


def _name(i, e):
    return f"cells.{i}._ops.{e}"


# --- costs, per-sample costs, output costs and path parts against autograd ---------------------------------------
def test_costs_per_sample_costs_output_costs_and_path_parts_equal_autograd():
    torch.manual_seed(0)
    net = R5Net()
    x, y = _batch()
    w = torch.softmax(torch.randn(5, K, dtype=DT), -1)
    net.Z = [w.expand(B, 5, K).clone().requires_grad_() for _ in net.cells]  # per-sample leaves: ∂L/∂Z_bk
    for c in net.cells:
        c.taps = [torch.zeros(B, C, 6, 6, dtype=DT, requires_grad=True) for _ in range(5)]
        c.node_scale = [torch.ones((), dtype=DT, requires_grad=True) for _ in range(2)]
    outs = {}
    handles = [op.register_forward_hook(lambda m, a, o, key=(i, e, k): outs.__setitem__(key, o.detach()))
               for i, c in enumerate(net.cells) for e, m in enumerate(c._ops) for k, op in enumerate(m._ops)]
    probe = nasdiag.attach(net, path_split=True)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    for h in handles:
        h.remove()
    costs, per_sample, paths = probe.costs(), probe.costs(per_sample=True), probe.path_costs()
    oc = probe.output_costs()
    for i, c in enumerate(net.cells):
        grad = net.Z[i].grad  # (B, E, K)
        for e in range(5):
            torch.testing.assert_close(per_sample[_name(i, e)], grad[:, e], rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(costs[_name(i, e)], grad[:, e].sum(0), rtol=1e-12, atol=1e-15)
        for n in range(2):
            torch.testing.assert_close(oc[f"cells.{i}"][n + 2], c.node_scale[n].grad, rtol=1e-12, atol=1e-15)
        # edges 0, 1 end at node 2, which feeds the output and edge 4 (2 -> 3): <tap_4.grad, O_k(x_i)>
        for e in (0, 1):
            through = torch.stack([(c.taps[4].grad * outs[(i, e, k)]).sum() for k in range(K)])
            torch.testing.assert_close(paths[_name(i, e)][_name(i, 4)], through, rtol=1e-10, atol=1e-15)
            torch.testing.assert_close(sum(paths[_name(i, e)].values()), costs[_name(i, e)], rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("order", ["relu-conv-bn", "conv-bn-relu", "conv-relu-bn"])
@pytest.mark.parametrize("kind", ["bn", "bn_affine", "ln"])
def test_thm1_cor12_and_thm2_at_tiny_eps(order, kind):
    """Thm. 1: with no skip on edge 4 (its active ops all scale-invariant), Σ_e Z_e·(part of e's cost through
    edge 4) over the edges entering node 2 is <J_4ᵀ g, x_2> = 0. Cor. 1.2: the output-edge costs of every cell
    but the last sum to 0. Thm. 2: the last cell's sum to L − H, L the batch-mean cross-entropy (eq. 3) and H the
    batch-mean entropy of softmax(Y), written out here."""
    torch.manual_seed(0)
    net = R5Net(order=order, kind=kind, eps=1e-12)
    x, y = _batch()
    w = torch.softmax(torch.randn(5, K, dtype=DT), -1)
    w[4, 1] = 0.0  # no skip_connect on the intermediate edge (eq. 11's exception)
    net.Z = [w] * 3
    probe = nasdiag.attach(net, path_split=True)
    with probe.record():
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
    paths, oc, costs = probe.path_costs(), probe.output_costs(), probe.costs()
    scale = max(float(v.abs().max()) for v in costs.values())
    for i in range(3):
        passed = sum((w[e] * paths[_name(i, e)][_name(i, 4)]).sum() for e in (0, 1))
        assert abs(float(passed)) < 1e-9 * scale
    for i in range(2):
        assert abs(float(sum(oc[f"cells.{i}"].values()))) < 1e-9 * scale
    p = torch.softmax(logits.detach(), -1)
    L = -torch.log(p[torch.arange(B), y]).mean()
    H = -(p * torch.log(p)).sum(-1).mean()
    torch.testing.assert_close(sum(oc["cells.2"].values()), L - H, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(loss_minus_entropy(logits.detach(), y), L - H, rtol=1e-12, atol=1e-14)


def test_loss_minus_entropy_refuses_labels_that_do_not_match_the_logits():
    logits = torch.randn(4, 5, dtype=DT)
    y = torch.tensor([1, 2, 3, 0])
    for bad in (y[:3], y.double(), torch.tensor([1, 2, 3, 5]), torch.tensor([1, 2, 3, -1]), torch.tensor([1, 2, 3, 0, 1])):
        with pytest.raises(CostError) as err:
            loss_minus_entropy(logits, bad)
        assert "\n" not in str(err.value) and "targets" in str(err.value)
    with pytest.raises(CostError, match="logits must be"):
        loss_minus_entropy(logits[0], y[:1])


def test_a_bare_normalization_candidate_op_gets_its_measured_deviation():
    torch.manual_seed(0)
    net = R5Net(layers=2)
    for c in net.cells:
        for m in c._ops:
            m._ops[3] = nn.BatchNorm2d(C, affine=False, dtype=DT)  # the op is the normalization itself
    net.Z = _softmax_z(net)
    seen = {}
    bn = net.cells[1]._ops[2]._ops[3]
    h = bn.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach()))
    probe = nasdiag.attach(net, norm_deviation=True)
    x, y = _batch()
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    h.remove()
    assert bool(probe.scale_invariant_ops()[_name(1, 2)][3])
    var = seen["x"].var(dim=(0, 2, 3), unbiased=False)
    expected = float((bn.eps / (var + bn.eps)).max())
    got = probe.invariance_deviation()[_name(1, 2)]["3:BatchNorm2d"]
    assert got == pytest.approx(expected, rel=1e-12)


# --- streaming statistics ---------------------------------------------------------------------------------------
def _exact_mean_var(values):
    fs = [Fraction(float(v)) for v in values]
    mu = sum(fs) / len(fs)
    return float(mu), float(sum((f - mu) ** 2 for f in fs) / len(fs))


@pytest.mark.parametrize("offset", [0.0, 1e8, -1e12, 1e15])
def test_masked_and_merged_moments_equal_exact_rational_arithmetic(offset):
    """Welford/Chan with masks and a merge of two accumulators, at |mean|/std up to 1e15, against the mean and
    population variance computed exactly (fractions) from the same float64 values."""
    rng = np.random.default_rng(int(abs(offset)) % 1000)
    shape = (2, 3)
    centre = offset * rng.standard_normal(shape)
    a, b = CostMoments(shape), CostMoments(shape)
    vals, masks = [], []
    for step in range(12):
        n = int(rng.integers(1, 4))
        v = centre + rng.standard_normal((n,) + shape)
        m = rng.random((n,) + shape) < 0.6
        (a if step % 3 else b).update(torch.tensor(v), torch.tensor(m))
        vals.append(v)
        masks.append(m)
    a.merge(b)
    V, M = np.concatenate(vals), np.concatenate(masks)
    for idx in np.ndindex(shape):
        sel = V[(slice(None),) + idx][M[(slice(None),) + idx]]
        assert int(a.count[idx]) == len(sel)
        if not len(sel):
            assert torch.isnan(a.var[idx])
            continue
        mu, var = _exact_mean_var(sel)
        # a mean rounds at ~1 ulp of |mean|; the variance to a few ulps of itself (the shift removes the offset)
        assert abs(float(a.mean[idx]) - mu) <= 4e-16 * abs(mu) + 1e-14 * var ** 0.5
        assert abs(float(a.var[idx]) - var) <= 1e-12 * var + 1e-300


def test_probe_statistics_over_steps_equal_numpy_over_the_autograd_costs():
    """count = steps × cells per (edge, op); mean and population variance over the per-cell autograd costs."""
    torch.manual_seed(0)
    net = R5Net()
    probe = nasdiag.attach(net)
    rows = []
    for step in range(6):
        x, y = _batch(step)
        net.Z = _softmax_z(net, seed=10 + step)
        with probe.record():
            F.cross_entropy(net(x), y).backward()
        rows += [z.grad.numpy().copy() for z in net.Z]
    st = probe.statistics()
    R = np.array(rows)
    assert (st["cost/normal/count"] == 6 * 3).all()
    np.testing.assert_allclose(st["cost/normal/mean"], R.mean(0), rtol=1e-10, atol=1e-16)
    np.testing.assert_allclose(st["cost/normal/var"], R.var(0), rtol=1e-8, atol=1e-18)


# --- lifecycle ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reentrant", [False, True])
def test_two_probes_at_once_and_checkpointed_cells_equal_autograd(reentrant):
    """Two probes recording the same step (one with the path split) and cells run under activation checkpointing
    (the forward hooks fire again in the recomputation) give autograd's ∂L/∂Z; no hook is left."""
    torch.manual_seed(0)
    net = R5Net()
    original = R5Net.forward

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for c, z in zip(self.cells, self.Z):
            s0, s1 = s1, checkpoint(c, s0, s1, z, use_reentrant=reentrant)
        return self.classifier(F.adaptive_avg_pool2d(s1, 1).flatten(1))

    net.forward = forward.__get__(net)
    net.Z = _softmax_z(net)
    p1, p2 = nasdiag.attach(net), nasdiag.attach(net, path_split=True)
    x, y = _batch()
    with p1.record(), p2.record():
        F.cross_entropy(net(x), y).backward()
    for probe in (p1, p2):
        costs = probe.costs()
        for i in range(3):
            for e in range(5):
                torch.testing.assert_close(costs[_name(i, e)], net.Z[i].grad[e], rtol=1e-12, atol=1e-15)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())
    assert R5Net.forward is original


def _saved_and_loaded(net):
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("duplicate", [copy.deepcopy, _saved_and_loaded], ids=["deepcopy", "torch.save"])
def test_a_twin_deep_copied_inside_the_block_is_inert(duplicate):
    """The twin's own step inside the block adds nothing to the probe's costs (its parameters are others), and
    its hooks, copied with the model, keep nothing across its later steps."""
    torch.manual_seed(0)
    net = R5Net()
    net.Z = _softmax_z(net)
    probe = nasdiag.attach(net)
    x, y = _batch()
    with probe.record():
        twin = duplicate(net)
        twin.Z = [z.detach().clone().requires_grad_() for z in net.Z]
        F.cross_entropy(twin(x), y).backward()
        F.cross_entropy(net(x), y).backward()
    costs = probe.costs()
    for i in range(3):
        for e in range(5):
            torch.testing.assert_close(costs[_name(i, e)], net.Z[i].grad[e], rtol=1e-12, atol=1e-15)
    twin.Z = [z.detach() for z in twin.Z]
    counts = []
    for _ in range(4):
        F.cross_entropy(twin(x), y).backward()
        counts.append(live_tensors())
    assert counts[-1] == counts[1], counts


def test_invariance_deviation_is_that_of_the_steps_mode_whatever_the_mode_when_read():
    torch.manual_seed(0)
    net = R5Net(layers=2)
    net.Z = _softmax_z(net)
    bn = net.cells[1]._ops[3]._ops[2][2]  # relu -> conv -> BN of edge 3, op 2
    seen = {}
    h = bn.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach()))
    probe = nasdiag.attach(net, norm_deviation=True)
    x, y = _batch()
    with probe.record():  # a training step
        F.cross_entropy(net(x), y).backward()
    h.remove()
    var = seen["x"].var(dim=(0, 2, 3), unbiased=False)
    expected = float((bn.eps / (var + bn.eps)).max())
    net.eval()  # e.g. a validation pass before the diagnostics are logged
    row = probe.invariance_deviation()[_name(1, 3)]
    assert set(row) == {"0:R5Zero", "2:Sequential", "3:Sequential", "4:Sequential"}
    assert row["2:Sequential"] == pytest.approx(expected, rel=1e-12) and row["0:R5Zero"] == 0.0
    with probe.record():  # an eval-mode step: BatchNorm with running statistics is affine, no op but Zero is invariant
        F.cross_entropy(net(x), y).backward()
    net.train()
    assert probe.invariance_deviation()[_name(1, 3)] == {"0:R5Zero": 0.0}


class R5Gated(R5Mixed):
    """ProxylessNAS/DSNAS style: only the ops some sample's gate selects are run."""

    def forward(self, x, weights):
        if weights.dim() == 2:
            return sum(weights[:, k].reshape(-1, 1, 1, 1) * op(x) for k, op in enumerate(self._ops)
                       if bool(weights[:, k].ne(0).any()))
        return sum(w * op(x) for w, op in zip(weights, self._ops) if bool(w != 0))


def test_sampled_statistics_of_per_sample_one_hot_gates_that_run_only_the_selected_ops():
    """(B, K) one-hot gates per sample: the (B, K) costs of the ops that ran are ∂L/∂Z_bk, the others NaN; with
    statistics='sampled' an (edge, op) is observed at a step where some sample selected it (docs/probe.md), and
    count, mean and variance equal numpy's over the autograd costs of those steps."""
    torch.manual_seed(0)
    net = R5Net()
    for c in net.cells:
        for e in range(5):
            gated = R5Gated("relu-conv-bn", "bn", 1e-5)
            gated._ops = c._ops[e]._ops
            c._ops[e] = gated
    probe = nasdiag.attach(net, statistics="sampled")
    g = torch.Generator().manual_seed(3)
    rows, masks = [], []
    for step in range(8):
        x, y = _batch(step)
        net.Z = [F.one_hot(torch.randint(0, K, (B, 5), generator=g), K).to(DT).requires_grad_() for _ in net.cells]
        with pytest.warns(RuntimeWarning, match="did not run"):
            with probe.record():
                F.cross_entropy(net(x), y).backward()
        per_sample = probe.costs(per_sample=True)
        for i, z in enumerate(net.Z):
            ran = z.detach().ne(0).any(0)  # (E, K)
            for e in range(5):
                got = per_sample[_name(i, e)]
                torch.testing.assert_close(got[:, ran[e]], z.grad[:, e][:, ran[e]], rtol=1e-12, atol=1e-15)
                assert bool(torch.isnan(got[:, ~ran[e]]).all())
            rows.append(z.grad.sum(0).numpy())
            masks.append(ran.numpy())
    st = probe.statistics()
    R, M = np.array(rows), np.array(masks)
    count = M.sum(0)
    assert (st["cost/normal/count"] == count).all() and (count > 0).all()
    mean = (R * M).sum(0) / count
    np.testing.assert_allclose(st["cost/normal/mean"], mean, rtol=1e-10, atol=1e-16)
    np.testing.assert_allclose(st["cost/normal/var"], (((R - mean) ** 2) * M).sum(0) / count, rtol=1e-8, atol=1e-18)


def _invariant_numerically(op, x):
    with torch.no_grad():
        a, b, c = op(x), op(2.7 * x), op(0.4 * x)
    tol = 1e-7 * float(a.abs().max()) + 1e-12
    return bool((a - b).abs().max() <= tol and (a - c).abs().max() <= tol)


def test_a_float32_model_moved_to_float64_after_attach_and_switched_to_eval():
    """Costs equal autograd in float64 after .double(); scale_invariant_ops() follows the current mode and agrees
    with evaluating f(c·x) = f(x) on each op at its recorded input (eps = 1e-12)."""
    torch.manual_seed(0)
    net = R5Net(eps=1e-12).float()
    probe = nasdiag.attach(net)
    x, y = _batch()
    net.Z = [z.detach().float() for z in _softmax_z(net)]
    with probe.record():
        F.cross_entropy(net(x.float()), y).backward()
    net.double()
    for mode in (True, False):
        net.train(mode)
        net.zero_grad()
        net.Z = _softmax_z(net, seed=5)
        inputs = {}
        hooks = [m.register_forward_pre_hook(lambda mod, a, i=i, e=e: [inputs.setdefault((i, e), a[0].detach()), None][1])
                 for i, c in enumerate(net.cells) for e, m in enumerate(c._ops)]
        with probe.record():
            F.cross_entropy(net(x), y).backward()
        for h in hooks:
            h.remove()
        costs, flags = probe.costs(), probe.scale_invariant_ops()
        for i, c in enumerate(net.cells):
            for e, m in enumerate(c._ops):
                assert costs[_name(i, e)].dtype == DT
                torch.testing.assert_close(costs[_name(i, e)], net.Z[i].grad[e], rtol=1e-10, atol=1e-15)
                numeric = [_invariant_numerically(op, inputs[(i, e)]) for op in m._ops]
                assert flags[_name(i, e)].tolist() == numeric, (mode, i, e)
        assert flags[_name(0, 0)].tolist() == ([True, False, True, True, True] if mode else [True, False, False, False, False])


def test_bad_edge_maps_and_mixing_weights_are_one_line_probe_errors():
    torch.manual_seed(0)
    net = R5Net(layers=1)
    mixed = net.cells[0]._ops[0]
    bad_maps = [{"a": "cells.0._ops.0"}, {}, {"a": mixed, "b": mixed}, {"a": (mixed, [])},
                {"a": (mixed, [net.cells[0]._ops[1]._ops[2]])}, {"a": net.cells[0]}, {"a": nn.Linear(2, 2)}]
    for edges in bad_maps:
        with pytest.raises(nasdiag.probe.ProbeError) as err:
            nasdiag.attach(net, edges=edges)
        assert "\n" not in str(err.value)
    x, y = _batch()
    z = _softmax_z(net)[0].detach()
    net.Z = [torch.cat([z, z[:, :1]], 1)]  # K + 1 weights for K candidates
    probe = nasdiag.attach(net)
    with pytest.raises(nasdiag.probe.ProbeError, match="weights of shape") as err:
        with probe.record():
            F.cross_entropy(net(x), y).backward()
    assert "\n" not in str(err.value)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())
    with pytest.raises(nasdiag.probe.ProbeError, match="no completed recorded step"):
        probe.costs()


def test_results_read_inside_the_block_say_to_read_them_after_it():
    """Before: 'no completed recorded step: run `with probe.record(): ...` first', inside that very block."""
    torch.manual_seed(0)
    net = R5Net(layers=1)
    net.Z = _softmax_z(net)
    probe = nasdiag.attach(net, path_split=True)
    x, y = _batch()
    for _ in range(2):  # also inside a second block, after a completed one
        with probe.record():
            F.cross_entropy(net(x), y).backward()
            for read in (probe.costs, probe.output_costs, probe.path_costs, probe.cell_type_costs):
                with pytest.raises(nasdiag.probe.ProbeError, match="after the block") as err:
                    read()
                assert "\n" not in str(err.value)
    torch.testing.assert_close(probe.costs()[_name(0, 0)], net.Z[0].grad[0] / 2, rtol=1e-12, atol=1e-15)


class R5TupleCell(R5Cell):
    def forward(self, s0, s1, weights):
        out = super().forward(s0, s1, weights)
        return out, out.pow(2).mean()  # (output, an auxiliary loss)


class R5TupleNet(R5Net):
    def forward(self, x):
        s0 = s1 = self.stem(x)
        aux = 0
        for c, z in zip(self.cells, self.Z):
            out, a = c(s0, s1, z)
            s0, s1, aux = s1, out, aux + a
        return self.classifier(F.adaptive_avg_pool2d(s1, 1).flatten(1)), aux


def test_a_cell_returning_a_tuple_is_named_as_such_not_as_unreached():
    """Before: 'no gradient reached the output of cell(s) ...' (output costs) and 'no gradient reached the node
    through the cell output or its edges' (path split), though the gradient did reach the cell's output."""
    torch.manual_seed(0)
    net = R5TupleNet(layers=2)
    for c in net.cells:
        c.__class__ = R5TupleCell
    net.Z = _softmax_z(net)
    x, y = _batch()
    probe = nasdiag.attach(net)
    with probe.record():  # no warning here: a cell may return an auxiliary value if output costs are not read
        logits, aux = net(x)
        (F.cross_entropy(logits, y) + 0.1 * aux).backward()
    for i in range(2):
        for e in range(5):  # edge costs are unaffected
            torch.testing.assert_close(probe.costs()[_name(i, e)], net.Z[i].grad[e], rtol=1e-12, atol=1e-15)
    with pytest.warns(RuntimeWarning, match="returned tuple, not the tensor") as got:
        oc = probe.output_costs()
    assert all(torch.isnan(v) for nodes in oc.values() for v in nodes.values())
    assert not any("no gradient reached" in str(w.message) for w in got)
    with pytest.raises(nasdiag.probe.ProbeError, match="returned tuple") as err:
        with nasdiag.attach(net, path_split=True).record():
            logits, aux = net(x)
            (F.cross_entropy(logits, y) + 0.1 * aux).backward()
    assert "\n" not in str(err.value)


def test_a_misordered_candidate_list_is_caught_after_a_uniform_first_step():
    torch.manual_seed(0)
    net = R5Net(layers=1)
    mixed = net.cells[0]._ops[0]
    edges = {f"e{e}": m for e, m in enumerate(net.cells[0]._ops)}
    swapped = [mixed._ops[1], mixed._ops[0], mixed._ops[2], mixed._ops[3], mixed._ops[4]]  # none and skip swapped
    x, y = _batch()
    probe = nasdiag.attach(net, edges={**edges, "e0": (mixed, swapped)})
    right = nasdiag.attach(net, edges={**edges, "e0": (mixed, list(mixed._ops))})
    net.Z = [torch.full((5, K), 1.0 / K, dtype=DT)]  # softmax of a zero-initialised α
    with probe.record(), right.record():
        F.cross_entropy(net(x), y).backward()
    net.Z = _softmax_z(net)
    with pytest.raises(nasdiag.probe.ProbeError, match="order of its weights") as err:
        with probe.record():
            F.cross_entropy(net(x), y).backward()
    assert "\n" not in str(err.value)
    with right.record():  # the list in the order of the weights passes, and is checked no more
        F.cross_entropy(net(x), y).backward()
    assert not any(right._convention_unchecked)
    torch.testing.assert_close(right.costs()["e0"], net.Z[0].grad[0], rtol=1e-12, atol=1e-15)
