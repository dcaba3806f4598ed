"""The InfluxDB write endpoint (`POST /api/v2/write`, which InfluxDB 2.x and 1.8+
serve) over urllib3. Failures become InfluxWriteError with a `kind` that is also the
writer's metric label.

Not through influxdb-client at run time: importing any part of it loads its whole
generated API (10.5 MiB of RSS, an eighth of the agent's 80 MiB budget) for what is one
POST of line protocol, which lines.py already makes. The tests still query InfluxDB
with influxdb-client, so what the agent writes is read back by the official client."""

from __future__ import annotations

import re
import urllib.parse
from typing import Protocol

import urllib3
import urllib3.exceptions

from gpudaemon.errors import InfluxWriteError, http_failure_kind, root_cause, server_message


class Transport(Protocol):
    """Sends one body of line protocol (ms precision); raises InfluxWriteError."""

    def write(self, body: bytes) -> None: ...

    def close(self) -> None: ...


class ClientTransport:
    """One synchronous POST per write, with its errors classified. The request is the
    one influxdb-client's write API sends: the token as `Authorization: Token ...`
    (InfluxDB 1.8 takes `user:password` there), org, bucket and precision=ms in the
    query, line protocol as the body."""

    def __init__(self, url: str, token: str, org: str, bucket: str, timeout_ms: int) -> None:
        query = urllib.parse.urlencode({"org": org, "bucket": bucket, "precision": "ms"})
        parts = urllib.parse.urlsplit(url)
        user, password = parts.username, parts.password
        if user is not None:  # never sent in the request line; the header carries it
            parts = parts._replace(netloc=parts.netloc.rpartition("@")[2])
        self._url = f"{urllib.parse.urlunsplit(parts).rstrip('/')}/api/v2/write?{query}"
        self._headers = {
            "Content-Type": "text/plain; charset=utf-8",
            "Accept": "application/json",
            "User-Agent": "gpudaemon",
        }
        if token:
            self._headers["Authorization"] = f"Token {token}"
        elif user is not None:
            # http://user:password@host, as curl reads it: HTTP Basic auth (InfluxDB
            # 1.8 takes its users' passwords so; a token, when given, wins).
            self._headers.update(
                urllib3.make_headers(
                    basic_auth=f"{urllib.parse.unquote(user)}:"
                    f"{urllib.parse.unquote(password or '')}"
                )
            )
        # retries=False: a retry would block the history job past timeout_ms; the
        # spool is our retry. One connection: the history job is the only writer.
        tls: dict[str, str] = {}
        if url.startswith("https:"):
            import certifi  # the CA bundle influxdb-client trusted (a kubernetes dependency)

            tls["ca_certs"] = certifi.where()
        self._pool = urllib3.PoolManager(
            num_pools=1,
            maxsize=1,
            retries=False,
            timeout=urllib3.Timeout(total=timeout_ms / 1000),
            **tls,  # type: ignore[arg-type]
        )

    def write(self, body: bytes) -> None:
        try:
            r = self._pool.request(
                "POST", self._url, body=body, headers=self._headers, preload_content=True
            )
        except Exception as e:
            raise _transport_error(e) from None
        if r.status >= 300:
            raise _http_error(r.status, r.reason, r.data[: 1 << 20])

    def close(self) -> None:
        self._pool.clear()


# The shared HTTP failure kinds, as this writer's metric labels (kept from before).
_KINDS = {
    "unauthorized": "unauthorized",
    "not_found": "not_found",  # InfluxDB 1.x: database not found; 2.x: bucket not found
    "conflict": "rejected",
    "gone": "rejected",
    "rejected": "rejected",
    "unavailable": "server",
}


def _http_error(status: int | None, reason: str | None, message: object) -> InfluxWriteError:
    body = message if isinstance(message, bytes | str) else str(message or "")
    text = server_message(body, limit=1 << 20)
    detail = text[:200]
    # "dropped=N" (how many points of a partial write InfluxDB refused) is what the
    # writer counts by; keep it even when the message is cut. So is whether some lines
    # could not be parsed (those are not counted in dropped=N).
    if "unable to parse" in text and "unable to parse" not in detail:
        detail += " ... unable to parse"
    dropped = re.search(r"\bdropped=\d+", text)
    if dropped and dropped.group() not in detail:
        detail += f" ... {dropped.group()}"
    kind = _KINDS[http_failure_kind(status)]
    return InfluxWriteError(kind, f"HTTP {status} {reason or ''}".rstrip() + f": {detail}")


def _transport_error(e: Exception) -> InfluxWriteError:
    cause = root_cause(e)
    # NewConnectionError subclasses ConnectTimeoutError for history's sake: test it first.
    if isinstance(cause, urllib3.exceptions.NewConnectionError | ConnectionError):
        return InfluxWriteError("unreachable", f"cannot connect: {cause}")
    if isinstance(cause, TimeoutError | urllib3.exceptions.TimeoutError):
        return InfluxWriteError("timeout", f"timed out: {cause}")
    if isinstance(cause, OSError | urllib3.exceptions.HTTPError):
        return InfluxWriteError("unreachable", f"{type(cause).__name__}: {cause}")
    return InfluxWriteError("server", f"{type(cause).__name__}: {cause}")


class Scrubber:
    """Replaces the secrets of a URL's userinfo and the token with *** in text that
    came from elsewhere (an exception's message) before it is logged."""

    def __init__(self, url: str, token: str) -> None:
        secrets: set[str] = set()
        try:
            parts = urllib.parse.urlsplit(url)
            userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
        except ValueError:
            userinfo = ""
        for s in (userinfo, userinfo.partition(":")[2], token, token.partition(":")[2]):
            if s:
                secrets.add(s)
                secrets.add(urllib.parse.unquote(s))
                secrets.add(urllib.parse.quote(s, safe=""))
        # Longest first, so a password inside the userinfo is not left half-replaced.
        self._secrets = sorted(secrets, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text
