"""`run(config)`: a whole search — threads, device, DDP, data, supernet, method, record, checkpoint,
resume, progress and figures — as the CLI and scripts run it.

The loop pairs search-train and search-val batches, calls ``method.step`` and hands the statistics to
callbacks (``on_step_end(step, stats)``, ``on_epoch_end(epoch, stats)``, ``on_exception(exc)``): the
recorder, the checkpointer, the progress bar and any the caller adds are the same kind of object a
user plugs into a loop of their own.

Resume (`nasdiag.search.checkpoint` has the commit rule): the record's last committed step S_rec and
the checkpoint's step S_ck <= S_rec are read; the run continues from the checkpoint, replays steps
S_ck+1 .. S_rec without handing them to the recorder or the caller's callbacks, and records from
S_rec+1 on. Steps are numbered from 1; epoch e covers steps e·S+1 .. (e+1)·S.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from nasdiag.errors import ConfigError, NasdiagError
from nasdiag.search.base import SearchError, Schedule, SearchMethod
from nasdiag.search.checkpoint import Checkpointer, load_checkpoint, os_error_in, set_rng_state, temp_path
from nasdiag.search.config import (RECORD_DEFINING, SearchConfig, check_probe_count, default_threads, did_you_mean,
                                   differing_fields)
from nasdiag.search.registry import get_method

EVAL_BATCH_SIZE = 256
#: fields of one invocation, not of the run (not stored in the record's meta)
SESSION_FIELDS = ("resume", "force", "progress", "threads")


@dataclass
class SearchResult:
    """What `run` returns.

    Attributes:
        genotype: the derived architecture (``method.genotype()``).
        evaluation: ``{"loss", "acc"}`` of the supernet on the whole search-val split after the last epoch.
        record: the record path (None if the run recorded nothing).
        figures: paths of the figures drawn at the end.
        config: the configuration that ran.
        method: the method object (its network holds the searched weights).
    """

    genotype: Any
    evaluation: Dict[str, float]
    record: Optional[str]
    figures: List[str] = field(default_factory=list)
    config: Optional[SearchConfig] = None
    method: Optional[SearchMethod] = None


# -- data order --------------------------------------------------------------------------------------
def steps_per_epoch(train_size: int, val_size: int, batch_size: int, world_size: int = 1) -> int:
    """Steps of one epoch: full batches of one rank's share of the smaller search split."""
    return min(train_size, val_size) // world_size // batch_size


def epoch_batches(dataset, batch_size: int, seed: int, epoch: int, *, rank: int = 0, world_size: int = 1,
                  start: int = 0) -> Iterator[Tuple[torch.Tensor, ...]]:
    """The batches of one epoch, from batch ``start`` on.

    The order is a permutation drawn from a generator seeded by (``seed``, ``epoch``) only, so a resumed
    run sees exactly the batches an uninterrupted one sees; under DDP rank r takes every
    ``world_size``-th sample of it. Only full batches are yielded. ``dataset`` is a ``TensorDataset``.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(dataset), generator=g)
    order = order[: len(order) // world_size * world_size][rank::world_size]
    for i in range(start, len(order) // batch_size):
        yield dataset[order[i * batch_size:(i + 1) * batch_size]]


def data_identity(splits) -> Dict[str, Any]:
    """What a checkpoint keeps of the data it was taken on: the split sizes and a digest of the labels in order (cheap,
    and another set of images, or another number of them, has other labels at almost every size)."""
    import hashlib

    digest = hashlib.sha256()
    for part in (splits.train, splits.val, splits.test):
        digest.update(part.tensors[1].to(torch.int64).contiguous().numpy().tobytes() + b"|")
    return {"sizes": splits.sizes(), "labels": digest.hexdigest()[:16]}


def _check_same_data(saved: Optional[Mapping[str, Any]], now: Mapping[str, Any], config: SearchConfig) -> None:
    """Refuse a resume on data that are not the run's: a --data-dir whose batches were replaced since. With other sizes
    the method refused the checkpoint as 'of a run of E × S steps per epoch' and said to build it with the saved
    Schedule; with as many images the run went on, silently, on other data than the steps it replays."""
    if not isinstance(saved, Mapping) or dict(saved) == dict(now):  # (a checkpoint from before this was kept: unchecked)
        return
    where = f" in {os.fspath(config.data_dir)}" if config.data_dir else ""
    sizes = lambda d: "/".join(str(d.get("sizes", {}).get(k, "?")) for k in ("train", "val", "test"))
    what = (f"the run searched {sizes(saved)} search-train/search-val/test images, now it has {sizes(now)}"
            if saved.get("sizes") != now.get("sizes") else "the images are as many as the run's, with other labels")
    raise ConfigError(f"cannot resume {os.fspath(config.record)}: the {config.dataset} data{where} changed since the run "
                      f"began ({what}); resume with the data the run began with, or record to a new --out")


# -- callbacks ---------------------------------------------------------------------------------------
class Committed:
    """Forwards to ``target`` only the steps after ``after_step`` (those not in the record yet), and the
    last step of each epoch only together with its epoch statistics: an interrupted epoch end leaves
    no row without the epoch's evaluation (the resumed run replays that step)."""

    def __init__(self, target, steps_per_epoch: int, after_step: int = 0):
        self.target = target
        self.steps_per_epoch = steps_per_epoch
        self.after_step = after_step
        self._held: Optional[Tuple[int, Mapping]] = None

    def on_step_end(self, step: int, stats) -> None:
        if step <= self.after_step:
            return
        if step % self.steps_per_epoch == 0:
            self._held = (step, stats)
        else:
            self.target.on_step_end(step, stats)

    def on_failed_step(self, step: int, stats) -> None:
        """The row of a step that stopped the run (a method's NaN loss, flagged): forwarded at once, also at an
        epoch's last step, where holding it for the epoch statistics that never come lost it. A resume replays
        the same NaN, so the row without its epoch statistics is never continued from."""
        if step > self.after_step:
            self.target.on_step_end(step, stats)

    def on_epoch_end(self, epoch: int, stats) -> None:
        held, self._held = self._held, None
        if held is None:  # the epoch's last step was replayed
            return
        self.target.on_step_end(*held)
        self.target.on_epoch_end(epoch, stats)

    def on_exception(self, exc: BaseException) -> None:
        self._held = None
        self.target.on_exception(exc)

    def settle(self) -> None:
        """Under DDP, when every rank stopped at the same step: hand the rows forwarded so far to ``target``'s
        ``flush`` (a `RecorderCallback` reduces them across ranks and commits them: a collective)."""
        flush = getattr(self.target, "flush", None)
        if callable(flush):
            flush()


