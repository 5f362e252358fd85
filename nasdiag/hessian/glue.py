"""Diagonal-Hessian rules for the autograd ops *between* modules ("glue"): the sums, concatenations,
slices, views and weighted sums that wire a supernet's modules into a DAG (a node is a sum of edges,
a mixed op is ``Σ_k w_k O_k(x)``, a cell output is a channel concatenation).

For an op with Jacobian J the diagonal recursion needs ``(J∘J)ᵀ h`` (+ a residual for nonlinear
ops). Most glue ops have Jacobian entries in {0, 1} (cat, slice, view, expand, sum, add, pad, ReLU,
max-pool indices, ...), where ``J∘J = J``: their ordinary backward *is* the squared backward, so we
call the autograd node itself. Ops with other constant coefficients get a rescaled call (``a·x``:
``a² h``; ``mean``: ``h/n²``; ``x − y``: ``+h`` for y). A product ``a·b`` sends ``b² h`` to a and
``a² h`` to b; the second-order cross term ``g·∂a·∂b`` it would add when a and b share an ancestor is
a fan-out cross term, dropped like every cross term between the branches of a fan-out.

Every other op raises: a wrong number is worse than none. Register more with
:func:`register_glue_rule`.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

from nasdiag.hessian.modes import CurvatureError, CurvatureTypeError

import torch

__all__ = ["GlueRule", "UnsupportedGlue", "register_glue_rule", "glue_rule_for"]

Tensors = List[Optional[torch.Tensor]]


class GlueRule:
    """``apply(node, h_outs, grad_out, wanted) -> per-input diagonals`` aligned with ``node.next_functions``.

    ``h_outs[i]`` is the diagonal w.r.t. the op's i-th output (None if nothing flows there).
    ``grad_out`` is ``∂L/∂(output 0)`` when ``needs_grad`` is set, else None.
    ``wanted[i]`` says whether input i leads to a requested tensor; others may be returned as None.
    Raise :class:`UnsupportedGlue` for a case the rule cannot handle.
    """

    needs_grad = False
    #: a product of its inputs: if two of them depend on the requested tensors, the second-order cross
    #: term between them is dropped (a fan-out cross term); the engine refuses that inside one module.
    bilinear = False
    #: an entrywise sum of its inputs (x ± y): two inputs that depend on the requested tensors through one
    #: input of the enclosing module rejoin a fan-out inside it, whose first-order cross term would be
    #: dropped; the engine refuses that inside one module (as for products).
    joins = False

    def apply(self, node, h_outs: Tensors, grad_out, wanted: Sequence[bool]) -> Sequence[Optional[torch.Tensor]]:
        raise NotImplementedError


class UnsupportedGlue(Exception):
    """Raised by a glue rule for an input configuration it cannot handle; the engine adds context."""


def _call(node, h_outs: Tensors):
    if len(h_outs) > 1 and any(h is None for h in h_outs):
        meta = node._input_metadata
        h_outs = [
            torch.zeros(tuple(m.shape), dtype=m.dtype, device=m.device) if h is None else h for h, m in zip(h_outs, meta)
        ]
    out = node(*h_outs)
    return out if isinstance(out, tuple) else (out,)


class PassThrough(GlueRule):
    """Jacobian entries in {0, 1}: the squared backward equals the backward."""

    def apply(self, node, h_outs, grad_out, wanted):
        return _call(node, h_outs)


class ScaledInputs(GlueRule):
    """Backward coefficients ``c_i`` per input (``x + α y``: (1, α); ``x − α y``: (1, −α)); the squared
    backward is the backward times ``c_i``."""

    joins = True

    def __init__(self, coefficients: Callable[[object], Sequence[float]]):
        self.coefficients = coefficients

    def apply(self, node, h_outs, grad_out, wanted):
        out = _call(node, h_outs)  # c_i h per input
        coefficients = tuple(self.coefficients(node))
        # one tensor on several inputs (x + x, x.add(x, alpha=a), x - x) is one elementwise map of it, c = Σ c_i, whose
        # squared backward is (Σ c_i)² h: each of its inputs passes c_i (Σ c_j) h, not c_i² h
        total: Dict[object, float] = {}
        for edge, c, want in zip(node.next_functions, coefficients, wanted):
            if want:
                total[edge] = total.get(edge, 0.0) + c
        return tuple(
            None if o is None else o * (total.get(edge, c) if want else c)
            for o, c, edge, want in zip(out, coefficients, node.next_functions, wanted)
        )


class Product(GlueRule):
    """``a · b`` (tensor or scalar b): ``b² h`` to a, ``a² h`` to b."""

    bilinear = True

    def apply(self, node, h_outs, grad_out, wanted):
        (h,) = h_outs
        n_in = len(node.next_functions)
        to_self = to_other = None
        if wanted[0]:
            to_self = _call(node, [h * _saved(node, "_saved_other")])[0]
        if n_in > 1 and wanted[1]:
            to_other = _call(node, [h * _saved(node, "_saved_self")])[1]
        return (to_self, to_other)[:n_in]


class Quotient(GlueRule):
    """``a / b`` with b not on the path: ``h / b²`` to a."""

    def apply(self, node, h_outs, grad_out, wanted):
        (h,) = h_outs
        if len(wanted) > 1 and wanted[1]:
            raise UnsupportedGlue("division by a tensor that depends on the requested parameters")
        other = _saved(node, "_saved_other")
        out = _call(node, [h / other])
        return (out[0],) + (None,) * (len(out) - 1)


class Mean(GlueRule):
    """``mean``: coefficients 1/n, so the squared backward is the backward / n."""

    def apply(self, node, h_outs, grad_out, wanted):
        (out,) = _call(node, h_outs)
        return (out * (h_outs[0].numel() / out.numel()),)


class Softmax(GlueRule):
    """``s = softmax(x)`` along a dim. With ``J_ki = s_k(δ_ki − s_i)`` and ``∂²s_k/∂x_i² = s_k(δ_ki − s_i)² −
    s_k s_i (1 − s_i)`` the diagonal recursion is, per slice along the dim,

        H_x,i = s_i² [(1 − 2 s_i) h_i + Σ_k s_k² h_k] + s_i (1 − 2 s_i) (g_i − Σ_k g_k s_k).

    This is the chain rule through softmax of C.3 (α → Z = softmax(α)) with the Z-Hessian diagonal.
    """

    needs_grad = True

    def apply(self, node, h_outs, grad_out, wanted):
        (h,) = h_outs
        s = node._saved_result.detach()
        dim = _signed_dim(node._saved_dim, s.dim())
        a = (s.square() * h).sum(dim, keepdim=True)
        b = (grad_out * s).sum(dim, keepdim=True)
        return (s.square() * ((1 - 2 * s) * h + a) + s * (1 - 2 * s) * (grad_out - b),)


class LogSoftmax(GlueRule):
    """``y = log_softmax(x)`` along a dim, ``s = exp(y)``: ``∂y_i/∂x_j = δ_ij − s_j`` and
    ``∂²y_i/∂x_j² = −s_j (1 − s_j)``, so per slice ``H_x,j = (1 − 2 s_j) h_j + s_j² Σ_i h_i − s_j (1 − s_j) Σ_i g_i``."""

    needs_grad = True

    def apply(self, node, h_outs, grad_out, wanted):
        (h,) = h_outs
        s = node._saved_result.detach().exp()
        dim = _signed_dim(node._saved_dim, s.dim())
        return ((1 - 2 * s) * h + s.square() * h.sum(dim, keepdim=True) - s * (1 - s) * grad_out.sum(dim, keepdim=True),)


class ElementwiseSaved(GlueRule):
    """Functional ``sigmoid``/``tanh`` from their saved result: ``σ'² h + σ'' g``."""

    needs_grad = True

    def __init__(self, derivatives: Callable[[torch.Tensor], tuple]):
        self.derivatives = derivatives

    def apply(self, node, h_outs, grad_out, wanted):
        d1, d2 = self.derivatives(node._saved_result.detach())
        return (d1.square() * h_outs[0] + d2 * grad_out,)


