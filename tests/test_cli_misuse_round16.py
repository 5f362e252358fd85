"""A sixteenth new user's misuse of the ``nasdiag`` CLI and the batch scripts, armed with README.md and ``--help``: what
rounds 1-15 (test_cli_errors.py, test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..15.py,
test_scripts_misuse_round14.py) did not cover: curvature_accuracy.py's ``--device`` (any text: torch's traceback);
kill_resume_trials.py's ``--folder`` given relative (the searches ran in the repository's folder, their records went
there) or holding an earlier run (a RuntimeError traceback); ``nasdiag report`` in a folder that cannot hold a file
(the line named a hidden temporary file) or of a long name the file system takes (refused for its temporary name);
``--plot-only`` of a run stopped before it finished (xnas_toys: a traceback or cut curves drawn; sparsenas_digits: a
KeyError/IndexError) or of a summary.json cut short or of another tool (asmnas_stability); the paper scripts
(bayes_compression, sparsenas_digits, asmnas_stability) replacing a user's fig3.png, compression.h5, ... without a
word; sparsenas_digits' values given twice and ``--out=~/sp``; ``PYTHONWARNINGS=error`` (chained tracebacks for the
CLI and the scripts); a command run in a current folder removed meanwhile (torch's loader: 'Intel oneMKL FATAL ERROR:
Cannot load libtorch_cpu.so'); a script's --out through a symbolic link that leads nowhere ('File exists: L'). Every
such mistake is one line on stderr saying what was wrong and what to do, exit code 2, no
traceback, nothing left behind.

Checked and found right (not repeated as tests, run as a user in a shell): ``--out`` under a file (search, report),
in a read-only current folder (/proc: search, plot, and search --figs refused before the run), through a dangling
link (plot, report: "no record at"), a record named through a link (report); PYTHONWARNINGS=error with darts,
bayesnas, xnas searches (no warning), plot and report, xnas_toys and xnas_statistical; HOME unwritable (matplotlib's
own cache line, then drawn); every script's ``--help`` (exit 0) and every typed option of every script given x, -1,
nan (one line, exit 2, nothing made: in-process over the parsers' actions); asmnas/wiring_evolution --layers 0/-1,
--steps 0; wiring_* --methods bogus, --data-dir with digits, cifar10 without or with a missing --data-dir;
sparsenas_digits --lambdas nan/0/-1/1e400/1e-3.x, --penalties ','; the scripts under ``ulimit -f`` (one line, the
record kept); the scripts run with no argument for a while, then Ctrl-C (exit 130, 'interrupted'); the search's
--help defaults against SearchConfig's; search --no-figs with --figs, --multiplier past --steps, --resume with
--force, --resume of nothing, --out -; ``nasdiag methods`` naming the digits presets.

Left alone: torch's threads default to the usable CPUs (at most 4) whatever OMP_NUM_THREADS says, as --help and
README document; the batch scripts print Python's two-line warnings (the CLI prints one line each); asmnas_stability
replaces a search record named like its own (darts_seed0.h5: the same method, not told apart); wiring_evolution
--plot-only of a record without architecture rows draws nothing and exits 0; the benchmarks and curvature_accuracy
take a name given twice (--sections, --nets) and time it twice; kill_resume_trials' reference or trial search failing
for the machine (a full disk) is a RuntimeError with the search's stderr (a harness, its failures are its output);
the batch scripts in a removed current folder end at torch's import as above (each imports torch before run_script).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from nasdiag.cli import main
from test_cli_errors import TINY, refused
from test_cli_misuse_round13 import _script  # runs a script in-process, the folder checked unchanged
from test_cli_plot_misuse import rec, source  # noqa: F401 (fixtures)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))  # the batch scripts


@pytest.mark.parametrize("device,said", [("bogus", "is not a device"), ("cuda:7", "is not available on this machine")])
def test_curvature_accuracy_device_is_checked_in_one_line_before_any_folder(device, said, tmp_path, capsys):
    """``--device bogus`` was torch's RuntimeError traceback ('Expected one of cpu, cuda, ...') and ``--device cuda`` on
    a CPU machine its AssertionError ('Torch not compiled with CUDA enabled'), after ``--out`` was made; the other
    scripts' --device is checked as they parse (script_args.device)."""
    out = tmp_path / "out"
    code, err = _script("curvature_accuracy", ["--nets", "tanh_mlp", "--device", device, "--out", str(out)], tmp_path,
                        capsys)
    assert code == 2 and len(err) == 1 and "--device" in err[0] and said in err[0], err
    assert not out.exists()


