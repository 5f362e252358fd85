"""One self-contained HTML page of a run: meta, key numbers, genotype and every registered figure.

Images are PNGs inlined as base64 ``data:`` URIs and the style sheet is inline, so the page fetches
nothing from the network and can be mailed as one file. It reads the record through the SWMR reader,
so it also works while a search is still writing the record (it then says so and shows the rows
committed so far).

Writing never loses a file: the page replaces an existing file only if that file is a page this module
wrote (it starts with :data:`PAGE_START`) or with ``force``; the record being read (its segments, lock
and checkpoint) and any HDF5 file are never replaced. The page is built in a temporary file next to it
that is removed on every failure path; one that a killed report left (SIGKILL while it wrote) is removed by the next
report of the same page, as a figure's (`nasdiag.plot.registry.temporary_path`).
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import os
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from nasdiag.plot.registry import (
    NothingToDraw, PlotError, _remove_stale_temporaries, checked_record_path, iter_figures, malformed_lines, no_rows,
    refuse_checkpoint, select, temporary_path, without_malformed,
)

#: section titles of the record groups, in page order (groups not listed follow in registry order)
GROUP_TITLES = {
    "scalars": "Losses, accuracies and learning rates",
    "arch": "Architecture distribution",
    "cost": "Cost C = ∂L/∂Z (wiring supplement)",
    "hessian": "Curvature (BayesNAS appendix C)",
    "sample": "Sampling",
    "regret": "Experts and regret (XNAS)",
    "attention": "Attention (ASM-NAS)",
    "sparsity": "Sparsity (SparseNAS)",
    "bayes": "Sparse Bayesian statistics (BayesNAS)",
}

#: how every page starts; the generator marker tells a previous report (safe to replace) from any other file
PAGE_START = "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><meta name='generator' content='nasdiag report'>"
#: how pages written before the marker existed start
LEGACY_PAGE_START = "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>nasdiag report: "
HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px;color:#222}
h1{font-size:22px;margin-bottom:4px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f5f5f5;font-weight:600}code{font-size:12px}.note{background:#fff6d6;border:1px solid #e8d48a;padding:6px 10px}
figure{margin:12px 0 24px 0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:13px;color:#444;margin-top:4px}.skipped{font-size:12px;color:#777}
"""


def _png(fig, dpi: int) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        # as `nasdiag plot` saves them: legends and titles placed outside the axes grid are kept, not cut off
        fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight", pad_inches=0.04)
    finally:
        plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _last(record, path: str) -> Optional[Tuple[int, float]]:
    if path not in record:
        return None
    valid = np.flatnonzero(record.get(f"valid/{path}", np.ones(len(record["step"]), bool)))
    values = np.asarray(record[path], dtype=float)[valid]
    finite = np.flatnonzero(np.isfinite(values))
    if finite.size == 0:
        return None
    i = finite[-1]
    return int(record["step"][valid[i]]), float(values[i])


def _value(value: float) -> str:
    """A key number with four decimals (accuracies), or four significant digits where four decimals would not show it: a
    search-val loss of 2.5e-05 was reported as ``0.0000``, a loss of exactly zero."""
    return f"{value:.4f}" if value == 0 or 1e-3 <= abs(value) < 1e6 else f"{value:.4g}"


def _key_number(record, path: str) -> Optional[str]:
    """``0.7500 (step 8)`` of the last row that logged ``path`` (None: none did). A last value that is NaN/inf (a run
    that diverged) is the number shown, with the last finite one after it: a key number never hides a NaN behind an
    earlier value."""
    if path not in record:
        return None
    valid = np.flatnonzero(record.get(f"valid/{path}", np.ones(len(record["step"]), bool)))
    if valid.size == 0:
        return None
    step, value = int(record["step"][valid[-1]]), float(np.asarray(record[path], dtype=float)[valid[-1]])
    if np.isfinite(value):
        return f"{_value(value)} (step {step})"
    finite = _last(record, path)
    before = f"last finite {_value(finite[1])}, step {finite[0]}" if finite is not None else "never finite"
    return f"{'NaN' if np.isnan(value) else value} (step {step}; {before})"


def _segment_attrs(segments) -> List[Dict]:
    """The attributes of each segment file (created, host, versions) and its rows and last write time."""
    from nasdiag.record.reader import segment_attrs

    out = []
    for seg in segments:
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in segment_attrs(seg.file).items()}
        attrs["rows"] = int(seg.steps.shape[0])
        attrs["first_step"] = int(seg.steps[0]) if seg.steps.size else None
        attrs["last_step"] = int(seg.steps[-1]) if seg.steps.size else None
        attrs["file"] = seg.file
        attrs["modified"] = os.path.getmtime(seg.file)
        out.append(attrs)
    return out


