"""Audit round 13 of the search methods: the "runs and methods" and "search methods I/II" contracts against an
auditor's own float64 arithmetic and the options documented as acting on each method (docs/methods.md,
docs/asmnas.md, ``Network.set_engine``'s docstring, the method docstrings).

References are written here from the papers and plain torch; no nasdiag helper computes one. The tiny float64
supernet has 3 cells (one normal, two reduction) of 2 nodes.

Defects these tests found (each fails without its fix):

- ASM-NAS set the network's engine to ``eager`` in its build without a word where the user had asked for
  ``fast`` by name (``--engine fast``, ``SearchConfig(engine="fast")``, ``net.set_engine("fast")``): an option
  silently undone, where ``set_engine`` promises a one-line warning wherever ``fast`` cannot apply.
- a plain ``--resume`` (``--epochs`` has a default) of a killed XNAS run started with fewer epochs asks to extend it,
  which XNAS refuses; the line said only "start a new run with the wanted --epochs", although the run resumes as
  started with ``--epochs`` = its own: it now names that value.
- the registry let a class of the same name as the one registered replace it (meant for a definition run again), so a
  user's own ``class DARTS`` registered as 'darts' silently took the built-in's place.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from nasdiag.search import Schedule, get_method
from nasdiag.supernet import Network

B = 4
PRIMS = ("none", "skip_connect", "max_pool_3x3", "avg_pool_3x3", "sep_conv_3x3")


def supernet(seed, primitives=PRIMS, alpha_scale=0.5):
    """Network(C=4, 3 classes, 3 layers: one normal cell and two reduction cells sharing α), float64."""
    torch.manual_seed(seed)
    net = Network(4, 3, 3, steps=2, multiplier=2, in_channels=1, primitives=primitives).double()
    with torch.no_grad():
        for a in net.arch_parameters():
            a.normal_(0, alpha_scale)
    return net


def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g))
            for _ in range(n)]


def test_asmnas_on_a_supernet_asked_to_run_the_fast_engine_says_it_runs_eager():
    """set_engine: 'fast' runs the batched engine, and where it cannot apply says so in one warning. ASM-NAS mixes
    per sample by attention, which the batched engine never runs, so it sets eager; a network asked for 'fast' by name
    must hear it (one EngineWarning), while 'auto' (fast where it applies, silently eager elsewhere) stays silent."""
    from nasdiag.supernet.engine import EngineWarning

    ASMNAS = get_method("asmnas")
    for engine, told in (("fast", 1), ("auto", 0), ("eager", 0)):
        net = supernet(3).set_engine(engine)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            method = ASMNAS(net, schedule=Schedule(epochs=1, steps_per_epoch=1, batch_size=B))
        said = [w for w in caught if issubclass(w.category, EngineWarning)]
        assert len(said) == told, (engine, [str(w.message) for w in caught])
        if told:
            text = str(said[0].message)
            assert "\n" not in text and "fast" in text and "eager" in text and "asmnas" in text
        assert method.network.engine == "eager"
        method.step(*batches(1, 4))  # and it still searches


def test_a_plain_resume_of_a_killed_xnas_run_says_how_to_resume_it_not_only_to_start_again(tmp_path):
    """docs/methods.md: --resume continues a killed run; --epochs has a default, so a plain ``--resume`` of a run started
    with fewer epochs asks to extend it, which XNAS cannot (its horizon T fixes η* and the thresholds). The refusal said
    only "start a new run with the wanted --epochs", although the run resumes as started with --epochs = its own: a
    user was sent to throw a resumable run away. One SearchError line naming the epochs to pass; nothing written."""
    import os

    from nasdiag.errors import NasdiagError
    from nasdiag.record import load
    from nasdiag.search import SearchConfig, run
    from test_run import TINY, _InterruptAt

    out = str(tmp_path / "x.h5")
    tiny = dict(TINY, method="xnas")  # digits, 2 steps an epoch
    with pytest.raises(KeyboardInterrupt):
        run(SearchConfig(epochs=2, record=out, **tiny), callbacks=[_InterruptAt(3)])
    steps = load(out)["step"].tolist()
    files = sorted(os.listdir(tmp_path))
    with pytest.raises(NasdiagError) as info:
        run(SearchConfig(epochs=3, record=out, resume=True, **tiny))
    message = str(info.value)
    assert "\n" not in message and "cannot extend" in message and "--epochs 2" in message, message
    assert sorted(os.listdir(tmp_path)) == files and load(out)["step"].tolist() == steps
    done = run(SearchConfig(epochs=2, record=out, resume=True, **tiny))  # what the line says resumes it
    assert load(done.record)["step"].tolist()[-1] > steps[-1]


def test_a_users_class_named_like_a_built_in_does_not_take_the_built_ins_name():
    """docs/methods.md: registering a different method under a taken name is refused. The registry let a class of the
    same name replace the one registered (so that a definition run again, a notebook cell, replaces itself), so a
    user's own ``class DARTS`` registered as 'darts' silently took the built-in's place: run(method='darts') then ran
    the user's method. One ValueError line naming the built-in; 'darts' stays the built-in; the user's own class
    defined twice still replaces itself. (A fresh interpreter: a failure must not replace this process's DARTS.)"""
    import subprocess
    import sys

    script = """
import dataclasses
from nasdiag.search import Hyperparameters, SearchMethod, get_method, register

HP = dataclasses.dataclass(type("Hyperparameters", (Hyperparameters,), {}))
define = lambda name, cls_name: register(name)(type(cls_name, (SearchMethod,), {"Hyperparameters": HP}))
try:
    define("darts", "DARTS")  # a class of the user's (module __main__) named DARTS, as the built-in
    print("taken")
except ValueError as err:
    print("refused:", err)
print(get_method("darts").__module__)
first, again = define("mine", "Mine"), define("mine", "Mine")
print(get_method("mine") is again and again.__qualname__ == "Mine" and again.__module__ == "__main__")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    refusal, module, replaced = out.stdout.splitlines()
    assert refusal.startswith("refused:") and "'darts'" in refusal and "nasdiag.search.methods.darts" in refusal, refusal
    assert module == "nasdiag.search.methods.darts"
    assert replaced == "True"
