"""An eleventh new user's misuse of the ``nasdiag`` CLI: what rounds 1-10 (test_cli_errors.py, test_cli_search_misuse.py,
test_cli_plot_misuse.py, test_cli_misuse_round3..10.py) did not cover: a CIFAR-10 run resumed from another working
directory (the README's relative ``--data-dir``), and ``--out`` through symbolic links that lead nowhere (a dangling
link or a loop as a folder of the path). Every mistake is one line on stderr, exit code 2, no traceback, the folder
left as it was.
"""

from __future__ import annotations

import os
import pickle
import sys

import numpy as np
import pytest

from nasdiag.cli import main
from test_cli_errors import TINY, refused
from test_cli_plot_misuse import rec, source  # noqa: F401 (fixtures)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))  # the batch scripts' script_args


def _fake_cifar(folder, seed: int) -> None:
    """Six python batches of 20 random images each, in the standard layout (N x 3072 bytes, a list of labels)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (20, 3072), dtype=np.uint8), b"labels": rng.integers(0, 10, 20).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))


def _cifar(out, data_dir, epochs, *extra):
    # 100 training images, split about 50/50 into search-train and search-val: a step or two of 25 per epoch
    return ["search", *TINY, "--dataset", "cifar10", "--data-dir", str(data_dir), "--batch-size", "25",
            "--epochs", str(epochs), "--out", str(out), *extra]


def test_a_cifar_run_resumed_from_another_folder_reads_its_own_data(tmp_path, monkeypatch, capsys):
    """The README's ``--data-dir`` is typed relative to where the search starts. It was compared as typed: from
    another folder, ``--data-dir data`` (other images there) resumed the run on those other images without a word
    (the record then mixed two datasets), while the run's own folder named by its absolute path (the only way to
    reach it from there) was refused as "different settings". The folder is compared resolved: the other images are
    refused in one line, the same folder by any name resumes."""
    _fake_cifar(tmp_path / "a" / "data", seed=0)
    _fake_cifar(tmp_path / "b" / "data", seed=1)
    monkeypatch.chdir(tmp_path / "a")
    assert main(_cifar("runs/c.h5", "data", 1)) == 0
    capsys.readouterr()
    from nasdiag.record import load

    first = len(load("runs/c.h5")["step"])  # one epoch's steps
    monkeypatch.chdir(tmp_path / "b")
    record = tmp_path / "a" / "runs" / "c.h5"
    line = refused(_cifar(record, "data", 2, "--resume"), tmp_path, "--resume with different settings", capsys)
    assert "data_dir=" in line and str(tmp_path / "b" / "data") in line, line
    assert main(_cifar(record, f"{tmp_path / 'a' / 'data'}{os.sep}", 2, "--resume")) == 0  # the same folder
    capsys.readouterr()
    assert load(str(record))["step"].tolist() == list(range(1, 2 * first + 1))


def test_a_record_of_an_unresolved_data_dir_resumes_from_its_folder(tmp_path, monkeypatch):
    """Records written before the folder was stored resolved hold it as typed: from the folder it was typed in,
    it still names the same data, so resuming them there is not refused."""
    from nasdiag.search.config import SearchConfig, differing_fields

    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    given = SearchConfig(dataset="cifar10", data_dir="data").run_defining()
    assert given["data_dir"] == os.path.realpath(tmp_path / "data")
    assert differing_fields(given, {**given, "data_dir": "data"}) == {}
    assert "data_dir" in differing_fields(given, {**given, "data_dir": "elsewhere"})


_FIGS = [a for a in TINY if a != "--no-figs"]
_LINKED_OUTPUTS = {  # (command line, the level that is a link), the link made by the test
    "search, a folder of --out dangling": (["search", *TINY, "--out", "L/run.h5"], "its folder L"),
    "search, a folder of --out a loop": (["search", *TINY, "--out", "loop/run.h5"], "its folder loop"),
    "search, --out itself a loop": (["search", *TINY, "--out", "loop"], "--out loop is"),
    "search, --figs dangling": (["search", *_FIGS, "--out", "run2.h5", "--figs", "L"], "--figs L is"),
    "search, the default figure folder dangling": (["search", *_FIGS, "--out", "x.h5"], "figure folder x-figs"),
    "plot, --out dangling": (["plot", "run.h5", "--out", "L"], "--out L is"),
    "plot, a folder of --out a loop": (["plot", "run.h5", "--out", "loop/figs"], "its folder loop"),
    "report, a folder of --out a loop": (["report", "run.h5", "--out", "loop/page.html"], "its folder loop"),
    "report, --out dangling": (["report", "run.h5", "--out", "L"], "--out L is"),
}


@pytest.mark.parametrize("case", list(_LINKED_OUTPUTS))
def test_an_output_through_a_link_that_leads_nowhere_names_the_link(case, rec, tmp_path, monkeypatch, capsys):
    """``--out`` (or the figure folder) through a symbolic link that leads nowhere, a dangling one or a loop, itself
    or as one of its folders: the lines were "cannot write the record under .../L: File exists", "cannot create the
    figure folder L: File exists", "File exists (loop)", "--out L exists and is not a regular file", none naming the
    link, nor what to do. The line names the link, where it leads and the way out; nothing is created."""
    monkeypatch.chdir(tmp_path)
    os.symlink("gone/nowhere", "L")  # dangling
    os.symlink("x-gone", "x-figs")
    os.symlink("loop", "loop")  # a loop
    argv, needle = _LINKED_OUTPUTS[case]
    line = refused(argv, tmp_path, needle, capsys)
    assert "symbolic link to" in line and ("a loop of links" if "loop" in case else "which does not exist") in line, line
    assert "remove the link" in line, line


@pytest.mark.parametrize("argv, needle", [
    (["search", "--out", "-x.h5"], "write --out=-x.h5"),
    (["search", "--figs", "-figs", "--out", "run.h5"], "write --figs=-figs"),
    (["plot", "run.h5", "--out", "-figs"], "write --out=-figs"),
    (["plot", "run.h5", "-b.h5", "--out", "figs"], "write ./-b.h5"),
    (["report", "-r.h5", "--out", "page.html"], "write ./-r.h5"),
])
def test_a_value_that_begins_with_a_dash_says_how_to_give_it(argv, needle, rec, tmp_path, monkeypatch, capsys):
    """A file named ``-x.h5`` is read by argparse as an option: the line said "argument --out: expected one argument"
    (one was given), or for ``nasdiag report -r.h5 --out page.html`` that the record, given, was required. It says
    that the value begins with - and how to give it (``--out=-x.h5``, ``./-r.h5``)."""
    monkeypatch.chdir(tmp_path)
    line = refused(argv, tmp_path, needle, capsys)
    assert "begins with - and is read as an option" in line, line


def test_the_dash_value_given_as_told_runs(rec, tmp_path, monkeypatch, capsys):
    """The way the line gives works: ``--out=-x.h5`` records to the file ``-x.h5``, ``./-r.h5`` is read."""
    monkeypatch.chdir(tmp_path)
    assert main(["search", *TINY, "--out=-x.h5"]) == 0
    os.replace("run.h5", "-r.h5")
    assert main(["report", "./-r.h5", "--out", "page.html"]) == 0
    capsys.readouterr()
    assert os.path.isfile("-x.h5") and os.path.isfile("page.html")


def test_negative_numbers_and_unknown_options_get_no_dash_hint(tmp_path, monkeypatch, capsys):
    """A negative number is a value (its own range check speaks), and the value of an unknown option is not the
    mistake: neither gets the hint."""
    monkeypatch.chdir(tmp_path)
    assert "begins with -" not in refused(["search", *TINY, "--seed", "-1"], tmp_path, "seed must be", capsys)
    line = refused(["search", "--bogus", "-x"], tmp_path, "unrecognized arguments: --bogus -x", capsys)
    assert "begins with -" not in line, line


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A run of two epochs, the second resumed: its rows lie in run.h5 and run.seg0001.h5."""
    folder = tmp_path_factory.mktemp("resumed")
    assert main(["search", *TINY, "--out", str(folder / "run.h5")]) == 0
    assert main(["search", *TINY, "--epochs", "2", "--out", str(folder / "run.h5"), "--resume"]) == 0
    return folder


