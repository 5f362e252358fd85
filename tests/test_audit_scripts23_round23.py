"""Scripts audit, round 23 (scripts23): how the batch scripts write their figures and tables when interrupted.

Defects found (each test fails without its fix):

* asmnas_stability.py (stability.png), bayes_compression.py (compression.png), sparsenas_digits.py (fig3.<fmt>) and
  xnas_statistical.py (fig8.png) called matplotlib's ``savefig`` on the figure's own name: Ctrl-C (or a kill, a full
  disk) while the figure was written left a truncated file under that name, the previous figure lost, where nasdiag's
  `nasdiag.plot.registry.save` writes a fresh exclusive temporary name, fsyncs and renames it over the old one. They
  draw through ``save`` now (test_ctrl_c_while_a_script_writes_its_figure_keeps_the_previous_figure_whole).
* the tables of the scripts (xnas_statistical's fits.json, asmnas_stability's summary.json, curvature_accuracy's .json
  and .md, bench_search's --json) were written with ``open(path, "w")`` / ``write_text``: the old table emptied first,
  so Ctrl-C mid-write left a truncated fits.json (which the next run refused as not one of the script's, the earlier
  numbers lost) and a reader that had the old table open read the new one. `script_args.write_table` writes them as
  ``save`` writes figures (test_a_rerun_replaces_its_tables_whole_so_a_reader_of_the_old_one_reads_it_whole,
  test_ctrl_c_while_a_table_is_written_keeps_the_earlier_table).
* make_readme_figures.py moved the two runs' comparison from ``<runs>/compare`` into ``--out`` with ``os.replace``:
  with ``--runs`` and ``--out`` on two file systems (runs on a scratch disk or /dev/shm, the images in the checkout) it
  stopped in "Invalid cross-device link" after the searches and every other image, exit 2, no
  compare_cost_heatmap.png; and a docs/img/compare_cost_heatmap.png that is a symbolic link was replaced by the figure
  (the link lost, the file it names left stale). The figure is copied through `script_args.write_file` (written next
  to the file replaced, renamed over it, through a link)
  (test_make_readme_figures_writes_the_comparison_into_out_across_file_systems_and_through_a_link).
* the wiring scripts (wiring_cost_heatmaps, wiring_variants, wiring_evolution: ``wiring_common.draw_figures``) drew
  the NaN and inf cells of a partly diverged run's heatmaps grey and exited 0 without a word, where ``nasdiag plot`` of
  the same record says "1 NaN, 1 +inf (cost/normal/mean: ...) in the drawn families, marked in the figures"; the same
  line on stderr now (stdout still lists the figures written)
  (test_a_wiring_script_says_the_nan_and_inf_of_the_heatmaps_it_draws); make_readme_figures.py likewise said nothing
  of the NaN in the seed-0 record it draws the README's images from
  (test_make_readme_figures_says_the_nan_of_the_record_it_draws).
* xnas_statistical.py took any --n-grid, --n-experts and --runs: ``--n-grid 2,10000000000`` simulated N = 2, replacing
  record.h5 by a record of that one point, then stopped in torch's "DefaultCPUAllocator: can't allocate memory"
  traceback, exit 1 (or, with memory overcommitted, the OOM killer). Every grid point is checked against the machine's
  memory before any work (`script_args.refuse_past_memory`)
  (test_xnas_statistical_refuses_a_grid_past_the_machines_memory_before_any_work).
* a script's output piped into a reader that stops early (``curvature_accuracy.py | head -1``, ``sparsenas_digits.py |
  head``) ended in "curvature_accuracy: error: Broken pipe", exit code 2, or, where the output was still in Python's
  buffer, in "Exception ignored ... BrokenPipeError" from the interpreter's final flush, exit code 120, where
  ``nasdiag ... | head`` exits 141 without a word. `nasdiag.errors.run_script` does as the CLI does
  (test_a_script_whose_reader_goes_away_exits_141_without_a_word).
* wiring_output_cost.main() added a filter ignoring the probe's "some candidate ops did not run" RuntimeWarning to the
  interpreter's ``warnings.filters`` and left it there: called in a session (a notebook, as the scripts' main()
  allows), every later probe of that session said nothing of ops that did not run. The filter lives for the run only
  (test_wiring_output_cost_main_leaves_the_sessions_warning_filters_as_they_were); xnas_statistical.main() likewise
  left seaborn's theme (``sns.set_theme``: axes.grid on, image.cmap 'rocket', font sizes) in the session's rcParams,
  restyling every later figure of the session; the theme is set for Fig. 8 only
  (test_xnas_statistical_main_leaves_the_sessions_rcparams_as_they_were); and bayes_compression.main() (always: its
  --threads defaults to 1), xnas_statistical's and asmnas_stability's (with --threads) left torch at the script's
  thread count; `script_args.torch_threads` sets it for the run and restores it, as ``nasdiag search --threads`` does
  (test_a_scripts_main_leaves_torchs_threads_as_they_were).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

OLD = b"an earlier nasdiag figure: the mark nasdiag figure makes it the script's own"


def _run(script, argv, capsys):
    """(exit code, stderr lines) of a batch script run in-process, through run_script as its command."""
    from nasdiag.errors import run_script

    code = run_script(script, importlib.import_module(script).main, argv)
    _, err = capsys.readouterr()
    return code, err.strip().splitlines()


def _interrupt_png_writes(monkeypatch):
    """Every PNG write writes its first bytes, then Ctrl-C comes (as from a user who gave up on a slow figure)."""
    import functools
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    original = FigureCanvasAgg.print_png

    @functools.wraps(original)  # its signature: matplotlib passes on only the keywords it takes
    def half_written(self, filename_or_obj, *args, **kwargs):
        if isinstance(filename_or_obj, io.BytesIO):  # matplotlib's own dry run of a layout, in memory
            return original(self, filename_or_obj, *args, **kwargs)
        if isinstance(filename_or_obj, (str, os.PathLike)):
            with open(filename_or_obj, "wb") as fh:
                fh.write(b"\x89PNG half")
        else:
            filename_or_obj.write(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(FigureCanvasAgg, "print_png", half_written)


def _asmnas_summary(out):
    runs = [{"method": m, "seed": 0, "selected": {"normal": ["skip_connect", "sep_conv_3x3"], "reduce": ["none", "none"]},
             "supernet_acc": 0.5, "discrete_acc": 0.4, "replaced_acc": {"normal": [0.45, 0.5], "reduce": [0.3, 0.5]},
             "genotype": "", "record": "", "seconds": 1.0} for m in ("asmnas", "darts")]
    (out / "summary.json").write_text(json.dumps({"config": {}, "runs": runs}))


@pytest.mark.parametrize("script, figure, argv", [
    ("asmnas_stability", "stability.png", ["--plot-only"]),
    ("bayes_compression", "compression.png", ["--iterations", "1", "--epochs-per-iteration", "1"]),
    ("sparsenas_digits", "fig3.png", ["--epochs", "1", "--retrain-epochs", "0", "--lambdas", "1e-3", "--optimizers",
                                      "sgd", "--penalties", "sgl", "--workers", "1", "--no-progress"]),
    ("xnas_statistical", "fig8.png", ["--runs", "2", "--steps", "5", "--n-grid", "2,4", "--sigma-grid", "1,2",
                                      "--lr-multipliers", ""]),
])
def test_ctrl_c_while_a_script_writes_its_figure_keeps_the_previous_figure_whole(script, figure, argv, tmp_path,
                                                                                 capsys, monkeypatch):
    """Ctrl-C in the middle of writing the figure: exit 130, the figure of the earlier run byte for byte as it was,
    no temporary file left beside it (savefig on the figure's name left b'\\x89PNG half' in its place)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / figure).write_bytes(OLD)
    if script == "asmnas_stability":
        _asmnas_summary(out)
    _interrupt_png_writes(monkeypatch)
    code, err = _run(script, ["--out", str(out), *argv], capsys)
    assert code == 130, err
    assert (out / figure).read_bytes() == OLD
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]


