"""The on-disk schema of a record: names, segment files, dataset layout and metadata.

Pure functions and constants only; `writer` and `reader` share them so that both sides agree on
the format. See docs/schema.md for the prose version.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import mmap
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nasdiag import vocabulary
from nasdiag.record.errors import RecordError

#: Version of the layout below; bump on any incompatible change and teach `reader` the old one.
#: Version 2 added ``/digest`` (a checksum per row) and the ``previous_segments`` attribute; version
#: 1 records still load, without the row checksums.
SCHEMA_VERSION = 2

#: HDF5 format bounds. SWMR needs at least the 1.10 format; capping it at 1.10 keeps records
#: readable by every h5py built against HDF5 >= 1.10 (newer formats would lock out older readers).
LIBVER = ("v110", "v110")
#: File-space layout of every segment: HDF5's paged aggregation, in pages of the OS page size, so that each
#: metadata block below a page (every object header and chunk index block a flush rewrites) lies inside one
#: page. A SIGKILL lands between the pages of a write, never inside one: with the default layout a dataset's
#: object header could straddle a page boundary, and a kill mid-write left it half old, half new (a bad
#: checksum, the whole segment unreadable). Needs the 1.10 format (`LIBVER`).
FILE_SPACE = {"fs_strategy": "page", "fs_page_size": max(4096, mmap.PAGESIZE), "fs_persist": False}

STEP = "step"
PRESENT = "present"
DIGEST = "digest"
META = "meta"
#: Top-level names the recorder uses itself; user paths may not start with them.
RESERVED_ROOTS = frozenset({STEP, PRESENT, DIGEST, META, "valid"})
#: Root attribute of a segment: JSON ``[[index, committed rows], ...]`` of the run's segments before
#: it, as they were when it was created (a reader checks that they are all still there, complete).
PREVIOUS_ATTR = "previous_segments"
#: Root attribute of a segment: int64 0 when written, set to 1 once the next segment of its session was published (the
#: writer marks it only after the next file is visible), so a reader notices a last segment missing as a whole (a copy
#: of ``run.h5`` alone). Segments written before it existed lack it.
CONTINUED_ATTR = "continued"
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
#: the longest meta key (kept as an attribute name of /meta): HDF5 stores an attribute's name with its NUL in 16 bits
MAX_META_KEY = 65534
#: what `reader.load_meta` adds to the meta: a meta key of one of these names would be hidden there
LOAD_META_KEYS = ("schema_version", "nasdiag_version", "torch_version", "h5py_version", "hdf5_version", "run_id",
                  "segments", "nonfinite_counts")

#: ``\Z``, not ``$``: ``$`` also matches before a trailing newline, which let "loss\n" through as a name
_NAME = re.compile(r"^[A-Za-z0-9_.\-+=]+\Z")
#: Target bytes of one HDF5 chunk; chunks are rewritten whole on each flush, so keep them small.
_CHUNK_BYTES = 16 * 1024
_MAX_CHUNK_ROWS = 1024
#: HDF5 chunk cache of each dataset a writer opens. Rows are appended, so only the last, partial chunk is written
#: again; HDF5's default (1 MiB per dataset) kept every finished chunk of the run in memory, growing the writer by
#: up to 1 MiB per recorded path. Room for the partial chunk and the one it spills into (16 KiB each at most; a
#: chunk of one larger row is written whole, past the cache).
CHUNK_CACHE_BYTES = 4 * _CHUNK_BYTES


def check_path(path: Any) -> str:
    """Validate a dataset path such as ``"scalars/train_loss"`` or ``"arch/normal/weights"``.

    Returns the path unchanged. Raises `RecordError` if it is not a non-empty ``/``-separated
    string of names made of ASCII letters, digits and ``_ . - + =``, or if it uses a reserved root.
    """
    if not isinstance(path, str) or not path:
        raise RecordError(f"dataset path must be a non-empty string like 'scalars/loss', got {path!r}")
    parts = path.split("/")
    if any(not _NAME.match(p) or p in (".", "..") for p in parts):
        raise RecordError(
            f"dataset path {path!r} is invalid: use '/'-separated names of ASCII letters, digits and _.-+= "
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
    ``run.h5`` continues in ``run.seg0001.h5``, ``run.seg0002.h5``, ... (at least four digits: segment 10000
    is ``run.seg10000.h5``).
    """
    if index == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.seg{index:04d}{ext}"


