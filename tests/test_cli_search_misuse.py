"""``nasdiag search`` misused by a new user: every mistake is one line on stderr, exit code 2, and nothing
that exists is touched (`refused` compares the folder's sha256s before and after). Paths another run or
the user owns are never replaced, not even with --force."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nasdiag.cli import main
from test_cli_errors import TINY, refused


def _search(out, *extra):
    return ["search", *TINY, "--out", str(out), *extra]


def _foreign_files(folder: Path) -> None:
    import h5py

    (folder / "b2.h5.ckpt").write_bytes(b"PK\x03\x04 a checkpoint of another run")
    (folder / "b2.h5.lock").write_text('{"pid": 1}')
    (folder / "b2.seg0001.h5").write_bytes(b"\x89HDF\r\n\x1a\n segment of another run")
    (folder / "notes.txt").write_text("my notes, not a record\n")
    (folder / "empty.h5").write_bytes(b"")
    with h5py.File(folder / "data.h5", "w") as f:  # an HDF5 file, but not a record
        f.create_dataset("x", data=[1.0, 2.0])


@pytest.mark.parametrize("flag", [[], ["--force"], ["--resume"]])
@pytest.mark.parametrize("name,needle", [
    ("b2.h5.ckpt", "named like the checkpoint of the record"),
    ("b2.h5.lock", "named like the writer lock of the record"),
    ("b2.seg0001.h5", "named like the continuation segment of the record"),
    ("new.seg0002.h5", "named like the continuation segment of the record"),  # also when nothing exists yet
    ("notes.txt", "is not a nasdiag record: it is not an HDF5 file"),
    ("empty.h5", "is not a nasdiag record: it is empty"),
    ("data.h5", "is not a nasdiag record: it is an HDF5 file without the /step"),
])
def test_out_that_is_not_a_record_is_never_replaced(name, needle, flag, tmp_path, capsys):
    _foreign_files(tmp_path)
    line = refused(_search(tmp_path / name, *flag), tmp_path, needle, capsys)
    assert "choose another --out" in line


def test_empty_out(tmp_path, capsys):
    refused(["search", *TINY, "--out", ""], tmp_path, "--out is empty", capsys)
    refused(["search", *TINY, "--out", "  "], tmp_path, "--out is empty", capsys)


def test_leftovers_without_their_record(tmp_path, capsys):
    """The main record was deleted, its later segment and checkpoint remain: the CLI names them in CLI terms,
    and --force replaces them (the stale segment would otherwise be read as part of the new record)."""
    out = tmp_path / "b5.h5"
    (tmp_path / "b5.seg0001.h5").write_bytes(b"\x89HDF\r\n\x1a\n stale segment")
    Path(str(out) + ".ckpt").write_bytes(b"stale checkpoint")
    line = refused(_search(out), tmp_path, "leftover files of a previous run at", capsys)
    assert "b5.seg0001.h5, b5.h5.ckpt" in line and "pass --force" in line and "=True" not in line
    refused(_search(out, "--resume"), tmp_path, "the record is missing and only leftover files", capsys)
    assert main(_search(out, "--force")) == 0
    capsys.readouterr()
    assert sorted(os.listdir(tmp_path)) == ["b5.h5", "b5.h5.ckpt"]
    assert Path(str(out) + ".ckpt").read_bytes() != b"stale checkpoint"


@pytest.mark.parametrize("method,item,needle", [
    ("darts", "alpha_betas=0.5", "alpha_betas=0.5 has 1 value(s), it needs 2: give them comma-separated, e.g. alpha_betas=0.5,0.999"),
    ("darts", "alpha_betas=0.5,0.999,0.1", "has 3 value(s), it needs 2"),
    ("darts", "alpha_betas=2,3", "alpha_betas=2.0,3.0 is out of range (element 2.0); each value must be < 1"),
    ("darts", "alpha_betas=0.5,1", "(element 1.0); each value must be < 1"),  # Adam needs β < 1
    ("darts", "alpha_betas=-0.1,0.9", "(element -0.1); each value must be >= 0"),
    ("proxyless", "alpha_betas=0", "has 1 value(s), it needs 2"),
    ("darts", "w_lr=inf", "w_lr=inf is not a finite number"),
    ("darts", "w_lr=1e400", "w_lr=inf is not a finite number"),  # overflows to inf when parsed
    ("darts", "alpha_lr=nan", "alpha_lr=nan is not a finite number"),
    ("darts", "w_lr_min=1", "w_lr_min=1.0 is above w_lr=0.025: the schedule would rise"),
    ("asmnas", "w_lr_min=0.5", "w_lr_min=0.5 is above w_lr=0.025"),
    ("snas", "tau_min=2", "tau_min=2.0 is above tau0=1.0"),
])
def test_bad_hyperparameter_values_refused_before_anything_is_written(method, item, needle, tmp_path, capsys):
    refused(_search(tmp_path / "run.h5", "--method", method, "--hp", item), tmp_path, needle, capsys)


def test_every_float_and_tuple_hyperparameter_is_checked():
    """Each method's every float field refuses inf, every tuple field a wrong length (a method added later is covered)."""
    import typing

    from nasdiag.errors import ConfigError
    from nasdiag.search.registry import available_methods

    checked = 0
    for name, cls in available_methods().items():
        hints = typing.get_type_hints(cls.Hyperparameters)
        for f in cls.Hyperparameters.fields():
            default = getattr(cls.Hyperparameters(), f.name)
            if hints[f.name] is float:
                bad = "inf"
            elif isinstance(default, tuple):
                bad = ",".join(map(str, default + default[:1]))
            else:
                continue
            with pytest.raises(ConfigError, match=f.name):
                cls.Hyperparameters.parse([f"{f.name}={bad}"], name)
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("device", ["mps", "cuda:99"])
def test_unavailable_device_names_the_available_ones(device, tmp_path, capsys):
    import torch

    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has an MPS device")
    line = refused(_search(tmp_path / "run.h5", "--device", device), tmp_path, f"device {device!r} is not available", capsys)
    assert "use one of auto, cpu" in line


