"""The warm-up queue, rule by rule: each test class is one numbered rule of `WarmQueue`.

Hand-made warm-ups (token ids are plain numbers), a fixed piece size and a plain-number clock; no
server, no event loop.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from proxy.config import PrefillConfig
from proxy.prefill.events import Load
from proxy.prefill.sizing import pause_s
from proxy.warm.queue import KEEP_ENDED, MIN_TOKENS, WarmQueue
from proxy.warm.values import (
    CancelWarmPiece,
    Ended,
    Feed,
    Outcome,
    RestoreKept,
    WarmDecision,
    WarmKnobs,
    WarmRefused,
    WarmUp,
    warm_share,
)

KNOBS = WarmKnobs(max_pending=3, max_tokens=10_000, expire_s=100.0, max_per_client=2, prefill_share=0.5)
IDLE = Load()
BUSY = Load(busy=True, decoders=3)


class Pieces:
    """A Sizer: `idle` tokens when nobody generates, `busy` tokens otherwise."""

    def __init__(self, idle: int = 512, busy: int = 128) -> None:
        self.idle, self.busy = idle, busy
        self.asked: list[tuple[int, int, int | None, Load]] = []

    def piece(self, done: int, remaining: int, largest: int | None, load: Load) -> int:
        self.asked.append((done, remaining, largest, load))
        return self.busy if load.busy else self.idle


def conv(n: int, seed: int = 1, start: int = 0) -> list[int]:
    """A conversation's prompt ids: distinct per seed, `start` shared ids first."""
    return list(range(start)) + [seed * 100_000 + i for i in range(n - start)]


def warm(warm_id: str, ids: list[int], *, cached: int = 0, at: float = 0.0,
         client: str | None = None) -> WarmUp:
    return WarmUp(id=warm_id, client=client, ids=ids, cached=cached, submitted=at)


def ended(decisions: list[WarmDecision]) -> list[str]:
    return [d.warm_id for d in decisions if isinstance(d, Ended)]


def feed(q: WarmQueue, load: Load = IDLE, now: float = 0.0, sizer: Pieces | None = None) -> Feed:
    [decision] = q.on_tick(load, sizer or Pieces(), KNOBS, now)
    assert isinstance(decision, Feed)
    return decision


def run_piece(q: WarmQueue, warm_id: str, *, batch_ms: float = 100.0, now: float = 1.0,
              load: Load = IDLE) -> list[WarmDecision]:
    w = q.warmups[warm_id]
    assert w.piece_upto is not None
    return q.on_piece_done(warm_id, w.piece_upto - w.done_upto, batch_ms, KNOBS, now)


class TestRule1AlreadyCachedCostsNothing:
    def test_a_prefix_the_server_holds_ends_done_with_no_piece(self) -> None:
        q = WarmQueue()
        decisions = q.submit(warm("w", conv(3000), cached=3000 - MIN_TOKENS + 1), KNOBS, 0.0)
        assert ended(decisions) == ["w"]
        w = q.warmups["w"]
        assert w.outcome is Outcome.DONE and w.pieces == 0 and "already cached" in w.reason
        assert q.on_tick(IDLE, Pieces(), KNOBS, 1.0) == []

    def test_one_with_a_block_to_compute_is_queued(self) -> None:
        q = WarmQueue()
        assert q.submit(warm("w", conv(3000), cached=3000 - MIN_TOKENS), KNOBS, 0.0) == []
        assert q.warmups["w"].state == "pending"


class TestRule2SameConversationSupersedes:
    def test_a_longer_prefix_of_the_same_conversation_replaces_the_pending_one(self) -> None:
        q = WarmQueue()
        q.submit(warm("old", conv(2000)), KNOBS, 0.0)
        assert ended(q.submit(warm("new", conv(2500)), KNOBS, 1.0)) == ["old"]
        assert q.warmups["old"].outcome is Outcome.SUPERSEDED
        assert "new" in q.warmups["old"].reason

    def test_the_running_one_ends_after_its_piece(self) -> None:
        q = WarmQueue()
        q.submit(warm("old", conv(2000)), KNOBS, 0.0)
        feed(q)
        assert q.submit(warm("new", conv(2500)), KNOBS, 1.0) == []
        assert q.on_tick(IDLE, Pieces(), KNOBS, 1.0) == []  # the new one waits for that piece
        assert ended(run_piece(q, "old")) == ["old"]
        assert q.warmups["old"].outcome is Outcome.SUPERSEDED
        assert feed(q, now=2.0).warm_id == "new"

    def test_another_conversation_sharing_a_system_prompt_does_not(self) -> None:
        q = WarmQueue()
        q.submit(warm("a", conv(2000, seed=1, start=300)), KNOBS, 0.0)
        assert q.submit(warm("b", conv(2000, seed=2, start=300)), KNOBS, 0.0) == []
        assert [w.id for w in q.active()] == ["a", "b"]


