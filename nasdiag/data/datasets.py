"""Search splits as in DARTS: the training data is split into a search-train part (for the weights w)
and a search-val part (for the architecture α); a held-out test part is never seen by the search."""

from __future__ import annotations

from nasdiag.errors import NasdiagError
import errno
import numbers
import os
import pickle
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import TensorDataset

class DataError(NasdiagError, ValueError):
    """A dataset cannot be loaded; the message says which file or option is wrong."""

@dataclass
class Splits:
    """``train`` (search-train, for w), ``val`` (search-val, for α) and ``test`` (held out).

    Each is a ``TensorDataset`` of images (N, C, H, W) and integer labels (N,).
    """

    train: TensorDataset
    val: TensorDataset
    test: TensorDataset
    num_classes: int
    name: str

    @property
    def input_shape(self) -> Tuple[int, int, int]:
        return tuple(self.train.tensors[0].shape[1:])

    @property
    def in_channels(self) -> int:
        return self.input_shape[0]

    def sizes(self) -> Dict[str, int]:
        return {"train": len(self.train), "val": len(self.val), "test": len(self.test)}

def _stratified_split(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """Indices (a, b) with ``b`` holding ``fraction`` of every class."""
    a, b = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_b = int(round(fraction * len(idx)))
        b.append(idx[:n_b])
        a.append(idx[n_b:])
    return np.sort(np.concatenate(a)), np.sort(np.concatenate(b))

def _to_splits(x: np.ndarray, y: np.ndarray, train_idx, val_idx, test_x, test_y, num_classes, name, dtype) -> Splits:
    # Standardize with the statistics of the search data only (train + val), per channel.
    search = np.concatenate([train_idx, val_idx])
    mean = x[search].mean(axis=(0, 2, 3), keepdims=True)
    std = x[search].std(axis=(0, 2, 3), keepdims=True) + 1e-8

    def tensors(images, labels):
        images = torch.as_tensor((images - mean) / std, dtype=dtype)
        return TensorDataset(images, torch.as_tensor(labels, dtype=torch.long))

    return Splits(
        tensors(x[train_idx], y[train_idx]),
        tensors(x[val_idx], y[val_idx]),
        tensors(test_x, test_y),
        num_classes,
        name,
    )

def digits(seed: int = 0, test_fraction: float = 0.2, dtype: torch.dtype = torch.float32) -> Splits:
    """scikit-learn's embedded digits: 1797 images of 1x8x8, 10 classes, no download.

    A stratified ``test_fraction`` is held out; the rest is split 50/50 (stratified) into
    search-train and search-val. The split depends only on ``seed``. Pixels are standardized with
    the search data's mean and standard deviation. A ``test_fraction`` that leaves a class without a test image or
    without one image in each search split raises :class:`DataError`, as does a ``dtype`` that is not a floating-point
    torch dtype.
    """
    from sklearn.datasets import load_digits

    if not 0 < test_fraction < 1:
        raise DataError(f"test_fraction must be in (0, 1), got {test_fraction}")
    _check_seed(seed)
    _check_dtype(dtype)
    bunch = load_digits()
    x = bunch.images.astype(np.float64)[:, None] / 16.0
    y = bunch.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    search_idx, test_idx = _stratified_split(y, test_fraction, rng)
    if np.bincount(y[test_idx], minlength=10).min() < 1 or np.bincount(y[search_idx], minlength=10).min() < 2:
        # 0.999 was numpy's "need at least one array" traceback, 0.995 an empty search-val split, 0.001 no test image
        raise DataError(f"test_fraction {test_fraction} leaves {len(search_idx)} of the {len(y)} digits images for the "
                        f"search and {len(test_idx)} for the test part, where each of the 10 classes needs one test image "
                        "and two search images (search-train and search-val); use a test_fraction nearer the default 0.2")
    train_rel, val_rel = _stratified_split(y[search_idx], 0.5, rng)
    return _to_splits(x, y, search_idx[train_rel], search_idx[val_rel], x[test_idx], y[test_idx], 10, "digits", dtype)

CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]

