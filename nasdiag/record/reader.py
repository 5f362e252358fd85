"""Reading records: one segment at a time, then all segments merged.

Readers never write and never take the writer lock, so a record can be read while it is being
written (SWMR), after its writer crashed, and from a read-only location.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import threading
import time
import warnings
from dataclasses import dataclass, field

import h5py
import numpy as np

from nasdiag.record import schema
from nasdiag.record.errors import DamagedRecordError, RecordError, RecordWarning
from nasdiag.record.lock import LockState, read_lock


@dataclass
class Column:
    """Schema of one logged dataset: per-row ``shape`` and ``dtype``."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class Segment:
    """The committed content of one segment file."""

    index: int
    file: str
    run_id: str
    meta: dict
    steps: np.ndarray  # (n,) int64, committed rows only
    columns: dict[str, Column]
    data: dict[str, np.ndarray] = field(default_factory=dict)  # path -> (n, *shape)
    present: dict[str, np.ndarray] = field(default_factory=dict)  # path -> (n,) bool
    nonfinite: dict[str, int] = field(default_factory=dict)  # path -> attribute value
    previous: list[tuple[int, int]] = field(default_factory=list)  # (index, rows) of earlier segments
    damage: "Damage | None" = None  # the first bad row; only the rows before it are kept
    continued: bool = False  # its writer published the next segment (root attribute ``continued``; older records: False)


#: HDF5 shares one file object between the opens of a file in one process, so a thread closing its open while
#: another reads through it crashed the process (a live reader thread beside a `load` in the main thread); the
#: readers below take turns, each from open to close
_READS = threading.RLock()


def _one_read_at_a_time(function):
    @functools.wraps(function)
    def locked(*args, **kwargs):
        with _READS:
            return function(*args, **kwargs)
    return locked


def open_segment_file(file: str, live: bool = True) -> h5py.File:
    """Open a segment for reading; SWMR first (live or crashed writers), plain read as fallback.

    ``live=False`` (no writer holds the record) reads metadata once instead of HDF5's SWMR default
    of up to 100 attempts with growing sleeps, which exist for metadata caught mid-write by a live
    writer; on a damaged file they would make a read hang for minutes before it fails.
    """
    try:
        if not live and _metadata_read_attempts() is not None:
            return _open_swmr_once(file)
        return h5py.File(file, "r", swmr=True)
    except OSError as swmr_err:
        try:
            return h5py.File(file, "r")
        except OSError:
            raise RecordError(f"cannot open record segment {file}: {_first_line(swmr_err)}") from None


def _special_file(file: str) -> str | None:
    """What ``file`` is when it exists and is no regular file ("a named pipe", "a device", "a socket"), else None."""
    try:
        mode = os.stat(file).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"


HDF5_SIGNATURE = schema.HDF5_SIGNATURE  # read here by the plot commands too


@_one_read_at_a_time
def not_a_record(file: str) -> str | None:
    """Why the existing file ``file`` is not a record segment (a phrase such as "it is not an HDF5
    file"), or None when it is one. An HDF5 file that cannot be opened counts as a damaged record
    (None): replacing it loses nothing readable (one that another program holds open to write, HDF5's file lock taken, is
    read without the lock: --force replaced it); a readable one is someone else's unless it has nasdiag's header
    attribute or both ``/step`` and ``/present`` (every segment is written whole with both): another program's log with
    a ``/step`` column alone was taken for a damaged record, and ``nasdiag search --force`` replaced it."""
    special = _special_file(file)
    if special:  # open() of a named pipe waits for a writer: nasdiag search --out pipe --force hung
        return f"it is {special}, not a regular file"
    try:
        with open(file, "rb") as fh:
            head = fh.read(len(HDF5_SIGNATURE))
    except OSError as err:
        return f"it cannot be read ({os.strerror(err.errno) if err.errno else err})"
    if not head:
        return "it is empty"
    if head != HDF5_SIGNATURE:
        return "it is not an HDF5 file (no HDF5 signature)"
    try:
        f = open_segment_file(file, live=False)
    except RecordError:
        try:  # another program writing its own file holds HDF5's file lock: its file, not a damaged record
            f = h5py.File(file, "r", locking=False)
        except OSError:
            return None
    with f:
        try:
            ours = "nasdiag_version" in f.attrs or (schema.STEP in f and schema.PRESENT in f)
        except _READ_ERRORS:
            return None
    return None if ours else "it is an HDF5 file without the /step and /present of a nasdiag record"


