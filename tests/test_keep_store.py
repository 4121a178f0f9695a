"""The keep store, rule by rule: each test class is one numbered rule of `KeepStore`.

Hand-made conversations (token ids are plain numbers, hashed into chains as slotwise does), slots as
`/slots` would show them, and a wall clock of plain numbers; no server, no files, no event loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from unittest.mock import ANY

from proxy.estimate import block_hashes
from proxy.keep.budget import over_budget
from proxy.keep.store import MAX_CONVERSATIONS, PLACE_WITHIN_S, KeepStore, names
from proxy.keep.values import (
    Delete,
    ForgetCache,
    KeepDecision,
    KeepFile,
    KeepKnobs,
    Quarantine,
    RestoreInto,
    SavedFile,
    SaveSlot,
    SlotState,
    Where,
    file_name,
    read_slots,
)

KNOBS = KeepKnobs(save_after_idle_s=100.0, max_bytes=10_000, max_files=5, max_age_s=1000.0,
              min_tokens=256)
MODEL = "/models/m.gguf"


def ids(n: int, seed: int = 1, start: int = 0) -> list[int]:
    """A prompt's ids: distinct per seed, `start` ids shared by every seed first."""
    return list(range(start)) + [seed * 100_000 + i for i in range(n - start)]


def chain(n: int, seed: int = 1, start: int = 0) -> tuple[int, ...]:
    return tuple(block_hashes(ids(n, seed, start)))


def slot(slot_id: int, tokens: int = 0, task: int | None = None, busy: bool = False) -> SlotState:
    return SlotState(id=slot_id, busy=busy, tokens=tokens, task=task)


def store(knobs: KeepKnobs = KNOBS) -> KeepStore:
    s = KeepStore(knobs)
    s.set_model(MODEL)
    return s


def ended(s: KeepStore, n: int, seed: int = 1, *, generated: int = 10, at: float = 0.0,
          variant: str = "") -> str:
    """A request of `n` prompt tokens ended at `at`; the conversation's name."""
    s.on_request_ended(chain(n, seed), variant, n, generated, at)
    return file_name(chain(n, seed), variant)


def saved_file(n: int, seed: int = 1, *, size: int = 1000, at: float = 0.0, uses: int = 0,
               model: str = MODEL, variant: str = "") -> SavedFile:
    c = chain(n, seed)
    return SavedFile(name=file_name(c, variant), chain=c, variant=variant, model=model, tokens=n,
                     size=size, saved_at=at, last_used=at, uses=uses)


def with_files(*files: SavedFile, knobs: KeepKnobs = KNOBS) -> KeepStore:
    s = store(knobs)
    s.load(files, {f.name: f.size for f in files}, 0.0)
    return s


def saves(decisions: list[KeepDecision]) -> list[SaveSlot]:
    return [d for d in decisions if isinstance(d, SaveSlot)]


def save_one(s: KeepStore, n: int, seed: int = 1, *, slot_id: int = 0, task: int = 1,
             size: int = 1000, at: float = 0.0) -> list[KeepDecision]:
    """The whole path: a request ends, it is placed, saved when due, and the save succeeds."""
    ended(s, n, seed, at=at)
    s.on_slots([slot(slot_id, n + 9, task)], at + 0.1, quiet=True)
    [save] = saves(s.on_slots([slot(slot_id, n + 9, task)], at + 200, quiet=True))
    return s.on_saved(save, save.tokens, size, at + 200, digest="d" * 64)


class TestRule1Identity:
    def test_a_conversation_is_named_by_its_chain_and_lora_settings(self) -> None:
        s = store()
        a = ended(s, 1000)
        assert a == file_name(chain(1000), "") and a.startswith("slotwise-") and a.endswith(".kv")
        assert ended(s, 1000, variant='[{"id":0,"scale":1.0}]') != a
        assert ended(s, 1000, seed=2) != a

    def test_a_short_prompt_is_placed_but_never_saved(self) -> None:
        """Placed, so that a restore pushing it out of its slot is known (the cache model forgets
        it: bench day, a 972-token conversation under `min_tokens` that a restore displaced was
        still estimated cached, 242 new tokens where the server computed 958)."""
        s = store()
        name = ended(s, 200)
        s.on_slots([slot(0, 209, 1)], 0.1, quiet=True)
        assert s.in_slot(0) is not None and s.in_slot(0).name == name
        assert saves(s.on_slots([slot(0, 209, 1)], 500.0, quiet=True)) == []

    def test_the_same_prompt_again_replaces_its_entry(self) -> None:
        s = store()
        name = ended(s, 1000, at=1.0)
        ended(s, 1000, at=5.0)
        assert list(s.conversations) == [name] and s.conversations[name].ended == 5.0

    def test_chain_and_name_are_the_same_in_every_process(self) -> None:
        """The index outlives slotwise: a restarted process (another str hash seed) must find
        the same chains and names."""
        code = ("from proxy.estimate import block_hashes; from proxy.keep.values import file_name; "
                "c = tuple(block_hashes(list(range(1000)))); print(c[-1], file_name(c, '[1]'))")
        out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in "12"}
        assert len(out) == 1


