"""bench/probe: /filter and /prioritize round trips to an extender, twice a second, from
a process of its own, until its stdin ends (the bench closes it, or the bench ended);
then the times as JSON on stdout. With
`--scrape-every-s S` it also reads the extender's /metrics every S seconds on a
connection of its own, as Prometheus does in production (the scrape's time is reported
too): the per-node series make a scrape the extender's longest request.

Its own process because a benchmark's other threads (bench/fleet runs a thousand
simulated agents in its own) would hold the probe's GIL: the reply would wait for the
client, and the client's wait would be counted as the extender's latency.

  python -m bench.probe --port P --body FILE [--scrape-every-s S]
  (FILE: ExtenderArgs as JSON)
"""

from __future__ import annotations

import argparse
import http.client
import sys
import threading
import time
from pathlib import Path

import orjson

VERBS = ("filter", "prioritize")


def scrape(port: int, every_s: float, stop: threading.Event, out: list[float]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.wait(every_s):
        t = time.perf_counter()
        try:
            conn.request("GET", "/metrics")
            conn.getresponse().read()
        except OSError:
            conn.close()
            continue
        out.append(time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--body", type=Path, required=True, help="ExtenderArgs as JSON")
    ap.add_argument("--interval-s", type=float, default=0.5)
    ap.add_argument("--scrape-every-s", type=float, default=0.0, help="0: no /metrics scrape")
    args = ap.parse_args()
    body = args.body.read_bytes()
    stop = threading.Event()

    def until_stdin_ends() -> None:
        sys.stdin.buffer.read()
        stop.set()

    threading.Thread(target=until_stdin_ends, daemon=True).start()
    times: dict[str, list[float]] = {v: [] for v in (*VERBS, "metrics")}
    passed, errors = 0, 0
    if args.scrape_every_s > 0:
        scraper = threading.Thread(
            target=scrape, args=(args.port, args.scrape_every_s, stop, times["metrics"]),
            daemon=True,
        )  # fmt: skip
        scraper.start()
    conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)
    while not stop.wait(args.interval_s):
        for verb in VERBS:
            t = time.perf_counter()
            try:
                conn.request("POST", f"/{verb}", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
            except OSError:  # the extender restarted or went away: count it, go on
                errors += 1
                conn.close()
                continue
            times[verb].append(time.perf_counter() - t)
            if resp.status != 200:
                errors += 1
            elif verb == "filter":
                passed = len(orjson.loads(data).get("NodeNames") or [])
    sys.stdout.write(orjson.dumps({**times, "passed": passed, "errors": errors}).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