@functools.lru_cache(maxsize=None)
def _metadata_read_attempts():
    """``H5Pset_metadata_read_attempts`` of the HDF5 library h5py loaded (h5py does not expose it),
    or None where it cannot be found (then HDF5's default applies)."""
    import ctypes

    try:
        with open("/proc/self/maps") as fh:
            libraries = {line.split()[-1] for line in fh if "libhdf5" in line and ".so" in line}
    except OSError:
        return None
    for library in sorted(libraries):
        name = os.path.basename(library)
        if not name.startswith("libhdf5") or name.startswith("libhdf5_hl"):
            continue
        try:
            function = ctypes.CDLL(library).H5Pset_metadata_read_attempts
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_int64, ctypes.c_uint]
        function.restype = ctypes.c_int
        return function
    return None


def _open_swmr_once(file: str) -> h5py.File:
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    # h5py's own default (weak): HDF5 shares a file opened twice in one process and refuses a second open whose
    # close degree differs, so a strong one here failed every other open of the record meanwhile (another thread's
    # load of a live record read it as damaged; a plain h5py.File raised "file close degree doesn't match").
    fapl.set_fclose_degree(h5py.h5f.CLOSE_WEAK)
    if _metadata_read_attempts()(fapl.id, 1) < 0:
        return h5py.File(file, "r", swmr=True)
    fid = h5py.h5f.open(os.fsencode(file), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ, fapl=fapl)
    return h5py.File(fid)


def _attr_str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _strings(dataset) -> list[str]:
    return [_attr_str(v) for v in dataset[()]]


def read_meta(f: h5py.File) -> dict:
    """The ``meta`` mapping a segment was written with (see `schema.normalize_meta`)."""
    meta: dict = {}
    attrs = f.attrs
    if "method" in attrs:
        meta["method"] = _attr_str(attrs["method"])
    if "config" in attrs:
        meta["config"] = schema.loads_json(_attr_str(attrs["config"]))
    if "seed" in attrs and int(attrs["seed"]) != schema.NO_SEED:
        meta["seed"] = int(attrs["seed"])
    group = f.get(schema.META)
    if group is not None:
        for key in ("op_names", "cell_types"):
            if key in group:
                meta[key] = _strings(group[key])
        if "edge_names" in group:
            meta["edge_names"] = {cell: _strings(ds) for cell, ds in group["edge_names"].items()}
        for key, value in group.attrs.items():
            meta[key] = schema.loads_json(_attr_str(value))
    return meta


def committed_rows(steps: np.ndarray) -> int:
    """Number of committed rows: ``/step`` up to its first never-written (fill -1) slot."""
    uncommitted = np.flatnonzero(steps < 0)
    return int(uncommitted[0]) if uncommitted.size else int(steps.shape[0])


@dataclass
class Damage:
    """Where a record stops being trustworthy: segment ``file`` from row ``row`` on (``step``, the
    step of that row, if it could be read), and why."""

    index: int
    file: str
    row: int
    reason: str
    step: int | None = None

    def where(self) -> str:
        step = f" (step {self.step})" if self.step is not None else ""
        return f"{self.file} row {self.row}{step}"


_READ_ERRORS = (OSError, RuntimeError, ValueError, KeyError, TypeError)


