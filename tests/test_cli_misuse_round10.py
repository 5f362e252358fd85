"""A tenth new user's misuse of the ``nasdiag`` CLI: what rounds 1-9 (test_cli_errors.py, test_cli_search_misuse.py,
test_cli_plot_misuse.py, test_cli_misuse_round3..9.py) did not cover: resource limits (``ulimit -f`` so that a write
fails with EFBIG: at the first checkpoint, in a record write, in a resumed run's next segment, while drawing the
figures, in plot and report; ``ulimit -v`` so that torch cannot load), standard output full or closed, CIFAR-10
folders a user gets wrong (batches pickled in torchvision's N x 32 x 32 x 3 layout, a batch that is a folder, the
download not unpacked) and the benchmark scripts' --device. Every mistake is one line on stderr, exit code 2, no
traceback, the folder left as it was; a run stopped by a full disk says what its record keeps and the command that
resumes it, and that command finishes the run.

Checked and found right (no test added): ``--device`` cuda, cuda:7, cuda:0, mps, meta, cpu:0, CPU, ' cpu', cuda:-1 on
a CPU machine (one line each, nothing written); every integer option at 0, -1, nan, '' (one line each); --hp w_lr at
inf, 1e400, NaN, alpha_betas of 1 or 3 values (one line each); LANG=C LC_ALL=C with non-ASCII --out, --figs, plot and
report paths (Python's C-locale coercion: the files get their names); a resume after a checkpoint a full disk refused
(the record past the checkpoint: its steps are kept once each).
"""

from __future__ import annotations

import os
import pickle
import resource
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nasdiag.cli import main
from test_cli_errors import ROOT, TINY, refused, snapshot
from test_cli_plot_misuse import rec, source  # noqa: F401 (fixtures)


def _search(out, *extra):
    return ["search", *TINY, "--out", str(out), *extra]


def _steps(record) -> list:
    from nasdiag.record import load

    return [int(s) for s in load(str(record))["step"]]


def _limited(kind: int, size: int):
    """A ``preexec_fn`` setting the soft and hard limit ``kind`` (resource.RLIMIT_*) to ``size`` bytes, as ``ulimit``
    does in the shell (Python ignores SIGXFSZ, so a write past ``ulimit -f`` fails with EFBIG)."""
    return lambda: resource.setrlimit(kind, (size, size))


def _nasdiag(argv, cwd, limit):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "nasdiag", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=limit)


def _resume_by_the_line(line: str, capsys) -> None:
    """Run the command the line ends with (quoted for a shell) once the limit is gone."""
    command = shlex.split(line.split(": nasdiag ", 1)[1])
    assert "--resume" in command and "--force" not in command, line
    assert main(command) == 0
    capsys.readouterr()


# -- ulimit -f: a full disk ------------------------------------------------------------------------------------------
def test_a_file_size_limit_at_the_first_checkpoint_says_the_record_resumes(tmp_path, capsys):
    """``ulimit -f 48``: the record's header fits, its first checkpoint (step 0, before any step) does not. The line
    said only "cannot write checkpoint run.h5.ckpt: disk full or file-size limit reached", and the same command, once
    there was space, was refused as "a record already exists". It says the record holds no step yet and gives the
    command that continues it, which runs the search to its end."""
    out = tmp_path / "run.h5"
    done = _nasdiag(_search(out), tmp_path, _limited(resource.RLIMIT_FSIZE, 48 * 1024))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "cannot write checkpoint" in lines[0] and "file-size limit reached" in lines[0], lines[0]
    assert f"the record {out} holds no step yet: fix that and continue it with the same settings: nasdiag " in lines[0]
    assert out.exists() and _steps(out) == []
    _resume_by_the_line(lines[0], capsys)
    full = tmp_path / "full.h5"  # the same run, never stopped
    assert main(_search(full)) == 0
    capsys.readouterr()
    assert _steps(out) == _steps(full) != []


