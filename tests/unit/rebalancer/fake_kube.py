"""An in-memory stand-in for the few API calls the rebalancer makes: Leases (with
resourceVersion conflicts, as the API server does them), Events and evictions."""

from __future__ import annotations

import copy
from typing import Any

from gpudaemon.errors import KubeConflictError, KubeNotFoundError, KubeUnavailableError


class FakeKube:
    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.evictions: list[tuple[str, bool]] = []  # (ns/name, dry run)
        self.refuse: set[str] = set()  # ns/name answered 429 (a PDB)
        self.patches: list[tuple[str, Any]] = []  # (pod name, merge patch)
        self.down = False
        self._rv = 0

    def request(
        self, method: str, path: str, body: Any = None, query: Any = None, **kw: Any
    ) -> dict[str, Any]:
        if self.down:
            raise KubeUnavailableError(f"{method} {path}: connection refused")
        parts = path.strip("/").split("/")
        if "leases" in parts:
            return self._lease(method, parts, body)
        if method == "PATCH":  # the reservation on a pending pod
            self.patches.append((parts[-1], body))
            return body
        if parts[-1] == "events":
            self.events.append(body)
            return body
        if parts[-1] == "eviction":
            key = f"{parts[-4]}/{parts[-2]}"
            if key in self.refuse:
                raise KubeUnavailableError("Cannot evict pod: disruption budget", 429)
            self.evictions.append((key, (query or {}).get("dryRun") == "All"))
            return {}
        raise AssertionError(f"unexpected call {method} {path}")

    def _lease(self, method: str, parts: list[str], body: Any) -> dict[str, Any]:
        if method == "GET":
            name = parts[-1]
            if name not in self.leases:
                raise KubeNotFoundError("not found", 404)
            return copy.deepcopy(self.leases[name])
        name = body["metadata"]["name"]
        if method == "POST" and name in self.leases:
            raise KubeConflictError("already exists", 409)
        if method == "PUT":
            have = self.leases.get(name)
            if have is None:
                raise KubeNotFoundError("not found", 404)
            if body["metadata"].get("resourceVersion") != have["metadata"]["resourceVersion"]:
                raise KubeConflictError("the object has been modified", 409)
        self._rv += 1
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = str(self._rv)
        self.leases[name] = stored
        return copy.deepcopy(stored)

    def reasons(self) -> list[str]:
        return [e["reason"] for e in self.events]