class Progress:
    """A tqdm bar over the steps. The losses in its postfix are read from the device only every
    ``every`` steps and at epoch ends, so the bar adds no per-step host–device synchronisation. Into a file or a
    pipe (``2> log``, a batch job) it is redrawn once a minute and at epoch ends, in ASCII: it was up to ten
    carriage-return states a second (megabytes an hour of a long run) and block characters in the log."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, every: int = 25):
        from tqdm.auto import tqdm

        try:
            terminal = sys.stderr.isatty()
        except (AttributeError, ValueError):  # no stderr, or a closed one
            terminal = False
        self.bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True,
                        mininterval=0.1 if terminal else 60.0, ascii=None if terminal else True)
        self.every = every
        self.postfix: Dict[str, str] = {}

    def on_step_end(self, step: int, stats) -> None:
        if not self.bar.disable and step % self.every == 0:
            for key in ("train_loss", "val_loss"):
                if f"scalars/{key}" in stats:
                    self.postfix[key] = f"{float(stats[f'scalars/{key}']):.3f}"
            self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.update(1)

    def on_epoch_end(self, epoch: int, stats) -> None:
        if not self.bar.disable and "scalars/search_val_acc" in stats:
            self.postfix["search_val_acc"] = f"{float(stats['scalars/search_val_acc']):.3f}"
            self.bar.set_postfix(self.postfix)

    def on_exception(self, exc: BaseException) -> None:
        self.bar.close()

    def close(self) -> None:
        self.bar.close()


# -- the loop ----------------------------------------------------------------------------------------
def search_loop(method: SearchMethod, splits, *, epochs: int, batch_size: int, seed: int, start_step: int = 0,
                callbacks: Sequence = (), diagnostics: Sequence[str] = ("cost", "hessian"), spectrum_every: int = 0,
                rank: int = 0, world_size: int = 1) -> Dict[str, float]:
    """Run ``method`` from step ``start_step`` (completed) to the end of epoch ``epochs - 1``.

    After each epoch the supernet is evaluated on the whole search-val split; ``on_epoch_end`` gets
    ``scalars/epoch``, ``scalars/search_val_loss``, ``scalars/search_val_acc`` and the method's
    ``diagnostics()`` of the families in ``diagnostics``. Returns the last evaluation.
    """
    from torch.utils.data import DataLoader

    from nasdiag import vocabulary as V

    S = steps_per_epoch(len(splits.train), len(splits.val), batch_size, world_size)
    p = next(method.network.parameters())
    device, dtype = p.device, p.dtype
    keep = tuple(f"{d}/" for d in diagnostics)
    evaluation: Dict[str, float] = {}
    step: Optional[int] = None
    phase, epoch = "step", start_step // S  # where a failure happened, for the caller's message (`stopped_at`)
    try:
        start_epoch, position = divmod(start_step, S)
        for epoch in range(start_epoch, epochs):
            first = position if epoch == start_epoch else 0
            stats = {}  # the statistics of the epoch's last step, once this session has run it
            shard = dict(rank=rank, world_size=world_size, start=first)
            batches = zip(epoch_batches(splits.train, batch_size, seed, epoch, **shard),
                          epoch_batches(splits.val, batch_size, seed + 1, epoch, **shard))
            for i, ((xt, yt), (xv, yv)) in enumerate(itertools.islice(batches, S - first), start=first):
                step = epoch * S + i + 1
                train = (xt.to(device, dtype, non_blocking=True), yt.to(device, non_blocking=True))
                val = (xv.to(device, dtype, non_blocking=True), yv.to(device, non_blocking=True))
                phase = "step"
                stats = method.step(train, val)
                if spectrum_every and step % spectrum_every == 0:
                    phase = "spectrum"
                    stats = {**stats, **_top_eigenvalues(method, train if method.single_level else val)}
                phase = "record"
                for cb in callbacks:
                    cb.on_step_end(step, stats)
            phase = "evaluation"
            evaluation = method.evaluate(DataLoader(splits.val, batch_size=EVAL_BATCH_SIZE))
            phase = "diagnostics"
            epoch_stats = {
                # in the run's dtype, as every float statistic (a float64 run's evaluation was rounded to float32)
                "scalars/epoch": torch.tensor(float(epoch), dtype=dtype),
                "scalars/search_val_loss": torch.tensor(evaluation["loss"], dtype=dtype),
                "scalars/search_val_acc": torch.tensor(evaluation["acc"], dtype=dtype),
                **{k: v for k, v in method.diagnostics().items() if k.startswith(keep)},
                # a method's own epoch records (ASM-NAS: the selection counts of its evaluation above)
                **(method.epoch_statistics() if hasattr(method, "epoch_statistics") else {}),
            }
            if epoch == start_epoch and rank == 0:
                _warn_missing_diagnostics(method, diagnostics, epoch_stats)
            for key in [k for k in epoch_stats if k in stats and V.family_of(k) is V.HESSIAN_NONFINITE]:
                # the epoch's flag joins the row of its last step: a NaN top eigenvalue of that step (--spectrum-every)
                # stays flagged beside a finite diagonal instead of being replaced by the diagonal's flag
                epoch_stats[key] = epoch_stats[key] | stats[key]
            phase = "epoch end"
            method.epoch_end(epoch)
            for cb in callbacks:
                cb.on_epoch_end(epoch, epoch_stats)
            if not math.isfinite(evaluation["loss"]):  # checked once per epoch: no per-step host sync
                raise SearchError(f"the search-val loss is {evaluation['loss']} after epoch {epoch}: the run diverged "
                                  "(its rows are recorded, NaN flagged); lower the learning rates")
    except BaseException as exc:
        with contextlib.suppress(AttributeError):  # (phase, step, epoch): which part of the loop failed
            exc.stopped_at = (phase, step, epoch)
        failed = getattr(exc, "statistics", None)  # a method's SearchError carries the failing step's row (NaN loss)
        if isinstance(exc, SearchError) and failed and step is not None:
            for cb in callbacks:  # recorded, so the NaN is kept and flagged in the record, not lost with the run
                getattr(cb, "on_failed_step", cb.on_step_end)(step, failed)
            if world_size > 1:  # every rank stopped at this step (the methods decide by finite_on_every_rank): the
                for cb in callbacks:  # rows held so far are reduced together now, which on_exception cannot do
                    settle = getattr(cb, "settle", None)
                    if settle is not None:
                        settle()
        for cb in callbacks:
            cb.on_exception(exc)
        raise
    return evaluation


def _warn_missing_diagnostics(method: SearchMethod, diagnostics: Sequence[str], epoch_stats: Mapping) -> None:
    """The ``cost/`` and ``hessian/`` statistics come from the cost service (``self.cost``: the Hessian is taken on the
    last batch it was given, or the one a method sets as ``_last_arch_batch``). A method that never calls it (a user's
    own update) recorded neither, silently, while the run was asked for them: said once, at the session's first epoch
    end."""
    wanted = [d for d in ("cost", "hessian") if d in diagnostics and not any(k.startswith(f"{d}/") for k in epoch_stats)]
    if wanted:
        warnings.warn(f"method {method.name!r} never called self.cost(x, y, weights) in its epoch, so the run records no "
                      f"{' and no '.join(f'{d}/ statistics' for d in wanted)} though diagnostics asks for them; call "
                      "the cost service on the architecture batch (docs/methods.md) or pass diagnostics=() "
                      "(--diagnostics none)", UserWarning, stacklevel=2)


def _top_eigenvalues(method: SearchMethod, batch) -> Dict[str, torch.Tensor]:
    """``hessian/<cell>/top_eigenvalue``, ``hessian/top_eigenvalue`` (joint) and the ``nonfinite`` flags of the
    α-Hessian on the architecture batch."""
    from nasdiag import vocabulary as V

    wanted = (V.HESSIAN_TOP_EIGENVALUE, V.HESSIAN_JOINT_TOP_EIGENVALUE, V.HESSIAN_NONFINITE)
    return {k: v for k, v in method.curvature(*batch, top_eigenvalue=True).items() if V.family_of(k) in wanted}


# -- checks before anything is written ----------------------------------------------------------------
def _probe_writable(folder: str, what: str) -> None:
    """Refuse ``folder`` (to be created if missing) unless a file can really be created there; leaves nothing."""
    folder = os.path.abspath(folder)
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"cannot put the {what} under {folder}: {existing} is a file, not a folder")
    # Under torchrun every rank probes the same folder at once: a level another rank made (or removed again) meanwhile
    # was "File exists" or "No such file or directory", and its rmdir of a level in use a traceback; tried again.
    for attempt in range(3):
        created = []  # every missing level: one too long for the file system (a path past PATH_MAX) failed only after
        try:          # the recorder had made the levels above it, and left them behind
            if existing == folder:
                with tempfile.TemporaryFile(dir=folder):
                    pass
            else:
                for part in os.path.relpath(folder, existing).split(os.sep):
                    existing = os.path.join(existing, part)
                    try:
                        os.mkdir(existing)
                    except FileExistsError:
                        if not os.path.isdir(existing):  # a file or a dangling link, not a level another rank made
                            raise
                        continue
                    created.append(existing)
            return
        except OSError as err:
            if not isinstance(err, FileNotFoundError) or attempt == 2:
                from nasdiag.record.lock import describe_os_error

                raise ConfigError(f"cannot write the {what} under {folder}: {describe_os_error(err)}") from None
        finally:
            for level in reversed(created):
                with contextlib.suppress(OSError):  # another rank probing inside it removes it in turn
                    os.rmdir(level)
        existing = folder
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)


def _check_side_file_names(record: str) -> None:
    """The files the search writes next to ``record`` must fit the file system's limits: a name of 247 to 250 bytes (of
    255) made the record, then failed on its checkpoint's ``.ckpt.tmp`` (a record of no rows left behind, so the same
    command was refused), and one of 244 to 246 on the first segment roll-over, well into the run."""
    from nasdiag.record.schema import side_file_too_long

    too_long = side_file_too_long(record)
    if too_long:
        raise ConfigError(f"record path {record} is too long: {too_long}; choose a shorter --out")


#: files written next to a record ``<out>``, by suffix (the checkpoint is `SearchConfig.checkpoint`)
SIDE_FILES = ((".ckpt.tmp", "checkpoint being written"), (".ckpt", "checkpoint"), (".lock", "writer lock"),
              (".tmp", "segment being written"))


def side_file_of(path: str) -> Optional[Tuple[str, str]]:
    """``(record, what)`` when ``path`` is named like a file nasdiag keeps next to the record ``record``
    (its checkpoint, lock, a temporary file or a later segment), else None."""
    for suffix, what in SIDE_FILES:
        if path.endswith(suffix) and os.path.basename(path[: -len(suffix)]):
            return path[: -len(suffix)], what
    from nasdiag.record.schema import segment_owner

    owner = segment_owner(path)
    return None if owner is None else (owner, "continuation segment")


def _leftovers(config: SearchConfig) -> List[str]:
    """Files of a previous run at ``config.record`` other than the record itself: later segments, the checkpoint."""
    from nasdiag.record.schema import list_segments

    found = [file for index, file in list_segments(os.fspath(config.record)) if index > 0]
    if os.path.exists(config.checkpoint):
        found.append(config.checkpoint)
    return found


def check_paths(config: SearchConfig) -> None:
    """Refuse a record or figure location that cannot work, before any search runs; touches nothing.

    An existing file at the record path that is not a record, or a path named like a record's side file
    (``<record>.ckpt``, ``.lock``, ``<root>.segNNNN<ext>``), is refused even with ``force``: replacing it
    would destroy something that is not this run's record."""
    if config.record is not None:
        record = os.fspath(config.record)
        if not record.strip():
            raise ConfigError("the record path (--out) is empty; pass a file path such as runs/search.h5")
        if os.path.isdir(record):
            raise ConfigError(f"record path {record} is a folder; pass a file path such as {os.path.join(record, 'run.h5')}")
        folders = [record + suffix for suffix, _ in SIDE_FILES if os.path.isdir(record + suffix)]
        if folders:  # --force replaced the record, then failed to remove the folder: "Is a directory", the old run lost
            raise ConfigError(f"{folders[0]} is a folder, where the search keeps a file next to the record {record}; "
                              "move the folder away or choose another --out")
        side = side_file_of(record)
        if side is not None:
            raise ConfigError(f"record path {record} is named like the {side[1]} of the record {side[0]} (nasdiag keeps "
                              "<record>.ckpt, <record>.lock and <root>.segNNNN<ext> next to a record); choose another --out, "
                              "such as one ending in .h5")
        from nasdiag.record.schema import foreign_temp

        foreign = foreign_temp(record)
        if foreign is not None:
            raise ConfigError(f"{foreign} is in the way: the record {record} is built under that name and the file would "
                              "be deleted; move it away or choose another --out, such as one ending in .h5")
        if os.path.exists(record):
            from nasdiag.record.reader import not_a_record

            reason = not_a_record(record)
            if reason is not None:
                raise ConfigError(f"{record} exists and is not a nasdiag record: {reason}; it is never replaced, "
                                  "not even with --force; choose another --out")
        if os.path.exists(record):  # first: without either flag, the line below sent the user to both, each refused
            _refuse_a_record_of_another_program(record, "--resume" if config.resume else "--force" if config.force else None)
        if os.path.exists(record) and not (config.resume or config.force):
            from nasdiag.record.lock import live_holder

            writer = live_holder(record)  # both flags are refused while it writes: "pass --resume or --force" led there
            if writer is not None:
                raise ConfigError(f"record {record} is being written by another search ({writer}); wait for it to finish "
                                  "(then --resume extends it), or record to another --out")
            raise ConfigError(f"a record already exists at {record}; pass --resume to continue it or --force to replace it")
        leftovers = [] if os.path.exists(record) or config.force else _leftovers(config)
        if leftovers:
            names = ", ".join(os.path.basename(f) for f in leftovers)
            if config.resume:
                raise ConfigError(f"cannot resume {record}: the record is missing and only leftover files of a previous "
                                  f"run remain ({names}); restore the record, or pass --force instead of --resume to "
                                  "replace them")
            raise ConfigError(f"leftover files of a previous run at {record} ({names}) but no record; pass --force to "
                              "replace them or choose another --out")
        if config.resume and not os.path.exists(record):
            raise ConfigError(f"nothing to resume at {record}: there is no record; drop --resume to start a run")
        _check_side_file_names(record)
        _probe_writable(os.path.dirname(os.path.abspath(record)), "record")
    if config.figures is not None:
        figures = os.fspath(config.figures)
        if os.path.exists(figures) and not os.path.isdir(figures):
            raise ConfigError(f"figure folder {figures} is a file; pass a folder")
        _probe_writable(figures, "figures")


