"""The on-disk schema of a record: names, segment files, dataset layout and metadata.

Pure functions and constants only; `writer` and `reader` share them so that both sides agree on
the format. See docs/schema.md for the prose version.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nasdiag.record.errors import RecordError

#: Version of the layout below; bump on any incompatible change and teach `reader` the old one.
SCHEMA_VERSION = 1

#: HDF5 format bounds. SWMR needs at least the 1.10 format; capping it at 1.10 keeps records
#: readable by every h5py built against HDF5 >= 1.10 (newer formats would lock out older readers).
LIBVER = ("v110", "v110")

STEP = "step"
PRESENT = "present"
META = "meta"
#: Top-level names the recorder uses itself; user paths may not start with them.
RESERVED_ROOTS = frozenset({STEP, PRESENT, META, "valid"})
#: Attribute on every data dataset counting its NaN/inf elements in the committed rows.
NONFINITE_ATTR = "nonfinite_count"
#: Attribute on /present listing the dataset path of each column.
PATHS_ATTR = "paths"
#: Fill value of /step: a slot that reads -1 was never committed (see `committed_rows`).
STEP_FILL = -1

#: Root attribute ``seed`` when meta has none (seeds must be >= 0).
NO_SEED = -1

#: meta keys with a fixed meaning; any other key is kept as a JSON attribute of /meta.
KNOWN_META_KEYS = ("method", "config", "seed", "op_names", "edge_names", "cell_types")

_NAME = re.compile(r"^[A-Za-z0-9_.\-+=]+$")
#: Target bytes of one HDF5 chunk; chunks are rewritten whole on each flush, so keep them small.
_CHUNK_BYTES = 16 * 1024
_MAX_CHUNK_ROWS = 1024


def check_path(path: Any) -> str:
    """Validate a dataset path such as ``"scalars/train_loss"`` or ``"arch/normal/weights"``.

    Returns the path unchanged. Raises `RecordError` if it is not a non-empty ``/``-separated
    string of names made of letters, digits and ``_ . - + =``, or if it uses a reserved root.
    """
    if not isinstance(path, str) or not path:
        raise RecordError(f"dataset path must be a non-empty string like 'scalars/loss', got {path!r}")
    parts = path.split("/")
    if any(not _NAME.match(p) or p in (".", "..") for p in parts):
        raise RecordError(
            f"dataset path {path!r} is invalid: use '/'-separated names of letters, digits and _.-+= "
            "(for example 'scalars/train_loss' or 'arch/normal/weights')"
        )
    if parts[0] in RESERVED_ROOTS:
        raise RecordError(
            f"dataset path {path!r} uses the reserved name {parts[0]!r} "
            f"(reserved: {sorted(RESERVED_ROOTS)}); log it under another group such as 'scalars/'"
        )
    return path


def check_no_prefix_clash(new_path: str, known_paths) -> None:
    """Refuse a path that would be both a dataset and a group (``a/b`` next to ``a/b/c``)."""
    for other in known_paths:
        if other.startswith(new_path + "/") or new_path.startswith(other + "/"):
            raise RecordError(
                f"dataset paths {other!r} and {new_path!r} clash: one would be a group of the other; rename one"
            )


# --- segments ----------------------------------------------------------------------------------


def segment_path(path: str, index: int) -> str:
    """File of segment ``index`` of the record at ``path``.

    Segment 0 is ``path`` itself; segment i > 0 is ``<root>.seg<iiii><ext>`` next to it, so
    ``run.h5`` continues in ``run.seg0001.h5``, ``run.seg0002.h5``, ...
    """
    if index == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.seg{index:04d}{ext}"


def lock_path(path: str) -> str:
    """The writer's lock file of the record at ``path``."""
    return path + ".lock"


def temp_path(final_path: str) -> str:
    """Where a segment is built before it appears under its final name."""
    return final_path + ".tmp"


def list_segments(path: str) -> list[tuple[int, str]]:
    """Existing segment files of the record at ``path`` as ``(index, file)``, by index."""
    found = []
    if os.path.exists(path):
        found.append((0, path))
    root, ext = os.path.splitext(path)
    pattern = glob.escape(root) + ".seg" + "[0-9]" * 4 + glob.escape(ext)
    prefix_len = len(root) + len(".seg")
    for file in glob.glob(pattern):
        found.append((int(file[prefix_len : prefix_len + 4]), file))
    return sorted(found)


