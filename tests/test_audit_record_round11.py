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


def _plain_rows(file, path):
    """The committed rows of ``path`` in one segment, and its logged flags, read with plain h5py as docs/schema.md shows."""
    with h5py.File(file, "r", swmr=True) as f:
        steps = f["step"][()]
        n = int(np.argmax(steps < 0)) if (steps < 0).any() else len(steps)
        paths = [p.decode() if isinstance(p, bytes) else p for p in f["present"].attrs["paths"]]
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
