"""Every built-in method searches on CIFAR-10 read from a local folder of the standard python batches (a
small fake folder here: the real one is never downloaded), records its own statistics and the Hessian
diagnostics.

The fake folder holds 5 × 16 training images (split into search-train / search-val) and 16 test images; one
epoch of a tiny supernet is enough to show the method's path from the folder to the record works end to end.
"""

from __future__ import annotations

import numpy as np
import pytest

from nasdiag.record import load
from nasdiag.search import SearchConfig, run
from nasdiag.search.registry import available_methods, get_method
from test_data import _write_fake_cifar

pytestmark = pytest.mark.slow

# the families a method records that another does not: its own statistics reach the record
OWN_FAMILY = {"bayesnas": "bayes/normal/gamma", "sparsenas": "sparsity/normal/nonzero",
              "asmnas": "attention/normal/mean", "xnas": "regret/normal/regret", "snas": "scalars/temperature",
              "dsnas": "sample/normal/count", "proxyless": "sample/normal/count"}


@pytest.fixture(scope="module")
def cifar_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cifar") / "cifar-10-batches-py"
    _write_fake_cifar(folder, n=16)
    return folder


# the built-ins only: test modules collected before this one register methods of their own (a REINFORCE method
# without the cost service, one that diverges on purpose), which would be parametrized here too
BUILT_IN = sorted(m for m in available_methods() if get_method(m).__module__.startswith("nasdiag.search.methods."))


@pytest.mark.parametrize("method", BUILT_IN)
def test_method_searches_on_a_local_cifar_folder(method, cifar_folder, tmp_path):
    config = SearchConfig(method=method, dataset="cifar10", data_dir=str(cifar_folder), epochs=1, batch_size=20,
                          C=4, layers=3, steps=2, diagnostics=("hessian",), record=str(tmp_path / "run.h5"), figures=None,
                          threads=1, progress=False)
    result = run(config)
    record = load(config.record)
    losses = np.asarray(record["scalars/train_loss"], dtype=float)
    assert len(losses) >= 1 and np.isfinite(losses).all()
    assert "hessian/normal/diag" in record, sorted(record)  # every method records what the diagnostics ask for
    if method in OWN_FAMILY:
        assert OWN_FAMILY[method] in record, sorted(record)
    assert result.genotype is not None
