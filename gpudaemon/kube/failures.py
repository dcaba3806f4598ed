"""What a failed Kubernetes request was, in our words: an HTTP failure as our
`KubeError` type with the server's message, and a failure below HTTP (TLS, time-outs,
lost connections) as one line an operator can act on. No client library is imported
here (urllib3's exception types only, lazily): kube/client.py maps with these."""

from __future__ import annotations

import http.client
import ssl
from collections.abc import Iterator

from gpudaemon.errors import (
    KubeConflictError,
    KubeError,
    KubeForbiddenError,
    KubeGoneError,
    KubeInvalidError,
    KubeNotFoundError,
    KubeUnavailableError,
    http_failure_kind,
    root_cause,
    server_message,
)

_ERROR_TYPES: dict[str, type[KubeError]] = {
    "unauthorized": KubeForbiddenError,
    "not_found": KubeNotFoundError,
    "conflict": KubeConflictError,
    "gone": KubeGoneError,
    "rejected": KubeInvalidError,
    "unavailable": KubeUnavailableError,
}


def error_for(status: int | None, method: str, path: str, body: bytes | str | None) -> KubeError:
    """An HTTP failure as our error type, with the server's own message."""
    msg = f"{method} {path}: HTTP {status}: {server_message(body)}"
    return _ERROR_TYPES[http_failure_kind(status)](msg, status)


def _chain(e: BaseException) -> Iterator[BaseException]:
    """`e` and what it wraps, breadth first: urllib3's `reason`, the exception it was
    raised from or during (the official client raises ApiException while handling an
    SSLError), an exception among its arguments (ProtocolError's)."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo and len(seen) < 16:
        x = todo.pop(0)
        if id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        for nxt in (getattr(x, "reason", None), x.__cause__, x.__context__, *x.args):
            if isinstance(nxt, BaseException):
                todo.append(nxt)


def describe_failure(e: BaseException, ca_source: str = "the kubeconfig's CA") -> str:
    """What went wrong below HTTP, in one line an operator can act on: TLS (with the
    likely cause when the certificate did not verify), a timeout, a refused or lost
    connection, or the library's own words, whitespace folded and bounded."""
    import urllib3

    chain = list(_chain(e))
    verify = [x for x in chain if isinstance(x, ssl.SSLCertVerificationError)]
    if verify or any("CERTIFICATE_VERIFY_FAILED" in str(x) for x in chain):
        detail = str(getattr(verify[0], "verify_message", "") or "") if verify else ""
        why = "certificate verify failed" + (f": {_one_line(detail)}" if detail else "")
        return f"TLS: {why} ({ca_source} does not match the server)"
    for x in chain:
        if isinstance(x, ssl.SSLError | urllib3.exceptions.SSLError):
            return f"TLS: {_one_line(x)}"
    # Refused before timed out: urllib3 2.x's NewConnectionError (what a refused or
    # unreachable connect raises) subclasses ConnectTimeoutError, for history's sake.
    for x in chain:
        if isinstance(x, ConnectionRefusedError):
            return "connection refused"
    for x in chain:
        if isinstance(x, urllib3.exceptions.NewConnectionError):
            continue
        if isinstance(x, urllib3.exceptions.ConnectTimeoutError):
            return "timed out connecting"
        if isinstance(x, urllib3.exceptions.ReadTimeoutError | TimeoutError):
            return "timed out waiting for the answer"
    for x in chain:
        if isinstance(x, urllib3.exceptions.NameResolutionError):
            return "cannot resolve the server's name"
        if isinstance(x, urllib3.exceptions.NewConnectionError):
            return f"cannot connect: {_one_line(x)}"
    for x in chain:
        if isinstance(x, ConnectionError | http.client.HTTPException):
            return f"connection lost: {type(x).__name__}"
    for x in chain:
        if isinstance(x, urllib3.exceptions.ProtocolError):
            return f"connection lost: {_one_line(x)}"
    return _one_line(root_cause(e))


def _one_line(e: object) -> str:
    text = str(e)
    if isinstance(e, BaseException) and not text:
        text = type(e).__name__
    return " ".join(text.split())[:200]
