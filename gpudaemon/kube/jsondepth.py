"""Decoding the API server's JSON when an object nests deeper than Python can.

Python's `json` recurses once per nested array or object and raises RecursionError at
about 1,000 levels; kube-apiserver stores up to 10,000. Any tenant can write that
much nesting into free-form JSON it owns (a ResourceClaim's or template's opaque
`parameters`: 10 KiB is 5,000 levels), and one such object would fail a whole list or
watch of its kind on every relist: the cache of every reader would freeze. So on a
RecursionError the text is decoded again with every value nested deeper than
`MAX_DEPTH` replaced by `null`: nothing we read sits that deep, and the other objects
(and the rest of this one) are read as they are.
"""

from __future__ import annotations

import json
import re
from typing import Any

from loguru import logger

from gpudaemon.logsetup import LogLimiter

MAX_DEPTH = 100  # a Kubernetes object's own fields nest about 15 deep
# A JSON string (skipped whole: brackets inside it are text) or a bracket.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_log = LogLimiter(every_s=600.0)


def loads(data: bytes | str, what: str = "") -> Any:
    """`json.loads`, but a value nested deeper than Python can decode reads as null
    (one line per ten minutes). Raises ValueError for text that is not JSON."""
    try:
        return json.loads(data)
    except RecursionError:
        pass
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    out = json.loads(flatten(text))
    if _log.allow():
        logger.warning(
            "{}: a value nested over {} levels deep was read as null (an object written "
            "to break JSON readers?)",
            what or "API answer",
            MAX_DEPTH,
        )
    return out


def flatten(text: str, max_depth: int = MAX_DEPTH) -> str:
    """`text` with each array or object that opens deeper than `max_depth` replaced by
    `null`. Iterative: no recursion, whatever the depth."""
    parts: list[str] = []
    depth, kept, start = 0, 0, -1
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok in ("[", "{"):
            depth += 1
            if depth == max_depth + 1:
                start = m.start()
        elif tok in ("]", "}"):
            if depth == max_depth + 1 and start >= 0:
                parts += [text[kept:start], "null"]
                kept, start = m.end(), -1
            depth -= 1
    # Unterminated: the deep part goes all the same, and json says the rest is not JSON.
    parts.append(text[kept:] if start < 0 else text[kept:start] + "null")
    return "".join(parts)
