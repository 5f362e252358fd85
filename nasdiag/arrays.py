"""Moving logged values to the host as numpy arrays, one at a time or a batch of rows at once.

Neither torch nor h5py is imported here: tensors are recognised by duck typing (``.detach``), so
the record layer and the DDP reduction can both use this module without pulling in the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def is_tensor(value) -> bool:
    """Whether ``value`` looks like a torch tensor (has ``detach`` and ``device``)."""
    return hasattr(value, "detach") and hasattr(value, "device")


def _tensor_to_numpy(tensor) -> np.ndarray:
    # resolve_neg: a view with the negative bit (z.conj().imag, the imaginary part the docs ask for) refused .numpy()
    tensor = tensor.detach().cpu().resolve_neg()
    try:
        return tensor.numpy()
    except TypeError:  # bfloat16 and friends have no numpy dtype
        return tensor.float().numpy()


def to_numpy(value) -> np.ndarray:
    """A logged value as a numpy array: Python scalars, numpy arrays and torch tensors.

    A tensor costs one device-to-host copy (and, on a GPU, one synchronisation); use
    `stack_to_numpy` to convert many rows of one path with a single copy.
    """
    if isinstance(value, np.ndarray):
        return value
    if is_tensor(value):
        return _tensor_to_numpy(value)
    return np.asarray(value)


def stack_to_numpy(values: Sequence) -> list[np.ndarray]:
    """Convert the values of one path over several rows, with one host copy for the tensors.

    Tensors of one shape, dtype and device are stacked on their device and copied to the host in one
    transfer; anything else is converted value by value (`to_numpy`). Returns one array per value,
    in order, with the shape and dtype `to_numpy` would give it.
    """
    values = list(values)
    out: list = [None] * len(values)
    groups: dict = {}
    for i, value in enumerate(values):
        if is_tensor(value):
            groups.setdefault((tuple(value.shape), value.dtype, value.device), []).append(i)
        else:
            out[i] = to_numpy(value)
    if groups:
        import torch  # a tensor was passed, so torch is already imported

        for indices in groups.values():
            if len(indices) == 1:
                out[indices[0]] = _tensor_to_numpy(values[indices[0]])
                continue
            stacked = _tensor_to_numpy(torch.stack([values[i].detach() for i in indices]))
            for row, i in enumerate(indices):
                out[i] = stacked[row, ...]  # an array also for 0-d values: stacked[row] is a numpy scalar, a float subclass
    return out
