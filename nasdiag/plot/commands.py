"""The ``nasdiag plot`` and ``nasdiag report`` subcommands (the CLI delegates to these).

``nasdiag plot RECORD [RECORD ...] --out DIR``: one record draws into DIR; several draw one folder per
record (``DIR/<record name>/``) plus ``DIR/compare/``, where each heatmap of every run stands side by
side on one colour scale. A record that cannot be read is reported in one line and skipped.

Exit codes of ``plot``: 0 when every record drew, 1 when some records were skipped but at least one
drew, 2 (one-line error) when none drew (so a single unreadable record exits 2).

``nasdiag report RECORD --out PAGE.html`` replaces an existing PAGE only if it is a page ``report``
wrote before, or with ``--force``; never the record it reads, and never an HDF5 file.

Importing this module imports only argparse: building the CLI parser must stay instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

#: kept in step with `nasdiag.plot.registry.FORMATS` (a test checks), spelled here so the parser needs no import
FORMATS = ("png", "pdf", "svg")
EXIT_PARTIAL = 1


def add_plot_arguments(subparsers) -> argparse.ArgumentParser:
    """Add ``plot`` to the CLI's subparsers; returns the subparser."""
    p = subparsers.add_parser(
        "plot", help="draw figures from one or many records",
        description="Draw every registered figure of each record (also while a search is still writing it). With "
        "several records: one folder per record under --out and, in --out/compare, each heatmap of every run side by "
        "side on one colour scale. Exit code 0: all drew; 1: some records were skipped; 2: none drew.")
    p.add_argument("records", nargs="+", metavar="RECORD", help="HDF5 record(s), e.g. runs/*.h5")
    p.add_argument("--out", required=True, help="figure folder")
    p.add_argument("--format", default="png", choices=FORMATS, help="png (default), or pdf/svg for papers")
    p.add_argument("--figures", default=None, metavar="NAMES",
                   help="comma-separated figure names or groups (e.g. cost,hessian,arch_evolution); default: all")
    p.add_argument("--at", default=None, metavar="ROWS",
                   help="rows of the heatmaps: comma-separated init, final or step numbers (default: final)")
    p.add_argument("--dpi", type=positive_dpi, default=150, help="resolution of png figures (default 150)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar over records")
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
    p.add_argument("--dpi", type=positive_dpi, default=110, help="resolution of the inlined images (default 110)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out that is not a page nasdiag report wrote (never the record read "
                        "or any HDF5 file)")
    p.set_defaults(handler=run_report)
    return p


def positive_dpi(text: str) -> int:
    """``--dpi``: an integer >= 1 (matplotlib refuses 0 and negative resolutions with a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number of dots per inch, e.g. 150, not {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of dots per inch, e.g. 150, not {value}")
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


def file_in_the_way(path: Path) -> Optional[Path]:
    """``path`` or its nearest existing ancestor if that is not a folder (so no folder can be made there);
    None when ``path`` is an existing folder or could be created as one."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


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


def _check_at_steps(at_tokens, record, record_path) -> None:
    """Refuse an ``--at`` step after the record's last step: its figure would show the last rows under a
    file name promising a later step."""
    from nasdiag.plot.registry import PlotError

    last = int(record["step"][-1])
    late = [t for t in at_tokens or () if isinstance(t, int) and t > last]
    if late:
        raise PlotError(f"--at {','.join(map(str, late))}: record {record_path} ends at step {last} "
                        f"(row {len(record['step'])}); give steps up to {last}, or init/final")


def _folders(records: List[str], out: Path) -> Dict[str, Path]:
    """One folder per record, named after the file; parent folders disambiguate equal names."""
    paths = [Path(r) for r in records]
    names = [p.stem for p in paths]
    out_dirs = {}
    for rec, p, name in zip(records, paths, names):
        if names.count(name) > 1:
            name = "_".join(part for part in (p.parent.name, p.stem) if part)
        out_dirs[rec] = out / name
    return out_dirs


