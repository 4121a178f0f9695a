"""The day `slotwise bench day` plays, as plain values (no I/O, no clock): five users over one
llama-server, each a script of steps with think times, and a background translation now and then;
the sizes, thresholds and server context that follow from one scale; the set-ups and the paths.

It is the field report's day compressed: first turns of the day, returning users whose history was
computed and saved yesterday, conversations folded into a summary and continued on the new prompt
(the chat app warming it in between, docs/warm.md), and one client sending other LoRA settings.
The conversations' messages are made in `day_talk.py`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from proxy.bench.setups import FIELD_ARGS, SETUPS
from proxy.report.tables import Thresholds


class Act(StrEnum):
    """What a user does in one step."""

    CHAT = "chat"
    RETURN = "return"
    """The first turn of a conversation computed and saved yesterday."""
    SUMMARY = "summary"
    """The app folds the conversation into a summary (`X-Slotwise-Purpose: summary`)."""
    WARM = "warm"
    """The app warms the new prompt right after applying the summary (slotwise only)."""
    RESUME = "after-summary"
    """The first turn on the new prompt."""
    TRANSLATE = "translation"


PURPOSE = {Act.CHAT: "chat", Act.RETURN: "chat", Act.SUMMARY: "summary", Act.WARM: "warm-up",
           Act.RESUME: "chat", Act.TRANSLATE: "translation"}
"""The `X-Slotwise-Purpose` each step's request carries (on every path: llama-server ignores it)."""

OTHER_LORA = ({"id": 0, "scale": 0.0},)
"""What the LoRA client sends: the adapter off, while everybody else sends no `lora` (the server's
global scale, 1.0): llama-server cannot batch the two."""
FIXED_LORA = ({"id": 0, "scale": 1.0},)
"""slotwise's `lora.mode = "fixed"` profile: what most requests run with anyway."""


@dataclass(frozen=True)
class Step:
    act: Act
    think_s: float
    """The pause after the user's previous step ended (reading, typing)."""
    not_before_s: float = 0.0
    """Not before this long after the day began."""
    reply_tokens: int = 0


@dataclass(frozen=True)
class User:
    name: str
    steps: tuple[Step, ...]
    card_tokens: int = 0
    """The system prompt (a character card) a conversation of today starts with."""
    yesterday_tokens: int = 0
    """The history computed and saved yesterday (0: the conversation starts today)."""
    lora: tuple[dict[str, Any], ...] | None = None
    """The `lora` field of every request (None: none sent)."""
    background: bool = False
    """Not a chatting user: the app's translation job."""


