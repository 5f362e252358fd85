"""Search methods built on the supernet and the primitives; one module per method.

- `SearchMethod`, `Schedule`, `Hyperparameters`, `hp`: the method contract (``docs/methods.md``).
- `register`, `get_method`, `methods`: the registry; built-ins live in ``nasdiag/search/methods/``.
- `SearchConfig`, `run`, `SearchResult`: a whole search (data, device, DDP, probe, record, checkpoint).
"""

from nasdiag.search.base import Batch, CostStep, Schedule, SearchError, SearchMethod, accuracy
from nasdiag.search.hyperparameters import Hyperparameters, hp
from nasdiag.search.registry import get_method, methods, register

__all__ = [
    "Batch", "CostStep", "Hyperparameters", "Schedule", "SearchError", "SearchMethod", "accuracy", "get_method", "hp",
    "methods", "register",
]
