"""Mutual TLS for the extender's service mode: the context (a client certificate from
our CA required) and the channel that runs TLS in memory on waitress's loop."""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any, cast

from gpudaemon.errors import UsageError
from gpudaemon.httpserver.limits import _Channel
from gpudaemon.textfile import check_regular_file


class _TlsChannel(_Channel):
    """TLS in memory (ssl.MemoryBIO) on waitress's event loop: the handshake advances
    as bytes arrive, like every other read, so no thread ever waits on a client that
    connected and stayed silent, and the server's time-outs apply to it as they do to
    plain connections. The context requires a client certificate: without one from our
    CA the handshake fails and the connection closes before any byte reaches the app."""

    def __init__(self, server: Any, sock: socket.socket, addr: Any, adj: Any, map: Any = None):
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._tls = server.ssl_context.wrap_bio(self._in, self._out, server_side=True)
        self._done = False
        self._raw = bytearray()  # ciphertext the socket has not taken yet
        super().__init__(server, sock, addr, adj, map)

    def handshaken(self) -> bool:
        return self._done

    def writable(self) -> bool:
        return bool(self._raw) or bool(super().writable())

    def handle_read(self) -> None:
        try:
            raw = cast(socket.socket, self.socket).recv(self.adj.recv_bytes)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.handle_close()
            return
        if not raw:
            self.handle_close()
            return
        self._in.write(raw)
        plain = []
        try:
            if not self._done:
                self._tls.do_handshake()
                self._done = True
            while True:
                plain.append(self._tls.read(1 << 16))
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:  # the client's close_notify
            self.will_close = True
        except ssl.SSLError as e:
            cast(Any, self.server).refused(e)
            self._flush_raw()  # the alert, so the client learns why
            self.handle_close()
            return
        self._flush_raw()
        data = b"".join(plain)
        if data:
            self.last_activity = time.time()
            self.received(data)

    def send(self, data: bytes, do_close: bool = True) -> int:
        if self._raw:
            self._flush_raw(do_close)
            if self._raw:
                return 0
        try:
            n = int(self._tls.write(data))
        except ssl.SSLError:
            self.expire()
            return 0
        self._flush_raw(do_close)
        return n

    def _flush_raw(self, do_close: bool = True) -> None:
        self._raw += self._out.read()
        if not self._raw or self.socket is None:
            return
        try:
            sent = self.socket.send(self._raw)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._raw.clear()
            if do_close:
                self.handle_close()
            return
        del self._raw[:sent]

    def handle_write(self) -> None:
        # waitress's, except that "flushed" also means no ciphertext left to send: an
        # answer followed by a close (a 413, say) must reach the client whole.
        if self.expired:
            self.handle_close()
            return
        self._flush_raw()
        if self._raw:
            return
        me: Any = self  # (types-waitress leaves these out)
        if not self.requests:
            flush: Any = me._flush_some
        elif self.total_outbufs_len >= self.adj.send_bytes:
            flush = me._flush_some_if_lockable
        else:
            flush = None
        me._flush_exception(flush)
        if self._raw:
            return
        if self.close_when_flushed and not self.total_outbufs_len:
            self.close_when_flushed = False
            self.will_close = True
        if self.will_close:
            self.handle_close()


@dataclass(frozen=True)
class TlsFiles:
    """Server certificate and key, and the CA that client certificates must chain to."""

    cert_file: str
    key_file: str
    client_ca_file: str


def _server_context(tls: TlsFiles, name: str) -> ssl.SSLContext:
    for what, path in (
        ("tls.cert_file", tls.cert_file),
        ("tls.key_file", tls.key_file),
        ("tls.client_ca_file", tls.client_ca_file),
    ):
        check_regular_file(path, f"{name}.{what}", 1 << 20)
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=tls.client_ca_file)
    except (ssl.SSLError, OSError, ValueError) as e:
        raise UsageError(f"{name}.tls: cannot load the certificates: {e}") from None
    return ctx
