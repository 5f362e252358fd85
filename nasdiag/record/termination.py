"""Flush open recorders when the process is told to stop (SIGTERM) or exits normally.

One guard object serves all recorders of the process: it installs its SIGTERM handler when the
first recorder opens and restores the previous handler when the last one closes, so nested or
sequential recorders never fight over the handler. Open recorders are held strongly until they
close: one that its owner dropped without closing must still flush at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import warnings

from nasdiag.record.errors import RecordWarning


@contextlib.contextmanager
def _outside_function_transforms():
    """Suspend torch.func's transforms for the block. A signal can land while one runs (the exact curvature is a
    ``vmap(jvp(grad))``); the handler's own torch ops would then be traced by it, and stacking the held rows
    for the host copy gives a dual tensor without storage instead of the rows."""
    torch = sys.modules.get("torch")  # a process that never imported torch has no transform running
    disable = getattr(getattr(torch, "_C", None), "_DisableFuncTorch", None)
    if disable is None:
        yield
        return
    with disable():
        yield


class _TerminationGuard:
    def __init__(self):
        self._recorders: dict = {}  # open recorder -> pid of the process that opened it (insertion-ordered)
        self._previous = None
        self._installed = False
        self._pending_signal: int | None = None
        atexit.register(self._close_all)

    def register(self, recorder, handle_sigterm: bool) -> None:
        self._recorders[recorder] = os.getpid()  # the process that opened it: the only one that may write it
        if not handle_sigterm or self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "Recorder opened outside the main thread cannot install a SIGTERM handler; rows are still "
                "flushed every flush_every rows, on close and at exit (pass handle_sigterm=False to silence this)",
                RecordWarning,
                stacklevel=3,
            )
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def unregister(self, recorder) -> None:
        self._recorders.pop(recorder, None)
        if self._installed and not len(self._recorders) and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                # None means a handler installed outside Python; the default is the closest we can restore.
                signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _close_all(self) -> None:
        self._for_all("close")

    def _own(self) -> list:
        """The open recorders this process opened. A forked child (e.g. a DataLoader worker) must never touch its
        parent's; those it opened itself it must flush (one process-wide pid check skipped them, and their rows)."""
        pid = os.getpid()
        return [recorder for recorder, opener in list(self._recorders.items()) if opener == pid]

    def _for_all(self, action: str) -> None:
        with _outside_function_transforms():
            for recorder in self._own():
                try:
                    getattr(recorder, action)()
                except Exception as err:  # in a signal handler or at exit there is no caller to raise to
                    warnings.warn(f"{action} of {recorder.path} failed: {err}", RecordWarning)

    def _on_sigterm(self, signum, frame) -> None:
        if any(r.writing for r in self._own()):
            # The signal arrived inside log/flush; acting now would re-enter the recorder mid-write.
            # The recorder calls `finish_pending_signal` when it is done.
            self._pending_signal = signum
            return
        self._handle(signum, frame)

    def finish_pending_signal(self) -> None:
        """Called by a recorder after log/flush; handles a SIGTERM that arrived during it."""
        signum, self._pending_signal = self._pending_signal, None
        if signum is not None:
            self._handle(signum, None)

    def _handle(self, signum, frame) -> None:
        previous = self._previous
        if callable(previous):
            # Someone else decides whether the process ends (e.g. a checkpoint-and-requeue handler):
            # make everything durable but leave the recorders usable.
            self._for_all("flush")
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            self._for_all("flush")
        else:  # default action: close cleanly, then terminate by the signal as if we had not been here
            self._close_all()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    @property
    def pending(self) -> bool:
        return self._pending_signal is not None


GUARD = _TerminationGuard()
