"""InfluxDB write failures below HTTP, by what failed: urllib3 2.x's NewConnectionError
(a refused or unreachable connect) subclasses ConnectTimeoutError, yet it is no
timeout; a connect or read that times out is one. Both, as urllib3 raises them."""

from __future__ import annotations

import pytest
import urllib3

from gpudaemon.history.transport import _client_error


def refused() -> BaseException:
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as e:
            raise urllib3.exceptions.NewConnectionError(
                None,  # type: ignore[arg-type]
                f"Failed to establish a new connection: {e}",
            ) from e
    except urllib3.exceptions.NewConnectionError as outer:
        return urllib3.exceptions.MaxRetryError(None, "/api/v2/write", outer)  # type: ignore[arg-type]


def connect_timed_out() -> BaseException:
    inner = urllib3.exceptions.ConnectTimeoutError(None, "Connection to influx timed out")
    return urllib3.exceptions.MaxRetryError(None, "/api/v2/write", inner)  # type: ignore[arg-type]


def read_timed_out() -> BaseException:
    return urllib3.exceptions.ReadTimeoutError(None, "/api/v2/write", "read timed out")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "kind", "words"),
    [
        (refused(), "unreachable", "cannot connect"),
        (ConnectionRefusedError(111, "Connection refused"), "unreachable", "cannot connect"),
        (connect_timed_out(), "timeout", "timed out"),
        (read_timed_out(), "timeout", "timed out"),
    ],
    ids=["refused, as urllib3 2 raises it", "refused, the socket's", "connect timeout",
         "read timeout"],
)  # fmt: skip
def test_a_refused_connection_is_not_a_timeout(error: Exception, kind: str, words: str) -> None:
    assert isinstance(refused().reason, urllib3.exceptions.ConnectTimeoutError)  # type: ignore[attr-defined]
    e = _client_error(error)
    assert e.kind == kind and words in str(e), (e.kind, str(e))
