"""`Recorder`: a crash-safe, resumable, live-readable HDF5 record of a search.

How durability is obtained (docs/schema.md has the format):

- Rows are buffered in preallocated arrays and written in batches of at most ``flush_every`` rows.
  A batch writes every data dataset and ``/present`` first, flushes, then appends ``/step`` and
  flushes again. ``/step`` is the commit marker: a reader takes ``len(/step)`` (up to the first
  never-written slot, fill -1) as the number of rows, so a writer killed at any moment leaves only
  complete rows.
- Files are written in SWMR mode, which HDF5 keeps consistent on disk at every flush; readers open
  them with ``swmr=True`` while they are written or after a crash.
- SWMR forbids creating datasets once it is on. A segment file is therefore created complete (all
  datasets known so far: built in memory, written in one write) under a temporary name, switched to SWMR
  and then linked to its final name, so every visible segment is readable. A dataset path first logged after that closes the
  segment cleanly and continues in the next one, and so does a segment about to pass
  ``schema.MAX_SEGMENT_CHUNKS`` chunks in a dataset. Resuming always starts a new segment; a crashed
  file is never reopened for writing. A finished segment stays open until the next one is published, then its root
  attribute ``continued`` is set to 1, so a reader notices the last file of a record missing (a copy of ``run.h5``).
- A kill can tear one write at a page boundary; segments use paged file space (``schema.FILE_SPACE``)
  so that no metadata block a flush rewrites crosses one (docs/schema.md, "A kill inside a write").
- ``<path>.lock`` holds an ``flock`` for the writer's lifetime (see `lock.WriterLock`).
- Each flush checks that the open segment is still the file at its path: rows are never written on
  into a file that another program moved away or deleted.
- Damage is detectable: each committed row carries a digest in ``/digest`` (`schema.RowDigest`),
  and each segment names the segments before it (``previous_segments``), which `reader` checks.
"""

from __future__ import annotations

import errno
import importlib.metadata
import json
import math
import os
import platform
import re
import socket
import time
import uuid
import warnings
from collections.abc import Mapping

import h5py
import numpy as np

from nasdiag.arrays import is_tensor, to_numpy
from nasdiag.memory import free_cpu_memory
from nasdiag.record import schema
from nasdiag.record.errors import RecordError, RecordWarning, ResumeMismatchError
from nasdiag.record.lock import WriterLock, describe_os_error
from nasdiag.record.reader import first_segment_among_later, merged_columns, not_a_record, read_segments, record_of_segment
from nasdiag.record.termination import GUARD

_ALLOWED_KINDS = "biuf"
#: /step is int64
_INT64 = np.dtype(np.int64)
_MAX_STEP = int(np.iinfo(_INT64).max)
#: HDF5 datasets have at most 32 axes (H5S_MAX_RANK), and the first one is the rows
_MAX_ROW_AXES = 31
_ERRNO_IN_MESSAGE = re.compile(r"errno\s*=\s*(\d+)")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _nasdiag_version() -> str:
    import nasdiag  # the parent package is loaded already; its __init__ imports nothing of ours

    return nasdiag.__version__


def _storage_error(action: str, err: Exception) -> str:
    number = getattr(err, "errno", None)
    if not number:
        found = _ERRNO_IN_MESSAGE.search(str(err))
        number = int(found.group(1)) if found else None
    if number:
        return f"{action}: {describe_os_error(OSError(number, os.strerror(number)))}"
    return f"{action}: {str(err).splitlines()[0] if str(err) else type(err).__name__}"


def _python_scalar_fits(value, dtype: np.dtype) -> bool:
    """Whether a Python bool/int/float may be stored in a path of ``dtype`` without changing kind."""
    kind = dtype.kind
    if kind == "b":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "f":
        return True
    if isinstance(value, float):
        return False
    info = np.iinfo(dtype)
    return info.min <= value <= info.max


def _append(dataset: h5py.Dataset, start: int, block: np.ndarray) -> None:
    """Write ``block`` (rows, ...) at row ``start``, growing the dataset to fit.

    Low-level h5py calls: the high-level ``resize`` + slice assignment costs several times more
    per call, which dominates a flush of many small datasets.
    """
    dsid = dataset.id
    stop = start + block.shape[0]
    dsid.set_extent((stop, *dsid.shape[1:]))
    if block.size == 0:
        return
    block = np.ascontiguousarray(block)
    file_space = dsid.get_space()
    file_space.select_hyperslab((start,) + (0,) * (block.ndim - 1), block.shape)
    dsid.write(h5py.h5s.create_simple(block.shape), file_space, block)


def _write_image(file: str, image: bytes) -> None:
    """Write a new file holding ``image`` (an HDF5 file built in memory); a failed write raises its OSError."""
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(image)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _detach_from_disk(f: h5py.File) -> None:
    """Point a failed file's descriptor at /dev/null before closing it.

    After a failed write (disk full) HDF5 cannot close the file: every close retries the write, and
    the library crashes at interpreter exit on the half-closed file. What is on disk is already a
    consistent SWMR state, so the writes of the close itself may go nowhere.
    """
    try:
        fd = f.id.get_vfd_handle()
        null = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)
    except (OSError, RuntimeError, ValueError):
        pass  # best effort: without it the close below may fail too, which we report


def checked_step(step) -> int:
    """``step`` as an int: a non-negative Python or numpy int, or a 0-d tensor/array holding one;
    anything else (a bool, a float, a negative number, one beyond int64) raises `RecordError`."""
    if hasattr(step, "item") and not isinstance(step, (int, np.integer)):
        try:
            step = step.item()  # 0-d tensors and arrays
        except (ValueError, RuntimeError):  # more than one element
            pass
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise RecordError(f"step must be a non-negative int, got {step!r}")
    if step > _MAX_STEP:  # else an OverflowError out of the int64 step buffer
        raise RecordError(f"step {step} is beyond the largest step a record holds ({_MAX_STEP}, int64)")
    return int(step)


