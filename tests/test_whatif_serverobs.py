"""What the what-if reads from llama-server's own log to price its batches (proxy/whatif/serverobs.py):
decode steps between generation-progress lines, each task's prompt time, the slots used before the
log's first request. Hand-written log lines in llama-server's format, times in plain seconds.
"""

from __future__ import annotations

import pytest

from proxy.report.serverlog import parse_server_log
from proxy.report.tasks import Task, rebuild_tasks
from proxy.whatif.serverobs import decode_obs, task_prefill_obs, used_before
from proxy.whatif.settings import ServerSettings
from proxy.whatif.slotted import recorded_slots

SERVER = ServerSettings(n_batch=2048, n_ubatch=512, parallel=4, kv_unified=True, ctx=0,
                        cache_ram=0, cache_idle_slots=False)


def stamp(t: float) -> str:
    minutes, rest = divmod(t, 60.0)
    ms = round(rest * 1_000_000)
    return f"{int(minutes)}.{ms // 1_000_000:02d}.{ms // 1000 % 1000:03d}.{ms % 1000:03d}"


def slot(t: float, sid: int, task: int, func: str, text: str) -> str:
    return f"{stamp(t)} I slot {func:>12}: id {sid:2d} | task {task} | {text}"


def task_lines(sid: int, task: int, launch: float, prompt: int, prompt_ms: float, cache: int,
               gen: int, eval_ms: float, tg_every: float = 0.0) -> list[str]:
    """A task launched at `launch`, its prompt right away, then `gen` tokens at an even pace; a
    generation-progress line every `tg_every` seconds from token 100."""
    first = launch + prompt_ms / 1000.0
    end = first + eval_ms / 1000.0
    lines = [slot(launch, sid, task, "launch_slot_", "processing task, is_child = 0")]
    if tg_every:
        step = eval_ms / 1000.0 / gen
        t = first + 100 * step
        while t < end - tg_every / 2:
            n = round((t - first) / step)
            lines.append(slot(t, sid, task, "print_timing",
                              f"n_gen = {n:6d}, tg = {1 / step:6.2f} t/s, tg_3s = {1 / step:6.2f} t/s"))
            t += tg_every
    lines += [
        slot(end, sid, task, "print_timing", f"prompt eval time = {prompt_ms:10.2f} ms / {prompt:5d} "
             "tokens (    1.00 ms per token,  1000.00 tokens per second)"),
        slot(end, sid, task, "print_timing", f"       eval time = {eval_ms:10.2f} ms / {gen:5d} "
             "tokens (    1.00 ms per token,  1000.00 tokens per second)"),
        slot(end, sid, task, "print_timing", f"      total time = {prompt_ms + eval_ms:10.2f} ms / "
             f"{prompt + gen:5d} tokens"),
        slot(end, sid, task, "     release",
             f"stop processing: n_tokens = {cache + prompt + gen - 1}, truncated = 0"),
    ]
    return lines


def tasks_of(*groups: list[str]) -> list[Task]:
    lines = sorted((line for group in groups for line in group),
                   key=lambda s: tuple(int(x) for x in s.split(" ", 1)[0].split(".")))
    return rebuild_tasks(parse_server_log(lines).events)