@dataclass(frozen=True)
class DayPlan:
    scale: float
    seed: int
    users: tuple[User, ...]
    long_tokens: int
    """A prefill this large is a long one in the tables, and cold for slotwise (`cold_tokens`)."""
    short_tokens: int
    """A turn with fewer new tokens than this is a short one (the report's 1,000)."""
    summary_tokens: int
    translation_tokens: int
    ctx_per_slot: int
    """Context each slot needs for the largest conversation of the day (llama-server's -c)."""
    limit_s: float
    """A path's day is cut this long after it began (what was in flight counts as failed, the rest
    as not played), so a path that stalls still ends: about 3.5 × the day on a quiet machine."""

    def requests(self) -> int:
        """The requests the day holds (a warm-up is a call of slotwise's, not a request)."""
        return sum(1 for u in self.users for st in u.steps if st.act is not Act.WARM)

    def user(self, name: str) -> User:
        return next(u for u in self.users if u.name == name)

    def thresholds(self) -> Thresholds:
        return Thresholds(big_new=self.long_tokens, long_prefill=self.long_tokens,
                          short_new=self.short_tokens)

    def keep_min_tokens(self) -> int:
        """keep_kv's `min_tokens`: its default, or less when the returning histories are smaller."""
        smallest = min((u.yesterday_tokens for u in self.users if u.yesterday_tokens), default=0)
        return max(64, min(1024, smallest // 2))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Sizes at scale 1: histories of 4-6k tokens (the report's ~20k, scaled to this 2-core machine).
CARDS = {"ann": 2000, "bob": 1600, "cho": 500}
YESTERDAY = {"dan": 6000, "eve": 4000}
REPLY = (200, 300)
"""Tokens a chat turn streams (a few hundred, as the report's median of 347)."""
CHO_REPLY = (100, 200)
THINK_S = (2.0, 6.0)
TYPE_AFTER_SUMMARY_S = (4.0, 8.0)
TRANSLATE_EVERY_S = (12.0, 20.0)
SUMMARY_TOKENS = 150
TRANSLATION_TOKENS = (600, 120)
"""A translation's text and its reply."""
DAY_LIMIT_S = 360.0
"""A path's day at scale 1 takes ~100 s on a quiet machine; one stalled for minutes is cut."""
MIN_LIMIT_S = 60.0
"""At a small scale the requests' own costs do not shrink with it: never cut a day sooner."""
LONG_TOKENS = 1500
SHORT_TOKENS = 1000
MESSAGE_TOKENS = 40
"""A user's message, with the template's tokens around it (a bound, for the context)."""


def plan_day(scale: float = 1.0, seed: int = 19) -> DayPlan:
    """The day at `scale`: token sizes, think times, the times the returning users come back and
    the number of chat turns are all multiplied by it (at least one turn, at least 16 tokens)."""
    if scale <= 0:
        raise ValueError(f"scale must be above 0, got {scale}")
    s = _Scaled(scale, seed)
    users = (
        User("ann", (*s.chats("ann", 3, not_before=0.0), *s.summary("ann"), *s.chats("ann", 2)),
             card_tokens=s.tokens(CARDS["ann"])),
        User("bob", (*s.chats("bob", 4, not_before=1.0), *s.summary("bob", not_before=55.0),
                     *s.chats("bob", 1)), card_tokens=s.tokens(CARDS["bob"])),
        User("cho", s.chats("cho", 6, not_before=2.0, reply=CHO_REPLY),
             card_tokens=s.tokens(CARDS["cho"]), lora=OTHER_LORA),
        User("dan", (s.step("dan", Act.RETURN, not_before=10.0), *s.chats("dan", 3)),
             yesterday_tokens=s.tokens(YESTERDAY["dan"])),
        User("eve", (s.step("eve", Act.RETURN, not_before=40.0), *s.chats("eve", 3)),
             yesterday_tokens=s.tokens(YESTERDAY["eve"])),
        User("translator", s.translations(3), background=True),
    )
    longest = max(max(u.card_tokens, u.yesterday_tokens) for u in users)
    chats = max(sum(1 for st in u.steps if st.reply_tokens) for u in users)
    need = longest + chats * (s.tokens(REPLY[1]) + MESSAGE_TOKENS) + 2 * s.tokens(SUMMARY_TOKENS)
    long_tokens = s.tokens(LONG_TOKENS)
    return DayPlan(scale=scale, seed=seed, users=users, long_tokens=long_tokens,
                   short_tokens=min(SHORT_TOKENS, long_tokens),
                   summary_tokens=s.tokens(SUMMARY_TOKENS),
                   translation_tokens=s.tokens(TRANSLATION_TOKENS[0]),
                   ctx_per_slot=1024 * -(-(need + 512) // 1024),
                   limit_s=max(MIN_LIMIT_S, round(DAY_LIMIT_S * scale, 1)))


class _Scaled:
    """Steps at one scale, each user's think times and reply sizes from a seeded generator of its
    own (the same on every path)."""

    def __init__(self, scale: float, seed: int) -> None:
        self.scale, self.seed = scale, seed
        self.rngs: dict[str, random.Random] = {}

    def tokens(self, n: int) -> int:
        return max(16, round(n * self.scale))

    def _rng(self, who: str) -> random.Random:
        return self.rngs.setdefault(who, random.Random(f"{self.seed}-{who}"))

    def _think(self, who: str, span: tuple[float, float] = THINK_S) -> float:
        return round(self._rng(who).uniform(*span) * self.scale, 3)

    def _reply(self, who: str, span: tuple[int, int] = REPLY) -> int:
        return self.tokens(self._rng(who).randint(*span))

    def step(self, who: str, act: Act, *, not_before: float = 0.0) -> Step:
        return Step(act, self._think(who), round(not_before * self.scale, 3), self._reply(who))

    def chats(self, who: str, n: int, *, not_before: float = 0.0,
              reply: tuple[int, int] = REPLY) -> tuple[Step, ...]:
        count = max(1, round(n * self.scale))
        return tuple(Step(Act.CHAT, self._think(who), round(not_before * self.scale, 3) if i == 0
                          else 0.0, self._reply(who, reply)) for i in range(count))

    def summary(self, who: str, *, not_before: float = 0.0) -> tuple[Step, ...]:
        """The summary, the app's warm-up of the new prompt at once, then the user's next turn."""
        return (Step(Act.SUMMARY, self._think(who), round(not_before * self.scale, 3),
                     self.tokens(SUMMARY_TOKENS)),
                Step(Act.WARM, 0.0),
                Step(Act.RESUME, self._think(who, TYPE_AFTER_SUMMARY_S), 0.0, self._reply(who)))

    def translations(self, n: int) -> tuple[Step, ...]:
        first = round(8.0 * self.scale, 3)
        return tuple(Step(Act.TRANSLATE, self._think("translator", TRANSLATE_EVERY_S),
                          first if i == 0 else 0.0, self.tokens(TRANSLATION_TOKENS[1]))
                     for i in range(n))


# -- where the day is played ---------------------------------------------------------------------

DAY_SETUPS: dict[str, tuple[str, ...]] = {"report": FIELD_ARGS, **SETUPS}
"""`report`: the field report's layout (four slots, one shared KV); `recommended`: the one
docs/prefill.md recommends; the other set-ups of `bench contention` by name. Their `-c` is replaced
by what the day needs."""
DEFAULT_SETUPS = ("report", "recommended")
PATHS = {"direct": "direct", "b512": "direct -b 512", "slotwise": "slotwise",
         "chunk": "slotwise chunk only"}
"""Short names (for `--paths`) and column labels: llama-server with its default batch, with the
report's fix, slotwise with everything on, and slotwise with `prefill.mode = "chunk"` alone (what
`slotwise whatif --set prefill.mode=chunk` predicts from a direct day; not played by default)."""
DEFAULT_PATHS = ("direct", "b512", "slotwise")
THROUGH_SLOTWISE = ("slotwise", "chunk")


def server_args(setup: Sequence[str], path: str, ctx_per_slot: int) -> list[str]:
    """A set-up's llama-server flags for one path, with a context for `ctx_per_slot` tokens in
    every slot (with one shared KV, as much in all)."""
    args, i = [], 0
    while i < len(setup):
        if setup[i] in ("-c", "--ctx-size"):
            i += 2
            continue
        args.append(setup[i])
        i += 1
    slots = slots_of(args)
    args += ["-c", str(slots * ctx_per_slot)]
    return args + (["-b", "512"] if path == "b512" else [])


def slots_of(args: Sequence[str]) -> int:
    """The slots a flag set asks for (`-np`, `--parallel`); 4 when automatic or not given."""
    for flag, value in itertools.pairwise(args):
        if flag in ("-np", "--parallel") and value.lstrip("-").isdigit() and int(value) > 0:
            return int(value)
    return 4


def slotwise_tables(plan: DayPlan, save_dir: str, learned_file: str, *, yesterday: bool = False
                    ) -> dict[str, dict[str, Any]]:
    """slotwise with everything on: one LoRA profile, chunk (the translations background jobs),
    warm-ups, keep_kv (yesterday: saved a second after each turn, so the evening's saves need not
    wait for the default two minutes), and what it learned of the server yesterday kept for the
    day (`learned_file`, as the systemd example has it)."""
    keep: dict[str, Any] = {"enabled": True, "dir": save_dir, "min_tokens": plan.keep_min_tokens()}
    if yesterday:
        keep["save_after_idle_s"] = 1.0
    return {"prefill": {"mode": "chunk", "cold_tokens": plan.long_tokens,
                        "background_purposes": [PURPOSE[Act.TRANSLATE]],
                        "learned_file": learned_file},
            "lora": {"mode": "fixed", "adapters": [dict(a) for a in FIXED_LORA]},
            "warm": {"enabled": True}, "keep_kv": keep}


def chunk_tables(plan: DayPlan) -> dict[str, dict[str, Any]]:
    """slotwise with `chunk` alone: LoRA settings as the clients send them, no warm-ups, no kept
    KV."""
    return {"prefill": {"mode": "chunk", "cold_tokens": plan.long_tokens}}
