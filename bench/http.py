"""bench/http: which HTTP server the agent (:9445) and the extender (:9446) share.

Each candidate serves the agent's own /metrics app (as `gpudaemon run --simulate dgx-h100`
wires it, after one poll: 8 GPUs, ~28 KiB), /healthz and an echo POST endpoint, in its own
process with the same bound of `--threads` app threads. The load generator is `hey`
(Debian package `hey`; HTTP/1.1 keep-alive, Go, so little client CPU on a small machine),
or this script's asyncio client over real sockets when hey is absent (`--client python`).
Measured per server:

- /metrics and /healthz: `--clients` concurrent clients, `--requests` in all, 5 s time-out
  per request: req/s, p50/p99 latency, the server process's CPU per request (user + sys
  from /proc: the steadiest figure on a shared machine), time-outs and errors; medians of
  `--rounds` rounds, interleaved between servers in rotating order;
- `--idle` connections opened and left silent: the server's thread count 1 s later, the
  same /metrics load while they are held, and whether the server closes them after its
  idle time-out (`--idle-timeout` everywhere);
- POST of a `--body-mb` JSON body echoed back (round trip, one client), and headers
  announcing a body over the 8 MiB limit (413 expected without reading it).

Candidates: `stdlib-today` (the server the agent had: ThreadingMixIn WSGIServer, backlog 5,
no time-out, no body limit), `stdlib` (the same tuned: backlog 1024, a bounded pool,
socket time-out, a 413 middleware), `waitress` (gpudaemon.httpserver.HttpServer itself),
`cheroot` (numthreads = max = --threads, backlog 1024, keep-alive limit 1000). Prints one
table. Usage:
    scripts/bench http [--servers stdlib-today,stdlib,waitress,cheroot] [--clients 200]
               [--requests 2000] [--idle 300] [--idle-timeout 3] [--body-mb 1]
               [--rounds 3] [--threads 8] [--client hey|python]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

REPO = Path(__file__).resolve().parent.parent

THREADS = 8
LOAD: Any = None  # the load generator: load (asyncio) or hey_load
MAX_BODY = 8 << 20
SERVERS = ("stdlib-today", "stdlib", "waitress", "cheroot")
TIMEOUT_S = 5.0

# -- the server side (a child process per candidate) ----------------------------------


def bench_app() -> Callable[..., Iterable[bytes]]:
    """The agent's own /metrics app, put together as the agent wires it (self-metrics,
    reading ages and the GPU collector over the cache after one poll of simulated
    dgx-h100), plus POST /echo."""
    from prometheus_client import CollectorRegistry

    from gpudaemon.agent.cache import Cache
    from gpudaemon.agent.metrics.collector import GpuCollector, ReadingAgeCollector
    from gpudaemon.agent.metrics.http import make_app
    from gpudaemon.agent.metrics.selfmetrics import AgentMetrics
    from gpudaemon.agent.poller import Poller
    from gpudaemon.backends.simulated import SimulatedBackend, load_profile

    registry, head = CollectorRegistry(), CollectorRegistry()
    registry.register(head)
    AgentMetrics(head).set_build("simulated")
    cache = Cache()
    poller = Poller(SimulatedBackend(load_profile("dgx-h100"), seed=0), cache)
    poller.inventory()
    poller.telemetry()
    head.register(ReadingAgeCollector(cache))
    gpus = GpuCollector(cache, "bench-node")
    registry.register(gpus)
    metrics = make_app(registry, lambda: (True, "ready"), gpus, head)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/echo":
            n = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(n)
            start_response(
                "200 OK",
                [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
            )
            return [body]
        return metrics(environ, start_response)

    return app


def limit_body(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """For the stdlib servers, which have no body limit of their own."""

    def limited(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if int(environ.get("CONTENT_LENGTH") or 0) > MAX_BODY:
            start_response("413 Request Entity Too Large", [("Content-Length", "0")])
            return [b""]
        return app(environ, start_response)

    return limited


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Today(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Pooled(WSGIServer):
    """The stdlib tuned: backlog 1024, a bounded pool, a socket time-out per connection."""

    request_queue_size = 1024
    allow_reuse_address = True
    idle_timeout = 3.0
    pool = ThreadPoolExecutor(THREADS)

    def process_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(self.idle_timeout)
        self.pool.submit(self._work, request, client_address)

    def _work(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            pass  # a client that went away or timed out
        finally:
            self.shutdown_request(request)


def serve(kind: str, idle_timeout: float, threads: int) -> None:
    app = bench_app()
    port: int
    if kind in ("stdlib-today", "stdlib"):
        cls: Any = _Today if kind == "stdlib-today" else _Pooled
        cls.idle_timeout = idle_timeout
        _Pooled.pool = ThreadPoolExecutor(threads)
        served = app if kind == "stdlib-today" else limit_body(app)  # today had no limit
        srv = make_server("127.0.0.1", 0, served, server_class=cls, handler_class=_Quiet)
        port = srv.server_address[1]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    elif kind == "waitress":
        from gpudaemon.httpserver import HttpServer

        hs = HttpServer(
            "127.0.0.1:0",
            app,
            name="bench",
            threads=threads,
            idle_timeout_s=idle_timeout,
            max_body_bytes=MAX_BODY,
        )
        hs.start()
        port = hs.port
    elif kind == "cheroot":
        from cheroot import wsgi

        cs = wsgi.Server(
            ("127.0.0.1", 0),
            app,
            numthreads=threads,
            max=threads,
            request_queue_size=1024,
            timeout=int(idle_timeout),
        )
        cs.max_request_body_size = MAX_BODY
        cs.keep_alive_conn_limit = 1000
        cs.prepare()
        port = cs.bind_addr[1]
        threading.Thread(target=cs.serve, daemon=True).start()
    else:
        raise SystemExit(f"unknown server {kind!r}: one of {', '.join(SERVERS)}")
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin


# -- the client side ------------------------------------------------------------------


@dataclass
class Load:
    latencies: list[float] = field(default_factory=list)
    timeouts: int = 0
    errors: int = 0
    wall_s: float = 0.0
    hey: tuple[float, float, float] | None = None  # req/s, p50 s, p99 s as hey printed them

    def stats(self) -> tuple[float, float, float]:
        """req/s, p50 and p99 in seconds (nan when no request succeeded)."""
        if self.hey is not None:
            return self.hey
        lat = sorted(self.latencies) or [float("nan")]
        rps = len(self.latencies) / self.wall_s if self.wall_s else 0.0
        return rps, statistics.median(lat), lat[min(len(lat) - 1, int(len(lat) * 0.99))]

    def row(self) -> tuple[str, str, str, str]:
        rps, p50, p99 = self.stats()
        ms = [f"{x * 1e3:.1f}" if x == x else "-" for x in (p50, p99)]
        return f"{rps:,.0f}", ms[0], ms[1], f"{self.timeouts}/{self.errors}"


async def hey_load(port: int, path: str, clients: int, total: int, body: bytes = b"") -> Load:
    """The same load through `hey` (Debian package `hey`, Go): less client CPU on a
    small machine than the asyncio client."""
    cmd = ["hey", "-n", str(total), "-c", str(clients), "-t", str(int(TIMEOUT_S))]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        if body:
            f.write(body)
            f.flush()
            cmd += ["-m", "POST", "-T", "application/json", "-D", f.name]
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *cmd, f"http://127.0.0.1:{port}{path}", stdout=asyncio.subprocess.PIPE
        )
        out = (await proc.communicate())[0].decode()
    res = Load(wall_s=time.perf_counter() - t0)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    pct = dict(re.findall(r"(\d+)% in ([\d.]+) secs", out))
    res.hey = (rps, float(pct.get("50", "nan")), float(pct.get("99", "nan")))
    for code, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", out):
        res.errors += int(n) if code != "200" else 0
    errors = out.partition("Error distribution:")[2]
    for n, what in re.findall(r"\[(\d+)\]\s+(.*)", errors):
        if "Timeout" in what or "deadline exceeded" in what:
            res.timeouts += int(n)
        else:
            res.errors += int(n)
    return res


class Conn:
    """One HTTP/1.1 client connection that reconnects when the server closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.r: asyncio.StreamReader | None = None
        self.w: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.w is None:
            self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.r is not None
        head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nAccept-Encoding: identity\r\n"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.w.write(head.encode() + b"\r\n" + body)
        await self.w.drain()
        status_line = await self.r.readline()
        if not status_line:
            raise ConnectionError("closed before a response")
        status = int(status_line.split()[1])
        length, chunked, close = None, False, status_line.startswith(b"HTTP/1.0")
        while (line := await self.r.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                chunked = value == "chunked"
            elif name == "connection":
                close = value == "close" or (close and value != "keep-alive")
        if chunked:
            parts = []
            while size := int((await self.r.readline()).split(b";")[0], 16):
                parts.append(await self.r.readexactly(size))
                await self.r.readexactly(2)
            while await self.r.readline() not in (b"\r\n", b""):
                pass  # trailers
            data = b"".join(parts)
        elif length is not None:
            data = await self.r.readexactly(length)
        else:
            data = await self.r.read()
            close = True
        if close:
            self.close()
        return status, data

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
        self.r = self.w = None


async def load(port: int, path: str, clients: int, total: int, body: bytes = b"") -> Load:
    out = Load()
    per = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]

    async def client(n: int) -> None:
        conn = Conn(port)
        for _ in range(n):
            t0 = time.perf_counter()
            try:
                status, _ = await asyncio.wait_for(
                    conn.request("POST" if body else "GET", path, body), TIMEOUT_S
                )
            except TimeoutError:
                out.timeouts += 1
                conn.close()
                continue
            except (OSError, ConnectionError, ValueError, IndexError, asyncio.IncompleteReadError):
                out.errors += 1
                conn.close()
                continue
            if status == 200:
                out.latencies.append(time.perf_counter() - t0)
            else:
                out.errors += 1
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(n) for n in per))
    out.wall_s = time.perf_counter() - t0
    return out


