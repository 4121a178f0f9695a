"""The filler words of the made-up chat text that the demo, the benchmarks and the tests send: one
list, so every generator's prompts are of the same kind and their sizes compare. No real text is
needed; a seeded `random.Random` makes the same text every time.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

WORDS = (
    "river", "stone", "lantern", "quiet", "market", "harbor", "winter", "letter", "garden",
    "window", "bridge", "candle", "forest", "mirror", "silver", "thunder", "meadow", "orchard",
)


def filler(rng: random.Random, count: int, words: Sequence[str] = WORDS) -> str:
    """`count` words drawn with `rng`, separated by spaces."""
    return " ".join(rng.choice(words) for _ in range(count))