def test_kill_resume_trials_relative_folder_is_taken_from_where_it_is_run(tmp_path, monkeypatch, capsys):
    """The searches run with the repository as their working folder: ``--folder k`` wrote the reference and trial
    records under the repository's k/, and each trial then missed its record here (a fresh start refused as 'a record
    already exists'). The folder is the user's k/ here; the searches are stood in for (no run)."""
    trials = importlib.import_module("kill_resume_trials")
    seen = []

    def reference(folder, epochs=3):
        seen.append(folder)
        raise KeyboardInterrupt  # stop before any search (exit 130)

    monkeypatch.setattr(trials, "reference", reference)
    monkeypatch.chdir(tmp_path)
    from nasdiag.errors import run_script

    assert run_script("kill_resume_trials", trials.main, ["--folder", "k", "--trials", "1"]) == 130
    capsys.readouterr()
    assert seen == [tmp_path / "k" / "ref"], seen


def test_kill_resume_trials_into_the_folder_of_an_earlier_run_is_one_line(tmp_path, capsys):
    """A second run into the same --folder (the default /tmp/nasdiag-kill-trials, say) was the reference search's
    refusal ('a record already exists at .../ref/reference.h5') raised as a RuntimeError traceback, exit 1."""
    (tmp_path / "k" / "ref").mkdir(parents=True)
    (tmp_path / "k" / "ref" / "reference.h5").write_bytes(b"")
    code, err = _script("kill_resume_trials", ["--folder", str(tmp_path / "k"), "--trials", "1"], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and "--folder" in err[0] and "earlier run" in err[0], err


def test_a_report_into_a_folder_that_cannot_hold_it_names_the_out_not_a_hidden_file(rec, tmp_path, monkeypatch, capsys):
    """``nasdiag report run.h5 --out r.html`` run in a folder where no file can be made (a read-only one; root ignores
    chmod, so /proc stands in) said 'nasdiag: error: No such file or directory (.r.html.16283.c5273b4a.tmp)': a
    hidden file the user never named, and no way out. The line names the --out, the folder and what to do."""
    if os.geteuid() == 0:
        where = "/proc"
    else:
        where = tmp_path / "ro"
        where.mkdir()
        where.chmod(0o555)
    monkeypatch.chdir(where)
    try:
        line = refused(["report", str(rec), "--out", "r.html"], tmp_path, "--out r.html cannot be written", capsys)
    finally:
        if where != "/proc":  # pytest must be able to remove it
            where.chmod(0o755)
    assert ".tmp" not in line and "give an --out" in line and os.path.abspath(".") in line, line


def test_a_report_of_a_long_name_the_file_system_takes_is_written(rec, tmp_path, capsys):
    """A page named with 245 characters (the file system takes 255) was refused as 'File name too long' of its hidden
    temporary name (the page's name plus '.<pid>.<hex>.tmp'), exit 2; it is written."""
    out = tmp_path / ("r" * 245 + ".html")
    assert main(["report", str(rec), "--out", str(out), "--figures", "scalars"]) == 0, capsys.readouterr().err
    assert out.read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run.h5", out.name])


@pytest.mark.parametrize("rows", [0, 5])
def test_xnas_toys_plot_only_of_a_run_stopped_before_it_finished_is_one_line(rows, tmp_path, capsys):
    """xnas_toys.py writes its record in one pass; a run stopped in it (Ctrl-C, or ``ulimit -f 100``: 'cannot write
    to t3/record.h5: disk full ...; the 0 rows committed before are intact') left a record that --plot-only drew from:
    with no row a ValueError traceback ('zero-size array to reduction operation maximum'), with some rows the
    paper's figures of curves cut short, exit 0. One line naming the steps there are, no figure drawn."""
    import numpy as np

    from nasdiag.record import Recorder

    out = tmp_path / "out"
    out.mkdir()
    problems = {name: {"steps": steps, "alpha": [0.0] * n, "optimum": [1.0] + [0.0] * (n - 1)}
                for name, steps, n in (("fig3", 120, 3), ("fig4", 50, 2), ("fig5", 50, 2), ("fig7", 50, 2))}
    with Recorder(str(out / "record.h5"), meta={"method": "xnas_toys", "config": {"lr": 0.1, "problems": problems}}) as rec:
        for t in range(rows):
            row = {f"toy/{name}/{opt}/{key}": np.full(len(p["alpha"]) if key != "loss" else (), 0.5)
                   for name, p in problems.items() for opt in ("xnas", "gd") for key in ("p", "update", "loss")}
            rec.log(t, {**row, **{f"toy/fig6/{key}": 0.5 for key in ("x", "factor_simplex", "alpha_x", "factor_alpha")}})
    code, err = _script("xnas_toys", ["--out", str(out), "--plot-only"], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and f"holds {rows} of the 120 steps of fig3" in err[0], err
    assert "without --plot-only" in err[0], err


def _search_record(path, method="darts"):
    """A record as nasdiag search writes it (meta's method), at ``path``."""
    import numpy as np

    from nasdiag.record import Recorder

    path.parent.mkdir(parents=True, exist_ok=True)
    with Recorder(str(path), meta={"method": method}) as rec:
        rec.log(1, {"scalars/loss": np.float32(1.0)})


@pytest.mark.parametrize("script,argv,where", [
    ("bayes_compression", ["--iterations", "1", "--epochs-per-iteration", "1"], "compression.png"),
    ("bayes_compression", ["--iterations", "1", "--epochs-per-iteration", "1"], "compression.h5"),
    ("sparsenas_digits", ["--epochs", "1", "--retrain-epochs", "0", "--lambdas", "1e-3", "--optimizers", "sgd",
                          "--penalties", "lasso", "--workers", "1", "--no-progress"], "fig3.png"),
    ("sparsenas_digits", ["--plot-only"], "fig3.h5"),
    ("asmnas_stability", ["--plot-only"], "stability.png"),
])
def test_a_paper_script_replaces_no_file_of_the_users(script, argv, where, tmp_path, capsys):
    """Round 14 kept the wiring and XNAS scripts from replacing a user's own record.h5 or fig5.png; the paper scripts
    were left: bayes_compression.py wrote compression.png and compression.h5 (Recorder(overwrite=True): a search's
    record deleted), sparsenas_digits.py fig3.png (the most common name of a paper's figure) and fig3.h5 (with
    --plot-only a KeyError traceback of another record), asmnas_stability.py stability.png, without a word. One line
    before any work, the folder as it was."""
    out = tmp_path / "out"
    out.mkdir()
    if where.endswith(".h5"):
        _search_record(out / where)
    else:
        (out / where).write_bytes(b"\x89PNG\r\n\x1a\n the user's own figure")
    code, err = _script(script, ["--out", str(out), *argv], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and where in err[0], err
    assert "record of darts" in err[0] if where.endswith(".h5") else "not drawn by nasdiag" in err[0], err


def test_sparsenas_digits_redraws_its_own_figure(tmp_path, capsys):
    """Its own fig3.png (drawn with nasdiag's mark now) is redrawn by the next --plot-only, not refused as the user's."""
    script = importlib.import_module("sparsenas_digits")
    out = tmp_path / "out"
    out.mkdir()
    results = [script.Result(opt, pen, lam, 0.9, 30, 40, 0.5) for opt in ("sgd", "hapg") for pen in ("lasso", "sgl")
               for lam in (1e-4, 1e-3)]
    script.write_record(results, out / "fig3.h5", {"epochs": 1})
    from nasdiag.errors import run_script

    for _ in range(2):
        assert run_script("sparsenas_digits", script.main, ["--out", str(out), "--plot-only"]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert b"nasdiag figure" in (out / "fig3.png").read_bytes()


@pytest.mark.parametrize("rows", [0, 1])
def test_sparsenas_digits_plot_only_of_a_record_whose_write_stopped_is_one_line(rows, tmp_path, capsys):
    """fig3.h5 is written in one pass after the grid; a write stopped by a full disk or Ctrl-C keeps meta's list of
    the 4 configurations and fewer rows: --plot-only was a KeyError ('scalars/lambda', no row) or IndexError (some)
    traceback. One line naming what the record holds."""
    from nasdiag.record import Recorder

    out = tmp_path / "out"
    out.mkdir()
    meta = {"method": "sparsenas-digits-ablation", "config": {}, "rows": [{"optimizer": "sgd", "penalty": "lasso"}] * 4}
    with Recorder(str(out / "fig3.h5"), meta=meta) as rec:
        for i in range(1, rows + 1):
            rec.log(i, {f"scalars/{c}": 0.5 for c in ("lambda", "valid_acc", "selected_features", "remaining_neurons",
                                                       "weight_sparsity", "seconds")})
    code, err = _script("sparsenas_digits", ["--out", str(out), "--plot-only"], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and f"holds {rows} of the 4 configurations" in err[0], err


@pytest.mark.parametrize("text,argv", [('{"config": {"seeds": 1}, "ru', ["--plot-only"]),  # cut short
                                       ('{"accuracy": 0.9}', ["--plot-only"]),  # another tool's
                                       ('{"accuracy": 0.9}', ["--seeds", "1", "--epochs", "1"])],
                         ids=["cut-short", "another-tools", "another-tools-run"])
def test_asmnas_stability_summary_cut_short_or_of_another_tool_is_one_line(text, argv, tmp_path, capsys):
    """asmnas_stability.py writes summary.json after its runs with a plain open(): a full disk or a kill there cuts it
    short, and --plot-only was json's JSONDecodeError traceback; another tool's summary.json (a common name) was a
    KeyError ('runs') traceback, and a run replaced it without a word. One line before any work."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text(text)
    code, err = _script("asmnas_stability", ["--out", str(out), *argv], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and "summary.json is not a summary of asmnas_stability.py" in err[0], err


def test_a_warning_raised_as_an_error_is_one_line_not_chained_tracebacks(tmp_path, capsys):
    """``PYTHONWARNINGS=error nasdiag search --method dsnas`` (a CI job's setting): the RecordWarning of the NaN costs
    of the ops DSNAS did not sample (recorded and flagged by design) was raised, then again by the recorder's close
    while handling it: three chained tracebacks ending in 'while handling RecordWarning, closing the recorder
    failed', exit 1. One line naming the warning itself and the setting that made it an error."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as PYTHONWARNINGS=error does for the process
        code = main(["search", *TINY, "--method", "dsnas", "--diagnostics", "cost", "--out", str(tmp_path / "run.h5")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "RecordWarning" in err[0] and "NaN/inf" in err[0] and "PYTHONWARNINGS" in err[0], err
    assert "closing the recorder failed" not in err[0], err


def test_a_script_warning_raised_as_an_error_is_one_line(tmp_path, capsys):
    """The batch scripts likewise: ``PYTHONWARNINGS=error python scripts/wiring_output_cost.py`` ended in the same
    chained tracebacks (the NaN costs of the unsampled ops); run_script says it in one line, exit 2."""
    import warnings

    from nasdiag.errors import run_script
    from nasdiag.record.errors import RecordWarning

    def main(argv):
        try:
            warnings.warn("'cost/normal/mean' at step 11: 5 NaN/inf value(s)", RecordWarning)
        finally:
            warnings.warn("while handling RecordWarning, closing the recorder failed", RecordWarning)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_script("wiring_output_cost", main, []) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("wiring_output_cost: error: 'cost/normal/mean' at step 11"), err
    assert "PYTHONWARNINGS" in err[0], err


@pytest.mark.parametrize("option,value,said", [("--lambdas", "1e-3,0.001", "0.001"), ("--optimizers", "sgd,sgd", "sgd"),
                                               ("--penalties", "sgl,lasso,sgl", "sgl")])
def test_sparsenas_digits_value_given_twice_is_one_line_not_two_runs(option, value, said, tmp_path, capsys):
    """Round 14 refused --configs minimal1,minimal1 of the wiring scripts; sparsenas_digits.py's --lambdas 1e-3,0.001
    (one λ written two ways), --optimizers sgd,sgd or --penalties sgl,lasso,sgl trained each configuration twice, the
    record holding both rows and the figure two points at one λ, exit 0. One line before any work."""
    out = tmp_path / "out"
    argv = ["--out", str(out), "--epochs", "1", "--retrain-epochs", "0", "--workers", "1", "--no-progress",
            "--lambdas", "1e-3", "--optimizers", "sgd", "--penalties", "lasso", option, value]
    code, err = _script("sparsenas_digits", argv, tmp_path, capsys)
    assert code == 2 and len(err) == 1 and f"{option} names {said} more than once" in err[0], err
    assert not out.exists()


def test_sparsenas_digits_out_with_a_tilde_the_shell_left_is_refused(tmp_path, monkeypatch, capsys):
    """Round 11 refused ``--out=~/figs`` for the scripts of script_args.Parser; sparsenas_digits.py has a parser of its
    own and ran the grid into a new folder named ``~`` in the current one, exit 0. One line, nothing made."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    argv = ["--out=~/sp", "--epochs", "1", "--retrain-epochs", "0", "--workers", "1", "--no-progress", "--lambdas",
            "1e-3", "--optimizers", "sgd", "--penalties", "lasso"]
    code, err = _script("sparsenas_digits", argv, tmp_path, capsys)
    assert code == 2 and len(err) == 1 and "write --out ~/sp" in err[0] and str(tmp_path / "home") in err[0], err


@pytest.mark.parametrize("command", [["methods", "darts"], ["search", "--epochs", "1"]])
def test_a_command_run_in_a_removed_folder_says_so(command, tmp_path):
    """A shell still in a folder that was removed (``rm -rf runs`` from another terminal, then the command again):
    importing torch there ended the process with 'Intel oneMKL FATAL ERROR: Cannot load .../libtorch_cpu.so.', exit 2,
    as if the installation were broken, for every command that loads torch. One line saying what is wrong."""
    import subprocess

    (tmp_path / "gone").mkdir()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # no relative entry: none resolves in there
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *(p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if os.path.isabs(p))])}
    script = f"cd gone && rmdir ../gone && exec {sys.executable} -m nasdiag \"$@\""
    argv = [*command, *(["--out", str(tmp_path / "run.h5")] if command[0] == "search" else [])]
    done = subprocess.run(["sh", "-c", script, "sh", *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "the current folder no longer exists" in err[0], done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", ["xnas_toys", "sparsenas_digits", "bayes_compression"])
@pytest.mark.parametrize("below", [False, True])
def test_a_script_folder_through_a_link_that_leads_nowhere_says_so(script, below, tmp_path, capsys):
    """Round 11 refused ``nasdiag search --out`` through a dangling link; the batch scripts said 'File exists: L' (their
    os.makedirs on a link to a folder that is not there), naming neither the link nor what to do."""
    (tmp_path / "L").symlink_to(tmp_path / "gone" / "nowhere")
    out = tmp_path / "L" / "sub" if below else tmp_path / "L"
    code, err = _script(script, ["--out", str(out)], tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{tmp_path / 'L'} is a symbolic link to {tmp_path / 'gone' / 'nowhere'}, which does not exist" in err[0], err
