"""Curvature of the architecture (mixing) weights of every edge: bayesnas-appendix C.3.

An edge's mixed op computes ``x_j = Σ_k Z_k B_k`` with ``B_k = O_k(x_i)`` the k-th candidate's output.
``x_j`` is linear in ``Z_k``, so ``∂²L/∂Z_k² = B_kᵀ H_j B_k`` exactly, with ``H_j`` the full Hessian of the
loss w.r.t. the edge output. The BayesNAS recursion keeps only the diagonal of ``H_j`` (C.3.1 as
``H = E(Σ B_i² H_j)``; the ``E`` is the batch average that our mean-reduced loss already carries):

* ``diag``:   ``H_Z,k = Σ_{n,c,p} B_k² ∘ h_j`` with ``h_j`` from the diagonal recursion (C.1.4-C.2.3);
* ``approx``: ``H_Z,k = Σ_c (Σ_{n,p} B_k²)_c · E_{n,p}(h_j)_c``, C.3.2 with ``h_j`` from the feature-mean
  recursion (C.2.4-C.2.5). The text copy prints ``(E(|B_i|)² H_j)``; under the independence of B and
  H that C.3.2 invokes, ``E(B² H) = E(B²) E(H)`` needs the mean of the *square* (``E(|B|)²`` would drop
  the variance of B), which is what we compute.

What each mode drops (docs/hessian.md has measured errors against ``exact``):

* both: off-diagonal entries of ``H_j`` (between positions, channels and samples coupled by later
  layers, BatchNorm and the loss), and cross terms between the branches of every fan-out on the way
  from the loss to the edge;
* ``approx`` also: the variation of ``h_j`` over batch and space within a channel;
* ``wrt="alpha"``: the chain rule through ``Z = softmax(α)`` uses only the diagonal of the edge's
  ``∂²L/∂Z²`` (``Σ_k J_ki² H_Z,k + Σ_k g_k ∂²Z_k/∂α_i²``), dropping its off-diagonal ``k ≠ k'`` terms;
* shared α: results are per edge (per cell). When several cells share one α (DARTS shares one per
  cell type) the caller sums their edges; the cross-cell terms ``∂²L/∂α^{(c)}∂α^{(c')}`` are dropped
  (also by ``exact``, which is exact per edge).
"""

from __future__ import annotations

import numbers
import warnings
from typing import Callable, Dict, List, Mapping, Optional

import torch
from torch import nn

from nasdiag.hessian._hvp import call_model, check_max_memory, check_model, preserved_buffers, scalar_loss
from nasdiag.edges import resolve_edges, weights_parameter
from nasdiag.hessian.arch_exact import (_check_softmax_weights, _frozen_parameters_traced, exact_arch_diag_hessian,
                                        refuse_loss_beyond_outputs, softmax_chain_diag)
from nasdiag.hessian.arch_ggn import ggn_arch_diag
from nasdiag.hessian.arch_hutchinson import hutchinson_arch_diag
from nasdiag.hessian.loss_curvature import output_hessian_diagonal
from nasdiag.hessian.modes import ARCH_MODES, CurvatureError, CurvatureTypeError, check_mode, check_seed, split_mode, no_weights_refusal
from nasdiag.hessian.propagate import walk_diagonals
from nasdiag.hessian.rules import HessianRule
from nasdiag.hessian.rules.base import check_rules
from nasdiag.hessian.trace import ModuleTracer, edge_of
from nasdiag.hessian.weights import _refuse_empty_batch
from nasdiag.hooks import Hooks

__all__ = ["arch_diag_hessian", "ARCH_MODES"]