def _cifar_folder(root: Path) -> Path:
    if root.exists() and not root.is_dir():  # it said "does not exist" (the scripts and the API; nasdiag search checks)
        raise DataError(f"CIFAR-10 folder {str(root)!r} is a file, not a folder; pass --data-dir pointing at the folder "
                        "of the standard python batches (data_batch_1..5, test_batch), e.g. cifar-10-batches-py/")
    if not root.is_dir():
        raise DataError(
            f"CIFAR-10 folder {str(root)!r} does not exist; pass --data-dir pointing at the folder of the "
            "standard python batches (data_batch_1..5, test_batch), e.g. cifar-10-batches-py/"
        )
    if not os.access(root, os.X_OK):  # its batches then read as missing ("CIFAR-10 file missing: data_batch_1")
        raise DataError(f"CIFAR-10 folder {str(root)!r} cannot be entered (Permission denied): its batches cannot be read; "
                        f"give this user access to it (chmod a+rx {shlex.quote(str(root))}) or pass a --data-dir holding a "
                        "readable copy of the batches")
    nested = root / "cifar-10-batches-py"
    return nested if not (root / "data_batch_1").exists() and nested.is_dir() else root

# What a CIFAR-10 python batch pickles: a dict of numpy arrays, lists, bytes and ints (Python 2's cPickle, or
# numpy 1/2 under protocols 2-5). Any other global is refused: unpickling calls it, so a batch from an
# untrusted folder could otherwise run arbitrary code.
_CIFAR_PICKLE_GLOBALS = frozenset(
    [(f"numpy.{core}.{module}", name) for core in ("core", "_core")
     for module, name in (("multiarray", "_reconstruct"), ("multiarray", "scalar"), ("numeric", "_frombuffer"))]
    + [("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"), ("builtins", "bytearray"),
       ("__builtin__", "bytearray"),
       # protocols 0-2 pickle an empty bytes (a 0-byte array's buffer, a batch_label b"") as bytes(): it was refused
       # as code that loading would run
       ("builtins", "bytes"), ("__builtin__", "bytes")]
)


class _ForeignPickleGlobal(pickle.UnpicklingError):
    pass


class _CifarUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _CIFAR_PICKLE_GLOBALS:
            raise _ForeignPickleGlobal(f"{module}.{name}")
        return super().find_class(module, name)


