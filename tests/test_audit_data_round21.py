"""Audit round 21, data: batch order and resume, the checkpoint's random states, and CIFAR-10 batches as Python
writes them, against this file's own references (never nasdiag's functions to check nasdiag's).

Round 20 checked the digits and CIFAR-10 splits, pixels and statistics and the DDP shards; this round went for:

* the samples every step sees, recorded by a hook on the method's ``step`` (pixels and label of each row, matched to
  the split's own rows): every epoch's batches are full, drawn without replacement from search-train / search-val
  (the last partial batch dropped, as ``epoch_batches`` says), another order in the next epoch; a run interrupted in
  the middle of its second epoch and resumed sees, step for step, the batches of an uninterrupted run (the first
  session its prefix, the resumed one the steps after the checkpoint: the rest of the epoch, not a restarted one), and
  ends bit-equal (float64) in network, optimizers, schedulers, generator and attributes.
* the checkpoint's random states: after `Checkpointer.save` and `load_checkpoint` + `set_rng_state`, torch, numpy
  (with its cached Gaussian) and Python (with ``gauss_next``) draw what they drew right after the save.
* CIFAR-10 batches pickled by Python 3 with protocols 0 to 5, keys as bytes or str, labels as a list, numpy array or
  numpy scalars: every image's bytes come back exactly from the standardized float64 pixels.

Defects found (each test fails without its fix):

* a batch pickled with protocol 0, 1 or 2 (the CIFAR format's own protocol) that holds an empty ``bytes`` (a
  ``batch_label`` of b"", a file name b"", a 0-image array's buffer) was refused as pickling ``__builtin__.bytes``
  "which loading would run": ``bytes()`` is how those protocols write b"" (test_a_protocol_2_batch_holding_empty_bytes_loads).
* a batch the user cannot read (permission denied) was an OSError traceback out of ``cifar10`` (the scripts), and
  ``nasdiag search`` said the location was "read-only or not writable"; one DataError line saying it cannot be read
  (test_an_unreadable_cifar_batch_is_one_line_saying_it_cannot_be_read); a folder this user cannot enter (mode 700
  of another user) had every batch "CIFAR-10 file missing", the files all there
  (same test); a named pipe where a batch should be was "CIFAR-10 file missing" too (same test).
* ``--resume`` on a ``--data-dir`` whose batches were replaced since the run began: with other sizes the method
  refused the checkpoint as "of a run of 1 epochs × 4 steps per epoch" and told a CLI user to "build the method with
  the saved Schedule(...)"; with as many images (other labels) the run went on, silently, on other data than the
  steps it replays. The checkpoint keeps the split sizes and a digest of the labels (``runner.data_identity``); a
  resume on other data is one ConfigError line, nothing written
  (test_a_resume_on_a_data_folder_whose_batches_were_replaced_is_refused_in_one_line).
* ``digits`` / ``cifar10`` with ``dtype=torch.int64`` (or uint8) truncated the standardized pixels to a handful of
  integers without a word; ``dtype="float32"`` was torch's TypeError after the whole set was read (synthetic: a
  RuntimeError); one DataError line before anything is read (test_a_dtype_that_is_not_floating_point_is_one_data_error).
* a named pipe at ``<record>.ckpt`` made ``load_checkpoint`` (so ``--resume``) wait for ever in torch.load's open; a
  folder there, or a checkpoint this user cannot read, was "unreadable ...; it was damaged"
  (test_a_checkpoint_that_is_a_named_pipe_or_a_folder_is_one_line_not_a_hang,
  test_a_checkpoint_this_user_cannot_read_is_not_called_damaged).

Noticed and left: ``load_checkpoint`` unpickles with ``weights_only=False`` (a checkpoint from elsewhere can run code,
where the CIFAR reader refuses foreign globals; it is the search's own file next to the record); the data check of a
resume compares split sizes and labels, not pixels (the same images re-encoded, or other pixels under the same labels,
pass); ``epoch_batches`` / ``steps_per_epoch`` with batch size 0 divide by zero (internal: ``run`` validates it); a
batch whose ``data`` is a Python ``bytes`` object is refused as "text values" (one line, the word a little off).
"""