class TestRule2Placement:
    def test_the_idle_slot_holding_prompt_and_generation_is_its_slot(self) -> None:
        s = store()
        name = ended(s, 1000, generated=10)
        s.on_slots([slot(0, 300, 4), slot(1, 1009, 7)], 1.0, quiet=False)
        conv = s.conversations[name]
        assert (conv.slot, conv.task, conv.slot_tokens) == (1, 7, 1009)
        assert s.where(conv) is Where.SLOT

    def test_among_several_the_newest_task(self) -> None:
        s = store()
        name = ended(s, 1000)
        s.on_slots([slot(0, 1005, 3), slot(1, 1005, 9)], 1.0, quiet=False)
        assert s.conversations[name].slot == 1

    def test_a_busy_slot_is_not_it_yet(self) -> None:
        s = store()
        name = ended(s, 1000)
        s.on_slots([slot(0, 1005, 3, busy=True)], 1.0, quiet=False)
        assert s.conversations[name].placing and s.conversations[name].slot is None
        s.on_slots([slot(0, 1005, 3)], 2.0, quiet=False)
        assert s.conversations[name].slot == 0

    def test_a_slot_that_changed_lost_it(self) -> None:
        s = store()
        name = ended(s, 1000)
        s.on_slots([slot(0, 1005, 3)], 1.0, quiet=False)
        s.on_slots([slot(0, 40, 8)], 2.0, quiet=False)
        assert s.conversations[name].slot is None
        assert s.where(s.conversations[name]) is Where.RAM

    def test_one_not_found_in_time_left_its_slot(self) -> None:
        s = store()
        name = ended(s, 1000)
        s.on_slots([slot(0, 5, 3)], PLACE_WITHIN_S + 1, quiet=False)
        s.on_slots([slot(0, 1005, 3)], PLACE_WITHIN_S + 2, quiet=False)
        assert s.conversations[name].slot is None and not s.conversations[name].placing

    def test_a_warm_up_prefix_is_in_the_slot_holding_its_tokens_until_that_slot_changes(
            self) -> None:
        s = store()
        s.on_warm_piece(chain(1024, seed=3), 1024, 1.0)
        s.on_warm_piece(chain(1408, seed=3), 1408, 1.2)  # its next piece, in the same slot
        s.on_slots([slot(0, 700, 2), slot(1, 1408, 6)], 1.5, quiet=False)
        assert {k: v.chain for k, v in s.warm_in.items()} == {1: chain(1408, seed=3)}
        assert s.conversations == {}  # no conversation: nothing of it is ever saved
        s.on_slots([slot(0, 700, 2), slot(1, 1408, 6)], 900.0, quiet=True)
        assert 1 in s.warm_in and s.saving is None
        s.on_slots([slot(0, 700, 2), slot(1, 1408, 7, busy=True)], 901.0, quiet=False)
        assert s.warm_in == {}  # its turn (or anything else) went there

    def test_a_warm_up_prefix_no_slot_shows_is_given_up(self) -> None:
        s = store()
        s.on_warm_piece(chain(1408, seed=3), 1408, 1.0)
        s.on_slots([slot(0, 700, 2)], 1.5, quiet=False)  # not read yet, or already gone
        s.on_slots([slot(0, 1408, 2)], PLACE_WITHIN_S + 2, quiet=False)
        assert s.warm_in == {}

    def test_read_slots_takes_what_the_server_answers(self) -> None:
        body = [{"id": 0, "is_processing": False},
                {"id": 1, "is_processing": True, "n_prompt_tokens": 12, "id_task": 4},
                {"id": 2, "id_task": 7, "params": {"lora": [{"id": 0, "scale": 1}]}},
                {"id": 3, "id_task": 8, "params": {"lora": []}}]
        assert read_slots(body) == [
            replace(slot(0), lora=None), replace(slot(1, 12, 4, busy=True), lora=None),
            replace(slot(2, 0, 7), lora=((0, 1.0),)), slot(3, 0, 8)]  # None: never had a task

    def test_read_slots_refuses_what_is_not_slots(self) -> None:
        for body in ({"id": 0}, [{"is_processing": False}]):
            try:
                read_slots(body)
            except ValueError as exc:
                assert "GET /slots" in str(exc)
            else:
                raise AssertionError(f"accepted {body!r}")


