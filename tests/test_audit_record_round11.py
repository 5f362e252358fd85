"""Round-11 audit of the record (nasdiag/record, the resume path): names, steps and values at the edges of the
documented contract, checked against plain h5py readings of the files made here (never nasdiag reading itself)."""

import os
import warnings

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder


def _plain_paths(file):
    """Every dataset path of a segment, as plain h5py lists it."""
    found = []
    with h5py.File(file, "r", swmr=True) as f:
        f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
    return found


@pytest.mark.parametrize("name", ["loss\n", "a\nb", "loss\r", "lo ss"])
def test_a_name_with_a_trailing_newline_is_refused_like_any_other_character_outside_the_documented_set(tmp_path, name):
    # docs/schema.md: names are "letters, digits and _ . - + =". The check used `$`, which also matches before a
    # final newline, so "scalars/loss\n" became a dataset (and a meta key / cell type) of that name.
    path = tmp_path / "run.h5"
    with Recorder(path) as rec:
        rec.log(0, {"scalars/ok": 1.0})
        with pytest.raises(RecordError) as err:
            rec.log(1, {"scalars/" + name: 1.0})
        assert len(str(err.value).splitlines()) == 1
        rec.log(2, {"scalars/ok": 2.0})
    assert sorted(_plain_paths(path)) == ["digest", "present", "scalars/ok", "step"]
    for meta in ({name: 1}, {"cell_types": [name], "edge_names": {name: ["0<-1"]}}):
        other = tmp_path / "meta.h5"
        with pytest.raises(RecordError) as err:
            Recorder(other, meta=meta)
        assert len(str(err.value).splitlines()) == 1
        assert not other.exists() and not (tmp_path / "meta.h5.lock").exists()


def _plain_rows(file, path):
    """The committed rows of ``path`` in one segment, and its logged flags, read with plain h5py as docs/schema.md shows."""
    with h5py.File(file, "r", swmr=True) as f:
        steps = f["step"][()]
        n = int(np.argmax(steps < 0)) if (steps < 0).any() else len(steps)
        paths = [p.decode() if isinstance(p, bytes) else p for p in f["present"].attrs["paths"]]
        if path not in paths:  # a segment has the datasets of the paths known when it was created
            return steps[:n], np.full(n, np.nan), np.zeros(n, bool)
        return steps[:n], f[path][:n], f["present"][:n, paths.index(path)]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_complex32_tensor_is_refused_like_every_complex_value_not_recorded_as_its_real_part(tmp_path):
    # docs/schema.md: dtypes bool, int, uint, float; torch tensors go through .numpy() (bfloat16 as float32).
    # complex64 was refused, but complex32 has no numpy dtype and took bfloat16's route through .float(), which
    # drops the imaginary part: [1+2j, 3-1j] was stored as float32 [1, 3] with only torch's UserWarning.
    torch = pytest.importorskip("torch")
    value = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    path = tmp_path / "run.h5"
    with Recorder(path) as rec:
        rec.log(0, {"x/real": torch.tensor([1.0, 3.0])})
        for dtype in (torch.complex32, torch.complex64, torch.complex128):
            with pytest.raises(RecordError, match="cannot be recorded") as err:
                rec.log(1, {"x/real": torch.tensor([1.0, 3.0]), "x/c": value.to(dtype)})
            assert len(str(err.value).splitlines()) == 1
        rec.log(2, {"x/real": torch.tensor([5.0, 6.0])})
    assert "x/c" not in _plain_paths(path)
    steps, real, logged = _plain_rows(path, "x/real")
    assert steps.tolist() == [0, 2] and real.tolist() == [[1.0, 3.0], [5.0, 6.0]] and logged.all()


def _segment_name(path, index):
    """docs/schema.md's file names: run.h5, run.seg0001.h5, ..."""
    return path if index == 0 else path[: -len(".h5")] + f".seg{index:04d}.h5"


class _PlainFollower:
    """A live reader written from docs/schema.md alone: opens the record's segments by name at each look (plain
    h5py, swmr=True), takes the committed rows (``/step`` up to its first -1) it has not taken yet, and moves to the
    next segment once that one's file exists."""

    def __init__(self, path, column):
        self.path, self.column, self.index, self.taken, self.rows = path, column, 0, 0, []

    def look(self):
        while os.path.exists(_segment_name(self.path, self.index)):
            final = os.path.exists(_segment_name(self.path, self.index + 1))  # checked before reading: then it is whole
            steps, values, logged = _plain_rows(_segment_name(self.path, self.index), self.column)
            self.rows += [(int(s), float(v), bool(ok)) for s, v, ok in
                          zip(steps[self.taken:], values[self.taken:], logged[self.taken:])]
            self.taken = len(steps)
            if not final:
                return
            self.index, self.taken = self.index + 1, 0


