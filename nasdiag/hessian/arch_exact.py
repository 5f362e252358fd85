"""Exact curvature of the mixing weights Z (and α) of every edge, by Hessian-vector products.

Mode ``exact``: the reference that the BayesNAS approximation (bayesnas-appendix C.3.1-C.3.2,
``H ≈ E(Σ B_i² H_j)``) is measured against.

What can be batched, and what cannot. Stack the mixing weights of all edges into one vector
``z = (Z_{e,k})`` of length ``N = Σ_e K_e``. The wanted numbers are the diagonal ``H_{ii}`` of the
``N × N`` Hessian ``H = ∂²L/∂z²``. One HVP with a sum of basis vectors, e.g. ``v = Σ_e e_{(e,k)}`` (one
op index on every edge), returns ``(Hv)_{(e,k)} = H_{(e,k),(e,k)} + Σ_{e'≠e} H_{(e,k),(e',k)}``; the
cross-edge terms do not vanish (two edges interact through every node downstream of both and through
the loss's own curvature), so that is not the diagonal. Nor does any other sparsity pattern help in
general: ``H_{(e,k),(e',k')} = B_{e,k}ᵀ (∂²L/∂x_j∂x_{j'}) B_{e',k'} + [first-order terms when one edge
feeds the other]``, dense in (e, e') for a DAG that ends in one loss. So the exact diagonal costs one
HVP per entry, N in all, and what *can* be batched is the N independent products ``H e_i``:
``chunk_size`` of them at a time, by ``torch.func`` forward-over-reverse vmapped over the tangents
(default), or by stacked second backwards through one retained graph (``backend="autograd"``). Each
``H e_i`` is a full column of H, so the within-edge K × K block that the chain rule to α needs comes
for free.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from nasdiag.edges import resolve_edges, weights_parameter
from nasdiag.hessian.modes import CurvatureError, CurvatureRuntimeError, no_weights_refusal
from nasdiag.hessian._hvp import (
    SavedBytes,
    check_chunk_size,
    check_max_memory,
    check_model,
    fit_chunk,
    leaf_sources,
    softmax_jacobian_ratio,
    source_entries,
    HessianVectorProduct,
    Inputs,
    batch_statistics_only,
    call_model,
    functional_hvp,
    preserved_buffers,
    random_state,
    scalar_loss,
    set_random_state,
)
from nasdiag.hessian.weights import _parameter_read_by, _refuse_empty_batch
from nasdiag.hooks import Hooks

__all__ = ["EdgeProducts", "edge_hessian_products", "exact_arch_diag_hessian", "softmax_chain_diag"]

_WRT = ("Z", "alpha")
BACKENDS = ("auto", "func", "autograd")


def exact_arch_diag_hessian(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: Inputs,
    targets,
    edges: Mapping[str, object],
    wrt: str = "Z",
    *,
    chunk_size: int = 64,
    backend: str = "auto",
    shared_alpha: str = "per_edge",
    max_memory: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """Exact diagonal of the Hessian of the loss w.r.t. each edge's mixing weights.

    For edge e with mixing weights ``Z_e = (Z_{e,1}, ..., Z_{e,K})`` (``out = Σ_k Z_{e,k} O_k(x)``),
    returns ``∂²L/∂Z_{e,k}²`` for k = 1..K, with every other edge's weights held fixed: the diagonal of
    the full Hessian over all edges' Z, each edge having its own Z (a leaf per cell, not shared across
    cells). Compare BayesNAS appendix C.3.1-C.3.2 for the approximation.

    How: a forward pre-hook on each mixed op replaces its weights ``Z_e`` by ``Z_e + δ_e`` with ``δ_e``
    zero, so ``∂L/∂δ_e = ∂L/∂Z_e`` and ``∂²L/∂δ_e² = ∂²L/∂Z_e²``; then N = Σ_e K_e exact Hessian-vector
    products ``H e_i`` give the diagonal (the module docstring says why they cannot be merged into
    fewer). One plain autograd pass first checks the edges and gives ``∂L/∂Z``. Hooks are removed on
    every path.

    Args:
        model: the supernet; ``model(inputs)`` (``model(*inputs)`` for a tuple) returns the outputs.
            Train-mode BatchNorm normalizes with the batch statistics and is differentiated through
            them (exact); its running statistics are left as they were.
        loss_fn: ``loss_fn(outputs, targets) -> scalar``. The Hessian is the one of exactly this
            scalar: with ``reduction="mean"`` (the nasdiag default) it is the Hessian of the batch mean,
            with ``"sum"`` B times that.
        inputs, targets: one mini-batch.
        edges: ``{edge name: (mixed_op_module, [candidate op modules])}`` (or any value with ``.module``
            and ``.ops``), or a list of specs with ``.name``, ``.module``, ``.ops`` such as
            ``Network.edge_specs()``. The mixed op's forward must be
            ``(x, weights) -> Σ_k weights[..., k] * ops[k](x)`` with ``weights`` the second positional
            argument or the ``weights=`` keyword, shape ``(K,)`` or ``(B, K)``.
        wrt: ``"Z"`` for ``∂²L/∂Z_{e,k}²``; ``"alpha"`` for ``∂²L/∂α_{e,k}²`` with ``Z_e = softmax(α_e)``
            (temperature 1), see :func:`softmax_chain_diag`. The α result is exact for an edge that owns
            its α. When α is shared by several cells (DARTS shares one (E, K) α per cell type) the
            total ``∂²L/∂α_{e,k}²`` also has cross-cell terms ``Σ_{c≠c'} ∂²L/∂α^{(c)}∂α^{(c')}``; they are
            NOT included, so summing these per-cell numbers over cells gives only the block-diagonal
            part of the shared-α curvature.
        chunk_size: Hessian-vector products evaluated together (one vmapped pass). Memory grows
            linearly with it: on the DARTS search supernet (8 cells, C=16, batch 64, float32) one
            ``"func"`` product held ≈ 10× the memory of a forward+backward, so about 4 fit an H200
            (BENCHMARKS.md). On out-of-memory the chunk is halved, with a warning.
        backend: ``"func"``: forward-over-reverse with ``torch.func`` (vmap over tangents; fast on
            GPUs, re-runs the forward per chunk). ``"autograd"``: second backwards through one
            retained graph (works for any double-differentiable model). ``"auto"`` (default): ``"func"``,
            falling back to ``"autograd"`` with a ``RuntimeWarning`` if the model cannot be traced.

    Returns:
        ``{edge name: tensor (K,)}`` in the loss's dtype and device, in the order of ``edges``.
        With ``(B, K)`` per-sample weights, δ_e is still one ``(K,)`` shift shared by the batch, so the
        entry is ``Σ_{b,b'} ∂²L/∂Z_{b,k}∂Z_{b',k}`` (``wrt="alpha"`` needs ``(K,)`` weights).

    Raises:
        CurvatureError (a ``ValueError``): ``wrt``, ``backend`` or ``chunk_size`` bad; an edge module not in ``model``; a module listed
            twice; a mixed op that never ran in the forward, or ran without weights of shape (..., K);
            ``wrt="alpha"`` on weights that are not a probability vector.

        shared_alpha: ``"per_edge"`` (default): the per-edge numbers above even when the edges' weights
            come from one shared α. ``"refuse"`` (``arch_diag_hessian(mode="exact")``): with ``wrt="alpha"``,
            raise :class:`~nasdiag.hessian.modes.CurvatureError` when two edges' weights derive from the
            same parameter, since no per-edge number is the exact shared-α curvature; the message names
            :func:`~nasdiag.hessian.alpha_diag_hessian` (exact, shared) and ``mode="exact_per_edge"``.
        max_memory: bytes one batch of products may use (default: half the memory free on the device at
            the call). The need is estimated from the tensors the forward saves for backward (a product holds
            about 8 times that); ``chunk_size`` is lowered to fit, and a net whose single product does not fit
            is refused with the estimate.

    An edge that ran but does not influence the loss gets zeros and a ``RuntimeWarning`` naming it.
    """
    if shared_alpha not in ("per_edge", "refuse"):
        raise CurvatureError(f"shared_alpha must be 'per_edge' or 'refuse', got {shared_alpha!r}")
    if wrt not in _WRT:
        raise CurvatureError(f"wrt must be 'Z' (the mixing weights) or 'alpha' (through Z = softmax(α)), got {wrt!r}")
    if backend not in BACKENDS:
        raise CurvatureError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}; 'auto' picks torch.func and falls back to autograd")
    check_chunk_size(chunk_size, "exact_arch_diag_hessian")
    check_max_memory(max_memory, "exact_arch_diag_hessian")
    check_model(model, loss_fn, "exact_arch_diag_hessian")
    _refuse_empty_batch(inputs)  # its mean loss is NaN, but no output entry carries that into the products (zeros)
    specs = resolve_edges(model, edges)
    n_ops = [s.n_ops for s in specs]
    with edge_hessian_products(
        model, loss_fn, inputs, targets, specs, wrt=wrt, backend=backend, shared_alpha=shared_alpha,
        chunk_size=chunk_size, max_memory=max_memory, what="the exact mixing-weight curvature (modes exact, exact_per_edge)",
    ) as ep:
        blocks = _edge_blocks(ep.products, n_ops, ep.chunk_size, ep.dtype, ep.device)
    names, grad_z, shift = ep.names, ep.grad_z, ep.shift

    out: Dict[str, torch.Tensor] = {}
    for name, block, grad in zip(names, blocks, grad_z):
        if wrt == "Z":
            out[name] = torch.diagonal(block).clone()
        else:
            out[name] = softmax_chain_diag(shift.observed[name][0].to(block.dtype), grad.to(block.dtype), block)
    return out


@dataclass
class EdgeProducts:
    """What :func:`edge_hessian_products` yields: ``products(V) = V H`` (c, N) → (c, N) over the flat
    δ of all edges (edge order, K_e entries each), ``∂L/∂Z`` per edge, the weights each edge saw."""

    products: Callable[[torch.Tensor], torch.Tensor]
    names: List[str]
    n_ops: List[int]
    grad_z: List[torch.Tensor]
    shift: "_WeightShift"
    chunk_size: int
    dtype: torch.dtype
    device: torch.device


@contextmanager
def edge_hessian_products(
    model: nn.Module,
    loss_fn: Callable,
    inputs: Inputs,
    targets,
    specs,
    *,
    wrt: str = "Z",
    backend: str = "auto",
    shared_alpha: str = "per_edge",
    chunk_size: int = 64,
    max_memory: Optional[int] = None,
    what: str = "arch_diag_hessian",
) -> Iterator[EdgeProducts]:
    """Exact Hessian-vector products w.r.t. the mixing weights of ``specs`` (resolved edges), valid inside
    the block: the δ-shift hooks are installed and the buffers are scratch copies until it exits.

    One plain autograd pass first checks that every edge ran with weights of the right shape, finds
    edges the loss ignores (zeros, with a ``RuntimeWarning``) and gives ``∂L/∂Z``; with ``wrt="alpha"``
    it checks that the weights are a softmax (and, for ``shared_alpha="refuse"``, not shared). Arguments
    as :func:`exact_arch_diag_hessian`; ``chunk_size`` comes back lowered to fit ``max_memory``.
    """
    names, modules, n_ops = [s.name for s in specs], [s.module for s in specs], [s.n_ops for s in specs]
    offsets = [sum(n_ops[:i]) for i in range(len(n_ops))]
    shift = _WeightShift(names, n_ops, offsets)
    hooks = Hooks()
    for i, module in enumerate(modules):
        hooks.forward_pre(module, shift.hook(i), with_kwargs=True)
    try:
        hooks.install()
        with preserved_buffers(model), torch.enable_grad():
            drawn = random_state()  # a fallback's forward draws pass 1's dropout masks: the products are of one net
            # Pass 1, plain autograd with a leaf δ_e per edge: checks that every edge ran with
            # weights of the right shape, finds edges the loss ignores, and gives ∂L/∂Z.
            shift.mode = "leaves"
            with _frozen_parameters_traced(model, wrt == "alpha"):
                with SavedBytes() as saved:
                    outputs = call_model(model, inputs)
                    loss = scalar_loss(loss_fn, outputs, targets)
                shift.check_all_ran()
                if wrt == "alpha":
                    _check_softmax_weights(shift.observed, shift.with_graph)
                    refuse_loss_beyond_outputs(loss, outputs, what, weights=shift.with_graph)
                    if shared_alpha == "refuse":
                        _refuse_shared_alpha({n: source_entries(w) for n, w in shift.with_graph.items()})
                del outputs
            chunk_size = fit_chunk(saved.bytes, max_memory, chunk_size, what, device=loss.device)
            leaves = [shift.leaves[n] for n in names]
            if backend == "autograd":
                products = HessianVectorProduct(loss, leaves, names)
                unused = products.unused
            else:
                grads = torch.autograd.grad(loss, leaves, allow_unused=True)
                unused = [n for n, g in zip(names, grads) if g is None]
                grad_z = [(torch.zeros_like(t) if g is None else g).detach() for t, g in zip(leaves, grads)]
                products = _functional_products(model, loss_fn, inputs, targets, shift, leaves[0], backend)
                if products is None:  # auto fell back: a fresh graph for second backwards
                    set_random_state(drawn)
                    loss = scalar_loss(loss_fn, call_model(model, inputs), targets)
                    products = HessianVectorProduct(loss, leaves, names)
            if isinstance(products, HessianVectorProduct):
                # ∂L/∂Z from the very forward whose Hessian is taken (matters if the forward is random)
                grad_z = list(torch.split(products.gradient.detach(), n_ops))
            if unused:
                warnings.warn(
                    f"the loss does not depend on edge(s) {unused}: their curvature is reported as zeros",
                    RuntimeWarning,
                    stacklevel=3,
                )
            yield EdgeProducts(products, names, n_ops, grad_z, shift, chunk_size, leaves[0].dtype, leaves[0].device)
    finally:
        hooks.remove()


def refuse_loss_beyond_outputs(loss, outputs, what: str, *, reached: Optional[Dict[int, str]] = None,
                               weights: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """One ``CurvatureError`` line where ``loss`` reads, besides the model ``outputs`` (its graph walked as
    :func:`~nasdiag.hessian.weights._parameter_read_by` does, stopping at the outputs), what the curvature asked for
    depends on: ``reached`` (``{id of an edge's output node or δ leaf: edge}``, an auxiliary loss on features the
    model stored, which a route seeded at the loss curvature in the outputs left out, silently) or, given ``weights``
    (``{edge: its weights with their graph}``, ``wrt="alpha"``), the α they come from read directly (a penalty on α
    written into the loss: every route chains the curvature in Z through Z = softmax(α), so the penalty's own
    curvature, 2λ per entry for λ‖α‖², was left out, silently)."""
    parts = outputs.values() if isinstance(outputs, Mapping) else outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    stops = {t.grad_fn for t in parts if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
        return
    edge = _parameter_read_by(loss, stops, reached) if reached else None
    if edge is not None:
        raise CurvatureError(
            f"edge {edge!r}: loss_fn reads a tensor the forward computed from its mixing weights besides the model "
            f"outputs (an auxiliary loss on features the model stored), and {what} starts from the loss curvature at the "
            "outputs, so that term's curvature would be left out; use mode='exact' or 'hutchinson:<k>', which "
            "differentiate the whole loss"
        )
    sources = {id(leaf): name for name, w in (weights or {}).items() for leaf in leaf_sources(w)}
    edge = _parameter_read_by(loss, stops | {w.grad_fn for w in (weights or {}).values()}, sources) if sources else None
    if edge is not None:
        raise CurvatureError(
            f"edge {edge!r}: loss_fn reads the α its mixing weights come from itself, not only through the model outputs "
            "(a penalty such as weight decay on α written into the loss), and wrt='alpha' chains the curvature in Z "
            "through Z = softmax(α), so that term's curvature would be left out; keep loss_fn a function of (outputs, "
            "targets) and add the penalty's curvature yourself (2·λ per entry for λ·‖α‖²)"
        )


@contextmanager
def _frozen_parameters_traced(model: nn.Module, active: bool) -> Iterator[None]:
    """For ``wrt="alpha"``: the model's frozen floating-point parameters (``requires_grad=False``) require grad for
    the block, then are frozen again. The checks of pass 1 find where each edge's weights come from by a backward to
    the parameters behind them (shared α, softmax's Jacobian); a frozen α leaves no graph to follow, and edges sharing
    it passed as per-edge α, their cross-cell terms silently dropped (mode ``exact``). Only pass 1 records these
    leaves; the products are taken w.r.t. the δ shifts alone, so the numbers do not change."""
    frozen = [p for p in model.parameters() if active and not p.requires_grad and (p.is_floating_point() or p.is_complex())]
    try:
        for p in frozen:
            p.requires_grad_(True)
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


class _WeightShift:
    """State of the forward pre-hooks that add δ to each mixed op's weights.

    ``mode == "leaves"``: δ_e is a (K,) zero leaf per edge, created at the edge's first call (dtype and
    device of its weights) and reused if the module runs again in the same forward (tied Z); the
    weights seen are recorded. ``mode == "flat"``: δ_e is the edge's slice of ``self.flat`` (set by the
    traced loss function under ``torch.func``). Local to one call, never module-global.
    """

    def __init__(self, names: List[str], n_ops: List[int], offsets: List[int]):
        self.names, self.n_ops, self.offsets = names, n_ops, offsets
        self.mode = "leaves"
        self.flat = None
        self.leaves: Dict[str, torch.Tensor] = {}
        self.observed: Dict[str, List[torch.Tensor]] = {n: [] for n in names}
        #: each edge's first weights, with their graph (to find where they come from)
        self.with_graph: Dict[str, torch.Tensor] = {}

    def hook(self, i: int):
        name, K, offset = self.names[i], self.n_ops[i], self.offsets[i]

        def hook(module, args, kwargs):
            key = weights_parameter(module)  # the weights by keyword: op(x, mix=w) for forward(x, mix)
            if key in kwargs:
                weights = kwargs[key]
            elif len(args) >= 2:
                weights = args[1]
            else:
                weights = None
            if not isinstance(weights, torch.Tensor):
                raise CurvatureError(no_weights_refusal(name, weights))
            if weights.dim() not in (1, 2) or weights.shape[-1] != K:
                shape = tuple(weights.shape)
                raise CurvatureError(
                    f"edge {name!r}: mixing weights must have shape (K,) or (B, K) with K={K} (the candidate ops listed), "
                    f"got {shape}; list exactly the ops the mixed op mixes"
                )
            if self.mode == "leaves":
                if name not in self.leaves:
                    self.leaves[name] = torch.zeros(K, dtype=weights.dtype, device=weights.device, requires_grad=True)
                self.observed[name].append(weights.detach())
                self.with_graph.setdefault(name, weights)
                delta = self.leaves[name]
            else:
                delta = self.flat[offset : offset + K].to(weights.dtype)
            shifted = weights + delta
            if key in kwargs:
                return args, {**kwargs, key: shifted}
            return (args[0], shifted, *args[2:]), kwargs

        return hook

    def check_all_ran(self) -> None:
        never_ran = [n for n in self.names if not self.observed[n]]
        if never_ran:
            raise CurvatureError(
                f"mixed op(s) {never_ran} never ran in the forward pass, so their curvature is undefined; "
                "pass only edges that model(inputs) actually uses"
            )


def _functional_products(model, loss_fn, inputs, targets, shift: _WeightShift, like: torch.Tensor, backend: str):
    """``V ↦ V H`` by ``torch.func`` over the flat δ, or None if ``backend="auto"`` and the model cannot be traced."""
    N = sum(shift.n_ops)
    primal = torch.zeros(N, dtype=like.dtype, device=like.device)

    def loss_of(flat):
        shift.flat = flat
        return scalar_loss(loss_fn, call_model(model, inputs), targets)

    columns = functional_hvp(loss_of, primal)

    def products(V):
        shift.mode = "flat"
        try:
            with batch_statistics_only(model):
                return columns(V)
        finally:
            shift.mode, shift.flat = "leaves", None

    if backend == "func":
        def traced(V):  # a model torch.func cannot trace: one line pointing to the backends that can (torch's own
            try:  # error, e.g. vmap's "use the 'same' or 'different' randomness flags" for a dropout, gave no way out)
                return products(V)
            except CurvatureRuntimeError:
                raise
            except (RuntimeError, NotImplementedError) as err:
                if _out_of_memory(err):  # halved by the caller
                    raise
                raise CurvatureRuntimeError(
                    f"backend='func' cannot trace this model with torch.func ({type(err).__name__}: "
                    f"{' '.join(str(err).split())[:200]}); use backend='autograd' (second backwards through one retained "
                    "graph, any double-differentiable model) or backend='auto', which falls back to it"
                ) from err
        return traced
    try:  # probe traceability once on a single column; the real work happens in _edge_blocks
        products(torch.eye(1, N, dtype=like.dtype, device=like.device))
    except (RuntimeError, NotImplementedError) as err:
        if _out_of_memory(err):  # not a tracing failure
            raise
        warnings.warn(
            f"torch.func products are not usable for this model ({type(err).__name__}: {str(err)[:200]}); using "
            "second backwards through a retained graph instead (right numbers, slower on GPUs)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return products


def softmax_chain_diag(z: torch.Tensor, grad_z: torch.Tensor, hess_z: torch.Tensor) -> torch.Tensor:
    """``∂²L/∂α_k²`` from the derivatives w.r.t. ``z = softmax(α)``.

    With ``J = ∂z/∂α = diag(z) − z zᵀ`` (symmetric) and ``∂²z_i/∂α_k² = z_i (δ_ik − z_k)² − z_i z_k (1 − z_k)``:

        ∂²L/∂α_k² = (J H J)_kk + Σ_i g_i ∂²z_i/∂α_k²

    Args:
        z: (K,) probability vector, the softmax of the edge's α.
        grad_z: (K,) ``g = ∂L/∂z``.
        hess_z: (K, K) ``H = ∂²L/∂z²`` (the edge's own block).

    Returns:
        (K,) in the dtype of ``hess_z`` (also under a caller's autocast, whose matmuls gave bfloat16 before round 20).
    """
    z, grad_z = z.to(hess_z.dtype), grad_z.to(hess_z.dtype)
    with torch.autocast(z.device.type, enabled=False):
        jac = torch.diag(z) - torch.outer(z, z)
        curvature = torch.diagonal(jac @ hess_z @ jac)
        eye = torch.eye(z.numel(), dtype=z.dtype, device=z.device)
        # second[i, k] = ∂²z_i/∂α_k²
        second = z[:, None] * (eye - z[None, :]) ** 2 - z[:, None] * (z * (1 - z))[None, :]
        return curvature + grad_z @ second


def _refuse_shared_alpha(sources: Dict[str, set]) -> None:
    """Raise when two edges' weights depend on one entry of a parameter (α shared across cells)."""
    owner: Dict[tuple, str] = {}
    for name, ids in sources.items():
        for i in ids:
            if i in owner and owner[i] != name:
                raise CurvatureError(
                    f"edges {owner[i]!r} and {name!r} take their mixing weights from the same entries of one parameter (shared α), so no "
                    "per-edge number is the exact ∂²L/∂α²: use nasdiag.hessian.alpha_diag_hessian(model, loss_fn, x, y) "
                    "for the exact shared-α diagonal, or mode='exact_per_edge' for the per-edge blocks (cross-cell "
                    "terms dropped)"
                )
            owner[i] = name


def _check_softmax_weights(observed: Dict[str, List[torch.Tensor]], with_graph: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """wrt='alpha' chains through ``Z = softmax(α)`` of the leaf α: refuse weights that are not a probability
    vector, and (where ``with_graph`` holds the weights still attached to their graph) weights whose Jacobian
    w.r.t. their leaf parameter is not softmax's (a temperature, a straight-through estimator, logits computed
    from another parameter), for which that chain rule would be silently wrong."""
    for name, calls in observed.items():
        z = calls[0]
        if z.dim() != 1:
            raise CurvatureError(
                f"edge {name!r}: wrt='alpha' needs (K,) weights softmax(α_e), got per-sample weights "
                f"{tuple(z.shape)}; use wrt='Z'"
            )
        if any(c.shape != z.shape or not torch.equal(c, z) for c in calls[1:]):
            raise CurvatureError(
                f"edge {name!r} ran {len(calls)} times with different weights; wrt='alpha' needs one Z per edge: use wrt='Z'"
            )
        # a float32 α whose softmax the forward casts up is a probability vector to float32's round-off, not Z's
        graph = with_graph.get(name) if with_graph else None
        eps = max([torch.finfo(z.dtype).eps] + [torch.finfo(leaf.dtype).eps for leaf in (leaf_sources(graph) if graph is not None else ())
                                               if leaf.dtype.is_floating_point])
        tol = 1e3 * eps
        if bool((z < 0).any()) or abs(float(z.sum()) - 1.0) > tol:
            raise CurvatureError(
                f"edge {name!r}: wrt='alpha' assumes Z = softmax(α) but the weights {z.tolist()} are not a "
                "probability vector; use wrt='Z' (or chain through your own map)"
            )
        ratio = softmax_jacobian_ratio(with_graph[name]) if with_graph and name in with_graph and z.dim() == 1 else None
        if ratio is not None and abs(ratio - 1.0) > 1e4 * eps:
            raise CurvatureError(
                f"edge {name!r}: wrt='alpha' assumes Z = softmax(α) of the architecture parameter itself, but ∂Z/∂α is "
                f"{ratio:.4g} times softmax's (e.g. softmax(α/τ) with τ = {1 / ratio:.4g}, or logits computed from α); "
                "use wrt='Z' and chain through your own map"
            )


def _edge_blocks(products, n_ops: Sequence[int], chunk_size: int, dtype, device) -> List[torch.Tensor]:
    """The K_e × K_e diagonal blocks of the Hessian from the N columns ``H e_i``, ``chunk_size`` at a time.

    ``products(V)`` maps a stack of vectors (c, N) to ``V H`` (c, N). On out-of-memory the chunk is
    halved (with a warning) down to one product at a time.
    """
    N = sum(n_ops)
    offsets = torch.cumsum(torch.tensor([0, *n_ops[:-1]]), 0)
    edge_of = torch.repeat_interleave(torch.arange(len(n_ops)), torch.tensor(n_ops))
    k_max = max(n_ops)
    # cols[i, :] = columns of the block of the edge that owns row i (padded past K_e, cut off below)
    cols = (offsets[edge_of][:, None] + torch.arange(k_max)[None, :]).clamp_(max=N - 1).to(device)
    rows = torch.empty(N, k_max, dtype=dtype, device=device)
    eye = torch.eye(N, dtype=dtype, device=device)
    start = 0
    while start < N:
        stop = min(start + chunk_size, N)
        try:
            block_rows = products(eye[start:stop])  # (c, N): row i is (H e_i)ᵀ, H symmetric
        except RuntimeError as err:
            if not _out_of_memory(err):
                raise
            if chunk_size == 1:
                raise CurvatureRuntimeError(
                    "out of memory with one Hessian-vector product at a time; use backend='autograd' "
                    "(one retained graph, one second backward per product), mode='ggn_mc', a smaller batch, or fewer edges"
                ) from err
            chunk_size = max(1, chunk_size // 2)
            warnings.warn(f"out of memory: retrying with chunk_size={chunk_size}", RuntimeWarning, stacklevel=3)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        rows[start:stop] = torch.gather(block_rows.detach(), 1, cols[start:stop])
        start = stop
    return [rows[o : o + K, :K] for o, K in zip(offsets.tolist(), n_ops)]


def _out_of_memory(err: BaseException) -> bool:
    # TorchScript'd jvp decompositions re-raise CUDA OOM as a plain RuntimeError
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err)