def _resumes(segments: List[Dict]) -> int:
    """Segments written by another process than the segment before them. A session also starts a segment for a path
    first logged after its first flush and before a dataset passes schema.MAX_SEGMENT_CHUNKS chunks: counting every
    segment after the first called a search that was never resumed resumed. A segment that replays steps (its first
    step at or before the last of the segment before it) is a resume too, also in the same process (``Recorder(...,
    resume=True)`` in a notebook); a same-process resume that replays nothing is not told apart from a rollover."""
    def replays(a: Dict, b: Dict) -> bool:
        return a.get("last_step") is not None and b.get("first_step") is not None and b["first_step"] <= a["last_step"]

    return sum((a.get("host"), a.get("pid")) != (b.get("host"), b.get("pid")) or replays(a, b)
               for a, b in zip(segments, segments[1:]))


def _seconds_per_step(record, segments: List[Dict]) -> Optional[str]:
    for key in record:
        if key.startswith("scalars/") and ("time" in key or "seconds" in key) and record[key].ndim == 1:
            last = _last(record, key)
            if last is not None:
                return f"{last[1]:.3g} s ({key[len('scalars/'):]}, step {last[0]})"
    total, steps, legacy = 0.0, 0, False
    for seg in segments:
        if not seg["rows"]:
            continue
        first = seg.get("first_row_time")
        try:
            first = float(first) if first is not None else None
        except (TypeError, ValueError):
            first = None
        if first is not None and np.isfinite(first):
            # from its first row's log to its last write: the time of the rows after the first one
            total += max(seg["modified"] - first, 0.0)
            steps += seg["rows"] - 1
            continue
        # written before segments had first_row_time: `created` is when the segment was built, at its first flush (its
        # first batch of rows had been computed before), an aware time whose UTC offset counts (time.mktime took it as
        # local time of the reading machine)
        try:
            created = datetime.strptime(str(seg.get("created", "")), "%Y-%m-%dT%H:%M:%S%z").timestamp()
        except ValueError:
            return None
        total += max(seg["modified"] - created, 0.0)
        steps += seg["rows"]
        legacy = True
    if steps == 0:
        return None
    span = "segment creation" if legacy else "each segment's first row"
    return f"≈ {total / steps:.3g} s ({span} to its last write, over {steps} steps; includes evaluation and flushes)"


