"""Round 22, plot/report output paths: symbolic links, folders and replacing figure files.

Defects fixed (`nasdiag.plot.registry.save`, the one function that writes a figure for ``nasdiag plot``, the
comparison figures and the figures ``nasdiag search`` draws at its end; `nasdiag.plot.commands.foreign_figures`, the
check before anything is drawn):
- a figure file that is a symbolic link to a figure elsewhere was replaced by the new figure: the link was lost and the
  file it named kept the old figure (``report --out LINK`` had the same defect, fixed in 4515bdc): now written through;
- a figure name that is a link to a folder, a link to nothing, or a link to a pipe was replaced by a file (the link
  lost) without a word: now refused in one line before anything is drawn, as a folder of that name already was;
- the temporary file had one fixed name ``.<figure>.tmp``, opened for writing: a link of that name had the PNG written
  into the file it named (any file of the user's, outside the figure folder), and two plots into one folder wrote into
  the same temporary file; and the figure was renamed into place unsynced (a crash after the rename could leave an
  empty figure under its name). Now a fresh name created exclusively, ``os.fsync`` before ``os.replace``, as the
  checkpoint writer does; ``nasdiag report`` now syncs its page before the rename too;
- a read-only figure folder (or a link into one) was "location is read-only ... (figs/.scalars.png.tmp)", naming
  nasdiag's hidden temporary file and nothing to do: now one line naming the figure, its folder and what to do;
- ``search --force`` removed a link named as a figure the new run does not draw (to a figure kept elsewhere): the link
  was lost; now only regular files holding nasdiag's mark are removed.

Checked and right (not repeated here): --out a link to a folder (drawn into that folder, the link kept); --out a link
to a file (one line, exit 2); a figure name that is a folder (refused, round 19); report --out a link to a folder, to
nothing (refused: "is a folder", "not a regular file"); a read-only --out's missing subfolder (one line, exit 2).
"""

from __future__ import annotations

import os

import pytest

from test_cli_errors import TINY, refused

FIGURE = ["--figures", "scalars", "--no-progress", "--dpi", "30"]


@pytest.fixture
def record(tmp_path):
    from plot_records import write_record

    return write_record(tmp_path / "run.h5", epochs=1, steps_per_epoch=4, cells=("normal",))


def test_a_figure_that_is_a_symbolic_link_is_written_through_and_the_link_stays(record, tmp_path, capsys):
    """``figs/scalars.png`` a link to ``paper/fig3.png`` (a figure nasdiag drew of another run): ``nasdiag plot --out figs``
    replaced the link by the new figure (the link lost, fig3.png kept the old figure). The new figure goes into the file
    the link names, byte for byte what the same plot draws into a plain folder."""
    from nasdiag.cli import main
    from plot_records import write_record

    other = write_record(tmp_path / "other.h5", epochs=2, steps_per_epoch=3, cells=("normal",))
    assert main(["plot", str(other), "--out", str(tmp_path / "paper"), *FIGURE]) == 0
    old = (tmp_path / "paper" / "scalars.png").read_bytes()
    assert main(["plot", str(record), "--out", str(tmp_path / "plain"), *FIGURE]) == 0  # the reference
    new = (tmp_path / "plain" / "scalars.png").read_bytes()
    assert new != old
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "scalars.png").symlink_to(os.path.join("..", "paper", "scalars.png"))
    capsys.readouterr()
    assert main(["plot", str(record), "--out", str(tmp_path / "figs"), *FIGURE]) == 0, capsys.readouterr().err
    assert os.readlink(tmp_path / "figs" / "scalars.png") == os.path.join("..", "paper", "scalars.png")
    assert (tmp_path / "paper" / "scalars.png").read_bytes() == new
    assert os.listdir(tmp_path / "figs") == ["scalars.png"] and os.listdir(tmp_path / "paper") == ["scalars.png"]


def test_write_figures_writes_through_a_link_too(record, tmp_path):
    """The Python API (what ``nasdiag search`` calls for its figures) writes through the same function."""
    from nasdiag.plot import write_figures

    (tmp_path / "plain").mkdir()
    write_figures(record, tmp_path / "plain", figures="scalars", dpi=30)
    (tmp_path / "figs").mkdir()
    (tmp_path / "elsewhere.png").write_bytes(b"old")
    (tmp_path / "figs" / "scalars.png").symlink_to(tmp_path / "elsewhere.png")
    written = write_figures(record, tmp_path / "figs", figures="scalars", dpi=30)
    assert [str(p) for p in written] == [str(tmp_path / "figs" / "scalars.png")]
    assert (tmp_path / "figs" / "scalars.png").is_symlink()
    assert (tmp_path / "elsewhere.png").read_bytes() == (tmp_path / "plain" / "scalars.png").read_bytes()


