"""A twenty-first new user's misuse of the ``nasdiag`` CLI, armed with README.md, ``--help`` and ``nasdiag methods``:
what rounds 1-20 (test_cli_errors.py, test_cli_search_misuse.py, test_cli_plot_misuse.py, test_cli_misuse_round3..20.py,
test_scripts_misuse_round14.py) did not cover: ``nasdiag search --out log.h5 --force`` over an HDF5 file of another
program that holds a ``/step`` column (a training log's common name) but none of a record's other parts took it for a
damaged record and replaced it, exit code 0, where README says --force refuses "another HDF5 file"; ``plot`` and
``report`` of it said "not a nasdiag record segment ...; remove or rename it", the user's own file.
Every such mistake is one line on stderr saying what was wrong and what to do, exit code 2, no traceback, nothing left
behind.
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
