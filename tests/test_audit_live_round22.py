"""Round 22 audit of live records and reports (area: live)."""

import calendar
import os
import time

import pytest


@pytest.fixture
def local_zone():
    """Set the process's local time zone for one test (``TZ`` + ``time.tzset``), restored after."""
    before = os.environ.get("TZ")

    def use(zone):
        os.environ["TZ"] = zone
        time.tzset()

    try:
        yield use
    finally:
        if before is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = before
        time.tzset()


@pytest.mark.parametrize("zone", ["UTC", "Asia/Tokyo", "America/New_York", "Europe/Berlin"])
def test_time_per_step_does_not_depend_on_the_readers_time_zone(local_zone, zone):
    """A segment's ``created`` carries its UTC offset (``%z``); the report read it as local time of the reading machine:
    100 rows in 100 s were '≈ 325 s' per step under Asia/Tokyo and '≈ 0 s' under America/New_York (a record written
    on a UTC host, reported on a laptop)."""
    from nasdiag.plot.report import _seconds_per_step

    if not os.path.exists(f"/usr/share/zoneinfo/{zone}"):
        pytest.skip(f"no zoneinfo for {zone}")
    local_zone(zone)
    # written at 12:00:00 UTC by a writer whose clock said +0000, and at 13:00:00+0100 by one in Berlin (same instant)
    last_write = calendar.timegm((2026, 11, 28, 12, 1, 40, 0, 0, 0))  # 100 s later, an absolute time (a file's mtime)
    for created in ("2026-11-28T12:00:00+0000", "2026-11-28T13:00:00+0100", "2026-11-28T07:00:00-0500"):
        text = _seconds_per_step({}, [{"created": created, "rows": 100, "modified": last_write}])
        assert text is not None and text.startswith("≈ 1 s "), (zone, created, text)


def _killed_writer(path):
    """A record whose writer committed 3 rows and was then killed (SIGKILL): its lock file is left, held by none."""
    import signal
    import subprocess
    import sys

    code = (
        "import os, signal, sys\n"
        "from nasdiag.record import Recorder\n"
        "r = Recorder(sys.argv[1], flush_every=2, handle_sigterm=False)\n"
        "for s in range(3):\n"
        "    r.log(s, {'scalars/train_loss': 1.0 / (s + 1)})\n"
        "r.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr


def test_report_says_a_killed_writer_stopped_and_a_live_one_writes(tmp_path):
    """The page of a record whose writer was killed said "the search is still writing this record, or crashed" (the
    note of a live record) although the kernel's table of locks tells that no writer holds it: a reader waited for
    rows that never came. A writer that holds the lock is still named as writing."""
    from nasdiag.plot.report import _live_note
    from nasdiag.record import Recorder, load

    killed = tmp_path / "killed.h5"
    _killed_writer(killed)
    assert len(load(killed)["step"]) == 3 and (tmp_path / "killed.h5.lock").exists()
    note = _live_note(killed)
    assert "stopped without closing it" in note and "still writing" not in note, note

    live = tmp_path / "live.h5"
    with Recorder(live, flush_every=2) as recorder:
        recorder.log(0, {"scalars/train_loss": 1.0})
        recorder.flush()
        note = _live_note(live)
        assert "is still writing this record" in note and f"pid {os.getpid()}" in note, note
    assert _live_note(live) == ""  # closed cleanly: no lock file, no note


def test_a_record_replaced_while_it_is_read_is_read_again_not_called_damaged(tmp_path, monkeypatch):
    """A reader that listed a record's three segments just before another writer replaced the record (``overwrite=True``,
    ``nasdiag search --force``: all segments deleted, a new run written) found the later ones gone and said
    "record ... is damaged at run.seg0001.h5 row 0: it cannot be opened" (1 read in 30 of a reader loop beside a writer
    that restarts), although neither record was ever damaged. A listing that changed during the read is looked at
    again: the read gives the new record whole."""
    import numpy as np

    from nasdiag.record import Recorder, load
    from nasdiag.record import reader

    path = tmp_path / "run.h5"
    with Recorder(path, flush_every=2) as rec:  # the old run: three segments (a path first logged later starts one)
        for step in range(6):
            rec.log(step, {"scalars/a": float(step), **({"x/late": 1.0} if step >= 2 else {}),
                           **({"x/later": 1.0} if step >= 4 else {})})
    assert (tmp_path / "run.seg0002.h5").exists()

    original = reader.read_segment
    replaced = []

    def read_after_a_replacement(index, file, *args, **kwargs):
        if not replaced:  # the files are listed; now another writer replaces the record before they are opened
            replaced.append(True)
            with Recorder(path, flush_every=2, overwrite=True) as other:
                for step in range(3):
                    other.log(step, {"scalars/a": 10.0 + step})
        return original(index, file, *args, **kwargs)

    monkeypatch.setattr(reader, "read_segment", read_after_a_replacement)
    record = load(path)
    assert replaced
    assert np.array_equal(record["step"], np.arange(3)) and np.array_equal(record["scalars/a"], 10.0 + np.arange(3))
    assert "x/late" not in record


def test_time_per_step_counts_the_rows_before_a_segments_first_flush(tmp_path):
    """A segment is built (and its ``created`` stamped) at its first flush, after its first batch of rows was computed;
    the report divided the time from there to the last write by every row: 100 rows of 0.05 s each, flush_every=64,
    were '≈ 0.0248 s' per step. Each segment now carries the time of its first row, and the estimate is within a few
    percent of the sleep that each row took (a closed form)."""
    import re

    from nasdiag.plot.report import _seconds_per_step, _segment_attrs
    from nasdiag.record import Recorder
    from nasdiag.record.reader import read_segments

    path = tmp_path / "run.h5"
    per_row = 0.02
    with Recorder(path, flush_every=64, flush_seconds=None) as rec:  # one batch: written at close
        for step in range(40):
            time.sleep(per_row)
            rec.log(step, {"scalars/train_loss": 1.0})
    attrs = _segment_attrs(read_segments(path))
    text = _seconds_per_step({}, attrs)
    found = re.match(r"≈ (\S+) s ", text or "")
    assert found, text
    # sleeps are a lower bound; the loop's own work adds a little (2 busy cores: allow 50 % more)
    assert per_row * 0.95 <= float(found.group(1)) <= per_row * 1.5, text
