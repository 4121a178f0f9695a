"""What the keep store holds and answers: a slot as `/slots` shows it, a conversation, a saved file,
the knobs, the decisions. Values and their parsing; the store (`store.py`) decides. Pure.

A conversation is a prompt prefix named by the chained hashes of its token-id blocks
(`proxy/estimate/chains.py` `block_hashes`, compared by its `common_blocks`): equal hashes at
block k mean equal prefixes of (k + 1) * 64 tokens. Neither text nor token ids are kept, only those
hashes and counts.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.config import KeepKvConfig
from proxy.estimate.chains import BLOCK_TOKENS

FILE_PREFIX = "slotwise-"
FILE_SUFFIX = ".kv"
PART_SUFFIX = ".part"
"""A save is written under `<name>.part` and renamed when it proved to hold what was asked."""
QUARANTINE_SUFFIX = ".quarantined"
"""A file whose restore left llama-server without an answer (it may have crashed on it) is renamed
`<name>.quarantined`: never restored again, kept for the operator to look at or delete."""


def file_name(chain: tuple[int, ...], variant: str) -> str:
    """The file a conversation is saved under: a hash of its last block hash (which names the whole
    prefix) and its LoRA settings; stable across processes (no text, no salted str hash)."""
    digest = hashlib.blake2b(f"{chain[-1] if chain else 0}:{variant}".encode(), digest_size=8)
    return f"{FILE_PREFIX}{digest.hexdigest()}{FILE_SUFFIX}"


def is_ours(name: str) -> bool:
    """A file slotwise made in the save directory (others' files there are never touched)."""
    return name.startswith(FILE_PREFIX) and (name.endswith(FILE_SUFFIX)
                                             or name.endswith(FILE_SUFFIX + PART_SUFFIX))


def is_quarantined(name: str) -> bool:
    """A file slotwise set aside after a restore of it got no answer (never restored again)."""
    return name.startswith(FILE_PREFIX) and name.endswith(FILE_SUFFIX + QUARANTINE_SUFFIX)


class Where(enum.StrEnum):
    """Where a conversation's KV is, as far as slotwise can tell."""

    SLOT = "slot"  # in an idle slot, as its last request left it
    RAM = "ram"  # it left its slot: in llama-server's RAM cache (--cache-ram) until evicted
    FILE = "file"  # only in a file slotwise saved


@dataclass(frozen=True)
class SlotState:
    """One slot as llama-server's `GET /slots` shows it."""

    id: int
    busy: bool
    tokens: int
    """`n_prompt_tokens`: the tokens its cache holds now (0 when empty)."""
    task: int | None
    """`id_task`: its current or last task (None before its first)."""
    lora: Lora | None = ()
    """The explicit LoRA settings of its last task (`params.lora`; () when it sent none), None
    before its first task."""


@dataclass(frozen=True)
class WarmPrefix:
    """What a warm-up's piece left in a slot (the store's rule 2)."""

    chain: tuple[int, ...]
    """The prefix's block-hash chain."""
    tokens: int
    ended: float
    """When its piece ended (wall clock seconds)."""
    task: int | None = None
    """The task of the slot it was placed in (None: not placed yet)."""


Lora = tuple[tuple[int, float], ...]
"""LoRA settings as (adapter id, scale) pairs, sorted: comparable across requests and slots."""


def lora_settings(lora: Any) -> Lora:
    """A `lora` array (a request's, or a slot's `params.lora`) as comparable pairs; entries
    without a numeric id or scale are left out."""
    if not isinstance(lora, list):
        return ()
    pairs = {(e["id"], float(e["scale"])) for e in lora if isinstance(e, dict)
             and isinstance(e.get("id"), int) and isinstance(e.get("scale"), int | float)}
    return tuple(sorted(pairs))


def keeps_restored_kv(slot: SlotState, lora: Lora | None) -> bool:
    """Whether a request with these explicit LoRA settings (None: it sends none) keeps KV restored
    into `slot`: llama-server clears a slot's cache when a request's explicit `lora` differs from
    the slot's last one, and a slot that never had a task counts as different (verified: a restore
    into a never-used slot, then the same prompt with `lora: [{id 0, scale 1}]`, cache_n 0; without
    `lora`, cache_n 1,897 of 1,900)."""
    if lora is None or slot.lora == ():
        return True
    return slot.lora == lora


def read_slots(body: Any) -> list[SlotState]:
    """`GET /slots`'s answer as values; ValueError saying what is wrong with it."""
    if not isinstance(body, list):
        raise ValueError("GET /slots answered with JSON that is not a list of slots")
    slots = []
    for entry in body:
        slot_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(slot_id, int):
            raise ValueError("GET /slots answered with a slot without an integer id")
        tokens, task = entry.get("n_prompt_tokens"), entry.get("id_task")
        params = entry.get("params")
        lora = lora_settings(params.get("lora")) if isinstance(params, dict) else None
        slots.append(SlotState(id=slot_id, busy=bool(entry.get("is_processing")),
                               tokens=tokens if isinstance(tokens, int) else 0,
                               task=task if isinstance(task, int) else None, lora=lora))
    return slots


@dataclass(frozen=True)
class KeepKnobs:
    """`[keep_kv]` in the units the store uses."""

    save_after_idle_s: float = 120.0
    max_bytes: int = 32 * 10**9
    max_files: int = 64
    max_age_s: float = 14 * 86400.0
    min_tokens: int = 1024
    max_wait_s: float = 60.0


def knobs(config: KeepKvConfig) -> KeepKnobs:
    return KeepKnobs(save_after_idle_s=config.save_after_idle_s,
                 max_bytes=int(config.max_disk_gb * 1e9), max_files=config.max_files,
                 max_age_s=config.max_age_days * 86400.0, min_tokens=config.min_tokens,
                 max_wait_s=config.max_wait_s)


def client_digest(client: str | None) -> str:
    """A client's name as a short digest (the index names no client)."""
    return hashlib.blake2b((client or "").encode(), digest_size=6).hexdigest()


def lora_variant(lora: Any) -> str:
    """The LoRA settings a request went upstream with, as a short digest ("" for none)."""
    if lora is None:
        return ""
    raw = orjson.dumps(lora, option=orjson.OPT_SORT_KEYS, default=str)
    return hashlib.blake2b(raw, digest_size=6).hexdigest()


@dataclass
class Conversation:
    """A prompt prefix slotwise saw a request end with, and the slot it left it in."""

    name: str
    chain: tuple[int, ...]
    variant: str
    """The request's LoRA settings (KV computed under other adapters is other KV)."""
    prompt_tokens: int
    ended: float
    """When its last request ended (wall clock seconds)."""
    lo: int
    hi: int
    """The tokens its slot holds after it: its prompt plus what it generated (the last token is
    not decoded), so between prompt and prompt + generated."""
    slot: int | None = None
    task: int | None = None
    slot_tokens: int = 0
    """The slot it is in, with that slot's task and token count when it was placed there."""
    placing: bool = True
    """Not yet found in a slot (looked for from its end on, for `PLACE_WITHIN_S`)."""
    given_up: bool = False
    """Its save failed, or its file did not fit the budget: not tried again until it goes on."""


@dataclass
class SavedFile:
    """A file slotwise saved: whose KV it holds and how it was used."""

    name: str
    chain: tuple[int, ...]
    variant: str
    model: str
    """llama-server's `/props` `model_path` when it was saved: never restored into another model."""
    tokens: int
    """Tokens it holds (the save's `n_saved`: the prompt and what was generated after it)."""
    size: int
    saved_at: float
    last_used: float
    uses: int = 0
    """Restores from it."""
    digest: str = ""
    """SHA-256 of the file as saved (hex): a file whose bytes differ is never restored, since
    llama-server aborts on a damaged one. "" in an index written before slotwise kept digests."""

    @property
    def prompt_tokens(self) -> int:
        """The prompt tokens its chain names (whole blocks)."""
        return len(self.chain) * BLOCK_TOKENS

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "chain": list(self.chain), "variant": self.variant,
                "model": self.model, "tokens": self.tokens, "size": self.size,
                "saved_at": self.saved_at, "last_used": self.last_used, "uses": self.uses,
                "digest": self.digest}

    @staticmethod
    def from_json(data: Any) -> SavedFile:
        """KeyError, TypeError or ValueError when `data` is not an entry of the index."""
        chain = tuple(int(h) for h in data["chain"])
        return SavedFile(name=str(data["name"]), chain=chain, variant=str(data["variant"]),
                         model=str(data["model"]), tokens=int(data["tokens"]), size=int(data["size"]),
                         saved_at=float(data["saved_at"]), last_used=float(data["last_used"]),
                         uses=int(data["uses"]), digest=str(data.get("digest", "")))


