"""The InfluxDB write through influxdb-client's own write endpoint (`WriteService`, the
generated API its WriteApi posts through, on its `ApiClient`): one call sends one body
of line protocol and either returns or raises. Failures become InfluxWriteError with a
`kind` that is also the writer's metric label.

The client's batching, retry buffer and jitter (WriteApi, over reactivex) are not used:
the writer and its SQLite spool decide what is sent and when (the spool is what survives
an outage or a restart), so here retries are off and every failure is reported at once.
Going to the WriteService skips `InfluxDBClient`, which imports every query, task and
bucket API and their models: with the lazy package `__init__`s (gpudaemon/lazyimport.py)
history costs 1.2 MiB of imports instead of 13 (docs/benchmarks.md, bench/memory).
Imported only when `influxdb.url` is set (`agent/app.py` imports the writer lazily):
with history off, `influxdb_client` is never loaded (tests/unit/history/test_imports.py).
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
    """influxdb-client's WriteService on its ApiClient, set up as `InfluxDBClient` sets
    them up, its errors classified. The token goes as `Authorization: Token ...`
    (InfluxDB 1.8 takes `user:password` there); credentials in the URL
    (`http://user:password@host`, as curl reads them) become HTTP Basic auth and leave
    the URL, unless a token is given, which wins."""

    def __init__(self, url: str, token: str, org: str, bucket: str, timeout_ms: int) -> None:
        import base64

        import certifi

        from gpudaemon import lazyimport

        lazyimport.install()
        from influxdb_client._sync.api_client import ApiClient
        from influxdb_client.configuration import Configuration
        from influxdb_client.service.write_service import WriteService

        parts = urllib.parse.urlsplit(url)
        user, password = parts.username, parts.password
        if user is not None:  # never sent in the request line; the header carries it
            parts = parts._replace(netloc=parts.netloc.rpartition("@")[2])
        basic = not token and user is not None
        if basic:
            secret = f"{urllib.parse.unquote(user or '')}:{urllib.parse.unquote(password or '')}"
            header = "Basic " + base64.b64encode(secret.encode()).decode()
        else:
            header = "Token " + token
        self._bucket, self._org = bucket, org
        conf = Configuration()  # type: ignore[no-untyped-call]
        conf.host = urllib.parse.urlunsplit(parts).rstrip("/")
        conf.timeout = timeout_ms
        # One connection: the history job is the only writer. certifi's bundle for
        # https, the one this client trusted before 1.50.
        conf.connection_pool_maxsize = 1
        conf.ssl_ca_cert = certifi.where() if parts.scheme == "https" else None
        # retries=False: a retry would block the history job past timeout_ms; the
        # spool is our retry.
        self._api = ApiClient(  # type: ignore[no-untyped-call]
            configuration=conf, header_name="Authorization", header_value=header, retries=False
        )
        self._service = WriteService(self._api)  # type: ignore[no-untyped-call]

    def write(self, body: bytes) -> None:
        try:
            self._service.post_write(  # type: ignore[no-untyped-call]
                org=self._org,
                bucket=self._bucket,
                body=body,
                precision="ms",
                async_req=False,
                content_type="text/plain; charset=utf-8",
            )
        except Exception as e:
            raise _client_error(e) from None

    def close(self) -> None:
        self._api.__del__()  # type: ignore[no-untyped-call]  # its pool; close() is async-only


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
