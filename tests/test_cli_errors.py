"""Every user mistake gets one line on stderr, exit code 2, no traceback, and changes nothing: the files
present before (record, checkpoint, data) have the same sha256 after, and no new file is left behind.

Most cases run in-process through ``main(argv)`` (what the subprocess would run after parsing); a few
run as real subprocesses to check the process boundary (exit code, stderr, signals).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nasdiag.cli import main

TINY = ["--epochs", "1", "--C", "4", "--layers", "3", "--steps", "2", "--batch-size", "240", "--diagnostics", "none", "--device", "cpu",
        "--no-progress", "--no-figs", "--threads", "1"]
ROOT = Path(__file__).resolve().parents[1]


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def refused(argv, folder: Path, needle: str, capsys) -> str:
    """Run ``nasdiag argv`` in-process; assert exit 2, one stderr line containing ``needle``, ``folder`` unchanged."""
    before = snapshot(folder)
    code = main(argv)
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    assert snapshot(folder) == before
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run.h5"
    assert main(["search", *TINY, "--out", str(out)]) == 0
    return out


def _other_method_key():
    from nasdiag.search.registry import available_methods

    darts = set(available_methods()["darts"].Hyperparameters.keys())
    for name, cls in available_methods().items():
        extra = sorted(set(cls.Hyperparameters.keys()) - darts)
        if extra:
            return name, extra[0]
    pytest.skip("no registered method has a hyperparameter DARTS lacks")


@pytest.mark.parametrize("extra,needle", [
    (["--seed", "-5"], "seed must be an integer >= 0"),
    (["--layers", "2"], "layers must be >= 3"),
    (["--epochs", "0"], "epochs must be an integer >= 1"),
    (["--method", "nope"], "unknown method 'nope'"),
    (["--hp", "bogus=1"], "unknown hyperparameter 'bogus'"),
    (["--hp", "w_lr=fast"], "w_lr of method 'darts' must be of type float"),
    (["--hp", "w_lr"], "--hp expects KEY=VALUE"),
    (["--hp", "w_lr=-1"], "w_lr=-1.0 is out of range"),
    (["--batch-size", "100000"], "batch size 100000 is larger than"),
    (["--dataset", "mnist"], "invalid choice: 'mnist'"),
    (["--dataset", "cifar10"], "needs data_dir"),
    (["--data-dir", "/tmp"], "only used with dataset cifar10"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--threads", "0"], "threads must be an integer >= 1"),
    (["--layers", "3", "--multiplier", "3"], "multiplier must be an integer in [1, steps=2]"),
    (["--spectrum-every", "-1"], "spectrum_every must be an integer >= 0"),
    (["--hessian-mode", "bogus"], "unknown curvature hessian_mode 'bogus'"),
    (["--hessian-mode", "hutchinson"], "needs k, the number of Hessian-vector products"),
    (["--hessian-mode", "hutchinson:0"], "e.g. hutchinson:4"),
    (["--resume"], "nothing to resume"),
    (["--hessian-mode", "exact"], "hessian_mode 'exact' has no effect: diagnostics 'none'"),
    (["--hessian-mode", "approx", "--diagnostics", "cost"], "hessian_mode 'approx' has no effect: diagnostics 'cost'"),
])
def test_bad_search_arguments(extra, needle, tmp_path, capsys):
    refused(["search", *TINY, "--out", str(tmp_path / "run.h5"), *extra], tmp_path, needle, capsys)


def test_hyperparameter_of_another_method(tmp_path, capsys):
    other, key = _other_method_key()
    refused(["search", *TINY, "--out", str(tmp_path / "run.h5"), "--hp", f"{key}=1"], tmp_path,
            f"unknown hyperparameter {key!r} for method 'darts'", capsys)


def test_bad_locations(tmp_path, capsys):
    (tmp_path / "afile.txt").write_text("not a folder")
    (tmp_path / "folder").mkdir()
    search = ["search", *TINY]
    refused([*search, "--out", str(tmp_path / "afile.txt" / "run.h5")], tmp_path, "is a file, not a folder", capsys)
    refused([*search, "--out", str(tmp_path / "folder")], tmp_path, "is a folder; pass a file path", capsys)
    # figures into a file: refused before the search runs (no record appears)
    refused([*search[:-3], "--out", str(tmp_path / "run.h5"), "--figs", str(tmp_path / "afile.txt")], tmp_path,
            "figure folder", capsys)
    # a location that cannot be written: a read-only folder (root ignores chmod, so /proc stands in)
    if os.geteuid() == 0:
        unwritable = Path("/proc/nasdiag-cannot-write")
    else:
        unwritable = tmp_path / "ro"
        unwritable.mkdir()
        unwritable.chmod(0o555)
    try:
        refused([*search, "--out", str(unwritable / "sub" / "run.h5")], tmp_path, "cannot write the record", capsys)
    finally:
        if unwritable.is_relative_to(tmp_path):
            unwritable.chmod(0o755)


def test_plot_mistakes(finished, tmp_path, capsys):
    (tmp_path / "afile.txt").write_text("x")
    refused(["plot", str(tmp_path), "--out", str(tmp_path / "figs")], tmp_path, str(tmp_path), capsys)
    refused(["plot", str(finished), "--out", str(tmp_path / "afile.txt")], tmp_path, "afile.txt", capsys)
    refused(["plot", str(tmp_path / "none.h5"), "--out", str(tmp_path / "figs")], tmp_path, "no record at", capsys)


def test_refused_resume_and_force_change_nothing(finished, tmp_path, capsys):
    folder = tmp_path / "copy"
    shutil.copytree(finished.parent, folder)
    out = folder / finished.name
    base = ["search", *TINY, "--out", str(out)]
    refused(base, folder, "a record already exists", capsys)
    refused([*base, "--resume"], folder, "already finished 1 epochs", capsys)
    refused([*base, "--resume", "--epochs", "3", "--seed", "1"], folder, "seed=1 (recorded 0)", capsys)
    refused([*base, "--resume", "--epochs", "3", "--hp", "alpha_lr=0.01"], folder, "hp.alpha_lr=0.01 (recorded ", capsys)
    refused([*base, "--resume", "--epochs", "3", "--batch-size", "120"], folder, "batch_size=120 (recorded 240)", capsys)
    other, _ = _other_method_key()
    refused([*base, "--resume", "--epochs", "3", "--method", other], folder,
            f"--resume with method {other}, but the checkpoint {out}.ckpt was written by darts", capsys)
    # --force against a live writer: the lock is checked before anything is deleted
    from nasdiag.record.lock import WriterLock

    lock = WriterLock(str(out) + ".lock", str(out))
    lock.acquire()
    try:
        before = snapshot(folder)
        code = main([*base, "--force"])
        err = capsys.readouterr().err
        assert code == 2 and "being written by another writer" in err and err.count("\n") == 1
        after = snapshot(folder)
        assert after == before
    finally:
        lock.release()
    # no checkpoint: resuming would rewrite history, so it is refused
    os.unlink(str(out) + ".ckpt")
    refused([*base, "--resume", "--epochs", "2"], folder, "checkpoint", capsys)


def _cifar_folder(folder: Path, make) -> Path:
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(make())
    return folder


@pytest.mark.parametrize("kind,make,needle", [
    ("random bytes", lambda: os.urandom(512), "unreadable pickle"),
    ("wrong shape", lambda: pickle.dumps({b"data": [[1, 2, 3]] * 4, b"labels": [0, 1, 2, 3]}), "N x 3072 bytes"),
])
def test_damaged_cifar_folder(kind, make, needle, tmp_path, capsys):
    data = _cifar_folder(tmp_path / "cifar", make)
    refused(["search", *TINY, "--dataset", "cifar10", "--data-dir", str(data), "--out", str(tmp_path / "run.h5")],
            tmp_path, needle, capsys)


def _subprocess(argv, **kwargs):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "nasdiag", *argv], capture_output=True, text=True, env=env, **kwargs)


@pytest.mark.parametrize("extra,needle", [
    (["--seed", "-5"], "seed must be"),
    (["--method", "nope"], "unknown method"),
    (["--out", "{tmp}/afile.txt/run.h5"], "is a file, not a folder"),
])
def test_as_a_subprocess(extra, needle, tmp_path):
    (tmp_path / "afile.txt").write_text("x")
    extra = [e.replace("{tmp}", str(tmp_path)) for e in extra]
    argv = ["search", *TINY, "--out", str(tmp_path / "run.h5"), *extra]
    before = snapshot(tmp_path)
    proc = _subprocess(argv)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and snapshot(tmp_path) == before


def test_sigterm_prints_one_line_and_the_run_resumes(tmp_path):
    out = tmp_path / "run.h5"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "nasdiag", "search", *TINY, "--epochs", "3", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not Path(str(out) + ".ckpt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the search finished before SIGTERM arrived")
    assert proc.returncode == 143 and err.count("\n") == 1 and "terminated (SIGTERM)" in err, err
    assert main(["search", *TINY, "--epochs", "3", "--out", str(out), "--resume"]) == 0
