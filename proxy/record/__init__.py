"""What slotwise knows about each request: the facts of one request in flight (`flight`), who is in
flight now (`inflight`), the clock readings (`timing`), the typed record made at its end (`schema`)
and the log it is written to (`timing_log`); its kind (`kind`), the client's strings made safe
(`clientstrings`), its unique id (`ids`) and the node that served it (`node`). It imports nothing
from the request path, which builds on it.
"""
