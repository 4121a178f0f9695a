"""The pure parts that keep a client's strings and ids safe: `clientstrings`, `RequestIds`, `LogLimit`,
and the record's last line of defence (`build_record`)."""

from __future__ import annotations

import itertools

import orjson

from proxy.record.clientstrings import MAX_CHARS, REPLACEMENT, clean_id, clean_text, safe_text
from proxy.record.ids import RequestIds
from proxy.record.kind import Kind
from proxy.record.log_limit import LogLimit
from proxy.record.schema import MAX_LORA_BYTES, build_record
from proxy.request.rewrite import client_key
from tests.helpers import make_flight


class TestCleanText:
    def test_a_plain_name_is_kept_as_it_is(self) -> None:
        assert clean_text("José / role-play") == "José / role-play"

    def test_nothing_is_none(self) -> None:
        assert clean_text(None) is None and clean_text("") is None and clean_text(42) is None

    def test_bytes_that_were_not_utf8_and_control_characters_become_replacement_characters(self) -> None:
        # aiohttp decodes a header's invalid UTF-8 into lone surrogates
        assert clean_text("a\udcffb\nc\x00") == f"a{REPLACEMENT}b{REPLACEMENT}c{REPLACEMENT}"
        assert orjson.dumps(clean_text("\udcff\udcfe"))

    def test_a_long_string_is_cut_and_says_so(self) -> None:
        cut = clean_text("u" * 1_000_000)
        assert cut is not None and len(cut) == MAX_CHARS and cut.endswith("…")


class TestCleanId:
    def test_a_token_is_kept(self) -> None:
        assert clean_id("req-42:abc/def=") == "req-42:abc/def="

    def test_other_characters_become_underscores_so_the_id_stays_recognisable(self) -> None:
        assert clean_id("my id é\udcff") == "my_id___"

    def test_a_long_id_is_cut_and_a_blank_one_is_none(self) -> None:
        assert clean_id("x" * 500) == "x" * MAX_CHARS
        assert clean_id("   ") is None and clean_id(None) is None


def test_safe_text_keeps_line_breaks_replaces_surrogates_and_cuts() -> None:
    assert safe_text("line 1\nline 2", 100) == "line 1\nline 2"
    assert safe_text("/a\udcffb", 100) == f"/a{REPLACEMENT}b"
    assert safe_text("e" * 50, 10) == "e" * 9 + "…"


def test_the_body_user_is_capped_like_the_header() -> None:
    key = client_key({"user": "u" * 1_000_000}, None)
    assert key is not None and len(key) == MAX_CHARS
    assert client_key({"user": "bob"}, "alice") == "alice"


def test_anthropic_s_metadata_user_id_names_the_client_of_a_messages_body() -> None:
    body = {"metadata": {"user_id": "ann\n" + "u" * 500}, "user": "the-user-field"}
    key = client_key(body, None, Kind.MESSAGES)
    assert key is not None and key.startswith(f"ann{REPLACEMENT}u") and len(key) == MAX_CHARS
    assert client_key(body, "header-wins", Kind.MESSAGES) == "header-wins"
    assert client_key({"metadata": {"user_id": "ann"}}, None, Kind.CHAT) is None  # OpenAI's metadata
    for odd in ({"metadata": "ann"}, {"metadata": {"user_id": 7}}, {"metadata": None}, {}):
        assert client_key(odd, None, Kind.MESSAGES) is None
    assert client_key({"user": "bob"}, None, Kind.MESSAGES) == "bob"  # without metadata, as before


class TestRequestIds:
    @staticmethod
    def ids() -> RequestIds:
        counter = itertools.count()
        return RequestIds(recent=3, token=lambda n: f"{next(counter):0{n}d}")

    def test_the_clients_id_is_used_when_it_is_free(self) -> None:
        assert self.ids().issue("abc", lambda _: False) == "abc"

    def test_an_id_in_flight_gets_a_suffix(self) -> None:
        assert self.ids().issue("abc", lambda taken: taken == "abc") == "abc~000000"

    def test_an_id_seen_recently_gets_a_suffix_and_every_issued_id_differs(self) -> None:
        ids = self.ids()
        issued = [ids.issue("abc", lambda _: False) for _ in range(3)]
        assert issued == ["abc", "abc~000000", "abc~000001"]

    def test_only_the_last_few_are_remembered(self) -> None:
        ids = self.ids()
        ids.issue("abc", lambda _: False)
        for name in ("x", "y", "z"):
            ids.issue(name, lambda _: False)
        assert ids.issue("abc", lambda _: False) == "abc"

    def test_without_a_client_id_a_new_one_is_made(self) -> None:
        assert self.ids().issue(None, lambda _: False) == "0" * 16


class TestLogLimit:
    def test_lines_past_the_limit_are_counted_and_told_with_the_next_window(self) -> None:
        limit = LogLimit(per_window=2, window_s=60.0)
        assert [limit.allow(t) for t in (0, 1, 2, 3)] == [(True, 0), (True, 0), (False, 0), (False, 0)]
        assert limit.allow(61) == (True, 2)
        assert limit.allow(62) == (True, 0)


class TestBuildRecordDefence:
    def test_a_flight_with_surrogates_still_makes_a_record_that_is_json(self) -> None:
        flight = make_flight("id\udcff", 0.0, client="c\udcff", purpose="p\udcff",
                             error="broke \udcff")
        flight.endpoint = "/v1/\udcff"
        record = orjson.loads(build_record(flight).to_json())
        assert record["id"] == "id_" and record["client"] == f"c{REPLACEMENT}"
        assert record["endpoint"] == f"/v1/{REPLACEMENT}" and record["error"] == f"broke {REPLACEMENT}"

    def test_a_huge_lora_field_is_not_copied_into_the_record(self) -> None:
        flight = make_flight("a", 0.0, lora_in=[{"id": 0, "scale": 1.0, "pad": "x" * 100_000}],
                             lora_out=[{"id": 0, "scale": 1.0}])
        record = build_record(flight)
        assert isinstance(record.lora_in, str) and "not recorded" in record.lora_in
        assert record.lora_out == [{"id": 0, "scale": 1.0}]
        assert len(record.to_json()) < MAX_LORA_BYTES + 2000
