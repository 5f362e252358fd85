"""Figures audit, round 19: heatmaps (cost, cost_std, hessian, arch, sample counts) and line figures (regret) of
records written here through the public `Recorder` with known values (negative and all-equal values, a single edge,
K = 1, cost rows at some epoch ends only), read back from the matplotlib artists (the image's array and norm, the
annotation texts, the tick labels, the titles) and compared cell by cell with this file's own expectation.

The references are the arrays logged here and this file's own arithmetic on them; nothing is computed by nasdiag.

Checked and found right (probes in the round's scratch, not kept as tests where earlier rounds cover them): cost, cost_std,
hessian, arch and sample_counts heatmaps of cells with negative values, all-equal values (hessian all −2: diverging
−2..2; all 3: sequential 3..4; cost_std all 2), one edge with K = 1 (arch p − 1/K = 0 on ±1, cost −0.3 on ±0.3), a
second cell type of other E, and values of 1e-6 (x 1e-6 on the bar) draw the logged (float32) numbers cell by cell, edges
down and ops across under the record's names (``op k`` where meta has none), annotated as logged; ``--at 6`` between
the cost rows of steps 4 and 8 draws step 4's and says so; the comparison of a 3-op and a 2-op run (hessian ≥ 0 in one,
signed in the other) puts both on one diverging scale spanning every run, the missing op blank and named; the
regret_bound and arch_evolution lines plot the logged numbers at the logged steps; ``nasdiag plot`` and ``report`` of
a record still being written draw its committed rows, the report saying it is being written.

Left alone: ``nasdiag plot`` of a record still being written does not say so (docs/figures.md promises it of the
report only); the comparison's panel of a cost map is titled with its row's step, not the steps it averages (the
single figure names them); a title wrapped at a hyphen splits "steps 5-8" over two lines.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402

from nasdiag.plot.style import plt  # noqa: E402
from nasdiag.record import load  # noqa: E402

from test_audit_figures_round8 import _heatmaps, _write  # noqa: E402

OPS = ["none", "skip_connect", "sep_conv_3x3"]
META = {"method": "darts", "op_names": OPS, "edge_names": {"normal": ["0->2", "1->2"], "reduce": ["0->2"]},
        "cell_types": ["normal", "reduce"]}


def test_a_cost_row_after_an_epoch_without_one_is_titled_with_its_own_epochs_steps(tmp_path):
    """The search resets the cost moments at every epoch end (``diagnostics()``: "statistics since the last call (then
    reset)"), so a cell type with no cost observation in epoch 0 (no ``cost/reduce/*`` row at its end, step 4) has a
    row at the end of epoch 1 (step 8) that averages steps 5-8. Its heatmap was titled "steps 1-8 (epoch 1)", two
    epochs, the first of which it holds nothing of (docs/figures.md: "titled with the steps and epoch it averages").
    Epoch 1 is steps 5-8 by this record's own layout (4 steps an epoch)."""
    cost = np.array([[-1.5, 0.25, 3.0], [2.0, -0.125, 0.0]], np.float32)
    rows = []
    for step in range(1, 9):
        row = {"scalars/train_loss": 1.0}
        if step % 4 == 0:  # the epoch end: scalars/epoch and the epoch's statistics
            row.update({"scalars/epoch": float(step // 4 - 1), "cost/normal/mean": cost * step,
                        "cost/normal/var": np.full_like(cost, 4.0)})
            if step == 8:
                row.update({"cost/reduce/mean": cost[:1] * -1, "cost/reduce/var": np.full_like(cost[:1], 0.25)})
        rows.append((step, row))
    maps = _heatmaps(load(_write(tmp_path / "c.h5", META, rows)), ["cost", "cost_std"], at="init,final")
    try:
        for (name, cell, label), (shown, texts, ax, fig) in maps.items():
            title = ax.get_title(loc="left").replace("\n", " ")
            last = 8 if cell == "reduce" or label == "final" else 4
            assert f"steps {last - 3}-{last} (epoch {last // 4 - 1})" in title, (name, cell, label, title)
            logged = (cost[:1] * -1 if cell == "reduce" else cost * last) if name == "cost" else \
                np.full((1 if cell == "reduce" else 2, 3), 0.5 if cell == "reduce" else 2.0)
            np.testing.assert_allclose(shown, logged, rtol=1e-6)
    finally:
        plt.close("all")