def arch_diag_hessian(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, object], torch.Tensor],
    inputs,
    targets,
    edges: Mapping[str, object],
    mode: str = "approx",
    wrt: str = "Z",
    *,
    rules: Optional[Mapping[type, HessianRule]] = None,
    samples: Optional[int] = None,
    seed: Optional[int] = None,
    max_memory: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """Diagonal of ``∂²L/∂Z²`` (or ``∂²L/∂α²``) for each edge's mixing weights (C.3.1-C.3.2).

    Args:
        model: the supernet; ``model(inputs)`` (``model(*inputs)`` for a tuple) returns one tensor.
        loss_fn: ``loss_fn(outputs, targets) -> scalar``; the Hessian is of exactly that scalar (mean
            reduction: of the batch mean). ``diag``/``approx`` need a per-sample loss (checked).
        inputs, targets: one mini-batch.
        edges: ``{edge name: (mixed_op_module, [candidate op modules])}`` (or values with ``.module`` and
            ``.ops`` such as ``Network.edge_specs()`` items). The mixed op's forward is
            ``(x, weights) -> Σ_k weights[k] * ops[k](x)``, weights (K,) or (B, K) as the second positional
            argument or ``weights=``.
        mode: one of :data:`~nasdiag.hessian.modes.ARCH_MODES` (docs/hessian.md tabulates accuracy and cost):

            * ``"exact"``: Hessian-vector products (:func:`~nasdiag.hessian.exact_arch_diag_hessian`), exact
              for what is asked: per edge Z, or α owned by the edge. When edges share one α (DARTS's one α
              per cell type) the per-edge α question has no exact answer; this raises and names
              :func:`~nasdiag.hessian.alpha_diag_hessian` (the exact shared diagonal) and ``"exact_per_edge"``;
            * ``"exact_per_edge"``: the same per-edge computation without that check (for shared α, summing it
              over cells drops the cross-cell terms: net-dependent, 24-80% off on the 3-cell nets of docs/hessian.md);
            * ``"ggn"``: the generalized Gauss-Newton diagonal, D batched backwards (D = outputs per sample);
            * ``"ggn_mc"``: its Monte-Carlo estimate from ``samples`` extra backwards (the cheap mode that
              tracks ``exact`` and tells the ops of an edge apart); see :mod:`nasdiag.hessian.arch_ggn`;
            * ``"hutchinson:<k>"``, e.g. ``"hutchinson:4"``: Hutchinson's unbiased estimate of the exact
              diagonal from k Rademacher probes per edge (k·E Hessian-vector products, ``seed``), with the
              ``ggn`` matrix as control variate (:mod:`nasdiag.hessian.arch_hutchinson`); with ``wrt="alpha"``
              the probes are in α, so it is unbiased for the α diagonal (within-edge terms kept); k has no default
              (it sets cost and noise; from k = K on, ``exact`` is cheaper);
            * ``"diag"``: C.3.1 on the diagonal recursion; ``"approx"``: C.3.2 on the feature-mean recursion.
        wrt: ``"Z"`` for the mixing weights; ``"alpha"`` chains through ``Z = softmax(α)`` per edge
            (needs (K,) probability-vector weights).
        rules: per-call ``{module type: HessianRule}`` overrides (``diag``/``approx``).
        samples, seed: Monte-Carlo draws and their seed (``ggn_mc``; default 1 and 0); ``seed`` also seeds the
            probes of ``hutchinson:<k>``. Given to a mode that draws nothing, they are refused (they would do nothing).
        max_memory: bytes the exact and Hutchinson modes may use for one batch of products; a net whose single product
            needs more is refused with its estimated size (default: half the memory free on the device at the call).
            The other modes hold one forward and a few backwards and refuse it.

    Returns:
        ``{edge name: tensor (K,)}`` in the model's dtype, in the order of ``edges``. With (B, K)
        per-sample weights the entry is the curvature of a (K,) shift shared by the batch,
        ``Σ_{n} Σ B_{k,n}² h_{j,n}``. A mixed op that runs several times (tied weights) gets the sum over
        its calls. A NaN or inf loss gives NaN entries in every mode (docs/hessian.md).

    Raises:
        CurvatureError (a ``ValueError``; ``CurvatureTypeError`` for a wrong type): unknown mode/wrt, bad ``edges``, an edge that never ran or skipped a candidate op,
            ``wrt="alpha"`` on weights that are not a softmax; in ``diag``/``approx``, a mixed op whose output is not
            ``Σ_k weights[k]·ops[k](x)`` of the ops as listed (listed in another order than it pairs them with its
            weights, or a sum it changes), whose numbers would pair each weight with another op's output; in
            ``diag``/``approx``/``ggn``/``ggn_mc``, a loss reading features stored downstream of an edge besides the
            outputs (an auxiliary loss), and with ``wrt="alpha"`` in every mode, a loss reading α itself (a penalty):
            their curvature would be left out.
        UnsupportedModuleError: a module or op on the path has no rule (names it, lists the supported
            modules, says how to register one).

    Side effects: none (hooks removed on every path, BatchNorm running statistics unchanged).
    """
    check_mode(mode, ARCH_MODES)
    if wrt not in ("Z", "alpha"):
        raise CurvatureError(f"wrt must be 'Z' (the mixing weights) or 'alpha' (through Z = softmax(α)), got {wrt!r}")
    rules = check_rules(rules)
    if rules is not None and mode not in ("diag", "approx"):
        raise CurvatureError(f"rules= only applies to mode='diag' or 'approx'; mode={mode!r} uses no per-module rules")
    check_model(model, loss_fn, "arch_diag_hessian")
    _refuse_empty_batch(inputs)  # a NaN mean loss of zeros (exact) or torch's amax error (diag/approx)
    check_max_memory(max_memory, "arch_diag_hessian")
    if samples is not None and (not isinstance(samples, numbers.Integral) or isinstance(samples, bool) or samples < 1):
        raise CurvatureError(f"samples must be an int >= 1 (Monte-Carlo draws of ggn_mc), got {samples!r}")
    if seed is not None:
        check_seed(seed, "the probes of ggn_mc and hutchinson:<k>")
    _refuse_idle_options(mode, samples=samples, seed=seed, max_memory=max_memory)
    samples = 1 if samples is None else samples
    seed = 0 if seed is None else seed
    if mode in ("exact", "exact_per_edge"):
        return exact_arch_diag_hessian(
            model, loss_fn, inputs, targets, edges, wrt=wrt, shared_alpha="refuse" if mode == "exact" else "per_edge",
            max_memory=max_memory,
        )
    specs = resolve_edges(model, edges)
    name, probes = split_mode(mode)
    if name == "hutchinson":
        hess, _, grad, observed = hutchinson_arch_diag(
            model, loss_fn, inputs, targets, specs, probes, control="ggn",
            generator=torch.Generator().manual_seed(int(seed)), max_memory=max_memory, wrt=wrt,
            through_softmax=wrt == "alpha",  # probed in α: unbiased for ∂²L/∂α², within-edge k ≠ k' terms included
        )
        if wrt == "alpha":  # + Σ_k g_k ∂²Z_k/∂α² (the chain with a zero Z-Hessian)
            hess = {n: h + softmax_chain_diag(observed[n][0].to(h.dtype), grad[n].to(h.dtype), torch.diag(torch.zeros_like(h)))
                    for n, h in hess.items()}
        return hess
    if mode in ("ggn", "ggn_mc"):
        with _frozen_parameters_traced(model, wrt == "alpha"):  # a frozen α's softmax is checked too
            hess, grad, observed = ggn_arch_diag(
                model, loss_fn, inputs, targets, [s.name for s in specs], [s.module for s in specs],
                [s.n_ops for s in specs], monte_carlo=mode == "ggn_mc", samples=int(samples),
                generator=torch.Generator().manual_seed(int(seed)),
                check_weights=_check_softmax_weights if wrt == "alpha" else None,
            )
        if wrt == "alpha":
            hess = {n: softmax_chain_diag(observed[n][0].to(h.dtype), grad[n], torch.diag(h)) for n, h in hess.items()}
        return hess

    names, modules, ops = [s.name for s in specs], [s.module for s in specs], [list(s.ops) for s in specs]
    recorder = _EdgeRecorder(names, modules, ops)
    tracer = ModuleTracer(model, rules)
    with preserved_buffers(model), torch.enable_grad(), _frozen_parameters_traced(model, wrt == "alpha"):
        with tracer, recorder:
            outputs = call_model(model, inputs)
        if not isinstance(outputs, torch.Tensor):
            raise CurvatureTypeError(
                f"model must return one tensor for mode={mode!r}, got {type(outputs).__name__}; return the logits alone "
                "(or wrap the model), or use mode='exact', which takes any outputs loss_fn accepts"
            )
        recorder.check_complete()
        loss = scalar_loss(loss_fn, outputs, targets)
        if wrt == "alpha":  # while the graph from α to the weights is alive
            _check_softmax_weights(recorder.weights, recorder.with_graph)
        # C.3.1-C.3.2 start from the loss curvature at the outputs: a term on stored features, or on α, is refused
        refuse_loss_beyond_outputs(loss, outputs, f"mode={mode!r}", reached={id(e[0]): key.rsplit("#", 1)[0] for e, key in recorder.observe.items()},
                                   weights=recorder.with_graph if wrt == "alpha" else None)
        h_out = output_hessian_diagonal(loss_fn, outputs, targets)
        _, h_nodes, g_nodes = walk_diagonals(tracer, loss, outputs, h_out, mode, observe=recorder.observe)

    result: Dict[str, torch.Tensor] = {}
    unused = []
    for name in names:
        hess = grad = None
        for key, op_outputs in recorder.calls[name]:
            h_j = h_nodes.get(key)
            if h_j is None:  # the edge output does not reach the loss
                continue
            g_j = g_nodes[key]
            B = torch.stack([b.expand_as(h_j) if b.shape != h_j.shape else b for b in op_outputs])  # (K, *out)
            H = _curvature(B, h_j, mode)
            G = (B * g_j).flatten(1).sum(1)
            hess, grad = (H, G) if hess is None else (hess + H, grad + G)
        if hess is None:
            unused.append(name)
            K = len(ops[names.index(name)])
            hess = torch.zeros(K, dtype=outputs.dtype, device=outputs.device)
            grad = torch.zeros_like(hess)
        if wrt == "alpha":
            z = recorder.weights[name][0].to(hess.dtype)
            hess = softmax_chain_diag(z, grad, torch.diag(hess))
        result[name] = hess.detach().to(recorder.weights[name][0].dtype)  # not autocast's bfloat16 of float32 weights
    if unused:  # as the exact and GGN routes say it
        warnings.warn(f"the loss does not depend on edge(s) {unused}: their curvature is reported as zeros", RuntimeWarning, stacklevel=3)
    return result


