"""The method contract: what every search method offers to `nasdiag.search.run`, the CLI and the recorder.

A method is one file: a `SearchMethod` subclass with a nested ``Hyperparameters`` dataclass,
decorated with ``@nasdiag.search.register("name")``. It owns its update rule and its state and
nothing else; data, device, DDP, checkpoints and records belong to `nasdiag.search.run`.

The contract separates two things that DARTS happens to make equal:

- the **forward relaxation**, :meth:`SearchMethod.forward_weights`: the mixing weights Z the training
  forward uses (softmax(α) for DARTS, a Gumbel-softmax or one-hot sample for SNAS/DSNAS, binary gates
  for ProxylessNAS, EG weights for XNAS, linear A for SparseNAS);
- the **architecture distribution**, :meth:`SearchMethod.probabilities`: what the genotype and the
  ``arch/<cell>/probabilities`` records are derived from (the supernet evaluation after each epoch runs at
  :meth:`SearchMethod.eval_weights`, by default the same).

Every method is built on the cost primitive of the wiring supplement (§2): :meth:`SearchMethod.cost`
runs one forward/backward with per-cell Z leaves and returns C = ∂L/∂Z once per step; each method's
architecture gradient is a map of it (``nasdiag.cost.darts_alpha_grad`` and friends, XNAS rewards −C).
"""

from __future__ import annotations

import math
import numbers
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from nasdiag.cost import CostMoments
from nasdiag.errors import ConfigError, NasdiagError
from nasdiag.hooks import has_module_hooks
from nasdiag.search.hyperparameters import Hyperparameters
from nasdiag.supernet import Genotype, derive_genotype

Batch = Tuple[torch.Tensor, torch.Tensor]
CellWeights = Dict[str, torch.Tensor]
#: the largest seed a method takes: its generator is seeded with seed + 7919, at most 2⁶⁴ − 1 for torch
MAX_METHOD_SEED = 2 ** 64 - 1 - 7919


class SearchError(NasdiagError, RuntimeError):
    """A search cannot go on (a NaN loss, every op of an edge removed, a bad supernet)."""


def nonfinite_loss_error(message: str, stats: Mapping[str, torch.Tensor]) -> SearchError:
    """The `SearchError` of a NaN/inf loss, raised before the step updates anything with it. It carries the step's
    statistics (``err.statistics``) with ``scalars/nonfinite_loss`` = 1, so the run records the failing row,
    flagged, before it stops (``nasdiag.search.runner.search_loop``)."""
    err = SearchError(message)
    # in the loss's dtype and on its device (the row is reduced over DDP ranks there)
    like = next((v for v in stats.values() if torch.is_tensor(v) and v.is_floating_point()), torch.ones(()))
    err.statistics = {**stats, "scalars/nonfinite_loss": torch.ones((), dtype=like.dtype, device=like.device)}
    return err


def loss_text(loss) -> str:
    """The value of a loss a `nonfinite_loss_error` message names (several as ``a / b``). A rank stopped by another DDP
    rank's NaN (`finite_on_every_rank`) has a finite loss of its own: its message said 'the search-val loss is 2.387
    (not finite)'; it now says the loss is finite on this rank and not on another."""
    values = torch.as_tensor(loss).detach().reshape(-1).tolist()
    text = " / ".join(str(float(v)) for v in values)
    if all(math.isfinite(v) for v in values):
        text += " on this rank, not finite on another DDP rank"
    return text


@contextmanager
def failing_row(stats: Dict[str, torch.Tensor]):
    """Around a step's updates: a NaN-loss `SearchError` raised inside (one carrying ``statistics``) also carries
    what ``stats`` holds by then (the step's learning rate, the losses before the failing one)."""
    try:
        yield
    except SearchError as err:
        if getattr(err, "statistics", None) is not None:
            err.statistics = {**stats, **err.statistics}
        raise


