"""A ninth new user's misuse of the ``nasdiag`` CLI and of the batch scripts: what rounds 1-8 (test_cli_errors.py,
test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..8.py) did not cover: paths at the file
system's limits (a record name too long for the files kept next to it, a folder path past PATH_MAX, a level of the
folder too long), for search and report; a newline in a file name in the commands printed; an empty unknown argument;
Ctrl-C while torch imports NumPy; a file name that is not UTF-8; RANK=00; an empty ``--hp`` value; the types
``nasdiag methods`` shows; the figures of a run replaced by ``--force``, and an interrupt before it replaced the
record; the wiring scripts' --data-dir without --dataset cifar10; the options of a run given to a script with
--plot-only; the benchmark scripts' numbers and names. Every mistake is one line on stderr, exit code 2, and leaves
the folder as it was (`refused` compares sha256s)."""

from __future__ import annotations

import os
import sys

import pytest

from test_cli_errors import TINY
from test_cli_misuse_round7 import test_a_script_argument_is_refused_in_one_line_before_any_work as script_refused
from test_cli_plot_misuse import rec, refused, source  # noqa: F401 (fixtures)

NAME_MAX = os.pathconf("/", "PC_NAME_MAX")  # 255 on Linux file systems
PATH_MAX = os.pathconf("/", "PC_PATH_MAX")  # 4096

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))


def _search(out, *extra):
    return ["search", *TINY, "--out", str(out), *extra]


# -- paths at the file system's limits ------------------------------------------------------------------------
@pytest.mark.parametrize("spare", [0, 3])
def test_a_record_name_too_long_for_the_files_next_to_it_is_refused_before_any_file(spare, tmp_path, capsys):
    """nasdiag keeps ``<out>.lock``, ``<out>.ckpt``, ``<out>.ckpt.tmp`` and, from the first segment roll-over on,
    ``<root>.seg0001<ext>.tmp`` next to the record: 12 bytes more than its name. A name that fits but whose
    ``.ckpt.tmp`` does not (``spare`` 3: 247 bytes) made the record, then stopped with "File name too long": a record
    of no rows left behind, so the same command was then refused as "a record already exists". One that fits all but
    the segment (``spare`` 0: 244 bytes) ran until the first roll-over (a new path recorded at an epoch end)."""
    name = "r" * (NAME_MAX - 12 + 1 + spare - 3) + ".h5"  # + 12 is one byte over the limit (+ spare more)
    assert len(name) + len(".ckpt.tmp") <= NAME_MAX or spare  # spare 0: every file but the segment's fits
    line = refused(_search(tmp_path / name), tmp_path, ["is too long", ".seg0001.h5.tmp next to it",
                                                          f"more than the {NAME_MAX}", "choose a shorter --out"], capsys)
    assert "Traceback" not in line


