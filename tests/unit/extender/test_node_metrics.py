"""The extender's per-node families, written by NodeCollector.render() rather than by
prometheus-client (25,000 series at 5,000 nodes): the same bytes, in both formats,
through /metrics as through prometheus-client's own app."""

from __future__ import annotations

import gzip
import io
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest
from prometheus_client.parser import text_string_to_metric_families

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.policies import BinPack
from gpudaemon.extender.api import ExtenderApi
from gpudaemon.extender.metrics import NodeCollector
from tests.clock import FakeClock
from tests.unit.extender.test_cluster import lease_obj, node_obj, pod_obj

OM = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def cluster() -> ClusterState:
    wall = FakeClock()
    c = ClusterState("gpudaemon.io/", wall=wall)
    # Odd names on purpose: the escaping must be prometheus-client's, byte for byte.
    names = ["a", "b", "sick", "old", 'we"ird\\name', "new\nline"]
    c.replace_nodes(
        [node_obj(n, uid=n, healthy=7 if n == "sick" else 8) for n in names]
        + [{"metadata": {"name": "cpu-only", "uid": "cpu", "labels": {}}, "status": {}}]
    )
    c.replace_pods([pod_obj("x1", "a", 6), pod_obj("x2", "b", 2), pod_obj("x3", "sick", 3)])
    c.replace_leases(
        [lease_obj(n, wall(), 300, owner_uid=n) for n in names if n != "old"]
        + [lease_obj("old", wall() - 1000, 300, owner_uid="old")]
    )
    return c


def only(collector: NodeCollector) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(collector)
    return reg


@pytest.mark.parametrize("openmetrics", [False, True])
def test_render_is_byte_for_byte_what_prometheus_client_writes(openmetrics: bool) -> None:
    nodes = NodeCollector(cluster())
    want = (
        om_latest(only(nodes)).removesuffix(b"# EOF\n") if openmetrics else text_latest(only(nodes))
    )
    got = nodes.render(openmetrics)
    assert got == want
    # and it says something: every GPU node, none without GPUs, the figures themselves
    fams = {f.name: f for f in text_string_to_metric_families(nodes.render(False).decode())}
    gpus = {(s.labels["node"], s.labels["kind"]): s.value for s in fams[NodeCollector.GPUS].samples}
    fresh = {s.labels["node"]: s.value for s in fams[NodeCollector.FRESH].samples}
    assert len(fresh) == 6 and "cpu-only" not in fresh
    assert gpus[("a", "allocated")] == 6 and gpus[("sick", "healthy")] == 7
    assert fresh["old"] == 0 and fresh["a"] == 1 and fresh['we"ird\\name'] == 1


def test_render_of_an_empty_cluster_is_the_two_headers() -> None:
    nodes = NodeCollector(ClusterState("gpudaemon.io/", wall=FakeClock()))
    assert nodes.render(False) == text_latest(only(nodes))
    assert nodes.render(False).count(b"# TYPE") == 2


def api_and_full_registry() -> tuple[ExtenderApi, CollectorRegistry]:
    c = cluster()
    reg = CollectorRegistry()
    nodes = NodeCollector(c)
    api = ExtenderApi(c, {"binpack": BinPack()}, "binpack", reg, lambda: (True, "ok"), nodes=nodes)
    full = CollectorRegistry()  # what prometheus-client alone would serve
    full.register(reg)
    full.register(nodes)
    return api, full


def get(api: ExtenderApi, query: str = "", **headers: str) -> tuple[dict[str, str], bytes]:
    got: dict[str, Any] = {}
    env = {
        "PATH_INFO": "/metrics",
        "REQUEST_METHOD": "GET",
        "QUERY_STRING": query,
        "wsgi.input": io.BytesIO(b""),
        **{f"HTTP_{k.upper()}": v for k, v in headers.items()},
    }
    body = b"".join(api(env, lambda s, h: got.update(status=s, headers=dict(h))))
    assert got["status"].startswith("200"), got
    return got["headers"], body


@pytest.mark.parametrize("openmetrics", [False, True])
def test_the_extenders_metrics_are_prometheus_clients_bytes(openmetrics: bool) -> None:
    api, full = api_and_full_registry()
    headers, body = get(api, **({"accept": OM} if openmetrics else {}))
    assert body == (om_latest(full) if openmetrics else text_latest(full))
    assert headers["Content-Type"].startswith(
        "application/openmetrics-text" if openmetrics else "text/plain"
    )
    assert b"gpudaemon_extender_request_duration_seconds_count" in body  # and the rest


