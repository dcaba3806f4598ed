"""The plain-text answers and the /healthz and /readyz probes every program serves."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

WsgiApp = Callable[..., Iterable[bytes]]
StartResponse = Callable[..., Any]
Readiness = Callable[[], tuple[bool, str]]


def text_response(start_response: StartResponse, status: str, body: str) -> list[bytes]:
    data = body.encode()
    start_response(
        status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    )
    return [data]


def probe_response(
    path: str, ready: Readiness, start_response: StartResponse
) -> list[bytes] | None:
    """/healthz (alive: always 200) and /readyz (the program's own readiness, 503 with
    the reason until ready), the same for the agent and the extender; None otherwise."""
    if path == "/healthz":
        return text_response(start_response, "200 OK", "ok\n")
    if path == "/readyz":
        ok, why = ready()
        return text_response(
            start_response, "200 OK" if ok else "503 Service Unavailable", why + "\n"
        )
    return None