from __future__ import annotations

import collections
import os
import pickle
import random
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from nasdiag.cli import main
from nasdiag.data import DataError, cifar10

NAMES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def _write_cifar(folder: Path, protocol: int = 2, n: int = 5, keys=bytes, labels=list, extra=None) -> dict:
    """The standard python batches of ``n`` random images each, pickled with ``protocol``; returns {name: (data, y)}."""
    rng = np.random.default_rng(protocol + 10 * n)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {}
    key = (lambda s: s.encode()) if keys is bytes else (lambda s: s)
    for name in NAMES:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, n)]
        raw[name] = (data, np.array(y))
        batch = {key("data"): data, key("labels"): labels(y), **(extra(name) if extra else {})}
        with open(folder / name, "wb") as fh:
            pickle.dump(batch, fh, protocol=protocol)
    return raw


def _assert_bytes_come_back(splits, raw: dict) -> None:
    """Every image of the splits is one of the batches' rows, its bytes exactly, with its label: the pixels are
    undone with this file's own per-channel mean and (population) deviation of the five training batches' bytes / 255."""
    train = np.concatenate([raw[n][0] for n in NAMES[:5]]).reshape(-1, 3, 1024) / 255.0
    mean, sd = train.mean(axis=(0, 2))[:, None], train.std(axis=(0, 2))[:, None]
    for part, names in ((splits.train, NAMES[:5]), (splits.val, NAMES[:5]), (splits.test, NAMES[5:])):
        rows = collections.Counter((row.tobytes(), int(label)) for n in names for row, label in zip(*raw[n]))
        back = (part.tensors[0].numpy().reshape(len(part), 3, 1024) * sd + mean) * 255.0
        # whole bytes: the map is (x / 255 - m) / sd up to the guard 1e-8 added to sd, which moves a byte by at most
        # 255 * 1e-8 / sd (sd ~ 0.29 for uniform bytes): < 1e-5 of a byte, where a wrong mean or sd moves it by far more
        assert np.abs(back - np.round(back)).max() < 1e-5
        got = collections.Counter((np.round(b).astype(np.uint8).reshape(-1).tobytes(), int(label))
                                  for b, label in zip(back, part.tensors[1].numpy()))
        assert not got - rows and sum(got.values()) == len(part)  # its own rows, each once


# -- CIFAR-10 batches as Python writes them ---------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_a_protocol_2_batch_holding_empty_bytes_loads(protocol, tmp_path):
    """Protocols 0-2 pickle b"" as ``__builtin__.bytes()``: a batch with an empty batch_label or file name was refused
    as pickling code that loading would run."""
    keys, labels = [(bytes, list), (str, np.array), (bytes, lambda y: [np.int64(v) for v in y])][protocol % 3]
    raw = _write_cifar(tmp_path, protocol, keys=keys, labels=labels,
                       extra=lambda name: {b"batch_label": b"", b"filenames": [b"a.png", b"", b"c.png", b"d.png", b"e.png"]})
    s = cifar10(tmp_path, seed=2, dtype=torch.float64)
    assert len(s.train) + len(s.val) == 25 and len(s.test) == 5
    y = np.concatenate([raw[n][1] for n in NAMES[:5]])
    for c in np.unique(y):  # stratified: each class halved (to rounding)
        assert abs(int((s.train.tensors[1] == int(c)).sum()) - int((s.val.tensors[1] == int(c)).sum())) <= 1
    _assert_bytes_come_back(s, raw)
    # a 0-image batch (b"" as its array's buffer) is told as such, not as foreign code
    with open(tmp_path / "test_batch", "wb") as fh:
        pickle.dump({b"data": np.zeros((0, 3072), np.uint8), b"labels": []}, fh, protocol=protocol)
    with pytest.raises(DataError, match=r"test_batch is not a CIFAR-10 python batch: 0 images and 0 labels"):
        cifar10(tmp_path)


