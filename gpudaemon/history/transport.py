"""The InfluxDB write through influxdb-client's WriteApi in synchronous mode: one call
sends one body of line protocol and either returns or raises. Failures become
InfluxWriteError with a `kind` that is also the writer's metric label.

The client's own batching, retry buffer and jitter are not used: the writer and its
SQLite spool decide what is sent and when (the spool is what survives an outage or a
restart), so here retries are off and every failure is reported at once. Imported only
when `influxdb.url` is set (`agent/app.py` imports the writer lazily): with
history off, `influxdb_client` is never loaded (tests/unit/history/test_imports.py).
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any, Protocol

import urllib3
import urllib3.exceptions

from gpudaemon.errors import InfluxWriteError, http_failure_kind, root_cause, server_message


class Transport(Protocol):
    """Sends one body of line protocol (ms precision); raises InfluxWriteError."""

    def write(self, body: bytes) -> None: ...

    def close(self) -> None: ...


class ClientTransport:
    """influxdb-client's synchronous WriteApi, its errors classified. The token goes as
    `Authorization: Token ...` (InfluxDB 1.8 takes `user:password` there); credentials
    in the URL (`http://user:password@host`, as curl reads them) become HTTP Basic auth
    and leave the URL, unless a token is given, which wins."""

    def __init__(self, url: str, token: str, org: str, bucket: str, timeout_ms: int) -> None:
        import certifi
        from influxdb_client.client.influxdb_client import InfluxDBClient
        from influxdb_client.client.write_api import SYNCHRONOUS
        from influxdb_client.domain.write_precision import WritePrecision

        parts = urllib.parse.urlsplit(url)
        user, password = parts.username, parts.password
        if user is not None:  # never sent in the request line; the header carries it
            parts = parts._replace(netloc=parts.netloc.rpartition("@")[2])
        basic = not token and user is not None
        if basic:
            token = f"{urllib.parse.unquote(user or '')}:{urllib.parse.unquote(password or '')}"
        self._bucket, self._org = bucket, org
        self._precision: Any = WritePrecision.MS
        # retries=False: a retry would block the history job past timeout_ms; the
        # spool is our retry. One connection: the history job is the only writer.
        # certifi's bundle for https, the one this client trusted before 1.50.
        self._client = InfluxDBClient(
            url=urllib.parse.urlunsplit(parts).rstrip("/"),
            token=token,
            org=org,
            timeout=timeout_ms,
            retries=False,
            auth_basic=basic,
            connection_pool_maxsize=1,
            ssl_ca_cert=certifi.where() if parts.scheme == "https" else None,
        )
        self._write = self._client.write_api(write_options=SYNCHRONOUS)

    def write(self, body: bytes) -> None:
        try:
            self._write.write(self._bucket, self._org, body, self._precision)
        except Exception as e:
            raise _client_error(e) from None

    def close(self) -> None:
        self._write.close()  # type: ignore[no-untyped-call]
        self._client.close()  # type: ignore[no-untyped-call]


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


def _client_error(e: Exception) -> InfluxWriteError:
    """The client's ApiException with an HTTP status as that status's kind; one with
    none (status 0: the client's word for a TLS failure) and urllib3's and the socket's
    errors by what failed below HTTP."""
    from influxdb_client.rest import ApiException

    if isinstance(e, ApiException) and e.status:
        return _http_error(e.status, e.reason, _body(e))
    if isinstance(e, ApiException):
        reason = " ".join(str(e.reason or "no answer").split())
        return InfluxWriteError("unreachable", reason[:200])
    return _transport_error(e)


def _body(e: Any) -> bytes | str:
    body = getattr(e, "body", None)
    return body if isinstance(body, bytes | str) else ""


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
