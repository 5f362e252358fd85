"""A reference DARTS search space written for diagnostics.

``MixedOp`` takes its mixing weights as an argument, so one supernet serves every method;
architecture parameters are ``nn.Parameter`` s kept apart from the weights.
"""

from nasdiag.supernet.cell import Cell, edge_nodes
from nasdiag.supernet.genotype import (
    Genotype,
    MixedGenotype,
    derive_cell,
    derive_genotype,
    derive_mixed_cell,
    derive_mixed_genotype,
)
from nasdiag.supernet.mixed import MixedOp
from nasdiag.supernet.network import EdgeSpec, Network
from nasdiag.supernet.norm import NORM_KINDS, make_norm
from nasdiag.supernet.ops import DARTS_PRIMITIVES, OPS, ORDERS, FactorizedReduce, OpConfig, Zero, register_op

__all__ = [
    "Cell",
    "DARTS_PRIMITIVES",
    "EdgeSpec",
    "FactorizedReduce",
    "Genotype",
    "MixedGenotype",
    "MixedOp",
    "NORM_KINDS",
    "Network",
    "OPS",
    "ORDERS",
    "OpConfig",
    "Zero",
    "derive_cell",
    "derive_genotype",
    "derive_mixed_cell",
    "derive_mixed_genotype",
    "edge_nodes",
    "make_norm",
    "register_op",
]
