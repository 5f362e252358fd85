"""The figure registry: one drawing function per record path family.

A figure module in ``nasdiag/plot/`` registers its figures when imported; every module of the package
is imported the first time the registry is read (as the method registry does with
``nasdiag/search/methods/``), so a new family gets its figure by adding one function in one file::

    from nasdiag import vocabulary as V
    from nasdiag.plot.registry import Heatmap, figure, heatmap

    @heatmap(V.SAMPLE_COUNT, name="sample_count", caption="How often each op was sampled.", paper="DSNAS Fig. 6b")
    def sample_count(record, cell, row):          # -> Heatmap (also drawn side by side across runs)
        ...

    @figure(V.REGRET_REGRET, name="regret", caption="Regret per edge against the bound of Theorem 1.")
    def regret_curves(record, cell):              # -> matplotlib Figure
        ...

`write_figures` then draws every registered figure whose family has paths in a record, once per cell
type (``<cell>``), and `write_comparison` draws each heatmap of several records side by side on one
colour scale. Nothing here imports matplotlib; figure modules do, when the registry loads them.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import numbers
import os
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from nasdiag import vocabulary as V
from nasdiag.errors import NasdiagError

FORMATS = ("png", "pdf", "svg")
Record = Mapping[str, np.ndarray]
FamilyLike = Union[V.Family, str]


class PlotError(NasdiagError, ValueError):
    """A record lacks what a figure needs, or a figure option is invalid; the message says which."""


class PlotTypeError(PlotError, TypeError):
    """An argument of the wrong type (a loaded record where the function reads a record's path)."""


def checked_record_path(record_path, function: str):
    """``record_path`` if it names a file (str or os.PathLike); else one `PlotTypeError` line: a dict of `load` passed
    to ``function`` stopped in pathlib's TypeError traceback."""
    if isinstance(record_path, (str, os.PathLike)):
        return record_path
    got = "a loaded record (a dict of nasdiag.record.load)" if isinstance(record_path, Mapping) else type(record_path).__name__
    raise PlotTypeError(f"{function} takes the path of a record file, got {got}; pass the file name (what load() was "
                        "given), or draw loaded records with nasdiag.plot.write_comparison({label: record}, out)")


class NothingToDraw(PlotError):
    """A figure has no data to show in this record (no rows yet, or every value NaN); it is skipped
    with this one-line message instead of drawing an empty plot."""


@dataclass
class Heatmap:
    """What a heatmap figure shows; the registry renders it alone or side by side with other runs.

    Attributes:
        matrix: (rows, cols) values; NaN cells are drawn grey and counted in the title.
        rows, cols: tick labels (edges ``i->j`` and op names for (E, K) statistics).
        title: what and when, e.g. ``"normal cell: cost mean E[C], steps 1-24 (epoch 0)"``.
        colorbar: colour-bar label with the unit or sign convention.
        signed: True: diverging map centred at 0; False: sequential map; None: diverging if any value
            is negative, else sequential.
        limits: a fixed (vmin, vmax) instead of a scale fitted to the data.
        xlabel, ylabel: axis labels.
        step: the record step the matrix belongs to (for comparison titles).
    """

    matrix: np.ndarray
    rows: Sequence[str]
    cols: Sequence[str]
    title: str
    colorbar: str
    signed: Optional[bool] = None
    limits: Optional[Tuple[float, float]] = None
    xlabel: str = "operation"
    ylabel: str = "edge (node i -> node j)"
    step: Optional[int] = None


@dataclass(frozen=True)
class FigureSpec:
    """One registered figure.

    Attributes:
        name: the selector of ``--figures`` (``"cost"``, ``"arch_evolution"``, ...).
        families: the families it draws; the figure is drawn for each ``<cell>`` that has a path of any.
        draw: ``(record, cell) -> Figure``, or ``(record, cell, row) -> Figure | Heatmap`` for ``rows``.
        file: file-name template (``{cell}`` is replaced), without suffix.
        caption: one sentence: what the figure shows.
        paper: the paper figure it mirrors (``""`` if none).
        rows: the figure shows one recorded row, selectable with ``at`` (init, final, a step).
        is_heatmap: ``draw`` returns a :class:`Heatmap` (also drawn across runs by `write_comparison`).
        reads: families of other paths whose values it draws (SparseNAS's |A| of ``arch/<cell>/params`` beside the
            boolean ``sparsity/`` family it is drawn for): their NaN/inf are counted with the figure's (`Drawn.nonfinite`).
    """

    name: str
    families: Tuple[V.Family, ...]
    draw: Callable
    file: str
    caption: str
    paper: str = ""
    rows: bool = False
    is_heatmap: bool = False
    reads: Tuple[V.Family, ...] = ()

    @property
    def group(self) -> str:
        """The record group the figure belongs to (``scalars``, ``arch``, ``cost``, ...), for reports."""
        return self.families[0].pattern.split("/")[0]

    def cells(self, record_paths: Sequence[str]) -> List[Optional[str]]:
        """Cell types with data for this figure (``[None]`` for families without ``<cell>``), or []."""
        found: Dict[Optional[str], None] = {}
        for fam in self.families:
            if "<cell>" in fam.pattern:
                found.update(dict.fromkeys(V.cells_with(record_paths, fam)))
            elif any(fam.regex.match(p) for p in record_paths):
                found[None] = None
        return list(found)

    def filename(self, cell: Optional[str]) -> str:
        return self.file.format(cell=cell or "").replace("__", "_").strip("_")


_FIGURES: Dict[str, FigureSpec] = {}
_BUILTINS_LOADED = False


def _as_family(spec: FamilyLike) -> V.Family:
    if isinstance(spec, V.Family):
        return spec
    for fam in V.families():
        if fam.pattern == spec:
            return fam
    if not isinstance(spec, str) or not spec or "/" not in spec:
        raise ValueError(f"a figure is keyed by a nasdiag.vocabulary family or a path pattern like 'x/<cell>/y', got {spec!r}")
    # an undeclared pattern: matched like a family, but not added to the vocabulary
    return V.Family(spec, "", "", "same", "")


def _register(families, name: str, file: Optional[str], caption: str, paper: str, rows: bool, is_heatmap: bool,
              reads: Sequence[FamilyLike] = ()):
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"figure name {name!r} must be lower-case letters, digits and '_'")
    fams = tuple(_as_family(f) for f in (families if isinstance(families, (tuple, list)) else (families,)))
    if not caption.strip():
        raise ValueError(f"figure {name!r} needs a caption: one sentence saying what it shows")

    def decorate(fn: Callable) -> Callable:
        if rows and len(inspect.signature(fn).parameters) < 3:
            raise TypeError(f"figure {name!r} selects rows, so it takes (record, cell, row)")
        template = file or (f"{name}_{{cell}}" if any("<cell>" in f.pattern for f in fams) else name)
        spec = FigureSpec(name, fams, fn, template, caption.strip(), paper, rows, is_heatmap,
                          tuple(_as_family(f) for f in (reads if isinstance(reads, (tuple, list)) else (reads,))))
        if not fn.__module__.startswith("nasdiag.plot."):
            # the built-ins first: a user's figure registered under a built-in's name before the registry was read
            # was taken, and every later read stopped in the built-in module's own registration (its ValueError)
            _load_builtins()
        previous = _FIGURES.get(name)
        builtin = previous is not None and previous.draw.__module__.startswith("nasdiag.plot.")
        if previous is not None and (previous.draw.__qualname__ != fn.__qualname__
                                     or (builtin and previous.draw.__module__ != fn.__module__)):
            raise ValueError(f"a different figure is already registered as {name!r}: {previous.draw.__module__}.{previous.draw.__qualname__}")
        _FIGURES[name] = spec
        return fn

    return decorate