def test_a_record_folder_past_the_longest_path_leaves_no_folder(tmp_path, capsys):
    """``--out`` in a folder path longer than PATH_MAX (levels of 200 characters each): the recorder's makedirs made
    the first levels, then failed ("cannot create folder ... File name too long") and left them behind."""
    levels = (PATH_MAX // 200) + 2
    out = tmp_path.joinpath(*["d" * 200] * levels, "run.h5")
    refused(_search(out), tmp_path, ["is too long", f"more than the {PATH_MAX - 1} allowed"], capsys)


@pytest.mark.parametrize("option", ["--out", "--figs"])
def test_a_folder_level_too_long_leaves_no_folder(option, tmp_path, capsys):
    """``--out a/<300 characters>/run.h5``: the check before the run made and removed only ``a``; the recorder then
    made ``a`` and failed on the next level, leaving ``a`` behind (the figure folder likewise)."""
    folder = tmp_path / "a" / ("d" * (NAME_MAX + 45)) / "b"
    argv = _search(folder / "run.h5") if option == "--out" else [
        *[t for t in _search(tmp_path / "run.h5") if t != "--no-figs"], "--figs", str(folder)]
    refused(argv, tmp_path, [f"cannot write the {'record' if option == '--out' else 'figures'} under",
                             "name too long"], capsys)


@pytest.mark.parametrize("where", ["level", "page"])
def test_a_report_that_cannot_be_written_leaves_no_folder(where, rec, tmp_path, capsys):
    """``nasdiag report RUN.h5 --out a/<300 characters>/r.html`` made ``a``, failed on the next level and left ``a``;
    a page name that does not fit left every folder made for it. (A page name that fits is written, round 16: its
    temporary file no longer repeats a name near the limit.)"""
    out = (tmp_path / "a" / ("d" * (NAME_MAX + 45)) / "r.html" if where == "level"
           else tmp_path / "a" / "b" / ("p" * (NAME_MAX - 4) + ".html"))
    refused(["report", rec, "--out", out, "--figures", "scalars", "--dpi", "20"], tmp_path, "name too long", capsys)


# -- the command line -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,shown", [([""], "''"), (["--epochs", "1", " "], "' '"), (["a b"], "'a b'")])
def test_an_empty_or_spaced_unknown_argument_is_shown_quoted(extra, shown, tmp_path, capsys):
    """``nasdiag search ... "$EXTRA"`` with EXTRA unset: "unrecognized arguments:  (see ...)", naming nothing. The
    unknown arguments are shown as a shell would need them, and an empty one is said to be one."""
    line = refused(_search(tmp_path / "run.h5", *extra), tmp_path, f"unrecognized arguments: {shown} (see", capsys)
    assert ("an empty argument ('')" in line) == (not extra[-1].strip()), line



def test_ctrl_c_while_torch_imports_numpy_exits_130_in_one_line(tmp_path):
    """Ctrl-C in the first second of ``nasdiag search`` could land while torch's C module imported NumPy: torch goes on
    without NumPy when that import fails, so the KeyboardInterrupt was lost and the search went on with a half-imported
    NumPy, to fail on it ("AttributeError: module 'numpy' has no attribute 'nonzero'", a traceback, exit code 1). The
    interrupt is made to land at one module of NumPy's import (a finder that raises it), in a fresh interpreter."""
    import subprocess

    code = (
        "import sys\n"
        "class Interrupt:\n"
        "    fired = False\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'numpy.matrixlib.defmatrix' and not Interrupt.fired:\n"
        "            Interrupt.fired = True\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "from nasdiag.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    done = subprocess.run([sys.executable, "-c", code, *_search(tmp_path / "run.h5")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 130 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0] == "nasdiag: interrupted before anything was recorded; run the command again (without --resume)"
    assert not list(tmp_path.iterdir())



@pytest.mark.parametrize("value", ["00", "+0", " 0 "])
def test_a_rank_variable_naming_rank_0_another_way_is_one_process(value, tmp_path, monkeypatch, capsys):
    """``RANK=00`` is rank 0 to the recorder (``int``), but the launch check compared the text with "0" and refused
    the run: "a single process would record nothing (only rank 0 writes)", which was not so."""
    from nasdiag.cli import main
    from nasdiag.record import load

    monkeypatch.setenv("RANK", value)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run.h5"
    assert main(_search(out)) == 0, capsys.readouterr().err
    assert len(load(str(out))["step"]) > 0



def test_a_file_name_that_is_not_utf8_is_printed_as_its_bytes(rec, tmp_path):
    """A record named in Latin-1 (``$'\\xff.h5'``) reaches Python as surrogates; a strict UTF-8 standard output (any
    locale but C, here PYTHONIOENCODING=utf-8) refused them: a UnicodeEncodeError traceback and exit code 1 once the
    figures were drawn (plot, the batch scripts), the run done (search), and the page could not be written (report)."""
    import subprocess

    name = os.fsdecode(b"\xff.h5")
    record = tmp_path / name
    os.rename(rec, record)
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONIOENCODING": "utf-8"}
    for argv in (["plot", str(record), "--out", str(tmp_path / os.fsdecode(b"\xfe")), "--figures", "scalars", "--dpi",
                  "20", "--no-progress"],
                 ["report", str(record), "--out", str(tmp_path / os.fsdecode(b"\xfe.html")), "--figures", "scalars",
                  "--dpi", "20"]):
        done = subprocess.run([sys.executable, "-m", "nasdiag", *argv], capture_output=True, env=env, timeout=300)
        assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr[-1500:]
        assert os.fsencode(str(record)) in done.stdout or b"\xfe.html" in done.stdout, done.stdout
    assert (tmp_path / os.fsdecode(b"\xfe") / "scalars.png").exists() and (tmp_path / os.fsdecode(b"\xfe.html")).exists()
    script = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "xnas_toys.py")  # a batch script prints its
    done = subprocess.run([sys.executable, script, "--out", str(tmp_path / os.fsdecode(b"\xfd"))], capture_output=True,
                          env=env, timeout=300)  # figures' paths the same way (through run_script)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr[-1500:]
    assert b"\xfd/fig" in done.stdout, done.stdout


# -- hyperparameters ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,item", [("xnas", "reward_bound="), ("xnas", "reward_bound= "), ("darts", "w_lr=")])
def test_an_empty_hyperparameter_value_is_refused(method, item, tmp_path, capsys):
    """``--hp reward_bound=$L`` with L unset: an Optional hyperparameter took the empty value for None, its default,
    and the run went on as if the option were not given (a float one was refused only as "must be of type float")."""
    key = item.split("=")[0]
    refused(_search(tmp_path / "run.h5", "--method", method, "--hp", item), tmp_path,
            [f"--hp {key}= gives no value", f"leave --hp {key} out"], capsys)


def test_nasdiag_methods_names_the_type_a_hyperparameter_takes(capsys):
    """``nasdiag methods`` listed ``reward_bound: Optional = None`` and ``alpha_betas: Tuple = (0.5, 0.999)``: typing's
    bare names, which say neither that a number is wanted nor how many. Each type shown is one the value parses as."""
    import typing

    from nasdiag.cli import main
    from nasdiag.search.registry import available_methods

    assert main(["methods"]) == 0
    listing = capsys.readouterr().out
    assert not any(f": {bare} =" in listing for bare in ("Optional", "Tuple", "Union")), listing
    shown = {"reward_bound": "float or None", "alpha_betas": "(float, float)"}
    for name, cls in available_methods().items():
        hints = typing.get_type_hints(cls.Hyperparameters)
        for field in cls.Hyperparameters.keys():
            if field in shown:
                assert f"    {field}: {shown[field]} = " in listing, (name, field)
            else:  # a plain type, shown by its name
                assert f"    {field}: {hints[field].__name__} = " in listing, (name, field)
    xnas, darts = available_methods()["xnas"].Hyperparameters, available_methods()["darts"].Hyperparameters
    assert xnas.parse(["reward_bound=0.5"]).reward_bound == 0.5 and xnas.parse(["reward_bound=none"]).reward_bound is None
    assert darts.parse(["alpha_betas=0.4,0.9"]).alpha_betas == (0.4, 0.9)


# -- --force -------------------------------------------------------------------------------------------------------
def test_a_forced_run_leaves_no_figure_of_the_run_it_replaced(tmp_path, capsys):
    """``--force`` replaces a record and the leftover files of its run, but the figures of the replaced run stayed in
    the figure folder: after an XNAS run replaced by a DARTS run, ``regret_bound_normal.png``, ``wipeouts_*.png`` and
    ``alive_experts_*.png`` lay next to the DARTS figures, as if drawn from its record. A file of the user's (not
    named as a figure) is kept."""
    from nasdiag.cli import main

    out, figs = tmp_path / "run.h5", tmp_path / "figs"
    tiny = [t for t in TINY if t != "--no-figs"]
    assert main(["search", *tiny, "--method", "xnas", "--out", str(out), "--figs", str(figs)]) == 0
    before = {p.name for p in figs.iterdir()}
    assert {"regret_bound_normal.png", "wipeouts_reduce.png"} <= before, before  # what only XNAS draws
    (figs / "notes.txt").write_text("mine\n")
    assert main(["search", *tiny, "--method", "darts", "--out", str(out), "--figs", str(figs), "--force"]) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]  # "figures: FOLDER (N files)"
    now = {p.name for p in figs.iterdir()} - {"notes.txt"}
    assert said == f"figures: {figs} ({len(now)} files)", (said, sorted(now))
    assert not any(n.startswith(("regret", "wipeouts", "alive_experts")) for n in now), sorted(now)
    assert (figs / "notes.txt").read_text() == "mine\n"



@pytest.mark.parametrize("replaced", [False, True])
def test_an_interrupt_before_force_replaced_the_record_says_to_run_the_command_again(replaced, tmp_path, capsys,
                                                                                    monkeypatch):
    """Ctrl-C early in ``nasdiag search --method xnas --out run.h5 --force`` over a DARTS record: the line said "the
    record holds every completed step: continue it with nasdiag search --method xnas ... --resume", which continues
    (or is refused for) the DARTS run that --force was to replace. Once the record is replaced, the resume command is
    right, and still given."""
    import nasdiag.search
    from nasdiag.cli import main

    out = tmp_path / "run.h5"
    out.write_bytes(b"stands in for the record of the run to replace")

    def interrupted(config, callbacks=()):
        if replaced:
            out.write_bytes(b"stands in for the new record")  # another file: what the recorder's overwrite makes
        raise KeyboardInterrupt

    monkeypatch.setattr(nasdiag.search, "run", interrupted)
    assert main(_search(out, "--method", "xnas", "--force")) == 130
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    if replaced:
        assert "continue it with nasdiag search" in lines[0] and lines[0].endswith("--resume"), lines
    else:
        assert lines[0] == (f"nasdiag: interrupted before --force replaced the record at {out}, which is as it was; "
                            "run the command again"), lines


# -- a newline in a file name ------------------------------------------------------------------------------------
def _bash_words(command: str) -> list:
    """The words bash makes of ``command`` (an independent reader of the quoting nasdiag prints)."""
    import subprocess

    done = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, check=True)
    return [w.decode() for w in done.stdout.split(b"\0")[:-1]]


