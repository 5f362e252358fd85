"""Arguments of the batch scripts, refused as ``nasdiag`` refuses its own: one line on stderr and exit code 2
(through `nasdiag.errors.run_script`), before any run starts.

argparse printed its usage and the error on two lines, and took any integer: ``--batch-size 0`` ended in a
ZeroDivisionError traceback, ``--seeds 0`` in a ValueError from ``max()``, ``--epochs -1`` drew the figures of
a run that never trained and exited 0, ``--dpi 5`` in FreeType's "invalid ppem value" traceback.
"""

from __future__ import annotations

import argparse
from typing import Callable

from nasdiag.errors import NasdiagError


class UsageError(NasdiagError):
    """A batch script's argument is invalid."""


class Parser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one `UsageError` line naming the script's ``--help``."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``low`` (counts of epochs, seeds, batches, samples)."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a whole number, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    whole_number.__name__ = f"whole number >= {low}"
    return whole_number


def dpi(text: str) -> int:
    """An argparse ``type``: a resolution the figures' smallest text renders at (``nasdiag plot --dpi``'s range)."""
    from nasdiag.plot.commands import positive_dpi

    return positive_dpi(text)
