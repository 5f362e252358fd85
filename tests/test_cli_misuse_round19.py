"""A nineteenth new user's misuse of the ``nasdiag`` CLI, armed with README.md and ``--help``: what rounds 1-16
(test_cli_errors.py, test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..16.py,
test_scripts_misuse_round14.py) did not cover: a record path that is a named pipe (``mkfifo run.h5``, a path of
process substitution) or a device (/dev/null): ``nasdiag search --out``, ``plot`` and ``report`` of it hung before a
word (reading a pipe waits for a writer), a search stopped then said "the record holds every completed step", and
plot/report called /dev/null a damaged record; ``--hp "alpha_betas=0.5 0.999"`` (a tuple not given by commas) was said to
need a float; ``nasdiag methods`` and ``nasdiag search --help`` on a standard output without unicode
(PYTHONIOENCODING=ascii, a Latin-1 locale) were a UnicodeEncodeError traceback; ``nasdiag -- search ...`` was told to run
``nasdiag search -- ...``, refused in turn; Ctrl-C while ``nasdiag search --out run.h5`` (an earlier run's record there)
started offered to continue that earlier run; docs/figures.md gave the main job steps 0-87 (1-88); a figure folder holding a
folder named as a figure (figs/scalars.png/) failed after the whole search; an integer hyperparameter given zero-padded (010)
was refused as not an int; ``nasdiag search --out run.png`` (or .html) wrote its HDF5 record under that name, and a batch
script's --out figs.pdf a folder so named; report --out page.h5 and plot --out figs.h5 a page or a folder under a record's name;
the resume command printed on stderr after Ctrl-C escaped a Latin-1 file name (\\udcff), naming another file.
Every such mistake is one line on stderr saying what was wrong and what to do, exit code 2, no traceback, nothing left
behind.

Checked and found right (not repeated as tests, run as a user in a shell): ``nasdiag``, ``python -m nasdiag``,
``--version`` and every command's ``--help`` (exit 0, one page on stdout; with stdout closed help goes to stderr); a
command misspelt (serach, searc: the near miss named), ambiguous prefixes (--e, --h, --no: the candidates named);
every numeric option of search given 0, -1, nan, inf, 1e309, 0x10, 1_000, '', ' 3', +2 (one line each, or the value
Python's int reads); --hp of wrong types, unknown, duplicate, empty keys and 1e309/nan/inf (one line); SIGINT and
SIGTERM mid-run (job control on), then --resume, and kill -9 then --resume: every array of a float64 DSNAS record with
cost and Hessian diagnostics bit-equal to an uninterrupted run's (meta's record path aside), exit 130/143, one line;
--resume with another method, dataset or of a finished run (one line naming it), with equal settings spelt otherwise
(--hp alpha_lr=3e-2 for the digits preset, alpha_betas=(0.5, 0.999), --multiplier = --steps, an absolute --out:
taken); two searches started at once on one --out, fresh or --force (one runs, the other refused naming the writer);
stdout closed, stdin closed, | head -1, HOME unset with TMPDIR nowhere, LANG=C with a path of ü and a space, a path
named with no suffix or '.h5' (runs, resumes, plots); --spectrum-every past the run (refused before any file);
--hessian-mode hutchinson:0/-1/1_000/ 4/99999999999999999999, DIAG (one line); plot --at 0/05/'5, 10'/+5/a huge step
(one line, or drawn at the step named); report --out of the checkpoint (refused, with --force too).

Left alone: a record path of a named pipe among several records of ``nasdiag plot`` refuses the whole batch in one line
(the other unreadable records of a batch are skipped: the check runs before any record is read); ``nasdiag plot``
interrupted leaves the figures it drew (each written whole); a search with stdout closed runs and exits 0, its
summary lines lost (the record holds them); a SIGTERM after the search returned, while Python exits, ends it by the
signal without a line (the run is complete); 'finished 1 epochs'; --hp alpha_betas=0.5,,0.999 reads as (0.5, 0.999);
--resume --out r.h5 without the run's --epochs extends it to the default 8 with a warning line, as --help says; a
checkpoint, lock or segment file that is itself a named pipe (made by hand) still blocks the reader.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nasdiag(argv, cwd, timeout=120):
    """``python -m nasdiag argv`` in ``cwd``: (exit code, stderr lines); a hang fails the test at ``timeout``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, "-m", "nasdiag", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    return done.returncode, done.stderr.strip().splitlines()