class TestDecodeSteps:
    def test_a_window_of_decode_steps_gives_their_time_and_the_cells_attended(self) -> None:
        alone = task_lines(0, 1, 0.0, 2000, 2000.0, 0, 400, 40_000.0, tg_every=3.0)
        obs = decode_obs(tasks_of(alone))
        assert obs, "no window found"
        assert all(o.step_ms == pytest.approx(100.0, rel=0.02) for o in obs)
        assert all(o.slots == 1 for o in obs)
        assert all(2.0 < o.kctx < 2.4 for o in obs)  # its prompt and what it generated so far

    def test_a_prompt_starved_of_batches_counts_only_where_it_was_computed(self) -> None:
        """A request with other LoRA settings waits in its slot until the others are done (its
        `prompt eval time` is the whole wait: `cho-0`, 573 tokens in 264 s with `-b 512`): taken
        as computing all that time, it kept every decode window out of the calibration (two left
        of a day); its tokens are taken to have been computed at the log's median rate, just
        before its first token."""
        long = task_lines(0, 1, 0.0, 2000, 2000.0, 0, 400, 40_000.0, tg_every=3.0)
        starved = task_lines(1, 2, 1.0, 500, 41_500.0, 0, 20, 400.0)
        clean = decode_obs(tasks_of(long))
        assert len(decode_obs(tasks_of(long, starved))) == len(clean)

    def test_a_window_with_a_prompt_computed_in_it_is_left_out(self) -> None:
        long = task_lines(0, 1, 0.0, 2000, 2000.0, 0, 400, 40_000.0, tg_every=3.0)
        other = task_lines(1, 2, 20.0, 3000, 6000.0, 0, 20, 4000.0)
        obs = decode_obs(tasks_of(long, other))
        clean = decode_obs(tasks_of(long))
        assert 0 < len(obs) < len(clean)


    def test_shared_a_slot_that_starts_generating_in_a_window_counts_for_its_share_of_it(
            self) -> None:
        """A compressed day's replies of a few hundred tokens start and stop inside nearly every
        window (`bench day` on `-np 4 -kvu`: one or two windows of a day were left). `shared`: a
        stream that generated for part of a window counts for that part, every reply's stretch
        from its first token to its first progress line and from its last to its end is a window
        too, and the steps' time is the same."""
        long = task_lines(0, 1, 0.0, 2000, 2000.0, 0, 400, 40_000.0, tg_every=3.0)
        short = task_lines(1, 2, 20.0, 20, 20.0, 3000, 40, 1_600.0)  # generates 20.02-21.62
        clean = decode_obs(tasks_of(long, short))
        obs = decode_obs(tasks_of(long, short), shared=True)
        assert len(obs) == len(clean) + 2 + 1 + 2  # long's first and last; short's; 2 shared
        assert all(o.step_ms == pytest.approx(100.0, rel=0.05) for o in obs if o.slots == 1.0)
        shared = [o for o in obs if 1.0 < o.slots < 2.0]
        assert len(shared) == 2, "its windows were left out"
        assert sum(o.slots - 1.0 for o in shared) == pytest.approx(1.6 / 3.0, rel=0.05)
        assert any(o.slots == pytest.approx(2.0) and o.steps == 39 for o in obs)  # its own reply

    def test_a_piece_computed_in_a_window_is_taken_out_of_it(self) -> None:
        """A day fed in pieces has few windows with none in them: a 64-token piece of 500 ms in a
        window leaves the window's time less its 500 ms over its steps less the one its batch
        carried; pieces over half the window leave none."""
        stream = task_lines(0, 1, 0.0, 2000, 2000.0, 0, 400, 40_000.0, tg_every=3.0)
        clean = decode_obs(tasks_of(stream), SERVER)
        piece = task_lines(1, 2, 20.0, 64, 500.0, 3000, 1, 1.0)
        obs = decode_obs(tasks_of(stream, piece), SERVER)
        assert len(obs) == len(clean)
        (window,) = [o for o, c in zip(obs, clean, strict=True)
                     if (o.steps, o.step_ms) != (c.steps, c.step_ms)]
        steps = window.steps + 1
        assert window.step_ms == pytest.approx((steps * 100.0 - 500.0) / (steps - 1), rel=0.01)
        big = task_lines(1, 2, 21.0, 2000, 2000.0, 3000, 1, 1.0)  # two thirds of one window
        assert len(decode_obs(tasks_of(stream, big), SERVER)) == len(clean) - 1

    @pytest.mark.parametrize("emptied", [False, True])
    def test_a_window_on_one_shared_kv_gives_the_cells_its_span_holds_beyond_its_own(
            self, emptied: bool) -> None:
        """A 10,000-token prompt ended in slot 0, then a stream in slot 1: slot 0 keeps its
        cells, and each of the stream's steps reads them; with a RAM cache and
        `cache_idle_slots` the stream's launch empties slot 0 first."""
        long = task_lines(0, 1, 0.0, 10_000, 10_000.0, 0, 1, 10.0)
        stream = task_lines(1, 2, 11.0, 200, 200.0, 0, 400, 40_000.0, tg_every=3.0)
        server = SERVER if not emptied else ServerSettings(
            n_batch=2048, n_ubatch=512, parallel=4, kv_unified=True, cache_ram=8192)
        obs = decode_obs(tasks_of(long, stream), server)
        assert obs, "no window found"
        for o in obs:
            span = 256 * -(-(10_001 + o.kctx * 1000) // 256) if not emptied \
                else 256 * -(-(o.kctx * 1000) // 256)
            assert o.scanned == pytest.approx((span - o.kctx * 1000) / 1000, abs=0.02)
        assert decode_obs(tasks_of(long, stream))[0].scanned == 0.0  # without the settings


class TestPromptTimes:
    def test_a_short_prompt_beside_a_generating_slot_counts_with_that_slot(self) -> None:
        long = task_lines(0, 1, 0.0, 2000, 2000.0, 0, 400, 40_000.0)
        short = task_lines(1, 2, 10.0, 50, 800.0, 3000, 20, 2000.0)
        obs = task_prefill_obs(tasks_of(long, short), SERVER)
        found = [o for o in obs if o.tokens == 50]
        assert len(found) == 1
        assert (found[0].ctx, found[0].ms, found[0].decoders) == (3000, 800.0, 1.0)
        assert found[0].dec_kctx == pytest.approx(2.08, abs=0.01)  # 2,000 + 80 generated by 10 s

    def test_two_prompts_computed_together_are_left_out(self) -> None:
        a = task_lines(0, 1, 0.0, 2000, 4000.0, 0, 20, 2000.0)
        b = task_lines(1, 2, 1.0, 2000, 4000.0, 0, 20, 2000.0)
        assert task_prefill_obs(tasks_of(a, b), SERVER) == []


class TestUsedBefore:
    def test_a_probe_before_the_first_request_marks_its_slot_as_used(self) -> None:
        probe = task_lines(3, 0, 1.0, 18, 30.0, 0, 4, 30.0)
        first = task_lines(2, 5, 4.0, 1998, 4000.0, 0, 265, 50_000.0)
        records = [{"id": "a-0", "_t0": 0.0, "kind": "chat",
                    "timings": {"prompt_n": 1998, "predicted_n": 265}}]
        assert used_before(tasks_of(probe, first), records) == [3]

    def test_no_request_found_in_the_server_log_says_nothing(self) -> None:
        probe = task_lines(3, 0, 1.0, 18, 30.0, 0, 4, 30.0)
        records = [{"id": "a-0", "_t0": 0.0, "kind": "chat",
                    "timings": {"prompt_n": 7, "predicted_n": 7}}]
        assert used_before(tasks_of(probe), records) == []


class TestRecordedSlots:
    def test_each_request_is_found_in_the_slot_of_its_task_by_its_sizes(self) -> None:
        tasks = tasks_of(task_lines(2, 5, 4.0, 1998, 4000.0, 0, 265, 5000.0),
                         task_lines(0, 6, 5.0, 500, 800.0, 0, 100, 3000.0))
        records = [{"id": "a-0", "_t0": 100.0, "timings": {"prompt_n": 1998, "predicted_n": 265}},
                   {"id": "b-0", "_t0": 101.0, "timings": {"prompt_n": 500, "predicted_n": 100}},
                   {"id": "c-0", "_t0": 102.0, "timings": {"prompt_n": 7, "predicted_n": 7}},
                   {"id": "d-0", "_t0": 103.0, "outcome": "client_gone"}]
        assert recorded_slots(tasks, records) == {"a-0": 2, "b-0": 0}

    def test_of_two_tasks_of_one_size_the_one_launched_nearest_its_arrival(self) -> None:
        tasks = tasks_of(task_lines(1, 5, 4.0, 1998, 1000.0, 0, 265, 5000.0),
                         task_lines(3, 9, 40.0, 300, 500.0, 0, 50, 1000.0),
                         task_lines(2, 12, 60.0, 300, 500.0, 0, 50, 1000.0))
        records = [{"id": "a-0", "_t0": 100.0, "timings": {"prompt_n": 1998, "predicted_n": 265}},
                   {"id": "late", "_t0": 156.0, "timings": {"prompt_n": 300, "predicted_n": 50}},
                   {"id": "early", "_t0": 136.0, "timings": {"prompt_n": 300, "predicted_n": 50}}]
        assert recorded_slots(tasks, records) == {"a-0": 1, "early": 3, "late": 2}
