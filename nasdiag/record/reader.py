"""Reading records: one segment at a time, then all segments merged.

Readers never write and never take the writer lock, so a record can be read while it is being
written (SWMR), after its writer crashed, and from a read-only location.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field

import h5py
import numpy as np

from nasdiag.record import schema
from nasdiag.record.errors import RecordError, RecordWarning


@dataclass
class Column:
    """Schema of one logged dataset: per-row ``shape`` and ``dtype``."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class Segment:
    """The committed content of one segment file."""

    index: int
    file: str
    run_id: str
    meta: dict
    steps: np.ndarray  # (n,) int64, committed rows only
    columns: dict[str, Column]
    data: dict[str, np.ndarray] = field(default_factory=dict)  # path -> (n, *shape)
    present: dict[str, np.ndarray] = field(default_factory=dict)  # path -> (n,) bool
    nonfinite: dict[str, int] = field(default_factory=dict)  # path -> attribute value


def open_segment_file(file: str) -> h5py.File:
    """Open a segment for reading; SWMR first (live or crashed writers), plain read as fallback."""
    try:
        return h5py.File(file, "r", swmr=True)
    except OSError as swmr_err:
        try:
            return h5py.File(file, "r")
        except OSError:
            raise RecordError(f"cannot open record segment {file}: {swmr_err}") from None


def _attr_str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _strings(dataset) -> list[str]:
    return [_attr_str(v) for v in dataset[()]]


def read_meta(f: h5py.File) -> dict:
    """The ``meta`` mapping a segment was written with (see `schema.normalize_meta`)."""
    meta: dict = {}
    attrs = f.attrs
    if "method" in attrs:
        meta["method"] = _attr_str(attrs["method"])
    if "config" in attrs:
        meta["config"] = json.loads(_attr_str(attrs["config"]))
    if "seed" in attrs and int(attrs["seed"]) != schema.NO_SEED:
        meta["seed"] = int(attrs["seed"])
    group = f.get(schema.META)
    if group is not None:
        for key in ("op_names", "cell_types"):
            if key in group:
                meta[key] = _strings(group[key])
        if "edge_names" in group:
            meta["edge_names"] = {cell: _strings(ds) for cell, ds in group["edge_names"].items()}
        for key, value in group.attrs.items():
            meta[key] = json.loads(_attr_str(value))
    return meta


def committed_rows(steps: np.ndarray) -> int:
    """Number of committed rows: ``/step`` up to its first never-written (fill -1) slot."""
    uncommitted = np.flatnonzero(steps < 0)
    return int(uncommitted[0]) if uncommitted.size else int(steps.shape[0])


def read_segment(index: int, file: str, with_data: bool = True) -> Segment:
    """Read the committed rows of one segment file (``with_data=False``: schema and steps only)."""
    with open_segment_file(file) as f:
        if schema.STEP not in f or schema.PRESENT not in f:
            raise RecordError(f"{file} is not a nasdiag record segment (no /step or /present); remove or rename it")
        step_ds = f[schema.STEP]
        steps = step_ds[()].astype(np.int64)
        n = committed_rows(steps)
        present_ds = f[schema.PRESENT]
        paths = [_attr_str(p) for p in present_ds.attrs[schema.PATHS_ATTR]]
        datasets = {path: f[path] for path in paths}
        # Datasets are written before /step; one that looks shorter was read from a stale cache.
        for ds in [present_ds, *datasets.values()]:
            if ds.shape[0] < n:
                ds.refresh()
            n = min(n, ds.shape[0])
        segment = Segment(
            index=index,
            file=file,
            run_id=_attr_str(f.attrs.get("run_id", "")),
            meta=read_meta(f),
            steps=steps[:n],
            columns={p: Column(p, tuple(ds.shape[1:]), ds.dtype) for p, ds in datasets.items()},
        )
        if with_data:
            present = present_ds[:n] if n else np.zeros((0, len(paths)), bool)
            for col, (path, ds) in enumerate(datasets.items()):
                segment.data[path] = ds[:n]
                segment.present[path] = present[:, col].astype(bool)
                segment.nonfinite[path] = int(ds.attrs.get(schema.NONFINITE_ATTR, 0))
    return segment


def read_segments(path: str, with_data: bool = True) -> list[Segment]:
    """All segments of the record at ``path`` that belong to its run, by index.

    A segment whose ``run_id`` differs from the first one is a leftover of another run; it is skipped
    with a `RecordWarning`. Raises `RecordError` if there is no segment at all.
    """
    path = os.fspath(path)
    files = schema.list_segments(path)
    if not files:
        raise RecordError(f"no record at {path} (no file {path} and no segments next to it)")
    segments = [read_segment(index, file, with_data) for index, file in files]
    run_id = segments[0].run_id
    kept = []
    for seg in segments:
        if seg.run_id != run_id:
            warnings.warn(f"skipping {seg.file}: it belongs to another run than {segments[0].file}", RecordWarning)
        else:
            kept.append(seg)
    return kept