class TestRule3Restart:
    def test_a_task_that_went_back_means_a_restart(self) -> None:
        s = store()
        name = ended(s, 1000)
        s.on_slots([slot(0, 1005, 30)], 1.0, quiet=False)
        assert s.on_slots([slot(0, 0, None)], 2.0, quiet=False) == [ForgetCache()]
        assert name not in s.conversations

    def test_a_saved_conversation_is_kept_in_its_file(self) -> None:
        s = store()
        save_one(s, 1000, task=30)
        name = file_name(chain(1000), "")
        assert s.on_slots([slot(0, 12, 2)], 300.0, quiet=False) == [ForgetCache()]
        assert s.where(s.conversations[name]) is Where.FILE and name in s.files

    def test_a_request_that_ended_since_ran_on_the_restarted_server(self) -> None:
        """The first turn after a restart ends before slotwise's next read: it is placed."""
        s = store()
        old = ended(s, 1000)
        s.on_slots([slot(0, 1005, 30)], 1.0, quiet=False)
        new = ended(s, 800, seed=2, at=2.0)
        assert s.on_slots([slot(0, 805, 0)], 3.0, quiet=False) == [ForgetCache()]
        assert old not in s.conversations and s.conversations[new].slot == 0

    def test_tasks_that_only_grow_are_no_restart(self) -> None:
        s = store()
        s.on_slots([slot(0, 10, 3)], 1.0, quiet=False)
        assert s.on_slots([slot(0, 20, 8)], 2.0, quiet=False) == []


class TestRule4Save:
    def test_an_idle_conversation_in_its_idle_slot_is_saved(self) -> None:
        s = store()
        name = ended(s, 1000, at=0.0)
        s.on_slots([slot(0, 1005, 3)], 1.0, quiet=True)
        assert saves(s.on_slots([slot(0, 1005, 3)], 99.0, quiet=True)) == []
        assert saves(s.on_slots([slot(0, 1005, 3)], 100.0, quiet=True)) == [
            SaveSlot(slot=0, name=name, tokens=1005)]

    def test_a_busy_slot_is_never_saved(self) -> None:
        s = store()
        ended(s, 1000)
        s.on_slots([slot(0, 1005, 3)], 1.0, quiet=True)
        assert saves(s.on_slots([slot(0, 1005, 3, busy=True)], 500.0, quiet=True)) == []
        assert saves(s.on_slots([slot(0, 1005, 3)], 501.0, quiet=True)) == []  # it left

    def test_nothing_is_saved_while_requests_are_in_flight(self) -> None:
        s = store()
        ended(s, 1000)
        s.on_slots([slot(0, 1005, 3)], 1.0, quiet=True)
        assert saves(s.on_slots([slot(0, 1005, 3)], 500.0, quiet=False)) == []
        assert len(saves(s.on_slots([slot(0, 1005, 3)], 501.0, quiet=True))) == 1

    def test_one_save_at_a_time_the_longest_idle_first(self) -> None:
        s = store()
        older = ended(s, 1000, seed=1, at=0.0)
        ended(s, 2000, seed=2, at=10.0)
        s.on_slots([slot(0, 1005, 3), slot(1, 2005, 4)], 11.0, quiet=True)
        [first] = saves(s.on_slots([slot(0, 1005, 3), slot(1, 2005, 4)], 200.0, quiet=True))
        assert first.name == older
        assert saves(s.on_slots([slot(0, 1005, 3), slot(1, 2005, 4)], 201.0, quiet=True)) == []

    def test_a_failed_save_or_a_file_too_large_is_not_tried_again(self) -> None:
        s = store()
        ended(s, 1000)
        s.on_slots([slot(0, 1005, 3)], 1.0, quiet=True)
        [save] = saves(s.on_slots([slot(0, 1005, 3)], 200.0, quiet=True))
        s.on_save_failed(save)
        assert saves(s.on_slots([slot(0, 1005, 3)], 300.0, quiet=True)) == []
        s = store()
        save_one(s, 1000, size=20_000)  # deleted at once by the budget
        assert saves(s.on_slots([slot(0, 1009, 1)], 900.0, quiet=True)) == []

    def test_a_conversation_a_file_holds_is_not_saved_again(self) -> None:
        s = store()
        save_one(s, 1000)
        assert saves(s.on_slots([slot(0, 1009, 1)], 900.0, quiet=True)) == []