def test_a_record_renamed_without_its_segments_is_not_read_as_a_shorter_run(resumed, tmp_path, monkeypatch, capsys):
    """``mv run.h5 lr01.h5`` (naming a run after its settings) leaves run.seg0001.h5 behind: plot and report drew
    lr01.h5 as a run that ended at its first resume, without a word, and its --resume was "its checkpoint lr01.h5.ckpt
    is missing; start again with --force" (which replaces it). Each says the record was renamed without its later
    segments, and doing what the line says reads every row."""
    import shutil

    from nasdiag.record import load

    capsys.readouterr()
    for f in resumed.iterdir():
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.chdir(tmp_path)
    steps = load("run.h5")["step"].tolist()
    assert os.path.exists("run.seg0001.h5") and steps == list(range(1, len(steps) + 1))
    os.rename("run.h5", "lr01.h5")
    needle = "lr01.h5 is the first file of the record run.h5, renamed without its later segments (run.seg0001.h5"
    for argv in (["plot", "lr01.h5", "--out", "figs"], ["report", "lr01.h5", "--out", "page.html"],
                 ["search", *TINY, "--epochs", "3", "--out", "lr01.h5", "--resume"]):
        line = refused(argv, tmp_path, needle, capsys)
        assert "rename each run.segNNNN.h5 to lr01.segNNNN.h5 (and run.h5.ckpt to lr01.h5.ckpt" in line, line
    os.rename("run.seg0001.h5", "lr01.seg0001.h5")  # as the line says
    os.rename("run.h5.ckpt", "lr01.h5.ckpt")
    assert load("lr01.h5")["step"].tolist() == steps
    assert main(["search", *TINY, "--epochs", "3", "--out", "lr01.h5", "--resume"]) == 0


