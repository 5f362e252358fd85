"""Expert/regret statistics of XNAS (Nayman et al. 2019): each edge is a forecaster over its ops.

Pure tensor mathematics (a primitive layer): nothing here imports the probe, the search methods,
the recorder or the CLI.
"""

from nasdiag.regret.depth import cell_depth
from nasdiag.regret.errors import HorizonError, RegretError, RegretTypeError
from nasdiag.regret.entropy import mean_normalized_entropy, normalized_entropy
from nasdiag.regret.forecaster import Forecaster, SoftmaxGD, Wipeout, WipeoutLog
from nasdiag.regret.rewards import gd_softmax_reward, rewards_from_gradient, xnas_reward
from nasdiag.regret.statistical import GaussianExpertsOutcome, default_loss_bound, simulate_gaussian_experts

__all__ = [
    "Forecaster",
    "GaussianExpertsOutcome",
    "HorizonError",
    "RegretError",
    "RegretTypeError",
    "SoftmaxGD",
    "Wipeout",
    "WipeoutLog",
    "cell_depth",
    "default_loss_bound",
    "gd_softmax_reward",
    "mean_normalized_entropy",
    "normalized_entropy",
    "rewards_from_gradient",
    "simulate_gaussian_experts",
    "xnas_reward",
]