# -- tables: renamed over the old one, never emptied and rewritten in place ----------------------------------------
def _curvature_accuracy(out, capsys, monkeypatch):
    import curvature_accuracy

    row = ("tanh_mlp", "weights", "diag", 0.25, 0.5, 1.5, None)  # the measurement is not what this test is about
    monkeypatch.setattr(curvature_accuracy, "measure", lambda *args, **kwargs: iter([row]))
    return _run("curvature_accuracy", ["--nets", "tanh_mlp", "--repeats", "1", "--out", str(out)], capsys)


@pytest.mark.parametrize("script", ["xnas_statistical", "curvature_accuracy"])
def test_a_rerun_replaces_its_tables_whole_so_a_reader_of_the_old_one_reads_it_whole(script, tmp_path, capsys,
                                                                                    monkeypatch):
    """A reader that opened the earlier run's table (fits.json; curvature_accuracy.json and .md) before the rerun
    still reads that table whole, and the path holds the rerun's: the table is a new file renamed over the old one.
    open(path, "w") emptied the old file and wrote the new table into it: the reader got the new one (or, interrupted,
    half of it), and Ctrl-C mid-write lost the earlier table. A table that is a symbolic link stays one, the table
    written into the file it names."""
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = tmp_path / "kept" / "fits.json"
    elsewhere.parent.mkdir()
    if script == "xnas_statistical":
        old = {out / "fits.json": json.dumps({"config": {"note": "the earlier run"}, "vs_n": {}}, indent=1)}
        elsewhere.write_text(old[out / "fits.json"])
        (out / "fits.json").symlink_to(elsewhere)
    else:
        old = {out / "curvature_accuracy.json": json.dumps({"setting": "the earlier run", "rows": []}) + "\n",
               out / "curvature_accuracy.md": "torch the earlier run\n\n| net | w.r.t. | mode | rel. error |\n"}
        for path, text in old.items():
            path.write_text(text)
    readers = {path: open(path, encoding="utf-8") for path in old}
    try:
        if script == "xnas_statistical":
            code, err = _run(script, ["--out", str(out), "--runs", "2", "--steps", "5", "--n-grid", "2,4",
                                      "--sigma-grid", "1,2", "--lr-multipliers", ""], capsys)
        else:
            code, err = _curvature_accuracy(out, capsys, monkeypatch)
        assert code == 0, err
        for path, reader in readers.items():
            assert reader.read() == old[path]
            assert path.read_text(encoding="utf-8") != old[path]
    finally:
        for reader in readers.values():
            reader.close()
    if script == "xnas_statistical":
        assert (out / "fits.json").is_symlink() and os.readlink(out / "fits.json") == str(elsewhere)
        assert "vs_sigma" in json.loads(elsewhere.read_text())
    else:
        assert json.loads((out / "curvature_accuracy.json").read_text())["rows"][0]["mode"] == "diag"
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]