class TestRule5Saved:
    def test_a_save_that_proved_right_is_kept_under_its_name(self) -> None:
        s = store()
        name = ended(s, 1000)
        s.on_slots([slot(0, 1005, 3)], 1.0, quiet=True)
        [save] = saves(s.on_slots([slot(0, 1005, 3)], 200.0, quiet=True))
        assert s.on_saved(save, 1005, 4000, 201.0, digest="ab" * 32) == [KeepFile(name + ".part", name)]
        assert s.files[name].tokens == 1005 and s.files[name].model == MODEL
        assert s.files[name].digest == "ab" * 32 and s.files[name].size == 4000
        assert s.saving is None

    def test_a_slot_that_changed_during_the_save_deletes_it(self) -> None:
        s = store()
        ended(s, 1000)
        s.on_slots([slot(0, 1005, 3)], 1.0, quiet=True)
        [save] = saves(s.on_slots([slot(0, 1005, 3)], 200.0, quiet=True))
        [delete] = s.on_saved(save, 3000, 9000, 201.0, digest="")
        assert isinstance(delete, Delete) and delete.name == save.temp and s.files == {}

    def test_a_longer_prefix_supersedes_the_older_file(self) -> None:
        s = store()
        save_one(s, 1000, seed=1, task=1)
        old = file_name(chain(1000), "")
        s.on_request_ended(chain(1600), "", 1600, 5, 300.0)  # the next turn, same conversation
        s.on_slots([slot(0, 1604, 2)], 300.5, quiet=True)
        [save] = saves(s.on_slots([slot(0, 1604, 2)], 500.0, quiet=True))
        decisions = s.on_saved(save, 1604, 1500, 500.0, digest="")
        assert names(decisions) == [old] and list(s.files) == [save.name]

    def test_another_conversation_is_not_superseded(self) -> None:
        s = store()
        save_one(s, 1000, seed=1, task=1)
        decisions = save_one(s, 1000, seed=2, task=5, at=300.0)
        assert names(decisions) == [] and len(s.files) == 2


class TestRule6Budget:
    def test_least_recently_used_go_first_beyond_the_count(self) -> None:
        files = [saved_file(1000, seed=i, at=float(i)) for i in range(7)]
        deletes = over_budget(files, KNOBS, 10.0)
        assert [d.name for d in deletes] == [files[0].name, files[1].name]

    def test_beyond_the_size_and_fewer_restores_first_among_equals(self) -> None:
        files = [saved_file(1000, seed=1, size=6000, uses=3), saved_file(1000, seed=2, size=6000)]
        [delete] = over_budget(files, KNOBS, 10.0)
        assert delete.name == files[1].name and "max_disk_gb" in delete.reason

    def test_a_file_not_used_for_max_age_goes(self) -> None:
        young, old = saved_file(1000, seed=1, at=500.0), saved_file(1000, seed=2, at=0.0)
        assert [d.name for d in over_budget([young, old], KNOBS, 1200.0)] == [old.name]

    def test_a_restore_renews_a_file(self) -> None:
        s = with_files(saved_file(1000, seed=1, at=0.0), saved_file(1000, seed=2, at=10.0))
        restore = s.restore(chain(1100, seed=1), "", 1100, 0, [slot(0)])
        assert restore is not None
        s.on_restored(restore, 1000, None, 900.0)
        assert names(s.budget(1050.0)) == [saved_file(1000, seed=2).name]

    def test_a_file_larger_than_the_budget_goes_at_once(self) -> None:
        s = store()
        decisions = save_one(s, 1000, size=20_000)
        assert isinstance(decisions[0], KeepFile) and names(decisions) == [decisions[0].name]

    def test_a_file_being_restored_stays(self) -> None:
        files = [saved_file(1000, seed=i, at=float(i)) for i in range(6)]
        assert over_budget(files, KNOBS, 10.0, protected={files[0].name})[0].name == files[1].name


