"""Round 23 audit of the record and report tidy-ups (area: records23).

Defects these tests found (each fails without its fix):
- the lock of a record was read by three functions with two rules (`live_holder` compared the device and inode of
  the lock file against the kernel's table, `writer_gone` and the reader's `_writer_alive` the inode alone), and the
  report's note read it three times: on a file system whose table writes the device otherwise than ``os.stat`` (btrfs
  subvolumes, overlay and network file systems), the page of a record a live writer held said "the search is still
  writing this record, or crashed" and `nasdiag search` said "pass --resume or --force" of a record being written.
  One function, `nasdiag.record.lock.read_lock`, reads the lock once and answers every question.
- the JSON attributes of a record (root ``config``, the attributes of ``/meta``, and load's ``meta/<key>`` texts) held
  Python's ``NaN``/``Infinity``/``-Infinity`` literals for non-finite floats of a user's meta (a SearchConfig dict whose
  hp holds nan and inf), which ``jq`` and standard JSON parsers refuse: a non-finite float is written as
  ``{"__float__": "nan"}`` (``"inf"``, ``"-inf"``) and read back as the float (`nasdiag.record.schema.dumps_json`,
  `loads_json`; docs/schema.md).
- a named pipe at ``run.h5.lock`` made ``load("run.h5")`` and the report wait for ever (``open`` of a FIFO blocks):
  `read_lock` opens the lock without blocking and reads a regular file only.
- `nasdiag report` killed (SIGKILL) while it wrote its page left its hidden temporary page next to --out for ever,
  where a killed plot's temporary figures are removed by the next plot: the page is built under the figures' name
  (`nasdiag.plot.registry.temporary_path`) and the next report removes a killed one's (`_remove_stale_temporaries`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

LINUX_LOCKS = pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="the kernel's lock table is Linux's")


class _Holder:
    """A process (not this one) that holds an flock on ``lock`` and has written a writer's description in it, as
    `WriterLock.acquire` does; released (the process ends) at ``close``."""

    def __init__(self, lock):
        code = (
            "import fcntl, json, os, socket, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(), 'since': 'then'}).encode())\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@LINUX_LOCKS
def test_a_live_writer_is_told_the_same_where_the_lock_table_writes_the_device_otherwise(tmp_path, monkeypatch):
    """The kernel's table writes a lock's device as the superblock's, which is not ``os.stat``'s st_dev on btrfs
    subvolumes (and some overlay and network file systems). Here a real flock is held by another process and the table
    is the kernel's with that lock's device written otherwise: every question about the writer must answer "a writer
    holds it" (before: the report's note said "still writing this record, or crashed" and `live_holder` None, while
    the reader took the writer as live)."""
    from nasdiag.plot.report import _live_note
    from nasdiag.record import lock as lockmod
    from nasdiag.record import reader

    record = tmp_path / "run.h5"
    lock = tmp_path / "run.h5.lock"
    holder = _Holder(lock)
    try:
        inode = os.stat(lock).st_ino
        real = open("/proc/locks").read()
        lines = [line for line in real.splitlines() if line.split()[-3].endswith(f":{inode}")]
        assert len(lines) == 1, real  # the kernel lists the other process's lock on it
        fields = lines[0].split()
        fields[-3] = f"00:2a:{inode}"  # the device as btrfs writes it for a subvolume's file
        table = tmp_path / "locks"
        table.write_text(real.replace(lines[0], " ".join(fields)))
        monkeypatch.setattr(lockmod, "LOCK_TABLE", str(table))

        described = f"pid {holder.proc.pid} on "
        assert described in (lockmod.live_holder(str(record)) or "")
        note = _live_note(record)
        assert "is still writing this record" in note and described in note, note
        assert reader._writer_alive(str(record)) and not reader.writer_gone(str(record))
    finally:
        holder.close()
    # released: the same table no longer lists it (the kernel's own table, read again)
    monkeypatch.setattr(lockmod, "LOCK_TABLE", "/proc/locks")
    assert lockmod.live_holder(str(record)) is None and reader.writer_gone(str(record))
    assert "stopped without closing it" in _live_note(record)


@LINUX_LOCKS
@pytest.mark.parametrize("writer", ["live", "killed"])
def test_the_report_note_reads_the_lock_file_and_the_lock_table_once(tmp_path, writer):
    """The report's note read the lock of a record left by a killed writer twice and the lock table twice per page (a
    writer that took or left the lock in between made the answers disagree); once each, also for a live writer.
    Counted with an audit hook on every ``open``, in a child process."""
    record = tmp_path / "run.h5"
    lock = tmp_path / "run.h5.lock"
    holder = _Holder(lock)
    if writer == "killed":
        holder.close()  # its process ended: the lock file is left, held by none
    code = (
        "import collections, json, sys\n"
        "from nasdiag.plot.report import _live_note\n"
        "opened = collections.Counter()\n"
        "watch = {sys.argv[2], '/proc/locks'}\n"
        "def hook(event, args):\n"
        "    if event == 'open' and str(args[0]) in watch:\n"
        "        opened[str(args[0])] += 1\n"
        "sys.addaudithook(hook)\n"
        "note = _live_note(sys.argv[1])\n"
        "print(json.dumps({'note': note, 'opened': opened}))\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code, str(record), str(lock)], capture_output=True, text=True,
                              timeout=120)
    finally:
        if writer == "live":
            holder.close()
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    said = "is still writing this record" if writer == "live" else "stopped without closing it"
    assert said in out["note"], out
    assert out["opened"] == {str(lock): 1, "/proc/locks": 1}, out


def _small_record(path):
    """A closed record of 4 rows of one scalar."""
    from nasdiag.record import Recorder

    with Recorder(path, flush_every=2) as recorder:
        for step in range(4):
            recorder.log(step, {"scalars/train_loss": 1.0 / (step + 1)})
    return path


def test_a_report_killed_at_its_write_leaves_no_temporary_page_after_the_next_report(tmp_path, capsys):
    """``nasdiag report run.h5 --out page.html`` killed (SIGKILL) while it wrote its page left its hidden temporary page
    next to --out for ever (a 3 kB ``.page.html.<pid>.<hex>.tmp`` per killed report), while the figures' temporaries of
    killed plots are removed by the next plot. The next report of the page removes it, and keeps that of a report still
    running."""
    import signal
    import time

    from nasdiag.cli import main

    record = _small_record(tmp_path / "run.h5")
    out = tmp_path / "pages" / "page.html"
    marker = tmp_path / "writing"
    code = (
        "import os, sys, time\n"
        "real_fsync = os.fsync\n"
        "def fsync_then_wait(fd):\n"  # the page is written, not yet renamed: the report is killed here
        "    real_fsync(fd)\n"
        "    open(sys.argv[3], 'w').close()\n"
        "    time.sleep(120)\n"
        "os.fsync = fsync_then_wait\n"
        "from nasdiag.cli import main\n"
        "sys.exit(main(['report', sys.argv[1], '--out', sys.argv[2], '--figures', 'scalars']))\n"
    )
    env = {**os.environ, "MPLBACKEND": "Agg"}
    child = subprocess.Popen([sys.executable, "-c", code, str(record), str(out), str(marker)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), child.stderr.read() if child.poll() is not None else "the report never wrote"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stderr.close()
    left = [p.name for p in out.parent.iterdir()]
    assert len(left) == 1 and left[0].startswith(".") and left[0].endswith(".tmp"), left  # the killed report's page
    assert "page.html" in left[0] and "<!doctype html" in (out.parent / left[0]).read_text(encoding="utf-8").lower()

    # a report still running (this process's parent: alive) writes the same page: its temporary is kept
    running = out.parent / f".{os.getppid()}.0123abcd.page.html.tmp"
    running.write_text("being written")
    assert main(["report", str(record), "--out", str(out), "--figures", "scalars"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(["page.html", running.name])
    assert out.read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")


def _strict_json(text):
    """A plain JSON parser of the standard (RFC 8259): Python's ``json.loads`` with its ``NaN``/``Infinity`` extension
    refused, as ``jq`` and the JSON parsers of other languages refuse them."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _config_with_nonfinite():
    """A user's config for their own loop, built from a SearchConfig, whose hp holds NaN and ±inf (as a user's
    experiment sweeps: an unclipped gradient, a not-yet-known value)."""
    from nasdiag.search import SearchConfig

    config = SearchConfig(method="darts", hp={"grad_clip": float("inf"), "w_lr": float("nan"), "floor": -float("inf"),
                                              "w_momentum": 0.9, "schedule": [1.0, float("nan")]}, record="run.h5")
    return config.to_dict()