def test_ctrl_c_while_a_table_is_written_keeps_the_earlier_table(tmp_path, capsys, monkeypatch):
    """Ctrl-C while xnas_statistical --plot-only writes fits.json: exit 130, the earlier fits.json as it was (json.dump
    into the opened file left its first lines only, which the next run refused as not a table of this script)."""
    out = tmp_path / "out"
    code, err = _run("xnas_statistical", ["--out", str(out), "--runs", "2", "--steps", "5", "--n-grid", "2,4",
                                          "--sigma-grid", "1", "--lr-multipliers", ""], capsys)
    assert code == 0, err
    before = (out / "fits.json").read_bytes()
    original = json.JSONEncoder.iterencode

    def interrupted(self, o, _one_shot=False):
        for n, chunk in enumerate(original(self, o, _one_shot)):
            if n == 20:
                raise KeyboardInterrupt
            yield chunk

    monkeypatch.setattr(json.JSONEncoder, "iterencode", interrupted)
    code, err = _run("xnas_statistical", ["--out", str(out), "--plot-only"], capsys)
    assert code == 130, err
    assert (out / "fits.json").read_bytes() == before


# -- make_readme_figures: the comparison into --out -----------------------------------------------------------------
def _darts_record(path, scale, nan=False):
    """A record of method darts with the cost means of one normal cell at two steps (what the comparison draws); with
    ``nan``, one of the 8 values NaN."""
    import warnings

    import numpy as np

    from nasdiag.record import Recorder

    meta = {"method": "darts", "op_names": ["none", "skip_connect"], "edge_names": {"normal": ["0->2", "1->2"]},
            "cell_types": ["normal"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Recorder(str(path), meta=meta) as rec:
            for step in (1, 2):
                rec.log(step, {"cost/normal/mean": scale * step * np.array([[0.1, -0.2], [0.3, np.nan if nan and step == 2
                                                                                     else 0.05]])})


def test_make_readme_figures_writes_the_comparison_into_out_across_file_systems_and_through_a_link(tmp_path, capsys,
                                                                                                monkeypatch):
    """--runs and --out on two file systems (os.replace between their folders fails with EXDEV, as the kernel's rename
    does: simulated here for any two folders): exit 0 and compare_cost_heatmap.png in --out, a nasdiag figure; the
    comparison of --runs kept. Where compare_cost_heatmap.png is a link to a figure kept elsewhere, the link stays and
    the figure it names is the new comparison."""
    import errno

    from nasdiag.plot.registry import is_nasdiag_figure

    runs, img, kept = tmp_path / "runs", tmp_path / "img", tmp_path / "kept"
    for folder in (runs, img, kept):
        folder.mkdir()
    for seed in (0, 1):
        _darts_record(runs / f"darts_seed{seed}.h5", 1 + seed)
    (kept / "compare.png").write_bytes(OLD)
    (img / "compare_cost_heatmap.png").symlink_to(kept / "compare.png")
    rename = os.replace

    def one_file_system_per_folder(src, dst, **kwargs):
        if os.path.dirname(os.path.abspath(src)) != os.path.dirname(os.path.abspath(dst)):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src))
        return rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", one_file_system_per_folder)
    code, err = _run("make_readme_figures", ["--out", str(img), "--runs", str(runs), "--plot-only"], capsys)
    assert code == 0, err
    assert (img / "compare_cost_heatmap.png").is_symlink()
    assert os.readlink(img / "compare_cost_heatmap.png") == str(kept / "compare.png")
    compared = (kept / "compare.png").read_bytes()
    assert compared != OLD and is_nasdiag_figure(kept / "compare.png") and compared.startswith(b"\x89PNG")
    assert (runs / "compare" / "cost_normal_heatmap.png").read_bytes() == compared

    (img / "compare_cost_heatmap.png").unlink()  # a plain file: written there, across the two "file systems"
    code, err = _run("make_readme_figures", ["--out", str(img), "--runs", str(runs), "--plot-only"], capsys)
    assert code == 0, err
    assert (img / "compare_cost_heatmap.png").read_bytes() == (runs / "compare" / "cost_normal_heatmap.png").read_bytes()
    assert not [name for name in os.listdir(img) if name.endswith(".tmp")]


