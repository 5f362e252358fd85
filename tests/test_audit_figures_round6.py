"""Figures audit, round 6: figures and reports drawn from REAL records, one per method `nasdiag methods` lists (the
smallest search through `nasdiag.search.run`: C = 2, 3 layers, 2 nodes, 2 epochs of one step, cost and Hessian
diagnostics, the top eigenvalue on one of them), instead of the synthetic records of the earlier rounds.

Checked against docs/figures.md and the method pages (docs/xnas.md, bayesnas.md, sparsenas.md, asmnas.md): every
figure promised for the method's families is drawn (or skipped with a reason that is true of the record); each
heatmap shows the record's row (read back from ``ax.images``) under the record's op and edge names, with a title
naming the cell and the step drawn and a labelled colour bar; ``--at STEP`` draws that step's row and a step after the
record is one line; the comparison of two methods' records puts one op in one column of every panel; the report
holds every figure `nasdiag plot` draws, as decodable inline PNGs; drawing twice gives the same bytes.

The references are the record's own arrays (`nasdiag.record.load`, h5py underneath) and this file's transforms of
them; nothing is compared to a stored image."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
import warnings

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from nasdiag.plot.registry import NothingToDraw, iter_figures, registered, write_comparison, write_figures  # noqa: E402
from nasdiag.plot.style import plt, render_heatmaps  # noqa: E402
from nasdiag.record import load  # noqa: E402

METHODS = ("asmnas", "darts", "sparsenas", "bayesnas", "darts2", "dsnas", "proxyless", "snas", "xnas")
#: figures every method's record has (docs/figures.md, "The built-in figures")
COMMON = {"scalars", "arch", "arch_evolution", "genotype", "wiring", "cost", "cost_std", "hessian"}
#: the figures of each method's own families (docs/figures.md and the method pages)
OWN = {
    "asmnas": {"attention", "attention_counts"},
    "sparsenas": {"sparsity_weights", "sparsity_evolution"},
    "bayesnas": {"bayes_gamma", "bayes_omega", "bayes_curvature", "bayes_switches"},
    "dsnas": {"sampling", "sample_counts"},
    "proxyless": {"sampling", "sample_counts"},
    "snas": {"sampling"},
    "xnas": {"regret_bound", "alive_experts", "wipeouts"},
}
SPECTRUM = "darts"  # the one run that records the top eigenvalue (its Lanczos dominates the run time)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from nasdiag.search import SearchConfig, run

    folder = tmp_path_factory.mktemp("runs")
    out = {}
    for method in METHODS:
        path = str(folder / f"{method}.h5")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DSNAS/ProxylessNAS: the cost of ops never sampled is NaN (recorded, warned)
            run(SearchConfig(method=method, C=2, layers=3, steps=2, epochs=2, batch_size=360, seed=0, device="cpu",
                             spectrum_every=2 if method == SPECTRUM else 0, record=path, progress=False, threads=1))
        out[method] = path
    return out


def _expected(method):
    return COMMON | OWN.get(method, set()) | ({"hessian_eigenvalue"} if method == SPECTRUM else set())


#: what each heatmap shows, from the record's row (p − 1/K, √Var, |A| are this file's transforms)
SHOWN = {
    "arch": lambda r, c, i: r[f"arch/{c}/probabilities"][i].astype(float) - 1.0 / r[f"arch/{c}/probabilities"].shape[-1],
    "cost": lambda r, c, i: r[f"cost/{c}/mean"][i],
    "cost_std": lambda r, c, i: np.sqrt(r[f"cost/{c}/var"][i].astype(float)),
    "hessian": lambda r, c, i: r[f"hessian/{c}/diag"][i],
    "attention": lambda r, c, i: r[f"attention/{c}/mean"][i],
    "attention_counts": lambda r, c, i: r[f"attention/{c}/count"][i],
    "sample_counts": lambda r, c, i: r[f"sample/{c}/count"][i],
    "sparsity_weights": lambda r, c, i: np.abs(r[f"arch/{c}/params"][i].astype(float)),
}


def _image_values(fig):
    """The heatmap's matrix as drawn, in the record's units (the colour bar's ``x 1e<p>`` undone)."""
    label = fig.axes[1].get_ylabel().replace("\n", " ")
    p = int(label.split("(x 1e")[1].split(")")[0]) if "(x 1e" in label else 0
    return np.ma.filled(fig.axes[0].images[0].get_array().astype(float), np.nan) * 10.0**p


def _check_heatmap(record, spec, cell, row, fig, method):
    ax = fig.axes[0]
    want = np.asarray(SHOWN[spec.name](record, cell, row), dtype=float)
    np.testing.assert_allclose(_image_values(fig), want, rtol=1e-6, atol=0, equal_nan=True, err_msg=f"{method} {spec.name}")
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(s) for s in record["meta/op_names"]], (method, spec.name)
    assert [t.get_text() for t in ax.get_yticklabels()] == [str(s) for s in record[f"meta/edge_names/{cell}"]]
    title = ax.get_title(loc="left").replace("\n", " ")
    step = int(record["step"][row])
    assert title.startswith(f"{cell} cell") and re.search(rf"\bsteps? (\d+-)?{step}\b", title), (method, spec.name, title)
    nan = int(np.isnan(want).sum())
    assert (f"{nan} NaN" in title) == bool(nan), (method, spec.name, title)  # NaN counted, never hidden
    assert fig.axes[1].get_ylabel().strip(), (method, spec.name)  # the colour bar says what it shows


