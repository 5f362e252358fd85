"""Figures audit, round 8: heatmaps of records built here through the public `Recorder` with known values (uniform
distributions of every K, 14 edges × 8 ops, one edge and one op, cell types with different E, a resume that replays
steps), read back from the matplotlib artists (the image's array and norm, the annotation texts, the tick labels).

The references are the arrays logged here, cast to the record's float32 with numpy, and this file's own arithmetic
on them; nothing is computed by nasdiag."""

from __future__ import annotations

import warnings

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from nasdiag.plot.registry import iter_figures  # noqa: E402
from nasdiag.plot.style import plt  # noqa: E402
from nasdiag.record import Recorder, RecordWarning, load  # noqa: E402


def _write(path, meta, rows, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        with Recorder(str(path), meta=meta, flush_seconds=None, **kwargs) as rec:
            for step, row in rows:
                rec.log(step, row)
    return str(path)


def _heatmaps(record, names, at=None):
    """{(figure name, cell, at label): (image array in the record's units, annotation texts, axes, figure)} of the heatmaps."""
    out = {}
    for spec, cell, label, thunk in iter_figures(record, names, at=at):
        fig = thunk()
        bar = fig.axes[1].get_ylabel().replace("\n", " ")
        p = int(bar.split("(x 1e")[1].split(")")[0]) if "(x 1e" in bar else 0
        ax = fig.axes[0]
        shown = np.ma.filled(ax.images[0].get_array().astype(float), np.nan) * 10.0**p
        out[spec.name, cell, label] = shown, [t.get_text() for t in ax.texts], ax, fig
    return out


@pytest.mark.parametrize("K", [3, 5, 6, 7])
def test_a_uniform_distribution_is_drawn_as_no_deviation_from_uniform_whatever_k(tmp_path, K):
    """A search that has not moved (α = 0: p = 1/K, what DSNAS's fixed-α runs and every search's first step log) is
    stored in float32, where 1/K (K = 3, 5, 6, 7) is not exact: 1/3 is 0.33333334. The arch heatmap showed
    p − 1/K = +9.9e-9 in every cell, "(x 1e-9)" on the bar and every cell in the darkest red, i.e. every op above
    uniform (impossible: the deviations of a distribution sum to 0). The docs: "a flat map means the search has
    not moved"."""
    E = 2
    uniform = np.full((E, K), 1.0 / K, np.float32)  # what softmax(0) is in float32
    moved = uniform.copy()
    moved[0] = np.float32(0.5) / (K - 1)
    moved[0, 0] = np.float32(0.5)  # a moved edge: the deviation is its own arithmetic, not snapped
    meta = {"method": "darts", "op_names": [f"op{k}" for k in range(K)], "edge_names": {"normal": ["0->2", "1->2"]},
            "cell_types": ["normal"]}
    record = load(_write(tmp_path / "u.h5", meta, [(1, {"arch/normal/probabilities": uniform}),
                                                   (2, {"arch/normal/probabilities": moved})]))
    maps = _heatmaps(record, ["arch"], at="init,final")
    first, texts, _, fig = maps["arch", "normal", "init"]
    last, _, _, fig2 = maps["arch", "normal", "final"]
    try:
        np.testing.assert_array_equal(first, np.zeros((E, K)))
        assert set(texts) == {"0"}
        want = moved.astype(float) - 1.0 / K
        want[1] = 0.0  # the edge that stayed uniform
        np.testing.assert_allclose(last, want, rtol=1e-12, atol=0)
    finally:
        plt.close(fig)
        plt.close(fig2)


def _key_numbers(page: str) -> dict:
    """{label: text} of the report's "Key numbers" table, parsed here with the standard library."""
    from html.parser import HTMLParser

    table = page.split("<h2>Key numbers</h2>", 1)[1].split("</table>", 1)[0]
    cells: list = []

    class Cells(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag in ("th", "td"):
                cells.append("")

        def handle_data(self, data):
            if cells:
                cells[-1] += data

    Cells().feed(table)
    return dict(zip(cells[::2], cells[1::2]))


def test_the_reports_final_accuracy_of_a_run_that_diverged_is_nan_not_an_earlier_value(tmp_path):
    """The key numbers are the run's final accuracies ("final accuracies", docs/figures.md). A search whose last epoch
    evaluation was NaN (it diverged) was reported as "0.7500 (step 8)", the last finite value, and a quantity NaN in
    every row was left out of the table: the page hid the NaN. Each number must equal load()'s last logged value."""
    from nasdiag.plot.report import build_report

    meta = {"method": "darts", "op_names": ["a", "b"], "edge_names": {"normal": ["0->2", "1->2"]}, "cell_types": ["normal"]}
    rows = [(4, {"scalars/search_val_acc": 0.5, "scalars/train_acc": 0.25, "scalars/val_acc": np.nan}),
            (8, {"scalars/search_val_acc": 0.75, "scalars/train_acc": 0.375, "scalars/val_acc": np.nan}),
            (12, {"scalars/search_val_acc": np.nan, "scalars/train_acc": 0.625, "scalars/val_acc": np.nan})]
    path = _write(tmp_path / "diverged.h5", meta, rows)
    record = load(path)
    numbers = _key_numbers(build_report(path, figures=["scalars"]))

    def last(name):
        return int(record["step"][-1]), float(record[f"scalars/{name}"][-1])

    assert np.isnan(last("search_val_acc")[1])  # the reference: what load() says the run ended with
    acc = numbers["search-val accuracy (epoch evaluation)"]
    assert acc.startswith("NaN (step 12") and "0.7500" in acc and "step 8" in acc, acc
    assert numbers["train accuracy (last w step's batch)"] == f"{last('train_acc')[1]:.4f} (step 12)"
    assert numbers["val accuracy (last α step's batch)"].startswith("NaN (step 12"), numbers


def test_wiring_output_cost_marks_the_nan_means_of_an_epoch_with_no_wrong_sample(tmp_path, monkeypatch):
    """scripts/wiring_output_cost.py logs the means over the wrongly classified samples as NaN when there are none
    (100 % train accuracy, common on digits); Figs 14-16 drew them with ``ax.plot``, a silent gap. docs/figures.md:
    "NaN and ±inf are drawn, never hidden. Line plots mark each non-finite step at the axes edge ... with legend
    entries"."""
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))
    import wiring_output_cost

    import nasdiag.plot.registry as registry

    epochs = [-1, 0, 1, 2]
    rows = []
    for i, epoch in enumerate(epochs):
        row = {"scalars/epoch": float(epoch)}
        for split in ("train", "search"):
            for part in ("", "_correct", "_wrong"):
                wrong_and_none = part == "_wrong" and split == "train" and epoch == 2  # every sample right
                for q, v in (("cz", -0.1 * i), ("loss", 1.0 / (i + 1)), ("entropy", 0.5 / (i + 1))):
                    row[f"scalars/{q}_{split}{part}"] = np.nan if wrong_and_none else v
        rows.append((i + 1, row))
    path = _write(tmp_path / "record.h5", {"method": "fixed_architecture"}, rows)
    figures = []
    monkeypatch.setattr(registry, "save", lambda fig, p, dpi: figures.append((os.path.basename(p), fig)))
    wiring_output_cost.draw(path, str(tmp_path), "png")
    fig = dict(figures)["fig14_16.png"]
    try:
        marked = set()  # (title of the panel, x of each NaN mark)
        for ax in fig.axes:
            for line in ax.get_lines():
                if line.get_marker() == "X" and len(line.get_xdata()):
                    marked |= {(ax.get_title(loc="left"), float(x)) for x in line.get_xdata()}
        # the three quantities of the train/wrong panel at epoch 2 (L, H on the axes, C_Z on its twin, untitled)
        assert {x for _, x in marked} == {2.0}, marked  # the epoch of the NaN means, nothing else
        # one mark on the train/wrong panel's axes (L_θ and H_θ) and one on its twin (C_Z, untitled)
        assert sorted(title for title, _ in marked) == ["", "search-train set (θ's data): wrongly classified"], marked
        labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
        assert "NaN" in labels, labels
    finally:
        plt.close(fig)
        for _, other in figures:
            plt.close(other)