@pytest.mark.parametrize("name", ["a\nb.h5", "it's a\tb\\c.h5"])
def test_the_resume_command_of_a_record_named_with_a_newline_is_one_line_bash_reads_back(name, tmp_path, capsys,
                                                                                      monkeypatch):
    """shlex.quote keeps a newline as is: after Ctrl-C, the line with the command that resumes the run took two lines
    on stderr. The command is one line, and bash reads back the arguments given (the record path included)."""
    import nasdiag.search
    from nasdiag.cli import _parse, main

    out = tmp_path / name

    def interrupted(config, callbacks=()):
        out.write_bytes(b"stands in for the record of this run")  # written by this run (one there before: round 19)
        raise KeyboardInterrupt

    monkeypatch.setattr(nasdiag.search, "run", interrupted)
    assert main(_search(out)) == 130
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    words = _bash_words(lines[0].split("continue it with nasdiag ", 1)[1])
    assert words == [*_search(out), "--resume"]
    assert _parse(words).out == str(out)


def test_options_before_the_command_are_given_back_with_a_newline_kept(tmp_path, capsys):
    """The corrected command in the refusal of options put before the command went through the one-line error, which
    turned the newline of ``--out`` into a space: a command naming another file."""
    out = str(tmp_path / "a\nb.h5")
    line = refused(["--epochs", "1", *_search(out)], tmp_path, "options go after it", capsys)
    words = _bash_words(line.split("options go after it: nasdiag ", 1)[1])
    assert words == ["search", "--epochs", "1", *_search(out)[1:]]


