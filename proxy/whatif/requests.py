"""What each logged request asks of the server, read from its timing record: when it arrived, its
prompt (as segments: which earlier request's prompt and reply it starts with, and how much of
them), the tokens it generated, its stream, its LoRA settings, and when its client gave up.

Which earlier sequence a prompt extends is inferred from what it found cached (`cache_n`, less
what slotwise's own warm-ups, restores and pieces put there): the newest earlier request of the
same client whose prompt and reply are at least that long, else any earlier one, else a sequence
from before the log began. A client's prompt that found less than its previous prompt after a
pause of `return_gap_s` or more is taken to extend that prompt and reply whole: the history was
the same, the server had lost it (a first turn of the day). A prompt part of which a kept file
restored (keep_kv) extends the client's newest earlier request that long, the one whose
conversation was saved; with none, the restored part was saved before the log (kept.py). A warm-up
that restored a file (the warm-up queue's rule 10) restored it for its turn: its client's first
request after it that found most of the file's tokens cached (one credited with the warm-up's work
and not finding them ends the search). The turn counts them as restored, and may restore the file
itself (with warm-ups off in the what-if: `Workload.file_of`). Pure.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.estimate.replies import held_reply
from proxy.keep.store import MOST
from proxy.record.kind import Kind
from proxy.report.records import (
    COMPLETION_KINDS,
    RecordLine,
    fed_tokens,
    num,
    prompt_split,
    start_of,
    timing,
)
from proxy.whatif.costs import Costs
from proxy.whatif.kept import KeptFile, LoggedSave, kept_files, logged_saves
from proxy.whatif.prompts import SegmentIds, Seq, lcp

RETURN_GAP_S = 600.0
"""A client away this long whose prompt missed the cache is taken to have come back to the same
history (the cache had lost it), not to have rewritten it."""
OWN_KINDS = frozenset({Kind.WARM, Kind.KV_SAVE, Kind.KV_RESTORE})
"""Records of slotwise's own work: the what-if makes its own (or none), never copies these."""
REPLAYED = frozenset({"done", "client_gone", "rejected", "shutdown"})
"""Outcomes of model requests the what-if replays; any other is copied as it was."""
SEARCH_BACK = 256
"""How many earlier requests of other clients a prompt's cached prefix is looked for in."""
MAX_OVERHEAD_S = 2.0
CUT_SLACK_S = 1.0
"""A client that left this close to the log's last moment was cut by the log's end."""


@dataclass(frozen=True)
class Job:
    """One logged request, as the server model runs it."""

    id: str
    record: RecordLine
    arrival: float
    """Epoch seconds."""
    prompt: Seq
    out: Seq
    """The prompt and the reply, as the slot holds it afterwards."""
    generated: int
    events: int
    """Token events its stream showed (0 for a non-streamed request)."""
    stream: bool
    client: str | None
    lora_in: Any
    patience_s: float | None
    """A client that left: how long after arrival it did; None: it waited for the end."""
    overhead_s: float
    """slotwise's own time before sending it (reading, estimating), as recorded."""
    shared: int
    """Prompt tokens inferred to be shared with an earlier sequence."""
    recorded_cache: int
    """What the server found cached in the recording, slotwise's own help left out."""
    starved: bool = False
    """Its client left without a first token and without sizes: it waited (in the queue or in a
    slot whose batches it never entered) the whole time, and its size is unknown, so the replay
    keeps its place and never computes it."""
    cut_at: float | None = None
    """Epoch seconds: its client was still waiting when the log ended (the recording stopped, not
    the client); in the replay it leaves then, whatever it waited, and a reply over by then is
    whole."""
    after: str | None = None
    """The client's previous request, when this one was sent after that one ended (a user reads
    the reply, then types): the replay sends it `think_s` after that request's end there."""
    think_s: float = 0.0
    kept: int = 0
    """The prompt's first tokens a kept file held when it arrived (keep_kv: what the log shows it
    restored, with what the server had already); 0: no file."""
    reply: tuple[int, int] = (0, 0)
    """The client's previous reply as this prompt repeats it: the tokens slotwise's estimate counts
    as cached (all the prompt has room for) and those the recorded server found (`_repeated`)."""

    @property
    def prompt_tokens(self) -> int:
        return self.prompt.length