def figure(families: Union[FamilyLike, Sequence[FamilyLike]], *, name: str, caption: str, paper: str = "",
           file: Optional[str] = None, rows: bool = False, reads: Sequence[FamilyLike] = ()) -> Callable:
    """Register ``fn(record, cell) -> matplotlib Figure`` (``fn(record, cell, row)`` with ``rows=True``).

    Args:
        families: a `nasdiag.vocabulary` family (or its pattern, or a tuple of them): the figure is drawn
            once per ``<cell>`` with a path of one of them (once, with ``cell=None``, for families without
            ``<cell>``).
        name: selector for ``nasdiag plot --figures``; also the file name (``<name>_<cell>``) unless
            ``file`` gives a template with ``{cell}``.
        caption: one sentence saying what the figure shows (shown in ``nasdiag report``).
        paper: the paper figure it mirrors, e.g. ``"wiring supplement Figs 5, 6"``.
        rows: ``fn`` draws one recorded row (an index into ``record["step"]``), chosen by ``at``.
        reads: families of other paths whose values ``fn`` draws (not ones it is drawn for): their NaN/inf are
            counted in ``nasdiag plot``'s line as the figure's own.

    ``fn`` raises :class:`NothingToDraw` when the record has nothing to show; it must not draw empty plots.
    """
    return _register(families, name, file, caption, paper, rows, is_heatmap=False, reads=reads)


def heatmap(families: Union[FamilyLike, Sequence[FamilyLike]], *, name: str, caption: str, paper: str = "",
            file: Optional[str] = None, reads: Sequence[FamilyLike] = ()) -> Callable:
    """Register ``fn(record, cell, row) -> Heatmap``: drawn per record (rows chosen by ``at``) and side by
    side across records on one colour scale (`write_comparison`). Arguments as for :func:`figure`."""
    return _register(families, name, file, caption, paper, rows=True, is_heatmap=True, reads=reads)


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    import nasdiag.plot as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")