def _nonfinite_line(drawn) -> str:
    """The NaN/inf the drawn families hold, as ``nasdiag report`` lists them, or that there are none."""
    from nasdiag.plot.registry import nonfinite_summary

    text = nonfinite_summary(drawn.nonfinite)
    return text + (" in the drawn families, marked in the figures" if drawn.nonfinite else " in the drawn families")


def run_plot(args) -> int:
    """Draw the figures of ``args.records`` (see the module docstring for folders and exit codes)."""
    from nasdiag.errors import NasdiagError
    from nasdiag.plot.registry import (
        PlotError, draw_record, parse_at, refuse_checkpoint, select, write_comparison,
    )
    from nasdiag.record import load

    figures = _figure_names(args.figures)
    select(figures)  # unknown names fail before any record is read
    at_tokens = parse_at(args.at)
    out = Path(args.out)
    _check_folder(out)
    if len(args.records) == 1:
        record_path = args.records[0]
        refuse_checkpoint(record_path)
        record = load(record_path)  # RecordError "no record at ..." if there is none
        if len(record["step"]) == 0:
            raise PlotError(f"record {record_path} has no committed rows yet; nothing to plot")
        _check_at_steps(at_tokens, record, record_path)
        drawn = draw_record(record, out, args.format, figures, args.at, args.dpi)
        for line in drawn.skipped:
            print(f"skipped {line}", file=sys.stderr)
        print(f"{record_path}: {len(drawn.files)} figures in {out}; {_nonfinite_line(drawn)}")
        return 0

    from tqdm.auto import tqdm

    folders = _folders(args.records, out)
    for record_path, folder in (*folders.items(), ("the comparison", out / "compare")):
        _check_folder(folder, record_path)
    loaded, failed = {}, []
    bar = tqdm(args.records, unit="record", disable=args.no_progress, file=sys.stderr, dynamic_ncols=True)
    for record_path in bar:
        bar.set_postfix_str(Path(record_path).name, refresh=False)
        try:
            refuse_checkpoint(record_path)
            record = load(record_path)
            if len(record["step"]) == 0:
                raise PlotError("no committed rows yet")
            _check_at_steps(at_tokens, record, record_path)
            drawn = draw_record(record, folders[record_path], args.format, figures, args.at, args.dpi)
        except NasdiagError as exc:
            failed.append(record_path)
            bar.write(f"nasdiag: skipped {record_path}: {exc}", file=sys.stderr)
            continue
        except OSError as exc:
            failed.append(record_path)
            bar.write(f"nasdiag: skipped {record_path}: cannot read it ({exc.strerror or exc})", file=sys.stderr)
            continue
        loaded[folders[record_path].name] = record
        for line in drawn.skipped:
            bar.write(f"skipped {Path(record_path).name}/{line}", file=sys.stderr)
        bar.write(f"{record_path}: {len(drawn.files)} figures in {folders[record_path]}; {_nonfinite_line(drawn)}",
                  file=sys.stdout)
    bar.close()
    if not loaded:
        raise PlotError(f"none of the {len(args.records)} records could be drawn (see the lines above)")
    compared = write_comparison(loaded, out / "compare", args.format, figures, args.at, args.dpi) if len(loaded) > 1 else None
    print(f"{len(loaded)} of {len(args.records)} records drawn into {out}"
          + (f"; {len(compared.files)} comparison figures in {out / 'compare'}" if compared else ""))
    return EXIT_PARTIAL if failed else 0


def run_report(args) -> int:
    """Write the HTML report of ``args.record`` to ``args.out``."""
    from nasdiag.plot.registry import select
    from nasdiag.plot.report import write_report

    figures = _figure_names(args.figures)
    select(figures)
    path = write_report(args.record, args.out, figures, args.dpi, force=args.force)
    print(f"report: {path}")
    return 0
