"""Errors of ``nasdiag.cost``: bad input to the cost primitives, one line each (also a ``ValueError``, the
type these checks raised before). ``UnsupportedModuleError`` (no homogeneity rule) lives in ``nasdiag.rules``."""

import torch

from nasdiag.errors import NasdiagError


class CostError(NasdiagError, ValueError):
    """Mismatched shapes, an empty edge, a bad temperature; the message says how to fix it."""


def require_tensors(where: str, **named) -> None:
    """A CostError naming the first argument that is not a tensor (a list of labels, a float): one line, not the
    AttributeError of its first ``.dim()`` / ``.shape``."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise CostError(f"{where}: {name} must be a torch.Tensor, got {type(value).__name__}; wrap it in torch.tensor(...)")
