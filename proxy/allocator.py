"""The process's C allocator: large buffers go back to the system as soon as they are freed.

A client's 8 MB body passes through a few buffers as large (the bytes read, the decoded text, the
body encoded again for llama-server). glibc's malloc serves a buffer over its mmap threshold with
a mapping of its own, returned on free; but the first such free raises the threshold to the freed
size (up to 32 MiB), so every later body of that size comes from the heap, whose freed middle is
never returned. Measured (issue 20, testbed): six 8 MB bodies left slotwise 25 MB larger for good,
its `[heap]` grown from 14 to 39 MB; with the threshold fixed, RSS came back to where it started.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("slotwise")

M_MMAP_THRESHOLD = -3
"""`mallopt`'s parameter number (glibc's malloc.h). Setting it also turns the dynamic threshold off."""
MMAP_THRESHOLD_BYTES = 256 * 1024
"""Every allocation from this size up is a mapping of its own, unmapped when freed: a body's
buffers, never a request's small objects (Python keeps those in its own 1 MiB arenas)."""


def return_large_buffers() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES; False where the C library is not glibc
    (musl, macOS: their allocators have no such threshold to raise) or refuses."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused: large buffers may stay in the heap")
        return False
    return True