def _read_cifar_batch(path: Path) -> Tuple[np.ndarray, np.ndarray]:
    if path.is_dir():  # it said "file missing"
        raise DataError(f"CIFAR-10 batch {path} is a folder, not a file; pass as --data-dir the folder that holds the "
                        f"standard python batches {', '.join(CIFAR_FILES)} as files")
    if path.exists() and not path.is_file():  # a named pipe, socket or device: it said "file missing"
        raise DataError(f"CIFAR-10 batch {path} is not a regular file (a named pipe, socket or device); put the "
                        f"{path.name} of cifar-10-python.tar.gz (unpacked: cifar-10-batches-py/{path.name}) there")
    if not path.is_file():
        archive = next(iter(sorted(path.parent.glob("cifar-10-python.tar*"))), None)  # the download, not unpacked
        unpack = (f"; {archive.name} is there: unpack it (tar xzf {shlex.quote(str(archive))} -C "
                  f"{shlex.quote(str(path.parent))}) and run again") if archive else ""
        binary = next((p for p in (path.with_suffix(".bin"), path.parent / "cifar-10-batches-bin") if p.exists()), None)
        if binary is not None and not unpack:  # the binary version (cifar-10-binary.tar.gz): "missing" said no more
            unpack = (f"; {binary} is there: that is CIFAR-10's binary version, and nasdiag reads its python version "
                      "(cifar-10-python.tar.gz, unpacked: cifar-10-batches-py/)")
        cifar100 = next((p for p in (path.parent / "train", path.parent / "cifar-100-python",
                                     *sorted(path.parent.glob("cifar-100-python.tar*"))) if p.exists()), None)
        if cifar100 is not None and not unpack and (cifar100.name != "train" or (path.parent / "meta").is_file()
                                                    and cifar100.is_file()):  # not a folder train/ of some other set
            unpack = (f"; {cifar100} is there: that is CIFAR-100 (train, test, meta), and nasdiag reads CIFAR-10's python "
                      "batches (cifar-10-python.tar.gz, unpacked: cifar-10-batches-py/)")  # it said "missing", no more
        raise DataError(f"CIFAR-10 file missing: {path} (expected the standard python batches {', '.join(CIFAR_FILES)})"
                        f"{unpack}")
    try:
        fh = open(path, "rb")
    except OSError as exc:  # unreadable (permission denied): an OSError traceback, and `nasdiag search` said the
        # location was "read-only or not writable"
        fix = (f"give this user read access to it (chmod a+r {shlex.quote(str(path))}) or pass"
               if exc.errno in (errno.EACCES, errno.EPERM) else "pass")
        raise DataError(f"CIFAR-10 batch {path} cannot be read ({os.strerror(exc.errno) if exc.errno else exc}); {fix} "
                        "a --data-dir holding a readable copy of the batches") from None
    try:
        with fh:
            batch = _CifarUnpickler(fh, encoding="bytes").load()
    except _ForeignPickleGlobal as exc:
        raise DataError(f"{path} is not a CIFAR-10 python batch: it pickles {exc}, which a batch of numpy arrays and "
                        "lists never does (refused unread, as loading it would run that code)") from None
    except Exception as exc:  # random bytes raise any of UnpicklingError, EOFError, ValueError, KeyError, ...
        again = f"replace it with the {path.name} of cifar-10-python.tar.gz (unpacked: cifar-10-batches-py/{path.name})"
        with open(path, "rb") as fh:  # a pickle (protocol 2+) that stops early, or nothing: an interrupted download,
            start = fh.read(2)         # copy or unpack; it said only "unreadable pickle", not what to do
        size = path.stat().st_size
        pickle_start = start[:1] == b"\x80" and start[1:] in (b"", b"\x02", b"\x03", b"\x04", b"\x05")  # PROTO 2-5
        if (isinstance(exc, EOFError) or "truncated" in str(exc)) and (not size or pickle_start):
            cut = "is empty (0 bytes)" if not size else f"ends early ({size:,} bytes; a batch of 10,000 images is about 30 MB)"
            raise DataError(f"CIFAR-10 batch {path} {cut}: it was cut short, likely by an interrupted download, copy or "
                            f"unpack; {again}") from None
        raise DataError(f"{path} is not a CIFAR-10 python batch (unreadable pickle: {type(exc).__name__}); "
                        f"{again}") from None
    data = batch.get(b"data", batch.get("data")) if isinstance(batch, dict) else None
    labels = batch.get(b"labels", batch.get("labels")) if isinstance(batch, dict) else None
    if data is None or labels is None:
        cifar100 = isinstance(batch, dict) and any(k in batch for k in (b"fine_labels", "fine_labels"))
        raise DataError(f"{path} is not a CIFAR-10 python batch (no 'data'/'labels' entries"
                        + ("; it is a CIFAR-100 batch, with 'fine_labels')" if cifar100 else ")"))
    images = _integers(data, path, "data", "bytes (integers 0..255)", 255)
    if images.ndim == 4 and images.shape[1:] == (32, 32, 3):  # torchvision's CIFAR10.data: read as 3 x 32 x 32, the
        # colours and rows of every image were silently scrambled
        raise DataError(f"{path} is not a CIFAR-10 python batch: 'data' is N x 32 x 32 x 3 (height, width, channel, "
                        "as torchvision's CIFAR10.data), where a batch holds N x 3072 bytes channel by channel "
                        "(3 x 32 x 32); store data.transpose(0, 3, 1, 2).reshape(len(data), 3072)")
    if images.shape[1:] not in ((3072,), (3, 32, 32)) and not (images.ndim == 1 and images.size % 3072 == 0):
        # 3072 x N, N x 1024 x 3: scrambled alike; 1000 bytes or one number: numpy's reshape error, a traceback
        raise DataError(f"{path} is not a CIFAR-10 python batch: 'data' must be N x 3072 bytes (3 x 32 x 32 per image), "
                        f"got an array of shape {images.shape}")
    images = images.astype(np.uint8, copy=False).reshape(-1, 3, 32, 32)
    labels = _integers(labels, path, "labels", "class numbers 0..9", 9).astype(np.int64).reshape(-1)
    if len(images) != len(labels) or not len(images):
        raise DataError(f"{path} is not a CIFAR-10 python batch: {len(images)} images and {len(labels)} labels "
                        "(one label in 0..9 per image, at least one image, expected)")
    return images, labels