def _curvature(B: torch.Tensor, h_j: torch.Tensor, mode: str) -> torch.Tensor:
    """``Σ B_k² h_j`` (C.3.1) or its feature-mean factorization (C.3.2), for all k at once."""
    if mode == "diag":
        return (B.square() * h_j).flatten(1).sum(1)
    channel = 1 if h_j.dim() > 1 else 0
    other = tuple(d for d in range(h_j.dim()) if d != channel)
    h_mean = h_j.mean(other) if other else h_j
    b2 = B.square().sum(tuple(d + 1 for d in other)) if other else B.square()
    return b2 @ h_mean


class _EdgeRecorder:
    """Hooks on each mixed op (its weights and output edge, per call) and its candidate ops (their outputs)."""

    def __init__(self, names, modules, ops):
        self.names, self.modules, self.ops = names, modules, ops
        self.weights: Dict[str, List[torch.Tensor]] = {n: [] for n in names}
        self.with_graph: Dict[str, torch.Tensor] = {}  # first call's weights, still attached (the softmax check)
        self.calls: Dict[str, List[tuple]] = {n: [] for n in names}
        self.observe: Dict[tuple, str] = {}
        self._frames: Dict[str, List[Dict[int, torch.Tensor]]] = {n: [] for n in names}
        self._gaps: List[tuple] = []  # (edge, device scalar > 0 where its output is not Σ_k w_k B_k of the listed ops)
        self._hooks = Hooks()

    def __enter__(self):
        # planned here and dropped on exit: the hooks are closures over this recorder, and a plan kept on it closed a
        # reference cycle that held the recorded op outputs until Python's cyclic collector ran
        self._hooks = Hooks()
        for name, module, ops in zip(self.names, self.modules, self.ops):
            self._hooks.forward_pre(module, self._pre(name, len(ops)), with_kwargs=True)
            self._hooks.forward(module, self._post(name, len(ops)))
            for k, op in enumerate(ops):
                self._hooks.forward(op, self._op(name, k))
        self._hooks.install()
        return self

    def __exit__(self, *exc):
        self._hooks.remove()
        self._hooks = Hooks()

    def _pre(self, name, K):
        def hook(module, args, kwargs):
            key = weights_parameter(module)  # the weights by keyword: op(x, mix=w) for forward(x, mix)
            weights = kwargs.get(key, args[1] if len(args) > 1 else None)
            if not isinstance(weights, torch.Tensor):
                raise CurvatureError(no_weights_refusal(name, weights))
            if weights.dim() not in (1, 2) or weights.shape[-1] != K:
                raise CurvatureError(
                    f"edge {name!r}: mixing weights must have shape (K,) or (B, K) with K={K} (the candidate ops listed), "
                    f"got {tuple(weights.shape)}; list exactly the ops the mixed op mixes"
                )
            self.weights[name].append(weights.detach())
            self.with_graph.setdefault(name, weights)
            self._frames[name].append({})
            if not weights.requires_grad:
                # a frozen model with fixed weights: a leaf copy gives the recursion the graph from the edge on
                # (the curvature w.r.t. Z does not depend on what requires grad upstream)
                weights = weights.detach().requires_grad_(True)
                if key in kwargs:
                    return args, {**kwargs, key: weights}
                return (args[0], weights, *args[2:]), kwargs
            return None

        return hook

    def _op(self, name, k):
        def hook(module, args, output):
            frames = self._frames[name]
            if frames:
                frames[-1][k] = output.detach()

        return hook

    def _post(self, name, K):
        def hook(module, args, output):
            frame = self._frames[name].pop()
            missing = [k for k in range(K) if k not in frame]
            if missing:
                raise CurvatureError(
                    f"edge {name!r}: candidate op(s) {missing} did not run in this call of the mixed op, so their "
                    "curvature is undefined; run every candidate (the BayesNAS formula needs each op output B_k)"
                )
            gap = _mixture_gap(self.weights[name][-1], [frame[k] for k in range(K)], output)
            if gap is not None:
                self._gaps.append((name, gap))
            e = edge_of(output)
            key = f"{name}#{len(self.calls[name])}"
            self.calls[name].append((key, [frame[k] for k in range(K)]))
            if e is not None:
                self.observe[e] = key

        return hook

    def check_complete(self):
        never = [n for n in self.names if not self.calls[n]]
        if never:
            raise CurvatureError(
                f"mixed op(s) {never} never ran in the forward pass, so their curvature is undefined; "
                "pass only edges that model(inputs) actually uses"
            )
        if self._gaps:  # one host read for all edges (none while a CUDA graph is captured: nothing was checked then)
            gaps = torch.stack([g.to(device=self._gaps[0][1].device, dtype=torch.float64) for _, g in self._gaps]).tolist()
            wrong = [(name, gap) for (name, _), gap in zip(self._gaps, gaps) if gap > 0]
            if wrong:
                name, gap = wrong[0]
                raise CurvatureError(
                    f"edge {name!r}: the mixed op's output is not Σ_k weights[k]·ops[k](x) of the candidate ops as listed "
                    f"(off by up to {gap:.3g}); list the ops in the order the mixed op pairs them with its weights, e.g. "
                    "(module, list(module.ops)), and return that sum alone, or use mode='exact' or 'ggn', which read "
                    "only the weights"
                )