# ---- decisions ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SaveSlot:
    """Ask llama-server to save idle `slot` to `temp`; rename it to `name` if it holds `tokens`."""

    slot: int
    name: str
    tokens: int

    @property
    def temp(self) -> str:
        return self.name + PART_SUFFIX


@dataclass(frozen=True)
class KeepFile:
    """The save proved right: make `temp` private and rename it to `name` (replacing an older one)."""

    temp: str
    name: str


@dataclass(frozen=True)
class RestoreInto:
    """Ask llama-server to restore `name` into idle `slot`; `covered` prompt tokens will be cached."""

    slot: int
    name: str
    covered: int
    displaced: int = 0
    """Tokens the slot holds of a conversation no file keeps: lost (its next turn recomputes)."""
    prime: bool = False
    """The slot's last LoRA settings are not the request's: a one-token task with them goes into
    the slot first, or llama-server would clear the restored KV when the request comes."""


@dataclass(frozen=True)
class Delete:
    """Delete the file `name` (and forget it); `reason` for the log."""

    name: str
    reason: str


@dataclass(frozen=True)
class Quarantine:
    """Rename the file `name` to `<name>.quarantined` (and forget it); `reason` for the log."""

    name: str
    reason: str


@dataclass(frozen=True)
class ForgetCache:
    """llama-server restarted: its slots and RAM cache are empty; the cache model must forget."""


KeepDecision = SaveSlot | KeepFile | RestoreInto | Delete | Quarantine | ForgetCache