def unrecordable_tensor(tensor) -> str | None:
    """What keeps a torch tensor from becoming a numpy array ("sparse", "meta", "quantized", "nested"), or None
    for a dense tensor with data (duck-typed: the record layer does not import torch)."""
    layout = str(getattr(tensor, "layout", "torch.strided"))
    if layout != "torch.strided":
        return layout.removeprefix("torch.").removesuffix("_coo")
    for kind in ("meta", "quantized", "nested"):
        if getattr(tensor, f"is_{kind}", False):
            return kind
    return None


def _describe_changes(changes: dict) -> str:
    return ", ".join(f"{key} ({stored!r} stored, {given!r} given)" for key, (stored, given) in changes.items())


class _Column:
    """One dataset path: its fixed row shape/dtype and its batch buffer."""

    __slots__ = ("path", "shape", "dtype", "is_float", "is_float_scalar", "index", "buffer", "nonfinite", "written_nonfinite", "session_nonfinite", "warned")

    def __init__(self, path: str, shape: tuple[int, ...], dtype: np.dtype, index: int, buffer: np.ndarray):
        self.path = path
        self.shape = shape
        self.dtype = dtype
        self.is_float = dtype.kind == "f"
        self.is_float_scalar = self.is_float and shape == ()
        self.index = index
        self.buffer = buffer  # (flush_every, *shape): the rows of the next batch
        self.nonfinite = 0  # in this segment, including buffered rows
        self.written_nonfinite = 0  # the value of the segment's attribute
        self.session_nonfinite = 0
        self.warned = False


