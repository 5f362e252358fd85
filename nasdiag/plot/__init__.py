"""Figures drawn from records (files), never from live models, so any old run can be redrawn.

- `write_figures(record, out, fmt, figures=None, at=None)`: every registered figure the record supports.
- `figure`, `heatmap`, `Heatmap`: register a figure for a record path family (``nasdiag.plot.registry``);
  a module placed in ``nasdiag/plot/`` is imported, and its figures registered, automatically.
- `write_comparison`: the same heatmap of several runs side by side, on one colour scale.
- `write_report`: one self-contained HTML page of a run (``nasdiag report``).

Importing this package imports neither matplotlib nor torch; drawing does.
"""

from nasdiag.plot.registry import (
    FORMATS,
    FigureSpec,
    Heatmap,
    NothingToDraw,
    PlotError,
    figure,
    heatmap,
    registered,
    write_comparison,
    write_figures,
)


def __getattr__(name):  # the report and the figure modules load matplotlib, so only on use
    if name == "write_report":
        from nasdiag.plot.report import write_report

        return write_report
    raise AttributeError(f"module 'nasdiag.plot' has no attribute {name!r}")


__all__ = [
    "FORMATS", "FigureSpec", "Heatmap", "NothingToDraw", "PlotError", "figure", "heatmap", "registered",
    "write_comparison", "write_figures", "write_report",
]
