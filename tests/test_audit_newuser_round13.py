"""Round-13 new-user audit: a researcher's own supernet and loop, following README.md and the docs only, up to the
figures: the heatmaps drawn from their own record, ``attach`` on α kept in unusual ways, attach/record cycles, and the
recorder callback used as a context manager.

References are written here from scratch in float64: Z a leaf, ∂L/∂Z by torch.autograd.grad on the same forward.
"""

import gc
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nasdiag
from nasdiag.record import RecordError, RecorderCallback, load

D = torch.float64


def test_hooks_of_a_recorder_callback_whose_with_block_ended_in_an_exception_are_refused_not_dropped(tmp_path):
    """Defect: leaving ``with RecorderCallback(...)`` by an exception (a KeyboardInterrupt in a notebook) closed its
    recorder but not the callback: later ``on_step_end`` / ``on_epoch_end`` were accepted and their rows dropped at
    flush and close without a word (after ``close()`` they are one `RecordError` line, round 10)."""
    path = tmp_path / "run.h5"
    with pytest.raises(KeyboardInterrupt):
        with RecorderCallback(path) as callback:
            for step in range(3):
                callback.on_step_end(step, {"scalars/loss": torch.tensor(float(step))})
            raise KeyboardInterrupt
    assert list(load(path)["step"]) == [0, 1, 2]  # what the block held is written
    assert callback.closed
    for hook in (lambda: callback.on_step_end(3, {"scalars/loss": 3.0}), lambda: callback.on_epoch_end(0, step=3)):
        with pytest.raises(RecordError, match="after close"):
            hook()
    callback.flush()
    callback.close()
    assert list(load(path)["step"]) == [0, 1, 2]