# -- NaN/inf in the heatmaps of a wiring script ----------------------------------------------------------------------
def test_a_wiring_script_says_the_nan_and_inf_of_the_heatmaps_it_draws(tmp_path, capsys):
    """A record of wiring_cost_heatmaps whose cost means hold one NaN (at initialization) and one +inf (at the end), as
    ``numpy`` plants them here: both heatmaps drawn, exit 0, and one stderr line counting 1 NaN and 1 +inf of
    cost/normal/mean (none before: the script said nothing of them)."""
    import warnings

    import numpy as np

    from nasdiag.errors import run_script
    from nasdiag.record import Recorder

    init, final = np.array([[0.1, np.nan], [0.2, 0.3]]), np.array([[0.1, 0.2], [np.inf, 0.3]])
    meta = {"method": "fixed_architecture", "op_names": ["none", "skip_connect"], "edge_names": {"normal": ["0->2", "1->2"]},
            "cell_types": ["normal"]}
    (tmp_path / "minimal8").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Recorder's own warning of the planted values
        with Recorder(str(tmp_path / "minimal8" / "record.h5"), meta=meta) as rec:
            rec.log(0, {"cost/normal/mean": init, "scalars/epoch": np.float32(-1)})
            rec.log(5, {"cost/normal/mean": final, "scalars/epoch": np.float32(0)})
    nan, inf = int(np.isnan(init).sum() + np.isnan(final).sum()), int(np.isposinf(init).sum() + np.isposinf(final).sum())
    capsys.readouterr()
    code = run_script("wiring_cost_heatmaps", importlib.import_module("wiring_cost_heatmaps").main,
                      ["--out", str(tmp_path), "--configs", "minimal8", "--plot-only"])
    printed, err = capsys.readouterr()
    assert code == 0, err
    assert sorted(Path(line).name for line in printed.split()) == ["cost_normal_heatmap_final.png",
                                                                    "cost_normal_heatmap_init.png"]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{nan} NaN, {inf} +inf" in lines[0] and "cost/normal/mean" in lines[0], lines


def test_make_readme_figures_says_the_nan_of_the_record_it_draws(tmp_path, capsys):
    """One NaN planted in seed 0's cost means: the README images drawn (exit 0) and one stderr line counting 1 NaN of
    cost/normal/mean in darts_seed0.h5 (the cost heatmap marks it grey; the script said nothing)."""
    runs, img = tmp_path / "runs", tmp_path / "img"
    runs.mkdir()
    _darts_record(runs / "darts_seed0.h5", 1, nan=True)
    _darts_record(runs / "darts_seed1.h5", 2)
    code, err = _run("make_readme_figures", ["--out", str(img), "--runs", str(runs), "--plot-only"], capsys)
    assert code == 0, err
    said = [line for line in err if "NaN" in line and "darts_seed0.h5" in line]
    assert len(said) == 1 and "1 NaN" in said[0] and "cost/normal/mean" in said[0], err
    assert (img / "cost_heatmap.png").exists()


