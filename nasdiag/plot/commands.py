"""The ``nasdiag plot`` and ``nasdiag report`` subcommands (the CLI delegates to these).

``nasdiag plot RECORD [RECORD ...] --out DIR``: one record draws into DIR; several draw one folder per
record (``DIR/<record name>/``) plus ``DIR/compare/``, where each heatmap of every run stands side by
side on one colour scale. A record that cannot be read is reported in one line and skipped.

Exit codes of ``plot``: 0 when every record drew, 1 when some records were skipped but at least one
drew, 2 (one-line error) when none drew (so a single unreadable record exits 2). A record whose every chosen
figure was skipped (nothing to show) drew nothing and counts as skipped.

``nasdiag report RECORD --out PAGE.html`` replaces an existing PAGE only if it is a page ``report``
wrote before, or with ``--force``; never the record it reads, and never an HDF5 file. An ``--out`` named as a file
of another format (``report.pdf``, ``report.md``; for ``plot`` a new folder ``figs.pdf``) is refused: the page is
HTML, and ``plot --format`` chooses the figures' format.

Importing this module imports only argparse: building the CLI parser must stay instant.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

#: kept in step with `nasdiag.plot.registry.FORMATS` (a test checks), spelled here so the parser needs no import
FORMATS = ("png", "pdf", "svg")
EXIT_PARTIAL = 1
#: the largest --dpi (a heatmap figure is about 10 inches wide: 12000 pixels, half a GB of pixels at most)
MAX_DPI = 1200
#: the smallest --dpi: the smallest text of a figure (5 pt) must be at least one pixel high (5 * 15 / 72 > 1);
#: below 7.2 dpi FreeType rounds it to 0 pixels and matplotlib's png renderer fails with a traceback
MIN_DPI = 15


def add_plot_arguments(subparsers) -> argparse.ArgumentParser:
    """Add ``plot`` to the CLI's subparsers; returns the subparser."""
    p = subparsers.add_parser(
        "plot", help="draw figures from one or many records",
        description="Draw every registered figure of each record (also while a search is still writing it). With "
        "several records: one folder per record under --out and, in --out/compare, each heatmap of every run side by "
        "side on one colour scale. Exit code 0: all drew; 1: some records were skipped; 2: none drew.")
    p.add_argument("records", nargs="+", metavar="RECORD", help="HDF5 record(s), e.g. runs/*.h5")
    p.add_argument("--out", required=True, help="figure folder (figures nasdiag drew there are redrawn; a file of a "
                   "figure's name that it did not draw is never replaced)")
    p.add_argument("--format", default="png", choices=FORMATS, help="png, or pdf/svg for papers (default: png)")
    p.add_argument("--figures", default=None, metavar="NAMES",
                   help="comma-separated figure names or groups (e.g. cost,hessian,arch_evolution); default: all")
    p.add_argument("--at", default=None, metavar="ROWS",
                   help="rows of the heatmaps: comma-separated init, final or step numbers (default: final)")
    p.add_argument("--dpi", type=positive_dpi, default=150, help=f"resolution of png figures, {MIN_DPI} to {MAX_DPI} (default 150)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar over records (there is none off a terminal)")
    p.set_defaults(handler=run_plot)
    return p


def add_report_arguments(subparsers) -> argparse.ArgumentParser:
    """Add ``report`` to the CLI's subparsers; returns the subparser."""
    p = subparsers.add_parser(
        "report", help="write one self-contained HTML page of a run",
        description="Write one HTML page (images inline, no network fetches) with the run's meta, key numbers, "
        "genotype drawings and every figure grouped by record family. Works on a record still being written.")
    p.add_argument("record", help="HDF5 record")
    p.add_argument("--out", required=True, help="HTML file to write, e.g. report.html")
    p.add_argument("--figures", default=None, metavar="NAMES", help="comma-separated figure names or groups; default: all")
    p.add_argument("--dpi", type=positive_dpi, default=110, help=f"resolution of the inlined images, {MIN_DPI} to {MAX_DPI} (default 110)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out that is not a page nasdiag report wrote (never the record read "
                        "or any HDF5 file)")
    p.set_defaults(handler=run_report)
    return p


