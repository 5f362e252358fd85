"""``nasdiag plot`` over many records (folders, comparison on one colour scale, unreadable records) through
`nasdiag.plot.commands`, the module the CLI delegates to."""

from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np
import pytest

from nasdiag.errors import NasdiagError
from nasdiag.plot import commands
from plot_records import write_record


def run(argv, command="plot"):
    parser = argparse.ArgumentParser(prog="nasdiag")
    sub = parser.add_subparsers(dest="command")
    commands.add_plot_arguments(sub)
    commands.add_report_arguments(sub)
    args = parser.parse_args([command, *argv])
    return args.handler(args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    return [write_record(folder / f"seed{s}.h5", epochs=2, seed=s, cells=("normal",)) for s in (0, 1)]


def test_batch_plot_draws_a_folder_per_record_and_comparisons(runs, tmp_path, capsys):
    bad = tmp_path / "broken.h5"
    bad.write_bytes(b"not an HDF5 file")
    code = run([*map(str, runs), str(bad), "--out", str(tmp_path / "figs"), "--figures", "cost",
                "--at", "init,final", "--dpi", "40", "--no-progress"])
    err = capsys.readouterr().err
    assert code == commands.EXIT_PARTIAL  # one record skipped, the others drawn
    assert [line for line in err.splitlines() if "broken.h5" in line and "skipped" in line]
    for name in ("seed0", "seed1"):
        assert sorted(p.name for p in (tmp_path / "figs" / name).iterdir()) == [
            "cost_normal_heatmap_final.png", "cost_normal_heatmap_init.png"]
    assert (tmp_path / "figs" / "compare" / "cost_normal_heatmap_final.png").stat().st_size > 2000


def test_comparison_shares_one_colour_scale(runs):
    from nasdiag.plot.registry import registered, resolve_row
    from nasdiag.plot.style import render_heatmaps
    from nasdiag.record import load

    records = [load(p) for p in runs]
    spec = registered()["cost"]
    panels = {f"run{i}": spec.draw(r, "normal", resolve_row(r, "cost/normal/mean", "final")) for i, r in enumerate(records)}
    fig = render_heatmaps(panels)
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 2
    assert images[0].norm is images[1].norm  # one norm object: one colour scale
    top = max(np.nanmax(np.abs(r["cost/normal/mean"][resolve_row(r, "cost/normal/mean", "final")])) for r in records)
    assert images[0].norm.vmax == pytest.approx(top * 10 ** -np.floor(np.log10(top)), rel=1e-6)
    assert images[0].norm.vcenter == 0  # signed: diverging map centred at 0


def test_single_unreadable_record_and_bad_options_are_one_line_errors(runs, tmp_path):
    bad = tmp_path / "broken.h5"
    bad.write_bytes(b"not an HDF5 file")
    with pytest.raises(NasdiagError):
        run([str(bad), "--out", str(tmp_path / "f")])
    with pytest.raises(NasdiagError, match="unknown figure"):
        run([str(runs[0]), "--out", str(tmp_path / "f"), "--figures", "nope"])
    with pytest.raises(NasdiagError, match="--at takes"):
        run([str(runs[0]), "--out", str(tmp_path / "f"), "--at", "middle"])


def test_formats_agree_and_import_is_light():
    from nasdiag.plot.registry import FORMATS

    assert commands.FORMATS == FORMATS
    code = ("import sys, argparse, nasdiag.plot.commands as c; p = argparse.ArgumentParser(); s = p.add_subparsers();"
            "c.add_plot_arguments(s); c.add_report_arguments(s);"
            "print(sorted(m for m in ('numpy', 'matplotlib', 'torch', 'h5py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