def segment_owner(path: str) -> str | None:
    """The record whose segment i > 0 `segment_path` would name ``path`` (``run.seg0001.h5`` -> ``run.h5``), else None."""
    for root, ext in (os.path.splitext(path), (path, "")):  # "run.seg0001" continues a record "run" without suffix
        stem, dot, number = root.rpartition(".seg")
        if dot and os.path.basename(stem) and _segment_number(number) is not None:
            return stem + ext
    return None


def _segment_number(text: str) -> int | None:
    """The index i > 0 that `segment_path` writes as ``text`` (``"0001"``, ``"10000"``), else None."""
    if not (text.isascii() and text.isdigit()) or len(text) < 4 or int(text) == 0:
        return None
    return int(text) if len(text) == 4 or text[0] != "0" else None  # past 4 digits, no leading zero


def resolve_link(path: str) -> str:
    """The file a record path names: ``path``, or the file it points to if it is a symbolic link. Later segments and
    files being built live next to that file, where every name of the record finds them (`lock_path` likewise)."""
    return os.path.realpath(path) if os.path.islink(path) else path


def lock_path(path: str) -> str:
    """The writer's lock file of the record at ``path``: ``<path>.lock``, with symbolic links resolved, so that a
    second writer given another name of the same record (a link to it) finds the first one's lock."""
    return os.path.realpath(path) + ".lock"


def temp_path(final_path: str) -> str:
    """Where a segment is built before it appears under its final name."""
    return final_path + ".tmp"


