"""What slotwise learned of its llama-server, kept across its restarts (prefill/learned.py, pure; and
the file's reading and writing, prefill/learned_file.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.config import PrefillConfig
from proxy.estimate.replies import ReplyReuse
from proxy.prefill.events import Admit, FeedPiece
from proxy.prefill.layout import ServerLayout
from proxy.prefill.learned import Learned, LearnedError, ServerKey, dump, parse
from proxy.prefill.learned_file import LearnedFile
from proxy.prefill.policy import PrefillPolicy

KEY = ServerKey(model="/m/small.gguf", build="b7000-abc", slots=4, slot_ctx=32768, n_batch=2048)


def taught() -> PrefillPolicy:
    """A policy that computed two long prompts and three short follow-ups (877 ms each, row by
    row) on a CPU-like server."""
    p = PrefillPolicy(PrefillConfig(mode="chunk"))
    for n, (new, cached, ms) in enumerate([(2000, 0, 2100.0), (1500, 2000, 1900.0),
                                           (54, 3000, 877.0), (54, 3000, 877.0),
                                           (54, 3000, 877.0)]):
        p.on_arrival(f"r{n}", new, new + cached, n * 10.0)
        p.on_prefill_started(f"r{n}", n * 10.0)
        p.on_finished(f"r{n}", n * 10.0 + 5.0, prompt_n=new, prompt_ms=ms, cache_n=cached)
    return p


def learned_of(p: PrefillPolicy, replies: ReplyReuse | None = None) -> Learned:
    batches, narrow = p.learned()
    return Learned(batches, narrow, (replies or ReplyReuse()).seen())


class TestKeptAcrossARestart:
    def test_a_restarted_policy_prices_and_trims_as_the_one_before_ended(self) -> None:
        before = taught()
        replies = ReplyReuse()
        for _ in range(3):
            replies.observe(250, 249)
        data = orjson.loads(orjson.dumps(dump(KEY, learned_of(before, replies))))
        learned, other = parse(data, KEY)
        assert other is None and learned is not None
        after, fresh = PrefillPolicy(PrefillConfig(mode="chunk")), PrefillPolicy(
            PrefillConfig(mode="chunk"))
        after.adopt_learned(learned.batches, learned.narrow)
        assert after.snapshot().cost.cost == before.snapshot().cost.cost
        assert after.snapshot().cost.source == "fitted"
        # the first short follow-up after the restart is trimmed; a fresh start learns first
        assert after.on_arrival("t", 54, 3154, 0.0) == [FeedPiece("t", 3090, trim=True)]
        assert fresh.on_arrival("t", 54, 3154, 0.0) == [Admit("t", "not cold")]
        kept = ReplyReuse()
        kept.adopt(learned.replies)
        assert kept.found_whole()

    def test_what_was_learned_on_another_server_is_not_taken_up(self) -> None:
        data = dump(KEY, learned_of(taught()))
        other = ServerKey(model="/m/big.gguf", build=KEY.build, slots=4, slot_ctx=32768,
                          n_batch=2048)
        assert parse(data, other) == (
            None, "another server (model was '/m/small.gguf', now '/m/big.gguf')")
        fewer = ServerKey(**{**data["server"], "slots": 5})
        assert parse(data, fewer)[1] == "another server (slots was 4, now 5)"

    def test_a_row_by_row_sample_below_the_tiled_price_is_read_back(self) -> None:
        """A short prompt that took less than the tiled price gives a negative sample (the price
        is the samples' median, floored at 0): slotwise wrote such files, then refused them at its
        next start and learned afresh (half of `bench day`'s slotwise days, 2026-12-06)."""
        policy = taught()
        batches, narrow = policy.learned()
        learned = Learned(batches, [-0.51, *narrow], [])
        back, _ = parse(dump(KEY, learned), KEY)
        assert back is not None and back.narrow == [-0.51, *narrow]
        assert back.batches == batches

    def test_the_key_waits_for_props(self) -> None:
        assert ServerKey.of(ServerLayout(slots=4, slot_ctx=8192), 2048) is None
        layout = ServerLayout(slots=4, slot_ctx=8192, model="/m/x.gguf", build=None)
        assert ServerKey.of(layout, 512) == ServerKey("/m/x.gguf", "", 4, 8192, 512)


class TestWhatIsNotAFileSlotwiseWrote:
    @pytest.mark.parametrize(("change", "message"), [
        ({"version": 2}, "version: expected 1, got 2"),
        ({"batch_cost": {}}, "batch_cost: expected a list, got dict"),
        ({"batch_cost": [[1, 2, 3]]}, r"batch_cost\[0\]: expected \[7 row terms, ms, scale\]"),
        ({"batch_cost": [[1, 0, 0, 0, 0, 0, 0, float("nan"), 1]]},
         r"batch_cost\[0\]\[7\]: expected a number, got nan"),
        ({"batch_cost": [[1, 0, 0, 0, 0, 0, 0, 0, 1]]},
         r"batch_cost\[0\]: expected a positive number, got 0"),
        ({"row_by_row_ms": [-1, "x"]}, r"row_by_row_ms\[1\]: expected a number, got 'x'"),
        ({"replies": [[1.5, True]]}, r"replies\[0\]: expected \[share found 0-1, found whole\]"),
        ({"replies": [[0.5, 1]]}, r"replies\[0\]: expected \[share found 0-1, found whole\]"),
        ({"row_by_row_ms": [1.0] * 2000}, "row_by_row_ms: 2000 entries, at most 1024"),
    ])
    def test_each_says_where_and_what(self, change: dict[str, Any], message: str) -> None:
        data = {**dump(KEY, learned_of(taught())), **change}
        with pytest.raises(LearnedError, match=message):
            parse(data, KEY)


class _Estimator:
    """What LearnedFile uses of the estimator: its layout, its cache model's replies."""

    def __init__(self) -> None:
        self.layout = ServerLayout(slots=4, slot_ctx=32768, model=KEY.model, build=KEY.build)
        self.cache = type("Cache", (), {"replies": ReplyReuse()})()

    async def slot_ctx(self, config: PrefillConfig) -> int | None:
        return self.layout.slot_ctx


async def started(path: Path, policy: PrefillPolicy) -> LearnedFile:
    """A LearnedFile that has read `path` (its loop then waits for the first save)."""
    file = LearnedFile(str(path), policy, _Estimator(), KEY.n_batch)  # type: ignore[arg-type]
    task = asyncio.create_task(file.run(PrefillConfig()))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if file.loaded:
            break
    task.cancel()
    assert file.loaded
    return file


class TestTheFile:
    async def test_written_for_its_user_only_and_read_back(self, tmp_path: Path) -> None:
        path = tmp_path / "learned.json"
        first = await started(path, taught())
        await first.save()
        assert path.stat().st_mode & 0o777 == 0o600
        assert orjson.loads(path.read_bytes())["server"]["model"] == KEY.model
        after = PrefillPolicy(PrefillConfig(mode="chunk"))
        await started(path, after)
        assert after.on_arrival("t", 54, 3154, 0.0) == [FeedPiece("t", 3090, trim=True)]
        assert [p.name for p in tmp_path.iterdir()] == ["learned.json"]  # no temporary left

    async def test_a_file_slotwise_did_not_write_is_never_written_over(
            self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        path = tmp_path / "settings.json"
        path.write_text('{"theme": "dark"}')
        with caplog.at_level(logging.WARNING, "slotwise.prefill"):
            file = await started(path, taught())
            await file.save()
        assert path.read_text() == '{"theme": "dark"}'
        assert "is not a file slotwise wrote: not read, and not written over" in caplog.text

    async def test_its_own_damaged_file_is_replaced(self, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
        path = tmp_path / "learned.json"
        path.write_bytes(orjson.dumps({**dump(KEY, learned_of(taught())), "row_by_row_ms": "x"}))
        with caplog.at_level(logging.WARNING, "slotwise.prefill"):
            file = await started(path, taught())  # what it learns from now on is written
        assert "not read (row_by_row_ms: expected a list, got str): learning afresh" in caplog.text
        await file.save()
        assert parse(orjson.loads(path.read_bytes()), KEY)[0] is not None
