"""The curvature modes, spelled once. Everything that offers or validates a mode (``diag_hessian``,
``arch_diag_hessian``, the probe, the search config and CLI) reads these tuples; docs/hessian.md says
what each computes, what it drops and what it costs (measured).

A mode with a count carries it in its name: ``"hutchinson:<k>"`` is Hutchinson's diagonal from k
Hessian-vector products, spelled ``"hutchinson:4"`` (any k ≥ 1). There is no default k: the count
decides the cost (k products) and the noise (∝ 1/√k), so the caller states it, and a record's
``hessian_mode`` says which k it used. The tuples list the placeholder ``"hutchinson:<k>"``; their
``in`` accepts every concrete spelling, so the probe, the search config and the CLI accept it too.
"""

from __future__ import annotations

import numbers
import re
from typing import Optional, Tuple

from nasdiag.errors import NasdiagError

__all__ = [
    "WEIGHT_MODES", "ARCH_MODES", "COUNTED_MODES", "GRAPHABLE_MODES", "CurvatureError", "CurvatureTypeError",
    "CurvatureRuntimeError", "ModeNames", "check_mode", "check_seed", "split_mode",
]

#: modes whose name carries a count, ``"<name>:<count>"``, and what the count is
COUNTED_MODES = {"hutchinson": "k, the number of Hessian-vector products"}

_COUNTED = re.compile(r"^([a-z_]+):([0-9]+)$")


class ModeNames(tuple):
    """A tuple of mode names whose ``in`` also accepts ``"<name>:<k>"`` (k ≥ 1) for the counted modes
    it lists as ``"<name>:<k>"``; the placeholder itself and ``"<name>"`` without k are not modes."""

    def __contains__(self, mode) -> bool:
        if not isinstance(mode, str):
            return False
        name, count = split_mode(mode)
        if count is None:
            return name not in COUNTED_MODES and ":" not in name and tuple.__contains__(self, name)
        # one spelling per k ("hutchinson:01" is not "hutchinson:1"), so a record's hessian_mode compares as equal
        return count >= 1 and mode == f"{name}:{count}" and tuple.__contains__(self, f"{name}:<k>")


#: modes of ``diag_hessian`` (weights): bayesnas-appendix C.1-C.2, and Hutchinson's estimate of the
#: exact diagonal from k Hessian-vector products
WEIGHT_MODES = ModeNames(("exact", "hutchinson:<k>", "diag", "approx"))

#: modes of ``arch_diag_hessian`` (mixing weights Z or α): exact by HVPs, the exact block per edge
#: summed by the caller over cells that share α, the generalized Gauss-Newton diagonal (exact over the
#: classes, or one Monte-Carlo draw), Hutchinson's diagonal from k HVPs with the GGN as control
#: variate, and the BayesNAS recursions C.3.1 / C.3.2
ARCH_MODES = ModeNames(("exact", "exact_per_edge", "ggn", "ggn_mc", "hutchinson:<k>", "diag", "approx"))


#: modes whose computation is a fixed sequence of device kernels (no host synchronisation, no random numbers),
#: so that :mod:`nasdiag.hessian.graphed` can capture it once as a CUDA graph and replay it: the recursions
#: C.1-C.3. The others read values on the host (``ggn``: an eigendecomposition check; ``exact``: chunking
#: decisions) or draw random probes.
GRAPHABLE_MODES = ("diag", "approx")


class CurvatureError(NasdiagError, ValueError):
    """Bad input to the curvature functions: a mode that does not exist or cannot apply here (too large, wrong
    loss, shared α ...), an unknown parameter, a loss that is not a scalar, edges that never ran. The one line
    says what was wrong and how to fix it. Also a ``ValueError`` (what these checks raised before), and the
    base of the two below, so ``except CurvatureError`` catches every refusal of ``nasdiag.hessian``."""


class CurvatureTypeError(CurvatureError, TypeError):
    """An argument of the wrong type (params given as a string, a model returning a tuple, a rule that is not
    a ``HessianRule``); also the ``TypeError`` it was before."""


class CurvatureRuntimeError(CurvatureError, RuntimeError):
    """A mode that cannot run on this model as called (an input modified in place after its module ran, out of
    memory at one product at a time); also the ``RuntimeError`` it was before."""


