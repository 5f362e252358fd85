"""The BayesNAS mixing-weight curvature (bayesnas-appendix C.3.1-C.3.2) on the batched-ops engine.

``nasdiag.hessian.arch_diag_hessian(mode="diag" | "approx")`` runs the diagonal recursion on the per-op
modules: its rules hook every module, so the forward runs on the eager modules and each rule is a handful of
kernels per module and edge. On a supernet the fast engine batches (:mod:`nasdiag.supernet.engine.fast`),
:func:`mixing_curvature` computes the same numbers on the engine's batched tensors instead:

* one forward of the batched cells keeps the tensors the rules read (a *tape*), one backward gives the
  gradients the BatchNorm residual terms need (at the BatchNorm outputs only);
* the recursion then walks the cells backwards with the very rules of :mod:`nasdiag.hessian.rules`, each
  applied once per batched call: a stage's depthwise convolutions are one ``Conv2d`` call with
  ``groups = edges·C``, its 1×1 convolutions one call with ``groups = edges``, its BatchNorms one call over the
  stacked channels (per channel, hence exactly the per-edge rule), pooling once per source;
* where edges share a tensor (a source node read by d edges, a ReLU of it, a pooled input) the rules are
  linear in the diagonal they receive, so the d diagonals are summed first and the rule runs once;
* the curvature of the mixing weights is C.3.1 (``diag``) or C.3.2 (``approx``) on the stacked op outputs.

What each mode drops is documented in :mod:`nasdiag.hessian.arch`; this is the same recursion in fewer
kernels (equal to the eager one up to float rounding: tests/test_engine_curvature.py, float64). Running
statistics are left as they were (the forward updates them; they are restored from a copy).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from nasdiag.supernet.engine.fast import (
    UNIT_AFFINE_ON_CUDA,
    CellPlan,
    Unsupported,
    _classify,
    _column,
    _Column,
    _factorized,
    _plans,
    _Run,
    _Stage,
    cell_forward,
    why_not_fast,
)

__all__ = ["MODES", "mixing_curvature"]

#: the recursions this module computes on the batched ops (the other modes of ``ARCH_MODES`` run elsewhere)
MODES = ("diag", "approx")


def mixing_curvature(net: nn.Module, x: torch.Tensor, y, per_cell: Sequence[torch.Tensor], mode: str,
                     loss_fn: Callable = F.cross_entropy) -> Optional[List[torch.Tensor]]:
    """Diagonal of ``∂²L/∂Z²`` per cell by C.3.1 (``diag``) or C.3.2 (``approx``), on the batched ops.

    Args:
        net: a :class:`~nasdiag.supernet.Network` in training mode.
        x, y: one batch; ``L = loss_fn(net(x, per_cell), y)`` (a per-sample loss reduced by its mean or sum,
            as :func:`nasdiag.hessian.arch_diag_hessian` requires).
        per_cell: one (E, K) mixing-weight tensor per cell (held fixed: no gradient flows to them).
        mode: ``"diag"`` or ``"approx"``.

    Returns:
        One (E, K) tensor per cell, ``H[e, k] = Σ B_k² ∘ h_j`` (diag) or ``Σ_c (Σ_{n,p} B_k²)_c E_{n,p}(h_j)_c``
        (approx) for edge e, exactly what ``arch_diag_hessian(..., mode)`` returns for that edge (the zero op
        gets 0); or None where the fast engine does not apply to this call (then use ``arch_diag_hessian``).

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if why_not_fast(net, x, per_cell) is not None:
        return None
    try:
        rules = _Rules(net, mode)
    except Unsupported:
        return None
    plans = _plans(net)
    statistics = net.__dict__["_fast_plans"][3]
    with _RestoredBuffers(net, statistics), torch.enable_grad():
        unit_affine = UNIT_AFFINE_ON_CUDA and x.is_cuda  # as the fast forward: cuDNN's BatchNorm kernels on CUDA
        tape = _Tape(rules, unit_affine)
        run = _Run(statistics.ensure_linked(), unit_affine, None, tape)
        s0 = s1 = net.stem(x)
        for cell, plan, w in zip(net.cells, plans, per_cell):
            s0, s1 = s1, cell_forward(cell, plan, s0, s1, w.detach(), run)
        pooled = net.global_pooling(s1)
        flat = pooled.flatten(1)
        logits = net.classifier(flat)
        loss = rules.scalar_loss(loss_fn, logits, y)
        h = rules.loss_diagonal(loss_fn, logits, y)
        tape.gradients(loss)
        h = rules.apply(net.classifier, flat, logits, h).reshape(pooled.shape)
        h = rules.apply(net.global_pooling, s1, pooled, h)
        return _cells_backward(net, plans, tape, rules, h)


