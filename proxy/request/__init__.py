"""The request path: one HTTP request in, one upstream call, the response relayed back.

`handler` runs a request's trip; `intake` reads and rewrites its body; `relay` moves bytes;
`observer` turns what it sees (headers, stream events, a body, the end) into facts.
"""
