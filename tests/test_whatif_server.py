"""The what-if's model of llama-server's slot loop, rule by rule: each class is one numbered rule of
`proxy/whatif/server.py`. Hand-made tasks, plain-number times, simple costs; no log, no policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest

from proxy.whatif.costs import Costs
from proxy.whatif.prompts import Held, Seq
from proxy.whatif.server import (
    CONTEXT_EXCEEDED,
    Failed,
    Finished,
    FirstToken,
    Happening,
    LoopDone,
    LoopWork,
    ServerModel,
    Started,
)
from proxy.whatif.settings import ServerSettings
from proxy.whatif.slots import Slots, Task

COSTS = Costs(fixed_ms=10.0, per_token_ms=1.0, per_token_per_kctx_ms=0.0, per_decoder_ms=0.0,
              per_kctx_ms=0.0, step_ms=20.0, per_slot_ms=0.0, decode_per_kctx_ms=0.0,
              lora_switch_ms=0.0, kv_bytes_per_token=1.0, save_gb_s=1e12, copy_gb_s=1e12)
"""A micro-batch: 10 ms + 1 ms a prompt token; a decode step 20 ms; copies free."""
SETTINGS = ServerSettings(n_batch=2048, n_ubatch=512, parallel=2, kv_unified=False, ctx=0,
                          cache_ram=0, cache_idle_slots=False)


def seq(sid: int, n: int, base: Seq | None = None) -> Seq:
    return (base or Seq()).extend(sid, n)


def task(key: str, prompt: Seq, generate: int = 3, *, lora: str = "default",
         explicit: bool = False) -> Task:
    return Task(key, prompt, prompt.extend(10_000 + hash(key) % 10_000, generate), generate,
                lora, explicit)


def model(**over: object) -> ServerModel:
    return ServerModel(dataclasses.replace(SETTINGS, **over), COSTS)  # type: ignore[arg-type]


def run(server: ServerModel, submits: Sequence[tuple[float, Task]],
        cancels: Sequence[tuple[float, Task]] = (), step: bool = False,
        loops: Sequence[tuple[float, LoopWork]] = ()) -> list[Happening]:
    """Submit each task (and restore or save) at its time and run the server until it is idle;
    `step`: no look-ahead (every boundary's horizon is its own time)."""
    events: list[tuple[float, int, Task | LoopWork]] = sorted(
        [(t, 0, x) for t, x in submits] + [(t, 1, x) for t, x in cancels]
        + [(t, 2, x) for t, x in loops], key=lambda e: (e[0], e[1]))
    out: list[Happening] = []
    i = 0
    while True:
        t_ext = events[i][0] if i < len(events) else math.inf
        t_srv = server.next_at
        if t_srv is not None and t_srv <= t_ext:
            out += server.boundary(t_srv if step else t_ext)
        elif i < len(events):
            t, kind, x = events[i]
            if isinstance(x, LoopWork):
                server.run_on_loop(x, t)
            else:
                (server.submit if kind == 0 else server.cancel)(x, t)
            i += 1
        else:
            return out


def beside_other_cells(costs: Costs) -> list[list[float]]:
    """A 1,000-token prompt's token times on one shared KV, with the other slots empty and then
    holding 20,000 cells."""
    times = []
    for other in (0, 20_000):
        server = ServerModel(dataclasses.replace(SETTINGS, kv_unified=True), costs)
        if other:
            server.preload([seq(9, other)], None)
        a = task("a", seq(1, 1000), 3)
        run(server, [(0.0, a)])
        times.append(a.tokens)
    return times


def of(happenings: Sequence[Happening], kind: type, key: str) -> list[Happening]:
    return [h for h in happenings if isinstance(h, kind)
            and (h.work.key if isinstance(h, LoopDone) else h.task.key) == key]


class TestRule1SlotChoice:
    def test_the_slot_holding_most_of_the_prompt_is_chosen(self) -> None:
        server = model()
        a, b = task("a", seq(1, 1000)), task("b", seq(2, 1000))
        run(server, [(0.0, a), (0.0, b)])
        holder = next(s.id for s in server.slots if s.held.seq.segs[0][0] == 1)
        again = task("a2", seq(3, 50, a.out))
        run(server, [(10.0, again)])
        assert again.cache_n == a.out.length - 1  # the reply's last token is not in the KV
        assert next(s for s in server.slots if s.held.seq is again.out).id == holder

    def test_without_a_similar_slot_the_least_recently_used_one(self) -> None:
        server = model()
        run(server, [(0.0, task("a", seq(1, 100)))])
        run(server, [(5.0, task("b", seq(2, 100)))])  # the other slot: never used
        used = {s.id: s.t_last for s in server.slots}
        c = task("c", seq(3, 100))
        run(server, [(10.0, c)])
        oldest = min(used, key=lambda i: used[i])
        assert server.slots[oldest].held.seq is c.out

    def test_of_two_slots_released_at_one_batch_the_lower_is_the_least_recent(self) -> None:
        """llama-server releases them in slot order, microseconds apart: the next task gets the
        lower slot (and with it the prompt budget first)."""
        table = Slots(SETTINGS, COSTS)
        for slot in table.slots:
            slot.task = task(f"t{slot.id}", seq(slot.id + 1, 100))
        for slot in table.slots:  # the end of one batch
            table.release(slot, 5.0)
        nxt = task("next", seq(9, 100))
        table.queue.append(nxt)
        table.assign(6.0)
        assert table.slots[0].task is nxt

    def test_a_replayed_task_takes_the_slot_the_recording_gave_it_for_the_least_recent(
            self) -> None:
        server = model()
        run(server, [(0.0, task("a", seq(1, 100)))])
        lru = min(server.slots, key=lambda s: s.t_last).id
        recorded = next(s.id for s in server.slots if s.id != lru)
        b = dataclasses.replace(task("b", seq(2, 100)), slot=recorded)
        run(server, [(5.0, b)])
        assert server.slots[recorded].held.seq is b.out
        busy = task("c", seq(3, 100), 500)  # into the slot never used
        d = dataclasses.replace(task("d", seq(4, 100)), slot=lru)
        out = run(server, [(10.0, busy), (10.1, d)])
        assert server.slots[lru].held.seq is busy.out
        assert of(out, Started, "d")[0].t < of(out, Finished, "c")[0].t  # busy: another slot
        holder = next(s.id for s in server.slots if s.held.seq is busy.out)
        again = dataclasses.replace(task("c2", seq(5, 20, busy.out)), slot=1 - holder)
        run(server, [(30.0, again)])
        assert again.cache_n == busy.out.length - 1  # the slot holding its prefix comes first

    def test_no_idle_slot_defers_until_one_is_released(self) -> None:
        server = model(parallel=1)
        a, b = task("a", seq(1, 100), 5), task("b", seq(2, 100))
        out = run(server, [(0.0, a), (0.01, b)])
        assert of(out, Started, "b")[0].t >= of(out, Finished, "a")[0].t


class TestRule2RamCache:
    def test_a_conversation_pushed_out_of_its_slot_comes_back_from_ram(self) -> None:
        server = model(parallel=1, cache_ram=1024)
        a, b = task("a", seq(1, 800)), task("b", seq(2, 800))
        run(server, [(0.0, a), (5.0, b)])
        back = task("a2", seq(3, 20, a.out))
        run(server, [(10.0, back)])
        assert back.cache_n == a.out.length - 1

    def test_without_the_cache_it_is_computed_again(self) -> None:
        server = model(parallel=1, cache_ram=0)
        a, b = task("a", seq(1, 800)), task("b", seq(2, 800))
        run(server, [(0.0, a), (5.0, b)])
        back = task("a2", seq(3, 20, a.out))
        run(server, [(10.0, back)])
        assert back.cache_n == 0

    def test_copies_take_the_main_loops_time(self) -> None:
        server = ServerModel(dataclasses.replace(SETTINGS, parallel=1, cache_ram=1024),
                             dataclasses.replace(COSTS, kv_bytes_per_token=1e6, save_gb_s=1.0))
        a, b = task("a", seq(1, 800)), task("b", seq(2, 800))
        out = run(server, [(0.0, a), (5.0, b)])
        held = 800 + 3 - 1  # its prompt and reply, the last token not in the KV
        assert of(out, Started, "b")[0].t == pytest.approx(5.0 + held * 1e6 / 1e9)

    def test_a_save_and_a_copy_back_each_take_their_own_speed(self) -> None:
        """Saving a slot's prompt to the RAM cache took 0.5-1.6 GB/s on the testbed, copying one
        back ~6 GB/s (docs/whatif.md, the RAM cache's copies)."""
        server = ServerModel(dataclasses.replace(SETTINGS, parallel=1, cache_ram=4096),
                             dataclasses.replace(COSTS, kv_bytes_per_token=1e6, save_gb_s=1.0,
                                                 copy_gb_s=10.0))
        a, b = task("a", seq(1, 800)), task("b", seq(2, 800))
        run(server, [(0.0, a), (5.0, b)])
        back = task("a2", seq(3, 20, a.out))
        out = run(server, [(10.0, back)])
        held = 800 + 3 - 1
        assert back.cache_n == held  # b's prompt saved, a's copied back
        assert of(out, Started, "a2")[0].t == pytest.approx(10.0 + held * 1e-3 + held * 1e-4)

    def test_idle_slots_are_saved_and_emptied_at_each_launch_with_one_shared_kv(self) -> None:
        server = model(cache_ram=1024, cache_idle_slots=True, kv_unified=True)
        run(server, [(0.0, task("a", seq(1, 500)))])
        run(server, [(5.0, task("b", seq(2, 500)))])
        assert [s.held.n for s in server.slots if s.task is None and s.held.seq.segs
                and s.held.seq.segs[0][0] == 1] in ([], [0])
        assert any(e.seq.segs[0][0] == 1 for e in server.table.cache.entries)


class TestRule3PromptStart:
    def test_a_prompt_reuses_what_its_slot_holds(self) -> None:
        server = model(parallel=1)
        a = task("a", seq(1, 1000))
        run(server, [(0.0, a)])
        b = task("b", seq(2, 100, a.prompt.prefix(600)))
        run(server, [(10.0, b)])
        assert (b.cache_n, b.prompt_n) == (600, 100)

    def test_a_prompt_held_whole_recomputes_one_token(self) -> None:
        server = model(parallel=1)
        a = task("a", seq(1, 1000))
        run(server, [(0.0, a)])
        again = task("again", a.prompt)
        run(server, [(10.0, again)])
        assert again.prompt_n == 1

    def test_a_prompt_longer_than_the_slot_context_is_refused(self) -> None:
        server = model(ctx=2048)  # two slots of 1,024
        big = task("big", seq(1, 1024))
        out = run(server, [(0.0, big)])
        assert [(h.status, "exceeds" in h.error) for h in out if isinstance(h, Failed)] == [
            (400, True)]

    def test_an_explicit_lora_change_clears_the_slot(self) -> None:
        server = model(parallel=1)
        a = task("a", seq(1, 500), lora="0:1.0", explicit=True)
        run(server, [(0.0, a)])
        b = task("b", seq(2, 10, a.out), lora="0:0.5", explicit=True)
        run(server, [(10.0, b)])
        assert b.cache_n == 0


class TestRule4BatchContents:
    def test_decode_tokens_first_then_prompt_tokens_up_to_n_batch(self) -> None:
        server = model(n_batch=512)
        gen = task("gen", seq(1, 10), 50)
        cold = task("cold", seq(2, 2000), 1)
        out = run(server, [(0.0, gen), (0.1, cold)])
        batch_end = cold.tokens[0] + 0.001  # the stream's token of that batch may come after it
        during = [t for t in gen.tokens if of(out, Started, "cold")[0].t < t <= batch_end]
        assert len(during) == math.ceil(2000 / 511)  # one token per batch of 1 + 511

    def test_the_lower_slot_takes_the_prompt_budget_first(self) -> None:
        server = model(n_batch=1000, parallel=2)
        first = task("first", seq(1, 3000), 1)
        second = task("second", seq(2, 3000), 1)
        run(server, [(0.0, first), (0.0, second)])
        low, high = (first, second) if server.slots[0].held.seq is first.out else (second, first)
        assert low.tokens[0] < high.tokens[0]

    def test_other_lora_settings_wait_for_the_generating_ones(self) -> None:
        server = model(parallel=2)
        a = task("a", seq(1, 100), 100, lora="0:1.0", explicit=True)
        b = task("b", seq(2, 100), 5, lora="none", explicit=True)
        out = run(server, [(0.0, a), (0.2, b)])
        assert of(out, Started, "b")[0].t >= of(out, Finished, "a")[0].t

    def test_a_lora_switch_costs_its_time(self) -> None:
        server = ServerModel(SETTINGS, dataclasses.replace(COSTS, lora_switch_ms=500.0))
        a = task("a", seq(1, 100), 1, lora="0:1.0", explicit=True)
        out = run(server, [(0.0, a)])
        assert of(out, FirstToken, "a")[0].t == pytest.approx((10 + 100 + 500) / 1000.0, abs=1e-5)


class TestRule5BatchTime:
    def test_a_prompt_in_micro_batches_then_decode_steps(self) -> None:
        server = model()
        a = task("a", seq(1, 1000), 3)
        run(server, [(0.0, a)])
        first = (2 * 10 + 1000) / 1000.0
        assert a.tokens == pytest.approx([first, first + 0.02, first + 0.04])

    def test_with_one_shared_kv_a_token_attends_to_its_own_cells_only(self) -> None:
        """What a decode token attends to is its own slot's cells: priced by them alone where
        the span's other cells are free (`decode_per_kv_ms` 0)."""
        costs = dataclasses.replace(COSTS, decode_per_kctx_ms=10.0, per_token_per_kctx_ms=1.0)
        times = beside_other_cells(costs)
        assert times[0] == pytest.approx(times[1])
        first = (2 * 10 + 1000 + 1.0 * 1000 * 0.5) / 1000.0
        step = (20 + 10.0 * 1.0) / 1000.0  # its 1,000 cells; the first sampled token is not in yet
        assert times[0][:2] == pytest.approx([first, first + step])

    def test_with_one_shared_kv_prompt_tokens_scan_the_other_slots_cells(self) -> None:
        """The mask of every cell of the span is read for each tile of queries: a prompt costs
        more beside a full cache (its 1,000 cells and the 20,000 others in a span of 21,248, the
        next multiple of 256, against 1,024 alone); a decode step only at its own price."""
        tokens = beside_other_cells(dataclasses.replace(COSTS, per_token_per_kv_ms=0.1))
        scanned = (21_248 - 1000) - (1024 - 1000)
        assert tokens[1][0] - tokens[0][0] == pytest.approx(0.1 * 1000 * scanned / 1e6)
        assert tokens[1][2] - tokens[1][1] == pytest.approx(tokens[0][2] - tokens[0][1])

    @pytest.mark.parametrize("unified", [True, False])
    def test_a_decode_step_reads_the_shared_kvs_span_beyond_its_own_cells(
            self, unified: bool) -> None:
        """A stream's steps before a 20,000-token prompt came into the other slot and after it
        ended (its slot keeps it): with one shared KV each step reads the span's ~20,000 other
        cells (kvcells.py); with a KV per slot it reads its own."""
        costs = dataclasses.replace(COSTS, per_token_ms=0.01, decode_per_kv_ms=0.1)
        server = ServerModel(dataclasses.replace(SETTINGS, kv_unified=unified), costs)
        a, b = task("a", seq(1, 100), 2000), task("b", seq(2, 20_000), 1)
        run(server, [(0.0, a), (1.0, b)])
        before = a.tokens[11] - a.tokens[10]
        after = a.tokens[-1] - a.tokens[-2]
        assert before == pytest.approx(0.020, abs=1e-4)
        if unified:
            own = 100 + len(a.tokens)
            span = -(-(20_000 + 1 + own) // 256) * 256
            assert after == pytest.approx(0.020 + 0.1 * (span - own) / 1e6, abs=2e-5)
        else:
            assert after == pytest.approx(0.020)

    def test_a_decode_token_in_a_prompts_batch_pays_for_its_cells(self) -> None:
        firsts = []
        for price in (0.0, 50.0):
            costs = dataclasses.replace(COSTS, per_decoder_kctx_ms=price)
            server = ServerModel(dataclasses.replace(SETTINGS, kv_unified=True), costs)
            a = task("a", seq(1, 2000), 10)
            b = task("b", seq(2, 100), 1)
            run(server, [(0.0, a), (2.1, b)])
            firsts.append(b.tokens[0])
        # a's ~2,003 cells at 64 rows' price, in the one batch b's prompt shares with a's token
        assert firsts[1] - firsts[0] == pytest.approx(50.0 * 2.003 / 1000.0, abs=2e-4)


class TestRule6Tokens:
    def test_a_task_ends_at_n_predict_and_its_slot_keeps_prompt_and_reply(self) -> None:
        server = model(parallel=1)
        a = task("a", seq(1, 100), 7)
        out = run(server, [(0.0, a)])
        assert a.n_gen == 7 and len(of(out, Finished, "a")) == 1
        assert server.slots[0].held.n == 100 + 6

    def test_tokens_of_one_batch_are_sent_in_slot_order(self) -> None:
        """A stream in a lower slot than a prompt that just finished gets its token before that
        prompt's first token, one in a higher slot after it, and the next batch starts after both."""
        for stream_slot in (0, 1):
            server = model(parallel=2)
            server.table.used_before([1 - stream_slot])  # the stream takes the other one
            gen = task("gen", seq(1, 10), 50)
            cold = task("cold", seq(2, 1000), 2)
            out = run(server, [(0.0, gen), (0.1, cold)])
            assert server.slots[stream_slot].held.seq is gen.out
            first = of(out, FirstToken, "cold")[0].t
            beside = min(gen.tokens, key=lambda t: abs(t - first))
            assert (beside < first) == (stream_slot == 0) and abs(beside - first) < 1e-3
            assert cold.tokens[1] > max(first, beside)

    def test_the_slot_context_limit_truncates(self) -> None:
        server = model(parallel=1, ctx=256)
        a = task("a", seq(1, 200), 500)
        run(server, [(0.0, a)])
        assert a.truncated and a.n_gen == 256 - 200


class TestRule7SharedKvFull:
    def test_idle_slots_are_emptied_to_make_room(self) -> None:
        server = model(kv_unified=True, ctx=1200)
        run(server, [(0.0, task("a", seq(1, 800), 1))])
        b = task("b", seq(2, 800), 1)
        out = run(server, [(5.0, b)])
        assert of(out, Finished, "b")

    def test_when_that_is_not_enough_every_running_task_fails(self) -> None:
        server = model(kv_unified=True, ctx=1200)
        a, b = task("a", seq(1, 700), 50), task("b", seq(2, 700), 50)
        out = run(server, [(0.0, a), (0.0, b)])
        assert {h.task.key for h in out if isinstance(h, Failed)
                and h.error == CONTEXT_EXCEEDED} == {"a", "b"}


class TestRule8Cancel:
    def test_a_queued_task_disappears(self) -> None:
        server = model(parallel=1)
        a, b = task("a", seq(1, 100), 10), task("b", seq(2, 100))
        out = run(server, [(0.0, a), (0.01, b)], cancels=[(0.02, b)])
        assert not of(out, Started, "b")

    def test_a_running_task_is_released_and_its_slot_keeps_what_it_computed(self) -> None:
        server = model(parallel=1, n_batch=256)
        a = task("a", seq(1, 2000), 10)
        out = run(server, [(0.0, a)], cancels=[(0.5, a)])
        assert not of(out, Finished, "a")
        assert 0 < server.slots[0].held.n < 2000 and server.slots[0].task is None


class TestRule9QuietStretches:
    @pytest.mark.parametrize("per_kv", [0.0, 0.5])
    def test_computed_at_once_the_same_as_batch_by_batch(self, per_kv: float) -> None:
        """With a price on the shared KV's span, within what the span moves in one stretch (its
        steps read it as at the first: 0.4 % over 400 tokens at a price five times the testbed's)."""
        costs = dataclasses.replace(COSTS, per_slot_ms=3.0, decode_per_kctx_ms=0.5,
                                    decode_per_kv_ms=per_kv)
        times = []
        for step in (False, True):
            server = ServerModel(dataclasses.replace(SETTINGS, kv_unified=True), costs)
            a, b = task("a", seq(1, 3000), 400), task("b", seq(2, 500), 250)
            run(server, [(0.0, a), (0.5, b)], step=step)
            times.append((a.tokens, b.tokens))
        rel = 0.005 if per_kv else 1e-6
        assert times[0][0] == pytest.approx(times[1][0], rel=rel)
        assert times[0][1] == pytest.approx(times[1][1], rel=rel)


class TestRule10KeptKv:
    def test_a_restore_takes_the_main_loop_and_leaves_its_tokens_in_an_idle_slot(self) -> None:
        server = model()
        stream = task("stream", seq(1, 100), 60)
        kept = seq(7, 2000)
        out = run(server, [(0.0, stream)], loops=[(0.5, LoopWork("r", 400.0, Held(kept, 2000)))])
        (done,) = of(out, LoopDone, "r")
        assert isinstance(done, LoopDone) and done.slot is not None
        assert server.slots[done.slot].held.common(kept) == 2000
        assert 0.5 + 0.4 <= done.t <= 0.5 + 0.02 + 0.4 + 1e-9  # after the step in flight
        gaps = [b - a for a, b in zip(stream.tokens, stream.tokens[1:], strict=False)]
        assert max(gaps) >= 0.4  # every slot waited for the restore
        back = task("back", seq(8, 50, kept))
        run(server, [(5.0, back)])
        assert back.cache_n == 2000  # found in the slot it was restored into

    def test_an_empty_slot_is_taken_before_one_that_holds_a_conversation(self) -> None:
        server = model()
        run(server, [(0.0, task("a", seq(1, 300), 2))])
        out = run(server, [], loops=[(5.0, LoopWork("r", 100.0, Held(seq(7, 1000), 1000)))])
        (done,) = of(out, LoopDone, "r")
        assert isinstance(done, LoopDone)
        assert server.slots[done.slot or 0].held.n == 1000
        assert any(s.held.seq.segs[0][0] == 1 for s in server.slots)  # "a" kept its slot

    def test_of_two_held_conversations_the_smaller_is_displaced(self) -> None:
        """As the keep store chooses (its rule 7): the conversation saved first is the cheaper."""
        server = model()  # two slots
        run(server, [(0.0, task("big", seq(1, 900), 2)), (0.0, task("small", seq(2, 300), 2))])
        small = seq(2, 300)
        run(server, [(3.0, task("small2", seq(3, 20, small), 2))])  # the small one is newer now
        chosen = server.table.restore_slot()
        assert chosen is not None and chosen.held.common(small) == 300  # not the older big one

    def test_restores_queued_at_once_are_chosen_two_slots_and_land_there_after_their_saves(
            self) -> None:
        """The keep store chooses a restore's slot when it decides it (`into`, never one another
        restore was chosen for) and saves the conversation there first (`before_ms`)."""
        server = model()
        run(server, [(0.0, task("a", seq(1, 300), 2))])
        first = server.table.restore_slot(taken=server.restoring_into())
        assert first is not None and first.held.n == 0  # an empty one
        server.run_on_loop(LoopWork("r1", 100.0, Held(seq(7, 1000), 1000), first.id, 50.0), 5.0)
        second = server.table.restore_slot(taken=server.restoring_into())
        assert second is not None and second.id != first.id
        server.run_on_loop(LoopWork("r2", 100.0, Held(seq(8, 900), 900), second.id), 5.0)
        out = run(server, [])
        done = {d.work.key: d for d in out if isinstance(d, LoopDone)}
        assert (done["r1"].slot, done["r2"].slot) == (first.id, second.id)
        assert done["r1"].t == pytest.approx(5.15, abs=1e-6)  # its save's 50 ms, then 100 ms
        assert server.slots[first.id].held.n == 1000 and server.slots[second.id].held.n == 900

    def test_with_no_idle_slot_a_restore_does_nothing(self) -> None:
        server = model(parallel=1)
        long = task("long", seq(1, 100), 200)
        out = run(server, [(0.0, long)], loops=[(0.5, LoopWork("r", 100.0, Held(seq(7, 900), 900)))])
        (done,) = of(out, LoopDone, "r")
        assert isinstance(done, LoopDone) and done.slot is None
        assert server.slots[0].held.seq.segs[0][0] == 1

    def test_a_save_takes_its_time_and_changes_no_slot(self) -> None:
        server = model()
        stream = task("stream", seq(1, 100), 40)
        out = run(server, [(0.0, stream)], loops=[(0.3, LoopWork("save", 700.0))])
        (done,) = of(out, LoopDone, "save")
        assert isinstance(done, LoopDone) and done.slot is None
        gaps = [b - a for a, b in zip(stream.tokens, stream.tokens[1:], strict=False)]
        assert 0.7 <= max(gaps) < 0.8
