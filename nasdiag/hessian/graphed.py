"""Curvature diagonals replayed as CUDA graphs: the recursions without their host cost.

``diag``/``approx`` (bayesnas-appendix C.1-C.3) walk the module DAG in Python: one rule call per
module, a few small kernels each. On a GPU that walk, not the arithmetic, sets the time (on the DARTS
supernet of BENCHMARKS.md: 1.6 s per α diagonal, of which the device is busy a fraction). The walk is
the same for every batch of one shape, and the modes of :data:`~nasdiag.hessian.modes.GRAPHABLE_MODES`
never synchronise with the host, so the whole call is captured once with
:class:`~nasdiag.cuda_graphs.StepGraph` and replayed on static input buffers: the rules'
kernels run back to back, the Python walk runs once per batch shape.

The replay returns the numbers of a plain call on the same inputs (tested on the GPU in float32). What the
graph bakes in, and what therefore makes it capture anew: the batch's shapes and dtypes (another shape runs
plainly once, with a one-line warning, and is captured when it comes again) and any non-tensor argument,
the mode, every module's train/eval mode and normalization flags, the storage of the parameters (``model.to(...)`` or replaced parameters), grad mode and autocast. Parameter *values* may change
freely between calls (optimizer steps update them in place). On the CPU, or for other modes, the call is
plain. Hooks a user registered on the model would run only while capturing, so a model with hooks is
called plainly too.
"""

from __future__ import annotations

from typing import Callable, Dict, Hashable, Mapping, Optional, Sequence

import torch
from torch import nn

from nasdiag.hessian.modes import GRAPHABLE_MODES, WEIGHT_MODES, CurvatureError, check_mode
from nasdiag.hooks import has_module_hooks

__all__ = ["GraphedDiagHessian", "curvature_graph", "has_user_hooks"]


def has_user_hooks(model: nn.Module) -> bool:
    """Whether any module of ``model`` (or the global registry) carries forward or backward hooks."""
    return has_module_hooks(model.modules())


def _storage_key(model: nn.Module) -> Hashable:
    return tuple((p.data_ptr(), p.dtype, p.device) for p in model.parameters()) + \
        tuple((b.data_ptr(), b.dtype) for b in model.buffers())


def curvature_graph(fn: Callable, model: nn.Module, mode: str, *, name: str, backend=None):
    """``fn(*tensors)`` (a ``diag``/``approx`` computation on ``model``) as a
    :class:`~nasdiag.cuda_graphs.StepGraph`: replayed on CUDA where the mode is graphable and the
    model has no hooks, plain otherwise. ``backend`` as ``StepGraph``'s (e.g. a
    :class:`~nasdiag.cuda_graphs.CudaGraphBackend` whose memory pool the graph shares with a training step's)."""
    from nasdiag.cuda_graphs import StepGraph, ambient_state, module_flags

    def enabled(tensors: Sequence[torch.Tensor]) -> bool:
        return (mode in GRAPHABLE_MODES and len(tensors) > 0 and all(t.is_cuda for t in tensors)
                and not has_user_hooks(model))

    def state_key() -> Hashable:
        return (mode, module_flags(model), _storage_key(model), ambient_state())

    return StepGraph(fn, state_key, enabled=enabled, name=name, backend=backend)


class GraphedDiagHessian:
    """:func:`~nasdiag.hessian.diag_hessian` bound to a model, a loss and a mode; on CUDA replayed as a CUDA graph.

    ``h = GraphedDiagHessian(model, F.cross_entropy, mode="approx"); h(x, y)`` returns what
    ``diag_hessian(model, F.cross_entropy, x, y, mode="approx")`` returns (``{name: tensor like the
    parameter}``, the Hessian of exactly the loss's scalar: with mean reduction, of the batch mean), each
    call on the current parameter values. The first call of a batch shape runs plainly, the second captures,
    later ones replay (module docstring). Call it with the same argument structure each time.

    Args:
        model, loss_fn, params, rules: as :func:`~nasdiag.hessian.diag_hessian`; ``params`` as names only
            (the graph reads the parameters' storage).
        mode: one of :data:`~nasdiag.hessian.modes.GRAPHABLE_MODES` (``"diag"``, ``"approx"``).

    Raises:
        CurvatureError: a mode that cannot be captured (it synchronises with the host or draws random
            numbers): call ``diag_hessian`` for it.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, *, mode: str = "approx", params: Optional[Sequence[str]] = None,
                 rules=None):
        check_mode(mode, WEIGHT_MODES)
        if mode not in GRAPHABLE_MODES:
            raise CurvatureError(f"mode {mode!r} cannot be captured in a CUDA graph (it reads values on the host or draws "
                                 f"random numbers); GraphedDiagHessian takes {' or '.join(map(repr, GRAPHABLE_MODES))}; "
                                 f"call nasdiag.hessian.diag_hessian(..., mode={mode!r}) instead")
        if params is not None:
            # taken as a list first: the names of a generator went to the check below, and the rest was "params is empty"
            try:
                names = None if isinstance(params, (str, Mapping)) else list(params)
            except TypeError:  # not iterable
                names = None
            if names is None or any(not isinstance(p, str) for p in names):
                raise CurvatureError("GraphedDiagHessian takes params as a list of parameter names (the graph reads the "
                                     f"parameters' storage), got {type(params).__name__}; to evaluate at other values "
                                     "call nasdiag.hessian.diag_hessian(..., params={name: tensor})")
            params = names
            known = dict(model.named_parameters())
            unknown = [p for p in params if p not in known]
            if unknown:
                raise CurvatureError(f"GraphedDiagHessian: {unknown} are not parameters of the model; "
                                     f"names look like {list(known)[:3]}")
        self.model, self.loss_fn, self.mode = model, loss_fn, mode
        self.params = None if params is None else list(params)
        self.rules = rules
        self.graph = curvature_graph(self._compute, model, mode, name=f"diag_hessian(mode={mode!r})")

    def _compute(self, inputs, targets) -> Dict[str, torch.Tensor]:
        from nasdiag.hessian.weights import diag_hessian

        return diag_hessian(self.model, self.loss_fn, inputs, targets, mode=self.mode, params=self.params, rules=self.rules)

    def __call__(self, inputs, targets) -> Dict[str, torch.Tensor]:
        return self.graph(inputs, targets)

    def release(self) -> None:
        """Free the captured graphs now (the next calls capture anew)."""
        self.graph.release()
