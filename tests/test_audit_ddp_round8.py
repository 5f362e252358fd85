"""Audit round 8 of data parallelism: a `RecorderCallback` batch of rows whose paths are not all logged at the same
steps, reduced over 2 gloo ranks on CPU, against numpy references built here.

Found: the batch was stacked per path and reduced with the paths' shapes as the only check, so
- a path rank 0 logs at step 1 and rank 1 at step 2 was averaged across the two steps (silently: the shapes agree)
  and recorded at step 1; the ranks must be refused (`ReductionError`, one line) as for different paths;
- a pooled ``cost/<cell>/mean`` whose ``count`` is logged at more steps than the mean was pooled with the counts of
  other rows, or failed in numpy's broadcasting (a ValueError traceback); it now takes the counts of its own steps;
- a row logging a pooled mean without its count failed the reduction of its batch and of every later batch (the row
  stayed held): nothing more of the run was recorded; the row alone is refused, in one line, as a row of a wrong shape;
- `reduce_statistics` of a pooled mean whose count does not broadcast to it was numpy's ValueError traceback;
- every rank probes the record's folder before the process group exists: a level one rank made (or removed) while
  another probed refused the launch with 'File exists' / 'No such file or directory' (1 in 3000 lock-step probes).

Checked and found right (references of our own, not kept as tests where earlier rounds cover them): the pooled merge
of ranks holding entries never observed (count 0, mean NaN) against numpy on the concatenated samples; CostMoments.merge
with masks, far from zero, against numpy; the runner takes equal full batches on every rank (the last partial batch
of an epoch is dropped, so the rank mean of batch means is the global mean); every rank evaluates the whole val split;
test_audit_ddp_round3.py and test_search_ddp.py pass with the changes.
"""

from __future__ import annotations

import json
import os
import tempfile
import textwrap

import numpy as np
import pytest

from nasdiag.record import load

from conftest import launch_ranks

