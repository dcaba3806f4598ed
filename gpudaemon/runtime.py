"""Process settings a program applies to itself at start, so that a run from source
behaves as the image does."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENAS = 2


def cap_malloc_arenas(arenas: int = ARENAS) -> bool:
    """At most `arenas` glibc malloc arenas for the threads started after this call: the
    per-thread arenas are most of what the agent's few threads cost in RSS (1.6 to 2.2
    MiB, bench/memory). The image also sets MALLOC_ARENA_MAX; a value set there (or
    anywhere in the environment) is left alone. False where it does not apply (musl, no
    libc found)."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_ARENA_MAX, arenas))