def _cells_backward(net, plans: List[CellPlan], tape: "_Tape", rules: "_Rules", h_last: torch.Tensor) -> List[torch.Tensor]:
    """The recursion from the last cell's output diagonal back through every cell: one (E, K) result per cell."""
    L = len(plans)
    h_cells: List[Optional[torch.Tensor]] = [None] * L
    h_cells[-1] = h_last
    result: List[torch.Tensor] = [None] * L
    for c in range(L - 1, -1, -1):
        cell, plan = net.cells[c], plans[c]
        h_out = h_cells[c]
        E, K = len(cell.edges), plan.num_ops
        if h_out is None:  # no later cell reads this one: its mixing weights do not reach the loss
            result[c] = h_last.new_zeros(E, K)
            continue
        h_nodes: Dict[int, torch.Tensor] = {}
        for node, (lo, hi) in cell.output_node_slices.items():
            h_nodes[node] = h_out[:, lo:hi]
        H = h_out.new_zeros(E * K)
        for stage in reversed(plan.stages):
            H_stage, h_sources = _stage_backward(stage, tape, rules, h_nodes)
            H.index_copy_(0, stage.z_index_on(H.device), H_stage.reshape(-1))
            for s, h_s in zip(stage.sources, h_sources):
                h_nodes[s] = h_s if s not in h_nodes else h_nodes[s] + h_s
        result[c] = H.view(E, K)
        # the cell's inputs: s1 is the previous cell's output, s0 the one before it (both the stem's for cell 0)
        for node, producer in ((1, c - 1), (0, c - 2)):
            if producer >= 0 and node in h_nodes:
                h_in = tape.preprocess_backward(cell.preprocess0 if node == 0 else cell.preprocess1, h_nodes[node])
                h_cells[producer] = h_in if h_cells[producer] is None else h_cells[producer] + h_in
    return result


def _stage_backward(stage: _Stage, tape: "_Tape", rules: "_Rules", h_nodes: Dict[int, torch.Tensor]):
    """``(H (m, d, K'), [h of each source])`` for one stage, from the diagonals of its destination nodes."""
    X, r, stacked, z, out = (tape.get(stage, name) for name in ("X", "r", "stacked", "z", "out"))
    B, m, d, C, Hp, Wp = out.shape
    n = m * d
    zeros = None
    dests = []
    for dest in stage.dests:
        h_dest = h_nodes.get(dest)
        if h_dest is None:  # a node that reaches no loss term
            zeros = torch.zeros_like(out[:, 0, 0]) if zeros is None else zeros
            h_dest = zeros
        dests.append(h_dest)
    h_dest = torch.stack(dests, dim=1).view(B, m, d, C, Hp, Wp)
    g_dest = tape.grad(out)
    H = rules.mixing(stacked, h_dest)  # (m, d, K')

    h_X = None  # (B, m, C, H, W): identity and pooling columns
    h_r = None  # (B, m·C, H, W): the columns that start with ReLU(X)
    for ci, col in enumerate(stage.columns):
        zk = z[:, 0, ci].view(1, m, d, 1, 1, 1)
        h_op, g_op = zk.square() * h_dest, zk * g_dest  # the mixing product's rule: Z_k² h_j, and ∂L/∂O_k
        if col.kind == "identity":
            contribution = h_op.sum(2)
            h_X = contribution if h_X is None else h_X + contribution
        elif col.kind == "pool":
            contribution = rules.pool_column(col, tape, X, h_op, g_op).view(B, m, C, *X.shape[-2:])
            h_X = contribution if h_X is None else h_X + contribution
        else:
            h_op, g_op = h_op.reshape(B, n * C, Hp, Wp), g_op.reshape(B, n * C, Hp, Wp)
            if col.kind == "chain":
                h_rr = rules.chain_column(col, tape, n, h_op, g_op)  # (B, n·C, H, W) at ReLU(X) per edge
                contribution = _sum_over_edges(h_rr, m, d)
            else:
                contribution = rules.factorized_column(col, tape, m, r, h_op, g_op)
            h_r = contribution if h_r is None else h_r + contribution
    h_total = torch.zeros_like(X) if h_X is None else h_X.reshape(X.shape)
    if h_r is not None:
        h_total = h_total + rules.relu(X, r, h_r)
    return H, h_total.view(B, m, C, *X.shape[-2:]).unbind(1)


