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


def live_holder(record: str):
    """Who holds the writer lock of ``record`` (``pid 123 on host since ...``), read from the kernel's table of locks
    (/proc/locks on Linux, so that no lock is taken to look: a writer starting then would be refused), else None: no
    lock held (a lock file left by a writer that died holds none), or no such table (`LOCK_TABLE`)."""
    from nasdiag.record.schema import lock_path

    lock = lock_path(record)
    try:
        st = os.stat(lock)
        with open(LOCK_TABLE) as fh:
            table = fh.read()
    except OSError:
        return None
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    if not any(line.split()[1:2] == ["FLOCK"] and device in line.split() for line in table.splitlines()):
        return None
    try:
        with open(lock) as fh:
            holder = json.loads(fh.read() or "{}")
    except (OSError, ValueError):
        holder = {}
    if not isinstance(holder, dict) or holder.get("pid") is None:
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"


#: the first bytes of an HDF5 file, which a lock file never holds
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"

#: the kernel's table of file locks (Linux), read by `live_holder`
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
                with open(self.lock_file) as fh:
                    info = json.loads(fh.read() or "{}")
            except (OSError, ValueError):
                info = {}
            if isinstance(info, dict) and info.get("pid") is not None:
                return f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')}"
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
