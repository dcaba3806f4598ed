"""The eviction rate limit: a sliding one-minute window, overall and per node."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any


class RateLimit:
    """At most `per_minute` evictions in any 60 s, and `per_node` on one node. The
    window is kept in the leader Lease (`export`/`load`, wall-clock seconds), so neither
    a restart nor a new leader starts it afresh."""

    def __init__(self, per_minute: int, per_node: int, clock: Callable[[], float]) -> None:
        self.per_minute, self.per_node, self.clock = per_minute, per_node, clock
        self._done: deque[tuple[float, str]] = deque()

    def _prune(self) -> None:
        now = self.clock()
        while self._done and now - self._done[0][0] >= 60.0:
            self._done.popleft()

    def room(self, node: str) -> tuple[int, int]:
        self._prune()
        on_node = sum(1 for _, n in self._done if n == node)
        return self.per_minute - len(self._done), self.per_node - on_node

    def allows(self, node: str, count: int = 1) -> bool:
        total, node_room = self.room(node)
        return count <= total and count <= node_room

    def record(self, node: str) -> None:
        self._done.append((self.clock(), node))

    def forget(self, node: str) -> None:
        """Take back the newest record for `node` (an eviction that did not happen)."""
        for i in range(len(self._done) - 1, -1, -1):
            if self._done[i][1] == node:
                del self._done[i]
                return

    def export(self, wall_now: float) -> list[list[Any]]:
        self._prune()
        now = self.clock()
        return [[round(wall_now - (now - t), 3), n] for t, n in self._done]

    def load(self, entries: Iterable[Any], wall_now: float) -> None:
        """Add another holder's window (wall times); entries we hold already, or that
        are malformed, are left out."""
        now = self.clock()
        have = {(round(w, 3), n) for w, n in self.export(wall_now)}
        merged = list(self._done)
        for e in entries:
            if not (isinstance(e, list) and len(e) == 2 and isinstance(e[1], str)
                    and isinstance(e[0], int | float)):  # fmt: skip
                continue
            # Another replica's wall clock: one running ahead must not hold the window
            # shut for longer than a minute from now.
            w, n = round(min(float(e[0]), wall_now), 3), e[1]
            if (w, n) not in have and wall_now - w < 60.0:
                merged.append((now - (wall_now - w), n))
        self._done = deque(sorted(merged))