def no_weights_refusal(name: str, got: object) -> str:
    """The line for a mixed op called without a tensor of mixing weights as its second argument (``got``: what it
    received there, None for nothing): called with x alone, or with an object holding them (NASLib's ``edge_data``)."""
    what = "without mixing weights" if got is None else f"with a {type(got).__name__} object as its second argument, not a tensor of mixing weights"
    return (f"edge {name!r}: the mixed op was called {what} (expected forward(x, weights) with the weights tensor as the "
            "second argument, positional or by its name); list mixed ops, not candidate ops, as edges, and give a mixed op "
            "that computes its weights inside its forward (a softmax of an α it holds or reads from an argument) a "
            "forward(x, weights)")


def split_mode(mode: str) -> Tuple[str, Optional[int]]:
    """``("hutchinson", 4)`` for ``"hutchinson:4"``; ``(mode, None)`` for a name without a count."""
    m = _COUNTED.match(mode)
    if m is None:
        return mode, None
    return m.group(1), int(m.group(2))


def check_mode(mode, modes=ARCH_MODES, what: str = "mode") -> str:
    """``mode`` if it is one of ``modes``, else a one-line :class:`CurvatureError` listing them (and, for
    a counted mode given without its count, saying how to give it; for a near miss such as ``"Exact"`` or
    ``"ggn-mc"``, naming the mode meant; for a mixing-weight mode given to ``diag_hessian``, saying so)."""
    if mode in modes:
        return mode
    if isinstance(mode, str):
        name = mode.split(":", 1)[0]  # "hutchinson", "hutchinson:0", "hutchinson:-2", "hutchinson:four"
        canonical = _canonical_count(mode)
        if canonical is not None and canonical in modes:
            raise CurvatureError(f"unknown curvature {what} {mode!r}; did you mean {canonical!r}? (k is written without leading zeros or spaces)")
        if name in COUNTED_MODES and f"{name}:<k>" in tuple(modes):
            raise CurvatureError(
                f"curvature {what} {mode!r} needs {COUNTED_MODES[name]} (an integer >= 1) in its name, e.g. "
                f"{name}:4 (docs/hessian.md tabulates k = 1, 4, 16)"
            )
        if modes is WEIGHT_MODES and mode in ARCH_MODES:
            raise CurvatureError(
                f"curvature {what} {mode!r} is a mode of the mixing weights (arch_diag_hessian), not of the weights "
                f"(diag_hessian); choose one of {', '.join(modes)}"
            )
        meant = _near_miss(mode, modes)
        if meant is not None:
            raise CurvatureError(f"unknown curvature {what} {mode!r}; did you mean {meant!r}? (modes: {', '.join(modes)})")
    raise CurvatureError(f"unknown curvature {what} {mode!r}; choose one of {', '.join(modes)}")


def check_seed(seed, seeds: str) -> int:
    """``seed`` as an int, else one line: a float (1.5 was truncated to 1), bool or other type is a
    :class:`CurvatureTypeError`; an int outside what torch's generator takes (``-2**63 .. 2**64 - 1``; beyond, its
    ``manual_seed`` raised a bare "Overflow when unpacking long long") a :class:`CurvatureError`."""
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise CurvatureTypeError(f"seed must be an int (it seeds {seeds}), got {seed!r}")
    if not -2**63 <= int(seed) <= 2**64 - 1:
        raise CurvatureError(f"seed must be an int from -2**63 to 2**64 - 1 (torch's generator takes no other; it seeds "
                             f"{seeds}), got {seed!r}")
    return int(seed)


def _canonical_count(mode: str) -> Optional[str]:
    """``"hutchinson:1"`` for ``"hutchinson:01"`` or ``" hutchinson: 1"``; None where ``mode`` carries no count."""
    name, _, count = mode.partition(":")
    if not count.strip().isdecimal():  # isdigit() also takes "²", which int() refuses (a ValueError traceback)
        return None
    return f"{name.strip().lower()}:{int(count)}"


def _near_miss(mode: str, modes) -> Optional[str]:
    """The mode that ``mode`` spells in another case, with ``-`` or spaces for ``_``, or by a prefix
    (``"exac"``, ``"approximate"``); None if there is none."""
    folded = mode.strip().lower().replace("-", "_").replace(" ", "_")
    if folded in modes:
        return folded  # also "hutchinson:4" from "Hutchinson:4"
    names = [m for m in modes if "<" not in m]
    longer = sorted((m for m in names if len(folded) >= 3 and m.startswith(folded)), key=len)
    if longer:
        return longer[0]
    shorter = sorted((m for m in names if len(m) >= 4 and folded.startswith(m)), key=len, reverse=True)
    return shorter[0] if shorter else None
