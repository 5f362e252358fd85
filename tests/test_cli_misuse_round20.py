"""A twentieth new user's misuse of the ``nasdiag`` CLI, armed with README.md and ``--help``: what rounds 1-19
(test_cli_errors.py, test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..19.py,
test_scripts_misuse_round14.py) did not cover: an option of ``nasdiag search`` given as a method hyperparameter
(``--hp seed=3``, ``--hp epochs=2``, ``--hp batch_size=32``) was refused with the method's keys listed and no word of
the option meant, and ``--hp hessian_mode=ggn`` of darts sent the user to ``--method bayesnas`` (whose own curvature
it sets) where ``--hessian-mode ggn`` (the recorded diagnostics' mode) was meant; ``nasdiag search --out mine.h5`` over
a record of the user's own loop (Recorder, no search settings) said to pass --resume or --force, each then refused;
``nasdiag report run.h5 --out r.html --format pdf`` (plot's option) was told report takes one record, run it once per
record (the value pdf taken for a second record), and an option of another command was only 'unrecognized';
``nasdiag plot runs/*.h5`` where the shell matched no file said "no record at runs/*.h5", as of a missing file so named;
a current folder removed while a search or plot ran (relative --out) ended in "No such file or directory (figs)";
``nasdiag plot run.h5 -o figs`` was told to write ./-o if -o is a file; ``--hp init_gamma=1e-300`` (range > 0) ran as
float32's 0: BayesNAS pruned every op, exit code 0 (XNAS's float64 forecaster values, reward_bound=1e-300, still run);
``--force --no-figs`` (or another --figs) left the replaced run's figures in run-figs/, which README says --force removes;
a command copied from a rendered page (``—epochs 2``, ``--hp w_lr=3e−4``: an em dash, a minus sign) was refused in a line
whose wrong character could not be seen ("must be of type float, got '3e−4'"), and ``--out “run.h5”`` (quotes a shell
keeps) wrote a record so named, exit code 0; ``--resume`` without a readable checkpoint said only "start again with
--force", which replaces the record; ``nasdiag search --out run.h5`` while another search writes run.h5 said to pass
--resume or --force, each refused while it writes; plot and report of a record of no row left by a search killed
before its first flush said "no committed rows yet", as of a run still starting.
Every such mistake is one line on stderr saying what was wrong and what to do, exit code 2, no traceback, nothing left
behind.

Checked and found right (not repeated as tests, run as a user in a shell): every method's documented hyperparameters
out of range (tau0=0, tau_decay=0, tau_min above tau0, w_momentum=1.5, w_lr=-1, alpha_betas=1,0.9 or one value,
zeta=0, reward_bound=-1/0, lambda_w=0, init_gamma=0, update_every=-1 or past the run, hessian_mode=bogus/hutchinson:0,
optimizer=HAPG, sgl_alpha=2, lambda_step=-1, attention_hidden=0, a SparseNAS key its optimizer does not use, values past
float32): one line each; the --help contract: --seed 99999999999999 runs, --spectrum-every 3 records the eigenvalues at
steps 3 and 6 of 8, --hessian-mode approx ends in the record's config and gives one value to the ops of an edge that end in BatchNorm
(skip_connect of an intermediate node apart, as --help says),
--diagnostics cost/hessian/none record only those families (BayesNAS's hessian/<cell>/nonfinite on its update rows, as
docs/schema.md says), report --dpi 15/300 sizes the inlined images, plot --at init draws each family's first row, the
figures of every method's record are those of its recorded families and its report is written; --device cuda, cuda:7,
cuda:-1, mps and ' cpu' (one line), CUDA_VISIBLE_DEVICES='' (auto is the CPU), OMP_NUM_THREADS=0 (runs), --threads past
the CPUs (one line), MPLBACKEND=bogus or TkAgg (plot draws); plot of a record given twice (also as ./run.h5), a folder,
two records of one name in two folders (two figure folders); --resume with the checkpoint of another run (the seed
named), of a record behind its checkpoint (refused), of a diverged run (replays to the same stop, writes nothing); a
search with an absolute --out whose current folder is removed mid-run (runs to its end).

Left alone: --threads is bounded by the machine's CPUs (os.cpu_count), its default by the usable ones (taskset -c 0
takes --threads 2): the batch scripts bound it alike and round 4's test pins the line; a checkpoint restored from an
earlier session of a run extended since replays the later steps under the new schedule, while the record keeps their
rows of the old one (a file replaced by hand); --method darts,snas is "unknown method", with no word of one method per
search; plot's "skipped ..." lines carry no "nasdiag:" prefix; a DARTS step whose training loss is NaN (w_lr=1e30) is
recorded and the epoch goes on to its search-val check, where SNAS stops at the step (the methods' area); a darts2
search's record gains a segment at its first epoch end (a path first logged then: SWMR cannot add datasets).
"""

