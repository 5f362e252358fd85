"""The base class of every error nasdiag raises on purpose.

A `NasdiagError` means the user asked for something that cannot be done; its message is one line that
says what was wrong and how to fix it, so that the CLI can print it as is and exit with code 2.
Subpackages derive their own errors from it (``RecordError``, ``DataError``, ``PlotError``,
``UnsupportedModuleError``, ``ConfigError``, ...).
"""


class NasdiagError(Exception):
    """A user-facing error with a one-line, actionable message."""


class ConfigError(NasdiagError, ValueError):
    """A search configuration or hyperparameter is invalid (unknown key, wrong type, out of range)."""
