"""`slotwise whatif LOG… [--server-log FILE] [--set KEY=VALUE …] [--costs FILE] -o OUT.jsonl`:
reads the inputs, runs the prediction, writes the what-if's timing log and says on stderr what it
assumed; `--check MEASURED` then compares it with a real run. Every bad input is a one-line error
and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from proxy.report.records import InputError, RecordLine, load_timing_log
from proxy.whatif.check import (
    FIGURES,
    cold_requests,
    compare,
    passed,
    shared,
    show,
    slowest_short,
)
from proxy.whatif.costs import KEYS, CostsError, load_costs
from proxy.whatif.modelfile import kv_bytes_per_token, model_path
from proxy.whatif.predict import Inputs, Prediction, predict
from proxy.whatif.seed import LearnedRead
from proxy.whatif.settings import SERVER_KEYS, SettingsError, load_config_data


def register(subparsers: Any) -> None:
    cmd = subparsers.add_parser(
        "whatif", help="replay timing logs against other settings: the log they would have made",
        description="Replays slotwise timing logs through a model of llama-server's slot loop "
        "with slotwise's own policies, under other settings; writes the timing log the same "
        "requests would have produced (docs/whatif.md).")
    cmd.add_argument("logs", nargs="+", metavar="LOG", help="slotwise timing logs (JSON lines)")
    cmd.add_argument("-o", "--output", required=True, metavar="OUT.jsonl",
                     help="where to write the what-if's timing log")
    cmd.add_argument("--server-log", metavar="FILE",
                     help="llama-server's log of the same time: its flags and batch steps")
    cmd.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                     help=f"a what-if setting (repeatable): a llama-server flag "
                          f"({', '.join(SERVER_KEYS)}) or a slotwise config key "
                          "(prefill.mode=chunk, lora.mode=fixed, ...)")
    cmd.add_argument("--recorded", action="append", default=[], metavar="KEY=VALUE",
                     help="a llama-server flag the log was recorded under, where its log does not "
                          "say (default: llama-server's defaults)")
    cmd.add_argument("--config", metavar="FILE",
                     help="the slotwise config the log was recorded under (default: inferred "
                          "from the records)")
    cmd.add_argument("--costs", metavar="FILE",
                     help=f"costs to use instead of the calibrated ones (TOML: {', '.join(KEYS)}; "
                          "or [measured] prefill_rates and decode_tok_s; or [measured] pieces "
                          "from `slotwise bench pieces --costs-out`, fitted with the log's "
                          "prompts: give them to predict chunk from a day without pieces)")
    cmd.add_argument("--costs-out", metavar="FILE", help="write the costs used, as a --costs file")
    cmd.add_argument("--check", metavar="MEASURED",
                     help="a timing log measured under the what-if's settings: compare, exit 1 if a "
                          "figure is off by more than --tolerance")
    cmd.add_argument("--tolerance", type=float, default=0.2,
                     help="--check: the largest relative error accepted (default 0.2)")
    cmd.add_argument("--cold-tokens", type=int, default=2000,
                     help="--check: a request computing this many prompt tokens is cold "
                          "(default 2000)")
    cmd.set_defaults(handler=run_whatif)


def run_whatif(args: argparse.Namespace) -> int:
    try:
        prediction = predict(_inputs(args))
        _write(args.output, b"".join(prediction.lines))
        if args.costs_out:
            _write(args.costs_out, prediction.costs.as_toml().encode())
        measured = _records(args.check) if args.check else None
    except (InputError, SettingsError, CostsError) as exc:
        print(f"slotwise whatif: {exc}", file=sys.stderr)
        return 1
    _summary(prediction, args.output)
    if measured is None:
        return 0
    return _check(prediction, measured, args.tolerance, args.cold_tokens)


def _inputs(args: argparse.Namespace) -> Inputs:
    records: list[RecordLine] = []
    for path in args.logs:
        records.extend(_records(path))
    lines = None
    if args.server_log:
        try:
            lines = Path(args.server_log).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as exc:
            raise InputError(f"cannot read server log {args.server_log}: {exc.strerror}") from None
    config = load_config_data(args.config) if args.config else None
    costs = load_costs(args.costs) if args.costs else None
    model = model_path(lines) if lines is not None else None
    return Inputs(records, lines, config, args.recorded, args.sets, costs,
                  model_kv_bytes=kv_bytes_per_token(model) if model is not None else None,
                  learned_file=_learned_file(config))


def _learned_file(config: dict[str, Any] | None) -> LearnedRead | None:
    """The file the recorded config's `prefill.learned_file` names: what slotwise started the
    day from. Not there or not JSON: the replay says so and goes on without it."""
    prefill = (config or {}).get("prefill")
    path = prefill.get("learned_file") if isinstance(prefill, dict) else None
    if not isinstance(path, str) or not path:
        return None
    try:
        return LearnedRead(path, orjson.loads(Path(path).read_bytes()))
    except OSError as exc:
        return LearnedRead(path, error=f"cannot be read ({exc.strerror})")
    except orjson.JSONDecodeError as exc:
        return LearnedRead(path, error=f"not JSON ({exc})")


def _records(path: str) -> list[RecordLine]:
    return list(load_timing_log(path).records)


def _write(path: str, data: bytes) -> None:
    try:
        Path(path).write_bytes(data)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror}") from None


def _summary(p: Prediction, output: str) -> None:
    work, out = p.workload, p.outcome
    say(f"slotwise whatif: {len(work.jobs)} requests replayed, {len(work.copied)} copied as they "
        f"were, {work.dropped} records of slotwise's own work read (not copied); {out.batches} batches in "
        f"{p.elapsed_s:.2f} s → {output}")
    say(f"  recorded: {_flags(p.recorded)}")
    changed = ", ".join(p.whatif.changed) or "nothing (a replay of the recorded settings)"
    say(f"  what-if:  {_flags(p.whatif)}  (set: {changed})")
    costs = p.costs
    say(f"  costs: batch ≈ {costs.fixed_ms:.1f} ms per micro-batch + {costs.per_token_ms:.3f} "
        f"ms/token + {costs.per_token_per_kctx_ms:.4f} ms/token per 1k ctx + "
        f"{costs.per_kctx_ms:.2f} ms per 1k ctx read + {costs.per_decoder_ms:.2f} ms/decoder + "
        f"{costs.per_decoder_kctx_ms:.2f} ms per 1k decoder cells + "
        f"{costs.per_token_per_kv_ms:.4f} ms/token per 1k cells of the span beyond its own, "
        f"under 64 rows + {costs.narrow_per_row_kctx_ms:.2f} ms/token per 1k ctx; "
        f"decode step {costs.step_ms:.1f} ms + {costs.per_slot_ms:.2f} ms/slot + "
        f"{costs.decode_per_kctx_ms:.3f} ms per 1k ctx + {costs.decode_per_kv_ms:.3f} ms per 1k "
        "cells of the span beyond its own")
    cal = p.calibration
    say(f"  calibrated from {cal.prefills} prefills ({cal.narrow} of them in under 64 rows), "
        f"{cal.steps} batch steps, {cal.decodes} decodes")
    assumed = costs.assumed()
    if assumed:
        say(f"  assumed (not calibrated): {', '.join(assumed)}")
    for note in [*cal.notes, *p.notes]:
        say(f"  note: {note}")
    if out.unknown_decisions:
        say(f"  note: policy decisions not modelled: {out.unknown_decisions}")
    if out.policy_cost is not None:
        say(f"  the prefill policy's batch cost at the end: {out.policy_cost}")


def say(text: str = "") -> None:
    print(text, file=sys.stderr)


def _flags(s: Any) -> str:
    srv, cfg = s.server, s.config
    return (f"-b {srv.n_batch} -ub {srv.n_ubatch} -np {srv.parallel}"
            f"{' -kvu' if srv.kv_unified else ''} -c {srv.ctx or 'unlimited'} "
            f"--cache-ram {srv.cache_ram}; prefill.mode {cfg.prefill.mode}, lora.mode "
            f"{cfg.lora.mode}")


def _check(p: Prediction, measured: list[RecordLine], tolerance: float, cold: int) -> int:
    predicted = [r.to_dict() for r in p.outcome.records]
    rows = compare(predicted, measured, cold)
    width = max(len(label) for _, label in FIGURES)
    if (both := shared(predicted, measured)) is not None:
        print(f"over the {len(both)} generation requests both logs have (by id)", file=sys.stdout)
    print(f"{'figure'.ljust(width)}  predicted  measured   error", file=sys.stdout)
    for row in rows:
        error = row.error
        mark = "" if error is None else ("  ok" if row.within(tolerance) else "  OFF")
        shown = "—" if error is None else f"{error:+.0%}"
        print(f"{row.label.ljust(width)}  {show(row.predicted):>9}  {show(row.measured):>8}  "
              f"{shown:>6}{mark}")
    if both is not None:
        _by_request(predicted, measured, cold)
    ok = passed(rows, tolerance)
    print(f"within ±{tolerance:.0%}: {'yes' if ok else 'no'}")
    return 0 if ok else 1


def _by_request(predicted: Sequence[RecordLine], measured: Sequence[RecordLine],
                cold: int) -> None:
    """What the figures are made of, request by request: where the two days parted."""
    found = cold_requests(predicted, measured, cold)
    if found:
        print(f"cold requests (>= {cold:,} new tokens measured), predicted / measured:")
    width = max((len(c.req_id) for c in found), default=0)
    for c in found:
        tokens = " / ".join("—" if n is None else f"{n:,.0f}" for n in c.new_tokens)
        ttft = " / ".join("—" if t is None else f"{t:.2f}" for t in c.ttft_s)
        beside = " / ".join("nobody" if w is None else f"{w.events:.0f} events in {w.ms / 1000:.1f} s"
                            for w in c.beside)
        print(f"  {c.req_id.ljust(width)}  new tokens {tokens};  first token {ttft} s;  "
              f"streams beside it {beside}")
    slowest = slowest_short(predicted, measured, cold)
    if slowest:
        shown = ", ".join(f"{i} {'—' if p is None else f'{p:.1f}'} / "
                          f"{'—' if m is None else f'{m:.1f}'} s" for i, p, m in slowest)
        print(f"short turns with the latest first tokens, predicted / measured: {shown}")