def registered() -> Dict[str, FigureSpec]:
    """``{name: FigureSpec}`` of every registered figure, in registration order."""
    _load_builtins()
    return dict(_FIGURES)


def select(names: Optional[Sequence[str]]) -> List[FigureSpec]:
    """The specs chosen by ``names`` (a list, or comma-separated in one string; None: all). A name selects the figure of that name or, if there is
    none, every figure of that record group (``regret`` selects all figures of ``regret/`` families)."""
    specs = registered()
    if names is None:
        return list(specs.values())
    if isinstance(names, str):  # "cost,hessian", as --figures and `at` take it (was read letter by letter)
        names = names.split(",")
    chosen: Dict[str, FigureSpec] = {}
    unknown = []
    for token in names:
        token = token.strip()
        if not token:
            continue
        hits = [specs[token]] if token in specs else [s for s in specs.values() if s.group == token]
        if not hits:
            unknown.append(token)
        chosen.update((s.name, s) for s in hits)
    if unknown:
        groups = sorted({s.group for s in specs.values()} - set(specs))
        raise PlotError(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(specs)} "
                        f"or a group: {', '.join(groups)}")
    return [s for s in specs.values() if s.name in chosen]


# -- rows --------------------------------------------------------------------------------------------
def parse_at(at: Union[None, str, Sequence]) -> Optional[List[Union[str, int]]]:
    """``"init,final,120"`` -> ``["init", "final", 120]``; None stays None (each figure's default row)."""
    if at is None:
        return None
    tokens = at.split(",") if isinstance(at, str) else list(at)
    out: List[Union[str, int]] = []
    for t in tokens:
        t = str(t).strip()
        if not t:
            continue
        if t in ("init", "final"):
            out.append(t)
        elif re.fullmatch(r"\d+", t):
            out.append(int(t))
        else:
            raise PlotError(f"--at takes init, final or a step number (comma-separated), not {t!r}")
    if not out:
        raise PlotError("--at is empty; give init, final or step numbers")
    return out


def valid_rows(record: Record, path: str) -> np.ndarray:
    """Indices of the rows in which ``path`` was logged."""
    if path not in record:
        raise NothingToDraw(f"the record has no {path}")
    valid = record.get(f"valid/{path}")
    return np.flatnonzero(valid) if valid is not None else np.arange(len(record["step"]))


def resolve_row(record: Record, path: str, at: Union[str, int]) -> int:
    """The row index of ``path`` for one ``at`` token: ``init`` its first logged row, ``final`` its last,
    a step number the last logged row at or before that step."""
    rows = valid_rows(record, path)
    if rows.size == 0:
        raise NothingToDraw(f"{path} has no rows yet")
    if at == "init":
        return int(rows[0])
    if at == "final":
        return int(rows[-1])
    steps = record["step"][rows]
    before = np.flatnonzero(steps <= int(at))
    if before.size == 0:
        raise NothingToDraw(f"{path} is first recorded at step {int(steps[0])}, after step {at}")
    return int(rows[before[-1]])


def malformed_paths(record: Record) -> Dict[str, str]:
    """``{path: why}`` for the record's paths of a `nasdiag.vocabulary` family whose rows do not have the family's
    shape: another number of axes, or an E (edges) or K (ops) other than the first such path of the cell type (of the
    record, for a family without ``<cell>``) gives. The recorder checks shapes against meta only, so a record written
    without ``op_names`` / ``edge_names`` may hold them; figures leave these paths out instead of failing on them.
    (Names in meta that do not match the rows are no reason: the figures then label ops and edges by number.)"""
    sizes: Dict[Tuple[str, Optional[str]], Tuple[int, str]] = {}
    bad: Dict[str, str] = {}
    for path, values in record.items():
        fam = None if path == "step" or path.startswith(("valid/", "meta/")) else V.family_of(path)
        if fam is None or not fam.shape:
            continue
        dims = re.findall(r"[A-Za-z]+|\d+", fam.shape)
        shape = tuple(np.shape(values)[1:])
        if len(shape) != len(dims):
            bad[path] = f"{path} has rows of shape {shape}, not the {fam.shape} of its family"
            continue
        parts = fam.pattern.split("/")
        cell = path.split("/")[parts.index("<cell>")] if "<cell>" in parts else None
        for dim, n in zip(dims, shape):
            if dim in ("E", "K"):
                # per cell type: the probe's statistics of edges with different op sets are one group per edge,
                # each with its own K (docs/probe.md, "Streaming statistics")
                n_known, source = sizes.setdefault((dim, cell), (n, path))
                if n != n_known:
                    bad[path] = f"{path} has rows of shape {shape}: {dim} = {n}, but {source} gives {dim} = {n_known}"
                    break
    return bad


def _without(record: Record, bad: Mapping[str, str]) -> Record:
    """``record`` without the ``bad`` paths and their ``valid/`` masks."""
    if not bad:
        return record
    return {k: v for k, v in record.items() if k not in bad and not (k.startswith("valid/") and k[len("valid/"):] in bad)}


