"""Independent audit of the probe's costs and the XNAS forecaster on supernets written here (not nasdiag's
Network), against autograd w.r.t. explicit mixing-weight leaves and a literal transcription of Algorithm 1.
All float64."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.cost import darts_alpha_grad
from nasdiag.probe import ProbeError
from nasdiag.regret import Forecaster

from conftest import assert_no_module_hooks

D, K = 4, 3


class LinearMixed(nn.Module):
    """DARTS-convention mixed op on (B, D) features: forward(x, weights) = Σ_k w_k op_k(x)."""

    def __init__(self):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(D, D, dtype=torch.float64), nn.Tanh(), nn.Identity()])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class LinearCell(nn.Module):
    """A cell of the node protocol on (B, D) features: nodes 0, 1 inputs, 2..steps+1 intermediate, edges in
    DARTS order, output = concatenation of the intermediate nodes along dim 1."""

    cell_type = "normal"

    def __init__(self, steps):
        super().__init__()
        self.edge_nodes = [(i, j) for j in range(2, 2 + steps) for i in range(j)]
        self.edges = nn.ModuleList(LinearMixed() for _ in self.edge_nodes)
        self.output_nodes = list(range(2, 2 + steps))
        self.output_node_slices = {n: ((n - 2) * D, (n - 1) * D) for n in self.output_nodes}

    def forward(self, s0, s1, Z):
        nodes = [s0, s1]
        for j in self.output_nodes:
            nodes.append(sum(self.edges[e](nodes[i], Z[e]) for e, (i, jj) in enumerate(self.edge_nodes) if jj == j))
        return torch.cat(nodes[2:], dim=1)


class IrregularNet(nn.Module):
    """Two cells of one type sharing α, one with 2 edges (1 step) and one with 5 (2 steps): the shared α has
    5 rows, the first cell uses rows 0-1."""

    def __init__(self):
        super().__init__()
        self.small, self.large = LinearCell(1), LinearCell(2)
        self.squeeze = nn.Linear(D, D, dtype=torch.float64)
        self.head = nn.Linear(2 * D, 3, dtype=torch.float64)
        self.alpha = nn.Parameter(0.5 * torch.randn(5, K, dtype=torch.float64))

    def forward(self, x, Z_small=None, Z_large=None):
        p = torch.softmax(self.alpha, -1)
        h = self.squeeze(self.small(x, x, p[:2] if Z_small is None else Z_small))
        return self.head(self.large(h, x, p if Z_large is None else Z_large))


def test_cell_type_costs_of_cells_with_different_edge_counts_are_the_shared_alpha_cost():
    """§2.1 summed over the cells that use each row of a shared α: a row used by only some cells of the type
    gets the sum over those cells, not NaN (the cells lacking that edge contribute nothing)."""
    torch.manual_seed(0)
    net = IrregularNet()
    x, y = torch.randn(6, D, dtype=torch.float64), torch.randint(0, 3, (6,))
    p = torch.softmax(net.alpha, -1).detach()
    Zs, Zl = p[:2].clone().requires_grad_(), p.clone().requires_grad_()
    gs, gl = torch.autograd.grad(F.cross_entropy(net(x, Zs, Zl), y), (Zs, Zl))
    shared = gl.clone()
    shared[:2] += gs

    probe = nasdiag.attach(net)
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    costs = probe.cell_type_costs()["normal"]
    assert torch.allclose(costs, shared, rtol=0, atol=1e-14)
    assert torch.allclose(darts_alpha_grad(costs, p), net.alpha.grad, rtol=0, atol=1e-14)
    assert torch.allclose(probe.aggregate(probe.costs())["normal"], shared, rtol=0, atol=1e-14)
    # the statistics count each row once per cell that has it
    assert probe.statistics()["cost/normal/count"][:, 0].tolist() == [2, 2, 1, 1, 1]


def test_cell_type_costs_keep_nan_of_an_edge_that_exists_but_was_not_observed():
    torch.manual_seed(1)
    net = IrregularNet()
    x, y = torch.randn(6, D, dtype=torch.float64), torch.randint(0, 3, (6,))
    probe = nasdiag.attach(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with probe.record():
            net(x).sum()  # no backward: every edge exists, none observed
        costs = probe.cell_type_costs()["normal"]
    assert torch.isnan(costs).all()


class ReturnsInputMixed(nn.Module):
    """A mixed op that, for a one-hot Z on skip, returns its input object itself (a memory short-cut)."""

    def __init__(self):
        super().__init__()
        self._ops = nn.ModuleList([nn.Identity(), nn.Linear(D, D, dtype=torch.float64)])

    def forward(self, x, weights):
        if bool(weights[0].detach() == 1):
            return self._ops[0](x)
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class EdgeThenHead(nn.Module):
    """One mixed op, then a linear head; ``skip`` adds ``skip·x`` around the edge (another consumer of x)."""

    def __init__(self, edge: nn.Module, skip: float = 0.0):
        super().__init__()
        self.edge, self.skip = edge, skip
        self.head = nn.Linear(D, 2, dtype=torch.float64)

    def forward(self, x, Z):
        return self.head(self.edge(x, Z) + self.skip * x)


def test_an_edge_returning_its_input_object_is_refused_not_given_the_inputs_total_gradient():
    """The edge output's tensor hook would be a hook on x_i, which collects the gradient of x_i's other
    consumers too (here 3× the true <∂L/∂x_j, x_i>): a silent wrong cost."""
    torch.manual_seed(2)

    net = EdgeThenHead(ReturnsInputMixed(), skip=2.0)
    x = torch.randn(3, D, dtype=torch.float64, requires_grad=True)
    probe = nasdiag.attach(net)
    with pytest.raises(ProbeError, match="input"):
        with probe.record():
            F.cross_entropy(net(x, torch.tensor([1.0, 0.0], dtype=torch.float64)), torch.tensor([0, 1, 0])).backward()
    assert_no_module_hooks(net)
    # a mixture (a new tensor) still gives autograd's ∂L/∂Z
    Z = torch.tensor([0.7, 0.3], dtype=torch.float64, requires_grad=True)
    with probe.record():
        F.cross_entropy(net(x, Z), torch.tensor([0, 1, 0])).backward()
    assert torch.allclose(probe.costs()["edge"], Z.grad, rtol=0, atol=1e-14)


class SampledOnlyMixed(nn.Module):
    """DSNAS/ProxylessNAS style: only the ops with a non-zero weight run."""

    def __init__(self):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(D, D, dtype=torch.float64), nn.Tanh(), nn.Identity()])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops) if bool(w.detach() != 0))


def test_statistics_leave_out_a_candidate_op_that_did_not_run():
    """An op that did not run has no cost at that step (NaN in costs(), flagged): it is not an observation, so
    its count does not grow and its mean is over the steps it ran (as for an edge whose forward never ran),
    instead of one skipped step turning its mean into NaN for good."""
    torch.manual_seed(3)

    net = EdgeThenHead(SampledOnlyMixed())
    probe = nasdiag.attach(net)
    observed = []
    for t, ops in enumerate([(0,), (1, 2), (0, 2), (0,)]):
        x, y = torch.randn(5, D, dtype=torch.float64), torch.randint(0, 2, (5,))
        Z = torch.zeros(K, dtype=torch.float64)
        Z[list(ops)] = 1.0 / len(ops)
        Z.requires_grad_()
        with pytest.warns(RuntimeWarning, match="did not run"):
            with probe.record():
                F.cross_entropy(net(x, Z), y).backward()
        observed.append(torch.where(Z.detach() != 0, Z.grad, math.nan))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not a "NaN cost (e.g. a NaN loss)": the op did not run
            assert torch.equal(torch.isnan(probe.costs()["edge"]), Z.detach() == 0)
    observed = torch.stack(observed)
    ran = ~torch.isnan(observed)
    stats = probe.statistics()
    assert stats["cost/edges/count"][0].tolist() == ran.sum(0).tolist()
    mean = torch.where(ran, observed, 0.0).sum(0) / ran.sum(0)
    var = (torch.where(ran, observed - mean, 0.0) ** 2).sum(0) / ran.sum(0)
    assert torch.allclose(torch.from_numpy(stats["cost/edges/mean"][0]), mean, rtol=0, atol=1e-15)
    assert torch.allclose(torch.from_numpy(stats["cost/edges/var"][0]), var, rtol=0, atol=1e-15)


def test_output_costs_of_a_cell_output_modified_in_place_are_nan_and_flagged_not_scaled():
    """<∂L/∂out, out> needs the cell output as it left the cell; scaled in place afterwards (out.mul_(2)) the
    probe read the new values (2× the cost). It cannot know the old ones: NaN + a warning; edge costs unaffected."""
    torch.manual_seed(4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = LinearCell(2)
            self.head = nn.Linear(2 * D, 3, dtype=torch.float64)
            self.alpha = nn.Parameter(0.5 * torch.randn(5, K, dtype=torch.float64))

        def forward(self, x, Z=None):
            out = self.cell(x, x, torch.softmax(self.alpha, -1) if Z is None else Z)
            out.mul_(2.0)
            return self.head(out)

    net = Net()
    x, y = torch.randn(6, D, dtype=torch.float64), torch.randint(0, 3, (6,))
    Z = torch.softmax(net.alpha, -1).detach().requires_grad_()
    (dZ,) = torch.autograd.grad(F.cross_entropy(net(x, Z), y), Z)
    probe = nasdiag.attach(net)
    with pytest.warns(RuntimeWarning, match="in place"):
        with probe.record():
            F.cross_entropy(net(x), y).backward()
    assert all(torch.isnan(v) for v in probe.output_costs()["cell"].values())
    costs = torch.stack([probe.costs()[f"cell.edges.{e}"] for e in range(5)])
    assert torch.allclose(costs, dZ, rtol=0, atol=1e-14)


def test_a_list_of_edge_specs_naming_one_edge_twice_is_refused_not_silently_dropped():
    from nasdiag.edges import EdgeSpec, EdgeSpecError, resolve_edges

    net = nn.Module()
    net.a, net.b = LinearMixed(), LinearMixed()
    specs = [EdgeSpec("e", m, tuple(m._ops), ("lin", "tanh", "skip")) for m in (net.a, net.b)]
    with pytest.raises(EdgeSpecError, match="'e'"):
        resolve_edges(net, specs)
    with pytest.raises(ProbeError, match="'e'"):
        nasdiag.attach(net, edges=specs)
    assert [s.module for s in resolve_edges(net, specs[:1])] == [net.a]


@pytest.mark.parametrize("slices", [{2: (0, D), 3: (D - 1, 2 * D)}, {2: (0, 0), 3: (D, 2 * D)}, {2: (-1, D), 3: (D, 2 * D)}])
def test_overlapping_or_empty_output_node_slices_are_refused_at_attach(slices):
    net = IrregularNet()
    net.large.output_node_slices = slices
    with pytest.raises(ProbeError, match="output_node_slices"):
        nasdiag.attach(net)


# --- XNAS: a literal linear-space transcription of Algorithm 1 -----------------------------------

def _algorithm_1(rewards, eta, L, T):
    """Lines 2-12 with Python floats; returns per round (u_t, alive, γ_t, regret of eq 2 with linear losses)."""
    N = len(rewards[0])
    v, alive, gamma, loss_f, loss_i, out = [1.0] * N, set(range(N)), 1.0, 0.0, [0.0] * N, []
    for t, R in enumerate(rewards, start=1):
        Z = sum(v[i] for i in alive)
        loss_f -= sum(v[i] / Z * R[i] for i in alive)  # ℓ_t(p_t), p_t from v_{t-1} (line 5)
        loss_i = [a - r for a, r in zip(loss_i, R)]
        v = [v[i] * math.exp(eta * R[i]) if i in alive else 0.0 for i in range(N)]
        theta = max(v[i] for i in alive) * math.exp(-2 * eta * L * (T - t))
        gone = {i for i in alive if v[i] < theta}
        if gone:
            gamma *= 1 + sum(v[i] for i in gone) / sum(v[i] for i in alive - gone)
        alive -= gone
        v = [v[i] if i in alive else 0.0 for i in range(N)]
        Z = sum(v)
        out.append(([x / Z for x in v], [i in alive for i in range(N)], gamma, loss_f - min(loss_i)))
    return out


@pytest.mark.parametrize("T,N,eta", [(1, 4, 0.7), (12, 3, 0.9), (25, 5, 0.4)])
def test_forecaster_matches_a_literal_algorithm_1(T, N, eta):
    g = torch.Generator().manual_seed(T)
    rewards = (torch.rand(T, N, generator=g, dtype=torch.float64) * 2 - 1)
    if T == 1:
        rewards[0] = torch.tensor([0.5, 0.5, -0.25, 0.5])  # ties at the maximum survive θ_T = max v
    ref = _algorithm_1(rewards.tolist(), eta, 1.0, T)
    fc = Forecaster(N, eta, 1.0, T)
    for t in range(T):
        fc.update(rewards[t])
        u, alive, gamma, regret = ref[t]
        assert fc.alive.tolist() == alive
        assert torch.allclose(fc.weights, torch.tensor(u, dtype=torch.float64), rtol=0, atol=1e-14)
        assert float(fc.gamma) == pytest.approx(gamma, abs=1e-13)
        assert float(fc.regret) == pytest.approx(regret, abs=1e-13)
        assert float(fc.regret) <= float(fc.bound()) + 1e-12
        bound = eta * (t + 1) / 2 + (math.log(N) - math.log(gamma)) / eta
        assert float(fc.bound()) == pytest.approx(bound, abs=1e-12)


# --- bad input: one NasdiagError (still the builtin type callers caught before) ---------------------

def _bad_inputs():
    from nasdiag.cost import CostMoments, edge_costs, output_edge_costs, snas_alpha_grad
    from nasdiag.regret import SoftmaxGD, cell_depth, gd_softmax_reward, normalized_entropy, xnas_reward

    two = torch.zeros(2, dtype=torch.float64)
    played = Forecaster(2, 0.5, 1.0, 1)
    played.update(two)
    return [
        (ValueError, lambda: Forecaster(2, 0.5, 1.0, 5).update(torch.zeros(3))),
        (ValueError, lambda: Forecaster(2, 0.5, 1.0, 5).update(torch.tensor([0.0, math.nan]))),
        (ValueError, lambda: Forecaster(0, 0.5, 1.0, 5)),
        (ValueError, lambda: Forecaster(2, "fast", 1.0, 5)),
        (TypeError, lambda: Forecaster(2, 0.5, 1.0, 2.5)),
        (TypeError, lambda: Forecaster(2, 0.5, 1.0, None)),
        (ValueError, lambda: Forecaster(2, 0.5, 1.0, math.inf)),
        (RuntimeError, lambda: played.update(two)),
        (ValueError, lambda: Forecaster.optimal_lr(10, 1.0, 1)),
        (ValueError, lambda: SoftmaxGD(2, 0.5).update(torch.tensor([math.inf, 0.0]))),
        (TypeError, lambda: xnas_reward(torch.tensor([1, 2]))),
        (ValueError, lambda: gd_softmax_reward(torch.zeros(3), torch.zeros(2))),
        (ValueError, lambda: normalized_entropy(torch.tensor([0.5, 0.6]))),
        (ValueError, lambda: cell_depth([])),
        (ValueError, lambda: edge_costs(torch.zeros(2, 3), [torch.zeros(2, 4)])),
        (ValueError, lambda: output_edge_costs(torch.zeros(2, 3), torch.zeros(2, 3), {2: (0, 5)})),
        (ValueError, lambda: darts_alpha_grad(torch.zeros(3), torch.zeros(2))),
        (ValueError, lambda: snas_alpha_grad(torch.zeros(2), torch.zeros(2), 0.0)),
        (ValueError, lambda: CostMoments((2, 3)).update(torch.zeros(4))),
    ]


def test_bad_input_to_costs_and_regret_is_one_nasdiag_error_of_the_documented_builtin_type():
    from nasdiag.errors import NasdiagError

    for builtin, call in _bad_inputs():
        with pytest.raises(NasdiagError) as info:
            call()
        assert isinstance(info.value, builtin), (info.value, builtin)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("below, wiped", [(0.0, False), (2.0 ** -20, True)])
def test_wipeout_is_strictly_below_the_threshold(below, wiped):
    """Line 12 removes v_{t,i} < θ_t: R = (L, −L) at t = T − 1 puts expert 1 exactly on θ_t = max v·e^{−2ηL}
    (kept, Lemma 1's equality case); 2^-20 lower (a bound violation) is below it (removed). Binary-exact numbers."""
    fc = Forecaster(2, 0.5, 1.0, 2)
    fc.update(torch.tensor([1.0, -1.0 - below], dtype=torch.float64))
    assert fc.alive.tolist() == [True, not wiped]
    assert fc.bound_violations.item() == int(wiped)
    if wiped:
        (entry,) = list(fc.wipeout_log)
        assert (entry.round, entry.expert, entry.log_threshold) == (1, 1, 0.5 - 1.0)