class TestRule3Bounds:
    def test_one_more_than_max_pending_is_refused(self) -> None:
        q = WarmQueue()
        for i in range(KNOBS.max_pending):
            q.submit(warm(f"w{i}", conv(1000, seed=i + 1)), KNOBS, 0.0)
        with pytest.raises(WarmRefused, match=r"warm\.max_pending = 3"):
            q.submit(warm("late", conv(1000, seed=9)), KNOBS, 0.0)
        assert "late" not in q.warmups

    def test_one_that_supersedes_takes_the_place_it_frees(self) -> None:
        q = WarmQueue()
        for i in range(KNOBS.max_pending):
            q.submit(warm(f"w{i}", conv(1000, seed=i + 1)), KNOBS, 0.0)
        assert ended(q.submit(warm("again", conv(1200, seed=1)), KNOBS, 1.0)) == ["w0"]

    def test_a_named_client_gets_max_per_client(self) -> None:
        q = WarmQueue()
        for i in range(KNOBS.max_per_client):
            q.submit(warm(f"w{i}", conv(1000, seed=i + 1), client="ann"), KNOBS, 0.0)
        with pytest.raises(WarmRefused, match=r"client .ann.*warm\.max_per_client = 2"):
            q.submit(warm("w9", conv(1000, seed=9), client="ann"), KNOBS, 0.0)
        q.submit(warm("bob", conv(1000, seed=8), client="bob"), KNOBS, 0.0)  # others still may

    def test_a_full_queue_of_other_clients_refuses_before_the_ids_are_known(self) -> None:
        q = WarmQueue()
        for i, client in enumerate(("ann", "ann", "cy")):
            q.submit(warm(f"w{i}", conv(1000, seed=i + 1), client=client), KNOBS, 0.0)
        with pytest.raises(WarmRefused, match=r"warm\.max_pending = 3"):
            q.check_room("bob", KNOBS)
        with pytest.raises(WarmRefused):
            q.check_room(None, KNOBS)
        q.check_room("ann", KNOBS)  # may supersede one of hers: her ids decide (rule 2)

    def test_one_ending_after_its_piece_does_not_count(self) -> None:
        q = WarmQueue()
        knobs = WarmKnobs(max_pending=1, max_tokens=10_000, expire_s=100.0, max_per_client=1)
        q.submit(warm("old", conv(2000), client="ann"), knobs, 0.0)
        feed(q)
        q.submit(warm("new", conv(2500), client="ann"), knobs, 1.0)  # old ends after its piece
        with pytest.raises(WarmRefused):
            q.submit(warm("third", conv(900, seed=3), client="bob"), knobs, 1.0)

    def test_a_prefix_longer_than_max_tokens_is_cut_and_says_so(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(20_000), cached=500), KNOBS, 0.0)
        w = q.warmups["w"]
        assert w.capped and len(w.ids) == 500 + KNOBS.max_tokens and w.to_compute == KNOBS.max_tokens


class TestRule4OneAtATimeFewestTokensFirst:
    def test_the_smallest_pending_one_goes_first_then_the_oldest(self) -> None:
        q = WarmQueue()
        q.submit(warm("big", conv(5000, seed=1)), KNOBS, 0.0)
        q.submit(warm("small", conv(1000, seed=2)), KNOBS, 1.0)
        q.submit(warm("small2", conv(1000, seed=3)), KNOBS, 2.0)
        assert feed(q, now=3.0).warm_id == "small"

    def test_the_running_one_goes_on_to_its_end(self) -> None:
        q = WarmQueue()
        q.submit(warm("big", conv(1500, seed=1)), KNOBS, 0.0)
        assert feed(q).upto == 512
        run_piece(q, "big")
        q.submit(warm("small", conv(500, seed=2)), KNOBS, 1.0)
        assert feed(q, now=1.0) == Feed("big", 1024)
        run_piece(q, "big", now=2.0)
        assert feed(q, now=2.0) == Feed("big", 1500)  # the rest fits one piece: all of it
        assert ended(run_piece(q, "big", now=3.0)) == ["big"]
        assert q.warmups["big"].outcome is Outcome.DONE
        assert feed(q, now=3.0).warm_id == "small"

    def test_pieces_start_after_the_cached_part(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000), cached=1000), KNOBS, 0.0)
        sizer = Pieces()
        assert feed(q, sizer=sizer).upto == 1472  # 1000 + 512, cut to a multiple of 64 as chunk does
        assert sizer.asked[0][:3] == (1000, 2000, None)


