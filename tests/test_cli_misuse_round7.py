"""A seventh new user's misuse of the ``nasdiag`` CLI and of the batch scripts: what rounds 1-6 (test_cli_errors.py,
test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..6.py) did not cover: abbreviated
options in the command printed after an interrupt, a diagnostic named twice, options put before the command, options
spelled the Python way (``--batch_size``), and the scripts' own arguments. Every mistake is one line on stderr, exit
code 2, and leaves the folder as it was (`refused` compares sha256s)."""

from __future__ import annotations

import importlib
import os
import shlex
import sys

import pytest

from nasdiag.cli import _parse, main
from test_cli_errors import TINY
from test_cli_plot_misuse import rec, refused, snapshot, source  # noqa: F401 (fixtures)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))


def _search(out, *extra):
    return ["search", *TINY, "--out", str(out), *extra]


# -- the command printed after Ctrl-C ------------------------------------------------------------------------
@pytest.mark.parametrize("force", ["--fo", "--for", "--force"])
def test_an_abbreviated_force_is_dropped_from_the_resume_command(force, tmp_path, capsys, monkeypatch):
    """argparse takes any unique prefix: ``--fo`` is ``--force``. The printed command dropped only prefixes of five
    characters or more, so after ``--fo`` it held ``--fo ... --resume``, which argparse refuses ("not allowed with
    argument --force"): the one command the user was given to continue the run did not run."""
    import nasdiag.search

    def interrupted(config, callbacks=()):
        with open(config.record, "ab") as record:  # --force replaced it (else: "run the command again", round 9)
            record.write(b" (replaced)")
        raise KeyboardInterrupt

    monkeypatch.setattr(nasdiag.search, "run", interrupted)
    out = tmp_path / "run.h5"
    out.write_bytes(b"stands in for the record of this run")
    assert _parse(_search(out, force)).force  # the token really is --force to argparse
    assert main(_search(out, force)) == 130
    line = capsys.readouterr().err.strip()
    printed = shlex.split(line.split("continue it with nasdiag ", 1)[1])
    args = _parse(printed)  # raised ConfigError: --resume not allowed with --force
    assert args.resume and not args.force and args.out == str(out)


# -- --diagnostics ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("given,once", [("cost,cost", "cost"), ("hessian, cost,hessian", "hessian,cost"),
                                        ("none,none", "none")])
def test_a_diagnostic_named_twice_is_recorded_once(given, once, tmp_path, monkeypatch):
    """``--diagnostics cost,cost`` was recorded as ['cost', 'cost']: its resume with ``--diagnostics cost`` was
    refused as "different settings: diagnostics=['cost'] (recorded ['cost', 'cost'])" (the runner compares
    `SearchConfig.record_defining`); ``none,none`` was refused as contradicting itself."""
    import nasdiag.search
    from nasdiag.search.config import SearchConfig

    configs = []
    monkeypatch.setattr(nasdiag.search, "run", lambda config, callbacks=(): configs.append(config) or 1 / 0)
    tiny = [t for t in TINY if t not in ("--diagnostics", "none")]
    with pytest.raises(ZeroDivisionError):  # the config reached the search
        main(["search", *tiny, "--out", str(tmp_path / "run.h5"), "--diagnostics", given])
    assert configs[0].record_defining() == SearchConfig(diagnostics=once).record_defining()
    assert sorted(configs[0].diagnostics) == sorted(d for d in once.split(",") if d != "none")


# -- where options go --------------------------------------------------------------------------------------
@pytest.mark.parametrize("before", [["--epochs", "1"], ["--no-progress"]])
def test_options_before_the_command_are_said_as_such(before, tmp_path, capsys):
    """``nasdiag --epochs 1 search ...`` was "invalid choice: '1'", ``nasdiag --no-progress search ...`` said that
    search does not know --no-progress (it does): the line now says where options go and gives the command."""
    argv = [*before, *_search(tmp_path / "run.h5")]
    line = refused(argv, tmp_path, [f"{' '.join(before)} is given before the command search", "options go after it"],
                   capsys)
    fixed = shlex.split(line.split("options go after it: nasdiag ", 1)[1])
    assert fixed[0] == "search" and _parse(fixed).command == "search"


