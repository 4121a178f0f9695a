"""`slotwise demo`: the product in one command. It starts the testbed llama-server and slotwise on
loopback, lets a few users chat at once while one comes back with a long cold history, and prints
every request's timing record; once with the prefill policy off and once on, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from proxy.bench.harness import SlotwiseProcess, temp_dir

WORDS = (
    "river", "stone", "lantern", "quiet", "market", "harbor", "winter", "letter", "garden",
    "window", "bridge", "candle", "forest", "mirror", "silver", "thunder", "meadow", "orchard",
)


def register(subparsers: Any) -> None:
    demo = subparsers.add_parser("demo", help="watch slotwise keep replies flowing (testbed)")
    demo.add_argument("--preset", choices=("tiny", "small"), default="small",
                      help="testbed model (default: small, where the stall is plain to see)")
    demo.add_argument("--cold-words", type=int, default=1800,
                      help="size of the returning user's history, in words (default 1800)")
    demo.add_argument("--modes", default="off,chunk",
                      help="prefill modes to compare, comma-separated (default off,chunk)")
    demo.set_defaults(handler=run_demo)


def history(words: int, seed: int) -> list[dict[str, str]]:
    """A long chat history, the same for a seed (no real text is needed)."""
    rng = random.Random(seed)
    turns = []
    for i in range(max(2, words // 60)):
        text = " ".join(rng.choice(WORDS) for _ in range(60))
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    turns.append({"role": "user", "content": "So, where were we?"})
    return turns


async def chat(session: aiohttp.ClientSession, url: str, user: str, purpose: str,
               messages: list[dict[str, str]], tokens: int, delay: float) -> None:
    await asyncio.sleep(delay)
    body = {"messages": messages, "stream": True, "max_tokens": tokens, "ignore_eos": True}
    headers = {"X-Slotwise-Client": user, "X-Slotwise-Purpose": purpose}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        async for _ in resp.content.iter_any():
            pass


async def play(url: str, cold_words: int) -> None:
    """Three users chatting, one coming back with a long history, two short turns meanwhile."""
    hello = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    quick = [{"role": "user", "content": "Thanks! One word: yes or no?"}]
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(
            chat(session, url, "ann", "chat", hello, 500, 0.0),
            chat(session, url, "bob", "chat", hello, 500, 0.1),
            chat(session, url, "cho", "chat", hello, 500, 0.2),
            chat(session, url, "dan", "first-turn", history(cold_words, 7), 40, 0.8),
            chat(session, url, "eve", "chat", quick, 20, 1.2),
            chat(session, url, "eve", "chat", quick, 20, 2.2),
        )


def run_once(server_url: str, work: Path, mode: str, cold_words: int) -> list[dict[str, Any]]:
    with SlotwiseProcess(server_url, work / f"slotwise-{mode}",
                         prefill={"mode": mode, "cold_tokens": 1000}) as proxy:
        asyncio.run(play(proxy.url, cold_words))
    return proxy.records()


def records_table(mode: str, records: list[dict[str, Any]]) -> Table:
    table = Table(title=f"timing records, prefill mode '{mode}'")
    columns = ("client", "purpose", "prompt tok", "new tok", "queue ms", "ttft ms", "events",
               "gap max ms", "worst 3s /s", "during cold /s", "plan")
    for column in columns:
        table.add_column(column, justify="left" if column in ("client", "purpose", "plan")
                         else "right")
    for rec in sorted(records, key=lambda r: r["start"]):
        timings = rec.get("timings") or {}
        table.add_row(
            str(rec.get("client")), str(rec.get("purpose")), _n(rec.get("prompt_tokens")),
            _n(timings.get("prompt_n")), _n(rec.get("queue_ms")), _n(rec.get("ttft_ms")),
            _n(rec.get("events")), _n(rec.get("gap_max_ms")), _n(rec.get("worst_3s_rate")),
            _n(rate_during_cold(rec)), str(rec.get("prefill_plan")))
    return table


def rate_during_cold(rec: dict[str, Any], cold: int = 1000) -> float | None:
    """This request's token rate while another request computed a cold prompt."""
    inside = [o for o in rec.get("overlaps", []) if (o.get("new_tokens") or 0) >= cold]
    ms = sum(o["decode_ms"] for o in inside)
    return sum(o["decode_events"] for o in inside) / (ms / 1000.0) if ms > 0 else None


def _n(value: Any) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if isinstance(value, int | float) else str(value)


def run_demo(args: argparse.Namespace) -> int:
    from proxy.testbed.model import write_model
    from proxy.testbed.server import LlamaServer

    console = Console()
    work = temp_dir("slotwise-demo-")
    console.print(f"[dim]writing the testbed model ({args.preset}) and starting llama-server "
                  f"… (files in {work})[/dim]")
    model = write_model(work / "model", args.preset, seed=0)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    with LlamaServer(model.model, args=["-np", "4", "-c", "32768"],
                     log_path=work / "llama-server.log") as server:
        results = {mode: run_once(server.url, work, mode, args.cold_words) for mode in modes}
    for mode, records in results.items():
        console.print(records_table(mode, records))
    console.print(summary_table(results))
    console.print(f"[dim]timing logs: {work}/slotwise-*/timing.jsonl; llama-server log: "
                  f"{work}/llama-server.log[/dim]")
    return 0


def summary_table(results: dict[str, list[dict[str, Any]]]) -> Table:
    table = Table(title="side by side: what the other users felt while dan's history was read")
    table.add_column("figure")
    for mode in results:
        table.add_column(f"prefill {mode}", justify="right")
    Figure = Callable[[list[dict[str, Any]]], float | None]
    rows: dict[str, Figure] = {
        "streams' rate during the cold prompt (tok/s)": lambda rs: _min(
            rate_during_cold(r) for r in rs if r.get("client") in ("ann", "bob", "cho")),
        "streams' longest gap (ms)": lambda rs: _max(
            r.get("gap_max_ms") for r in rs if r.get("client") in ("ann", "bob", "cho")),
        "short turns' time to first token (ms, worst)": lambda rs: _max(
            r.get("ttft_ms") for r in rs if r.get("client") == "eve"),
        "cold turn's time to first token (ms)": lambda rs: _max(
            r.get("ttft_ms") for r in rs if r.get("client") == "dan"),
    }
    for name, figure in rows.items():
        table.add_row(name, *(_n(figure(records)) for records in results.values()))
    return table


def _min(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _max(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
