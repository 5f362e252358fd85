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
"""

from __future__ import annotations

import json
import os

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
