"""Round-21 audit of the record (nasdiag/record): the recorder's contracts checked with a reader of this file's own,
plain h5py (never nasdiag's reader to check nasdiag's writer).

References are this file's own: values logged here are kept in numpy and the segments are read back with plain h5py
as docs/schema.md's recipe says (committed rows up to the first ``-1`` of ``/step``, ``/present`` for the absent rows).

Defects these tests found (each fails without its fix):
- a meta key longer than an HDF5 attribute name holds (65535 characters and up; other keys of /meta are attribute
  names) passed the meta check and raised h5py's ``KeyError: 'Unable to delete attribute (decoded name length is
  invalid)'`` traceback out of ``Recorder(...)``; one RecordError line at the construction, and the longest key that
  fits round-trips.
- a record path that is a loop of symbolic links (``a.h5 -> b.h5 -> a.h5``) was refused as ``a.h5 appeared while this
  recorder held the lock; another program writes there`` (for a new record, a resume and an overwrite alike), which
  sent the user looking for another writer; one line saying the path is a loop of links.
- a record path naming a named pipe (a FIFO; ``/dev/stdout`` and a shell's ``<(...)`` are others) made ``load``,
  ``load_meta`` and ``Recorder(..., resume=True)`` wait for ever in h5py's open, and ``reader.not_a_record`` (which
  ``nasdiag search --out ... --force`` asks before replacing a file) likewise in its ``open``; one RecordError line
  saying what the file is (``not_a_record`` says it); a named pipe where the recorder builds a segment (``run.h5.tmp``)
  made ``Recorder("run.h5")`` wait for ever reading its first bytes; refused as another program's file.
- a record path holding a NUL character was os.path's ``ValueError: embedded null byte`` traceback out of
  ``Recorder(...)``, where every error is a `RecordError`; one line.
- ``Recorder.segment_file`` of a recorder opened with a relative path named, after an ``os.chdir``, a file of the new
  working folder (that does not exist) while the rows went, as documented, next to the record in the folder of the
  moment it opened; it names the file written.
- a record named like a later segment of another name (``x.seg0001.h5``, which the library takes when no ``x.h5``
  exists) was taken for segment 1 of a record ``x.h5`` made later beside it: ``Recorder("x.h5")`` said 'a record already
  exists at x.h5' (there was none), a resume called x.h5 damaged, and ``Recorder("x.h5", overwrite=True)`` (``nasdiag
  search --out x.h5 --force``) deleted the other record; one RecordError line naming it, the record left whole.
- a file at the record path that is not a record (a text file, another program's HDF5 file) was called 'a record
  already exists at notes.txt; pass resume=True ... or overwrite=True to replace it', and ``overwrite=True`` then
  deleted it (``nasdiag search --out`` refuses such a file even with ``--force``); a resume called it a damaged
  record with 0 rows to salvage. One RecordError line saying it is not a record, the file left as it was.
- a record path that is a symbolic link to a file in a folder not made yet (``latest.h5 -> runs/today/run.h5``) was
  refused as 'cannot create lock file ...: No such file or directory', where the Recorder's docstring says the
  parent folder is created if needed: it created the link's folder (which exists), not the target's, where every
  file of the record goes.
- a meta value nested deeper than json can encode (a list in a list ... 10^5 deep, in ``config`` or another key) was
  json's ``RecursionError`` traceback out of ``Recorder(...)``; one RecordError line.

Checked and found right (scratch runs, not kept as tests), each read back with plain h5py: float16/32/64, float128,
int8..uint64 (2**64 - 1), bool, np.bool_, 0-d and n-d arrays, CPU tensors (float64, bool, uint16/32/64, bfloat16 and
float8 as float32, negated, expanded, transposed), numpy scalars, bit for bit at their steps, directly and through
`RecorderCallback` (with an epoch row and a path first handed over mid-run); paths first logged at a later step (earlier
rows NaN/0/False with ``/present`` False, in the old and the new segment); a row of another shape refused in one line
with the rows before and after it kept; a plain h5py reader process opening every segment by name while the writer
appends (flush_every=3, 600 rows, 12 paths added late, 13 segments): 427 looks, every committed row equal to its
step's values and flags, never a torn one; a SIGKILLed writer (flush_every=5, a path first logged at step 7): the
rows up to its last flush in its segments, the resume's ``last_step`` their last step, the merged record each step
once; empty rows; meta with nested dicts, Unicode (non-BMP too), NaN/±inf (in ``config`` and other keys: a resume with
the same meta is no change), 300 kB and 2 MB strings, a 5 MB config, 20000 keys, 10^5 edge names, a 70000-character
cell type, round-tripping through a resume; a relative path with ``os.chdir`` before the first flush, across a
rollover and at close; relative links to other folders, written and resumed through the link; record names with
``[``, ``*``, ``?``, spaces, non-ASCII, several dots, a leading dot; no memory growth of the recorder or the callback
over 10^4 steps (tracemalloc: what grows, grows alike in a loop of torch alone).

Left alone: meta NaN/inf are stored as Python's JSON (``NaN``, ``Infinity``), which Python reads back but strict JSON
parsers refuse (docs/schema.md says JSON str); ``load_meta`` returns ``nasdiag/torch/h5py/hdf5_version`` but not the
root attributes ``numpy_version`` and ``python_version`` (its docstring lists the four; a test of round 18 pins the
set); a finite Python number that overflows a float32/float16 path also raises numpy's ``RuntimeWarning: overflow
encountered in cast`` beside the documented RecordWarning; a 1-element 1-d array is taken as a step (the docs speak of
0-d); ``load("x.h5")`` beside a record of its own named ``x.seg0001.h5`` (and no x.h5) calls x.h5 damaged (segment 0
missing) rather than absent; a meta nested 990 deep passes the meta check and fails at the segment's creation as
"cannot create record segment ...: maximum recursion depth exceeded" (one line, but not naming the meta key).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder


def test_a_meta_key_longer_than_an_hdf5_attribute_name_is_one_record_error_line_and_the_longest_round_trips(tmp_path):
    limit = 65534  # HDF5 keeps an attribute name with its NUL in 16 bits (H5O_attr_decode: 'decoded name length')
    path = tmp_path / "run.h5"
    with pytest.raises(RecordError) as info:
        Recorder(path, meta={"k" * (limit + 1): 1})
    message = str(info.value)
    assert "\n" not in message and "meta key" in message and len(message) < 300
    assert os.listdir(tmp_path) == []  # no placeholder, no lock, no .tmp
    longest = "k" * limit
    with Recorder(path, meta={longest: {"nested": [1.5, "é→"]}}) as rec:
        rec.log(0, {"scalars/a": 1.0})
    with h5py.File(path, "r") as f:
        assert json.loads(f["meta"].attrs[longest]) == {"nested": [1.5, "é→"]}


@pytest.mark.parametrize("options", [{}, {"resume": True}, {"overwrite": True}])
def test_a_record_path_that_is_a_loop_of_symbolic_links_is_named_so_in_one_line(tmp_path, options):
    os.symlink("b.h5", tmp_path / "a.h5")
    os.symlink("a.h5", tmp_path / "b.h5")
    with pytest.raises(RecordError) as info:
        Recorder(tmp_path / "a.h5", **options)
    message = str(info.value)
    assert "\n" not in message and "loop" in message and "another program" not in message
    assert sorted(os.listdir(tmp_path)) == ["a.h5", "b.h5"]  # the links as they were, no lock left
    assert os.readlink(tmp_path / "a.h5") == "b.h5" and os.readlink(tmp_path / "b.h5") == "a.h5"


def test_a_named_pipe_at_the_record_path_is_one_line_for_load_and_resume_not_a_hang(tmp_path):
    pipe = tmp_path / "run.h5"
    os.mkfifo(pipe)
    # in a child with a time limit: the defect is a wait for ever, which must fail this test, not hang the suite
    code = f"""
