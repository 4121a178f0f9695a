"""The prefill gate applying the policy's decisions: a fake estimator, a fake piece feeder, the real
registry and a plain-number clock; the event loop is real, the upstream is not."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from proxy.config import PrefillConfig
from proxy.estimate import Estimate, EstimateError
from proxy.prefill.events import Decision, Load, Restorable, Sizer
from proxy.prefill.feeder import PieceError, PieceResult
from proxy.prefill.gate import PrefillGate
from proxy.prefill.hooks import Restored
from proxy.prefill.layout import ServerLayout
from proxy.prefill.policy import STUCK_PAUSE_S, PrefillPolicy
from proxy.record.flight import Flight, Phase
from proxy.record.inflight import Registry
from proxy.record.kind import Kind
from proxy.request.errors import Rejected
from tests.helpers import make_flight


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeEstimator:
    """`body["n"]` prompt ids, all new; `body["fail"]` raises EstimateError."""

    def __init__(self, slots: int | None = None, slot_ctx: int | None = None) -> None:
        self.calls = 0
        self.learned: list[tuple[int, int | None]] = []
        self.layout = ServerLayout(slots=slots, slot_ctx=slot_ctx)

    async def estimate(self, cfg: PrefillConfig, kind: str, body: Mapping[str, Any]
                       ) -> tuple[list[int], Estimate]:
        self.calls += 1
        if body.get("fail"):
            raise EstimateError("no tokenizer today")
        ids = list(range(body["n"]))
        return ids, Estimate(len(ids), len(ids))

    def learn(self, ids: list[int], cache_n: int | None, generated: int = 0) -> None:
        self.learned.append((len(ids), cache_n))

    def first_piece_floor(self, ids: list[int]) -> int:
        return 0  # its prompts share nothing with each other's slots


class FakeFeeder:
    """Each piece waits for the test to finish it (`done`/`fail`), so in-flight states can be seen."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, Any]] = []
        self.prompts: list[int] = []
        """The length of the prompt each piece was cut from (whose piece it was)."""
        self.pending: list[asyncio.Future[PieceResult]] = []
        self.cancelled = 0

    async def feed(self, ids: list[int], upto: int, lora: Any) -> PieceResult:
        self.pieces.append((upto, lora))
        self.prompts.append(len(ids))
        future: asyncio.Future[PieceResult] = asyncio.get_running_loop().create_future()
        self.pending.append(future)
        try:
            return await future
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def done(self, tokens: int, cache_n: int = 0, ms: float = 100.0) -> None:
        self.pending.pop(0).set_result(PieceResult(tokens, cache_n, ms))

    def fail(self) -> None:
        self.pending.pop(0).set_exception(PieceError("HTTP 500: boom"))


@dataclasses.dataclass
class Rig:
    gate: PrefillGate
    registry: Registry
    clock: Clock
    estimator: FakeEstimator
    feeder: FakeFeeder
    config: list[PrefillConfig]


@pytest.fixture
def rig() -> Rig:
    return make_rig("chunk")


class FakeKeeper:
    """A kept file for every body with `"kept": True`, covering all but 100 of its ids; each
    restore waits for the test to finish it (`restored`), so in-flight states can be seen."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.pending: list[asyncio.Future[Restored]] = []
        self.kept: set[str] = set()
        self.looks: list[bool] = []
        self.saving: asyncio.Future[None] | None = None
        self.wake = asyncio.Event()
        """The gate's wake-up, as the real keeper shares it."""

    async def restorable(self, flight: Flight, ids: list[int],
                         est: Estimate) -> tuple[Estimate, Restorable | None]:
        if flight.id not in self.kept:
            return est, None
        return est, Restorable(len(ids) - 100, restore_ms=50.0, max_wait_s=60.0)

    async def restore(self, flight: Flight, ids: list[int]) -> Restored:
        self.asked.append(flight.id)
        future: asyncio.Future[Restored] = asyncio.get_running_loop().create_future()
        self.pending.append(future)
        return await future

    def warmed(self, ids: Sequence[int]) -> None:
        """The rig's warm-ups are fakes: no prefix of theirs is in any slot."""

    def restored(self, new_tokens: int = 100) -> None:
        self.pending.pop(0).set_result(Restored(Estimate(6000, new_tokens), None, done=True))

    # the saves: one is due once `look_wanted`; it runs until the test ends it (`saved`)
    due: str | None = None
    look_wanted = False

    def want_a_look(self) -> None:
        self.look_wanted = True
        self.wake.set()

    def next_look_in(self, quiet: bool) -> float | None:
        return 0.0 if self.look_wanted else None

    async def look(self, quiet: bool) -> FakeSave | None:
        self.look_wanted = False
        self.looks.append(quiet)
        return FakeSave(self.due) if quiet and self.due else None

    async def save(self, save: FakeSave) -> None:
        self.saving = asyncio.get_running_loop().create_future()
        await self.saving
        self.due = None

    def saved(self) -> None:
        assert self.saving is not None
        self.saving.set_result(None)

    def save_dropped(self, save: FakeSave) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class FakeSave:
    name: str