@dataclass
class Workload:
    jobs: list[Job] = field(default_factory=list)
    copied: list[RecordLine] = field(default_factory=list)
    """Records the what-if does not model, written out as they were."""
    dropped: int = 0
    """Records of slotwise's own work (warm-ups, saves, restores) left out as records (kept.py
    reads the saves and restores, warmjobs.py the warm-ups)."""
    warm_records: list[RecordLine] = field(default_factory=list)
    """Of them, the warm-ups'."""
    before_log: list[Seq] = field(default_factory=list)
    """Sequences some prompt found cached that no earlier request in the log explains."""
    returns: int = 0
    used_before: list[int] = field(default_factory=list)
    """Slots the server's log shows used before the first request, oldest first."""
    slots: dict[str, int] = field(default_factory=dict)
    """The slot the server's log shows each request ran in, by its id (slotted.py): where the
    model would take the least recently used slot, it takes that one if idle. Empty when the
    what-if has another number of slots or other slotwise settings (other tasks: pieces,
    restores, holds)."""
    guessed: list[str] = field(default_factory=list)
    """Requests whose client left before the server said their prompt's size: replayed with the
    log's median prompt (they held a slot or a place in the queue all the same); those with no
    first token either are `starved`."""
    files: dict[str, KeptFile] = field(default_factory=dict)
    """The kept file each request (or warm-up) the log shows restored had, by its id (kept.py)."""
    restored_by_warm_up: dict[str, str] = field(default_factory=dict)
    """Warm-up id → the id of its turn, for warm-ups the log shows restored a file whose turn
    found most of it cached."""
    saves: list[LoggedSave] = field(default_factory=list)
    """The saves of kept KV the log shows."""

    def file_of(self, request_id: str) -> KeptFile | None:
        """The kept file a request or warm-up may restore: its own in the log, or, for a warm-up's
        turn, the warm-up's."""
        if request_id in self.files:
            return self.files[request_id]
        warm = next((w for w, turn in self.restored_by_warm_up.items() if turn == request_id), None)
        return self.files.get(warm) if warm is not None else None


def build_workload(records: Iterable[RecordLine], return_gap_s: float = RETURN_GAP_S,
                   rewritten: Collection[str] = (),
                   sizes: Mapping[str, tuple[int, int]] | None = None,
                   kv_bytes_per_token: float = Costs.kv_bytes_per_token) -> Workload:
    """`rewritten`: ids of requests known not to have come back to their history (a replay of
    the recorded settings found it cached where the recording did not); `sizes`: id → (prompt,
    cached) of requests whose client left before the server said them, as its log shows;
    `kv_bytes_per_token`: a kept file's size per token, where the log does not say it."""
    records = sorted(records, key=start_of)
    work = Workload(files=kept_files(records, kv_bytes_per_token), saves=logged_saves(records))
    typical = _typical_generated(records)
    usual_prompt = _typical_prompt(records)
    ids = SegmentIds()
    by_client: dict[str | None, list[Job]] = {}
    last: dict[str, RecordLine] = {}
    log_end = max((start_of(r) + (num(r, "total_ms") or 0.0) / 1000.0 for r in records),
                  default=0.0)
    restoring_warm: dict[str, RecordLine] = {}
    """By client: its latest warm-up that restored a file in the log, until its turn."""
    for record in records:
        kind = record.get("kind")
        if kind in OWN_KINDS:
            work.dropped += 1
            if kind == Kind.WARM:
                work.warm_records.append(record)
                if str(record.get("id")) in work.files and isinstance(record.get("client"), str):
                    restoring_warm[str(record.get("client"))] = record
            continue
        client = record.get("client")
        previous = last.get(client) if isinstance(client, str) else None
        if isinstance(client, str):
            last[client] = record
        shape = _shape(record, typical)
        known = (sizes or {}).get(str(record.get("id")))
        if shape is None and _left_unsized(record) and known is not None:
            events = int(num(record, "events") or 0)
            shape = _Shape(known[0], min(known[1], known[0] - 1), max(typical, events, 1))
        elif shape is None and _left_unsized(record):
            shape = _Shape(usual_prompt, 0, typical)
            work.guessed.append(str(record.get("id")))
        if kind not in COMPLETION_KINDS or record.get("outcome") not in REPLAYED or shape is None:
            work.copied.append(record)
            continue
        if isinstance(client, str) and (warm := restoring_warm.get(client)) is not None:
            found = _restored_by_warm_up(shape, warm, str(record.get("id")), work)
            if found is not shape or str(warm.get("id")) in (record.get("warm_ids") or ()):
                del restoring_warm[client]
            shape = found
        gap = math.inf if str(record.get("id")) in rewritten else return_gap_s
        job = _job(record, shape, work, by_client, ids, gap)
        if str(record.get("id")) in work.guessed and num(record, "ttft_ms") is None:
            job = dataclasses.replace(job, starved=True)
        if previous is not None:
            job = _reacting(job, previous, work.jobs, return_gap_s)
        if job.patience_s is not None and job.arrival + job.patience_s >= log_end - CUT_SLACK_S \
                and str(record.get("id")) not in work.guessed:
            job = dataclasses.replace(job, cut_at=log_end)
        work.jobs.append(job)
        if job.client is not None:
            by_client.setdefault(job.client, []).append(job)
    return work


