"""Per-module diagonal-Hessian rules and their registry (see :mod:`nasdiag.hessian.rules.base`).

Importing this package registers the built-in rules for torch's layers.
"""

from nasdiag.hessian.rules.base import (
    HessianRule,
    ModuleCall,
    UnsupportedModuleError,
    register_rule,
    rule_for,
    supported_modules,
)
from nasdiag.hessian.rules.affine import Conv2dRule, LinearRule
from nasdiag.hessian.rules.elementwise import ElementwiseRule, IdentityRule, ReshapeRule
from nasdiag.hessian.rules.lifted import Lifted1dRule
from nasdiag.hessian.rules.norm import NormRule
from nasdiag.hessian.rules.conv3d import Conv3dRule
from nasdiag.hessian.rules.pooling import (
    AdaptiveAvgPool2dRule,
    AdaptiveMaxPool2dRule,
    AdaptiveMaxPool3dRule,
    AvgPool2dRule,
    AvgPool3dRule,
    MaxPool2dRule,
    MaxPool3dRule,
)

__all__ = [
    "AdaptiveAvgPool2dRule",
    "AdaptiveMaxPool2dRule",
    "AdaptiveMaxPool3dRule",
    "AvgPool2dRule",
    "AvgPool3dRule",
    "Conv2dRule",
    "Conv3dRule",
    "ElementwiseRule",
    "HessianRule",
    "IdentityRule",
    "Lifted1dRule",
    "LinearRule",
    "MaxPool2dRule",
    "MaxPool3dRule",
    "ModuleCall",
    "NormRule",
    "ReshapeRule",
    "UnsupportedModuleError",
    "register_rule",
    "rule_for",
    "supported_modules",
]
