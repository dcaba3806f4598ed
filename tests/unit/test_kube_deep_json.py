"""An object nested deeper than Python's JSON decoder can go (a tenant's ResourceClaim
with 5,000 levels in its opaque parameters, which kube-apiserver stores) must not fail
the list or watch it is in: the deep value reads as null, everything else as sent."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpudaemon.kube.jsondepth import MAX_DEPTH, flatten, loads
from tests.unit.test_kube import _WatchServer

DEEP = 5000


def deep_claim(name: str) -> str:
    params = '{"a": ' + "[" * DEEP + "]" * DEEP + ', "s": "[[[{{ not brackets \\" ]"}'
    obj = {"metadata": {"name": name, "namespace": "t1", "resourceVersion": "7"},
           "spec": {"devices": {"requests": [], "config": [{"opaque": {
               "driver": "gpu.nvidia.com", "parameters": "@P@"}}]}}}  # fmt: skip
    return json.dumps(obj).replace('"@P@"', params)


def test_plain_json_cannot_decode_it() -> None:
    with pytest.raises(RecursionError):
        json.loads(deep_claim("c"))


def test_a_deep_value_reads_as_null_and_the_rest_as_sent() -> None:
    obj = loads(deep_claim("c"))
    params = obj["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    assert obj["metadata"]["name"] == "c"
    assert params["s"] == '[[[{{ not brackets " ]'
    v, depth = params["a"], 0
    while isinstance(v, list):
        v, depth = (v[0] if v else None), depth + 1
    assert v is None and depth < MAX_DEPTH


def test_flatten_keeps_shallow_text_unchanged_and_refuses_nothing() -> None:
    text = '{"a": [[1], {"b": "]}"}], "c": null}'
    assert flatten(text) == text
    assert flatten("[[[1]]]", 1) == "[null]"
    with pytest.raises(ValueError):
        loads(b"[" * DEEP)  # not JSON: still a ValueError, never a RecursionError


def test_a_watch_with_a_deep_object_delivers_it_and_the_next_event(tmp_path: Any) -> None:
    srv = _WatchServer(tmp_path, 200, [
        json.dumps({"type": "ADDED", "object": "@O@"}).replace('"@O@"', deep_claim("deep")),
        {"type": "ADDED", "object": {"metadata": {"name": "next", "resourceVersion": "8"}}},
    ])  # fmt: skip
    try:
        got = list(srv.client.watch("/apis/resource.k8s.io/v1/resourceclaims", "1", timeout_s=5))
    finally:
        srv.close()
    assert [o["metadata"]["name"] for _, o in got] == ["deep", "next"]
