"""Scoped hooks on any supernet's edges: ``nasdiag.attach(model) -> Probe`` (see docs/probe.md)."""

from nasdiag.edges import EdgeSpec
from nasdiag.probe.discovery import CellInfo, ProbeError, is_darts_mixed_op
from nasdiag.probe.layout import Group
from nasdiag.probe.probe import Probe, attach

__all__ = ["CellInfo", "EdgeSpec", "Group", "Probe", "ProbeError", "attach", "is_darts_mixed_op"]
