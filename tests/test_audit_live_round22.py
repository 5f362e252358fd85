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
