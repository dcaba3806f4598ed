"""The reset grant: the Node annotation `<prefix>gpu-reset` by which the rebalancer
(the one place that sees the fleet: its concurrency limit, its circuit breaker) lets the
node's agent reset one GPU. One value per Node, so never two resets on one node.

Only the rebalancer's identity may set it and only the node's agent may remove it
(the chart's admission policies); both treat what they read as hostile: bounded,
typed, one `BadValueError` otherwise."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpudaemon.errors import BadValueError
from gpudaemon.labels.annotations import bounded_json

GRANT_ANNOTATION = "gpu-reset"  # under the label prefix
MAX_GRANT_BYTES = 1024


@dataclass(frozen=True)
class Grant:
    uuid: str  # the GPU to reset
    index: int
    granted_at: float  # UNIX seconds, the rebalancer's clock
    until: float  # after this the grant is void and its slot free

    def encode(self) -> str:
        return json.dumps(
            {"uuid": self.uuid, "index": self.index, "granted_at": round(self.granted_at, 3),
             "until": round(self.until, 3)},
            separators=(",", ":"),
        )  # fmt: skip

    @property
    def id(self) -> str:
        """Tells one grant from the next for the same GPU."""
        return f"{self.uuid}@{self.granted_at:.3f}"


def parse(text: object, key: str) -> Grant:
    """The grant in `text`; BadValueError for anything else."""
    doc = bounded_json(text, key, MAX_GRANT_BYTES, 2)
    if not isinstance(doc, dict):
        raise BadValueError(key, "not an object")
    uuid, index = doc.get("uuid"), doc.get("index")
    at, until = doc.get("granted_at"), doc.get("until")
    if not isinstance(uuid, str) or not 0 < len(uuid) <= 96:
        raise BadValueError(key, "uuid is not a GPU UUID")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1024:
        raise BadValueError(key, "index is not a GPU index")
    for name, v in (("granted_at", at), ("until", until)):
        if not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v < 1e11:
            raise BadValueError(key, f"{name} is not a time")
    assert isinstance(at, int | float) and isinstance(until, int | float)
    return Grant(uuid, index, float(at), float(until))


def of_node(node: Mapping[str, Any], key: str) -> Grant | None:
    """The grant on a Node object, None when there is none; BadValueError when there is
    one that does not read."""
    raw = ((node.get("metadata") or {}).get("annotations") or {}).get(key)
    if raw is None or raw == "":
        return None
    return parse(raw, key)