def test_a_reader_that_opens_the_record_by_name_at_each_look_sees_every_row_once_in_order_across_rollovers(
        tmp_path, monkeypatch):
    # Rollovers of both kinds (a path first logged after the first flush; a dataset at the chunk limit, made small
    # here), NaN rows and rows without the followed path; a handle opened before the first flush is the header-only
    # placeholder, which the first flush replaces, and never sees a row (docs/schema.md, "Live and crashed files").
    from nasdiag.record import schema

    monkeypatch.setattr(schema, "MAX_SEGMENT_CHUNKS", 3)
    path = str(tmp_path / "run.h5")
    expected = []
    follower = _PlainFollower(path, "scalars/a")
    with warnings.catch_warnings(record=True) as caught, Recorder(path, flush_every=5, flush_seconds=None) as rec:
        warnings.simplefilter("always")
        early = h5py.File(path, "r", swmr=True)
        follower.look()
        for step in range(0, 600, 3):
            row = {"wide/x": np.full(2048, step, np.float64)}  # 16 KiB: a chunk a row, 3 rows a segment
            if step % 7:
                row["scalars/a"] = float("nan") if step % 11 == 0 else float(step)
            if step >= 300:
                row["scalars/late"] = 1.0
            rec.log(step, row)
            expected.append((step, row.get("scalars/a", float("nan")), "scalars/a" in row))
            follower.look()
        early["step"].refresh()
        assert early["step"].shape == (0,)
        early.close()
    follower.look()
    assert any("'scalars/a' at step 33: 1 NaN" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert follower.index >= 30  # it followed rollovers: here every flush of 5 rows opens a segment
    assert [r[0] for r in follower.rows] == [e[0] for e in expected]
    assert [r[2] for r in follower.rows] == [e[2] for e in expected]
    np.testing.assert_array_equal([r[1] for r in follower.rows], [e[1] for e in expected])  # NaN where NaN


@pytest.mark.parametrize("name", ["loss_λ", "épaisseur", "ｌｏｓｓ"])
def test_a_name_of_non_ascii_letters_is_refused_saying_ascii_not_use_letters(tmp_path, name):
    # The message said "use '/'-separated names of letters, digits and _.-+=" to someone who had used letters
    # (λ, é, fullwidth l): names are ASCII only, as the check (and HDF5 path handling in every reader) has it.
    with Recorder(tmp_path / "run.h5") as rec:
        with pytest.raises(RecordError, match="ASCII letters") as err:
            rec.log(0, {f"scalars/{name}": 1.0})
        assert len(str(err.value).splitlines()) == 1
    for meta in ({name: 1}, {"cell_types": [name], "edge_names": {name: ["0<-1"]}}):
        with pytest.raises(RecordError, match="ASCII letters"):
            Recorder(tmp_path / "meta.h5", meta=meta)


def _two_segment_record(path):
    with Recorder(path, flush_every=2, flush_seconds=None) as rec:
        for step in range(4):
            rec.log(step, {"scalars/a": float(step)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Recorder(path, resume=True, flush_every=2, flush_seconds=None) as rec:
            for step in range(4, 8):
                rec.log(step, {"scalars/a": float(step)})


def _plain_record_rows(path):
    """(segment file, its steps) of every segment file next to ``path`` that docs/schema.md names, by plain h5py."""
    found, index = [], 0
    while os.path.exists(_segment_name(path, index)):
        found.append((os.path.basename(_segment_name(path, index)), _plain_rows(_segment_name(path, index), "scalars/a")[0].tolist()))
        index += 1
    return found


def test_a_recorder_named_like_a_later_segment_of_a_record_is_refused_leaving_that_record_whole(tmp_path):
    # Recorder("run.seg0001.h5", overwrite=True) deleted segment 1 of the record run.h5 (its rows after the resume)
    # and wrote a record of its own there: run.h5 was then "damaged at run.seg0001.h5 row 0", 4 of 8 rows left. A new
    # run.seg0002.h5 likewise damaged it. And load("run.seg0001.h5") called the segment damaged, offering 0 rows.
    path = str(tmp_path / "run.h5")
    _two_segment_record(path)
    before = _plain_record_rows(path)
    assert before == [("run.h5", [0, 1, 2, 3]), ("run.seg0001.h5", [4, 5, 6, 7])]
    for name in ("run.seg0001.h5", "run.seg0002.h5"):
        for options in ({"overwrite": True}, {"resume": True}, {}):
            with pytest.raises(RecordError, match="later segment of the record") as err:
                Recorder(tmp_path / name, **options)
            assert len(str(err.value).splitlines()) == 1
    assert _plain_record_rows(path) == before
    assert sorted(os.listdir(tmp_path)) == ["run.h5", "run.seg0001.h5"]
    from nasdiag.record import load

    with pytest.raises(RecordError, match=r"is segment 1 of the record .*run\.h5.*load .*run\.h5") as err:
        load(tmp_path / "run.seg0001.h5")
    assert "damaged" not in str(err.value) and len(str(err.value).splitlines()) == 1
    # a record that merely has such a name, with no record it would continue, is a record like any other
    other = tmp_path / "solo" / "exp.seg0001.h5"
    with Recorder(other) as rec:
        rec.log(0, {"scalars/a": 1.0})
    assert load(other)["step"].tolist() == [0]


def test_every_hook_of_a_closed_callback_says_it_is_closed_not_that_its_step_is_wrong(tmp_path):
    # on_epoch_end without step= after close() said "the row of step 4 is already written ...; pass step= a step
    # after 4", and on_step_end of an earlier step said the step goes back: doing as told then met the close.
    from nasdiag.record import RecorderCallback

    path = tmp_path / "run.h5"
    callback = RecorderCallback(path, flush_every=3)
    for step in range(5):
        callback.on_step_end(step, {"scalars/a": float(step)})
    callback.close()
    for call in (lambda: callback.on_epoch_end(0, {"scalars/x": 1.0}), lambda: callback.on_epoch_end(0, step=2),
                 lambda: callback.on_step_end(3, {"scalars/a": 1.0}), lambda: callback.on_step_end(4, {"scalars/a": 1.0})):
        with pytest.raises(RecordError, match=r"after close\(\)") as err:
            call()
        assert len(str(err.value).splitlines()) == 1
    steps, values, logged = _plain_rows(path, "scalars/a")
    assert steps.tolist() == [0, 1, 2, 3, 4] and values.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and logged.all()


def test_a_record_named_like_a_segment_of_an_hdf5_file_that_is_no_record_is_a_record_like_any_other(tmp_path):
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f["images"] = np.zeros(3)
    from nasdiag.record import load

    with Recorder(tmp_path / "data.seg2024.h5") as rec:
        rec.log(0, {"scalars/a": 1.0})
    assert load(tmp_path / "data.seg2024.h5")["scalars/a"].tolist() == [1.0]


@pytest.mark.parametrize("empty", ["", b""])
def test_an_empty_record_path_is_one_line_that_says_so(tmp_path, monkeypatch, empty):
    # Recorder("") (an unset variable) said "cannot create : No such file or directory"; load("") "no record at  (no
    # file  and no segments next to it)".
    from nasdiag.record import RecorderCallback, load, load_meta

    monkeypatch.chdir(tmp_path)
    makers = [lambda: Recorder(empty), lambda: load(empty), lambda: load_meta(empty)]
    if isinstance(empty, str):  # a callback's target is a str path, a Recorder or None
        makers.append(lambda: RecorderCallback(empty))
    for make in makers:
        with pytest.raises(RecordError, match="record path is empty") as err:
            make()
        assert len(str(err.value).splitlines()) == 1
    assert os.listdir(tmp_path) == []


_KILLED_LOOP = """
import os, signal, sys, warnings
from nasdiag.record import RecorderCallback
warnings.simplefilter("ignore")
callback = RecorderCallback(sys.argv[1], flush_every=8, flush_seconds=None)
for step in range(1, 100):
    callback.on_step_end(step, {"scalars/a": float(step)})
    if step == 3:
        callback.on_epoch_end(0)  # hands over a partial batch: steps 1, 2 (3 stays open for its epoch statistics)
    if step == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("killed_at", [9, 10, 17, 18])
def test_a_loop_killed_after_an_epoch_end_loses_at_most_flush_every_rows_plus_the_open_one(tmp_path, killed_at):
    # docs/schema.md, "Buffered rows": at most flush_every rows (plus the callback's open row) are lost to a SIGKILL.
    # An epoch end hands the recorder a partial batch (2 rows here), which it held until its buffer filled, while the
    # callback gathered a whole batch of 8 more on top: killed after step 10, none of the 10 rows was on disk.
    import subprocess
    import sys

    path = tmp_path / "run.h5"
    done = subprocess.run([sys.executable, "-c", _KILLED_LOOP, str(path), str(killed_at)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-500:]
    steps, values, logged = _plain_rows(path, "scalars/a")  # every committed row, whole and in order
    assert steps.tolist() == list(range(1, len(steps) + 1)) and values.tolist() == [float(s) for s in steps]
    assert logged.all()
    assert killed_at - len(steps) <= 8 + 1


def test_a_callback_hook_called_from_another_thread_while_one_runs_is_refused_not_merged_into_its_row(tmp_path):
    # Two threads feeding one RecorderCallback: a value of one step was recorded under another step (seen: step 2269
    # holding 1835), with no error. The Recorder refuses a second thread; the callback now does too, at the call.
    import threading
    from collections.abc import Mapping

    from nasdiag.record import RecorderCallback

    inside, go_on = threading.Event(), threading.Event()

    class Slow(Mapping):
        """Statistics whose reading, inside the hook, waits until the other thread has called in."""

        def __init__(self, values):
            self.values = values

        def __getitem__(self, key):
            return self.values[key]

        def __len__(self):
            return len(self.values)

        def __iter__(self):
            inside.set()
            assert go_on.wait(30)
            return iter(self.values)

    path = tmp_path / "run.h5"
    callback = RecorderCallback(path, flush_every=4, flush_seconds=None)
    callback.on_step_end(1, {"scalars/a": 1.0})
    first = threading.Thread(target=callback.on_step_end, args=(2, Slow({"scalars/a": 2.0})))
    first.start()
    assert inside.wait(30)
    try:
        with pytest.raises(RecordError, match="another thread") as err:
            callback.on_step_end(3, {"scalars/a": 30.0})
        assert len(str(err.value).splitlines()) == 1
    finally:
        go_on.set()
        first.join(30)
    callback.on_step_end(3, {"scalars/a": 3.0})
    callback.close()
    steps, values, logged = _plain_rows(path, "scalars/a")
    assert steps.tolist() == [1, 2, 3] and values.tolist() == [1.0, 2.0, 3.0] and logged.all()


_FORKED = """
import os, signal, sys, warnings
warnings.simplefilter("ignore")
from nasdiag.record import Recorder
folder = sys.argv[1]
parent = Recorder(os.path.join(folder, "parent.h5"), flush_seconds=None)
parent.log(0, {"scalars/a": 0.0})
children = []
for how in ("exit", "sigterm"):
    pid = os.fork()
    if pid == 0:
        child = Recorder(os.path.join(folder, how + ".h5"), flush_seconds=None)  # never closed by the child's code
        for step in range(3):
            child.log(step, {"scalars/a": float(step)})
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        sys.exit(0)
    children.append(pid)
print([os.waitpid(pid, 0)[1] for pid in children], flush=True)
parent.log(1, {"scalars/a": 1.0})
parent.close()
"""


def test_a_recorder_a_forked_child_opens_is_flushed_at_its_exit_and_sigterm_while_the_parent_holds_one(tmp_path):
    # docs/schema.md, Durability: buffered rows are written at SIGTERM and at interpreter exit. The guard skipped
    # every recorder in a process other than the one that first installed its handler, so a child forked while the
    # parent held a recorder lost the rows of its own recorder (none on disk) and left its lock behind.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FORKED, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1000:]
    for how in ("exit", "sigterm"):
        steps, values, logged = _plain_rows(str(tmp_path / f"{how}.h5"), "scalars/a")
        assert steps.tolist() == [0, 1, 2] and values.tolist() == [0.0, 1.0, 2.0] and logged.all(), how
        assert not (tmp_path / f"{how}.h5.lock").exists()
    steps, values, _ = _plain_rows(str(tmp_path / "parent.h5"), "scalars/a")  # the children never touched it
    assert steps.tolist() == [0, 1] and values.tolist() == [0.0, 1.0]
