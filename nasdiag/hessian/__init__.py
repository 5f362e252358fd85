"""Second-order diagnostics: diagonal Hessians of weights and of architecture (mixing) weights.

* :func:`diag_hessian` — weights, modes ``exact`` / ``diag`` / ``approx`` (bayesnas-appendix §C.1-C.2).
* :func:`arch_diag_hessian` — mixing weights Z (or α) per edge, C.3.1-C.3.2, the GGN modes, Hutchinson
  (``"hutchinson:<k>"``, GGN control variate) and ``exact`` by HVPs (modes: :data:`ARCH_MODES`, spelled once in :mod:`nasdiag.hessian.modes`).
* :func:`alpha_diag_hessian` — the exact diagonal w.r.t. α shared by several cells;
  :func:`shared_weights_diag_hessian` — the same w.r.t. mixing weights Z shared by several cells.
* :func:`register_rule` — teach the recursions a new module type.
* :func:`hessian_eigenvalues`, :func:`hutchinson_trace`, :func:`hutchinson_diagonal`,
  :class:`EigenvalueEarlyStop` — spectrum of the α-Hessian and RobustDARTS's early stop (spectrum.py).
"""

from nasdiag.hessian.arch import arch_diag_hessian
from nasdiag.hessian.arch_exact import exact_arch_diag_hessian
from nasdiag.hessian.arch_shared import alpha_diag_hessian, shared_weights_diag_hessian
from nasdiag.hessian.modes import ARCH_MODES, WEIGHT_MODES, CurvatureError, CurvatureRuntimeError, CurvatureTypeError
from nasdiag.hessian.rules import (
    ElementwiseRule,
    HessianRule,
    ModuleCall,
    NormRule,
    UnsupportedModuleError,
    register_rule,
    supported_modules,
)
from nasdiag.hessian.spectrum import (
    EarlyStopDecision,
    EigenvalueEarlyStop,
    HutchinsonEstimate,
    NonFiniteHessianError,
    SpectrumResult,
    diagonal_from_hvp,
    eigenvalues_from_hvp,
    hessian_eigenvalues,
    hutchinson_diagonal,
    hutchinson_trace,
    loss_hvp,
    trace_from_hvp,
)
from nasdiag.hessian.weights import HESSIAN_MODES, diag_hessian

__all__ = [
    "ARCH_MODES",
    "WEIGHT_MODES",
    "CurvatureError",
    "CurvatureRuntimeError",
    "CurvatureTypeError",
    "alpha_diag_hessian",
    "shared_weights_diag_hessian",
    "EarlyStopDecision",
    "EigenvalueEarlyStop",
    "HutchinsonEstimate",
    "NonFiniteHessianError",
    "SpectrumResult",
    "diagonal_from_hvp",
    "eigenvalues_from_hvp",
    "hessian_eigenvalues",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "loss_hvp",
    "trace_from_hvp",
    "ElementwiseRule",
    "HESSIAN_MODES",
    "HessianRule",
    "ModuleCall",
    "NormRule",
    "UnsupportedModuleError",
    "arch_diag_hessian",
    "diag_hessian",
    "exact_arch_diag_hessian",
    "register_rule",
    "supported_modules",
]
