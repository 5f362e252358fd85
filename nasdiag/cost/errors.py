"""Errors of ``nasdiag.cost``: bad input to the cost primitives, one line each (also a ``ValueError``, the
type these checks raised before). ``UnsupportedModuleError`` (no homogeneity rule) lives in ``nasdiag.rules``."""

from nasdiag.errors import NasdiagError


class CostError(NasdiagError, ValueError):
    """Mismatched shapes, an empty edge, a bad temperature; the message says how to fix it."""