def _saved(node, attr: str):
    value = getattr(node, attr, None)
    if isinstance(value, torch.Tensor):
        return value.detach()
    return value


def _signed_dim(dim: int, ndim: int) -> int:
    return dim - 2**64 if dim >= 2**63 else dim


def _dropout_scale(node) -> float:
    """``1/(1 − p)`` of a fused dropout (CUDA); on CPU dropout is a product with the mask (``Product``)."""
    p = getattr(node, "_saved_p", None)
    if p is None:
        raise UnsupportedGlue("dropout without a readable drop probability")
    train = getattr(node, "_saved_train", True)
    return 1.0 if train is False or p >= 1 else 1.0 / (1.0 - float(p))


def _sigmoid_derivatives(s):
    d1 = s * (1 - s)
    return d1, d1 * (1 - 2 * s)


def _tanh_derivatives(t):
    d1 = 1 - t.square()
    return d1, -2 * t * d1


_GLUE: Dict[str, GlueRule] = {}


def register_glue_rule(node_name: str, rule: GlueRule, *, overwrite: bool = False) -> None:
    """Register ``rule`` for autograd nodes whose class is named ``node_name`` (e.g. ``"CumsumBackward0"``)."""
    if not isinstance(rule, GlueRule):
        raise CurvatureTypeError(f"rule must be a GlueRule instance, got {type(rule).__name__}; subclass GlueRule and pass an instance")
    if node_name in _GLUE and not overwrite:
        raise CurvatureError(f"a glue rule for {node_name} is already registered; pass overwrite=True to replace it")
    _GLUE[node_name] = rule