def _check_rows(f: h5py.File, file: str, index: int, steps: np.ndarray, n: int, paths, datasets, present_ds):
    """Read the first ``n`` committed rows and verify them; returns (n_intact, data, present, damage)."""
    damage = None

    def cut(row: int, reason: str) -> None:
        nonlocal n, damage
        if row < n:
            n = row
            damage = Damage(index, file, row, reason, int(steps[row]) if row < steps.size and steps[row] >= 0 else None)

    # Steps increase within a segment (the writer refuses anything else).
    if n > 1:
        bad = np.flatnonzero(np.diff(steps[:n]) <= 0)
        if bad.size:
            cut(int(bad[0]) + 1, f"step {int(steps[bad[0] + 1])} follows step {int(steps[bad[0]])} (steps must increase)")
    later = np.flatnonzero(steps[n:] >= 0) if damage is None else np.zeros(0)
    if later.size:  # a committed step after a never-written slot: /step itself was damaged
        cut(n, f"/step slot {n} reads -1 but slot {n + int(later[0])} holds step {int(steps[n + int(later[0])])}")
    # Datasets are written before /step; one that looks shorter was read from a stale cache.
    digest_ds = f.get(schema.DIGEST)
    for name, ds in [(schema.PRESENT, present_ds), (schema.DIGEST, digest_ds), *datasets.items()]:
        if ds is None:
            continue
        if ds.shape[0] < n:
            ds.refresh()
        if ds.shape[0] < n:
            cut(ds.shape[0], f"/{name} holds only {ds.shape[0]} rows of the {n} committed")
    data: dict[str, np.ndarray] = {}
    for name, ds in [(schema.PRESENT, present_ds), (schema.DIGEST, digest_ds), *datasets.items()]:
        if ds is None:
            continue
        data[name], bad, error = _read_prefix(ds, n)
        if bad is not None:
            cut(bad, f"/{name} cannot be read from there on ({error})")
    present = data.pop(schema.PRESENT)
    stored = data.pop(schema.DIGEST, None)
    if stored is not None and n:
        digest = schema.RowDigest(n)
        digest.add(schema.STEP, steps[:n])
        digest.add(schema.PRESENT, present[:n])
        for path in paths:
            digest.add(path, data[path][:n])
        wrong = np.flatnonzero(digest.value() != stored[:n])
        if wrong.size:
            cut(int(wrong[0]), "its checksum does not match its content (flipped bytes or a truncated file)")
    data = {path: values[:n] for path, values in data.items()}
    return n, data, present[:n], damage


def _read_prefix(ds, n: int) -> tuple[np.ndarray, int | None, str]:
    """Rows ``[:n]`` of ``ds``; where they cannot all be read (damaged chunks or index), the readable
    rows before the first unreadable chunk, that chunk's first row and the error."""
    try:
        return ds[:n], None, ""
    except _READ_ERRORS as err:
        error = _first_line(err)
    block = ds.chunks[0] if ds.chunks else n
    parts = []
    for start in range(0, n, max(block, 1)):
        try:
            parts.append(ds[start : min(start + block, n)])
        except _READ_ERRORS as err:
            error = _first_line(err)
            prefix = np.concatenate(parts) if parts else np.zeros((0, *ds.shape[1:]), ds.dtype)
            return prefix, start, error
    return np.concatenate(parts), None, ""  # readable block by block: a transient failure


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _check_version(f: h5py.File, file: str) -> None:
    """Refuse a segment of a newer schema than `schema.SCHEMA_VERSION`: its layout may mean something else, so
    reading it (or resuming it with segments of this version) could silently misread or mix formats."""
    version = f.attrs.get("schema_version", 1)
    try:
        version = int(version)
    except (TypeError, ValueError):
        raise RecordError(f"{file} has an unreadable schema_version {version!r}; it was not written by nasdiag") from None
    if version > schema.SCHEMA_VERSION:
        writer = _attr_str(f.attrs.get("nasdiag_version", "a newer version"))
        raise RecordError(
            f"{file} has record schema version {version} (written by nasdiag {writer}); this nasdiag reads versions up "
            f"to {schema.SCHEMA_VERSION}: upgrade nasdiag to read or resume it"
        )