# -- the batch scripts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("script,argv,needle", [  # before: what the mistake did
    ("wiring_cost_heatmaps", ["--data-dir", "cifar-10-batches-py", "--configs", "minimal1", "--epochs", "1"],
     "--data-dir cifar-10-batches-py is only read with --dataset cifar10, not digits"),  # ran on digits, exit 0
    ("wiring_variants", ["--data-dir", "cifar-10-batches-py", "--variants", "layer", "--epochs", "1"],
     "--data-dir cifar-10-batches-py is only read with --dataset cifar10"),  # the same
    ("wiring_output_cost", ["--data-dir", "cifar-10-batches-py", "--epochs", "1"],
     "--data-dir cifar-10-batches-py is only read with --dataset cifar10"),  # the same
    ("wiring_output_cost", ["--dataset", "cifar10", "--epochs", "1"], "--dataset cifar10 needs --data-dir"),  # left --out
    ("wiring_output_cost", ["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar", "--epochs", "1"],
     "does not exist"),  # left an empty --out folder
])
def test_a_script_data_option_is_refused_in_one_line_before_any_work(script, argv, needle, tmp_path, capsys):
    script_refused(script, argv, needle, tmp_path, capsys)  # round 7's check: exit 2, one line, the folder as it was


@pytest.mark.parametrize("script,argv,needle", [  # before: each ran, redrew the old figures and exited 0
    ("xnas_toys", ["--plot-only", "--lr", "0.5"], "--lr does nothing with --plot-only"),
    ("xnas_statistical", ["--plot-only", "--n-grid", "2,4", "--threads", "1"], "--n-grid, --threads do nothing with"),
    ("wiring_cost_heatmaps", ["--plot-only", "--configs", "minimal1", "--epochs", "3"], "--epochs does nothing with"),
    ("wiring_variants", ["--plot-only", "--variants", "layer", "--data-dir", "d"], "--data-dir does nothing with"),
    ("wiring_output_cost", ["--plot-only", "--prot", "darts"], "--protocol does nothing with"),  # a prefix, as argparse
    ("wiring_evolution", ["--plot-only", "--methods", "dsnas", "--seed", "1"], "--seed does nothing with"),
    ("asmnas_stability", ["--plot-only", "--seeds", "5"], "--seeds does nothing with"),
    ("make_readme_figures", ["--plot-only", "--engine", "eager"], "--engine does nothing with"),
    ("sparsenas_digits", ["--plot-only", "--lambdas", "1e-4"], "--lambdas does nothing with"),
])
def test_an_option_of_the_run_with_plot_only_is_refused(script, argv, needle, tmp_path, capsys):
    """``--plot-only`` redraws from the records of an earlier run: the options that shape a run (``--lr``, ``--epochs``,
    ``--threads``, ...) were accepted and silently ignored, so ``xnas_toys.py --plot-only --lr 0.5`` drew the figures
    of the old learning rate under a command naming the new one."""
    script_refused(script, argv, needle, tmp_path, capsys)


