"""`slotwise bench kv`: what one long prompt held in one slot costs the other slots' decode steps,
and what erasing it gives back, on one shared KV (`-kvu`, the field report's layout) against a KV
per slot. Three streams generate on a fresh server (a few rounds); then a long prompt is computed
in slot 0, and three new streams generate while it is held there, after its slot is erased, and
after every slot is erased. Each phase's figure is the streams' decode step (llama-server's own
`predicted_per_token_ms`, their mean), and held ÷ before, after ÷ before.

On the testbed (docs/benchmarks.md): with a 12,309-token prompt held, one shared KV's steps cost
about a third more, and most of it comes back once it is erased; a KV per slot's do not change.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

from proxy.bench.harness import temp_dir
from proxy.bench.output import figures_table, print_table
from proxy.testbed.args import positive_int
from proxy.testbed.model import write_model
from proxy.testbed.server import LlamaServer
from proxy.testbed.words import filler

LAYOUTS: dict[str, tuple[str, ...]] = {
    "shared": ("-np", "4", "-kvu", "-c", "40960", "--cache-ram", "0"),
    "per-slot": ("-np", "4", "-c", "65536", "--cache-ram", "0"),
}
"""Four slots either way; a KV per slot of 16,384 cells holds the long prompt. No RAM prompt cache:
an erased slot's cells are gone, not copied."""
STREAM_SLOTS = (1, 2, 3)
LONG_SLOT = 0


@dataclass(frozen=True)
class KvFigures:
    """One layout's decode steps (ms), before and after the long prompt."""

    layout: str
    before_ms: list[float]
    long_tokens: int
    long_ms: float
    held_ms: float
    slot_erased_ms: float
    all_erased_ms: float

    @property
    def before(self) -> float:
        return statistics.median(self.before_ms)

    @property
    def held_x(self) -> float:
        """While the long prompt is held, as × before."""
        return self.held_ms / self.before

    @property
    def after_x(self) -> float:
        """After every slot is erased, as × before: what stays behind."""
        return self.all_erased_ms / self.before


async def measure(url: str, *, long_words: int, stream_tokens: int, rounds: int, layout: str,
                  seed: int = 1) -> KvFigures:
    connector = aiohttp.TCPConnector(force_close=True)  # llama-server closes idle connections
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        async def complete(slot: int, prompt: str, n: int) -> dict[str, Any]:
            body = {"prompt": prompt, "n_predict": n, "id_slot": slot, "cache_prompt": True,
                    "ignore_eos": True, "temperature": 0.8}
            async with http.post(url + "/completion", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"llama-server answered {response.status} to a "
                                       f"{len(prompt)}-character prompt in slot {slot}")
                timings: dict[str, Any] = (await response.json())["timings"]
                return timings

        async def streams(tag: str) -> float:
            done = await asyncio.gather(*(complete(s, f"{tag} {s}: tell me a long story.",
                                                   stream_tokens) for s in STREAM_SLOTS))
            return statistics.mean(float(t["predicted_per_token_ms"]) for t in done)

        async def erase(*slots: int) -> None:
            for slot in slots:
                async with http.post(f"{url}/slots/{slot}?action=erase") as response:
                    if response.status != 200:
                        raise RuntimeError(f"llama-server answered {response.status} to erasing "
                                           f"slot {slot}: {(await response.text())[:200]}")

        before = []
        for n in range(rounds):
            before.append(await streams(f"before {n}"))
            await erase(*STREAM_SLOTS)
        long = await complete(LONG_SLOT, filler(random.Random(seed), long_words), 1)
        held = await streams("held")
        await erase(LONG_SLOT)
        slot_erased = await streams("slot erased")
        await erase(LONG_SLOT, *STREAM_SLOTS)
        all_erased = await streams("all erased")
    return KvFigures(layout, before, int(long["prompt_n"]), float(long["prompt_ms"]), held,
                     slot_erased, all_erased)