import os
import warnings
warnings.simplefilter("ignore")
from nasdiag.record import RecordError, Recorder, load, load_meta
from nasdiag.record.reader import not_a_record
print(not_a_record({str(pipe)!r}))
for call in (lambda: load({str(pipe)!r}), lambda: load_meta({str(pipe)!r}), lambda: Recorder({str(pipe)!r}, resume=True)):
    try:
        call()
    except RecordError as err:
        print("RecordError", err)
os.rename({str(pipe)!r}, {str(pipe)!r} + ".tmp")  # where the recorder builds the segment
try:
    Recorder({str(pipe)!r})
except RecordError as err:
    print("RecordError", err)
os.rename({str(pipe)!r} + ".tmp", {str(pipe)!r})
"""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("reading a named pipe as a record waits for ever")
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    assert len(lines) == 5 and "pipe" in lines[0]
    assert all(line.startswith("RecordError") and "named pipe" in line for line in lines[1:4])
    assert lines[4].startswith("RecordError") and "run.h5.tmp" in lines[4] and "move it away" in lines[4]
    assert sorted(os.listdir(tmp_path)) == ["run.h5"]  # the pipe as it was, no lock left
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)


def test_a_record_path_with_a_nul_character_is_one_record_error_line(tmp_path):
    for path in (str(tmp_path / "a\x00b.h5"), os.fsencode(tmp_path / "a\x00b.h5")):
        with pytest.raises(RecordError, match="NUL"):
            Recorder(path)
    assert os.listdir(tmp_path) == []


def test_the_segment_file_of_a_relative_record_names_the_file_written_after_a_chdir(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    rec = Recorder("run.h5", flush_every=2, flush_seconds=None)
    try:
        monkeypatch.chdir(tmp_path / "b")
        for step in range(3):
            rec.log(step, {"scalars/a": float(step), **({"scalars/late": step} if step == 2 else {})})
        rec.flush()  # rows 0-1 in run.h5, row 2 (a path first logged after the first flush) in run.seg0001.h5
        written = tmp_path / "a" / "run.seg0001.h5"
        assert os.path.samefile(rec.segment_file, written)
    finally:
        rec.close()
    assert os.listdir(tmp_path / "b") == []
    with h5py.File(written, "r") as f:  # plain h5py: the row is where segment_file said
        assert f["step"][()].tolist() == [2] and f["scalars/late"][()].tolist() == [2]


@pytest.mark.parametrize("options", [{}, {"resume": True}, {"overwrite": True}])
def test_a_record_named_like_a_later_segment_is_neither_deleted_nor_taken_by_the_record_of_that_name(tmp_path, options):
    other = tmp_path / "x.seg0001.h5"  # a record of its own: no x.h5 beside it when it was made
    values = np.linspace(-1.0, 1.0, 5)
    with Recorder(other, flush_every=2) as rec:
        for step, value in enumerate(values):
            rec.log(step, {"scalars/v": float(value)})
    before = other.read_bytes()
    with pytest.raises(RecordError) as info:
        Recorder(tmp_path / "x.h5", **options)
    message = str(info.value)
    assert "\n" not in message and "x.seg0001.h5" in message and "already exists" not in message
    assert other.read_bytes() == before and not (tmp_path / "x.h5").exists()
    with h5py.File(other, "r") as f:  # plain h5py: the other record as it was written
        assert f["step"][()].tolist() == list(range(5))
        assert f["scalars/v"][()].tobytes() == values.tobytes()


@pytest.mark.parametrize("options", [{}, {"resume": True}, {"overwrite": True}])
def test_a_file_that_is_not_a_record_is_never_called_one_nor_replaced(tmp_path, options):
    notes = tmp_path / "notes.h5"
    notes.write_text("my notes\n")
    theirs = tmp_path / "theirs.h5"
    with h5py.File(theirs, "w") as f:  # another program's HDF5 file: no /step and /present
        f["data"] = np.arange(3.0)
    for path in (notes, theirs):
        before = path.read_bytes()
        with pytest.raises(RecordError) as info:
            Recorder(path, **options)
        message = str(info.value)
        assert "\n" not in message and "not a nasdiag record" in message and "already exists" not in message
        assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["notes.h5", "theirs.h5"]


def test_a_link_to_a_record_in_a_folder_not_made_yet_makes_that_folder(tmp_path):
    link = tmp_path / "latest.h5"
    os.symlink(os.path.join("runs", "today", "run.h5"), link)  # relative, as ln -s makes it
    with Recorder(link, flush_every=2) as rec:
        for step in range(3):
            rec.log(step, {"scalars/a": float(step)})
    target = tmp_path / "runs" / "today" / "run.h5"
    assert os.path.islink(link) and sorted(os.listdir(target.parent)) == ["run.h5"]
    with h5py.File(target, "r") as f:
        assert f["step"][()].tolist() == [0, 1, 2] and f["scalars/a"][()].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("key", ["config", "notes"])
def test_a_meta_value_nested_too_deeply_for_json_is_one_record_error_line(tmp_path, key):
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(RecordError) as info:
        Recorder(tmp_path / "run.h5", meta={key: {"a": deep} if key == "config" else deep})
    assert "\n" not in str(info.value) and key in str(info.value)
    assert os.listdir(tmp_path) == []


def test_a_copy_of_segment_0_in_a_later_segments_place_is_still_damage_that_overwrite_replaces(tmp_path):
    # the refusal above is for a record of its own (another run); a copy of this run's segment 0 is damage, as before
    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=2) as rec:
        rec.log(0, {"scalars/a": 0.0})
    (tmp_path / "run.seg0001.h5").write_bytes(path.read_bytes())
    with pytest.raises(RecordError, match="damaged"):
        Recorder(path, resume=True)
    with Recorder(path, overwrite=True) as rec:
        rec.log(5, {"scalars/a": 5.0})
    assert sorted(os.listdir(tmp_path)) == ["run.h5"]
    with h5py.File(path, "r") as f:
        assert f["step"][()].tolist() == [5]
