"""Audit round 20, data: the search splits and the CIFAR-10 reader against this file's own numpy/sklearn/pickle code.

Checked against references written here (never nasdiag's own functions):

* digits: every image of sklearn's ``load_digits`` (pixels / 16) lands in exactly one of search-train, search-val and
  test (multisets of (pixels, label), the set having duplicate images); per class the test part is ``test_fraction``
  of it and search-train / search-val halve the rest (to rounding); the pixels are standardized with the mean and
  (population) standard deviation of search-train + search-val only, the test part with those same numbers; the split
  is fixed by ``seed`` alone (another dtype: the same images in the same order; another seed: another split).
* CIFAR-10 from a fake folder of the standard python batches (bytes keys, plus ``batches.meta``, ``batch_label`` and
  ``filenames`` as the real ones have): every pixel is the batch's byte at ``c * 1024 + h * 32 + w`` / 255, standardized
  per channel with the search images' statistics (CHW, RGB order kept), labels carried with their images, the test part
  is ``test_batch`` in order; search-train and search-val partition the 5 training batches; another seed another split;
  ``limit`` keeps the first images of each part, standardized with the statistics of the search images kept.
* ``run`` loads the split from the seed (and dtype) alone, whatever the batch size or method.
* data order under DDP (``epoch_batches``): for world sizes that do not divide the split, rank r's batch i is the
  one-process order's samples ``(i * B + j) * W + r``; the ranks are disjoint, cover the first ``N // W * W`` samples,
  and yield full batches only (drop_last), at least the runner's ``steps_per_epoch`` of them on both splits.

Defects found (each test fails without its fix):

* a batch whose ``data`` is one-dimensional and not a whole number of 3072-byte images (or a single number) was numpy's
  ``cannot reshape array of size 1000 into shape (3,32,32)`` traceback from ``nasdiag search`` instead of one line
  (test_a_cifar_batch_of_flat_bytes_not_whole_images_is_one_line).
* a ``--data-dir`` of CIFAR-100 (``cifar-100-python/`` with train, test, meta, or its parent) said only "CIFAR-10 file
  missing: .../data_batch_1", as the binary version did before round 13; it now says the folder is CIFAR-100
  (test_a_cifar_100_folder_says_it_is_cifar_100).
* digits' ``test_fraction`` and cifar10's ``train_fraction`` inside (0, 1) that leave a part empty (0.999: numpy's
  concatenate traceback; 0.995: an empty search-val split; 0.001: no test image), and a CIFAR-10 folder that is a file
  ("does not exist" from the scripts and the API) (test_a_fraction_that_leaves_a_part_empty_is_one_data_error).

Noticed and left: ``cifar10`` holds all 50k training images as float64 and copies them for the statistics: a peak
RSS of 4.25 GB for 180 MB of batches (0.74 GB of float32 tensors kept), also under ``limit`` (the wiring scripts'
"CPU-sized subset" of 5000) and on every DDP rank; a memory cost, not a wrong result.
"""

from __future__ import annotations

import collections
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from nasdiag.cli import main
from nasdiag.data import DataError, cifar10, digits
from nasdiag.search.runner import epoch_batches, steps_per_epoch

CIFAR_NAMES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
SEARCH = ["--epochs", "1", "--C", "4", "--layers", "3", "--steps", "2", "--batch-size", "4", "--diagnostics", "none",
          "--device", "cpu", "--no-progress", "--no-figs", "--threads", "1"]


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def _refused(argv, folder: Path, needles, capsys) -> str:
    """``nasdiag argv`` exits 2 with one stderr line holding every needle and changes nothing under ``folder``."""
    before = _files(folder)
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert _files(folder) == before
    return lines[0]