# -- a simulation past the machine's memory ----------------------------------------------------------------------------
def test_xnas_statistical_refuses_a_grid_past_the_machines_memory_before_any_work(tmp_path, capsys):
    """--n-grid 2,10000000000 at 1000 runs: one (runs, N) float64 tensor alone is 80 TB, more than this machine's
    physical memory (os.sysconf): exit 2, one line naming --n-grid and the N, and nothing written (the earlier
    record.h5 of the folder as it was), where it was a traceback after the first point replaced the record."""
    need = 1000 * 10_000_000_000 * 8
    assert need > os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # the premise: it cannot fit
    out = tmp_path / "out"
    code, err = _run("xnas_statistical", ["--out", str(out), "--runs", "2", "--steps", "5", "--n-grid", "2,4",
                                          "--sigma-grid", "1", "--lr-multipliers", ""], capsys)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, err = _run("xnas_statistical", ["--out", str(out), "--runs", "1000", "--n-grid", "2,10000000000"], capsys)
    assert code == 2 and len(err) == 1 and "--n-grid" in err[0] and "10000000000 experts" in err[0], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# -- | head ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prints", ["for i in range(100000): print(i, flush=True)",  # a table printed line by line
                                    "time.sleep(1); print('wrote fits.json')"])      # one buffered line, flushed at exit
def test_a_script_whose_reader_goes_away_exits_141_without_a_word(prints):
    """A script run as its command (``sys.exit(run_script(...))``) whose standard output is a pipe the reader closed
    (as ``| head -1`` does once it has its line): exit code 141 (128 + SIGPIPE, nasdiag's), nothing on stderr."""
    import subprocess
    import sys

    code = ("import sys, time\nfrom nasdiag.errors import run_script\n"
            f"def main(argv):\n    {prints}\n"
            "sys.exit(run_script('table', main))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before (or as) the script writes
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert err == ""


# -- module-global state ---------------------------------------------------------------------------------------------
def test_wiring_output_cost_main_leaves_the_sessions_warning_filters_as_they_were(tmp_path, capsys):
    """main() in-process (here refused at once: --plot-only of no record, exit 2) leaves ``warnings.filters`` as it
    found them; a later probe's "did not run" RuntimeWarning is still shown."""
    import warnings

    before = list(warnings.filters)
    code, err = _run("wiring_output_cost", ["--out", str(tmp_path / "out"), "--plot-only"], capsys)
    assert code == 2 and len(err) == 1 and "no record at" in err[0], err
    assert warnings.filters == before
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("probe: some candidate ops did not run (a later probe's)", RuntimeWarning)
    assert len(caught) == 1


def test_xnas_statistical_main_leaves_the_sessions_rcparams_as_they_were(tmp_path, capsys):
    """A small xnas_statistical run in-process (exit 0, fig8.png drawn): matplotlib's rcParams as before it."""
    import matplotlib

    with matplotlib.rc_context():  # from matplotlib's defaults (an earlier test's run may have left a theme), restored
        matplotlib.rcdefaults()
        before = dict(matplotlib.rcParams)
        code, err = _run("xnas_statistical", ["--out", str(tmp_path / "out"), "--runs", "2", "--steps", "5", "--n-grid",
                                              "2,4", "--sigma-grid", "1", "--lr-multipliers", ""], capsys)
        assert code == 0 and (tmp_path / "out" / "fig8.png").exists(), err
        after = dict(matplotlib.rcParams)
    assert {k: (before[k], after[k]) for k in before if before[k] != after[k]} == {}



@pytest.mark.parametrize("script, argv", [
    ("bayes_compression", ["--iterations", "1", "--epochs-per-iteration", "1"]),  # --threads 1 by default
    ("xnas_statistical", ["--runs", "2", "--steps", "5", "--n-grid", "2,4", "--sigma-grid", "1", "--lr-multipliers", "",
                          "--threads", "1"]),
])
def test_a_scripts_main_leaves_torchs_threads_as_they_were(script, argv, tmp_path, capsys):
    """A session at 2 torch threads runs the script with 1: exit 0, and torch.get_num_threads() is 2 again after it."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        code, err = _run(script, ["--out", str(tmp_path / "out"), *argv], capsys)
        assert code == 0, err
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
