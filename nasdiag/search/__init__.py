"""Search methods built on the supernet and the primitives; one module per method.

- `SearchMethod`, `Schedule`, `Hyperparameters`, `hp`: the method contract (``docs/methods.md``).
- `register`, `get_method`, `available_methods`: the registry; built-ins live in ``nasdiag/search/methods/``.
- `SearchConfig`, `run`, `SearchResult`: a whole search (data, device, DDP, record, checkpoint, resume).

Names are imported on first use, so that ``nasdiag.search.config`` (what the CLI parses into) loads
without torch.
"""

import importlib

_EXPORTS = {
    "Batch": "base", "CostStep": "base", "Schedule": "base", "SearchError": "base", "SearchMethod": "base",
    "accuracy": "base", "Hyperparameters": "hyperparameters", "hp": "hyperparameters", "get_method": "registry",
    "available_methods": "registry", "register": "registry", "SearchConfig": "config", "SearchResult": "runner", "run": "runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nasdiag.search' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