def _fake_cifar(folder: Path, n: int = 7, seed: int = 1, change=None) -> dict:
    """A folder of the standard python batches (pickled as CIFAR-10's are: bytes keys), ``n`` random images each;
    ``change(name, batch)`` may alter or drop (None) a batch. Returns {name: (uint8 N x 3072, labels)}."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {}
    for name in CIFAR_NAMES:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        raw[name] = (data, labels)
        batch = {b"batch_label": name.encode(), b"labels": labels, b"data": data,
                 b"filenames": [f"img{i}.png".encode() for i in range(n)]}
        batch = change(name, batch) if change else batch
        if batch is not None:
            with open(folder / name, "wb") as fh:
                pickle.dump(batch, fh, protocol=2)
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({b"num_cases_per_batch": n, b"label_names": [b"airplane", b"automobile", b"bird", b"cat", b"deer",
                                                                  b"dog", b"frog", b"horse", b"ship", b"truck"],
                     b"num_vis": 3072}, fh, protocol=2)
    return raw


def _source_rows(part, images: np.ndarray, labels: np.ndarray, tol: float) -> list:
    """The index in ``images`` of each image of ``part`` (asserting a match within ``tol`` and the same label)."""
    flat = images.reshape(len(images), -1)
    found = []
    for x, y in zip(part.tensors[0].double().numpy(), part.tensors[1].numpy()):
        gap = np.abs(flat - x.reshape(-1)).max(axis=1)
        j = int(gap.argmin())
        assert gap[j] <= tol and labels[j] == y, (gap[j], labels[j], y)
        found.append(j)
    return found


# -- digits -------------------------------------------------------------------------------------------------------------
def test_digits_split_scaling_and_seed_as_documented():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    raw = bunch.images.astype(np.float64) / 16.0  # (1797, 8, 8) in [0, 1]
    y = bunch.target
    s = digits(seed=3, dtype=torch.float64)
    parts = {"train": s.train, "val": s.val, "test": s.test}
    assert s.input_shape == (1, 8, 8) and s.num_classes == 10
    # the standardization is one affine map x -> (x - m) / sd: recover the raw pixels from the output's own extremes
    # (every level 0/16 .. 16/16 occurs in search-train), without trusting nasdiag's m and sd
    out = s.train.tensors[0].numpy()
    lo, hi = out.min(), out.max()
    recovered = {k: (p.tensors[0].numpy()[:, 0] - lo) / (hi - lo) for k, p in parts.items()}
    for k, r in recovered.items():
        assert np.abs(r * 16 - np.round(r * 16)).max() < 1e-9, k  # pixels are sixteenths
    # every (image, label) of the set is in exactly one part: multisets, as the set holds duplicate images
    key = lambda img, label: (tuple(np.round(img.reshape(-1) * 16).astype(int)), int(label))
    whole = collections.Counter(key(img, label) for img, label in zip(raw, y))
    split = collections.Counter(key(img, label) for k, p in parts.items() for img, label in zip(recovered[k], p.tensors[1]))
    assert split == whole
    # stratified: per class the test part is test_fraction of it, and search-train / search-val halve the rest
    for c in range(10):
        n_c = int((y == c).sum())
        t, v, te = (int((p.tensors[1] == c).sum()) for p in (s.train, s.val, s.test))
        assert abs(te - 0.2 * n_c) <= 0.5 and abs(t - v) <= 1 and t + v + te == n_c, (c, t, v, te, n_c)
    # standardized with the search data's (train + val) mean and population std, the test part with the same numbers
    search = np.concatenate([recovered["train"], recovered["val"]])
    m, sd = search.mean(), search.std()
    for k, p in parts.items():
        np.testing.assert_allclose(p.tensors[0].numpy()[:, 0], (recovered[k] - m) / sd, rtol=0, atol=1e-7)
    # fixed by the seed alone: float32 gives the same images in the same order, another seed another split
    s32 = digits(seed=3)
    for a, b in ((s.train, s32.train), (s.val, s32.val), (s.test, s32.test)):
        assert torch.equal(a.tensors[1], b.tensors[1])
        assert torch.allclose(a.tensors[0].float(), b.tensors[0], atol=1e-5)
    assert torch.equal(digits(seed=3).test.tensors[0], s32.test.tensors[0])
    other = digits(seed=4)
    assert not torch.equal(other.test.tensors[1], s.test.tensors[1])


# -- CIFAR-10 -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nested", [False, True])
def test_cifar10_pixels_are_the_batches_bytes_in_chw_order_standardized_per_channel(nested, tmp_path):
    folder = tmp_path / "cifar-10-batches-py" if nested else tmp_path
    raw = _fake_cifar(folder)
    s = cifar10(tmp_path, seed=5, dtype=torch.float64)
    # the reference: byte c * 1024 + h * 32 + w of a row is channel c (R, G, B), row h, column w, / 255
    x = np.concatenate([raw[f"data_batch_{i}"][0] for i in range(1, 6)]).reshape(-1, 3, 32, 32) / 255.0
    y = np.concatenate([raw[f"data_batch_{i}"][1] for i in range(1, 6)])
    assert x[3, 1, 2, 5] == raw["data_batch_1"][0][3, 1024 + 2 * 32 + 5] / 255.0  # the layout, spelled out once
    mean = x.mean(axis=(0, 2, 3), keepdims=True)  # every training image is a search image here (no limit)
    sd = x.std(axis=(0, 2, 3), keepdims=True)
    train = _source_rows(s.train, (x - mean) / sd, y, 1e-7)
    val = _source_rows(s.val, (x - mean) / sd, y, 1e-7)
    assert sorted(train + val) == list(range(len(x)))  # disjoint, covering the five training batches
    assert train == sorted(train) and val == sorted(val)
    tx = raw["test_batch"][0].reshape(-1, 3, 32, 32) / 255.0
    assert _source_rows(s.test, (tx - mean) / sd, np.array(raw["test_batch"][1]), 1e-7) == list(range(len(tx)))
    assert s.test.tensors[0].shape == (7, 3, 32, 32) and s.test.tensors[1].dtype == torch.long
    # stratified by class, fixed by the seed
    for c in np.unique(y):
        t, v = int((s.train.tensors[1] == int(c)).sum()), int((s.val.tensors[1] == int(c)).sum())
        assert abs(t - v) <= 1, (c, t, v)
    again = cifar10(tmp_path, seed=5, dtype=torch.float64)
    assert torch.equal(again.train.tensors[0], s.train.tensors[0]) and torch.equal(again.val.tensors[1], s.val.tensors[1])
    # limit: the first images of each part, standardized with the statistics of the search images kept
    cut = cifar10(tmp_path, seed=5, dtype=torch.float64, limit=3)
    kept = x[train[:3] + val[:3]]
    m3, sd3 = kept.mean(axis=(0, 2, 3), keepdims=True), kept.std(axis=(0, 2, 3), keepdims=True)
    assert _source_rows(cut.train, (x - m3) / sd3, y, 1e-7) == train[:3]
    assert _source_rows(cut.val, (x - m3) / sd3, y, 1e-7) == val[:3]
    assert _source_rows(cut.test, (tx - m3) / sd3, np.array(raw["test_batch"][1]), 1e-7) == [0, 1, 2]
    other = cifar10(tmp_path, seed=6, dtype=torch.float64)
    assert _source_rows(other.val, (x - mean) / sd, y, 1e-7) != val  # another seed, another split (the same test part)
    assert torch.allclose(other.test.tensors[0], s.test.tensors[0], rtol=0, atol=1e-12)  # statistics summed in another order


def test_a_cifar_batch_of_flat_bytes_not_whole_images_is_one_line(tmp_path, capsys):
    """A ``data`` of 1000 bytes (not N x 3072) was numpy's reshape traceback out of ``nasdiag search``."""
    def flat(name, batch):
        if name == "data_batch_2":
            batch[b"data"] = batch[b"data"].reshape(-1)[:1000]
        return batch

    _fake_cifar(tmp_path / "data", change=flat)
    line = _refused(["search", *SEARCH, "--dataset", "cifar10", "--data-dir", tmp_path / "data", "--out",
                     tmp_path / "run.h5"], tmp_path, ["data_batch_2", "N x 3072", "(1000,)"], capsys)
    assert line.startswith("nasdiag: error:")
    for value in (np.uint8(7), np.zeros(3072 + 5, np.uint8)):  # one number; a flat array one image and a bit long
        _fake_cifar(tmp_path / "one", change=lambda name, batch: {**batch, b"data": value} if name == "test_batch" else batch)
        with pytest.raises(DataError, match="test_batch is not a CIFAR-10 python batch: 'data' must be N x 3072"):
            cifar10(tmp_path / "one")
    # a flat array of whole images is the same bytes as N x 3072 and reads as such
    _fake_cifar(tmp_path / "whole", change=lambda name, batch: {**batch, b"data": batch[b"data"].reshape(-1)})
    _fake_cifar(tmp_path / "rows")
    assert torch.equal(cifar10(tmp_path / "whole").test.tensors[0], cifar10(tmp_path / "rows").test.tensors[0])


