"""The InfluxDB v2 write API over influxdb-client: the only module that imports
influxdb_client. Its exceptions become InfluxWriteError with a `kind` that is also
the writer's metric label."""

from __future__ import annotations

import re
import urllib.parse
from typing import Protocol

import urllib3.exceptions
from influxdb_client.client.influxdb_client import InfluxDBClient
from influxdb_client.client.write_api import SYNCHRONOUS
from influxdb_client.rest import ApiException

from gpudaemon.errors import InfluxWriteError, http_failure_kind, root_cause, server_message


class Transport(Protocol):
    """Sends one body of line protocol (ms precision); raises InfluxWriteError."""

    def write(self, body: bytes) -> None: ...

    def close(self) -> None: ...


class ClientTransport:
    """influxdb-client's synchronous write API, with its errors classified."""

    def __init__(self, url: str, token: str, org: str, bucket: str, timeout_ms: int) -> None:
        self.bucket = bucket
        self.org = org
        # retries=False: a retry would block the history job past timeout_ms; the
        # spool is our retry.
        self._client = InfluxDBClient(
            url=url, token=token, org=org, timeout=timeout_ms, retries=False
        )
        self._api = self._client.write_api(write_options=SYNCHRONOUS)

    def write(self, body: bytes) -> None:
        try:
            self._api.write(
                bucket=self.bucket,
                org=self.org,
                record=body,
                write_precision="ms",  # type: ignore[arg-type]
            )
        except ApiException as e:
            raise _http_error(e.status, e.reason, getattr(e, "message", "")) from None
        except Exception as e:
            raise _transport_error(e) from None

    def close(self) -> None:
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