@_one_read_at_a_time
def read_segment(index: int, file: str, with_data: bool = True, live: bool = True) -> Segment:
    """Read and verify the committed rows of one segment file (``with_data=False``: keep schema and
    steps only). The rows are checked as `load` describes; ``Segment.damage`` says where the first
    bad row is (the segment then holds only the rows before it), None if all are intact."""
    try:
        f = open_segment_file(file, live)
    except RecordError as err:
        return _damaged_segment(index, file, f"it cannot be opened ({err})")
    with f:
        try:
            if "nasdiag_version" in f.attrs:  # nasdiag's: a newer layout (without /present, say) is said to be one
                _check_version(f, file)
            if schema.STEP not in f or schema.PRESENT not in f:
                raise RecordError(f"{file} is not a nasdiag record segment (no /step or /present); remove or rename it")
            _check_version(f, file)
            present_ds, step_ds = f[schema.PRESENT], f[schema.STEP]
            if not (isinstance(step_ds, h5py.Dataset) and step_ds.ndim == 1 and step_ds.dtype.kind in "iu"
                    and isinstance(present_ds, h5py.Dataset) and present_ds.ndim == 2):
                # a group, a 0-d or float /step (someone else's file) raised IndexError or AttributeError further on
                raise RecordError(f"{file} is not a nasdiag record segment (its /step is not a column of steps or its "
                                  "/present not a table of flags); remove or rename it")
            paths = [_attr_str(p) for p in present_ds.attrs[schema.PATHS_ATTR]]
            datasets = {path: f[path] for path in paths}
            lost = next((path for path, ds in datasets.items() if not isinstance(ds, h5py.Dataset)), None)
            if lost is not None or present_ds.shape[1] != len(paths):
                raise KeyError(f"/{lost} is not a dataset" if lost is not None else
                               f"/present has {present_ds.shape[1]} columns for {len(paths)} paths")
            run_id = _attr_str(f.attrs.get("run_id", ""))
            meta = read_meta(f)
            previous = json.loads(_attr_str(f.attrs.get(schema.PREVIOUS_ATTR, "[]")))
            columns = {p: Column(p, tuple(ds.shape[1:]), ds.dtype) for p, ds in datasets.items()}
            nonfinite = {p: int(ds.attrs.get(schema.NONFINITE_ATTR, 0)) for p, ds in datasets.items()}
            numbered = int(f.attrs.get("segment", index))
            continued = bool(int(f.attrs.get(schema.CONTINUED_ATTR, 0)))
        except RecordError:
            raise
        except _READ_ERRORS as err:
            return _damaged_segment(index, file, f"its structure cannot be read ({_first_line(err)})")
        if numbered != index:  # the segment of this number is gone: its rows would be missing without a word
            return _damaged_segment(index, file, f"it holds segment {numbered} of its run, not segment {index} "
                                                 "(a copy or a renamed file)")
        steps, bad, error = _read_prefix(step_ds, step_ds.shape[0])
        steps = steps.astype(np.int64)
        n, data, present, damage = _check_rows(f, file, index, steps, committed_rows(steps), paths, datasets, present_ds)
        if bad is not None and damage is None and committed_rows(steps) == steps.size:
            # /step is unreadable beyond its first `bad` rows: every row from there on is lost.
            damage = Damage(index, file, bad, f"/step cannot be read from there on ({error})")
    segment = Segment(index=index, file=file, run_id=run_id, meta=meta, steps=steps[:n], columns=columns,
                      previous=[(int(i), int(rows)) for i, rows in previous], damage=damage, continued=continued)
    if with_data:
        for col, path in enumerate(paths):
            segment.data[path] = data[path]
            segment.present[path] = present[:, col].astype(bool)
            segment.nonfinite[path] = nonfinite[path]
    return segment


@_one_read_at_a_time
def segment_attrs(file: str) -> dict:
    """The root attributes of one segment file (created, host, versions, run id, ...), as stored."""
    with open_segment_file(file) as f:
        return dict(f.attrs.items())


def _damaged_segment(index: int, file: str, reason: str) -> Segment:
    return Segment(index=index, file=file, run_id="", meta={}, steps=np.zeros(0, np.int64), columns={},
                   damage=Damage(index, file, 0, reason))


