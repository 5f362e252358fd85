"""The one exception and the one warning class of `nasdiag.record`.

Every user-facing failure of the recorder (bad input, an existing record, a live writer holding the
lock, a full disk, a read-only location) raises `RecordError` with a one-line message that says what
was wrong and how to fix it, so that a CLI can print it as is.
"""


from nasdiag.errors import NasdiagError


class RecordError(NasdiagError):
    """A record could not be written or read; the message says why and what to do."""


class RecordWarning(UserWarning):
    """Something was recorded but deserves attention (NaN/inf values, a mismatching resume)."""