class TestRule5LowestPriority:
    @pytest.mark.parametrize("load", [Load(cold_held=True), Load(starting=True),
                                      Load(cold_held=True, busy=True, decoders=2),
                                      Load(no_slot=True, busy=True, decoders=4)])
    def test_no_piece_while_a_real_prompt_is_held_fed_or_just_sent_or_no_slot_is_free(
            self, load: Load) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000)), KNOBS, 0.0)
        assert q.on_tick(load, Pieces(), KNOBS, 10.0) == []
        assert feed(q, now=11.0).upto == 512  # once it is over

    def test_a_held_cold_request_stops_a_running_warm_up_between_pieces(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000)), KNOBS, 0.0)
        feed(q)
        run_piece(q, "w")
        assert q.on_tick(Load(cold_held=True, busy=True), Pieces(), KNOBS, 50.0) == []
        assert q.warmups["w"].state == "running" and q.warmups["w"].done_upto == 512


class TestRule6SharePauseAndSizes:
    def test_while_others_generate_a_pause_follows_each_piece(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000)), KNOBS, 0.0)
        assert feed(q, load=BUSY).upto == 128
        run_piece(q, "w", batch_ms=200.0, now=1.0, load=BUSY)
        pause = pause_s(0.2, KNOBS.prefill_share)
        assert pause == pytest.approx(0.2)
        assert q.on_tick(BUSY, Pieces(), KNOBS, 1.0 + pause - 0.01) == []
        assert q.next_wakeup(BUSY, KNOBS, 1.0) == pytest.approx(1.0 + pause)
        assert feed(q, load=BUSY, now=1.0 + pause).upto == 256

    def test_a_warm_up_takes_at_least_a_behind_requests_share(self) -> None:
        """Its user is typing the turn that needs it: with `chunk`'s default share (0.55) the
        pause after a 200 ms piece is 50 ms, not 164 ms."""
        knobs = replace(KNOBS, prefill_share=warm_share(PrefillConfig().prefill_share))
        q = WarmQueue()
        q.submit(warm("w", conv(3000)), knobs, 0.0)
        piece = feed(q, load=BUSY).upto
        q.on_piece_done("w", piece, 200.0, knobs, 1.0)
        assert q.next_wakeup(BUSY, knobs, 1.0) == pytest.approx(1.05)
        assert warm_share(0.9) == 0.9  # an operator's larger share stands

    def test_on_an_idle_server_pieces_go_back_to_back_and_larger(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000)), KNOBS, 0.0)
        feed(q)
        run_piece(q, "w", batch_ms=600.0, now=1.0)
        assert feed(q, now=1.0).upto == 1024

    def test_the_sizer_hears_the_largest_piece_so_far(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000)), KNOBS, 0.0)
        sizer = Pieces()
        feed(q, sizer=sizer)
        run_piece(q, "w")
        feed(q, now=1.0, sizer=sizer)
        assert [a[2] for a in sizer.asked] == [None, 512]


class TestRule7ARealRequestOfTheSameConversation:
    def test_it_ends_a_pending_warm_up_at_once(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000)), KNOBS, 0.0)
        decisions, wait = q.claim([*conv(3000), 7, 8, 9], 1.0)
        assert ended(decisions) == ["w"] and wait == []
        assert q.warmups["w"].outcome is Outcome.SUPERSEDED
        assert q.credit([*conv(3000), 7, 8, 9]).tokens == 0  # it computed nothing

    def test_it_waits_for_the_piece_in_flight_and_is_credited_with_what_was_computed(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000), cached=200), KNOBS, 0.0)
        feed(q)
        run_piece(q, "w")
        feed(q, now=1.0)
        turn = [*conv(3000), 7, 8, 9]
        decisions, wait = q.claim(turn, 1.5)
        assert decisions == [] and wait == ["w"]
        assert q.on_tick(IDLE, Pieces(), KNOBS, 1.6) == []  # no further piece
        assert ended(run_piece(q, "w", now=2.0)) == ["w"]
        w = q.warmups["w"]
        credit = q.credit(turn)
        assert credit.tokens == w.done_upto - 200 == w.computed and credit.warm_ids == ("w",)
        assert credit.largest_piece == w.largest_piece == 512  # where the turn's pieces may start
        assert q.credit(turn).tokens == 0  # each warm-up is credited once

    def test_a_finished_warm_up_is_credited_to_the_turn_that_comes_later(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(500)), KNOBS, 0.0)
        feed(q)
        run_piece(q, "w")
        assert q.warmups["w"].outcome is Outcome.DONE
        decisions, wait = q.claim([*conv(500), 1, 2], 5.0)
        assert decisions == [] and wait == []
        assert q.credit([*conv(500), 1, 2]).tokens == 500

    def test_another_conversation_neither_ends_nor_is_credited(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000, seed=1, start=300)), KNOBS, 0.0)
        decisions, wait = q.claim(conv(3000, seed=2, start=300), 1.0)
        assert decisions == [] and wait == [] and q.warmups["w"].state == "pending"
        assert q.credit(conv(3000, seed=2, start=300)).tokens == 0

    def test_nothing_to_claim_once_every_warm_up_is_credited_or_computed_nothing(self) -> None:
        q = WarmQueue()
        assert not q.claimable()
        q.submit(warm("w", conv(500)), KNOBS, 0.0)
        assert q.claimable()
        feed(q)
        run_piece(q, "w")
        assert q.claimable()
        q.credit([*conv(500), 1])
        assert not q.claimable()