def _refuse_a_record_of_another_program(record: str, flag: Optional[str]) -> None:
    """A record that a user's own loop wrote through `nasdiag.record.Recorder` (no search settings in its meta) can
    neither be resumed by a search nor replaced by one: --force silently deleted it. ``flag``: the one given, if any
    (without one, the line was "pass --resume to continue it or --force to replace it", each then refused)."""
    from nasdiag.record import load_meta
    from nasdiag.record.errors import RecordError

    try:
        meta = load_meta(record)
    except RecordError:  # damaged: resume says so later, --force may replace it (the documented way out)
        return
    config = meta.get("config")
    if meta.get("run") or meta.get("config_hash") or (isinstance(config, Mapping) and "method" in config):
        return
    raise ConfigError(f"{record} was written by another program (a nasdiag record without the settings of a nasdiag "
                      f"search; method {meta.get('method')!r}): a search can neither continue it (--resume{' given' * (flag == '--resume')}) "
                      "nor replace it, not even with --force; choose another --out")


CALLBACK_HOOKS = ("on_step_end", "on_epoch_end", "on_exception")


def _checked_callbacks(callbacks) -> Tuple:
    """``run``'s callbacks as a tuple, each with the three hooks the loop calls. One without ``on_exception`` ran until
    the run failed and then replaced the failure (a NaN loss, an interrupt) by its AttributeError; one without
    ``on_epoch_end`` stopped the first epoch end; a single callback not in a list was a TypeError once the record was
    open. Each is one `ConfigError` line before anything is written."""
    if callbacks is None:
        return ()
    single = any(hasattr(callbacks, hook) for hook in CALLBACK_HOOKS)
    try:
        listed = tuple(callbacks) if not single and not isinstance(callbacks, (str, bytes, Mapping)) else None
    except TypeError:
        listed = None
    if listed is None:
        raise ConfigError(f"callbacks must be a list of callback objects, got {type(callbacks).__name__}"
                          + (f"; pass callbacks=[{type(callbacks).__name__}(...)]" if single else ""))
    for cb in listed:
        missing = [hook for hook in CALLBACK_HOOKS if not callable(getattr(cb, hook, None))]
        if missing:
            raise ConfigError(f"callback {type(cb).__name__} lacks {', '.join(missing)}: run() calls on_step_end(step, stats), "
                              "on_epoch_end(epoch, stats) and on_exception(exc) on each callback (define the ones it "
                              "does not need as methods that do nothing)")
    return listed


