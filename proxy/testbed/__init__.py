"""The testbed: a real llama-server binary (`binary`), a random-weight model the project writes
itself (`model`), and a runner that starts the one with the other on 127.0.0.1 (`server`), for
tests, benchmarks and demos; and what they share: the filler words of made-up prompts (`words`) and
the TOML writer of generated configs (`toml`). Import from the submodules; this file stays empty so
the CLI is fast.
"""
