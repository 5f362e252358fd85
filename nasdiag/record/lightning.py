"""PyTorch Lightning adapter of `RecorderCallback`. Lightning is imported only when it is used."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping

from nasdiag.record.errors import RecordError


def _lightning_callback_base():
    broken = None
    for module in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(module).Callback
        except ImportError:
            continue
        except Exception as err:  # an installed package that fails at import (a torchvision built for another torch)
            broken = broken or (module, err)
    if broken is not None:
        module, err = broken
        text = str(err).strip().splitlines()
        raise RecordError(
            f"PyTorch Lightning is installed but 'import {module}' fails ({type(err).__name__}: "
            f"{text[0] if text else 'no message'}); repair that install (a torchvision built for another torch breaks "
            "it: pip uninstall torchvision, which nasdiag does not use) or call RecorderCallback's hooks from your loop"
        ) from None
    raise RecordError(
        "the Lightning adapter needs PyTorch Lightning (pip install lightning); nasdiag does not depend on it. "
        "Without it, call RecorderCallback's hooks from your loop"
    )


def _statistics_from_module(trainer, pl_module, outputs) -> Mapping:
    source = getattr(pl_module, "nasdiag_statistics", None)
    if callable(source):
        return source()
    if isinstance(outputs, Mapping) and isinstance(outputs.get("nasdiag"), Mapping):
        return outputs["nasdiag"]
    raise RecordError(
        f"{type(pl_module).__name__} gives no statistics: define a nasdiag_statistics() method returning "
        "{record path: value}, return {'nasdiag': {...}} from training_step, or pass statistics=fn to lightning_callback"
    )


@functools.lru_cache(maxsize=None)
def _adapter_class(base):
    class NasdiagRecorder(base):
        """Records statistics at each training batch end and epoch end; rank 0 writes."""

        def __init__(self, path, meta, statistics, epoch_statistics, callback_kwargs):
            super().__init__()
            self.path = path
            self.meta = meta
            self.statistics = statistics
            self.epoch_statistics = epoch_statistics
            self.callback_kwargs = callback_kwargs
            self.callback = None
            self.fits = 0  # setups that opened the record: a later fit with this callback continues it
            self.steps_before = None  # trainer.global_step as the current training batch began

        def __reduce__(self):
            # The class is made at run time, so pickle (ddp_spawn sends callbacks to the workers)
            # rebuilds it through the factory; an open recorder is never sent.
            return (_rebuild, (self.path, self.meta, self.statistics, self.epoch_statistics, self.callback_kwargs))

        def setup(self, trainer, pl_module, stage=None):
            if stage not in (None, "fit"):
                # trainer.validate/test/predict run no training batch: opening the record (for resume) added an empty
                # segment to it at every such call, and made a record where there was none
                return
            if self.callback is not None and not self.callback.closed:
                return
            from nasdiag.record.callbacks import RecorderCallback

            writes = trainer.global_rank == 0
            kwargs = dict(self.callback_kwargs)
            if self.fits and writes:  # another fit after teardown closed the record: append to it
                kwargs.pop("overwrite", None)
                kwargs["resume"] = True
            self.fits += 1
            if not writes:
                kwargs = {k: v for k, v in kwargs.items() if k in ("reduce", "rules", "ddof", "group", "flush_every")}
            self.callback = RecorderCallback(self.path if writes else None, meta=self.meta if writes else None, **kwargs)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.steps_before = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            stats = self.statistics(trainer, pl_module, outputs)
            step = trainer.global_step
            if step == self.steps_before:
                # No optimizer step in this batch (a micro-batch of gradient accumulation): it goes into the row of
                # the step it accumulates into, global_step after that step, not the row of the step before it
                step += 1
            self.callback.on_step_end(step, stats)

        def on_train_epoch_end(self, trainer, pl_module):
            stats = self.epoch_statistics(trainer, pl_module) if self.epoch_statistics is not None else None
            self.callback.on_epoch_end(trainer.current_epoch, stats)

        def on_exception(self, trainer, pl_module, exception):
            if self.callback is not None:
                self.callback.on_exception(exception)
                self.callback.close()

        def teardown(self, trainer, pl_module, stage=None):
            if self.callback is not None and stage in (None, "fit"):
                self.callback.close()

    return NasdiagRecorder


def _rebuild(path, meta, statistics, epoch_statistics, callback_kwargs):
    return _adapter_class(_lightning_callback_base())(path, meta, statistics, epoch_statistics, callback_kwargs)


def lightning_callback(path, *, meta=None, statistics=None, epoch_statistics=None, **callback_kwargs):
    """A Lightning ``Callback`` that records to ``path`` (rank 0 writes, statistics reduced under DDP).

    ``statistics(trainer, pl_module, outputs) -> {record path: value}`` gives each training batch's
    statistics; by default ``pl_module.nasdiag_statistics()`` or ``outputs["nasdiag"]``. The row's
    step is ``trainer.global_step`` after the batch's optimizer step: the batches of one step under gradient
    accumulation (``accumulate_grad_batches``, or a manual loop stepping every few batches) share the row of the
    step they accumulate into, later values winning. ``epoch_statistics(trainer, pl_module)``, if given, adds to
    the last row of each epoch. ``callback_kwargs`` go to `RecorderCallback` (``reduce``, ``rules``)
    and `Recorder` (``flush_every``, ``resume``, ``overwrite``). Teardown closes the record; another fit with the
    same callback continues it (``resume=True``); ``trainer.validate``, ``test`` and ``predict`` leave the record alone. Raises `RecordError` if neither
    ``lightning`` nor ``pytorch_lightning`` is installed, or if the installed one fails to import.
    """
    base = _lightning_callback_base()
    return _adapter_class(base)(path, meta, statistics or _statistics_from_module, epoch_statistics, callback_kwargs)