class FakeWarmer:
    """One warm-up piece, started at the first tick whose load lets it (the queue's rule 5), in
    flight until the test ends it (`piece_done`)."""

    def __init__(self, wake: asyncio.Event) -> None:
        self.wake = wake
        self.wanted = False
        self.in_flight = 0
        self.loads: list[Load] = []
        self.done: list[tuple[int, int, float]] = []

    async def claim(self, flight: Flight, body: dict[str, Any]) -> int:
        return 0

    def tick(self, load: Load, sizer: Sizer) -> float | None:
        self.loads.append(load)
        if self.wanted and not (load.cold_held or load.starting or load.no_slot):
            self.wanted, self.in_flight = False, 1
        return None

    def pieces_in_flight(self) -> int:
        return self.in_flight

    def done_pieces(self) -> list[tuple[int, int, float]]:
        done, self.done = self.done, []
        return done

    def piece_done(self) -> None:
        self.in_flight = 0
        self.done.append((256, 0, 300.0))
        self.wake.set()


def make_rig(mode: str, *, slots: int | None = None, keeper: FakeKeeper | None = None,
             warm: FakeWarmer | None = None, **over: Any) -> Rig:
    config = [PrefillConfig(mode=mode, cold_tokens=1000, max_stall_ms=256.0, prefill_share=0.5,
                            max_waiting=1, max_hold_s=30.0, **over)]
    registry, clock = Registry(), Clock()
    estimator, feeder = FakeEstimator(slots), FakeFeeder()
    gate = PrefillGate(config=config[0], estimator=estimator,  # type: ignore[arg-type]
                       feeder=feeder, registry=registry, clock=clock,  # type: ignore[arg-type]
                       keep=keeper, warm=warm,
                       wake=keeper.wake if keeper is not None else warm.wake if warm else None)
    registry.subscribe(gate.on_phase)
    return Rig(gate, registry, clock, estimator, feeder, config)


def flight(rig: Rig, name: str, kind: Kind = Kind.CHAT) -> Flight:
    f = make_flight(name, rig.clock.now, kind)
    rig.registry.add(f, rig.clock.now)
    return f


async def generating(rig: Rig, name: str = "s") -> Flight:
    f = flight(rig, name)
    await rig.gate.admit(f, {"n": 50})
    rig.registry.move(f, Phase.PREFILLING, rig.clock.now)
    rig.registry.move(f, Phase.DECODING, rig.clock.now)
    return f


def finish(rig: Rig, f: Flight, prompt_n: int = 50, cache_n: int = 0) -> None:
    f.computed_tokens, f.prompt_tokens = prompt_n, prompt_n + cache_n
    rig.registry.finish(f, rig.clock.now)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_mode_off_does_not_estimate_but_tracks() -> None:
    rig = make_rig("off")
    f = flight(rig, "a")
    await rig.gate.admit(f, {"n": 5000})
    admission = f.prefill
    assert admission.plan == "none" and admission.est_new_tokens is None
    assert rig.estimator.calls == 0
    assert [k for k, _ in rig.gate.policy.snapshot().in_flight] == ["a#1"]
    finish(rig, f)
    assert rig.gate.policy.snapshot().in_flight == ()


async def test_other_kinds_pass_untouched(rig: Rig) -> None:
    await rig.gate.admit(e := flight(rig, "e", Kind.EMBEDDINGS), {"n": 5000})
    assert e.prefill.plan == "none" and rig.estimator.calls == 0


async def test_short_request_admitted_at_once_with_its_estimate(rig: Rig) -> None:
    await rig.gate.admit(f := flight(rig, "a"), {"n": 300})
    admission = f.prefill
    assert (admission.plan, admission.held_ms, admission.note) == ("none", 0.0, None)
    assert (admission.est_prompt_tokens, admission.est_new_tokens) == (300, 300)


async def test_estimate_error_fails_open_with_a_note(rig: Rig) -> None:
    await generating(rig)
    await rig.gate.admit(f := flight(rig, "a"), {"fail": True})
    admission = f.prefill
    assert admission.plan == "none" and admission.est_new_tokens is None
    assert admission.note and admission.note.startswith("not estimated")


