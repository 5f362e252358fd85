"""Reducing diagnostics across DDP ranks before rank 0 records them.

Every rank calls `reduce_statistics` with its own statistics (a mapping of record path ->
array-like, as a probe or search method hands them out) at the same point of the loop; every rank
gets the reduced statistics back, and only rank 0 writes them. The rule of a path is its family's
rule in the statistics vocabulary (`nasdiag.vocabulary.reduction_rule`; paths of no family: bools
``all``, other integers ``same``, floats ``mean``) unless ``rules`` says otherwise:

=========  ================================================================================
rule       result over ranks r = 1..R
=========  ================================================================================
mean       (1/R) sum_r x_r (equal per-rank batches: the global batch mean); ints give float64
sum        sum_r x_r (bools and ints give int64, unsigned ints uint64, exact: a bool's sum counts the ranks holding True)
pooled     ``<prefix>/mean`` and ``<prefix>/var`` next to ``<prefix>/count``: the mean and
           variance of all samples of all ranks, by `nasdiag.vocabulary.pooled_moments`; ints give float64
all, any   logical and / or (ints and floats: 1 where true, 0 where false; NaN stays NaN)
min, max   elementwise extremes (of ints exact in 64 bits)
same       the value, which must agree on all ranks (else `ReductionError`)
=========  ================================================================================

A NaN is never reduced away: ``mean``, ``sum`` and ``pooled`` propagate it arithmetically, and for float
paths under ``min``, ``max``, ``all``, ``any`` and ``same`` the result is NaN wherever any rank holds a NaN
(``same`` compares the ranks only where none does). The families' ``nonfinite`` flags reduce by ``any``.

Batch convention of a search under DDP (``nasdiag.search.run``: every rank takes an equal batch of B samples,
the losses are batch means; checked against autograd in tests/test_audit_ddp_round3.py):

- scalars (losses, accuracies): the rank mean of each rank's batch mean, which is the global batch's mean;
- ``cost/<cell>/{mean,var,count}``: one observation per rank, step and cell, C = ∂L_r/∂Z of rank r's mean loss on
  its own batch, pooled over all of them (var with ddof 0, count = ranks × steps × cells). The α step uses the
  rank mean of the C_r, the cost of the global mean loss;
- ``hessian/<cell>/diag``: the rank mean of each rank's diagonal on its own last batch. It equals the global
  batch's where the loss decouples the samples (LayerNorm, eval-mode BatchNorm) in the modes linear in them
  (exact, exact_per_edge, diag, ggn), not for ``approx`` (its feature means are over the rank's batch), not
  under train-mode BatchNorm (statistics per rank's batch); sampled modes average the ranks' estimates;
- ``hessian/*top_eigenvalue``: the top eigenvalue of the rank-mean Hessian (Lanczos on HVPs averaged over ranks),
  the same on every rank;
- architecture and method state (α, forecasters, γ, switches, λ, sample counts): identical on every rank
  (``same``), since every rank updates them from rank-averaged costs and curvature.

"The global batch" above holds where the supernet treats each sample on its own (``--norm layer`` or ``instance``,
eval-mode BatchNorm). Under train-mode BatchNorm (``--norm batch``, the default) every rank normalises with its own
batch's statistics (there is no SyncBatchNorm): losses, costs, ∂L/∂w and the steps taken are the rank means over R
batches of B samples each normalised apart, not those of one batch of R·B samples (a single process with
``--batch-size`` R·B), as in any DDP training.

A loop of one's own with unequal per-rank batches must log its ``count`` next to a ``mean``/``var`` and reduce
them ``pooled``: the ``mean`` rule weighs every rank alike. Next to a pooled ``<prefix>/mean``, ``<prefix>/count`` is
summed (the number of samples of all ranks) and ``<prefix>/var`` pooled unless ``rules`` names them.

A batch of rows can be reduced at once (``rows=True``: the first axis of every value is the row),
so a recorder callback reduces all the rows it buffered with one collective per rule.

Importing this module imports neither torch nor h5py (torch only once a process group is in use).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Mapping

import numpy as np

from nasdiag.arrays import to_numpy
from nasdiag.errors import ConfigError, NasdiagError
from nasdiag.vocabulary import RULES, pooled_moments, reduction_rule


class ReductionError(NasdiagError):
    """Ranks handed statistics that cannot be reduced together (the message says what differs)."""


def _dist(group=None):
    """``torch.distributed`` if a process group is initialised (and torch is imported), else None."""
    import sys

    if "torch" not in sys.modules:
        return None  # nobody can have initialised a process group without importing torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist


def world_size(group=None) -> int:
    """Number of ranks (1 without an initialised process group)."""
    dist = _dist(group)
    return dist.get_world_size(group) if dist else 1


def rank(group=None) -> int:
    """This process's rank: from the process group, else the ``RANK`` variable a launcher sets
    (so a recorder built before ``init_process_group`` still knows it is not rank 0), else 0."""
    dist = _dist(group)
    if dist:
        return dist.get_rank(group)
    text = os.environ.get("RANK", "").strip()
    try:
        return int(text or 0)  # set but empty: unset (int('') was a traceback)
    except ValueError:  # int()'s traceback from inside the caller (a RecorderCallback)
        raise ConfigError(f"environment variable RANK={text!r} is not a process rank (an integer, as a launcher sets it); "
                          "unset it for a single process") from None


def is_writer(group=None) -> bool:
    """Whether this process is the one that writes records (rank 0)."""
    return rank(group) == 0


def finite_on_every_rank(value, group=None) -> bool:
    """Whether the tensor ``value`` is finite (no NaN, no ±inf) on every rank of ``group``: one host read, and
    under DDP one all-reduce of one number, so every rank must call it at the same point of its step.

    A method's NaN-loss check decides with it: a NaN on one rank then stops every rank at the same step, and the
    run records the step's row, flagged (a rank that stopped alone left the others waiting in their next
    collective, and the NaN row of the rank that saw it was never reduced nor written)."""
    import torch

    finite = torch.isfinite(value).all()
    dist = _dist(group)
    if dist is None or dist.get_world_size(group) == 1:
        return bool(finite)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    flag = finite.to(device=device, dtype=torch.int32).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag)


def all_gather_objects(value, group=None) -> list:
    """Every rank's ``value`` (picklable), in rank order: one collective under an initialised process group of several
    ranks (every rank must call it at the same point), else ``[value]``."""
    dist = _dist(group)
    if dist is None or dist.get_world_size(group) == 1:
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def check_ddof(ddof, error: type[Exception] = ReductionError) -> None:
    """Raise ``error`` (one line) unless ``ddof`` is a non-negative int: under DDP ``'1'`` or None was numpy's
    traceback after the collectives, -1 and 1.5 pooled silently (and a single process ignored it)."""
    if isinstance(ddof, bool) or not isinstance(ddof, (int, np.integer)) or ddof < 0:
        raise error(f"ddof must be a non-negative int (0: the var paths are population variances, 1: unbiased ones), "
                    f"got {ddof!r}")


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition("/")
    return parent, name


def plan_rules(arrays: Mapping[str, np.ndarray], rules: Mapping[str, str] | None = None) -> dict[str, str]:
    """Rule per path: the first matching pattern of ``rules`` (exact path or fnmatch glob), else the
    vocabulary's rule (`nasdiag.vocabulary.reduction_rule`); next to a pooled ``<prefix>/mean``, ``<prefix>/count`` is
    summed and ``<prefix>/var`` pooled unless ``rules`` names them (of no family, an int count was 'same', refused as
    the ranks' counts differ, a float count and the var 'mean': the rank means); a count ``rules`` calls ``pooled`` (a
    glob ``'<prefix>/*'``) is summed too. Raises `ReductionError` for an unknown rule, a ``pooled`` path other than a
    ``mean``/``var``/``count``, or one without its ``count`` (for ``var``, its ``mean``; for ``count``, a pooled mean)."""
    plan, chosen = {}, set()
    for path, array in arrays.items():
        rule = None
        for pattern, candidate in (rules or {}).items():
            if pattern == path or fnmatch.fnmatchcase(path, pattern):
                rule = candidate
                chosen.add(path)
                break
        if rule is None:
            rule = reduction_rule(path, np.asarray(array).dtype)
        if rule not in RULES:
            raise ReductionError(f"unknown reduction rule {rule!r} for {path!r}; use one of {RULES}")
        if rule == "pooled":
            parent, name = _split(path)
            if name not in ("mean", "var", "count"):
                raise ReductionError(f"rule 'pooled' is for a '<prefix>/mean' and '/var' beside their '<prefix>/count', "
                                     f"not {path!r}; give it another rule (one of {RULES})")
            if name != "count" and f"{parent}/count" not in arrays:
                raise ReductionError(
                    f"rule 'pooled' for {path!r} needs a '<prefix>/mean' or '/var' path with '{parent}/count' next to it; "
                    f"log '{parent}/count' in the same row"
                )
            if name == "var" and f"{parent}/mean" not in arrays:
                raise ReductionError(f"pooling {path!r} needs '{parent}/mean' in the same row too")
        plan[path] = rule
    for path in plan:  # the count and var of a pooled mean are of every rank's samples, unless ``rules`` says otherwise
        parent, name = _split(path)
        pooled_mean = plan.get(f"{parent}/mean") == "pooled"
        if name == "count" and plan[path] == "pooled":  # as a glob '<prefix>/*' names it: the count of the pooled mean
            if not pooled_mean:  # (it was refused as lacking the count it is)
                raise ReductionError(f"rule 'pooled' for {path!r} pools nothing without a pooled '{parent}/mean' beside "
                                     "it; pool the mean, or give the count the rule 'sum'")
            plan[path] = "sum"
        elif name in ("count", "var") and path not in chosen and pooled_mean:
            plan[path] = "sum" if name == "count" else "pooled"
    return plan


def _signature(arrays, plan, row_steps=None) -> int:
    steps = row_steps or {}
    text = json.dumps([[p, list(a.shape), a.dtype.str, plan[p], [int(s) for s in steps.get(p, ())]]
                       for p, a in sorted(arrays.items())])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _aligned_count(count: np.ndarray, like: np.ndarray, rows: bool, path: str) -> np.ndarray:
    """The sample count broadcast to the shape of the mean at ``path`` (per row first when ``rows``)."""
    shape = count.shape
    count = count.astype(np.float64)
    if rows and count.ndim < like.ndim:
        count = count.reshape(count.shape + (1,) * (like.ndim - count.ndim))
    try:
        return np.broadcast_to(count, like.shape)
    except ValueError:  # numpy's broadcast traceback (every rank alike: their shapes agree)
        parent, _ = _split(path)
        raise ReductionError(f"'{parent}/count' of shape {shape} does not fit {path!r} of shape {like.shape}; log the count "
                             "as a scalar or in the mean's shape") from None


def reduce_statistics(
    statistics: Mapping, *, rules: Mapping[str, str] | None = None, ddof: int = 0, group=None, rows: bool = False,
    row_steps: Mapping[str, list[int]] | None = None,
) -> dict[str, np.ndarray]:
    """Reduce ``statistics`` over the ranks of ``group``; every rank must call it with the same paths.

    ``statistics`` maps record paths to Python scalars, numpy arrays or tensors. Returns numpy arrays
    of the input shapes and dtypes (``mean`` and ``pooled`` of ints give float64, ``sum`` of bools and ints 64-bit ints) on every
    rank. ``ddof`` is the convention of the ``var`` paths being pooled (0: population variance, 1: unbiased; a non-negative
    int, else `ReductionError`). ``rows``: the
    first axis of every value is a row (a batch of recorded steps, reduced elementwise); a ``count``
    with fewer axes than its ``mean`` then lines up with the leading axes. ``row_steps`` (with ``rows``; every
    path): the step of each row of the path, where a batch's paths are not all logged at the same steps; the ranks
    must agree on them too, and a pooled ``mean``/``var`` takes its ``count`` at its own steps. Without an initialised
    process group (or with one rank) the statistics come back unchanged (as numpy). The work is
    batched into at most five collectives: a schema check, then one sum, one min, one max and, for
    pooled paths and the ``sum``, ``min`` and ``max`` of ints (exact in 64 bits, not through float64), one
    all-gather. Raises `ReductionError` if the ranks disagree on the paths, shapes
    or dtypes (or ``row_steps``), or on a ``same`` value, where a pooled ``mean`` has no ``count`` at one of
    its steps or its ``var`` other steps, and for a value that is not bool, int or float (complex, strings), on every
    rank and in a single process alike.
    """
    arrays = {path: np.asarray(to_numpy(value)) for path, value in statistics.items()}
    refused = None  # raised after the ranks' check: a rank refusing alone, before it, left the others in the check's
    try:  # collective, which then paired with that rank's next reduction (another step's statistics)
        check_ddof(ddof)
        for path, array in arrays.items():  # the collectives run in float64: a complex part was dropped (a ComplexWarning)
            if array.dtype.kind not in "biuf":
                raise ReductionError(f"{path!r} has dtype {array.dtype}, which cannot be reduced across ranks (nor "
                                     "recorded); hand bool, int or float values (a complex value as its real and imaginary parts)")
        plan = plan_rules(arrays, rules)
    except ReductionError as err:
        refused, plan = err, {path: f"refused: {err}" for path in arrays}
    dist = _dist(group)
    if dist is None or dist.get_world_size(group) == 1:
        if refused is not None:
            raise refused
        return arrays
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    signature = _signature(arrays, plan, row_steps)
    check = torch.tensor([signature, -signature], dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    if check.tolist() != [signature, -signature]:
        raise ReductionError(
            "ranks passed different statistics (paths, shapes, dtypes, rules or steps of the rows) to reduce_statistics; "
            "every rank must hand the same paths at the same step"
        )
    if refused is not None:  # every rank refuses alike
        raise refused
    world = dist.get_world_size(group)
    counts = _pooled_counts(arrays, plan, row_steps)  # after the check: every rank refuses alike

    sums, mins, maxs, gathered = _Packer(), _Packer(), _Packer(), _Packer()
    for path, array in arrays.items():
        rule = plan[path]
        x = array.astype(np.float64)
        if rule in ("all", "any"):  # logical: as the min/max of the truth values (the min of flags 0 and -1 was -1, true)
            x = np.where(np.isnan(x), np.nan, x != 0)
        if rule == "same" and array.dtype.kind in "iu":  # exact (float64 rounds past 2**53: 2**60 + 1 became 2**60, and
            for key, half in _halves(array, path):  # values differing only there passed as the same)
                mins.add(key, half)
                maxs.add(key, half)
            continue
        if rule in ("sum", "min", "max") and array.dtype.kind in "iu":  # exact, from every rank's value: through float64
            for key, half in _halves(array, path):  # the sum of 2**53 + 1 and 2 was 2**53 + 2, the min of 2**53 + 1 and
                gathered.add(key, half)  # 2**53 + 3 was 2**53, a value no rank held
            continue
        if rule in ("mean", "sum"):
            sums.add(path, x)
        elif rule == "pooled":
            parent, name = _split(path)
            gathered.add(path, x)
            if name == "mean":
                gathered.add(f"{parent}/count#n", _aligned_count(counts[path], x, rows, path))
        elif rule in ("all", "min", "same"):
            mins.add(path, x)
        if rule in ("any", "max", "same"):
            maxs.add(path, x)
        if rule in ("all", "any", "min", "max", "same") and array.dtype.kind in "fc":
            # gloo's and NCCL's MIN/MAX are NaN-blind in one argument order (std::min(1.0, nan) is 1.0): a NaN
            # on one rank came back as the other rank's number. Where any rank holds a NaN, the result is NaN.
            maxs.add(f"{path}#nan", np.isnan(x))

    reduced_sum = sums.all_reduce(dist, dist.ReduceOp.SUM, device, group)
    reduced_min = mins.all_reduce(dist, dist.ReduceOp.MIN, device, group)
    reduced_max = maxs.all_reduce(dist, dist.ReduceOp.MAX, device, group)
    per_rank = gathered.all_gather(dist, world, device, group)  # key -> (R, *shape)
    pooled = _pool(per_rank, plan, ddof)

    out: dict[str, np.ndarray] = {}
    for path, array in arrays.items():
        rule = plan[path]
        if rule == "mean":
            value = reduced_sum[path] / world
            dtype = array.dtype if array.dtype.kind == "f" else np.float64
        elif rule in ("sum", "min", "max") and array.dtype.kind in "iu":  # in 64 bits (200 + 200 in uint8 was 144)
            value, dtype = _exact_int(per_rank, path, array.dtype, rule), (_summed_dtype(array.dtype) if rule == "sum" else array.dtype)
        elif rule == "sum":  # of bools: how many ranks hold True (cast back to bool, the sum was an 'any')
            value, dtype = reduced_sum[path], _summed_dtype(array.dtype)
        elif rule in ("all", "min"):
            value, dtype = _nan_where(reduced_min[path], reduced_max, path), array.dtype
        elif rule in ("any", "max"):
            value, dtype = _nan_where(reduced_max[path], reduced_max, path), array.dtype
        elif rule == "same":
            if array.dtype.kind in "iu":
                low = array  # agreeing on every rank, as compared in 32-bit halves
                agree = all(np.array_equal(reduced_min[key], reduced_max[key]) for key, _ in _halves(array, path))
            else:
                low, high = (_nan_where(reduced_min[path], reduced_max, path), _nan_where(reduced_max[path], reduced_max, path))
                agree = np.array_equal(low, high, equal_nan=array.dtype.kind in "fc")
            if not agree:
                raise ReductionError(
                    f"{path!r} differs across ranks but its reduction rule is 'same'; pass rules={{{path!r}: 'sum'}} "
                    "(or mean/min/max) to reduce_statistics"
                )
            value, dtype = low, array.dtype
        else:  # of ints float64, as the mean's (in their dtype the pooled mean of 1 and 2 was 1)
            value, dtype = pooled[path], array.dtype if array.dtype.kind == "f" else np.float64
        out[path] = np.asarray(value).astype(dtype)
    return out


def _pooled_counts(arrays, plan, row_steps) -> dict[str, np.ndarray]:
    """Per pooled ``mean`` path: its ``count``, at the mean's own steps where ``row_steps`` says which rows hold which
    path (a count logged at other steps than its mean was pooled with the wrong rows' counts, or broadcast into a
    numpy ValueError)."""
    out = {}
    for path, rule in plan.items():
        parent, name = _split(path)
        if rule != "pooled":
            continue
        count = arrays[f"{parent}/count"]
        if row_steps is None:
            out[path] = count
            continue
        steps = [int(s) for s in row_steps[path]]
        if name == "var":
            if steps != [int(s) for s in row_steps[f"{parent}/mean"]]:
                raise ReductionError(f"{path!r} is logged at other steps than '{parent}/mean'; log them in the same rows")
            continue
        where = {int(s): i for i, s in enumerate(row_steps[f"{parent}/count"])}
        missing = [s for s in steps if s not in where]
        if missing:
            raise ReductionError(f"{path!r} is pooled by '{parent}/count', which step(s) {missing} do not log; log the "
                                 "count in every row of its mean")
        out[path] = count[[where[s] for s in steps]]
    return out


def _summed_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype of a sum over ranks: 64-bit for bools and ints (narrower ones overflowed, a bool was an 'any')."""
    return np.dtype(np.uint64 if dtype.kind == "u" else np.int64) if dtype.kind in "biu" else dtype


