"""The testbed: a real llama-server binary (`binary`), a random-weight model the project writes
itself (`model`), and a runner that starts the one with the other on 127.0.0.1 (`server`), for
tests, benchmarks and demos; and what they share: the filler words of made-up prompts (`words`), the
TOML writer of generated configs (`toml`), `slotwise serve` in a process of its own (`slotwise`) and
the command lines' argument types (`args`). It imports nothing from `proxy/bench/`, which builds on
it. Import from the submodules; this file stays empty so the CLI is fast.
"""