WORKER = textwrap.dedent(
    """
    import datetime, json, sys
    import numpy as np
    import torch.distributed as dist
    from nasdiag.distributed import reduce_statistics
    from nasdiag.record import RecorderCallback

    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    errors = {}

    def attempt(name, steps):
        callback = RecorderCallback(f"{out}/{name}.h5", flush_every=8, flush_seconds=None)
        try:
            for step, statistics in steps:
                callback.on_step_end(step, statistics)
            callback.close()
        except Exception as err:  # recorded for the test, on every rank
            errors[name] = [type(err).__name__, str(err)]
            callback.__exit__(type(err), err, None)

    # rank r logs scalars/x at step r + 1 only; both log scalars/loss at steps 1 and 2
    attempt("shifted", [(s, {"scalars/loss": float(s), **({"scalars/x": 10.0 * (rank + 1)} if s == rank + 1 else {})})
                        for s in (1, 2)])
    # count at every step, mean and var at steps 1 and 3
    def pooled(s):
        x = np.random.default_rng(10 * s + rank).standard_normal((2 + rank + s, 3))
        row = {"cost/normal/count": np.int64(len(x))}
        if s != 2:
            row.update({"cost/normal/mean": x.mean(0), "cost/normal/var": x.var(0)})
        return s, row
    attempt("pooled", [pooled(s) for s in (1, 2, 3)])
    # mean at steps 1..5, its count at every step but 2; batches of 2 rows
    callback = RecorderCallback(f"{out}/countless.h5", flush_every=2, flush_seconds=None)
    for s in range(1, 6):
        try:
            callback.on_step_end(s, {"cost/normal/mean": np.full(3, float(rank + s)),
                                     **({"cost/normal/count": np.int64(1 + rank)} if s != 2 else {})})
        except Exception as err:
            errors.setdefault("countless", []).append([s, type(err).__name__, str(err)])
    try:
        callback.close()
    except Exception as err:
        errors.setdefault("countless", []).append(["close", type(err).__name__, str(err)])
    try:  # a count that does not broadcast to its mean
        reduce_statistics({"cost/normal/mean": np.zeros(2), "cost/normal/count": np.ones(3, np.int64)})
    except Exception as err:
        errors["misfit"] = [type(err).__name__, str(err)]
    dist.destroy_process_group()
    with open(f"{out}/errors{rank}.json", "w") as file:
        json.dump(errors, file)
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp8")
    (out / "worker.py").write_text(WORKER)
    launch_ranks(out / "worker.py", lambda rank: [rank, f"file://{out}/pg", out])
    return out, [json.loads((out / f"errors{rank}.json").read_text()) for rank in (0, 1)]


def test_a_path_two_ranks_log_at_different_steps_is_refused_not_averaged_across_steps(ranks):
    out, errors = ranks
    for rank_errors in errors:
        kind, message = rank_errors["shifted"]
        assert kind == "ReductionError" and "\n" not in message and "steps" in message, message
    if (out / "shifted.h5").exists():  # nothing of the refused batch was recorded
        assert "scalars/x" not in load(out / "shifted.h5")


def test_a_pooled_mean_takes_the_counts_of_its_own_steps(ranks):
    out, errors = ranks
    assert all("pooled" not in e for e in errors), errors
    record = load(out / "pooled.h5")
    np.testing.assert_array_equal(record["step"], [1, 2, 3])
    mean, var = np.asarray(record["cost/normal/mean"]), np.asarray(record["cost/normal/var"])
    for row, s in enumerate((1, 2, 3)):
        samples = np.concatenate([np.random.default_rng(10 * s + r).standard_normal((2 + r + s, 3)) for r in (0, 1)])
        assert record["cost/normal/count"][row] == len(samples)  # sum over the ranks
        if s == 2:
            assert np.isnan(mean[row]).all()  # not logged at step 2
            continue
        np.testing.assert_allclose(mean[row], samples.mean(0), rtol=1e-12)  # pooled: float64 rounding only
        np.testing.assert_allclose(var[row], samples.var(0), rtol=1e-10)


def test_a_row_with_a_pooled_mean_but_no_count_is_refused_alone_in_one_line(ranks):
    """Such a row failed its batch's reduction, was held, and failed every batch after it: nothing more was recorded."""
    out, errors = ranks
    for rank_errors in errors:
        assert len(rank_errors["countless"]) == 1, rank_errors["countless"]
        (at, kind, message), = rank_errors["countless"]
        assert at == 3 and kind == "RecordError" and "\n" not in message, message  # at the hand-over of rows 1, 2
        assert "cost/normal/count" in message and "step 2" in message, message
    record = load(out / "countless.h5")
    np.testing.assert_array_equal(record["step"], [1, 3, 4, 5])
    for row, s in enumerate((1, 3, 4, 5)):  # rank r: count 1 + r of value r + s
        np.testing.assert_allclose(record["cost/normal/mean"][row], (1 * s + 2 * (1 + s)) / 3, rtol=1e-15)


def test_a_count_that_does_not_fit_its_pooled_mean_is_one_line(ranks):
    _, errors = ranks
    for rank_errors in errors:
        kind, message = rank_errors["misfit"]
        assert kind == "ReductionError" and "\n" not in message and "cost/normal/count" in message, message


# -- every rank of a launch probes the record's folder at once (check_paths runs before the process group) ----------
def test_a_folder_level_another_rank_makes_meanwhile_is_not_refused(tmp_path, monkeypatch):
    """Rank 1 made ``new`` between this rank's existence check and its mkdir: 'File exists' refused the launch."""
    from nasdiag.search.runner import _probe_writable

    real = os.mkdir

    def raced(path, *args, **kwargs):
        if not os.path.exists(path):
            real(path, *args, **kwargs)  # the other rank's mkdir, just before this one
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", raced)
    _probe_writable(str(tmp_path / "new" / "sub"), "record")


def test_a_folder_another_rank_removes_meanwhile_is_probed_again(tmp_path, monkeypatch):
    """Rank 1 removed its probe level ``new`` between this rank's existence check and its temporary file: 'No such file
    or directory' refused the launch. Nothing is left behind either way."""
    from nasdiag.search.runner import _probe_writable

    folder = tmp_path / "new"
    folder.mkdir()  # the other rank's probe level
    real, calls = tempfile.TemporaryFile, []

    def raced(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            os.rmdir(folder)  # the other rank's probe ends
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", raced)
    _probe_writable(str(folder), "record")
    assert not folder.exists()


def test_a_dangling_link_as_the_folder_is_still_refused(tmp_path):
    from nasdiag.errors import ConfigError
    from nasdiag.search.runner import _probe_writable

    os.symlink(tmp_path / "gone", tmp_path / "link")
    with pytest.raises(ConfigError, match="cannot write the record under"):
        _probe_writable(str(tmp_path / "link"), "record")