def positive_dpi(text: str) -> int:
    """``--dpi``: an integer in [`MIN_DPI`, `MAX_DPI`] (matplotlib refuses 0 and negative resolutions with a
    traceback, cannot render 5 pt text below 7.2 dpi, and runs out of memory far above print quality)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number of dots per inch, e.g. 150, not {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of dots per inch, e.g. 150, not {value}")
    if value < MIN_DPI:  # FreeType's "invalid ppem value" traceback: the figures' 5 pt text would be 0 pixels high
        raise argparse.ArgumentTypeError(f"must be at least {MIN_DPI} dots per inch (the figures' smallest text would "
                                         f"be less than a pixel high), not {value}")
    if value > MAX_DPI:  # matplotlib's renderer runs out of memory, or for minutes, far above print quality
        raise argparse.ArgumentTypeError(f"must be at most {MAX_DPI} dots per inch (print quality is 300-600), not {value}")
    return value


def _figure_names(text):
    """``--figures`` as a list (None: all figures). Given but naming nothing (``''``, ``','``) is refused:
    it would draw nothing and still exit 0."""
    if text is None:
        return None
    names = [t for t in text.split(",") if t.strip()]
    if not names:
        from nasdiag.plot.registry import PlotError, registered

        specs = registered()
        groups = sorted({s.group for s in specs.values()} - set(specs))
        raise PlotError(f"--figures {text!r} names no figure; give comma-separated names ({', '.join(specs)}) or "
                        f"groups ({', '.join(groups)}), or leave --figures out to draw all")
    return names


def select_figures(names):
    """`nasdiag.plot.registry.select`, its refusal of an unknown name naming the near miss (``hesian``,
    ``Hessian``: did you mean 'hessian'?), as ``--hessian-mode`` does."""
    import difflib

    from nasdiag.plot.registry import PlotError, registered, select

    try:
        return select(names)
    except PlotError as exc:
        specs = registered()
        choices = [*specs, *sorted({s.group for s in specs.values()} - set(specs))]
        def meant(t):  # "cost;hessian" (or "cost hessian") was "did you mean 'hessian'": the commas, not one of them
            parts = t.replace(";", " ").split()
            if len(parts) > 1 and all(p.lower() in choices for p in parts):
                return [",".join(p.lower() for p in parts)]
            return _of_file(t, specs) or difflib.get_close_matches(t.lower(), choices, 1)


        near = [(t, meant(t)) for t in (n.strip() for n in names or ()) if t and t not in choices]
        hints = [f"{m[0]!r} for {t!r}" for t, m in near if m]
        if not hints:
            raise
        raise PlotError(f"{exc} (did you mean {', '.join(hints)}?)") from None


def _of_file(name: str, specs) -> List[str]:
    """``[figure]`` whose file ``name`` is (``cost_heatmap`` as README's image, ``cost_normal_heatmap.png`` or
    ``..._final`` as drawn), else []: ``--figures cost_heatmap`` was "did you mean 'cost_std'?", another figure."""
    import re

    stem = re.sub(r"\.(png|pdf|svg)$", "", name.strip().lower())
    stem = re.sub(r"_(init|final|step\d+)$", "", stem)
    return [s.name for s in specs.values() if stem in {s.filename(cell) for cell in (None, "normal", "reduce")}][:1]


#: suffixes of a file of another format than ``report``'s page or ``plot``'s folder: a page written as rep.pdf was
#: HTML under a PDF's name, figures drawn into figs.pdf/ png files in a folder so named, both without a word
OTHER_FORMATS = (".pdf", ".png", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".md", ".tex", ".docx", ".ipynb", ".html",
                 ".htm")
#: the names of an HDF5 record: a page, or a folder of figures, so named is read as one (``nasdiag plot runs/*.h5``)
RECORD_SUFFIXES = (".h5", ".hdf5", ".hdf")


def refuse_other_format(out: str, command: str, fmt: str = "png", option: str = "--out") -> None:
    """Refuse (one line) a ``--out`` named as a file of another format: for ``report`` (an HTML page) one not .html,
    for ``plot`` (a folder of figure files; and ``search``, its ``option`` --figs) a folder not there yet named as a
    figure or page file."""
    from nasdiag.plot.registry import PlotError

    path = Path(out)
    suffix = path.suffix.lower()
    if suffix not in OTHER_FORMATS + RECORD_SUFFIXES:  # report --out b.h5 wrote HTML there, plot a folder of figures
        return
    if suffix in RECORD_SUFFIXES:
        import os

        from nasdiag.record.schema import segment_owner

        if os.path.lexists(out) or segment_owner(str(out)) is not None:
            return  # a file there, or a segment's name: said by their own checks (the record read, never an HDF5 file)
    if command == "report":
        if suffix in (".html", ".htm"):
            return
        raise PlotError(f"--out {out} names a {suffix} file, but report writes an HTML page (it would be HTML under "
                        f"a {suffix} name); give an .html file, e.g. --out {path.with_suffix('.html')}"
                        + (" (a browser prints it to PDF)" if suffix == ".pdf" else
                           f" (nasdiag plot RECORD --out FOLDER --format {suffix[1:]} draws the figures as {suffix} files)"
                           if suffix[1:] in FORMATS else ""))
    if path.is_dir():  # a folder so named already: taken as the user's
        return
    who = "the search draws" if command == "search" else "plot writes"
    if suffix in (".html", ".htm"):
        raise PlotError(f"{option} {out} names an HTML page, but {who} one file per figure into the folder {option} "
                        f"names; give a folder, e.g. {option} {path.with_suffix('')}, or write one page of a run with "
                        f"nasdiag report RECORD --out {out}")
    again = ""
    if suffix[1:] in FORMATS and suffix[1:] != fmt:
        again = (f" --format {suffix[1:]}" if command == "plot" else
                 f" (nasdiag plot RECORD --out FOLDER --format {suffix[1:]} then draws them as {suffix} files)")
    raise PlotError(f"{option} {out} names a {suffix} file, but {who} one {fmt} file per figure into the folder "
                    f"{option} names; give a folder, e.g. {option} {path.with_suffix('')}{again}")


def file_in_the_way(path: Path) -> Optional[Path]:
    """``path`` or its nearest existing ancestor if that is not a folder (so no folder can be made there);
    None when ``path`` is an existing folder or could be created as one."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def refuse_empty_records(records: List[str]) -> None:
    """An empty RECORD (an unset shell variable) was "no record at  (no file and no segments next to it)"."""
    from nasdiag.plot.registry import PlotError

    if any(not r.strip() for r in records):
        raise PlotError("a record path is empty; pass the record file, such as runs/search.h5")