def run_layouts(layouts: Sequence[str], *, long_words: int, stream_tokens: int, rounds: int,
                binary: Path | None = None, model: Path | None = None,
                say: Callable[[str], None] = print) -> list[KvFigures]:
    """Each layout on a llama-server of its own (`model`, else the testbed small model), one after
    the other."""
    work = temp_dir("slotwise-bench-kv-")
    gguf = model if model is not None else write_model(work / "model", "small", seed=0).model
    (work / "slots").mkdir()
    out = []
    for name in layouts:
        args = (*LAYOUTS[name], "--slot-save-path", str(work / "slots"))  # the erase action needs it
        say(f"llama-server {' '.join(args)} …")
        with LlamaServer(gguf, args=args, binary=binary,
                         log_path=work / f"llama-server-{name}.log") as server:
            out.append(asyncio.run(measure(server.url, long_words=long_words,
                                           stream_tokens=stream_tokens, rounds=rounds,
                                           layout=name)))
    say(f"llama-server logs in {work}")
    return out


# ---- the command --------------------------------------------------------------------------------

def add_kv(commands: Any) -> None:
    kv = commands.add_parser(
        "kv", help="what one long prompt held in a slot costs the others' decode steps, and "
                   "what erasing it gives back: one shared KV against a KV per slot")
    kv.add_argument("--long-words", type=positive_int, default=2600,
                    help="the long prompt in words (default 2600, about 12,300 tokens)")
    kv.add_argument("--stream-tokens", type=positive_int, default=256,
                    help="tokens each of the three streams generates (default 256)")
    kv.add_argument("--rounds", type=positive_int, default=3,
                    help="rounds of streams before the long prompt (default 3)")
    kv.add_argument("--layouts", default=",".join(LAYOUTS),
                    help=f"comma-separated, of {', '.join(LAYOUTS)} (default both)")
    kv.add_argument("--repeat", type=positive_int, default=1,
                    help="measure everything this many times, fresh servers each time")
    kv.add_argument("--json", action="store_true", help="also print the figures as JSON")
    kv.set_defaults(handler=run_kv)


def run_kv(args: argparse.Namespace) -> int:
    layouts = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in layouts if n not in LAYOUTS]
    if unknown or not layouts:
        print(f"slotwise: --layouts: unknown layout {', '.join(unknown) or '(none given)'} "
              f"(valid: {', '.join(LAYOUTS)})", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    runs = []
    for n in range(args.repeat):
        if args.repeat > 1:
            console.print(f"[dim]run {n + 1} of {args.repeat}[/dim]")
        figures = run_layouts(layouts, long_words=args.long_words,
                              stream_tokens=args.stream_tokens, rounds=args.rounds,
                              say=lambda line: console.print(f"[dim]{line}[/dim]", markup=True))
        print_table(table(figures))
        runs.append(figures)
    if args.json:
        print(orjson.dumps([[{**asdict(f), "held_x": f.held_x, "after_x": f.after_x} for f in run]
                            for run in runs],
                           option=orjson.OPT_INDENT_2).decode())
    return 0


def table(figures: Sequence[KvFigures]) -> Table:
    grid = figures_table("three streams' decode step (ms) beside one long prompt held, and after")
    grid.add_column("phase")
    for f in figures:
        grid.add_column(f.layout, justify="right")
    rows: list[tuple[str, Callable[[KvFigures], str]]] = [
        ("before (median of rounds)", lambda f: f"{f.before:.2f}"),
        ("long prompt: tokens / s", lambda f: f"{f.long_tokens:,} / {f.long_ms / 1000:.1f}"),
        ("while it is held in its slot", lambda f: f"{f.held_ms:.2f}"),
        ("  as × before", lambda f: f"{f.held_x:.2f} ×"),
        ("after its slot is erased", lambda f: f"{f.slot_erased_ms:.2f}"),
        ("after every slot is erased", lambda f: f"{f.all_erased_ms:.2f}"),
        ("  as × before", lambda f: f"{f.after_x:.2f} ×"),
    ]
    for label, cell in rows:
        grid.add_row(label, *(cell(f) for f in figures))
    return grid