def malformed_lines(record: Record, skipped: Sequence[str]) -> List[str]:
    """One line for each malformed path (`malformed_paths`) that no line of ``skipped`` names yet: one that only
    figures of other families read (the |A| of SparseNAS) or one of a ``<name>`` family (a scalar)."""
    return [f"{why}; left out of the figures" for path, why in malformed_paths(record).items()
            if not any(f"{path} has rows" in line for line in skipped)]


def without_malformed(record: Record) -> Record:
    """``record`` without its malformed paths (`malformed_paths`), for whatever reads it beside the figures."""
    return _without(record, malformed_paths(record))


def _bad_path_of(spec: FigureSpec, cell: Optional[str], bad: Mapping[str, str]) -> Optional[str]:
    """The first malformed path of the figure's own families for ``cell`` (families with ``<name>`` draw the rest)."""
    for fam in spec.families:
        if "<name>" not in fam.pattern:
            path = fam.path(cell=cell) if cell is not None and "<cell>" in fam.pattern else fam.pattern
            if path in bad:
                return path
    return None


def _row_path(spec: FigureSpec, record: Record, cell: Optional[str]) -> str:
    for fam in spec.families:
        path = fam.path(cell=cell) if cell is not None and "<cell>" in fam.pattern else fam.pattern
        if path in record:
            return path
    raise NothingToDraw(f"the record has no {spec.families[0].pattern}")


def check_at_steps(at_tokens, record: Record, record_path) -> None:
    """Refuse (`PlotError`) an ``at`` step (``at_tokens``: `parse_at`'s list) after the record's last step (its figure
    would show the last rows under a file name promising a later step) or before its first (no figure has a row there:
    each was skipped)."""
    if len(record["step"]) == 0:  # no rows: said by the caller
        return
    first, last = int(record["step"][0]), int(record["step"][-1])
    early = [t for t in at_tokens or () if isinstance(t, int) and t < first]
    if early:
        raise PlotError(f"--at {','.join(map(str, early))}: record {record_path} starts at step {first}, so no figure "
                        f"has a row there; give steps from {first} to {last}, or init/final")
    late = [t for t in at_tokens or () if isinstance(t, int) and t > last]
    if late:
        raise PlotError(f"--at {','.join(map(str, late))}: record {record_path} ends at step {last} "
                        f"(row {len(record['step'])}); give steps up to {last}, or init/final")


def _at_label(at: Union[str, int]) -> str:
    return at if isinstance(at, str) else f"step{at}"


# -- inputs ------------------------------------------------------------------------------------------
#: first bytes of a torch.save file: its zip archive, or a pickle (protocol 2-5) of older torch versions
_TORCH_SIGNATURES = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
_CHECKPOINT_SUFFIXES = (".ckpt", ".ckpt.tmp")


def no_rows(record_path, nothing: str) -> "PlotError":
    """The error for a record of no committed row (``nothing``: "nothing to plot"): its writer is at its first steps (it
    holds the lock), or stopped before recording any (killed: its lock file is left, held by none), which "no committed
    rows yet" made look like a run still starting."""
    from nasdiag.record.lock import read_lock

    state = read_lock(os.fspath(record_path))  # once: a second read could see another writer
    if state.held:
        return PlotError(f"record {record_path} has no committed rows yet: its writer ({state.description}) has recorded "
                         f"none so far; {nothing} now, run the command again in a while")
    if state.held is False:  # a lock file the kernel's table lists no lock on
        return PlotError(f"record {record_path} holds no row: its writer stopped (killed) before it recorded any, leaving its "
                         f"lock file; {nothing}. A nasdiag search continues it with --resume and the options it was started "
                         "with, or starts it again with --force")
    return PlotError(f"record {record_path} has no committed rows yet; {nothing}")


def _record_of_temp(path: Path) -> Optional[Path]:
    """The existing record whose segment is built under the name ``path`` (`schema.temp_path`: ``run.h5.tmp``,
    ``run.seg0002.h5.tmp`` -> ``run.h5``), else None (also for a checkpoint being written, ``run.h5.ckpt.tmp``)."""
    from nasdiag.record.schema import segment_owner

    if not path.name.endswith(".tmp") or path.name.endswith(_CHECKPOINT_SUFFIXES) or len(path.name) <= len(".tmp"):
        return None
    built = path.with_name(path.name[: -len(".tmp")])
    owner = segment_owner(str(built))
    record = Path(owner) if owner is not None else built
    return record if record.is_file() else None


