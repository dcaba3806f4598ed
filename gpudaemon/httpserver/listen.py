"""Listen addresses: the one parser (the config checks `listen` keys with it) and the
bind, each failure one line (UsageError)."""

from __future__ import annotations

import errno
import socket

from gpudaemon.errors import UsageError

BACKLOG = 1024


def parse_listen(listen: str | tuple[str, int], what: str) -> tuple[str, int]:
    """Accepts "host:port", "[v6]:port", ":port" (all IPv4 addresses) or (host, port)."""
    if isinstance(listen, tuple):
        host, port_text = listen[0], str(listen[1])
    else:
        text = listen.strip()
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]")
            if not sep or not rest.startswith(":"):
                raise UsageError(f"{what}: {listen!r} is not [ipv6-address]:port")
            port_text = rest[1:]
        else:
            host, sep, port_text = text.rpartition(":")
            if not sep:
                raise UsageError(f"{what}: {listen!r} has no port (expected host:port)")
            if ":" in host:
                raise UsageError(f"{what}: {listen!r}: write an IPv6 address as [addr]:port")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise UsageError(f"{what}: {listen!r}: port must be a number from 0 to 65535")
    return host or "0.0.0.0", int(port_text)


def _bind(host: str, port: int, listen: str, what: str) -> socket.socket:
    try:
        infos = socket.getaddrinfo(
            host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )
        # A name with both (localhost) binds its IPv4 address, as the stdlib server did;
        # "[::]:port" listens on both families (Linux's default bindv6only=0).
        family, kind, proto, _, addr = min(infos, key=lambda i: i[0] != socket.AF_INET)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise UsageError(f"{what}: cannot listen on {listen}: {reason}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as e:  # address in use, not an address of this host, permission
        sock.close()
        reason = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            reason += " (another process is listening there)"
        raise UsageError(f"{what}: cannot listen on {listen}: {reason}") from None
    return sock
