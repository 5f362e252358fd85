"""HAPG and AdamHAPG (sparse-supernet eq 6–10): proximal optimizers for the sparse group lasso.

Both minimise l(A) + Ω_SGL(A) (eq 2) for any parameters. Options per parameter group:
``lr`` (η), ``lam`` (λ ≥ 0), ``alpha`` (α ∈ [0, 1], the balance of element and group sparsity) and
``groups``: one integer tensor of group ids per parameter (its shape), or None to make each
parameter tensor one group. λ may be changed between steps (``group["lam"] = ...``) for the
progressive schedule of SparseNAS.

Momentum of eq 7–8: u_t = (t − 2)/(t + 1). Read literally, the first step (t = 1) would use u_1 = −1/2;
we count the first step as t = 2 so that it carries no momentum (u = 0) and u_t rises towards 1 as in
FISTA, which is the accelerated scheme eq 6–8 reformulate (Huang & Wang 2018).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from nasdiag.errors import ConfigError
from nasdiag.sparse.prox import check_number, prox_group, prox_l1


def _momentum(t: int) -> float:
    return (t - 2) / (t + 1)


def _check_options(lr: float, lam: float, alpha: float, *, scheduled: bool = False) -> None:
    for name, value in (("learning rate", lr), ("sparsity strength lam (λ)", lam), ("alpha (α)", alpha)):
        check_number(value, name)
    # a schedule may anneal η to 0 (cosine to eta_min = 0; a finished run extended stays there): a step at η = 0
    # leaves z = A and the prox the identity, so only the momentum of eq 7-8 moves A
    if not (lr >= 0 if scheduled else lr > 0) or lr == math.inf:
        raise ConfigError(f"learning rate must be a finite number > 0, got {lr}")
    if not lam >= 0 or lam == math.inf:
        raise ConfigError(f"sparsity strength lam (λ) must be a finite number >= 0, got {lam}")
    if not 0 <= alpha <= 1:
        raise ConfigError(f"alpha (α) balances element and group sparsity and must be in [0, 1], got {alpha}")


def _check_adam(betas, eps) -> None:
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ConfigError(f"Adam betas must be two numbers (β₁, β₂), got {betas!r}") from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ConfigError(f"Adam betas must be in [0, 1), got {tuple(betas)}")
    if isinstance(eps, (str, bool)) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ConfigError(f"Adam eps must be a number > 0 (it keeps the step sizes η_i finite), got {eps!r}")


def _check_group_ids(g, index: int, p: torch.Tensor) -> None:
    if not isinstance(g, torch.Tensor) or g.dtype not in (torch.int32, torch.int64):
        raise ConfigError(f"groups[{index}] must be an integer tensor of group ids, got "
                          f"{g.dtype if isinstance(g, torch.Tensor) else type(g).__name__}")
    if g.shape != p.shape:
        raise ConfigError(f"groups[{index}] has shape {tuple(g.shape)} but its parameter has {tuple(p.shape)}")
    if g.numel() and int(g.min()) < 0:
        raise ConfigError(f"groups[{index}] must hold group ids 0..G−1, got the negative id {int(g.min())}")


def _groups_of(group: dict, index: int, p: torch.Tensor) -> torch.Tensor:
    groups = group.get("groups")
    if groups is None:
        return torch.zeros(p.shape, dtype=torch.long, device=p.device)
    g = groups[index]
    if g.shape != p.shape:
        raise ConfigError(f"groups[{index}] has shape {tuple(g.shape)} but its parameter has {tuple(p.shape)}")
    return g.to(p.device).long()


class _HierarchicalProximal(torch.optim.Optimizer):
    """Eq 6–8 around a per-element gradient step ``(direction, step sizes)`` given by the subclass."""

    def __init__(self, params, defaults):
        super().__init__(params, defaults)
        inherited = [group for group in self.param_groups if defaults["groups"] is not None and
                     group.get("groups") is defaults["groups"]]
        if inherited and len(self.param_groups) > 1:
            # torch gives every dict without its own "groups" the constructor's list, indexed from its first tensor: the
            # parameters of a second group were grouped by the first group's ids (silently where the shapes agree), and
            # groups=[ids_a, ids_b] for {"params": [a]}, {"params": [b]} was refused as "1 parameters, 2 groups tensors"
            raise ConfigError(f"groups= of the constructor is one tensor per parameter of a single parameter group; with "
                              f"{len(self.param_groups)} parameter groups give each dict its own: {{'params': [...], "
                              f"'groups': [ids, ...]}} (None: each tensor one group)")
        for group in self.param_groups:
            self._check_group(group)
        self._built = True

    @staticmethod
    def _check_group(group: dict) -> None:
        _check_options(group["lr"], group["lam"], group["alpha"])
        if group.get("groups") is not None and not isinstance(group["groups"], (list, tuple)):
            # one tensor for one parameter read as the list: "groups[0] has shape (7,) but its parameter has (1, 7)"
            # of a (1, 7) tensor given for a (1, 7) parameter, and a 0-dim one was len()'s TypeError
            raise ConfigError(f"groups must be a list with one integer tensor of group ids per parameter (groups=[ids] for "
                              f"one parameter), got a {type(group['groups']).__name__}")
        if group.get("groups") is not None and len(group["groups"]) != len(group["params"]):
            raise ConfigError(f"give one groups tensor per parameter: {len(group['params'])} parameters, "
                              f"{len(group['groups'])} groups tensors")
        for i, p in enumerate(group["params"]):
            if group.get("groups") is not None:
                _check_group_ids(group["groups"][i], i, p)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with the constructor's checks. A group added after construction without its own ``groups`` has
        each tensor one group: the constructor's ``groups`` name the constructor's parameters (they were inherited
        as a default, so a tensor of the same shape was grouped as another parameter, silently)."""
        built = getattr(self, "_built", False)
        if built and "groups" not in param_group:
            param_group = dict(param_group, groups=None)
        super().add_param_group(param_group)
        if built:
            try:
                self._check_group(self.param_groups[-1])
            except ConfigError:
                self.param_groups.pop()  # nothing added
                raise

    @staticmethod
    def _check_step_options(group: dict) -> None:  # the options a step reads, which may change between steps
        _check_options(group["lr"], group["lam"], group["alpha"], scheduled=True)

    def _gradient_step(self, p, grad, state, group):  # -> (z_t, per-element step sizes η_i)
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # every group checked before any parameter moves
            self._check_step_options(group)
        for group in self.param_groups:
            lam, alpha = group["lam"], group["alpha"]
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["t"] = 1
                    state["v"] = torch.zeros_like(p)
                state["t"] += 1
                t = state["t"]
                groups = _groups_of(group, i, p)
                z, eta = self._gradient_step(p, p.grad, state, group)  # eq 6
                eta_group = self._group_step_size(eta, groups, p)
                prox = prox_group(prox_l1(z, eta * lam * alpha), eta_group * lam * (1 - alpha), groups)  # eq 5, 9, 10
                v = prox - p + _momentum(t - 1) * state["v"]  # eq 7
                p.copy_(prox + _momentum(t) * v)  # eq 8
                state["v"] = v
        return loss

    @staticmethod
    def _group_step_size(eta, groups: torch.Tensor, p: torch.Tensor):
        return eta  # one step size for all elements


