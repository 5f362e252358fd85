"""The one exception and the one warning class of `nasdiag.record`.

Every user-facing failure of the recorder (bad input, an existing record, a live writer holding the
lock, a full disk, a read-only location) raises `RecordError` with a one-line message that says what
was wrong and how to fix it, so that a CLI can print it as is.
"""


from nasdiag.errors import NasdiagError


class RecordError(NasdiagError):
    """A record could not be written or read; the message says why and what to do."""


class ResumeMismatchError(RecordError):
    """A resume was refused because the record holds another run or another search space.

    ``differences`` maps each differing meta key (``method``, ``config``, ``seed``, ``op_names``,
    ``edge_names``, ``cell_types``) to ``(stored value, given value)``.
    """

    def __init__(self, message: str, differences: dict):
        super().__init__(message)
        self.differences = dict(differences)


class DamagedRecordError(RecordError):
    """A record's rows fail their checks. ``path``, ``where`` (file and first bad row), ``reason`` and
    ``intact_rows`` (the rows before it, which ``load(path, salvage=True)`` returns) let a caller, such as
    the CLI, phrase its own advice."""

    def __init__(self, message: str, path: str, where: str, reason: str, intact_rows: int):
        super().__init__(message)
        self.path, self.where, self.reason, self.intact_rows = path, where, reason, int(intact_rows)


class RecordWarning(UserWarning):
    """Something was recorded but deserves attention (NaN/inf values, a mismatching resume)."""