@pytest.mark.parametrize("script,argv", [
    ("xnas_toys", ["--format", "svg"]),
    ("wiring_cost_heatmaps", ["--con", "minimal1", "--format", "pdf"]),
    ("wiring_evolution", ["--methods", "dsnas"]),
    ("wiring_variants", ["--variants", "layer"]),
    ("make_readme_figures", ["--runs", "r", "--dpi", "50"]),
    ("asmnas_stability", []),
])
def test_the_options_that_act_on_the_figures_are_taken_with_plot_only(script, argv):
    """What a redraw reads (the folders, the format, the records to redraw) is still taken with ``--plot-only``."""
    import importlib

    args = importlib.import_module(script).parse_args(["--plot-only", "--out", "o", *argv])
    assert args.plot_only and args.out == "o"


@pytest.mark.parametrize("script,argv,needle", [  # before: what the mistake did
    ("bench_cost", ["--iters", "0"], "--iters: must be at least 1, not 0"),  # StatisticsError traceback after the runs
    ("bench_cost", ["--batch", "0"], "--batch: must be at least 1"),  # torch's reshape RuntimeError traceback
    ("bench_cost", ["--threads", "-1"], "--threads: must be at least 0"),  # set_num_threads' RuntimeError traceback
    ("bench_cost", ["--device", "gpu"], "--device: is not a device"),  # torch.device's RuntimeError traceback
    ("bench_cost", ["--C", "3"], "--C: must be even"),  # the supernet's ValueError traceback
    ("bench_methods", ["--repeats", "0"], "--repeats: must be at least 1"),  # StatisticsError traceback after the runs
    ("bench_methods", ["--methods", "darts,dart"], "unknown method 'dart'"),  # ConfigError traceback after darts was built
    ("bench_search", ["--sections", "bogus"], "unknown section 'bogus'; choose from darts,"),  # timed nothing, exit 0
    ("bench_search", ["--sections", " , "], "names no section"),  # the same
    ("bench_hessian", ["--sections", "speed,bogus"], "unknown section 'bogus'; choose from speed,"),  # bogus skipped
    ("bench_hessian", ["--repeat", "0"], "--repeat: must be at least 1"),
    ("bench_hessian", ["--scaling-widths", "64,abc"], "--scaling-widths: takes a whole number, not 'abc'"),
    ("bench_hessian", ["--conv-width", "nan"], "--conv-width: must be a finite number"),
    ("curvature_residual", ["--sketch", "abc"], "--sketch: takes a whole number"),  # SystemExit after minutes of work
    ("kill_resume_trials", ["--trials", "0"], "--trials: must be at least 1"),  # "0 trials", exit 0
    ("bench_record", ["--dir", "notes.txt"], "--dir notes.txt is not a folder"),  # NotADirectoryError traceback
])
def test_a_benchmark_argument_is_refused_in_one_line_before_any_work(script, argv, needle, tmp_path, capsys,
                                                                    monkeypatch):
    """The benchmark and study scripts took any integer and name: a count of 0 was a traceback after the timed runs, an
    unknown section was skipped (with --sections bogus nothing was timed, exit 0), a bad device torch's traceback."""
    import importlib

    from nasdiag.errors import run_script

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("a file\n")
    code = run_script(script, importlib.import_module(script).main, argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: ") and needle in lines[0], lines
    assert out == "" and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