async def over_limit(port: int) -> str:
    """Headers announcing a body one byte over the limit, and no body: a server that
    checks the limit answers 413 at once; one that does not waits for the body."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(
        f"POST /echo HTTP/1.1\r\nHost: bench\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()
    )
    try:
        line = await asyncio.wait_for(r.readline(), 2.0)
        return line.split()[1].decode() if line else "closed"
    except TimeoutError:
        return "waits for the body"
    finally:
        w.close()


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return -1


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class Server:
    """One candidate in its own process, for the length of a `with`."""

    def __init__(self, kind: str, args: argparse.Namespace) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve",
                kind,
                "--idle-timeout",
                str(args.idle_timeout),
                "--threads",
                str(args.threads),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(log := tempfile.TemporaryFile()),  # noqa: SIM115 - lives with the process
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            log.seek(0)
            raise SystemExit(f"{kind} did not start:\n{log.read().decode()[-2000:]}")
        self.port = int(line)
        self.pid = self.proc.pid

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


async def measure_load(kind: str, args: argparse.Namespace) -> dict[str, float]:
    """One round of the /metrics and /healthz loads: numbers, medians taken later."""
    res: dict[str, float] = {}
    with Server(kind, args) as srv:
        await LOAD(srv.port, "/metrics", 20, 200)  # warm-up
        for path in ("/metrics", "/healthz"):
            cpu0 = cpu_seconds(srv.pid)
            m = await LOAD(srv.port, path, args.clients, args.requests)
            cpu = cpu_seconds(srv.pid) - cpu0
            rps, p50, p99 = m.stats()
            what = path.strip("/")
            res[f"{what} req/s"] = rps
            res[f"{what} p50 ms"], res[f"{what} p99 ms"] = p50 * 1e3, p99 * 1e3
            res[f"{what} server CPU ms/request"] = cpu * 1e3 / args.requests
            res[f"{what} time-outs"], res[f"{what} other errors"] = m.timeouts, m.errors
        res["threads under load"] = threads_of(srv.pid)
    return res


async def measure_rest(kind: str, args: argparse.Namespace) -> dict[str, str]:
    """Idle connections, the body round trip and the body limit: once per server."""
    res: dict[str, str] = {}
    with Server(kind, args) as srv:
        idle = []
        for _ in range(args.idle):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT_S)
            idle.append(s)
        await asyncio.sleep(1.0)
        res[f"threads, {args.idle} idle conns open"] = str(threads_of(srv.pid))
        m2 = await LOAD(srv.port, "/metrics", args.clients, args.requests)
        res["/metrics p99 ms, idle conns open"] = m2.row()[2]
        res["/metrics time-outs/errors, idle conns open"] = m2.row()[3]
        wait = args.idle_timeout * 2 + 1.5
        await asyncio.sleep(max(0.0, wait - m2.wall_s))
        closed = 0
        for s in idle:
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
            s.close()
        res[f"idle conns closed by the server ({wait:.1f} s)"] = f"{closed}/{len(idle)}"
        await asyncio.sleep(0.5)
        res["threads after"] = str(threads_of(srv.pid))

        names = int(args.body_mb * 2**20 / 24) + 100
        doc = json.dumps(
            {"Nodes": None, "NodeNames": [f"node-{i:05d}-gpu-pool-a" for i in range(names)]}
        ).encode()[: int(args.body_mb * 2**20) - 2]
        doc = doc[: doc.rfind(b",")] + b"]}"
        # One client, one request at a time: the asyncio client's own cost is small here,
        # and hey misprints p99 for small counts.
        post = await load(srv.port, "/echo", 1, args.posts, doc)
        mib = f"{len(doc) / 2**20:.1f} MiB"
        res[f"POST {mib} JSON echoed, p50 ms"] = post.row()[1]
        res[f"POST {mib} JSON echoed, p99 ms"] = post.row()[2]
        res[f"POST {mib} time-outs/errors"] = post.row()[3]
        res["body over the limit"] = await over_limit(srv.port)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    # cheroot is no dependency of ours: `.venv/bin/pip install cheroot` to include it.
    have = [k for k in SERVERS if k != "cheroot" or importlib.util.find_spec("cheroot")]
    p.add_argument("--servers", default=",".join(have))
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--idle", type=int, default=300)
    p.add_argument("--idle-timeout", type=float, default=3.0)
    p.add_argument("--body-mb", type=float, default=1.0)
    p.add_argument("--posts", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3, help="of the loads; medians are printed")
    p.add_argument("--threads", type=int, default=THREADS, help="app threads in every server")
    p.add_argument(
        "--client", choices=("hey", "python"), default="hey" if shutil.which("hey") else "python"
    )
    args = p.parse_args()
    global LOAD
    LOAD = hey_load if args.client == "hey" else load
    if args.serve:
        serve(args.serve, args.idle_timeout, args.threads)
        return
    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for r in range(args.rounds):  # interleaved, rotating the order: the machine's load drifts
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            print(f"... round {r + 1}: {kind}", file=sys.stderr, flush=True)
            rounds[kind].append(asyncio.run(measure_load(kind, args)))
    results: dict[str, dict[str, str]] = {}
    for kind in kinds:
        res: dict[str, str] = {}
        for key in rounds[kind][0]:
            values = [rd[key] for rd in rounds[kind]]
            if "time-outs" in key or "errors" in key:
                res[key] = f"{sum(values):.0f}"
            elif "CPU" in key:
                res[key] = f"{statistics.median(values):.2f}"
            elif "threads" in key:
                res[key] = f"{max(values):.0f}"
            else:
                res[key] = f"{statistics.median(values):{',.0f' if 'req/s' in key else '.1f'}}"
        print(f"... {kind}: idle connections, body", file=sys.stderr, flush=True)
        res.update(asyncio.run(measure_rest(kind, args)))
        results[kind] = res
    cheroot = version("cheroot") if importlib.util.find_spec("cheroot") else "absent"
    print(
        f"bench/http: {args.clients} clients x {args.requests} requests ({args.client}), "
        f"{args.threads} app threads, "
        f"time-out {TIMEOUT_S:.0f} s; {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, waitress {version('waitress')}, cheroot "
        f"{cheroot}, load {os.getloadavg()[0]:.1f}"
    )
    rows = list(next(iter(results.values())))
    w = max(len(r) for r in rows)
    print("| " + "measure".ljust(w) + " | " + " | ".join(kinds) + " |")
    print("|" + "-" * (w + 2) + "|" + "|".join("-" * (len(k) + 2) for k in kinds) + "|")
    for r in rows:
        cells = " | ".join(results[k].get(r, "").rjust(len(k)) for k in kinds)
        print(f"| {r.ljust(w)} | {cells} |")
    print(
        f"loads: medians of {args.rounds} interleaved rounds (time-outs and errors: totals); "
        "errors = refused, reset or non-200"
    )


if __name__ == "__main__":
    main()
