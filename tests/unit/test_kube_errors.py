"""Every failure below HTTP is one line of ours (issue 28): the client library's and the
socket's exceptions (TLS, timeouts, refused or lost connections, the official client's
ApiException) become a KubeUnavailableError naming the server, the request and what
failed; a body the API server would refuse for its size is refused here; an insecure
kubeconfig is one WARNING, not urllib3's warning on every request. The same against a
real kube-apiserver with another CA: tests/integration/kube/test_client_errors.py."""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import warnings
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException
from loguru import logger

from gpudaemon.errors import KubeInvalidError, KubeUnavailableError
from gpudaemon.kube import client as kube
from gpudaemon.kube.client import KubeClient, describe_failure

VERIFY = "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate"


def as_the_official_client_raises_it(e: BaseException) -> ApiException:
    """kubernetes.client.rest turns urllib3's SSLError into ApiException(status=0)
    while handling it: the cause is only in the context."""
    try:
        try:
            raise e
        except urllib3.exceptions.SSLError as inner:
            raise ApiException(status=0, reason=f"SSLError\n{inner}") from None
    except ApiException as outer:
        outer.__context__ = e
        return outer


def tls_verify(detail: str = "") -> BaseException:
    e = ssl.SSLCertVerificationError(1, VERIFY)
    if detail:
        e.verify_message = detail  # what ssl sets from the handshake
    return urllib3.exceptions.SSLError(e)


def refused() -> BaseException:
    """What urllib3 2.x raises for a closed port: NewConnectionError from the OSError."""
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as e:
            raise urllib3.exceptions.NewConnectionError(
                None,  # type: ignore[arg-type]
                f"Failed to establish a new connection: {e}",
            ) from e
    except urllib3.exceptions.NewConnectionError as outer:
        return outer


def connect_timed_out() -> BaseException:
    """... and for a connect that times out: ConnectTimeoutError from the socket's."""
    try:
        try:
            raise TimeoutError("timed out")
        except TimeoutError as e:
            raise urllib3.exceptions.ConnectTimeoutError(None, "Connection timed out") from e
    except urllib3.exceptions.ConnectTimeoutError as outer:
        return outer


CASES: list[tuple[str, BaseException, str]] = [
    ("tls, as the official client raises it", as_the_official_client_raises_it(tls_verify()),
     "TLS: certificate verify failed (the kubeconfig's CA does not match the server)"),
    ("tls, with the handshake's reason",
     as_the_official_client_raises_it(tls_verify("self-signed certificate in certificate chain")),
     "TLS: certificate verify failed: self-signed certificate in certificate chain "
     "(the kubeconfig's CA does not match the server)"),
    ("tls, as urllib3 raises it", tls_verify(),
     "TLS: certificate verify failed (the kubeconfig's CA does not match the server)"),
    ("tls, another failure", urllib3.exceptions.SSLError(ssl.SSLError(1, "[SSL] wrong version")),
     "TLS: [SSL] wrong version"),
    ("max retries around tls", urllib3.exceptions.MaxRetryError(None, "/", tls_verify()),  # type: ignore[arg-type]
     "TLS: certificate verify failed (the kubeconfig's CA does not match the server)"),
    ("connect timeout", urllib3.exceptions.ConnectTimeoutError(None, "timed out"),
     "timed out connecting"),
    ("read timeout", urllib3.exceptions.ReadTimeoutError(None, "/", "read timed out"),  # type: ignore[arg-type]
     "timed out waiting for the answer"),
    ("refused", ConnectionRefusedError(111, "Connection refused"), "connection refused"),
    # urllib3 2.x: NewConnectionError subclasses ConnectTimeoutError, yet it is no timeout
    ("refused, as urllib3 2 raises it", urllib3.exceptions.MaxRetryError(None, "/", refused()),  # type: ignore[arg-type]
     "connection refused"),
    ("connect timeout, as urllib3 2 raises it",
     urllib3.exceptions.MaxRetryError(None, "/", connect_timed_out()),  # type: ignore[arg-type]
     "timed out connecting"),
    ("protocol", urllib3.exceptions.ProtocolError("Connection aborted.", BrokenPipeError(32, "x")),
     "connection lost: BrokenPipeError"),
    ("http.client", http.client.RemoteDisconnected("Remote end closed connection"),
     "connection lost: RemoteDisconnected"),
    ("anything else", ApiException(status=0, reason="Cannot prepare a request\n message"),
     "(0)\nReason: Cannot prepare a request\n message\n"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "error", "line"), CASES, ids=[c[0] for c in CASES])
def test_a_failure_below_http_is_one_line(case: str, error: BaseException, line: str) -> None:
    got = describe_failure(error)
    assert "\n" not in got and len(got) <= 200
    assert got == " ".join(line.split())