def _mixture_gap(weights: torch.Tensor, op_outputs: List[torch.Tensor], output) -> Optional[torch.Tensor]:
    """How far a mixed op's output is from ``Σ_k weights[..., k] · ops[k](x)`` of the ops as listed (on the batch's
    first sample), as a device scalar: the largest gap beyond 1000 ulp of the terms' magnitudes in float64, 1e-2 of
    them in lower precisions (> 0: not that sum). The recursions pair ``B_k`` (the k-th listed op's output) with ``Z_k`` (the k-th weight), so ops listed
    in another order than the mixed op pairs them with its weights (or a mixed op that changes the sum, e.g. normalizes
    it) gave silently wrong numbers, while ``exact``, ``hutchinson:<k>`` and the GGN modes, which read only the
    weights, were right. Non-finite entries (a NaN batch) are left out: they give NaN curvature, not a refusal. None
    (nothing checked) for shapes that do not broadcast, on the meta device, and while a CUDA graph is captured (the
    plain call before the capture checked it; a host read is not allowed there)."""
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        return None
    if output.is_meta or (output.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None  # a meta tensor has no values to read: the call's own meta-device refusal speaks
    if output.dim() == 0:
        return None
    # the first sample only: a reordering or a changed sum shows there as anywhere, at 1/B of the cost
    first = output.detach()[:1]
    try:
        B = torch.stack([(b[:1] if b.dim() == output.dim() else b).expand_as(first) for b in op_outputs])  # (K, 1, ...)
    except RuntimeError:
        return None
    w = weights.detach().to(output.dtype).reshape(-1, weights.shape[-1])[0]  # (K,): the first sample's row of (B, K)
    terms = w.reshape(-1, *([1] * first.dim())) * B
    gap, scale = (first - terms.sum(0)).abs(), terms.abs().sum(0)
    eps = torch.finfo(output.dtype).eps  # float32 and below: 1e-2 (a mix by einsum/matmul may run in TF32 on a GPU)
    over = gap - (1e3 * eps if output.dtype == torch.float64 else max(1e-2, 64 * eps)) * scale
    finite = torch.isfinite(gap) & torch.isfinite(scale)
    return torch.where(finite & (over > 0), gap, torch.zeros_like(gap)).amax()


#: which options of arch_diag_hessian each mode family uses; any other given explicitly would do nothing
_OPTIONS_USED = {"ggn_mc": {"samples", "seed"}, "hutchinson": {"seed", "max_memory"}, "exact": {"max_memory"},
                 "exact_per_edge": {"max_memory"}}


def _refuse_idle_options(mode: str, **given) -> None:
    used = _OPTIONS_USED.get(split_mode(mode)[0], set())
    idle = sorted(name for name, value in given.items() if value is not None and name not in used)
    if idle:
        users = sorted(m for m, names in _OPTIONS_USED.items() if set(idle) & names)
        raise CurvatureError(f"{', '.join(f'{n}=' for n in idle)} does nothing in mode={mode!r}; it applies to "
                             f"mode {', '.join(repr(m + (':<k>' if m == 'hutchinson' else '')) for m in users)} "
                             "(leave it out, or choose that mode)")
