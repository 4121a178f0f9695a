"""`proxy/allocator.py`: after large buffers are freed, RSS comes back (glibc's dynamic mmap
threshold would keep them in the heap). Each case runs in a fresh interpreter: the allocator's
state is the process's."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import sys
from proxy.allocator import return_large_buffers

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024

if sys.argv[1] == "fixed":
    assert return_large_buffers()
start = rss_mb()
first = b"x" * (8 << 20)  # a mapping of its own; freeing it raises glibc's threshold to 8 MB
del first
for _ in range(3):  # three bodies' buffers, then small allocations above them in the heap
    bodies = [b"x" * (8 << 20) for _ in range(3)]
    small = [bytes(2000 + i) for i in range(50)]
    del bodies
print(rss_mb() - start)
"""

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


def grown_mb(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    return int(done.stdout)


def test_freed_body_buffers_go_back_to_the_system() -> None:
    assert grown_mb("default") >= 16  # what glibc does on its own: 24 MB kept for good
    assert grown_mb("fixed") <= 4
