"""Strings a client chooses that slotwise keeps: its name (`X-Slotwise-Client`, the body's `user`), the
request's purpose (`X-Slotwise-Purpose`) and its `X-Request-Id`. They reach the timing log, /metrics
labels and the status page, so each is capped and made printable here, in one place.

aiohttp decodes header bytes that are not UTF-8 into lone surrogates, which no JSON encoder and no
Prometheus exposition can write; a control character would break a log line. Pure functions.
"""

from __future__ import annotations

MAX_CHARS = 128
"""The longest client name, purpose or request id kept; a longer one is cut (names end in "…")."""
REPLACEMENT = "\ufffd"
"""What stands for a character that is not printable (as bytes.decode(errors="replace") does)."""
_ID_SUBSTITUTE = "_"


def clean_text(value: object, limit: int = MAX_CHARS) -> str | None:
    """`value` as a printable string of at most `limit` characters; None for no string or an empty one.

    Every character Python does not call printable (control characters, line breaks, lone
    surrogates, format characters) becomes U+FFFD; a cut string ends in "…" to say so.
    """
    if not isinstance(value, str) or not value:
        return None
    cut = len(value) > limit
    text = value[:limit - 1] if cut else value
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else REPLACEMENT for ch in text)
    return text + "…" if cut else text


def clean_id(value: str | None, limit: int = MAX_CHARS) -> str | None:
    """A client's request id as a token of printable ASCII (no spaces) of at most `limit` characters:
    every other character becomes "_", so the id stays recognisable; None for an absent or blank id."""
    if not value or not value.strip():
        return None
    text = value.strip()[:limit]
    if not (text.isascii() and text.isprintable() and " " not in text):
        text = "".join(ch if "!" <= ch <= "~" else _ID_SUBSTITUTE for ch in text)
    return text


def safe_text(value: str | None, limit: int) -> str | None:
    """Any other text bound for the record (a path, an error message): lone surrogates replaced so it
    can be written as JSON, and cut at `limit` characters; line breaks and the like are kept."""
    if value is None:
        return None
    text = value[:limit - 1] + "…" if len(value) > limit else value
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = "".join(REPLACEMENT if "\ud800" <= ch <= "\udfff" else ch for ch in text)
    return text
