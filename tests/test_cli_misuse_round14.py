"""A fourteenth new user's misuse of the ``nasdiag`` CLI, armed with README.md and ``--help``: what rounds 1-13
(test_cli_errors.py, test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..13.py) did not
cover: an output named as a file of another format (``report --out report.pdf`` wrote an HTML page under a PDF's
name, ``plot --out figs.pdf`` and ``search --figs figs.pdf`` a folder of png files so named, all exit 0 without a
word); ``--figures`` given a figure's file name (``cost_heatmap`` as README's image: "did you mean 'cost_std'?");
``report --figures`` of figures the record has none of (a page of no figure, exit 0) or without the genotype ("No
architecture rows" of a run that has them); ``plot`` of several records into a log (the bar's states ahead of each
error line) or with no heatmap chosen ("0 comparison figures in figs/compare", a folder not made); ``--resume
--epochs N`` of a finished run told to "pass --epochs 3 to finish it as started" (refused as finished); the exit codes
of an interrupted search documented nowhere. Every such mistake is one line on stderr saying what was wrong and what
to do, exit code 2, no traceback, nothing left behind.

Checked and found right (not repeated as tests, run as a user in a shell): ``nasdiag search`` stopped by SIGINT,
SIGTERM (at start-up, loading, the first epoch, mid-epoch, the evaluation) and SIGHUP (then exit 129, nothing said, the
lock left: as kill -9; since the lead's round-14 change, ended as SIGTERM is, tests/test_audit_lead_round13.py), then ``--resume``: every recorded array equal to an uninterrupted run's, bit for bit in
float64 (scalars, α, costs, Hessians); an interrupt before anything was recorded leaves no folder; ``--force`` over a
run killed by SIGHUP (its stale lock) runs; ``--resume`` with another --batch-size, --diagnostics, --hessian-mode,
--spectrum-every, --seed refused in one line naming the field, --threads/--device/--figs taken, --epochs below the
run's or equal to a finished run's refused; ``plot --at`` past the end (per record with several), before the first
cost row, between cost rows of a resumed record (the last row at or before it, as docs/figures.md says); --dpi
changes the rasterised heatmaps of pdf/svg figures too; ``plot --out`` of the record or its checkpoint refused;
--data-dir with digits/synthetic refused; --spectrum-every with --diagnostics none records the eigenvalues; no ANSI
colour anywhere (NO_COLOR, TERM=dumb need nothing); messages on stderr, results on stdout.
"""

from __future__ import annotations

import pytest

from nasdiag.cli import main
from test_cli_errors import refused
from test_cli_plot_misuse import rec, source  # noqa: F401 (fixtures)


@pytest.mark.parametrize("page,said", [("report.pdf", "--out report.html"), ("report.md", "--out report.html"),
                                       ("report.svg", "--format svg")])
def test_a_report_named_as_another_format_is_refused_not_written_as_html(page, said, rec, tmp_path, capsys):
    """``nasdiag report RUN.h5 --out report.pdf`` wrote the HTML page into report.pdf (exit 0): no PDF viewer opens
    it. The line says the page is HTML and gives the .html name."""
    out = tmp_path / page
    line = refused(["report", str(rec), "--out", str(out), "--figures", "scalars", "--dpi", "20"], tmp_path,
                   "writes an HTML page", capsys)
    assert said in line.replace(str(tmp_path) + "/", ""), line
    assert main(["report", str(rec), "--out", str(tmp_path / "report.html"), "--figures", "scalars", "--dpi", "20"]) == 0


@pytest.mark.parametrize("folder,fmt,said", [("figs.pdf", "png", "--format pdf"), ("figs.svg", "svg", "e.g. --out figs"),
                                             ("figs.html", "png", "nasdiag report")])
def test_a_figure_folder_named_as_a_file_is_refused(folder, fmt, said, rec, tmp_path, capsys):
    """``nasdiag plot RUN.h5 --out figs.pdf`` drew png files into a new folder named figs.pdf (exit 0, "1 figures in
    figs.pdf"), as if one PDF had been written. A folder of that name already there is the user's and is drawn into."""
    argv = ["plot", str(rec), "--out", str(tmp_path / folder), "--format", fmt, "--figures", "scalars", "--dpi", "20",
            "--no-progress"]
    line = refused(argv, tmp_path, "writes one", capsys)
    assert said in line.replace(str(tmp_path) + "/", ""), line
    (tmp_path / folder).mkdir()
    assert main(argv) == 0 and [p.suffix for p in (tmp_path / folder).iterdir()] == [f".{fmt}"]


@pytest.mark.parametrize("given,meant", [("cost_heatmap", "cost"), ("cost_normal_heatmap.png", "cost"),
                                         ("hessian_reduce_heatmap_final", "hessian"), ("arch_normal_evolution", "arch_evolution"),
                                         ("cost_normal_std", "cost_std")])
def test_a_figure_given_by_its_file_name_names_that_figure(given, meant, rec, tmp_path, capsys):
    """``--figures cost_heatmap`` (README's image cost_heatmap.png, the drawn cost_normal_heatmap.png) was "did you
    mean 'cost_std'?": another figure than the file's. The near miss is the figure that draws the file."""
    refused(["plot", str(rec), "--out", str(tmp_path / "figs"), "--no-progress", "--figures", given], tmp_path,
            f"(did you mean {meant!r} for {given!r}?)", capsys)


