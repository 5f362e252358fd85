"""`RecorderCallback`: the hooks a training loop calls to record the statistics of a search.

A plain loop::

    with RecorderCallback("run.h5", meta=meta) as callback:
        try:
            for step, ... in ...:
                stats = method.step(...)           # {"scalars/loss": tensor, "arch/normal/weights": ...}
                callback.on_step_end(step, stats)
            callback.on_epoch_end(epoch, epoch_stats)
        except BaseException as exc:
            callback.on_exception(exc)
            raise

Statistics stay where they are (on the GPU, for a GPU run) until a batch of rows is handed to the
recorder: no host-device synchronisation per step. Under DDP every rank constructs the callback and
calls every hook; the rows of a batch are reduced across ranks with one call of
`nasdiag.distributed.reduce_statistics` (one collective per reduction rule), and only rank 0 owns a
`Recorder`. Constructing the callback is a collective then too: a record rank 0 cannot open stops every rank.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import warnings
from collections.abc import Mapping

import numpy as np

from nasdiag.arrays import is_tensor, stack_to_numpy
from nasdiag.record import schema
from nasdiag.record.errors import RecordError, RecordWarning
from nasdiag.record.writer import (
    Recorder,
    _python_scalar_fits,
    checked_flush_seconds,
    checked_step,
    unrecordable_tensor,
)
from nasdiag.vocabulary import RULES


def _one_thread_at_a_time(hook):
    """A hook called from another thread while one runs is refused: the two threads' rows were merged into one
    another's steps (a value recorded under another step), silently. The thread that runs a hook may enter another
    (a flush of the recorder calls the flush listener)."""
    @functools.wraps(hook)
    def guarded(self, *args, **kwargs):
        if not self._turn.acquire(blocking=False):
            raise RecordError(
                f"RecorderCallback.{hook.__name__.lstrip('_')} called from another thread while a hook runs; a callback "
                "serves one thread: call its hooks from one thread, or under one lock"
            )
        try:
            return hook(self, *args, **kwargs)
        finally:
            self._turn.release()
    return guarded


class RecorderCallback:
    """Record statistics handed to ``on_step_end`` / ``on_epoch_end`` / ``on_exception``.

    Parameters
    ----------
    target:
        A record path (rank 0 opens a `Recorder` there with ``meta`` and ``recorder_kwargs``; other
        ranks open nothing), an open `Recorder` (used as is; it must live on rank 0 only: under DDP one on another
        rank is a `RecordError` on every rank at the construction), or None
        (this rank reduces but does not write). Without a process group the rank is read from the ``RANK``
        variable a launcher sets: a process it calls rank 1 writes nothing (a `RecordWarning` says so at its first rows).
    meta, **recorder_kwargs:
        Passed to `Recorder` when ``target`` is a path (``flush_every``, ``resume``, ``overwrite``...).
        ``flush_every`` (default 64, or the given recorder's) is also the number of rows the callback
        holds before it hands them over; under DDP every rank must use the same value, and the same ``meta``
        (every rank checks it as rank 0's `Recorder` does, and its rows' shapes against it), to which the callback adds
        ``world_size``, the number of ranks the rows are reduced over, unless it names one.
    reduce:
        Under an initialised process group with several ranks, reduce statistics across ranks
        before writing (every rank must then call every hook). False: rank 0 records its own.
    rules, ddof, group:
        Passed to `nasdiag.distributed.reduce_statistics`. ``rules`` maps a path or glob to one of
        the reduction rules of `nasdiag.vocabulary.RULES`; another rule, or an unknown keyword
        argument, raises `RecordError` here, before any file is opened.

    Rows: each step is one row. The row of a step is held back until a hook brings another step
    (or a flush), so that ``on_epoch_end`` can add the epoch's statistics to the row of the epoch's
    last step, and calls with the same step (gradient accumulation) merge into one row; later values
    of a path replace earlier ones. ``on_epoch_end`` adds ``scalars/epoch`` (float32) when absent.
    Steps never go back: a hook called with a step before the open row's, or with the step of a row
    a flush has already written, raises `RecordError` at that call and records nothing of it; the
    callback stays usable and everything recorded before is kept. After `close`, ``on_step_end`` and
    ``on_epoch_end`` raise `RecordError` (the record is closed; a new callback with ``resume=True`` goes on).
    A callback serves one thread: a hook called from another thread while one runs raises `RecordError`.

    Batches: rows are kept as handed in (tensors are snapshotted with ``detach().clone()`` on their
    device, numpy arrays copied) and handed to the recorder ``flush_every`` rows at a time (single
    process: also when the recorder's ``flush_seconds`` have passed, and after an epoch end as many as
    fill up the recorder's buffer, so that it writes them) and at every epoch end: each
    path's tensors are stacked and copied to the host once, and under DDP the whole batch is reduced
    with one call (a row in which a path has another shape or dtype than in its first row is then refused, with
    a `RecordError` at that hand-over, costing that row only; Python scalars are cast as `Recorder.log` casts them). After ``on_epoch_end`` every row so far,
    the open one included, is settled, so a `Recorder.flush` on rank 0 alone (a checkpoint at the
    epoch boundary) commits all of them.
    `flush` (every rank), `close` (every rank) and, in a single process, the recorder's own flushes
    (``Recorder.flush``, SIGTERM, exit; through `Recorder.add_flush_listener`) write everything held.
    Under DDP the recorder alone cannot reduce (the other ranks are not there): rows not yet reduced
    when it closes on its own (SIGTERM, exit) or at ``on_exception`` are not written, with a
    `RecordWarning` naming their steps (a resume replays them; nothing local is passed off as a
    global value); at a plain `Recorder.flush` they wait for the next batch.
    """

    def __init__(
        self,
        target,
        *,
        meta: Mapping | None = None,
        reduce: bool = True,
        rules: Mapping[str, str] | None = None,
        ddof: int = 0,
        group=None,
        **recorder_kwargs,
    ):
        from nasdiag import distributed

        self._turn = threading.RLock()  # see _one_thread_at_a_time
        _check_recorder_options(recorder_kwargs)
        _check_rules(rules)
        distributed.check_ddof(ddof, RecordError)  # else refused only at the first reduction under DDP, rows held
        self._reduce = reduce
        self._rules = rules
        self._ddof = ddof
        self._group = group
        # Rows as [step, raw, settled]: raw values as handed in (snapshots, maybe on a GPU), settled
        # values converted to numpy (and reduced across ranks). The open row is `_open`.
        self._open: list | None = None
        self._rows: list[list] = []  # finished rows, in step order
        self._last_step: int | None = None  # step of the newest row, open or finished
        self._shapes: dict = {}  # path -> (row shape, first step, dtype) of the rows reduced across ranks so far
        self._closed = False  # close() ran: later hooks are refused, not dropped
        self._path = None  # a record path this rank does not write (another rank's recorder writes it)
        self._meta: dict = {}  # the meta given to a rank that opens no recorder: its rows are checked against it
        self.recorder = None
        try:
            self._open_target(target, meta, recorder_kwargs)
        except Exception as err:
            self._agree_on_opening(err)
            raise
        self._agree_on_opening(None)
        if self.recorder is not None:
            self.recorder.add_flush_listener(self._on_recorder_flush)

    def _open_target(self, target, meta, recorder_kwargs) -> None:
        from nasdiag import distributed

        group = self._group
        if isinstance(target, Recorder):
            if meta is not None or recorder_kwargs:
                raise RecordError("meta and recorder options apply when target is a path, not an open Recorder")
            if not distributed.is_writer(group) and self._needs_reduction():  # it wrote a second record of the rows
                raise RecordError(f"an open Recorder is the target on rank {distributed.rank(group)}, but under DDP only "
                                  "rank 0 writes the record; give the other ranks None (or every rank the record's "
                                  "path: rank 0 opens it)")
            self.recorder: Recorder | None = target
            if target.rows_committed or target.rows_buffered:  # rows logged directly in this session
                self._last_step = target.last_step
        elif target is None:
            self.recorder = None
        else:
            if not isinstance(target, (str, os.PathLike)):
                raise RecordError(f"target must be a path, a Recorder or None, got {type(target).__name__}")
            if self._needs_reduction() and (meta is None or isinstance(meta, Mapping) and "world_size" not in meta):
                # the ranks the rows are reduced over (a report of the record said world size 1)
                meta = {**(meta or {}), "world_size": distributed.world_size(group)}
            self.recorder = Recorder(target, meta=meta, **recorder_kwargs) if distributed.is_writer(group) else None
            self._path = None if self.recorder is not None else os.fspath(target)
            if self.recorder is None:  # checked as rank 0's Recorder checks it: a meta it refused was taken here, and
                self._meta = schema.normalize_meta(meta)  # this rank went on into its loop alone (gloo's traceback)
        self.rows_per_batch = self.recorder.flush_every if self.recorder is not None else _rows_per_batch(recorder_kwargs)

    def _agree_on_opening(self, failure: Exception | None) -> None:
        """Under DDP every rank learns whether every rank made its callback (one collective): rank 0's Recorder refused
        alone (a record already at the path, a full disk) while the other ranks went on into their loops, where their
        first reduction waited for rank 0 until gloo's timeout (30 minutes by default). Raises on every rank alike."""
        if not self._needs_reduction():
            return
        from nasdiag import distributed

        said = None if failure is None else str(failure).splitlines()[0] if str(failure) else type(failure).__name__
        # with the layouts of a resumed record's paths, which only rank 0's recorder knows: a row of another shape or
        # dtype was refused by it alone at the hand-over, the other ranks going on without it
        layouts = self.recorder.layouts if failure is None and self.recorder is not None else {}
        heard = distributed.all_gather_objects((said, layouts), self._group)
        others = [(r, m) for r, (m, _) in enumerate(heard) if m is not None]
        if failure is None and others:
            if self.recorder is not None:
                self.recorder.close()
            rank, message = others[0]
            raise RecordError(f"rank {rank} could not make its RecorderCallback, so no rank records: {message}")
        for _, known in heard[:1] if failure is None else ():  # rank 0's (the writer)
            for path, (shape, dtype) in known.items():  # float paths: every reduction rule keeps a float's dtype (an
                if np.dtype(dtype).kind == "f":  # int's 'mean' is float64, a bool's 'sum' int64: not the raw rows')
                    self._shapes.setdefault(path, (tuple(shape), None, np.dtype(dtype)))

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes (holds a recorder)."""
        return self.recorder is not None

    @property
    def rows_held(self) -> int:
        """Rows handed to the hooks but not yet given to the recorder (the open row included)."""
        return len(self._rows) + (self._open is not None)

    @property
    def closed(self) -> bool:
        """`close` has run: the hooks refuse further rows."""
        return self._closed

    @_one_thread_at_a_time
    def on_step_end(self, step: int, statistics: Mapping) -> None:
        """Record the statistics of ``step`` (a mapping of record path -> array-like).

        Tensors are kept on their device (snapshotted, not copied to the host) until the batch is
        handed to the recorder. A step before the open row's (or one already written), a value of a dtype
        the recorder cannot store (complex, strings) or a value of a shape the record's meta contradicts
        (docs/schema.md: (E, K) against ``edge_names`` and ``op_names``; under DDP on every rank, against the meta it
        was given: give every rank the same ``meta``) raises `RecordError`; nothing of this call is recorded and the
        callback stays usable."""
        statistics = _snapshot(statistics)
        self._check_open("on_step_end")  # before the step: a closed record is what is wrong, whatever the step
        step = self._row_step(step, "on_step_end")
        self._check_meta_shapes(statistics)
        try:
            if self._open is not None and step != self._open[0]:
                self._finish_row()
        finally:  # a bad earlier row raised at its hand-over: this call's row is still kept
            self._add(step, statistics)

    @_one_thread_at_a_time
    def on_epoch_end(self, epoch: int, statistics: Mapping | None = None, *, step: int | None = None) -> None:
        """Record the epoch's statistics in the row of its last step (or of ``step`` if given).

        An epoch end is a point every rank reaches: the rows so far, the open one included, are
        converted (and reduced across ranks) now and the finished ones handed to the recorder, so that
        a `Recorder.flush` on rank 0 alone (a checkpoint at the epoch boundary) commits all of them."""
        statistics = _snapshot(statistics or {})
        self._check_open("on_epoch_end")  # before the step: after close there is no open row, which said "pass step="
        row_step = self._open_row_step(f"on_epoch_end(epoch={epoch})") if step is None else self._row_step(step, "on_epoch_end")
        statistics.setdefault("scalars/epoch", np.float32(epoch))
        self._check_meta_shapes(statistics)
        if self._open is not None and row_step != self._open[0]:
            self._finish_row(hand_over=False)
        # Still open: a Lightning batch right after the epoch can carry the same global step.
        self._add(row_step, statistics)
        self._hand_over(collective=True, open_row=True)

    @_one_thread_at_a_time
    def on_exception(self, exception: BaseException, statistics: Mapping | None = None, *, step: int | None = None) -> None:
        """Write what is held back (and ``statistics``, if any, at ``step``) and flush to disk.

        The recorder stays open, so a loop that recovers may go on logging; close it (or leave
        the ``with`` block) when the run ends. No collective runs here (after an exception other
        ranks may never reach this call): under DDP, rows not yet reduced are not written (see the
        class docstring); in a single process everything is written. ``statistics`` that cannot be
        placed (a step that goes back, or no ``step`` and no open row) raise `RecordError` after
        everything else is written.
        """
        refused = None
        if statistics:
            try:
                row_step = self._open_row_step("on_exception") if step is None else self._row_step(step, "on_exception")
                statistics = _snapshot(statistics)
            except RecordError as err:  # reported after the held rows are safe on disk
                refused = err
            else:
                if self._open is not None and row_step != self._open[0]:
                    self._finish_row(hand_over=False)
                self._add(row_step, statistics)
        try:
            self._finish_row(hand_over=False)
            self._hand_over(collective=False, drop_unreduced=True)
        finally:  # a held row of another shape raised at its hand-over: the rows logged before it were left unwritten
            if self.recorder is not None and not self.recorder.closed:
                self.recorder.flush()
        if refused is not None:
            raise refused

    @_one_thread_at_a_time
    def flush(self) -> None:
        """Hand every held row to the recorder (reducing across ranks: under DDP every rank must call
        it) and commit it to disk. Afterwards ``recorder.last_committed_step`` is the last step seen."""
        try:
            self._finish_row(hand_over=False)
            self._hand_over(collective=True)
        finally:  # as in on_exception: a refused row costs only itself, the others are committed before it raises
            if self.recorder is not None and not self.recorder.closed:
                self.recorder.flush()

    @_one_thread_at_a_time
    def close(self) -> None:
        """Write what is held back and close the recorder (if this rank has one). Under DDP every rank
        must call it (the last rows are reduced first)."""
        try:
            self._finish_row(hand_over=False)
            self._hand_over(collective=True)
        finally:
            self._closed = True
            if self.recorder is not None:
                self.recorder.close()

    def __enter__(self) -> RecorderCallback:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            if self.recorder is not None:
                self.recorder.__exit__(exc_type, exc, tb)
        finally:  # the recorder is closed: later hooks are refused, as after close(), not dropped without a word
            self._closed = True

    # --- batching ------------------------------------------------------------------------------

    def _check_meta_shapes(self, statistics: dict) -> None:
        """A value whose shape the record's meta contradicts (an (E, K) family against ``op_names`` and
        ``edge_names``) is refused at its call, nothing of the call recorded: at the hand-over it cost every row that
        held the path, the whole record of a loop that logs it each step, after the loop. Under DDP every rank
        checks, against the meta it was given (rank 0: its recorder's): only rank 0's recorder refused such a row, at
        the hand-over, while the other ranks went on into their next collectives alone (gloo's traceback, or a hang)."""
        if self.recorder is not None:
            check = self.recorder.check_shape
        elif self._meta and self._needs_reduction():
            def check(path, shape):
                schema.check_against_meta(path, tuple(shape), self._meta)
        else:  # a rank that neither writes nor reduces: its rows are not recorded
            return
        for path, value in statistics.items():
            try:
                check(path, np.shape(value))
            except RecordError as err:
                raise RecordError(f"{err}; nothing of this call was recorded") from None

    def _needs_reduction(self) -> bool:
        if not self._reduce:
            return False
        from nasdiag import distributed

        return distributed.world_size(self._group) > 1

    def _check_open(self, hook: str) -> None:
        """A hook after `close` would hand rows to a closed recorder, which drops them: refused on every rank."""
        if self._closed:
            where = f" of {self.recorder.path}" if self.recorder is not None else ""
            raise RecordError(
                f"{hook} after close(): the record{where} is closed and nothing of this call was recorded; to go on "
                "recording, make a new RecorderCallback(path, resume=True)"
            )

    def _row_step(self, step, hook: str) -> int:
        """``step`` checked against the rows so far: the open row's step (merge) or a later one.
        Checked at the call, before anything is held, so that a step that goes back is refused
        there and not where its row is written (by then later rows would be refused with it)."""
        step = checked_step(step)
        last = self._last_step
        if self._open is not None and step < self._open[0]:
            raise RecordError(
                f"{hook}: step {step} is before the current step {last}; steps never go back (step {last} merges into "
                f"its row, a later step starts a new one); nothing of this call was recorded"
            )
        if self._open is None and last is not None and step <= last:
            raise RecordError(
                f"{hook}: step {step} is not after step {last}, whose row is already written (by a flush or an "
                f"exception); pass a step after {last}; nothing of this call was recorded"
            )
        return step

    def _open_row_step(self, hook: str) -> int:
        """The open row's step, for a hook called without ``step=``."""
        if self._open is not None:
            return self._open[0]
        if self._last_step is None:
            raise RecordError(f"{hook} came before any on_step_end; pass step= to say which row it belongs to")
        raise RecordError(
            f"{hook}: the row of step {self._last_step} is already written (by a flush or an exception); "
            f"pass step= a step after {self._last_step}; nothing of this call was recorded"
        )

    def _add(self, step: int, statistics: dict) -> None:
        if self._open is None:
            self._open = [step, {}, {}]
        self._open[1].update(statistics)
        self._last_step = step

    def _finish_row(self, hand_over: bool = True) -> None:
        """Close the open row; hand the batch over when it is full (or, alone, when a flush is due)."""
        if self._open is not None:
            self._rows.append(self._open)
            self._open = None
        if not hand_over or not self._rows:
            return
        if len(self._rows) >= self.rows_per_batch - self._rows_in_recorder():
            self._hand_over(collective=True)
        elif self.recorder is not None and self.recorder.flush_due and not self._needs_reduction():
            self._hand_over(collective=False)

    def _rows_in_recorder(self) -> int:
        """Rows the recorder holds unwritten (a partial batch an epoch end handed over). The next batch fills its buffer
        up, so that the recorder writes when it comes: a full batch on top of them stayed unwritten, and a kill lost up
        to twice ``flush_every`` rows. Under DDP the ranks hand over at the same rows, which rank 0's buffer cannot
        decide: 0 there."""
        if self.recorder is None or self.recorder.closed or self._needs_reduction():
            return 0
        return min(self.recorder.rows_buffered, self.rows_per_batch - 1)

    def _hand_over(self, collective: bool, open_row: bool = False, drop_unreduced: bool = False) -> None:
        """Settle the raw values of the held rows (convert; under DDP reduce, which needs
        ``collective``), then log the settled rows in order. ``open_row``: settle the open row too
        (it stays open). ``drop_unreduced``: rows that needed a reduction that cannot run now are
        dropped, with a warning."""
        rows = [row for row in self._rows + ([self._open] if open_row and self._open else []) if row[1]]
        refused = []
        if rows:
            if not self._needs_reduction():
                settled = _convert_rows(rows)
            elif collective:
                # One shape and dtype per path in a reduced batch: a row of another is refused here (the ranks hold
                # the same shapes, so they refuse the same rows); it failed the whole batch, held it, and every
                # batch after it, for the rest of the run.
                rows, refused = _one_shape_per_path(rows, self._shapes)
                rows, uncounted = _pooled_with_counts(rows, self._rules)
                refused += uncounted
                gone = [id(row) for row, _ in refused]
                self._rows = [row for row in self._rows if id(row) not in gone]
                if self._open is not None and id(self._open) in gone:
                    self._open = None
                settled = _reduce_rows(rows, self._rules, self._ddof, self._group, self._shapes)
            else:
                settled = None
                if drop_unreduced:
                    self._drop_unreduced()
            if settled is not None:
                for row, values in zip(rows, settled):
                    row[2].update(values)  # handed in later: replaces an earlier settled value
                    row[1] = {}
        self._log_settled()
        if refused:
            more = f" ({len(refused) - 1} more row(s) of this batch refused alike)" if len(refused) > 1 else ""
            raise RecordError(refused[0][1] + more)

    def _log_settled(self) -> None:
        """Log the finished rows up to the first one that still holds raw values (order is kept)."""
        errors = []
        if self._path is not None and self._rows and not self._rows[0][1]:
            self._warn_no_writer()
        while self._rows and not self._rows[0][1]:
            step, _, values = self._rows.pop(0)  # popped first: a SIGTERM flush meanwhile skips it
            if self.recorder is None or self.recorder.closed:
                continue
            try:
                self.recorder.log(step, values)
            except RecordError as err:  # one bad row must not cost the rows after it
                errors.append(err)
            except BaseException:
                if self.recorder.last_step != step:  # Ctrl-C before the recorder took it: keep it for on_exception
                    self._rows.insert(0, [step, {}, values])
                raise
        if errors:
            raise errors[0]

    def _warn_no_writer(self) -> None:
        """Rows of a non-writing rank are dropped (rank 0 writes them, reduced): right under a process group, but a
        single process that is not rank 0 only by a ``RANK`` variable in its environment (a job array, a shell of a
        torchrun launch, no ``init_process_group``) would drop every row of its own run, silently."""
        from nasdiag import distributed

        if distributed.world_size(self._group) > 1:
            self._path = None  # the reduction hands the rows to rank 0: nothing to say
            return
        path, self._path = self._path, None  # once
        warnings.warn(
            f"RecorderCallback({path!r}) does not write: the environment says RANK={os.environ.get('RANK')} and no process group is "
            "initialised, so this process takes itself for a rank other than 0 and leaves the record to rank 0; its rows "
            "are not recorded. Call torch.distributed.init_process_group before making the callback, or for a run of its "
            "own unset RANK (or give it an open Recorder)",
            RecordWarning,
            stacklevel=5,
        )

    def _drop_unreduced(self) -> None:
        dropped = [row[0] for row in self._rows if row[1]]
        self._rows = [row for row in self._rows if not row[1]]
        if self.recorder is not None and dropped:
            warnings.warn(
                f"{self.recorder.path}: {len(dropped)} row(s) (steps {dropped[0]}..{dropped[-1]}) were not reduced "
                "across ranks and are not recorded; call RecorderCallback.flush() on every rank to write them",
                RecordWarning,
                stacklevel=4,
            )

    @_one_thread_at_a_time
    def _on_recorder_flush(self, closing: bool) -> None:
        """Flush listener: the recorder flushes or closes on its own (no other rank takes part)."""
        if self._open is not None and not (self._open[1] and self._needs_reduction()):
            self._finish_row(hand_over=False)  # as before: a flush writes the open row too
        elif closing:
            self._finish_row(hand_over=False)
        self._hand_over(collective=False, drop_unreduced=closing)


def _check_recorder_options(options: Mapping) -> None:
    """Refuse keywords that `Recorder` does not take, naming the ones it does (here, before a file
    is opened, and on every rank alike)."""
    known = [name for name in inspect.signature(Recorder).parameters if name not in ("path", "meta")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise RecordError(
            f"RecorderCallback got unknown keyword argument(s) {', '.join(unknown)}; it takes meta, reduce, rules, "
            f"ddof, group and the Recorder options {', '.join(known)}"
        )


def _rows_per_batch(options: Mapping) -> int:
    """``flush_every`` of a rank that opens no recorder, refused as rank 0's `Recorder` refuses it: int() took 0, 2.5 and
    True (so rank 1 went on into its loop while rank 0 stopped) and was a ValueError traceback for a string; its
    ``flush_seconds`` likewise (any value was taken)."""
    checked_flush_seconds(options.get("flush_seconds"))
    flush_every = options.get("flush_every", 64)
    if isinstance(flush_every, bool) or not isinstance(flush_every, (int, np.integer)) or flush_every < 1:
        raise RecordError(f"flush_every must be a positive int, got {flush_every!r}")
    return int(flush_every)


def _check_rules(rules) -> None:
    """Refuse a ``rules`` mapping with a rule that `nasdiag.distributed.reduce_statistics` does not
    know (it would otherwise fail only at the first reduction, under DDP)."""
    if rules is None:
        return
    if not isinstance(rules, Mapping):
        raise RecordError(f"rules must be a mapping of record path or glob -> reduction rule, got {type(rules).__name__}")
    for pattern, rule in rules.items():
        if not isinstance(pattern, str):
            raise RecordError(f"rules keys must be record paths or globs (str), got {pattern!r}")
        if rule not in RULES:
            raise RecordError(f"rules[{pattern!r}] = {rule!r} is not a reduction rule; use one of {', '.join(RULES)}")


def _snapshot(statistics) -> dict:
    """The values as they are now: tensors cloned on their device (no host copy), arrays copied."""
    if not isinstance(statistics, Mapping):
        raise RecordError(f"statistics must be a mapping of record path -> array-like, got {type(statistics).__name__}")
    out = {}
    for path, value in statistics.items():
        if is_tensor(value):
            kind = unrecordable_tensor(value)
            if kind:  # refused at its call: at the hand-over it failed its batch and every later one
                raise RecordError(
                    f"{path!r}: a {kind} tensor cannot be recorded; log a dense tensor with data (e.g. .to_dense(), "
                    ".dequantize()); nothing of this call was recorded"
                )
            value = value.detach().clone()
        elif isinstance(value, np.ndarray):
            value = value.copy()
        elif type(value) not in _PYTHON_SCALARS:
            # Lists and other host values become arrays here, so that one numpy cannot convert (a ragged list) is
            # refused at its call: at the hand-over it failed the whole batch, and every batch after it.
            try:
                value = np.array(value)
            except (ValueError, TypeError) as err:
                raise RecordError(
                    f"{path!r}: {type(value).__name__} value cannot be made an array ({str(err).splitlines()[0]}); "
                    "log a scalar, an array or a tensor; nothing of this call was recorded"
                ) from None
        dtype = value.dtype if is_tensor(value) or isinstance(value, (np.ndarray, np.generic)) else np.asarray(value).dtype
        if (dtype.is_complex if is_tensor(value) else dtype.kind not in "biuf"):
            # refused at its call: under DDP the hand-over's reduction failed the whole batch with it
            raise RecordError(f"{path!r}: dtype {dtype} cannot be recorded; log bool, int or float values (a complex "
                              "value as its real and imaginary parts); nothing of this call was recorded")
        out[path] = value
    return out


def _columns(rows) -> dict[str, tuple[list[int], list]]:
    """Per path: the indices of the rows (``[step, raw, settled]``) whose raw values hold it, and those values."""
    columns: dict[str, tuple[list[int], list]] = {}
    for i, (_, values, _) in enumerate(rows):
        for path, value in values.items():
            where, column = columns.setdefault(path, ([], []))
            where.append(i)
            column.append(value)
    return columns


_PYTHON_SCALARS = (bool, int, float)


def _convert_rows(rows) -> list[dict]:
    """The raw values of the rows as numpy arrays; one host copy per path and tensor kind. Python scalars stay
    as they are, so that `Recorder.log` casts them to their path's dtype as it does when called directly (an
    int 0 on a float path; as a numpy int64 it was refused, and its row lost)."""
    out: list[dict] = [{} for _ in rows]
    for path, (where, column) in _columns(rows).items():
        for i, value, array in zip(where, column, stack_to_numpy(column)):
            out[i][path] = value if type(value) in _PYTHON_SCALARS else array
    return out


def _shape(value) -> tuple:
    return tuple(value.shape) if hasattr(value, "shape") else ()


def _recorded_dtype(value) -> np.dtype:
    """The dtype ``value`` reaches the recorder with (a tensor's without a host copy; bfloat16 and the float8 types
    as float32, as `nasdiag.arrays` converts them)."""
    if is_tensor(value):
        try:
            return np.dtype(str(value.dtype).removeprefix("torch."))
        except TypeError:
            return np.dtype(np.float32)
    return np.asarray(value).dtype.newbyteorder("=")  # the recorder stores big-endian values in the native order


def _fits(value, dtype: np.dtype) -> bool:
    """Whether the recorder takes ``value`` into a path of ``dtype``: of that dtype, or a Python scalar it casts there."""
    if type(value) not in _PYTHON_SCALARS:
        return _recorded_dtype(value) == dtype
    try:
        with np.errstate(over="ignore"):  # a finite int that overflows a float32 path is inf there, as the recorder stores it
            return _python_scalar_fits(value, dtype) and np.asarray(value, dtype=dtype) is not None
    except OverflowError:  # an int beyond any float
        return False


def _one_shape_per_path(rows, known: dict):
    """Split ``rows`` into those whose every path has its known shape and dtype and the refused others. ``known`` maps
    a path to ``(shape, step, dtype)`` of its first row; it is kept across batches and updated here with the kept rows.
    Returns ``(kept, refused)``, ``refused`` a list of ``(row, message)``. (A row of another dtype was stacked with the
    others into their common dtype: its whole batch was then refused by the recorder, or, in the first batch, the
    path took that dtype, an int64 2**60 + 1 recorded as the float64 2**60.)"""
    kept, refused = [], []
    for row in rows:
        wrong = None
        for path, value in row[1].items():
            if path not in known:
                continue
            shape, step, dtype = known[path]
            where = "the resumed record" if step is None else f"step {step}"  # None: a path of the record resumed
            if _shape(value) != shape:
                wrong = f"got shape {_shape(value)}, but {where} logged it with shape {shape}; log one shape per path"
            elif not _fits(value, dtype):
                got = f"Python {type(value).__name__} {value!r}" if type(value) in _PYTHON_SCALARS else f"dtype {_recorded_dtype(value)}"
                wrong = f"got {got}, but {where} logged it with dtype {dtype}; log values of one dtype per path"
            if wrong is not None:
                refused.append((row, f"{path!r} at step {row[0]}: {wrong}; nothing of step {row[0]} was recorded"))
                break
        if wrong is not None:
            continue
        for path, value in row[1].items():
            known.setdefault(path, (_shape(value), row[0], _recorded_dtype(value)))
        kept.append(row)
    return kept, refused


def _pooled_with_counts(rows, rules):
    """Split ``rows`` into those whose pooled ``mean``/``var`` paths have their ``count`` (and ``mean``) in the row and
    the refused others, as `_one_shape_per_path` (such a row failed the reduction of its batch, and of every batch
    after it, for the rest of the run). The ranks hold the same paths, so they refuse the same rows."""
    from nasdiag import distributed

    kept, refused = [], []
    for row in rows:
        try:  # the rules only: a path of no family is never pooled, whatever its dtype
            distributed.plan_rules(dict.fromkeys(row[1], np.float64(0.0)), rules)
        except distributed.ReductionError as err:
            refused.append((row, f"step {row[0]}: {err}; nothing of step {row[0]} was recorded"))
            continue
        kept.append(row)
    return kept, refused


def _reduce_rows(rows, rules, ddof, group, known: dict) -> list[dict]:
    """The raw values of the rows reduced across ranks, all of them with one `reduce_statistics` call; ``known`` as
    `_one_shape_per_path` left it (Python scalars are cast to their path's dtype, as `Recorder.log` casts them)."""
    from nasdiag import distributed

    columns = _columns(rows)
    stacked = {}
    for path, (where, column) in columns.items():
        with np.errstate(over="ignore"):
            arrays = [array.astype(known[path][2], copy=False) for array in stack_to_numpy(column)]
        try:
            stacked[path] = np.stack(arrays)
        except ValueError:
            shapes = sorted({a.shape for a in arrays})
            raise RecordError(f"{path!r} was logged with shapes {shapes} within one batch of rows; log one shape per path") from None
    # The steps of each path's rows: a path one rank logs at another step than the others was reduced with their
    # rows of that path (silently: the shapes agree), and a pooled mean took the counts of other rows.
    steps = {path: [rows[i][0] for i in where] for path, (where, _) in columns.items()}
    reduced = distributed.reduce_statistics(stacked, rules=rules, ddof=ddof, group=group, rows=True, row_steps=steps)
    out: list[dict] = [{} for _ in rows]
    for path, (where, _) in columns.items():
        for row, i in enumerate(where):
            out[i][path] = reduced[path][row]
    return out
