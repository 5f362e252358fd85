"""What a search method needs from a supernet, and adapters for supernets nasdiag did not build.

A method talks to ``method.network`` through this interface (nasdiag's
:class:`~nasdiag.supernet.Network` offers it natively):

- ``cell_types`` (list of str), ``cells`` (each with ``.cell_type``), ``steps``, ``multiplier``,
  ``primitives``, ``num_edges``;
- ``alphas()`` → ``{cell type: nn.Parameter (E, K)}``, ``arch_parameters()``, ``weight_parameters()``;
- ``forward(x, weights, active=None)`` with ``weights`` a ``{cell type: (E, K)}`` mapping or one
  (E, K) tensor per cell, and ``active`` an optional ``{cell type: (E, K) bool}`` of ops to compute;
- ``edge_specs()``.
"""

from __future__ import annotations

from torch import nn

from nasdiag.errors import ConfigError
from nasdiag.supernet import Network


def as_supernet(model: nn.Module):
    """``model`` itself if it offers the interface above, else an adapter around it."""
    if isinstance(model, Network):
        return model
    required = ("cell_types", "cells", "alphas", "arch_parameters", "weight_parameters", "edge_specs")
    if all(hasattr(model, a) for a in required):
        return model
    raise ConfigError(
        f"{type(model).__name__} does not offer the supernet interface of nasdiag.search.supernet "
        "(cell_types, cells, alphas(), forward(x, weights)); wrap it with nasdiag.search.supernet.adapt(model)"
    )
