"""The writer lock of a record: one live writer per record, across processes.

HDF5's own file lock does not cover SWMR writing (a second ``h5py.File(path, "w")`` silently
truncates a live SWMR file), so the recorder holds an ``flock`` on ``<path>.lock`` for as long as
it writes. The kernel drops the lock when the writer dies, even by SIGKILL, so a crashed run never
blocks its own resume.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time

from nasdiag.record.errors import RecordError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


def describe_os_error(err: OSError) -> str:
    """A short reason for ``err`` that tells disk-full and read-only cases apart."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"disk full or file-size limit reached ({os.strerror(err.errno)})"
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"location is read-only or not writable ({os.strerror(err.errno)})"
    return os.strerror(err.errno) if err.errno else str(err)


class LockState:
    """What the lock file of a record says, read once (`read_lock`), so that the questions asked of it (`live_holder`,
    `nasdiag.record.reader.writer_gone`, whether a reader waits for a live writer, a report's note) are answered from
    one reading and cannot disagree when the writer changes between two reads.

    Attributes:
        present: the lock file is there (a writer lives, or one stopped without closing the record).
        holder: the writer's description it holds (``{"pid", "host", "since"}``), or None where it holds none that
            can be read (empty or half written: a writer has just taken the lock; not JSON; unreadable).
        held: whether the kernel's table of locks (`LOCK_TABLE`) lists a lock on the file: True (a writer holds it),
            False (none does: its writer died), None (it cannot be told: no lock file, or no table).
    """

    __slots__ = ("present", "holder", "held")

    def __init__(self, present: bool, holder, held):
        self.present = present
        self.holder = holder
        self.held = held

    @property
    def description(self) -> str:
        """``pid 123 on host since 2026-01-01T00:00:00``, or ``holder unknown``."""
        return _description(self.holder) or "holder unknown"

    @property
    def on_this_host(self) -> bool:
        """Whether the writer it names is of this host (one that names no host is taken as of this host)."""
        return (self.holder or {}).get("host", socket.gethostname()) == socket.gethostname()

    def __repr__(self) -> str:
        return f"LockState(present={self.present}, holder={self.holder!r}, held={self.held})"


def _parse_holder(text: bytes):
    """The writer's description a lock file holds (a dict), else None (empty, half written, not JSON)."""
    try:
        holder = json.loads(text or b"{}")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _description(holder) -> str | None:
    """``pid 123 on host since ...`` of a parsed description, None where it names no pid."""
    if holder is None or holder.get("pid") is None:
        return None
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"


def read_lock(record: str) -> LockState:
    """Read the lock file of ``record`` (`schema.lock_path`) and the kernel's table of locks once: the one reading of
    the lock that every question about a record's writer is answered from (see `LockState`).

    Whether a lock is held is read from the kernel's table (/proc/locks on Linux), so that no lock is taken to look (a
    writer starting then would be refused). The file's inode alone is compared there (with any lock kind): the
    device of a file may be written otherwise in the table than ``os.stat`` gives it (btrfs subvolumes, some network
    and overlay file systems), and a flock on NFS is listed as a POSIX lock. The description and the inode are read
    through one open file, so they are of the same file."""
    from nasdiag.record.schema import lock_path

    lock = lock_path(record)
    holder = inode = None
    try:
        # O_NONBLOCK: a named pipe of that name is no lock file, and a plain open waited for a writer of it for ever
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return LockState(False, None, None)
    except OSError:  # there, but not readable: its inode still tells whether a writer holds it
        try:
            inode = os.stat(lock).st_ino
        except OSError:
            return LockState(False, None, None)
    else:
        try:
            st = os.fstat(fd)
            inode = st.st_ino
            if stat.S_ISREG(st.st_mode):  # a pipe, a device, ...: nothing to read (a writer describes itself in a file)
                holder = _parse_holder(os.read(fd, max(st.st_size, 0) + 4096))  # None where half written
        except OSError:
            pass
        finally:
            os.close(fd)
    if inode is None:
        return LockState(True, holder, None)
    try:
        with open(LOCK_TABLE) as fh:
            table = fh.read()
    except OSError:
        return LockState(True, holder, None)
    suffix = f":{inode}"
    held = any(field.endswith(suffix) and field.count(":") == 2 for line in table.splitlines() for field in line.split())
    return LockState(True, holder, held)


def live_holder(record: str):
    """Who holds the writer lock of ``record`` (``pid 123 on host since ...``; ``holder unknown`` while a writer that
    has just taken it has not yet written who it is), read by `read_lock`, else None: no lock held (a lock file left by
    a writer that died holds none), or no table of locks (`LOCK_TABLE`)."""
    state = read_lock(record)
    return state.description if state.held else None


#: the first bytes of an HDF5 file, which a lock file never holds
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"

#: the kernel's table of file locks (Linux), read by `read_lock`
LOCK_TABLE = "/proc/locks"


class WriterLock:
    """An exclusive, non-blocking ``flock`` on ``lock_file``.

    ``acquire()`` raises `RecordError` naming the holder (pid, host, start time) if another writer
    holds the lock, in this process or another. ``release()`` removes the file and drops the lock.
    """

    def __init__(self, lock_file: str, record: str):
        self.lock_file = lock_file
        self.record = record
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if fcntl is None:  # pragma: no cover
            raise RecordError("recording needs fcntl.flock (Linux or macOS); this platform has none")
        while True:
            try:
                fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise RecordError(
                    f"cannot create lock file {self.lock_file}: {describe_os_error(err)}; record to a writable location"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RecordError(
                        f"record {self.record} is being written by another writer ({self._holder()}); "
                        "wait for it to finish or record to another path"
                    ) from None
                raise RecordError(f"cannot lock {self.lock_file}: {describe_os_error(err)}") from None
            # The previous holder may have removed the file between our open and our flock; then we
            # locked an orphaned inode and must retry on the file now at that path.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.lock_file))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            head = os.pread(fd, len(_HDF5_SIGNATURE), 0)
        except OSError:
            head = b""
        if head == _HDF5_SIGNATURE:  # a record named like this record's lock: it was truncated, then deleted at close
            os.close(fd)
            raise RecordError(
                f"{self.lock_file}, the writer lock of record {self.record}, is an HDF5 file (a record of that name?) "
                "that the lock would overwrite; rename one of them"
            )
        self._fd = fd
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")})
        try:
            os.ftruncate(fd, 0)
            os.write(fd, info.encode())
        except OSError:
            pass  # the lock itself is what matters; the holder description is a courtesy

    def _holder(self) -> str:
        # A writer that has just taken the lock writes its description right after; until then the file is empty
        # (or half written): look again shortly instead of naming "pid None on None".
        for attempt in range(10):
            try:
                with open(self.lock_file, "rb") as fh:
                    described = _description(_parse_holder(fh.read()))
            except OSError:
                described = None
            if described is not None:
                return described
            time.sleep(0.01 * (attempt + 1))
        return "holder unknown"

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.lock_file)
        except OSError:
            pass
        os.close(fd)
