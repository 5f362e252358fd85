"""Candidate operations of the DARTS search space and a registry for adding more.

Every op is built from standard modules (``nn.ReLU``, ``nn.Conv2d``, normalization, pooling) inside
``nn.Sequential`` so that hook-based diagnostics and per-module Hessian rules can see through it. The
stacking order of ReLU, convolution and normalization is a switch (wiring paper §8.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
from torch import nn

from nasdiag.supernet.norm import NORM_KINDS, make_norm

ORDERS = ("relu-conv-bn", "conv-bn-relu", "conv-relu-bn")


@dataclass(frozen=True)
class OpConfig:
    """How candidate ops are built: stacking order (§8.2) and normalization (§8.1)."""

    order: str = "relu-conv-bn"
    norm: str = "batch"
    affine: bool = False
    eps: float = 1e-5

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"unknown op stacking order {self.order!r}: choose one of {', '.join(ORDERS)}")
        if self.norm not in NORM_KINDS:
            raise ValueError(f"unknown normalization {self.norm!r}: choose one of {', '.join(NORM_KINDS)}")
        if not self.eps > 0:
            raise ValueError(f"normalization eps must be > 0, got {self.eps}")

    def norm_layer(self, channels: int, affine: bool | None = None) -> nn.Module:
        return make_norm(self.norm, channels, self.affine if affine is None else affine, self.eps)

    def stack(self, convs: List[nn.Module], channels: int) -> nn.Sequential:
        """Arrange ReLU, the linear part ``convs`` and the normalization in the configured order."""
        norm = self.norm_layer(channels)
        relu = nn.ReLU(inplace=False)
        if self.order == "relu-conv-bn":
            layers = [relu, *convs, norm]
        elif self.order == "conv-bn-relu":
            layers = [*convs, norm, relu]
        else:  # conv-relu-bn
            layers = [*convs, relu, norm]
        return nn.Sequential(*layers)


def relu_conv_bn(C_in: int, C_out: int, kernel: int, stride: int, padding: int, cfg: OpConfig) -> nn.Sequential:
    return cfg.stack([nn.Conv2d(C_in, C_out, kernel, stride=stride, padding=padding, bias=False)], C_out)


def dil_conv(C_in: int, C_out: int, kernel: int, stride: int, padding: int, dilation: int, cfg: OpConfig) -> nn.Sequential:
    """Depthwise dilated convolution followed by a pointwise one (DARTS ``DilConv``)."""
    convs = [
        nn.Conv2d(C_in, C_in, kernel, stride=stride, padding=padding, dilation=dilation, groups=C_in, bias=False),
        nn.Conv2d(C_in, C_out, 1, bias=False),
    ]
    return cfg.stack(convs, C_out)


def sep_conv(C_in: int, C_out: int, kernel: int, stride: int, padding: int, cfg: OpConfig) -> nn.Sequential:
    """Two stacked depthwise-separable convolutions (DARTS ``SepConv``)."""
    return nn.Sequential(
        dil_conv(C_in, C_in, kernel, stride, padding, 1, cfg),
        dil_conv(C_in, C_out, kernel, 1, padding, 1, cfg),
    )


def pool(kind: str, C: int, stride: int, cfg: OpConfig) -> nn.Sequential:
    """3x3 pooling followed by an affine-free normalization, as in the DARTS search ``MixedOp``."""
    if kind == "max":
        layer = nn.MaxPool2d(3, stride=stride, padding=1)
    else:
        layer = nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)
    return nn.Sequential(layer, cfg.norm_layer(C, affine=False))


class Zero(nn.Module):
    """The ``none`` op: a zero tensor of the output shape (its cost is identically 0)."""

    def __init__(self, stride: int):
        super().__init__()
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            return x.mul(0.0)
        return x[:, :, :: self.stride, :: self.stride].mul(0.0)


class FactorizedReduce(nn.Module):
    """Halve the spatial size with two offset strided 1x1 convolutions, concatenated, then normalize.

    The ReLU/normalization placement follows the configured stacking order.
    """

    def __init__(self, C_in: int, C_out: int, cfg: OpConfig):
        super().__init__()
        if C_out % 2:
            raise ValueError(f"FactorizedReduce needs an even number of output channels, got {C_out}")
        self.order = cfg.order
        self.relu = nn.ReLU(inplace=False)
        self.conv_1 = nn.Conv2d(C_in, C_out // 2, 1, stride=2, bias=False)
        self.conv_2 = nn.Conv2d(C_in, C_out // 2, 1, stride=2, bias=False)
        self.norm = cfg.norm_layer(C_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.order == "relu-conv-bn":
            x = self.relu(x)
        # Odd sizes: the shifted branch is padded so both halves keep ceil(H/2) x ceil(W/2).
        shifted = x[:, :, 1:, 1:]
        if x.shape[-1] % 2 or x.shape[-2] % 2:
            shifted = nn.functional.pad(shifted, (0, x.shape[-1] % 2, 0, x.shape[-2] % 2))
        out = torch.cat([self.conv_1(x), self.conv_2(shifted)], dim=1)
        if self.order == "conv-relu-bn":
            return self.norm(self.relu(out))
        out = self.norm(out)
        if self.order == "conv-bn-relu":
            out = self.relu(out)
        return out


OpBuilder = Callable[[int, int, OpConfig], nn.Module]

#: name -> builder(C, stride, cfg). Extend with :func:`register_op`.
OPS: Dict[str, OpBuilder] = {
    "none": lambda C, stride, cfg: Zero(stride),
    "skip_connect": lambda C, stride, cfg: nn.Identity() if stride == 1 else FactorizedReduce(C, C, cfg),
    "max_pool_3x3": lambda C, stride, cfg: pool("max", C, stride, cfg),
    "avg_pool_3x3": lambda C, stride, cfg: pool("avg", C, stride, cfg),
    "sep_conv_3x3": lambda C, stride, cfg: sep_conv(C, C, 3, stride, 1, cfg),
    "sep_conv_5x5": lambda C, stride, cfg: sep_conv(C, C, 5, stride, 2, cfg),
    "dil_conv_3x3": lambda C, stride, cfg: dil_conv(C, C, 3, stride, 2, 2, cfg),
    "dil_conv_5x5": lambda C, stride, cfg: dil_conv(C, C, 5, stride, 4, 2, cfg),
}

#: The 8 DARTS candidates in the order of the original code and the wiring paper's figures.
DARTS_PRIMITIVES = (
    "none",
    "skip_connect",
    "max_pool_3x3",
    "avg_pool_3x3",
    "sep_conv_3x3",
    "sep_conv_5x5",
    "dil_conv_3x3",
    "dil_conv_5x5",
)


def register_op(name: str, builder: OpBuilder, *, overwrite: bool = False) -> None:
    """Add a candidate op. ``builder(C, stride, cfg)`` returns a module mapping (B, C, H, W) to
    (B, C, H/stride, W/stride); ``cfg`` is the network's :class:`OpConfig`."""
    if not callable(builder):
        raise TypeError(f"builder for op {name!r} must be callable as builder(C, stride, cfg)")
    if name in OPS and not overwrite:
        raise ValueError(f"op {name!r} is already registered; pass overwrite=True to replace it")
    OPS[name] = builder