async def test_cold_with_nobody_generating_goes_in_idle_pieces_back_to_back(rig: Rig) -> None:
    task = asyncio.create_task(rig.gate.admit(f := flight(rig, "c"), {"n": 3000}))
    await settle()
    done = 0
    while not task.done():  # each piece's end sends the next at once: nobody waits for a pause
        upto = rig.feeder.pieces[-1][0]
        rig.feeder.done(upto - done, cache_n=done, ms=300.0)
        done = upto
        await settle()
    admission = f.prefill
    assert admission.plan == "chunked" and admission.pieces == len(rig.feeder.pieces) >= 2
    assert admission.note and admission.note.startswith("nobody generating after")


async def test_defer_holds_until_the_others_finish() -> None:
    rig = make_rig("defer")
    s = await generating(rig)
    c = flight(rig, "c")
    task = asyncio.create_task(rig.gate.admit(c, {"n": 3000}))
    await settle()
    assert not task.done() and c.phase is Phase.HELD
    rig.clock.now = 2.0
    finish(rig, s, prompt_n=50, cache_n=10)
    await task
    admission = c.prefill
    assert (admission.plan, admission.held_ms) == ("held", 2000.0)
    assert admission.note == "held until others finished"
    assert (50, 10) in rig.estimator.learned  # the cache model heard the server's cache_n


async def test_defer_releases_at_max_hold_on_tick() -> None:
    rig = make_rig("defer")
    await generating(rig)
    task = asyncio.create_task(rig.gate.admit(c := flight(rig, "c"), {"n": 3000}))
    await settle()
    rig.clock.now = 31.0
    rig.gate.tick()
    await task
    assert c.prefill.note == "held prefill.max_hold_s"


async def test_chunk_feeds_pieces_then_forwards(rig: Rig) -> None:
    s = await generating(rig)
    c = flight(rig, "c")
    task = asyncio.create_task(rig.gate.admit(c, {"n": 1200, "lora": [{"id": 0}]}))
    await settle()
    assert rig.feeder.pieces == [(64, [{"id": 0}])]  # the prior cost, 20 ms + 2 ms a token: 64 fit
    rig.clock.now = 0.1
    rig.feeder.done(64, ms=30.0)
    await settle()
    assert rig.feeder.pieces[1:] == []  # the pause after a piece
    rig.clock.now = 0.3
    rig.gate.tick()
    await settle()
    assert len(rig.feeder.pieces) == 2
    finish(rig, s)  # nobody generating: the piece in flight ends, then the short rest goes whole
    await settle()
    assert not task.done()
    rig.feeder.done(128, ms=60.0)
    await task
    admission = c.prefill
    assert (admission.plan, admission.pieces) == ("chunked", 2)
    assert admission.note and admission.note.startswith("nobody generating after 2 pieces")


async def test_client_leaving_while_chunked_cancels_its_piece(rig: Rig) -> None:
    await generating(rig)
    task = asyncio.create_task(rig.gate.admit(c := flight(rig, "c"), {"n": 3000}))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settle()
    assert rig.feeder.cancelled == 1
    snap = rig.gate.policy.snapshot()
    assert snap.held == () and snap.chunking is None
    assert c.prefill.plan == "held" and c.prefill.pieces == 0  # its record says it left held


async def test_pieces_fed_before_the_client_leaves_stay_counted(rig: Rig) -> None:
    await generating(rig)
    task = asyncio.create_task(rig.gate.admit(c := flight(rig, "c"), {"n": 3000}))
    await settle()
    rig.clock.now = 0.1
    rig.feeder.done(128, ms=100.0)
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (c.prefill.plan, c.prefill.pieces, c.prefill.fed_tokens) == ("chunked", 1, 128)


async def test_failed_piece_forwards_as_it_came(rig: Rig) -> None:
    await generating(rig)
    task = asyncio.create_task(rig.gate.admit(c := flight(rig, "c"), {"n": 3000}))
    await settle()
    rig.feeder.fail()
    await task
    admission = c.prefill
    assert admission.note == "piece failed, forwarded as it came: HTTP 500: boom"
    assert admission.pieces == 0


async def test_too_many_waiting_are_rejected(rig: Rig) -> None:
    await generating(rig)
    first = asyncio.create_task(rig.gate.admit(flight(rig, "c1"), {"n": 3000}))
    second = asyncio.create_task(rig.gate.admit(flight(rig, "c2"), {"n": 3000}))
    await settle()
    with pytest.raises(Rejected):
        await rig.gate.admit(flight(rig, "c3"), {"n": 3000})
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)