def merged_columns(segments: list[Segment]) -> dict[str, Column]:
    """The union of the segments' schemas; a path must keep its shape and dtype across segments."""
    columns: dict[str, Column] = {}
    for seg in segments:
        for path, col in seg.columns.items():
            known = columns.setdefault(path, col)
            if (known.shape, known.dtype) != (col.shape, col.dtype):
                raise RecordError(
                    f"{path!r} has shape {known.shape} {known.dtype} in one segment and {col.shape} {col.dtype} "
                    f"in {seg.file}; the record is inconsistent"
                )
    return columns


def _meta_arrays(meta: dict) -> dict[str, np.ndarray]:
    out = {}
    for key, value in meta.items():
        if key in ("op_names", "cell_types"):
            out[f"meta/{key}"] = np.asarray(value, dtype=str)
        elif key == "edge_names":
            for cell, names in value.items():
                out[f"meta/edge_names/{cell}"] = np.asarray(names, dtype=str)
        elif key == "method":
            out["meta/method"] = np.asarray(value, dtype=str)
        elif key == "seed":
            out["meta/seed"] = np.asarray(value, dtype=np.int64)
        else:  # config and unknown keys: the JSON text, as stored
            out[f"meta/{key}"] = np.asarray(json.dumps(value, sort_keys=True), dtype=str)
    return out


def load(path) -> dict[str, np.ndarray]:
    """Read a record (all its segments) into numpy arrays with aligned rows.

    Returns a dict with:

    - ``"step"``: (T,) int64, increasing. Segments are merged; where a step appears in several
      segments the later segment's row wins.
    - ``"<path>"`` for every logged dataset path: (T, *shape), the dtype it was logged with. A row in
      which the path was not logged holds the fill value (NaN for floats, 0 for ints, False for bools).
    - ``"valid/<path>"``: (T,) bool, True where the path was logged in that row.
    - ``"meta/..."``: the run's metadata from the last segment: ``meta/op_names`` (K,) str,
      ``meta/cell_types`` (C,) str, ``meta/edge_names/<cell type>`` (E,) str, ``meta/method`` 0-d str,
      ``meta/seed`` 0-d int64, ``meta/config`` and any other key as 0-d JSON str.
      `load_meta` gives the same as plain Python objects.

    Only committed rows are read, so a record whose writer is alive, was killed or is resuming loads
    consistently. Raises `RecordError` if there is no record at ``path``.
    """
    segments = read_segments(path, with_data=True)
    columns = merged_columns(segments)
    all_steps = np.concatenate([seg.steps for seg in segments])
    total = all_steps.shape[0]
    # Last occurrence of each step wins: unique over the reversed rows finds it, sorted by step.
    steps, first_in_reversed = np.unique(all_steps[::-1], return_index=True)
    winners = total - 1 - first_in_reversed
    out: dict[str, np.ndarray] = {"step": steps.astype(np.int64)}
    for path, col in columns.items():
        data = np.full((total, *col.shape), schema.fill_value(col.dtype), dtype=col.dtype)
        valid = np.zeros(total, bool)
        start = 0
        for seg in segments:
            stop = start + seg.steps.shape[0]
            if path in seg.data:
                data[start:stop] = seg.data[path]
                valid[start:stop] = seg.present[path]
            start = stop
        data[~valid] = schema.fill_value(col.dtype)
        out[path] = data[winners]
        out[f"valid/{path}"] = valid[winners]
    out.update(_meta_arrays(segments[-1].meta))
    return out


def load_meta(path) -> dict:
    """The run's metadata as Python objects (from its last segment).

    Keys as passed to `Recorder` (``method``, ``config`` dict, ``seed``, ``op_names``,
    ``edge_names``, ``cell_types``, extra keys), plus ``schema_version``, ``nasdiag_version``,
    ``torch_version``, ``h5py_version``, ``hdf5_version``, ``run_id``, ``segments`` (list of segment
    files) and ``nonfinite_counts`` (dict path -> NaN/inf count over all committed rows).
    """
    segments = read_segments(path, with_data=True)
    meta = dict(segments[-1].meta)
    with open_segment_file(segments[-1].file) as f:
        for key in ("schema_version", "nasdiag_version", "torch_version", "h5py_version", "hdf5_version"):
            if key in f.attrs:
                value = f.attrs[key]
                meta[key] = int(value) if key == "schema_version" else _attr_str(value)
    meta["run_id"] = segments[0].run_id
    meta["segments"] = [seg.file for seg in segments]
    counts: dict[str, int] = {}
    for seg in segments:
        for p, data in seg.data.items():
            if data.dtype.kind == "f":
                counts[p] = counts.get(p, 0) + int(np.count_nonzero(~np.isfinite(data[seg.present[p]])))
    meta["nonfinite_counts"] = counts
    return meta