def refuse_checkpoint(record_path) -> None:
    """Raise `PlotError` when ``record_path`` is a search checkpoint (``<record>.ckpt``, or any file that is
    not HDF5 but starts like a torch.save file), the writer lock of a record (``<record>.lock`` next to that
    record) or a segment of a record being built (``<record>.tmp``, ``<root>.segNNNN<ext>.tmp``) instead of a record, naming the record to pass; a missing or unreadable file is left to the record
    reader's message."""
    from nasdiag.record.reader import HDF5_SIGNATURE

    path = Path(record_path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(HDF5_SIGNATURE))
    except OSError:
        return
    if head != HDF5_SIGNATURE and len(path.name) > len(".lock") and path.name.endswith(".lock"):
        record = path.with_name(path.name[: -len(".lock")])
        if record.exists():  # `schema.lock_path`: "is not a nasdiag record: it is not an HDF5 file" named no record
            raise PlotError(f"{path} is the writer lock of the record {record} (a small file naming the process that "
                            f"writes it), not a record; pass the record {record} instead")
    record = _record_of_temp(path)
    if record is not None:  # run.seg0002.h5.tmp "is damaged: it holds segment 2 of its run, not segment 0"; run.h5.tmp
        raise PlotError(f"{path} is a segment of the record {record} being built (or left by a writer killed while it "
                        f"built it), not a record; pass the record {record} instead")  # was drawn as a run of its own
    named = path.name.endswith(_CHECKPOINT_SUFFIXES)
    if head == HDF5_SIGNATURE or not (named or head.startswith(_TORCH_SIGNATURES)):
        return
    suffix = next((x for x in _CHECKPOINT_SUFFIXES[::-1] if path.name.endswith(x)), None)
    record = path.with_name(path.name[: -len(suffix)]) if suffix else None
    target = f"the record {record}" if record is not None and record.exists() else "the .h5 record it belongs to"
    raise PlotError(f"{path} is a nasdiag checkpoint (the search's resume state, a torch file), not a record; "
                    f"pass {target} instead")


# -- non-finite values -------------------------------------------------------------------------------
#: the kinds of non-finite values, in the order figures and messages name them
NONFINITE_KINDS = ("NaN", "+inf", "−inf")


def nonfinite_counts(values) -> Dict[str, int]:
    """``{"NaN": n, "+inf": n, "−inf": n}`` of ``values`` (any shape), without the kinds that are absent;
    ``{}`` for integer or boolean arrays and for all-finite ones."""
    values = np.asarray(values)
    if values.dtype.kind not in "fc":
        return {}
    counts = dict(zip(NONFINITE_KINDS, (int(np.count_nonzero(np.isnan(values))),
                                        int(np.count_nonzero(np.isposinf(values))),
                                        int(np.count_nonzero(np.isneginf(values))))))
    return {k: n for k, n in counts.items() if n}


def nonfinite_text(counts: Mapping[str, int]) -> str:
    """``"2 NaN, 1 +inf"`` (``""`` for no counts)."""
    return ", ".join(f"{counts[k]} {k}" for k in NONFINITE_KINDS if counts.get(k))


def family_nonfinite(record: Record, specs: Sequence["FigureSpec"]) -> Dict[str, Dict[str, int]]:
    """``{path: nonfinite_counts}`` over the logged rows of every record path of the ``specs``' families
    that holds a NaN or inf (paths in record order)."""
    # the paths a figure draws beside those it is drawn for (SparseNAS's |A|): a NaN there was "no NaN/inf"
    families = {fam.pattern: fam for spec in specs for fam in spec.families + spec.reads}.values()
    found = {}
    for path in record:
        if path.startswith(("valid/", "meta/")) or path == "step" or not any(f.regex.match(path) for f in families):
            continue
        counts = nonfinite_counts(np.asarray(record[path])[valid_rows(record, path)])
        if counts:
            found[path] = counts
    return found


def nonfinite_summary(found: Mapping[str, Mapping[str, int]], most: int = 4) -> str:
    """One phrase for `family_nonfinite`'s result: ``"no NaN/inf"`` or
    ``"1 NaN, 1 +inf (scalars/x: 1 NaN; cost/normal/mean: 1 +inf)"`` (at most ``most`` paths named)."""
    if not found:
        return "no NaN/inf"
    total = {k: sum(c.get(k, 0) for c in found.values()) for k in NONFINITE_KINDS}
    named = [f"{path}: {nonfinite_text(c)}" for path, c in list(found.items())[:most]]
    more = f"; {len(found) - most} more paths" if len(found) > most else ""
    return f"{nonfinite_text(total)} ({'; '.join(named)}{more})"


# -- drawing -----------------------------------------------------------------------------------------
@dataclass
class Drawn:
    """The figures drawn from one record: ``files`` in order, one line per figure that was skipped, and
    ``nonfinite``: `family_nonfinite` of the figures tried (their NaN/inf are marked in the figures)."""

    files: List[Path] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    specs: Dict[Path, FigureSpec] = field(default_factory=dict)
    nonfinite: Dict[str, Dict[str, int]] = field(default_factory=dict)