def test_an_unreadable_cifar_batch_is_one_line_saying_it_cannot_be_read(tmp_path, capsys, monkeypatch):
    """Permission denied on data_batch_3: an OSError traceback from cifar10, and nasdiag search said 'location is
    read-only or not writable'."""
    import nasdiag.data.datasets as datasets

    folder = tmp_path / "cifar"
    _write_cifar(folder)
    locked = folder / "data_batch_3"
    if os.geteuid() == 0:  # root reads a mode-000 file: the open is refused as the kernel refuses it to a user
        real = open

        def refusing(path, *args, **kwargs):
            if Path(path) == locked:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *args, **kwargs)

        monkeypatch.setattr(datasets, "open", refusing, raising=False)
    else:
        locked.chmod(0)
    def refused(*needles):  # cifar10(folder) is one DataError line holding every needle
        with pytest.raises(DataError) as caught:
            cifar10(folder)
        assert "\n" not in str(caught.value) and all(n in str(caught.value) for n in needles), str(caught.value)
        return str(caught.value)

    try:
        refused("data_batch_3 cannot be read (Permission denied)")
        out = tmp_path / "runs" / "r.h5"
        code = main(["search", "--dataset", "cifar10", "--data-dir", str(folder), "--out", str(out), "--epochs", "1",
                     "--C", "4", "--layers", "3", "--steps", "1", "--batch-size", "2", "--diagnostics", "none",
                     "--device", "cpu", "--no-progress", "--no-figs", "--threads", "1"])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "cannot be read" in lines[0] and "writable" not in lines[0], err
        assert not out.parent.exists() or not any(out.parent.iterdir())
    finally:
        locked.chmod(0o644)
    # a folder of mode 700 of another user (a shared data set): every batch read as missing ('CIFAR-10 file missing:
    # .../data_batch_1'), the files all there
    if os.geteuid() == 0:  # root enters a mode-000 folder: os.access answers as the kernel does to a user
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, *a, **k: False if Path(path) == folder and mode & os.X_OK
                            else real_access(path, mode, *a, **k))
    else:
        folder.chmod(0)
    try:
        assert "missing" not in refused("cannot be entered (Permission denied)")
    finally:
        folder.chmod(0o755)
    # a named pipe where a batch should be (it said "CIFAR-10 file missing"; opening it would wait for a writer)
    monkeypatch.undo()
    (folder / "test_batch").unlink()
    os.mkfifo(folder / "test_batch")
    assert "missing" not in refused("test_batch is not a regular file (a named pipe")


# -- the checkpoint's random states ----------------------------------------------------------------------------------
def test_a_checkpoint_restores_torch_numpy_and_python_random_states_exactly(tmp_path):
    from nasdiag.search.checkpoint import Checkpointer, load_checkpoint, set_rng_state

    class Stub:
        def state_dict(self):
            return {"w": torch.arange(3.0)}

    def draws():
        return (torch.rand(5, dtype=torch.float64).tolist(), torch.randint(0, 1000, (4,)).tolist(),
                np.random.standard_normal(3).tolist(), np.random.randint(0, 1000, 4).tolist(),
                random.gauss(0, 1), random.random(), random.getrandbits(64))

    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        torch.manual_seed(11)
        np.random.seed(12)
        random.seed(13)
        np.random.standard_normal()  # leave numpy's second Gaussian cached and Python's gauss_next set
        random.gauss(0, 1)
        assert np.random.get_state()[3] == 1 and random.getstate()[2] is not None
        path = tmp_path / "c.ckpt"
        Checkpointer(path, Stub(), steps_per_epoch=4).save(0)
        expected = draws()
        draws()  # move every source on
        state = load_checkpoint(path)
        assert state["step"] == 0 and state["epoch"] == 0 and state["position"] == 0
        assert torch.equal(state["method"]["w"], torch.arange(3.0))
        set_rng_state(state["rng"])
        assert draws() == expected
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