class Raising:
    """The official ApiClient's shape, failing every call with `error`."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.calls = 0
        self.configuration = type("C", (), {"host": "https://10.0.0.1:6443"})()

    def param_serialize(self, method: str, path: str, **kw: Any) -> tuple[Any, ...]:
        return method, path, {}, kw.get("body"), None

    def call_api(self, *a: Any, **kw: Any) -> Any:
        self.calls += 1
        raise self.error

    def close(self) -> None:
        pass


def test_the_client_raises_ours_naming_the_server_request_and_cause() -> None:
    client = KubeClient(Raising(as_the_official_client_raises_it(tls_verify())), 1.0)
    with pytest.raises(KubeUnavailableError) as e:
        client.request("GET", "/api/v1/nodes")
    assert str(e.value) == (
        "GET https://10.0.0.1:6443/api/v1/nodes: TLS: certificate verify failed "
        "(the kubeconfig's CA does not match the server)"
    )
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_a_watch_that_cannot_connect_raises_ours() -> None:
    client = KubeClient(Raising(ConnectionRefusedError(111, "refused")), 1.0)
    with pytest.raises(
        KubeUnavailableError,
        match=r"^GET https://10\.0\.0\.1:6443/api/v1/nodes: connection refused$",
    ):
        list(client.watch("/api/v1/nodes", "1", 1.0))


def test_a_body_over_the_api_servers_limit_is_refused_before_sending() -> None:
    api = Raising(AssertionError("must not be sent"))
    client = KubeClient(api, 1.0)
    big = {"metadata": {"annotations": {"x": "y" * (3 << 20)}}}
    with pytest.raises(KubeInvalidError, match="over the API server's 3145728 byte limit") as e:
        client.request("PATCH", "/api/v1/nodes/n1", big, kube.STRATEGIC_MERGE_PATCH)
    assert e.value.status == 413 and api.calls == 0
    with pytest.raises(KubeUnavailableError, match="must not be sent"):  # just under: sent
        client.request("PATCH", "/api/v1/nodes/n1", {"x": "y" * ((3 << 20) - 100)})
    assert api.calls == 1


def insecure_kubeconfig(tmp_path: Path, port: int = 1) -> Path:
    kc = tmp_path / "kc"
    kc.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:{port}',"
        " insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    return kc


def test_an_insecure_kubeconfig_is_one_warning_and_no_per_request_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube, "_insecure_warned", False)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING", format="{message}")
    try:
        kc = insecure_kubeconfig(tmp_path)
        for _ in range(3):
            KubeClient.from_credentials(kube.Credentials(False, str(kc)), 1.0).close()
    finally:
        logger.remove(sink)
    assert len(lines) == 1 and "insecure-skip-tls-verify" in lines[0], lines
    assert "https://127.0.0.1:1" in lines[0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn("per request", urllib3.exceptions.InsecureRequestWarning, stacklevel=1)
    assert seen == []


# -- against real sockets: what urllib3 raises, as it raises it ----------------------


def plain_kubeconfig(tmp_path: Path, port: int) -> Path:
    kc = tmp_path / "kc"
    kc.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    return kc


def real_client(tmp_path: Path, port: int) -> KubeClient:
    creds = kube.Credentials(False, str(plain_kubeconfig(tmp_path, port)))
    return KubeClient.from_credentials(creds, timeout_s=0.5, connect_timeout_s=0.5)


def failure_of(tmp_path: Path, port: int) -> str:
    """The one line a GET to `port` fails with, through the real client."""
    client = real_client(tmp_path, port)
    try:
        with pytest.raises(KubeUnavailableError) as e:
            client.request("GET", "/api/v1/nodes")
    finally:
        client.close()
    return str(e.value)


def test_a_closed_port_is_reported_as_refused_not_timed_out(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: the kernel refuses at once
        got = failure_of(tmp_path, port)
    assert got == f"GET http://127.0.0.1:{port}/api/v1/nodes: connection refused"


def test_a_server_that_never_accepts_is_reported_as_timed_out_connecting(
    tmp_path: Path,
) -> None:
    """A black hole, made here: a listener whose accept queue is full drops every new
    SYN, so the connect times out as it would to an address nothing answers."""
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(socket.socket())
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        for _ in range(8):  # fill the queue until a connect hangs
            c = stack.enter_context(socket.socket())
            c.settimeout(0.2)
            try:
                c.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            pytest.skip("this kernel never dropped a SYN to a full accept queue")
        client = real_client(tmp_path, port)
        stack.callback(client.close)
        with pytest.raises(KubeUnavailableError) as e:
            client.request("GET", "/api/v1/nodes")
    assert str(e.value) == f"GET http://127.0.0.1:{port}/api/v1/nodes: timed out connecting"


def test_a_server_that_accepts_and_never_answers_is_reported_as_timed_out_waiting(
    tmp_path: Path,
) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)  # the kernel completes the handshake; nobody reads or answers
        port = srv.getsockname()[1]
        got = failure_of(tmp_path, port)
    assert got == f"GET http://127.0.0.1:{port}/api/v1/nodes: timed out waiting for the answer"