def _integers(values, path: Path, entry: str, expected: str, top: int) -> np.ndarray:
    """``values`` as an integer array (its own dtype), refused (one `DataError`) unless every value is an integer in
    [0, ``top``]: a cast would silently wrap 300 or -1 to a byte and floor 0.7 to 0 (float images in [0, 1] became
    all black)."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged lists
        raise DataError(f"{path} is not a CIFAR-10 python batch: {entry!r} must hold {expected} ({exc})") from None
    if array.size and array.dtype.kind not in "iu":  # float, bool, str, object ([] is float64: left to the count)
        kind = {"f": "floating-point", "b": "true/false", "U": "text", "S": "text", "c": "complex"}.get(array.dtype.kind, "mixed")
        raise DataError(f"{path} is not a CIFAR-10 python batch: {entry!r} must hold {expected}, not {kind} values")
    if array.size and (array.min() < 0 or array.max() > top):
        raise DataError(f"{path} is not a CIFAR-10 python batch: {entry!r} must hold {expected}, not values from "
                        f"{array.min()} to {array.max()}")
    return array

def cifar10(root, seed: int = 0, train_fraction: float = 0.5, dtype: torch.dtype = torch.float32, limit: Optional[int] = None) -> Splits:
    """CIFAR-10 from a local folder of the standard python batches (read with numpy/pickle).

    The 50k training images are split (stratified, by ``seed``) into search-train (``train_fraction``)
    and search-val; ``test_batch`` is the held-out test part. ``limit`` keeps only the first
    ``limit`` images of each part (for quick runs). Image row ``c * 1024 + h * 32 + w`` of a batch is channel ``c`` (R, G,
    B), row ``h``, column ``w``; pixels are divided by 255 and standardized per channel with the mean and standard
    deviation of the search images (search-train + search-val, after ``limit``), the test part with the same numbers
    (no fixed CIFAR-10 constants). A missing file raises :class:`DataError` naming it, and
    so do a ``train_fraction`` outside (0, 1) and a ``limit`` that is not a positive integer (they gave other
    splits than asked, e.g. 1.5 a 49/51 split and -1 all but the last image, without a word), and a ``train_fraction``
    that leaves search-train or search-val empty, and a ``dtype`` that is not a floating-point torch dtype.
    """
    if not 0 < train_fraction < 1:  # also NaN
        raise DataError(f"train_fraction must be in (0, 1) (the search-train share of the 50k training images), "
                        f"got {train_fraction}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1):
        raise DataError(f"limit must be a positive integer (images kept per part) or None for all, got {limit!r}")
    _check_seed(seed)
    _check_dtype(dtype)
    folder = _cifar_folder(Path(root))
    parts = [_read_cifar_batch(folder / name) for name in CIFAR_FILES]
    x = np.concatenate([p[0] for p in parts[:5]]).astype(np.float64) / 255.0
    y = np.concatenate([p[1] for p in parts[:5]])
    tx, ty = parts[5][0].astype(np.float64) / 255.0, parts[5][1]
    rng = np.random.default_rng(seed)
    train_idx, val_idx = _stratified_split(y, 1.0 - train_fraction, rng)
    if limit is not None:
        train_idx, val_idx, tx, ty = train_idx[:limit], val_idx[:limit], tx[:limit], ty[:limit]
    if not len(train_idx) or not len(val_idx):  # a fraction near 0 or 1 of few images per class: an empty part, silently
        raise DataError(f"train_fraction {train_fraction} of the {len(y)} training images leaves {len(train_idx)} for "
                        f"search-train and {len(val_idx)} for search-val (split per class); use a train_fraction nearer 0.5")
    return _to_splits(x, y, train_idx, val_idx, tx, ty, 10, "cifar10", dtype)

def synthetic(
    n: int = 256,
    shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Splits:
    """Gaussian images of any shape with random labels, for timing; each split has ``n`` samples."""
    if n < 1 or num_classes < 1 or any(s < 1 for s in shape):
        raise DataError(f"synthetic data needs n >= 1, num_classes >= 1 and a positive shape, got n={n}, shape={tuple(shape)}")
    _check_dtype(dtype)
    g = torch.Generator().manual_seed(seed)

    def part():
        return TensorDataset(torch.randn(n, *shape, generator=g, dtype=dtype), torch.randint(0, num_classes, (n,), generator=g))

    return Splits(part(), part(), part(), num_classes, "synthetic")


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:  # torch.int64 truncated the standardized
        # pixels to -1, 0, 1, 2 without a word; "float32" was torch's TypeError traceback after the whole set was read
        raise DataError(f"dtype must be a floating-point torch dtype (torch.float32 or torch.float64: the pixels are "
                        f"standardized), got {dtype!r}")


def _check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise DataError(f"seed must be an integer >= 0 (it fixes the split), got {seed!r}")

DATASETS: Dict[str, Callable[..., Splits]] = {"digits": digits, "cifar10": cifar10, "synthetic": synthetic}

def load_dataset(name: str, **kwargs) -> Splits:
    """Load a dataset by name (``digits``, ``cifar10`` (needs ``root``), ``synthetic``)."""
    try:
        loader = DATASETS[name]
    except KeyError:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}") from None
    return loader(**kwargs)