def refuse_empty_out(out: str, example: str) -> None:
    """``--out ''`` is the current folder to `pathlib` (plot drew every figure there, report called it a folder);
    ``--out -`` is not standard output."""
    from nasdiag.plot.registry import PlotError

    if not out.strip():
        raise PlotError(f"--out is empty; give the {example}")
    if out.strip() == "-":  # report wrote a page named '-', plot a folder of that name (search refuses it too)
        raise PlotError(f"--out - is not standard output: it would write '-' into the current folder; give the {example}")


def later_segment_in(path, record) -> Optional[str]:
    """The name of a later segment of ``record`` (``run.seg0001.h5``, also one being built: ``.tmp``) that ``path`` is
    or lies in, else None: a folder or page written there made plot, report and --resume read the record as damaged."""
    from nasdiag.record.schema import segment_owner, temp_path

    level, own = os.path.abspath(path), os.path.abspath(record)
    while os.path.dirname(level) != level:
        name = level[: -len(temp_path(""))] if level.endswith(temp_path("")) else level
        if segment_owner(name) is not None and os.path.abspath(segment_owner(name)) == own:
            return os.path.basename(name)
        level = os.path.dirname(level)
    return None


def _refuse_segment_out(out, records: List[str]) -> None:
    from nasdiag.plot.registry import PlotError

    for record in records:
        segment = later_segment_in(out, record)
        if segment is not None:
            raise PlotError(f"--out {out} is or lies in {segment}, the name of a later segment of the record {record} (its rows after "
                            f"a resume), which plot, report and --resume would then read as damaged; give another "
                            f"--out, e.g. --out figs")


