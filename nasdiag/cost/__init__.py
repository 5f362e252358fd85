"""Cost assignment of the wiring paper on bare tensors (``../shared/papers/wiring-evolution-supplement.txt``).

C(Z_ij^k) = ∂L/∂Z_ij^k = <∂L/∂x_j, O_ij^k(x_i)> is computed once and mapped to each method's
architecture gradient. This layer never imports the probe, search methods, recorder or CLI.
"""

from nasdiag.cost.errors import CostError
from nasdiag.cost.assignment import edge_costs, output_edge_costs, scatter_cells
from nasdiag.cost.credit import (
    darts_alpha_grad,
    dsnas_alpha_grad,
    proxyless_alpha_grad,
    snas_alpha_grad,
    softmax_jacobian,
)
from nasdiag.cost.scale_invariance import (
    HOMOGENEITY_RULES,
    Homogeneity,
    UnsupportedModuleError,
    analyse,
    compose,
    degree_rule,
    delegate_rule,
    eps_deviation,
    input_ranks_of,
    is_scale_invariant,
    register_homogeneity_rule,
    sequential_rule,
)
from nasdiag.cost.streaming import CostMoments
from nasdiag.cost.theory import loss_minus_entropy

__all__ = [
    "CostError",
    "CostMoments",
    "HOMOGENEITY_RULES",
    "Homogeneity",
    "UnsupportedModuleError",
    "analyse",
    "compose",
    "darts_alpha_grad",
    "degree_rule",
    "delegate_rule",
    "dsnas_alpha_grad",
    "edge_costs",
    "eps_deviation",
    "input_ranks_of",
    "is_scale_invariant",
    "loss_minus_entropy",
    "output_edge_costs",
    "proxyless_alpha_grad",
    "register_homogeneity_rule",
    "scatter_cells",
    "sequential_rule",
    "snas_alpha_grad",
    "softmax_jacobian",
]