def _halves(array: np.ndarray, path: str) -> list[tuple[str, np.ndarray]]:
    """An integer array as its high and low 32 bits, each exact in float64 (the collectives' dtype)."""
    wide = array.astype(np.int64 if array.dtype.kind == "i" else np.uint64)
    return [(f"{path}#hi", (wide >> 32).astype(np.float64)), (f"{path}#lo", (wide & 0xFFFFFFFF).astype(np.float64))]


def _exact_int(per_rank: Mapping[str, np.ndarray], path: str, dtype: np.dtype, rule: str) -> np.ndarray:
    """The ``sum``/``min``/``max`` over ranks of an integer path, from every rank's value gathered as its 32-bit halves."""
    wide = np.dtype(np.int64 if dtype.kind == "i" else np.uint64)
    values = (per_rank[f"{path}#hi"].astype(wide) << wide.type(32)) | per_rank[f"{path}#lo"].astype(wide)
    if rule == "sum":
        with np.errstate(over="ignore"):
            return values.sum(axis=0, dtype=wide)
    return values.min(axis=0) if rule == "min" else values.max(axis=0)


def _nan_where(value: np.ndarray, reduced_max: Mapping[str, np.ndarray], path: str) -> np.ndarray:
    """``value`` with NaN wherever some rank held a NaN (the ``<path>#nan`` flags, max-reduced), for float paths."""
    flags = reduced_max.get(f"{path}#nan")
    return value if flags is None else np.where(flags > 0, np.nan, value)