async def test_reload_to_off_releases_the_held(rig: Rig) -> None:
    await generating(rig)
    task = asyncio.create_task(rig.gate.admit(c := flight(rig, "c"), {"n": 3000}))
    await settle()
    rig.gate.reconfigure(dataclasses.replace(rig.config[0], mode="off"))
    rig.feeder.done(128)
    await task
    admission = c.prefill
    assert admission.note == "cold, prefill.mode off (reload)"


# ---- the interplay of cold prompts and kept KV (one scheduler) -----------------------------------


async def test_a_returning_conversation_waits_for_the_next_slot_then_is_restored() -> None:
    keeper = FakeKeeper()
    rig = make_rig("chunk", slots=2, keeper=keeper)
    s1, s2 = await generating(rig, "s1"), await generating(rig, "s2")
    keeper.kept.add("r")
    returning = asyncio.create_task(rig.gate.admit(r := flight(rig, "r"), {"n": 6000}))
    short = asyncio.create_task(rig.gate.admit(x := flight(rig, "x"), {"n": 50}))
    await settle()
    assert keeper.asked == [] and not returning.done() and not short.done()
    assert x.phase is Phase.HELD  # the next slot is claimed for the restore
    rig.clock.now = 2.0
    finish(rig, s1)
    await settle()
    assert keeper.asked == ["r"] and not short.done()
    keeper.restored()
    await returning
    await settle()
    assert not short.done()  # not until r has its restored slot: x could take it first
    rig.registry.move(r, Phase.PREFILLING, rig.clock.now)
    await settle()
    assert not short.done()  # r and s2 use both slots: x would only queue in the server
    finish(rig, s2)
    await short
    assert r.prefill.held_ms == 2000.0 and r.prefill.est_new_tokens == 100
    assert rig.feeder.pieces == []  # restored, not recomputed in pieces


async def test_two_cold_requests_share_the_prefill_time(rig: Rig) -> None:
    rig.config[0] = dataclasses.replace(rig.config[0], max_waiting=2)
    rig.gate.reconfigure(rig.config[0])
    await generating(rig)
    long = asyncio.create_task(rig.gate.admit(flight(rig, "long"), {"n": 16000}))
    await settle()
    assert rig.feeder.prompts == [16000]
    short = asyncio.create_task(rig.gate.admit(c := flight(rig, "short"), {"n": 1200}))
    await settle()
    for _ in range(100):
        rig.clock.now += 1.0
        if rig.feeder.pending:
            rig.feeder.done(64)
        await settle()
        rig.gate.tick()
        await settle()
        if short.done():
            break
    # one piece of the long history, then the short turn's until it was sent, but for a piece
    # of the long one each time it had waited its own time alone (32 s at the prior cost)
    prompts = rig.feeder.prompts
    assert prompts[0] == 16000 and set(prompts[1:]) == {1200, 16000}
    assert prompts.count(1200) > 2 * prompts.count(16000), prompts
    assert c.prefill.pieces >= 1 and not long.done()
    long.cancel()
    await asyncio.gather(long, return_exceptions=True)


async def test_a_prompt_longer_than_a_slot_is_never_fed(rig: Rig) -> None:
    rig.estimator.layout = ServerLayout(slots=4, slot_ctx=8192)  # type: ignore[attr-defined]
    await generating(rig)
    await rig.gate.admit(c := flight(rig, "c"), {"n": 9456})
    assert rig.feeder.pieces == [] and c.prefill.pieces == 0
    assert c.prefill.note == ("the prompt's 9,456 tokens are more than a slot holds (8,192): "
                              "forwarded as it came, no piece fed")