def _table(rows: Sequence[Tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _code(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return f"<code>{html.escape(text)}</code>"


def _live_note(record_path) -> str:
    """The page's note on the record's writer: one that holds the lock is writing it now; a lock file no writer holds
    is a writer that stopped without closing the record (killed, crashed: "still writing, or crashed" said of such a
    record left a reader waiting for rows that never come); none where no lock file is left (closed cleanly). The lock
    is read once (`read_lock`): two reads could disagree when the writer changed between them."""
    from nasdiag.record.lock import read_lock
    from nasdiag.record.reader import writer_gone

    path = os.fspath(record_path)
    state = read_lock(path)
    if not state.present:
        return ""
    if state.held:
        return (f'<p class="note">A writer ({html.escape(state.description)}) is still writing this record: this page '
                "shows the rows committed so far.</p>")
    who = ", ".join(f"{k} {v}" for k, v in (state.holder or {}).items()) or "unknown writer"
    if writer_gone(path, state):  # the kernel's table lists no lock on it, and its writer was on this host
        return (f'<p class="note">The writer of this record ({html.escape(who)}) stopped without closing it (killed or '
                "crashed; its lock file is left): this page shows the rows it committed, and no more will come unless "
                "the run is resumed (nasdiag search --resume).</p>")
    return (f'<p class="note">A writer lock exists ({html.escape(who)}): the search is still writing this record, '
            "or crashed. This page shows the rows committed so far.</p>")


def _genotype_text(record) -> List[Tuple[str, str]]:
    from nasdiag.plot.arch import ARCH_FAMILIES, cell_genes

    out = []
    paths = list(record)
    from nasdiag import vocabulary as V

    cells = []
    for fam in ARCH_FAMILIES:
        cells += [c for c in V.cells_with(paths, fam) if c not in cells]
    for cell in cells:
        path = next(f.path(cell=cell) for f in ARCH_FAMILIES if f.path(cell=cell) in record)
        valid = np.flatnonzero(record.get(f"valid/{path}", np.ones(len(record["step"]), bool)))
        if valid.size == 0:
            continue
        try:
            genes = cell_genes(record, cell, int(valid[-1]))
        except NothingToDraw as exc:
            out.append((f"genotype ({cell})", html.escape(str(exc))))
            continue
        text = ", ".join(f"{op} ({i}→{j})" for op, i, j in genes) or "no op kept"
        out.append((f"genotype ({cell})", html.escape(text)))
    return out


def build_report(record_path, figures: Optional[Sequence[str]] = None, dpi: int = 110) -> str:
    """The HTML text of the report of the record at ``record_path`` (see :func:`write_report`)."""
    from nasdiag.plot.style import paper_style
    from nasdiag.record.reader import meta_of, read_segments, record_of

    if not isinstance(dpi, int) or dpi < 1:
        raise PlotError(f"dpi must be a positive number of dots per inch, e.g. 110, not {dpi!r}")
    refuse_checkpoint(record_path)
    # one reading of a live record for the rows, NaN counts and segments alike: three reads met a writer's flushes
    # between them (a NaN of a row the page does not show counted, segments of rows past its last step)
    read = read_segments(record_path, with_data=True)
    record, meta = record_of(read), meta_of(read)
    if len(record["step"]) == 0:
        raise no_rows(record_path, "nothing to report")
    segments = _segment_attrs(read)
    config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    name = Path(os.fspath(record_path)).name
    steps = record["step"]

    run_rows = [
        ("record", _code(os.fspath(record_path))),
        ("method", _code(meta.get("method", "?"))),
        ("hyperparameters", _code(meta.get("hp", config.get("hp", "not recorded")))),
        ("data", _code({k: config[k] for k in ("dataset", "data_dir", "batch_size", "epochs") if k in config} or "not recorded")),
        ("supernet", _code({k: config[k] for k in ("C", "layers", "steps", "multiplier", "order", "norm") if k in config} or "not recorded")),
        ("machine", _code({"host": segments[-1].get("host", "?"), "device": config.get("device", "?"),
                           "world size": meta.get("world_size", config.get("world_size", 1)),
                           "dtype": config.get("dtype", "?")})),
        ("versions", _code({k: meta.get(k) or segments[-1].get(k) for k in
                            ("nasdiag_version", "torch_version", "python_version", "h5py_version")})),
        ("seed", _code(meta.get("seed", "not recorded"))),
        ("rows", f"{len(steps)} (steps {int(steps[0])}–{int(steps[-1])})"),
        ("segments and resumes", f"{len(segments)} segment(s), {_resumes(segments)} resume(s): " + "; ".join(
            html.escape(f"{Path(s['file']).name}: " + (f"steps {s['first_step']}–{s['last_step']}" if s["rows"] else "no rows yet")
                        + f", created {s.get('created', '?')}")
            for s in segments)),
        ("full config", _code(config or "not recorded")),
    ]
    nonfinite = {k: v for k, v in meta.get("nonfinite_counts", {}).items() if v}
    if nonfinite:
        run_rows.append(("NaN/inf values", _code(nonfinite)))

    key_rows = []
    usable = without_malformed(record)  # paths whose rows are not their family's shape are left out, as in the figures
    for label, path in (("search-val accuracy (epoch evaluation)", "scalars/search_val_acc"),
                        ("search-val loss (epoch evaluation)", "scalars/search_val_loss"),
                        ("train accuracy (last w step's batch)", "scalars/train_acc"),
                        ("val accuracy (last α step's batch)", "scalars/val_acc")):
        number = _key_number(usable, path)
        if number is not None:
            key_rows.append((label, number))
    key_rows += _genotype_text(usable)
    per_step = _seconds_per_step(record, segments)
    key_rows.append(("time per step", html.escape(per_step) if per_step else "not recorded"))

    groups: Dict[str, List[str]] = {}
    skipped: List[str] = []
    genotype_html: List[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for spec, cell, _, thunk in iter_figures(record, figures):
            title = spec.filename(cell)
            try:
                with paper_style():
                    fig = thunk()
            except NothingToDraw as exc:
                skipped.append(f"{title}: {exc}")
                continue
            mirrors = f" Mirrors {html.escape(spec.paper)}." if spec.paper else ""
            block = (f'<figure id="{html.escape(title)}"><img alt="{html.escape(title)}" '
                     f'src="data:image/png;base64,{_png(fig, dpi)}">'
                     f"<figcaption><b>{html.escape(title)}</b>: {html.escape(spec.caption)}{mirrors}</figcaption></figure>")
            (genotype_html if spec.name == "genotype" else groups.setdefault(spec.group, [])).append(block)

    if figures is None:  # every figure was tried: say what was left out of them
        skipped += malformed_lines(record, skipped)
    order = list(GROUP_TITLES) + [g for g in groups if g not in GROUP_TITLES]
    sections = "".join(f"<h2>{html.escape(GROUP_TITLES.get(g, g))}</h2>" + "".join(groups[g]) for g in order if g in groups)
    skipped_html = ("<h2>Not drawn</h2><ul class='skipped'>" + "".join(f"<li>{html.escape(s)}</li>" for s in skipped)
                    + "</ul>") if skipped else ""
    return (
        PAGE_START
        + f"<title>nasdiag report: {html.escape(name)}</title><style>{CSS}</style></head><body>"
        f"<h1>nasdiag report: {html.escape(name)}</h1>"
        f"<p>{html.escape(str(meta.get('method', '?')))} run, generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} "
        f"from {len(steps)} committed rows.</p>{_live_note(record_path)}"
        f"<h2>Run</h2>{_table(run_rows)}<h2>Key numbers</h2>{_table(key_rows)}"
        f"{_genotype_section(genotype_html, figures)}"
        f"{sections}{skipped_html}</body></html>"
    )


def _genotype_section(blocks: List[str], figures: Optional[Sequence[str]]) -> str:
    """The page's genotype section; none when ``figures`` leave the genotype out (``--figures scalars`` said "No
    architecture rows to derive a genotype from." of a record that has them)."""
    if not blocks and figures is not None and "genotype" not in {s.name for s in select(figures)}:
        return ""
    return f"<h2>Genotype</h2>{''.join(blocks) or '<p>No architecture rows to derive a genotype from.</p>'}"


def is_previous_report(path: Path) -> bool:
    """Whether the file at ``path`` is a page :func:`write_report` wrote (judged by how it starts)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(PAGE_START.encode()))
    except OSError:
        return False
    return head.startswith((PAGE_START.encode(), LEGACY_PAGE_START.encode()))


def is_hdf5(path: Path) -> bool:
    """Whether ``path`` is named like an HDF5 file or is one (``h5py.is_hdf5``: the signature at byte 0 or
    after a user block)."""
    import h5py

    if path.suffix.lower() in HDF5_SUFFIXES:
        return True
    try:
        return bool(h5py.is_hdf5(os.fspath(path)))
    except (OSError, ValueError):
        return False


def _record_files(record_path) -> List[Tuple[str, str]]:
    """The files that make up the record at ``record_path``, each with what it is: segments, writer lock, checkpoint
    (``--out run.h5.ckpt`` was called "the record being read (run.h5.ckpt)")."""
    from nasdiag.record.schema import list_segments, lock_path

    path = os.fspath(record_path)
    return ([(path, "the record being read"), (lock_path(path), f"the writer lock of the record being read, {path}"),
             (path + ".ckpt", f"the checkpoint of the record being read, {path}")]
            + [(file, "the record being read" if index == 0 else f"segment {index} of the record being read, {path}")
               for index, file in list_segments(path)])


def _same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)  # also a hard link
    except OSError:
        return False


def check_report_out(record_path, out_html, force: bool = False) -> None:
    """Refuse (`PlotError`, one line) an ``out_html`` the page must not be written to: a folder (also a
    path ending in a slash), a path under a file, the record being read (any of its files, or a later segment's
    name), an HDF5 file
    (even with ``force``), or an existing file that is not a previous report (unless ``force``)."""
    text = os.fspath(out_html)
    out = Path(text)
    if out.is_dir() or text.endswith((os.sep, "/")):
        raise PlotError(f"--out {text} is a folder; give the HTML file to write, e.g. --out {out / 'report.html'}")
    for ancestor in out.parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise PlotError(f"--out {text} cannot be written: {ancestor} is a file, not a folder; "
                                f"give a path in a folder, e.g. --out {ancestor.with_suffix('')}-report.html")
            break
    from nasdiag.plot.commands import later_segment_in

    segment = later_segment_in(text, record_path)
    if segment is not None:
        raise PlotError(f"--out {text} is or lies in {segment}, the name of a later segment of the record {os.fspath(record_path)} (its "
                        f"rows after a resume or a new kind of row), which plot, report and --resume would then read as damaged; give an HTML "
                        f"file, e.g. --out {Path(os.fspath(record_path)).with_suffix('')}-report.html")
    if not (out.exists() or out.is_symlink()):
        return
    target = os.path.realpath(out)
    for file, what in _record_files(record_path):
        if os.path.exists(file) and (os.path.realpath(file) == target or _same_file(file, out)):
            raise PlotError(f"--out {text} is {what} ({file}); give an HTML file, "
                            f"e.g. --out {Path(os.fspath(record_path)).with_suffix('')}-report.html")
    if not out.is_file():
        raise PlotError(f"--out {text} exists and is not a regular file; give another path, e.g. report.html")
    if is_hdf5(out):
        raise PlotError(f"--out {text} is an HDF5 file (a record?); report never replaces one, not even with "
                        "--force: give another path, e.g. report.html")
    if not force and not is_previous_report(out):
        raise PlotError(f"--out {text} exists and is not a page nasdiag report wrote; give another path, "
                        "or pass --force to replace it")


def write_report(record_path, out_html, figures: Optional[Sequence[str]] = None, dpi: int = 110,
                 force: bool = False) -> Path:
    """Write one self-contained HTML page for the record at ``record_path``.

    The page holds the run's meta (method, hyperparameters, data, machine, versions, segments and
    resumes), the key numbers (final accuracies, genotype, time per step), the genotype drawings and
    every registered figure of the record, grouped by record family, each with one sentence saying
    what it shows and which paper figure it mirrors. Images are inline (base64 PNG); nothing is
    fetched from the network.

    Args:
        record_path: an HDF5 record, also one still being written.
        out_html: the page to write (its folder is created). An existing file there is replaced only
            if it is a previous report or ``force`` is set (see :func:`check_report_out`).
        figures: figure names to include (``nasdiag plot --figures``); None: all.
        dpi: resolution of the inlined PNGs (>= 1).
        force: replace an existing ``out_html`` that is not a previous report (never an HDF5 file or
            a file of the record being read).

    Returns:
        The written path.

    Raises:
        PlotError: ``out_html`` must not be written (checked before the record is read and again just
            before the page replaces it), cannot be made in its folder, or the record has nothing to report.
    """
    check_report_out(checked_record_path(record_path, "write_report"), out_html, force)
    given = Path(out_html)
    # through a symbolic link (latest.html -> run3/report.html), the page replaces the file the link names, as a record
    # written through a link is the file it points to: the link itself was replaced by the page, lost, and the file it
    # named kept the old page (and --out /dev/stdout with --force, run as root, replaced the /dev/stdout link)
    out = Path(os.path.realpath(given)) if given.is_symlink() else given
    text = build_report(record_path, figures, dpi)
    missing = [folder for folder in out.parents if not folder.exists()]  # removed again if the page is not written
    # a fresh name ("x": never an existing file), removed on every path where it does not become the page; a page's
    # name near the file system's 255 bytes is not repeated in it ("File name too long" of a name that is not)
    stem = out.name if len(os.fsencode(out.name)) <= 200 else "report.html"
    tmp = temporary_path(out, stem)  # the figures' name: the next report removes what a killed one left (below)
    created = written = False
    try:
        try:  # a folder that cannot hold the page was "No such file or directory (.report.html.123.ab12cd34.tmp)"
            out.parent.mkdir(parents=True, exist_ok=True)
            page = open(tmp, "x", encoding="utf-8", errors="backslashreplace")  # a file name that is not UTF-8
        except OSError as exc:
            from nasdiag.record.lock import describe_os_error

            where = os.path.abspath(exc.filename if exc.filename not in (None, str(tmp)) else out.parent)
            raise PlotError(f"--out {out_html} cannot be written: {describe_os_error(exc)} in {where}; give an --out in "
                            f"a folder where files can be written") from None
        with page as f:
            created = True
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # on disk before it replaces the old page, as a figure and a checkpoint
        check_report_out(record_path, given, force)  # the build takes a while: the path may have changed
        os.replace(tmp, out)
        created, written = False, True
    finally:
        if created:
            tmp.unlink(missing_ok=True)
        for folder in [] if written else missing:  # innermost first: a name too long left its folders behind
            with contextlib.suppress(OSError):
                folder.rmdir()
    _remove_stale_temporaries({out.parent: {stem}})  # the pages of killed reports (SIGKILL at the write), as figures'
    return given