def _sum_over_edges(h: torch.Tensor, m: int, d: int) -> torch.Tensor:
    """(B, m·d·C, H, W) -> (B, m·C, H, W): the sum over the d edges of each source. A diagonal the feature-mean
    rules broadcast (constant over batch and space, stride 0) is summed on one entry per channel."""
    B, nC, H, W = h.shape
    C = nC // (m * d)
    if all(h.stride(i) == 0 or h.shape[i] == 1 for i in (0, 2, 3)):
        return h[:1, :, :1, :1].reshape(1, m, d, C, 1, 1).sum(2).view(1, m * C, 1, 1).expand(B, m * C, H, W)
    return h.view(B, m, d, C, H, W).sum(2).view(B, m * C, H, W)


_RELU = nn.ReLU()


class _Rules:
    """The rules of :mod:`nasdiag.hessian.rules`, applied to the engine's batched calls in one mode."""

    def __init__(self, net: nn.Module, mode: str):
        from nasdiag.hessian._hvp import scalar_loss
        from nasdiag.hessian.loss_curvature import output_hessian_diagonal
        from nasdiag.hessian.rules import ModuleCall, rule_for

        self.mode, self.ModuleCall, self._rule_for = mode, ModuleCall, rule_for
        self.loss_diagonal, self.scalar_loss = output_hessian_diagonal, scalar_loss
        self._meta: Dict[tuple, nn.Module] = {}
        for module in (net.classifier, net.global_pooling):
            self.rule(module)
        for cell in net.cells:
            for pre in (cell.preprocess0, cell.preprocess1):
                for leaf in _preprocess_leaves(pre):
                    self.rule(leaf)

    def rule(self, module: nn.Module):
        rule = self._rule_for(module)
        if rule is None:
            raise Unsupported(f"no diagonal-Hessian rule for {type(module).__name__}")
        return rule

    def apply(self, module: nn.Module, x: torch.Tensor, out: torch.Tensor, h: torch.Tensor, *, params=None,
              grad_output=None, name: str = "") -> torch.Tensor:
        """The diagonal w.r.t. ``x`` of one call ``out = module(x)`` from the diagonal ``h`` w.r.t. ``out``."""
        rule = self.rule(module)
        call = self.ModuleCall(name or type(module).__name__, module, x, out, params, grad_output)
        return rule.input_approx(call, h) if self.mode == "approx" else rule.input_diag(call, h)

    def relu(self, x: torch.Tensor, out: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The ReLU rule for ``out = relu(x)`` computed functionally (the engine's own ReLUs, no module)."""
        return self.apply(_RELU, x, out, h)

    def conv(self, like: nn.Conv2d, in_channels: int, weight: torch.Tensor, groups: int) -> nn.Module:
        """A Conv2d with ``like``'s geometry over stacked channels (on the meta device: the rule reads its
        geometry, the weight is passed with the call)."""
        key = (like.kernel_size, like.stride, like.padding, like.dilation, in_channels, weight.shape[0], groups)
        conv = self._meta.get(key)
        if conv is None:
            conv = self._meta[key] = nn.Conv2d(in_channels, weight.shape[0], like.kernel_size, like.stride, like.padding,
                                               like.dilation, groups, bias=False, device="meta")
        return conv

    def mixing(self, stacked: torch.Tensor, h_dest: torch.Tensor) -> torch.Tensor:
        """C.3.1 / C.3.2 for every (edge, op) of a stage: stacked (B, m, d, K', C, H, W), h_dest (B, m, d, C, H, W)."""
        if self.mode == "diag":
            return (stacked.square() * h_dest.unsqueeze(3)).sum((0, 4, 5, 6))
        b2 = stacked.square().sum((0, 5, 6))  # (m, d, K', C)
        return (b2 * h_dest.mean((0, 4, 5)).unsqueeze(2)).sum(-1)

    def batch_norm(self, norm, x, out, h, g) -> torch.Tensor:
        bns = norm.modules
        params = {}
        if bns[0].affine:
            params = {"weight": torch.cat([b.weight for b in bns]), "bias": torch.cat([b.bias for b in bns])}
        return self.apply(bns[0], x, out, h, params=params, grad_output=g)

    def chain_column(self, col: _Column, tape: "_Tape", n: int, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """ReLU → depthwise → 1×1 → BN blocks of n edges, backwards from the diagonal at their output to ReLU(X)."""
        relu_out, dw_out, bn_in, bn_out = (tape.get(col, k, all=True) for k in ("relu_out", "dw_out", "bn_in", "bn_out"))
        for depth in range(len(col.blocks) - 1, -1, -1):
            blocks = col.blocks[depth]
            if depth < len(col.blocks) - 1:
                g = tape.grad(bn_out[depth])
            h = self.batch_norm(col.norms[depth], bn_in[depth], bn_out[depth], h, g)
            w_pw = torch.cat([b[2].weight for b in blocks])  # (n·C_out, C, 1, 1): one 1×1 conv per edge = groups n
            pw = self.conv(blocks[0][2], dw_out[depth].shape[1], w_pw, n)
            h = self.apply(pw, dw_out[depth], bn_in[depth], h, params={"weight": w_pw})
            w_dw = torch.cat([b[1].weight for b in blocks])  # (n·C, 1, k, k)
            dw = self.conv(blocks[0][1], w_dw.shape[0], w_dw, w_dw.shape[0])
            h = self.apply(dw, relu_out[depth], dw_out[depth], h, params={"weight": w_dw})
            if depth > 0:
                h = self.relu(bn_out[depth - 1], relu_out[depth], h)
        return h

    def pool_column(self, col: _Column, tape: "_Tape", X: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Pooling → affine-free BN shared by the d edges of each source; h, g (B, m, d, C, H', W') per edge."""
        pooled, normed = tape.get(col, "bn_in"), tape.get(col, "bn_out")
        B, m, d = h.shape[:3]
        h_pooled = None
        for j in range(d):  # per edge: its own diagonal and gradient through the shared statistics
            h_j = self.batch_norm(col.norms[0], pooled, normed, h[:, :, j].reshape(pooled.shape),
                                  g[:, :, j].reshape(pooled.shape))
            h_pooled = h_j if h_pooled is None else h_pooled + h_j
        return self.apply(col.modules[0][0], X, pooled, h_pooled)

    def factorized_column(self, col: _Column, tape: "_Tape", m: int, r: torch.Tensor, h: torch.Tensor,
                          g: torch.Tensor) -> torch.Tensor:
        """``FactorizedReduce`` of n edges (d per source), backwards to r = ReLU(X) (B, m·C, H, W)."""
        shifted, o1, o2, y, normed = (tape.get(col, k) for k in ("shifted", "o1", "o2", "bn_in", "bn_out"))
        h = self.batch_norm(col.norms[0], y, normed, h, g)
        B, _, Hp, Wp = y.shape
        n, half = o1.shape[1] // col.modules[0].conv_1.out_channels, col.modules[0].conv_1.out_channels
        halves = h.reshape(B, n, 2, half, Hp, Wp).unbind(2)
        h_r = None
        for which, (inp, o, h_o) in enumerate(((r, o1, halves[0]), (shifted, o2, halves[1]))):
            w = torch.cat([getattr(op, f"conv_{which + 1}").weight for op in col.modules])
            conv = self.conv(getattr(col.modules[0], f"conv_{which + 1}"), inp.shape[1], w, m)
            h_in = self.apply(conv, inp, o, h_o.reshape(o.shape), params={"weight": w})
            if which == 1:  # shifted = r[:, :, 1:, 1:], padded back to even size: its backward crops and places
                h_full = torch.zeros_like(r)
                h_full[:, :, 1:, 1:] = h_in[:, :, : r.shape[-2] - 1, : r.shape[-1] - 1]
                h_in = h_full
            h_r = h_in if h_r is None else h_r + h_in
        return h_r


def _preprocess_leaves(module: nn.Module) -> List[nn.Module]:
    """The modules whose rules the tape applies for a cell's preprocessing: a ``FactorizedReduce`` runs as the
    engine's factorized column (its convolutions and BatchNorm), a Sequential as its children in order."""
    from nasdiag.supernet.ops import FactorizedReduce

    if type(module) is FactorizedReduce:
        if _classify(module, 2)[0] != "factorized":
            raise Unsupported("a FactorizedReduce preprocessing the engine does not batch")
        return []
    if type(module) is nn.Sequential and all(len(list(c.children())) == 0 for c in module) \
            and not any("forward" in vars(m) for m in module.modules()):  # (a subclass's forward: not its leaves')
        return list(module)
    raise Unsupported(f"a cell preprocessing of type {type(module).__name__} (not a Sequential of layers)")


class _Tape:
    """The tensors one forward keeps for the recursion, and the gradients the BatchNorm residuals read."""

    def __init__(self, rules: _Rules, unit_affine: bool):
        self.rules = rules
        self.unit_affine = unit_affine
        self.kept: Dict[int, Dict[str, List[torch.Tensor]]] = {}
        self.owners: List[object] = []  # keeps the owners alive while their ids key ``kept``
        self.preprocessed: Dict[int, tuple] = {}
        self.want: List[torch.Tensor] = []
        self.grads: Dict[int, torch.Tensor] = {}

    # -- forward ------------------------------------------------------------------------------------
    def keep(self, owner, name: str, t: torch.Tensor) -> None:
        entry = self.kept.get(id(owner))
        if entry is None:
            entry = self.kept[id(owner)] = {}
            self.owners.append(owner)
        kept = entry.setdefault(name, [])
        kept.append(t)
        # gradients: at a stage's mixed outputs (every op's last BatchNorm reads Z_k times it) and at the inner
        # BatchNorms of a chain (sep_conv's first block)
        if name == "out" or (name == "bn_out" and getattr(owner, "kind", None) == "chain" and len(kept) < len(owner.blocks)):
            self.want.append(t)

    def get(self, owner, name: str, all: bool = False):
        kept = self.kept[id(owner)][name]
        return kept if all else kept[-1]

    def preprocess(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not _preprocess_leaves(module):  # FactorizedReduce: the factorized column of one edge
            col = self.preprocessed.get(id(module))
            col = col[0] if col is not None else _column(0, "factorized", [module], _classify(module, 2)[1], 1)
            C = module.norm.num_features
            unit = (x.new_ones(C), x.new_zeros(C)) if self.unit_affine else None
            r = F.relu(x)
            y = _factorized(r, col, 1, 1, _Run(False, self.unit_affine, None, self), unit)
            self.preprocessed[id(module)] = (col, x, r)
            self.want.append(y)
            return y
        calls = []
        for leaf in module:
            out = leaf(x)
            calls.append((leaf, x, out))
            if self.rules.rule(leaf).needs_grad_output(leaf):
                self.want.append(out)
            x = out
        self.preprocessed[id(module)] = (None, calls)
        return x

    def gradients(self, loss: torch.Tensor) -> None:
        """∂loss/∂t for every kept tensor a rule reads the gradient of (graph retained: rules read saved statistics)."""
        grads = torch.autograd.grad(loss, self.want, retain_graph=True, allow_unused=True)
        self.grads = {id(t): (torch.zeros_like(t) if g is None else g) for t, g in zip(self.want, grads)}

    def grad(self, t: torch.Tensor) -> torch.Tensor:
        return self.grads[id(t)]

    # -- backward through a preprocessing -------------------------------------------------------------
    def preprocess_backward(self, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        entry = self.preprocessed[id(module)]
        if entry[0] is not None:
            col, x, r = entry
            y = self.get(col, "bn_out")
            h_r = self.rules.factorized_column(col, self, 1, r, h, self.grad(y))
            return self.rules.relu(x, r, h_r)
        for leaf, x, out in reversed(entry[1]):
            needs = self.rules.rule(leaf).needs_grad_output(leaf)
            h = self.rules.apply(leaf, x, out, h, grad_output=self.grad(out) if needs else None)
        return h


class _RestoredBuffers:
    """Copies the network's buffers (running statistics, step counters) on entry and writes them back on exit,
    so the curvature's forward leaves them as they were. Statistics linked into the engine's flat buffer are
    copied as that one buffer."""

    def __init__(self, net: nn.Module, statistics):
        self.net, self.statistics = net, statistics

    def __enter__(self):
        stats = self.statistics
        shared = set()
        targets: List[torch.Tensor] = []
        if stats.ensure_linked() and stats.flat is not None:
            targets += [stats.flat, stats.counts]
            shared = {stats.flat.untyped_storage().data_ptr(), stats.counts.untyped_storage().data_ptr()}
        targets += [b for b in self.net.buffers() if b.untyped_storage().data_ptr() not in shared]
        self.targets = targets
        with torch.no_grad():
            self.saved = [t.clone() for t in targets]
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            torch._foreach_copy_(self.targets, self.saved)
        self.targets = self.saved = None
