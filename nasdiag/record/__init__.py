"""Durable HDF5 records of a search, and the callbacks that feed them.

- `Recorder(path, meta=None, flush_every=64, resume=False, overwrite=False)`: crash-safe,
  resumable, live-readable writer; ``log(step, values)`` appends one row.
- `load(path)`: every committed row of every segment, merged, as numpy arrays; `load_meta(path)`:
  the run's metadata.
- `RecorderCallback`: ``on_step_end`` / ``on_epoch_end`` / ``on_exception`` hooks for any training
  loop, with DDP reduction and rank-0 writing; `lightning_callback` adapts it to PyTorch Lightning.
- `RecordError`: every user-facing error; `RecordWarning`: NaN/inf and resume notices.

The format is described in docs/schema.md. Importing this package imports neither torch nor
Lightning; the callbacks import them only when they need them.
"""

from nasdiag.record.callbacks import RecorderCallback
from nasdiag.record.errors import RecordError, RecordWarning, ResumeMismatchError
from nasdiag.record.lightning import lightning_callback
from nasdiag.record.reader import load, load_meta
from nasdiag.record.schema import SCHEMA_VERSION
from nasdiag.record.writer import Recorder

__all__ = [
    "Recorder",
    "load",
    "load_meta",
    "RecordError",
    "RecordWarning",
    "ResumeMismatchError",
    "RecorderCallback",
    "lightning_callback",
    "SCHEMA_VERSION",
]
