"""Probe audit round 21 (probe21): supernets written from scratch here in the styles of the field's public codebases
that rounds 4 and 20 did not reach, attached with ``nasdiag.attach``, against float64 references computed here with
plain autograd (leaf mixing weights Z put in place of each edge's weights: C_k = ∂L/∂Z_k, wiring supplement §2.1;
``torch.autograd.functional.hessian`` in one edge's Z). Never nasdiag against nasdiag.

Defects found (each test fails without its fix):

* AutoDL-Projects' GDAS (the official code: ``MixedOp.forward_gdas(x, weights, index) = _ops[index](x) *
  weights[index]``, which the cell calls as a method, ``op.forward_gdas(h, weights, index)``) runs no module hooks of
  the mixed op, so every edge's costs are NaN, as documented for a mixed op whose forward never ran; but the warning
  said "the forward of 2 edge(s) never ran inside probe.record() ... Run the model's forward inside the block" after a
  block that ran it: the wrong cause and a fix that changes nothing. The probe sees the edge's candidate ops run with no
  call of their mixed op open and says so: call the module (op(x, weights)) with a forward doing what the method does
  (test_gdas_called_as_a_method_is_said_to_bypass_the_module_and_called_as_a_module_costs_the_sampled_op).
* docs/probe.md promised that a torch.compile'd model "works" and, attaching the eager net and calling the compiled
  one, "the same hooks fire, the same costs". Dynamo does not guard on module hooks by default
  (``torch._dynamo.config.skip_nnmodule_hook_guards = True``): a compiled model called once before the block (a warm-up,
  the unprobed steps of a loop that probes every N steps) ran the code compiled without the hooks inside it, every cost
  NaN with the "never ran ... Run the model's forward inside the block" warning; code compiled inside a first block was
  replaced by the unprobed steps after it, so the second probed step was NaN too (round 11's test passed because its
  warm-up call had weights without grad, a guard change that made dynamo recompile inside the block). The warning now
  names the flag and the fix; docs/probe.md says to set it to False before the first compiled call, with which every
  probed step costs as autograd
  (test_a_compiled_model_called_outside_the_blocks_says_which_dynamo_flag_and_with_it_costs_as_autograd).
* PC-DARTS mapped as docs/probe.md says (the ops' mix on the channel slice, a module inside the partial-channel one at
  each position of the cell's edge list) in a cell declaring its nodes: its edges had their cell but no edge index or
  node pair, although the docs say edges inside a cell get them, so the statistics were one group "edges" of 10 rows
  (2 cells x 5 edges, each a row) and cell_type_costs() the costs of no α instead of the (5, K) sum over the cells
  sharing α; an edge inside an entry of the edge list that is no edge itself now takes that entry's index and node
  pair (test_pc_darts_mix_inside_a_declared_cells_edge_list_gets_its_edge_and_nodes_and_the_shared_alpha_costs).
* PC-DARTS's own cell (``_ops``, ``_steps``, ``_multiplier``, ``reduction``, forward ``(s0, s1, weights, weights2)``)
  was no DARTS-convention cell, which took a forward of exactly three arguments: its edges had no cell, type, index or
  node pair (one group "edges", no cell_type_costs per α) and it had no output costs; a forward with more arguments
  after (s0, s1, weights) is one now
  (test_pc_darts_cell_taking_weights2_is_a_darts_cell_whose_edges_and_output_costs_are_autograds).
* probe.hessian() in the exact mode of a compiled model (attach(torch.compile(net), hessian='exact'), or a net compiled
  in place with net.compile()) re-ran the compiled code under torch.func and stopped in dynamo's 'AssertionError:
  False != True' traceback; the eager module is re-run (the same forward and parameters)
  (test_exact_curvature_of_a_compiled_wrapper_or_a_module_compiled_in_place_is_autograds).

Checked and right (autograd references here or in scratch): FairDARTS's sigmoid weights and DrNAS's Dirichlet
rsample over candidates kept in an nn.ModuleDict, as plain attributes mixed by hand, and one op module shared by three
edges: costs and per-sample rows = ∂L/∂Z, the exact Z curvature of a Dirichlet step (its re-run draws the recorded
sample) = torch.autograd.functional.hessian, hessian(wrt='alpha') refused in one line for both (no softmax); candidates
mapped out of the weights' order are refused at the first step whose weights differ (sigmoid(0) = 0.5 passes the first,
as documented); GDAS called as a module: the sampled op's cost = autograd at the straight-through one-hot, the rest NaN
with the documented warning, statistics count only sampled ops, statistics='sampled' on a forward (x, weights, index)
refused at attach, invariance_deviation NaN for the ops that did not run; a compiled (eager and aot_eager backends,
flag False) GDAS chain, DrNAS net and declared cell with path_split give the eager costs, rows and path parts;
attach(torch.compile(net)) and net.compile() after a warm-up get the new warning; PC-DARTS with path_split is one
ProbeError line naming β/partial channels; hooks gone after every block, also when a warning raised as an error.

Noticed and left: under warnings-as-errors (pytest -W error) a block whose only fault is a warning (ops that did not
run) discards the step and costs() says 'a block whose body raised records nothing' (the body did not raise: the
warning did; the behaviour is the documented discard); one mixed op used at two layers of a one-shot net whose one-hot
samples happen to be equal on a step is taken for tied Z and adds both layers' costs under one name (refused only at a
step where they differ, as documented); the compiled-model warning is chosen for any edge that ran no hook while a
forward of the model has dynamo code and the flag is True (a path dropped in such a run is named as that cause too);
the GDAS warning marks an edge whose candidate ran while no mixed op listing it was open, so a candidate shared with a
module outside every edge (a stem) of an edge dropped that step would be named as a bypassed mixed op; the DrNAS
wrt='alpha' refusal speaks of a softmax temperature (the line still says to use wrt='Z').
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag

DT = torch.float64
D, K, N_CLS = 4, 3, 3


def _no_hooks(model: nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                   for m in model.modules())


def _batch(seed: int = 0, b: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, D, dtype=DT, generator=g), torch.randint(0, N_CLS, (b,), generator=g)


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


# -- GDAS as AutoDL-Projects writes it ------------------------------------------------------------------------------
class _AutoDLMixedOp(nn.Module):
    """AutoDL-Projects' search_cells.MixedOp: no mixing in forward's place, methods the cell calls by name."""

    def __init__(self):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(D, D, dtype=DT), nn.Identity(), nn.Tanh()])

    def forward_gdas(self, x, weights, index):
        return self._ops[index](x) * weights[index]

    def forward(self, x, weights, index):  # the same as a module call (what the warning asks for)
        return self.forward_gdas(x, weights, index)


class _GDASChain(nn.Module):
    """Two edges whose weights are GDAS's hard Gumbel one-hot with a straight-through gradient; only the argmax op runs.
    ``Z``: leaves put in place of the hard weights (the reference's ∂L/∂Z)."""

    def __init__(self, as_method: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = _AutoDLMixedOp(), _AutoDLMixedOp()
        self.head = nn.Linear(D, N_CLS, dtype=DT)
        self.arch = nn.Parameter(0.5 * torch.randn(2, K, dtype=DT))
        self.as_method, self.seed, self.Z = as_method, 0, None

    def hardwts(self):
        g = torch.Generator().manual_seed(self.seed)
        gumbels = -torch.empty_like(self.arch).exponential_(generator=g).log()
        probs = (self.arch.log_softmax(-1) + gumbels).softmax(-1)
        index = probs.max(-1, keepdim=True)[1]
        return torch.zeros_like(probs).scatter_(-1, index, 1.0) - probs.detach() + probs, index[:, 0]

    def forward(self, x):
        hard, index = self.hardwts()
        w = hard if self.Z is None else self.Z
        h = x
        for e, op in enumerate((self.a, self.b)):
            h = op.forward_gdas(h, w[e], int(index[e])) if self.as_method else op(h, w[e], int(index[e]))
        return self.head(torch.tanh(h))


def test_gdas_called_as_a_method_is_said_to_bypass_the_module_and_called_as_a_module_costs_the_sampled_op():
    """Before: a cell calling op.forward_gdas(h, w, k) (no module hooks fire) got 'the forward of 2 edge(s) never ran
    inside probe.record() ... Run the model's forward inside the block' after a block that ran it. Now the warning says
    the candidate ops ran but the module was never called. Called as a module, the sampled op's cost is autograd's
    ∂L/∂Z_k at the hard one-hot (its straight-through value), the ops that did not run are NaN with the documented
    warning, and the statistics count only the ops that ran."""
    x, y = _batch()
    edges = lambda net: {"a": (net.a, list(net.a._ops)), "b": (net.b, list(net.b._ops))}  # noqa: E731

    net = _GDASChain(as_method=True)
    probe = nasdiag.attach(net, edges=edges(net))

    def step():
        with probe.record():
            F.cross_entropy(net(x), y).backward()

    msgs = _caught(step)
    assert len(msgs) == 1 and "('a', 'b')" in msgs[0] and "never called" in msgs[0] and "forward_gdas" in msgs[0]
    assert "Run the model's forward" not in msgs[0] and "\n" not in msgs[0]
    assert all(torch.isnan(c).all() for c in probe.costs().values()) and _no_hooks(net)

    net = _GDASChain(as_method=False)
    probe = nasdiag.attach(net, edges=edges(net))
    counts = torch.zeros(2, K, dtype=torch.int64)
    for seed in (0, 1, 2):
        net.seed = seed
        msgs = _caught(step)
        assert len(msgs) == 1 and "some candidate ops did not run" in msgs[0]
        hard, index = net.hardwts()
        Z = hard.detach().clone().requires_grad_()
        net.Z = Z
        grad = torch.autograd.grad(F.cross_entropy(net(x), y), Z)[0]
        net.Z = None
        for e, name in enumerate("ab"):
            k = int(index[e])
            c = probe.costs()[name]
            assert torch.allclose(c[k], grad[e, k], rtol=1e-12, atol=1e-15)
            assert torch.isnan(c).sum() == K - 1
            rows = probe.costs(per_sample=True)[name]
            assert rows.shape == (x.shape[0], K) and torch.allclose(rows[:, k].sum(), grad[e, k], rtol=1e-12, atol=1e-15)
            counts[e, k] += 1
    assert torch.equal(torch.as_tensor(probe.statistics()["cost/edges/count"]), counts)
    assert _no_hooks(net)


# -- torch.compile: a compiled model called outside the blocks -------------------------------------------------------
class _Mixed(nn.Module):
    """DARTS convention: forward(x, weights) = Σ_k w_k·op_k(x)."""

    def __init__(self):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(D, D, dtype=DT), nn.Identity(), nn.Tanh()])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class _CompiledNet(nn.Module):
    """Two edges, α inside; ``Z``: leaves put in place of softmax(α) (the reference)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.head = _Mixed(), _Mixed(), nn.Linear(D, N_CLS, dtype=DT)
        self.alpha = nn.Parameter(torch.randn(2, K, dtype=DT))

    def forward(self, x, Z=None):
        w = F.softmax(self.alpha, -1) if Z is None else Z
        return self.head(self.b(torch.tanh(self.a(x, w[0])), w[1]))


def _reference(net, x, y):
    Z = F.softmax(net.alpha, -1).detach().requires_grad_()
    return torch.autograd.grad(F.cross_entropy(net(x, Z), y), Z)[0]


def test_a_compiled_model_called_outside_the_blocks_says_which_dynamo_flag_and_with_it_costs_as_autograd():
    """docs/probe.md: 'attach the eager net and call the compiled module (the same hooks fire, the same costs)'. Before:
    a compiled model called once before the block (a warm-up, the unprobed steps of a loop probing every N steps) ran
    inside the block the code dynamo compiled without the hooks (it does not guard on module hooks,
    torch._dynamo.config.skip_nnmodule_hook_guards = True by default): every cost NaN with 'the forward of 2 edge(s)
    never ran inside probe.record() ... Run the model's forward inside the block' after a block that ran it; and code
    compiled inside a first block was replaced by the unprobed steps after it, so the second probed step was NaN. Now the
    warning names the flag; with the flag False (the docs now say so) every probed step costs as autograd."""
    x, y = _batch(seed=4)
    net = _CompiledNet()
    compiled = torch.compile(net, backend="eager")
    probe = nasdiag.attach(net)
    torch._dynamo.reset()  # no code compiled for _CompiledNet by another test, in any order
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):  # torch's default
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dynamo's own warnings about tracing the probe's hooks
            compiled(x)  # a warm-up step without the probe
        msgs = _caught(lambda: _probed_step(probe, compiled, x, y))
    assert any("skip_nnmodule_hook_guards = False" in m and "('a', 'b')" in m for m in msgs), msgs
    assert not any("Run the model's forward" in m for m in msgs)
    assert all(torch.isnan(c).all() for c in probe.costs().values()) and _no_hooks(net)

    torch._dynamo.reset()  # the code compiled above without hook guards would serve another _CompiledNet too
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        net = _CompiledNet()
        compiled = torch.compile(net, backend="eager")
        probe = nasdiag.attach(net)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled(x)
            for _ in range(2):
                _probed_step(probe, compiled, x, y)
                ref = _reference(net, x, y)
                assert torch.allclose(torch.stack([probe.costs()["a"], probe.costs()["b"]]), ref, rtol=1e-12, atol=1e-16)
                F.cross_entropy(compiled(x), y).backward()  # an unprobed step between the blocks
                assert _no_hooks(net)


def _probed_step(probe, model, x, y):
    with probe.record():
        F.cross_entropy(model(x), y).backward()


# -- FairDARTS (sigmoid) and DrNAS (Dirichlet) weights over candidates in a ModuleDict, attributes, one op shared -------
class _DictMixed(nn.Module):
    """Candidates in an nn.ModuleDict, the last one shared with the other edges (one-shot weight sharing)."""

    def __init__(self, shared):
        super().__init__()
        self.ops = nn.ModuleDict({"lin": nn.Linear(D, D, dtype=DT), "skip": nn.Identity(), "tanh": nn.Tanh(),
                                  "shared": shared})

    def forward(self, x, w):
        return sum(w[k] * op(x) for k, op in enumerate(self.ops.values()))


class _AttrMixed(nn.Module):
    """Candidates as plain attributes, mixed in a hand-written order."""

    def __init__(self, shared):
        super().__init__()
        self.conv, self.skip, self.act, self.shared = nn.Linear(D, D, dtype=DT), nn.Identity(), nn.Sigmoid(), shared

    def forward(self, x, w):
        return w[0] * self.conv(x) + w[1] * self.skip(x) + w[2] * self.act(x) + w[3] * self.shared(x)


class _WeightsNet(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(5)
        shared = nn.Linear(D, D, bias=False, dtype=DT)
        self.a, self.b, self.c = _DictMixed(shared), _AttrMixed(shared), _DictMixed(shared)
        self.head = nn.Linear(D, N_CLS, dtype=DT)
        self.alpha = nn.Parameter(torch.randn(3, 4, dtype=DT))
        self.kind, self.Z, self.last = kind, None, None

    def forward(self, x):
        if self.Z is not None:
            w = self.Z
        elif self.kind == "fair":  # FairDARTS: independent sigmoids, not summing to 1
            w = torch.sigmoid(self.alpha)
        else:  # DrNAS: a reparameterised Dirichlet sample, drawn in forward from the global generator
            w = torch.distributions.Dirichlet(F.elu(self.alpha) + 1).rsample()
        self.last = w.detach()
        h = self.b(self.a(x, w[0]), w[1]) + self.c(x, w[2])
        return self.head(torch.relu(h))

    def edges(self):
        return {"a": (self.a, list(self.a.ops.values())), "b": (self.b, [self.b.conv, self.b.skip, self.b.act, self.b.shared]),
                "c": (self.c, list(self.c.ops.values()))}


@pytest.mark.parametrize("kind", ["fair", "drnas"])
def test_fairdarts_and_drnas_weights_over_dict_attribute_and_shared_candidates_cost_and_curve_as_autograd(kind):
    """Checked and right: costs and per-sample rows are autograd's ∂L/∂Z at the step's weights (sigmoid ones that do
    not sum to 1; a Dirichlet sample, which probe.hessian()'s re-run draws again from the recorded generator state: the
    exact Z curvature is autograd's at that sample), op names '<k>:<class>', and wrt='alpha' (softmax assumed) refused in
    one line for both."""
    x, y = _batch(seed=6)
    net = _WeightsNet(kind)
    probe = nasdiag.attach(net, edges=net.edges(), hessian="exact")
    assert probe.edge_names == ["a", "b", "c"] and probe.edges[1].op_names == ("0:Linear", "1:Identity", "2:Sigmoid", "3:Linear")
    for _ in range(2):
        with probe.record(targets=y):
            F.cross_entropy(net(x), y).backward()
        W = net.last
        Z = W.clone().requires_grad_()
        net.Z = Z
        grad = torch.autograd.grad(F.cross_entropy(net(x), y), Z)[0]
        for e, name in enumerate("abc"):
            assert torch.allclose(probe.costs()[name], grad[e], rtol=1e-12, atol=1e-16)
            assert torch.allclose(probe.costs(per_sample=True)[name].sum(0), grad[e], rtol=1e-12, atol=1e-16)
        net.Z = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DrNAS: Dirichlet's autograd.Function is not torch.func's; the fallback says so
        H = probe.hessian()
    for e, name in enumerate("abc"):
        def loss(z, e=e):
            net.Z = torch.cat([W[:e], z[None], W[e + 1:]])
            return F.cross_entropy(net(x), y)
        ref = torch.diagonal(torch.autograd.functional.hessian(loss, W[e].clone()))
        net.Z = None
        assert torch.allclose(H[name], ref, rtol=1e-10, atol=1e-14)
    with pytest.raises(nasdiag.errors.NasdiagError, match="assumes Z = softmax") as raised:
        probe.hessian(wrt="alpha")
    assert "\n" not in str(raised.value) and _no_hooks(net)


# -- PC-DARTS in a declared cell: partial channels, channel shuffle, edge normalization β, α shared by the cells -------
def _channel_shuffle(x, groups):
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).contiguous().view(b, c, h, w)


class _PCMix(nn.Module):
    """The ops' mix on the channel slice (discovered: `_ops` and forward(x, weights)), as docs/probe.md says to map it."""

    def __init__(self, c):
        super().__init__()
        self._ops = nn.ModuleList([nn.Conv2d(c, c, 1, bias=False, dtype=DT), nn.Identity(), nn.Tanh()])

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self._ops))


