"""A twenty-second new user's misuse of the ``nasdiag`` CLI: what rounds 1-21 (test_cli_errors.py,
test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..21.py) did not cover. ``--hp w_lr=1e-2=3``
(an ``=`` inside a value) was told it "sets 2 hyperparameters at once" and to pass ``--hp w_lr= --hp 1e-2=3``, a value
taken for a key and a first setting of no value, itself refused; with no writable home (HOME=/nonexistent of a service
account) plot, report and a search's figures printed two lines of matplotlib's logger; ``report --out latest.html``
where latest.html is a link replaced the link by the page (lost) and left the file it names with the old page; ``plot
a.h5 --out figs b.h5`` was "unrecognized arguments: b.h5"; ``nasdiag --out run.h5`` (the command forgotten) was
"invalid choice: 'run.h5'", as if a misspelt command.
Every such mistake is one line on stderr saying what was wrong and what to do, exit code 2, nothing written.

Checked and found right (not repeated as tests): a misspelt command names the one meant; ambiguous prefixes (--e, --data,
report --f) are refused naming the candidates; --flag=value of a flag; 1e3, 0x10, 1.0, inf, nan, '' for int options; 0
and negative counts; huge --layers, --seed, hutchinson:<k>; --hp with duplicate keys, empty values, keys of another
method or of a search option; --device cuda, cuda:7, mps, CUDA, gpu; --out a folder, under a file, /dev/full, a side
file of a record; report --out -, /dev/null; plot --at in other number forms; methods | head -1, > /dev/full, >&-;
PYTHONIOENCODING=ascii with non-ASCII paths; LC_ALL=C; HOME unset; ulimit -n 16.
"""

from __future__ import annotations

import pytest

from test_cli_errors import TINY, refused


@pytest.mark.parametrize("given,said", [
    ("w_lr=1e-2=3", "hyperparameter w_lr of method 'darts' must be of type float, got '1e-2=3'"),
    ("w_lr=0.1=", "hyperparameter w_lr of method 'darts' must be of type float, got '0.1='"),
    ("w_lr=alpha_lr=0.1", "hyperparameter w_lr of method 'darts' must be of type float, got 'alpha_lr=0.1'"),
])
def test_an_equals_sign_inside_a_value_is_a_bad_value_not_two_settings(given, said, tmp_path, capsys):
    """An ``=`` inside the value of ``--hp`` (a typo, ``w_lr=1e-2=3``) was "sets 2 hyperparameters at once; ... --hp
    w_lr= --hp 1e-2=3": a number split off as a key, and a first --hp of no value that the CLI refuses in turn. A setting
    begins only with a hyperparameter's name after a value; this is the bad value it is."""
    line = refused(["search", *TINY, "--out", str(tmp_path / "run.h5"), "--hp", given], tmp_path, said, capsys)
    assert "at once" not in line and "--hp w_lr= " not in line, line


