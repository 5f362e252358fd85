"""Data splits: sizes, disjointness, stratification, determinism; CIFAR-10 reading and its errors."""

import pickle

import numpy as np
import pytest
import torch

from nasdiag.data import DataError, cifar10, digits, load_dataset, synthetic


def _rows(ds):
    return {tuple(r) for r in ds.tensors[0].flatten(1).numpy().round(6)}


def test_digits_splits_are_disjoint_stratified_and_fixed_by_seed():
    s = digits(seed=0)
    sizes = s.sizes()
    assert sum(sizes.values()) == 1797
    assert abs(sizes["train"] - sizes["val"]) <= 10  # 50/50 of the search part
    assert abs(sizes["test"] - 0.2 * 1797) <= 10
    assert s.input_shape == (1, 8, 8) and s.num_classes == 10
    tr, va, te = _rows(s.train), _rows(s.val), _rows(s.test)
    # the digits set has a few exact duplicate images; disjointness is checked on indices through counts
    assert len(tr & te) <= 5 and len(va & te) <= 5
    for part in (s.train, s.val, s.test):
        counts = torch.bincount(part.tensors[1], minlength=10).float()
        assert (counts / counts.sum() - 0.1).abs().max() < 0.02
    again = digits(seed=0)
    assert torch.equal(again.train.tensors[0], s.train.tensors[0])
    other = digits(seed=1)
    assert not torch.equal(other.train.tensors[1], s.train.tensors[1])
    x = torch.cat([s.train.tensors[0], s.val.tensors[0]])
    assert abs(float(x.mean())) < 1e-6 and abs(float(x.std()) - 1) < 1e-2


def test_digits_dtype():
    assert digits(dtype=torch.float64).train.tensors[0].dtype == torch.float64


def _write_fake_cifar(folder, n=20, skip=None):
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        if name == skip:
            continue
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, n))}
        with open(folder / name, "wb") as fh:
            pickle.dump(batch, fh)


def test_cifar10_reads_python_batches(tmp_path):
    _write_fake_cifar(tmp_path / "cifar-10-batches-py")
    s = cifar10(tmp_path)  # the parent folder works too
    assert s.input_shape == (3, 32, 32)
    assert len(s.train) + len(s.val) == 100 and len(s.test) == 20


def test_cifar10_missing_file_is_named(tmp_path):
    _write_fake_cifar(tmp_path, skip="data_batch_3")
    with pytest.raises(DataError, match="data_batch_3"):
        cifar10(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        cifar10(tmp_path / "nowhere")


def test_synthetic_and_registry():
    s = synthetic(5, (2, 4, 4), num_classes=3)
    assert s.input_shape == (2, 4, 4) and len(s.train) == 5
    assert int(s.train.tensors[1].max()) < 3
    with pytest.raises(DataError, match="unknown dataset"):
        load_dataset("mnist")
