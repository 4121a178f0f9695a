"""Benchmarks that measure slotwise against a real llama-server, figures beside their baselines."""
