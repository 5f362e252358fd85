"""A twelfth new user's misuse of the ``nasdiag`` CLI: what rounds 1-11 (test_cli_errors.py, test_cli_search_misuse.py,
test_cli_plot_misuse.py, test_cli_misuse_round3..11.py) did not cover: a figure folder (``search --figs``, ``plot
--out``) that already holds the user's own files named as figures (``scalars.png`` of another tool, a hand-edited
``cost_normal_heatmap_final.png``). They were replaced without a word. Every such mistake is one line on stderr, exit
code 2, no traceback, the folder left as it was; figures nasdiag drew itself are still redrawn in place. And the
progress bar of a search whose stderr is a file or a pipe (a batch job's log): one state per step before.

Checked and found right (not repeated as tests): --hp of the wrong type or shape per method (bayesnas hessian_mode
empty, hutchinson:0, update_every=0x10 past the run's steps; sparsenas options of the other optimizer), a batch size
past the search split, MPLBACKEND=foo or TkAgg for plot (Agg is used), OMP_NUM_THREADS=abc for search.
"""

from __future__ import annotations

import pytest

from nasdiag.cli import main
from test_cli_errors import TINY, snapshot
from test_cli_plot_misuse import rec, refused, source  # noqa: F401 (fixtures)

MINE = b"my own figure, drawn by hand\n"


@pytest.mark.parametrize("name,argv", [
    ("scalars.png", []),
    ("cost_normal_heatmap_final.png", ["--at", "final"]),
    ("scalars.svg", ["--format", "svg"]),
])
def test_plot_into_a_folder_of_the_users_own_figure_names_replaces_none(name, argv, rec, tmp_path, capsys):
    """``nasdiag plot run.h5 --out figs`` over a folder holding the user's ``figs/scalars.png`` replaced it with the
    record's scalars figure, exit 0."""
    figs = tmp_path / "figs"
    figs.mkdir()
    (figs / name).write_bytes(MINE)
    (figs / "notes.txt").write_bytes(MINE)
    refused(["plot", rec, "--out", figs, "--no-progress", *argv], tmp_path,
            [f"--out {figs} holds {name}", "not drawn by nasdiag", "move it away or give another --out"], capsys)
    assert (figs / name).read_bytes() == MINE


def test_plot_of_several_records_keeps_the_users_own_comparison_figure(rec, tmp_path, capsys):
    """With several records, ``<out>/compare`` holding a file of a comparison figure's name is refused before any
    record is drawn (it was replaced after every record folder had been drawn)."""
    other = tmp_path / "other.h5"
    other.write_bytes(rec.read_bytes())
    compare = tmp_path / "figs" / "compare"
    compare.mkdir(parents=True)
    (compare / "cost_normal_heatmap.png").write_bytes(MINE)
    refused(["plot", rec, other, "--out", tmp_path / "figs", "--no-progress"], tmp_path,
            ["the comparison folder", "cost_normal_heatmap.png", "not drawn by nasdiag"], capsys)


def test_plot_redraws_its_own_figures_in_place(rec, tmp_path, capsys):
    """The figures nasdiag drew are its own to redraw: plotting twice into one folder works and gives the same files."""
    figs = tmp_path / "figs"
    assert main(["plot", str(rec), "--out", str(figs), "--no-progress"]) == 0
    first = snapshot(figs)
    assert main(["plot", str(rec), "--out", str(figs), "--no-progress"]) == 0
    capsys.readouterr()
    assert snapshot(figs) == first and any(name.endswith(".png") for name in first)


@pytest.mark.parametrize("given", [True, False])
def test_a_search_whose_figure_folder_holds_the_users_own_figure_names_is_refused_before_it_runs(given, tmp_path, capsys):
    """``nasdiag search --figs shared`` (or the default ``<out>-figs``) over the user's own ``scalars.png`` ran the
    search and then replaced it with the run's figure; it is refused before anything is written."""
    figs = tmp_path / ("shared" if given else "run-figs")
    figs.mkdir()
    (figs / "scalars.png").write_bytes(MINE)
    argv = ["search", *[a for a in TINY if a != "--no-figs"], "--out", str(tmp_path / "run.h5")]
    argv += ["--figs", str(figs)] if given else []
    line = refused(argv, tmp_path, ["holds scalars.png", "not drawn by nasdiag", "give another --figs"], capsys)
    assert ("--no-figs" in line) is not given
    assert not (tmp_path / "run.h5").exists()


def test_the_progress_bar_into_a_log_file_is_a_few_ascii_states_not_one_per_step(tmp_path, capsys):
    """``nasdiag search ... 2> log`` (stderr not a terminal) wrote a bar state for up to every step (ten a second:
    megabytes an hour of carriage-return states) in block characters; into a file the bar is redrawn only at its
    start, at each epoch end and at its close (once a minute besides), in ASCII."""
    epochs = 2
    argv = ["search", *[a for a in TINY if a != "--no-progress"], "--out", str(tmp_path / "run.h5")]
    argv[argv.index("--epochs") + 1] = str(epochs)
    argv[argv.index("--batch-size") + 1] = "32"  # 22 steps an epoch: each a state of the bar before
    assert main(argv) == 0
    err = capsys.readouterr().err
    states = [s for s in err.replace("\n", "\r").split("\r") if "step" in s]
    assert states and "/44 " in states[-1], err
    assert len(states) <= epochs + 2, states  # the start, each epoch end, the close
    assert err.isascii(), err