@dataclass(frozen=True)
class _Shape:
    prompt: int
    cache: int
    generated: int
    restored: int = 0
    """Tokens a kept file spared it in the log (not in `cache`)."""


def _shape(record: RecordLine, typical: int) -> _Shape | None:
    """Prompt tokens, what was cached before slotwise helped, tokens generated; None if unknown."""
    computed, found = prompt_split(record)
    total = num(record, "prompt_tokens")
    if computed is None or found is None:
        est_total, est_new = num(record, "est_prompt_tokens"), num(record, "est_new_tokens")
        if est_total is None or est_new is None:
            return None
        total, cached = est_total, max(0.0, est_total - est_new)
    else:
        cached = float(found)
        total = float(computed + found) if total is None else total
    helped = fed_tokens(record) + int(num(record, "warmed_tokens") or 0) \
        + int(num(record, "restored_tokens") or 0)
    prompt = max(1, int(total))
    cache = min(prompt - 1, max(0, int(cached) - helped))
    generated = timing(record, "predicted_n")
    if generated is None or record.get("outcome") != "done":
        generated = max(float(typical), float(num(record, "events") or 0))
    restored = int(num(record, "restored_tokens") or 0)
    return _Shape(prompt, cache, max(1, int(generated)),
                  max(0, min(restored, prompt - 1 - cache)))


def _restored_by_warm_up(shape: _Shape, warm: RecordLine, rid: str, work: Workload) -> _Shape:
    """A request after its client's warm-up that restored a file: if it found most of the
    file's tokens cached, it is the warm-up's turn (`Workload.restored_by_warm_up`) and those are
    its restored ones (its prompt extends the saved conversation, not a sequence cached before the
    log); else `shape` itself."""
    covered = int(num(warm, "restored_tokens") or 0)  # the keeper's record: what the file covered
    if covered <= 0 or shape.cache < MOST * covered:
        return shape
    spared = min(covered, shape.cache)
    work.restored_by_warm_up[str(warm.get("id"))] = rid
    return dataclasses.replace(shape, cache=shape.cache - spared, restored=shape.restored + spared)


def _left_unsized(record: RecordLine) -> bool:
    """A model request whose client left before its timings came (a stream cut, or one that never
    got a slot's batch): it took a place all the same, its size is unknown."""
    return (record.get("kind") in COMPLETION_KINDS and record.get("outcome") == "client_gone"
            and num(record, "total_ms") is not None)


def _typical_prompt(records: Sequence[RecordLine]) -> int:
    sizes = [int(n) for r in records if (n := num(r, "prompt_tokens")) is not None and n >= 1]
    return int(statistics.median(sizes)) if sizes else 1024


def _typical_generated(records: Sequence[RecordLine]) -> int:
    done = [timing(r, "predicted_n") for r in records if r.get("outcome") == "done"]
    counts = [int(n) for n in done if n is not None and n >= 1]
    return int(statistics.median(counts)) if counts else 128


