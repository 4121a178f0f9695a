"""docs/record.md documents every field of the timing record, in the record's order, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.record.schema import OVERLAP_FIELDS, RECORD_FIELDS

DOC = Path(__file__).resolve().parent.parent / "docs" / "record.md"
ROW = re.compile(r"^\|\s*`(?P<field>[a-z0-9_]+)`\s*\|")


def documented(heading: str) -> list[str]:
    """The field names in the first column of the table under `## {heading}`."""
    sections = re.split(r"^## ", DOC.read_text(), flags=re.MULTILINE)
    (section,) = [s for s in sections if s.startswith(heading + "\n")]
    return [m["field"] for line in section.splitlines() if (m := ROW.match(line))]


@pytest.mark.parametrize(("heading", "fields"), [("Record fields", RECORD_FIELDS),
                                                 ("Overlap fields", OVERLAP_FIELDS)])
def test_every_field_is_documented_in_order_and_nothing_else(
        heading: str, fields: tuple[str, ...]) -> None:
    doc = documented(heading)
    missing = [f for f in fields if f not in doc]
    extra = [f for f in doc if f not in fields]
    assert not missing, f"docs/record.md '{heading}' lacks {missing}"
    assert not extra, f"docs/record.md '{heading}' lists {extra}, which the record does not have"
    assert doc == list(fields), f"docs/record.md '{heading}' is not in the record's order"
