"""Scripts and figures audit, round 20: a NAS researcher turning records into figures with the batch scripts
(scripts/*.py) and ``nasdiag plot``. Records are made here by ``nasdiag search`` (darts, dsnas, xnas: digits, two short
epochs, once per module) or planted through the public `Recorder`; every number a figure or a script prints is
compared with this file's own reading of the HDF5 file (h5py directly, not nasdiag's reader) and its own arithmetic
(numpy; XNAS eq 3/4 transcribed here).

Checked and found right (probes in the round's scratch, kept as tests where they are cheap): every heatmap (arch,
cost, cost_std, hessian, sample_counts) of darts, snas, dsnas, xnas and bayesnas search records at ``init``, step 8
and ``final``: cell values (the image's array times the bar's power of ten) equal to the h5py row (√var for the std,
p − 1/K for arch, the float32 1/K drawn as 0), tick labels meta's op and edge names in order, titles with the row's
step and the epoch's steps, colour limits ±max|finite| (signed) or min..max (sequential), DSNAS's unsampled-op NaN cells
counted in the title; xnas_statistical's fits.json and printed fits against this file's own means, least squares
through the origin, R², log-log slope (scipy's linregress), its bound against eq 3 (η T L²/2 + ln N/η − ln γ_T/η)
and its η against eq 4 with L = 3√(1 + σ²); its per-run regret (eq 2), uniform regret, bound (eq 3 with eq 28's
γ_T), experts alive and correct selections against this file's Algorithm 1 and GD-with-softmax fed the same draws; xnas_toys' fig4, fig5, fig7 trajectories, update terms and losses against
this file's EG-with-wipeout and softmax-GD recursions (fig3's XNAS differs from a float transcription only by the tie
at t = 100, where the gap of x to z is exactly 2ηL(T − t) = 8 and Algorithm 1's ≥ keeps x one more round, as nasdiag
does); curvature_accuracy's relative error ‖g − e‖/‖e‖ and Spearman ρ (scipy's, exact zeros left out) as its
docstring defines them; curvature_residual's Gauss-Newton term Σ_b (Σ_c p v² − (Σ_c p v)²)/B.

Also right: every line figure of those records (arch_evolution, regret_bound, alive_experts, bayes γ/ω/curvature and
switches, sampling, hessian_eigenvalue of a --spectrum-every run over its two segments, scalars) plots h5py's values at
h5py's steps; the comparison of darts, bayesnas (7 ops) and xnas aligns columns by op name on one norm spanning every
run; ``nasdiag plot`` of a record with planted NaN/inf rows counts them per path as h5py does, skips the all-NaN maps in
one line each and titles the wiring's NaN epoch; the report's key numbers are the last logged rows; xnas_toys' fig6 is
x(1 − x) and σ(α)(1 − σ(α)).

Left alone: xnas_statistical's fraction of correct selections draws a Wald interval past [0, 1] for few runs (a
cosmetic choice of the 95% interval), joins the points of an unsorted --n-grid in the order given, and at --sigma-grid
1e300 warns numpy's overflow of the interval's square (absurd input); as root here a read-only folder cannot be made,
so the unwritable output is the earlier rounds' file-as-folder case (--out under /sys: one line each); xnas_statistical's
XNAS and GD correct-selection fractions are equal at almost every point of short runs (nasdiag/regret, outside this
area); a comparison panel of a run whose row is NaN in every cell is drawn hatched, where the single figure is skipped.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil

import h5py
import numpy as np
import pytest


def _tree(folder):
    """{relative path: bytes} of every file under ``folder``."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = f.read()
    return found


