"""/metrics for every program: a fast encoder for big families of gauges and counters,
in text 0.0.4 and OpenMetrics, and the WSGI app that serves a registry with it.

prometheus-client formats and escapes every label of every sample (~12 us a sample).
The agent's ~18 families per GPU share one label set, so formatting each label set once
makes its scrape about 4x cheaper; the extender's per-node families are rendered by
their collector directly (extender/metrics.py). Only gauges and counters without
exemplars or timestamps are handled; anything else raises so it cannot go out wrong.
tests/unit/metrics checks the output against prometheus-client's encoders.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.utils import floatToGoString

from gpudaemon.httpserver.responses import StartResponse, WsgiApp

# One collector's families, already encoded: `render(openmetrics)`, no trailing `# EOF`.
Render = Callable[[bool], bytes]


def float_text(v: float) -> str:
    """A sample value as prometheus-client writes it (Go's float format)."""
    return str(floatToGoString(v))  # type: ignore[no-untyped-call]


def label_value(s: str) -> str:
    """A label value escaped for both formats."""
    return s.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _help(s: str, openmetrics: bool) -> str:
    s = s.replace("\\", r"\\").replace("\n", r"\n")
    return s.replace('"', r"\"") if openmetrics else s  # OpenMetrics escapes quotes in HELP


LabelSets = dict[tuple[tuple[str, str], ...], str]


def encode_families(
    families: Iterable[Metric], openmetrics: bool, labelsets: LabelSets | None = None
) -> bytes:
    """The families as exposition text; OpenMetrics output has no trailing `# EOF`.
    `labelsets`: formatted label sets to share across calls (one render's families)."""
    if labelsets is None:
        labelsets = {}
    out: list[str] = []
    for f in families:
        if f.type not in ("gauge", "counter"):
            raise ValueError(f"encode_families handles gauges and counters, not {f.type}")
        head = f.name + "_total" if f.type == "counter" and not openmetrics else f.name
        out.append(f"# HELP {head} {_help(f.documentation, openmetrics)}\n# TYPE {head} {f.type}\n")
        for s in f.samples:
            if s.exemplar is not None or s.timestamp is not None:
                raise ValueError("encode_families does not handle exemplars or timestamps")
            key = tuple(s.labels.items())
            lab = labelsets.get(key)
            if lab is None:
                inner = ",".join(f'{k}="{label_value(v)}"' for k, v in sorted(key))
                lab = labelsets[key] = "{" + inner + "}" if inner else ""
            out.append(f"{s.name}{lab} {float_text(s.value)}\n")
    return "".join(out).encode()


def metrics_app(
    registry: CollectorRegistry,
    head: CollectorRegistry | None = None,
    render: Render | None = None,
) -> WsgiApp:
    """GET /metrics for `registry` (every series): prometheus-client's WSGI app (text or
    OpenMetrics by the Accept header, gzip by Accept-Encoding), `?name[]=` filtering over
    every family. With `head` (every series but one collector's) and `render` (that
    collector's families, encoded), a plain scrape encodes `head` and appends
    `render`'s bytes instead of building and encoding each of its samples."""
    slow = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET") != "GET":  # 405 (OPTIONS: 200), as before
            return slow(environ, start_response)  # type: ignore[no-any-return]
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        if names:
            return _filtered_metrics(registry, set(names), environ, start_response)
        _, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        # Names escaped with dots (Prometheus 3's `metric_name_escaping_scheme: dots`) are
        # prometheus-client's to write: the fast encoders write names as they are.
        dots = "escaping=dots" in content_type
        if head is None or render is None or environ.get("QUERY_STRING") or dots:
            return slow(environ, start_response)  # type: ignore[no-any-return]
        return _fast_metrics(head, render, environ, start_response)

    return app


def _fast_metrics(
    head: CollectorRegistry,
    render: Render,
    environ: dict[str, Any],
    start_response: StartResponse,
) -> list[bytes]:
    encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
    openmetrics = content_type.startswith("application/openmetrics-text")
    tail = render(openmetrics)
    # OpenMetrics ends with "# EOF": the rendered families go before it.
    body = encoder(head).removesuffix(b"# EOF\n") + tail + (b"# EOF\n" if openmetrics else b"")
    return _send_metrics(body, content_type, environ, start_response)


def _send_metrics(
    body: bytes, content_type: str, environ: dict[str, Any], start_response: StartResponse
) -> list[bytes]:
    headers = [("Content-Type", content_type)]
    if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
        body = gzip.compress(body)
        headers.append(("Content-Encoding", "gzip"))
    headers.append(("Content-Length", str(len(body))))
    start_response("200 OK", headers)
    return [body]


class _Restricted:
    """`?name[]=` filtering over every family the registry collects. prometheus-client's
    restricted registry finds collectors by their describe() names, so it returned
    nothing for collectors that cannot describe themselves up front (the GPU collector,
    a registry inside a registry): issue 12, item 15. Same rule as prometheus-client:
    a family keeps the samples whose name was asked for."""

    def __init__(self, registry: CollectorRegistry, names: set[str]) -> None:
        self.registry, self.names = registry, names

    def collect(self) -> Iterator[Metric]:
        for fam in self.registry.collect():
            samples = [s for s in fam.samples if s.name in self.names]
            if samples:
                out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples = samples
                yield out


def _filtered_metrics(
    registry: CollectorRegistry,
    names: set[str],
    environ: dict[str, Any],
    start_response: StartResponse,
) -> list[bytes]:
    encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
    body = encoder(cast(CollectorRegistry, _Restricted(registry, names)))
    return _send_metrics(body, content_type, environ, start_response)