def _link_to_folder(tmp_path):
    (tmp_path / "shots").mkdir()
    (tmp_path / "figs" / "scalars.png").symlink_to(tmp_path / "shots")


def _link_to_nothing(tmp_path):
    (tmp_path / "figs" / "scalars.png").symlink_to(tmp_path / "gone" / "scalars.png")


def _link_to_a_pipe(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "figs" / "scalars.png").symlink_to(tmp_path / "pipe")


@pytest.mark.parametrize("make,said", [(_link_to_folder, "holds scalars.png/, named as a figure"),
                                       (_link_to_nothing, "holds scalars.png (a symbolic link to nothing)"),
                                       (_link_to_a_pipe, "holds scalars.png, named as a figure but not drawn")])
def test_a_figure_name_that_is_a_link_to_no_figure_is_refused_and_kept(make, said, record, tmp_path, capsys):
    """A link of a figure's name to a folder, to nothing or to a pipe was replaced by the new figure (exit 0, the link
    lost). No figure can be written through it: one line, exit 2, the link as it was."""
    (tmp_path / "figs").mkdir()
    make(tmp_path)
    target = os.readlink(tmp_path / "figs" / "scalars.png")
    refused(["plot", str(record), "--out", str(tmp_path / "figs"), *FIGURE], tmp_path, said, capsys)
    assert os.readlink(tmp_path / "figs" / "scalars.png") == target


def test_search_refuses_a_figs_folder_with_a_link_to_a_folder_before_it_searches(tmp_path, capsys):
    """The figures of ``nasdiag search`` are checked at its start by the same function: a link to a folder in --figs
    is refused there, not replaced at the end of the run."""
    (tmp_path / "figs").mkdir()
    _link_to_folder(tmp_path)
    argv = [a for a in TINY if a != "--no-figs"] + ["--figs", str(tmp_path / "figs")]
    refused(["search", *argv, "--out", str(tmp_path / "run.h5")], tmp_path, "holds scalars.png/", capsys)
    assert (tmp_path / "figs" / "scalars.png").is_symlink()


def test_a_link_named_as_the_temporary_file_does_not_receive_the_figure(record, tmp_path, capsys):
    """The figure was first written to ``.scalars.png.tmp``, opened for writing: a link of that name (left behind, or
    planted) had the PNG written into the file it named, here the user's notes outside the figure folder, and then
    became ``scalars.png``. The temporary file is a fresh name, created exclusively."""
    from nasdiag.cli import main

    (tmp_path / "notes.txt").write_text("precious\n")
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / ".scalars.png.tmp").symlink_to(tmp_path / "notes.txt")
    assert main(["plot", str(record), "--out", str(tmp_path / "figs"), *FIGURE]) == 0, capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "precious\n"
    figure = tmp_path / "figs" / "scalars.png"
    assert not figure.is_symlink() and figure.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert sorted(os.listdir(tmp_path / "figs")) == [".scalars.png.tmp", "scalars.png"]


