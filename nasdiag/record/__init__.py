"""Durable HDF5 records of a search, and the callbacks that feed them.

- `Recorder(path, meta=None, flush_every=64, resume=False, overwrite=False, on_run_change="warn")`:
  crash-safe, resumable, live-readable writer; ``log(step, values)`` appends one row, ``flush()``
  commits, ``last_committed_step`` is the last step on disk, ``add_flush_listener(fn)`` lets a
  caller hand over rows it holds back, ``resume_differences`` says how a resumed run differs.
- `load(path, salvage=False)`: every committed row of every segment, merged and verified, as numpy
  arrays (a damaged record raises `RecordError` naming the first bad row; ``salvage=True`` returns
  the intact prefix); `load_meta(path)`: the run's metadata.
- `RecorderCallback`: ``on_step_end`` / ``on_epoch_end`` / ``on_exception`` / ``flush`` hooks for any
  training loop; statistics stay on their device until a batch of rows is handed over, reduced
  across DDP ranks once per batch, written by rank 0; `lightning_callback` adapts it to Lightning.
- `RecordError` (every user-facing error), `ResumeMismatchError` (a resume into another run or
  search space, with ``differences``), `DamagedRecordError` (a damaged record: ``path``, ``where``, ``reason``,
  ``intact_rows``), `RecordWarning` (NaN/inf, resume notices, salvage).

The format, the commit protocol and damage detection are described in docs/schema.md. Importing
this package imports neither torch nor Lightning; the callbacks import them only when they need them.
"""

from nasdiag.record.callbacks import RecorderCallback
from nasdiag.record.errors import DamagedRecordError, RecordError, RecordWarning, ResumeMismatchError
from nasdiag.record.lightning import lightning_callback
from nasdiag.record.reader import load, load_meta
from nasdiag.record.schema import SCHEMA_VERSION
from nasdiag.record.writer import Recorder

__all__ = [
    "Recorder",
    "load",
    "load_meta",
    "RecordError",
    "DamagedRecordError",
    "RecordWarning",
    "ResumeMismatchError",
    "RecorderCallback",
    "lightning_callback",
    "SCHEMA_VERSION",
]