def _first_damage(path: str, files: list[tuple[int, str]], segments: list[Segment]) -> Damage | None:
    """The earliest damage in segment order: a bad row, a missing segment (the one after the last file there too,
    where that file is marked ``continued``), or a segment that has fewer rows than a later segment recorded for it."""
    present = {index for index, _ in files}
    found: list[Damage] = [seg.damage for seg in segments if seg.damage is not None]
    last = max(segments, key=lambda seg: seg.index)
    following = schema.segment_path(path, last.index + 1)
    # marked only after the next segment was published: that file is gone (a copy of run.h5 alone), unless it is there
    # now (a live writer published it, and marked this one, after the files were listed: rows not read yet, no damage)
    if last.continued and not os.path.lexists(following):
        found.append(Damage(last.index + 1, following, 0, f"the segment is missing ({last.file} was continued in it; "
                                                          "copy or move all files of a record together)"))
    for index in range(max(present) + 1):
        if index not in present:  # the writer numbers segments without gaps
            later = min(i for i in present if i > index)
            found.append(Damage(index, schema.segment_path(path, index), 0, f"the segment is missing (segment {later} exists)"))
    by_index = {seg.index: seg for seg in segments}
    for seg in segments:
        for index, rows in seg.previous:
            earlier = by_index.get(index)
            if earlier is None and index not in present:
                found.append(Damage(index, schema.segment_path(path, index), 0, f"the segment is missing ({seg.file} lists it)"))
            elif earlier is not None and earlier.damage is None and earlier.steps.size < rows:
                found.append(Damage(index, earlier.file, int(earlier.steps.size),
                                    f"it has {earlier.steps.size} rows, but {seg.file} recorded {rows} when it was created"))
    return min(found, key=lambda d: (d.index, d.row)) if found else None


def _writer_alive(path: str) -> bool:
    """Whether a live writer holds the record's lock (its rows may be read mid-write), from one `read_lock`."""
    state = read_lock(path)
    try:
        pid = int(state.holder.get("pid", 0))
    except (ValueError, TypeError, AttributeError):  # no lock file, or no description that can be read
        return False
    if not state.on_this_host:
        return True  # a writer on another host (a shared file system): its pid cannot be checked here
    if pid <= 0 or pid == os.getpid():
        return False  # a writer in this process is not writing while this thread reads
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    # The pid of a killed writer is soon another process's (pid_max is often 32768): then a damaged record was read
    # with HDF5's retries and a load hung for many minutes instead of failing. A live writer holds its flock.
    return state.held is not False


def writer_gone(path: str, state: LockState | None = None) -> bool:
    """Whether the record at ``path`` was left by a writer that stopped without closing it (killed, crashed): its lock
    file is there, names a writer of this host, and the kernel lists no lock on it. False where a writer holds it,
    where there is no lock file (closed cleanly), and where it cannot be told (a writer on another host, no table of
    locks). ``state``: the lock as already read by `read_lock` (one reading answers every question of a caller), else
    it is read here."""
    state = read_lock(path) if state is None else state
    return state.present and state.on_this_host and state.held is False


def record_of_segment(path: str) -> str | None:
    """The existing record whose later segment `schema.segment_path` names ``path`` (``run.seg0001.h5`` next to
    ``run.h5`` -> ``run.h5``), else None (also where that file is not a record: ``data.seg2024.h5`` next to a
    ``data.h5`` of someone else's)."""
    owner = schema.segment_owner(path)
    return owner if owner is not None and os.path.isfile(owner) and not_a_record(owner) is None else None


def first_segment_among_later(files: list[tuple[int, str]]) -> str | None:
    """The first of the later segments in ``files`` (`schema.list_segments`: index > 0) that is segment 0 of a record of
    its own (root attribute ``segment`` 0: a record named ``x.seg0001.h5`` beside which ``x.h5`` is made), else None.
    Unreadable files count as segments (a damaged or half-written one is judged by `load`), and so does a copy of
    segment 0 of the same run (damage, which `load` names)."""
    def numbered_and_run(file: str, index: int):
        try:
            with _READS, open_segment_file(file, live=False) as f:
                if "step" not in f:
                    return index, None
                return int(f.attrs.get("segment", index)), _attr_str(f.attrs.get("run_id", ""))
        except (RecordError, *_READ_ERRORS):
            return index, None

    first_run = numbered_and_run(files[0][1], 0)[1] if files and files[0][0] == 0 and os.path.isfile(files[0][1]) else None
    for index, file in files:
        if index == 0 or not os.path.isfile(file):
            continue
        numbered, run = numbered_and_run(file, index)
        if numbered == 0 and not (run and run == first_run):
            return file
    return None