def _cifar100(folder: Path) -> None:
    folder.mkdir(parents=True)
    for name, n in (("train", 6), ("test", 3)):
        with open(folder / name, "wb") as fh:
            pickle.dump({b"data": np.zeros((n, 3072), np.uint8), b"fine_labels": [1] * n, b"coarse_labels": [0] * n,
                         b"filenames": [b"a.png"] * n, b"batch_label": name.encode()}, fh, protocol=2)
    with open(folder / "meta", "wb") as fh:
        pickle.dump({b"fine_label_names": [b"apple"] * 100, b"coarse_label_names": [b"fruit"] * 20}, fh, protocol=2)


@pytest.mark.parametrize("parent", [False, True])
def test_a_cifar_100_folder_says_it_is_cifar_100(parent, tmp_path, capsys):
    """``--data-dir cifar-100-python`` (train, test, meta) or its parent said "CIFAR-10 file missing: data_batch_1"."""
    _cifar100(tmp_path / "cifar-100-python")
    data_dir = tmp_path if parent else tmp_path / "cifar-100-python"
    _refused(["search", *SEARCH, "--dataset", "cifar10", "--data-dir", data_dir, "--out", tmp_path / "run.h5"], tmp_path,
             ["data_batch_1", "CIFAR-100", "cifar-10-python.tar.gz"], capsys)
    other = tmp_path / "other"  # a folder train/ and a file meta of some other data set is not called CIFAR-100
    (other / "train").mkdir(parents=True)
    (other / "meta").write_text("labels")
    with pytest.raises(DataError, match="file missing") as info:
        cifar10(other)
    assert "CIFAR-100" not in str(info.value)


