"""The RAM prompt cache as the what-if reads it from llama-server's log (proxy/whatif/copies.py,
settings.py): the speed of the saves its slot switches show, and the cache's flags in the command line the
testbed writes at the log's head. Hand-written log lines in llama-server's format."""

from __future__ import annotations

import pytest

from proxy.whatif.copies import save_gb_s
from proxy.whatif.predict import Inputs, calibrate, read_server_log, settings_of
from proxy.whatif.settings import server_log_settings
from tests.test_whatif_serverobs import slot, stamp, task_lines, tasks_of

BYTES = 24_592.0  # the small testbed model's KV a token


def lru_task(sid: int, task: int, chosen: float, switch_ms: float, prompt: int,
             cache: int = 0) -> list[str]:
    """A task given slot `sid` by LRU at `chosen`, launched `switch_ms` later."""
    launch = chosen + switch_ms / 1000.0
    return [slot(chosen, sid, -1, "get_availabl", "selected slot by LRU, t_last = 1"),
            *task_lines(sid, task, launch, prompt, 100.0, cache, 10, 100.0)]


def day(*switches: tuple[int, float]) -> list[str]:
    """Slots 0-3 filled with prompts of the given sizes, then each switched to a new task by LRU
    after `ms` of copying."""
    lines: list[str] = []
    for sid, (held, _) in enumerate(switches):
        lines += lru_task(sid, sid + 1, sid * 2.0, 0.1, held - 10)
    for sid, (_, ms) in enumerate(switches):
        lines += lru_task(sid, sid + 10, 20.0 + sid * 2.0, ms, 300)
    return lines


class TestCopySpeed:
    def test_the_slot_switches_time_the_copies_of_what_the_slots_held(self) -> None:
        # 7,000 tokens of 24,592 bytes in 480 ms: 0.36 GB/s; 3,000 in 200: 0.37; 1,000 in 60: 0.41
        speed = save_gb_s(tasks_of(day((7000, 480.0), (3000, 200.0), (1000, 60.0))), BYTES)
        assert speed is not None
        gb_s, count = speed
        assert count == 3
        assert gb_s == pytest.approx(3000 * BYTES / 0.2 / 1e9, rel=0.01)

    def test_quick_switches_copied_nothing_and_too_few_leave_the_speed_unknown(self) -> None:
        # the cache held those prompts already, or the slots were empty: no copy to time
        tasks = tasks_of(day((7000, 480.0), (3000, 5.0), (1000, 2.0), (2000, 150.0)))
        assert save_gb_s(tasks, BYTES) is None

    def test_a_switch_that_also_restored_a_cached_prompt_is_not_one_copy(self) -> None:
        lines = day((7000, 480.0), (3000, 200.0), (1000, 60.0))
        # slot 0 switched again, to a task that found 2,500 of its 2,600 tokens cached: two copies
        lines += [slot(40.0, 0, -1, "get_availabl", "selected slot by LRU, t_last = 1"),
                  *task_lines(0, 30, 40.9, 100, 100.0, 2500, 10, 100.0)]
        speed = save_gb_s(tasks_of(lines), BYTES)
        assert speed is not None and speed[1] == 3

    def test_the_calibration_takes_the_speed_from_the_log_and_says_so(self) -> None:
        log = day((7000, 480.0), (3000, 200.0), (1000, 60.0))
        inputs = Inputs(records=[], server_log=log, model_kv_bytes=BYTES)
        recorded, _, _ = settings_of(inputs)
        tasks, _ = read_server_log(inputs)
        cal = calibrate(inputs, recorded.server, tasks)
        assert cal.costs.save_gb_s == pytest.approx(0.369, rel=0.01)
        assert cal.costs.origin("save_gb_s") == "log"
        assert cal.costs.origin("copy_gb_s") == "assumed"  # back into a slot: not timed here
        assert any("saved to the RAM cache at 0.37 GB/s, the median of 3 slot switches" in n
                   for n in cal.notes)


class TestCommandLine:
    def test_the_testbeds_command_line_says_the_ram_caches_flags(self) -> None:
        head = ("# slotwise: /x/llama-server --host 127.0.0.1 -m /m.gguf -t 2 -np 5 "
                "--no-cache-idle-slots -cram 4096 -sps 0.5 -c 46080")
        start = (f"{stamp(0.7)} I srv    load_model: initializing, n_slots = 5, n_ctx_slot = 9216, "
                 "kv_unified = 'false'")
        found = server_log_settings([head, start])
        assert found == {"cache_idle_slots": False, "cache_ram": 4096,
                         "slot_prompt_similarity": 0.5, "parallel": 5, "kv_unified": False,
                         "ctx": 46080}

    def test_a_log_without_it_leaves_them_to_recorded_or_the_defaults(self) -> None:
        start = (f"{stamp(0.7)} I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 8192, "
                 "kv_unified = 'true'")
        assert server_log_settings([start]) == {"parallel": 4, "kv_unified": True, "ctx": 8192}
