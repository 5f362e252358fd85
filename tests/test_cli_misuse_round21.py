"""A twenty-first new user's misuse of the ``nasdiag`` CLI, armed with README.md, ``--help`` and ``nasdiag methods``:
what rounds 1-20 (test_cli_errors.py, test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..20.py,
test_scripts_misuse_round14.py) did not cover: ``nasdiag search --out log.h5 --force`` over an HDF5 file of another
program that holds a ``/step`` column (a training log's common name) but none of a record's other parts took it for a
damaged record and replaced it, exit code 0, where README says --force refuses "another HDF5 file" (plot and report told
the user to remove or rename it); so did ``--force`` over an HDF5 file another program holds open to write (HDF5's file
lock kept nasdiag from looking inside); ``--out=-run.h5`` (the form its refusal of ``--out -run.h5`` asks for) stopped
while drawing its figures gave "nasdiag plot -run.h5 --out -run-figs", a command refused; a Ctrl-C (or SIGTERM, SIGHUP)
during ``nasdiag report`` that matplotlib's pybind11 turned into its "TypeError: incompatible function arguments" was a
traceback, exit code 1, and one raised in a finalizer was printed as "Exception ignored ... KeyboardInterrupt" and lost;
``--out "run.h5 "`` (white space inside the quotes, or a name read with its newline) wrote a record that looks like
run.h5, exit code 0, and plot's ``--out "figs "`` such a folder; a record path ending in / after the file (``run.h5/``)
was told to give run.h5/run.h5 (search) or "no record at run.h5/" (plot, report).
Every such mistake is one line on stderr saying what was wrong and what to do, exit code 2 (130/143/129 for a signal),
no traceback, nothing left behind.

Checked and found right (not repeated as tests, run as a user in a shell or in-process): ``nasdiag methods`` as a contract:
every hyperparameter of every method given at the default it prints (``--hp optimizer=adamhapg``, ``reward_bound=None``,
``"alpha_betas=(0.5, 0.999)"``, ``first_order=False``) runs and ends in the record's meta ``hp`` with that value; an int
key given 1.5, 1.0, 1e1 (one line), 0x10, 010, 1_0, -0, Arabic-Indic digits (Python's int); a bool key given yes, 1, TRUE
(True), 2, None, '' (one line); a float key given 1e-3 (taken), inf, -inf, nan, 0x10 (one line); hyperparameters at the
ends of their printed ranges (w_momentum=1, alpha_betas=0,0, sgl_alpha=0/1, tau_decay=1 with tau_min=1, zeta=1e-30,
attention_hidden=1); --out and --seed given twice (the last, as README says); empty values of every path option; --out
through a file, a folder, a dangling link, in /sys (read-only); --figs a file, through a file, a folder of other files;
plot/report --dpi 0/14/1e3/150.5, --figures ''/,/twice, --at ''/-1/init,init, --format PNG/jpg, --out the record, its
checkpoint, a file, through a file, a dangling link; plot and report of a text file named .h5, an empty file, an HDF5
file of other groups, and copies of a real record cut every 4 KiB (one line each, or drawn from the rows intact);
SIGINT at five moments of a search (before the record, while drawing: one line each, the plot command given works);
an interrupt at step 4 of 6 then --resume equal, array by array, to an uninterrupted run (float64, cost and Hessian
diagnostics) for bayesnas (update_every=1), xnas, snas, sparsenas (adamhapg and hapg), asmnas, darts2 and proxyless;
Ctrl-C at 30 random moments of nasdiag report (one line, exit 130, no temporary file left).

Left alone: a figure folder that ``nasdiag plot`` (or a search's default --figs: a.h5 and a.hdf5 share a-figs) drew the
figures of one run into keeps them when another run's are drawn there: the figures of families the second run lacks
stay beside its own (the figures carry no run identity; README says plot redraws in place what it drew); a search
stopped while drawing its figures prints no genotype (the record holds the run; report shows it); ``report --out
notes.h5`` of a text file calls it "an HDF5 file (a record?)" (refused for its name); an unparsable bool or int
hyperparameter is "must be of type bool, got 'Y'", without the accepted spellings; ``--figures scalars,scalars`` draws
once where ``--at init,init`` is refused; a checkpoint is read with torch.load(weights_only=False) (a pickle: a
checkpoint from elsewhere runs its code).
"""

from __future__ import annotations

import pytest

from test_cli_errors import TINY, snapshot


def _foreign_log(path) -> None:
    """Another program's HDF5 log: a /step column and a loss, no nasdiag header, no /present."""
    import h5py
    import numpy as np

    with h5py.File(path, "w") as f:
        f.create_dataset("step", data=np.arange(5, dtype=np.int64))
        f.create_dataset("scalars/val_loss", data=np.linspace(2.0, 1.0, 5))
        f.attrs["creator"] = "my own trainer"


@pytest.mark.parametrize("argv", [["search", *TINY, "--out", "log.h5", "--force"],
                                  ["search", *TINY, "--out", "log.h5", "--resume"],
                                  ["plot", "log.h5", "--out", "figs"],
                                  ["report", "log.h5", "--out", "log.html"]])
