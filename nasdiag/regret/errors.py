"""Errors of ``nasdiag.regret``: bad input to the XNAS forecasters and statistics, one line each.

Each also derives from the builtin type the check raised before (``ValueError``, ``TypeError``, and
``RuntimeError`` for a forecaster past its horizon), so existing ``except`` clauses keep working.
"""

from nasdiag.errors import NasdiagError


class RegretError(NasdiagError, ValueError):
    """A bad value (shape, range, a non-finite reward of an alive expert); the message says how to fix it."""


class RegretTypeError(RegretError, TypeError):
    """An argument of the wrong type (an integer tensor, a float horizon)."""


class HorizonError(RegretError, RuntimeError):
    """A :class:`~nasdiag.regret.Forecaster` updated after its horizon T (its thresholds depend on T - t)."""