def build_op(name: str, C: int, stride: int, cfg: OpConfig) -> nn.Module:
    try:
        builder = OPS[name]
    except KeyError:
        raise KeyError(
            f"unknown candidate op {name!r}; registered ops: {', '.join(OPS)}. "
            "Add one with nasdiag.supernet.register_op(name, builder)."
        ) from None
    return builder(C, stride, cfg)


# --- per-op rules of the one rule registry (nasdiag.rules), registered here so that the primitives
# (nasdiag.cost, nasdiag.hessian) never import the supernet. Torch's own layers are covered there.

def _factorized_reduce_homogeneity(module: FactorizedReduce, analyse):
    # relu? -> cat(conv_1(x), conv_2(shift(x))) -> norm (-> relu); each branch is positively homogeneous
    # of the conv's degree, the cat preserves it, and the norm makes the op invariant.
    from nasdiag.rules import Homogeneity, compose

    convs = [analyse(module.conv_1), analyse(module.conv_2)]
    if any(c.degree != 1 or c.offset is not None for c in convs):
        return Homogeneity(None, "FactorizedReduce with a non-linear conv branch")
    return compose([("relu", analyse(module.relu)), ("cat(conv_1, conv_2)", convs[0]), ("norm", analyse(module.norm))])


def _register_rules() -> None:
    from nasdiag.rules import REGISTRY, degree_rule

    REGISTRY.register("homogeneity", Zero, degree_rule(0.0, "constant zero output (J = 0)"), overwrite=True)
    REGISTRY.register("homogeneity", FactorizedReduce, _factorized_reduce_homogeneity, overwrite=True)


_register_rules()