@pytest.fixture(scope="module")
def hessian_run(tmp_path_factory) -> Path:
    """A finished one-epoch run recording the Hessian diagonal in mode approx."""
    out = tmp_path_factory.mktemp("hessian") / "run.h5"
    tiny = [a if a != "none" else "hessian" for a in TINY]  # --diagnostics hessian
    assert main(["search", *tiny, "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("extra,needle", [
    (["--diagnostics", "hessian", "--hessian-mode", "ggn"], "hessian_mode='ggn' (recorded 'diag')"),
    (["--diagnostics", "hessian", "--spectrum-every", "1"], "spectrum_every=1 (recorded 0)"),
    (["--diagnostics", "cost,hessian"], "diagnostics=['cost', 'hessian'] (recorded ['hessian'])"),
    (["--diagnostics", "none"], "diagnostics=[] (recorded ['hessian'])"),
])
def test_resume_keeps_what_is_recorded(hessian_run, extra, needle, capsys):
    """Epoch 0 was recorded in mode approx: a resume in another mode would mix modes under one meta."""
    argv = ["search", *TINY, "--epochs", "2", "--out", str(hessian_run), "--resume", *extra]
    refused(argv, hessian_run.parent, needle, capsys)
    capsys.readouterr()


@pytest.mark.parametrize("extra,needle", [
    (["--hp", "w_lr=0.1", "--hp", "w_lr=0.001"], "--hp w_lr is given twice (w_lr=0.1 and w_lr=0.001); pass it once"),
    (["--hp", "w_lr=0.1", "--hp", " w_lr =0.2"], "--hp w_lr is given twice"),
    (["--figs", "myfigs"], "--figs myfigs and --no-figs contradict each other"),  # TINY has --no-figs
])
def test_options_that_would_silently_do_nothing(extra, needle, tmp_path, capsys):
    refused(_search(tmp_path / "run.h5", *extra), tmp_path, needle, capsys)


def test_unknown_option_points_at_the_commands_help(tmp_path, capsys):
    refused(["search", "--methd", "darts"], tmp_path,
            "nasdiag search: unrecognized arguments: --methd darts (see nasdiag search --help)", capsys)


@pytest.mark.parametrize("exists", [False, True])
def test_interrupt_says_whether_anything_was_recorded(exists, tmp_path, capsys, monkeypatch):
    import nasdiag.search

    out = tmp_path / "run.h5"

    def interrupted(config, callbacks=()):
        if exists:  # written by this run (a file there before it is an earlier run's: round 19)
            out.write_bytes(b"stands in for the record of this run")
        raise KeyboardInterrupt

    monkeypatch.setattr(nasdiag.search, "run", interrupted)
    assert main(_search(out)) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    expected = "the record holds every completed step" if exists else "interrupted before anything was recorded"
    assert expected in lines[0], lines[0]


