"""A fifteenth new user's misuse of the ``nasdiag`` CLI, armed with README.md and ``--help``: what rounds 1-14
(test_cli_errors.py, test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..14.py) did not
cover: ``nasdiag report`` of a record whose run was just resumed and is still locked by its live writer, its new
segment holding no row yet: the page said ``run.seg0001.h5: steps None–None`` (Python's None on the page); ``nasdiag
search --figs run.seg0001.h5`` (a figure folder named as a later segment of its own record) ran and drew there, and
then plot, report and --resume called the record damaged at that segment; so did ``nasdiag plot run.h5 --out
run.seg0001.h5`` and ``nasdiag report run.h5 --out run.seg0001.h5``; ``search --figs run.h5.tmp`` (or
run.h5.ckpt.tmp, where the record and checkpoint are built) ran, then its own --resume and --force were refused.

Checked and found right (not repeated as tests, run as a user in a shell): ``nasdiag methods`` with options it does
not take (--method, --hp, --no-progress: argparse's one line), with DARTS, darts=1, darts,snas, '' or -x (one line,
the near miss named), a method named twice (listed once); ``nasdiag search --method M --hp K=V`` for every method M
with a key K of another method (reward_bound, alpha_lr, tau0, optimizer, update_every, hessian_mode, fd_eps_scale:
one line naming the methods that take K); --engine fast with --device cpu, --norm layer/instance, --order
conv-bn-relu, --method dsnas/xnas/asmnas (runs; where the fast engine cannot apply, one warning line and eager, as
Network.set_engine documents); --dtype float16/bfloat16 (argparse's one line, the choices named); README's main-job
command with --epochs 0, --batch-size 0 or past the search split (one line before any file), --batch-size 1 (runs)
and 718 (a last batch of one sample: runs); ``plot`` and ``report`` of a record locked by a live writer, before and
after a resume (drawn, the page says a writer lock exists), and of its segment run.seg0001.h5 (one line naming the
record); --spectrum-every with --diagnostics cost or none (the eigenvalues recorded; asmnas and bayesnas refused in one
line); --hessian-mode with --diagnostics cost or none (one line: no effect); --hp given twice, W_LR, w_lr:0.1, --hp=K=V;
xnas --hp clip_rewards=yes/TRUE/no/off/0 (read as the bools they say); --device cuda, mps, CPU, cpu:0, gpu, '' (one
line); search --figs naming the record, checkpoint or lock (one line), plot --at with no heatmap chosen (one line).
Left alone: plot --out run.h5.lock (or .tmp, .ckpt.tmp) draws into a folder of that name, after which --resume is
refused in one line that says to move the folder away (not silent; the check would load torch for plot's
one-line errors); plot --dpi with svg/pdf of line figures only changes nothing; --dtype float16 suggests float64.
"""

from __future__ import annotations

import pytest

from nasdiag.cli import main
from nasdiag.record import Recorder
from test_cli_errors import TINY
from test_cli_plot_misuse import rec, refused, source  # noqa: F401 (fixtures)


def test_a_report_of_a_run_just_resumed_does_not_print_none_for_its_empty_segment(rec, tmp_path, capsys):
    """A resumed search opens run.seg0001.h5 at once and commits its first rows only at its first flush; a report
    meanwhile listed that segment as ``steps None–None``. It says the segment has no rows yet."""
    writer = Recorder(str(rec), resume=True, handle_sigterm=False)  # the live writer of the resumed run
    try:
        assert (tmp_path / "run.seg0001.h5").exists()
        page = tmp_path / "page.html"
        assert main(["report", str(rec), "--out", str(page), "--figures", "scalars"]) == 0
        capsys.readouterr()
        text = page.read_text()
    finally:
        writer.close()
    assert "None" not in text.split("segments and resumes", 1)[1].split("</tr>", 1)[0]
    assert "run.seg0001.h5: no rows yet" in text and "run.h5: steps 1–4" in text


@pytest.mark.parametrize("figs", ["run.seg0001.h5", "run.seg0002.h5/figs", "run.seg0001.h5.tmp"])
def test_a_search_figure_folder_named_as_a_segment_of_its_record_is_refused_before_the_run(figs, tmp_path, capsys):
    """``--figs run.seg0001.h5`` was checked against the record, its checkpoint and lock only: the search ran, drew
    into that folder, and plot, report and ``--resume`` then read the folder as the record's damaged segment 1."""
    refused(["search", *[a for a in TINY if a != "--no-figs"], "--out", tmp_path / "run.h5", "--figs", tmp_path / figs],
            tmp_path, ["the name of a later segment of the record", "pass another --figs"], capsys)


@pytest.mark.parametrize("command,out", [("plot", "run.seg0001.h5"), ("plot", "run.seg0003.h5/figs"),
                                         ("report", "run.seg0001.h5"), ("report", "run.seg0002.h5.tmp")])
def test_a_plot_or_report_out_named_as_a_segment_of_the_record_is_refused(command, out, rec, tmp_path, capsys):
    """``nasdiag plot run.h5 --out run.seg0001.h5`` drew its figures into a folder of that name and ``nasdiag report
    run.h5 --out run.seg0001.h5`` wrote its page there, exit 0: the record was then read as damaged at segment 1."""
    refused([command, rec, "--out", tmp_path / out], tmp_path, ["the name of a later segment of the record", "give"], capsys)


@pytest.mark.parametrize("figs", ["run.h5.tmp", "run.h5.ckpt.tmp/figs"])
def test_a_search_figure_folder_where_the_search_builds_a_file_is_refused_before_the_run(figs, tmp_path, capsys):
    """``--figs run.h5.tmp`` ran and drew there; ``--resume`` and ``--force`` of that run were then refused with
    "run.h5.tmp is a folder, where the search keeps a file next to the record"."""
    refused(["search", *[a for a in TINY if a != "--no-figs"], "--out", tmp_path / "run.h5", "--figs", tmp_path / figs],
            tmp_path, ["that the search writes", "pass another --figs"], capsys)