def iter_figures(record: Record, figures: Optional[Sequence[str]] = None, at=None):
    """Yield ``(spec, cell, at label or None, thunk)`` for every figure the record supports; calling the
    thunk draws it (a matplotlib Figure) or raises :class:`NothingToDraw`."""
    from nasdiag.plot.style import render_heatmap

    ats = parse_at(at)
    paths = [k for k in record if not k.startswith(("valid/", "meta/")) and k != "step"]
    bad = malformed_paths(record)
    record = _without(record, bad)
    for spec in select(figures):
        for cell in spec.cells(paths):
            malformed = _bad_path_of(spec, cell, bad)
            if malformed is not None:
                def refuse(why=f"{bad[malformed]}; left out of the figures"):
                    raise NothingToDraw(why)

                yield spec, cell, None if ats is None or not spec.rows else _at_label(ats[0]), refuse
                continue
            if not spec.rows:
                yield spec, cell, None, (lambda s=spec, c=cell: s.draw(record, c))
                continue
            for token in ats or ["final"]:
                label = None if ats is None else _at_label(token)

                def thunk(s=spec, c=cell, t=token):
                    path = _row_path(s, record, c)
                    row = resolve_row(record, path, t)
                    values = np.asarray(record[path][row])
                    if values.dtype.kind == "f" and not np.isfinite(values).any():
                        # say what the row holds: an all-inf row is not NaN
                        kinds = nonfinite_counts(values)
                        what = "NaN" if list(kinds) == ["NaN"] else f"not finite ({nonfinite_text(kinds)})"
                        raise NothingToDraw(f"{path} is {what} at step {int(record['step'][row])}; nothing to draw")
                    out = s.draw(record, c, row)
                    return render_heatmap(out) if s.is_heatmap else out

                yield spec, cell, label, thunk


#: what makes one record's figure files byte-identical on every run: no creation date in SVG/PDF metadata, and
#: SVG element ids from a fixed salt instead of a random one
_REPRODUCIBLE_METADATA = {"svg": {"Date": None}, "pdf": {"CreationDate": None}}
_REPRODUCIBLE_RC = {"svg.hashsalt": "nasdiag"}
#: rcParams of `nasdiag.plot.style.RC` that act when a file is written: TrueType (42) fonts in PDFs, text in SVGs
_FILE_FONTS = ("pdf.fonttype", "svg.fonttype")
#: written into every figure file (a PNG text chunk, the PDF's and SVG's Creator): `is_nasdiag_figure` tells a figure
#: nasdiag drew from a file of the same name it did not (``scalars.png`` of the user's own), which plot and search
#: refuse to replace
FIGURE_MARK = "nasdiag figure"
_METADATA = {fmt: {**_REPRODUCIBLE_METADATA.get(fmt, {}), "Creator": FIGURE_MARK} for fmt in ("png", "pdf", "svg")}