def _check_folder(out: Path, record: Optional[str] = None) -> None:
    """Refuse (one line) a figure folder that a file is in the way of: ``--out`` itself, or with ``record``
    the folder of that record under ``--out``."""
    from nasdiag.plot.registry import PlotError

    blocker = file_in_the_way(out)
    if blocker is None:
        return
    if record is not None:
        raise PlotError(f"the figure folder {out} (for {record}) would replace the existing file {blocker}; "
                        f"move that file away or give another --out")
    if blocker == out:
        raise PlotError(f"--out {out} is an existing file, but plot writes one file per figure into a folder: "
                        f"give a folder, e.g. --out {out.with_suffix('')}-figs")
    raise PlotError(f"--out {out} cannot be a folder: {blocker} is a file; give a folder path outside it, "
                    f"e.g. --out {blocker.with_suffix('')}-figs")


def named_as_figures(folder, fmt: str, cells=()) -> List[Path]:
    """The entries of ``folder`` named as a figure nasdiag draws there (``scalars.png``, ``cost_normal_heatmap_final.png``;
    ``cells``: cell types besides normal and reduce), drawn by nasdiag or not."""
    folder = Path(folder)
    if not folder.is_dir():  # a new folder: nothing in the way, and no figure module loaded for it
        return []
    import re

    from nasdiag.plot.registry import registered

    names = {spec.filename(cell) for spec in registered().values() for cell in {None, "normal", "reduce", *cells}}
    named = re.compile(f"({'|'.join(map(re.escape, sorted(names)))})(_(init|final|step[0-9]+))?\\.{re.escape(fmt)}")
    return [p for p in sorted(folder.iterdir()) if named.fullmatch(p.name)]


def foreign_figures(folder, fmt: str, cells=()) -> List[Path]:
    """The entries in ``folder`` named as a figure nasdiag draws there (`named_as_figures`) that are not a figure nasdiag
    drew: a file drawing would replace; a folder so named, which no figure can replace (a search ran to its end, then
    failed "Is a directory" naming a hidden temporary file, as plot did); anything else that is not a regular file (a
    pipe, a device). A symbolic link is judged by what it names, as a figure is written through it (`registry.save`): a
    link to a folder, or a link to nothing (as ``report --out``), is refused too; the new figure replaced each such link
    by a file, and the link was lost."""
    from nasdiag.plot.registry import is_nasdiag_figure

    return [p for p in named_as_figures(folder, fmt, cells) if
            (p.is_symlink() and not p.exists()) or p.exists() and not (p.is_file() and is_nasdiag_figure(p))]