@pytest.mark.parametrize("extra,hint", [
    (["--batch_size", "32"], "; did you mean --batch-size for --batch_size?"),
    (["--hessian_mode=diag"], "; did you mean --hessian-mode for --hessian_mode?"),
    (["--methods", "snas"], "; did you mean --method for --methods?"),
    (["snas"], "(see nasdiag search --help); did you mean --method snas?"),
])
def test_an_unknown_option_names_the_one_meant(extra, hint, tmp_path, capsys):
    """``--batch_size`` (Python's spelling), ``--methods`` and a bare method name were only "unrecognized"."""
    line = refused(_search(tmp_path / "run.h5", *extra), tmp_path, ["unrecognized arguments", hint], capsys)
    assert line.count("did you mean") == 1, line  # not also "--method snas" for the value of --methods


def test_report_of_many_records_says_it_takes_one(tmp_path, capsys):
    """``nasdiag report runs/*.h5 --out r.html`` was only "unrecognized arguments: runs/b.h5"."""
    records = [tmp_path / "a.h5", tmp_path / "b.h5"]
    for record in records:
        record.write_bytes(b"stands in for a record")
    refused(["report", *records, "--out", tmp_path / "r.html"], tmp_path,
            [f"unrecognized arguments: {records[1]}", "run it once per record", "nasdiag plot RECORD RECORD"], capsys)


def test_a_named_figure_the_record_lacks_is_said(rec, tmp_path, capsys):
    """``--figures regret,scalars`` on a record without regret rows drew scalars and said nothing of regret
    (round 3 refused the record only when it lacked every named figure)."""
    code = main(["plot", str(rec), "--out", str(tmp_path / "figs"), "--figures", "regret,scalars", "--dpi", "20"])
    out, err = capsys.readouterr()
    assert code == 0 and "1 figures" in out, out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("skipped regret: the record holds no regret/<cell>/regret, "), err
    assert [p.name for p in (tmp_path / "figs").iterdir()] == ["scalars.png"]


def test_every_hessian_mode_the_help_lists_is_accepted():
    """``nasdiag search --help`` lists the curvature modes: the search accepts each (hutchinson:<k> with a k)."""
    import re

    from nasdiag.cli import _parser
    from nasdiag.search.config import SearchConfig

    action = next(a for a in _parser().commands["search"]._actions if a.dest == "hessian_mode")
    text = action.help.split("epoch: ", 1)[1].split("; docs/")[0]  # "diag (default), approx (...), ggn, ... or ..."
    listed = re.findall(r"(?:^|, | or )([a-z_]+(?::<k>)?)(?= \(|,|$)", text)
    assert sorted(listed) == ["approx", "diag", "exact", "exact_per_edge", "ggn", "ggn_mc", "hutchinson:<k>"], listed
    for mode in listed:
        SearchConfig(hessian_mode=mode.replace("<k>", "4")).validate()


# -- the batch scripts ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script,argv,needle", [
    ("make_readme_figures", ["--plot-only", "--dpi", "5"], "--dpi: must be at least 15"),  # FreeType traceback
    ("make_readme_figures", ["--plot-only", "--dpi", "0"], "--dpi: must be a positive number"),  # ValueError traceback
    ("wiring_cost_heatmaps", ["--batch-size", "0"], "--batch-size: must be at least 1, not 0"),  # ZeroDivisionError
    ("wiring_output_cost", ["--epochs", "-1"], "--epochs: must be at least 1, not -1"),  # drew an untrained run, exit 0
    ("wiring_variants", ["--observe-batches", "0"], "--observe-batches: must be at least 1"),
    ("asmnas_stability", ["--seeds", "0"], "--seeds: must be at least 1, not 0"),  # ValueError from max()
    ("xnas_statistical", ["--runs", "0"], "--runs: must be at least 1, not 0"),  # a RecordError about shape (0,)
    ("bayes_compression", ["--seed", "-1"], "--seed: must be at least 0, not -1"),
    ("xnas_toys", ["--lr=0.1", "--bogus"], "unrecognized arguments: --bogus (see"),  # argparse's usage + error: 2 lines
    ("wiring_evolution", ["--methods", "darts,bogus", "--epochs", "1"], "unknown method(s) bogus"),  # after darts ran
    ("wiring_variants", ["--plot-only"], "no record at"),  # SystemExit: exit code 1
])
def test_a_script_argument_is_refused_in_one_line_before_any_work(script, argv, needle, tmp_path, capsys):
    from nasdiag.errors import run_script

    before = snapshot(tmp_path)
    code = run_script(script, importlib.import_module(script).main, [*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith(f"{script}: error: ") and needle in err[0], err
    assert snapshot(tmp_path) == before
