"""A thirteenth new user's misuse of the ``nasdiag`` CLI and the batch scripts: what rounds 1-12 (test_cli_errors.py,
test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..12.py) did not cover: a batch script's
``--seed`` past what torch or sklearn take and ``--threads`` past the machine's CPUs; a CIFAR-10 ``--data-dir`` with a
batch cut short by an interrupted download or copy, or of the binary version; an ``--hp`` key of another method
(``--method`` forgotten) and several settings in one ``--hp``; ``--diagnostics None``, ``cost;hessian`` (and plot
``--figures cost;hessian``); ``--version`` after a command; a batch script's path option empty, its folder a file or
its ``--json`` unwritable, a wiring script's or benchmark's supernet too large for memory; ``--plot-only`` of a batch
script on the record of a run stopped or still writing (xnas_statistical, wiring_output_cost). Every such mistake is
one line on stderr saying what was wrong and what to do, exit code 2, no traceback, nothing left behind.

Checked and found right (not repeated as tests): every numeric option of search at 0, -1, nan, inf, 1e3, ' 5', '５'
(int() takes the unicode digit and the spaces: the same number), huge (--C 10**6 and --epochs 10**20 refused or run
as asked, --spectrum-every past the steps refused); --hp nan/inf/1e400/-1/empty key; --diagnostics with duplicates and
empty items; ambiguous prefixes (--d, --no: one line naming the candidates) and unique ones (--ep 3: taken, and
README now says so, and that an option given twice takes its last value); --hessian-mode hutchinson:1e3, :５, ': 4';
plot --at -1/0/nan/1e1/huge/''/final,final and --figures ''/,,/bogus; plot of one record twice; report --out of the
record, a folder, '', a page of the user's; plot and report of a record a running search writes (no rows yet: one
line; later: drawn); --help/--version with stdout closed (written to stderr, exit 0); search, plot, report, methods
and --help into a closed pipe (exit 141, nothing said); python -m nasdiag and the nasdiag entry point alike.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys

import numpy as np
import pytest

from nasdiag.cli import main
from test_cli_errors import TINY, refused, snapshot
from test_cli_plot_misuse import rec, source  # noqa: F401 (fixtures)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))  # the batch scripts


def _script(script, argv, tmp_path, capsys):
    """Run a batch script in-process as its command does; (exit code, stderr lines), the folder checked unchanged."""
    from nasdiag.errors import run_script

    before = snapshot(tmp_path)
    code = run_script(script, importlib.import_module(script).main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert snapshot(tmp_path) == before, err
    return code, err


@pytest.mark.parametrize("script,seed,largest", [
    ("bayes_compression", 2 ** 64, "99999999999999"),  # torch.manual_seed: "Overflow when unpacking long long"
    ("xnas_statistical", 2 ** 63, "99999999999999"),   # torch.Generator().manual_seed: the same
    ("sparsenas_digits", 2 ** 32, "4294967295"),      # sklearn's train_test_split(random_state=): InvalidParameterError
])
def test_a_script_seed_past_what_the_generators_take_is_one_line_before_any_work(script, seed, largest, tmp_path, capsys):
    """``--seed`` of the batch scripts took any whole number >= 0 (``nasdiag search --seed`` stops at MAX_SEED): past
    2**63 (sklearn: 2**32) the run stopped in a traceback, exit code 1, its output folder left behind."""
    out = tmp_path / "out"
    code, err = _script(script, ["--out", str(out), "--seed", str(seed)], tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"{script}: error: argument --seed: {seed} is too large") and largest in err[0], err
    assert not out.exists()


def test_a_script_seed_at_its_largest_is_taken():
    """The bound is the largest seed the run takes, not one below it: the parsers accept it."""
    from script_args import seed

    from nasdiag.search.config import MAX_SEED

    assert seed()(str(MAX_SEED)) == MAX_SEED and seed(2 ** 32 - 1)(str(2 ** 32 - 1)) == 2 ** 32 - 1
    import torch
    from sklearn.model_selection import train_test_split

    torch.Generator().manual_seed(MAX_SEED + 1)  # bench_search seeds a generator with seed + 1
    train_test_split(np.arange(10), test_size=0.2, random_state=2 ** 32 - 1)


@pytest.mark.parametrize("script,takes_out", [("bayes_compression", True), ("xnas_statistical", True),
                                              ("asmnas_stability", True), ("bench_cost", False)])
def test_a_script_thread_count_past_the_cpus_is_one_line_before_any_work(script, takes_out, tmp_path, capsys):
    """``--threads`` of the batch scripts took any count >= 1 (``nasdiag search --threads`` stops at the CPUs): torch was
    set to it, and ``--threads 100000`` made libgomp allocate 100000 thread stacks at the first parallel op ("libgomp:
    Out of memory", exit code 1) after the output folder was made."""
    cpus = os.cpu_count() or 1
    out = tmp_path / "out"
    code, err = _script(script, ["--out", str(out)] * takes_out + ["--threads", str(cpus + 1)], tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert f"--threads: {cpus + 1} is more than the {cpus} CPUs" in err[0] and f"give at most {cpus}" in err[0], err
    assert not out.exists()
    from script_args import threads

    assert threads()(str(cpus)) == cpus and threads(0)("0") == 0  # the machine's CPUs are taken (bench_cost: 0 too)


def _cifar(folder, cut=None):
    """Six python batches of 20 random images (protocol 2, as the download's), ``data_batch_3`` cut to ``cut`` bytes."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (20, 3072), dtype=np.uint8), b"labels": rng.integers(0, 10, 20).tolist()}
        data = pickle.dumps(batch, protocol=2)
        (folder / name).write_bytes(data[:cut] if name == "data_batch_3" and cut is not None else data)


@pytest.mark.parametrize("cut,said", [(0, "is empty (0 bytes)"), (1000, "ends early (1,000 bytes"),
                                      (-1, "ends early (")])
def test_a_cifar_batch_cut_short_says_so_and_what_to_do(cut, said, tmp_path, capsys):
    """A batch cut short (an interrupted download, ``cp`` or ``tar``: empty, or a pickle that stops) was "is not a
    CIFAR-10 python batch (unreadable pickle: EOFError)", naming neither what happened nor what to do."""
    _cifar(tmp_path / "data", cut)
    argv = ["search", *TINY, "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--batch-size", "25",
            "--out", str(tmp_path / "run.h5")]
    line = refused(argv, tmp_path, f"data_batch_3 {said}", capsys)
    assert "cut short" in line and "replace it with the data_batch_3 of cifar-10-python.tar.gz" in line, line


def test_a_cifar_batch_of_other_bytes_is_not_said_to_be_cut_short(tmp_path, capsys):
    """Bytes that are no pickle at all (a text file saved under the batch's name) stay "not a CIFAR-10 python batch",
    now with what to do."""
    _cifar(tmp_path / "data")
    (tmp_path / "data" / "data_batch_3").write_bytes(b"garbage")
    argv = ["search", *TINY, "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "r.h5")]
    line = refused(argv, tmp_path, "data_batch_3 is not a CIFAR-10 python batch (unreadable pickle", capsys)
    assert "cut short" not in line and "replace it with the data_batch_3" in line, line


@pytest.mark.parametrize("method,key", [
    ("darts", "reward_bound"),  # one other method takes it: named with its --method
    ("xnas", "alpha_lr"),       # several do
])
def test_a_hyperparameter_of_another_method_names_the_method_that_takes_it(method, key, tmp_path, capsys):
    """``--hp reward_bound=1`` without ``--method xnas`` was "unknown hyperparameter 'reward_bound' for method 'darts';
    valid keys: <darts's>": the line named neither the method that takes it nor that --method was forgotten."""
    from nasdiag.search.registry import available_methods

    owners = [n for n, cls in available_methods().items() if n != method and key in cls.Hyperparameters.keys()]
    assert owners  # the case is real: some other method takes the key
    argv = ["search", *TINY, "--method", method, "--out", str(tmp_path / "run.h5"), "--hp", f"{key}=1"]
    line = refused(argv, tmp_path, f"unknown hyperparameter {key!r} for method {method!r}", capsys)
    assert f"it is a hyperparameter of {', '.join(owners)} (" in line and f"not of {method}" in line, line
    assert (f"--method {owners[0]}" if len(owners) == 1 else "choose one with --method") in line, line


@pytest.mark.parametrize("nested", [True, False])
def test_a_cifar_folder_of_the_binary_version_says_it_is_the_binary_version(nested, tmp_path, capsys):
    """``--data-dir`` of CIFAR-10's binary version (cifar-10-binary.tar.gz: data_batch_1.bin ..., in
    cifar-10-batches-bin/) was "file missing: data/data_batch_1" while data_batch_1.bin lay there: it says which version
    it is and which one nasdiag reads."""
    data = tmp_path / "data"
    batches = data / "cifar-10-batches-bin" if nested else data
    batches.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (batches / f"{name}.bin").write_bytes(bytes(3073))  # one record of the binary layout: a label, 3072 bytes
    argv = ["search", *TINY, "--dataset", "cifar10", "--data-dir", str(data), "--out", str(tmp_path / "run.h5")]
    line = refused(argv, tmp_path, "CIFAR-10 file missing", capsys)
    there = batches if nested else batches / "data_batch_1.bin"
    assert f"{there} is there: that is CIFAR-10's binary version" in line and "cifar-10-python.tar.gz" in line, line


@pytest.mark.parametrize("argv", [["search", "--version"], ["plot", "--version"], ["methods", "darts", "--version"],
                                  ["report", "run.h5", "--version", "--out", "r.html"]])
def test_version_after_a_command_says_where_it_goes(argv, tmp_path, monkeypatch, capsys):
    """``nasdiag search --version`` was "unrecognized arguments: --version", and ``nasdiag plot --version`` "the
    following arguments are required: RECORD, --out", as if the version needed a record: --version is nasdiag's own."""
    monkeypatch.chdir(tmp_path)
    refused(argv, tmp_path, f"--version is an option of nasdiag itself, not of the command {argv[0]}: run nasdiag "
            "--version", capsys)
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out.startswith("nasdiag ")


@pytest.mark.parametrize("script,argv,option", [
    ("xnas_toys", ["--out", "", "--plot-only"], "--out"),             # a run wrote record.h5 and fig*.png right here
    ("sparsenas_digits", ["--out", " ", "--plot-only"], "--out"),     # its own parser
    ("wiring_evolution", ["--plot-only", "--data-dir", ""], "--data-dir"),
])
def test_an_empty_script_option_is_refused_not_taken_as_the_current_folder(script, argv, option, tmp_path, monkeypatch,
                                                                           capsys):
    """``--out "$OUT"`` with OUT unset: the batch scripts took ``--out ''`` as the current folder (a run wrote its
    record and figures there, --plot-only looked for them there), ``--data-dir ''`` as not given."""
    monkeypatch.chdir(tmp_path)
    code, err = _script(script, argv, tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{option} is empty" in err[0] and "shell variable that is not set" in err[0], err


@pytest.mark.parametrize("script,argv", [
    ("xnas_toys", ["--out", "notes.txt"]),                            # "File exists: notes.txt"
    ("wiring_evolution", ["--out", "notes.txt", "--epochs", "1"]),    # "Not a directory: notes.txt/dsnas"
    ("make_readme_figures", ["--plot-only", "--runs", "notes.txt"]),  # "no record at notes.txt/darts_seed0.h5"
])
def test_a_script_folder_option_naming_a_file_says_so(script, argv, tmp_path, monkeypatch, capsys):
    """A batch script's output folder (``--out``, ``--runs``) that is a file was "File exists: notes.txt" or "Not a
    directory: notes.txt/dsnas": naming neither the option nor what to do. The file is kept as it was."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine\n")
    code, err = _script(script, argv, tmp_path, capsys)
    option = argv[argv.index("notes.txt") - 1]
    assert code == 2 and len(err) == 1, err
    assert f"{option} notes.txt is not a folder but a file" in err[0] and f"give another {option}" in err[0], err


@pytest.mark.parametrize("value,meant", [("None", "'none'"), ("NONE", "'none'"), ("cost;hessian", "'cost,hessian'"),
                                         ("cost hessian", "'cost,hessian'"), ("all", None)])
def test_an_unknown_diagnostic_names_none_and_the_commas(value, meant, tmp_path, capsys):
    """``--diagnostics None`` (or NONE, all, cost;hessian) was "unknown diagnostics 'None'; choose one of cost,
    hessian": no word of ``none``, which --help offers, nor of the commas that separate them."""
    line = refused(["search", *TINY, "--out", str(tmp_path / "run.h5"), "--diagnostics", value], tmp_path,
                   f"unknown diagnostics {value!r};", capsys)
    assert "(comma-separated), or none to record no diagnostics" in line, line
    assert (f"did you mean {meant}?" in line) if meant else "did you mean" not in line, line


@pytest.mark.parametrize("given,again", [
    ("w_lr=0.1,w_momentum=0.8", "--hp w_lr=0.1 --hp w_momentum=0.8"),
    ("w_lr=0.1 w_momentum=0.8", "--hp w_lr=0.1 --hp w_momentum=0.8"),
    ("alpha_betas=0.5,0.999,w_lr=0.1", "--hp alpha_betas=0.5,0.999 --hp w_lr=0.1"),  # a tuple's commas kept
])
def test_several_hyperparameters_in_one_hp_say_to_repeat_it(given, again, tmp_path, capsys):
    """``--hp w_lr=0.1,w_momentum=0.8`` was "hyperparameter w_lr must be of type float, got '0.1,w_momentum=0.8'": not
    that --hp takes one setting and is repeated."""
    line = refused(["search", *TINY, "--out", str(tmp_path / "run.h5"), "--hp", given], tmp_path,
                   "hyperparameters at once; --hp takes one KEY=VALUE, repeated for each: " + again, capsys)
    assert line.endswith(again), line


def test_xnas_statistical_plot_only_of_a_record_without_a_point_is_one_line(tmp_path, capsys):
    """``xnas_statistical.py --plot-only`` on the record of a run still writing its first point (or stopped before it)
    was matplotlib's "Number of columns must be a positive integer, not 0" traceback, exit code 1."""
    from nasdiag.record import Recorder

    (tmp_path / "out").mkdir()
    with Recorder(str(tmp_path / "out" / "record.h5"), meta={"method": "xnas_statistical",
                                                              "config": {"steps": 2, "runs": 2}}):
        pass
    code, err = _script("xnas_statistical", ["--out", str(tmp_path / "out"), "--plot-only"], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and "holds no finished point yet" in err[0], err


def test_xnas_statistical_with_one_number_of_experts_draws_without_a_fit(tmp_path, capsys):
    """One N in the regret-vs-N sweep (``--n-grid 8``, or a run stopped or still writing after its first point): the
    fits of regret against N divided 0 by 0 (a ZeroDivisionError traceback after the run). The point is drawn, no fit."""
    import json

    from nasdiag.errors import run_script

    out = tmp_path / "out"
    argv = ["--out", str(out), "--runs", "2", "--steps", "2", "--n-grid", "8", "--sigma-grid", "1", "--lr-multipliers", ""]
    assert run_script("xnas_statistical", importlib.import_module("xnas_statistical").main, argv) == 0, capsys.readouterr()
    summary = json.loads((out / "fits.json").read_text())
    assert len(summary["vs_n"]["rows"]) == 1 and "fits" not in summary["vs_n"], summary
    assert (out / "fig8.png").stat().st_size > 0


def test_wiring_output_cost_plot_only_of_a_record_without_an_evaluation_is_one_line(tmp_path, capsys):
    """``wiring_output_cost.py --plot-only`` on the record of a run stopped (or still running) before its first epoch
    evaluation was a KeyError traceback ('valid/scalars/loss_train'), exit code 1."""
    from nasdiag.record import Recorder

    (tmp_path / "out").mkdir()
    with Recorder(str(tmp_path / "out" / "record.h5"), meta={"method": "fixed_architecture"}) as rec:
        rec.log(1, {"scalars/loss": 2.3, "scalars/epoch": 0})  # a training step's row, no evaluation yet
    code, err = _script("wiring_output_cost", ["--out", str(tmp_path / "out"), "--plot-only"], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and "holds no evaluated epoch yet" in err[0], err


@pytest.mark.parametrize("where,said", [("folder", "is a folder; give the file to write"),
                                        ("missing/rows.json", "which does not exist; create it")])
def test_a_benchmark_json_that_cannot_be_written_is_refused_before_the_timing(where, said, tmp_path, capsys):
    """``bench_search.py --json FOLDER`` (or in a folder that is not there) timed every section for minutes, then
    stopped at the write: "Is a directory" / "No such file or directory". Refused before any work."""
    (tmp_path / "folder").mkdir()
    small = ["--sections", "fwdbwd", "--C", "2", "--layers", "3", "--batch", "2", "--image", "8", "--in-channels", "1",
             "--steps", "1", "--eager-steps", "1", "--warmup", "0", "--device", "cpu"]
    code, err = _script("bench_search", [*small, "--json", str(tmp_path / where)], tmp_path, capsys)
    assert code == 2 and len(err) == 1 and f"--json {tmp_path / where} " in err[0] and said in err[0], err


@pytest.mark.parametrize("given", ["cost;hessian", "cost hessian"])
def test_figures_separated_by_other_than_commas_name_the_commas(given, rec, tmp_path, capsys):
    """``nasdiag plot --figures 'cost;hessian'`` was "did you mean 'hessian' for 'cost;hessian'?": one of the two
    figures, the other dropped; the line gives them comma-separated."""
    refused(["plot", str(rec), "--out", str(tmp_path / "figs"), "--no-progress", "--figures", given], tmp_path,
            f"(did you mean 'cost,hessian' for {given!r}?)", capsys)


@pytest.mark.parametrize("script", ["wiring_variants", "wiring_output_cost"])
def test_a_wiring_supernet_too_large_for_memory_is_one_line_before_any_folder(script, tmp_path, capsys):
    """The wiring scripts build their supernet themselves: ``--C 1000000`` was torch's "DefaultCPUAllocator: can't
    allocate memory" traceback (with memory overcommitted, the OOM killer) after the output folder was made;
    ``nasdiag search`` refuses it counted on the meta device, and so do they now."""
    out = tmp_path / "out"
    code, err = _script(script, ["--out", str(out), "--C", "1000000", "--epochs", "1"], tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert "the supernet (--C 1000000" in err[0] and "does not fit in the memory of cpu" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("script", ["bench_methods", "bench_cost"])
def test_a_benchmark_supernet_too_large_for_memory_is_one_line(script, tmp_path, capsys):
    """The benchmarks build their supernet from --C and --layers: ``--C 1000000`` was torch's "can't allocate memory"
    traceback, exit code 1."""
    code, err = _script(script, ["--C", "1000000"], tmp_path, capsys)
    # bench_cost runs on CUDA where there is one (the GPU host: "the memory of cuda")
    assert code == 2 and len(err) == 1 and "does not fit in the memory of c" in err[0], err
    assert "use a smaller --C or --layers" in err[0], err


def test_bench_methods_with_fewer_than_four_steps_runs(capsys):
    """``bench_methods.py --steps 2`` (its --help: intermediate nodes per cell) was the cell's "multiplier must be in
    [1, steps=2], got 4" ValueError traceback: the supernet kept DARTS's multiplier 4."""
    from nasdiag.errors import run_script

    argv = ["--C", "2", "--layers", "3", "--steps", "2", "--repeats", "1", "--methods", "darts", "--batch", "4"]
    assert run_script("bench_methods", importlib.import_module("bench_methods").main, argv) == 0, capsys.readouterr().err
    assert "| darts |" in capsys.readouterr().out