def checked_flush_seconds(value) -> float | None:
    """``flush_seconds`` as a float (or None), else one `RecordError`: numpy's numbers (a config read with numpy) were
    refused as 'no positive number', True was taken as 1 s, and a rank that opens no recorder took any value."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) or not value > 0:
        raise RecordError(f"flush_seconds must be a positive number of seconds or None, got {value!r}")
    return float(value)


class Recorder:
    """Append rows of diagnostics to an HDF5 record, durably.

    Parameters
    ----------
    path:
        The record file (segment 0). Later segments live next to it (``run.seg0001.h5``, ...). A relative
        path is taken in the working folder of the moment the recorder opens; a later ``chdir`` does not move it.
    meta:
        Run metadata: ``method`` (str), ``config`` (dict, stored as JSON), ``seed`` (int),
        ``op_names`` (list[str], the K candidate ops), ``edge_names`` (dict cell type -> list[str],
        the E edges), ``cell_types`` (list[str]). Other keys must be JSON-serialisable and are kept
        as JSON attributes of ``/meta``. When given, ``arch/<cell>/{params,weights}`` rows are
        checked to be (E, K). On resume, ``None`` keeps the stored meta.
    flush_every:
        Rows per batch (default 64). At most this many rows are lost if the process is killed.
    resume:
        Continue an existing record in a new segment (a new record if there is none).
    overwrite:
        Delete an existing record (all segments) first. Refused while another writer holds it, and where the file at
        ``path`` is not a record (a text file, another program's HDF5 file: never deleted).
    flush_seconds:
        Also flush at the first ``log`` after this many seconds since the last flush (None: never),
        so a slow search loses little and live readers stay current.
    handle_sigterm:
        On SIGTERM write all buffered rows. Under the default action the recorder is then closed
        and the process ends by the signal; if the application installed its own handler before,
        the recorder stays open and that handler runs and decides.
    on_run_change:
        What a resume does when the given ``method``, ``config`` or ``seed`` differ from the stored
        ones: ``"warn"`` (default: a `RecordWarning`, the run continues, `resume_differences` says
        what differs) or ``"error"`` (raise `ResumeMismatchError`, whose ``differences`` say the same;
        nothing is touched). A different search space (ops, edges, cell types) is always refused.

    ``log(step, values)`` appends one row. Use as a context manager, or call `close`; open
    recorders are also closed at interpreter exit. The parent folder is created if needed. A
    recorder serves one thread. All errors are `RecordError`.
    """

    def __init__(
        self,
        path,
        meta: Mapping | None = None,
        flush_every: int = 64,
        resume: bool = False,
        *,
        overwrite: bool = False,
        flush_seconds: float | None = 10.0,
        handle_sigterm: bool = True,
        on_run_change: str = "warn",
    ):
        try:
            path = os.fspath(path)
        except TypeError:
            raise RecordError(f"path must be a str or os.PathLike, got {type(path).__name__}") from None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not path:  # an unset variable: "cannot create : No such file or directory" said nothing of it
            raise RecordError("the record path is empty; pass a file path such as runs/run.h5")
        if "\x00" in path:  # os.path's ValueError traceback ('embedded null byte')
            raise RecordError(f"record path {path!r} holds a NUL character, which no file name can hold; pass a file "
                              "path such as runs/run.h5")
        if isinstance(flush_every, bool) or not isinstance(flush_every, (int, np.integer)) or flush_every < 1:
            raise RecordError(f"flush_every must be a positive int, got {flush_every!r}")
        flush_seconds = checked_flush_seconds(flush_seconds)
        if resume and overwrite:
            raise RecordError("resume=True and overwrite=True contradict each other; pass only one")
        if on_run_change not in ("warn", "error"):
            raise RecordError(f"on_run_change must be 'warn' or 'error', got {on_run_change!r}")
        self._on_run_change = on_run_change
        # a path ending in a separator names a folder: 'runs/' made a file 'runs' (load('runs/') found no record), and
        # 'run.h5/' of an existing record said the record 'appeared while this recorder held the lock'
        if os.path.isdir(path) or path.endswith(tuple(filter(None, (os.sep, os.altsep)))):
            raise RecordError(f"record path {path} names a folder; pass a file path such as {os.path.join(path, 'run.h5')}")
        if os.path.islink(path):
            try:
                os.stat(path)
            except OSError as err:  # a loop of links was 'appeared while this recorder held the lock; another program'
                if err.errno == errno.ELOOP:
                    raise RecordError(f"record path {path} is a symbolic link that leads back to itself (a loop of links); "
                                      "point it at a file or pass another path") from None
        # through a symbolic link: segments, temporary files and replacements go next to the file it names (a resume
        # through the link put them next to the link, where the record read by its own name never saw them)
        self.path = schema.resolve_link(path)
        # where its files are written: a relative path named a file of the working folder at each write, so after a
        # chdir the first flush replaced a placeholder in the new folder and later segments went there too
        self._anchor = os.path.abspath(self.path)
        owner = record_of_segment(self.path)
        if owner is not None:  # overwrite=True deleted that record's segment, a new file made the record damaged
            raise RecordError(
                f"{path} is the name of a later segment of the record {owner}; record to another name, or continue "
                f"that record with Recorder({owner!r}, resume=True)"
            )
        too_long = schema.side_file_too_long(self._anchor)
        if too_long:
            raise RecordError(f"record {self._anchor} is too long: {too_long}")
        self.flush_every = int(flush_every)
        self.flush_seconds = flush_seconds
        self._meta = schema.normalize_meta(meta)
        self._columns: dict[str, _Column] = {}
        self._step_buffer = self._new_buffer("step", (), np.int64)
        self._present = np.zeros((self.flush_every, 0), bool)
        self._rows = 0  # buffered rows
        self._file: h5py.File | None = None
        self._datasets: dict[str, h5py.Dataset] = {}
        self._segment_index = 0
        self._segment_rows = 0  # committed rows in the open segment
        self._segment_row_limit = 0  # rows the open segment may hold (schema.segment_row_limit)
        self._segment_identity: tuple | None = None  # (absolute path, st_dev, st_ino) of the open segment
        # the segment closed by `_next_segment`, kept open (SWMR) until the next one is published and it is marked
        # continued in it (`_mark_continued`); None when there is none
        self._continued_from: tuple[h5py.File, str, os.stat_result | None] | None = None
        self._committed = 0  # committed rows in this session
        self._last_step: int | None = None
        self._session_last_step: int | None = None
        self._run_id = uuid.uuid4().hex
        self._placeholder_published = False
        self._closed = False
        self._busy = False
        self._failure: str | None = None
        self._last_flush = time.monotonic()
        self._batch_started = time.time()  # when the first row of the buffered batch was logged (its segment's first row)
        self._flush_listeners: list = []  # see add_flush_listener
        self._digest_weights: dict = {}  # byte weights of the row digest per (path, row bytes)
        self._previous_segments: list[list[int]] = []  # [index, committed rows] of earlier segments
        self.resume_differences: dict[str, tuple] = {}
        self._committed_last_step: int | None = None
        folder = os.path.dirname(self._anchor)  # a link's target's: the link's own exists, and the lock is made there
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            raise RecordError(f"cannot create folder {folder} for the record: {describe_os_error(err)}") from None
        self._lock = WriterLock(schema.lock_path(path), path)
        self._lock.acquire()
        try:
            self._prepare(resume, overwrite)
        except BaseException:
            self._lock.release()
            raise
        GUARD.register(self, handle_sigterm)

    # --- opening -----------------------------------------------------------------------------

    def _prepare(self, resume: bool, overwrite: bool) -> None:
        foreign = schema.foreign_temp(self.path)
        if foreign is not None:  # before anything is removed: the user's file, and their record, stay as they were
            raise RecordError(
                f"{foreign} is not a segment this recorder was building, but the recorder builds its segments under "
                "that name and would delete it; move it away, or name the record with an extension such as .h5"
            )
        existing = schema.list_segments(self.path)
        if existing and existing[0][0] == 0:
            reason = not_a_record(self.path)
            if reason is not None:  # 'a record already exists; pass ... overwrite=True', which deleted the user's file
                raise RecordError(f"{self.path} exists and is not a nasdiag record ({reason}); it is never replaced, not even "
                                  "with overwrite=True: record to another path or move it away")
        other = first_segment_among_later(existing)
        if other is not None:  # overwrite=True deleted it, and a new record was refused as 'a record already exists'
            raise RecordError(
                f"{other} is a record of its own, named like a later segment of {self.path}, which would take it for one "
                "(and overwrite=True delete it); record to another name or rename that record"
            )
        if existing and not (resume or overwrite):
            raise RecordError(
                f"a record already exists at {self.path}; pass resume=True to continue it "
                "or overwrite=True to replace it"
            )
        if existing and overwrite:
            for _, file in existing:
                self._remove(file)
        if existing and resume:
            self._adopt(existing)
        for tmp in schema.temp_files(self.path):  # left by a writer killed while creating a segment; we hold the lock
            self._remove(tmp)
        self._create_segment(placeholder=True)

    def _remove(self, file: str) -> None:
        try:
            os.unlink(file)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise RecordError(f"cannot remove {file}: {describe_os_error(err)}") from None

    def _adopt(self, existing) -> None:
        """Take over schema, meta, run id and last step of an existing record, for resume."""
        segments = read_segments(self.path, with_data=False)
        stored = segments[-1].meta
        if not self._meta:
            self._meta = dict(stored)
        else:
            given, kept = schema.structural_meta(self._meta), schema.structural_meta(stored)
            differing = sorted(k for k in given if k in kept and given[k] != kept[k])
            if differing:
                raise ResumeMismatchError(
                    f"cannot resume {self.path}: {', '.join(differing)} differ from the stored ones; "
                    "resume with the same search space or record to a new path",
                    {k: (kept[k], given[k]) for k in differing},
                )
            changed = {
                k: (stored.get(k), self._meta[k])
                for k in ("method", "config", "seed")
                if k in self._meta and not schema.same_json(self._meta[k], stored.get(k))  # a NaN is the same NaN
            }
            if changed and self._on_run_change == "error":
                raise ResumeMismatchError(
                    f"cannot resume {self.path}: it holds another run ({_describe_changes(changed)}); "
                    "resume with the same settings or record to a new path",
                    changed,
                )
            self._meta = {**stored, **self._meta}  # keys not given are kept from the record
            self.resume_differences = changed
            if changed:
                warnings.warn(f"resuming {self.path} with a different {_describe_changes(changed)}", RecordWarning, stacklevel=4)
        added = {k: (stored.get(k), self._meta[k]) for k in ("op_names", "edge_names", "cell_types")
                 if k in self._meta and k not in stored}
        for path, col in merged_columns(segments).items():
            try:  # names given now for the first time must fit the rows recorded without them
                if added:
                    schema.check_against_meta(path, col.shape, self._meta)
            except RecordError as err:
                raise ResumeMismatchError(
                    f"cannot resume {self.path}: the given meta does not fit its recorded rows ({err}); resume with "
                    "names that fit them or record to a new path", added,
                ) from None
            self._add_column(path, col.shape, col.dtype, self._new_buffer(path, col.shape, col.dtype))
        self._run_id = segments[0].run_id or self._run_id
        steps = [int(seg.steps.max()) for seg in segments if seg.steps.size]
        self._last_step = max(steps) if steps else None
        self._previous_segments = [[seg.index, int(seg.steps.size)] for seg in segments]
        self._committed_last_step = self._last_step
        self._segment_index = max(index for index, _ in existing) + 1

    # --- public API ----------------------------------------------------------------------------

    @property
    def layouts(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Row shape and dtype of every path this recorder knows (a resumed record's too): later rows must match."""
        return {path: (column.shape, column.dtype) for path, column in self._columns.items()}

    @property
    def last_step(self) -> int | None:
        """The last step logged in this session, else the largest step of the resumed record, else None."""
        return self._session_last_step if self._session_last_step is not None else self._last_step

    @property
    def last_committed_step(self) -> int | None:
        """The last step this session committed to disk, else the largest step of the resumed record,
        else None. Unlike `last_step` it never counts buffered rows: a checkpoint that can reproduce
        the record must be taken at or before this step (after `flush`, the two are equal)."""
        return self._committed_last_step

    @property
    def rows_committed(self) -> int:
        """Rows of this session that are on disk (flushed and committed)."""
        return self._committed

    @property
    def rows_buffered(self) -> int:
        """Rows of this session not yet flushed (lost if the process is killed now)."""
        return self._rows

    @property
    def segment_file(self) -> str:
        """The segment file this session writes (or will write) to; absolute where the record path was relative (after
        a ``chdir`` the relative name named a file of the new working folder, not the one written)."""
        return schema.segment_path(self.path if os.path.isabs(self.path) else self._anchor, self._segment_index)

    @property
    def nonfinite_counts(self) -> dict[str, int]:
        """NaN/inf element counts per path logged in this session (buffered rows included)."""
        return {p: c.session_nonfinite for p, c in self._columns.items() if c.session_nonfinite}

    @property
    def closed(self) -> bool:
        return self._closed

    def check_shape(self, path: str, shape: tuple) -> None:
        """Raise `RecordError` (one line) if a value of ``shape`` at ``path`` contradicts the record's meta (an
        (E, K) family against its ``edge_names`` and ``op_names``), as `log` would at the hand-over; a caller that
        holds rows back (`RecorderCallback`) checks at its own call, so a refusal costs only that call."""
        schema.check_against_meta(path, tuple(shape), self._meta)

    @property
    def writing(self) -> bool:
        """True while `log` or `flush` is writing; a SIGTERM arriving then is handled right after."""
        return self._busy

    @property
    def flush_due(self) -> bool:
        """Whether ``flush_seconds`` have passed since the last flush (a caller that holds rows back,
        like `RecorderCallback`, hands them over then, so live readers stay current)."""
        return self.flush_seconds is not None and time.monotonic() - self._last_flush >= self.flush_seconds

    def add_flush_listener(self, listener) -> None:
        """Call ``listener(closing=...)`` at the start of every `flush` (``closing=False``) and of
        `close` (``closing=True``; also on SIGTERM and at exit), before the buffered rows are written.

        A listener that holds rows back (`RecorderCallback` holds the current step's row, and its
        buffered device tensors) logs them from there, so that they are written with this flush.
        Listeners run in the order they were added. One that raises `RecordError` (a held row it could not hand
        over) does not cost the others: the flush goes on and its error is raised after the rows are written; any
        other exception stops the flush.
        """
        if not callable(listener):
            raise RecordError(f"a flush listener must be callable, got {type(listener).__name__}")
        self._flush_listeners.append(listener)

    def remove_flush_listener(self, listener) -> None:
        """Stop calling ``listener`` (no error if it was not added)."""
        self._flush_listeners = [fn for fn in self._flush_listeners if fn is not listener]

    def log(self, step: int, values: Mapping) -> None:
        """Append one row.

        ``step``: a non-negative int, strictly increasing within a session (a resumed session may
        restart lower; `load` then prefers its rows). ``values`` maps dataset paths such as
        ``"scalars/train_loss"`` or ``"arch/normal/weights"`` to Python scalars, numpy arrays or
        torch tensors. The first value of a path fixes its row shape and dtype; a later value of
        another shape or dtype raises `RecordError` and nothing of that row is written. Python
        scalars are cast to the path's dtype when that loses nothing of their kind (an int into a
        float path; not a float into an int path). NaN/inf are recorded as they are, counted in the
        dataset's ``nonfinite_count`` attribute and reported once per path with a `RecordWarning`.
        """
        if self._busy:
            raise RecordError("Recorder.log re-entered (from a signal handler or another thread); a recorder serves one thread")
        self._busy = True
        try:
            self._log(step, values)
        finally:
            self._busy = False
            if GUARD.pending:
                GUARD.finish_pending_signal()

    def _log(self, step, values) -> None:
        if self._closed or self._failure is not None:
            self._refuse()
        last = self._session_last_step
        if type(step) is not int or step < 0 or step > _MAX_STEP or (last is not None and step <= last):
            step = self._check_step(step)
        if type(values) is not dict and not isinstance(values, Mapping):
            raise RecordError(f"values must be a dict of dataset path -> value, got {type(values).__name__}")
        if self._rows >= self.flush_every:
            # full: the flush of the last log could not create its segment (nothing of it was written); try again
            self._flush()
        columns = self._columns
        # Fast path (the common row): Python floats on known float scalar paths need no conversion.
        row = []
        for path, value in values.items():
            column = columns.get(path)
            if column is None or type(value) is not float or not column.is_float_scalar:
                row = None
                break
            row.append((column, value))
        if row is None:
            row = self._validated_row(step, values)
        i = self._rows
        if i == 0:
            self._batch_started = time.time()
        self._step_buffer[i] = step
        present = self._present[i]
        present[:] = False  # a row interrupted half-way here (Ctrl-C) left flags that are not this row's
        for column, value in row:
            column.buffer[i] = value
            present[column.index] = True
            if column.is_float_scalar:
                # The stored value: a finite Python number may overflow a float32 path to inf.
                if not math.isfinite(column.buffer[i]):
                    self._count_nonfinite(column, column.buffer[i], step)
            elif column.is_float and not np.isfinite(value).all():
                self._count_nonfinite(column, value, step)
        self._rows = i + 1
        self._session_last_step = step
        if self._rows >= self.flush_every or (
            self.flush_seconds is not None and time.monotonic() - self._last_flush >= self.flush_seconds
        ):
            self._flush()

    def _refuse(self):
        if self._closed:
            raise RecordError(f"recorder for {self.path} is closed; open a new one with resume=True to continue")
        raise RecordError(f"recorder for {self.path} failed earlier ({self._failure}); it accepts no more rows")

    def _validated_row(self, step: int, values: Mapping) -> list:
        """The slow path of `log`: validate and convert every value, add new paths (switching to a
        new segment if the current one is already in SWMR mode); returns ``[(column, value)]``."""
        row, new_columns = self._validate_row(step, values)
        if new_columns:
            # allocated before anything changes: a row whose buffers do not fit is refused whole
            buffers = [self._new_buffer(path, shape, dtype) for path, shape, dtype in new_columns]
            if self._file is not None:
                # SWMR cannot create datasets in an open file: finish this segment, start the next.
                # (A placeholder is replaced by the first flush, so it needs no switch.)
                self._flush()
                self._next_segment()
            for (path, shape, dtype), buffer in zip(new_columns, buffers):
                self._add_column(path, shape, dtype, buffer)
        columns = self._columns
        return [(columns[path], value) for path, value in row]

    def flush(self) -> None:
        """Call the flush listeners, then write and commit the buffered rows now (no-op when none
        are buffered). When it returns, `last_step` and every row before it are on disk."""
        refused = None
        if not self._busy and not self._closed:
            for listener in list(self._flush_listeners):
                try:
                    listener(closing=False)
                except RecordError as err:  # a callback's held row of another shape: the rows it handed over are
                    refused = refused or err  # written all the same (the flush of a checkpoint or of a SIGTERM lost them)
        if self._busy:
            raise RecordError("Recorder.flush re-entered (from a signal handler or another thread); a recorder serves one thread")
        self._busy = True
        try:
            self._flush()
        finally:
            self._busy = False
            if GUARD.pending:
                GUARD.finish_pending_signal()
        if refused is not None:
            raise refused

    def _flush(self) -> None:
        if self._rows == 0 or self._closed:
            return
        if self._failure is not None:
            raise RecordError(f"recorder for {self.path} failed earlier ({self._failure}); it accepts no more rows")
        self._write_batch()

    def close(self) -> None:
        """Flush, close the segment and release the lock. Safe to call twice."""
        if self._closed:
            return
        listeners, self._flush_listeners = self._flush_listeners, []
        try:
            for listener in listeners:
                listener(closing=True)
        finally:
            try:
                if self._failure is None:
                    self.flush()
            finally:
                self._closed = True
                try:
                    try:
                        self._close_segment()
                    finally:
                        self._close_continued_from()
                finally:
                    self._lock.release()
                    GUARD.unregister(self)
                self._warn_nonfinite_summary()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as err:  # keep the original exception; report ours alongside it, unless it is the same
            if str(err) != str(exc):  # failure again (a segment a full disk cannot hold: the line said twice)
                warnings.warn(f"while handling {exc_type.__name__}, closing the recorder failed: {err}", RecordWarning)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._committed} rows committed, {self._rows} buffered"
        return f"Recorder({self.path!r}, segment {self._segment_index}, {state})"

    # --- validation --------------------------------------------------------------------------

    def _check_step(self, step) -> int:
        step = checked_step(step)
        last = self._session_last_step
        if last is not None and step <= last:
            raise RecordError(f"step {step} is not after the previous step {last}; steps must increase within a run")
        return step

    def _validate_row(self, step: int, values: Mapping):
        """Check a whole row before anything is buffered: returns ``[(path, value)]`` and the new
        paths as ``[(path, shape, dtype)]``."""
        row = []
        new_columns = []
        new_paths: list[str] = []
        for path, value in values.items():
            column = self._columns.get(path)
            if column is not None and column.shape == () and isinstance(value, (float, int)) and not isinstance(value, np.generic):
                # Fast path: a Python scalar on a known scalar path is cast to the path's dtype. (np.float64 is a float
                # subclass, but a numpy value keeps its dtype: it was cast into a float32 path, a 0-d array refused.)
                if not _python_scalar_fits(value, column.dtype):
                    raise RecordError(
                        f"{path!r} at step {step}: got Python {type(value).__name__} {value!r}, but the path holds "
                        f"{column.dtype}; log values of one type per path"
                    )
                if column.is_float and isinstance(value, int):
                    try:  # checked here, before any value of the row is buffered
                        value = float(value)
                    except OverflowError:
                        raise RecordError(
                            f"{path!r} at step {step}: a Python int of {value.bit_length()} bits is beyond any float; "
                            "log a float (inf, if that is what it means)"
                        ) from None
                row.append((path, value))
                continue
            if column is None and type(value) is int and not _python_scalar_fits(value, _INT64):
                # np.asarray made 2**63 a uint64 path and 2**64 an object array ('dtype object cannot be recorded')
                raise RecordError(
                    f"{path!r} at step {step}: Python int {value} is beyond int64, the dtype of a Python int's path; "
                    "log a numpy value of the dtype you mean (np.uint64(...)) or a float"
                )
            kind = unrecordable_tensor(value) if is_tensor(value) else None
            if kind:
                raise RecordError(
                    f"{path!r} at step {step}: a {kind} tensor cannot be recorded; log a dense tensor with data "
                    "(e.g. .to_dense(), .dequantize())"
                )
            if is_tensor(value) and value.dtype.is_complex:
                # complex32 has no numpy dtype: its conversion (as bfloat16's, through float32) kept the real part only
                raise RecordError(
                    f"{path!r} at step {step}: dtype {value.dtype} cannot be recorded; log bool, int or float values "
                    "(a complex value as its real and imaginary parts)"
                )
            try:
                array = to_numpy(value)
            except (ValueError, TypeError) as err:  # a ragged nested list, an object numpy cannot convert
                raise RecordError(
                    f"{path!r} at step {step}: {type(value).__name__} value cannot be made an array "
                    f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); log a scalar, an array or a tensor"
                ) from None
            if array.dtype.kind not in _ALLOWED_KINDS:
                raise RecordError(f"{path!r} at step {step}: dtype {array.dtype} cannot be recorded; log bool, int or float values")
            if array.dtype.byteorder == ">":
                array = array.astype(array.dtype.newbyteorder("="))
            if column is None:
                schema.check_path(path)
                schema.check_no_prefix_clash(path, [*self._columns, *new_paths])
                schema.check_against_meta(path, array.shape, self._meta)
                if array.ndim > _MAX_ROW_AXES:  # the segment would fail at the flush, and every flush after it
                    raise RecordError(
                        f"{path!r} at step {step}: a value of {array.ndim} axes cannot be recorded (an HDF5 dataset has at "
                        f"most 32, one of them the rows); reshape it to at most {_MAX_ROW_AXES} axes"
                    )
                if array.size == 0:  # an HDF5 chunk cannot have a 0-long axis: the segment would fail at the flush
                    raise RecordError(
                        f"{path!r} at step {step}: a value of shape {array.shape} has no elements and cannot be recorded; "
                        "leave the path out of rows in which it has no values"
                    )
                new_columns.append((path, array.shape, array.dtype))
                new_paths.append(path)
            elif array.shape != column.shape or array.dtype != column.dtype:
                raise RecordError(
                    f"{path!r} at step {step}: got shape {array.shape} {array.dtype}, but the path was first logged "
                    f"with shape {column.shape} {column.dtype}; log the same shape and dtype every time or use a new path"
                )
            row.append((path, array))
        return row, new_columns

    def _count_nonfinite(self, column: _Column, value, step: int) -> None:
        """Count (and the first time, report) the NaN/inf elements of a value that has some."""
        bad = 1 if np.ndim(value) == 0 else int(np.size(value) - np.count_nonzero(np.isfinite(value)))
        column.nonfinite += bad
        column.session_nonfinite += bad
        if not column.warned:
            column.warned = True
            warnings.warn(
                f"{column.path!r} at step {step}: {bad} NaN/inf value(s), recorded as is and counted in the "
                f"'{schema.NONFINITE_ATTR}' attribute (later ones in this path are counted without a warning)",
                RecordWarning,
                stacklevel=3,
            )

    def _warn_nonfinite_summary(self) -> None:
        counts = self.nonfinite_counts
        if counts:
            warnings.warn(f"{self.path}: NaN/inf values logged in this session: {counts}", RecordWarning, stacklevel=3)

    def _new_buffer(self, path: str, shape, dtype) -> np.ndarray:
        """An empty (flush_every, *shape) buffer; `RecordError` (one line) where it does not fit in memory."""
        try:
            nbytes = self.flush_every * math.prod(shape) * np.dtype(dtype).itemsize
            free = free_cpu_memory()
            if free is not None and nbytes > free:
                # a kernel that overcommits hands out any size, and kills the process when the rows are written
                raise MemoryError(f"{nbytes} bytes, {free} free")
            return np.empty((self.flush_every, *shape), dtype)
        except (MemoryError, ValueError) as err:  # ValueError: more bytes than an array may have
            raise RecordError(
                f"{path!r}: a buffer of flush_every={self.flush_every} rows of shape {tuple(shape)} {np.dtype(dtype)} "
                f"does not fit in memory ({str(err).splitlines()[0]}); pass a smaller flush_every (default 64)"
            ) from None

    def _add_column(self, path: str, shape, dtype, buffer: np.ndarray) -> None:
        index = len(self._columns)
        self._columns[path] = _Column(path, tuple(shape), np.dtype(dtype), index, buffer)
        present = np.zeros((self.flush_every, index + 1), bool)
        present[:, :index] = self._present
        self._present = present

    # --- writing -------------------------------------------------------------------------------

    def _create_segment(self, placeholder: bool = False) -> None:
        """Build the current segment under a temporary name, then publish it.

        ``placeholder``: a header-only file (meta, empty /step), closed cleanly at once, so that a
        record exists (and loads, empty) from the moment the recorder opens. The first flush
        replaces it with the full segment; every other publication refuses to replace a file.
        """
        final = schema.segment_path(self._anchor, self._segment_index)  # not in a working folder changed since
        tmp = schema.temp_path(final)
        self._remove(tmp)
        f = built = None
        try:
            # Built in memory and written out as one image: HDF5 swallows a write that fails while it creates
            # objects (disk full, a file-size limit) and then crashed the process closing the file (a segmentation
            # fault, not an error). Only the image's write, os.write's OSError, and reopening it touch the disk.
            built = h5py.File(tmp, "w", driver="core", backing_store=False, libver=schema.LIBVER, **schema.FILE_SPACE)
            self._write_header(built)
            columns = [] if placeholder else list(self._columns.values())
            rows_per_chunk = [schema.chunk_rows((), 8), schema.chunk_rows((max(len(columns), 1),), 1)]
            for column in columns:
                rows_per_chunk.append(schema.chunk_rows(column.shape, column.dtype.itemsize))
                ds = built.create_dataset(
                    column.path,
                    shape=(0, *column.shape),
                    maxshape=(None, *column.shape),
                    chunks=(rows_per_chunk[-1], *column.shape),
                    dtype=column.dtype,
                    fillvalue=schema.fill_value(column.dtype),
                )
                ds.attrs[schema.NONFINITE_ATTR] = np.int64(0)
            built.create_dataset(
                schema.DIGEST,
                shape=(0,),
                maxshape=(None,),
                chunks=(schema.chunk_rows((), 8),),
                dtype=np.uint64,
                fillvalue=0,  # never a valid digest (bit 63 is always set)
            )
            n_cols = len(columns)
            present = built.create_dataset(
                schema.PRESENT,
                shape=(0, n_cols),
                maxshape=(None, None),  # a fixed 0-wide axis could not be chunked
                chunks=(schema.chunk_rows((max(n_cols, 1),), 1), max(n_cols, 1)),
                dtype=bool,
            )
            present.attrs[schema.PATHS_ATTR] = np.array([c.path for c in columns], dtype=h5py.string_dtype())
            built.create_dataset(
                schema.STEP,
                shape=(0,),
                maxshape=(None,),
                chunks=(schema.chunk_rows((), 8),),
                dtype=np.int64,
                fillvalue=schema.STEP_FILL,
            )
            built.flush()
            image = built.id.get_file_image()
            built.close()
            built = None
            _write_image(tmp, image)
            if not placeholder:
                f = h5py.File(tmp, "r+", libver=schema.LIBVER, rdcc_nbytes=schema.CHUNK_CACHE_BYTES)
                f.swmr_mode = True
        except (OSError, RuntimeError, ValueError) as err:
            for opened, on_disk in ((built, False), (f, True)):
                if opened is not None:
                    try:
                        if on_disk:
                            _detach_from_disk(opened)  # the file is discarded; its close must not retry writes
                        opened.close()
                    except Exception:
                        pass
            self._remove(tmp)
            raise RecordError(_storage_error(f"cannot create record segment {self.segment_file}", err)) from None
        try:
            self._publish(tmp, final, replace=self._placeholder_published)
        except BaseException:
            if not placeholder:
                f.close()
            self._remove(tmp)
            raise
        self._placeholder_published = placeholder
        if not placeholder:
            self._mark_continued()  # only now: the mark is never set while the next segment is not visible
            self._file = f
            # Keep every dataset open for the segment's life: a dataset closed mid-write would flush
            # its chunks from a destructor, where a failed write (disk full) cannot be reported.
            self._datasets = {path: f[path] for path in [*self._columns, schema.PRESENT, schema.DIGEST, schema.STEP]}
            self._segment_rows = 0
            self._segment_row_limit = schema.segment_row_limit(rows_per_chunk)
            try:
                found = os.fstat(f.id.get_vfd_handle())
                self._segment_identity = (os.path.abspath(final), found.st_dev, found.st_ino)
            except (OSError, RuntimeError, ValueError):
                self._segment_identity = None  # a file driver without a descriptor: not checked

    def _check_segment_in_place(self) -> None:
        """Refuse to write on when the open segment is no longer at its path (moved or deleted by another
        program): the rows would go to a file the record no longer names, or to no file at all."""
        if self._segment_identity is None:
            return
        where, device, inode = self._segment_identity
        try:
            found = os.stat(where)
        except (FileNotFoundError, NotADirectoryError):
            found = None
        except OSError:
            return  # cannot tell (permissions of a folder above); the writes themselves will say
        if found is not None and (found.st_dev, found.st_ino) == (device, inode):
            return
        self._failure = f"{self.segment_file} was moved or deleted while this recorder wrote it"
        raise RecordError(
            f"record segment {self._failure}; its {self._segment_rows} committed rows are where it was moved (lost if "
            f"deleted) and the last {self._rows} buffered rows are not written; record to a path nothing moves or removes"
        )

    def _publish(self, tmp: str, final: str, replace: bool) -> None:
        if replace:  # our own placeholder, under our lock: swap it atomically for the full segment
            try:
                os.replace(tmp, final)
            except OSError as err:
                raise RecordError(_storage_error(f"cannot create {final}", err)) from None
            return
        # link() fails if `final` exists, so even a file created behind our back is never replaced.
        try:
            os.link(tmp, final)
        except FileExistsError:
            raise RecordError(f"{final} appeared while this recorder held the lock; another program writes there") from None
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise RecordError(_storage_error(f"cannot create {final}", err)) from None
            if os.path.exists(final):  # no hard links on this file system: check, then rename
                raise RecordError(f"{final} appeared while this recorder held the lock; another program writes there") from None
            os.rename(tmp, final)
            return
        self._remove(tmp)

    def _write_header(self, f: h5py.File) -> None:
        attrs = f.attrs
        attrs["schema_version"] = np.int64(schema.SCHEMA_VERSION)
        attrs["nasdiag_version"] = _nasdiag_version()
        attrs["method"] = self._meta.get("method", "")
        attrs["config"] = schema.dumps_json(self._meta.get("config", {}))  # standard JSON: NaN/inf tagged
        attrs["seed"] = np.int64(self._meta.get("seed", schema.NO_SEED))
        attrs["torch_version"] = _version("torch")
        attrs["h5py_version"] = h5py.__version__
        attrs["hdf5_version"] = h5py.version.hdf5_version
        attrs["numpy_version"] = np.__version__
        attrs["python_version"] = platform.python_version()
        attrs["run_id"] = self._run_id
        attrs["segment"] = np.int64(self._segment_index)
        attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        # the segment is built at its first flush, after its first batch of rows was computed: the time of its first row
        # (Unix seconds) is where the time its rows took starts (`nasdiag report`'s time per step counted from `created`)
        attrs["first_row_time"] = np.float64(self._batch_started)
        attrs["host"] = socket.gethostname()
        attrs["pid"] = np.int64(os.getpid())
        attrs[schema.PREVIOUS_ATTR] = json.dumps(self._previous_segments)
        attrs[schema.CONTINUED_ATTR] = np.int64(0)  # set to 1 (same size: allowed under SWMR) by `_mark_continued`
        meta = f.create_group(schema.META)
        strings = h5py.string_dtype()
        for key in ("op_names", "cell_types"):
            if key in self._meta:
                meta.create_dataset(key, data=np.array(self._meta[key], dtype=strings))
        if "edge_names" in self._meta:
            edges = meta.create_group("edge_names")
            for cell, names in self._meta["edge_names"].items():
                edges.create_dataset(cell, data=np.array(names, dtype=strings))
        for key, value in self._meta.items():
            if key not in schema.KNOWN_META_KEYS:
                meta.attrs[key] = schema.dumps_json(value)

    def _write_batch(self) -> None:
        if self._file is not None and self._segment_rows and self._segment_rows + self._rows > self._segment_row_limit:
            # Past schema.MAX_SEGMENT_CHUNKS chunks HDF5's chunk index writes blocks larger than a page, which a
            # kill could tear: go on in the next segment. (A single batch larger than that stays in one segment.)
            self._next_segment()
        if self._file is None:
            try:
                self._create_segment()
            except RecordError as err:  # nothing was written: the rows stay buffered for the next try
                raise RecordError(f"{err}; the {self._rows} buffered rows are not written yet") from None
        else:
            self._check_segment_in_place()
        f = self._file
        datasets = self._datasets
        rows = self._rows
        start = self._segment_rows
        stop = start + rows
        present = self._present[:rows]
        steps = self._step_buffer[:rows]
        digest = schema.RowDigest(rows, self._digest_weights)
        digest.add(schema.STEP, steps)
        digest.add(schema.PRESENT, present)
        try:
            for column in self._columns.values():
                block = column.buffer[:rows]
                missing = ~present[:, column.index]
                if missing.any():
                    block[missing] = schema.fill_value(column.dtype)
                digest.add(column.path, block)
                _append(datasets[column.path], start, block)
            _append(datasets[schema.PRESENT], start, present)
            _append(datasets[schema.DIGEST], start, digest.value())
            f.flush()  # data before the commit marker
            _append(datasets[schema.STEP], start, steps)
            for column in self._columns.values():
                if column.nonfinite != column.written_nonfinite:
                    # Same-size overwrite of an attribute that exists since before SWMR started.
                    datasets[column.path].attrs[schema.NONFINITE_ATTR] = np.int64(column.nonfinite)
                    column.written_nonfinite = column.nonfinite
            f.flush()
        except (OSError, RuntimeError, ValueError) as err:
            message = _storage_error(f"cannot write to {self.segment_file}", err)
            self._failure = message
            _detach_from_disk(f)  # before anything else tries to write
            # Closed now, not at `close`: HDF5 shares an open file with every later open of it in this process, so
            # a `load` of the record meanwhile read the detached file (nothing) and retried for ever.
            self._file, self._datasets = None, {}
            try:
                f.close()  # its writes go to /dev/null
            except Exception:
                pass
            raise RecordError(
                f"{message}; the {self._committed} rows committed before are intact, the last {rows} buffered rows may be lost"
            ) from None
        self._segment_rows = stop
        self._committed += rows
        self._committed_last_step = int(steps[-1])
        self._rows = 0
        self._present[:rows] = False
        self._last_flush = time.monotonic()

    def _mark_continued(self) -> None:
        """Set the root attribute ``continued`` of the segment before the one just published to 1 and close it: a
        reader that finds it marked and no next segment file says the record's last file is missing. A kill before the
        mark leaves it unmarked beside the published next segment (the record reads whole, as before)."""
        if self._continued_from is None:
            return
        (f, file, written), self._continued_from = self._continued_from, None
        try:
            f.attrs[schema.CONTINUED_ATTR] = np.int64(1)  # exists since before SWMR started: a same-size overwrite
            f.flush()
            f.close()
        except (OSError, RuntimeError, ValueError, KeyError) as err:
            # its rows were committed and flushed before; only the mark is missing (a missing last file then goes
            # unnoticed, as in records written before the mark existed)
            _detach_from_disk(f)
            try:
                f.close()
            except Exception:
                pass
            warnings.warn(_storage_error(f"{file} could not be marked as continued in the next segment", err),
                          RecordWarning, stacklevel=4)
            return
        if written is None:
            return
        # the file's modification time stays that of its last rows (`nasdiag report` counts a segment's time per step
        # from its first row to its last write; the mark came with the next segment's first batch)
        try:
            found = os.stat(file)
            if (found.st_dev, found.st_ino) == (written.st_dev, written.st_ino):
                os.utime(file, ns=(found.st_atime_ns, written.st_mtime_ns))
        except OSError:
            pass  # a read-only mount of the time stamps, say: the report's time per step then counts that batch too

    def _close_continued_from(self) -> None:
        """Close the segment kept for `_mark_continued` unmarked (the next segment was never published)."""
        if self._continued_from is None:
            return
        (f, file, _), self._continued_from = self._continued_from, None
        try:
            f.close()
        except Exception as err:
            if self._failure is None:
                raise RecordError(_storage_error(f"cannot close {file}", err)) from None

    def _next_segment(self) -> None:
        """Close the open segment's writing (kept open until the next one is published, which marks it continued:
        `_mark_continued`); the next batch creates the next one."""
        self._close_segment(hand_over=True)
        self._previous_segments.append([self._segment_index, self._segment_rows])
        self._segment_index += 1

    def _close_segment(self, hand_over: bool = False) -> None:
        """Close the open segment; ``hand_over``: keep it open for `_mark_continued` instead."""
        f, self._file = self._file, None
        self._datasets = {}
        if f is None:
            return
        for column in self._columns.values():  # the next segment counts its own rows, and the buffered ones it gets
            column.nonfinite -= column.written_nonfinite
            column.written_nonfinite = 0
        if hand_over:
            self._close_continued_from()  # never more than one kept open
            try:
                written = os.fstat(f.id.get_vfd_handle())  # after its last flush: when its last rows were written
            except (OSError, RuntimeError, ValueError):
                written = None
            self._continued_from = (f, self.segment_file, written)
            return
        try:
            f.close()
        except Exception as err:
            if self._failure is None:
                raise RecordError(_storage_error(f"cannot close {self.segment_file}", err)) from None