def test_json_attributes_of_the_record_are_standard_json_and_read_back_nan_and_inf(tmp_path):
    """``meta={"config": <a SearchConfig's dict whose hp holds nan and inf>, "hp": ...}`` was written into the root
    ``config`` and the ``/meta`` attributes as ``{"grad_clip": Infinity, "w_lr": NaN, ...}``: Python's own extension,
    refused by ``jq`` and every standard JSON parser (here: ``json.loads`` with the constants refused). They are
    standard JSON now, NaN/inf written as ``{"__float__": "nan"}`` (not dropped), and read back as the floats."""
    import math

    import h5py

    from nasdiag.record import Recorder, load, load_meta

    config = _config_with_nonfinite()
    hp = config["hp"]
    path = tmp_path / "run.h5"
    with Recorder(path, meta={"config": config, "hp": hp, "bound": float("inf")}, flush_every=2) as recorder:
        for step in range(2):
            recorder.log(step, {"scalars/train_loss": 1.0})

    with h5py.File(path, "r") as f:  # the file itself, read without nasdiag
        texts = {"config": f.attrs["config"], "hp": f["meta"].attrs["hp"], "bound": f["meta"].attrs["bound"]}
    texts = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in texts.items()}
    stored = {k: _strict_json(v) for k, v in texts.items()}  # before: "NaN is not JSON"
    assert stored["hp"]["w_lr"] == {"__float__": "nan"} and stored["hp"]["grad_clip"] == {"__float__": "inf"}
    assert stored["hp"]["floor"] == {"__float__": "-inf"} and stored["bound"] == {"__float__": "inf"}
    assert stored["hp"]["schedule"] == [1.0, {"__float__": "nan"}] and stored["hp"]["w_momentum"] == 0.9
    assert stored["config"]["hp"] == stored["hp"] and stored["config"]["method"] == "darts"

    meta = load_meta(path)  # read back as the floats
    for got in (meta["hp"], meta["config"]["hp"]):
        assert math.isnan(got["w_lr"]) and got["grad_clip"] == math.inf and got["floor"] == -math.inf
        assert got["schedule"][0] == 1.0 and math.isnan(got["schedule"][1]) and got["w_momentum"] == 0.9
    assert meta["bound"] == math.inf
    record = load(path)  # load's meta/<key> texts are the JSON as stored
    assert _strict_json(str(record["meta/hp"])) == stored["hp"]
    assert _strict_json(str(record["meta/config"])) == stored["config"]


