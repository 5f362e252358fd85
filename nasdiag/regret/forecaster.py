"""Forecasters over experts: XNAS (Algorithm 1) and, for comparison, GD with softmax (eq 5-6).

Every state is batched: a forecaster object holds ``shape`` independent forecasters (e.g. ``(E,)``
edges of a cell, or ``(runs,)`` Monte-Carlo runs), each over the same ``n_experts`` experts, and one
``update`` is one round for all of them at once -- no Python loop over forecasters.
Weights are kept as logarithms (``alpha = ln v``) so that long runs neither overflow nor underflow.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Mapping
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from nasdiag.regret.rewards import gd_softmax_reward
from nasdiag.regret.errors import HorizonError, RegretError, RegretTypeError

__all__ = ["Forecaster", "SoftmaxGD", "Wipeout", "WipeoutLog"]

ShapeLike = Union[int, Sequence[int], torch.Size]


class Wipeout(NamedTuple):
    """One removed expert: the round ``t`` (1-based), the expert, ``theta_t``, the forecaster's index
    within ``shape`` (``()`` for a single forecaster) and ``ln theta_t``."""

    round: int
    expert: int
    threshold: float
    forecaster: Tuple[int, ...]
    log_threshold: float


class WipeoutLog:
    """Every wipeout of a :class:`Forecaster`, one entry per removed expert (M entries, round order).

    A sequence of :class:`Wipeout` entries (``len``, indexing, iteration) that also exposes each field
    as a column tensor:

    Attributes:
        round: ``(M,)`` int64, the round ``t`` (1-based, as in Algorithm 1) of the removal.
        expert: ``(M,)`` int64, the removed expert.
        forecaster: ``(M, len(shape))`` int64, the index of the forecaster within ``shape``.
        log_threshold: ``(M,)`` ``ln theta_t`` (Algorithm 1 line 11), in the units of
            :attr:`Forecaster.log_weights` (``ln v`` with ``v_0 = 1``).
        threshold: ``(M,)`` ``theta_t`` itself; underflows to 0 where ``log_threshold`` < -745 (float64).
        log_weight: ``(M,)`` ``ln v_{t,i}`` of the removed expert, below ``log_threshold``.
    """

    def __init__(self, round, expert, forecaster, log_threshold, log_weight):
        self.round, self.expert, self.forecaster = round, expert, forecaster
        self.log_threshold, self.log_weight = log_threshold, log_weight

    @property
    def threshold(self) -> torch.Tensor:
        return self.log_threshold.exp()

    def __len__(self) -> int:
        return int(self.round.shape[0])

    def __getitem__(self, k: int) -> Wipeout:
        if not -len(self) <= k < len(self):
            raise IndexError(f"wipeout log has {len(self)} entries, no entry {k}")
        return Wipeout(int(self.round[k]), int(self.expert[k]), float(self.threshold[k]),
                       tuple(self.forecaster[k].tolist()), float(self.log_threshold[k]))

    def __iter__(self) -> Iterator[Wipeout]:
        return (self[k] for k in range(len(self)))

    def __repr__(self) -> str:
        return f"WipeoutLog({list(self)!r})"


def _as_shape(shape: ShapeLike) -> torch.Size:
    if isinstance(shape, int):
        shape = (shape,)
    try:
        size = torch.Size(tuple(int(s) for s in shape))
        if any(isinstance(s, bool) or s != n for s, n in zip(shape, size)):  # int(2.5) = 2: a forecaster lost
            raise TypeError
    except (TypeError, ValueError) as err:
        raise RegretTypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from err
    if any(s < 0 for s in size):
        raise RegretError(f"shape must have non-negative sizes, got {tuple(size)}")
    return size


def _positive(name: str, value, *, integer: bool = False, allow_inf: bool = False):
    try:  # int(None), float("fast"): the builtin messages do not name the argument
        if integer:
            if isinstance(value, bool) or int(value) != value:
                raise RegretTypeError(f"{name} must be an integer, got {value!r}")
            value = int(value)
        else:
            value = float(value)
    except (TypeError, ValueError, OverflowError) as err:
        if isinstance(err, RegretError):
            raise
        kind = "an integer" if integer else "a number"
        raise (RegretTypeError if isinstance(err, TypeError) else RegretError)(f"{name} must be {kind}, got {value!r}") from None
    if not (value > 0) or (not integer and math.isinf(value) and not allow_inf):  # isinf of an int past 1e308 overflows
        raise RegretError(f"{name} must be a {'positive' if not allow_inf else 'positive (or inf)'} "
                         f"{'integer' if integer else 'finite number'}, got {value!r}")
    return value


def _check_state_shapes(state: dict, shapes: dict) -> None:
    """Refuse a state whose entries are missing or do not have this forecaster's shapes (a corrupt or edited state
    would otherwise be loaded and break, or silently broadcast, at a later update)."""
    for key, shape in shapes.items():
        if key not in state:
            raise RegretError(f"the state has no {key!r}; pass a Forecaster.state_dict() of this configuration")
        got = tuple(torch.as_tensor(state[key]).shape)
        if got != tuple(shape):
            raise RegretError(f"the state's {key} has shape {got}, this forecaster's is {tuple(shape)}; the state is corrupt")


class _RegretTally:
    """Cumulative linearized losses ``l'_t(.) = -R_t`` (eq 18-19) and the regret of eq 31 / 32.

    ``forecaster_reward`` (shape ``shape``) accumulates ``sum_t u_{t-1} . R_t`` (mixture *before* round
    t's update); ``expert_reward`` (shape ``shape + (N,)``) accumulates ``sum_t R_{t,i}`` for every
    expert. A non-finite reward of an expert that is not in the mixture (wiped out, e.g. an op no longer
    computed) makes that expert's hindsight total unknown (NaN); it is then left out of the minimum.
    Forecasters in ``skip`` sit the round out: nothing is added to their totals.
    """

    def __init__(self, shape: torch.Size, n_experts: int, dtype: torch.dtype, device):
        self.forecaster_reward = torch.zeros(shape, dtype=dtype, device=device)
        self.expert_reward = torch.zeros(shape + (n_experts,), dtype=dtype, device=device)

    def add(self, mixture_weights: torch.Tensor, rewards: torch.Tensor, all_finite: bool,
            skip: Optional[torch.Tensor] = None) -> None:
        if not all_finite:
            finite = torch.isfinite(rewards)
            rewards_in_mixture = torch.where(finite, rewards, 0.0)
            rewards = torch.where(finite, rewards, math.nan)
        else:
            rewards_in_mixture = rewards
        forecaster_reward = (mixture_weights * rewards_in_mixture).sum(-1)
        if skip is not None:
            forecaster_reward = forecaster_reward.masked_fill(skip, 0.0)
            rewards = rewards.masked_fill(skip.unsqueeze(-1), 0.0)
        self.forecaster_reward += forecaster_reward
        self.expert_reward += rewards

    def regret(self, among: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Eq 31 with the minimum over every expert whose total is known, or only over ``among`` (bool,
        ``shape + (N,)``)."""
        unknown = torch.isnan(self.expert_reward)
        if among is not None:
            unknown = unknown | ~among
        return self.expert_reward.masked_fill(unknown, -math.inf).amax(-1) - self.forecaster_reward


class _ExpertsState:
    """What XNAS and GD with softmax share: shapes, ``alpha = ln v``, the regret tally."""

    def __setattr__(self, name, value):
        if name == "lr":  # SoftmaxGD's may follow a schedule: a negative or NaN eta would still be refused
            value = _positive("lr", value)
        super().__setattr__(name, value)

    def __init__(self, n_experts, lr, shape, init_log_weights, dtype, device):
        self.n_experts = _positive("n_experts", n_experts, integer=True)
        self.lr = _positive("lr", lr)
        self.shape = _as_shape(shape)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise RegretTypeError(f"dtype must be a floating-point dtype, got {dtype}")
        self.dtype, self.device = dtype, torch.device(device) if device is not None else torch.device("cpu")
        full = self.shape + (self.n_experts,)
        if init_log_weights is None:
            # Algorithm 1 line 2: v_0 = 1, i.e. alpha_0 = 0.
            log_v = torch.zeros(full, dtype=dtype, device=self.device)
            self._uniform_init = True
        else:
            # detached: ln v_0 taken from a network's alpha (a Parameter) would chain every round onto its graph
            try:
                log_v = torch.as_tensor(init_log_weights, dtype=dtype, device=self.device).detach()
            except (TypeError, ValueError) as err:  # torch's "new(): invalid data type 'str'" names no argument
                raise RegretTypeError(f"init_log_weights must be a tensor (or nested lists) of numbers, ln v_0, got "
                                      f"{init_log_weights!r:.80}") from None
            try:
                log_v = log_v.expand(full).clone()
            except RuntimeError as err:
                raise RegretError(
                    f"init_log_weights must broadcast to shape + (n_experts,) = {tuple(full)}, "
                    f"got {tuple(log_v.shape)}"
                ) from err
            if not torch.isfinite(log_v).all():
                raise RegretError("init_log_weights must be finite (ln v_0 of every expert)")
            self._uniform_init = bool((log_v == log_v[..., :1]).all())
        self._log_v = log_v
        self._rounds = 0
        self._tally = _RegretTally(self.shape, self.n_experts, dtype, self.device)

    @staticmethod
    def _all_finite(rewards: torch.Tensor) -> bool:
        # One reduction instead of an elementwise pass: a NaN/inf anywhere makes the sum non-finite;
        # a finite overflow of the sum only sends us to the exact elementwise check.
        return bool(torch.isfinite(rewards.sum())) or bool(torch.isfinite(rewards).all())

    def _checked_rewards(self, rewards) -> torch.Tensor:
        if not isinstance(rewards, torch.Tensor):  # Python floats straight to the state's dtype, not via torch's float32
            try:
                rewards = torch.as_tensor(rewards, dtype=self.dtype, device=self.device)
            except (TypeError, ValueError, RuntimeError):
                raise RegretTypeError(f"rewards must be a tensor (or nested lists) of numbers, got {rewards!r}") from None
        expected = self.shape + (self.n_experts,)
        if rewards.shape != expected:
            raise RegretError(
                f"rewards must have shape shape + (n_experts,) = {tuple(expected)}, got "
                f"{tuple(rewards.shape)}; one update is one round for every forecaster"
            )
        # detached: a forecaster is state, and a graph kept across rounds would grow without end
        return rewards.detach().to(dtype=self.dtype, device=self.device)

    @property
    def rounds(self) -> int:
        """Number of rounds ``t`` played so far."""
        return self._rounds

    @property
    def log_weights(self) -> torch.Tensor:
        """``(*shape, N)`` ``alpha_t = ln v_t`` (``v_0 = 1`` unless initialized otherwise); ``-inf``
        for wiped-out experts."""
        return self._log_v.clone()

    @property
    def weights(self) -> torch.Tensor:
        """``(*shape, N)`` mixture weights ``u_t = v_t / sum v_t`` (eq 1), 0 for wiped-out experts."""
        return torch.softmax(self._log_v, dim=-1)

    @property
    def forecaster_loss(self) -> torch.Tensor:
        """``(*shape,)`` ``sum_t l'_t(p_t) = -sum_t u_{t-1} . R_t`` (eq 18), mixture before each update."""
        return -self._tally.forecaster_reward

    @property
    def expert_losses(self) -> torch.Tensor:
        """``(*shape, N)`` ``L'_{t,i} = -sum_s R_{s,i}`` (eq 19); NaN where a wiped-out expert was
        given a non-finite reward."""
        return -self._tally.expert_reward

    @property
    def regret(self) -> torch.Tensor:
        """``(*shape,)`` cumulative linearized regret ``sum_t l'_t(p_t) - min_i L'_{t,i}`` (eq 31),
        which upper-bounds the regret of eq 2 for convex losses (eq 32) and equals it for the linear
        losses of the toy and statistical settings (§8).

        The minimum runs over all N experts, wiped-out ones included (eq 2 and eq 31: ``i = 1..N``), with
        the rewards given to them after their removal; an expert given a NaN reward (its prediction not
        computed) is left out, its total being unknown. See ``Forecaster.survivor_regret``."""
        return self._tally.regret()

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Everything that evolves with the rounds (``ln v``, the round count, the regret tally) and the
        configuration it belongs to; :meth:`load_state_dict` continues bit-identically."""
        return {
            "config": self._config(),
            "log_weights": self._log_v.clone(),
            "rounds": self._rounds,
            "uniform_init": self._uniform_init,
            "forecaster_reward": self._tally.forecaster_reward.clone(),
            "expert_reward": self._tally.expert_reward.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` of a forecaster with the same configuration (else ValueError)."""
        if not isinstance(state, Mapping):
            raise RegretError(f"a state is the dict of {type(self).__name__}.state_dict(), got {type(state).__name__}")
        theirs = state.get("config", {})
        if not isinstance(theirs, Mapping):
            raise RegretError(f"the state's config is {theirs!r:.80}, not a {type(self).__name__}'s; the state is corrupt")
        mine, theirs = self._config(), dict(theirs)
        if mine != theirs:
            diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
            raise RegretError(f"this state belongs to a forecaster configured differently (saved, current): {diff}")
        self._check_state(state)  # before anything is loaded
        as_state = lambda t: torch.as_tensor(t).detach().to(dtype=self.dtype, device=self.device).clone()  # noqa: E731
        self._log_v = as_state(state["log_weights"])
        self._rounds = int(state["rounds"])
        self._uniform_init = bool(state["uniform_init"])
        self._tally.forecaster_reward = as_state(state["forecaster_reward"])
        self._tally.expert_reward = as_state(state["expert_reward"])

    def _check_state(self, state: dict) -> None:
        """Refuse a state with an entry missing or malformed before anything is loaded (a truncated or edited state
        would otherwise be half loaded and fail with a bare KeyError, or load a round count the update cannot use)."""
        _check_state_shapes(state, self._state_shapes())
        for key in ("rounds", "uniform_init"):
            if key not in state:
                raise RegretError(f"the state has no {key!r}; pass a {type(self).__name__}.state_dict() of this configuration")
        try:
            rounds = operator.index(state["rounds"])
        except TypeError:
            rounds = None
        if rounds is None or not 0 <= rounds <= self._max_rounds():
            raise RegretError(f"the state's rounds is {state['rounds']!r}, not a round count in [0, {self._max_rounds()}]; "
                              "the state is corrupt")

    def _max_rounds(self) -> float:
        return math.inf

    def _config(self) -> dict:
        return {"kind": type(self).__name__, "n_experts": self.n_experts, "lr": self.lr, "shape": tuple(self.shape)}

    def _state_shapes(self) -> dict:
        """The shape of every tensor of :meth:`state_dict` that :meth:`load_state_dict` checks."""
        full = tuple(self.shape) + (self.n_experts,)
        return {"log_weights": full, "forecaster_reward": tuple(self.shape), "expert_reward": full}


class Forecaster(_ExpertsState):
    """XNAS forecasters (Algorithm 1): EG step and wipeout, batched over ``shape``.

    Args:
        n_experts: N, experts (candidate ops) per forecaster.
        lr: the learning rate eta (see :meth:`optimal_lr`, eq 4).
        loss_bound: L, the bound on ``|R_{t,i}|`` (eq 20); enters the wipeout threshold.
        horizon: T, the number of rounds the thresholds plan for; more updates raise.
        zeta: relaxation of the wipeout threshold (§3.2.2): ``theta_t = max_i v_{t,i}
            exp(-2 eta L (T - t) zeta)``. ``zeta = 1`` is Algorithm 1; Lemma 1 and Theorem 1 hold
            for any ``zeta >= 1`` (a later wipeout); ``zeta < 1`` wipes out sooner, and eq 3 then bounds only :attr:`survivor_regret` (see :meth:`bound`).
            ``zeta = math.inf`` disables the wipeout (plain EG).
        shape: the batch of independent forecasters, e.g. ``(E,)`` for the edges of a cell.
        init_log_weights: optional ``ln v_0`` broadcastable to ``shape + (N,)``; default 0
            (Algorithm 1 line 2). A non-uniform start voids Lemma 1 and eq 3 (:meth:`bound` raises).
        dtype, device: of the state; float64 by default.

    ``lr``, ``loss_bound``, ``horizon`` and ``zeta`` are fixed for the run (an assignment raises RegretError): the
    thresholds of line 11 and eq 3 assume one value from round 1 to T. All tensors are detached state; no autograd
    flows through a forecaster.
    """

    def __init__(
        self,
        n_experts: int,
        lr: float,
        loss_bound: float,
        horizon: int,
        zeta: float = 1.0,
        shape: ShapeLike = (),
        *,
        init_log_weights: Optional[torch.Tensor] = None,
        dtype: torch.dtype = torch.float64,
        device=None,
    ):
        super().__init__(n_experts, lr, shape, init_log_weights, dtype, device)
        self.loss_bound = _positive("loss_bound", loss_bound)
        self.horizon = _positive("horizon", horizon, integer=True)
        self.zeta = _positive("zeta", zeta, allow_inf=True)
        self._alive = torch.ones(self.shape + (self.n_experts,), dtype=torch.bool, device=self.device)
        self._log_gamma = torch.zeros(self.shape, dtype=dtype, device=self.device)
        #: (*shape,) the largest |ln v| of an alive expert so far: the scale of the rounding in ln v (see _wipe_out)
        self._peak = self._log_v.abs().amax(-1)
        self._bound_violations = torch.zeros(self.shape, dtype=torch.int64, device=self.device)
        self._wipeouts: List[dict] = []  # one dict of column tensors per round with removals

    _FIXED = ("lr", "loss_bound", "horizon", "zeta")

    def __setattr__(self, name, value):
        # Algorithm 1 plays one eta, L, T and zeta from round 1 to T: the thresholds (line 11) weigh a gap of ln v summed
        # under the old eta against the margin of the new one (an eta lowered mid-run wipes out the best expert in
        # hindsight, Lemma 1), and bound() would put the last eta into eq 3 for every round
        if name in self._FIXED and name in self.__dict__:
            raise RegretError(f"a Forecaster's {name} is fixed for its run (Algorithm 1, Lemma 1 and eq 3 assume one {name} "
                              f"from round 1 to T); create a new Forecaster with {name}={value!r} for a new run")
        super().__setattr__(name, value)

    # ---------------------------------------------------------------- theory
    @staticmethod
    def optimal_lr(T: int, L: float, N: int) -> float:
        """``eta* = sqrt(2 ln N / (T L^2))``, the minimizer of the first two terms of eq 3 (eq 4).

        With ``eta*``, eq 3 becomes ``L sqrt(2 T ln N) (1 - ln gamma_T / (2 ln N))`` (eq 4).
        Callable on the class (``Forecaster.optimal_lr(T, L, N)``) and on instances. Computed without
        underflow or overflow of ``T L^2``; an ``eta*`` itself outside the float range raises RegretError.
        """
        T = _positive("T", T, integer=True)
        L = _positive("L", L)
        N = _positive("N", N, integer=True)
        if N < 2:
            raise RegretError("eta* needs N >= 2 experts: with one expert ln N = 0 and there is nothing to select")
        try:
            scale = T * L * L
        except OverflowError:  # T past the float range
            scale = math.inf
        if sys.float_info.min <= scale < math.inf:
            return math.sqrt(2.0 * math.log(N) / scale)
        # T L^2 underflows (L = 1e-200: a ZeroDivisionError, or digits lost in a subnormal) or overflows (eta* = 0):
        # the same eta* in log space, and one error where it is itself outside the float range
        log_eta = 0.5 * (math.log(2.0 * math.log(N)) - math.log(T)) - math.log(L)
        eta = math.exp(log_eta) if log_eta < math.log(sys.float_info.max) else math.inf
        if not sys.float_info.min <= eta < math.inf:
            raise RegretError(f"eta* = sqrt(2 ln N / (T L^2)) is {eta:.3g} for T = {T}, L = {L:.3g}, N = {N}, outside the "
                              "float range; rescale the rewards so that L is nearer 1")
        return eta

    def bound(self) -> torch.Tensor:
        """``(*shape,)`` the regret bound of Theorem 1 (eq 3) after the rounds played so far:
        ``eta t L^2 / 2 + (ln N - ln gamma_t) / eta``.

        Eq 3 is stated at the horizon, but its proof (eq 23-31) holds at every ``t <= T``: the
        per-round bound (27) is unconditional, and Lemma 1's argument with ``t`` in place of ``T``
        shows the best expert in hindsight at ``t`` is still alive then, because the threshold uses
        ``T - s >= t - s``. The guarantee needs ``|R| <= L`` for the experts in the mixture (see
        :attr:`bound_violations`) and the uniform start of Algorithm 1. It then bounds
        :attr:`survivor_regret` for every ``zeta`` (the lower bound (23) with the minimum over ``I_t``
        needs no Lemma 1, and (24)-(30) hold for any thresholds), and :attr:`regret` (eq 2, every
        expert) when ``zeta >= 1`` and the rewards given to wiped-out experts are within L as well
        (Lemma 1: the two regrets are then equal). With ``zeta < 1`` a wiped-out expert may end up best
        in hindsight and :attr:`regret` may exceed the bound, "the price of a violation of the
        theoretical regret" (§3.2.2).
        """
        if not self._uniform_init:
            raise RegretError(
                "eq 3 assumes the uniform start v_0 = 1 of Algorithm 1 (line 2); this forecaster was "
                "created with non-uniform init_log_weights, for which Lemma 1 and the bound do not hold"
            )
        t, eta, L = self._rounds, self.lr, self.loss_bound
        return eta * t * L * L / 2.0 + (math.log(self.n_experts) - self._log_gamma) / eta

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Adds the alive set, ``ln gamma``, the bound violations and the wipeout log to the base state."""
        state = super().state_dict()
        state.update(alive=self._alive.clone(), log_gamma=self._log_gamma.clone(),
                     bound_violations=self._bound_violations.clone(), peak=self._peak.clone(),
                     wipeouts=[{k: v.clone() for k, v in entry.items()} for entry in self._wipeouts])
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._alive = torch.as_tensor(state["alive"]).to(dtype=torch.bool, device=self.device).clone()
        self._log_gamma = torch.as_tensor(state["log_gamma"]).detach().to(dtype=self.dtype, device=self.device).clone()
        self._bound_violations = torch.as_tensor(state["bound_violations"]).to(dtype=torch.int64, device=self.device).clone()
        if "peak" in state:
            self._peak = torch.as_tensor(state["peak"]).detach().to(dtype=self.dtype, device=self.device).clone()
        else:  # a state saved before the peak was kept: the present |ln v|, the scale the slack used then
            self._peak = self._log_v.masked_fill(~self._alive, 0.0).abs().amax(-1)
        self._wipeouts = [{k: v.detach().to(self.device).clone() for k, v in entry.items()} for entry in state["wipeouts"]]

    def _check_state(self, state: dict) -> None:
        super()._check_state(state)
        if "wipeouts" not in state:
            raise RegretError("the state has no 'wipeouts'; pass a Forecaster.state_dict() of this configuration")
        columns = {"round", "expert", "forecaster", "log_threshold", "log_weight"}
        if not isinstance(state["wipeouts"], (list, tuple)) or not all(
                isinstance(entry, Mapping) and columns <= set(entry) for entry in state["wipeouts"]):
            raise RegretError(f"the state's wipeouts must be a list of dicts with the columns {sorted(columns)}; the state "
                              "is corrupt")
        if "peak" in state:  # the scale of the wipeout's slack: a NaN one would never wipe out, a negative one too soon
            peak = torch.as_tensor(state["peak"])
            if tuple(peak.shape) != tuple(self.shape) or not bool((torch.isfinite(peak) & (peak >= 0)).all()):
                raise RegretError(f"the state's peak must be finite and >= 0 of shape {tuple(self.shape)}, got "
                                  f"{peak.dtype} of shape {tuple(peak.shape)}; the state is corrupt")
        if not torch.as_tensor(state["alive"]).to(torch.bool).any(-1).all():
            raise RegretError("the state has a forecaster with every expert wiped out (Lemma 1 keeps the best one); the "
                              "state is corrupt")

    def _max_rounds(self) -> float:
        return self.horizon

    def _config(self) -> dict:
        return {**super()._config(), "loss_bound": self.loss_bound, "horizon": self.horizon, "zeta": self.zeta}

    def _state_shapes(self) -> dict:
        return {**super()._state_shapes(), "alive": tuple(self.shape) + (self.n_experts,), "log_gamma": tuple(self.shape),
                "bound_violations": tuple(self.shape)}

    @property
    def alive(self) -> torch.Tensor:
        """``(*shape, N)`` bool, the experts not wiped out (``I_t`` of eq 21)."""
        return self._alive.clone()

    @property
    def log_gamma(self) -> torch.Tensor:
        """``(*shape,)`` ``ln gamma_t = sum_s ln Gamma_s`` (eq 28), >= 0."""
        return self._log_gamma.clone()

    @property
    def gamma(self) -> torch.Tensor:
        """``(*shape,)`` the aggregated wipeout factor ``gamma_t = prod_s Gamma_s`` (eq 28);
        ``1 <= gamma_T < N`` by Lemma 2."""
        return self._log_gamma.exp()

    @property
    def survivor_regret(self) -> torch.Tensor:
        """``(*shape,)`` eq 31 against the experts still alive: ``sum_t l'_t(p_t) - min_{i in I_t} L'_{t,i}``.

        What a search can know when wiped-out ops are no longer computed. Equal to :attr:`regret` for
        ``zeta >= 1`` and rewards within L (Lemma 1 at t: the best expert in hindsight is alive); for
        ``zeta < 1`` a lower bound of it. Eq 3 (:meth:`bound`) bounds it for every ``zeta``.
        """
        return self._tally.regret(among=self._alive)

    @property
    def bound_violations(self) -> torch.Tensor:
        """``(*shape,)`` int64, how many rewards of alive experts had ``|R| > L`` so far. Any
        violation voids Lemma 1 and Theorem 1 for that forecaster; nothing is clipped. Rewards given to
        experts already wiped out are not counted: beyond L they void only Lemma 1's step (10), so
        :attr:`regret` (every expert) may exceed :meth:`bound` while :attr:`survivor_regret` may not."""
        return self._bound_violations.clone()

    @property
    def wipeout_log(self) -> WipeoutLog:
        """Every wipeout so far (round, expert, threshold, forecaster index), in round order."""
        columns = ("round", "expert", "forecaster", "log_threshold", "log_weight")
        if not self._wipeouts:
            i64 = dict(dtype=torch.int64, device=self.device)
            f = dict(dtype=self.dtype, device=self.device)
            return WipeoutLog(torch.zeros(0, **i64), torch.zeros(0, **i64), torch.zeros(0, len(self.shape), **i64),
                              torch.zeros(0, **f), torch.zeros(0, **f))
        return WipeoutLog(**{c: torch.cat([entry[c] for entry in self._wipeouts]) for c in columns})

    # ---------------------------------------------------------------- update
    def update(self, rewards: torch.Tensor, *, skip: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Play one round of Algorithm 1 for every forecaster.

        Args:
            rewards: ``(*shape, N)`` rewards ``R_t`` (e.g. :func:`~nasdiag.regret.xnas_reward` of the
                probe's cost). Rewards of experts already wiped out are ignored by the update (they
                may be NaN: unknown, left out of :attr:`regret`); those of alive experts must be
                finite, except in the forecasters that ``skip`` the round.
            skip: optional ``(*shape,)`` bool, forecasters that sit this round out (e.g. a non-finite
                reward of an alive expert, :meth:`skip_nonfinite`): no EG step and nothing added to
                their regret tallies or bound violations, as if every expert had got the same reward
                (EG is unchanged by a common shift). The round still counts for them -- t advances for
                every forecaster, so the thresholds keep to the horizon T -- and their wipeout (lines
                11-12) runs with the unchanged weights.

        Returns:
            ``(*shape, N)`` bool, the experts wiped out in this round.

        Raises:
            RegretError: a non-finite reward of an alive expert of a forecaster not in ``skip`` (it
                would corrupt the weights for good), or a finite one whose EG step overflows ``ln v``
                (``|ln v + eta R|`` past the dtype's range); nothing is changed.

        The round: record ``u_{t-1} . R_t`` for the regret (the mixture ``p_t`` predicts *before* the
        update, line 5), EG step ``v <- v exp(eta R)`` (line 9), threshold ``theta_t = max v
        exp(-2 eta L (T - t) zeta)`` (line 11), removal of every ``v < theta_t`` (line 12).
        """
        rewards = self._checked_rewards(rewards)
        skip = self._checked_skip(skip)
        if self._rounds >= self.horizon:
            raise HorizonError(
                f"this Forecaster has played its horizon T = {self.horizon} rounds; the wipeout "
                "thresholds depend on T - t, so create it with the horizon you need"
            )
        t = self._rounds + 1
        alive = self._alive
        all_finite = self._all_finite(rewards)
        if not all_finite:
            bad = alive & ~torch.isfinite(rewards)
            if skip is not None:
                bad &= ~skip.unsqueeze(-1)
            if bad.any():
                where = tuple(bad.nonzero()[0].tolist())
                raise RegretError(
                    f"round {t}: {int(bad.sum())} non-finite rewards of alive experts (first at index "
                    f"{where}); a NaN/inf cost would corrupt the weights for good -- skip those forecasters' "
                    "round (update(rewards, skip=forecaster.skip_nonfinite(rewards))) or fix the cost upstream"
                )
        playing = alive if skip is None else alive & ~skip.unsqueeze(-1)
        log_v = torch.where(playing, self._log_v + self.lr * rewards, self._log_v).masked_fill(~alive, -math.inf)
        if not self._all_finite(log_v.masked_fill(~alive, 0.0)):
            # finite rewards whose EG step leaves the range of ln v (|ln v| past the dtype's largest number): the
            # weights u = softmax(ln v) would be NaN from now on, with no error
            where = tuple((alive & ~torch.isfinite(log_v)).nonzero()[0].tolist())
            raise RegretError(
                f"round {t}: the EG step ln v + eta R overflows {self.dtype} (first at index {where}, reward "
                f"{float(rewards[where]):.3g}, eta {self.lr:.3g}); nothing was changed -- rewards this large are not "
                "losses of a bounded scale L: clip or rescale them (the search clips them to L)"
            )
        self._tally.add(self.weights, rewards, all_finite, skip)
        self._bound_violations += (playing & (rewards.abs() > self.loss_bound)).sum(-1)
        self._peak = torch.maximum(self._peak, log_v.masked_fill(~alive, 0.0).abs().amax(-1))
        wiped = self._wipe_out(log_v, t)
        self._rounds = t
        return wiped

    def skip_nonfinite(self, rewards: torch.Tensor) -> torch.Tensor:
        """``(*shape,)`` bool, the forecasters in which an alive expert has a non-finite reward in
        ``rewards`` (``(*shape, N)``): the ``skip`` of :meth:`update` that plays every other
        forecaster's round and leaves these as they are, instead of raising."""
        return (self._alive & ~torch.isfinite(self._checked_rewards(rewards))).any(-1)

    def _checked_skip(self, skip) -> Optional[torch.Tensor]:
        if skip is None:
            return None
        try:
            skip = torch.as_tensor(skip, device=self.device)
        except (TypeError, ValueError, RuntimeError):
            raise RegretTypeError(f"skip must be a bool tensor of the forecasters' shape {tuple(self.shape)}, got "
                                  f"{skip!r:.80}") from None
        if skip.dtype != torch.bool or skip.shape != self.shape:
            raise RegretError(f"skip must be a bool tensor of the forecasters' shape {tuple(self.shape)}, got "
                              f"{skip.dtype} of shape {tuple(skip.shape)}")
        return skip

    def _wipe_out(self, log_v: torch.Tensor, t: int) -> torch.Tensor:
        alive = self._alive
        if math.isinf(self.zeta):
            self._log_v = log_v
            return torch.zeros_like(alive)
        log_max = log_v.amax(-1, keepdim=True)
        margin = 2.0 * self.lr * self.loss_bound * (self.horizon - t) * self.zeta
        log_threshold = log_max - margin
        # Why a slack: the proof of Lemma 1 reaches equality (a best expert that first loses L then
        # gains L sits exactly on theta_t), and ln v is a sum of t rounded products eta*R, so rounding
        # alone could wipe out the best expert. Each of the t additions rounds by up to an ulp of the partial
        # sum, so the slack scales with the largest |ln v| of the run (the peak), not the present one: an expert
        # that gains and then loses as much is back near 0 with the rounding of its peak (with |max ln v| here,
        # T = 100, eta = 100, |R| <= L = 1: the best in hindsight wiped out at T). ~1e-12 relative for float64
        # runs of thousands of rounds.
        eps = torch.finfo(self.dtype).eps
        slack = 8.0 * eps * (t + 1) * (self._peak.unsqueeze(-1) + margin + 1.0)
        wiped = alive & (log_v < log_threshold - slack)
        if wiped.any():
            survivors = alive & ~wiped
            log_wiped_mass = torch.logsumexp(log_v.masked_fill(~wiped, -math.inf), dim=-1)
            log_kept_mass = torch.logsumexp(log_v.masked_fill(~survivors, -math.inf), dim=-1)
            # eq 28: Gamma_t = 1 + (mass wiped at t) / (mass kept at t); log1p keeps ln Gamma >= 0.
            self._log_gamma += torch.log1p(torch.exp(log_wiped_mass - log_kept_mass))
            index = wiped.nonzero()
            self._wipeouts.append(
                {
                    "round": torch.full((index.shape[0],), t, dtype=torch.int64, device=self.device),
                    "expert": index[:, -1],
                    "forecaster": index[:, :-1],
                    "log_threshold": log_threshold.expand_as(log_v)[wiped],
                    "log_weight": log_v[wiped],
                }
            )
            log_v = log_v.masked_fill(wiped, -math.inf)
            self._alive = survivors
        self._log_v = log_v
        return wiped


class SoftmaxGD(_ExpertsState):
    """GD with softmax, the DARTS-style update XNAS is compared with (§3.2.1, eq 5-6).

    ``alpha <- alpha - eta d l / d alpha = alpha + eta R~`` with the effective reward ``R~`` of eq 6
    (:func:`~nasdiag.regret.gd_softmax_reward`), so ``v <- v exp(eta R~)`` (eq 5). No wipeout.

    Args:
        n_experts: N.
        lr: eta.
        shape: batch of independent forecasters.
        init_log_weights: optional ``alpha_0`` broadcastable to ``shape + (N,)``; default 0.
        dtype, device: of the state; float64 by default.
    """

    def __init__(
        self,
        n_experts: int,
        lr: float,
        shape: ShapeLike = (),
        *,
        init_log_weights: Optional[torch.Tensor] = None,
        dtype: torch.dtype = torch.float64,
        device=None,
    ):
        super().__init__(n_experts, lr, shape, init_log_weights, dtype, device)

    def update(self, rewards: torch.Tensor) -> torch.Tensor:
        """One GD step for every forecaster from the XNAS rewards ``R_t`` (``(*shape, N)``, finite).

        Raises RegretError, changing nothing, for a non-finite reward or one whose step overflows ``alpha``.

        Returns:
            ``(*shape, N)`` the effective rewards ``R~_t`` of eq 6 that were applied.
        """
        rewards = self._checked_rewards(rewards)
        if not self._all_finite(rewards):
            raise RegretError(
                f"round {self._rounds + 1}: non-finite rewards; fix or flag the cost upstream before updating"
            )
        weights = self.weights
        effective = gd_softmax_reward(rewards, weights)
        log_v = self._log_v + self.lr * effective
        if not self._all_finite(log_v):  # as in Forecaster.update: u would be NaN from now on, with no error
            raise RegretError(
                f"round {self._rounds + 1}: the GD step alpha + eta R~ overflows {self.dtype}; nothing was changed -- "
                "rewards this large are not losses of a bounded scale: clip or rescale them"
            )
        self._tally.add(weights, rewards, True)
        self._log_v = log_v
        self._rounds += 1
        return effective
