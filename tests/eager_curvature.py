"""The reference for the search's mixing-weight curvature in tests: ``arch_diag_hessian`` on the per-op modules (a
deep copy of the supernet under the eager engine, whose hooks keep every forward on the modules)."""

import copy

import torch.nn.functional as F
from torch import nn

from nasdiag.hessian import arch_diag_hessian


def eager_per_edge(net, x, y, weights, mode):
    """``(edge specs of the copy, {spec name: (K,)})``: the diagonal of ∂²L/∂Z² per edge at fixed mixing ``weights``
    ({cell type: (E, K)})."""
    ref_net = copy.deepcopy(net).set_engine("eager")

    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = ref_net

        def forward(self, inp):
            return self.net(inp, weights)

    specs = ref_net.edge_specs()
    per_edge = arch_diag_hessian(Fixed(), F.cross_entropy, x, y, {f"net.{e.name}": e for e in specs}, mode=mode)
    return specs, {e.name: per_edge[f"net.{e.name}"] for e in specs}