class TestRule7Restore:
    def test_a_prompt_a_file_holds_is_restored_into_an_empty_slot_first(self) -> None:
        f = saved_file(1024)
        s = with_files(f)
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0, 500, 9), slot(1, 0, 2)])
        assert restore == RestoreInto(slot=1, name=f.name, covered=1024)

    def test_then_a_slot_whose_conversation_is_saved_then_the_oldest_task(self) -> None:
        s = store()
        save_one(s, 1000, seed=2, slot_id=1, task=50)
        s.load([*s.files.values(), saved_file(1024)], {**{n: f.size for n, f in s.files.items()},
                                                        saved_file(1024).name: 1000}, 300.0)
        busy_free = [slot(0, 400, 7), slot(1, 1009, 50), slot(2, 300, 3)]
        assert s.restore(chain(1100), "", 1100, 0, busy_free) == RestoreInto(1, saved_file(1024).name, 1024)
        s = with_files(saved_file(1024))
        oldest = s.restore(chain(1100), "", 1100, 0, [slot(0, 400, 7), slot(2, 300, 3)])
        assert oldest is not None and oldest.slot == 2

    def test_of_unsaved_conversations_the_smallest_is_displaced_its_save_the_shortest_stall(
            self) -> None:
        """bench day: `eve`'s restore took the oldest task's slot, `dan`'s 6,877 tokens, saved
        first in 0.6-1.0 s while every stream waited; `cho`'s 1,532 in the other idle slot took
        0.18 s to save."""
        s = with_files(saved_file(1024))
        ended(s, 6870, seed=2)
        ended(s, 1525, seed=3)
        s.on_slots([slot(0, 6877, 3), slot(2, 1532, 9)], 1.0, quiet=False)
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0, 6877, 3), slot(2, 1532, 9)])
        assert restore is not None and restore.slot == 2 and restore.displaced == 1532

    def test_a_slot_no_known_conversation_explains_is_displaced_last(self) -> None:
        """A warm-up's prefix (the store knows none) is for a turn about to come: bench day,
        `eve`'s restore took the slot of `ann`'s warm-up, 1,856 tokens, and her turn computed
        2,472 tokens."""
        s = with_files(saved_file(1024))
        ended(s, 6870, seed=2)
        s.on_slots([slot(0, 6877, 3), slot(2, 1856, 9)], 1.0, quiet=False)
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0, 6877, 3), slot(2, 1856, 9)])
        assert restore is not None and restore.slot == 0

    def test_an_unsaved_conversation_it_would_displace_is_saved_first(self) -> None:
        s = with_files(saved_file(1024, seed=5))
        name = ended(s, 700, seed=2)
        s.on_slots([slot(0, 709, 4)], 1.0, quiet=False)  # placed in slot 0, not saved yet
        restore = s.restore(chain(1100, seed=5), "", 1100, 0, [slot(0, 709, 4)])
        assert restore is not None and restore.slot == 0 and restore.displaced == 709
        save = s.displaced_save(restore)
        assert save == SaveSlot(slot=0, name=name, tokens=709) and s.saving == save
        assert s.displaced_save(restore) is None  # one save at a time
        s.on_saved(save, 709, 500, 2.0, digest="d" * 64)
        assert name in s.files

    def test_a_conversation_being_saved_says_how_much_more_its_save_will_hold(self) -> None:
        s = with_files(saved_file(1024, seed=5), saved_file(768, seed=2))
        ended(s, 1300, seed=2)
        s.on_slots([slot(0, 1309, 4)], 1.0, quiet=False)
        restore = s.restore(chain(1100, seed=5), "", 1100, 0, [slot(0, 1309, 4)])
        assert restore is not None and s.displaced_save(restore) is not None
        assert s.saving_spares(chain(1360, seed=2), "", 1360) == 1280 - 768  # whole blocks
        assert s.saving_spares(chain(1360, seed=2), "other", 1360) == 0
        assert s.saving_spares(chain(1360, seed=7), "", 1360) == 0  # another conversation

    def test_once_it_is_saved_the_restore_displaces_nothing_and_frees_its_slot_after(self) -> None:
        """The restore goes on, displacing nothing now; restored, its slot is free for the next
        restore (it was not: bench day, a returning user waited 60 s for a slot, none found)."""
        s = with_files(saved_file(1024, seed=5), saved_file(1024, seed=6))
        ended(s, 700, seed=2)
        s.on_slots([slot(0, 709, 4)], 1.0, quiet=False)
        restore = s.restore(chain(1100, seed=5), "", 1100, 0, [slot(0, 709, 4)])
        assert restore is not None
        save = s.displaced_save(restore)
        assert save is not None
        s.on_saved(save, 709, 500, 2.0, digest="d" * 64)
        made = s.room_made(restore)
        assert made.displaced == 0 and s.restoring == {0: made}
        s.on_restored(made, 1030, 5, 3.0)
        assert s.restoring == {} and s.displaced_tokens == 0
        assert s.restore(chain(1100, seed=6), "", 1100, 0, [slot(0, 1030, 5)]) is not None

    def test_never_into_the_slot_a_request_in_flight_would_be_given(self) -> None:
        """bench day: `bob`'s trim piece went as `eve`'s restore chose his idle slot; llama-server
        gave the piece and then `bob`'s turn that slot by similarity, and ran the restore after
        his whole reply, 25.8 s later. A shared head of a tenth of a prompt or less does not
        count (llama-server's similarity threshold)."""
        def bobs_store(*idle: SlotState) -> KeepStore:
            s = with_files(saved_file(4096, seed=5))
            s.on_request_ended(chain(1900, seed=2, start=128), "", 1900, 10, 0.0)
            s.on_request_ended(chain(1100, seed=3, start=128), "", 1100, 10, 0.0)
            s.on_slots(idle, 1.0, quiet=False)
            return s

        both = [slot(1, 1909, 4), slot(2, 1109, 5)]
        bobs_turn = (chain(1960, seed=2, start=128), 1960)  # his conversation and a new message
        restore = bobs_store(*both).restore(chain(4130, seed=5), "", 4130, 0, both,
                                            others=[bobs_turn])
        assert restore is not None and restore.slot == 2
        alone = [slot(1, 1909, 4)]
        assert bobs_store(*alone).restore(chain(4130, seed=5), "", 4130, 0, alone,
                                          others=[bobs_turn]) is None  # it waits for a slot
        # another conversation sharing only the first 128 tokens with bob's: under 10 % of 1,960
        other = (chain(1960, seed=9, start=128), 1960)
        assert bobs_store(*alone).restore(chain(4130, seed=5), "", 4130, 0, alone,
                                          others=[other]) is not None

    def test_never_into_the_slot_of_a_warm_up_prefix_a_request_in_flight_continues(self) -> None:
        """bench day: `eve`'s restore took the one idle slot, where `ann`'s warm-up had just
        computed 1,400 tokens for the turn she sent 70 ms before; that turn computed 2,472 tokens
        (6.0 s to its first token). With no request continuing it, the slot is still taken,
        last (a slot no known conversation explains)."""
        s = with_files(saved_file(4096, seed=5))
        s.on_warm_piece(chain(1408, seed=3), 1408, 1.0)
        slots = [slot(0, 1408, 6), slot(1, 3000, 7, busy=True)]
        s.on_slots(slots, 1.1, quiet=False)
        anns_turn = (chain(2500, seed=3), 2500)
        assert s.restore(chain(4130, seed=5), "", 4130, 0, slots, others=[anns_turn]) is None
        restore = s.restore(chain(4130, seed=5), "", 4130, 0, slots)
        assert restore is not None and restore.slot == 0

    def test_nothing_to_save_first_in_an_empty_slot_or_under_min_tokens(self) -> None:
        s = with_files(saved_file(1024, seed=5))
        empty = s.restore(chain(1100, seed=5), "", 1100, 0, [slot(1, 0, 2)])
        assert empty is not None and s.displaced_save(empty) is None
        s = with_files(saved_file(1024, seed=5))
        ended(s, 100, seed=2)
        s.on_slots([slot(0, 109, 4)], 1.0, quiet=False)
        small = s.restore(chain(1100, seed=5), "", 1100, 0, [slot(0, 109, 4)])
        assert small is not None and small.displaced == 109 and s.displaced_save(small) is None

    def test_an_empty_slot_first_primed_if_need_be_and_of_equal_loss_one_that_keeps_the_kv(
            self) -> None:
        fixed = ((0, 1.0),)
        never = SlotState(id=0, busy=False, tokens=0, task=None, lora=None)
        other = SlotState(id=1, busy=False, tokens=0, task=3, lora=((0, 0.0),))
        empty_same = SlotState(id=2, busy=False, tokens=0, task=5, lora=fixed)
        s = with_files(saved_file(1024))
        first = s.restore(chain(1100), "", 1100, 0, [never, other, empty_same], fixed)
        assert first is not None and first.slot == 2 and not first.prime
        s = with_files(saved_file(1024))
        primed = s.restore(chain(1100), "", 1100, 0, [never, other], fixed)
        assert primed is not None and primed.slot == 0 and primed.prime
        s = with_files(saved_file(1024))  # a request that sends no lora keeps any slot's KV
        plain = s.restore(chain(1100), "", 1100, 0, [never], None)
        assert plain is not None and not plain.prime

    def test_a_never_used_slot_is_primed_rather_than_a_conversation_pushed_out(self) -> None:
        """bench day, `-np 5`: `dan`'s restore took the slot of `cho`'s 676 tokens, which keeps
        the request's KV, rather than prime a never-used slot; `cho`'s next turn computed 728
        tokens whole, every stream frozen 0.66 s. A prime is a one-token task."""
        fixed = ((0, 1.0),)
        s = with_files(saved_file(1024, seed=5))
        ended(s, 670, seed=2)
        chos = SlotState(id=2, busy=False, tokens=676, task=14, lora=fixed)
        s.on_slots([chos], 1.0, quiet=False)
        never = SlotState(id=0, busy=False, tokens=0, task=None, lora=None)
        restore = s.restore(chain(1100, seed=5), "", 1100, 0, [never, chos], fixed)
        assert restore is not None and restore.slot == 0 and restore.prime
        assert restore.displaced == 0
        # with no empty slot, the known conversation of fewest tokens goes, unprimed
        s = with_files(saved_file(1024, seed=5))
        ended(s, 670, seed=2)
        s.on_slots([chos], 1.0, quiet=False)
        unknown = SlotState(id=3, busy=False, tokens=300, task=9, lora=fixed)
        pushed = s.restore(chain(1100, seed=5), "", 1100, 0, [unknown, chos], fixed)
        assert pushed is not None and pushed.slot == 2 and not pushed.prime

    def test_what_it_displaces_is_counted_once_restored(self) -> None:
        """A saved conversation's slot displaces nothing (its file holds it); an unsaved one's
        tokens are lost: its next turn computes them again."""
        s = with_files(saved_file(1024))
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0, 400, 7), slot(2, 300, 3)])
        assert restore is not None and restore.displaced == 300 and s.displaced_tokens == 0
        s.on_restored(restore, 1024, 8, 10.0)
        assert s.displaced_tokens == 300
        empty = with_files(saved_file(1024)).restore(chain(1100), "", 1100, 0, [slot(1, 0, 2)])
        assert empty is not None and empty.displaced == 0

    def test_never_a_busy_slot_and_none_without_an_idle_one(self) -> None:
        s = with_files(saved_file(1024))
        assert s.restore(chain(1100), "", 1100, 0, [slot(0, 0, None, busy=True)]) is None

    def test_not_when_the_cache_holds_it_or_the_file_holds_little_of_it(self) -> None:
        s = with_files(saved_file(1024))
        assert s.candidate(chain(1100), "", 1100, cached=900) is None  # spares < min_tokens
        assert s.candidate(chain(3000), "", 3000, cached=0) is None  # < half of the prompt
        assert s.candidate(chain(1100, seed=2), "", 1100, cached=0) is None  # another conversation

    def test_not_under_other_lora_settings_or_another_model(self) -> None:
        s = with_files(saved_file(1024))
        assert s.candidate(chain(1100), '[{"id":0,"scale":1}]', 1100, 0) is None
        s = KeepStore(KNOBS)  # model not known yet
        s.load([saved_file(1024)], {saved_file(1024).name: 1000}, 0.0)
        assert s.candidate(chain(1100), "", 1100, 0) is None

    def test_two_restores_never_share_a_slot(self) -> None:
        s = with_files(saved_file(1024, seed=1), saved_file(1024, seed=2))
        first = s.restore(chain(1100, seed=1), "", 1100, 0, [slot(0), slot(1)])
        second = s.restore(chain(1100, seed=2), "", 1100, 0, [slot(0), slot(1)])
        assert first is not None and second is not None and first.slot != second.slot
        assert s.restore(chain(1100, seed=1), "", 1100, 0, [slot(0), slot(1)]) is None


