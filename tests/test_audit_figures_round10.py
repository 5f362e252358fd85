"""Figures audit, round 10: heatmaps of records written here through the public `Recorder` with known values (sample
counts of a long run, a resume that replays steps), read back from the matplotlib artists (the image's array, the
annotation texts, the colour bar's label, the tick labels).

The references are the arrays logged here and this file's own arithmetic on them; nothing is computed by nasdiag."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from nasdiag.plot.registry import iter_figures  # noqa: E402
from nasdiag.plot.style import plt  # noqa: E402
from nasdiag.record import load  # noqa: E402

from test_audit_figures_round8 import _heatmaps, _key_numbers, _write  # noqa: E402

OPS = ["none", "skip_connect", "sep_conv_3x3", "max_pool_3x3"]
EDGES = ["0->2", "1->2", "0->3"]
META = {"method": "dsnas", "op_names": OPS, "edge_names": {"normal": EDGES}, "cell_types": ["normal"]}


def _drawn(record, name, at=None):
    """{at label: (image array in the record's units, annotation texts, colour-bar label, axes)} of heatmap ``name``."""
    return {label: (shown, texts, fig.axes[1].get_ylabel().replace("\n", " "), ax)
            for (_, _, label), (shown, texts, ax, fig) in _heatmaps(record, [name], at=at).items()}


@pytest.mark.parametrize("path, name", [("sample/normal/count", "sample_counts"), ("attention/normal/count", "attention_counts")])
def test_sample_counts_of_a_run_of_thousands_of_steps_are_annotated_as_the_counts_they_are(tmp_path, path, name):
    """DSNAS samples one op per edge per step, so after some thousand steps the counts pass 1000. The heatmap scaled
    them by the largest (x 1e3 on the bar) and annotated 1247 as "1.25" and 3 as "3e-3"; at 10^4 steps 625 was "0.06"
    (600). The counts are integers and must read as such (docs: the annotations keep every value). ASM-NAS's argmax
    counts over a validation split of thousands of samples are the same case."""
    counts = np.array([[1247, 3, 0, 250], [625, 1000, 125, 2], [12470, 7, 30, 999]], np.int64)
    record = load(_write(tmp_path / "c.h5", META, [(13900, {path: counts})]))
    shown, texts, bar, ax = _drawn(record, name)[None]
    assert texts == [str(c) for c in counts.ravel()], texts  # row-major: edges down, ops across
    np.testing.assert_array_equal(shown, counts)  # the colour maps back to the count
    assert "(x 1e" not in bar, bar
    assert [t.get_text() for t in ax.get_yticklabels()] == EDGES
    assert [t.get_text() for t in ax.get_xticklabels()] == OPS


def test_heatmaps_at_a_step_a_resume_replayed_show_the_later_segments_row(tmp_path):
    """A resume that replays steps 6-10: `--at 8` and `final` draw the rows the resumed run wrote (cost 100 + step),
    never the replaced segment's (cost = step), and the title names the step."""
    def row(step, offset):
        m = np.full((len(EDGES), len(OPS)), offset + step, np.float32)
        m[0, 1] = -(offset + step)  # a signed map, and the first edge's second op tells rows from columns
        return {"cost/normal/mean": m}

    path = _write(tmp_path / "r.h5", META, [(s, row(s, 0)) for s in range(1, 11)])
    _write(path, META, [(s, row(s, 100)) for s in range(6, 13)], resume=True)
    drawn = _drawn(load(path), "cost", at="8,final")
    for label, step in (("step8", 8), ("final", 12)):
        shown, texts, _, ax = drawn[label]
        expected = np.full((len(EDGES), len(OPS)), 100.0 + step)
        expected[0, 1] = -(100.0 + step)
        np.testing.assert_array_equal(shown, expected)
        assert texts == [f"{v:.0f}" for v in expected.ravel()]
        assert f"step {step}" in ax.get_title(loc="left")
        norm = ax.images[0].norm
        assert norm.vmin == -norm.vmax and norm.vmax >= 100 + step  # diverging, centred on 0, every value in range


def test_the_reports_key_numbers_show_a_tiny_loss_as_its_value_not_zero(tmp_path):
    """The report printed every key number with four decimals: a search-val loss of 2.5e-5 (a run that fits its
    split) read "0.0000 (step 2)", a loss of exactly zero. The number must read back as the logged value to four
    significant digits; accuracies keep their four decimals."""
    loss = 2.5e-5
    from nasdiag.plot import write_report

    path = _write(tmp_path / "k.h5", META, [(1, {"scalars/search_val_loss": 0.5, "scalars/search_val_acc": 0.5}),
                                             (2, {"scalars/search_val_loss": loss, "scalars/search_val_acc": 0.96875})])
    logged = load(path)["scalars/search_val_loss"][-1]  # the record's float32
    write_report(path, tmp_path / "k.html", figures=["scalars"])
    numbers = _key_numbers((tmp_path / "k.html").read_text())
    text = numbers["search-val loss (epoch evaluation)"]
    value, rest = text.split(" ", 1)
    assert rest == "(step 2)" and float(value) == pytest.approx(float(logged), rel=5e-4), text
    assert numbers["search-val accuracy (epoch evaluation)"] == "0.9688 (step 2)"


def _visible_points(ax) -> set:
    """(x, y) of what the lines of ``ax`` draw: every point of a line of two or more points, or of a marker."""
    points = set()
    for line in ax.get_lines():
        x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
        if x.size >= 2 and line.get_linestyle() not in ("None", "", " ") or line.get_marker() not in (None, "None", "", " "):
            points |= {(float(a), round(float(b))) for a, b in zip(x, y) if np.isfinite(b)}
    return points


@pytest.mark.parametrize("path, name", [("regret/normal/alive", "alive_experts"), ("bayes/normal/switch", "bayes_switches")])
def test_ops_still_on_after_a_single_step_are_drawn_not_an_empty_plot(tmp_path, path, name):
    """A record of one step (an XNAS run stopped after its first α step, BayesNAS's first update): the step curve of
    each edge was one point without a marker, so the figure was empty axes (docs: no empty plot is drawn; the other
    line figures mark such a lone value with a dot)."""
    on = np.array([[True, True, False, True], [True, False, False, False], [True, True, True, True]])
    record = load(_write(tmp_path / "a.h5", META, [(5, {path: on})]))
    (thunk,) = [t for spec, cell, _, t in iter_figures(record, [name])]
    fig = thunk()
    try:
        assert _visible_points(fig.axes[0]) >= {(5.0, int(n)) for n in on.sum(-1)}
    finally:
        plt.close(fig)


def test_xnas_fig8_with_a_noise_free_sigma_places_every_sigma_apart_in_order(tmp_path, monkeypatch):
    """`scripts/xnas_statistical.py --sigma-grid 0,1,2` (σ_R = 0, the noise-free baseline, is accepted) drew the σ
    panels on a log x axis: 0 has no logarithm, matplotlib's limits then ran from ~0 to 2 and put σ = 1 and σ = 2 (and
    their tick labels) on top of each other at the right edge. Every σ of the grid must have its own place, in order."""
    import os
    import sys

    from matplotlib.figure import Figure

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))
    import xnas_statistical

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: saved.append(fig))
    xnas_statistical.main(["--out", str(tmp_path), "--runs", "2", "--steps", "5", "--n-grid", "2,4",
                           "--sigma-grid", "0,1,2", "--lr-multipliers", ""])
    (fig,) = saved
    for ax in fig.axes:
        if "σ" not in ax.get_xlabel() and "sigma" not in ax.get_xlabel():
            continue
        ticks = np.asarray(ax.get_xticks(), float)
        np.testing.assert_array_equal(ticks, [0.0, 1.0, 2.0])
        pixels = ax.transData.transform(np.c_[ticks, np.ones_like(ticks)])[:, 0]
        width = ax.bbox.width
        assert np.all(np.diff(pixels) > 0.1 * width), (ax.get_xscale(), pixels, width)  # apart, left to right
        assert np.all((pixels >= ax.bbox.x0 - 1) & (pixels <= ax.bbox.x1 + 1)), (pixels, ax.bbox)  # inside the axes