def test_cifar_misuse_is_one_line_and_writes_nothing(tmp_path, capsys):
    """Found right: a missing folder, a missing batch, a corrupt pickle, an image layout or labels out of range,
    a dataset name that does not exist and the ambiguous ``--data``."""
    base = ["search", *SEARCH, "--out", tmp_path / "run.h5"]
    _refused([*base, "--dataset", "cifar10", "--data-dir", tmp_path / "none"], tmp_path, ["does not exist"], capsys)
    _fake_cifar(tmp_path / "gap", change=lambda name, batch: None if name == "data_batch_4" else batch)
    _refused([*base, "--dataset", "cifar10", "--data-dir", tmp_path / "gap"], tmp_path, ["missing", "data_batch_4"], capsys)
    _fake_cifar(tmp_path / "bad")
    (tmp_path / "bad" / "data_batch_3").write_bytes(pickle.dumps({b"data": 1})[:-3] + b"zz")
    _refused([*base, "--dataset", "cifar10", "--data-dir", tmp_path / "bad"], tmp_path, ["data_batch_3"], capsys)
    _fake_cifar(tmp_path / "hwc", change=lambda name, batch: {**batch, b"data": batch[b"data"].reshape(-1, 32, 32, 3)})
    _refused([*base, "--dataset", "cifar10", "--data-dir", tmp_path / "hwc"], tmp_path, ["32 x 32 x 3"], capsys)
    _fake_cifar(tmp_path / "ten", change=lambda name, batch: {**batch, b"labels": [10] * len(batch[b"labels"])})
    _refused([*base, "--dataset", "cifar10", "--data-dir", tmp_path / "ten"], tmp_path, ["'labels'", "0..9"], capsys)
    _refused([*base, "--dataset", "cifar100"], tmp_path, ["invalid choice", "cifar10"], capsys)
    _refused([*base, "--data", "cifar10"], tmp_path, ["ambiguous", "--dataset", "--data-dir"], capsys)