def test_a_record_whose_meta_holds_nan_resumes_as_the_same_run(tmp_path):
    """A resume with the same ``meta`` (config holding a NaN) must not be refused as "it holds another run (config
    ...)" (NaN != NaN): the NaN read back from its tag is the same config. (Before, json's one NaN object made the
    comparison pass; this guards the tagged form, whose NaN is made anew.)"""
    import math
    import warnings

    from nasdiag.record import Recorder, RecordWarning, load, load_meta

    config = _config_with_nonfinite()
    path = tmp_path / "run.h5"
    with Recorder(path, meta={"config": config}, flush_every=2) as recorder:
        recorder.log(0, {"scalars/train_loss": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecordWarning)  # no "resuming with a different config" either
        with Recorder(path, meta={"config": config}, resume=True, flush_every=2) as recorder:
            recorder.log(1, {"scalars/train_loss": 0.5})
    assert list(load(path)["step"]) == [0, 1] and math.isnan(load_meta(path)["config"]["hp"]["w_lr"])


def test_meta_holding_the_tag_form_itself_is_refused_in_one_line(tmp_path):
    """An object ``{"__float__": ...}`` of the user's would be read back as a float: refused when the Recorder is made,
    nothing written."""
    from nasdiag.record import RecordError, Recorder

    with pytest.raises(RecordError, match=r"^meta\['x'\] holds \{'__float__': \.\.\.\}.*rename that key$"):
        Recorder(tmp_path / "run.h5", meta={"x": {"a": [{"__float__": "nan"}]}})
    assert list(tmp_path.iterdir()) == []


def test_a_named_pipe_at_the_lock_path_does_not_hang_load_or_the_report(tmp_path):
    """A named pipe at ``run.h5.lock`` (no lock file: nothing ever writes into it) made ``load("run.h5")`` and the
    report's note wait for a writer of the pipe for ever (``open`` of a FIFO blocks); they read the record."""
    record = _small_record(tmp_path / "run.h5")
    os.mkfifo(tmp_path / "run.h5.lock")
    code = (
        "import sys\n"
        "from nasdiag.record import load\n"
        "from nasdiag.plot.report import _live_note\n"
        "print(len(load(sys.argv[1])['step']))\n"
        "_live_note(sys.argv[1])\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code, str(record)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("load of a record whose lock path is a named pipe did not return in 60 s")
    assert done.returncode == 0 and done.stdout.split() == ["4"], done.stderr
