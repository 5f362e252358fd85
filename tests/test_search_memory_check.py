"""A supernet whose parameters alone outgrow the device is refused before anything is allocated.

Where the kernel overcommits memory (``vm.overcommit_memory=1``, as on a GPU host of this project), torch's
allocation of a ``--C 2000000`` supernet did not fail: the process began filling terabytes until the OOM killer
ended it without a word (seen as a 240 s test timeout there). The size is now counted on the meta device first.
"""

import pytest
import torch

from nasdiag.search import runner
from test_cli_errors import TINY
from test_cli_plot_misuse import refused


def test_cpu_memory_is_the_machines_physical_memory():
    with open("/proc/meminfo") as f:  # the kernel's own count, independent of sysconf
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    assert runner._device_memory("cpu") == pytest.approx(kib * 1024, rel=0.02)


def test_a_supernet_larger_than_the_memory_is_refused_before_allocating(tmp_path, capsys, monkeypatch):
    # C=16 takes ~1 MiB of parameters: it would allocate fine, so only the count can refuse it
    monkeypatch.setattr(runner, "_device_memory", lambda device: 64 * 1024)
    line = refused(["search", *TINY, "--out", tmp_path / "run.h5", "--C", "16"], tmp_path,
                   ["the supernet (C=16", "does not fit in the memory of cpu", "GiB of 0.0 GiB", "smaller --C"], capsys)
    assert "parameters and buffers alone" in line


def test_parameter_bytes_follow_the_run_dtype(tmp_path, capsys, monkeypatch):
    """float64 doubles what float32 needs: a memory between the two refuses only the float64 run."""
    from nasdiag.supernet import Network

    with torch.device("meta"):
        net = Network(8, 10, 3, steps=2, multiplier=2, in_channels=1)  # TINY: 3 layers, 2 steps, multiplier = steps; digits: 10 classes, 1 channel
    floats = sum(t.numel() for t in [*net.parameters(), *net.buffers()] if t.is_floating_point())
    monkeypatch.setattr(runner, "_device_memory", lambda device: 6 * floats)  # between 4 and 8 bytes per float
    tiny = list(TINY)
    tiny[tiny.index("--C") + 1] = "8"
    refused(["search", *tiny, "--out", tmp_path / "a.h5", "--dtype", "float64"], tmp_path,
            "does not fit in the memory of cpu", capsys)
    from nasdiag.cli import main
    assert main([str(a) for a in ["search", *tiny, "--out", tmp_path / "b.h5", "--dtype", "float32"]]) == 0