def side_file_too_long(path: str) -> str | None:
    """Why a file the recorder writes next to the record at ``path`` cannot exist on its file system, or None. The
    longest is a later segment being built, ``<root>.seg0001<ext>.tmp`` (12 bytes longer than the name), or the lock:
    past NAME_MAX/PATH_MAX a record was made, then lost its buffered rows at its first rollover and could never resume.
    The limits are read from the nearest existing folder (the record's may not be made yet)."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        name_max, path_max = os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # pragma: no cover - no limits to read (Windows)
        return None
    longest = max(temp_path(segment_path(path, 1)), path + ".lock", key=lambda f: len(os.fsencode(os.path.basename(f))))
    name, extra = os.path.basename(longest), len(os.fsencode(longest)) - len(os.fsencode(path))
    if len(os.fsencode(name)) > name_max:
        return (f"the recorder writes {name} next to it, a name of {len(os.fsencode(name))} bytes, more than the {name_max} "
                f"this file system allows; a record name of at most {name_max - extra} bytes fits")
    size = len(os.fsencode(os.path.abspath(longest)))
    if size >= path_max:
        return f"the recorder writes {name} next to it, a path of {size} bytes, more than the {path_max - 1} allowed"
    return None


def list_segments(path: str) -> list[tuple[int, str]]:
    """Existing segment files of the record at ``path`` (a symbolic link resolved, `resolve_link`) as ``(index, file)``,
    by index."""
    path = resolve_link(path)
    found = []
    if os.path.exists(path):
        found.append((0, path))
    root, ext = os.path.splitext(path)
    # four digits or more: a glob of exactly four missed segment 10000 on, whose rows `load` then silently left out
    pattern = glob.escape(root) + ".seg" + "[0-9]" * 4 + "*" + glob.escape(ext)
    prefix_len = len(root) + len(".seg")
    for file in glob.glob(pattern):
        index = _segment_number(file[prefix_len : len(file) - len(ext)])
        if index is not None:
            found.append((index, file))
    return sorted(found)


#: the 8 bytes every HDF5 file without a user block starts with (every record segment does)
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def foreign_temp(path: str) -> str | None:
    """The first of `temp_files` at ``path`` that no recorder wrote, else None.

    A segment is written as one image from its first byte, so a file the recorder left (killed while building it)
    is empty or starts with (a prefix of) the HDF5 signature; anything else under that name is a user's file (a
    record named ``run`` builds in ``run.tmp``) and must not be deleted as a leftover.
    """
    for file in temp_files(path):
        if not os.path.isfile(file):  # a named pipe: open() waited for a writer for ever
            return file
        try:
            with open(file, "rb") as f:
                head = f.read(len(HDF5_SIGNATURE))
        except OSError:
            return file
        if not HDF5_SIGNATURE.startswith(head):
            return file
    return None


def temp_files(path: str) -> list[str]:
    """Existing segments of the record at ``path`` being built (`temp_path`): left by a writer killed while it
    created one, whichever segment it was."""
    suffix = temp_path("")
    root, ext = os.path.splitext(path)
    pattern = glob.escape(root) + ".seg" + "[0-9]" * 4 + "*" + glob.escape(ext + suffix)
    found = [tmp for tmp in glob.glob(pattern) if segment_owner(tmp[: -len(suffix)]) == path]
    return sorted(found + ([temp_path(path)] if os.path.exists(temp_path(path)) else []))


def chunk_rows(row_shape: tuple[int, ...], itemsize: int) -> int:
    """Rows per HDF5 chunk for rows of ``row_shape`` (a power of two, at most 16 KiB a chunk)."""
    row_bytes = max(1, itemsize * math.prod(row_shape))
    rows = max(1, min(_MAX_CHUNK_ROWS, _CHUNK_BYTES // row_bytes))
    return 1 << (rows.bit_length() - 1)


#: Chunks a dataset may get in one segment. HDF5 indexes the chunks of an appendable dataset in an extensible
#: array whose data blocks grow as chunks are added: past about 8192 chunks a block (4118 bytes for 512 chunk
#: addresses) is larger than a 4 KiB page, so paged aggregation (`FILE_SPACE`) can no longer keep it inside one
#: page and a kill could tear it, losing committed rows. The writer starts the next segment before that.
MAX_SEGMENT_CHUNKS = 4096


def segment_row_limit(rows_per_chunk: Sequence[int]) -> int:
    """Rows one segment may hold: `MAX_SEGMENT_CHUNKS` chunks of its dataset with the fewest rows per chunk."""
    return MAX_SEGMENT_CHUNKS * min(rows_per_chunk)


def fill_value(dtype: np.dtype):
    """Value stored for a row in which a dataset was not logged (NaN for floats)."""
    if dtype.kind == "f":
        return np.nan
    if dtype.kind == "b":
        return False
    return 0


# --- row checksums -----------------------------------------------------------------------------
#
# Every committed row of a version-2 segment has a 64-bit digest in /digest, written with the data
# before the /step commit marker. It is a weighted byte sum modulo 2**64:
#
#   digest[t] = (sum over parts p of  sum_b w_p[b] * byte_p[t, b]) mod 2**64, with bit 63 set,
#
# where the parts are /step, /present and every data dataset (in the order of the /present
# ``paths`` attribute), byte_p[t, :] is row t of part p as little-endian bytes, and the weights
# w_p[b] = splitmix64(seed_p + b) | 1 (odd), seed_p = the first 8 bytes (little-endian) of
# blake2b(name_p, digest_size=8) with name_p the part's path ("step", "present", "scalars/loss").
# A changed byte changes the digest (odd weights: a byte change is never 0 mod 2**64), rows moved
# between datasets change it (weights per path), and bit 63 keeps a digest from ever being 0, so a
# row of a truncated file (read back as zeros) never passes. Row by row, so the first bad row is
# named exactly; and untouched by the writer rewriting the partial chunk of a live file, so a live
# (SWMR) record never fails its checks while being written.

_U64 = np.uint64
_TOP_BIT = _U64(1 << 63)
#: bytes of rows summed at once: their uint64 copy is 8 times that (a block of whole rows made it 8 times the rows
#: of a batch, or of 4096 rows of a record being loaded: gigabytes for rows of a few hundred KiB)
_DIGEST_BLOCK_BYTES = 1 << 20


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        return z ^ (z >> _U64(31))


def _byte_weights(name: str, nbytes: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    with np.errstate(over="ignore"):
        return _splitmix64(_U64(seed) + np.arange(nbytes, dtype=_U64)) | _U64(1)


class RowDigest:
    """Accumulates the digest of a block of rows, part by part (see the comment above).

    ``weights``: a dict the caller keeps across blocks to reuse the byte weights of each part.
    """

    def __init__(self, rows: int, weights: dict | None = None):
        self.rows = rows
        self._sum = np.zeros(rows, _U64)
        self._weights: dict = {} if weights is None else weights

    def add(self, name: str, block: np.ndarray) -> None:
        """Add part ``name``: ``block`` has one row per row of the digest, (rows, *row shape)."""
        if self.rows == 0:
            return
        block = np.asarray(block)
        little = block.dtype.newbyteorder("<") if block.dtype.byteorder not in ("|", "<") else block.dtype
        raw = np.ascontiguousarray(block, dtype=little).view(np.uint8).reshape(self.rows, -1)
        if raw.shape[1] == 0:
            return
        key = (name, raw.shape[1])
        weights = self._weights.get(key)
        if weights is None:
            weights = self._weights[key] = _byte_weights(name, raw.shape[1])
        # Bounded temporaries on long records and large rows: blocks of rows and of their bytes (the sum modulo
        # 2**64 may be taken in any order).
        row_bytes = raw.shape[1]
        byte_block = min(row_bytes, _DIGEST_BLOCK_BYTES)
        row_block = max(1, _DIGEST_BLOCK_BYTES // byte_block)
        with np.errstate(over="ignore"):
            for start in range(0, self.rows, row_block):
                stop = start + row_block
                for first in range(0, row_bytes, byte_block):
                    last = first + byte_block
                    self._sum[start:stop] += raw[start:stop, first:last].astype(_U64) @ weights[first:last]

    def value(self) -> np.ndarray:
        """(rows,) uint64, bit 63 set."""
        return self._sum | _TOP_BIT


# --- metadata ----------------------------------------------------------------------------------


def _storable_text(key: str, text: str) -> str:
    """``text`` if HDF5 can store it as a UTF-8 string: no NUL (a C string ends there) and no lone surrogate
    (what ``os.fsdecode`` makes of bytes that are not UTF-8); checked here, or the segment fails to be created."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RecordError(f"meta[{key!r}] holds {text!r}, which is not valid Unicode text ({err.reason}); pass plain text") from None
    if "\x00" in text:
        raise RecordError(f"meta[{key!r}] holds {text!r} with a NUL character, which HDF5 strings cannot hold; remove it")
    return text