def _resolve_method(config: SearchConfig):
    """The method class and its effective hyperparameters (overrides, then the digits preset, then defaults)."""
    try:
        cls = get_method(config.method)
    except ConfigError:
        from nasdiag.search.registry import available_methods

        names = sorted(available_methods())
        hint = did_you_mean(config.method, names)
        if not hint:
            raise
        raise ConfigError(f"unknown method {config.method!r};{hint} (available: {', '.join(names)})") from None
    values = dict(config.hp)
    if config.dataset == "digits":
        for key, value in dict(getattr(cls, "digits_preset", {}) or {}).items():
            values.setdefault(key, value)
    missing = [m for m in ("step", "probabilities") if getattr(cls, m) is getattr(SearchMethod, m)]
    if missing:  # was the base's NotImplementedError at the first step, the record and a checkpoint written by then
        raise ConfigError(f"method {config.method!r} ({cls.__qualname__}) does not implement {' and '.join(f'{m}()' for m in missing)}: "
                          "a SearchMethod defines step(train_batch, val_batch) -> {record path: tensor} and "
                          "probabilities() -> {cell type: (E, K)} (docs/methods.md)")
    hp = cls.Hyperparameters.from_dict(values, method=config.method)
    for key, value in hp.to_dict().items():  # a curvature mode among them (bayesnas's hessian_mode)
        check_probe_count(value, f"hyperparameter {key}")
    if config.spectrum_every and "top_eigenvalue" not in inspect.signature(cls.curvature).parameters:
        raise ConfigError(f"spectrum_every needs {cls.__name__}.curvature(x, y, top_eigenvalue=True), which method "
                          f"{config.method!r} does not offer; pass --spectrum-every 0")
    return cls, hp


def available_devices() -> List[str]:
    """The ``device`` values this machine can run: auto, cpu, and cuda, cuda:0 .. cuda:N-1 (mps) where available."""
    names = ["auto", "cpu"]
    if torch.cuda.is_available():
        names += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        names.append("mps")
    return names


def _device(name: str, world: int):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    available = available_devices()
    if name not in available:
        why = "CUDA is not available" if name.startswith("cuda") and not torch.cuda.is_available() else (
            f"this machine has {torch.cuda.device_count()} CUDA device(s)" if name.startswith("cuda")
            else "this PyTorch build or machine does not support it")
        raise ConfigError(f"device {name!r} is not available ({why}); use one of {', '.join(available)}")
    device = torch.device(name)
    if world > 1 and device.index is not None:
        raise ConfigError(f"under torchrun the device must be auto, cuda or cpu (each rank takes its own GPU), not {name!r}")
    return device


_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _launch_environment() -> Tuple[int, int, int]:
    """``(world, rank, local rank)`` from the environment torchrun sets, or one ConfigError naming what is wrong."""
    how = ("launch data-parallel runs with torchrun --nproc_per_node=N -m nasdiag search ..., or unset WORLD_SIZE "
           "for one process")

    def integer(name: str, default: Optional[str]) -> int:
        text = os.environ.get(name, default)
        try:
            return int(text)
        except (TypeError, ValueError):
            raise ConfigError(f"environment variable {name}={text!r} is not an integer; {how}") from None

    world = integer("WORLD_SIZE", "1")
    if world < 1:  # ran as one process, silently
        raise ConfigError(f"environment variable WORLD_SIZE={world} is not a number of processes (at least 1); {how}")
    if world == 1:
        if not _rank_zero(os.environ.get("RANK", "")):  # the recorder would take this process for another
            raise ConfigError(f"environment variable RANK={os.environ['RANK']!r} is set but WORLD_SIZE is not above 1: a "  # rank
                              "single process would record nothing (only rank 0 writes); unset RANK, or " + how)
        return 1, 0, 0
    missing = [name for name in _LAUNCH_VARIABLES if not os.environ.get(name)]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                          f"(torchrun sets them all); {how}")
    rank, local_rank = integer("RANK", None), integer("LOCAL_RANK", None)
    local_world = integer("LOCAL_WORLD_SIZE", str(world)) if os.environ.get("LOCAL_WORLD_SIZE") else world
    if not 0 <= rank < world or not 0 <= local_rank < min(local_world, world):
        raise ConfigError(f"RANK={rank} / LOCAL_RANK={local_rank} do not fit WORLD_SIZE={world}"
                          f"{f' / LOCAL_WORLD_SIZE={local_world}' if local_world != world else ''}; {how}")
    port = integer("MASTER_PORT", None)
    if not 1 <= port <= 65535:  # torch's ValueError traceback (port 0: each rank would pick its own)
        raise ConfigError(f"environment variable MASTER_PORT={port} is not a TCP port (1 to 65535); {how}")
    _check_master_address(os.environ["MASTER_ADDR"], port, how)
    return world, rank, local_rank


def _rank_zero(text: str) -> bool:
    """Whether ``RANK`` (unset or empty: one process) names rank 0 as the recorder reads it (``int``): ``00`` and ``+0``
    were refused as "another rank", which would record nothing."""
    try:
        return not text.strip() or int(text) == 0
    except ValueError:
        return False


def _check_master_address(address: str, port: int, how: str) -> None:
    """A MASTER_ADDR that does not resolve made every rank retry the rendezvous until its timeout (30 minutes)."""
    import socket

    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        raise ConfigError(f"environment variable MASTER_ADDR={address!r} is not a host this machine can reach ({err}); "
                          f"{how}") from None


