"""A model of what llama-server holds in its prompt cache, learned from the prompts slotwise sent.

Each entry is one slot's prompt, with the chain of its block hashes to match long prompts fast
(chains.py); bounded by the slot count and context. Behind the slots, llama-server's RAM prompt
cache (`--cache-ram`, on by default): a slot's prompt that another took over goes there, and a
later prompt keeping at least a quarter of it finds it there whole. Pure: no I/O; the server's
`cache_n` corrects it, and shows how much of a held reply follow-ups find (replies.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.estimate.chains import BLOCK_TOKENS, Entry, block_hashes, common_blocks
from proxy.estimate.replies import ReplyReuse, held_reply

SLOT_SIMILARITY = 0.1
"""llama-server's `--slot-prompt-similarity` default: a prompt goes to the slot it shares the
longest prefix with only if that prefix is more than this share of the prompt."""
RAM_MIN_KEEP = 0.25
"""llama-server restores a RAM cache entry only for a prompt that keeps at least this share of it
(`server_prompt_cache::load`: "don't trash large prompts"). So a piece shorter than a quarter of a
history in RAM never restores it: fed from there, the history is computed again."""
RAM_SAVE_BELOW = 0.5
"""A prompt that takes a slot by similarity but keeps less than this share of the slot's prompt
has that prompt copied to the RAM cache first (`get_available_slot`); one that takes the least
recently used slot always does."""


class CacheModel:
    """The server's slots as an LRU of prompts.

    `estimate_cached(ids)` is the longest cached prefix, to the token (at most len(ids) - 1, since
    the server always recomputes one token). `record(ids, cache_n)` is called after each request or
    piece with the prompt it sent: the entry sharing the longest prefix with it (the slot the server
    most likely chose) takes the new prompt, otherwise the least recently used entry makes room. If
    the server reports less cached than predicted, the entries that claimed more are cut back to what
    the server said (trust the server).
    """

    def __init__(self, n_slots: int, n_ctx: int, *, block: int = BLOCK_TOKENS,
                 max_total_tokens: int | None = None, ram_tokens: int | None = None) -> None:
        """`ram_tokens`: the RAM cache's room in tokens (0: none); by default one slot's context,
        the least llama-server's `--cache-ram` keeps whatever its byte limit."""
        if n_slots < 1 or n_ctx < 1 or block < 1:
            raise ValueError(f"need n_slots, n_ctx, block >= 1, got {n_slots}, {n_ctx}, {block}")
        self._n_slots = n_slots
        self._n_ctx = n_ctx
        self._block = block
        self._max_total = max_total_tokens
        self._entries: list[Entry] = []  # least recently used first
        self._ram: list[Entry] = []  # oldest first, as llama-server evicts them
        self._ram_room = n_ctx if ram_tokens is None else max(0, ram_tokens)
        self._ram_hits = 0
        self.replies = ReplyReuse()
        """How much of a held reply follow-ups found cached (learned in `record`)."""
        self.ram_off = False
        """The server found nothing of a prompt the RAM cache was to hold, and never anything:
        its RAM cache is taken to be off (`--cache-ram 0`) and no longer modelled, until a prompt
        finds a block or more beyond what any slot held (then it is on after all)."""

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        """Tokens modelled per entry, least recently used first (for a status page)."""
        return tuple(len(e.ids) for e in self._entries)

    @property
    def ram_tokens(self) -> tuple[int, ...]:
        """Tokens modelled per RAM cache entry, oldest first."""
        return tuple(len(e.ids) for e in self._ram)

    def estimate_cached(self, ids: Sequence[int]) -> int:
        return self._cached(ids, block_hashes(ids, self._block))

    def estimate_parts(self, ids: Sequence[int]) -> tuple[int, int]:
        """`estimate_cached(ids)`, and how many of those tokens are a held reply counted at the
        share follow-ups found (`replies`)."""
        chain = block_hashes(ids, self._block)
        cached = self._cached(ids, chain)
        ram = self._ram_match(ids, chain)
        holders = [self._ram[ram[0]]] if ram is not None else self._entries
        share = self.replies.share()
        for entry in holders:
            prompt, reply = entry.parts(ids, chain, self._block)
            if prompt + round(reply * share) >= cached:
                return cached, max(0, min(round(reply * share), cached - prompt))
        return cached, 0

    def found(self, ids: Sequence[int]) -> tuple[int, int]:
        """The most of `ids` a slot holds, and what the RAM cache would give back (0: nothing)."""
        chain = block_hashes(ids, self._block)
        ram = self._ram_match(ids, chain)
        return max(self._shared(ids, chain), default=0), 0 if ram is None else ram[1]

    def first_piece_floor(self, ids: Sequence[int]) -> int:
        """The shortest prefix of `ids` a first piece may end at for llama-server to place it as
        it would the whole prompt (0: any piece goes there). The server places a prompt by its own
        similarity: a whole prompt sharing only the chat template's head with every slot goes to
        the least recently used one, but a short first piece shares more than SLOT_SIMILARITY of
        itself with them and is put into the slot it shares the most with, taking that slot from
        whoever keeps it (bench day: a 128-token first piece sharing 23 tokens took the slot of
        another cold prompt fed in pieces, `f_keep = 0.012`, which then computed part of its
        prefix twice). A piece past this floor shares at most SLOT_SIMILARITY of itself."""
        shared = self._shared(ids, block_hashes(ids, self._block))
        if not shared or self._similar(shared, len(ids)) is not None:
            return 0  # the whole prompt goes to the slot sharing the most: so does any piece
        most = max(shared)
        return min(len(ids), int(most / SLOT_SIMILARITY + 1e-9) + 1) if most else 0

    def record(self, ids: Sequence[int], cache_n_reported: int | None = None,
               generated: int = 0) -> None:
        """`generated`: the tokens the server generated after `ids` (`predicted_n`); the slot
        holds all but the last (`held_reply`)."""
        ids = list(ids[:self._n_ctx])
        chain = block_hashes(ids, self._block)
        if cache_n_reported is not None:
            self._observe_reply(ids, chain, cache_n_reported)
        ram = self._ram_match(ids, chain)
        in_slots = max(self._shared(ids, chain), default=0)
        if cache_n_reported is not None and ram is not None and cache_n_reported <= in_slots:
            # No more than a slot held: the entry was not restored. Fewer tokens than the entry
            # holds, but more than any slot, came from RAM all the same: the server computes one
            # token of a prompt the entry holds whole (bench day: a trim piece inside `dan`'s
            # history in RAM found all but that one, the first RAM use of the day, and was taken
            # for the RAM cache being off: every later turn whose history had left its slot was
            # judged cold and fed in pieces, 13-29 s to their first tokens).
            self._ram_missed(ram[0])
        elif ram is not None:
            self._ram_hits += cache_n_reported is not None
            del self._ram[ram[0]]  # restored into the slot: the server takes it out of RAM
        elif (self.ram_off and cache_n_reported is not None
              and cache_n_reported > in_slots + self._block):
            self.ram_off = False  # found more than any slot held: from RAM after all
            self._ram_hits += 1
        if cache_n_reported is not None and cache_n_reported < self._cached(ids, chain):
            self._cut_back(ids, chain, cache_n_reported)
        best = self._best_match(ids, chain)
        if best is not None:
            old = self._entries.pop(best)
            if self._common(old, ids, chain) < RAM_SAVE_BELOW * len(old.ids):
                self._save_ram(old)
        held = min(held_reply(generated), max(0, self._n_ctx - len(ids)))
        self._entries.append(Entry(ids, chain, held))
        self._evict()

    def forget(self, chain: Sequence[int]) -> None:
        """A conversation left the server (a restore took its slot and kept no copy: in `bench
        day`, 2026-12-02, the next turn of a conversation displaced so found it neither in a slot
        nor in RAM): the entries holding most of its block chain go."""
        blocks = list(chain)
        self._entries = [e for e in self._entries
                         if 2 * common_blocks(e.chain, blocks) < max(1, len(blocks))]

    def clear(self) -> None:
        """Forget everything (the server restarted, or its caches were erased)."""
        self._entries.clear()
        self._ram.clear()

    def _observe_reply(self, ids: Sequence[int], chain: list[int], cache_n: int) -> None:
        """What the server found of the held reply `ids` repeats, if any: the entry (a slot's or
        RAM's) whose prompt `ids` shares whole and that holds the longest, unless the server found
        less than that prompt (its slot was lost: that says nothing of replies)."""
        holders = [e for e in (*self._entries, *self._ram)
                   if e.generated and len(e.ids) < len(ids)
                   and e.parts(ids, chain, self._block)[0] == len(e.ids)]
        if not holders:
            return
        holder = max(holders, key=lambda e: len(e.ids))
        if cache_n >= len(holder.ids):
            claimed = min(holder.generated, len(ids) - 1 - len(holder.ids))
            self.replies.observe(claimed, cache_n - len(holder.ids))

    def _shared(self, ids: Sequence[int], chain: list[int]) -> list[int]:
        share = self.replies.share()
        return [e.common(ids, chain, self._block, share) for e in self._entries]

    def _common(self, entry: Entry, ids: Sequence[int], chain: list[int]) -> int:
        return entry.common(ids, chain, self._block, self.replies.share())

    def _cached(self, ids: Sequence[int], chain: list[int]) -> int:
        ram = self._ram_match(ids, chain)
        found = ram[1] if ram is not None else max(self._shared(ids, chain), default=0)
        return max(0, min(found, len(ids) - 1))

    def _ram_match(self, ids: Sequence[int], chain: list[int]) -> tuple[int, int] | None:
        """The RAM entry the server would restore for `ids` (its index, the tokens it holds of
        them), or None. It looks in RAM when the prompt takes the least recently used slot, or a
        slot by similarity keeping less than RAM_SAVE_BELOW of that slot's prompt; it restores
        the entry holding the most of the prompt, if that keeps at least RAM_MIN_KEEP of itself
        and holds more than the slots."""
        if not self._ram:
            return None
        shared = self._shared(ids, chain)
        slot = self._similar(shared, len(ids))
        if slot is not None and shared[slot] >= RAM_SAVE_BELOW * len(self._entries[slot].ids):
            return None
        best, most = None, max(shared, default=0)
        for i, entry in enumerate(self._ram):
            common = self._common(entry, ids, chain)
            if common >= RAM_MIN_KEEP * len(entry.ids) and common > most:
                best, most = (i, common), common
        return best

    def _save_ram(self, entry: Entry) -> None:
        """The server copies a slot's prompt to RAM before another takes the slot: skipped when an
        entry holds it already, the entries it holds dropped, the oldest evicted for room."""
        size = len(entry.ids)
        if self.ram_off or not 0 < size <= self._ram_room or any(
                self._common(e, entry.ids, entry.chain) == size for e in self._ram):
            return
        self._ram = [e for e in self._ram
                     if self._common(entry, e.ids, e.chain) < len(e.ids)]
        self._ram.append(entry)
        while sum(len(e.ids) for e in self._ram) > self._ram_room:
            self._ram.pop(0)

    def _ram_missed(self, index: int) -> None:
        """The server did not have what the RAM entry at `index` held: it and every older entry
        were evicted (oldest first); if the RAM cache never delivered, it is off."""
        del self._ram[:index + 1]
        if not self._ram_hits:
            self.ram_off = True
            self._ram.clear()

    def _cut_back(self, ids: Sequence[int], chain: list[int], cache_n: int) -> None:
        """The server found only `cache_n` of `ids`: the entries it would have chosen for them
        (sharing more than SLOT_SIMILARITY of the prompt) and that claim more are cut back to it.
        An entry sharing less was never a candidate: what the server found in the slot it took
        says nothing of it (seen in `bench day`: a new conversation's warm-up, 7 tokens found,
        cut every conversation sharing the chat template's first 18 tokens, and the next turns
        of four users were judged cold and fed in pieces)."""
        keep = max(0, cache_n)
        candidate = SLOT_SIMILARITY * len(ids)
        for entry, shared in zip(self._entries, self._shared(ids, chain), strict=True):
            if shared > keep and shared > candidate:
                entry.cut(keep, self._block)
        self._entries = [e for e in self._entries if e.ids]

    def _best_match(self, ids: Sequence[int], chain: list[int]) -> int | None:
        """The entry the server would put this prompt in: the longest shared prefix, if it is more
        than SLOT_SIMILARITY of the prompt (else the server takes its least recently used slot)."""
        return self._similar(self._shared(ids, chain), len(ids))

    @staticmethod
    def _similar(shared: Sequence[int], tokens: int) -> int | None:
        if not shared or max(shared) <= SLOT_SIMILARITY * tokens:
            return None
        return shared.index(max(shared))

    def _evict(self) -> None:
        """A prompt beyond the slot count took the least recently used slot, whose prompt went to
        RAM; one beyond a shared KV's room had an idle slot purged (nothing saved)."""
        while len(self._entries) > self._n_slots:
            self._save_ram(self._entries.pop(0))
        while self._over_total():
            self._entries.pop(0)

    def _over_total(self) -> bool:
        if self._max_total is None or len(self._entries) <= 1:
            return False
        return sum(len(e.ids) for e in self._entries) > self._max_total