def _refuse_a_segment_of_another_record(path: str) -> None:
    """A later segment read as a record was called damaged ("it holds segment 1 of its run, not segment 0"), with
    a salvage of 0 rows offered: say which record it belongs to instead."""
    owner = record_of_segment(path)
    if owner is None or not os.path.isfile(path):
        return
    try:
        with _READS, open_segment_file(path, live=False) as f:
            numbered = int(f.attrs.get("segment", 0))
    except (RecordError, *_READ_ERRORS):
        return  # unreadable: judged as a record below
    if numbered > 0:
        raise RecordError(f"{path} is segment {numbered} of the record {owner} (rows after a resume or a new path), not "
                          f"a record of its own; load {owner}, which is read with all its segments")


def _identities(files: list[tuple[int, str]]) -> list[tuple]:
    """``(index, file, device, inode)`` of each listed segment (None for one that is gone): a read whose listing is not
    the same after it read files that changed meanwhile."""
    out = []
    for index, file in files:
        try:
            found = os.stat(file)
            out.append((index, file, found.st_dev, found.st_ino))
        except OSError:
            out.append((index, file, None, None))
    return out


def read_segments(path: str, with_data: bool = True, salvage: bool = False) -> list[Segment]:
    """All segments of the record at ``path`` that belong to its run, by index, verified.

    A segment whose ``run_id`` differs from the first one is a leftover of another run; it is skipped
    with a `RecordWarning`. Damage (see `load`) raises `RecordError` naming the file and the first bad
    row; with ``salvage=True`` the intact prefix is returned instead, with a `RecordWarning`. Raises
    `RecordError` if there is no segment at all.
    """
    try:
        path = os.fspath(path)
    except TypeError:
        raise RecordError(f"path must be a str or os.PathLike, got {type(path).__name__}") from None
    if isinstance(path, bytes):  # as `Recorder` takes it
        path = os.fsdecode(path)
    if not path:
        raise RecordError("the record path is empty; pass a record file such as runs/run.h5")
    if os.path.isdir(path):
        raise RecordError(f"{path} is a folder, not a record; pass the record file (for example {os.path.join(path, 'run.h5')})")
    path = schema.resolve_link(path)
    _refuse_a_segment_of_another_record(path)
    for attempt in range(4):
        files = schema.list_segments(path)
        if not files:
            raise RecordError(f"no record at {path} (no file {path} and no segments next to it)")
        for _, file in files:
            special = _special_file(file)
            if special:  # h5py's open of a named pipe waited for a writer for ever (load, a resume)
                raise RecordError(f"{file} is {special}, not a record file; pass the path of a record")
        live = _writer_alive(path)
        before = _identities(files)
        segments = [read_segment(index, file, with_data, live) for index, file in files]
        damage = _first_damage(path, files, segments)
        # A live writer may be mid-way through writing metadata, and files that changed during the read (a record
        # replaced by another writer: a listed segment deleted before it was opened) are no damage: look again.
        if damage is None or not (live or _identities(schema.list_segments(path)) != before):
            break
        time.sleep(0.05 * (attempt + 1))
    if damage is not None:
        kept = [seg for seg in segments if seg.index < damage.index]
        cut = next((seg for seg in segments if seg.index == damage.index and seg.damage is damage), None)
        if cut is None:
            cut = next((seg for seg in segments if seg.index == damage.index), None)
        rows = sum(seg.steps.size for seg in kept) + (min(damage.row, cut.steps.size) if cut is not None else 0)
        if not salvage:
            raise DamagedRecordError(
                f"record {path} is damaged at {damage.where()}: {damage.reason}; "
                f"load(path, salvage=True) returns the {rows} intact rows before it",
                path, damage.where(), damage.reason, rows,
            )
        warnings.warn(
            f"record {path} is damaged at {damage.where()}: {damage.reason}; returning the {rows} intact rows before it",
            RecordWarning,
            stacklevel=3,
        )
        if cut is not None and cut.steps.size and cut.run_id:
            kept.append(_prefix(cut, damage.row))
        segments = kept
        if not segments:
            return []
    run_id = segments[0].run_id
    kept = []
    for seg in segments:
        if seg.run_id != run_id:
            warnings.warn(f"skipping {seg.file}: it belongs to another run than {segments[0].file}", RecordWarning)
        else:
            kept.append(seg)
    return kept


