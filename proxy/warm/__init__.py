"""Warm-ups: a conversation's known prompt computed into llama-server's cache in idle time, so the
user's turn, which adds a message to it, arrives warm (docs/warm.md).

It owns `POST /slotwise/warm/<endpoint>` and `GET`/`DELETE /slotwise/warm/<id>`, the queue that
decides which warm-up computes what and when (`queue`, pure, the lowest priority there is: never
while a real cold request is held or fed, at chunk's share while others generate), the stable
prefix of a body (`prefix`, pure), when a warm-up's next piece may start and where it ends
(`pieces`, pure; its size from the prefill policy's fitted batch cost), and the async `Warmer`
that feeds the pieces, ends a warm-up when a real request of the same conversation arrives (the
prefill gate's `warm` hook) and writes one record per warm-up.
"""