class TestRule8Restored:
    def test_a_restore_puts_its_conversation_in_the_slot(self) -> None:
        f = saved_file(1024)
        s = with_files(f)
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0, 0, 4)])
        assert restore is not None
        s.on_restored(restore, 1030, 4, 50.0)
        conv = s.conversations[f.name]
        assert (conv.slot, conv.slot_tokens) == (0, 1030) and s.files[f.name].uses == 1
        assert s.restoring == {}

    def test_the_conversation_there_before_left_it(self) -> None:
        s = store()
        save_one(s, 1000, seed=2, slot_id=0, task=5)
        other = file_name(chain(1000, seed=2), "")
        s.load([*s.files.values(), saved_file(1024)],
               {**{n: f.size for n, f in s.files.items()}, saved_file(1024).name: 1000}, 300.0)
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0, 1009, 5)])
        assert restore is not None
        s.on_restored(restore, 1024, 5, 301.0)
        assert s.conversations[other].slot is None

    def test_a_refused_restore_deletes_the_file_another_error_keeps_it(self) -> None:
        f = saved_file(1024)
        s = with_files(f)
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0)])
        assert restore is not None
        assert s.on_restore_failed(restore, status=500) == [] and f.name in s.files
        assert s.restoring == {}
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0)])
        assert restore is not None
        assert names(s.on_restore_failed(restore, status=400)) == [f.name] and s.files == {}

    def test_a_restore_without_an_answer_from_a_server_gone_quarantines_the_file(self) -> None:
        f = saved_file(1024)
        s = with_files(f)
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0)])
        assert restore is not None
        assert s.on_restore_failed(restore, status=None) == []  # slow, the server still up
        assert f.name in s.files
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0)])
        assert restore is not None
        assert s.on_restore_failed(restore, status=None, server_gone=True) == [
            Quarantine(f.name, ANY)]
        assert s.files == {} and s.restoring == {}
        assert s.restore(chain(1100), "", 1100, 0, [slot(0)]) is None  # never tried again

    def test_a_restore_whose_caller_left_keeps_the_file_and_frees_the_slot(self) -> None:
        f = saved_file(1024)
        s = with_files(f)
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0)])
        assert restore is not None
        s.on_restore_abandoned(restore)
        assert f.name in s.files and s.restoring == {}

    def test_a_damaged_file_is_deleted_and_its_restore_not_asked(self) -> None:
        f = saved_file(1024)
        s = with_files(f)
        restore = s.restore(chain(1100), "", 1100, 0, [slot(0)])
        assert restore is not None
        assert names(s.on_damaged(f.name, "cut short")) == [f.name]
        assert s.files == {} and s.restoring == {}


