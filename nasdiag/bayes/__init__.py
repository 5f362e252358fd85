"""The sparse-Bayesian update of BayesNAS (appendix §A) and its structured-compression variant (§B,
Algorithm 3) on bare tensors: no model, no autograd.

See :mod:`nasdiag.bayes.update` and :mod:`nasdiag.bayes.structured`.
"""

from nasdiag.bayes.structured import (
    StructuredUpdate,
    expand_groups,
    group_lasso_penalty,
    group_norms,
    structured_update,
)
from nasdiag.bayes.update import (
    ENTROPY_THRESHOLD_GAMMA,
    BayesUpdate,
    covariance,
    dependent_gamma,
    entropy,
    group_bayes_update,
    group_omega,
    group_switch,
    lasso_weights,
    omega,
    parent_matrix,
    posterior_mean,
    prune,
    sparse_bayes_update,
    switch,
)

__all__ = [
    "ENTROPY_THRESHOLD_GAMMA", "BayesUpdate", "covariance", "dependent_gamma", "entropy", "group_bayes_update", "group_omega",
    "group_switch", "lasso_weights", "omega",
    "parent_matrix", "posterior_mean", "prune", "sparse_bayes_update", "switch",
    "StructuredUpdate", "expand_groups", "group_lasso_penalty", "group_norms", "structured_update",
]