def _str_list(key: str, value) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise RecordError(f"meta[{key!r}] must be a list of strings, got {type(value).__name__}")
    if not all(isinstance(v, str) for v in value):
        raise RecordError(f"meta[{key!r}] must be a list of strings, got {list(value)!r}")
    return [_storable_text(key, v) for v in value]


#: the one key of the JSON object that stands for a non-finite float in the record's JSON attributes (`dumps_json`):
#: ``{"__float__": "nan"}``, ``{"__float__": "inf"}``, ``{"__float__": "-inf"}``
NONFINITE_JSON_KEY = "__float__"
_NONFINITE_NAMES = ("nan", "inf", "-inf")
#: what json writes for a non-finite float used as a key (a key is text in JSON: it stays text)
_NONFINITE_KEYS = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


class _TagClash(ValueError):
    """A value holds an object of the form `dumps_json` writes a non-finite float in."""


def _nonfinite_name(value: float) -> str:
    return "nan" if value != value else "inf" if value > 0 else "-inf"


def _tagged(value):
    """``value`` with each non-finite float replaced by its tag object (see `dumps_json`)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else {NONFINITE_JSON_KEY: _nonfinite_name(value)}
    if isinstance(value, Mapping):
        if len(value) == 1 and NONFINITE_JSON_KEY in value:
            raise _TagClash(f"an object whose only key is {NONFINITE_JSON_KEY!r} is how a record writes NaN and inf")
        return {_NONFINITE_KEYS[_nonfinite_name(k)] if isinstance(k, float) and not math.isfinite(k) else k: _tagged(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tagged(v) for v in value]
    return value


#: the floats `loads_json` reads: one NaN object, so that two values read stay ``==`` where they hold a NaN at the same
#: place (dicts and lists compare their items by identity first), as json's own NaN literal did
_READ_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf,
                "NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _untagged(obj: dict):
    tag = obj.get(NONFINITE_JSON_KEY) if len(obj) == 1 else None
    return _READ_FLOATS[tag] if isinstance(tag, str) and tag in _NONFINITE_NAMES else obj


def dumps_json(value) -> str:
    """``value`` as standard JSON text (RFC 8259; keys sorted), as every JSON attribute of a record is written (the
    root ``config`` and the attributes of ``/meta``). Standard JSON has no NaN or Infinity (Python's ``NaN`` literal is
    refused by ``jq`` and by the JSON parsers of other languages), so a non-finite float is written as the object
    ``{"__float__": "nan"}`` (``"inf"``, ``"-inf"``), which `loads_json` reads back as the float: recorded, never
    dropped. Raises ``TypeError``/``ValueError`` for what JSON cannot hold (`normalize_meta` says which key)."""
    return json.dumps(_tagged(value), sort_keys=True, allow_nan=False)


def loads_json(text):
    """The value of a JSON attribute of a record (`dumps_json`): each ``{"__float__": "nan"|"inf"|"-inf"}`` is read
    back as the float; the ``NaN``/``Infinity`` literals of records written before are read too."""
    return json.loads(text, object_hook=_untagged, parse_constant=_READ_FLOATS.__getitem__)


def same_json(a, b) -> bool:
    """Whether two JSON values (as `loads_json` gives them) are the same: ``==``, except that a NaN is the same as a
    NaN (a record's meta holding one is the same on resume; ``nan != nan`` called it another run)."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return a == b


def _json(key: str, value) -> str:
    try:
        return dumps_json(value)
    except _TagClash as err:
        raise RecordError(f"meta[{key!r}] holds {{{NONFINITE_JSON_KEY!r}: ...}} alone in an object: {err}; rename that "
                          "key") from None
    except (TypeError, ValueError) as err:
        raise RecordError(f"meta[{key!r}] is not JSON-serialisable ({err}); pass plain dicts, lists, numbers and strings") from None
    except RecursionError:  # json's own traceback out of Recorder(...)
        raise RecordError(f"meta[{key!r}] is nested too deeply to be stored as JSON; pass a flatter value") from None


def normalize_meta(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check ``meta`` and return a plain copy.

    Keys with a fixed meaning: ``method`` (str), ``config`` (dict, stored as JSON), ``seed`` (int),
    ``op_names`` (list[str], the K ops), ``edge_names`` (dict cell type -> list[str], the E edges),
    ``cell_types`` (list[str]). Every other key must be JSON-serialisable and is kept as a JSON
    attribute of ``/meta``; the keys `LOAD_META_KEYS` that `load_meta` adds are refused.
    """
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise RecordError(f"meta must be a dict, got {type(meta).__name__}")
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if not isinstance(key, str) or not _NAME.match(key):
            raise RecordError(f"meta key {key!r} is invalid: use ASCII letters, digits and _.-+=")
        if len(key) > MAX_META_KEY:  # an attribute of /meta: a longer name was h5py's KeyError traceback
            raise RecordError(f"meta key {key[:20]!r}... has {len(key)} characters, more than the {MAX_META_KEY} an "
                              "HDF5 attribute name holds; use a shorter key")
        if key in LOAD_META_KEYS:
            raise RecordError(f"meta key {key!r} is reserved: load_meta reports the record's own {key} under it; "
                              "rename the key")
        if value is None:
            continue
        if key == "method":
            if not isinstance(value, str):
                raise RecordError(f"meta['method'] must be a string, got {type(value).__name__}")
            _storable_text(key, value)
        elif key == "config":
            if not isinstance(value, Mapping):
                raise RecordError(f"meta['config'] must be a dict, got {type(value).__name__}")
            value = loads_json(_json(key, dict(value)))
        elif key == "seed":
            # stored as the int64 root attribute: 2**63 was an OverflowError traceback at the first segment's creation
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= 2**63 - 1:
                raise RecordError(f"meta['seed'] must be a non-negative int of at most 2**63 - 1 (int64), got {value!r}")
            value = int(value)
        elif key in ("op_names", "cell_types"):
            value = _str_list(key, value)
        elif key == "edge_names":
            if not isinstance(value, Mapping):
                raise RecordError("meta['edge_names'] must be a dict mapping cell type -> list of edge names")
            value = {str(k): _str_list(f"edge_names/{k}", v) for k, v in value.items()}
            for cell in value:
                if not _NAME.match(cell) or cell in (".", ".."):  # an HDF5 name: "." and ".." are taken
                    raise RecordError(f"cell type {cell!r} in meta['edge_names'] is invalid: use ASCII letters, digits and _.-+= "
                                      "(not '.' or '..')")
        else:
            value = loads_json(_json(key, value))
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


_SYMBOLS = re.compile(r"[A-Za-z]+|\d+")


def _family_dims(fam) -> tuple[str, ...] | None:
    """A family's row shape as symbols, e.g. ``("E", "K")`` for ``"(E, K)"``; None if it has no E/K."""
    dims = tuple(_SYMBOLS.findall(fam.shape))
    return dims if any(d in ("E", "K") for d in dims) else None


def check_against_meta(path: str, shape: tuple[int, ...], meta: Mapping[str, Any]) -> None:
    """Check the row shape of a vocabulary path whose shape is given in E (edges) and K (ops).

    The family comes from `nasdiag.vocabulary.family_of` (``arch/<cell>/weights`` is (E, K),
    ``regret/<cell>/regret`` is (E,), ...). E is ``len(meta["edge_names"][cell])`` and K is
    ``len(meta["op_names"])``; where meta gives either, the number of axes and the sizes meta
    gives are checked. ``<cell>`` must be one of ``meta["cell_types"]`` when that is given. Paths
    of no family, or of a family without E/K axes, are not checked. Raises `RecordError`.
    """
    fam = vocabulary.family_of(path)
    dims = _family_dims(fam) if fam is not None else None
    if dims is None:
        return
    cell = None
    pattern = fam.pattern.split("/")
    if "<cell>" in pattern:
        cell = path.split("/")[pattern.index("<cell>")]
        cells = meta.get("cell_types")
        if cells is not None and cell not in cells:
            raise RecordError(f"{path!r}: cell type {cell!r} is not in meta['cell_types'] {cells}")
    sizes = {
        "K": len(meta["op_names"]) if "op_names" in meta else None,
        "E": len(meta["edge_names"][cell]) if cell in meta.get("edge_names", {}) else None,
    }
    if all(sizes.get(d) is None for d in dims if d in sizes):
        return  # meta gives neither E nor K: nothing to check against
    # other symbols (e.g. R, the cells of a type, in regret/<cell>/rewards) are not checked
    want = tuple(sizes.get(d) if d in sizes else int(d) if d.isdigit() else None for d in dims)
    if len(shape) != len(dims) or any(w is not None and got != w for got, w in zip(shape, want)):
        text = ", ".join(str(w) if w is not None else d for d, w in zip(dims, want))
        text = f"({text},)" if len(dims) == 1 else f"({text})"
        raise RecordError(f"{path!r}: a row must have shape {fam.shape} = {text} from meta, got {shape}")
