"""What a router in front of several slotwise nodes needs from each (docs/scale-out.md): the prompt's
token ids (`/v1/chat/completions/render` and the other render endpoints, for cache-aware routing),
a load figure that counts what only this node knows (`/get_load`), an honest `/health`, and a
response header naming the node (its name: `proxy/record/node.py`). slotwise never becomes a router
itself.

`load` is pure; `render`, `health` and `feature` do the I/O.
"""
