"""Execution engines of the reference supernet: ``Network.set_engine("auto" | "fast" | "eager")``.

- ``fast``: :mod:`nasdiag.supernet.engine.fast`, the edges leaving one node computed as batched ops;
- :mod:`nasdiag.supernet.engine.graph`: a whole search step captured once as a CUDA graph and replayed;
- :mod:`nasdiag.supernet.engine.curvature`: the BayesNAS mixing-weight recursion (``diag``/``approx``) on the batched ops.
"""

from nasdiag.supernet.engine.fast import ENGINES, EngineWarning, fast_forward, plan_cell, resolve, why_not_fast

__all__ = ["ENGINES", "EngineWarning", "fast_forward", "plan_cell", "resolve", "why_not_fast"]
