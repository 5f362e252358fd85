"""Reducing diagnostics across DDP ranks before rank 0 records them.

Every rank calls `reduce_statistics` with its own statistics (a mapping of record path ->
array-like, as a probe or search method hands them out) at the same point of the loop; every rank
gets the reduced statistics back, and only rank 0 writes them. The reduction rule of a path comes
from its name and dtype unless ``rules`` says otherwise:

=========  ================================================================================
rule       result over ranks r = 1..R
=========  ================================================================================
mean       (1/R) sum_r x_r, the default for floats (equal per-rank batches: the global batch mean)
sum        sum_r x_r, the default for paths named ``count`` or ``*_count``
pooled     the default for ``<prefix>/mean`` and ``<prefix>/var`` next to ``<prefix>/count``:
           mean = sum_r n_r m_r / N and var = (sum_r [(n_r - ddof) v_r + n_r m_r^2] - N mean^2) / (N - ddof)
           with N = sum_r n_r, i.e. exactly the mean and variance of all samples of all ranks
all, any   logical and / or, the default for bools (``all``)
min, max   elementwise extremes
same       the value, which must agree on all ranks (else `RecordError`); the default for other ints
=========  ================================================================================

torch is imported only inside the functions, so that importing this module stays cheap.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Mapping

import numpy as np

from nasdiag.record.errors import RecordError
from nasdiag.record.writer import to_numpy

RULES = ("mean", "sum", "pooled", "all", "any", "min", "max", "same")


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
    return int(os.environ.get("RANK", "0"))


def is_writer(group=None) -> bool:
    """Whether this process is the one that writes records (rank 0)."""
    return rank(group) == 0


def default_rule(path: str, dtype: np.dtype, siblings) -> str:
    """The rule `reduce_statistics` uses for ``path`` unless told otherwise (see module docstring)."""
    parent, _, name = path.rpartition("/")
    if dtype.kind == "b":
        return "all"
    if name == "count" or name.endswith("_count"):
        return "sum"
    if name in ("mean", "var") and dtype.kind == "f" and f"{parent}/count" in siblings:
        return "pooled"
    if dtype.kind == "f":
        return "mean"
    return "same"


def plan_rules(arrays: Mapping[str, np.ndarray], rules: Mapping[str, str] | None = None) -> dict[str, str]:
    """Rule per path: the first matching pattern of ``rules`` (exact path or fnmatch glob), else the default."""
    plan = {}
    for path, array in arrays.items():
        rule = None
        for pattern, candidate in (rules or {}).items():
            if pattern == path or fnmatch.fnmatchcase(path, pattern):
                rule = candidate
                break
        if rule is None:
            rule = default_rule(path, array.dtype, arrays)
        if rule not in RULES:
            raise RecordError(f"unknown reduction rule {rule!r} for {path!r}; use one of {RULES}")
        if rule == "pooled":
            parent = path.rpartition("/")[0]
            if path.rpartition("/")[2] not in ("mean", "var") or f"{parent}/count" not in arrays:
                raise RecordError(f"rule 'pooled' for {path!r} needs a '<prefix>/mean' or '/var' path with '{parent}/count' next to it")
            if path.endswith("/var") and f"{parent}/mean" not in arrays:
                raise RecordError(f"pooling {path!r} needs '{parent}/mean' too")
        plan[path] = rule
    return plan


def _signature(arrays, plan) -> int:
    text = json.dumps([[p, list(a.shape), a.dtype.str, plan[p]] for p, a in sorted(arrays.items())])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def reduce_statistics(
    statistics: Mapping, *, rules: Mapping[str, str] | None = None, ddof: int = 0, group=None
) -> dict[str, np.ndarray]:
    """Reduce ``statistics`` over the ranks of ``group``; every rank must call it with the same paths.

    ``statistics`` maps record paths to Python scalars, numpy arrays or tensors. Returns numpy arrays
    of the input shapes and dtypes (``mean`` of ints gives float64) on every rank. ``ddof`` is the
    convention of the ``var`` paths being pooled (0: population variance, 1: unbiased). Without an
    initialised process group (or with one rank) the statistics come back unchanged. All work is
    batched into at most four collectives: a schema check, then one sum, one min and one max.
    Raises `RecordError` if the ranks disagree on the paths, shapes or dtypes, or on a ``same`` value.
    """
    arrays = {path: np.asarray(to_numpy(value)) for path, value in statistics.items()}
    plan = plan_rules(arrays, rules)
    dist = _dist(group)
    if dist is None or dist.get_world_size(group) == 1:
        return arrays
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    signature = _signature(arrays, plan)
    check = torch.tensor([signature, -signature], dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    if check.tolist() != [signature, -signature]:
        raise RecordError(
            "ranks passed different statistics (paths, shapes, dtypes or rules) to reduce_statistics; "
            "every rank must hand the same paths at the same step"
        )
    world = dist.get_world_size(group)

    sums, mins, maxs = _Packer(), _Packer(), _Packer()
    for path, array in arrays.items():
        rule = plan[path]
        x = array.astype(np.float64)
        if rule in ("mean", "sum"):
            sums.add(path, x)
        elif rule == "pooled" and path.endswith("/mean"):
            parent = path.rpartition("/")[0]
            n = np.broadcast_to(arrays[f"{parent}/count"].astype(np.float64), x.shape)
            sums.add(f"{path}#n", n)
            sums.add(f"{path}#nm", np.where(n > 0, n * x, 0.0))
            var = arrays.get(f"{parent}/var")
            if var is not None and plan.get(f"{parent}/var") == "pooled":
                v = var.astype(np.float64)
                second = np.where(n > ddof, (n - ddof) * v, 0.0) + np.where(n > 0, n * x * x, 0.0)
                sums.add(f"{path}#sq", second)
        elif rule in ("all", "min", "same"):
            mins.add(path, x)
        if rule in ("any", "max", "same"):
            maxs.add(path, x)

    reduced_sum = sums.reduce(dist, dist.ReduceOp.SUM, device, group)
    reduced_min = mins.reduce(dist, dist.ReduceOp.MIN, device, group)
    reduced_max = maxs.reduce(dist, dist.ReduceOp.MAX, device, group)

    out: dict[str, np.ndarray] = {}
    for path, array in arrays.items():
        rule = plan[path]
        if rule == "mean":
            value = reduced_sum[path] / world
            dtype = array.dtype if array.dtype.kind == "f" else np.float64
        elif rule == "sum":
            value, dtype = reduced_sum[path], array.dtype
        elif rule in ("all", "min"):
            value, dtype = reduced_min[path], array.dtype
        elif rule in ("any", "max"):
            value, dtype = reduced_max[path], array.dtype
        elif rule == "same":
            if not np.array_equal(reduced_min[path], reduced_max[path], equal_nan=array.dtype.kind == "f"):
                raise RecordError(
                    f"{path!r} differs across ranks but its reduction rule is 'same'; pass rules={{{path!r}: 'sum'}} "
                    "(or mean/min/max) to reduce_statistics"
                )
            value, dtype = reduced_min[path], array.dtype
        else:  # pooled
            parent = path.rpartition("/")[0]
            key = f"{parent}/mean"
            total = reduced_sum[f"{key}#n"]
            with np.errstate(invalid="ignore", divide="ignore"):
                mean = reduced_sum[f"{key}#nm"] / total
                if path.endswith("/mean"):
                    value = np.where(total > 0, mean, np.nan)
                else:
                    var = (reduced_sum[f"{key}#sq"] - total * mean * mean) / (total - ddof)
                    value = np.where(total > ddof, np.maximum(var, 0.0), np.nan)
            dtype = array.dtype
        out[path] = np.asarray(value).astype(dtype)
    return out


class _Packer:
    """Concatenates float64 arrays into one flat buffer so that one collective reduces them all."""

    def __init__(self):
        self._parts: list[tuple[str, np.ndarray]] = []

    def add(self, key: str, array: np.ndarray) -> None:
        self._parts.append((key, np.asarray(array, dtype=np.float64)))  # (ascontiguousarray makes 0-d 1-d)

    def reduce(self, dist, op, device, group) -> dict[str, np.ndarray]:
        if not self._parts:
            return {}
        import torch

        flat = np.concatenate([a.reshape(-1) for _, a in self._parts])
        tensor = torch.from_numpy(flat).to(device)
        dist.all_reduce(tensor, op=op, group=group)
        flat = tensor.cpu().numpy()
        out, offset = {}, 0
        for key, array in self._parts:
            out[key] = flat[offset : offset + array.size].reshape(array.shape)
            offset += array.size
        return out
