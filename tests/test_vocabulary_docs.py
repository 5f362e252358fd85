"""docs/schema.md and the statistics vocabulary (`nasdiag.vocabulary.FAMILIES`) agree: every family is in
the doc's table with its pattern, shape, dtype, reduction and meaning, and the table names no family the
module does not declare. The table is parsed from the Markdown, independently of the generator."""

from __future__ import annotations

import pathlib
import re

from nasdiag import vocabulary
from nasdiag.record import families_doc

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "schema.md"


def _doc_table() -> dict[str, dict[str, str]]:
    text = DOC.read_text(encoding="utf-8")
    start, end = text.index(families_doc.FAMILIES_BEGIN), text.index(families_doc.FAMILIES_END)
    lines = [line for line in text[start:end].splitlines() if line.startswith("|")]
    split = lambda line: [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]  # noqa: E731
    header = split(lines[0])
    rows = {}
    for line in lines[2:]:
        row = dict(zip(header, split(line)))
        rows[row["pattern"].strip("`")] = row
    return rows


def test_every_family_is_documented_and_the_doc_lists_no_other():
    documented = _doc_table()
    declared = {f.pattern: f for f in vocabulary.FAMILIES}
    missing, extra = sorted(set(declared) - set(documented)), sorted(set(documented) - set(declared))
    hint = "run `python -m nasdiag.record.families_doc docs/schema.md`"
    assert not missing, f"families missing from docs/schema.md: {missing}; {hint}"
    assert not extra, f"docs/schema.md lists families the vocabulary does not declare: {extra}; {hint}"
    for pattern, fam in declared.items():
        row = documented[pattern]
        got = (row["shape"], row["dtype"], row["reduction"], row["when"], row["meaning"])
        assert got == (fam.shape, fam.dtype, fam.reduce, fam.when, fam.meaning), f"{pattern}: doc {got} vs module; {hint}"


def test_doc_table_is_the_generated_one():
    text = DOC.read_text(encoding="utf-8")
    assert families_doc.families_markdown() in text, "docs/schema.md's family table is stale; run `python -m nasdiag.record.families_doc docs/schema.md`"


def test_every_reduction_rule_in_the_vocabulary_is_described():
    text = DOC.read_text(encoding="utf-8")
    for rule in vocabulary.RULES:
        assert f"`{rule}`" in text.split("## Statistics vocabulary")[1].split("## Commit protocol")[0], rule