def glue_rule_for(node) -> Optional[GlueRule]:
    return _GLUE.get(type(node).__name__)


def _alpha(node) -> float:
    return float(getattr(node, "_saved_alpha", 1))


_pass = PassThrough()
for _name in (
    "AddBackward1",  # tensor + scalar
    "CatBackward0",
    "StackBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ReshapeAliasBackward0",
    "AliasBackward0",
    "CloneBackward0",
    "ToCopyBackward0",
    "SliceBackward0",
    "SelectBackward0",
    "NarrowBackward0",
    "IndexBackward0",
    "IndexSelectBackward0",
    "GatherBackward0",
    "PermuteBackward0",
    "TransposeBackward0",
    "TransposeBackward1",
    "TBackward0",
    "SqueezeBackward0",
    "SqueezeBackward1",
    "SqueezeBackward2",
    "SqueezeBackward3",
    "SqueezeBackward4",
    "UnsqueezeBackward0",
    "ExpandBackward0",
    "RepeatBackward0",
    "SplitBackward0",
    "SplitWithSizesBackward0",
    "UnbindBackward0",
    "ConstantPadNdBackward0",
    "ReflectionPad1DBackward0",
    "ReflectionPad2DBackward0",
    "ReflectionPad3DBackward0",
    "ReplicationPad1DBackward0",
    "ReplicationPad2DBackward0",
    "ReplicationPad3DBackward0",
    "FlipBackward0",
    "RollBackward0",
    "SumBackward0",
    "SumBackward1",
    "ReluBackward0",
    "ThresholdBackward0",
    "MaxPool2DWithIndicesBackward0",
    "MaxPool3DWithIndicesBackward0",
    "AdaptiveMaxPool2DBackward0",
    "AdaptiveMaxPool3DBackward0",
    "WhereBackward0",
    # each output entry is one input entry (F.interpolate's nearest modes, pixel (un)shuffle, F.unfold) or a plain sum
    # of input entries (F.fold): Jacobian entries in {0, 1}
    "UpsampleNearest1DBackward0",
    "UpsampleNearest2DBackward0",
    "UpsampleNearest3DBackward0",
    "UpsampleNearestExact1DBackward0",
    "UpsampleNearestExact2DBackward0",
    "UpsampleNearestExact3DBackward0",
    "PixelShuffleBackward0",
    "PixelUnshuffleBackward0",
    "Im2ColBackward0",
    "Col2ImBackward0",
):
    register_glue_rule(_name, _pass)

register_glue_rule("AddBackward0", ScaledInputs(lambda n: (1.0, _alpha(n))))
register_glue_rule("SubBackward0", ScaledInputs(lambda n: (1.0, -_alpha(n))))
register_glue_rule("RsubBackward0", ScaledInputs(lambda n: (-_alpha(n), 1.0)))
register_glue_rule("RsubBackward1", ScaledInputs(lambda n: (-_alpha(n),)))
register_glue_rule("NegBackward0", ScaledInputs(lambda n: (-1.0,)))
register_glue_rule("MulBackward0", Product())
register_glue_rule("MulBackward1", Product())
register_glue_rule("DivBackward0", Quotient())
register_glue_rule("DivBackward1", Quotient())
register_glue_rule("MeanBackward0", Mean())
register_glue_rule("MeanBackward1", Mean())
register_glue_rule("SoftmaxBackward0", Softmax())
register_glue_rule("LogSoftmaxBackward0", LogSoftmax())
register_glue_rule("NativeDropoutBackward0", ScaledInputs(lambda n: (_dropout_scale(n),)))
register_glue_rule("SigmoidBackward0", ElementwiseSaved(_sigmoid_derivatives))
register_glue_rule("TanhBackward0", ElementwiseSaved(_tanh_derivatives))