class TestRule8Expiry:
    def test_a_pending_warm_up_expires(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000)), KNOBS, 0.0)
        assert q.next_wakeup(Load(cold_held=True), KNOBS, 1.0) == KNOBS.expire_s
        decisions = q.on_tick(Load(cold_held=True), Pieces(), KNOBS, KNOBS.expire_s)
        assert ended(decisions) == ["w"]
        assert q.warmups["w"].outcome is Outcome.EXPIRED and "warm.expire_s" in q.warmups["w"].reason

    def test_a_running_one_expires_after_its_piece(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000)), KNOBS, 0.0)
        feed(q, now=99.0)
        assert q.on_tick(IDLE, Pieces(), KNOBS, 100.0) == []
        assert ended(run_piece(q, "w", now=100.5)) == ["w"]
        assert q.warmups["w"].outcome is Outcome.EXPIRED and q.warmups["w"].computed == 512

    def test_an_ended_one_is_forgotten_expire_s_after_its_end(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(500)), KNOBS, 0.0)
        feed(q)
        run_piece(q, "w", now=1.0)
        q.on_tick(IDLE, Pieces(), KNOBS, 100.0)
        assert "w" in q.warmups
        q.on_tick(IDLE, Pieces(), KNOBS, 101.0)
        assert "w" not in q.warmups and not q.claimable()

    def test_at_most_keep_ended_are_kept(self) -> None:
        q = WarmQueue()
        for i in range(KEEP_ENDED + 5):
            q.submit(warm(f"w{i}", conv(100, seed=i + 1), cached=100), KNOBS, float(i))
        q.on_tick(IDLE, Pieces(), KNOBS, KEEP_ENDED + 5.0)
        assert len(q.warmups) == KEEP_ENDED and "w0" not in q.warmups


class TestRule9CancelAndFailure:
    def test_cancel_ends_it_at_once_and_cancels_its_piece(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000)), KNOBS, 0.0)
        feed(q)
        assert q.cancel("w", 0.5) == [CancelWarmPiece("w"), Ended("w")]
        assert q.warmups["w"].outcome is Outcome.CANCELLED
        assert q.on_piece_done("w", 512, 100.0, KNOBS, 1.0) == []  # a late answer changes nothing
        assert q.cancel("w", 2.0) == []

    def test_cancel_of_an_unknown_id_raises(self) -> None:
        with pytest.raises(KeyError):
            WarmQueue().cancel("nope", 0.0)

    def test_a_failed_piece_ends_it_failed(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(3000)), KNOBS, 0.0)
        feed(q)
        assert ended(q.on_piece_failed("w", "HTTP 500", 1.0)) == ["w"]
        assert q.warmups["w"].outcome is Outcome.FAILED and "HTTP 500" in q.warmups["w"].reason