def test_damaged_record_in_cli_terms(hessian_run, tmp_path, capsys):
    damaged = tmp_path / "run.h5"
    damaged.write_bytes(hessian_run.read_bytes()[: hessian_run.stat().st_size // 2])
    tiny = [a if a != "none" else "hessian" for a in TINY]
    line = refused(["search", *tiny, "--epochs", "2", "--out", str(damaged), "--resume"], tmp_path,
                   f"cannot resume {damaged}: it is damaged at", capsys)
    assert "pass --force instead of --resume" in line and "salvage=True) returns" not in line
    line = refused(["plot", str(damaged), "--out", str(tmp_path / "figs")], tmp_path, f"record {damaged} is damaged", capsys)
    assert "no row of it can be read" in line and "salvage" not in line, line  # cut before its first row


def test_closed_pipe_is_not_an_error():
    """``nasdiag methods | head -1``: the reader leaves early; no message, exit 0 or 141 (128 + SIGPIPE)."""
    import subprocess
    import sys

    from test_cli_errors import ROOT

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "nasdiag", "methods"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # before the command writes a byte
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 141) and err == "", (proc.returncode, err)


@pytest.mark.parametrize("method, values, message", [
    ("sparsenas", {"first_order": "false"}, "first_order must be True or False"),  # a non-empty string is truthy
    ("bayesnas", {"update_every": 1.5}, "update_every must be an int"),
    ("darts", {"w_lr": True}, "w_lr must be a number"),
    ("darts", {"w_momentum": None}, "w_momentum must be a number"),
    ("darts", {"alpha_betas": (0.5, "x")}, "alpha_betas must be a number"),
    ("darts", {"alpha_betas": [0.5, 0.9]}, "alpha_betas must be a tuple"),
    ("bayesnas", {"hessian_mode": "hutchinson:<k>"}, "e.g. 'hutchinson:4'"),
])
def test_hyperparameters_built_in_python_are_type_checked(method, values, message):
    """``Method.Hyperparameters(...)`` from Python gets no string conversion (``from_dict`` does that for --hp):
    a value of the wrong type is a ConfigError at construction, not a silent truthy string or a late TypeError."""
    from nasdiag.errors import ConfigError
    from nasdiag.search import get_method

    with pytest.raises(ConfigError, match=message):
        get_method(method).Hyperparameters(**values)
    assert get_method("darts").Hyperparameters(w_lr=1).w_lr == 1  # an int is a number


@pytest.mark.parametrize("env, needle", [
    ({"WORLD_SIZE": "2"}, "RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not (torchrun sets them all)"),
    ({"WORLD_SIZE": "abc", "RANK": "0"}, "WORLD_SIZE='abc' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "5", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"},
     "RANK=5 / LOCAL_RANK=0 do not fit WORLD_SIZE=2"),
])
def test_torchrun_variables_without_torchrun_are_one_line(env, needle, tmp_path, capsys, monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    refused(["search", *TINY, "--out", str(tmp_path / "run.h5")], tmp_path, needle, capsys)


@pytest.mark.slow
def test_sigterm_ends_a_run_waiting_for_peers_that_never_come(tmp_path):
    """All of torchrun's variables set, but no other rank: the rendezvous waits in C++, where Python's handlers
    cannot run; SIGTERM must still end the process (nothing is recorded yet)."""
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29541"}
    proc = subprocess.Popen([sys.executable, "-m", "nasdiag", "search", *TINY, "--out", str(tmp_path / "run.h5")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(6)  # imports, then the wait
        assert proc.poll() is None, "the run did not wait for its peer"
        proc.send_signal(signal.SIGTERM)
        # killed inside the C++ wait (-15), or by nasdiag's own handler (143) where a loaded machine was still importing
        assert proc.wait(timeout=10) in (-signal.SIGTERM, 128 + signal.SIGTERM)
    finally:
        proc.kill()
        proc.wait()
    assert not (tmp_path / "run.h5").exists()


def test_an_interrupt_while_drawing_the_figures_points_at_nasdiag_plot(tmp_path, capsys, monkeypatch):
    # the run is complete when the figures are drawn: --resume would answer "already finished"
    import nasdiag.plot

    def interrupted(record, folder, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(nasdiag.plot, "write_figures", interrupted)
    out, figs = tmp_path / "run.h5", tmp_path / "figs"
    argv = [a for a in TINY if a != "--no-figs"]
    assert main(["search", *argv, "--out", str(out), "--figs", str(figs)]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "while drawing the figures; the run is complete" in lines[0], lines[0]
    suggested = lines[0].split("draw them with nasdiag ")[1].split()
    assert suggested == ["plot", str(out), "--out", str(figs)]
    monkeypatch.undo()
    assert main(suggested + ["--no-progress"]) == 0
    assert any(figs.rglob("*.png"))