def test_a_full_disk_in_a_record_write_says_what_the_record_keeps(tmp_path, capsys, monkeypatch):
    """A record write that fails for a full disk or ``ulimit -f`` is HDF5's RuntimeError ("Unable to synchronously
    flush file (file write failed: ... errno = 27, error message = 'File too large' ...)"), not an OSError: the line
    was "recorder for run.h5 failed earlier (cannot write to run.h5: disk full ...); it accepts no more rows", with
    neither the steps kept nor the command that resumes (what a full disk at a checkpoint says since round 5). Here
    the record's second batch (epoch 2) fails as HDF5 fails it; the first epoch's steps stay and the run resumes."""
    from nasdiag.record import writer

    append = writer._append

    def full(dataset, start, block):
        if start > 0:  # the second batch of the segment
            raise RuntimeError("Unable to synchronously flush file (file write failed: time = Fri Nov 27 15:41:49 2026, "
                               "filename = 'run.h5', file descriptor = 5, errno = 28, error message = 'No space left "
                               "on device', buf = 0x1, total write size = 4096, bytes this sub-write = 4096, bytes "
                               "actually written = 18446744073709551615, offset = 0)")
        return append(dataset, start, block)

    out = tmp_path / "run.h5"
    monkeypatch.setattr(writer, "_append", full)
    assert main(_search(out, "--epochs", "2")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "disk full" in lines[0], lines
    kept = _steps(out)
    assert kept and kept == list(range(1, len(kept) + 1))
    assert f"the record {out} keeps steps 1 to {kept[-1]}: fix that and continue it with the same settings: " in lines[0]
    monkeypatch.undo()
    _resume_by_the_line(lines[0], capsys)
    assert _steps(out) == list(range(1, 2 * len(kept) + 1))


# -- ulimit -v: torch cannot load ------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["search", "plot"])
def test_a_memory_limit_too_small_to_load_torch_is_one_line(command, tmp_path):
    """``ulimit -v 400000`` (390 MiB): importing torch failed with "ImportError: libtorch_cpu.so: failed to map segment
    from shared object" (or a MemoryError, or scipy's SystemError, by the limit): a traceback and exit code 1. One line
    says the limit is too small to load the libraries and how to raise it; nothing is written."""
    record = tmp_path / "given" / "run.h5"
    if command == "plot":
        assert main(_search(record)) == 0
    argv = _search(tmp_path / "run.h5") if command == "search" else ["plot", str(record), "--out", "figs",
                                                                     "--figures", "genotype", "--dpi", "20"]
    before = snapshot(tmp_path)
    done = _nasdiag(argv, tmp_path, _limited(resource.RLIMIT_AS, 400_000 * 1024))
    if done.returncode == 1 and done.stderr.startswith("OpenBLAS error"):
        # seen on a 16-CPU GPU host: numpy's OpenBLAS sizes its buffers by the CPU count at load and exits the
        # process itself (C exit 1, its own one line) before any Python of nasdiag's runs
        pytest.skip(f"OpenBLAS ended the process while loading under this limit on {os.cpu_count()} CPUs")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "out of memory under the memory limit of 390 MiB (ulimit -v 400000)" in lines[0], lines[0]
    assert "raise the limit (ulimit -v unlimited)" in lines[0], lines[0]
    assert snapshot(tmp_path) == before


def test_a_missing_module_under_a_memory_limit_is_not_said_to_be_memory(monkeypatch):
    """Clusters set ``ulimit -v`` by default: there, a module that is not installed must stay its own error, not be
    called out of memory."""
    from nasdiag import cli

    def methods(args):
        raise ModuleNotFoundError("No module named 'lightning'")

    monkeypatch.setattr(cli, "_memory_limit", lambda: ("-v", 8 * 2 ** 30))
    monkeypatch.setitem(cli.COMMANDS, "methods", methods)
    with pytest.raises(ModuleNotFoundError):
        main(["methods"])


# -- CIFAR-10 batches in another layout ------------------------------------------------------------------------------
def _cifar(folder: Path, layout) -> Path:
    """Six batches of 20 images whose pixel (c, h, w) is (37 c + 5 h + 3 w + n) mod 256, stored by ``layout``."""
    folder.mkdir()
    c, h, w = np.meshgrid(np.arange(3), np.arange(32), np.arange(32), indexing="ij")
    images = np.stack([(37 * c + 5 * h + 3 * w + n) % 256 for n in range(20)]).astype(np.uint8)  # N x 3 x 32 x 32
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": layout(images), b"labels": [i % 10 for i in range(20)], b"batch_label": name.encode()}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    return folder


@pytest.mark.parametrize("layout,needle", [
    (lambda x: x.transpose(0, 2, 3, 1), "'data' is N x 32 x 32 x 3 (height, width, channel, as torchvision's "
                                        "CIFAR10.data)"),
    (lambda x: x.reshape(20, 3072).T.copy(), "'data' must be N x 3072 bytes (3 x 32 x 32 per image), got an array of "
                                             "shape (3072, 20)"),
    (lambda x: x.reshape(20, 1024, 3), "got an array of shape (20, 1024, 3)"),
])
def test_a_cifar_batch_in_another_layout_is_refused(layout, needle, tmp_path, capsys):
    """torchvision's ``CIFAR10.data`` is N x 32 x 32 x 3; pickled as a batch's 'data', it has N x 3072 bytes and was
    read as 3 x 32 x 32: every image's colours and rows silently scrambled, and the search ran on them. So was a
    3072 x N array (transposed). Only N x 3072 and N x 3 x 32 x 32 are a batch's layout."""
    data = _cifar(tmp_path / "cifar", layout)
    argv = _search(tmp_path / "run.h5", "--dataset", "cifar10", "--data-dir", str(data), "--batch-size", "4")
    line = refused(argv, tmp_path, needle, capsys)  # a batch of 4: without the check, the search ran
    assert "data_batch_1 is not a CIFAR-10 python batch" in line


@pytest.mark.parametrize("what", ["folder", "archive"])
def test_a_cifar_folder_of_a_folder_or_the_download_says_what_to_do(what, tmp_path, capsys):
    """A ``data_batch_1`` that is a folder was "CIFAR-10 file missing"; a folder holding the download
    (cifar-10-python.tar.gz) not unpacked said the batches were missing without a word of the archive next to them."""
    data = tmp_path / "data"
    data.mkdir()
    if what == "folder":
        (data / "data_batch_1").mkdir()
        needle = f"CIFAR-10 batch {data / 'data_batch_1'} is a folder, not a file"
    else:
        (data / "cifar-10-python.tar.gz").write_bytes(b"\x1f\x8b")
        needle = f"cifar-10-python.tar.gz is there: unpack it (tar xzf {data / 'cifar-10-python.tar.gz'} -C {data})"
    refused(_search(tmp_path / "run.h5", "--dataset", "cifar10", "--data-dir", str(data)), tmp_path, needle, capsys)


def test_a_cifar_batch_of_n_x_3_x_32_x_32_reads_as_the_flat_one(tmp_path):
    """The layout kept: an N x 3 x 32 x 32 'data' is the same bytes in the same order as N x 3072, and gives the same
    splits; the images are the pixels written, channel first (own reference: the formula of `_cifar`)."""
    import torch

    from nasdiag.data import cifar10

    flat = cifar10(_cifar(tmp_path / "flat", lambda x: x.reshape(20, 3072)), limit=5, dtype=torch.float64)
    square = cifar10(_cifar(tmp_path / "square", lambda x: x), limit=5, dtype=torch.float64)
    for part in ("train", "val", "test"):
        for a, b in zip(getattr(flat, part).tensors, getattr(square, part).tensors):
            assert torch.equal(a, b)
    test = flat.test.tensors[0].numpy()  # standardized per channel: an affine map of the pixels, slope > 0
    c, h, w = np.meshgrid(np.arange(3), np.arange(32), np.arange(32), indexing="ij")
    expected = np.stack([(37 * c + 5 * h + 3 * w + n) % 256 for n in range(5)]).astype(np.float64)
    for channel in range(3):
        x, y = expected[:, channel].ravel(), test[:, channel].ravel()
        slope, offset = np.polyfit(x, y, 1)
        assert slope > 0 and np.abs(slope * x + offset - y).max() < 1e-9 * np.abs(y).max()


# -- standard output that cannot be written ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["search", "--help"], ["plot", "--help"], ["methods"]])
def test_output_that_cannot_be_written_is_one_line(argv, tmp_path):
    """``nasdiag --help > /dev/full``: argparse drops a failed write of the help or the version, and the command
    exited 0 with nothing written and nothing said (``nasdiag methods > /dev/full`` said it). It is one line naming
    standard output, exit code 2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "nasdiag", *argv], stdout=full, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=tmp_path, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("nasdiag: error: disk full or file-size limit reached") and "standard output" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_methods_with_standard_output_closed_says_so(tmp_path):
    """``nasdiag methods >&-``: Python's stdout is None and print() writes nowhere: exit code 0, nothing said, the
    list lost. (``--help`` and ``--version`` then write to standard error, as argparse does: the user sees them.)"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "nasdiag", "methods", "darts"], stderr=subprocess.PIPE, text=True,
                          env=env, cwd=tmp_path, timeout=120, preexec_fn=lambda: os.close(1))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "standard output is closed (>&-)" in lines[0], lines[0]
    shown = subprocess.run([sys.executable, "-m", "nasdiag", "--version"], stderr=subprocess.PIPE, text=True, env=env,
                           cwd=tmp_path, timeout=120, preexec_fn=lambda: os.close(1))
    assert shown.returncode == 0 and shown.stderr.startswith("nasdiag "), shown.stderr


