"""Cost audit round 16 (cost16): the probe (``nasdiag.attach``) in a user's own training loop, against float64 models
written from scratch here (DARTS-convention mixed ops, leaf mixing weights Z, per-sample leaf weights Z_b, plain
autograd for ∂L/∂Z and ∂L/∂Z_bk; wiring supplement §2.1: C_k = ∂L/∂Z_k = <∂L/∂x_j, O_k(x_i)>). Never nasdiag against
nasdiag.

Defects found (each test fails without its fix):

* A model called with its batch by keyword (``model(x=x)``, a keyword-only input) had no batch size in the probe
  (read off the first *positional* argument only): a forward running an edge on chunks of its batch returned (B/2, K)
  per-sample rows, each the sum of two samples' rows, silently, where the docs promise a ProbeError; and gradient
  accumulation with a path dropped in one micro-batch was refused as such a chunked forward, where the docs (and the
  block's own warning) promise NaN rows for the samples of that micro-batch. The batch is now the model forward's
  first parameter, positional or by its name
  (test_a_model_called_by_keyword_keeps_its_batch_per_sample_rows_as_a_positional_call_does).
* A mixed op called with its input by keyword (``op(x=h, weights=w)``; the weights by keyword were already read) had
  no input x_i in the probe: with ``path_split=True`` the parts through it were never gathered and the first backward
  stopped in a ProbeError blaming the node for scaling its edges (relative deviation 0.5), and a mixed op returning its
  input object so called (every candidate run, a one-hot Z picking Identity's output) was not refused: its costs were
  read off the gradient of x_i with its other consumers' (0.018, 0.075, 0.088, silently)
  (test_mixed_ops_called_by_keyword_split_their_costs_and_refuse_returning_their_input).

Checked and right (test_a_users_loop_accumulation_double_backward_evaluation_wrappers_and_two_probes_cost_as_autograd,
against autograd's ∂L/∂Z of the leaf Z the forwards mixed with): micro-batches accumulated in one block (mean loss / n,
a smaller last one) with a grad-off evaluation forward and a forward without backward in the block; retain_graph and
create_graph backwards; two probes at once and a probe of a user's module holding the supernet as ``.net``; a body
raising KeyboardInterrupt after its backward leaves no hook and no step. By hand (too slow for this box): a
``torch.compile(backend="aot_eager")`` supernet costs as autograd (dynamo traces into the probe's hooks and hits its
recompile limit: warnings, not errors); a model deep-copied inside a block keeps inert hooks and can be attached and
costed itself; 200 steps of accumulation + evaluation + path_split + norm_deviation + hessian keep the tensor count
flat; with micro-batches in one block the candidate outputs of a micro-batch are freed with its graph (not held to the
block's end).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nasdiag
from nasdiag.probe.discovery import ProbeError

DT = torch.float64


class _Mixed(nn.Module):
    """A DARTS-convention mixed op, Σ_k w_k·op_k(x), for (K,) or per-sample (B, K) weights."""

    def __init__(self, width: int):
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(width, width, bias=False), nn.Tanh(), nn.Identity()])

    def forward(self, x, weights):
        if weights.dim() == 1:
            return sum(w * op(x) for w, op in zip(weights, self._ops))
        return sum(weights[:, k:k + 1] * op(x) for k, op in enumerate(self._ops))


class _KeywordNet(nn.Module):
    """Two edges in a chain, called as ``net(inp=x, Z=Z)`` (a keyword-only input); ``chunks`` runs edge a on chunks of
    the batch, ``skip_b`` drops edge b (a path dropped in a micro-batch)."""

    def __init__(self, width: int = 3):
        super().__init__()
        self.a, self.b = _Mixed(width), _Mixed(width)
        self.chunks, self.skip_b = 1, False

    def forward(self, *, inp, Z):
        za = Z[0] if Z[0].dim() == 1 else None
        h = torch.cat([self.a(c, za if za is not None else zc) for c, zc in
                       zip(inp.chunk(self.chunks), Z[0].expand(inp.shape[0], -1).chunk(self.chunks))])
        return h if self.skip_b else self.b(h, Z[1])


def _loss(out):
    return (out ** 2).sum() + out.sum()


def _per_sample_reference(net, x, Z):
    """∂L/∂Z_bk of per-sample leaf weights Z_b = Z for every sample: the (B, K) per-sample cost terms of each edge."""
    leaves = [z.detach().expand(x.shape[0], -1).clone().requires_grad_() for z in Z]
    out = net(inp=x, Z=leaves)
    grads = torch.autograd.grad(_loss(out), leaves)
    return {"a": grads[0], "b": grads[1]}


def test_a_model_called_by_keyword_keeps_its_batch_per_sample_rows_as_a_positional_call_does():
    torch.manual_seed(0)
    net = _KeywordNet().to(DT)
    probe = nasdiag.attach(net)
    x1, x2 = torch.randn(4, 3, dtype=DT), torch.randn(2, 3, dtype=DT)
    Z = torch.softmax(torch.randn(2, 3, dtype=DT), -1)
    ref1, ref2 = _per_sample_reference(net, x1, Z), _per_sample_reference(net, x2, Z)

    # gradient accumulation, edge b dropped in the second micro-batch: rows of the first forward, then NaN rows for b
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.record():
            _loss(net(inp=x1, Z=Z.clone().requires_grad_())).backward()
            net.skip_b = True
            _loss(net(inp=x2, Z=Z.clone().requires_grad_())).backward()
            net.skip_b = False
    assert any("took no part" in str(w.message) for w in caught)
    rows = probe.costs(per_sample=True)  # was a ProbeError "ran ... on chunks of the model's batch"
    assert rows["a"].shape == rows["b"].shape == (6, 3)
    # edge a ran in both micro-batches; its rows without b downstream are those of the chain cut at a
    zb = Z[0].expand(2, -1).clone().requires_grad_()
    ref2_cut = torch.autograd.grad(_loss(net.a(x2, zb)), zb)[0]
    torch.testing.assert_close(rows["a"], torch.cat([ref1["a"], ref2_cut]), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(rows["b"][:4], ref1["b"], rtol=1e-12, atol=1e-14)
    assert torch.isnan(rows["b"][4:]).all()

    # a forward running edge a on halves of its batch: per-sample rows undefined, refused as for a positional call
    net.chunks = 2
    with probe.record():
        _loss(net(inp=x1, Z=Z.clone().requires_grad_())).backward()
    torch.testing.assert_close(probe.costs()["a"], ref1["a"].sum(0), rtol=1e-12, atol=1e-14)  # the sum is still right
    with pytest.raises(ProbeError, match="chunks"):
        probe.costs(per_sample=True)  # were (2, K) rows, row b the sum of samples b and b + 2


class _KeywordCell(nn.Module):
    """A DARTS-convention cell (``_ops``, ``_steps``, ``_multiplier``, forward ``(s0, s1, weights)``) whose mixed ops are
    called by keyword, ``op(x=h, weights=w)``."""

    def __init__(self, width: int = 3):
        super().__init__()
        self._steps, self._multiplier = 2, 2
        self._ops = nn.ModuleList([_Mixed(width) for i in range(2) for _ in range(2 + i)])

    def forward(self, s0, s1, weights):
        states, off = [s0, s1], 0
        for _ in range(self._steps):
            node = sum(self._ops[off + j](x=h, weights=weights[off + j]) for j, h in enumerate(states))
            off += len(states)
            states.append(node)
        return torch.cat(states[-self._multiplier:], 1)


class _KeywordCellNet(nn.Module):
    def __init__(self, width: int = 3):
        super().__init__()
        self.stem = nn.Linear(2, width)
        self.cell = _KeywordCell(width)
        self.head = nn.Linear(2 * width, 4)

    def forward(self, x, Z):
        s = torch.tanh(self.stem(x))
        return self.head(torch.tanh(self.cell(s, s * s, Z)))


def test_mixed_ops_called_by_keyword_split_their_costs_and_refuse_returning_their_input():
    torch.manual_seed(1)
    net = _KeywordCellNet().to(DT)
    x, y = torch.randn(5, 2, dtype=DT), torch.randint(0, 4, (5,))
    Z = torch.softmax(torch.randn(5, 3, dtype=DT), -1).requires_grad_()
    probe = nasdiag.attach(net, path_split=True)
    with probe.record():
        nn.functional.cross_entropy(net(x, Z), y).backward()
    reference = Z.grad.clone()  # autograd's ∂L/∂Z, the leaf the forward mixed with
    costs, parts = probe.costs(), probe.path_costs()
    for e, name in enumerate(probe.edge_names):
        torch.testing.assert_close(costs[name], reference[e], rtol=1e-12, atol=1e-15)
        # every edge ends at a node feeding the output or another edge: its parts sum to ∂L/∂Z (were a ProbeError
        # blaming node 2 for scaling its edges: the split of an edge called by keyword was never gathered)
        assert parts[name]
        torch.testing.assert_close(sum(parts[name].values()), reference[e], rtol=1e-10, atol=1e-14)

    # a mixed op returning its input object, called by keyword: the hook there would read x_i's whole gradient
    class ReturnsInput(_Mixed):
        def forward(self, x, weights):
            outs = [op(x) for op in self._ops]  # every candidate runs; a one-hot Z returns one output, Identity's x
            return outs[int(weights.argmax())] if bool(weights.max() == 1) else sum(w * o for w, o in zip(weights, outs))

    net.cell._ops[0] = ReturnsInput(3).to(DT)
    probe = nasdiag.attach(net)
    onehot = torch.zeros(5, 3, dtype=DT)
    onehot[:, -1] = 1
    with pytest.raises(ProbeError, match="returned its input tensor object"):
        with probe.record():
            nn.functional.cross_entropy(net(x, onehot.requires_grad_()), y).backward()


def _no_hooks(model: nn.Module) -> bool:
    return not any(getattr(m, d) for m in model.modules() for d in
                   ("_forward_hooks", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                    "_backward_pre_hooks"))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph:UserWarning")
def test_a_users_loop_accumulation_double_backward_evaluation_wrappers_and_two_probes_cost_as_autograd():
    """The loop patterns of docs/probe.md ("Several forwards or backwards in one block add up, as .grad does"; grad-off
    forwards left alone; nothing left on the model, also when the body raises), each against autograd's ∂L/∂Z of the
    leaf Z the forwards mixed with."""
    torch.manual_seed(2)
    net = _KeywordCellNet().to(DT)
    batches = [(torch.randn(b, 2, dtype=DT), torch.randint(0, 4, (b,))) for b in (4, 4, 3)]
    ce = nn.functional.cross_entropy

    class Holder(nn.Module):  # a user's module holding the supernet as .net
        def __init__(self, inner):
            super().__init__()
            self.net = inner

        def forward(self, x, Z):
            return self.net(x, Z)

    holder = Holder(net)
    probe, second, wrapped = nasdiag.attach(net), nasdiag.attach(net), nasdiag.attach(holder)
    assert wrapped.edge_names == ["net." + n for n in probe.edge_names]

    def leaf():
        return torch.softmax(torch.randn(5, 3, dtype=DT), -1).requires_grad_()

    def check(p, Z, prefix=""):
        for e, name in enumerate(probe.edge_names):
            torch.testing.assert_close(p.costs()[prefix + name], Z.grad[e], rtol=1e-12, atol=1e-15)

    # gradient accumulation: micro-batches (the last one smaller) in one block, mean loss / n; a grad-off evaluation
    # forward and a forward without backward in the block add nothing; rows are the backwarded forwards' samples
    Z = leaf()
    with probe.record():
        for x, y in batches:
            (ce(net(x, Z), y) / len(batches)).backward()
        with torch.no_grad():
            net(batches[0][0], Z)
        net(batches[1][0], Z)
    check(probe, Z)
    assert all(v.shape == (11, 3) for v in probe.costs(per_sample=True).values())
    # retain_graph: two backwards through one forward add up; create_graph: costs stay out of the graph
    Z = leaf()
    with probe.record():
        loss = ce(net(*batches[0][:1], Z), batches[0][1])
        loss.backward(retain_graph=True)
        (3 * loss).backward(create_graph=True)
    check(probe, Z)
    assert not any(v.requires_grad for v in probe.costs().values())
    net.zero_grad(set_to_none=True)  # (the create_graph .grad holds a graph)
    # two probes at once, and a probe of the module holding the supernet
    Z = leaf()
    with probe.record(), second.record(), wrapped.record():
        ce(holder(batches[2][0], Z), batches[2][1]).backward()
    check(probe, Z)
    check(second, Z)
    check(wrapped, Z, "net.")
    # the body raises inside the backward's block: nothing left on any module, the next step exact
    with pytest.raises(KeyboardInterrupt):
        with probe.record(), second.record():
            ce(net(batches[0][0], leaf()), batches[0][1]).backward()
            raise KeyboardInterrupt
    assert _no_hooks(holder)
    with pytest.raises(ProbeError, match="no completed recorded step"):
        probe.costs()
    Z = leaf()
    with probe.record():
        ce(net(batches[1][0], Z), batches[1][1]).backward()
    check(probe, Z)
    assert _no_hooks(holder)