async def test_a_save_goes_only_when_no_cold_request_waits_and_holds_one_that_comes() -> None:
    """The keeper's looks and saves run in the gate's one loop, under the policy's rule 16."""
    keeper = FakeKeeper()
    rig = make_rig("chunk", slots=4, keeper=keeper)
    loop = asyncio.create_task(rig.gate.run())
    try:
        s = await generating(rig)
        cold = asyncio.create_task(rig.gate.admit(c := flight(rig, "c"), {"n": 5000}))
        await settle()
        assert len(rig.feeder.pieces) == 1  # c is fed in pieces beside s
        keeper.due = "conv-1"
        keeper.want_a_look()
        await settle()
        assert keeper.looks == [False] and keeper.saving is None  # not while c waits
        rig.clock.now = 1.0
        finish(rig, s)
        while not cold.done():  # alone now: c's rest goes in idle pieces, then c itself
            rig.feeder.done(1000)
            await settle()
        finish(rig, c, prompt_n=100, cache_n=4900)
        fed = len(rig.feeder.pieces)
        keeper.want_a_look()
        await settle()
        assert keeper.looks == [False, True] and keeper.saving is not None  # quiet: it goes
        late = asyncio.create_task(rig.gate.admit(d := flight(rig, "d"), {"n": 5000}))
        short = asyncio.create_task(rig.gate.admit(x := flight(rig, "x"), {"n": 50}))
        await settle()
        assert short.done() and not late.done()  # a short one goes; the cold one waits
        assert d.phase is Phase.HELD and len(rig.feeder.pieces) == fed
        finish(rig, x)
        await settle()
        assert len(rig.feeder.pieces) == fed  # still the save's time
        rig.clock.now = 1.5
        keeper.saved()
        await settle()
        assert late.done() and d.prefill.held_ms == 500.0  # then d goes, at full speed
        assert d.prefill.note == "cold, nobody generating"
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_a_cold_arrival_during_a_warm_piece_waits_for_it_then_goes_at_full_speed() -> None:
    """A warm-up's piece is the one piece in flight: the server is not idle for a cold request
    that comes meanwhile; once the piece ends it goes as on an idle server, and the warm-ups stop
    while it is held."""
    warmer = FakeWarmer(asyncio.Event())
    rig = make_rig("chunk", slots=4, warm=warmer)
    loop = asyncio.create_task(rig.gate.run())
    try:
        warmer.wanted = True
        warmer.wake.set()
        await settle()
        assert warmer.in_flight == 1
        cold = asyncio.create_task(rig.gate.admit(c := flight(rig, "c"), {"n": 5000}))
        await settle()
        assert not cold.done() and c.phase is Phase.HELD and rig.feeder.pieces == []
        assert c.prefill.note is None and warmer.loads[-1].cold_held  # warm-ups stop behind it
        rig.clock.now = 0.3
        warmer.piece_done()
        await settle()
        assert rig.feeder.prompts == [5000]  # alone now: its first piece goes, back to back
        cold.cancel()
        await asyncio.gather(cold, return_exceptions=True)
        assert rig.feeder.cancelled == 1
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_a_slot_that_frees_goes_to_the_held_turn_and_the_warm_up_waits_for_the_next() -> None:
    """bench day: as `ann`'s summary ended, a turn held for a slot took hers; her warm-up's piece,
    sent once that turn's prompt started, waited 4.8 s in llama-server's queue for another."""
    warmer = FakeWarmer(asyncio.Event())
    rig = make_rig("chunk", slots=2, warm=warmer)
    loop = asyncio.create_task(rig.gate.run())
    try:
        s1, s2 = await generating(rig, "s1"), await generating(rig, "s2")
        short = asyncio.create_task(rig.gate.admit(x := flight(rig, "x"), {"n": 50}))
        await settle()
        assert x.phase is Phase.HELD
        warmer.wanted = True
        rig.clock.now = 1.0
        finish(rig, s1)
        await short  # the turn held for a slot has the one that freed
        assert x.prefill.slot_wait_ms == 1000.0  # its record says what a third slot spared
        rig.registry.move(x, Phase.PREFILLING, rig.clock.now)
        warmer.wake.set()
        await settle()
        assert warmer.in_flight == 0 and warmer.loads[-1].no_slot  # no slot for its piece
        rig.clock.now = 2.0
        finish(rig, s2)
        await settle()
        assert warmer.in_flight == 1  # the next slot to come free is the warm-up's
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_a_wake_up_the_policy_leaves_in_the_past_does_not_spin_the_loop(
        caplog: pytest.LogCaptureFixture) -> None:
    """A policy bug that keeps asking for a tick already given (one such, a cold request waiting
    for a slot, spun a core beside llama-server) costs a tick every STUCK_PAUSE_S, said once."""

    class Stuck(PrefillPolicy):
        ticks = 0

        def next_wakeup(self) -> float | None:
            return 0.5

        def on_tick(self, now: float) -> list[Decision]:
            Stuck.ticks += 1
            return []

    config = PrefillConfig(mode="chunk")
    clock = Clock()
    clock.now = 1.0
    gate = PrefillGate(config=config, estimator=FakeEstimator(),  # type: ignore[arg-type]
                       feeder=FakeFeeder(), registry=Registry(), clock=clock,  # type: ignore[arg-type]
                       policy=Stuck(config, n_batch=config.n_batch))
    loop = asyncio.create_task(gate.run())
    try:
        await asyncio.sleep(0.3)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert 2 <= Stuck.ticks <= 0.3 / STUCK_PAUSE_S + 2
    assert sum("a policy bug" in r.message for r in caplog.records) == 1