def test_a_full_disk_while_drawing_the_figures_says_the_run_is_complete(tmp_path, capsys, monkeypatch):
    """The run recorded to its end, then its first figure met a full disk: the line was only "disk full ...
    (run-figs/.arch_normal_heatmap.png.tmp)", an empty figure folder stayed, the same command was refused as a record
    that exists and its --resume as a run already finished. The line says the run is complete and gives the plot
    command (as Ctrl-C while drawing does), no folder is left, and that command draws them."""
    import errno

    from matplotlib.figure import Figure

    def full(self, fname, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(fname))

    out = tmp_path / "run.h5"
    monkeypatch.setattr(Figure, "savefig", full)
    assert main([t for t in _search(out) if t != "--no-figs"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "disk full" in lines[0], lines
    figures = tmp_path / "run-figs"
    assert f"while drawing the figures: the run is complete in {out}; draw them with nasdiag plot " in lines[0]
    assert not figures.exists() and len(_steps(out)) > 0
    monkeypatch.undo()
    command = shlex.split(lines[0].split("; draw them with nasdiag ", 1)[1])
    assert command == ["plot", str(out), "--out", str(figures)]
    assert main([*command, "--figures", "scalars", "--dpi", "20"]) == 0
    assert [p.name for p in figures.iterdir()] == ["scalars.png"]


@pytest.mark.parametrize("command", ["plot", "report"])
def test_a_file_size_limit_in_plot_or_report_names_what_was_written(command, rec, tmp_path):
    """``ulimit -f 1`` (1 KiB): the page's write and PIL's png chunks fail with EFBIG without naming their file, and
    the line was "disk full or file-size limit reached (File too large)", not saying which write. It names the page
    or the figure folder; nothing is left (the page's temporary file, the figure folder made for it)."""
    argv = ([command, str(rec), "--out", "figs", "--figures", "scalars", "--dpi", "20"] if command == "plot"
            else [command, str(rec), "--out", "page.html", "--dpi", "20"])
    before = snapshot(tmp_path)
    done = _nasdiag(argv, tmp_path, _limited(resource.RLIMIT_FSIZE, 1024))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    where = "(writing the figures under figs)" if command == "plot" else "(writing page.html)"
    assert lines[0] == f"nasdiag: error: disk full or file-size limit reached (File too large) {where}", lines[0]
    assert snapshot(tmp_path) == before


# -- the batch scripts' --device -------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["bench_cost", "bench_hessian", "bench_search"])
@pytest.mark.parametrize("name", ["cuda:7", "mps", "meta"])
def test_a_script_device_this_machine_lacks_is_one_line_before_any_work(script, name, tmp_path, capsys, monkeypatch):
    """``bench_cost.py --device cuda:7`` (or mps) on a machine without it was torch's AssertionError ("Torch not compiled
    with CUDA enabled") or RuntimeError traceback once the supernet was built; meta a line after the setup. The
    available devices are named before any work (on this CPU machine: cpu; cuda needs a GPU, and is refused alike
    where there is none)."""
    import torch

    from test_cli_misuse_round9 import test_a_benchmark_argument_is_refused_in_one_line_before_any_work as refused_script

    if (name == "cuda:7" and torch.cuda.device_count() > 7) or (name == "mps" and torch.backends.mps.is_available()):
        pytest.skip(f"this machine has {name}")  # pragma: no cover
    refused_script(script, ["--device", name], f"--device: {name!r} is not available on this machine; use one of cpu",
                   tmp_path, capsys, monkeypatch)


def test_a_resume_whose_next_segment_a_full_disk_cannot_hold_is_one_line(tmp_path, capsys):
    """``--resume --epochs 2`` under ``ulimit -f 20``: the record's next segment cannot be made. The error line came
    after a warning saying the same failure again ("while handling RecordError, closing the recorder failed: cannot
    create record segment ..."): two lines. One line, the record as it was (its steps readable), and the resume then
    runs."""
    out = tmp_path / "run.h5"
    first = _search(out, "--diagnostics", "cost,hessian")  # a segment header of every path: more than 20 KiB
    assert main(first) == 0
    capsys.readouterr()
    kept = _steps(out)
    done = _nasdiag([*first, "--epochs", "2", "--resume"], tmp_path, _limited(resource.RLIMIT_FSIZE, 20 * 1024))
    lines = [line for line in done.stderr.strip().splitlines() if "(UserWarning)" not in line]  # "extends the run"
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "file-size limit reached" in lines[0] and f"the record {out} keeps steps 1 to {kept[-1]}" in lines[0], lines
    assert _steps(out) == kept
    _resume_by_the_line(lines[0], capsys)
    assert _steps(out) == list(range(1, 2 * len(kept) + 1))