def refuse_foreign_figures(folder, fmt: str, option: str, cells=(), instead: Optional[str] = None) -> None:
    """Refuse (one line) a figure folder holding a file of a figure's name that nasdiag did not draw (the user's own
    ``scalars.png``): it was replaced without a word."""
    from nasdiag.plot.registry import PlotError

    foreign = foreign_figures(folder, fmt, cells)
    if foreign:
        shown = ", ".join(p.name + ("/" if p.is_dir() else "" if p.exists() else " (a symbolic link to nothing)")
                          for p in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise PlotError(f"{option} {folder} holds {shown}, named as a figure but not drawn by nasdiag, which drawing would "
                        f"replace; move {'it' if len(foreign) == 1 else 'them'} away or {instead or 'give another ' + option}")


def _cells(record) -> set:
    """The cell types of a loaded record (``cost/<cell>/mean`` and the like)."""
    return {key.split("/")[1] for key in record if key.count("/") >= 2 and not key.startswith("valid/")}


def _segment_owner(record_path) -> Optional[str]:
    """The record that ``record_path`` continues when it is an existing later segment of an existing record
    (``run.seg0001.h5`` next to ``run.h5``), else None."""
    import os

    from nasdiag.record.schema import segment_owner

    owner = segment_owner(str(record_path))
    return owner if owner is not None and os.path.isfile(record_path) and os.path.exists(owner) else None


def refuse_segment(record_path) -> None:
    """Refuse a later segment given instead of its record: alone it holds only the rows after a resume
    or a new column (a search that never resumed has one: "the rows after a resume" misled), and would be drawn as
    if it were a whole run."""
    from nasdiag.plot.registry import PlotError

    owner = _segment_owner(record_path)
    if owner is not None:
        raise PlotError(f"{record_path} is a continuation segment of the record {owner} (later rows: a search starts "
                        "one when it resumes, and when it first records a new kind of row, as the main job's first cost "
                        f"row), not a record of its own; pass the record {owner}, which is read with all its segments")
    renamed = renamed_record(record_path)
    if renamed is not None:
        raise PlotError(renamed)


def renamed_record(record_path) -> Optional[str]:
    """Why ``record_path`` is not a whole record if it is the first file of a run renamed without its later segments
    (``mv run.h5 lr01.h5`` leaves ``run.seg0001.h5``, ... behind, named after ``run.h5``, which is gone), else None:
    read alone it gave the rows before the first resume as if the run ended there, and its resume was told to start
    again with --force, which replaces it. A later segment next to it, named after a record that is not there, that
    carries this file's run id, tells."""
    import glob
    import os

    from nasdiag.record.errors import RecordError
    from nasdiag.record.reader import open_segment_file
    from nasdiag.record.schema import resolve_link, segment_owner, segment_path

    path = resolve_link(str(record_path))
    if not os.path.isfile(path) or os.path.lexists(segment_path(path, 1)):
        return None
    root, ext = os.path.splitext(os.path.basename(path))
    others = [f for f in sorted(glob.glob(os.path.join(glob.escape(os.path.dirname(path) or "."), f"*.seg0001{glob.escape(ext)}")))
              if segment_owner(f) is not None and not os.path.lexists(segment_owner(f))]  # a copy keeps its record

    def run_id(file):
        try:  # read once: a damaged file's SWMR retries took minutes
            with open_segment_file(file, live=False) as f:
                return f.attrs.get("run_id")
        except (RecordError, OSError):
            return None

    mine = run_id(path) if others else None
    if mine is None:
        return None
    owner = next((segment_owner(f) for f in others if run_id(f) == mine), None)
    if owner is None:
        return None
    owner = os.path.join(os.path.dirname(path), os.path.basename(owner))  # as the user named the folder
    first, theirs = os.path.basename(segment_path(owner, 1)), os.path.splitext(os.path.basename(owner))[0]
    also = (f" (and {os.path.basename(owner)}.ckpt to {os.path.basename(path)}.ckpt, to resume it)"
            if os.path.exists(owner + ".ckpt") else "")
    return (f"{record_path} is the first file of the record {owner}, renamed without its later segments ({first}, ...), "
            f"which hold the rest of its rows; rename it back to {owner}, or rename each {theirs}.segNNNN{ext} to "
            f"{root}.segNNNN{ext}{also} too")


def _load(record_path):
    """`nasdiag.record.load`, with a file that is not a record (empty, text, foreign HDF5) said as such
    instead of as a damaged record."""
    from nasdiag.record import load

    return _as_not_a_record(record_path, load, record_path)


def _as_not_a_record(record_path, fn, *args):
    """``fn(*args)``; a `RecordError` about ``record_path`` that is an existing file but not a record
    becomes one `PlotError` saying so (the reader calls it damaged, or asks to remove it)."""
    import os

    from nasdiag.plot.registry import PlotError
    from nasdiag.record.errors import RecordError
    from nasdiag.record.reader import not_a_record

    try:
        return fn(*args)
    except RecordError:
        reason = not_a_record(str(record_path)) if os.path.isfile(record_path) else None
        if reason is None:
            raise
        raise PlotError(f"{record_path} is not a nasdiag record: {reason}; pass a record that nasdiag search or "
                        "nasdiag.record.Recorder wrote") from None


def _refuse_repeats(records: List[str]) -> None:
    """The same file given twice (also by another spelling or a link) would be drawn twice into one folder."""
    import os

    from nasdiag.plot.registry import PlotError

    seen: Dict[str, str] = {}
    for record_path in records:
        key = os.path.realpath(record_path)
        if key in seen:
            same = "" if seen[key] == record_path else f" (as {seen[key]} and {record_path})"
            raise PlotError(f"record {record_path} is given twice{same}; pass each record once")
        seen[key] = record_path


def _segments_with_their_record(records: List[str]) -> List[str]:
    """``records`` without the later segments of records also given (``runs/*.h5`` matches both), each
    noted in one line on stderr."""
    import os

    listed = {os.path.realpath(r) for r in records}
    kept = []
    for record_path in records:
        owner = _segment_owner(record_path)
        if owner is not None and os.path.realpath(owner) in listed:
            print(f"nasdiag: {record_path} is read as part of its record {owner}", file=sys.stderr)
            continue
        kept.append(record_path)
    return kept


def _folders(records: List[str], out: Path) -> Dict[str, Path]:
    """One folder per record, named after the file; parent folders disambiguate equal names (as many as
    it takes), a number what they cannot (``run.h5`` and ``run.hdf5``). ``compare`` is the comparison's."""
    import os

    paths = [Path(os.path.abspath(r)) for r in records]
    depth = [0] * len(paths)

    def name(i: int) -> str:
        parents = [part for part in paths[i].parent.parts[len(paths[i].parent.parts) - depth[i]:] if part != os.sep]
        return "_".join([*parents, paths[i].stem])

    while True:
        names = [name(i) for i in range(len(paths))]
        clash = [i for i, n in enumerate(names) if (names.count(n) > 1 or n == "compare")
                 and depth[i] < len(paths[i].parent.parts)]
        if not clash:
            break
        for i in clash:
            depth[i] += 1
    taken: Dict[str, int] = {}
    out_dirs = {}
    for record_path, n in zip(records, names):
        taken[n] = taken.get(n, 0) + 1
        out_dirs[record_path] = out / (n if taken[n] == 1 and n != "compare" else f"{n}_{taken[n]}")
    return out_dirs


def _refuse_nothing_to_draw(record, record_path, figures_arg) -> None:
    """Refuse a record that holds none of the families the chosen figures draw (it would draw no file, say
    "0 figures" and count as drawn)."""
    from nasdiag.plot.registry import PlotError, iter_figures

    figures = _figure_names(figures_arg)
    if next(iter(iter_figures(record, figures)), None) is not None:
        return
    if figures_arg is None:
        raise PlotError(f"record {record_path} holds nothing that a registered figure draws (docs/figures.md lists "
                        "the record families each figure needs)")
    raise PlotError(f"record {record_path} holds nothing that --figures {figures_arg} draws; leave --figures out to "
                    "draw every figure it has")


def absent_figures(record, figures) -> List[str]:
    """One line per name of ``--figures`` (``figures``: its list, None for all) whose figures have no rows in
    ``record``: ``--figures cost,arch`` on a record without costs drew the arch figures and said nothing of cost."""
    from nasdiag.plot.registry import select

    paths = [k for k in record if not k.startswith(("valid/", "meta/")) and k != "step"]
    lines = []
    for name in dict.fromkeys(n.strip() for n in figures or () if n.strip()):
        specs = select([name])
        if not any(spec.cells(paths) for spec in specs):
            families = ", ".join(dict.fromkeys(fam.pattern for spec in specs for fam in spec.families))
            lines.append(f"{name}: the record holds no {families}; nothing to draw")
    return lines


def _missing_folders(folder: Path) -> List[Path]:
    """``folder`` and its ancestors that do not exist yet, deepest first: what drawing into it creates."""
    missing = []
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    return missing


def _make_folder(out: Path, created: List[Path]) -> None:
    """Create the figure folder ``out`` (``created``: its missing folders, removed again if that fails); a location
    that cannot hold it is one `PlotError` naming it. Over many records it was each record "skipped: cannot read
    it (No such file or directory)", as if the records were unreadable."""
    from nasdiag.plot.registry import PlotError
    from nasdiag.record.lock import describe_os_error

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_empty(created)
        raise PlotError(f"cannot create the figure folder {out}: {describe_os_error(exc)}; give an --out where "
                        "folders can be created") from None


def _remove_empty(folders: List[Path]) -> None:
    """Remove those of ``folders`` (deepest first) that are empty: a refused plot leaves no empty figure folder."""
    import os

    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:  # not empty (a figure was drawn there) or already gone
            pass


def _refuse_none_drawn(drawn, what: str) -> None:
    """Refuse a record whose every chosen figure was skipped (no data to show, every value NaN): it drew no
    file and must not count as drawn (exit 0)."""
    from nasdiag.plot.registry import PlotError

    if not drawn.files:
        raise PlotError(f"{what} has figures, but every one was skipped ({len(drawn.skipped)} lines above say why); "
                        "nothing was drawn")


def _refuse_idle_at(at_tokens, specs) -> None:
    """Refuse an ``--at`` that names a row twice, or that none of the chosen figures uses: ``--at`` chooses
    rows of the figures that draw one row (heatmaps), and would otherwise do nothing."""
    from nasdiag.plot.registry import PlotError

    twice = sorted({str(t) for t in at_tokens or () if at_tokens.count(t) > 1})
    if twice:  # each would be drawn again into the same file
        raise PlotError(f"--at {','.join(map(str, at_tokens))} names {', '.join(twice)} twice; name each row once")
    if at_tokens and not any(spec.rows for spec in specs):
        names = ", ".join(spec.name for spec in specs)
        raise PlotError(f"--at {','.join(map(str, at_tokens))} chooses heatmap rows, but none of the chosen figures "
                        f"({names}) draws one row; drop --at, or add a heatmap figure such as cost or arch")


def _nonfinite_line(drawn) -> str:
    """The NaN/inf the drawn families hold, as ``nasdiag report`` lists them, or that there are none."""
    from nasdiag.plot.registry import nonfinite_summary

    text = nonfinite_summary(drawn.nonfinite)
    return text + (" in the drawn families, marked in the figures" if drawn.nonfinite else " in the drawn families")


def _read_or_write(exc: OSError, folder: Path) -> str:
    """What failed for one record of many: writing into its figure ``folder`` (a file name too long, a full disk)
    or reading it."""
    import os

    from nasdiag.record.lock import describe_os_error

    target = os.path.abspath(exc.filename) if isinstance(exc.filename, str) else None
    inside = target is not None and (target + os.sep).startswith(os.path.abspath(folder) + os.sep)
    if inside:
        return f"cannot write its figures into {folder} ({describe_os_error(exc)}: {exc.filename})"
    return f"cannot read it ({exc.strerror or exc})"


def run_plot(args) -> int:
    """Draw the figures of ``args.records`` (see the module docstring for folders and exit codes)."""
    from nasdiag.errors import NasdiagError
    from nasdiag.plot.registry import (
        PlotError, check_at_steps, draw_record, no_rows, parse_at, refuse_checkpoint, write_comparison,
    )

    figures = _figure_names(args.figures)
    specs = select_figures(figures)  # unknown names fail before any record is read
    at_tokens = parse_at(args.at)
    _refuse_idle_at(at_tokens, specs)
    refuse_empty_out(args.out, "figure folder, e.g. --out figs")
    refuse_other_format(args.out, "plot", args.format)
    refuse_empty_records(args.records)
    out = Path(args.out)
    _check_folder(out)
    _refuse_repeats(args.records)
    records = _segments_with_their_record(args.records)
    _refuse_segment_out(out, records)
    if len(records) == 1:
        record_path = records[0]
        refuse_checkpoint(record_path)
        refuse_segment(record_path)
        record = _load(record_path)  # RecordError "no record at ..." if there is none
        if len(record["step"]) == 0:
            raise no_rows(record_path, "nothing to plot")
        check_at_steps(at_tokens, record, record_path)
        _refuse_nothing_to_draw(record, record_path, args.figures)
        refuse_foreign_figures(out, args.format, "--out", _cells(record))
        created = _missing_folders(out)
        _make_folder(out, created)
        try:
            drawn = draw_record(record, out, args.format, figures, args.at, args.dpi)
        except BaseException:  # torch or matplotlib that cannot load (ulimit -v), Ctrl-C: no empty folder left behind
            _remove_empty(created)
            raise
        for line in [*absent_figures(record, figures), *drawn.skipped]:
            print(f"skipped {line}", file=sys.stderr)
        if not drawn.files:
            _remove_empty(created)
        _refuse_none_drawn(drawn, f"record {record_path}")
        print(f"{record_path}: {len(drawn.files)} figures in {out}; {_nonfinite_line(drawn)}")
        return 0

    from tqdm.auto import tqdm

    folders = _folders(records, out)
    for record_path, folder in (*folders.items(), ("the comparison", out / "compare")):
        _check_folder(folder, record_path)
    refuse_foreign_figures(out / "compare", args.format, "the comparison folder", (), "give another --out")
    loaded, failed = {}, []
    created = _missing_folders(out)
    _make_folder(out, created)
    try:  # into a log (2> log) the bar's states in block characters and carriage returns ran ahead of each line
        terminal = sys.stderr.isatty()  # on the line of a skipped record: none off a terminal, as the lines say it all
    except (AttributeError, ValueError):
        terminal = False
    bar = tqdm(records, unit="record", disable=args.no_progress or not terminal, file=sys.stderr, dynamic_ncols=True)
    for record_path in bar:
        bar.set_postfix_str(Path(record_path).name, refresh=False)
        try:
            refuse_checkpoint(record_path)
            refuse_segment(record_path)
            record = _load(record_path)
            if len(record["step"]) == 0:
                raise no_rows(record_path, "nothing to plot")
            check_at_steps(at_tokens, record, record_path)
            _refuse_nothing_to_draw(record, record_path, args.figures)
            refuse_foreign_figures(folders[record_path], args.format, "the figure folder", _cells(record), "give another --out")
            made = [folders[record_path]] if not folders[record_path].exists() else []
            try:
                drawn = draw_record(record, folders[record_path], args.format, figures, args.at, args.dpi)
            except BaseException as exc:  # as for one record; a record skipped below keeps the folders of the others
                if not isinstance(exc, (NasdiagError, OSError)):
                    _remove_empty([*made, *created])
                raise
            for line in [*absent_figures(record, figures), *drawn.skipped]:
                bar.write(f"skipped {Path(record_path).name}/{line}", file=sys.stderr)
            if not drawn.files:
                _remove_empty(made)
            _refuse_none_drawn(drawn, "it")
        except NasdiagError as exc:
            failed.append(record_path)
            bar.write(f"nasdiag: skipped {record_path}: {exc}", file=sys.stderr)
            continue
        except OSError as exc:
            failed.append(record_path)
            bar.write(f"nasdiag: skipped {record_path}: {_read_or_write(exc, folders[record_path])}", file=sys.stderr)
            continue
        loaded[folders[record_path].name] = record
        bar.write(f"{record_path}: {len(drawn.files)} figures in {folders[record_path]}; {_nonfinite_line(drawn)}",
                  file=sys.stdout)
    bar.close()
    if not loaded:
        _remove_empty(created)
        raise PlotError(f"none of the {len(records)} records could be drawn (see the lines above)")
    compared = write_comparison(loaded, out / "compare", args.format, figures, args.at, args.dpi) if len(loaded) > 1 else None
    if compared is not None and not compared.files:  # "0 comparison figures in figs/compare", a folder not there
        for line in compared.skipped:
            print(f"skipped compare/{line}", file=sys.stderr)
    print(f"{len(loaded)} of {len(records)} records drawn into {out}"
          + (f"; {len(compared.files)} comparison figures in {out / 'compare'}" if compared and compared.files else
             "; no comparison figure (" + ("heatmaps are compared: none of the chosen figures is one)" if not any(
                 s.is_heatmap for s in specs) else "the lines above say why)") if compared else ""))
    return EXIT_PARTIAL if failed else 0


def run_report(args) -> int:
    """Write the HTML report of ``args.record`` to ``args.out``."""
    from nasdiag.plot.report import write_report

    figures = _figure_names(args.figures)
    select_figures(figures)
    refuse_empty_out(args.out, "HTML file to write, e.g. --out report.html")
    refuse_other_format(args.out, "report")
    refuse_empty_records([args.record])
    refuse_segment(args.record)
    if figures is not None:  # --figures bayes of a DARTS run wrote a page of no figure, exit 0 (plot refuses it)
        from nasdiag.plot.registry import refuse_checkpoint
        from nasdiag.plot.report import check_report_out

        check_report_out(args.record, args.out, args.force)
        refuse_checkpoint(args.record)
        record = _load(args.record)
        if len(record["step"]):
            _refuse_nothing_to_draw(record, args.record, args.figures)
    path = _as_not_a_record(args.record, write_report, args.record, args.out, figures, args.dpi, args.force)
    print(f"report: {path}")
    return 0