@pytest.mark.parametrize("fmt", ["png", "pdf"])
def test_a_figure_is_synced_to_disk_before_it_replaces_the_old_one(fmt, tmp_path, monkeypatch):
    """A figure was renamed over the old one unsynced: after a power loss the name could hold an empty or partial file
    (the old figure gone). As the checkpoint writer does: the whole new file is written and ``os.fsync``-ed, then renamed
    over the figure's name in one step; nothing else is left in the folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nasdiag.plot.registry import save

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync", name, os.fstat(fd).st_size))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.abspath(src), os.path.getsize(src), os.path.abspath(dst)))
        return real_replace(src, dst)

    path = tmp_path / f"scalars.{fmt}"
    path.write_bytes(b"the old figure")
    fig = plt.figure(figsize=(1, 1))
    fig.add_subplot().plot([0, 1])
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save(fig, path, 30)
    monkeypatch.undo()
    renames = [e for e in events if e[0] == "replace"]
    assert len(renames) == 1 and renames[0][3] == str(path), events
    synced = [e for e in events[:events.index(renames[0])] if e[0] == "fsync" and e[1] == renames[0][1]]
    assert synced and synced[-1][2] == renames[0][2] == path.stat().st_size > 100, events
    assert os.listdir(tmp_path) == [path.name]


def _without_root_override():
    """The command prefix that runs a process unable to bypass file permissions: none for a user, ``setpriv`` without
    CAP_DAC_OVERRIDE for root (root writes into a read-only folder)."""
    import shutil

    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root needs setpriv to drop CAP_DAC_OVERRIDE")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]


@pytest.mark.parametrize("through_a_link", [False, True])
def test_a_read_only_figure_folder_is_one_line_naming_the_folder_not_a_temporary_file(through_a_link, record, tmp_path):
    """``nasdiag plot --out figs`` into a read-only folder (or through a link into one) said "location is read-only or
    not writable (Permission denied) (figs/.scalars.png.tmp)": a hidden temporary file of nasdiag's own named as the
    problem, and nothing to do. One line names the figure and its folder and says what to do; exit 2, nothing left."""
    import subprocess
    import sys

    figs, folder = tmp_path / "figs", tmp_path / ("shared" if through_a_link else "figs")
    folder.mkdir(exist_ok=True)
    if through_a_link:
        figs.mkdir()
        (figs / "scalars.png").symlink_to(folder / "scalars.png")
        from nasdiag.cli import main

        assert main(["plot", str(record), "--out", str(folder), *FIGURE]) == 0
    os.chmod(folder, 0o555)
    try:
        done = subprocess.run([*_without_root_override(), sys.executable, "-m", "nasdiag", "plot", str(record), "--out",
                               str(figs), *FIGURE], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, MPLBACKEND="Agg"))
    finally:
        os.chmod(folder, 0o755)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"cannot write the figure {folder / 'scalars.png'}" in lines[0] and ".tmp" not in lines[0], lines[0]
    assert "not writable" in lines[0] and "a folder where files can be written" in lines[0], lines[0]
    assert sorted(os.listdir(folder)) == ([] if not through_a_link else ["scalars.png"])


def test_search_force_keeps_a_link_named_as_a_figure_it_does_not_draw(record, tmp_path):
    """``nasdiag search --force --figs figs`` removes the figures the replaced run drew that the new one does not (an
    XNAS run's regret_bound.png replaced by a DARTS run). A link ``figs/regret_bound.png`` to a figure kept elsewhere
    (no file the replaced run drew) was removed too, the link lost; as the figures of a run replaced into another
    folder, only regular files that hold nasdiag's mark go."""
    from nasdiag.cli import main
    from nasdiag.search.runner import _remove_replaced_figures

    assert main(["plot", str(record), "--out", str(tmp_path / "kept"), *FIGURE]) == 0
    figs = tmp_path / "figs"
    assert main(["plot", str(record), "--out", str(figs), *FIGURE]) == 0
    os.rename(figs / "scalars.png", figs / "wipeouts.png")  # a figure of the replaced run this one does not draw
    (figs / "regret_bound.png").symlink_to(tmp_path / "kept" / "scalars.png")
    (figs / "scalars.png").write_bytes((tmp_path / "kept" / "scalars.png").read_bytes())  # this run's
    _remove_replaced_figures(str(figs), [str(figs / "scalars.png")], str(record))
    assert sorted(os.listdir(figs)) == ["regret_bound.png", "scalars.png"]
    assert os.readlink(figs / "regret_bound.png") == str(tmp_path / "kept" / "scalars.png")


def test_a_report_is_synced_to_disk_before_it_replaces_the_old_page(record, tmp_path, monkeypatch):
    """``nasdiag report`` renamed its page over the old one unsynced (the figures and checkpoints are synced first): after
    a power loss report.html could be empty, the old page gone. The whole page is ``os.fsync``-ed, then renamed."""
    from nasdiag.plot.report import write_report

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.abspath(src), os.path.getsize(src), os.path.abspath(dst)))
        return real_replace(src, dst)

    out = tmp_path / "report.html"
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_report(record, out, figures=["arch"], dpi=20)
    monkeypatch.undo()
    renames = [e for e in events if e[0] == "replace" and e[3] == str(out)]
    assert len(renames) == 1, events
    synced = [e for e in events[:events.index(renames[0])] if e[0] == "fsync" and e[1] == renames[0][1]]
    assert synced and synced[-1][2] == renames[0][2] == out.stat().st_size > 1000, events
