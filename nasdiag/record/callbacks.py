"""`RecorderCallback`: the hooks a training loop calls to record the probe's statistics.

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

Under DDP every rank constructs the callback and calls every hook; statistics are reduced across
ranks with `nasdiag.distributed.reduce_statistics` and only rank 0 owns a `Recorder`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from nasdiag.record.errors import RecordError
from nasdiag.record.writer import Recorder


class RecorderCallback:
    """Record statistics handed to ``on_step_end`` / ``on_epoch_end`` / ``on_exception``.

    Parameters
    ----------
    target:
        A record path (rank 0 opens a `Recorder` there with ``meta`` and ``recorder_kwargs``; other
        ranks open nothing), an open `Recorder` (used as is; it must live on rank 0 only), or None
        (this rank reduces but does not write).
    meta, **recorder_kwargs:
        Passed to `Recorder` when ``target`` is a path (``flush_every``, ``resume``, ``overwrite``...).
    reduce:
        Under an initialised process group with several ranks, reduce statistics across ranks
        before writing (every rank must then call every hook). False: rank 0 records its own.
    rules, ddof, group:
        Passed to `nasdiag.distributed.reduce_statistics`.

    Rows: each step is one row. The row of a step is held back until a hook brings another step
    (or ``on_exception`` / close), so that ``on_epoch_end`` can add the epoch's statistics to the row
    of the epoch's last step, and calls with the same step (gradient accumulation) merge into one
    row; later values of a path replace earlier ones. ``recorder.flush()`` writes the held row too. ``on_epoch_end`` adds ``scalars/epoch``
    (float32) when absent. A held-back row is written when the recorder closes, also on SIGTERM and
    at exit, so at most ``flush_every + 1`` rows are lost to a SIGKILL.
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

        self._reduce = reduce
        self._rules = rules
        self._ddof = ddof
        self._group = group
        self._pending_step: int | None = None
        self._pending: dict = {}
        self._last_step: int | None = None
        if isinstance(target, Recorder):
            if meta is not None or recorder_kwargs:
                raise RecordError("meta and recorder options apply when target is a path, not an open Recorder")
            self.recorder: Recorder | None = target
        elif target is None:
            self.recorder = None
        else:
            if not isinstance(target, (str, os.PathLike)):
                raise RecordError(f"target must be a path, a Recorder or None, got {type(target).__name__}")
            self.recorder = Recorder(target, meta=meta, **recorder_kwargs) if distributed.is_writer(group) else None
        if self.recorder is not None:
            self.recorder._before_flush.append(self._write_pending)
            self._last_step = self.recorder.last_step

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes (holds a recorder)."""
        return self.recorder is not None

    def on_step_end(self, step: int, statistics: Mapping) -> None:
        """Record the statistics of ``step`` (a mapping of record path -> array-like)."""
        statistics = self._reduced(statistics)
        step = int(step)
        if self._pending_step is not None and step != self._pending_step:
            self._write_pending()
        self._pending_step = step
        self._pending.update(statistics)

    def on_epoch_end(self, epoch: int, statistics: Mapping | None = None, *, step: int | None = None) -> None:
        """Record the epoch's statistics in the row of its last step (or of ``step`` if given)."""
        statistics = dict(self._reduced(statistics or {}))
        statistics.setdefault("scalars/epoch", _float32(epoch))
        if step is not None and step != self._pending_step:
            self._write_pending()
            self._pending_step = int(step)
        elif self._pending_step is None:
            raise RecordError(
                f"on_epoch_end(epoch={epoch}) came before any on_step_end; pass step= to say which row it belongs to"
            )
        # Still held back: a Lightning batch right after the epoch can carry the same global step.
        self._pending.update(statistics)

    def on_exception(self, exception: BaseException, statistics: Mapping | None = None, *, step: int | None = None) -> None:
        """Write what is held back (and ``statistics``, if any, at ``step``) and flush to disk.

        The recorder stays open, so a loop that recovers may go on logging; close it (or leave
        the ``with`` block) when the run ends. Statistics are not reduced here: after an exception
        other ranks may never reach this call.
        """
        if statistics:
            if step is not None and step != self._pending_step:
                self._write_pending()
                self._pending_step = int(step)
            if self._pending_step is not None:
                self._pending.update(statistics)
        self._write_pending()
        if self.recorder is not None and not self.recorder.closed:
            self.recorder.flush()

    def close(self) -> None:
        """Write what is held back and close the recorder (if this rank has one)."""
        if self.recorder is not None:
            self.recorder.close()  # runs _write_pending first

    def __enter__(self) -> RecorderCallback:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.recorder is not None:
            self.recorder.__exit__(exc_type, exc, tb)

    def _reduced(self, statistics: Mapping) -> Mapping:
        if not isinstance(statistics, Mapping):
            raise RecordError(f"statistics must be a mapping of record path -> array-like, got {type(statistics).__name__}")
        if not self._reduce:
            return statistics
        from nasdiag import distributed

        if distributed.world_size(self._group) == 1:
            return statistics
        return distributed.reduce_statistics(statistics, rules=self._rules, ddof=self._ddof, group=self._group)

    def _write_pending(self) -> None:
        step, row = self._pending_step, self._pending
        self._pending_step, self._pending = None, {}
        if step is None or self.recorder is None or self.recorder.closed:
            return
        self.recorder.log(step, row)


def _float32(value):
    import numpy as np

    return np.float32(value)
