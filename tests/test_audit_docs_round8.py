"""Round-8 docs audit: every ```python block of README.md and docs/*.md runs as a new user would run it.

A user copies the blocks of one file, in order, into one Python session. Before this round, docs/schema.md's
record example (``range(...)``, undefined ``ops``/``edges``/``loss``), docs/hessian.md's and docs/spectrum.md's
examples (undefined ``model``/``net``/``x``/``y``/``x_val``, ``arch_diag_hessian(...)``) stopped at NameError or
TypeError; docs/figures.md's "add a figure" block re-registered the shipped ``attention`` figure (ValueError);
docs/methods.md's adapt loop used the user's own ``model``/``PRIMITIVES``/``loader``; README.md's and
docs/methods.md's ``run(SearchConfig(...))`` searched 8 and 4 epochs (over a minute here).

Now a block is either runnable as written (it may use what earlier blocks of the same file defined) or is
marked as the user's own code by ``<!-- fragment -->`` on the line right above its fence, with text saying so.
``<!-- needs-gpu: reason -->`` / ``<!-- needs-network: reason -->`` skip a block with that reason (none today).
The round-3 test checks what the README's costs/regret/records blocks compute; this one only runs everything.
"""
import os
import pathlib
import re
import traceback
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"<!--\s*needs-(gpu|network):\s*(.+?)\s*-->")


def blocks(path):
    """[(line of the fence, code, marker line above it)] of every python block of a markdown file."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        above = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1), above))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_of_the_docs_runs_as_written_or_is_marked_a_fragment(doc, tmp_path, monkeypatch):
    """Runs a file's non-fragment blocks in order in one namespace, in a temporary folder, MPLBACKEND=Agg;
    fails naming file:line and the error of the first block that raises."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = doc.relative_to(ROOT).as_posix()
    ns = {"__name__": "__main__"}
    for line, code, above in blocks(doc):
        where = f"{name}:{line}"
        if above == "<!-- fragment -->":
            continue
        skip = SKIP.search(above)
        if skip:
            print(f"{where}: skipped, needs {skip.group(1)}: {skip.group(2)}")
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(compile(code, where, "exec"), ns)
        except BaseException as exc:  # noqa: BLE001 - any exception of a doc block is the failure reported
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == where]
            at = f"{name}:{line + frames[-1].lineno}" if frames else where  # the file's line that raised
            pytest.fail(f"the python block at {at} raises {type(exc).__name__}: {exc}".splitlines()[0])
        finally:
            plt.close("all")


def test_fragment_markers_sit_right_above_a_fence_and_the_text_says_so():
    """A ``<!-- fragment -->`` not on the line right above a ```python fence would mark nothing; and the reader
    must be told in the text above it that the block is their own code (the word "fragment" or "module")."""
    for doc in DOCS:
        lines = doc.read_text().split("\n")
        for i, line in enumerate(lines):
            if line.strip() == "<!-- fragment -->":
                assert i + 1 < len(lines) and lines[i + 1].startswith("```python"), f"{doc.name}:{i + 1}"
                said = "\n".join(lines[max(0, i - 4): i]).lower()
                assert "fragment" in said or "module" in said, f"{doc.name}:{i + 1}: say it is the user's code"
