"""A SIGKILL inside a write: the worst case of a crash, which .ci/run met once (stop 27).

Linux copies a write into the page cache page by page and a fatal signal stops it between pages, so
a kill can leave the first pages of one write and not the rest. A dataset's object header that
straddled a page boundary was then half old, half new: its checksum failed, `load` raised h5py's
KeyError, and the whole segment was lost. Segments now use HDF5's paged aggregation (schema.FILE_SPACE),
which keeps every metadata block below a page inside one page. scripts/tear_writes.c produces the
tear on purpose (LD_PRELOAD); scripts/record_kill_trials.py --tear runs many such trials."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest
from record_kill_trials import _pythonpath, build_tear_library, expected_row, tear_trial

from nasdiag.record import RecordError, Recorder, RecordWarning, load
from nasdiag.record import schema
from nasdiag.record.schema import list_segments

PAGE = mmap.PAGESIZE


def _write(path, late_from, rows=200, flush_every=3):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(path, meta={"method": "crashtest", "seed": 0}, flush_every=flush_every, flush_seconds=None) as rec:
            for step in range(rows):
                rec.log(step, expected_row(step, 0, late_from))


def _object_headers(file) -> dict[str, tuple[int, int, int]]:
    """Every dataset's object header: (address, bytes, number of blocks), from HDF5's own object info."""
    headers = {}
    with h5py.File(file, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                info = h5py.h5o.get_info(obj.id)
                headers[name] = (info.addr, info.hdr.space.total, info.hdr.nchunks)
        f.visititems(visit)
    return headers


@pytest.mark.parametrize("late_from", [None, 0, 33, 150], ids=["one segment", "late column at once", "late at 33", "late at 150"])
def test_every_one_block_object_header_lies_inside_one_page(tmp_path, late_from):
    """Each flush rewrites every dataset's object header (its extent grows); one that crossed a page
    boundary could be torn by a kill. (Headers of several blocks are checked by the tear trials below:
    h5py does not give the address of a continuation block.)"""
    path = tmp_path / "run.h5"
    _write(path, late_from)
    checked = 0
    for _, file in list_segments(str(path)):
        for name, (address, size, blocks) in _object_headers(file).items():
            if blocks == 1:
                checked += 1
                assert address // PAGE == (address + size - 1) // PAGE, (
                    f"{file}: the object header of /{name} spans bytes {address}..{address + size - 1}, "
                    f"across a {PAGE}-byte page boundary"
                )
    assert checked >= 4  # /step, /digest and the data datasets at least


@pytest.fixture(scope="module")
def tear_library(tmp_path_factory):
    library = build_tear_library(tmp_path_factory.mktemp("tear"))
    if library is None:
        pytest.skip("the torn-write injector needs a C compiler (cc) on Linux")
    return library


@pytest.mark.parametrize("tear_at", [6, 7, 9, 12, 20])
def test_a_kill_inside_a_metadata_write_leaves_the_committed_rows(tmp_path, tear_library, tear_at):
    """Seed 7: flush_every 8 and a late column at step 38, which opens a second segment; HDF5 rewrites
    that segment's metadata on every flush. The tear_at-th metadata write that crosses a page is cut
    after its first page and the writer is killed; tear_trial checks the record holds exactly the
    committed rows (at most one buffer lost) and that a resume leaves the crashed files alone."""
    report = tear_trial(tmp_path, 7, tear_at, tear_library, metadata_only=True)
    assert report["rows_on_disk"] >= report["reported"]


@pytest.mark.parametrize("seed, tear_at", [(7, 3), (7, 40), (7, 150), (8, 25), (11, 20), (5, 100), (1, 200), (2, 50)])
def test_a_kill_inside_any_write_leaves_the_committed_rows(tmp_path, tear_library, seed, tear_at):
    """Chunks of rows are rewritten whole on each flush (the committed rows in them again, unchanged), so
    these writes cross pages; cutting one must leave the committed rows as they were."""
    report = tear_trial(tmp_path, seed, tear_at, tear_library)
    assert report["torn"], "the writer made fewer page-crossing writes than tear_at; the trial tested nothing"


def _flip_a_byte_of_the_step_header(file) -> None:
    with h5py.File(file, "r") as f:
        info = h5py.h5o.get_info(f["step"].id)
        address, size = info.addr, info.hdr.space.total
    with open(file, "r+b") as fh:
        fh.seek(address + size // 2)
        byte = fh.read(1)
        fh.seek(address + size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_a_segment_whose_step_header_is_damaged_is_reported_and_salvaged(tmp_path):
    """A record torn by an older nasdiag (or by a disk): `load` names the damaged segment in a
    RecordError, and salvage returns the intact segments before it."""
    path = tmp_path / "run.h5"
    _write(path, late_from=40)
    files = list_segments(str(path))
    assert len(files) == 2
    _flip_a_byte_of_the_step_header(files[1][1])
    with pytest.raises(RecordError, match=r"seg0001.*structure cannot be read.*salvage=True\) returns the 40 intact rows"):
        load(path)
    with pytest.warns(RecordWarning, match="40 intact rows"):
        out = load(path, salvage=True)
    np.testing.assert_array_equal(out["step"], np.arange(40))
    np.testing.assert_array_equal(out["scalars/i"], np.arange(40))


def _wide_row(step: int, width: int = 4096) -> dict:
    """A 16 KiB row (one HDF5 chunk each) and a scalar."""
    return {"wide/x": np.full(width, step, np.float32), "scalars/a": float(step)}


@pytest.mark.parametrize("flush_every, rows, segments", [(1, 9, 5), (2, 9, 5), (3, 10, 4)])
def test_a_segment_is_closed_before_its_datasets_pass_the_chunk_limit(tmp_path, monkeypatch, flush_every, rows, segments):
    """With the limit set to 2 chunks, a dataset of one row per chunk fills a segment every 2 rows; a
    batch larger than that (flush_every=3) stays whole in its own segment. Every row loads, in order,
    and a resume goes on in the next segment."""
    monkeypatch.setattr(schema, "MAX_SEGMENT_CHUNKS", 2)
    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=flush_every, flush_seconds=None) as rec:
        for step in range(rows):
            rec.log(step, _wide_row(step))
    assert len(list_segments(str(path))) == segments
    out = load(path)
    np.testing.assert_array_equal(out["step"], np.arange(rows))
    np.testing.assert_array_equal(out["wide/x"], np.repeat(np.arange(rows, dtype=np.float32)[:, None], 4096, axis=1))
    with Recorder(path, resume=True, flush_seconds=None) as rec:
        assert rec.last_step == rows - 1
        rec.log(rows, _wide_row(rows))
    np.testing.assert_array_equal(load(path)["step"], np.arange(rows + 1))


WIDE_WRITER = """
import sys
import numpy as np
from nasdiag.record import Recorder
with Recorder(sys.argv[1], flush_every=64, flush_seconds=None) as rec:
    for step in range(int(sys.argv[2])):
        rec.log(step, {"wide/x": np.full(4096, step, np.float32), "scalars/a": float(step)})