@contextlib.contextmanager
def _default_signals():
    """Ctrl-C and SIGTERM end the process while it waits in the rendezvous (a C++ wait that Python's handlers
    cannot interrupt: without this, a run started with torchrun's variables but no peers ignores SIGTERM).
    Nothing is recorded yet at that point, so the default action loses nothing."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _process_group(device_name: str):
    """Join the process group a launcher (torchrun) describes in the environment; yields (rank, world, device)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # the caller joined a group itself (any init method)
        world, local_rank = dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0") or 0)
    else:
        world, _, local_rank = _launch_environment()
    if world <= 1:
        yield 0, 1, _device(device_name, 1)
        return
    device = _device(device_name, world)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():  # torch.cuda.set_device's "invalid device ordinal" traceback
            raise ConfigError(f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} CUDA device(s): "
                              "each rank takes the GPU of its local rank; launch at most that many processes per host "
                              "(torchrun --nproc_per_node), or use --device cpu")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    created = not dist.is_initialized()
    if created:
        with _default_signals():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        yield dist.get_rank(), dist.get_world_size(), device
    except BaseException:
        if created:
            dist.destroy_process_group()
        raise
    if created:
        # a rank that tears gloo down while a peer is still finishing its last collective makes that peer's
        # transport thread abort the process ("terminate called without an active exception", exit -6), failing a
        # complete run under torchrun; after a run every rank leaves together
        dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def _threads(n: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _resume_point(config: SearchConfig, defining: Mapping[str, Any]) -> Tuple[Optional[Dict], int]:
    """The checkpoint to continue from and the record's last committed step, or a refusal naming why."""
    from nasdiag.record import load, load_meta
    from nasdiag.record.errors import DamagedRecordError

    record, ckpt = os.fspath(config.record), config.checkpoint
    if not os.path.exists(record):
        raise ConfigError(f"nothing to resume at {record}: there is no record; drop --resume to start a run")
    try:
        meta = load_meta(record)
        steps = load(record)["step"]
    except DamagedRecordError as err:
        raise ConfigError(f"cannot resume {record}: it is damaged at {err.where}: {err.reason}; record to a new --out, "
                          "or pass --force instead of --resume to replace it (its "
                          f"{err.intact_rows} intact rows stay readable in Python: nasdiag.record.load(path, salvage=True))"
                          ) from None
    last = int(steps.max()) if steps.size else 0
    if not os.path.exists(ckpt):
        if last:
            raise ConfigError(f"cannot resume {record}: its checkpoint {ckpt} is missing; start the run again under a new "
                              f"--out, or with --force, which replaces the record {record} and its {last} steps")
        state = None  # killed before its first checkpoint: the record holds no step, so nothing is rewritten
    else:
        state = load_checkpoint(ckpt)
    recorded = config.record_defining()
    for source, where in ((state, f"checkpoint {ckpt}"), (meta, f"record at {record}")):
        if source is None:
            continue
        stored_config = source.get("config") or {}
        # what is recorded must not change either; a record written before these were compared may lack them
        shared = [k for k in RECORD_DEFINING if k in stored_config]
        given = {**defining, **{k: recorded[k] for k in shared}}
        stored = {**source.get("run", {}),
                  **{k: sorted(set(stored_config[k])) if k == "diagnostics" else stored_config[k] for k in shared}}
        diff = differing_fields(given, stored)
        if "method" in diff:
            raise ConfigError(f"--resume with method {diff['method'][0]}, but the {where} was written by {diff['method'][1]}; "
                              "pass the recorded method or record to a new path")
        if diff:
            listed = ", ".join(f"{k}={a!r} (recorded {b!r})" for k, a, b in ((k, *v) for k, v in diff.items()))
            world = diff.get("world_size", (None, None))[1]  # no option sets it: say how the launch does
            how = "" if not isinstance(world, int) else "; world_size is the number of data-parallel processes: " + (
                f"relaunch with {world} of them (torchrun --nproc_per_node={world} -m nasdiag search ... on one host)"
                if world > 1 else "resume in one process, without torchrun")
            raise ConfigError(f"--resume with different settings than the {where}: {listed}; "
                              f"resume with the recorded settings or record to a new path{how}")
    if state is None:
        return None, 0
    if last < state["step"]:
        raise ConfigError(f"the record at {record} ends at step {last}, before its checkpoint (step {state['step']}); "
                          f"the record lost rows; start the run again under a new --out, or with --force, which replaces "
                          f"the record {record}")
    if config.epochs < state["epochs"]:
        raise ConfigError(f"--epochs {config.epochs} is shorter than the run's {state['epochs']} epochs; "
                          "resume with at least as many epochs")
    if state["epoch"] >= config.epochs:
        raise ConfigError(f"the run at {record} already finished {state['epoch']} epochs; "
                          f"extend it with --resume --epochs N, N > {state['epoch']}")
    return state, last


# -- the run -----------------------------------------------------------------------------------------
def run(config: SearchConfig, callbacks: Sequence = ()) -> SearchResult:
    """Run the search ``config`` describes; ``callbacks`` get every step recorded in this session.

    Under torchrun (``WORLD_SIZE`` > 1) every rank calls ``run``: the ranks train data-parallel
    (``method.distribute()``), rank 0 writes the record and the checkpoint, and only rank 0's result
    has figures. Every refusal is a one-line `NasdiagError` raised before anything is written.
    """
    if not isinstance(config, SearchConfig):
        how = "SearchConfig.from_dict(d)" if isinstance(config, Mapping) else "SearchConfig(method=..., ...)"
        raise ConfigError(f"run() takes a SearchConfig, got {type(config).__name__}; build one with {how}")
    config.validate()
    callbacks = _checked_callbacks(callbacks)
    method_cls, hp = _resolve_method(config)
    check_paths(config)
    with _threads(config.threads or default_threads()):
        with _process_group(config.device) as (rank, world, device):
            try:
                result = _run(config, callbacks, method_cls, hp, rank, world, device)
            except RuntimeError as exc:
                if world > 1 and not isinstance(exc, NasdiagError) and lost_a_rank(exc):
                    raise RankLostError(exc, rank, world) from exc
                raise
        # drawn once every rank left the process group: a rank that left it while rank 0 still drew them (in it)
        # at times aborted on exit ("terminate called without an active exception"), and torchrun then killed rank 0
        if config.figures is not None and rank == 0 and config.record is not None:
            result.figures = _draw_figures(config)
        return result


def _draw_figures(config: SearchConfig) -> List[str]:
    from nasdiag.plot import write_figures

    made = not os.path.isdir(os.fspath(config.figures))
    try:
        written = [str(p) for p in write_figures(config.record, config.figures)]
    except BaseException as exc:  # Ctrl-C, a signal, a full disk: the run itself is complete and recorded (a full
        with contextlib.suppress(AttributeError):  # disk said only "disk full", its empty figure folder left behind)
            exc.complete_run = (os.fspath(config.record), os.fspath(config.figures))
        if made:
            with contextlib.suppress(OSError):  # only if empty
                os.rmdir(os.fspath(config.figures))
        raise
    if config.force:
        _remove_replaced_figures(os.fspath(config.figures), written, os.fspath(config.record))
    return written


def _remove_replaced_figures(folder: str, written: Sequence[str], record: str) -> None:
    """``force`` replaces a run and the leftover files of its run: the figures the replaced run drew into this folder
    that this one does not draw (the regret and wipeout figures of an XNAS run replaced by a DARTS run) stayed next to
    the new ones, as if this run had drawn them. Only figures nasdiag drew (files named as a registered figure (png) that
    hold its mark) are removed, as by `_remove_figures_drawn_in`: a symbolic link of such a name (to a figure kept
    elsewhere) was removed too, and the link was lost."""
    from nasdiag.plot.registry import is_nasdiag_figure, registered
    from nasdiag.record import load_meta

    cells = {None, "normal", "reduce", *load_meta(record).get("cell_types", [])}
    names = {spec.filename(cell) + ".png" for spec in registered().values() for cell in cells}
    for name in sorted(names - {os.path.basename(p) for p in written}):
        path = os.path.join(folder, name)
        if os.path.islink(path) or not os.path.isfile(path) or not is_nasdiag_figure(path):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def lost_a_rank(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another rank died, hung past the timeout or cannot be
    reached (torch's ``DistError`` family, gloo's "Connection closed by peer" / "Timed out waiting")."""
    dist_error = getattr(torch.distributed, "DistError", None)
    text = str(exc)
    return (dist_error is not None and isinstance(exc, dist_error)) or "/gloo/" in text or "NCCL" in text


class RankLostError(SearchError):
    """A collective of a data-parallel run failed: another rank stopped (its own output says why), hung past the
    timeout or cannot be reached. Every rank stops with this one line (gloo's traceback before); rank 0's record
    keeps its committed steps (``kept``) and continues with --resume once every rank runs again."""

    def __init__(self, exc: BaseException, rank: int, world: int):
        reason = " ".join(str(exc).split())
        reason = reason.split("] ", 1)[1] if reason.startswith("[") and "] " in reason else reason
        reason = reason.split(". ")[0][:200]
        super().__init__(f"rank {rank} of {world} stops: the data-parallel run lost another rank ({reason}); the "
                         "output of the other ranks says why")
        kept = getattr(exc, "kept", None)
        if kept is not None:
            self.kept, self.resumable = kept, True


def _run(config, callbacks, method_cls, hp, rank, world, device) -> SearchResult:
    from nasdiag.data import load_dataset
    from nasdiag.supernet import Network

    dtype = {"float32": torch.float32, "float64": torch.float64}[config.dtype]
    kwargs = {"seed": config.seed, "dtype": dtype}
    if config.dataset == "cifar10":
        kwargs["root"] = config.data_dir
    splits = load_dataset(config.dataset, **kwargs)
    n_train, n_val = len(splits.train), len(splits.val)
    S = steps_per_epoch(n_train, n_val, config.batch_size, world)
    if S == 0:
        share = min(n_train, n_val) // world
        raise ConfigError(f"batch size {config.batch_size} is larger than the {share} samples of the smaller search split "
                          f"{'per rank ' if world > 1 else ''}of {config.dataset}; use --batch-size <= {share}")
    if config.spectrum_every > S * config.epochs:  # it would record nothing: an option that does nothing
        raise ConfigError(f"spectrum_every {config.spectrum_every} is more than the run's {S * config.epochs} steps "
                          f"({config.epochs} × {S} per epoch), so no top eigenvalue would be recorded; use --spectrum-every "
                          f"<= {S * config.epochs}")
    hp.check_steps(S * config.epochs, f" ({config.epochs} epochs × {S} per epoch)")
    hp_values = hp.to_dict()
    _check_representable(hp_values, dtype, config.method, positive={
        f.name for f in hp.fields() if f.metadata.get("low") is not None and (f.metadata["low"] > 0 or f.metadata.get("low_open"))
        and not f.metadata.get("float64")})
    defining = config.run_defining(hp_values, world)
    digest = config.config_hash(hp_values, world)
    state, recorded_until = (None, 0)
    data = data_identity(splits)
    if config.resume:
        state, recorded_until = _resume_point(config, defining)
        if state is not None:
            _check_same_data(state.get("data"), data, config)

    def build_network():
        return Network(config.C, splits.num_classes, config.layers, steps=config.steps, multiplier=config.cell_multiplier,
                       in_channels=splits.in_channels, order=config.order, norm=config.norm,
                       **({"primitives": method_cls.primitives} if getattr(method_cls, "primitives", None) else {}))

    supernet = f"the supernet (C={config.C}, layers={config.layers}, steps={config.steps})"
    smaller = "use a smaller --C, --layers or --steps"
    try:
        with _fits_in_memory(supernet, device, smaller):
            _check_tensors_fit(build_network, supernet, device, dtype, smaller)
            torch.manual_seed(config.seed)
            net = build_network().to(device=device, dtype=dtype)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"invalid supernet settings: {exc.args[0] if exc.args else exc}") from None
    _set_engine(net, config.engine)
    epochs = state["epochs"] if state is not None else config.epochs
    schedule = Schedule(epochs=epochs, steps_per_epoch=S, batch_size=config.batch_size, train_size=n_train,
                        val_size=n_val, world_size=world)
    with _fits_in_memory(f"method {config.method!r} with its hyperparameters", device,
                         "use smaller sizes in --hp (nasdiag methods lists them and their defaults)"), \
            _float_range(config, dtype):
        method = method_cls(net, hp, schedule=schedule,
                            hessian_mode=config.hessian_mode if "hessian" in config.diagnostics else None, seed=config.seed)
    if config.spectrum_every:
        _check_softmax_architecture(method, config.method)
    start_step = 0
    if state is not None:
        method.load_state_dict(state["method"])
        set_rng_state(state["rng"])
        start_step = state["step"]
        if config.epochs > epochs:
            try:
                method.extend_schedule(config.epochs)
            except SearchError as exc:  # --epochs has a default: a plain --resume of a killed shorter run asks for this
                # too, and was told only to start a new run, although the run resumes as started with its own epochs
                if state["epoch"] >= epochs:
                    raise
                raise SearchError(f"{exc}; to resume this run of {epochs} epochs as it was started, pass --epochs "
                                  f"{epochs} (epochs={epochs})") from None
    if world > 1:
        method.distribute(device_ids=[device.index] if device.type == "cuda" else None)
        import torch.distributed as dist

        dist.barrier()  # every rank has read the record and the checkpoint before rank 0 opens the record

    extending = []  # the warning that --epochs extends the run, raised here and shown once the record is open
    if state is not None and config.epochs > epochs and rank == 0:  # --epochs has a default: a plain --resume of a
        # shorter run lands here; shown once the record is open (a resume refused for another writer said it too), but
        # raised before: as an error (PYTHONWARNINGS=error) it stopped the command after the record was opened, and the
        # refused command (exit 2) left a new empty segment next to the record
        finished = state["epoch"] >= epochs  # "pass --epochs 3 to finish it as started" was then "already finished"
        with warnings.catch_warnings(record=True) as extending:  # the filters still apply: "error" raises here
            warnings.warn(f"resuming {os.fspath(config.record)} extends the run from {epochs} to {config.epochs} epochs "
                          f"({'it had finished; ' if finished else ''}its schedule anneals on from the current rate)"
                          + ("" if finished else f"; pass --epochs {epochs} to finish it as started"), UserWarning,
                          stacklevel=2)
    loop_callbacks: List = []
    record_cb = None
    if config.record is not None:
        record_cb = _open_record(config, net, method, hp_values, defining, digest, world)
        loop_callbacks.append(Committed(record_cb, S, recorded_until))
        if record_cb.recorder is not None:
            checkpointer = Checkpointer(
                config.checkpoint, method, S, commit=record_cb.recorder.flush,
                extra={"run": defining, "config_hash": digest, "config": config.to_dict(), "epochs": config.epochs,
                       "data": data})
            if state is None:
                try:
                    checkpointer.save(0)  # a run killed before its first epoch end resumes from here
                except Exception as exc:  # a full disk: the record made stays, and a rerun was refused as existing
                    _say_what_is_kept(exc, config, record_cb)
                    raise
            loop_callbacks.append(checkpointer)
    for said in extending:
        warnings.showwarning(said.message, said.category, said.filename, said.lineno, said.file, said.line)
    progress = Progress(config.epochs * S, start_step, enabled=rank == 0 and config.progress)
    loop_callbacks.append(progress)
    loop_callbacks.extend(Committed(cb, S, recorded_until) for cb in callbacks)
    try:
        with (record_cb if record_cb is not None else contextlib.nullcontext()):
            evaluation = search_loop(method, splits, epochs=config.epochs, batch_size=config.batch_size, seed=config.seed,
                                     start_step=start_step, callbacks=loop_callbacks, diagnostics=config.diagnostics,
                                     spectrum_every=config.spectrum_every, rank=rank, world_size=world)
    except Exception as exc:
        if out_of_memory(exc):
            raise _ran_out_of_memory(exc, config, device, record_cb) from exc
        _say_what_is_kept(exc, config, record_cb, lost_rank=world > 1 and lost_a_rank(exc))
        raise
    finally:
        progress.close()
        if world > 1:  # graphs with captured collectives would hang the process group's destruction
            method.release_graphs()
    return SearchResult(method.genotype(), evaluation, None if config.record is None else os.fspath(config.record),
                        [], config, method)


def _check_softmax_architecture(method: SearchMethod, name: str) -> None:
    """Refuse ``spectrum_every`` for a method whose architecture distribution is not softmax(α): the recorded top
    eigenvalue is that of ∂²L/∂α² through Z = softmax(α) (docs/spectrum.md), which for SparseNAS (Z = A), BayesNAS
    (Z = w), XNAS (EG weights) and ASM-NAS (attention) describes a supernet the method never trains."""
    alphas = method.network.alphas()
    saved = {t: a.detach().clone() for t, a in alphas.items()}
    g = torch.Generator().manual_seed(0)
    softmax = bool(alphas)
    try:  # probabilities() as a function of α, at α and at a random α (a uniform α hides BayesNAS's uniform γ)
        for shift in (0.0, 1.0):
            with torch.no_grad():
                for t, a in alphas.items():
                    a.copy_(saved[t] + shift * torch.randn(a.shape, generator=g, dtype=a.dtype).to(a.device))
            probs = method.probabilities()
            softmax = softmax and probs.keys() == alphas.keys() and all(
                torch.allclose(probs[t], torch.softmax(a.detach(), dim=-1), rtol=1e-5, atol=0) for t, a in alphas.items())
    finally:
        with torch.no_grad():
            for t, a in alphas.items():
                a.copy_(saved[t])
    if softmax:
        return
    raise ConfigError(f"spectrum_every records the top eigenvalue of the α-Hessian through Z = softmax(α), and method "
                      f"{name!r} does not mix by softmax(α) (its probabilities() are not softmax of its α), so the "
                      "number would describe a supernet it never trains; pass --spectrum-every 0")


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure to allocate memory: torch's `OutOfMemoryError` (CUDA), its CPU allocator's
    RuntimeError ("can't allocate memory") or Python's `MemoryError`."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


class OutOfMemoryError(SearchError):
    """The search ran out of memory after it began recording. The record keeps every step before the failure
    and resumes with the same settings; ``record`` is its path (None when nothing is recorded)."""

    def __init__(self, message: str, record: Optional[str] = None):
        super().__init__(message)
        self.record = record
        self.resumable = record is not None  # the CLI adds the command that resumes it


#: what each part of the loop (`search_loop`'s ``stopped_at``) holds in memory, and the settings that size it
_MEMORY_USERS = {
    "step": ("the training step", "--batch-size, --C or --layers"),
    "spectrum": ("the top α-Hessian eigenvalue (--spectrum-every)", "--spectrum-every 0, or a smaller --batch-size or --C"),
    "evaluation": (f"the search-val evaluation (batches of {EVAL_BATCH_SIZE})", "--C or --layers"),
    "diagnostics": ("the epoch's diagnostics", "a cheaper --hessian-mode (diag or approx), --diagnostics cost, or a smaller "
                                               "--batch-size or --C"),
}


def _ran_out_of_memory(exc: BaseException, config: SearchConfig, device, record_cb) -> OutOfMemoryError:
    """The one line for an allocation that failed during the loop: where, which settings size it, and that the
    record (closed by now) keeps its rows and resumes."""
    phase, step, epoch = getattr(exc, "stopped_at", ("step", None, 0))
    what, lower = _MEMORY_USERS.get(phase, _MEMORY_USERS["step"])
    if phase == "diagnostics" and "hessian" in config.diagnostics:
        what = f"{what} (hessian in mode {config.hessian_mode})"
    where = f" at step {step}" if phase in ("step", "spectrum") and step is not None else ""
    head = (f"ran out of memory on {device} in {what}{where} (epoch {epoch}, batch size {config.batch_size}, C={config.C}, "
            f"layers={config.layers}, method {config.method}); lower {lower} in a run to a new --out")
    recorder = getattr(record_cb, "recorder", None)
    if recorder is None:
        return OutOfMemoryError(f"{head}")
    last = recorder.last_committed_step
    record = os.fspath(config.record)
    kept = f"keeps steps 1 to {last}" if last else "holds no step yet"
    return OutOfMemoryError(f"{head}; the record {record} {kept} and continues with the same settings through --resume "
                            "(once the memory is free, or on another --device)", record=record)


def _say_what_is_kept(exc: BaseException, config: SearchConfig, record_cb, lost_rank: bool = False) -> None:
    """On a machine failure during the loop (a failed write it is or was raised while handling,
    `_storage_failure_in`, or a collective that lost another rank, ``lost_rank``), tell the caller what the record keeps:
    ``exc.kept = (record, last committed step)`` and ``exc.resumable``, which the CLI turns into the command
    that resumes it (a full disk said only "disk full", as if the run were lost)."""
    recorder = getattr(record_cb, "recorder", None)
    if recorder is None or not (_storage_failure_in(exc) or lost_rank) or not os.path.exists(os.fspath(config.record)):
        return
    with contextlib.suppress(AttributeError):  # an exception type with __slots__
        exc.kept = (os.fspath(config.record), recorder.last_committed_step or 0)
        exc.resumable = True


def _storage_failure_in(exc: BaseException) -> bool:
    """Whether ``exc`` is or was raised while handling a failed write to storage: an OSError (`os_error_in`), or
    HDF5's RuntimeError naming the errno of its failed write ("file write failed: ... errno = 27"), which the record
    writer raises again as a RecordError; that one was not seen, so a search stopped by a full disk or a file-size
    limit in a record write said nothing of the steps the record keeps or of the command that resumes it."""
    if os_error_in(exc) is not None:
        return True
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, RuntimeError) and re.search(r"errno\s*=\s*[1-9]", str(exc)):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _device_memory(device) -> Optional[int]:
    """Bytes of memory ``device`` has in all (physical memory for the CPU), or None where it cannot be told."""
    device = torch.device(device)
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[1])
        if device.type == "cpu":
            return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, RuntimeError, AttributeError):
        pass
    return None


def _check_tensors_fit(build, what: str, device, dtype: torch.dtype, fix: str) -> None:
    """Refuse a module whose parameters and buffers alone outgrow ``device``'s memory, counted on the meta device
    before anything is allocated: where the kernel overcommits memory (``vm.overcommit_memory=1``), a
    ``--C 2000000`` supernet was not refused by a failed allocation but started filling terabytes, until the OOM
    killer ended the process without a word."""
    total = _device_memory(device)
    if total is None:
        return
    with torch.device("meta"):
        module = build()
    tensors = itertools.chain(module.parameters(), module.buffers())
    need = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors)
    if need > total:
        raise ConfigError(f"{what} does not fit in the memory of {device} (its parameters and buffers alone take "
                          f"{need / 2**30:,.1f} GiB of {total / 2**30:,.1f} GiB); {fix}")


@contextlib.contextmanager
def _fits_in_memory(what: str, device, fix: str):
    """Turn torch's failure to allocate a tensor sized by the user (``--C 200000``, a method's own tensors;
    a size past 64 bits fails to unpack) into one `ConfigError` line instead of a traceback."""
    try:
        yield
    except (RuntimeError, TypeError, MemoryError) as exc:
        if not (out_of_memory(exc) or "Overflow when unpacking long" in str(exc)):
            raise
        raise ConfigError(f"{what} does not fit in the memory of {device}; {fix}") from None


def _check_representable(hp_values: Mapping[str, Any], dtype: torch.dtype, method: str, positive=()) -> None:
    """A float hyperparameter past the run dtype's largest value (``w_lr=1e39`` in float32) built the method, then
    stopped the first optimizer step with torch's "cannot be converted ... without overflow" traceback; one so small
    that the dtype rounds it to 0 (``init_gamma=1e-300`` in float32, its range > 0) ran as 0: BayesNAS pruned every op
    (an empty genotype, exit code 0), SNAS's ``tau0`` divided by 0. ``positive``: the keys whose range excludes 0."""
    largest, name = torch.finfo(dtype).max, str(dtype).replace('torch.', '')
    for key, value in hp_values.items():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, float) and math.isfinite(v) and abs(v) > largest:
                raise ConfigError(f"hyperparameter {key}={v} of method {method!r} is larger than "
                                  f"{name} holds ({largest:.3g}); give a value nearer its "
                                  "default (nasdiag methods lists them) or --dtype float64")
            if key in positive and isinstance(v, float) and v != 0 and torch.tensor(v, dtype=dtype).item() == 0:
                raise ConfigError(f"hyperparameter {key}={v} of method {method!r} is so small that {name} rounds it to 0 "
                                  f"(its smallest positive value is {torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps:.3g}); give a value "
                                  "nearer its default (nasdiag methods lists them) or --dtype float64")


@contextlib.contextmanager
def _float_range(config: SearchConfig, dtype):
    """A method built from hyperparameters past what floating point holds (``init_gamma=1e300`` in float32,
    ``reward_bound=1e-300`` squared to 0) failed with torch's overflow or a ZeroDivisionError traceback: one
    `ConfigError` line naming the values given instead."""
    try:
        yield
    except (ZeroDivisionError, OverflowError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "without overflow" not in str(exc):
            raise
        given = ", ".join(f"{k}={v}" for k, v in config.hp.items()) or "the defaults"
        raise ConfigError(f"method {config.method!r} cannot be built with its hyperparameters ({given}): a value is too "
                          f"large or too small for {str(dtype).replace('torch.', '')} arithmetic ({exc}); give values "
                          "nearer the defaults (nasdiag methods lists them)") from None


def _set_engine(net, engine: str) -> None:
    set_engine = getattr(net, "set_engine", None)
    if set_engine is None:
        if engine == "fast":
            raise ConfigError(f"engine 'fast' needs {type(net).__name__}.set_engine, which this supernet lacks; "
                              "use --engine eager or auto")
        return
    try:
        set_engine(engine)
    except ValueError as exc:
        raise ConfigError(f"engine {engine!r}: {exc}") from None


def _open_record(config, net, method, hp_values, defining, digest, world):
    """Open the record (rank 0) after every check has passed; with --force drop the old checkpoint only
    once the record's writer lock is ours."""
    from nasdiag.record import RecorderCallback, RecordWarning

    meta = {
        "method": config.method,
        "config": {k: v for k, v in config.to_dict().items() if k not in SESSION_FIELDS},
        "seed": config.seed,
        "op_names": list(net.primitives),
        "edge_names": {t: net.edge_labels() for t in net.cell_types},
        "cell_types": list(net.cell_types),
        "hp": hp_values,
        "run": defining,
        "config_hash": digest,
        "world_size": world,
        # torch's intra-op threads of this session (a session field, not in config): another count sums in another
        # order, so a float64 DSNAS rerun from the config alone with 2 threads for 1 differed by 1 ulp in α
        "threads": torch.get_num_threads(),
    }
    from nasdiag.distributed import rank

    # rank 0 replaces the record (the others would read it while it is replaced)
    replaced = _figures_of(os.fspath(config.record)) if config.force and rank() == 0 else None
    with warnings.catch_warnings():
        # the run-defining settings were compared above; only epochs (an explicit extension) may differ
        warnings.simplefilter("ignore", RecordWarning)
        record_cb = RecorderCallback(config.record, meta=meta, resume=config.resume, overwrite=config.force)
    if record_cb.recorder is not None:
        stale = [temp_path(config.checkpoint)] + ([config.checkpoint] if config.force else [])
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if replaced is not None and (config.figures is None or os.path.abspath(os.fspath(config.figures)) != replaced[0]):
            _remove_figures_drawn_in(*replaced)  # in this run's own folder: _remove_replaced_figures, once drawn
    return record_cb


def _figures_of(record: str) -> Optional[Tuple[str, List[str]]]:
    """(the absolute figure folder, the cell types) of the search that wrote ``record`` (its meta), None where the
    folder is not known: a relative folder is taken from the folder that search ran in, the record's absolute path less
    the path the search was given, and is unknown when those do not match (the record moved since)."""
    from nasdiag.record import load_meta
    from nasdiag.record.errors import RecordError

    try:
        meta = load_meta(record)
    except (RecordError, OSError):
        return None
    stored = meta.get("config")
    figures, named = (stored.get("figures"), stored.get("record")) if isinstance(stored, Mapping) else (None, None)
    if not isinstance(figures, str) or not figures or not isinstance(named, str) or not named:
        return None
    cells = [c for c in meta.get("cell_types", []) if isinstance(c, str)]
    if os.path.isabs(figures):
        return os.path.normpath(figures), cells
    given = os.path.normpath(named).split(os.sep)
    here = os.path.abspath(record).split(os.sep)
    if os.path.isabs(named) or ".." in given or here[-len(given):] != given:
        return None
    return os.path.normpath(os.path.join(os.sep, *here[:-len(given)], figures)), cells


def _remove_figures_drawn_in(folder: str, cells: Sequence[str]) -> None:
    """Remove the figures nasdiag drew in ``folder`` (files named as a registered figure that hold its mark), and the
    folder if that leaves it empty: the figures of a run that --force replaced, when the new run draws elsewhere or none
    (``--no-figs``, another ``--figs``) stayed next to the new record, as if of its run."""
    from nasdiag.plot.commands import named_as_figures
    from nasdiag.plot.registry import is_nasdiag_figure

    for fmt in ("png", "pdf", "svg"):  # a search draws png; nasdiag plot --out of the same folder, any
        for path in named_as_figures(folder, fmt, cells):
            if path.is_file() and not path.is_symlink() and is_nasdiag_figure(path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
    with contextlib.suppress(OSError):  # only if empty
        os.rmdir(folder)


__all__ = ["Committed", "OutOfMemoryError", "Progress", "RankLostError", "SearchResult", "check_paths", "epoch_batches", "run", "search_loop", "steps_per_epoch"]
