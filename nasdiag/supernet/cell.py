"""A DARTS cell: a DAG of mixed ops between two input nodes and ``steps`` intermediate nodes."""

from __future__ import annotations

import numbers
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from nasdiag.supernet.mixed import MixedOp
from nasdiag.supernet.ops import FactorizedReduce, OpConfig, relu_conv_bn


def edge_nodes(steps: int) -> List[Tuple[int, int]]:
    """(i, j) node pairs of the edges in the DARTS order: node j = 2, 3, ... receives an edge from
    every earlier node i (0 and 1 are the cell inputs). ``len == Σ_{s<steps} (2 + s)``."""
    return [(i, j + 2) for j in range(steps) for i in range(j + 2)]


class Cell(nn.Module):
    """A cell with inputs s0 (output of cell k-2) and s1 (output of cell k-1).

    Node j = Σ_{i<j} MixedOp_ij(node i, Z_ij); the output is the channel concatenation of the last
    ``multiplier`` intermediate nodes, so intermediate node n occupies channels
    ``output_node_slices[n]`` of the output (the wiring paper's *output edges*).

    Attributes:
        cell_type: ``"reduce"`` or ``"normal"``.
        edges: ``nn.ModuleList`` of :class:`MixedOp`, one per edge, in :func:`edge_nodes` order.
        edge_nodes: list of (i, j) node pairs, aligned with ``edges``.
        output_nodes: intermediate nodes concatenated into the output.
        output_node_slices: node -> (start, stop) channel range in the output.
    """

    def __init__(
        self,
        steps: int,
        multiplier: int,
        C_prev_prev: int,
        C_prev: int,
        C: int,
        reduction: bool,
        reduction_prev: bool,
        primitives: Sequence[str],
        cfg: OpConfig,
    ):
        super().__init__()
        # steps = 0 was "multiplier must be in [1, steps=0]" for any multiplier, a float steps range()'s TypeError
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(f"steps (intermediate nodes per cell) must be an integer >= 1, got {steps!r}")
        if isinstance(multiplier, bool) or not isinstance(multiplier, numbers.Integral) or not 1 <= multiplier <= steps:
            raise ValueError(f"multiplier must be an integer in [1, steps={steps}], got {multiplier!r}")
        steps, multiplier = int(steps), int(multiplier)
        self.reduction = reduction
        self.cell_type = "reduce" if reduction else "normal"
        self.steps = steps
        self.multiplier = multiplier
        self.C = C
        if reduction_prev:
            self.preprocess0 = FactorizedReduce(C_prev_prev, C, cfg)
        else:
            self.preprocess0 = relu_conv_bn(C_prev_prev, C, 1, 1, 0, cfg)
        self.preprocess1 = relu_conv_bn(C_prev, C, 1, 1, 0, cfg)
        self.edge_nodes = edge_nodes(steps)
        self.edges = nn.ModuleList(
            MixedOp(C, 2 if reduction and i < 2 else 1, primitives, cfg) for i, _ in self.edge_nodes
        )
        self.output_nodes = list(range(2 + steps - multiplier, 2 + steps))
        self.output_node_slices: Dict[int, Tuple[int, int]] = {
            node: (n * C, (n + 1) * C) for n, node in enumerate(self.output_nodes)
        }

    def forward(self, s0: torch.Tensor, s1: torch.Tensor, weights: torch.Tensor | Sequence[torch.Tensor],
                active: Optional[Sequence] = None) -> torch.Tensor:
        """Args:
            s0, s1: (B, C_prev_prev, H', W') and (B, C_prev, H, W).
            weights: (E, K) mixing weights, or (E, B, K) per sample, or a sequence of E tensors.
            active: optional (E, K) bool mask (CPU tensor or nested lists) of the ops to compute
                (``MixedOp.forward``); None computes every op.

        Returns:
            (B, multiplier * C, H/r, W/r) with r = 2 for reduction cells.
        """
        if len(weights) != len(self.edges):
            raise ValueError(f"cell has {len(self.edges)} edges but got mixing weights for {len(weights)}")
        states = [self.preprocess0(s0), self.preprocess1(s1)]
        offset = 0
        for _ in range(self.steps):
            if active is None:
                node = sum(self.edges[offset + i](h, weights[offset + i]) for i, h in enumerate(states))
            else:
                node = sum(self.edges[offset + i](h, weights[offset + i], active[offset + i]) for i, h in enumerate(states))
            offset += len(states)
            states.append(node)
        return torch.cat(states[-self.multiplier :], dim=1)

    def extra_repr(self) -> str:
        return f"cell_type={self.cell_type}, steps={self.steps}, multiplier={self.multiplier}"