print("DONE", flush=True)
"""


def test_a_long_run_writes_no_metadata_block_across_a_page(tmp_path, tear_library):
    """9000 rows of 16 KiB: one chunk per row, past the ~8192 chunks at which HDF5's chunk index writes
    blocks of 4118 bytes. The injector cuts the first metadata write that crosses a page and kills the
    writer; the writer must end normally (there was none), with every row on disk."""
    path = tmp_path / "wide.h5"
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "LD_PRELOAD": tear_library,
           "NASDIAG_TEAR_AT": "1", "NASDIAG_TEAR_PAGE": str(PAGE), "NASDIAG_TEAR_METADATA": "1"}
    done = subprocess.run([sys.executable, "-c", WIDE_WRITER, str(path), "9000"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "DONE" in done.stdout, (
        f"the writer was killed at a metadata write across a page (exit {done.returncode}): {done.stderr[-500:]}"
    )
    out = load(path)
    np.testing.assert_array_equal(out["step"], np.arange(9000))
    expected = np.arange(0, 9000, 997, dtype=np.float32)[:, None]
    np.testing.assert_array_equal(out["wide/x"][::997, ::1000], np.repeat(expected, 5, axis=1))
    for _, file in list_segments(str(path)):  # 150 MB
        os.remove(file)
