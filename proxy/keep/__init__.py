"""Keeping each conversation's KV across days (docs/keep-kv.md): llama-server saves an idle slot's KV
to a file (`--slot-save-path`), and a returning conversation's file is restored into an idle slot
instead of recomputing its history.

It owns the pure store (`store`, `budget`, `values`: where each conversation's KV is, which files to
keep, what to save, restore and delete), the index of the files on disk (`index`), the startup probe
(`probe`), the `Keeper` that applies the store's decisions (`keeper`: `/slots`, save, restore,
files), the records of saves and restores (`record`), and the feature that wires it (`feature`:
the prefill gate's `keep` hook, /metrics, the status page).
"""
