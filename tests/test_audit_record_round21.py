"""Round-21 audit of the record (nasdiag/record): the recorder's contracts checked with a reader of this file's own,
plain h5py (never nasdiag's reader to check nasdiag's writer).

References are this file's own: values logged here are kept in numpy and the segments are read back with plain h5py
as docs/schema.md's recipe says (committed rows up to the first ``-1`` of ``/step``, ``/present`` for the absent rows).

Defects these tests found (each fails without its fix):
- a meta key longer than an HDF5 attribute name holds (65535 characters and up; other keys of /meta are attribute
  names) passed the meta check and raised h5py's ``KeyError: 'Unable to delete attribute (decoded name length is
  invalid)'`` traceback out of ``Recorder(...)``; one RecordError line at the construction, and the longest key that
  fits round-trips.
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