@pytest.mark.slow
def test_every_method_draws_every_figure_its_docs_promise_with_the_records_names_and_rows(records):
    for method, path in records.items():
        record = load(path)
        drawn, skipped = set(), {}
        for spec, cell, _, thunk in iter_figures(record):
            try:
                fig = thunk()
            except NothingToDraw as exc:
                skipped[spec.name] = str(exc)
                continue
            try:
                assert fig.axes and any(ax.has_data() for ax in fig.axes), (method, spec.name)  # never an empty plot
                if spec.is_heatmap:
                    _check_heatmap(record, spec, cell, len(record["step"]) - 1, fig, method)
                elif cell is not None and spec.name not in ("genotype",):
                    text = " ".join([fig.get_suptitle()] + [ax.get_title(loc="left") for ax in fig.axes])
                    assert f"{cell} cell" in text, (method, spec.name, text)  # the cell drawn is named
                drawn.add(spec.name)
            finally:
                plt.close(fig)
        missing = _expected(method) - drawn
        if method == "xnas" and "wipeouts" in missing:  # skipped only with its true reason
            assert not any(np.asarray(v).any() for k, v in record.items() if k.startswith("regret/") and k.endswith("/wipeouts"))
            assert "wiped out yet" in skipped["wipeouts"]
            missing.discard("wipeouts")
        assert not missing, (method, missing, skipped)
        assert drawn <= _expected(method), (method, drawn - _expected(method))


