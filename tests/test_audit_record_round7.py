"""Recorder audit, round 7: the segment rollover of schema.MAX_SEGMENT_CHUNKS (monkeypatched small) under live
readers in another process, resumes and new paths; segment numbers past 9999; many segments; whole searches killed
(SIGKILL, and inside a write by scripts/tear_writes.c) and resumed.

References are this file's own: values logged as known functions of the step (and of the session that logged
them), file names built by hand, plain h5py reads, and an uninterrupted run of the same seed for the searches."""

from __future__ import annotations

import os

from nasdiag.record import schema


def test_segments_past_9999_belong_to_their_record(tmp_path):
    """segment_path names segment 10000 ``run.seg10000.h5``; list_segments looked for exactly four digits, so from
    there on `load` silently left the newest rows out and a resume tried to create an existing segment again."""
    path = str(tmp_path / "run.h5")
    indices = [0, 1, 9999, 10000, 10001, 123456]
    for index in indices:
        open(schema.segment_path(path, index), "w").close()
    assert os.path.basename(schema.segment_path(path, 10000)) == "run.seg10000.h5"
    for other in ("run.seg01234.h5", "run.seg0000.h5", "run.seg12x45.h5", "run.seg123.h5", "run.seg10000.h5.tmp"):
        open(tmp_path / other, "w").close()  # not a name segment_path gives to any segment of run.h5
    assert schema.list_segments(path) == [(index, schema.segment_path(path, index)) for index in indices]
    for index in indices[1:]:
        assert schema.segment_owner(schema.segment_path(path, index)) == path
    for other in ("run.seg01234.h5", "run.seg0000.h5", "run.seg12x45.h5", "run.seg123.h5"):
        assert schema.segment_owner(str(tmp_path / other)) is None, other
    bare = str(tmp_path / "bare")  # a record without a suffix
    open(bare, "w").close()
    open(schema.segment_path(bare, 10000), "w").close()
    assert schema.list_segments(bare) == [(0, bare), (10000, bare + ".seg10000")]
    assert schema.segment_owner(bare + ".seg10000") == bare