def test_another_programs_hdf5_log_with_a_step_column_is_never_replaced_nor_called_damaged(argv, tmp_path, monkeypatch, capsys):
    """``nasdiag search --out log.h5 --force`` over a user's own HDF5 log holding a ``/step`` dataset replaced it with
    a record, exit code 0 (the check "is it a record" looked for /step or /present, either); plot and report said "is
    not a nasdiag record segment (no /step or /present); remove or rename it". One line naming it another program's
    file, the file byte for byte as it was, nothing made."""
    from nasdiag.cli import main

    monkeypatch.chdir(tmp_path)
    _foreign_log(tmp_path / "log.h5")
    before = snapshot(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "log.h5" in err[0] and "is not a nasdiag record" in err[0] and "remove" not in err[0], err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("argv", [["search", *TINY, "--out", "held.h5", "--force"], ["plot", "held.h5", "--out", "figs"]])
def test_an_hdf5_file_another_program_holds_open_to_write_is_not_replaced(argv, tmp_path, monkeypatch, capsys):
    """An HDF5 file another program is writing (h5py.File(path, "a") open: HDF5's file lock taken) could not be
    opened to look inside, so it counted as a damaged record: ``nasdiag search --out held.h5 --force`` replaced it
    under the program writing it, exit code 0. It is read without the lock and named another program's file."""
    import subprocess
    import sys

    import h5py
    import numpy as np

    from nasdiag.cli import main

    monkeypatch.chdir(tmp_path)
    with h5py.File(tmp_path / "held.h5", "w") as f:
        f.create_dataset("x", data=np.arange(3.0))
    holder = subprocess.Popen([sys.executable, "-c", "import h5py, sys; f = h5py.File(sys.argv[1], 'a'); print('open', "
                               "flush=True); sys.stdin.read()", str(tmp_path / "held.h5")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(OSError):  # the premise: HDF5's lock keeps a reader out while the program writes
            h5py.File(tmp_path / "held.h5", "r").close()
        before = snapshot(tmp_path)
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert snapshot(tmp_path) == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "held.h5" in err[0] and "is not a nasdiag record" in err[0], err


def test_the_plot_command_given_after_an_interrupt_while_drawing_reads_a_record_named_with_a_leading_dash(tmp_path, monkeypatch,
                                                                                                          capsys):
    """``nasdiag search --out=-run.h5`` (the form its own refusal of ``--out -run.h5`` asks for) stopped by Ctrl-C
    while drawing its figures said "draw them with nasdiag plot -run.h5 --out -run-figs": that command is refused,
    -run.h5 read as an option. The command given reads the paths as paths, and draws the run's figures."""
    import shlex

    import nasdiag.plot
    from nasdiag.cli import main

    monkeypatch.chdir(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(nasdiag.plot, "write_figures", interrupted)
        code = main(["search", *[a for a in TINY if a != "--no-figs"], "--out=-run.h5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and len(err) == 1 and "draw them with nasdiag plot " in err[0], err
    argv = shlex.split(err[0].split("draw them with nasdiag ", 1)[1])
    assert main([*argv, "--no-progress", "--figures", "scalars"]) == 0, capsys.readouterr().err
    assert (tmp_path / "-run-figs" / "scalars.png").is_file()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One finished tiny search, its record read by the tests below (each copies what it changes)."""
    import contextlib
    import io

    from nasdiag.cli import main

    folder = tmp_path_factory.mktemp("run")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["search", *TINY, "--out", str(folder / "run.h5")]) == 0
    return folder / "run.h5"


def _interrupt_then(error, signum=None):
    """A stand-in for a command's work that a Ctrl-C (or ``signum``) reaches inside a C extension or a finalizer: the
    signal is delivered (the command's handler raising KeyboardInterrupt or its own), then ``error(that exception)``
    says what comes of it."""
    import signal

    def work(*args, **kwargs):
        try:
            signal.raise_signal(signal.SIGINT if signum is None else signum)
        except BaseException as exc:
            error(exc)
        return []

    return work


def _swallowed_into_type_error(exc):  # pybind11 (matplotlib's _path) clears it while matching overloads
    raise TypeError("affine_transform(): incompatible function arguments. The following argument types are supported: "
                    "...") from None


def _swallowed_by_a_finalizer(exc):  # raised in a weakref callback or __del__: "Exception ignored in ...", then on
    import time

    class Finalized:
        def __del__(self):
            raise exc

    Finalized()
    time.sleep(5)  # the command's work goes on


@pytest.fixture
def terminal_signals():
    """The dispositions a command typed at a terminal starts with (Python's Ctrl-C handler, SIGHUP's default): a test
    run in a background job (``cmd &``, ``nohup``) inherits SIGINT and SIGHUP ignored, and the CLI rightly leaves ignored
    signals alone. Restored afterwards."""
    import signal

    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGHUP)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGHUP, saved[1])


@pytest.mark.parametrize("command", ["plot", "report"])
@pytest.mark.parametrize("fate", [_swallowed_into_type_error, _swallowed_by_a_finalizer])
def test_a_ctrl_c_that_a_library_turns_into_another_error_or_swallows_is_still_an_interrupt(command, fate, finished_run, tmp_path,
                                                                                             monkeypatch, capsys,
                                                                                             terminal_signals):
    """Ctrl-C during ``nasdiag report`` (about one press in 30, at random moments) ended in matplotlib's pybind11
    "TypeError: affine_transform(): incompatible function arguments" traceback, exit code 1 (the interrupt raised while
    it converted an argument, which it then cleared), or printed "Exception ignored in: <function WeakKeyDictionary...>
    KeyboardInterrupt" and went on to exit 0 (raised in a finalizer, which Python ignores). Either is the interrupt:
    one line, exit code 130, nothing written."""
    import nasdiag.plot.registry
    import nasdiag.plot.report
    from nasdiag.cli import main

    monkeypatch.setattr(*(nasdiag.plot.report, "write_report") if command == "report" else (nasdiag.plot.registry, "draw_record"),
                        _interrupt_then(fate))
    monkeypatch.chdir(tmp_path)
    out = "page.html" if command == "report" else "figs"
    code = main([command, str(finished_run), "--out", out])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and err == ["nasdiag: interrupted"], (code, err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("signum,code,line", [("SIGTERM", 143, "nasdiag: terminated (SIGTERM)"),
                                              ("SIGHUP", 129, "nasdiag: hung up (SIGHUP)")])
def test_a_sigterm_that_a_library_turns_into_another_error_is_still_the_signal(signum, code, line, finished_run, tmp_path,
                                                                               monkeypatch, capsys, terminal_signals):
    """SIGTERM (or a hang-up) raised while pybind11 converts an argument becomes its TypeError as a Ctrl-C does: a
    traceback, exit code 1. It is the signal: its line and exit code, nothing written."""
    import signal

    import nasdiag.plot.report
    from nasdiag.cli import main

    monkeypatch.setattr(nasdiag.plot.report, "write_report", _interrupt_then(_swallowed_into_type_error, getattr(signal, signum)))
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(finished_run), "--out", "page.html"]) == code
    assert capsys.readouterr().err.strip().splitlines() == [line]
    assert list(tmp_path.iterdir()) == []


def _refused_beside_a_record(argv, finished_run, tmp_path, monkeypatch, capsys) -> str:
    """Run ``nasdiag argv`` in ``tmp_path`` holding a copy of the finished run as run.h5; assert exit code 2, one line,
    nothing changed; return the line."""
    import shutil

    from nasdiag.cli import main

    monkeypatch.chdir(tmp_path)
    shutil.copy(finished_run, tmp_path / "run.h5")
    before = snapshot(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert snapshot(tmp_path) == before
    return err[0]


@pytest.mark.parametrize("argv,said", [(["search", *TINY, "--out", "run.h5 "], "--out 'run.h5 ' ends with white space (a space)"),
                                       (["search", *TINY, "--out", "run.h5\n"], "ends with white space (a newline)"),
                                       (["search", *TINY, "--out", "r.h5", "--no-figs", "--figs", " figs"], None),
                                       (["plot", "run.h5 ", "--out", "figs"], "the record 'run.h5 ' ends with white space"),
                                       (["report", " run.h5", "--out", "r.html"], "the record ' run.h5' begins with white space"),
                                       (["plot", "run.h5", "--out", "figs "], "--out 'figs ' ends with white space")])
def test_a_path_with_white_space_around_it_is_named(argv, said, finished_run, tmp_path, monkeypatch, capsys):
    """``nasdiag search --out "run.h5 "`` (a space inside the quotes, or a name read with its newline) wrote its record
    as 'run.h5 ', exit code 0, a file that looks like run.h5 and that plot run.h5 then did not find; plot into "figs "
    made such a folder, and plot "run.h5 " said "no record at run.h5 ". One line naming the white space and the path to
    type, nothing made."""
    line = _refused_beside_a_record(argv, finished_run, tmp_path, monkeypatch, capsys)
    assert (said or "") in line and ("type run.h5" in line or "type figs" in line), line


@pytest.mark.parametrize("argv", [["search", *TINY, "--out", "run.h5/", "--resume"], ["plot", "run.h5/", "--out", "figs"],
                                  ["report", "run.h5/", "--out", "r.html"]])
def test_a_record_path_ending_in_a_slash_after_a_file_says_to_drop_it(argv, finished_run, tmp_path, monkeypatch, capsys):
    """``nasdiag search --out run.h5/ --resume`` was told to "pass the record's file path, such as run.h5/run.h5", a path
    under the record file; ``plot run.h5/`` and ``report run.h5/`` said "no record at run.h5/ (no file run.h5/ and no
    segments next to it)", the record there all along. One line: drop the /."""
    line = _refused_beside_a_record(argv, finished_run, tmp_path, monkeypatch, capsys)
    assert "drop the / and give run.h5" in line and "run.h5/run.h5" not in line, line
