"""`slotwise demo`: the product in one command. It starts the testbed llama-server and slotwise on
loopback, lets a few users chat at once while one comes back with a long cold history, and prints
every request's timing record; once with the prefill policy off and once on, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from proxy.bench.harness import StreamResult, temp_dir
from proxy.bench.output import figures_table, print_table
from proxy.report.cells import fmt
from proxy.testbed.slotwise import SlotwiseProcess
from proxy.testbed.words import filler

Felt = tuple[str, StreamResult]
"""One user's turn as the user saw it."""

def register(subparsers: Any) -> None:
    demo = subparsers.add_parser("demo", help="watch slotwise keep replies flowing (testbed)")
    demo.add_argument("--preset", choices=("tiny", "small"), default="small",
                      help="testbed model (default: small, where the stall is plain to see)")
    demo.add_argument("--cold-words", type=int, default=700,
                      help="size of the returning user's history, in words (default 700, "
                           "about 3,400 tokens)")
    demo.add_argument("--modes", default="off,chunk,warm",
                      help="prefill modes to compare, comma-separated (default off,chunk,warm; "
                           "warm: chunk, and dan's app warms his history when he opens it)")
    demo.set_defaults(handler=run_demo)


def history(words: int, seed: int) -> list[dict[str, str]]:
    """A long chat history, the same for a seed (no real text is needed)."""
    rng = random.Random(seed)
    turns = []
    for i in range(max(2, words // 60)):
        text = filler(rng, 60)
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    turns.append({"role": "user", "content": "So, where were we?"})
    return turns


async def chat(session: aiohttp.ClientSession, url: str, user: str, purpose: str,
               messages: list[dict[str, str]], tokens: int, delay: float) -> Felt:
    """One user's turn; returns what that user felt (when it was sent, when each token came)."""
    await asyncio.sleep(delay)
    body = {"messages": messages, "stream": True, "max_tokens": tokens, "ignore_eos": True}
    headers = {"X-Slotwise-Client": user, "X-Slotwise-Purpose": purpose}
    result = StreamResult(sent=time.monotonic())
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":"' in line:
                result.tokens.append(time.monotonic())
    return user, result


async def play(url: str, cold_words: int, *, warm: bool = False) -> list[Felt]:
    """Three users chatting, one coming back with a long history, two short turns meanwhile."""
    hello = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    quick = [{"role": "user", "content": "Thanks! One word: yes or no?"}]
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        dan = (warmed_turn(session, url, history(cold_words, 7)) if warm else
               chat(session, url, "dan", "first-turn", history(cold_words, 7), 40, 0.8))
        others = asyncio.gather(
            chat(session, url, "ann", "chat", hello, 700, 0.0),
            chat(session, url, "bob", "chat", hello, 700, 0.1),
            chat(session, url, "cho", "chat", hello, 700, 0.2),
            chat(session, url, "eve", "chat", quick, 20, 1.2),
            chat(session, url, "eve", "chat", quick, 20, 2.2),
        )
        dans, felt = await asyncio.gather(dan, others)
    return [*felt, *(dans if isinstance(dans, list) else [dans])]


# -- warm (docs/warm.md): dan's app warms his history when he opens the conversation --------------

WARM_MODE = "warm"
"""Not a prefill mode: `chunk`, and dan's app warms his history when he opens the conversation."""
DAN_OPENS_S = 0.8
DAN_TYPES_S = 4.0
"""How long dan reads and types before his turn goes out."""


async def warmed_turn(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]
                      ) -> list[Felt]:
    """Dan opens the conversation (his app warms the history so far), types, then sends his turn.
    The warm-up is felt as a turn without tokens: when it was asked for."""
    await asyncio.sleep(DAN_OPENS_S)
    opened = StreamResult(sent=time.monotonic())
    headers = {"X-Slotwise-Client": "dan", "X-Slotwise-Purpose": "warm-up"}
    async with session.post(url + "/slotwise/warm/v1/chat/completions",
                            json={"messages": messages[:-1]}, headers=headers) as resp:
        await resp.read()
    return [("dan", opened), await chat(session, url, "dan", "first-turn", messages, 40, DAN_TYPES_S)]


def run_once(server_url: str, work: Path, mode: str, cold_words: int
             ) -> tuple[list[dict[str, Any]], list[Felt]]:
    prefill = "chunk" if mode == WARM_MODE else mode
    with SlotwiseProcess(server_url, work / f"slotwise-{mode}",
                         prefill={"mode": prefill, "cold_tokens": 1000}) as proxy:
        felt = asyncio.run(play(proxy.url, cold_words, warm=mode == WARM_MODE))
    return proxy.records(), felt


def records_table(mode: str, records: list[dict[str, Any]]) -> Table:
    """A line per record; times as the report shows them (ms under a second), the client and its
    purpose in one column that wraps, so that 80 columns hold the twelve figures."""
    table = figures_table(f"timing records, prefill mode '{mode}'")
    columns = ("client, purpose", "prompt tok", "new tok", "warmed tok", "queue", "ttft",
               "events", "gap max", "worst 3s /s", "during cold /s", "plan")
    for column in columns:
        table.add_column(column, justify="left" if column in ("client, purpose", "plan")
                         else "right")
    for rec in sorted(records, key=lambda r: r["start"]):
        timings = rec.get("timings") or {}
        table.add_row(
            f"{rec.get('client')}, {rec.get('purpose')}", _n(rec.get("prompt_tokens")),
            _n(timings.get("prompt_n", rec.get("fed_tokens"))), _n(rec.get("warmed_tokens")),
            _ms(rec.get("queue_ms")), _ms(rec.get("ttft_ms")),
            _n(rec.get("events")), _ms(rec.get("gap_max_ms")), _n(rec.get("worst_3s_rate")),
            _n(rate_during_cold(rec)), str(rec.get("prefill_plan")))
    return table


def rate_during_cold(rec: dict[str, Any], cold: int = 1000) -> float | None:
    """This request's token rate while another request computed a cold prompt (the overlap's
    `computed_tokens`; `new_tokens` in older logs)."""
    inside = [o for o in rec.get("overlaps", [])
              if (o.get("computed_tokens", o.get("new_tokens")) or 0) >= cold]
    ms = sum(o["decode_ms"] for o in inside)
    return sum(o["decode_events"] for o in inside) / (ms / 1000.0) if ms > 0 else None


def _n(value: Any) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if isinstance(value, int | float) else str(value)


def _ms(value: Any) -> str:
    """A time in milliseconds, as the report shows times (proxy/report/cells.py)."""
    return fmt(value, "ms") if isinstance(value, int | float) else _n(value)


def run_demo(args: argparse.Namespace) -> int:
    from proxy.testbed.model import write_model
    from proxy.testbed.server import LlamaServer

    console = Console()
    work = temp_dir("slotwise-demo-")
    console.print(f"[dim]writing the testbed model ({args.preset}) and starting llama-server "
                  f"… (files in {work})[/dim]")
    model = write_model(work / "model", args.preset, seed=0)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    with LlamaServer(model.model, args=["-np", "5", "-c", "40960", "--no-cache-idle-slots"],
                     log_path=work / "llama-server.log") as server:
        results = {mode: run_once(server.url, work, mode, args.cold_words) for mode in modes}
    for mode, (records, _) in results.items():
        print_table(records_table(mode, records), console)
    print_table(summary_table({mode: felt for mode, (_, felt) in results.items()}), console)
    console.print(f"[dim]timing logs: {work}/slotwise-*/timing.jsonl; llama-server log: "
                  f"{work}/llama-server.log[/dim]")
    return 0


def summary_table(results: dict[str, list[Felt]]) -> Table:
    """What the users felt, measured at the client: the streams during dan's cold prompt (from
    its arrival to its first token), eve's short turns, and dan's own wait."""
    table = figures_table("side by side: what the users felt while dan's history was read")
    table.add_column("figure")
    for mode in results:
        table.add_column(f"prefill {mode}", justify="right")
    rows: dict[str, Callable[[list[Felt]], float | None]] = {
        "streams' rate during the cold prompt (tok/s, slowest)": _rate_during_cold,
        "streams' longest gap": lambda felt: _max(
            _gap_ms(r) for user, r in felt if user in STREAMERS),
        "short turns' time to first token (worst)": lambda felt: _max(
            _ttft_ms(r) for user, r in felt if user == "eve"),
        "cold turn's time to first token": lambda felt: _max(
            _ttft_ms(r) for user, r in felt if user == "dan"),
    }
    for name, figure in rows.items():
        show = _n if name.startswith("streams' rate") else _ms
        table.add_row(name, *(show(figure(felt)) for felt in results.values()))
    return table


STREAMERS = ("ann", "bob", "cho")


def _rate_during_cold(felt: list[Felt]) -> float | None:
    """From dan's first move (his turn, or opening the conversation) to his first token."""
    dan = next((r for user, r in felt if user == "dan" and r.tokens), None)
    if dan is None:
        return None
    lo, hi = min(r.sent for user, r in felt if user == "dan"), dan.tokens[0]
    rates = []
    for user, r in felt:
        if user in STREAMERS and r.tokens and r.tokens[-1] > lo + 0.3:
            end = min(hi, r.tokens[-1])
            rates.append(sum(1 for t in r.tokens if lo < t <= end) / max(end - lo, 1e-3))
    return min(rates) if rates else None


def _gap_ms(r: StreamResult) -> float | None:
    gaps = [b - a for a, b in itertools.pairwise(r.tokens)]
    return max(gaps) * 1000.0 if gaps else None


def _ttft_ms(r: StreamResult) -> float | None:
    return r.ttft * 1000.0 if r.ttft is not None else None


def _max(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
