"""Round-20 audit of the record (nasdiag/record): the reader's API as a user's batch script uses it, values and
names at the edges of docs/schema.md, and what `nasdiag report` makes of such records.

References are this file's own: values logged here are kept in numpy and the files are read back with plain h5py
(never with nasdiag's reader).

Defects these tests found (each fails without its fix):
- a Python int beyond int64 logged first on a path (``2**63``) made the path uint64, where docs/schema.md says a
  Python int's path is int64 (a later negative int then refused), and one beyond uint64 (``2**64``) was refused as
  'dtype object cannot be recorded; log bool, int or float values' of what is an int; one line saying it is beyond
  int64, and what to log instead.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder


def _h5_column(file, path):
    """The committed rows of ``path`` in one segment, read with plain h5py (docs/schema.md's recipe)."""
    with h5py.File(file, "r", swmr=True) as f:
        steps = f["step"][()]
        n = int(np.argmax(steps < 0)) if (steps < 0).any() else len(steps)
        return f[path][:n]


@pytest.mark.parametrize("value", [2**63, 2**64, -(2**63) - 1])
def test_a_python_int_beyond_int64_first_logged_is_refused_in_one_line_not_made_uint64(tmp_path, value):
    file = tmp_path / "run.h5"
    with Recorder(file, flush_every=2) as rec:
        with pytest.raises(RecordError, match=r"beyond int64") as err:
            rec.log(0, {"scalars/big": value, "scalars/other": 1})
        assert "\n" not in str(err.value)
        # the edges of int64 are taken, as int64, and nothing of the refused row was written
        rec.log(1, {"scalars/big": -(2**63), "scalars/other": 2})
        rec.log(2, {"scalars/big": 2**63 - 1, "scalars/other": 3})
    big = _h5_column(file, "scalars/big")
    assert big.dtype == np.int64
    assert big.tolist() == [-(2**63), 2**63 - 1]
    assert _h5_column(file, "step").tolist() == [1, 2]
