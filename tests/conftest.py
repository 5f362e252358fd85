"""Shared test setup: one torch thread for the whole session, and the helpers several test files need.

The helpers are plain functions, imported as ``from conftest import tiny_network, float64_batch`` (pytest
puts this folder on ``sys.path`` when it loads this file).
"""

import os
import sys

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run, so a suite that passed passes again on a clean
# checkout; HYPOTHESIS_PROFILE=explore draws fresh random examples (and keeps failures) while developing.
settings.register_profile("reproducible", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))

# The batch scripts import their sibling ``script_args``, as they do when run as ``python scripts/x.py``;
# tests that load a script by path need that folder importable whichever test file runs first or alone.
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    # On a small shared CPU box two intra-op threads oversubscribe the cores: tiny float64 tests then
    # stall for seconds at a time. One thread keeps the suite fast and its timings stable.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_network(layers: int = 3, seed: int = 0, *, C: int = 4, num_classes: int = 5, **kwargs):
    """nasdiag's supernet with the wiring paper's minimal cell (Fig. 7), float64, seeded: 5 edges per cell,
    ``C`` channels; ``kwargs`` go to ``Network.minimal`` (primitives, reductions, order, norm, ...)."""
    from nasdiag.supernet import Network

    torch.manual_seed(seed)
    return Network.minimal(C, num_classes, layers, **kwargs).double()


def float64_batch(B: int = 4, seed: int = 1, *, channels: int = 3, hw: int = 8, num_classes: int = 5):
    """One seeded float64 image batch ``(x (B, channels, hw, hw), y (B,) int64 in [0, num_classes))``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, channels, hw, hw, generator=g, dtype=torch.float64)
    return x, torch.randint(0, num_classes, (B,), generator=g)


def assert_no_module_hooks(model) -> None:
    """No forward, forward-pre or backward hook is left on any submodule of ``model``."""
    for name, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                     "_backward_hooks", "_backward_pre_hooks"):
            assert not getattr(m, attr, None), f"{attr} left on {name or 'model'}"


def live_tensors() -> int:
    """Tensors the garbage collector can reach, after a collection: a count that must not grow across steps."""
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))  # type(): no proxy lookups


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a gloo rendezvous or torchrun's master)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: runs a rank's script as ``python script args`` would, then leaves without the interpreter's finalization once the
#: script returned: gloo's threads, torn down there, at times aborted a rank that had completed its work ("terminate
#: called without an active exception", SIGABRT; torch's, after destroy_process_group, seen in .ci/run on 2 of ~20
#: launches at once). A script that raises still exits with its traceback and status 1.
_RANK_MAIN = """
import os, runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def launch_ranks(script, args, nprocs: int = 2, timeout: float = 180):
    """Run ``python script *args(rank)`` as ``nprocs`` processes at once (DDP ranks of a gloo test), with this
    repository and this folder importable; fail with the first failing rank's stderr. Returns the stdouts."""
    import os
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    path = [os.path.dirname(tests_dir), tests_dir, os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    procs = [subprocess.Popen([sys.executable, "-c", _RANK_MAIN, str(script), *map(str, args(rank))], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(nprocs)]
    outputs = [p.communicate(timeout=timeout) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return [out for out, _ in outputs]