def _run(script, argv, capsys):
    """A batch script run in-process as its command runs it: (exit code, stdout, stderr lines)."""
    from nasdiag.errors import run_script

    code = run_script(script, importlib.import_module(script).main, argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


def _h5(path):
    """(file, {path: rows in which it was logged}) read with h5py alone (docs/schema.md: /present, its 'paths')."""
    f = h5py.File(path, "r")
    names = [p.decode() if isinstance(p, bytes) else str(p) for p in f["present"].attrs["paths"]]
    present = f["present"][:]
    return f, {name: np.flatnonzero(present[:, j]) for j, name in enumerate(names)}


def _strings(dataset):
    return [s.decode() if isinstance(s, bytes) else str(s) for s in dataset[:]]


def _plant(path, method, rows, meta=None):
    """A record of ``method`` with ``rows`` ({step: {path: value}}) written through the public Recorder."""
    import warnings

    from nasdiag.record import Recorder

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the planted NaN's RecordWarning
        with Recorder(str(path), meta={"method": method, **(meta or {})}) as rec:
            for step, row in rows.items():
                rec.log(step, row)


@pytest.fixture(scope="module")
def searches(tmp_path_factory):
    """Records of ``nasdiag search`` (the same run), digits, two epochs of 3 steps, a small supernet."""
    import warnings

    from nasdiag.search import SearchConfig, run

    folder = tmp_path_factory.mktemp("searches")
    paths = {}
    for method in ("darts", "dsnas", "xnas"):
        paths[method] = str(folder / f"{method}.h5")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(SearchConfig(method=method, dataset="digits", epochs=2, batch_size=200, C=4, layers=3, steps=2, seed=0,
                             record=paths[method], force=True, progress=False, threads=1, device="cpu", figures=None))
        assert not os.path.exists(paths[method][:-3] + ".seg0001.h5")  # one segment: h5py of the file reads every row
    return paths


# -- the figures of search records show the records' numbers --------------------------------------------------------
def test_heatmaps_of_search_records_show_the_h5_rows_under_the_records_names(searches):
    """Each heatmap of a darts, dsnas and xnas record at init, step 4 and final: the drawn cells (times the bar's power
    of ten) are the h5py row of the step the title names, ticks are meta's names in order, the colour limits span the
    finite cells, NaN cells (DSNAS's unsampled ops) are counted in the title."""
    import re

    import matplotlib.pyplot as plt

    from nasdiag.plot.registry import iter_figures
    from nasdiag.record import load

    seen = set()
    for method, path in searches.items():
        f, logged = _h5(path)
        steps, ops = f["step"][:], _strings(f["meta/op_names"])
        for spec, cell, at, thunk in iter_figures(load(path), ["arch", "cost", "cost_std", "hessian", "sample_counts"],
                                                  ["init", 4, "final"]):
            fig = thunk()
            ax = next(a for a in fig.axes if a.images)
            image = ax.images[0]
            power = re.search(r"\(x 1e(-?\d+)\)", fig.axes[-1].get_ylabel())
            scale = 10.0 ** int(power.group(1)) if power else 1.0
            drawn = np.ma.filled(image.get_array().astype(float), np.nan) * scale
            name = {"arch": "arch/{}/probabilities", "cost": "cost/{}/mean", "cost_std": "cost/{}/var",
                    "hessian": "hessian/{}/diag", "sample_counts": "sample/{}/count"}[spec.name].format(cell)
            rows = logged[name]
            row = rows[0] if at == "init" else rows[-1] if at == "final" else rows[steps[rows] <= 4][-1]
            stored = f[name][row]
            want = stored.astype(float)
            if spec.name == "cost_std":
                want = np.sqrt(want)
            if spec.name == "arch":  # p − 1/K, the stored float32 1/K counted as uniform
                want = np.where(stored == np.float32(1 / want.shape[1]), 0.0, want - 1 / want.shape[1])
            np.testing.assert_allclose(drawn, want, rtol=1e-6, atol=1e-12 * scale, err_msg=f"{method} {spec.name} {cell} {at}")
            assert [t.get_text() for t in ax.get_xticklabels()] == ops
            assert [t.get_text() for t in ax.get_yticklabels()] == _strings(f[f"meta/edge_names/{cell}"])
            title = ax.get_title(loc="left").replace("\n", " ")
            assert f"step {steps[row]}" in title or f"-{steps[row]}" in title, title
            if spec.name.startswith("cost"):  # the epoch's steps: after the previous cost row (or the first step)
                earlier = rows[rows < row]
                first = steps[earlier[-1]] + 1 if earlier.size else steps[0]
                span = f"steps {first}-{steps[row]}" if first < steps[row] else f"step {steps[row]}"
                assert f"{span} (epoch {int(f['scalars/epoch'][row])})" in title, title
            nan = int(np.isnan(want).sum())
            assert (f"{nan} NaN" in title) == bool(nan), title
            finite = want[np.isfinite(want)]
            if "clipped" not in title:
                lo, hi = image.norm.vmin * scale, image.norm.vmax * scale
                if finite.min() < 0 or spec.name in ("arch", "cost"):
                    assert np.isclose(hi, np.abs(finite).max()) and np.isclose(lo, -hi), (lo, hi)
                elif finite.max() > finite.min():
                    assert np.isclose(lo, finite.min()) and np.isclose(hi, finite.max()), (lo, hi)
            seen.add((method, spec.name))
            plt.close(fig)
        f.close()
    assert {("dsnas", "sample_counts"), ("xnas", "hessian"), ("darts", "cost_std")} <= seen, seen


def test_the_regret_figure_of_an_xnas_search_plots_the_h5_regret_and_bound(searches):
    """regret_bound of an xnas search record: per edge, a solid curve of regret/<cell>/regret and a dashed one of
    regret/<cell>/bound at the steps they were logged, as h5py reads them."""
    import matplotlib.pyplot as plt

    from nasdiag.plot.registry import iter_figures
    from nasdiag.record import load

    f, logged = _h5(searches["xnas"])
    steps = f["step"][:]
    cells = set()
    for spec, cell, _, thunk in iter_figures(load(searches["xnas"]), ["regret_bound"]):
        fig = thunk()
        ax = fig.axes[0]
        solid = [ln for ln in ax.lines if ln.get_label() in _strings(f[f"meta/edge_names/{cell}"])]
        dashed = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
        regret, bound = f[f"regret/{cell}/regret"], f[f"regret/{cell}/bound"]
        assert len(solid) == regret.shape[1] == len(dashed)
        for e, (s, d) in enumerate(zip(solid, dashed)):
            rows = logged[f"regret/{cell}/regret"]
            np.testing.assert_array_equal(s.get_xdata(), steps[rows])
            np.testing.assert_allclose(s.get_ydata(), regret[:, e][rows], rtol=0, atol=0)
            rows = logged[f"regret/{cell}/bound"]
            np.testing.assert_array_equal(d.get_xdata(), steps[rows])
            np.testing.assert_allclose(d.get_ydata(), bound[:, e][rows], rtol=0, atol=0)
        cells.add(cell)
        plt.close(fig)
    assert cells == {"normal", "reduce"}


# -- a record lacking the family the script draws ----------------------------------------------------------------------
def test_wiring_plot_only_of_a_record_without_costs_is_one_line_and_draws_nothing(tmp_path, capsys):
    """wiring_cost_heatmaps --plot-only of a record of its method without cost/<cell>/mean drew nothing and exited 0
    without a word (``nasdiag plot --figures cost`` of it exits 2); and of two configurations, the second one's
    missing record was refused after the first one's heatmaps were drawn. One line, before any figure."""
    out = tmp_path / "out"
    meta = {"op_names": ["a", "b"], "edge_names": {"normal": ["0->2"]}, "cell_types": ["normal"]}
    _plant(out / "minimal1" / "record.h5", "fixed_architecture",
           {0: {"scalars/train_loss": np.float32(2.3), "scalars/epoch": np.float32(-1)}}, meta)
    before = _tree(tmp_path)
    code, _, err = _run("wiring_cost_heatmaps", ["--out", str(out), "--configs", "minimal1", "--plot-only"], capsys)
    assert code == 2 and len(err) == 1 and "cost/<cell>/mean" in err[0] and "minimal1" in err[0], err
    assert _tree(tmp_path) == before

    _plant(out / "minimal8" / "record.h5", "fixed_architecture",  # this one has costs; minimal1 still has none
           {0: {"cost/normal/mean": np.array([[0.1, -0.2]]), "scalars/epoch": np.float32(-1)}}, meta)
    before = _tree(tmp_path)
    code, _, err = _run("wiring_cost_heatmaps", ["--out", str(out), "--configs", "minimal8,minimal1", "--plot-only"],
                        capsys)
    assert code == 2 and len(err) == 1 and "minimal1" in err[0], err
    assert _tree(tmp_path) == before  # minimal8's heatmap not drawn before the refusal

    shutil.rmtree(out / "minimal1")
    before = _tree(tmp_path)
    code, _, err = _run("wiring_cost_heatmaps", ["--out", str(out), "--configs", "minimal8,minimal1", "--plot-only"],
                        capsys)
    assert code == 2 and len(err) == 1 and "no record at" in err[0] and "minimal1" in err[0], err
    assert _tree(tmp_path) == before

    code, printed, err = _run("wiring_cost_heatmaps", ["--out", str(out), "--configs", "minimal8", "--plot-only"], capsys)
    assert code == 0 and not err and "cost_normal_heatmap_init.png" in printed, err


def test_wiring_evolution_plot_only_of_a_record_without_arch_is_one_line(tmp_path, capsys):
    """wiring_evolution --plot-only of a darts record holding no arch/<cell>/probabilities drew nothing, exit 0."""
    out = tmp_path / "out"
    _plant(out / "darts" / "record.h5", "darts", {1: {"scalars/train_loss": np.float32(2.3)}})
    before = _tree(tmp_path)
    code, _, err = _run("wiring_evolution", ["--out", str(out), "--methods", "darts", "--plot-only"], capsys)
    assert code == 2 and len(err) == 1 and "arch/<cell>/probabilities" in err[0], err
    assert _tree(tmp_path) == before


# -- the user's files ------------------------------------------------------------------------------------------------
def test_make_readme_figures_replaces_no_image_of_the_users(searches, tmp_path, capsys):
    """make_readme_figures --out docs/img replaced the user's own scalars.png (any of its image names) without a word,
    and a comparison of the user's in <runs>/compare; one line before any work, as the other scripts (round 14)."""
    runs, img = tmp_path / "runs", tmp_path / "img"
    runs.mkdir()
    for seed in (0, 1):
        shutil.copy(searches["darts"], runs / f"darts_seed{seed}.h5")
    img.mkdir()
    (img / "scalars.png").write_bytes(b"my own figure")
    before = _tree(tmp_path)
    code, _, err = _run("make_readme_figures", ["--out", str(img), "--runs", str(runs), "--plot-only"], capsys)
    assert code == 2 and len(err) == 1 and "scalars.png" in err[0], err
    assert _tree(tmp_path) == before

    (img / "scalars.png").unlink()
    (runs / "compare").mkdir()
    (runs / "compare" / "cost_normal_heatmap.png").write_bytes(b"my own comparison")
    before = _tree(tmp_path)
    code, _, err = _run("make_readme_figures", ["--out", str(img), "--runs", str(runs), "--plot-only"], capsys)
    assert code == 2 and len(err) == 1 and "cost_normal_heatmap.png" in err[0] and "--runs" in err[0], err
    assert _tree(tmp_path) == before

    (runs / "compare" / "cost_normal_heatmap.png").unlink()
    code, printed, err = _run("make_readme_figures", ["--out", str(img), "--runs", str(runs), "--plot-only"], capsys)
    assert code == 0, err
    assert sorted(os.listdir(img)) == sorted(f"{n}.png" for n in ("scalars", "arch_heatmap", "arch_evolution",
                                                                  "cost_heatmap", "hessian_heatmap", "genotype",
                                                                  "wiring", "compare_cost_heatmap"))


# -- XNAS §8.3: the summary is the record's numbers; a NaN is not averaged away -------------------------------------
def _xnas_statistical(out, capsys):
    argv = ["--out", str(out), "--runs", "4", "--steps", "20", "--n-grid", "2,4,8", "--sigma-grid", "1,2",
            "--lr-multipliers", "", "--seed", "3"]
    code, printed, err = _run("xnas_statistical", argv, capsys)
    assert code == 0, err
    return printed


def test_xnas_statistical_summary_is_the_records_numbers_with_eq_3_and_4(tmp_path, capsys):
    """fits.json and the printed fits against this file's reading of record.h5: per-point means and fractions, the
    one-parameter fits a√(ln N), b√N (least squares through 0, R² about the mean), the log-log slope (scipy), the bound
    of eq 3 and η* of eq 4 with L = 3√(1 + σ²)."""
    from scipy.stats import linregress

    out = tmp_path / "xs"
    printed = _xnas_statistical(out, capsys)
    summary = json.loads((out / "fits.json").read_text())
    f, logged = _h5(out / "record.h5")
    T = json.loads(f.attrs["config"])["steps"]
    for sweep in ("vs_n", "vs_sigma"):
        rows = logged[f"regret/{sweep}/n_experts"]

        def get(name):
            return f[f"regret/{sweep}/{name}"][:][rows]

        N, sigma, lr, L, gamma = get("n_experts").astype(float), get("sigma"), get("lr"), get("loss_bound"), get("xnas/gamma")
        np.testing.assert_allclose(L, 3 * np.sqrt(1 + sigma ** 2), rtol=1e-15)
        np.testing.assert_allclose(lr, np.sqrt(2 * np.log(N) / (T * L ** 2)), rtol=1e-14)  # eq 4, multiplier 1
        eq3 = (lr * T * L ** 2 / 2)[:, None] + (np.log(N) / lr)[:, None] - np.log(gamma) / lr[:, None]
        np.testing.assert_allclose(get("xnas/bound"), eq3, rtol=1e-12)
        for i, row in enumerate(summary[sweep]["rows"]):
            for method in ("xnas", "gd"):
                assert np.isclose(row[f"{method}_regret_mean"], get(f"{method}/regret")[i].mean(), rtol=1e-14, atol=0)
                assert row[f"{method}_correct_fraction"] == get(f"{method}/correct")[i].mean()
            assert row["xnas_regret_below_bound_fraction"] == np.mean(get("xnas/regret")[i] <= get("xnas/bound")[i])
        if sweep == "vs_n":
            for method in ("xnas", "gd"):
                y = get(f"{method}/regret").mean(1)
                for key, x in (("sqrt_ln_n", np.sqrt(np.log(N))), ("sqrt_n", np.sqrt(N))):
                    a = x @ y / (x @ x)
                    r2 = 1 - np.sum((y - a * x) ** 2) / np.sum((y - y.mean()) ** 2)
                    got = summary[sweep]["fits"][method][key]
                    assert np.isclose(got["coefficient"], a, rtol=1e-12) and np.isclose(got["r2"], r2, rtol=1e-10)
                slope = linregress(np.log(N), np.log(y)).slope
                assert np.isclose(summary[sweep]["fits"][method]["loglog_slope"], slope, rtol=1e-10)
                assert f"log-log slope {slope:.3f}" in printed
    f.close()


def test_a_nan_regret_run_is_not_counted_as_a_run_above_the_bound_and_is_marked_in_fig8(tmp_path, capsys, monkeypatch):
    """One run's regret NaN at N = 4 (a diverged run): its point's mean is NaN (shown), but the fraction of runs below
    the bound of eq 3 counted it as a run above the bound (0.75 of 4 runs, where 3 are known and below), and Fig. 8
    left the point out without a mark. The fraction is NaN, the point marked at the axes' edge as nasdiag's figures do."""
    import matplotlib.pyplot as plt

    source = tmp_path / "xs"
    _xnas_statistical(source, capsys)
    f, logged = _h5(source / "record.h5")
    rows = {}
    for j, step in enumerate(f["step"][:]):
        rows[int(step)] = {name: f[name][j] for name, where in logged.items() if j in where}
    nan_row = logged["regret/vs_n/n_experts"][list(f["regret/vs_n/n_experts"][:][logged["regret/vs_n/n_experts"]]).index(4)]
    regret = rows[int(f["step"][nan_row])]["regret/vs_n/xnas/regret"].copy()
    regret[2] = np.nan
    rows[int(f["step"][nan_row])]["regret/vs_n/xnas/regret"] = regret
    bound = f["regret/vs_n/xnas/bound"][nan_row]
    meta = {"config": json.loads(f.attrs["config"]), "seed": int(f.attrs["seed"])}
    f.close()
    out = tmp_path / "nan"
    _plant(out / "record.h5", "xnas_statistical", rows, meta)

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    code, _, err = _run("xnas_statistical", ["--out", str(out), "--plot-only"], capsys)
    assert code == 0, err
    point = next(r for r in json.loads((out / "fits.json").read_text())["vs_n"]["rows"] if r["n_experts"] == 4)
    assert np.isnan(point["xnas_regret_mean"])
    assert np.isnan(point["xnas_regret_below_bound_fraction"]), point  # was 0.75
    assert np.all(np.delete(regret, 2) <= np.delete(bound, 2))  # the three known runs are below it
    (fig,) = figures
    ax = fig.axes[0]  # regret vs N
    marks = [ln for ln in ax.lines if ln.get_marker() == "X" and len(ln.get_xdata())]
    assert [list(ln.get_xdata()) for ln in marks] == [[4.0]], [ln.get_xdata() for ln in ax.lines]
    assert "NaN" in ax.get_legend_handles_labels()[1]
    fig.clf()


# -- wiring_output_cost's summary ---------------------------------------------------------------------------------------
def test_wiring_output_cost_summary_names_the_epochs_whose_theorem_2_check_is_nan(tmp_path, capsys, monkeypatch):
    """The printed check of Theorem 2 took np.nanmax of the record's per-epoch deviations: a NaN epoch (a diverged run)
    was left out and the summary read as a clean 1e-7. The largest finite value, and the NaN epochs named."""
    import wiring_common

    def fake_train(net, splits, record_path, config, epochs, *args, **kwargs):  # the record a diverged run leaves
        rows = {}
        for step, epoch, err in ((0, -1, 1e-7), (11, 0, 3e-7), (22, 1, np.nan)):
            row = {"scalars/epoch": np.float32(epoch)}
            for split in ("train", "search"):
                row[f"scalars/thm2_max_abs_error_{split}"] = np.float64(err)
                row[f"scalars/cz_{split}_correct_max"] = np.float64(-0.01 * (epoch + 2))
                for q in ("loss", "entropy", "cz"):
                    for part in ("", "_correct", "_wrong"):
                        row[f"scalars/{q}_{split}{part}"] = np.float64(0.5)
            rows[step] = row
        _plant(record_path, "fixed_architecture", rows)
        return 0.0

    monkeypatch.setattr(wiring_common, "train_fixed", fake_train)
    code, printed, err = _run("wiring_output_cost", ["--out", str(tmp_path / "out"), "--epochs", "2"], capsys)
    assert code == 0, err
    lines = [ln for ln in printed.splitlines() if "max |C_Z" in ln]
    assert len(lines) == 2, printed
    for line in lines:
        assert f"= {3e-7:.2e}" in line and "NaN/inf at epoch 1" in line, line
        assert f"= {-0.01:.2e}" in line, line  # the largest C_Z of a correct sample, every epoch finite


# -- a damaged record of the script's own ---------------------------------------------------------------------------
def test_a_damaged_record_of_the_script_is_named_damaged_not_no_record(tmp_path, capsys):
    """A record of xnas_statistical with one flipped value (its checksum no longer matches): --plot-only said it 'holds
    no nasdiag record, not a record of this script', the reader's reason (which row, that ``salvage=True`` reads the
    rows before it) swallowed; a run said the same before refusing to replace it. One line naming the damage."""
    out = tmp_path / "xs"
    _xnas_statistical(out, capsys)
    with h5py.File(out / "record.h5", "r+") as f:
        regret = f["regret/vs_n/gd/regret"]
        values = regret[:]
        values[1, 0] += 1.0
        regret[...] = values
    before = _tree(tmp_path)
    for extra in (["--plot-only"], ["--runs", "2", "--steps", "2"]):
        code, _, err = _run("xnas_statistical", ["--out", str(out), *extra], capsys)
        assert code == 2 and len(err) == 1, err
        assert "cannot be read" in err[0] and "checksum" in err[0] and "row 1" in err[0], err
        assert "no nasdiag record" not in err[0], err
        assert _tree(tmp_path) == before


def test_wiring_output_cost_plot_only_of_another_scripts_record_names_whose_it_is(searches, tmp_path, capsys):
    """wiring_output_cost --plot-only of a darts search's record (or xnas_toys') said it 'holds no evaluated epoch yet (a
    run stopped before its first evaluation, or one still writing it)', and of a file of the user's that it is a
    damaged record: round 14 named whose record it is for the other scripts. One line naming it."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(searches["darts"], out / "record.h5")
    before = _tree(tmp_path)
    code, _, err = _run("wiring_output_cost", ["--out", str(out), "--plot-only"], capsys)
    assert code == 2 and len(err) == 1 and "a record of darts" in err[0] and "evaluated epoch" not in err[0], err
    assert _tree(tmp_path) == before
    (out / "record.h5").write_text("my notes")
    before = _tree(tmp_path)
    code, _, err = _run("wiring_output_cost", ["--out", str(out), "--plot-only"], capsys)
    assert code == 2 and len(err) == 1 and "no nasdiag record" in err[0] and "damaged" not in err[0], err
    assert _tree(tmp_path) == before


# -- a learning rate the forecasters cannot play, an N without eta* ------------------------------------------------------
@pytest.mark.parametrize("script,argv,said", [
    ("xnas_toys", ["--lr", "1e308"], "--lr 1e+308"),
    ("xnas_statistical", ["--runs", "2", "--steps", "5", "--n-grid", "2", "--sigma-grid", "1", "--lr-multipliers",
                          "1,1e308"], "--lr-multipliers 1,1e308"),
    ("xnas_statistical", ["--runs", "2", "--steps", "5", "--n-grid", "1,2", "--sigma-grid", "1", "--lr-multipliers", ""],
     "--n-grid"),
])
def test_an_eg_step_past_float64_or_one_expert_is_one_line_before_any_folder(script, argv, said, tmp_path, capsys):
    """xnas_toys --lr 1e308 (and xnas_statistical's --lr-multipliers 1,1e308 after the Fig. 8 sweeps) stopped in the
    forecaster's RegretError 'the EG step ln v + eta R overflows ... rewards this large are not losses of a bounded scale
    L: clip or rescale them', naming no option, an empty folder (a record of the points before it) left; --n-grid 1 was
    'eta* needs N >= 2 experts' after the folder and the record were made. One line naming the option, nothing made."""
    out = tmp_path / "out"
    code, _, err = _run(script, ["--out", str(out), *argv], capsys)
    assert code == 2 and len(err) == 1 and said in err[0] and "clip or rescale" not in err[0], err
    assert not out.exists()


def test_make_readme_figures_says_a_skipped_image_on_stderr_not_among_the_paths(tmp_path, capsys):
    """A README image the record cannot draw (the Hessian row NaN in every cell) was said on stdout, among the paths of
    the images written, which the scripts print there (run_script), and a comparison that could not be drawn (a run
    without costs) not at all; on stderr, as the wiring scripts and nasdiag plot."""
    runs, img = tmp_path / "runs", tmp_path / "img"
    ops, edges = ["none", "skip_connect", "sep_conv_3x3"], ["0->2", "1->2"]
    meta = {"op_names": ops, "edge_names": {"normal": edges}, "cell_types": ["normal"]}
    for seed in (0, 1):
        p = np.full((2, 3), 1 / 3, np.float32) + np.float32(0.01 * seed)
        _plant(runs / f"darts_seed{seed}.h5", "darts", {
            1: {"arch/normal/probabilities": p, "scalars/train_loss": np.float32(2.0), "scalars/epoch": np.float32(0),
                "cost/normal/mean": np.array([[0.1, -0.2, 0.3], [0.0, 0.2, -0.1]]) * (seed + 1),
                "hessian/normal/diag": np.full((2, 3), np.nan, np.float32)}}, meta)
    code, printed, err = _run("make_readme_figures", ["--out", str(img), "--runs", str(runs), "--plot-only"], capsys)
    assert code == 0, err
    assert [ln for ln in err if ln.startswith("skipped hessian_heatmap")], err
    assert all(os.path.exists(ln) for ln in printed.splitlines()), printed
    assert (img / "compare_cost_heatmap.png").exists()

    # the second run without costs (recorded with --diagnostics none): no comparison, which was not said at all
    (img / "compare_cost_heatmap.png").unlink()
    (runs / "darts_seed1.h5").unlink()
    _plant(runs / "darts_seed1.h5", "darts", {1: {"arch/normal/probabilities": np.full((2, 3), 0.3, np.float32)}}, meta)
    code, printed, err = _run("make_readme_figures", ["--out", str(img), "--runs", str(runs), "--plot-only"], capsys)
    assert code == 0 and not (img / "compare_cost_heatmap.png").exists(), err
    assert [ln for ln in err if ln.startswith("skipped compare: cost_normal_heatmap")], err


def test_xnas_statistical_records_eq_2_regret_and_eq_3_bound_of_its_own_rewards(tmp_path, capsys):
    """Every per-run number of xnas_statistical's record against this file's float64 transcription, fed the same
    draws (biases N(0, 1), then each step's N(b, σ²) rewards, from one generator seeded with --seed, in grid order):
    Algorithm 1 (EG on ln v, wipeout below max v · exp(−2ηL(T − t))), GD with softmax (eq 5-6: α += η u (R − u·R)),
    the regret of eq 2 with the linear losses −R·p (max_i S_i − Σ_t R_t·p_t), the uniform mixture's, eq 3's bound
    with γ_T = Π Γ_t of eq 28, the experts alive, and correct selection (argmax of the final weights = argmax b)."""
    import math

    import torch

    out = tmp_path / "xs"
    argv = ["--out", str(out), "--runs", "3", "--steps", "40", "--n-grid", "2,4", "--sigma-grid", "0.5",
            "--lr-multipliers", "8", "--n-experts", "3", "--sigma", "1", "--seed", "5"]
    code, _, err = _run("xnas_statistical", argv, capsys)
    assert code == 0, err
    f, logged = _h5(out / "record.h5")
    T, runs = 40, 3
    generator = torch.Generator().manual_seed(5)
    for row, (sweep, N, sigma, k) in enumerate([("vs_n", 2, 1.0, 1.0), ("vs_n", 4, 1.0, 1.0), ("vs_sigma", 3, 0.5, 1.0),
                                                ("vs_lr", 3, 1.0, 8.0)]):
        assert row in logged[f"regret/{sweep}/n_experts"]
        L = 3 * math.sqrt(1 + sigma ** 2)
        lr = k * math.sqrt(2 * math.log(N) / (T * L * L))  # eq 4 times the multiplier
        b = torch.randn(runs, N, generator=generator, dtype=torch.float64).numpy()
        rewards = np.stack([torch.randn(runs, N, generator=generator, dtype=torch.float64).numpy() * sigma + b
                            for _ in range(T)])
        want = {name: [] for name in ("xnas/regret", "gd/regret", "uniform/regret", "xnas/bound", "xnas/correct",
                                      "gd/correct", "xnas/alive")}
        for r in range(runs):
            log_v, alive, alpha = np.zeros(N), np.ones(N, bool), np.zeros(N)
            xnas_gain = gd_gain = log_gamma = 0.0
            for t in range(T):
                R = rewards[t, r]
                v = np.where(alive, np.exp(log_v - log_v[alive].max()), 0.0)
                xnas_gain += v / v.sum() @ R
                log_v = log_v + lr * R
                top = log_v[alive].max()
                keep = alive & (log_v >= top - 2 * lr * L * (T - (t + 1)))
                log_gamma += math.log(np.exp(log_v[alive] - top).sum() / np.exp(log_v[keep] - top).sum())  # ln Γ_t
                alive = keep
                u = np.exp(alpha - alpha.max())
                u /= u.sum()
                gd_gain += u @ R
                alpha = alpha + lr * u * (R - u @ R)
            S = rewards[:, r].sum(0)
            want["xnas/regret"].append(S.max() - xnas_gain)
            want["gd/regret"].append(S.max() - gd_gain)
            want["uniform/regret"].append(S.max() - S.mean())
            want["xnas/bound"].append(lr * T * L * L / 2 + math.log(N) / lr - log_gamma / lr)
            want["xnas/correct"].append(np.where(alive, log_v, -np.inf).argmax() == b[r].argmax())
            want["gd/correct"].append(alpha.argmax() == b[r].argmax())
            want["xnas/alive"].append(alive.sum())
        for name, values in want.items():
            np.testing.assert_allclose(f[f"regret/{sweep}/{name}"][row].astype(float), np.asarray(values, float),
                                       rtol=1e-10, atol=1e-10, err_msg=f"{sweep} N={N} {name}")
    f.close()