class _PCEdge(nn.Module):
    """PC-DARTS's MixedOp: 1/k of the channels through the mix, the rest bypassed, then a channel shuffle."""

    def __init__(self, c, k=2):
        super().__init__()
        self.k, self.mixed = k, _PCMix(c // k)

    def forward(self, x, weights):
        dim = x.shape[1] // self.k
        return _channel_shuffle(torch.cat([self.mixed(x[:, :dim], weights), x[:, dim:]], 1), self.k)


class _PCCell(nn.Module):
    """Node protocol: edges (0,2), (1,2), (0,3), (1,3), (2,3) from `steps`; node j = Σ_i β_ij·edge_ij(x_i)."""

    cell_type, steps, output_nodes = "normal", 2, [2, 3]

    def __init__(self, c):
        super().__init__()
        self.output_node_slices = {2: (0, c), 3: (c, 2 * c)}
        self.edges = nn.ModuleList([_PCEdge(c) for _ in range(5)])

    def forward(self, s0, s1, weights, betas):
        return _pc_nodes(self.edges, self.steps, s0, s1, weights, betas)


def _pc_nodes(edges, steps, s0, s1, weights, betas):
    """The last two nodes of a cell, concatenated; node j = Σ_i β_ij·edge_ij(x_i, w_ij), edges in DARTS order."""
    states, offset = [s0, s1], 0
    for _ in range(steps):
        states.append(sum(betas[offset + j] * edges[offset + j](h, weights[offset + j]) for j, h in enumerate(states)))
        offset += len(states) - 1
    return torch.cat(states[-2:], 1)


class _PCNet(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        torch.manual_seed(7)
        self.stem = nn.Conv2d(2, c, 3, padding=1, bias=False, dtype=DT)
        self.cells = nn.ModuleList([_PCCell(c), _PCCell(c)])
        self.pre = nn.Conv2d(2 * c, c, 1, bias=False, dtype=DT)
        self.head = nn.Linear(2 * c, N_CLS, dtype=DT)
        self.alpha = nn.Parameter(0.5 * torch.randn(5, K, dtype=DT))  # shared by the cells
        self.beta = nn.Parameter(0.5 * torch.randn(5, dtype=DT))
        self.Z = None

    def betas(self):  # PC-DARTS: a softmax over the edges entering each node
        return torch.cat([F.softmax(self.beta[:2], 0), F.softmax(self.beta[2:], 0)])

    def forward(self, x):
        w = F.softmax(self.alpha, -1) if self.Z is None else self.Z
        s = self.stem(x)
        h = self.cells[0](s, s, w, self.betas())
        s = self.pre(h)
        return self.head(self.cells[1](s, s, w, self.betas()).mean((2, 3)))


def test_pc_darts_mix_inside_a_declared_cells_edge_list_gets_its_edge_and_nodes_and_the_shared_alpha_costs():
    """Before: the mix on the channel slice (the module docs/probe.md says to map for PC-DARTS, inside the partial-
    channel module at each position of the cell's edge list) had its cell but no edge index or node pair, although
    the docs say edges inside a cell get them: one group 'edges' of 10 rows (2 cells x 5) and cell_type_costs() of no
    α, not the (5, K) sum over the cells sharing α. Now it takes its position's edge index and node pair: the normal
    group's cell_type_costs() is autograd's ∂L/∂Z for the Z both cells share, and each cell is one observation."""
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(3, 2, 4, 4, dtype=DT, generator=g), torch.randint(0, N_CLS, (3,), generator=g)
    net = _PCNet()
    probe = nasdiag.attach(net)
    pairs = [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    assert probe.edge_names == [f"cells.{c}.edges.{e}.mixed" for c in range(2) for e in range(5)]
    assert [(e.cell, e.edge_index, (e.src, e.dst)) for e in probe.edges] == \
        [(f"cells.{c}", e, pairs[e]) for c in range(2) for e in range(5)]
    for _ in range(2):
        with probe.record():
            F.cross_entropy(net(x), y).backward()
    Z = F.softmax(net.alpha, -1).detach().requires_grad_()
    net.Z = Z
    grad = torch.autograd.grad(F.cross_entropy(net(x), y), Z)[0]
    net.Z = None
    assert torch.allclose(probe.cell_type_costs()["normal"], grad, rtol=1e-10, atol=1e-15)
    assert (probe.statistics()["cost/normal/count"] == 4).all() and _no_hooks(net)


class _PCDartsCell(nn.Module):
    """PC-DARTS's model_search.Cell as written: `_ops`, `_steps`, `_multiplier`, `reduction`, no declarations, forward
    (s0, s1, weights, weights2) with node j = Σ_i weights2_ij·op_ij(x_i, weights_ij), the last nodes concatenated."""

    def __init__(self, c, reduction=False):
        super().__init__()
        self.reduction, self._steps, self._multiplier = reduction, 2, 2
        self._ops = nn.ModuleList([_PCEdge(c) for _ in range(5)])

    def forward(self, s0, s1, weights, weights2):
        return _pc_nodes(self._ops, self._steps, s0, s1, weights, weights2)


def test_pc_darts_cell_taking_weights2_is_a_darts_cell_whose_edges_and_output_costs_are_autograds():
    """Before: a DARTS-convention cell was one whose forward takes exactly (s0, s1, weights); PC-DARTS's takes
    weights2 too, so its edges had no cell, index or node pair and it had no output costs at all. Now it is a cell:
    edge indices and DARTS node pairs, cell_type_costs() = autograd's ∂L/∂Z of the shared Z, and output_costs() =
    autograd's derivative in a scalar multiplier on each node's chunk of the cell output (§5-6)."""
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(3, 2, 4, 4, dtype=DT, generator=g), torch.randint(0, N_CLS, (3,), generator=g)
    net = _PCNet()
    net.cells = nn.ModuleList([_PCDartsCell(4), _PCDartsCell(4)])
    probe = nasdiag.attach(net)
    pairs = [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    assert [(e.name, e.cell, e.cell_type, e.edge_index, (e.src, e.dst)) for e in probe.edges] == \
        [(f"cells.{c}._ops.{e}.mixed", f"cells.{c}", "normal", e, pairs[e]) for c in range(2) for e in range(5)]
    with probe.record():
        F.cross_entropy(net(x), y).backward()
    Z = F.softmax(net.alpha, -1).detach().requires_grad_()
    scales = torch.ones(2, 2, dtype=DT, requires_grad=True)  # (cell, output node)

    def scaled(cell, c):
        return lambda m, args, out: torch.cat([out[:, :4] * scales[c, 0], out[:, 4:] * scales[c, 1]], 1)

    handles = [cell.register_forward_hook(scaled(cell, c)) for c, cell in enumerate(net.cells)]
    net.Z = Z
    try:
        gz, gs = torch.autograd.grad(F.cross_entropy(net(x), y), (Z, scales))
    finally:
        net.Z = None
        for h in handles:
            h.remove()
    assert torch.allclose(probe.cell_type_costs()["normal"], gz, rtol=1e-10, atol=1e-15)
    out = probe.output_costs()
    assert torch.allclose(torch.stack([torch.stack([out[f"cells.{c}"][n] for n in (2, 3)]) for c in range(2)]), gs,
                          rtol=1e-10, atol=1e-15)
    assert _no_hooks(net)


def test_exact_curvature_of_a_compiled_wrapper_or_a_module_compiled_in_place_is_autograds():
    """Before: probe.hessian() in the exact mode of attach(torch.compile(net), hessian='exact') or of a net compiled in
    place (net.compile()) re-ran the compiled code under torch.func and stopped in dynamo's 'AssertionError: False !=
    True' traceback (diag and approx were right); the re-run is the eager module's. Reference: the diagonal of
    torch.autograd.functional.hessian of the loss in each edge's Z."""
    x, y = _batch(seed=10)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for in_place in (False, True):
            net = _CompiledNet()
            if in_place:
                net.compile(backend="eager")
                model, names = net, ["a", "b"]
            else:
                model, names = torch.compile(net, backend="eager"), ["_orig_mod.a", "_orig_mod.b"]
            probe = nasdiag.attach(model, hessian="exact")
            with probe.record(targets=y):
                F.cross_entropy(model(x), y).backward()
            H = probe.hessian()
            W = F.softmax(net.alpha, -1).detach()
            for e, name in enumerate(names):
                def loss(z, e=e):
                    return F.cross_entropy(net(x, torch.cat([W[:e], z[None], W[e + 1:]])), y)
                ref = torch.diagonal(torch.autograd.functional.hessian(loss, W[e].clone()))
                assert torch.allclose(H[name], ref, rtol=1e-10, atol=1e-15)
            assert _no_hooks(net)