def _job(record: RecordLine, shape: _Shape, work: Workload,
         by_client: Mapping[str | None, list[Job]], ids: SegmentIds, return_gap_s: float) -> Job:
    arrival = start_of(record)
    client = record.get("client") if isinstance(record.get("client"), str) else None
    mine = by_client.get(client, [])[-SEARCH_BACK:][::-1] if client is not None else []
    kept = shape.cache + shape.restored if shape.restored else 0
    saved = next((j.out for j in mine if j.out.length >= kept), None) if kept else None
    if saved is not None:
        base = saved.prefix(kept)
    else:
        parent, shared = _parent(mine, work.jobs[-SEARCH_BACK:][::-1], shape, arrival,
                                 math.inf if kept else return_gap_s)
        if parent is None and shape.cache > 0:
            parent = Seq(((ids(), shape.cache),), shape.cache)
            work.before_log.append(parent)
            shared = shape.cache
        if parent is not None and shared > shape.cache:
            work.returns += 1
        base = parent.prefix(shared) if parent is not None else Seq()
        if kept:  # restored from a file saved before the log began
            base = base.extend(ids(), kept - base.length)
    prompt = base.extend(ids(), shape.prompt - base.length)
    stream = record.get("stream") is True
    events = int(num(record, "events") or 0) if stream else 0
    return Job(
        id=str(record.get("id")), record=record, arrival=arrival, prompt=prompt,
        out=prompt.extend(ids(), shape.generated), generated=shape.generated,
        events=min(events, shape.generated) if events else (shape.generated if stream else 0),
        stream=stream, client=client, lora_in=lora_asked(record),
        patience_s=_patience(record), overhead_s=_overhead(record), shared=base.length,
        recorded_cache=shape.cache, kept=kept, reply=_repeated(prompt, mine[0]) if mine else (0, 0))


def _repeated(prompt: Seq, last: Job) -> tuple[int, int]:
    """The reply of `last` this prompt repeats, claimed and found (0, 0: it does not start with
    all of `last`'s prompt), as slotwise's cache model learns it (estimate/replies.py)."""
    common = lcp(prompt, last.out)
    if last.generated <= 0 or common < last.prompt_tokens:
        return 0, 0
    claimed = max(0, min(held_reply(last.generated), prompt.length - 1 - last.prompt_tokens))
    return claimed, min(claimed, common - last.prompt_tokens)


def _parent(mine: Sequence[Job], recent: Sequence[Job], shape: _Shape, arrival: float,
            return_gap_s: float) -> tuple[Seq | None, int]:
    """The sequence the prompt starts with and how many of its tokens (rules in the docstring);
    `mine`: the client's earlier requests, `recent`: everybody's, newest first."""
    if mine:
        last = mine[0]
        ended = last.arrival + (num(last.record, "total_ms") or 0.0) / 1000.0
        away = arrival - ended >= return_gap_s
        if away and shape.cache < last.prompt_tokens < shape.prompt:
            return last.out, min(shape.prompt - 1, last.out.length)
    if shape.cache <= 0:
        return None, 0
    for job in (*mine, *recent):
        if job.out.length >= shape.cache:
            return job.out, shape.cache
    return None, 0


def _reacting(job: Job, previous: RecordLine, jobs: Sequence[Job], return_gap_s: float) -> Job:
    """`job` sent `think_s` after its client's previous request ended, if it was sent after that
    one's end (not while it ran, nor after a pause of `return_gap_s` or more: a new session comes
    when it comes) and that one is replayed too."""
    think = pause_after(previous, job.arrival, return_gap_s)
    pid = str(previous.get("id"))
    if think is None or not any(j.id == pid for j in jobs[-SEARCH_BACK:]):
        return job
    return dataclasses.replace(job, after=pid, think_s=think)


def pause_after(previous: RecordLine, arrival: float, return_gap_s: float) -> float | None:
    """How long after `previous` ended something arriving at `arrival` was sent, if it was sent
    after that end and less than `return_gap_s` later (a user who read the reply); else None."""
    total = num(previous, "total_ms")
    if total is None:
        return None
    think = arrival - (start_of(previous) + total / 1000.0)
    return think if 0.0 <= think < return_gap_s else None


def _patience(record: RecordLine) -> float | None:
    if record.get("outcome") != "client_gone":
        return None
    total = num(record, "total_ms")
    return None if total is None else total / 1000.0


def _overhead(record: RecordLine) -> float:
    proxy_ms = num(record, "proxy_ms")
    if proxy_ms is None:
        return 0.0
    spent = proxy_ms - (num(record, "held_ms") or 0.0)
    return min(MAX_OVERHEAD_S, max(0.0, spent / 1000.0))


def lora_asked(record: Mapping[str, Any]) -> Any:
    """The `lora` field the client sent; a log made by a client (no `lora_in`) has only what was
    sent to the server."""
    return record.get("lora_in") if "lora_in" in record else record.get("lora_out")
