"""Round-5 review: defects found while reading the auditors' reports (each test fails without its fix)."""

import pickle

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


def _cifar_folder(root, pickle_module, protocol, payload=None):
    import numpy as np

    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        batch = {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": [0, 1, 2, 9],
                 b"filenames": [b"a.png"] * 4, b"batch_label": b"x"}
        if payload is not None and name == "data_batch_3":
            batch = payload
        with open(root / name, "wb") as fh:
            pickle_module.dump(batch, fh, protocol=protocol)
    return root


class _RunsCode:
    """A pickle that calls a function when it is loaded (what a tampered batch would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_batches_load_under_every_pickle_protocol_and_a_batch_that_runs_code_is_refused_unrun(tmp_path, protocol):
    """Before, the CIFAR reader unpickled with ``pickle.load``: a batch in the ``--data-dir`` folder that pickled
    ``os.mkdir`` (any callable) ran it. Now only what a batch of numpy arrays pickles is resolved."""
    from nasdiag.data import DataError
    from nasdiag.data.datasets import cifar10

    (tmp_path / "good").mkdir()
    data = cifar10(str(_cifar_folder(tmp_path / "good", pickle, protocol)))
    assert len(data.test) == 4 and len(data.train) + len(data.val) == 20
    marker = tmp_path / "ran"
    (tmp_path / "bad").mkdir()
    bad = _cifar_folder(tmp_path / "bad", pickle, protocol, payload={b"data": _RunsCode(marker), b"labels": [0]})
    with pytest.raises(DataError, match=r"data_batch_3 is not a CIFAR-10 python batch: it pickles (posix|os)\.mkdir"):
        cifar10(str(bad))
    assert not marker.exists()


@pytest.mark.parametrize("method,key", [("darts", "w_lr"), ("snas", "alpha_lr")])
def test_a_float_hyperparameter_past_the_run_dtype_is_one_config_error_before_any_file(tmp_path, method, key):
    """Before, ``--hp w_lr=1e39`` in a float32 run built the method and stopped the first optimizer step with
    torch's "value cannot be converted to type float without overflow" traceback, after the record was made."""
    from nasdiag.errors import ConfigError
    from nasdiag.search import SearchConfig, run

    record = tmp_path / "run.h5"
    config = SearchConfig(method=method, dataset="digits", epochs=1, C=2, layers=3, steps=2, batch_size=240,
                          diagnostics=(), progress=False, threads=1, hp={key: 1e39}, record=str(record))
    with pytest.raises(ConfigError, match=rf"hyperparameter {key}=1e\+39 .* larger than float32 holds"):
        run(config)
    assert list(tmp_path.iterdir()) == []
