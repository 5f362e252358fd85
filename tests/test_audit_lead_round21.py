"""Lead's round-21 finding: a record named without an extension deleted a user's file.

The recorder builds each segment under ``<segment>.tmp`` and, on opening, removes such files as leftovers of a writer
killed while building one. A record named ``run`` (no extension) builds in ``run.tmp``: a user's own ``run.tmp`` (notes,
another program's output) was deleted, both by ``Recorder("run")`` and by ``nasdiag search --out run``. A file the
recorder leaves there is empty or begins with the HDF5 signature (a segment is written as one image from its first byte,
see record/writer.py ``_write_image``), so anything else is refused in one line and left as it was; a real leftover
(the HDF5 image of a killed writer, whole or torn) is still cleared.
"""
from __future__ import annotations

import numpy as np
import pytest

from nasdiag.record import Recorder, RecordError
from test_cli_errors import TINY, snapshot

USER_TEXT = b"my notes of the run, not an HDF5 file\n"


def test_a_recorder_named_without_an_extension_keeps_a_users_tmp_file(tmp_path):
    (tmp_path / "run.tmp").write_bytes(USER_TEXT)
    before = snapshot(tmp_path)
    with pytest.raises(RecordError, match=r"run\.tmp is not a segment this recorder was building.*move it away"):
        Recorder(str(tmp_path / "run"))
    assert snapshot(tmp_path) == before  # no record, no lock, the user's file untouched


@pytest.mark.parametrize("leftover", [b"", b"\x89HDF\r", b"\x89HDF\r\n\x1a\n" + bytes(100)], ids=["empty", "torn", "image"])
def test_a_killed_writers_leftover_is_still_cleared(leftover, tmp_path):
    (tmp_path / "run.h5.tmp").write_bytes(leftover)
    with Recorder(str(tmp_path / "run.h5")) as rec:
        rec.log(0, {"loss": np.float64(1.0)})
    assert not (tmp_path / "run.h5.tmp").exists()
    assert (tmp_path / "run.h5").exists()


def test_search_out_without_an_extension_keeps_a_users_tmp_file(tmp_path, capsys):
    from nasdiag.cli import main

    (tmp_path / "run.tmp").write_bytes(USER_TEXT)
    before = snapshot(tmp_path)
    code = main(["search", *TINY, "--method", "darts", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "run.tmp is in the way" in err[0] and "ending in .h5" in err[0], err
    assert snapshot(tmp_path) == before
