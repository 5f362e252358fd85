"""Kill record writers with SIGKILL at random moments, many times (the test suite runs 20).

    python scripts/record_kill_trials.py                  # 200 trials in a temporary folder
    python scripts/record_kill_trials.py --trials 1000 --dir /scratch/me   # on the file system you use

Each trial (nasdiag.record.crashtest.kill_trial) starts a writer in a child process (fresh, or
resuming and rewinding an existing record), kills it right after opening or after a random number
of commits, then checks that the record loads, holds exactly the first rows logged (no torn row),
lost at most one unflushed buffer, and resumes without touching the crashed files. Prints one JSON
line per trial, a summary, and exits 1 if any trial failed.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nasdiag.record.crashtest import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--trials" or a.startswith("--trials=") for a in argv):
        argv = ["--trials", "200", *argv]
    sys.exit(main(argv))
