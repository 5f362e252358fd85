"""The reference DARTS supernet, written for diagnostics."""

from __future__ import annotations

import numbers
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from nasdiag.edges import EdgeSpec
from nasdiag.supernet.cell import Cell, edge_nodes
from nasdiag.supernet.engine import fast as _engine
from nasdiag.supernet.ops import DARTS_PRIMITIVES, OpConfig

MixingWeights = Union[None, Mapping[str, torch.Tensor], Sequence[torch.Tensor]]


class Network(nn.Module):
    """DARTS supernet: stem, ``layers`` cells (reduction cells at 1/3 and 2/3 of the depth), global
    average pooling and a linear classifier.

    Architecture parameters are ``alphas_<cell type>`` of shape (E, K), one per cell type present,
    shared by all cells of that type and kept apart from the weights: :meth:`arch_parameters` and
    :meth:`weight_parameters` partition :meth:`parameters`.

    Args:
        C: channels of the first cell (doubled at each reduction).
        num_classes: classifier outputs.
        layers: number of cells.
        steps: intermediate nodes per cell (4 in DARTS, 2 for the minimal cell).
        multiplier: intermediate nodes concatenated into a cell's output.
        in_channels: input image channels.
        stem_multiplier: the stem outputs ``stem_multiplier * C`` channels.
        order: op stacking order ``"relu-conv-bn"``, ``"conv-bn-relu"`` or ``"conv-relu-bn"`` (wiring paper §8.2).
        norm: ``"batch"``, ``"layer"`` or ``"instance"`` (§8.1), with ``affine`` on or off and ``norm_eps``.
        classifier_bias: ``False`` gives the bias-free classifier of Thm 2.
        primitives: candidate op names; None is DARTS's eight (``DARTS_PRIMITIVES``), as a method's ``primitives``
            of None means.
        reductions: indices of reduction cells; default ``(layers // 3, 2 * layers // 3)`` as in DARTS.
        alpha_init_scale: α is initialised as ``alpha_init_scale * randn(E, K)`` (1e-3 in DARTS).

    Raises:
        ValueError: (one line) ``C`` not a positive even integer, ``layers``, ``steps``, ``num_classes``, ``in_channels``
            or ``stem_multiplier`` not an integer >= 1, no ``primitives``, a ``multiplier`` outside [1, steps], reduction
            indices that are not cells. KeyError: a primitive not in ``nasdiag.supernet.OPS``.
    """

    def __init__(
        self,
        C: int,
        num_classes: int,
        layers: int,
        steps: int = 4,
        multiplier: int = 4,
        in_channels: int = 3,
        stem_multiplier: int = 3,
        order: str = "relu-conv-bn",
        norm: str = "batch",
        affine: bool = False,
        norm_eps: float = 1e-5,
        classifier_bias: bool = True,
        primitives: Optional[Sequence[str]] = DARTS_PRIMITIVES,
        reductions: Optional[Sequence[int]] = None,
        alpha_init_scale: float = 1e-3,
    ):
        super().__init__()
        whole = lambda v: not isinstance(v, bool) and isinstance(v, numbers.Integral)  # noqa: E731
        if not whole(layers) or layers < 1:  # a float was range()'s TypeError
            raise ValueError(f"layers must be an integer >= 1, got {layers!r}")
        if not whole(C) or C < 1 or C % 2:  # C = 4.0 was torch's "empty(): argument 'size'" TypeError
            raise ValueError(f"C must be a positive even integer (FactorizedReduce halves it), got {C!r}")
        if not whole(steps) or steps < 1:  # steps = 0 was the cell's "multiplier must be in [1, steps=0]" for any multiplier
            raise ValueError(f"steps (intermediate nodes per cell) must be an integer >= 1, got {steps!r}")
        for name, value in (("num_classes", num_classes), ("in_channels", in_channels), ("stem_multiplier", stem_multiplier)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                # 0 built a classifier of no outputs / a stem of no input channels without a word
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.C = C
        self.num_classes = num_classes
        self.layers = layers
        self.steps = steps
        self.multiplier = multiplier
        if primitives is None:  # a method's primitives of None (DARTS's space) was list(None)'s bare TypeError
            primitives = DARTS_PRIMITIVES
        self.primitives = [] if isinstance(primitives, str) else list(primitives)  # a str was taken letter by letter
        if not self.primitives:
            raise ValueError("primitives must name at least one candidate op (nasdiag.supernet.OPS lists them)")
        self.op_config = OpConfig(order=order, norm=norm, affine=affine, eps=norm_eps)
        if reductions is None:
            reductions = sorted({layers // 3, 2 * layers // 3})
        reductions = list(reductions)
        if any(not whole(r) or not 0 <= r < layers for r in reductions):  # 1.5 was int()'d to cell 1 without a word
            raise ValueError(f"reduction indices must be integers in [0, {layers}), got {reductions}")
        self.reductions = sorted(set(int(r) for r in reductions))

        C_curr = stem_multiplier * C
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, C_curr, 3, padding=1, bias=False),
            self.op_config.norm_layer(C_curr, affine=True),
        )
        C_prev_prev, C_prev, C_curr = C_curr, C_curr, C
        self.cells = nn.ModuleList()
        reduction_prev = False
        for i in range(layers):
            reduction = i in self.reductions
            if reduction:
                C_curr *= 2
            cell = Cell(steps, multiplier, C_prev_prev, C_prev, C_curr, reduction, reduction_prev, self.primitives, self.op_config)
            self.cells.append(cell)
            reduction_prev = reduction
            C_prev_prev, C_prev = C_prev, multiplier * C_curr
        self.global_pooling = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(C_prev, num_classes, bias=classifier_bias)

        E, K = len(edge_nodes(steps)), len(self.primitives)
        for cell_type in self.cell_types:
            self.register_parameter(f"alphas_{cell_type}", nn.Parameter(alpha_init_scale * torch.randn(E, K)))

    # -- construction shortcuts ---------------------------------------------------------------
    @classmethod
    def minimal(cls, C: int, num_classes: int, layers: int, **kwargs) -> "Network":
        """The wiring paper's minimal cell (Fig. 7): 2 intermediate nodes, 5 edges, both nodes
        concatenated into the output. Edges 0-3 are input edges, edge 4 = (2, 3) is intermediate."""
        kwargs.setdefault("steps", 2)
        kwargs.setdefault("multiplier", 2)
        return cls(C, num_classes, layers, **kwargs)

    # -- architecture / weight split ---------------------------------------------------------
    @property
    def cell_types(self) -> List[str]:
        """Cell types present, in order of first appearance (``"normal"`` first if both)."""
        present = {"reduce" if i in self.reductions else "normal" for i in range(self.layers)}
        return [t for t in ("normal", "reduce") if t in present]

    @property
    def num_edges(self) -> int:
        return len(edge_nodes(self.steps))

    @property
    def edge_nodes(self) -> List[Tuple[int, int]]:
        return edge_nodes(self.steps)

    def edge_labels(self) -> List[str]:
        """Human-readable labels ``"i->j"`` of the E edges of a cell, shared by all cells."""
        return [f"{i}->{j}" for i, j in self.edge_nodes]

    def named_arch_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        for cell_type in self.cell_types:
            name = f"alphas_{cell_type}"
            yield name, getattr(self, name)

    def arch_parameters(self) -> List[nn.Parameter]:
        """α of each cell type present, (E, K) each."""
        return [p for _, p in self.named_arch_parameters()]

    def named_weight_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        arch = {id(p) for p in self.arch_parameters()}
        for name, p in self.named_parameters():
            if id(p) not in arch:
                yield name, p

    def weight_parameters(self) -> List[nn.Parameter]:
        """All parameters that are not architecture parameters."""
        return [p for _, p in self.named_weight_parameters()]

    def alphas(self) -> Dict[str, nn.Parameter]:
        """``{cell type: α}``."""
        return {t: getattr(self, f"alphas_{t}") for t in self.cell_types}

    def softmax_weights(self) -> Dict[str, torch.Tensor]:
        """``{cell type: softmax(α, dim=-1)}``, the DARTS mixing weights, (E, K) each."""
        return {t: torch.softmax(a, dim=-1) for t, a in self.alphas().items()}

    def edge_specs(self) -> List[EdgeSpec]:
        """Every edge of every cell, in (cell, edge) order; ``name`` is the mixed op's qualified module name
        ``"cells.<k>.edges.<e>"``, as in ``dict(net.named_modules())`` and the probe's discovery."""
        specs = []
        for k, cell in enumerate(self.cells):
            for e, ((i, j), mixed) in enumerate(zip(cell.edge_nodes, cell.edges)):
                specs.append(EdgeSpec(f"cells.{k}.edges.{e}", mixed, tuple(mixed.ops), tuple(mixed.primitives),
                                      cell=f"cells.{k}", cell_type=cell.cell_type, cell_index=k, edge_index=e,
                                      src=i, dst=j))
        return specs

    # -- execution engine ------------------------------------------------------------------
    #: ``"auto"`` (default), ``"fast"`` or ``"eager"``: see :meth:`set_engine`
    engine: str = "auto"

    def set_engine(self, name: str) -> "Network":
        """Choose how :meth:`forward` runs the cells: ``"eager"`` (one module per candidate op, a loop over
        edges), ``"fast"`` (the batched-ops engine of ``nasdiag.supernet.engine``, the same function in far
        fewer kernels; where it cannot apply, a one-line warning and eager) or ``"auto"`` (fast where it
        applies, silently eager otherwise). Parameters, buffers and hooks are the same under every engine."""
        if name not in _engine.ENGINES:
            raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(_engine.ENGINES)}")
        self.engine = name
        return self

    # -- forward ---------------------------------------------------------------------------
    def _cell_weights(self, weights: MixingWeights, batch: Optional[int] = None) -> List[torch.Tensor]:
        """One entry per cell of ``weights`` (see :meth:`forward`), shapes checked; ``batch``: len(x), for (E, B, K)."""
        if weights is None:
            weights = self.softmax_weights()
        if isinstance(weights, Mapping):
            missing = [t for t in self.cell_types if t not in weights]
            if missing:
                raise ValueError(f"mixing weights missing for cell types {missing}; got keys {list(weights)}")
            per_cell = [weights[cell.cell_type] for cell in self.cells]
        else:
            per_cell = list(weights)
            if len(per_cell) != self.layers:
                raise ValueError(
                    f"a sequence of mixing weights needs one (E, K) tensor per cell ({self.layers}), got {len(per_cell)}; "
                    "pass a dict {cell type: (E, K)} to share weights across cells"
                )
        # shapes only (no device read), for every engine: the fast engine took (E + 1, K) weights without a word and
        # failed on (E, K − 1) with "index out of range in self"
        K = len(self.primitives)
        for k, (cell, w) in enumerate(zip(self.cells, per_cell)):
            if not isinstance(w, torch.Tensor):  # one entry per edge (the cell checks each; ASM-NAS's None = attention)
                continue
            E, shape = len(cell.edges), tuple(w.shape)
            if len(shape) not in (2, 3) or shape[0] != E or shape[-1] != K or (len(shape) == 3 and batch not in (None, shape[1])):
                raise ValueError(f"the mixing weights of cell {k} ({cell.cell_type}) must be (E, K) = ({E}, {K}) or, per "
                                 f"sample, (E, B, K) = ({E}, {batch}, {K}); got {shape}")
        return per_cell

    def _cell_active(self, active: MixingWeights) -> List[Optional[List[List[bool]]]]:
        # One host read per cell type and forward (a sync only if the masks live on the device), so
        # that the per-edge op selection below is plain Python and costs no further syncs.
        if isinstance(active, Mapping):
            missing = [t for t in self.cell_types if t not in active]
            if missing:
                raise ValueError(f"active-op masks missing for cell types {missing}; got keys {list(active)}")
            rows = {t: torch.as_tensor(active[t]).bool().tolist() for t in self.cell_types}
            return [rows[cell.cell_type] for cell in self.cells]
        active = list(active)
        if len(active) != self.layers:
            raise ValueError(f"a sequence of active-op masks needs one (E, K) mask per cell ({self.layers}), got {len(active)}")
        return [torch.as_tensor(m).bool().tolist() for m in active]

    def forward(self, x: torch.Tensor, weights: MixingWeights = None, active: MixingWeights = None) -> torch.Tensor:
        """Args:
            x: (B, in_channels, H, W).
            weights: mixing weights Z. ``None``: softmax(α) per cell type (DARTS). A mapping
                ``{cell type: (E, K)}`` (or (E, B, K) per sample) shared by the cells of that type, or a
                sequence of one (E, K) tensor per cell, e.g. leaves to take ∂L/∂Z per cell.
            active: optional ``{cell type: (E, K) bool}`` (or one (E, K) mask per cell) of the ops to
                **compute**; inactive ops are never called and contribute nothing (the forward equals
                the dense one with their weights set to 0). Prefer CPU masks: they are read on the host.

        Returns:
            logits (B, num_classes).
        """
        per_cell = self._cell_weights(weights, len(x))
        if self.engine != "eager" and _engine.resolve(self, x, per_cell, active):  # batched cells (engine/fast.py)
            # Z in the activations' dtype, as the eager cells' w_k·op_k(x) promotes a (K,) row (float32 Z on a float64
            # supernet stopped here with "expected scalar type Double but found Float"); a no-op when they agree. The
            # cells' (every cell has its preprocessing's conv): a classifier without .weight (a Sequential with dropout)
            # stopped the fast forward in an AttributeError
            dtype = next(self.cells.parameters()).dtype
            return _engine.fast_forward(self, x, [w.to(dtype) for w in per_cell])
        per_cell_active = [None] * len(per_cell) if active is None else self._cell_active(active)
        s0 = s1 = self.stem(x)
        for cell, w, on in zip(self.cells, per_cell, per_cell_active):
            s0, s1 = s1, cell(s0, s1, w) if on is None else cell(s0, s1, w, on)
        return self.classifier(self.global_pooling(s1).flatten(1))