class TestRule10KeptFiles:
    def kept(self, restorable: int = 2900) -> WarmQueue:
        q = WarmQueue()
        q.submit(WarmUp(id="w", client=None, ids=conv(3000), cached=0, submitted=0.0,
                        restorable=restorable), KNOBS, 0.0)
        return q

    def test_a_kept_file_is_restored_before_any_piece_and_then_it_is_done(self) -> None:
        q = self.kept(2990)
        assert q.on_tick(IDLE, Pieces(), KNOBS, 0.0) == [RestoreKept("w")]
        assert q.warmups["w"].state == "running" and q.on_tick(IDLE, Pieces(), KNOBS, 0.1) == []
        assert q.on_restored("w", 2990, 0.2) == [Ended("w")]  # 10 left: < MIN_TOKENS
        w = q.warmups["w"]
        assert w.outcome is Outcome.DONE and w.reason == "restored 2990 tokens from a kept file"
        assert w.restored == 2990 and w.computed == 0 and w.pieces == 0

    def test_the_rest_goes_on_in_pieces_after_what_the_file_held(self) -> None:
        q = self.kept(2000)
        q.on_tick(IDLE, Pieces(), KNOBS, 0.0)
        assert q.on_restored("w", 2000, 0.2) == []
        assert feed(q, now=0.3).upto == 2496  # 2,000 + 512, down to a multiple of 64

    def test_a_file_holding_fewer_than_min_tokens_more_is_not_worth_a_restore(self) -> None:
        q = self.kept(MIN_TOKENS - 1)
        assert [type(d) for d in q.on_tick(IDLE, Pieces(), KNOBS, 0.0)] == [Feed]

    def test_under_rule_5_s_conditions(self) -> None:
        q = self.kept()
        assert q.on_tick(Load(cold_held=True), Pieces(), KNOBS, 0.0) == []
        assert q.on_tick(Load(starting=True), Pieces(), KNOBS, 0.0) == []

    def test_no_restore_after_all_leaves_it_to_compute(self) -> None:
        q = self.kept()
        q.on_tick(IDLE, Pieces(), KNOBS, 0.0)
        assert q.on_restore_failed("w", 0.2) == []
        assert feed(q, now=0.3).upto == 512  # from where it was, and never restored again

    def test_a_real_request_waits_for_the_restore_in_flight_then_ends_it(self) -> None:
        q = self.kept()
        q.on_tick(IDLE, Pieces(), KNOBS, 0.0)
        decisions, wait = q.claim(conv(3100), 0.1)
        assert decisions == [] and wait == ["w"]
        assert q.on_restored("w", 2900, 0.2) == [Ended("w")]
        assert q.warmups["w"].outcome is Outcome.SUPERSEDED


class TestRule11FirstPieceGoesWhereThePrefixWould:
    def test_the_first_piece_reaches_first_upto_then_pieces_are_the_sizer_s(self) -> None:
        q = WarmQueue()
        q.submit(WarmUp(id="w", client=None, ids=conv(3000), cached=0, submitted=0.0,
                        first_upto=231), KNOBS, 0.0)
        assert feed(q, BUSY).upto == 256  # 128 from the sizer, raised past the template's share
        run_piece(q, "w", now=1.0)
        assert feed(q, BUSY, now=5.0).upto == 384

    def test_no_floor_after_a_restore_nor_past_a_quarter_of_the_prefix(self) -> None:
        q = WarmQueue()
        q.submit(WarmUp(id="w", client=None, ids=conv(3000), cached=0, submitted=0.0,
                        restorable=2000, first_upto=2900), KNOBS, 0.0)
        q.on_tick(IDLE, Pieces(), KNOBS, 0.0)
        q.on_restored("w", 2000, 0.2)
        assert feed(q, now=0.3).upto == 2496
        q = WarmQueue()
        q.submit(WarmUp(id="w", client=None, ids=conv(800), cached=0, submitted=0.0,
                        first_upto=210), KNOBS, 0.0)
        assert feed(q, BUSY).upto == 128  # 256 would be over a quarter of the prefix


class TestRule12NoPieceLeavesLessThanATile:
    def test_the_last_piece_takes_a_short_rest(self) -> None:
        """128-token pieces of a 560-token prefix: 512 would leave 48, so that piece ends at 560."""
        q = WarmQueue()
        q.submit(warm("w", conv(560)), KNOBS, 0.0)
        ends = []
        for i in range(4):
            ends.append(feed(q, BUSY, now=10.0 * i).upto)
            run_piece(q, "w", now=10.0 * i + 1.0)
        assert ends == [128, 256, 384, 560]
        assert q.warmups["w"].outcome is Outcome.DONE

    def test_a_rest_of_a_tile_is_left_for_the_next_piece(self) -> None:
        q = WarmQueue()
        q.submit(warm("w", conv(576)), KNOBS, 0.0)
        for i in range(3):
            feed(q, BUSY, now=10.0 * i)
            run_piece(q, "w", now=10.0 * i + 1.0)
        assert feed(q, BUSY, now=30.0).upto == 512