@pytest.mark.parametrize("command", [["search", "--epochs", "1", "--out", "run.h5"], ["plot", "run.h5", "--out", "figs"],
                                     ["report", "run.h5", "--out", "run.html"]])
def test_a_record_path_that_is_a_named_pipe_is_one_line_not_a_hang(command, tmp_path):
    """``mkfifo run.h5`` (or a path of the shell's process substitution): the search's check whether the existing file
    is a record, plot's and report's check whether it is a checkpoint, opened it for reading, which waits for a writer
    that never comes: the command hung, nothing said (ended by a signal, the search said the record holds every
    completed step). One line naming the pipe, before any work."""
    os.mkfifo(tmp_path / "run.h5")
    code, err = _nasdiag(command, tmp_path, timeout=90)
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "run.h5 is a named pipe (FIFO)" in err[0] and "pass" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]


@pytest.mark.parametrize("command,out", [("plot", "figs"), ("report", "r.html")])
def test_a_record_that_is_a_device_is_not_called_damaged(command, out, tmp_path, capsys):
    """``nasdiag plot /dev/null`` said 'record /dev/null is damaged at /dev/null row 0 ... no row of it can be read'."""
    from nasdiag.cli import main

    code = main([command, os.devnull, "--out", str(tmp_path / out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{os.devnull} is a device" in err[0] and "damaged" not in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["0.5 0.999", "0.5;0.999", "0.5,abc"])
def test_a_tuple_hyperparameter_not_given_by_commas_is_not_said_to_be_a_float(value, tmp_path, capsys):
    """``--hp "alpha_betas=0.5 0.999"`` (Adam's betas, ``(float, float)`` in nasdiag methods) was refused as 'alpha_betas
    of method 'darts' must be of type float, got '0.5 0.999'': the element's type, so a user fixing it gave one float and
    was told it needs 2 values. The line names the tuple's type and the commas."""
    from nasdiag.cli import main

    out = tmp_path / "run.h5"
    code = main(["search", "--hp", f"alpha_betas={value}", "--epochs", "1", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "alpha_betas of method 'darts' must be of type (float, float)" in err[0] and "commas" in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command,escaped", [(["methods", "darts"], "\\u03be"), (["search", "--help"], "\\u03b1")])
def test_help_and_methods_on_a_standard_output_without_unicode_are_printed_not_a_traceback(command, escaped, tmp_path):
    """On a standard output whose encoding lacks Greek letters (PYTHONIOENCODING=ascii here; a Latin-1 locale, or the C
    locale without Python's UTF-8 mode, are alike), ``nasdiag methods`` (ξ, Θ, ℓ in the methods' docstrings) and
    ``nasdiag search --help`` (α) were a UnicodeEncodeError traceback, exit code 1. Each such character is written as
    its escape, as Python writes it to standard error; the rest as is."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "PYTHONIOENCODING": "ascii"}
    done = subprocess.run([sys.executable, "-m", "nasdiag", *command], cwd=tmp_path, env=env, capture_output=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr.decode(errors="replace")
    out = done.stdout.decode("ascii")  # nothing but ASCII reached it
    assert escaped in out and ("w_lr: float = 0.025" in out if command[0] == "methods" else "--spectrum-every" in out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("before", [["--"], ["--no-progress", "--"]])
def test_a_double_dash_before_the_command_is_not_moved_after_it(before, tmp_path, capsys):
    """``nasdiag -- search --epochs 1`` was told to run ``nasdiag search -- --epochs 1``, which is refused in turn (after
    --, every argument is a value). The command given back drops the --, and runs as told."""
    from nasdiag.cli import main

    out = str(tmp_path / "run.h5")
    rest = ["--epochs", "0", "--out", out]  # 0: the command given back stops at its own check, before any work
    assert main([*before, "search", *rest]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drop the --" in err[0], err
    told = err[0].split(": nasdiag ", 1)[1].split()
    assert "--" not in told and told[0] == "search" and told[-len(rest):] == rest, err
    assert main(told) == 2
    again = capsys.readouterr().err.strip().splitlines()
    assert len(again) == 1 and "epochs must be an integer >= 1, got 0" in again[0], again
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A finished search's record (one epoch of the smallest supernet), the earlier run at an --out given again."""
    from nasdiag.cli import main
    from test_cli_errors import TINY

    out = tmp_path_factory.mktemp("earlier") / "run.h5"
    assert main(["search", *TINY, "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("flag", [[], ["--force"]])
def test_an_interrupt_at_start_up_does_not_offer_to_continue_an_earlier_runs_record(flag, earlier_run, monkeypatch, capsys):
    """``nasdiag search --out run.h5`` (a record there from an earlier run: the command would be refused), or with
    ``--force``, stopped by Ctrl-C while it starts (loading numpy and torch, before the record is touched) said "the
    record holds every completed step: continue it with nasdiag search ... --resume", which continued the earlier run,
    not this one. It says nothing was recorded, and the record is as it was."""
    from nasdiag import cli
    from test_cli_errors import TINY, snapshot

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_import_numpy", interrupted)
    before = snapshot(earlier_run.parent)
    assert cli.main(["search", *TINY, "--out", str(earlier_run), *flag]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume" not in err[0].replace("only with --resume", ""), err
    assert ("before --force replaced the record" if flag else "before anything was recorded") in err[0], err
    assert snapshot(earlier_run.parent) == before


def test_the_step_range_docs_figures_gives_the_main_job_is_the_records(earlier_run):
    """docs/figures.md's ``nasdiag plot ... --at init,final,40`` said 'the main job has steps 0-87': a search records
    steps from 1 (``--at 0`` is refused: 'starts at step 1'), one per full batch of the smaller search split, so README's
    main job (digits, 8 epochs, batch 64) has steps 1 to 8 · ⌊min(train, val) / 64⌋ = 88."""
    import re

    import h5py

    from nasdiag.data import load_dataset

    text = open(os.path.join(ROOT, "docs", "figures.md"), encoding="utf-8").read()
    first, last = map(int, re.search(r"the main job has steps (\d+)-(\d+)", text).groups())
    with h5py.File(earlier_run, "r") as f:  # the record's own step column, read without nasdiag
        steps = f["step"][()]
    splits = load_dataset("digits")
    assert first == int(steps.min()) == 1
    assert "--epochs 8" in open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert "--batch-size" not in open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().split("--epochs 8")[1][:40]
    assert last == 8 * (min(len(splits.train), len(splits.val)) // 64)


@pytest.mark.parametrize("command", ["search", "plot"])
def test_a_figure_folder_holding_a_folder_named_as_a_figure_is_refused_before_the_run(command, earlier_run, tmp_path,
                                                                                   capsys):
    """A figure folder holding a folder named as a figure (``figs/scalars.png/``): ``nasdiag search --figs figs`` ran to
    its end, then failed 'Is a directory (figs/.scalars.png.tmp)', naming a hidden temporary file, and told to draw them
    with nasdiag plot, which failed alike. Refused in one line before the run, as a user's own file of that name is."""
    from nasdiag.cli import main
    from test_cli_errors import TINY, snapshot

    (tmp_path / "figs" / "scalars.png").mkdir(parents=True)
    before = snapshot(tmp_path)
    if command == "search":
        argv = ["search", *[a for a in TINY if a != "--no-figs"], "--out", str(tmp_path / "run.h5"), "--figs",
                str(tmp_path / "figs")]
    else:
        argv = ["plot", str(earlier_run), "--out", str(tmp_path / "figs"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds scalars.png/, named as a figure" in err[0] and ".tmp" not in err[0], err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("method,key", [("bayesnas", "update_every"), ("asmnas", "attention_hidden")])
def test_a_zero_padded_integer_hyperparameter_is_taken_as_the_decimal_it_is(method, key):
    """``--hp update_every=010`` was refused as 'must be of type int, got '010'' (Python's int(text, 0), which takes 0x10
    but no zero-padded decimal), where ``--epochs 010`` is 10; it is 10, and 0x10 still 16."""
    from nasdiag.search.registry import available_methods

    hp = available_methods()[method].Hyperparameters
    assert getattr(hp.parse([f"{key}=010"], method), key) == 10
    assert getattr(hp.parse([f"{key}=0x10"], method), key) == 16


@pytest.mark.parametrize("name", ["run.png", "results.html", "run.PDF"])
def test_a_search_record_named_as_another_format_is_refused_before_the_run(name, tmp_path, capsys):
    """``nasdiag search --out run.png`` (or results.html: --out taken for the figures or a page) ran and wrote its HDF5
    record under that name, exit 0, as round 14 found report --out report.pdf writing HTML; one line naming the .h5
    record to give, before any file."""
    from nasdiag.cli import main
    from test_cli_errors import TINY

    assert main(["search", *TINY, "--out", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"names a {os.path.splitext(name)[1].lower()} file" in err[0], err
    assert f"--out {tmp_path / os.path.splitext(name)[0]}.h5" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_a_record_already_named_as_another_format_is_still_resumed_or_replaced(earlier_run, tmp_path, capsys):
    """A record written under such a name before the refusal (or renamed so) stays the user's to continue."""
    import shutil

    from nasdiag.cli import main
    from test_cli_errors import TINY

    record = tmp_path / "run.png"
    shutil.copyfile(earlier_run, record)
    shutil.copyfile(f"{earlier_run}.ckpt", f"{record}.ckpt")
    assert main(["search", *TINY, "--out", str(record), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already finished" in err[0], err  # read as the run it is: refused as finished


@pytest.mark.parametrize("script,argv", [("xnas_toys", []), ("curvature_accuracy", ["--nets", "tanh_mlp"])])
@pytest.mark.parametrize("name", ["figs.pdf", "notes.md", "out.h5"])
def test_a_script_folder_named_as_another_format_is_refused_before_any_work(script, argv, name, tmp_path, capsys):
    """Round 14 refused ``nasdiag plot --out figs.pdf`` (a folder of png files so named); a batch script's --out figs.pdf
    still made that folder, its record and png figures in it, exit 0. One line naming a folder to give."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from test_cli_misuse_round13 import _script  # in-process, the folder checked unchanged

    out = tmp_path / name
    code, err = _script(script, ["--out", str(out), *argv], tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert f"--out {out} names a {os.path.splitext(name)[1]} file" in err[0], err
    assert f"give a folder, e.g. --out {tmp_path / os.path.splitext(name)[0]}" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("command,name,said", [("report", "page.h5", "report writes an HTML page"),
                                               ("plot", "figs.h5", "plot writes one png file per figure"),
                                               ("search", "figs.hdf5", "the search draws one png file per figure")])
def test_a_page_or_figure_folder_named_as_a_record_is_refused(command, name, said, earlier_run, tmp_path, capsys):
    """``nasdiag report run.h5 --out page.h5`` wrote its HTML page under a record's name, ``plot --out figs.h5`` (and
    search --figs figs.hdf5) a folder of png files so named, exit 0; ``nasdiag plot runs/*.h5`` then read them as
    records. Refused in one line, as a page or folder named .pdf is (round 14)."""
    from nasdiag.cli import main
    from test_cli_errors import TINY

    out = str(tmp_path / name)
    argv = {"report": ["report", str(earlier_run), "--out", out], "plot": ["plot", str(earlier_run), "--out", out],
            "search": ["search", *[a for a in TINY if a != "--no-figs"], "--out", str(tmp_path / "run.h5"), "--figs", out]}
    assert main(argv[command]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out} names a {os.path.splitext(name)[1]} file, but {said}" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_the_resume_command_of_a_record_named_in_latin1_names_that_file(tmp_path):
    """A record named in Latin-1 (``$'\\xff.h5'``) reaches Python as surrogates; standard error wrote them as escapes,
    so the line after Ctrl-C said 'continue it with nasdiag search ... --out .../\\udcff.h5 --resume', a file that is not
    there (round 9 wrote such a name on stdout as its bytes; stderr still escaped it). Its bytes, as on stdout."""
    out = tmp_path / os.fsdecode(b"\xff.h5")
    script = ("import sys, nasdiag.search\nfrom nasdiag.cli import main\n"
              "def run(config, callbacks=()):\n"
              "    open(config.record, 'wb').write(b'stands in for the record of this run')\n"
              "    raise KeyboardInterrupt\n"
              "nasdiag.search.run = run\nsys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script, "search", "--epochs", "1", "--out", str(out)], cwd=tmp_path,
                          env=env, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 130, done.stderr
    line = done.stderr.strip()
    assert b"\n" not in line and b"\\udc" not in line and b"continue it with nasdiag search" in line, line
    words = subprocess.run(["bash", "-c", f"printf '%s\\0' {os.fsdecode(line.split(b'continue it with nasdiag ', 1)[1])}"],
                           capture_output=True, check=True).stdout.split(b"\0")[:-1]
    assert words[words.index(b"--out") + 1] == os.fsencode(str(out)), words