def test_a_minus_inf_variance_is_a_hatched_minus_inf_cell_of_the_cost_std_map_not_zero(tmp_path):
    """docs/figures.md: heatmaps fill non-finite cells with a hatch and count them in the title, and `nasdiag plot`
    reports the NaN/inf of the drawn families. The cost_std map clipped Var[C] at 0 before √, so a −inf variance was
    drawn as a plain "0" cell (the value of an op with no spread), uncounted, while the plot line reported a −inf."""
    meta = {"method": "darts", "op_names": ["a", "b", "c"], "edge_names": {"normal": ["0->2", "1->2"]},
            "cell_types": ["normal"]}
    var = np.array([[0.25, 4.0, 1.0], [-np.inf, np.inf, np.nan]], np.float32)
    record = load(_write(tmp_path / "v.h5", meta, [(1, {"cost/normal/var": var})]))
    shown, texts, ax, fig = _heatmaps(record, ["cost_std"])["cost_std", "normal", None]
    try:
        np.testing.assert_array_equal(shown[0], [0.5, 2.0, 1.0])  # √ of exact binary fractions
        assert texts[3:] == ["-inf", "inf", "NaN"], texts
        hatches = sorted(p.get_hatch() for p in ax.patches if p.get_hatch())
        assert hatches == sorted(["xxx", "///", "\\\\\\"]), hatches
        assert "1 −inf" in ax.get_title(loc="left"), ax.get_title(loc="left")
    finally:
        plt.close(fig)