def check_batch(network, batch, what: str) -> None:
    """Raise a one-line `SearchError` unless ``batch`` is an ``(x, y)`` pair the supernet can take: x a non-empty
    floating tensor of the network's dtype and device (with the stem's input channels, where the network has a
    ``stem`` starting with a convolution), y a 1-D int64 (or uint8) tensor of class indices, one per sample of x, each in
    [0, ``network.num_classes``) where the network states it and y is on the CPU. Reads only shapes and dtypes of
    device tensors (no device synchronisation)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise SearchError(f"the {what} batch must be a pair (x, y) of tensors, got {type(batch).__name__}")
    x, y = batch
    param = next(network.parameters())
    if not x.is_floating_point() or x.dim() < 2 or len(x) == 0:
        raise SearchError(f"the {what} inputs x must be a non-empty floating tensor (B, ...), got {x.dtype} "
                          f"{tuple(x.shape)}")
    if x.dtype != param.dtype or x.device != param.device:
        raise SearchError(f"the {what} inputs x are {x.dtype} on {x.device}, the supernet is {param.dtype} on "
                          f"{param.device}; move them with x.to(device, dtype)")
    stem = getattr(network, "stem", None) or getattr(getattr(network, "model", None), "stem", None)
    first = next((m for m in stem.modules() if isinstance(m, nn.Conv2d)), None) if isinstance(stem, nn.Module) else None
    if first is not None and (x.dim() != 4 or x.shape[1] != first.in_channels):
        raise SearchError(f"the {what} inputs x must be images (B, {first.in_channels}, H, W) for this supernet's stem, "
                          f"got {tuple(x.shape)}")
    # int64 (or uint8), what cross-entropy takes: int32 labels passed here and stopped the step in torch's "expected
    # target dtype to be Long or Byte"
    if y.dim() != 1 or y.dtype not in (torch.int64, torch.uint8) or len(y) != len(x):
        raise SearchError(f"the {what} labels y must be a 1-D int64 tensor of class indices (y.long()), one per sample "
                          f"({len(x)}), got {y.dtype} {tuple(y.shape)}")
    # a label past the classifier stopped the step in cross-entropy's IndexError after a forward had moved BatchNorm's
    # running statistics (and -100, its ignore_index, was silently left out of the loss). Read where it is free: labels
    # on the CPU (on a GPU it would synchronise every step)
    classes = getattr(network, "num_classes", None)
    if isinstance(classes, int) and y.device.type == "cpu":
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= classes:
            raise SearchError(f"the {what} labels y must be class indices in [0, {classes}) for this supernet's {classes} "
                              f"classes, got values from {low} to {high}")


@contextmanager
def buffers_kept(network):
    """Around a measurement's train-mode forwards (``evaluate``): the network's buffers (BatchNorm's running statistics
    and batch counts) are put back as they were, in place, on every path. The forwards moved them: the measured
    batches (the search-val split, a user's test set) went into the statistics an eval-mode use then normalises with."""
    saved = [(b, b.clone()) for b in network.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


class _BatchChecked:
    """``step`` that first checks its batches (`check_batch`), and that a bi-level method (not ``single_level``) is given
    a search-val batch: a wrong or missing batch is one line before any update. An object,
    not a closure, so that ``copy.deepcopy(method)`` gives the copy a step of its own (a closure is copied by
    reference and would step the original)."""

    def __init__(self, network, step, name: str = "", single_level: bool = True):
        self.network, self.step, self.name, self.single_level = network, step, name, single_level
        self.__doc__ = getattr(step, "__doc__", None)

    def __call__(self, train_batch, val_batch=None, *args, **kwargs):
        check_batch(self.network, train_batch, "search-train")
        if val_batch is not None:
            check_batch(self.network, val_batch, "search-val")
        elif not self.single_level:  # a bi-level step without it was a TypeError, at times after the w step had run
            raise SearchError(f"{self.name} is bi-level: its step takes a search-train and a search-val batch, "
                              "method.step(train_batch, val_batch)")
        stats = self.step(train_batch, val_batch, *args, **kwargs)
        check_statistics(self.network, stats, self.name)
        return stats


def check_statistics(network, stats, name: str = "") -> None:
    """What a method's ``step`` returns: a mapping of record paths (str) to values whose row shape is their vocabulary
    family's (``scalars/<name>`` one number, ``(E, K)`` the cell type's α shape) and, for the ``bool`` families (masks,
    flags), bool. A wrong one was recorded silently (a per-sample loss as ``scalars/train_loss``: rows of B numbers
    the figures and the DDP mean took for one), or stopped the recorder in a traceback (a key that is no string).
    Reads shapes and dtypes only (no host synchronisation). Raises `SearchError` naming the method."""
    from nasdiag import vocabulary as V

    who = f"{name or 'the method'}: step() must return"
    if not isinstance(stats, Mapping):
        raise SearchError(f"{who} a dict {{record path: tensor}} (nasdiag.vocabulary, e.g. 'scalars/train_loss'), "
                          f"got {type(stats).__name__}")
    alphas = None
    for path, value in stats.items():
        if not isinstance(path, str):
            raise SearchError(f"{who} record paths (str, e.g. 'scalars/train_loss') as keys, got {path!r}")
        fam = V.family_of(path)
        if fam is None:
            continue  # a path of the method's own (docs/schema.md: any other group/name)
        shape = tuple(value.shape) if hasattr(value, "shape") else ()
        dims = tuple(d.strip() for d in fam.shape.strip("()").split(",") if d.strip())
        want: Tuple = dims
        if dims and set(dims) & {"E", "K"}:
            if alphas is None:
                alphas = {t: tuple(a.shape) for t, a in network.alphas().items()}
            cell = path.split("/")[fam.pattern.split("/").index("<cell>")] if "<cell>" in fam.pattern else None
            if cell not in alphas:
                continue  # (the record refuses a cell type not in its meta)
            edges, ops = alphas[cell]
            want = tuple(edges if d == "E" else ops if d == "K" else None for d in dims)
        if len(shape) != len(want) or any(w is not None and not isinstance(w, str) and got != w
                                           for got, w in zip(shape, want)):
            text = ", ".join(str(w) if w is not None else d for w, d in zip(want, dims))
            what = f"of shape {fam.shape} = ({text}{',' if len(dims) == 1 else ''})" if dims else "as one number, shape ()"
            raise SearchError(f"{who} {path!r} {what} (nasdiag.vocabulary: {fam.pattern}), got {shape}"
                              + ("; reduce it to one number per step (a mean over the batch)" if not dims else ""))
        is_bool = getattr(value, "dtype", None) in (torch.bool, bool) or str(getattr(value, "dtype", "")) == "bool" \
            or isinstance(value, bool)
        if (fam.dtype == "bool") != is_bool:
            raise SearchError(f"{who} {path!r} as {'bool' if fam.dtype == 'bool' else 'numbers, not bool'} "
                              f"(nasdiag.vocabulary: {fam.pattern} is {fam.dtype}), got {getattr(value, 'dtype', type(value).__name__)}")


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Fraction of correct top-1 predictions, a 0-dim tensor (stays on the device). NaN where a sample's logits hold a
    NaN: such a sample has no prediction (argmax takes the first NaN for the largest, so the logits of a diverged
    network read as the batch's share of class 0). A −inf logit (a masked class) is a prediction of it never."""
    correct = (logits.argmax(dim=1) == targets).to(logits.dtype).mean()
    return torch.where(torch.isnan(logits).any(), torch.full_like(correct, math.nan), correct)


@dataclass(frozen=True)
class Schedule:
    """What a method may know of the run it is part of.

    Attributes:
        epochs: epochs of the whole run (the length of cosine schedules).
        steps_per_epoch: steps per epoch on this rank.
        batch_size: per-rank batch size.
        train_size, val_size: samples in the search-train and search-val splits (all ranks; 0: not known).
        world_size: number of DDP ranks.

    Raises:
        ConfigError: (one line) a field that is not an integer, or below 1 (0 for the split sizes).
    """

    epochs: int
    steps_per_epoch: int
    batch_size: int = 64
    train_size: int = 0
    val_size: int = 0
    world_size: int = 1

    def __post_init__(self):
        # a run of 0 epochs stopped the first epoch end in the cosine schedule's ZeroDivisionError, a negative one
        # dropped w's learning rate to its minimum after one epoch, 2.5 epochs annealed over a fractional period
        for name, least in (("epochs", 1), ("steps_per_epoch", 1), ("batch_size", 1), ("train_size", 0), ("val_size", 0),
                            ("world_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ConfigError(f"Schedule {name} must be an integer >= {least}, got {value!r}")

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch


@dataclass
class CostStep:
    """One forward/backward of :meth:`SearchMethod.cost`.

    Attributes:
        loss: 0-dim mean loss of the batch (detached).
        logits: (B, classes), detached.
        per_cell: one (E, K) tensor per cell, C = ∂L/∂Z of that cell's mixing weights (mean-reduced loss;
            (E, B, K) per sample when the weights were given per sample). Under DDP those of the global mean loss: the
            rank mean of the (E, K) ones, an (E, B, K) one this rank's samples' C / R (equal rank batches).
        costs: ``{cell type: (E, K)}``, the per-cell costs summed over the cells of the type: the
            cost of the shared weights (wiring supplement §2.1 sums the chain rule over every use).
    """

    loss: torch.Tensor
    logits: torch.Tensor
    per_cell: List[torch.Tensor]
    costs: CellWeights


class SearchMethod:
    """Base of every search method.

    Args:
        network: the supernet, a nasdiag :class:`~nasdiag.supernet.Network` or any object offering its
            interface (``cell_types``, ``alphas()``, ``arch_parameters()``, ``weight_parameters()``,
            ``cells`` with ``cell_type``, ``forward(x, weights)``; see ``nasdiag.search.supernet``).
        hp: the method's ``Hyperparameters`` (defaults: the paper's values).
        schedule: the run's shape (:class:`Schedule`).
        probe: optional ``nasdiag.attach(network, ...)`` for the foreign-supernet and path/normalization
            diagnostics; the cost statistics of nasdiag's own supernet need none.
        hessian_mode: None, or the mixing-weight curvature mode recorded by :meth:`diagnostics`.

    Subclasses implement :meth:`build` (optimizers, forecasters), :meth:`step`, :meth:`probabilities`
    and, where it differs from them, :meth:`forward_weights`. State is saved automatically: the
    network, every attribute with ``state_dict``/``load_state_dict`` (optimizers, schedulers,
    forecasters), ``self.generator`` and the tensors/numbers listed in ``state_attributes``.
    """

    name: ClassVar[str] = "base"
    Hyperparameters: ClassVar[type] = Hyperparameters
    #: attribute names of plain state (tensors, numbers) saved with the method, e.g. ("temperature",)
    state_attributes: ClassVar[Tuple[str, ...]] = ()
    #: candidate op names of the supernet `nasdiag.search.run` builds for this method (None: DARTS's)
    primitives: ClassVar[Optional[Tuple[str, ...]]] = None
    #: the α step takes the training batch (SNAS, DSNAS, ASM-NAS) rather than the validation batch
    single_level: ClassVar[bool] = False
    #: :meth:`step` may be captured once as a CUDA graph and replayed (``nasdiag.supernet.engine.graph``): no
    #: host synchronisation, no Python state that changes per step, no random numbers. Read from the class's
    #: own ``__dict__``, so a subclass that changes the step must opt in again.
    graph_capturable: ClassVar[bool] = False
    #: data parallelism without the ``DistributedDataParallel`` wrapper: the method's weight step calls
    #: :meth:`average_weight_gradients` after its backward (one all-reduce of a flat buffer, which a captured
    #: step records too). For methods whose weight steps compute every op (no unused weights that depend on
    #: the data). Read from the class's own ``__dict__``, like ``graph_capturable``.
    averages_own_gradients: ClassVar[bool] = False

    def __init__(self, network, hp: Optional[Hyperparameters] = None, *, schedule: Schedule, probe=None,
                 hessian_mode: Optional[str] = None, seed: int = 0):
        from nasdiag.search.supernet import as_supernet

        self.network = as_supernet(network)
        if probe is not None and getattr(probe, "model", None) is not self.network and getattr(probe, "model", None) is not network:
            # (anything but a probe, e.g. a path string, was an AttributeError traceback)
            raise NasdiagError("the probe must be attached to the method's network: nasdiag.attach(network, ...); got "
                               f"{'a probe of another model' if hasattr(probe, 'model') else type(probe).__name__}")
        if hp is None:
            hp = self.Hyperparameters()
        if not isinstance(hp, self.Hyperparameters):
            raise NasdiagError(f"{type(self).__name__} takes {self.Hyperparameters.__qualname__}(...), got "
                               f"{type(hp).__qualname__}")  # the qualified name: every method's class is "Hyperparameters"
        foreign = [k for k in hp.keys() if k not in self.Hyperparameters.keys()]
        if foreign:  # another method's hyperparameters (SNAS's subclass DARTS's): their extra fields would do nothing
            raise NasdiagError(f"{type(self).__name__} does not use {', '.join(foreign)} of {type(hp).__qualname__} (the "
                               f"hyperparameters of another method, e.g. snas's for darts); pass "
                               f"{type(self).__name__}.Hyperparameters(...)")
        if not isinstance(schedule, Schedule):
            raise NasdiagError(f"schedule must be a nasdiag.search.Schedule(epochs=..., steps_per_epoch=...), got "
                               f"{type(schedule).__name__}")
        # the generator is seeded with seed + 7919, which torch takes up to 2⁶⁴ − 1 (above: a ValueError traceback)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_METHOD_SEED:
            raise NasdiagError(f"seed must be an integer from 0 to {MAX_METHOD_SEED}, got {seed!r}")
        # a number of steps between actions above the run's steps never acts (BayesNAS's update_every): refused as run()
        # refuses it, so a method built by hand does not silently skip the action
        hp.check_steps(schedule.total_steps, f" ({schedule.epochs} epochs × {schedule.steps_per_epoch} steps per epoch)")
        if hessian_mode is not None:
            from nasdiag.hessian.modes import ARCH_MODES, check_mode

            check_mode(hessian_mode, ARCH_MODES, what="hessian_mode")  # one line, before a search runs into it
        self.hp = hp
        self.schedule = schedule
        self.probe = probe
        self.hessian_mode = hessian_mode
        #: what the training forwards call: the network, or its DistributedDataParallel wrapper
        self.model: nn.Module = self.network
        #: the process group whose ranks :meth:`average_weight_gradients` averages over (set by :meth:`distribute`)
        self._gradient_group = None
        device = next(self.network.parameters()).device
        #: the method's random source (samples, noise); saved with its state so resume is exact
        self.generator = torch.Generator(device=device).manual_seed(int(seed) + 7919)
        self._cost_moments: Dict[str, CostMoments] = {}
        self._cost_mask: Optional[CellWeights] = None
        self._last_arch_batch: Optional[Batch] = None
        self._curvature_graph = None  # built by curvature() on first use
        self._curvature_graph_mode: Optional[str] = None
        self.build()
        self.step = _BatchChecked(self.network, self.step, self.name, self.single_level)
        if type(self).__dict__.get("graph_capturable", False):
            from nasdiag.supernet.engine.graph import StepGraph

            # the cost service (darts2: its step) keeps the architecture batch that diagnostics() takes the Hessian on,
            # in a replay the graph's static batch, which no replay sets (Python does not run)
            self.step = StepGraph(self.step, self._graph_state_key, enabled=self._graph_enabled,
                                  prepare=self._graph_prepare, name=f"{self.name} step", backend=self._graph_backend(),
                                  python_state=(self, ("_last_arch_batch",)))

    # -- to implement ------------------------------------------------------------------------------
    def build(self) -> None:
        """Create optimizers, schedulers, forecasters from ``self.hp`` and ``self.schedule``."""

    def step(self, train_batch: Batch, val_batch: Batch) -> Dict[str, torch.Tensor]:
        """One search step; returns statistics as record paths (see ``nasdiag.vocabulary``), on the device."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def probabilities(self) -> CellWeights:
        """``{cell type: (E, K)}``, detached: the architecture distribution the genotype and
        ``arch/<cell>/probabilities`` are derived from (the evaluation uses :meth:`eval_weights`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement probabilities()")

    def forward_weights(self) -> CellWeights:
        """``{cell type: (E, K)}`` mixing weights of the training forward (the relaxation); default
        :meth:`probabilities`. Sampling methods draw here with ``self.generator``."""
        return self.probabilities()

    def eval_weights(self) -> CellWeights:
        """Mixing weights of the supernet evaluation after each epoch; default :meth:`probabilities`."""
        return self.probabilities()

    def active_ops(self) -> Optional[CellWeights]:
        """``{cell type: (E, K) bool}`` ops that still exist (wiped out / pruned ones are not computed), or None."""
        return None

    def epoch_end(self, epoch: int) -> None:
        """Called after each epoch (schedules, annealing)."""

    @staticmethod
    def step_schedules(*schedulers) -> None:
        """One epoch of each learning-rate schedule. A cosine schedule at its end (``last_epoch`` ≥ ``T_max``, the
        run's epochs) stays at its minimum: torch's `CosineAnnealingLR` is periodic and rose again past its end
        (0.001 → 0.013 → 0.025 for DARTS's defaults) where a hand-written loop calls `epoch_end` more often than
        ``schedule.epochs``; `extend_schedule` is the way to lengthen a run."""
        from torch.optim.lr_scheduler import CosineAnnealingLR

        for scheduler in schedulers:
            if isinstance(scheduler, CosineAnnealingLR) and scheduler.last_epoch >= scheduler.T_max:
                continue
            scheduler.step()

    def extend_schedule(self, epochs: int) -> None:
        """Continue the run to ``epochs`` epochs in all (``nasdiag search --resume --epochs N``).

        Every cosine learning-rate schedule anneals from its current learning rate to its minimum over
        the remaining epochs, lr = lr_min + (lr_now − lr_min)·(1 + cos(π t / (N − e)))/2 after t more
        epochs (cosine annealing restarted at lr_now): it never rises, and a finished run, at lr_min, stays
        there. Methods with other schedules override this; by default they raise `SearchError`. ``epochs`` below
        the run's own (or not an integer) is one `SearchError` line.
        """
        import dataclasses

        from torch.optim.lr_scheduler import CosineAnnealingLR, LRScheduler

        now = self.schedule.epochs
        if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs < now:
            # fewer epochs shrank the schedule silently (the run's length, its cosine left as it was); a string was a
            # TypeError traceback
            raise SearchError(f"extend_schedule(epochs) continues the run to that many epochs in all, at least its {now}; "
                              f"got {epochs!r}")
        epochs = int(epochs)

        for name, obj in self._stateful().items():
            if isinstance(obj, CosineAnnealingLR):
                # the epochs its cosine has left (T_max − last_epoch: one scheduler step per completed epoch, T_max the
                # run's epochs or, after an extension, the epochs left then) plus the added ones; epochs − last_epoch
                # took last_epoch for the completed epochs, which it is not after an extension (its restart at 0)
                remaining = epochs - self.schedule.epochs + obj.T_max - obj.last_epoch
                if remaining > 0:
                    obj.base_lrs = [group["lr"] for group in obj.optimizer.param_groups]
                    for group in obj.optimizer.param_groups:
                        group["initial_lr"] = group["lr"]
                    obj.T_max, obj.last_epoch = remaining, 0
            elif isinstance(obj, LRScheduler):
                raise SearchError(f"{type(self).__name__} cannot extend its {type(obj).__name__} schedule ({name}); "
                                  "start a new run with the wanted --epochs")
        self.schedule = dataclasses.replace(self.schedule, epochs=epochs)

    def genotype(self):
        """The derived architecture (DARTS top-2 rule on :meth:`probabilities`; mixed-path methods override).
        Raises `SearchError` where the weights hold a NaN or inf (`finite_architecture`)."""
        net = self.network
        weights = self.architecture_of(self.probabilities(), "probabilities()")
        return derive_genotype(self.finite_architecture(weights), net.steps, net.multiplier, net.primitives)

    def architecture_of(self, weights, source: str) -> CellWeights:
        """``weights`` if they are ``{cell type: (E, K) tensor}`` for every cell type of the network (α's shapes), else
        one `SearchError` line naming the method's ``source`` (``probabilities()``, ``eval_weights()``). A third-party
        method's wrong return was a silent genotype without the missing cell type's nodes (one cell type given), or
        an AttributeError/ValueError traceback of the genotype or the network at the epoch's evaluation."""
        shapes = {t: tuple(a.shape) for t, a in self.network.alphas().items()}
        want = ", ".join(f"{t!r}: {s}" for t, s in shapes.items())
        if not isinstance(weights, Mapping):
            raise SearchError(f"{self.name}: {source} must return a dict {{cell type: (E, K) tensor}}, {{{want}}}; got "
                              f"{type(weights).__name__}")
        for t, s in shapes.items():
            w = weights.get(t)
            if not isinstance(w, torch.Tensor) or tuple(w.shape) != s:
                got = "nothing" if w is None else type(w).__name__ if not isinstance(w, torch.Tensor) else f"shape {tuple(w.shape)}"
                raise SearchError(f"{self.name}: {source} must return a dict {{cell type: (E, K) tensor}}, {{{want}}}; "
                                  f"got {got} for {t!r}")
        return weights

    def finite_architecture(self, weights: CellWeights, use: str = "no architecture can be derived from them") -> CellWeights:
        """``weights`` (``{cell type: (E, K)}``, what a genotype is derived from, or a sampling method's p), or
        `SearchError` naming the cell type and edges where they are NaN or ±inf, and what cannot be done (``use``): a
        top-k or non-zero rule would otherwise pick ops at random there (NaN compares false with everything) and return
        an architecture that looks like any other; a sampler stopped in torch.multinomial's RuntimeError."""
        for cell_type, w in weights.items():
            bad = ~torch.isfinite(w.detach())
            if bool(bad.any()):
                edges = sorted({int(e) for e in bad.reshape(w.shape[0], -1).any(-1).nonzero()[:, 0]})
                raise SearchError(f"{self.name}: the {cell_type} architecture weights are NaN or inf on edge(s) {edges}, so "
                                  f"{use}: the search diverged; lower the learning rates and search again")
        return weights

    # -- CUDA-graph capture of the step (engine "fast"/"auto" on CUDA) ------------------------------------
    def _graph_enabled(self, tensors) -> bool:
        return all(t.is_cuda for t in tensors) and self._graph_applies()

    def _graph_applies(self) -> bool:
        """Whether a captured step may stand for this step (on CUDA tensors): the engine not ``eager``, no DDP wrapper,
        no probe, and no hook on any module of the network (nor a global one) or its parameters (``register_hook``,
        ``register_post_accumulate_grad_hook``): a replay runs no Python, so a hook (a
        user's, an attached probe's) would be called at the capture only, and one that changes a tensor with a value
        read in Python would replay the capture's value (nasdiag.hessian.graphed calls a hooked model plainly too)."""
        return (getattr(self.network, "engine", "eager") != "eager" and self.model is self.network and self.probe is None
                and not has_module_hooks(self.network.modules())
                and not any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
                            for p in self.network.parameters()))

    def _graph_state_key(self):
        """What a captured step bakes in besides the batch: optimizer settings (the scheduled learning rate),
        the identities of the cost accumulators, every module's identity, train mode and normalization settings, grad
        mode and autocast, where the parameters live and the engine's plan."""
        settings = []
        for name, obj in sorted(self._stateful().items()):
            if isinstance(obj, torch.optim.Optimizer):
                settings.append((name, id(obj), tuple(tuple(sorted((k, v) for k, v in g.items() if k != "params"
                                                                   and isinstance(v, (bool, int, float, str, tuple, type(None)))))
                                                      for g in obj.param_groups)))
        params = list(self.network.parameters())
        from nasdiag.cuda_graphs import ambient_state, module_flags

        # every module's mode, not only the network's: a cell module switched to eval on its own (frozen BatchNorms)
        # runs eager (nasdiag.supernet.engine.why_not_fast), and a replay of the step captured before would not; and
        # every module's identity and normalization settings (the stem's BatchNorm too, outside the engine's plan)
        modes = module_flags(self.network)
        from nasdiag.supernet.engine.fast import plan_key

        # the engine's plan (a module swapped inside an op, a BatchNorm's eps or momentum set) and hooks on the cells;
        # grad mode and autocast
        return (tuple(settings), tuple((t, id(m)) for t, m in self._cost_moments.items()), modes,
                ambient_state(), params[0].data_ptr(), params[-1].data_ptr(), plan_key(self.network))

    def _graph_prepare(self) -> None:
        """Adam/AdamW keep their step count on the device (``capturable=True``) so a replay advances it.

        Their bias corrections 1 − β^t are then computed in the step count's dtype: it is made float64 for
        float64 parameters (float32, torch's default, would put a relative error of ~1e-5 into 1 − 0.999^t)."""
        for obj in self._stateful().values():
            if isinstance(obj, torch.optim.Optimizer) and "capturable" in obj.defaults:
                for group in obj.param_groups:
                    group["capturable"] = True
                for p, state in obj.state.items():
                    if torch.is_tensor(state.get("step")):
                        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
                        state["step"] = state["step"].to(p.device, dtype)

    # -- the cost primitive as a service ---------------------------------------------------------------
    def cost(self, x: torch.Tensor, y: torch.Tensor, weights: CellWeights, *, active: Optional[CellWeights] = None,
             train_weights: bool = False, observe: bool = True, record_probe: Optional[bool] = None,
             observed: Optional[CellWeights] = None) -> CostStep:
        """One forward/backward with per-cell leaves Z_k = weights[type of cell k]; returns C = ∂L/∂Z_k.

        C(Z) = ∂L/∂Z = <∂L/∂x_j, O(x_i)> (wiring supplement §2) for every edge and candidate op, computed
        once; each method maps it to its architecture gradient. The loss is the mean cross-entropy.

        Args:
            x, y: the batch.
            weights: ``{cell type: (E, K)}`` (or (E, B, K) per sample), the relaxation's Z; detached here.
            active: ``{cell type: (E, K) bool}``: only these ops are computed (others contribute 0 and get
                cost 0).
            train_weights: also accumulate ∂L/∂w into the weights' ``.grad`` (single-level methods share
                one backward between w and α); the forward then goes through ``self.model`` (the DDP
                wrapper, which averages ∂L/∂w over ranks).
            observe: add the per-cell costs to the streaming cost statistics of :meth:`diagnostics`.
            record_probe: record this forward with the method's probe (``probe=``), if any; None (default) means
                ``observe``, so a forward that is not an observation (ProxylessNAS's w step) stays out of the
                probe's costs and statistics too. True records an evaluation forward that must not move the
                method's statistics (``scripts/wiring_output_cost.py`` reads its per-sample output costs).
            observed: ``{cell type: (E, K) bool}``: the ops whose costs enter the statistics (default: ``active``); an
                op computed only to keep its edge's output defined (BayesNAS's first op of a removed edge, at Z = 0) is
                computed but not an op of the architecture, and is left out of them.

        Returns:
            :class:`CostStep`. Under DDP the costs are averaged over ranks (the cost of the global mean
            loss), so every rank applies the same architecture update; costs of per-sample (E, B, K) weights are of this
            rank's samples, ∂L_r/∂Z / R (the global mean loss's, equal rank batches): a method maps them to its α
            gradient and averages that over the ranks itself. Under train-mode BatchNorm each rank
            normalises with its own batch's statistics: the rank mean of costs of batches normalised apart, not
            the cost of the concatenated batch (`nasdiag.distributed`, batch convention).
        """
        self._check_cell_weights(weights, len(x))
        leaves = [weights[c.cell_type].detach().clone().requires_grad_(True) for c in self.network.cells]
        module = self.model if train_weights else self.network
        kwargs = {} if active is None else {"active": active}
        with self._probe_recording(y) if (observe if record_probe is None else record_probe) else nullcontext():
            logits = module(x, leaves, **kwargs)
            loss = nn.functional.cross_entropy(logits, y)
            if train_weights:
                loss.backward()
                grads = [z.grad for z in leaves]
            else:
                grads = list(torch.autograd.grad(loss, leaves, allow_unused=True))
        grads = [torch.zeros_like(z) if g is None else g for z, g in zip(leaves, grads)]
        if observe:
            self._observe_costs(grads, active if observed is None else observed)
        grads = _global_mean_costs(grads)
        costs: CellWeights = {}
        for cell, g in zip(self.network.cells, grads):
            costs[cell.cell_type] = costs[cell.cell_type] + g if cell.cell_type in costs else g
        self._last_arch_batch = (x, y)
        return CostStep(loss.detach(), logits.detach(), grads, costs)

    def _check_cell_weights(self, weights, batch: int) -> None:
        """`SearchError` (one line, before any forward: the stem's BatchNorm would have taken the batch) unless
        ``weights`` maps every cell type to a floating (E, K) or per-sample (E, B, K) tensor; a missing cell type was a
        KeyError, a list a TypeError, integer weights torch's "only Tensors of floating point dtype can require
        gradients". Reads shapes and dtypes only."""
        net = self.network
        types = sorted({c.cell_type for c in net.cells})
        E, K = getattr(net, "num_edges", None), len(net.primitives)
        wanted = f"{{cell type: (E, K) = ({E}, {K}) floating tensor, or (E, B, K) per sample}} for the cell types {types}"
        if not isinstance(weights, Mapping) or not set(types) <= set(weights):
            got = sorted(weights) if isinstance(weights, Mapping) else type(weights).__name__
            raise SearchError(f"{self.name}: cost() takes the mixing weights as {wanted}; got {got}")
        for t in types:
            w = weights[t]
            shapes = ((E, K), (E, batch, K)) if E is not None else ()
            if not torch.is_tensor(w) or not w.is_floating_point() or (shapes and tuple(w.shape) not in shapes):
                got = f"{w.dtype} {tuple(w.shape)}" if torch.is_tensor(w) else type(w).__name__
                raise SearchError(f"{self.name}: cost() takes the mixing weights as {wanted}; the {t} ones are {got}")

    def _probe_recording(self, targets):
        return self.probe.record(targets=targets) if self.probe is not None else nullcontext()

    def _observe_costs(self, per_cell: Sequence[torch.Tensor], active: Optional[CellWeights]) -> None:
        by_type: Dict[str, List[torch.Tensor]] = {}
        for cell, g in zip(self.network.cells, per_cell):
            if g.dim() == 3:  # per-sample weights (E, B, K): one observation per sample, summed to the batch cost
                g = g.sum(1)
            by_type.setdefault(cell.cell_type, []).append(g)
        for cell_type, rows in by_type.items():
            obs = torch.stack(rows)
            moments = self._cost_moments.get(cell_type)
            if moments is None:
                moments = self._cost_moments[cell_type] = CostMoments(tuple(obs.shape[1:]), device=obs.device)
            mask = None
            if active is not None:
                mask = active[cell_type].to(obs.device).bool().unsqueeze(0).expand_as(obs)
            moments.update(obs, mask)

    # -- statistics ------------------------------------------------------------------------------------
    def scalar_statistic(self, value: float) -> torch.Tensor:
        """A number the host holds (w's learning rate, SparseNAS's λ) as a 0-dim CPU statistic in the run's float dtype,
        which the vocabulary's ``float32`` stands for (``torch.tensor(lr)`` is float32: a float64 run recorded its
        rate rounded to 24 bits, a λ past 3.4e38 as inf). Half precision networks get float32."""
        dtype = next(self.network.parameters()).dtype
        return torch.tensor(value, dtype=torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32)

    def arch_statistics(self, forward_weights: Optional[CellWeights] = None) -> Dict[str, torch.Tensor]:
        """``arch/<cell>/params`` (α, where the method has them), ``arch/<cell>/probabilities`` and, if
        given, ``arch/<cell>/weights`` (the step's Z; batch mean where per sample)."""
        from nasdiag import vocabulary as V

        stats = {}
        for cell_type, alpha in self.network.alphas().items():
            stats[V.ARCH_PARAMS.path(cell=cell_type)] = alpha.detach().clone()
        for cell_type, p in self.probabilities().items():
            stats[V.ARCH_PROBABILITIES.path(cell=cell_type)] = p.detach().clone()
        for cell_type, z in (forward_weights or {}).items():
            z = z.detach()
            stats[V.ARCH_WEIGHTS.path(cell=cell_type)] = (z.mean(1) if z.dim() == 3 else z).clone()
        return stats

    def diagnostics(self) -> Dict[str, torch.Tensor]:
        """Statistics since the last call (then reset): ``cost/<cell>/{mean,var,count}`` over the cost
        steps (each cell of a type one observation per step) and, with ``hessian_mode``,
        ``hessian/<cell>/diag`` of ∂²L/∂Z² (BayesNAS C.3) at :meth:`eval_weights` on the last cost
        batch, summed over the cells of the type, plus ``hessian/<cell>/nonfinite``."""
        from nasdiag import vocabulary as V

        stats: Dict[str, torch.Tensor] = {}
        for cell_type, m in self._cost_moments.items():
            stats[V.COST_MEAN.path(cell=cell_type)] = torch.where(m.count > 0, m.mean, torch.full_like(m.mean, math.nan))
            stats[V.COST_VAR.path(cell=cell_type)] = m.var
            stats[V.COST_COUNT.path(cell=cell_type)] = m.count.to(torch.int64)
        self._cost_moments = {}
        if self.hessian_mode is not None and self._last_arch_batch is not None:
            stats.update(self.curvature(*self._last_arch_batch))
        return stats

    def curvature(self, x: torch.Tensor, y: torch.Tensor, *, top_eigenvalue: bool = False) -> Dict[str, torch.Tensor]:
        """Curvature statistics on one batch (mean cross-entropy), per cell type:

        * with ``hessian_mode``: ``hessian/<cell>/diag`` (E, K), the diagonal of ∂²L/∂Z² at
          :meth:`eval_weights`, Z shared by the cells of the type (a mode of ``nasdiag.hessian.ARCH_MODES``:
          ``exact`` includes the cross-cell terms; ``exact_per_edge``, C.3.1-C.3.2, GGN and Hutchinson sum
          per-edge numbers over the cells of the type);
        * with ``top_eigenvalue`` (RobustDARTS's early-stop signal; the run asks for it every k steps):
          ``hessian/<cell>/top_eigenvalue``, the largest algebraic eigenvalue of ∂²L/∂α² for the α of
          the type shared by its cells, through Z = softmax(α), cross-cell terms and train-mode BatchNorm
          included, and ``hessian/top_eigenvalue``, the same for the α of all cell types jointly (the
          cross-type terms too: RobustDARTS's dominant eigenvalue of ∇²_α L_valid). Lanczos on exact
          Hessian-vector products, allowed as many iterations as α has entries, where it is exact;
        * ``hessian/<cell>/nonfinite``: True where either result held a NaN or inf (kept, not averaged away).
        """
        from nasdiag import vocabulary as V
        from nasdiag.hessian import eigenvalues_from_hvp, loss_hvp

        net = self.network
        check_batch(net, (x, y), "curvature")  # images of other channels were a convolution's RuntimeError traceback
        stats: Dict[str, torch.Tensor] = {}
        bad: Dict[str, torch.Tensor] = {}
        if self.hessian_mode is not None:
            weights = {t: w.detach() for t, w in self.eval_weights().items()}
            if self._curvature_graph is None or self._curvature_graph_mode != self.hessian_mode:
                from nasdiag.hessian.graphed import curvature_graph

                self.release_curvature_graph()
                self._curvature_graph = curvature_graph(self._mixing_curvature, net, self.hessian_mode,
                                                        name=f"{self.name} curvature ({self.hessian_mode})",
                                                        backend=self._graph_backend())
                self._curvature_graph_mode = self.hessian_mode
            for cell_type, h in self._curvature_graph(x, y, weights).items():
                stats[V.HESSIAN_DIAG.path(cell=cell_type)] = h
                bad[cell_type] = ~torch.isfinite(h).all()
        if top_eigenvalue:
            alphas = net.alphas()

            class _Softmax(nn.Module):  # Z = softmax(α) per cell type, shared by the cells of the type
                def __init__(self):
                    super().__init__()
                    self.net = net

                def forward(self, inp):
                    return self.net(inp, {t: torch.softmax(a, dim=-1) for t, a in alphas.items()})

            def largest(params):
                # at most as many Lanczos steps as α has entries: then the Krylov basis spans the space and the
                # answer is exact, so it never comes back unconverged
                dim = sum(a.numel() for _, a in params)
                try:
                    op = loss_hvp(_Softmax(), nn.functional.cross_entropy, x, y, params)
                    # under DDP the products of the ranks' batches are averaged, so every rank finds the top eigenvalue
                    # of the global batch's Hessian (the rank mean of the ranks' top eigenvalues was 20-25% above it)
                    top = eigenvalues_from_hvp(lambda v: mean_over_ranks([op(v)])[0], op.dim, k=1, iters=dim,
                                               dtype=op.dtype, device=op.device)
                    value = top.largest_algebraic
                except FloatingPointError:  # a product came out NaN or inf (a NaN batch): recorded as NaN and flagged
                    value = math.nan
                return torch.tensor(value, dtype=params[0][1].dtype, device=params[0][1].device)

            for cell_type, alpha in alphas.items():
                value = stats[V.HESSIAN_TOP_EIGENVALUE.path(cell=cell_type)] = largest([(cell_type, alpha)])
                bad[cell_type] = bad.get(cell_type, torch.tensor(False, device=alpha.device)) | ~torch.isfinite(value)
            joint = largest(list(alphas.items())) if len(alphas) > 1 else value
            stats[V.HESSIAN_JOINT_TOP_EIGENVALUE.path()] = joint
            for cell_type in alphas:  # a NaN joint eigenvalue is flagged on every type it involves
                bad[cell_type] = bad[cell_type] | ~torch.isfinite(joint)
        for cell_type, flag in bad.items():
            stats[V.HESSIAN_NONFINITE.path(cell=cell_type)] = flag
        return stats

    def _mixing_curvature(self, x: torch.Tensor, y: torch.Tensor, weights: CellWeights) -> Dict[str, torch.Tensor]:
        """``{cell type: (E, K)}``: the diagonal of ∂²L/∂Z² at fixed mixing ``weights``, Z shared by the cells of a
        type. ``exact``: :func:`~nasdiag.hessian.shared_weights_diag_hessian` (cross-cell terms included); the other
        modes: ``arch_diag_hessian`` per edge, summed over the cells of each type (``exact_per_edge``: the exact
        per-cell blocks without the cross-cell terms). For the recursions (``diag``/``approx``) on a supernet the fast engine
        batches (engine ``auto``/``fast``), the same recursion runs on the batched ops
        (:func:`nasdiag.supernet.engine.curvature.mixing_curvature`); on CUDA :meth:`curvature` replays either as a
        CUDA graph (:mod:`nasdiag.hessian.graphed`)."""
        from nasdiag.hessian import arch_diag_hessian, shared_weights_diag_hessian
        from nasdiag.supernet.engine import curvature as fast_curvature

        net = self.network
        if self.hessian_mode == "exact":  # Z is shared by the cells of a type: exact includes the cross-cell terms
            return shared_weights_diag_hessian(net, nn.functional.cross_entropy, x, y, weights)
        if self.hessian_mode in fast_curvature.MODES and getattr(net, "engine", "eager") != "eager":
            per_cell = fast_curvature.mixing_curvature(net, x, y, net._cell_weights(weights), self.hessian_mode)
            if per_cell is not None:
                out: Dict[str, torch.Tensor] = {}
                for cell, h in zip(net.cells, per_cell):
                    out[cell.cell_type] = h.detach() if cell.cell_type not in out else out[cell.cell_type] + h.detach()
                return out

        class _Fixed(nn.Module):  # the supernet at fixed mixing weights, as the curvature engine expects
            def __init__(self):
                super().__init__()
                self.net = net

            def forward(self, inp):
                return self.net(inp, weights)

        edges = {f"net.{e.name}": e for e in net.edge_specs()}
        per_edge = arch_diag_hessian(_Fixed(), nn.functional.cross_entropy, x, y, edges, mode=self.hessian_mode)
        out: Dict[str, torch.Tensor] = {}
        for key, e in zip(edges, edges.values()):
            h = out.setdefault(e.cell_type, torch.zeros_like(weights[e.cell_type]))
            h[e.edge_index] += per_edge[key].detach()
        return out

    def _graph_backend(self):
        """The CUDA-graph backend of :meth:`step` and :meth:`curvature`: a new capture shares the memory pool of a
        live graph of either (they replay one at a time, so the pool holds the largest graph's memory, not the sum)."""
        from nasdiag.cuda_graphs import CudaGraphBackend, StepGraph

        def pool():
            for graph in (self.step, self._curvature_graph):
                live = graph.pool() if isinstance(graph, StepGraph) else None
                if live is not None:
                    return live
            return None

        return CudaGraphBackend(pool=pool)

    def release_curvature_graph(self) -> None:
        """Free the captured CUDA graph of the mixing-weight curvature (if any)."""
        if self._curvature_graph is not None:
            self._curvature_graph.release()
        self._curvature_graph = None

    # -- evaluation ------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, loader) -> Dict[str, float]:
        """Mean loss and accuracy of the supernet at :meth:`eval_weights` over ``loader``.

        BatchNorm uses batch statistics, as during the search (DARTS's own ``infer`` uses eval mode, its running
        statistics). A measurement: the network's buffers (BatchNorm's running statistics and batch counts) are as they
        were before the call.
        """
        net = self.network
        p = next(net.parameters())
        total, loss_sum, correct = 0, torch.zeros((), dtype=torch.float64, device=p.device), torch.zeros((), dtype=torch.float64, device=p.device)
        unpredicted = torch.zeros((), dtype=torch.bool, device=p.device)
        weights = self.eval_weights()
        if not (isinstance(weights, Mapping) and any(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights.values())):
            self.architecture_of(weights, "eval_weights()" if type(self).eval_weights is not SearchMethod.eval_weights
                                 else "probabilities() (the default eval_weights())")  # (per-sample (E, B, K): the network checks)
        active = self.active_ops()
        kwargs = {} if active is None else {"active": active}
        with buffers_kept(net):
            for x, y in loader:
                x, y = x.to(p.device, p.dtype), y.to(p.device)
                check_batch(net, (x, y), "evaluation")  # a label past the classifier was cross-entropy's IndexError
                logits = net(x, weights, **kwargs)
                loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").double()
                correct += (logits.argmax(1) == y).sum()
                unpredicted |= torch.isnan(logits).any()  # no prediction: the accuracy is NaN (as `accuracy`'s)
                total += len(y)
        if total == 0:
            raise SearchError("evaluate() got an empty loader")
        return {"loss": float(loss_sum) / total, "acc": math.nan if bool(unpredicted) else float(correct) / total}

    # -- DDP ----------------------------------------------------------------------------------------
    def distribute(self, device_ids=None) -> None:
        """Train data-parallel across the ranks of the initialised default process group.

        Every rank starts from rank 0's parameters and buffers. Methods with ``averages_own_gradients``
        (DARTS, darts2) keep the plain network: their weight step averages ∂L/∂w itself
        (:meth:`average_weight_gradients`), so the step, collectives included, can be captured as one CUDA
        graph; their BatchNorm running statistics then stay each rank's own (the wrapper would copy rank 0's
        before every forward), which the search never reads: :meth:`evaluate` uses batch statistics, and the
        checkpoint holds rank 0's. Other methods' weight forwards go through ``DistributedDataParallel`` with
        ``find_unused_parameters=True`` (ops that are not computed leave weights without a gradient).
        Architecture updates use costs averaged over ranks by :meth:`cost` either way.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise SearchError("distribute() needs torch.distributed.init_process_group() first (e.g. launch with torchrun)")
        if type(self).__dict__.get("averages_own_gradients", False):
            with torch.no_grad():
                for t in list(self.network.parameters()) + list(self.network.buffers()):
                    dist.broadcast(t, 0)  # what DDP's constructor does
            self._gradient_group = dist.group.WORLD
            return
        self.model = nn.parallel.DistributedDataParallel(self.network, device_ids=device_ids, find_unused_parameters=True)

    def release_graphs(self) -> None:
        """Free the captured CUDA graphs of :meth:`step` and :meth:`curvature` (if any); the next calls capture anew. ``run`` calls it
        before leaving the process group: a live graph with captured collectives makes its destruction hang."""
        from nasdiag.supernet.engine.graph import StepGraph

        if isinstance(self.step, StepGraph):
            self.step.release()
        self.release_curvature_graph()

    def average_weight_gradients(self) -> None:
        """Average the weights' ``.grad`` over the ranks after :meth:`distribute` (a no-op before it): one
        all-reduce of a flat buffer, no host synchronisation. Weights without a gradient (on every rank: the
        code path, not the data, decides which) are left without one, as DDP leaves globally unused ones."""
        if self._gradient_group is None:
            return
        grads = [p.grad for p in self.network.weight_parameters() if p.grad is not None]
        if not grads:
            return
        averaged = mean_over_ranks(grads)
        torch._foreach_copy_(grads, averaged)

    # -- state -----------------------------------------------------------------------------------------
    _NOT_STATE = ("network", "model", "probe", "hp", "schedule")

    def _stateful(self) -> Dict[str, Any]:
        return {k: v for k, v in vars(self).items()
                if k not in self._NOT_STATE and not k.startswith("_")
                and callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))
                and not isinstance(v, nn.Module)}

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue bit-identically: network, stateful attributes, RNG, plain state."""
        return {
            "method": self.name,
            "network": self.network.state_dict(),
            "objects": {k: v.state_dict() for k, v in self._stateful().items()},
            # the class of each object: a state of another configuration (SparseNAS's HAPG for an AdamHAPG) is refused
            "types": {k: type(v).__name__ for k, v in self._stateful().items()},
            "generator": self.generator.get_state(),
            "attributes": {k: getattr(self, k) for k in self.state_attributes},
            # the run's shape the schedules (cosine T_max, XNAS's horizon, BayesNAS's update steps) were built for
            "schedule": {"epochs": self.schedule.epochs, "steps_per_epoch": self.schedule.steps_per_epoch},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state. A captured step graph is dropped first: loading an optimizer
        replaces its state tensors (Adam's moments), and a replay would keep updating the old ones.

        Raises:
            NasdiagError: (one line, before anything is loaded) what is not a state_dict() (no network, objects or
                generator), a state of another method, one of a run of another schedule (epochs, steps per epoch: the saved
                learning-rate schedules would run on under this one's), one that lacks a stateful object of this method, one whose objects are of other classes (another configuration: SparseNAS's
                HAPG state for an AdamHAPG), or one of a supernet whose tensors differ in names or shapes. An object
                that refuses its saved state (XNAS's forecasters of another ζ) raises its own one-line error, the
                objects loaded before it are restored and the network is not touched.
        """
        lacking = ["network", "objects", "generator"] if not isinstance(state, Mapping) else \
            [k for k in ("network", "objects", "generator") if not isinstance(state.get(k), (Mapping, torch.Tensor))]
        if lacking:  # a KeyError (or AttributeError) traceback, the first two after the network had been loaded
            raise NasdiagError(f"this is not a state of a {self.name} method (its state_dict()): it lacks {lacking}"
                               + ("" if isinstance(state, Mapping) else f" (got a {type(state).__name__})"))
        if state.get("method", self.name) != self.name:
            raise NasdiagError(f"this state is of method {state.get('method')!r}, not {self.name!r}")
        saved_schedule = state.get("schedule")
        if isinstance(saved_schedule, Mapping):  # (a state saved before it was stored: not checked)
            theirs = (saved_schedule.get("epochs"), saved_schedule.get("steps_per_epoch"))
            mine = (self.schedule.epochs, self.schedule.steps_per_epoch)
            if theirs != mine:  # loaded, the saved cosine schedule ran on (and rose again past its end) under this one
                raise NasdiagError(
                    f"this state is of a run of {theirs[0]} epochs × {theirs[1]} steps per epoch, this {self.name} method's "
                    f"schedule is {mine[0]} × {mine[1]}; build the method with the saved Schedule(epochs={theirs[0]}, "
                    f"steps_per_epoch={theirs[1]}), then extend_schedule(epochs) to continue it to more epochs")
        objects = self._stateful()
        missing = sorted(set(objects) - set(state["objects"]))
        if missing:
            raise NasdiagError(f"the saved state of {self.name!r} lacks {missing}")
        other = {k: (t, type(objects[k]).__name__) for k, t in state.get("types", {}).items()
                 if k in objects and t != type(objects[k]).__name__}
        if other:  # loaded, it failed only later, in a step (a KeyError of the other optimizer's settings)
            k, (saved_type, own) = next(iter(other.items()))
            raise NasdiagError(f"the saved state of {self.name!r} is of another configuration: its {k} is {saved_type}, "
                               f"this method's is {own}; build the method with the hyperparameters the state was saved with")
        # torch's load_state_dict copies every tensor that fits before it raises on the others (a 200-line error):
        # a state of another supernet left this one half replaced (α, the classifier's bias)
        current, saved = self.network.state_dict(), state["network"]
        differ = [k for k in current if k not in saved or tuple(saved[k].shape) != tuple(current[k].shape)]
        differ += [k for k in saved if k not in current]
        if differ:
            k = differ[0]
            shapes = (f"{tuple(saved[k].shape) if k in saved else 'missing'} saved, "
                      f"{tuple(current[k].shape) if k in current else 'missing'} here")
            raise NasdiagError(f"this state is of another supernet: {len(differ)} of its tensors differ in name or shape "
                               f"(first {k}: {shapes}); build the method on a supernet of the saved shape")
        release = getattr(self.step, "release", None)
        if release is not None:
            release()
        # the objects first, undone if one refuses its state, then the network: a refusal leaves the method as it was
        previous = {}
        try:
            for k, obj in objects.items():
                previous[k] = obj.state_dict()
                obj.load_state_dict(state["objects"][k])
                _capturable_as_before(obj, previous[k])
        except Exception:
            for k, saved in previous.items():
                objects[k].load_state_dict(saved)
            raise
        self.network.load_state_dict(state["network"])
        self.generator.set_state(state["generator"])
        for k, v in state.get("attributes", {}).items():
            setattr(self, k, _on_devices_of(getattr(self, k, None), v))


def _capturable_as_before(obj: Any, before: Mapping[str, Any]) -> None:
    """An optimizer's ``capturable`` is how this process steps, not a part of the run: ``_graph_prepare`` turns it on
    before a CUDA-graph capture (and runs again before the next one), so a checkpoint of a graphed GPU run holds it on.
    Loaded into a method that was not prepared, it was kept: resumed with ``--device cpu`` Adam stopped in its
    assertion that capturable steps need a GPU (and an eager GPU run took the capturable path). A group keeps it on only
    where it was on before the load; the step count it then holds goes back to the host, where the plain step reads it."""
    if not isinstance(obj, torch.optim.Optimizer) or "capturable" not in obj.defaults:
        return
    for group, old in zip(obj.param_groups, before.get("param_groups", ())):
        if group.get("capturable") and not old.get("capturable"):
            group["capturable"] = False
            for p in group["params"]:
                step = obj.state.get(p, {}).get("step")
                if torch.is_tensor(step):
                    obj.state[p]["step"] = step.to("cpu")


def _on_devices_of(current: Any, loaded: Any) -> Any:
    """``loaded`` with each tensor moved to the device of the tensor at the same place in ``current``: a
    checkpoint is loaded on the CPU, but a CUDA run keeps e.g. BayesNAS's per-cell-type ``{t: tensor}``
    on the GPU (and its pruning masks on the CPU, on purpose). Places ``current`` lacks stay as loaded."""
    if isinstance(loaded, torch.Tensor):
        return loaded.to(current.device) if isinstance(current, torch.Tensor) else loaded
    if isinstance(loaded, dict) and isinstance(current, dict):
        return {k: _on_devices_of(current.get(k), v) for k, v in loaded.items()}
    if type(loaded) in (list, tuple) and isinstance(current, (list, tuple)) and len(loaded) == len(current):
        return type(loaded)(_on_devices_of(c, v) for c, v in zip(current, loaded))
    return loaded


def _global_mean_costs(grads: List[torch.Tensor]) -> List[torch.Tensor]:
    """The costs of the global mean loss (R ranks of equal batches: L = (1/R) Σ_r L_r) from this rank's ∂L_r/∂Z: an
    (E, K) cost shared by the batch is the rank mean; an (E, B, K) per-sample cost is of this rank's samples, C_r / R
    (averaged over ranks, sample b of one rank was mixed with sample b of another, and unequal batches met in one
    all-reduce of different sizes)."""
    from nasdiag.distributed import world_size

    shared = [i for i, g in enumerate(grads) if g.dim() != 3]
    out = [g / world_size() if g.dim() == 3 else g for g in grads]
    for i, g in zip(shared, mean_over_ranks([grads[i] for i in shared]) if shared else []):
        out[i] = g
    return out


def mean_over_ranks(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The tensors averaged over the ranks of the default process group (one all-reduce of a flat buffer);
    unchanged without one. Every rank must call it with tensors of the same shapes."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].view_as(t))
        at += t.numel()
    return out