# -- batch order and resume ---------------------------------------------------------------------------------------------
def _equal_states(a, b, where="state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _equal_states(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            _equal_states(u, v, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), (where, a, b)


def test_each_step_sees_full_batches_of_the_seeds_order_and_a_resumed_run_sees_the_rest_of_the_epoch(tmp_path, monkeypatch):
    from nasdiag.data import digits
    from nasdiag.search import SearchConfig, get_method, run

    seen = []
    method_cls = get_method("darts")
    plain_step = method_cls.step

    def hooked(self, train, val):  # what this step's losses are computed on
        seen.append(tuple(tuple((x.numpy().tobytes(), int(y)) for x, y in zip(*batch)) for batch in (train, val)))
        return plain_step(self, train, val)

    monkeypatch.setattr(method_cls, "step", hooked)

    def interrupt_at(step):  # a callback that stops the run as Ctrl-C does, after ``step``
        def on_step_end(at, stats):
            if at == step:
                raise KeyboardInterrupt

        return types.SimpleNamespace(on_step_end=on_step_end, on_epoch_end=lambda epoch, stats: None,
                                     on_exception=lambda exc: None)

    B = 128

    def config(name, **kw):
        return SearchConfig(method="darts", C=4, layers=3, steps=1, epochs=2, batch_size=B, seed=3, dtype="float64",
                            device="cpu", diagnostics=(), record=str(tmp_path / name), progress=False, threads=1, **kw)

    reference = run(config("ref.h5"))
    whole, seen[:] = list(seen), []
    splits = digits(seed=3, dtype=torch.float64)
    rows = {k: collections.Counter((x.numpy().tobytes(), int(y)) for x, y in zip(*part.tensors))
            for k, part in (("train", splits.train), ("val", splits.val))}
    S = min(len(splits.train), len(splits.val)) // B  # full batches of the smaller split: a partial one is dropped
    assert len(whole) == 2 * S and S >= 4 and min(len(splits.train), len(splits.val)) % B
    for e in range(2):
        for side, name in enumerate(("train", "val")):
            batches = [step[side] for step in whole[e * S:(e + 1) * S]]
            assert all(len(b) == B for b in batches)  # full batches only
            drawn = collections.Counter(s for b in batches for s in b)
            assert not drawn - rows[name]  # from its own split, without replacement
        assert whole[e * S] != whole[((e + 1) % 2) * S]  # another order in the other epoch
    # interrupted in the middle of epoch 1 (step S + 2), then resumed: the checkpoint is the end of epoch 0
    with pytest.raises(KeyboardInterrupt):
        run(config("cut.h5"), callbacks=[interrupt_at(S + 2)])
    first, seen[:] = list(seen), []
    assert first == whole[:S + 2]
    resumed = run(config("cut.h5", resume=True))
    assert seen == whole[S:]  # the steps after the checkpoint: the rest of epoch 1 in its order, not a new epoch
    _equal_states(resumed.method.state_dict(), reference.method.state_dict())
    assert resumed.evaluation == reference.evaluation


# -- resume on the run's data ----------------------------------------------------------------------------------------
def test_a_resume_on_a_data_folder_whose_batches_were_replaced_is_refused_in_one_line(tmp_path, capsys):
    """Other sizes: the method's 'build the method with the saved Schedule(...)', an API hint, out of nasdiag search;
    as many images with other labels: the run went on, silently, on other data than the steps it replays."""
    data, runs = tmp_path / "cifar", tmp_path / "runs"
    argv = ["search", "--dataset", "cifar10", "--data-dir", str(data), "--out", str(runs / "r.h5"), "--C", "4",
            "--layers", "3", "--steps", "1", "--batch-size", "2", "--diagnostics", "none", "--device", "cpu",
            "--no-progress", "--no-figs", "--threads", "1"]
    raw = _write_cifar(data, n=4)
    assert main(argv + ["--epochs", "1"]) == 0
    capsys.readouterr()
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(runs.iterdir())}
    for n, needle in ((8, "now it has"), (4, "with other labels")):
        _write_cifar(data, n=n)
        if n == 4:  # the run's images, each batch's labels reversed: as many per class (the same split sizes)
            for name in NAMES:
                with open(data / name, "wb") as fh:
                    pickle.dump({b"data": raw[name][0], b"labels": raw[name][1][::-1].tolist()}, fh, protocol=2)
        assert main(argv + ["--epochs", "2", "--resume"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "data in" in lines[0] and "changed since the run began" in lines[0], lines
        assert needle in lines[0] and "Schedule(" not in lines[0], lines[0]
        assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(runs.iterdir())} == before
    again = _write_cifar(data, n=4)  # the run's own batches back: it resumes
    assert all(np.array_equal(again[k][0], raw[k][0]) for k in NAMES)
    assert main(argv + ["--epochs", "2", "--resume"]) == 0



def test_a_checkpoint_that_is_a_named_pipe_or_a_folder_is_one_line_not_a_hang(tmp_path, capsys):
    """A named pipe at <record>.ckpt made load_checkpoint (so --resume) wait for ever in torch.load's open; a folder
    there was 'unreadable (IsADirectoryError); it was damaged'."""
    import threading

    from nasdiag.search.checkpoint import CheckpointError, load_checkpoint

    pipe = tmp_path / "run.h5.ckpt"
    os.mkfifo(pipe)
    outcome = []

    def load():
        try:
            load_checkpoint(pipe)
        except CheckpointError as exc:
            outcome.append(str(exc))

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # waiting in open: a writer's open and close let it go on (to torch's EOF error)
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("load_checkpoint of a named pipe waited for a writer")
    assert len(outcome) == 1 and "\n" not in outcome[0] and "not a regular file (a named pipe" in outcome[0], outcome
    folder = tmp_path / "other.h5.ckpt"
    folder.mkdir()
    with pytest.raises(CheckpointError, match=r"other\.h5\.ckpt is a folder, not a checkpoint file") as caught:
        load_checkpoint(folder)
    assert "damaged" not in str(caught.value)


def test_a_checkpoint_this_user_cannot_read_is_not_called_damaged(tmp_path, monkeypatch):
    """Permission denied on <record>.ckpt was 'unreadable (PermissionError); it was damaged: start the run again'."""
    from nasdiag.search.checkpoint import CheckpointError, load_checkpoint

    path = tmp_path / "run.h5.ckpt"
    torch.save({"format": 1}, path)
    if os.geteuid() == 0:  # root reads a mode-000 file: torch.load's open refused as the kernel refuses it to a user
        monkeypatch.setattr(torch, "load", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    else:
        path.chmod(0)
    with pytest.raises(CheckpointError, match=r"run\.h5\.ckpt cannot be read \(Permission denied\)") as caught:
        load_checkpoint(path)
    assert "damaged" not in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, "float32"])
def test_a_dtype_that_is_not_floating_point_is_one_data_error(dtype, tmp_path):
    """torch.int64 truncated the standardized pixels to a handful of integers without a word (digits, cifar10);
    'float32' (a string) was torch's TypeError traceback once the whole set had been read, synthetic's a RuntimeError."""
    from nasdiag.data import digits, synthetic

    _write_cifar(tmp_path, n=3)
    for load in (lambda: digits(dtype=dtype), lambda: cifar10(tmp_path, dtype=dtype), lambda: synthetic(n=4, dtype=dtype)):
        with pytest.raises(DataError, match=r"^dtype must be a floating-point torch dtype .*, got "):
            load()
