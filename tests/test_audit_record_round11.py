"""Round-11 audit of the record (nasdiag/record, the resume path): names, steps and values at the edges of the
documented contract, checked against plain h5py readings of the files made here (never nasdiag reading itself)."""

import os

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