def test_a_report_of_figures_the_record_has_none_of_is_refused(rec, tmp_path, capsys):
    """``nasdiag report RUN.h5 --out r.html --figures bayes`` of a run without BayesNAS rows wrote a page without a
    figure (exit 0), where ``nasdiag plot --figures bayes`` refuses: one line, no page, no folder."""
    refused(["report", str(rec), "--out", str(tmp_path / "new" / "r.html"), "--figures", "bayes"], tmp_path,
            "holds nothing that --figures bayes draws", capsys)


def test_a_report_without_the_genotype_figure_does_not_say_the_run_has_no_architecture(rec, tmp_path, capsys):
    """``report --figures scalars`` said under "Genotype": "No architecture rows to derive a genotype from." of a
    record that has them (its key numbers give the genotype): the section is left out when the genotype is."""
    import h5py

    with h5py.File(rec, "r") as f:  # the fixture's record has architecture rows: a genotype can be derived
        assert "arch" in f
    page = tmp_path / "r.html"
    assert main(["report", str(rec), "--out", str(page), "--figures", "scalars", "--dpi", "20"]) == 0
    assert "No architecture rows" not in page.read_text()
    assert main(["report", str(rec), "--out", str(page), "--figures", "scalars,genotype", "--dpi", "20"]) == 0
    assert "<h2>Genotype</h2><figure" in page.read_text()


def test_plot_of_several_records_into_a_log_writes_each_skipped_record_on_a_line_of_its_own(rec, tmp_path, capsys):
    """``nasdiag plot a.h5 b.h5 missing.h5 --out figs 2> log``: the bar over records wrote its states (block
    characters, carriage returns) into the log ahead of "nasdiag: skipped missing.h5: ..." on the same line (round 12
    kept search's bar out of logs); off a terminal there is no bar, each line is itself."""
    import shutil

    other = shutil.copy(rec, tmp_path / "other.h5")
    code = main(["plot", str(rec), str(other), str(tmp_path / "missing.h5"), "--out", str(tmp_path / "figs"),
                 "--figures", "scalars", "--dpi", "20"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "\r" not in err and err.splitlines() == [line for line in err.splitlines() if line.startswith("nasdiag: ")], err
    assert len(err.splitlines()) == 1 and "missing.h5" in err, err


def test_extending_a_finished_run_does_not_say_to_finish_it_as_started(tmp_path, capsys):
    """``--resume --epochs 2`` of a finished 1-epoch run warned "pass --epochs 1 to finish it as started", which is
    refused as a run already finished; the warning says the run had finished."""
    from test_cli_errors import TINY

    out = str(tmp_path / "run.h5")
    assert main(["search", *TINY, "--out", out]) == 0
    capsys.readouterr()
    with pytest.warns(UserWarning, match=r"extends the run from 1 to 2 epochs \(it had finished;") as said:
        assert main(["search", *TINY, "--out", out, "--resume", "--epochs", "2"]) == 0
    assert not [w for w in said if "finish it as started" in str(w.message)], [str(w.message) for w in said]


def test_plot_of_several_records_without_a_heatmap_does_not_name_a_comparison_folder_it_did_not_make(rec, tmp_path,
                                                                                                     capsys):
    """``nasdiag plot a.h5 b.h5 --out figs --figures scalars`` ended "0 comparison figures in figs/compare", a folder
    that is not there; the line says no comparison figure is drawn and why (heatmaps are compared)."""
    import shutil

    other = shutil.copy(rec, tmp_path / "other.h5")
    assert main(["plot", str(rec), str(other), "--out", str(tmp_path / "figs"), "--figures", "scalars", "--dpi", "20"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert not (tmp_path / "figs" / "compare").exists()
    assert "/compare" not in last and "no comparison figure (heatmaps are compared" in last, last


def test_the_exit_codes_of_an_interrupted_search_are_in_its_help_and_the_readme(capsys):
    """A batch job around ``nasdiag search`` reads its exit code: 130 (Ctrl-C) and 143 (SIGTERM), with the line that
    gives the resume command, were in no --help nor in README (only 2 for a mistake)."""
    from pathlib import Path

    from nasdiag.cli import EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE

    with pytest.raises(SystemExit):
        main(["search", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    for text in (shown, readme):
        assert f"{EXIT_SIGINT}" in text and f"{EXIT_SIGTERM}" in text and f"{EXIT_USAGE}" in text
        assert "resumes" in text
    assert f"Ctrl-C (exit code {EXIT_SIGINT}), SIGTERM ({EXIT_SIGTERM})" in readme


def test_a_search_figure_folder_named_as_a_file_is_refused_before_the_run(tmp_path, capsys):
    """``nasdiag search ... --figs figs.pdf`` ran the search and drew png files into a new folder named figs.pdf, as
    ``plot --out figs.pdf`` did: refused in one line before any file."""
    from test_cli_errors import TINY

    argv = ["search", *[a for a in TINY if a != "--no-figs"], "--out", str(tmp_path / "run.h5")]
    line = refused([*argv, "--figs", str(tmp_path / "figs.pdf")], tmp_path, "the search draws one png file", capsys)
    assert "--format pdf" in line, line