@pytest.mark.slow
def test_the_comparison_of_two_methods_puts_each_op_in_one_column_of_every_panel(records, tmp_path):
    """DARTS's space has 8 ops, BayesNAS's 7 (no none): the panels were drawn each on its own columns, so
    skip_connect stood in column 1 of one panel and column 0 of the other, under one colour bar."""
    runs = {m: load(records[m]) for m in ("darts", "bayesnas")}
    drawn = write_comparison(runs, tmp_path, figures=["cost", "hessian"])
    assert len(drawn.files) == 4, drawn.skipped
    for spec in {s.name: s for s in drawn.specs.values()}.values():  # each redrawn as write_comparison draws it
        for cell in ("normal", "reduce"):
            panels = {m: spec.draw(r, cell, len(r["step"]) - 1) for m, r in runs.items()}
            fig = render_heatmaps(panels)
            try:
                axes = [ax for ax in fig.axes if ax.images]
                columns = [[t.get_text() for t in ax.get_xticklabels()] for ax in axes]
                assert columns[0] == columns[1], (spec.name, columns)
                for ax, (m, r) in zip(axes, runs.items()):
                    shown = np.ma.filled(ax.images[0].get_array().astype(float), np.nan)
                    ops = [str(s) for s in r["meta/op_names"]]
                    want = np.asarray(SHOWN[spec.name](r, cell, len(r["step"]) - 1), dtype=float)
                    scale = np.nanmax(np.abs(shown[:, [columns[0].index(o) for o in ops]])) / np.nanmax(np.abs(want))
                    for k, op in enumerate(ops):
                        np.testing.assert_allclose(shown[:, columns[0].index(op)], want[:, k] * scale, rtol=1e-5)
                    lacks = [o for o in columns[0] if o not in ops]
                    assert np.isnan(shown[:, [columns[0].index(o) for o in lacks]]).all()
                    title = ax.get_title(loc="left")
                    assert ("NaN" not in title) and (all(o in title for o in lacks)), title  # blank, said, not "NaN"
                    dashes = [t.get_position() for t in ax.texts if t.get_text() == "–"]
                    assert sorted(dashes) == sorted((columns[0].index(o), e) for o in lacks for e in range(shown.shape[0]))
                    assert not any(patch.get_hatch() for patch in ax.patches)  # not drawn as a NaN cell
            finally:
                plt.close(fig)


