"""Policies as plug-ins (issue 23): a policy registered from this test file alone is
accepted by config and selected by the pod annotation, with no other edit; an unknown
name in config exits 2 with one line naming the known ones, and in a pod's annotation
fails every node with that reason."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.policies import (
    BUILT_IN,
    PolicySpec,
    UnknownPolicyError,
    known_policies,
    register,
    unregister,
)
from gpudaemon.cluster.policies.base import FreeGpuPolicy, utilization
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.config import load_config
from gpudaemon.extender.api import ExtenderApi
from gpudaemon.extender.app import Extender, make_policies
from tests.clock import FakeClock
from tests.support import run_cli
from tests.unit.extender.test_api import call, make_api, pod
from tests.unit.extender.test_cluster import lease_obj, node_obj, pod_obj


class Idlest(FreeGpuPolicy):
    """Prefer the node whose GPUs are least busy (a policy written for this test)."""

    name = "idlest"

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        return -utilization(node)


@pytest.fixture
def idlest() -> Iterator[PolicySpec]:
    spec = register(PolicySpec("idlest", lambda ext: Idlest(), "least busy GPUs first"))
    yield spec
    unregister("idlest")


class NoApi:
    """An extender that never gets as far as calling the API."""

    def list_items(self, path: str, query: Any = None) -> Any:
        raise AssertionError("no API call expected")

    def watch(self, *a: Any, **k: Any) -> Any:
        raise AssertionError("no API call expected")

    def request(self, method: str, path: str, **kw: Any) -> Any:
        raise AssertionError("no API call expected")


def test_the_built_in_policies_are_registered() -> None:
    assert {"binpack", "spread", "fragmentation"} <= set(known_policies())


def test_importing_the_policy_modules_registers_nothing() -> None:
    """registry.py's table is the one list: a policy module defines its SPEC and makes
    no call at import, and every module's SPEC is in the table."""
    import gpudaemon.cluster.policies as package

    before = known_policies()
    specs = []
    for mod in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{mod.name}")
        tree = ast.parse(Path(module.__file__ or "").read_text())
        calls = [n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
        assert not calls, f"{mod.name}: a call at import"
        if hasattr(module, "SPEC"):
            specs.append(module.SPEC)
    assert known_policies() == before == sorted(s.name for s in BUILT_IN)
    assert {s.name for s in specs} == set(before)


def test_a_policy_from_one_file_is_accepted_by_config(idlest: PolicySpec) -> None:
    cfg = load_config(None, environ={}, overrides={"extender": {"policy": "idlest"}})
    assert "idlest" in make_policies(cfg)
    ext = Extender(cfg, client=NoApi(), registry=CollectorRegistry())  # type: ignore[arg-type]
    assert ext.api.default_policy == "idlest"


def test_the_annotation_selects_a_registered_policy(idlest: PolicySpec) -> None:
    wall = FakeClock()
    c = ClusterState("gpudaemon.io/", wall=wall)
    busy = {"a": 90, "b": 10, "c": 50}
    c.replace_nodes([node_obj(n, uid=n, util=[u]) for n, u in busy.items()])
    c.replace_pods([pod_obj("x1", "a", 6)])  # binpack would pick "a"
    c.replace_leases([lease_obj(n, wall(), 300, owner_uid=n) for n in busy])
    cfg = load_config(None, environ={})
    api = ExtenderApi(c, make_policies(cfg), "binpack", CollectorRegistry(), lambda: (True, "ok"))

    def top(policy: str | None) -> str:
        body = {"Pod": pod("p1", 1, policy), "NodeNames": list(busy)}
        code, scores = call(api, "/prioritize", json.dumps(body).encode())
        assert code.startswith("200")
        return str(max(scores, key=lambda s: s["Score"])["Host"])

    assert top(None) == "a"  # the default, binpack
    assert top("idlest") == "b"  # the annotation picks the policy this file registered


def test_an_unknown_policy_in_config_is_one_line_naming_the_known_ones(tmp_path: Path) -> None:
    cfg = load_config(None, environ={}, overrides={"extender": {"policy": "coolest"}})
    with pytest.raises(UnknownPolicyError, match=r"unknown policy 'coolest' \(known: binpack,"):
        make_policies(cfg)
    f = tmp_path / "c.yaml"
    f.write_text("extender: {policy: coolest}\n")
    p = run_cli("extender", "--config", str(f))
    assert p.returncode == 2, p
    (line,) = p.stderr.strip().splitlines()
    assert "extender.policy: unknown policy 'coolest'" in line
    assert all(name in line for name in ("binpack", "fragmentation", "spread"))


def test_an_unknown_policy_in_a_pods_annotation_fails_every_node_with_the_reason() -> None:
    api, _, reg = make_api()
    body = json.dumps({"Pod": pod("p1", 1, "coolest"), "NodeNames": ["a", "b"]}).encode()
    code, result = call(api, "/filter", body)
    assert code.startswith("200") and result["NodeNames"] == []
    reason = result["FailedNodes"]["a"]
    assert "unknown policy 'coolest' in annotation gpudaemon.io/policy" in reason
    assert "known: binpack, spread" in reason
    code, scores = call(api, "/prioritize", body)
    assert code.startswith("200") and {s["Score"] for s in scores} == {0}
    v = reg.get_sample_value("gpudaemon_extender_filter_nodes_total", {"result": "unknown_policy"})
    assert v == 2