@pytest.mark.parametrize("fmt", ["pdf", "svg"])
def test_pdf_and_svg_figures_have_the_fonts_of_the_paper_style(tmp_path, fmt):
    """nasdiag.plot.style.RC (the paper style) sets pdf.fonttype 42 and svg.fonttype none: TrueType fonts in a PDF
    (journal checks such as IEEE PDF eXpress refuse Type 3 fonts) and editable text in an SVG. matplotlib reads both
    when the file is written, and `nasdiag plot` / `write_figures` wrote outside the style: every PDF had Type 3
    fonts and every SVG its text as glyph paths."""
    import re
    import xml.etree.ElementTree as ET

    from nasdiag.plot import write_figures

    meta = {"method": "darts", "op_names": ["skip_connect", "sep_conv_3x3"], "edge_names": {"normal": ["0->2", "1->2"]},
            "cell_types": ["normal"]}
    path = _write(tmp_path / "f.h5", meta, [(1, {"cost/normal/mean": np.array([[0.5, -0.25], [0.125, 1.0]], np.float32)})])
    (figure,) = write_figures(path, tmp_path / "figs", fmt=fmt, figures=["cost"])
    data = figure.read_bytes()
    if fmt == "pdf":
        subtypes = set(re.findall(rb"/Subtype\s*/(\w+)", data))
        assert b"Type3" not in subtypes and {b"Type0", b"CIDFontType2"} <= subtypes, subtypes  # Type 42 = CIDFontType2
    else:
        texts = {"".join(el.itertext()).strip() for el in ET.fromstring(data).iter("{http://www.w3.org/2000/svg}text")}
        assert {"skip_connect", "sep_conv_3x3", "0->2", "1->2", "0.50", "-0.25"} <= texts, texts


def test_the_wiring_figure_draws_each_row_once_and_names_an_epoch_it_could_not_draw(tmp_path):
    """An epoch whose arch row holds a NaN fell back to the previous epoch's row: the wiring figure drew "epoch 1" twice
    and nothing said epoch 2 was missing; its title also explained abbreviations of DARTS ops (sep3 = sep_conv_3x3,
    max3 = max_pool_3x3) that a record of other ops does not have."""
    ops, edges = ["none", "conv_a", "skip_connect"], ["0->2", "1->2", "0->3", "1->3", "2->3"]
    meta = {"method": "darts", "op_names": ops, "edge_names": {"normal": edges}, "cell_types": ["normal"]}
    rows = []
    for epoch in range(4):
        p = np.full((5, 3), 0.1, np.float32)
        p[:, 1 + epoch % 2] = 0.8  # conv_a on even epochs, skip_connect on odd ones
        if epoch == 2:
            p[0, 0] = np.nan
        rows.append((epoch + 1, {"scalars/epoch": float(epoch), "arch/normal/probabilities": p}))
    record = load(_write(tmp_path / "w.h5", meta, rows))
    ((spec, cell, _, thunk),) = list(iter_figures(record, ["wiring"]))
    fig = thunk()
    try:
        titles = [ax.get_title(loc="left") for ax in fig.axes if ax.get_title(loc="left")]
        assert titles == ["epoch 0 (step 1)", "epoch 1 (step 2)", "epoch 3 (step 4)"], titles
        for ax, want in zip(fig.axes, ["conv_a", "skip", "skip"]):  # the argmax op on every edge of the panel's row
            assert [t.get_text() for t in ax.texts][:5] == [want] * 5
        title = fig._suptitle.get_text().replace("\n", " ")
        assert "step 3" in title and "NaN" in title, title
        assert "sep_conv_3x3" not in title and "max_pool_3x3" not in title and "skip = skip_connect" in title, title
    finally:
        plt.close(fig)


def test_the_report_counts_a_resume_in_the_same_process_that_replayed_steps(tmp_path):
    """A record resumed from a checkpoint in the same process (``Recorder(path, resume=True)`` in a notebook) replays
    steps 6-10 in a second segment; the report said "2 segment(s), 0 resume(s)" next to the segments' own step
    ranges (steps 1-10, steps 6-12), and its rows must be load()'s: 12 rows, the replayed steps once."""
    from nasdiag.plot.report import build_report

    meta = {"method": "darts"}
    path = _write(tmp_path / "r.h5", meta, [(s, {"scalars/train_loss": float(s)}) for s in range(1, 11)])
    _write(path, meta, [(s, {"scalars/train_loss": 100.0 + s}) for s in range(6, 13)], resume=True)
    record = load(path)
    page = build_report(path, figures=["scalars"])
    assert "2 segment(s), 1 resume(s)" in page
    assert list(record["step"]) == list(range(1, 13)) and float(record["scalars/train_loss"][6]) == 107.0  # later wins
    assert "<th>rows</th><td>12 (steps 1–12)</td>" in page