class HAPG(_HierarchicalProximal):
    """Hierarchical accelerated proximal gradient (eq 6–10): z_t = A_{t−1} − η g (eq 6), then the
    composed proximal operator and the momentum of eq 7–8.

    Args:
        params: parameters or parameter groups (each may carry ``lr``, ``lam``, ``alpha``, ``groups``).
        lr: η. lam: λ. alpha: α. groups: one group-id tensor per parameter (None: each tensor one group); with
            several parameter groups (dicts) each dict gives its own ``groups``.
    """

    def __init__(self, params: Iterable, lr: float, lam: float = 0.0, alpha: float = 0.5, groups: Optional[list] = None):
        super().__init__(params, dict(lr=lr, lam=lam, alpha=alpha, groups=groups))

    def _gradient_step(self, p, grad, state, group):
        return p - group["lr"] * grad, group["lr"]


class AdamHAPG(_HierarchicalProximal):
    """AdamHAPG (sparse-supernet §"Hierarchical Proximal Optimization"): eq 6's gradient step is an Adam
    step, so every weight i has its own step size η_i = lr / (1 − β₁ᵗ) / (√(v_i/(1 − β₂ᵗ)) + ε) and
    z_t = A − η_i m_i. The ℓ1 proximal operator (eq 9) uses each weight's η_i; the group operator (eq 10)
    uses the median of the step sizes of the group (the lower median for even sizes), as the paper
    prescribes heuristically.

    Args:
        lr, betas, eps: Adam's (Kingma & Ba 2015). lam, alpha, groups: as in :class:`HAPG`.
    """

    def __init__(self, params: Iterable, lr: float = 3e-4, betas=(0.5, 0.999), eps: float = 1e-8, lam: float = 0.0,
                 alpha: float = 0.5, groups: Optional[list] = None):
        _check_adam(betas, eps)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, lam=lam, alpha=alpha, groups=groups))

    # a parameter group's own betas or eps (given in its dict, or set between steps) are checked as the constructor's:
    # betas (0.5, 1.0) or eps = 0 made NaN weights, betas (1.0, …) a ZeroDivisionError traceback
    @staticmethod
    def _check_group(group: dict) -> None:
        _HierarchicalProximal._check_group(group)
        _check_adam(group["betas"], group["eps"])

    @staticmethod
    def _check_step_options(group: dict) -> None:
        _HierarchicalProximal._check_step_options(group)
        _check_adam(group["betas"], group["eps"])

    def _gradient_step(self, p, grad, state, group):
        b1, b2 = group["betas"]
        if "m" not in state:
            state["m"] = torch.zeros_like(p)
            state["s"] = torch.zeros_like(p)
            state["adam_t"] = 0
        state["adam_t"] += 1
        n = state["adam_t"]
        # out of place: a state loaded from another optimizer's state_dict may share these tensors
        state["m"] = b1 * state["m"] + (1 - b1) * grad
        state["s"] = b2 * state["s"] + (1 - b2) * grad * grad
        eta = group["lr"] / (1 - b1**n) / ((state["s"] / (1 - b2**n)).sqrt() + group["eps"])
        return p - eta * state["m"], eta

    @staticmethod
    def _group_step_size(eta, groups: torch.Tensor, p: torch.Tensor):
        flat_groups = groups.reshape(-1)
        if not flat_groups.numel():  # an empty parameter has no group (its max() was torch's RuntimeError)
            return eta.reshape(-1)
        G = int(flat_groups.max()) + 1
        sizes = torch.bincount(flat_groups, minlength=G)
        # pad each group's step sizes into one row and take the NaN-aware median of every row at once
        order = torch.argsort(flat_groups, stable=True)
        starts = torch.cumsum(sizes, 0) - sizes
        position = torch.arange(flat_groups.numel(), device=p.device) - starts[flat_groups[order]]
        padded = torch.full((G, int(sizes.max())), float("nan"), dtype=eta.dtype, device=eta.device)
        padded[flat_groups[order], position] = eta.reshape(-1)[order]
        return padded.nanmedian(dim=1).values
