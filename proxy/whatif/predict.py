"""From the inputs to the prediction: the recorded settings and the what-if's, the costs (calibrated
from the log, then what `--costs` gives), the workload, the replay, the log lines to write.
No terminal and no files here (`cli.py` reads and writes them).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.prefill.sizing import TILE_ROWS
from proxy.record.outcome import Outcome
from proxy.record.schema import Record
from proxy.report.records import COMPLETION_KINDS, RecordLine, first_pieces, record_to_span
from proxy.report.serverlog import parse_server_log
from proxy.report.tasks import Task, rebuild_tasks
from proxy.whatif.calibrate import Calibration, fit, fit_rates
from proxy.whatif.copies import save_gb_s
from proxy.whatif.costs import Costs, CostsFile
from proxy.whatif.cutsizes import cut_sizes, log_offset, seen_by_task
from proxy.whatif.kept import kept_bytes_per_token
from proxy.whatif.observe import DecodeObs, PrefillObs, lora_switch_ms, observations, prompt_obs
from proxy.whatif.recorded import recorded_config, recorded_server
from proxy.whatif.replay import Replay, Replayed
from proxy.whatif.requests import Workload, build_workload
from proxy.whatif.seed import LearnedRead, Seed, seed
from proxy.whatif.serverobs import server_obs, used_before
from proxy.whatif.settings import (
    ServerSettings,
    Settings,
    apply,
    config_from,
    parse_assignment,
    server_log_settings,
    server_settings,
)
from proxy.whatif.slotted import recorded_slots

MIN_DECODES = 8
"""Under this many decode windows in which no other reply started or ended (the server log's, else
the records' whole replies), the decode step is fitted on every window of the server log's replies
(`decode_obs(shared=True)`): `bench day` fed in pieces on `-np 4 -kvu` left one or two, and a
direct day one to three on both layouts (eighteenth sitting; another left 28-30)."""


@dataclass(frozen=True)
class Inputs:
    records: Sequence[RecordLine]
    server_log: Sequence[str] | None = None
    config_data: dict[str, Any] | None = None
    """The recorded slotwise config file's mapping; None: inferred from the records."""
    recorded: Sequence[str] = ()
    sets: Sequence[str] = ()
    costs_file: CostsFile | None = None
    model_kv_bytes: float | None = None
    """One token's KV in bytes, as the model file the server log names says (modelfile.py)."""
    learned_file: LearnedRead | None = None
    """The file the recorded config's `prefill.learned_file` names, as read (seed.py)."""


@dataclass
class Prediction:
    lines: list[bytes]
    recorded: Settings
    whatif: Settings
    costs: Costs
    calibration: Calibration
    workload: Workload
    outcome: Replayed
    elapsed_s: float
    notes: list[str] = field(default_factory=list)


def settings_of(inputs: Inputs) -> tuple[Settings, Settings, list[str]]:
    """(recorded, what-if, notes)."""
    found = server_log_settings(inputs.server_log) if inputs.server_log is not None else {}
    given = dict(parse_assignment(item) for item in inputs.recorded)
    values, notes = recorded_server(found, given)
    server = server_settings(values)
    if inputs.config_data is not None:
        data = inputs.config_data
    else:
        data, more = recorded_config(inputs.records)
        notes += more
    for key in ("n_batch", "n_ubatch"):  # what slotwise was told of the server, as it ran
        prefill = data.get("prefill")
        if key in values and not (isinstance(prefill, dict) and key in prefill):
            data = {**data, "prefill": {**(prefill if isinstance(prefill, dict) else {}),
                                        key: getattr(server, key)}}
    recorded = Settings(server, config_from(data))
    return recorded, apply(recorded, inputs.sets, data), notes


def read_server_log(inputs: Inputs) -> tuple[list[Task] | None, dict[str, tuple[int, int]]]:
    """The server log's tasks, and the sizes it shows of requests whose client left before their
    timings (none without a server log); the log parsed once."""
    if inputs.server_log is None:
        return None, {}
    events = parse_server_log(inputs.server_log).events
    tasks = rebuild_tasks(events)
    return tasks, cut_sizes(tasks, inputs.records, seen_by_task(events, inputs.server_log))


def calibrate(inputs: Inputs, server: ServerSettings, tasks: Sequence[Task] | None) -> Calibration:
    """`tasks`: the server log's (`read_server_log`), None without one."""
    fed_from = first_pieces(inputs.records)
    spans = [record_to_span(r, fed_from) for r in inputs.records
             if r.get("kind") in COMPLETION_KINDS and r.get("outcome") == "done"]
    logged: list[PrefillObs] = []
    steps: list[PrefillObs] = []
    logged_decodes: list[DecodeObs] = []
    shared_decodes: list[DecodeObs] = []
    span_at = span = None
    if tasks is not None:
        # the server's own times of its batches, where it has them, rather than the clients'
        obs = server_obs(tasks, server)
        logged, steps, logged_decodes, span = obs.prefills, obs.steps, obs.decodes, obs.span
        shared_decodes = obs.shared_decodes
        span_at = _on_record_clock(span, tasks, inputs.records)
    prefills, decodes = observations(spans, server, span_at)
    prefills, decodes = logged or prefills, logged_decodes or decodes
    few = len(decodes)
    if few < MIN_DECODES and len(shared_decodes) > few:
        decodes = shared_decodes
    given = inputs.costs_file
    pieces = given.pieces if given is not None else ()
    measured = [prompt_obs(p.tokens, p.prefix, p.prompt_ms, p.decoders, server) for p in pieces]
    cal = fit([*prefills, *steps, *measured], decodes, server.n_ubatch,
              Costs().with_values(given.values, "given") if given is not None else None,
              given.values if given is not None else ())
    cal.prefills, cal.steps = len(prefills), len(steps)
    if decodes is shared_decodes:
        cal.notes.append(f"decode: {few} reply windows with no other reply starting or ending in "
                         f"them (under {MIN_DECODES}: a busy day, or one fed in pieces, has few): "
                         f"fitted on every window of the server log's replies, each slot counted "
                         f"for the share of a window it generated")
    elif decodes and not logged_decodes and span is not None and span_at is None:
        cal.notes.append("decode: the records' replies could not be placed on the server log's "
                         "clock (no request of a size only one task had): the shared KV's span "
                         "they read is not known, and not priced")
    if pieces:
        small = sum(p.tokens < TILE_ROWS for p in pieces)
        cal.notes.append(f"prefill: fitted with the {len(pieces)} measured pieces of --costs "
                         "beside the log's prompts"
                         + (f" ({small} under {TILE_ROWS} tokens: with the log's short prompts, "
                            "the price of a micro-batch computed row by row)" if small else ""))
    switch = lora_switch_ms(spans, cal.costs, server)
    if switch is not None:
        cal.costs = cal.costs.with_values({"lora_switch_ms": switch}, "log")
    kept = kept_bytes_per_token(inputs.records)
    if kept is not None:
        cal.costs = cal.costs.with_values({"kv_bytes_per_token": kept}, "log")
    elif inputs.model_kv_bytes is not None:
        cal.costs = cal.costs.with_values({"kv_bytes_per_token": inputs.model_kv_bytes},
                                          "model file")
    copies = save_gb_s(tasks, cal.costs.kv_bytes_per_token) if tasks is not None else None
    if copies is not None:
        cal.costs = cal.costs.with_values({"save_gb_s": copies[0]}, "log")
        cal.notes.append(f"server: prompts saved to the RAM cache at {copies[0]:.2f} GB/s, the "
                         f"median of {copies[1]} slot switches the server log times")
    if given is not None:
        cal.costs = fit_rates(given.prefill_rates, given.decode_tok_s, server, cal.costs)
        cal.costs = cal.costs.with_values(given.values, "given")
    return cal


def _on_record_clock(span: Callable[[float], int] | None, tasks: Sequence[Task],
                     records: Sequence[RecordLine]) -> Callable[[float], float] | None:
    """One shared KV's span as the server log places its cells, at a time of the records' clock:
    the records' decodes read it, for a day whose server log has no window of decode steps alone
    (pieces in every one)."""
    offset = log_offset(tasks, records) if span is not None else None
    if span is None or offset is None:
        return None
    return lambda t: float(span(t + offset))


def predict(inputs: Inputs) -> Prediction:
    began = time.perf_counter()
    recorded, whatif, notes = settings_of(inputs)
    tasks, cut = read_server_log(inputs)
    cal = calibrate(inputs, recorded.server, tasks)
    workload = reconciled(inputs.records, recorded, cal.costs,
                          used_before(tasks, inputs.records) if tasks else [], cut,
                          recorded_slots(tasks, inputs.records) if tasks else {},
                          seed_of(inputs.learned_file, recorded))
    if whatif.server.parallel != recorded.server.parallel or not same_tasks(whatif, recorded):
        workload.slots = {}  # other slots, or slotwise sends other tasks: the model chooses
    learned = seed_of(inputs.learned_file, whatif)
    if learned is not None:
        notes.append(learned.note)
    outcome = Replay(workload, whatif, cal.costs, seed=learned).run()
    outcome.records = unsized(outcome.records, set(workload.guessed), set(cut))
    lines = sorted([(r.start or "", r.to_json()) for r in outcome.records]
                   + [(str(r.get("start")), _line(r)) for r in (*workload.copied, *outcome.copied)])
    return Prediction([line for _, line in lines], recorded, whatif, cal.costs, cal, workload,
                      outcome, time.perf_counter() - began,
                      notes + outcome.notes + unmodelled(whatif, workload)
                      + unpriced_pieces(whatif, inputs.records, inputs.costs_file))


def same_tasks(whatif: Settings, recorded: Settings) -> bool:
    """Whether slotwise sends the server the same tasks in the what-if (its settings other than
    the batch sizes it is told are the recorded ones): no other pieces, restores or holds (a
    `-b` or `-ub` it is told may move where its pieces and trims end; left out here)."""
    prefill = dataclasses.replace(whatif.config.prefill, n_batch=recorded.config.prefill.n_batch,
                                  n_ubatch=recorded.config.prefill.n_ubatch)
    return dataclasses.replace(whatif.config, prefill=prefill) == recorded.config


MODELLED_TABLES = ("prefill", "lora", "keep_kv", "warm")
"""The slotwise tables the replay follows; a key of another table changes nothing in it."""


def unmodelled(whatif: Settings, workload: Workload) -> list[str]:
    """What the what-if's settings ask for that the model does not do (yet)."""
    notes = []
    files, saves = len(workload.files), len(workload.saves)
    if whatif.config.keep_kv.enabled and (files or saves):
        notes.append(f"keep_kv: the {files} restores and {saves} saves the log shows go as "
                     "slotwise's policy decides them; a conversation the log shows no file of is "
                     "saved only when a restore pushes it out of its slot (then restored "
                     "like the log's)")
    elif whatif.config.keep_kv.enabled:
        notes.append("keep_kv: the log shows no kept file (recorded without keep_kv): nothing to "
                     "restore; which conversations slotwise would have saved is not modelled")
    elif files:
        notes.append(f"keep_kv off: the {files} requests the log shows restored compute what their "
                     "file held")
    if workload.guessed:
        notes.append(f"{len(workload.guessed)} requests whose client left before their size was "
                     f"logged ({', '.join(workload.guessed[:5])}) replayed with the median prompt, "
                     "nothing cached; those with no first token either hold their place and are "
                     "never computed")
    warmups = len(workload.warm_records)
    if warmups and whatif.config.warm.enabled:
        notes.append(f"warm-ups: the {warmups} the log shows are asked for again (after their "
                     "client's previous request, as then) and slotwise's warm-up queue runs them; "
                     "one restores only a kept file the log shows it restored")
    elif warmups:
        notes.append(f"warm.enabled off: the {warmups} warm-up calls the log shows are refused; "
                     "what they computed is computed by the requests, a kept file one restored "
                     "is restored by its turn")
    others = sorted({k for k in whatif.changed if "." in k
                     and k.split(".", 1)[0] not in MODELLED_TABLES})
    if others:
        notes.append(f"{', '.join(others)}: no effect on what the model follows")
    return notes


def unpriced_pieces(whatif: Settings, records: Sequence[RecordLine],
                    given: CostsFile | None) -> list[str]:
    """Pieces asked of a day that fed none, with no measured ones (of `TILE_ROWS` tokens or more)
    to price them by."""
    if whatif.config.prefill.mode != "chunk" or any(r.get("pieces") for r in records) \
            or (given is not None and any(p.tokens >= TILE_ROWS for p in given.pieces)):
        return []
    return ["prefill.mode=chunk on a day without pieces: its whole prompts cannot tell what a "
            "small piece after a long prefix costs (on the testbed 15-30 % more than they price "
            "it); measure them with `slotwise bench pieces --prefix 1000,5000,10000,15000 "
            "--costs-out FILE` and give FILE with --costs"]


def seed_of(read: LearnedRead | None, settings: Settings) -> Seed | None:
    """The learned file for the server `settings` play, when their config still names it."""
    if read is None or settings.config.prefill.learned_file != read.path:
        return None
    return seed(read, settings.server.parallel, settings.config.prefill.n_batch)


def reconciled(records: Sequence[RecordLine], recorded: Settings, costs: Costs,
               used: Sequence[int] = (),
               sizes: dict[str, tuple[int, int]] | None = None,
               slots: dict[str, int] | None = None, learned: Seed | None = None) -> Workload:
    """The workload, with the clients taken to have come back to their history (requests.py)
    checked against a replay of the recorded settings: where that replay finds cached what the
    recording did not, the history was rewritten, not lost. `used`, `slots`: what the server's log
    shows of its slots (`Workload.used_before`, `Workload.slots`); `learned`: the learned file the
    recorded slotwise started from."""
    def built(rewritten: Collection[str]) -> Workload:
        workload = build_workload(records, rewritten=rewritten, sizes=sizes,
                                  kv_bytes_per_token=costs.kv_bytes_per_token)
        workload.used_before, workload.slots = list(used), dict(slots or {})
        return workload

    workload = built(())
    if not workload.returns:
        return workload
    found = Replay(workload, recorded, costs, records=False, seed=learned).run().cache_found
    rewritten = {j.id for j in workload.jobs if j.shared > j.recorded_cache and
                 found.get(j.id, 0) > j.recorded_cache + max(64, j.prompt_tokens // 10)}
    return built(rewritten) if rewritten else workload


def unsized(records: list[Record], guessed: set[str],
            cut: Collection[str] = ()) -> list[Record]:
    """The guessed requests' records without the sizes and timings the log did not have: the
    replay gave them a prompt to hold their place, not a size to report. So too the records of
    requests sized from the server log (`cut`) whose client left before the end in the what-if
    as well: the log they were recorded in says no sizes for a request its client left."""
    return [dataclasses.replace(r, prompt_tokens=None, computed_tokens=None, timings=None)
            if r.id in guessed or (r.id in cut and r.outcome is Outcome.CLIENT_GONE) else r
            for r in records]


def _line(record: RecordLine) -> bytes:
    return orjson.dumps({k: v for k, v in record.items() if k != "_t0"},
                        option=orjson.OPT_APPEND_NEWLINE)