def test_matplotlib_without_a_writable_home_is_one_warning_line(tmp_path):
    """With no writable home (``HOME=/nonexistent`` of a service account, here a file), ``nasdiag plot`` drew its figures
    and printed two lines of matplotlib's logger on stderr ("mkdir -p failed for path .../.config/matplotlib", then a
    long one on a temporary cache folder), no nasdiag line. It is one ``nasdiag: warning:`` line that names MPLCONFIGDIR;
    the figures are drawn as before."""
    import os
    import subprocess
    import sys

    from plot_records import write_record

    record = write_record(tmp_path / "run.h5", epochs=1, steps_per_epoch=4, cells=("normal",))
    home = tmp_path / "home"
    home.write_text("a file, so no folder can be made under it\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    env.update(HOME=str(home), MPLBACKEND="Agg", PYTHONWARNINGS="default")
    done = subprocess.run([sys.executable, "-m", "nasdiag", "plot", str(record), "--out", str(tmp_path / "figs"),
                           "--figures", "arch", "--no-progress"], env=env, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 0, done.stderr
    assert len(lines) == 1 and lines[0].startswith("nasdiag: warning: matplotlib found no writable folder"), lines
    assert str(home) in lines[0] and "set MPLCONFIGDIR to a writable folder" in lines[0], lines
    assert any(p.suffix == ".png" for p in (tmp_path / "figs").iterdir())


@pytest.mark.parametrize("force", [False, True])
def test_a_report_through_a_symbolic_link_replaces_the_file_it_names_and_keeps_the_link(force, tmp_path, monkeypatch,
                                                                                          capsys):
    """``nasdiag report run.h5 --out latest.html`` where latest.html is a link to run3/report.html (a previous page, or
    with --force any file) replaced the link itself by the page: the link was lost and run3/report.html kept the old
    page (and ``--out /dev/stdout --force`` run as root would replace the system's /dev/stdout link). As a record written
    through a link is the file it points to, the page goes to the file the link names; the link stays."""
    import os

    from nasdiag.cli import main
    from plot_records import write_record

    monkeypatch.chdir(tmp_path)
    write_record(tmp_path / "run.h5", epochs=1, steps_per_epoch=4, cells=("normal",))
    (tmp_path / "run3").mkdir()
    if force:
        (tmp_path / "run3" / "report.html").write_text("my own notes\n")
    else:
        assert main(["report", "run.h5", "--out", "run3/report.html", "--figures", "arch"]) == 0
        os.utime(tmp_path / "run3" / "report.html", (1, 1))
    old = (tmp_path / "run3" / "report.html").read_bytes()
    os.symlink(os.path.join("run3", "report.html"), tmp_path / "latest.html")
    capsys.readouterr()
    argv = ["report", "run.h5", "--out", "latest.html", "--figures", "arch", "--dpi", "20"] + (["--force"] if force else [])
    assert main(argv) == 0, capsys.readouterr().err
    assert os.path.islink(tmp_path / "latest.html") and os.readlink(tmp_path / "latest.html") == os.path.join("run3",
                                                                                                                "report.html")
    page = (tmp_path / "run3" / "report.html").read_bytes()
    assert page != old and page.lstrip().lower().startswith(b"<!doctype html"), page[:80]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.html", "run.h5", "run3"]
    assert sorted(p.name for p in (tmp_path / "run3").iterdir()) == ["report.html"]


def test_plot_takes_records_given_after_its_options(tmp_path, monkeypatch, capsys):
    """``nasdiag plot a.h5 --out figs b.h5`` (a record added at the end of the command) was "unrecognized arguments:
    b.h5", though RECORD takes several: argparse takes one run of them. plot takes no other argument that is not an
    option, so each is a record, drawn in the order given, as ``nasdiag plot a.h5 b.h5 --out figs``."""
    from nasdiag.cli import main
    from plot_records import write_record

    monkeypatch.chdir(tmp_path)
    for name in ("a", "b", "c"):
        write_record(tmp_path / f"{name}.h5", epochs=1, steps_per_epoch=4, cells=("normal",))
    argv = ["plot", "a.h5", "--out", "figs", "b.h5", "--figures", "arch", "c.h5", "--dpi", "20", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:3]] == ["a.h5", "b.h5", "c.h5"], out
    assert {"a", "b", "c"} <= {p.name for p in (tmp_path / "figs").iterdir()}
    assert all(any(p.suffix == ".png" for p in (tmp_path / "figs" / n).iterdir()) for n in "abc")


@pytest.mark.parametrize("argv,owners", [
    (["--out", "run.h5"], "nasdiag search, nasdiag plot and nasdiag report"),
    (["--epochs", "1", "--no-figs"], "nasdiag search"),
    (["--format=pdf"], "nasdiag plot"),
])
def test_an_option_of_a_command_given_without_the_command_says_so(argv, owners, tmp_path, monkeypatch, capsys):
    """``nasdiag --out run.h5`` or ``nasdiag --epochs 1`` (the command forgotten) was "argument command: invalid choice:
    'run.h5'" (or '1'), as if the value were a misspelt command. The line says whose option it is and gives the
    command first."""
    import shlex

    monkeypatch.chdir(tmp_path)
    line = refused(argv, tmp_path, f"nasdiag: {argv[0].split('=')[0]} is an option of {owners}, and no command is given",
                   capsys)
    assert "invalid choice" not in line, line
    fixed = shlex.split(line.rsplit(" nasdiag ", 1)[1])
    assert fixed[1:] == argv and fixed[0] == owners.split(",")[0].split()[1], line
