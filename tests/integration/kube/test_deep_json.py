"""A tenant's ResourceClaim whose opaque parameters nest 5,000 levels deep: the real
kube-apiserver stores it, and our client still lists and watches its kind (the deep
value reads as null) instead of failing every relist and freezing the cache."""

from __future__ import annotations

import json
import threading

import pytest

from gpudaemon.kube.informer import Reflector
from tests.integration.kube.controlplane import ControlPlane
from tests.support import wait_for

pytestmark = pytest.mark.integration

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
DEPTH = 5000
YAML = "application/yaml"  # a body sent as is (JSON is YAML); the client would re-encode a str


def claim(name: str, depth: int) -> str:
    params = '{"a": ' + "[" * depth + "]" * depth + "}"
    obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
           "spec": {"devices": {"requests": [{"name": "g", "exactly": {
               "deviceClassName": "gpu.nvidia.com"}}], "config": [{"opaque": {
               "driver": "gpu.nvidia.com", "parameters": "@P@"}}]}}}  # fmt: skip
    return json.dumps(obj).replace('"@P@"', params)


def test_a_claim_nested_5000_deep_is_stored_and_read(control_plane: ControlPlane) -> None:
    admin = control_plane.admin
    admin.request("POST", CLAIMS, body=claim("deep-before", DEPTH), content_type=YAML)
    items, _ = admin.list_items(CLAIMS)
    assert "deep-before" in {i["metadata"]["name"] for i in items}

    seen: dict[str, dict[str, object]] = {}
    lock = threading.Lock()

    def replace(objs: object) -> None:
        with lock:
            seen.clear()
            seen.update({o["metadata"]["name"]: o for o in objs})  # type: ignore[attr-defined]

    def event(kind: str, o: dict[str, object]) -> None:
        with lock:
            seen[o["metadata"]["name"]] = o  # type: ignore[index]

    r = Reflector(admin, "resourceclaims", CLAIMS, replace, event)
    stop = threading.Event()
    t = threading.Thread(target=r.run, args=(stop,), daemon=True)
    t.start()
    try:
        wait_for(r.synced.is_set, 60, what="claims listed")
        admin.request("POST", CLAIMS, body=claim("deep-after", DEPTH),
                      content_type=YAML)  # fmt: skip
        admin.request("POST", CLAIMS, body=claim("plain", 1), content_type=YAML)
        wait_for(lambda: "plain" in seen and "deep-after" in seen, 60, what="watched")
        assert r.relists == 0 and r.handler_errors == 0
    finally:
        stop.set()
        t.join(10)