def chunk_rows(row_shape: tuple[int, ...], itemsize: int) -> int:
    """Rows per HDF5 chunk for rows of ``row_shape`` (a power of two, at most 16 KiB a chunk)."""
    row_bytes = max(1, itemsize * math.prod(row_shape))
    rows = max(1, min(_MAX_CHUNK_ROWS, _CHUNK_BYTES // row_bytes))
    return 1 << (rows.bit_length() - 1)


def fill_value(dtype: np.dtype):
    """Value stored for a row in which a dataset was not logged (NaN for floats)."""
    if dtype.kind == "f":
        return np.nan
    if dtype.kind == "b":
        return False
    return 0


# --- metadata ----------------------------------------------------------------------------------


def _str_list(key: str, value) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise RecordError(f"meta[{key!r}] must be a list of strings, got {type(value).__name__}")
    if not all(isinstance(v, str) for v in value):
        raise RecordError(f"meta[{key!r}] must be a list of strings, got {list(value)!r}")
    return list(value)


def _json(key: str, value) -> str:
    try:
        return json.dumps(value, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as err:
        raise RecordError(f"meta[{key!r}] is not JSON-serialisable ({err}); pass plain dicts, lists, numbers and strings") from None


def normalize_meta(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check ``meta`` and return a plain copy.

    Keys with a fixed meaning: ``method`` (str), ``config`` (dict, stored as JSON), ``seed`` (int),
    ``op_names`` (list[str], the K ops), ``edge_names`` (dict cell type -> list[str], the E edges),
    ``cell_types`` (list[str]). Every other key must be JSON-serialisable and is kept as a JSON
    attribute of ``/meta``.
    """
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise RecordError(f"meta must be a dict, got {type(meta).__name__}")
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if not isinstance(key, str) or not _NAME.match(key):
            raise RecordError(f"meta key {key!r} is invalid: use letters, digits and _.-+=")
        if value is None:
            continue
        if key == "method":
            if not isinstance(value, str):
                raise RecordError(f"meta['method'] must be a string, got {type(value).__name__}")
        elif key == "config":
            if not isinstance(value, Mapping):
                raise RecordError(f"meta['config'] must be a dict, got {type(value).__name__}")
            value = json.loads(_json(key, dict(value)))
        elif key == "seed":
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise RecordError(f"meta['seed'] must be a non-negative int, got {value!r}")
            value = int(value)
        elif key in ("op_names", "cell_types"):
            value = _str_list(key, value)
        elif key == "edge_names":
            if not isinstance(value, Mapping):
                raise RecordError("meta['edge_names'] must be a dict mapping cell type -> list of edge names")
            value = {str(k): _str_list(f"edge_names/{k}", v) for k, v in value.items()}
            for cell in value:
                if not _NAME.match(cell):
                    raise RecordError(f"cell type {cell!r} in meta['edge_names'] is invalid: use letters, digits and _.-+=")
        else:
            value = json.loads(_json(key, value))
        out[key] = value
    cells = out.get("cell_types")
    if cells is not None and "edge_names" in out:
        unknown = sorted(set(out["edge_names"]) - set(cells))
        if unknown:
            raise RecordError(f"meta['edge_names'] has cell types {unknown} missing from meta['cell_types'] {cells}")
    return out


def structural_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The part of ``meta`` that fixes array layouts (must not change on resume)."""
    return {k: meta[k] for k in ("op_names", "edge_names", "cell_types") if k in meta}


def check_against_meta(path: str, shape: tuple[int, ...], meta: Mapping[str, Any]) -> None:
    """Check ``arch/<cell>/{params,weights}`` rows are (E, K) as ``meta`` says."""
    parts = path.split("/")
    if len(parts) != 3 or parts[0] != "arch" or parts[2] not in ("params", "weights"):
        return
    cell = parts[1]
    cells = meta.get("cell_types")
    if cells is not None and cell not in cells:
        raise RecordError(f"{path!r}: cell type {cell!r} is not in meta['cell_types'] {cells}")
    n_ops = len(meta["op_names"]) if "op_names" in meta else None
    n_edges = len(meta["edge_names"][cell]) if cell in meta.get("edge_names", {}) else None
    if len(shape) != 2 or (n_edges is not None and shape[0] != n_edges) or (n_ops is not None and shape[1] != n_ops):
        want = f"({n_edges if n_edges is not None else 'E'}, {n_ops if n_ops is not None else 'K'})"
        raise RecordError(f"{path!r}: a row must have shape (E, K) = {want} from meta, got {shape}")