def _nasdiag(*args):
    env = dict(os.environ, MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-m", "nasdiag", *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_plot_at_a_step_and_the_report_through_the_cli_and_the_python_api(records, tmp_path):
    path = records["dsnas"]  # cost rows with NaN (ops never sampled), sample counts, two steps
    record = load(path)
    first, last = (int(s) for s in record["step"][[0, -1]])
    out = tmp_path / "figs"
    done = _nasdiag("plot", path, "--out", str(out), "--at", str(first))
    assert done.returncode == 0, done.stderr
    files = sorted(os.listdir(out))
    row_figures = {spec.filename(c) for spec, c, _, _ in iter_figures(record) if spec.rows}
    assert {f"{stem}_step{first}.png" for stem in row_figures} <= set(files), files
    # the files of --at FIRST hold that step's row: drawn in-process from the same tokens
    for spec, cell, label, thunk in iter_figures(record, at=str(first)):
        if spec.is_heatmap:
            fig = thunk()
            try:
                _check_heatmap(record, spec, cell, 0, fig, "dsnas")
            finally:
                plt.close(fig)
    late = _nasdiag("plot", path, "--out", str(tmp_path / "late"), "--at", str(last + 7))
    assert late.returncode == 2 and len(late.stderr.strip().splitlines()) == 1 and "Traceback" not in late.stderr
    assert not (tmp_path / "late").exists()

    stems = {p.stem for p in write_figures(path, tmp_path / "plain")}  # what `nasdiag plot` draws (run_plot calls the same)
    from nasdiag.plot.report import write_report

    for page in (tmp_path / "cli.html", tmp_path / "api.html"):
        if page.name == "cli.html":
            assert _nasdiag("report", path, "--out", str(page)).returncode == 0
        else:
            write_report(path, page)
        html = page.read_text()
        ids = re.findall(r"<figure id=\"([^\"]+)\"><img alt=\"[^\"]*\" src=\"data:image/png;base64,([^\"]+)\"", html)
        assert {i for i, _ in ids} == stems, (page.name, stems ^ {i for i, _ in ids})
        for _, data in ids:
            assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")
        for target in re.findall(r"href=\"#([^\"]+)\"", html):  # any in-page link lands on a figure
            assert f'id="{target}"' in html
        assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html


@pytest.mark.slow
def test_redrawing_a_real_record_gives_the_same_bytes(records, tmp_path):
    for method, figures in (("xnas", ["regret", "cost", "wiring"]), ("bayesnas", ["bayes_gamma", "hessian", "genotype"])):
        a = write_figures(records[method], tmp_path / f"{method}-a", figures=figures)
        b = write_figures(records[method], tmp_path / f"{method}-b", figures=figures)
        assert [p.name for p in a] == [p.name for p in b] and a
        for x, y in zip(a, b):
            assert x.read_bytes() == y.read_bytes(), x.name


def test_every_registered_figure_is_expected_of_some_method():
    """A figure registered for a family no method writes would go unchecked above."""
    every = set().union(COMMON, *OWN.values(), {"hessian_eigenvalue"})
    assert set(registered()) == every


def test_the_python_api_refuses_a_step_after_the_record_as_the_cli_does(tmp_path):
    """``write_figures(record, out, at="99")`` on a record ending at step 12 wrote ``cost_normal_heatmap_step99.png``
    holding step 12's row (the CLI refused it in one line); `write_comparison` likewise."""
    from nasdiag.plot.registry import PlotError
    from plot_records import write_record

    path = write_record(tmp_path / "run.h5", epochs=3, steps_per_epoch=4)
    last = int(load(path)["step"][-1])
    for at in (str(last + 87), f"init,{last + 1}", "0"):
        with pytest.raises(PlotError, match=r"--at .*record .*(ends|starts) at step"):
            write_figures(path, tmp_path / "figs", figures=["cost"], at=at)
        assert not (tmp_path / "figs").exists()
        runs = {"a": load(path), "b": load(path)}
        with pytest.raises(PlotError, match=r"(ends|starts) at step"):
            write_comparison(runs, tmp_path / "compare", figures=["cost"], at=at)
        assert not (tmp_path / "compare").exists()
    drawn = write_figures(path, tmp_path / "ok", figures=["cost"], at=str(last))  # the last step itself is drawn
    assert sorted(p.name for p in drawn) == [f"cost_{c}_heatmap_step{last}.png" for c in ("normal", "reduce")]


def test_the_arch_heatmap_of_a_record_with_only_mixing_weights_labels_its_colour_bar_z_as_its_title_does(tmp_path):
    """Records written before ``arch/<cell>/probabilities`` hold only the weights Z: the title said "mixing weight Z
    − 1/K" over a colour bar labelled "p − 1/K"."""
    from nasdiag.record import Recorder

    ops, edges = ["none", "skip_connect", "sep_conv_3x3"], ["0->2", "1->2"]
    z = np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])
    with Recorder(str(tmp_path / "old.h5"), meta={"op_names": ops, "edge_names": {"normal": edges}}) as rec:
        rec.log(1, {"arch/normal/weights": z})
    record = load(str(tmp_path / "old.h5"))
    (spec, cell, _, thunk), = [f for f in iter_figures(record, figures=["arch"])]
    fig = thunk()
    try:
        np.testing.assert_allclose(_image_values(fig), z - 1 / 3, rtol=1e-6)
        title, bar = fig.axes[0].get_title(loc="left"), fig.axes[1].get_ylabel().replace("\n", " ")
        assert "Z − 1/K" in title and bar.startswith("Z − 1/K"), (title, bar)
    finally:
        plt.close(fig)


def test_the_groups_docs_figures_names_for_figures_select_what_it_says():
    """docs/figures.md named `arch` and `cost` as groups of `--figures`; a figure of that name wins, so they select
    the one heatmap (not arch_evolution, genotype, wiring, cost_std). The page now says which names are groups."""
    from pathlib import Path

    from nasdiag.plot.registry import select

    text = Path(__file__).resolve().parents[1].joinpath("docs", "figures.md").read_text()
    line = next(x for x in text.split("\n- ") if x.startswith("`--figures`"))
    groups = re.findall(r"`(\w+)`", line.split("default all")[0])[1:]
    shadowed = re.findall(r"`(\w+)`", line.split("default all")[1].split("selects")[0])
    specs = registered()
    for group in groups:  # every figure of the group's families
        assert group not in specs and {s.name for s in select([group])} == {n for n, s in specs.items() if s.group == group}
    for name in shadowed:  # that figure only
        assert [s.name for s in select([name])] == [name] and any(s.group == name and n != name for n, s in specs.items())
