"""Figures drawn from records (files), never from live models, so any old run can be redrawn.

- `write_figures(record_path, out, fmt, figures=None, at=None)`: every registered figure the record supports.
- `figure`, `heatmap`, `Heatmap`: register a figure for a record path family (``nasdiag.plot.registry``);
  a module placed in ``nasdiag/plot/`` is imported, and its figures registered, automatically.
- `write_comparison`: the same heatmap of several runs side by side, on one colour scale.
- `write_report`: one self-contained HTML page of a run (``nasdiag report``).
- ``nasdiag.plot.commands``: the ``plot`` and ``report`` subcommands of the CLI.

Importing this package imports nothing (not even numpy): the CLI imports ``nasdiag.plot.commands``
while building its parser, and ``nasdiag --help`` must stay instant.
"""

_EXPORTS = {
    "FORMATS": "registry", "FigureSpec": "registry", "Heatmap": "registry", "NothingToDraw": "registry",
    "PlotError": "registry", "figure": "registry", "heatmap": "registry", "registered": "registry",
    "write_comparison": "registry", "write_figures": "registry", "write_report": "report",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nasdiag.plot' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"nasdiag.plot.{module}"), name)


__all__ = sorted(_EXPORTS)
