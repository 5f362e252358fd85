"""The unrolled-step hypergradient of second-order DARTS, on parameter dicts (no copy of the network).

The bilevel problem min_α L_val(w*(α), α) with w*(α) ≈ w' = w − ξ·(∇_w L_train(w, α) + μ·b + λ·w)
(one SGD step with the optimizer's momentum buffer b and weight decay λ, as DARTS's ``architect.py``)
has the hypergradient (sparse-supernet eq 11–12, DARTS eq 7)

    g = ∇_α L_val(w', α) − ξ · ∇²_{α,w} L_train(w, α) · ∇_{w'} L_val(w', α),

whose mixed second derivative is approximated by a central finite difference (eq 13, DARTS eq 8)

    ∇²_{α,w} L_train · v ≈ [∇_α L_train(w⁺, α) − ∇_α L_train(w⁻, α)] / (2ε),
    w^± = w ± ε·v,   v = ∇_{w'} L_val(w', α),   ε = r / ‖v‖  (r = 0.01 in DARTS).

Eq 13 of the sparse-supernet paper as printed drops the factor ξ (γ there) and perturbs w along
∇_w l_train; both are typos against its own eq 12 and DARTS eq 8, which we follow. The divisor is
``(2 * eps)``: the ``/ 2.*eps`` of several public implementations multiplies by ε instead.

Every ∇_α term is composed from the cost primitive: one forward with per-cell leaves Z gives
C = ∂L/∂Z (wiring supplement §2) and ∇_α L = ``arch_grad(C)`` (``darts_alpha_grad(C, p)`` for DARTS,
the identity for SparseNAS's linear weights). The network is evaluated with
``torch.func.functional_call`` on ``{name: tensor}`` dicts; buffers are passed as clones, so the
extra forwards leave BatchNorm's running statistics untouched.

Under DDP every gradient (∇_w L_train, ∇_{w'} L_val, the costs) is averaged over ranks before use,
so each rank computes the hypergradient of the global-batch losses, identical on every rank.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call

from nasdiag.distributed import finite_on_every_rank
from nasdiag.hessian._hvp import random_state, set_random_state
from nasdiag.search.base import Batch, CellWeights, loss_text, mean_over_ranks, nonfinite_loss_error

Params = Dict[str, torch.Tensor]
#: maps the step's costs {cell type: (E, K)} (summed over the cells of a type) to ∇_α {cell type: (E, K)}
ArchGradMap = Callable[[CellWeights], CellWeights]


@dataclass
class FunctionalCost:
    """One functional forward/backward at given weights w and mixing weights Z.

    Attributes:
        loss: 0-dim mean cross-entropy of the batch (detached, this rank's).
        logits: (B, classes), detached.
        per_cell: one (E, K) tensor per cell, C = ∂L/∂Z of this rank's loss (not averaged over DDP ranks: the
            cost statistics' observations, one per rank, step and cell).
        costs: ``{cell type: (E, K)}``, the rank mean of ``per_cell`` summed over the cells of a type (what the
            architecture gradients use).
        weight_grads: ``{name: ∂L/∂w}`` (rank mean) if asked for, else None.
    """

    loss: torch.Tensor
    logits: torch.Tensor
    per_cell: List[torch.Tensor]
    costs: CellWeights
    weight_grads: Optional[Params]


@dataclass
class UnrolledGradient:
    """The pieces of the second-order hypergradient (eq 12–13), each ``{cell type: (E, K)}``.

    Attributes:
        arch_grad: g = ``val_grad − xi * implicit`` (eq 13), what the α optimizer applies.
        val_grad: ∇_α L_val(w', α), the first term.
        implicit: [∇_α L_train(w⁺) − ∇_α L_train(w⁻)] / (2ε) ≈ ∇²_{α,w} L_train · ∇_{w'} L_val.
        val: the forward at w' on the validation batch (its costs feed the cost statistics).
        train_loss: L_train(w, α) of the unrolled step, 0-dim.
        xi: ξ, the unrolled step's learning rate.
        eps: 0-dim tensor on the device, ε = r / ‖∇_{w'} L_val‖ (inf where that gradient is zero: then
            ``implicit`` is 0). A tensor, not a float: reading it would synchronise the host with the device.
    """

    arch_grad: CellWeights
    val_grad: CellWeights
    implicit: CellWeights
    val: FunctionalCost
    train_loss: torch.Tensor
    xi: float
    eps: torch.Tensor


def weight_params(network) -> Params:
    """``{name: parameter}`` of the weights w the unrolled step moves: every parameter that is not an architecture
    parameter and requires a gradient. A frozen weight (``requires_grad=False``) takes no step of w's optimizer (it
    gets no ``.grad``), so w' keeps it: it is left out of w' = w − ξ(…), of v = ∇_{w'} L_val and of ‖v‖ (moving it
    in the virtual step gave the hypergradient of another bilevel problem, the one where it is trained)."""
    arch = {id(p) for p in network.arch_parameters()}
    return {n: p for n, p in network.named_parameters() if id(p) not in arch and p.requires_grad}


def functional_cost(network, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                    x: torch.Tensor, y: torch.Tensor, weights: CellWeights, *, weight_grads: bool = False,
                    active: Optional[CellWeights] = None, context: Callable[[], ContextManager] = nullcontext,
                    ) -> FunctionalCost:
    """C = ∂L/∂Z (and optionally ∂L/∂w) of the mean cross-entropy at weights ``params``, one backward.

    Args:
        network: the supernet (``forward(x, per-cell weights[, active])``).
        params: ``{name: tensor}`` weights to evaluate at (detached or not; gradients are taken w.r.t.
            fresh leaves). Parameters not named keep the module's own values.
        buffers: ``{name: tensor}`` buffers (pass clones to leave the module's running statistics alone).
        x, y: the batch.
        weights: ``{cell type: (E, K)}`` mixing weights Z, detached here.
        weight_grads: also return ∂L/∂w for every entry of ``params`` (zeros where unused).
        active: optional ``{cell type: (E, K) bool}`` ops to compute.
        context: a context manager factory wrapped around forward and backward (e.g. a probe recording).

    Returns:
        :class:`FunctionalCost`, gradients averaged over DDP ranks (``per_cell``: this rank's own).
    """
    leaves = [weights[c.cell_type].detach().clone().requires_grad_(True) for c in network.cells]
    names = list(params)
    w_leaves = [params[n].detach().requires_grad_(weight_grads) for n in names]
    kwargs = {} if active is None else {"active": active}
    with context():
        logits = functional_call(network, ({**dict(zip(names, w_leaves)), **buffers}), (x, leaves), kwargs)
        loss = nn.functional.cross_entropy(logits, y)
        inputs = leaves + (w_leaves if weight_grads else [])
        grads = list(torch.autograd.grad(loss, inputs, allow_unused=True))
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]
    # this rank's costs, the cost statistics' observations (nasdiag.distributed: one per rank, step and cell); their
    # rank mean was observed, so under DDP every rank pooled the same mean and the variance lost the ranks' spread
    per_cell = [g.detach().clone() for g in grads[: len(leaves)]]
    grads = mean_over_ranks(grads)
    costs: CellWeights = {}
    for cell, g in zip(network.cells, grads[: len(leaves)]):
        costs[cell.cell_type] = costs[cell.cell_type] + g if cell.cell_type in costs else g
    w_grads = dict(zip(names, grads[len(leaves):])) if weight_grads else None
    return FunctionalCost(loss.detach(), logits.detach(), per_cell, costs, w_grads)


def sgd_momentum_buffers(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]) -> Params:
    """``{name: momentum buffer}`` of an SGD optimizer's state (zeros before its first step)."""
    state = optimizer.state
    return {n: state[p]["momentum_buffer"] if p in state and state[p].get("momentum_buffer") is not None
            else torch.zeros_like(p) for n, p in params.items()}


def unrolled_weights(params: Mapping[str, torch.Tensor], train_grads: Mapping[str, torch.Tensor], *, xi: float,
                     momentum: float = 0.0, momentum_buffers: Optional[Mapping[str, torch.Tensor]] = None,
                     weight_decay: float = 0.0) -> Params:
    """w' = w − ξ·(∇_w L_train + μ·b + λ·w): the one-step approximation of w*(α) (DARTS eq 6–7, with the
    momentum buffer b and weight decay λ of DARTS's ``architect._compute_unrolled_model``); detached."""
    # foreach ops: a handful of kernels for all ~1400 weight tensors of a supernet, not six per tensor
    names = list(params)
    if not names:  # every weight frozen: nothing to move (the foreach ops refuse an empty list)
        return {}
    w = [params[n].detach() for n in names]
    d = torch._foreach_add([train_grads[n] for n in names], w, alpha=weight_decay) if weight_decay else \
        [train_grads[n] for n in names]
    if momentum_buffers is not None and momentum:
        d = torch._foreach_add(d, [momentum_buffers[n] for n in names], alpha=momentum)
    return dict(zip(names, torch._foreach_add(w, d, alpha=-xi)))


def host_checks_allowed() -> bool:
    """False while a CUDA graph is being captured: a check that reads a device value (``float(t)``,
    ``if t:``) would synchronise and break the capture. A replayed step cannot raise; its NaN statistics
    are recorded and the run's per-epoch check stops it."""
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@contextmanager
def random_state_kept() -> Iterator[None]:
    """The global generators (CPU, CUDA) put back on exit as they were on entry (not read while a CUDA graph is
    captured). For what computes a step's quantity without taking the step (``arch_gradient``): its forwards draw
    what the step's will (train-mode dropout masks), and the step that follows draws them again, so it applies what
    was returned (the generators left advanced, the next step differentiated other masks: 0.07 off in α's gradient
    on a tiny supernet with dropout 0.3, and every later step of the run differed)."""
    drawn = random_state() if host_checks_allowed() else None
    try:
        yield
    finally:
        if drawn is not None:
            set_random_state(drawn)


def _check_finite(what: str, loss: torch.Tensor, path: str) -> None:
    """Raise before any update if ``loss`` is NaN/inf; the error carries it as the record path ``path``, flagged."""
    if host_checks_allowed() and not finite_on_every_rank(loss):  # under DDP: every rank stops here
        raise nonfinite_loss_error(f"the {what} loss is {loss_text(loss)}: the unrolled step cannot continue "
                                   "(lower the learning rates or check the data)", {path: loss.detach()})


def unrolled_gradient(network, train_batch: Batch, val_batch: Batch, weights: CellWeights, arch_grad: ArchGradMap, *,
                      xi: float, momentum: float = 0.0, momentum_buffers: Optional[Mapping[str, torch.Tensor]] = None,
                      weight_decay: float = 0.0, eps_scale: float = 0.01, active: Optional[CellWeights] = None,
                      val_context: Callable[[], ContextManager] = nullcontext) -> UnrolledGradient:
    """The second-order hypergradient of eq 12–13 at the network's current weights, without changing them.

    Four forwards (train at w, val at w', train at w⁺ and w⁻), each with a backward (to the mixing weights; the
    first two also to w), and no copy of the network.
    The forwards at w⁺ and w⁻ draw what the train forward at w drew from the global generators (train-mode
    dropout: one net differenced), except while a CUDA graph is captured.

    Args:
        network: the supernet; its weights w are read, never written.
        train_batch, val_batch: (x, y) pairs; losses are batch means.
        weights: ``{cell type: (E, K)}`` mixing weights Z(α) of both losses (softmax(α) for DARTS).
        arch_grad: maps costs ``{cell type: (E, K)}`` at Z to ∇_α (linear in the costs).
        xi: ξ, the unrolled step's learning rate (DARTS: the current learning rate of w).
        momentum, momentum_buffers: μ and the SGD buffers b by parameter name (see :func:`sgd_momentum_buffers`).
        weight_decay: λ of the unrolled step.
        eps_scale: r in ε = r / ‖∇_{w'} L_val‖ (0.01 in DARTS's ``_hessian_vector_product``).
        active: optional ops to compute in every forward.
        val_context: context manager factory around the validation forward at w' (a probe recording).

    Returns:
        :class:`UnrolledGradient`.

    Raises:
        SearchError: (``nonfinite_loss_error``, outside a CUDA-graph capture) where the loss of any of the four
            forwards (train at w, val at w', train at w⁺ and w⁻) is NaN or inf, before anything uses it.
    """
    params = {n: p.detach() for n, p in weight_params(network).items()}
    buffer_names, buffer_values = zip(*network.named_buffers()) if any(True for _ in network.buffers()) else ((), ())

    def buffers() -> Params:  # copies (x + 0 is x, for every dtype), so the forwards leave the running statistics alone
        return dict(zip(buffer_names, torch._foreach_add([b.detach() for b in buffer_values], 0))) if buffer_names else {}

    x_t, y_t = train_batch
    x_v, y_v = val_batch

    # a random forward (train-mode dropout) draws its masks from the global generators: the forwards at w± take the
    # train forward's draws, so eq 13 differences one net (other draws at w⁺ and w⁻ made the mixed term mask noise
    # over 2ε: the hypergradient 90-99% off at DARTS's r). Not while a CUDA graph is captured (no host RNG reads).
    drawn = random_state() if host_checks_allowed() else None
    train = functional_cost(network, params, buffers(), x_t, y_t, weights, weight_grads=True, active=active)
    _check_finite("search-train (unrolled step)", train.loss, "scalars/unrolled_train_loss")
    w_unrolled = unrolled_weights(params, train.weight_grads, xi=xi, momentum=momentum,
                                  momentum_buffers=momentum_buffers, weight_decay=weight_decay)

    val = functional_cost(network, w_unrolled, buffers(), x_v, y_v, weights, weight_grads=True, active=active,
                          context=val_context)
    _check_finite("search-val (at the unrolled weights)", val.loss, "scalars/val_loss")
    val_grad = arch_grad(val.costs)

    v = val.weight_grads
    # every weight frozen (no w, so w' = w): v is empty, a zero vector, and the mixed term vanishes as for v = 0
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(v.values())))) if v else val.loss.new_zeros(())
    # ε stays on the device (no host sync, so the step can be captured as a CUDA graph). Where v = 0 there is
    # no direction to differentiate along: the mixed term vanishes (ε = inf, w± = w, implicit = 0).
    nonzero = norm > 0
    eps = torch.where(nonzero, eps_scale / norm, torch.full_like(norm, math.inf))
    step = torch.where(nonzero, eps, torch.zeros_like(norm))
    names = list(params)
    w = [params[n] for n in names]
    shift = torch._foreach_mul([v[n] for n in names], step) if names else []
    plus = dict(zip(names, torch._foreach_add(w, shift))) if names else {}
    minus = dict(zip(names, torch._foreach_sub(w, shift))) if names else {}
    after = random_state() if drawn is not None else None
    try:
        if drawn is not None:
            set_random_state(drawn)
        c_plus = functional_cost(network, plus, buffers(), x_t, y_t, weights, active=active)
        if drawn is not None:
            set_random_state(drawn)
        c_minus = functional_cost(network, minus, buffers(), x_t, y_t, weights, active=active)
    finally:  # the generators as the train and val forwards left them
        if after is not None:
            set_random_state(after)
    # the losses at w± are unrolled forwards too: a NaN/inf there made the hypergradient NaN, which the α step
    # applied before the w step's check stopped the run (α already NaN, the error blaming the search-train batch)
    if host_checks_allowed() and not finite_on_every_rank(torch.stack([c_plus.loss, c_minus.loss])):
        raise nonfinite_loss_error(
            f"the search-train loss at w ± εv (the finite difference of eq 13, ε = {float(eps):.3g}) is "
            f"{loss_text(torch.stack([c_plus.loss, c_minus.loss]))}: the unrolled step cannot continue (lower fd_eps_scale or "
            "the learning rates)", {"scalars/unrolled_train_loss": train.loss.detach(), "scalars/fd_eps": eps.detach()})
    g_plus, g_minus = arch_grad(c_plus.costs), arch_grad(c_minus.costs)
    # the divisor is (2 * eps): `/ 2.*eps` would multiply by eps
    implicit = {t: torch.where(nonzero, (g_plus[t] - g_minus[t]) / (2.0 * eps), torch.zeros_like(g_plus[t]))
                for t in g_plus}
    hyper = {t: val_grad[t] - xi * implicit[t] for t in val_grad}
    return UnrolledGradient(hyper, val_grad, implicit, val, train.loss, float(xi), eps)
