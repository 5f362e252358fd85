"""The curvature modes, spelled once. Everything that offers or validates a mode (``diag_hessian``,
``arch_diag_hessian``, the probe, the search config and CLI) reads these tuples; docs/hessian.md says
what each computes, what it drops and what it costs (measured).
"""

from __future__ import annotations

from nasdiag.errors import NasdiagError

__all__ = ["WEIGHT_MODES", "ARCH_MODES", "CurvatureError", "check_mode"]

#: modes of ``diag_hessian`` (weights): bayesnas-appendix C.1-C.2
WEIGHT_MODES = ("exact", "diag", "approx")

#: modes of ``arch_diag_hessian`` (mixing weights Z or α): exact by HVPs, the exact block per edge
#: summed by the caller over cells that share α, the generalized Gauss-Newton diagonal (exact over the
#: classes, or one Monte-Carlo draw), and the BayesNAS recursions C.3.1 / C.3.2
ARCH_MODES = ("exact", "exact_per_edge", "ggn", "ggn_mc", "diag", "approx")


class CurvatureError(NasdiagError, ValueError):
    """A curvature mode that does not exist or cannot apply here (too large, wrong loss, shared α ...)."""


def check_mode(mode, modes=ARCH_MODES, what: str = "mode") -> str:
    """``mode`` if it is one of ``modes``, else a one-line :class:`CurvatureError` listing them."""
    if mode not in modes:
        raise CurvatureError(f"unknown curvature {what} {mode!r}; choose one of {', '.join(modes)}")
    return mode
