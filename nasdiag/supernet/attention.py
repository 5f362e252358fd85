"""The architecture self-attention module of ASM-NAS (asm-nas §4.1-4.2) and the mixed op that carries it.

On each edge (i, j) the K candidate outputs y^k = o^k(x_i) are embedded by their mean (eq 4.3),
e^k = mean over (C, H, W) of y^k, per sample; the embedding vector E = [e^1..e^K] goes through
4 fully-connected layers with ReLU between them and a sigmoid after the last (eq 4.4),
z = σ(Θ4 δ(Θ3 δ(Θ2 δ(Θ1 E)))), and the attention is a = softmax(z) (eq 4.5). The edge outputs
Σ_k a^k y^k (eq 4.2). a depends on the sample, so it is (B, K).

Θ are network weights (they are in ``weight_parameters()``, never in ``arch_parameters()``).

:class:`AttentionMixedOp` is a :class:`~nasdiag.supernet.mixed.MixedOp` (the same candidate op modules, so
parameter names of the ops and the probe's discovery are unchanged) whose ``forward(x, None)`` mixes by
attention; given explicit weights ((K,) or (B, K)) it is the plain mixed op (one op fixed after selection,
or the cost leaves of ``SearchMethod.cost``). :func:`attach_attention` swaps the mixed ops of a nasdiag
``Network`` in place; :func:`collect_attention` exposes each forward's a per cell and edge.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence

import torch
from torch import nn

from nasdiag.supernet.mixed import ActiveOps, MixedOp


class ArchitectureAttention(nn.Module):
    """a = softmax(σ(Θ4 δ(Θ3 δ(Θ2 δ(Θ1 E))))) of an embedding E (eq 4.4-4.5).

    Args:
        K: candidate ops of the edge (input and output width).
        hidden: widths of the three hidden layers (the paper does not give them; nasdiag's default
            is 2K each, see ``nasdiag.search.methods.asmnas``).

    Shapes: E (B, K) -> a (B, K), each row on the simplex.
    """

    def __init__(self, K: int, hidden: Sequence[int]):
        super().__init__()
        if len(hidden) != 3 or any(int(h) < 1 for h in hidden):
            raise ValueError(f"the attention module has 4 fully-connected layers: give 3 positive hidden widths, got {list(hidden)}")
        widths = [K, *[int(h) for h in hidden], K]
        layers: List[nn.Module] = []
        for n, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(nn.Linear(a, b))
            layers.append(nn.ReLU() if n < 3 else nn.Sigmoid())
        self.net = nn.Sequential(*layers)

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.net(embedding), dim=-1)


def mean_embedding(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """e^k = (1/(H·W·C)) Σ y^k[l, m, n] (eq 4.3) per sample: K tensors (B, C, H, W) -> (B, K)."""
    return torch.stack([y.flatten(1).mean(1) for y in outputs], dim=-1)


class AttentionMixedOp(MixedOp):
    """A mixed op whose weights are its own attention a(x) when none are given (eq 4.2).

    Built from an existing :class:`MixedOp` (its candidate op modules are reused, not copied).
    """

    def __init__(self, mixed: MixedOp, hidden: Sequence[int]):
        nn.Module.__init__(self)
        self.primitives = list(mixed.primitives)
        self.stride = mixed.stride
        self.ops = mixed.ops
        self.attention = ArchitectureAttention(len(self.ops), hidden)
        self._tap: Optional[tuple] = None  # (store, cell, edge) while collect_attention is active

    def forward(self, x: torch.Tensor, weights: Optional[torch.Tensor] = None,
                active: Optional[ActiveOps] = None) -> torch.Tensor:
        """Args:
            x: (B, C, H, W).
            weights: None: mix by the attention a(x) (B, K) of eq 4.5; (K,) or (B, K): the plain mixed op.
            active: only with explicit weights (the attention needs every candidate's output).

        Returns:
            (B, C, H/stride, W/stride).
        """
        if weights is not None:
            return super().forward(x, weights, active)
        if active is not None:
            raise ValueError("attention mixing embeds every candidate's output; pass explicit weights to compute a subset of ops")
        outputs = [op(x) for op in self.ops]
        a = self.attention(mean_embedding(outputs))
        if self._tap is not None:
            store, cell, edge = self._tap
            if a.requires_grad:
                a.retain_grad()  # ∂L/∂a after backward: the cost of the attention coefficients
            store[cell][edge] = a
        shape = (a.shape[0],) + (1,) * (x.dim() - 1)
        return sum(a[:, k].reshape(shape) * y for k, y in enumerate(outputs))

    def extra_repr(self) -> str:
        return f"stride={self.stride}, primitives={self.primitives}, attention"


def attach_attention(network: nn.Module, hidden: Sequence[int]) -> List[List[AttentionMixedOp]]:
    """Replace every mixed op of ``network.cells[k].edges`` by an :class:`AttentionMixedOp` (idempotent: attention
    modules already there, of the same widths, are kept with their weights).

    The new attention modules get the device and dtype of the network's parameters. Returns the
    attention mixed ops as ``[cell][edge]``.

    Raises:
        ValueError: the network has no nasdiag cells with mixed-op edges, or already carries attention modules of
            other hidden widths (they were kept and the widths asked for silently ignored); nothing is replaced then.
    """
    cells = getattr(network, "cells", None)
    if cells is None or not all(isinstance(getattr(c, "edges", None), nn.ModuleList) for c in cells):
        raise ValueError(f"{type(network).__name__} has no nasdiag cells (cells[k].edges of mixed ops) to attach attention to")
    want = tuple(int(h) for h in hidden)
    for k, cell in enumerate(cells):  # every edge checked before any is replaced
        for e, mixed in enumerate(cell.edges):
            if not isinstance(mixed, MixedOp):
                raise ValueError(f"edge {e} of a cell is a {type(mixed).__name__}, not a MixedOp")
            have = want if not isinstance(mixed, AttentionMixedOp) else tuple(
                m.out_features for m in mixed.attention.modules() if isinstance(m, nn.Linear))[:3]
            if have != want:
                raise ValueError(f"the network already carries attention modules of hidden widths {list(have)} (cell {k}, "
                                 f"edge {e}), not the {list(want)} asked for; build on a fresh supernet, or ask for "
                                 f"{list(have)}")
    p = next(network.parameters())
    out = []
    for cell in cells:
        row = []
        for e, mixed in enumerate(cell.edges):
            if not isinstance(mixed, AttentionMixedOp):
                mixed = AttentionMixedOp(mixed, hidden).to(device=p.device, dtype=p.dtype)
                cell.edges[e] = mixed
            row.append(mixed)
        out.append(row)
    return out


def attention_weights(network: nn.Module) -> List[List[None]]:
    """Per-cell mixing weights for ``Network.forward`` that select attention mixing on every edge."""
    return [[None] * len(cell.edges) for cell in network.cells]


@contextmanager
def collect_attention(network: nn.Module) -> Iterator[List[List[Optional[torch.Tensor]]]]:
    """Within the block, every attention forward stores its a (B, K) into ``store[cell][edge]`` (the last
    forward's; with grad enabled a retains its gradient, so after ``backward`` ``a.grad`` = ∂L/∂a).
    The taps are removed on exit (also on error)."""
    store: List[List[Optional[torch.Tensor]]] = [[None] * len(cell.edges) for cell in network.cells]
    mods = [(k, e, m) for k, cell in enumerate(network.cells) for e, m in enumerate(cell.edges)
            if isinstance(m, AttentionMixedOp)]
    try:
        for k, e, m in mods:
            m._tap = (store, k, e)
        yield store
    finally:
        for _, _, m in mods:
            m._tap = None