def _prefix(seg: Segment, rows: int) -> Segment:
    rows = min(rows, seg.steps.size)
    return Segment(index=seg.index, file=seg.file, run_id=seg.run_id, meta=seg.meta, steps=seg.steps[:rows],
                   columns=seg.columns, previous=seg.previous, damage=None,
                   data={p: d[:rows] for p, d in seg.data.items()},
                   present={p: m[:rows] for p, m in seg.present.items()}, nonfinite=dict(seg.nonfinite))


def merged_columns(segments: list[Segment]) -> dict[str, Column]:
    """The union of the segments' schemas; a path must keep its shape and dtype across segments."""
    columns: dict[str, Column] = {}
    for seg in segments:
        for path, col in seg.columns.items():
            known = columns.setdefault(path, col)
            if (known.shape, known.dtype) != (col.shape, col.dtype):
                raise RecordError(
                    f"{path!r} has shape {known.shape} {known.dtype} in one segment and {col.shape} {col.dtype} "
                    f"in {seg.file}; the record is inconsistent"
                )
    return columns


def _meta_arrays(meta: dict) -> dict[str, np.ndarray]:
    out = {}
    for key, value in meta.items():
        if key in ("op_names", "cell_types"):
            out[f"meta/{key}"] = np.asarray(value, dtype=str)
        elif key == "edge_names":
            for cell, names in value.items():
                out[f"meta/edge_names/{cell}"] = np.asarray(names, dtype=str)
        elif key == "method":
            out["meta/method"] = np.asarray(value, dtype=str)
        elif key == "seed":
            out["meta/seed"] = np.asarray(value, dtype=np.int64)
        else:  # config and unknown keys: the JSON text, as stored
            out[f"meta/{key}"] = np.asarray(schema.dumps_json(value), dtype=str)
    return out