from __future__ import annotations

import os

import pytest

from test_cli_errors import TINY, snapshot


@pytest.mark.parametrize("method,item,meant", [("darts", "seed=3", "--seed 3"), ("darts", "hessian_mode=ggn", "--hessian-mode ggn"),
                                               ("snas", "batch_size=32", "--batch-size 32"), ("bayesnas", "epochs=2", "--epochs 2"),
                                               ("xnas", "resume=yes", "--resume, a flag")])
def test_an_option_of_the_search_given_as_a_hyperparameter_names_the_option(method, item, meant, tmp_path, capsys):
    """``--hp seed=3`` was "unknown hyperparameter 'seed' for method 'darts'; valid keys: w_lr, ...", no word of --seed;
    ``--hp hessian_mode=ggn`` of darts said "it is a hyperparameter of bayesnas (--method bayesnas)": another method,
    where the option --hessian-mode was meant. The line names the option and how to give it, before any file."""
    from nasdiag.cli import main

    before = snapshot(tmp_path)
    code = main(["search", *TINY, "--method", method, "--hp", item, "--out", str(tmp_path / "run.h5")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    key = item.partition("=")[0]
    assert f"{key} is an option of nasdiag search" in err[0] and f"give it as {meant}" in err[0], err
    assert err[0].find("--method") == -1 or err[0].find("--method") > err[0].find(meant), err  # the option first
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flag", [[], ["--resume"], ["--force"]])
def test_a_record_of_another_program_at_out_is_not_offered_resume_or_force(flag, tmp_path, capsys):
    """``nasdiag search --out mine.h5`` over a record a user's own loop wrote (nasdiag.record.Recorder, no search
    settings) said "a record already exists at mine.h5; pass --resume to continue it or --force to replace it"; each
    was then refused ("a search can neither continue it nor replace it, not even with --force"). Every form of the
    command says so at once, and the record is untouched."""
    from nasdiag.cli import main
    from nasdiag.record import Recorder

    mine = tmp_path / "mine.h5"
    with Recorder(str(mine)) as rec:
        for step in (1, 2):
            rec.log(step, {"scalars/loss": 1.0 / step})
    before = snapshot(tmp_path)
    code = main(["search", *TINY, "--out", str(mine), *flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "was written by another program" in err[0] and "choose another --out" in err[0], err
    assert "pass --resume" not in err[0] and "pass --force" not in err[0], err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("argv,other", [
    (["report", "run.h5", "--out", "r.html", "--format", "pdf"], "--format is an option of nasdiag plot, not of nasdiag report"),
    (["report", "run.h5", "--out", "r.html", "--at", "final"], "--at is an option of nasdiag plot, not of nasdiag report"),
    (["search", "--figures", "cost", "--out", "run.h5"], "--figures is an option of nasdiag plot and nasdiag report"),
    (["plot", "run.h5", "--out", "figs", "--epochs", "3"], "--epochs is an option of nasdiag search, not of nasdiag plot"),
])
def test_an_option_of_another_command_is_named_so_not_taken_for_a_record(argv, other, tmp_path, monkeypatch, capsys):
    """``nasdiag report run.h5 --out r.html --format pdf`` (plot's option, as its --help names it) was told "report writes
    the page of one record: run it once per record, or draw several side by side with nasdiag plot RECORD RECORD ...":
    the value pdf taken for a second record, when one was given; ``search --figures cost`` and ``plot --epochs 3`` were
    only 'unrecognized'. The line names the command that takes the option."""
    from nasdiag.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "unrecognized arguments" in err[0] and other in err[0], err
    assert "once per record" not in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["plot", "runs/*.h5", "--out", "figs"], ["report", "runs/r?.h5", "--out", "r.html"]])
def test_a_pattern_that_matched_no_record_is_said_to_be_one(command, tmp_path, monkeypatch, capsys):
    """``nasdiag plot runs/*.h5 --out figs`` where the shell matched no file (it passes the pattern on unexpanded) said
    "no record at runs/*.h5 (no file runs/*.h5 and no segments next to it)", as if a file of that name were missing.
    The line says no file matches the pattern and where to look; nothing is made."""
    from nasdiag.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("not a record")
    before = snapshot(tmp_path)
    code = main(command)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"no file matches {command[1]}" in err[0] and "the folder runs" in err[0], err
    assert snapshot(tmp_path) == before


def _removing_the_current_folder(function):
    """``function`` that first removes the current folder (another shell's ``rm -r`` of it, mid-command)."""
    import shutil

    def removed_first(*args, **kwargs):
        shutil.rmtree(os.getcwd())
        return function(*args, **kwargs)

    return removed_first


@pytest.mark.parametrize("command", ["search", "plot"])
def test_a_current_folder_removed_while_the_command_runs_is_named(command, tmp_path, monkeypatch, capsys):
    """A search recording to a relative --out whose current folder another shell removed mid-run ended "cannot create
    record segment run.h5: No such file or directory; the 4 buffered rows are not written yet", and plot drawing into a
    relative --out "No such file or directory (figs)": a path that looked right, no word of the folder, no way out
    (round 16 covered a folder removed before the command started). The line says the folder was removed."""
    from nasdiag import cli
    from nasdiag.plot import registry
    from nasdiag.search import runner

    work = tmp_path / "work"
    work.mkdir()
    record = tmp_path / "earlier.h5"
    if command == "plot":
        assert cli.main(["search", *TINY, "--out", str(record)]) == 0
        monkeypatch.setattr(registry, "draw_record", _removing_the_current_folder(registry.draw_record))
        argv = ["plot", str(record), "--out", "figs"]
    else:
        monkeypatch.setattr(runner, "search_loop", _removing_the_current_folder(runner.search_loop))
        argv = ["search", *TINY, "--out", "run.h5"]
    monkeypatch.chdir(work)
    capsys.readouterr()
    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "the current folder was removed while the command ran" in err[0] and "cd to a folder that exists" in err[0], err
    assert not work.exists()


@pytest.mark.parametrize("argv,meant", [(["plot", "run.h5", "-o", "figs"], "did you mean --out for -o?"),
                                        (["report", "run.h5", "-o", "r.html"], "did you mean --out for -o?"),
                                        (["plot", "run.h5", "--out", "figs", "-a", "3"], "did you mean --at for -a?")])
def test_a_one_letter_option_is_pointed_at_its_long_form(argv, meant, tmp_path, monkeypatch, capsys):
    """``nasdiag plot run.h5 -o figs`` (the -o of other tools) said "the following arguments are required: --out; -o
    begins with - and is read as an option: if it is a file, write ./-o": a file named -o. The line names --out."""
    from nasdiag.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert meant in err[0] and "./-" not in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("method,item", [("bayesnas", "init_gamma=1e-300"), ("snas", "tau0=1e-300")])
def test_a_positive_hyperparameter_the_run_dtype_rounds_to_zero_is_refused(method, item, tmp_path, capsys):
    """``--hp init_gamma=1e-300`` passed the range check (> 0) as a Python float and ran as 0 in float32: BayesNAS pruned
    every op, exit code 0 with an empty genotype and NaN omegas; ``--hp tau0=1e-300`` divided SNAS's logits by 0 (a NaN
    loss at the first step, "lower the learning rates"). The run's dtype is what holds the value: refused in one line
    before any file, as a value past its largest (round 8) is."""
    import numpy as np

    from nasdiag.cli import main

    assert np.float32(float(item.partition("=")[2])) == 0  # the premise: float32 holds it as 0, out of the range > 0
    before = snapshot(tmp_path)
    code = main(["search", *TINY, "--method", method, "--hp", item, "--out", str(tmp_path / "run.h5")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"hyperparameter {item} of method {method!r} is so small that float32 rounds it to 0" in err[0], err
    assert "--dtype float64" in err[0], err
    assert snapshot(tmp_path) == before


def test_force_removes_the_figures_of_the_run_it_replaces_when_the_new_run_draws_none_there(tmp_path, monkeypatch, capsys):
    """README: "--force replaces a record and the leftover files of its run, the figures it drew included". Only the
    figures in the new run's own figure folder were: with --no-figs (or another --figs) the replaced run's figures
    stayed in run-figs/ next to the new record, as if of its run. They go (a file of the user's there stays)."""
    from nasdiag.cli import main

    monkeypatch.chdir(tmp_path)
    with_figures = [a for a in TINY if a != "--no-figs"]
    assert main(["search", *with_figures, "--out", "run.h5"]) == 0
    drawn = sorted(p.name for p in (tmp_path / "run-figs").iterdir())
    assert "scalars.png" in drawn, drawn
    (tmp_path / "run-figs" / "notes.txt").write_text("mine")
    assert main(["search", *TINY, "--seed", "1", "--out", "run.h5", "--force"]) == 0  # TINY: --no-figs
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "run-figs").iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("given,typed", [(["search", "--hp", "w_lr=3e\u22124"], "type 3e-4"),
                                         (["search", "\u2014epochs", "2"], "type --epochs"),
                                         (["search", "\u2013epochs", "2"], "type --epochs"),
                                         (["search", "--seed", "\u22121"], "type -1"),
                                         (["search", "--hp", "alpha_betas=0.5,\u22120.9"], "type 0.5,-0.9"),
                                         (["plot", "run.h5", "\u2014out", "figs"], "type --out")])
def test_a_typographic_dash_copied_from_a_page_is_named(given, typed, tmp_path, monkeypatch, capsys):
    """A command copied from a rendered page or a word processor carries its dashes: ``—epochs 2`` (em dash for --) was
    "unrecognized arguments: '—epochs' 2", ``plot run.h5 —out figs`` "the following arguments are required: --out" (given,
    to the eye), ``--hp w_lr=3e−4`` (a minus sign) "must be of type float, got '3e−4'": what was wrong could not be
    seen. The line names the character and the text to type."""
    from nasdiag.cli import main

    monkeypatch.chdir(tmp_path)
    argv = [*given, "--out", "run.h5", *TINY] if given[0] == "search" else given
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "which a document or word processor writes for the hyphen-minus" in err[0] and err[0].endswith(typed), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,typed", [(["search", *TINY, "--out", "\u201crun.h5\u201d"], "type run.h5 without them"),
                                        (["plot", "\u201crun.h5\u201d", "--out", "figs"], "type run.h5 without them"),
                                        (["report", "run.h5", "--out", "\u2018r.html\u2019"], "type r.html without them"),
                                        (["search", *TINY, "--out", "run.h5", "--hp", "w_lr=\u201c0.1\u201d"],
                                         "type 0.1 without them")])
def test_a_path_or_value_in_typographic_quotes_is_named(argv, typed, tmp_path, monkeypatch, capsys):
    """``nasdiag search --out “run.h5”`` (quotes of a rendered page, which a shell keeps in the word) wrote its record as
    “run.h5” and “run.h5”.ckpt, exit code 0, and ``plot --out “figs”`` a folder so named: files a user cannot name
    without the same characters; ``--hp w_lr=“0.1”`` was "must be of type float, got '“0.1”'". One line naming the
    quotes and the text to type, nothing made."""
    from nasdiag.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "is in typographic quotes" in err[0] and typed in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("checkpoint", [None, b"garbage"])
def test_a_resume_without_a_readable_checkpoint_offers_a_way_that_keeps_the_record(checkpoint, tmp_path, capsys):
    """``--resume`` of a finished run (to extend it) whose checkpoint is missing or damaged said only "start again with
    --force", which replaces the record and every step it holds; the line also offers a new --out, as the damaged
    record's line does, and names what --force replaces. The record stays as it was."""
    from nasdiag.cli import main

    out = tmp_path / "run.h5"
    assert main(["search", *TINY, "--out", str(out)]) == 0
    if checkpoint is None:
        (tmp_path / "run.h5.ckpt").unlink()
    else:
        (tmp_path / "run.h5.ckpt").write_bytes(checkpoint)
    capsys.readouterr()
    before = snapshot(tmp_path)
    argv = ["search", *TINY, "--out", str(out), "--resume"]
    argv[argv.index("--epochs") + 1] = "2"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "start the run again under a new --out, or with --force, which replaces" in err[0], err
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="the kernel's lock table is Linux's")
def test_a_search_over_a_record_being_written_says_so_not_resume_or_force(tmp_path, capsys):
    """``nasdiag search --out run.h5`` while another search writes run.h5 said "a record already exists at run.h5; pass
    --resume to continue it or --force to replace it", and each was then refused as "being written by another writer".
    It says so at once; the record and its lock are untouched (no lock is taken to look)."""
    from nasdiag.cli import main
    from nasdiag.record.lock import WriterLock
    from nasdiag.record.schema import lock_path

    out = tmp_path / "run.h5"
    assert main(["search", *TINY, "--out", str(out)]) == 0
    capsys.readouterr()
    writer = WriterLock(lock_path(str(out)), str(out))  # the other search's lock, as its Recorder holds it
    writer.acquire()
    try:
        before = snapshot(tmp_path)
        assert main(["search", *TINY, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"is being written by another search (pid {os.getpid()} on" in err[0], err
        assert "pass --resume" not in err[0] and "record to another --out" in err[0], err
        assert snapshot(tmp_path) == before
    finally:
        writer.release()
    assert main(["search", *TINY, "--out", str(out)]) == 2  # released: the record of a finished run, as before
    assert "a record already exists" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="the kernel's lock table is Linux's")
@pytest.mark.parametrize("command", [["plot", "run.h5", "--out", "figs"], ["report", "run.h5", "--out", "r.html"]])
def test_plot_and_report_of_a_record_of_no_row_tell_a_killed_writer_from_a_starting_one(command, tmp_path, monkeypatch,
                                                                                        capsys):
    """A search killed (kill -9) before its first flush leaves a record of no row and its lock file; plot and report said
    "record run.h5 has no committed rows yet; nothing to plot", as of a run still starting, forever. A writer that
    holds the lock is at its first steps ("run the command again in a while"); a lock held by none was left by a
    writer that stopped, and the line says how the record goes on."""
    from nasdiag.cli import main
    from nasdiag.record import Recorder
    from nasdiag.record.lock import WriterLock
    from nasdiag.record.schema import lock_path

    monkeypatch.chdir(tmp_path)
    Recorder("run.h5").close()  # the file a recorder publishes first: no row
    (tmp_path / "run.h5.lock").write_text('{"pid": 999999999, "host": "gone", "since": "then"}')  # as kill -9 leaves it
    before = snapshot(tmp_path)
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no row: its writer stopped (killed) before it recorded any" in err[0], err
    assert "--resume" in err[0] and snapshot(tmp_path) == before
    writer = WriterLock(lock_path("run.h5"), "run.h5")
    writer.acquire()
    try:
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"no committed rows yet: its writer (pid {os.getpid()} on" in err[0], err
        assert "run the command again in a while" in err[0], err
    finally:
        writer.release()
