"""docs/record.md documents every field of the timing record, in the record's order, and nothing else;
and what each field means in the records of slotwise's own work (warm-ups, saves and restores)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.keep.record import kv_flight, kv_record
from proxy.record.kind import Kind
from proxy.record.outcome import Outcome
from proxy.record.schema import OVERLAP_FIELDS, RECORD_FIELDS, Record
from proxy.warm.record import warm_flight, warm_record
from proxy.warm.values import WarmUp

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


def set_fields(record: Record) -> list[str]:
    """The fields a record holds other than their defaults."""
    default = Record(id="-")
    return [f for f in RECORD_FIELDS if getattr(record, f) != getattr(default, f)]


def a_warm_up_record(outcome: Outcome) -> Record:
    flight = warm_flight("w1", "/slotwise/warm/v1/chat/completions", now=1.0, wall=1.7e9,
                         config_gen=2, client="ann", purpose="chat", node="n1")
    flight.status, flight.bytes_in, flight.bytes_out = 202, 900, 120
    flight.prefill_start, flight.timer.prefill_done = 1.5, 3.9
    flight.timer.on_end(4.0)
    warm = WarmUp(id="w1", client="ann", ids=list(range(3000)), cached=200, submitted=1.0,
                  capped=True)
    warm.started, warm.ended, warm.pieces, warm.computed = 1.5, 4.0, 3, 1536
    warm.outcome, warm.reason = outcome, "piece failed: 500" if outcome is Outcome.FAILED else "x"
    return warm_record(flight, warm)


def a_restore_record() -> Record:
    flight = kv_flight("r1-restore", 2, Kind.KV_RESTORE, "slotwise-ab.kv", now=1.0, wall=1.7e9,
                       config_gen=2, client="dan", node="n1")
    flight.kv_tokens, flight.kv_bytes, flight.restored_tokens, flight.status = 6000, 10**8, 5900, 500
    flight.outcome, flight.error = Outcome.FAILED, "llama-server answered 500"
    flight.prefill.note = "displaced 700 tokens of an unsaved conversation from slot 2"
    return kv_record(flight, 2.0)


@pytest.mark.parametrize(("heading", "records"), [
    ("Warm-up records", [a_warm_up_record(Outcome.DONE), a_warm_up_record(Outcome.FAILED)]),
    ("Save and restore records", [a_restore_record()])])
def test_the_fields_of_slotwise_s_own_records_are_documented_and_exist(
        heading: str, records: list[Record]) -> None:
    doc = documented(heading)
    set_by_builders = {f for r in records for f in set_fields(r)}
    assert set_by_builders - set(doc) == set(), f"docs/record.md '{heading}' lacks them"
    assert [f for f in doc if f not in RECORD_FIELDS] == [], f"'{heading}' lists fields not in Record"
    assert {r.kind for r in records} <= {Kind.WARM, Kind.KV_SAVE, Kind.KV_RESTORE}


def test_a_warm_up_record_is_built_without_writing_on_its_flight() -> None:
    flight = warm_flight("w1", "/slotwise/warm/v1/chat/completions", now=1.0, wall=1.7e9,
                         config_gen=2, client="ann", purpose="chat", node=None)
    flight.timer.on_end(2.0)
    before = (flight.outcome, flight.error, flight.prompt_tokens, repr(flight.prefill))
    warm = WarmUp(id="w1", client="ann", ids=[1, 2, 3], cached=0, submitted=1.0)
    warm.outcome, warm.reason = Outcome.SUPERSEDED, "superseded by warm-up w2"
    record = warm_record(flight, warm)
    assert (record.outcome, record.prompt_tokens, record.policy_note) == (
        "superseded", 3, "superseded by warm-up w2")
    assert (flight.outcome, flight.error, flight.prompt_tokens, repr(flight.prefill)) == before
