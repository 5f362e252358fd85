"""Round-5 review: defects found while reading the auditors' reports (each test fails without its fix)."""

import pytest

import nasdiag
from nasdiag.probe.discovery import ProbeError
from nasdiag.supernet import Network


@pytest.mark.parametrize("option", ["path_split", "norm_deviation"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_attach_switches_must_be_bools_not_truthy_values(option, value):
    """Before, ``attach(path_split="no")`` switched the path split on (``bool("no")`` is True), and
    ``norm_deviation=None`` switched it off: an option whose value was not looked at."""
    net = Network.minimal(C=4, layers=3, num_classes=10)
    with pytest.raises(ProbeError, match=f"{option} must be True or False, got {value!r}"):
        nasdiag.attach(net, **{option: value})
    assert not net._forward_hooks and not net._forward_pre_hooks