def test_gzip_is_the_same_text_compressed() -> None:
    api, full = api_and_full_registry()
    headers, body = get(api, accept_encoding="gzip")
    assert headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(body) == text_latest(full)


def test_a_name_filter_finds_the_node_families() -> None:
    """prometheus-client's own filter finds collectors by describe(), which this one
    lacks: the shared app filters the collected families instead."""
    api, _ = api_and_full_registry()
    _, body = get(api, "name[]=gpudaemon_extender_node_fresh")
    fams = list(text_string_to_metric_families(body.decode()))
    assert [f.name for f in fams] == ["gpudaemon_extender_node_fresh"]
    assert len(fams[0].samples) == 6


def test_a_plain_scrape_renders_the_node_families_without_collecting_them() -> None:
    """The point of render(): a scrape builds no sample object per node and kind."""

    class NoCollect(NodeCollector):
        def collect(self) -> Any:
            raise AssertionError("a plain scrape collected the per-node families")

    c = cluster()
    api = ExtenderApi(
        c, {"binpack": BinPack()}, "binpack", CollectorRegistry(), lambda: (True, "ok"),
        nodes=NoCollect(c),
    )  # fmt: skip
    for headers in ({}, {"accept": OM}, {"accept_encoding": "gzip"}):
        _, body = get(api, **headers)
        text = gzip.decompress(body) if headers.get("accept_encoding") else body
        assert text.count(b"gpudaemon_extender_node_fresh{") == 6


def slow_answer(full: CollectorRegistry, env: dict[str, Any]) -> tuple[str, dict[str, str], bytes]:
    """What prometheus-client's own app answers for every series."""
    from prometheus_client import make_wsgi_app

    got: dict[str, Any] = {}
    body = b"".join(make_wsgi_app(full)(env, lambda s, h: got.update(s=s, h=dict(h))))
    return got["s"], got["h"], body


def request(method: str, **headers: str) -> dict[str, Any]:
    return {
        "PATH_INFO": "/metrics",
        "REQUEST_METHOD": method,
        "QUERY_STRING": "",
        "wsgi.input": io.BytesIO(b""),
        **{f"HTTP_{k.upper()}": v for k, v in headers.items()},
    }


@pytest.mark.parametrize("method", ["HEAD", "POST", "PUT", "OPTIONS"])
def test_methods_other_than_get_are_answered_as_prometheus_client_answers_them(
    method: str,
) -> None:
    """405 with `Allow` (OPTIONS: 200, empty): no scrape's worth of work for them."""
    api, full = api_and_full_registry()
    got: dict[str, Any] = {}
    body = b"".join(api(request(method), lambda s, h: got.update(s=s, h=dict(h))))
    want_status, want_headers, want_body = slow_answer(full, request(method))
    assert (got["s"], body) == (want_status, want_body)
    assert got["h"].get("Allow") == want_headers.get("Allow")
    assert b"gpudaemon_extender_node_fresh" not in body


@pytest.mark.parametrize(
    "accept",
    [
        "text/plain; version=1.0.0; escaping=dots",
        "application/openmetrics-text; version=1.0.0; escaping=dots",
        "application/openmetrics-text; version=1.0.0; escaping=allow-utf-8",
        "text/plain; version=1.0.0; escaping=values",
    ],
)
def test_every_escaping_scheme_prometheus_may_ask_for_gives_its_bytes(accept: str) -> None:
    """Prometheus 3 may ask for names escaped with dots; only prometheus-client writes
    those, so such a scrape takes its path, and one body never mixes two schemes."""
    api, full = api_and_full_registry()
    _, body = get(api, accept=accept)
    assert body == slow_answer(full, request("GET", accept=accept))[2]


@pytest.mark.parametrize(("encoding", "gzipped"), [("GZIP", True), ("br, gzip;q=0.5", True),
                                                    ("x-gzip", False), ("identity", False)])  # fmt: skip
def test_gzip_is_negotiated_as_prometheus_client_does(encoding: str, gzipped: bool) -> None:
    api, _ = api_and_full_registry()
    headers, _ = get(api, accept_encoding=encoding)
    assert (headers.get("Content-Encoding") == "gzip") is gzipped
