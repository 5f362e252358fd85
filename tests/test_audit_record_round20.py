"""Round-20 audit of the record (nasdiag/record): the reader's API as a user's batch script uses it, values and
names at the edges of docs/schema.md, and what `nasdiag report` makes of such records.

References are this file's own: values logged here are kept in numpy and the files are read back with plain h5py
(never with nasdiag's reader).

Defects these tests found (each fails without its fix):
- a Python int beyond int64 logged first on a path (``2**63``) made the path uint64, where docs/schema.md says a
  Python int's path is int64 (a later negative int then refused), and one beyond uint64 (``2**64``) was refused as
  'dtype object cannot be recorded; log bool, int or float values' of what is an int; one line saying it is beyond
  int64, and what to log instead.
- ``Recorder("runs/")`` (a path ending in '/', a folder's name) made a file ``runs`` that ``load("runs/")`` did not
  find, and ``Recorder("run.h5/", resume=True)`` of an existing record said run.h5 'appeared while this recorder held
  the lock; another program writes there'; one line saying the path names a folder, as for an existing folder.
- ``meta={"seed": 2**63}`` (a seed beyond the int64 root attribute docs/schema.md names) passed the meta check and
  raised numpy's OverflowError traceback at the first segment's creation; one RecordError line at the construction.
- a record named like another record's lock (``run.h5.lock`` beside a new ``run.h5``) was truncated to the
  writer's pid line by ``Recorder("run.h5")`` and deleted at its close; one RecordError line, the file left whole.
- `nasdiag report` (and `nasdiag plot`) of a record with a scalar per layer drew one panel per ``scalars/<name>``
  outside the meaning groups: 300 scalars took a minute (constrained layout of 150 rows of panels), 10^4 had not
  finished after 10 minutes (a figure of 5000 rows); the panels past ``MAX_PANELS`` are named in the title, not drawn
  (nasdiag/plot/scalars.py, outside this area); 10^4 scalars now report in seconds.

Checked and found right (scratch runs, not kept as tests): a path first logged at step 50 (new segment; rows before it
NaN/0/False with ``valid/`` False, dtype kept: int32, uint8, bool, float16, (2, 3) int64, on disk too); the same step
twice and a step going back within a session (one line each), a replayed step after a resume (the later segment's
row wins whole, its unlogged paths fill, not the older row); float32 then a float64 value after a resume (refused; a
Python float is cast); Python ints/floats/bools into paths of other kinds, overflow to ±inf counted in
``nonfinite_count`` (float16 and float32) and in ``load_meta``; -0.0 and 5e-324; str, bytes, object, datetime,
void, structured, ragged lists (one line each); path names with spaces, '..', '.', '//', a leading or trailing '/',
Unicode, reserved roots, a path and its prefix (one line each); meta that is not JSON (sets, objects, bytes, numpy
floats: one line), int keys and tuples (a resume with the same meta is no change), reserved keys, cell types with
'/'; 10^4 scalar paths (written in 11 s, load 2 s, values equal plain h5py); two reader processes polling `load`
while a writer rolls over 200 segments and adds a path (exact prefixes, never shrinking); `live_holder` against
/proc/locks; `nasdiag report` of these records (NaN counts, a (T, 1) scalar named under "Not drawn", segments).

Left alone: duplicate ``op_names`` and an empty ``op_names`` are accepted (a K = 0 row is refused anyway);
``meta={"x": np.float32(1)}`` is refused as not JSON while ``seed=np.int64(3)`` is taken (the message says what to
pass); a Python int list beyond int64 (``[2**63]``) becomes a uint64 path, as numpy makes it (docs speak of scalars).
A record named without an extension (``run``) builds segment 0 as ``run.tmp`` and segment 1 as ``run.seg0001.tmp``,
so its writer removes a file ``run.tmp`` of the user's (or a record of that name and its later segments) beside it
as a segment left being built: telling a killed writer's file from another record needs more than a name; a record
name with an extension (``run.h5``) has no such neighbour.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from nasdiag.record import RecordError, Recorder, load


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


@pytest.mark.parametrize("existing", [False, True])
def test_a_record_path_ending_in_a_slash_names_a_folder_and_is_refused_in_one_line(tmp_path, existing):
    if existing:
        with Recorder(tmp_path / "run.h5") as rec:
            rec.log(0, {"scalars/x": 1.0})
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(RecordError, match=r"names a folder") as err:
        Recorder(f"{tmp_path}/run.h5/", resume=existing)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing made, nothing changed
    if existing:
        assert _h5_column(tmp_path / "run.h5", "scalars/x").tolist() == [1.0]


@pytest.mark.parametrize("seed", [2**63, 2**64, np.uint64(2**63)])
def test_a_seed_beyond_int64_is_one_record_error_line_leaving_no_file(tmp_path, seed):
    with pytest.raises(RecordError, match=r"meta\['seed'\]") as err:
        Recorder(tmp_path / "run.h5", meta={"seed": seed})
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []
    with Recorder(tmp_path / "run.h5", meta={"seed": 2**63 - 1}) as rec:  # the largest int64 is a seed
        rec.log(0, {"scalars/x": 1.0})
    with h5py.File(tmp_path / "run.h5", "r") as f:
        assert int(f.attrs["seed"]) == 2**63 - 1


def test_a_record_named_like_the_lock_of_another_is_not_overwritten_by_that_ones_writer(tmp_path):
    lock_named = tmp_path / "run.h5.lock"
    with Recorder(lock_named) as rec:
        rec.log(0, {"scalars/x": 2.5})
    before = lock_named.read_bytes()
    with pytest.raises(RecordError, match=r"run\.h5\.lock") as err:
        Recorder(tmp_path / "run.h5")
    assert "\n" not in str(err.value)
    assert lock_named.read_bytes() == before
    assert not (tmp_path / "run.h5").exists()
    assert _h5_column(lock_named, "scalars/x").tolist() == [2.5]


def test_the_scalars_figure_of_a_record_of_many_scalars_draws_a_bounded_number_of_panels(tmp_path):
    import re

    import matplotlib.pyplot as plt

    from nasdiag.plot.scalars import scalar_curves

    names = [f"m{i}" for i in range(60)]  # none of a meaning group: a panel each
    file = tmp_path / "many.h5"
    with Recorder(file, flush_every=4) as rec:
        for step in range(3):
            rec.log(step, {"scalars/train_loss": 1.0 / (step + 1), **{f"scalars/{n}": float(step + i) for i, n in enumerate(names)}})
    fig = scalar_curves(load(file))
    try:
        drawn = [ax.get_title(loc="left") for ax in fig.axes if ax.axison]
        assert drawn[0] == "losses"  # the meaning groups come first and are kept
        assert len(drawn) <= 30  # was 61: one per scalar outside the meaning groups
        left_out = int(re.search(r"(\d+) more not drawn", fig._suptitle.get_text()).group(1))
        assert left_out + len(drawn) - 1 == len(names)  # every scalar is drawn or counted in the title
    finally:
        plt.close(fig)