def test_a_record_next_to_the_segments_of_another_run_is_read(resumed, tmp_path, capsys):
    """Segments of another run in the same folder (another run id) say nothing about a record: it is drawn."""
    import shutil

    for f in resumed.iterdir():
        shutil.copy(f, tmp_path / f.name)
    assert main(["search", *TINY, "--out", str(tmp_path / "other.h5")]) == 0
    assert main(["report", str(tmp_path / "other.h5"), "--out", str(tmp_path / "page.html")]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("argv, needle", [
    (["search", *TINY, "--out=~/run.h5"], "write --out ~/run.h5 (a space, not =)"),
    (["search", *_FIGS, "--out", "run.h5", "--figs=~/figs"], "write --figs ~/figs (a space, not =)"),
    (["search", *TINY, "--dataset", "cifar10", "--data-dir=~/cifar", "--out", "run.h5"], "write --data-dir ~/cifar"),
    (["plot", "~/run.h5", "--out", "figs"], "write ~/run.h5 unquoted"),
    (["report", "run.h5", "--out=~/page.html"], "write --out ~/page.html (a space, not =)"),
])
def test_a_tilde_the_shell_left_as_is_is_not_a_folder_named_tilde(argv, needle, tmp_path, monkeypatch, capsys):
    """The shell expands ``~`` only in a word of its own: ``--out=~/run.h5`` reaches nasdiag as is, and the search made
    a folder named ``~`` in the current one and printed "record: ~/run.h5", as if the record were in the home folder
    (where it was not). Refused in one line naming the way to write it and the full path; nothing is created."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    line = refused(argv, tmp_path, needle, capsys)
    assert "the shell expands only in a word of its own" in line and str(home) in line, line


def test_a_folder_really_named_tilde_is_taken(tmp_path, monkeypatch, capsys):
    """Where a folder named ``~`` exists in the current one, ``--out=~/run.h5`` means it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "~").mkdir()
    assert main(["search", *TINY, "--out=~/run.h5"]) == 0
    capsys.readouterr()
    assert (tmp_path / "~" / "run.h5").is_file()


@pytest.mark.parametrize("script, argv, option", [
    ("xnas_toys", ["--out=~/figs"], "--out"),
    ("make_readme_figures", ["--plot-only", "--runs=~/runs"], "--runs"),
    ("bayes_compression", ["--out=~/figs", "--seed", "0"], "--out"),
])
def test_a_script_path_with_a_tilde_the_shell_left_is_refused(script, argv, option, tmp_path, monkeypatch, capsys):
    """The batch scripts took ``--out=~/figs`` as a folder named ``~`` in the current one; one line, nothing made."""
    import importlib

    from nasdiag.errors import run_script
    from test_cli_errors import snapshot

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    code = run_script(script, importlib.import_module(script).main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"write {option} ~/" in err[0] and str(tmp_path / "home") in err[0], err
    assert snapshot(tmp_path / "work") == {}  # (matplotlib may make its cache under the home folder)


def test_resume_help_names_what_may_change_and_it_may(tmp_path, capsys):
    """``--resume``'s help said only "(same settings)": a user could not tell that --device, --engine or --threads
    may change (and may have refused to resume a CPU run on a GPU). It names them, each option the help says must
    match is compared, and each it says may change is accepted."""
    from nasdiag.cli import _parser
    from nasdiag.search.config import RECORD_DEFINING, RUN_DEFINING

    actions = {a.dest: a for a in _parser().commands["search"]._actions}
    text = actions["resume"].help
    may = text.split(" may change")[0].rsplit("; ", 1)[1]
    for option in ("--device", "--engine", "--threads"):
        assert option in may and actions[option[2:]].dest not in RUN_DEFINING + RECORD_DEFINING, (option, text)
    for option in ("--diagnostics", "--hessian-mode", "--spectrum-every"):
        assert option in text.split(" must match")[0] and option[2:].replace("-", "_") in RECORD_DEFINING
    out = tmp_path / "run.h5"
    assert main(["search", *TINY, "--out", str(out)]) == 0
    refused(["search", *TINY, "--epochs", "2", "--out", str(out), "--resume", "--order", "conv-bn-relu"], tmp_path,
            "order='conv-bn-relu' (recorded 'relu-conv-bn')", capsys)
    assert main(["search", *TINY, "--epochs", "2", "--out", str(out), "--resume", "--engine", "eager"]) == 0
    capsys.readouterr()