# -- data order under DDP -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,world,batch", [(23, 2, 3), (23, 3, 2), (23, 4, 5), (29, 7, 1), (10, 3, 4)])
def test_ranks_shards_are_disjoint_full_batches_of_the_one_process_order(n, world, batch):
    data = torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float64), torch.arange(n))
    order = torch.cat([y for _, y in epoch_batches(data, 1, seed=11, epoch=2)])  # the one-process order
    assert sorted(order.tolist()) == list(range(n))
    kept = n // world * world
    shards = []
    for rank in range(world):
        got = [y for _, y in epoch_batches(data, batch, seed=11, epoch=2, rank=rank, world_size=world)]
        assert all(len(b) == batch for b in got)  # full batches only
        assert len(got) == (n // world) // batch
        for i, b in enumerate(got):  # every world-th sample of the order, from the rank's own offset
            assert b.tolist() == [int(order[(i * batch + j) * world + rank]) for j in range(batch)]
        shards.append([v for b in got for v in b.tolist()])
    flat = [v for s in shards for v in s]
    assert len(flat) == len(set(flat))  # disjoint
    used = (n // world) // batch * batch * world
    assert set(flat) == set(order[:used].tolist()) and used <= kept
    # the runner's steps per epoch fit every rank's batches of both splits (the val split one sample longer here)
    val = torch.utils.data.TensorDataset(torch.zeros(n + 1), torch.arange(n + 1))
    steps = steps_per_epoch(n, n + 1, batch, world)
    for rank in range(world):
        assert len(list(epoch_batches(val, batch, 12, 2, rank=rank, world_size=world))) >= steps <= len(shards[rank]) // batch


# -- fractions inside (0, 1) that leave a part empty, a data folder that is a file ------------------------------------
def test_a_fraction_that_leaves_a_part_empty_is_one_data_error(tmp_path):
    """Round 5 refused ``train_fraction`` 0 and 1 (an empty part); fractions inside (0, 1) did the same: digits'
    ``test_fraction=0.999`` was numpy's "need at least one array to concatenate" ValueError, 0.995 an empty search-val
    split and 0.001 no test image (1 of 174..183 images per class rounds to 0); ``cifar10(train_fraction=0.01)`` of
    7 images per batch an empty search-train split."""
    from sklearn.datasets import load_digits

    per_class = np.bincount(load_digits().target)
    for fraction in (0.999, 0.995, 0.001):
        test = np.round(fraction * per_class)  # this file's own rounding of the documented per-class share
        assert test.min() < 1 or (per_class - test).min() < 2  # each of these leaves a class without a part
        with pytest.raises(DataError, match=f"test_fraction {fraction} leaves .* use a test_fraction nearer"):
            digits(test_fraction=fraction)
    s = digits(test_fraction=0.99)  # 1 .. 2 search images per class: every part still has every class
    assert all(len(torch.unique(p.tensors[1])) == 10 for p in (s.train, s.val, s.test))
    _fake_cifar(tmp_path / "c")
    for fraction in (0.01, 0.99):
        with pytest.raises(DataError, match=f"train_fraction {fraction} of the 35 training images leaves"):
            cifar10(tmp_path / "c", train_fraction=fraction)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(DataError, match="is a file, not a folder"):  # it said "does not exist" (scripts, the API)
        cifar10(tmp_path / "file")


def test_the_runner_loads_the_split_from_the_seed_alone_whatever_the_batch_size_or_method(monkeypatch):
    """Found right: ``run`` asks for the dataset with the seed and dtype only (the dtype does not move the split:
    test_digits_split_scaling_and_seed_as_documented), so batch size and method cannot change which images are
    search-train, search-val or test."""
    import nasdiag.data
    from nasdiag.search import SearchConfig, run

    class Loaded(Exception):
        pass

    calls = []

    def spy(name, **kwargs):
        calls.append((name, kwargs))
        raise Loaded

    monkeypatch.setattr(nasdiag.data, "load_dataset", spy)
    for method, batch in (("darts", 64), ("snas", 5), ("xnas", 7)):
        with pytest.raises(Loaded):
            run(SearchConfig(method=method, batch_size=batch, dataset="digits", epochs=1, record=None, seed=9,
                             progress=False, figures=None, device="cpu"))
    assert calls == [("digits", {"seed": 9, "dtype": torch.float32})] * 3
