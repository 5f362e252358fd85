"""Checkpoints of a search and the commit rule that keeps them consistent with the record.

The commit rule: a checkpoint is written only after the record has been flushed, so the step of the
checkpoint is never past the record's last committed step. A resumed run loads the checkpoint (step
S_ck), replays steps S_ck+1 .. S_rec without writing rows (the data order depends only on the seed
and the epoch, every random source is in the checkpoint) and records from S_rec+1 on. Every step is
then in the record exactly once, whatever moment the previous process was killed at.

A checkpoint file is written to ``<path>.tmp`` and renamed over ``<path>`` (``os.replace``), so a
reader sees the old or the new file, never a partial one; a failed write removes its temporary file.
"""

from __future__ import annotations

import math
import os
import random
from typing import Any, Callable, Dict, Mapping, Optional

import numpy as np
import torch

from nasdiag.errors import NasdiagError

FORMAT = 1


class CheckpointError(NasdiagError):
    """A checkpoint cannot be written or read; the message says which file and why."""


def temp_path(path: str) -> str:
    return os.fspath(path) + ".tmp"


def rng_state() -> Dict[str, Any]:
    """Every global random source a search step may draw from (torch CPU and CUDA, numpy, Python)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` atomically to ``path`` (tmp file, fsync, rename); no temporary file survives a failure."""
    path = os.fspath(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as fh:
            torch.save({"format": FORMAT, **payload}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        cause = os_error_in(exc) if isinstance(exc, Exception) else None  # an interrupt stays one
        if cause is not None:
            from nasdiag.record.lock import describe_os_error

            raise CheckpointError(f"cannot write checkpoint {path}: {describe_os_error(cause)}") from None
        raise


def os_error_in(exc: BaseException):
    """The OSError ``exc`` is or was raised while handling (torch.save turns a failed write, such as a
    full disk, into a RuntimeError raised from its zip writer's cleanup), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def load_checkpoint(path: str) -> Dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`; a damaged or foreign file raises `CheckpointError`."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path):  # a named pipe made torch.load (and --resume) wait for ever
        kind = "a folder" if os.path.isdir(path) else "not a regular file (a named pipe, socket or device)"
        raise CheckpointError(f"checkpoint {path} is {kind}, not a checkpoint file; move it away and start the run "
                              "again under a new --out, or with --force, which replaces the record and its checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except PermissionError as exc:  # it said the file "was damaged"
        raise CheckpointError(f"checkpoint {path} cannot be read ({os.strerror(exc.errno) if exc.errno else exc}); give "
                              "this user read access to it") from None
    except Exception as exc:  # a truncated zip, random bytes, a pickle of something else
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(exc).__name__}); it was damaged: start the run "
                              "again under a new --out, or with --force, which replaces its record") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a nasdiag checkpoint (format {FORMAT})")
    return state


class Checkpointer:
    """A search callback that checkpoints at every epoch end, but one whose ``scalars/search_val_loss`` is NaN/inf
    (the run stops there: its last checkpoint stays the one before the divergence).

    Args:
        path: the checkpoint file.
        method: the `SearchMethod` whose ``state_dict()`` is saved.
        steps_per_epoch: S, to place a step in its epoch.
        extra: constant entries stored in every checkpoint (config, config hash, schedule length).
        commit: called before each write; it must make the record durable up to the current step
            (the recorder's flush), so that a checkpoint is never ahead of the record.

    Each checkpoint holds ``step`` (the last completed step, 0 before the first), ``epoch`` (epochs
    completed) and ``position`` (steps completed within the current epoch), the method's state (with
    ``method.generator``) and the global RNG states. Checkpoints fall on epoch boundaries only: the
    method's streaming epoch statistics (cost moments) are not part of its state, so a checkpoint
    inside an epoch could not reproduce the epoch's statistics; resume replays the partial epoch.
    """

    def __init__(self, path: str, method, steps_per_epoch: int, *, extra: Optional[Mapping[str, Any]] = None,
                 commit: Callable[[], None] = lambda: None):
        self.path = os.fspath(path)
        self.method = method
        self.steps_per_epoch = int(steps_per_epoch)
        self.extra = dict(extra or {})
        self.commit = commit

    def save(self, step: int) -> None:
        if step:  # step 0 (before the first step) has no row to commit
            self.commit()
        S = self.steps_per_epoch
        save_checkpoint(self.path, {
            **self.extra,
            "step": int(step),
            "epoch": int(step) // S,
            "position": int(step) % S,
            "method": self.method.state_dict(),
            "rng": rng_state(),
        })

    def on_step_end(self, step: int, stats) -> None:
        pass

    def on_epoch_end(self, epoch: int, stats) -> None:
        loss = stats.get("scalars/search_val_loss")
        if loss is not None and not math.isfinite(float(loss)):
            # the run stops at this epoch end (`search_loop`'s check): the checkpoint stays the one before, so that
            # --resume replays to the same stop writing nothing, as after a method's NaN-loss step (saved, a NaN state
            # was continued, one more epoch of NaN rows per resume, and a diverged last epoch read as a finished run)
            self.commit()
            return
        self.save((epoch + 1) * self.steps_per_epoch)

    def on_exception(self, exc: BaseException) -> None:
        pass