def _pool(per_rank: dict[str, np.ndarray], plan: dict[str, str], ddof: int) -> dict[str, np.ndarray]:
    """Pooled mean and var of every ``<prefix>`` from the ranks' (count, mean, var)."""
    out = {}
    for path, rule in plan.items():
        parent, name = _split(path)
        if rule != "pooled" or name != "mean":
            continue
        n = per_rank[f"{parent}/count#n"]
        # A rank without samples (or too few for its var) contributes nothing, whatever it holds.
        mean = np.where(n > 0, per_rank[path], 0.0)
        var_path = f"{parent}/var"
        pooled_var = plan.get(var_path) == "pooled"
        var = np.where(n > ddof, per_rank[var_path], 0.0) if pooled_var else np.zeros_like(mean)
        with np.errstate(invalid="ignore", divide="ignore"):
            _, out[path], pooled = pooled_moments(n, mean, var, ddof=ddof, xp=np)
        if pooled_var:
            out[var_path] = np.maximum(pooled, 0.0)  # rounding must not make a variance negative
    return out


class _Packer:
    """Concatenates float64 arrays into one flat buffer so that one collective serves them all."""

    def __init__(self):
        self._parts: list[tuple[str, np.ndarray]] = []

    def add(self, key: str, array: np.ndarray) -> None:
        self._parts.append((key, np.asarray(array, dtype=np.float64)))

    def _flat(self, device):
        import torch

        flat = np.concatenate([a.reshape(-1) for _, a in self._parts])
        return torch.from_numpy(flat).to(device)

    def _unpack(self, flat: np.ndarray, lead: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
        out, offset = {}, 0
        for key, array in self._parts:
            out[key] = flat[..., offset : offset + array.size].reshape(lead + array.shape)
            offset += array.size
        return out

    def all_reduce(self, dist, op, device, group) -> dict[str, np.ndarray]:
        if not self._parts:
            return {}
        tensor = self._flat(device)
        dist.all_reduce(tensor, op=op, group=group)
        return self._unpack(tensor.cpu().numpy())

    def all_gather(self, dist, world: int, device, group) -> dict[str, np.ndarray]:
        """Every rank's buffer, stacked: key -> (R, *shape)."""
        if not self._parts:
            return {}
        import torch

        tensor = self._flat(device)
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor, group=group)
        return self._unpack(torch.stack(parts).cpu().numpy(), (world,))