class TestRule9Model:
    def test_files_of_another_model_are_deleted(self) -> None:
        s = KeepStore(KNOBS)
        mine, theirs = saved_file(1024, seed=1), saved_file(1024, seed=2, model="/other.gguf")
        s.load([mine, theirs], {mine.name: mine.size, theirs.name: theirs.size}, 0.0)
        assert names(s.set_model(MODEL)) == [theirs.name] and list(s.files) == [mine.name]


class TestRule10Start:
    def test_orphans_are_deleted_and_missing_files_forgotten(self) -> None:
        s = KeepStore(KNOBS)
        listed, missing = saved_file(1024, seed=1, size=777), saved_file(1024, seed=2)
        decisions = s.load([listed, missing], {listed.name: 777, "slotwise-abc.kv.part": 5}, 0.0)
        assert names(decisions) == ["slotwise-abc.kv.part"]
        assert list(s.files) == [listed.name] and s.files[listed.name].size == 777

    def test_a_file_whose_size_is_not_the_one_saved_is_deleted(self) -> None:
        s = KeepStore(KNOBS)
        whole, cut = saved_file(1024, seed=1, size=5000), saved_file(1024, seed=2, size=5000)
        decisions = s.load([whole, cut], {whole.name: 5000, cut.name: 4096}, 0.0)
        assert names(decisions) == [cut.name] and list(s.files) == [whole.name]
        assert "4096 bytes on disk, 5000 saved" in decisions[0].reason  # type: ignore[union-attr]

    def test_the_budget_runs_at_start(self) -> None:
        files = [saved_file(1024, seed=i, at=float(i)) for i in range(7)]
        s = KeepStore(KNOBS)
        assert len(names(s.load(files, {f.name: f.size for f in files}, 10.0))) == 2

    def test_conversations_remembered_are_bounded(self) -> None:
        s = store()
        for i in range(MAX_CONVERSATIONS + 3):
            ended(s, 300, seed=i + 1, at=float(i))
        assert len(s.conversations) == MAX_CONVERSATIONS