def is_nasdiag_figure(path) -> bool:
    """Whether the file at ``path`` is a figure nasdiag drew (it holds `FIGURE_MARK`); False if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return FIGURE_MARK.encode() in f.read()
    except OSError:
        return False


def save(fig, path: Path, dpi: int) -> None:
    """Write ``fig`` to ``path`` (format from the suffix) and close it; the same figure gives the same bytes.

    As `_write_figure` (below), then the temporaries of this figure that killed processes left are removed (a drawing
    pass of one figure; `draw_record` and `write_comparison` remove those of all their figures once, after the pass)."""
    folder, name = _write_figure(fig, path, dpi)
    _remove_stale_temporaries({folder: {name}})


def _write_figure(fig, path: Path, dpi: int) -> Tuple[Path, str]:
    """Write ``fig`` to ``path`` (format from the suffix) and close it; the same figure gives the same bytes. Returns
    the folder the file was written in and the name its temporaries carry (`_remove_stale_temporaries`).

    The file is written under a fresh hidden name next to the file it replaces (``.<pid>.<random>.<name>.tmp``,
    created exclusively), flushed to disk (``os.fsync``) and renamed over it, so a reader never sees a half-written
    figure: a process killed mid-write (a search killed while it drew its figures) left a truncated figure under the
    figure's own name; the one fixed name ``.<name>.tmp`` let two plots into one folder write into the same file, and
    a symbolic link of that name had the figure written into the file it named. A ``path`` that is a symbolic link is
    written through, as a record or a report: the figure replaces the file the link names, and the link stays (it was
    replaced by the new figure, lost, and its file kept the old one)."""
    import matplotlib
    import matplotlib.pyplot as plt

    from nasdiag.plot.style import RC

    path = Path(path)
    fmt = path.suffix.lstrip(".").lower()
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    stem = target.name if len(os.fsencode(target.name)) <= 200 else f"figure.{fmt}"  # a long name: no "too long"
    tmp = temporary_path(target, stem)  # ends as the name: a figure's .tmp
    # the fonts of the paper style are read when the file is written, not when the figure is drawn: saved outside
    # `paper_style`, a PDF got Type 3 fonts (refused by IEEE's and ACM's checks) and an SVG its text as paths
    fonts = {key: RC[key] for key in _FILE_FONTS}
    try:  # "x": never an existing file (nor one a link of that name points to)
        fh = open(tmp, "xb")
    except OSError as exc:  # a read-only folder was "... not writable (Permission denied) (<folder>/.123.ab12cd34.x.png.tmp)"
        from nasdiag.record.lock import describe_os_error

        plt.close(fig)
        through = f" (the file {path} links to)" if target != path else ""
        raise PlotError(f"cannot write the figure {target}{through}: {describe_os_error(exc)} in {target.parent}; draw "
                        f"the figures into a folder where files can be written") from None
    created = True
    try:
        with fh:
            with matplotlib.rc_context({**_REPRODUCIBLE_RC, **fonts}):
                fig.savefig(fh, format=fmt, dpi=dpi, bbox_inches="tight", pad_inches=0.04,
                            metadata=_METADATA.get(fmt))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        created = False
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
    return target.parent, stem


#: a temporary file of `temporary_path` (a figure's of `_write_figure`, a page's of `nasdiag.plot.report.write_report`):
#: ``.<pid>.<8 hex digits>.<file name>.tmp``
_TEMPORARY = re.compile(r"\.([0-9]+)\.[0-9a-f]{8}\.(.+)\.tmp")


def temporary_path(target: Path, stem: str) -> Path:
    """A fresh hidden name next to ``target`` to build it under before it is renamed over ``target``:
    ``.<pid>.<8 random hex digits>.<stem>.tmp`` (``stem``: ``target``'s name, or a shorter one where that is long), the
    name `_remove_stale_temporaries` knows, so that what a killed process left is removed by the next writer of the
    file: a figure's (`_write_figure`) and a report's page (`nasdiag.plot.report.write_report`)."""
    import secrets

    return Path(target).with_name(f".{os.getpid()}.{secrets.token_hex(4)}.{stem}.tmp")


def _remove_stale_temporaries(written: Mapping[Path, set]) -> None:
    """Remove the temporary files of `temporary_path` that a process killed mid-write left for the files of a writing
    pass (``written``: ``{folder: {file name}}``, as `_write_figure` returns them; a report's page alone):
    ``.<pid>.<random>.<name>.tmp`` of a process no longer running (the one fixed name of before was reused); one of a
    plot or report still running is kept, and so is a temporary of a file the pass did not write. Each folder is listed
    once per pass (it was once per figure)."""
    for folder, stems in written.items():
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            match = _TEMPORARY.fullmatch(name)
            if match is None or match.group(2) not in stems or int(match.group(1)) == os.getpid():
                continue
            try:
                os.kill(int(match.group(1)), 0)
                continue  # running: its figure is being written
            except ProcessLookupError:
                pass
            except (OSError, OverflowError):
                continue  # another user's process, or no such pid number: not ours to judge
            with contextlib.suppress(OSError):
                if not os.path.islink(folder / name) and os.path.isfile(folder / name):
                    os.unlink(folder / name)


def check_output(fmt: str, dpi) -> None:
    """Refuse (`PlotError`) an unknown figure format or a dpi that is not a positive number (matplotlib's ValueError
    traceback, after the folder was made)."""
    if fmt not in FORMATS:
        raise PlotError(f"unknown figure format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if isinstance(dpi, bool) or not isinstance(dpi, numbers.Real) or not dpi > 0:
        raise PlotError(f"dpi must be a positive number of dots per inch, e.g. 150, not {dpi!r}")


def draw_record(record: Record, out_dir, fmt: str = "png", figures: Optional[Sequence[str]] = None, at=None,
                dpi: int = 150) -> Drawn:
    """Draw every registered figure ``record`` (a dict from `nasdiag.record.load`) supports into ``out_dir``.

    Files are ``<figure file>[_<at>].<fmt>``; a figure with nothing to show is skipped with one line in
    ``Drawn.skipped``. Raises `PlotError` if ``fmt`` or ``figures`` is unknown.
    """
    check_output(fmt, dpi)
    import warnings

    from nasdiag.plot.style import paper_style

    select(figures)  # an unknown name is refused before the folder is made
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn = Drawn()
    tried: Dict[str, FigureSpec] = {}
    written: Dict[Path, set] = {}  # {folder: {figure file}}: their killed writers' temporaries are removed once, at the end
    try:
        for spec, cell, label, thunk in iter_figures(record, figures, at):
            tried[spec.name] = spec
            stem = spec.filename(cell) + (f"_{label}" if label else "")
            try:
                with warnings.catch_warnings(), paper_style():
                    warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices are reported, not warned
                    fig = thunk()
            except NothingToDraw as exc:
                drawn.skipped.append(f"{stem}: {exc}")
                continue
            path = out / f"{stem}.{fmt}"
            folder, name = _write_figure(fig, path, dpi)
            written.setdefault(folder, set()).add(name)
            drawn.files.append(path)
            drawn.specs[path] = spec
    finally:
        _remove_stale_temporaries(written)
    drawn.nonfinite = family_nonfinite(record, list(tried.values()))
    if figures is None:  # every figure was tried: say what was left out of them
        drawn.skipped += malformed_lines(record, drawn.skipped)
    return drawn


class WrittenFigures(list):
    """The written files (a list of paths, as before), with ``skipped``: one line per figure not drawn, and
    ``nonfinite``: the NaN/inf counts of the drawn families (see `Drawn`)."""

    skipped: List[str]
    nonfinite: Dict[str, Dict[str, int]]


def write_figures(record_path, out_dir, fmt: str = "png", figures: Optional[Sequence[str]] = None, at=None,
                  dpi: int = 150) -> WrittenFigures:
    """Draw every registered figure whose paths are in the record at ``record_path`` into ``out_dir``.

    Args:
        record_path: an HDF5 record (also one that a search is still writing).
        out_dir: folder, created if needed.
        fmt: ``png``, ``pdf`` or ``svg``.
        figures: figure names to draw, a list or comma-separated as ``--figures`` (see `select`); None: all.
        at: rows of the row figures (heatmaps): ``"init,final,120"`` or a list; None: the last row, and
            file names without an ``_<at>`` suffix.
        dpi: raster resolution (png).

    Returns:
        The written files (a list), with ``.skipped`` listing the figures that had nothing to draw.

    Raises:
        PlotError: the record has no committed rows, or an option is invalid (also an ``at`` step before the
            record's first step or after its last).
        RecordError: the record cannot be read.
    """
    from nasdiag.record import load

    refuse_checkpoint(checked_record_path(record_path, "write_figures"))
    record = load(record_path)
    if len(record["step"]) == 0:
        raise no_rows(record_path, "nothing to plot")
    check_at_steps(parse_at(at), record, record_path)  # a later step drew the last rows into files named after it
    drawn = draw_record(record, out_dir, fmt, figures, at, dpi)
    written = WrittenFigures(drawn.files)
    written.skipped = drawn.skipped
    written.nonfinite = drawn.nonfinite
    return written


def write_comparison(records: Mapping[str, Record], out_dir, fmt: str = "png", figures: Optional[Sequence[str]] = None,
                     at=None, dpi: int = 150) -> Drawn:
    """For each registered heatmap, cell type and ``at`` row: one figure with the heatmap of every record
    side by side on one colour scale (``<file>[_<at>].<fmt>`` in ``out_dir``).

    Args:
        records: ``{run label: record dict}`` in display order.
    """
    check_output(fmt, dpi)
    ats = parse_at(at) or ["final"]
    for label, record in records.items():
        if not isinstance(record, Mapping):  # a path here stopped in "string indices must be integers" of check_at_steps
            raise PlotTypeError(f"write_comparison takes loaded records, {{label: nasdiag.record.load(path)}}, got "
                                f"{type(record).__name__} {record!r} for {label!r}; load it first")
        check_at_steps(parse_at(at), record, label)
    out = Path(out_dir)
    drawn = Drawn()
    records = {label: without_malformed(record) for label, record in records.items()}
    written: Dict[Path, set] = {}  # {folder: {figure file}}: their killed writers' temporaries are removed once, at the end
    try:
        _compare(records, out, fmt, figures, at, ats, dpi, drawn, written)
    finally:
        _remove_stale_temporaries(written)
    return drawn


def _compare(records, out: Path, fmt: str, figures, at, ats, dpi, drawn: Drawn, written: Dict[Path, set]) -> None:
    """The drawing pass of `write_comparison`: its figures into ``drawn``, their folders and names into ``written``."""
    from nasdiag.plot.style import paper_style, render_heatmaps

    for spec in select(figures):
        if not spec.is_heatmap:
            continue
        cells: Dict[Optional[str], None] = {}
        for record in records.values():
            cells.update(dict.fromkeys(spec.cells(list(record))))
        for cell in cells:
            for token in ats:
                stem = spec.filename(cell) + (f"_{_at_label(token)}" if at is not None else "")
                panels = {}
                for label, record in records.items():
                    try:
                        row = resolve_row(record, _row_path(spec, record, cell), token)
                        panels[label] = spec.draw(record, cell, row)
                    except NothingToDraw:
                        continue
                if len(panels) < 2:
                    drawn.skipped.append(f"{stem}: fewer than two runs have it; no comparison")
                    continue
                out.mkdir(parents=True, exist_ok=True)
                path = out / f"{stem}.{fmt}"
                try:
                    with paper_style():
                        fig = render_heatmaps(panels)
                except NothingToDraw as exc:
                    drawn.skipped.append(f"{stem}: {exc}")
                    continue
                folder, name = _write_figure(fig, path, dpi)
                written.setdefault(folder, set()).add(name)
                drawn.files.append(path)
                drawn.specs[path] = spec