def _winners(segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """The merged record's steps, sorted, and for each the index of its row among the segments' rows concatenated:
    where a step appears more than once, the row of the later segment wins."""
    all_steps = np.concatenate([seg.steps for seg in segments])
    # Last occurrence of each step wins: unique over the reversed rows finds it, sorted by step.
    steps, first_in_reversed = np.unique(all_steps[::-1], return_index=True)
    return steps, all_steps.shape[0] - 1 - first_in_reversed


def load(path, *, salvage: bool = False) -> dict[str, np.ndarray]:
    """Read a record (all its segments) into numpy arrays with aligned rows.

    Returns a dict with:

    - ``"step"``: (T,) int64, increasing. Segments are merged; where a step appears in several
      segments the later segment's row wins.
    - ``"<path>"`` for every logged dataset path: (T, *shape), the dtype it was logged with. A row in
      which the path was not logged holds the fill value (NaN for floats, 0 for ints, False for bools).
    - ``"valid/<path>"``: (T,) bool, True where the path was logged in that row.
    - ``"meta/..."``: the run's metadata from the last segment: ``meta/op_names`` (K,) str,
      ``meta/cell_types`` (C,) str, ``meta/edge_names/<cell type>`` (E,) str, ``meta/method`` 0-d str,
      ``meta/seed`` 0-d int64, ``meta/config`` and any other key as 0-d JSON str.
      `load_meta` gives the same as plain Python objects.

    Only committed rows are read, so a record whose writer is alive, was killed or is resuming loads
    consistently: rows not yet committed are simply not there.

    Damage is refused with a `RecordError` naming the file and the first bad row: a row whose
    checksum (``/digest``) does not match its content (flipped bytes; a truncated file, whose lost
    part reads back as zeros), steps that do not increase, a dataset shorter than the committed
    rows, a segment that cannot be opened or read, a missing segment (a gap in the numbering, one
    that a later segment lists, or the one after the last file there when that file's root attribute
    ``continued`` says its writer published it: a ``run.h5`` copied alone), a segment with fewer rows than a later one recorded for it, or a segment file
    whose ``segment`` attribute is not the number in its name (another segment copied or renamed over it).
    ``salvage=True`` returns the intact prefix instead (every row before the first bad one; later
    segments are dropped) with a `RecordWarning`. Raises `RecordError` if there is no record.
    """
    return record_of(read_segments(path, with_data=True, salvage=salvage))


def record_of(segments: list[Segment]) -> dict[str, np.ndarray]:
    """What `load` returns for ``segments`` (`read_segments` with data): a caller that also needs `meta_of` of the
    same rows reads the record once (a live writer's next flush between two reads made them disagree)."""
    if not segments:
        return {"step": np.zeros(0, np.int64)}
    columns = merged_columns(segments)
    steps, winners = _winners(segments)
    total = sum(seg.steps.shape[0] for seg in segments)
    out: dict[str, np.ndarray] = {"step": steps.astype(np.int64)}
    for path, col in columns.items():
        data = np.full((total, *col.shape), schema.fill_value(col.dtype), dtype=col.dtype)
        valid = np.zeros(total, bool)
        start = 0
        for seg in segments:
            stop = start + seg.steps.shape[0]
            if path in seg.data:
                data[start:stop] = seg.data[path]
                valid[start:stop] = seg.present[path]
            start = stop
        data[~valid] = schema.fill_value(col.dtype)
        out[path] = data[winners]
        out[f"valid/{path}"] = valid[winners]
    out.update(_meta_arrays(segments[-1].meta))
    return out


def load_meta(path, *, salvage: bool = False) -> dict:
    """The run's metadata as Python objects (from its last segment).

    Keys as passed to `Recorder` (``method``, ``config`` dict, ``seed``, ``op_names``,
    ``edge_names``, ``cell_types``, extra keys), plus ``schema_version``, ``nasdiag_version``,
    ``torch_version``, ``h5py_version``, ``hdf5_version``, ``run_id``, ``segments`` (list of segment
    files) and ``nonfinite_counts`` (dict path -> NaN/inf count over the rows `load` returns: a row a later
    segment replaced is not counted). A damaged
    record raises `RecordError` as in `load` (``salvage=True``: the meta of the intact prefix).
    """
    return meta_of(read_segments(path, with_data=True, salvage=salvage))


def meta_of(segments: list[Segment]) -> dict:
    """What `load_meta` returns for ``segments`` (`read_segments` with data; see `record_of`)."""
    if not segments:
        return {"segments": [], "nonfinite_counts": {}}
    meta = dict(segments[-1].meta)
    attrs = segment_attrs(segments[-1].file)
    for key in ("schema_version", "nasdiag_version", "torch_version", "h5py_version", "hdf5_version"):
        if key in attrs:
            meta[key] = int(attrs[key]) if key == "schema_version" else _attr_str(attrs[key])
    meta["run_id"] = segments[0].run_id
    meta["segments"] = [seg.file for seg in segments]
    counts: dict[str, int] = {}
    won = np.zeros(sum(seg.steps.shape[0] for seg in segments), bool)
    won[_winners(segments)[1]] = True  # a row a later segment replaced (a replayed step) is not in the record
    start = 0
    for seg in segments:
        rows = won[start : start + seg.steps.shape[0]]
        start += seg.steps.shape[0]
        for p, data in seg.data.items():
            if data.dtype.kind == "f":
                counts[p] = counts.get(p, 0) + int(np.count_nonzero(~np.isfinite(data[seg.present[p] & rows])))
    meta["nonfinite_counts"] = counts
    return meta
