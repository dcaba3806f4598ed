"""The agent against a real Prometheus: promtool lints its /metrics, every dashboard
query returns data, pod labels land only on the assigned GPU, and injected faults fire
the matching alerts in a real rule evaluation."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.prometheus.conftest import NODE_A, NODE_B, RULES, Stack
from tests.support import REPO, http_get, wait_for

pytestmark = pytest.mark.integration

DASHBOARDS = sorted((REPO / "grafana").glob("*.json"))
# Grafana's own variables, as Grafana would fill them for a short range.
BUILTINS = {"$__rate_interval": "15s", "$__interval": "5s", "$__range": "5m"}


@pytest.mark.parametrize("node", [NODE_A, NODE_B])
def test_promtool_check_metrics_is_clean(stack: Stack, promtool: str, node: str) -> None:
    status, body = http_get(stack.agents[node].url + "/metrics")
    assert status == 200
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=30
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b""), stack.agents[node].profile


def _targets(path: Path) -> list[tuple[str, str]]:
    dash = json.loads(path.read_text())
    return [
        (p["title"], t["expr"])
        for p in dash["panels"]
        for t in p.get("targets", [])
        if t.get("expr")
    ]


def _variables(path: Path) -> list[dict[str, Any]]:
    return [v for v in json.loads(path.read_text())["templating"]["list"] if v["type"] == "query"]


def _substitute(expr: str, values: dict[str, str]) -> str:
    for k, v in BUILTINS.items():
        expr = expr.replace(k, v)
    expr = re.sub(r"\$\{(\w+)\}", r"$\1", expr)
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("$" + name, values[name])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


PANEL_QUERIES = [
    pytest.param(path, title, expr, id=f"{path.stem}:{title}:{i}")
    for path in DASHBOARDS
    for i, (title, expr) in enumerate(_targets(path))
]


def test_dashboards_exist_with_the_promised_variables() -> None:
    assert [p.name for p in DASHBOARDS] == ["gpudaemon-fleet.json", "gpudaemon-node.json"]
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        names = [v["name"] for v in dash["templating"]["list"]]
        assert names[0] == "datasource" and "node" in names
        for p in dash["panels"]:
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
    assert "gpu" in [v["name"] for v in _variables(REPO / "grafana/gpudaemon-node.json")]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_variable_query_returns_values(stack: Stack, path: Path) -> None:
    for var in _variables(path):
        q = var["query"]["query"]
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q)
        assert m, q
        selector = _substitute(m.group(1), {"node": ".*"})
        values = {
            r["metric"].get(m.group(2))
            for r in stack.query(f"group by ({m.group(2)}) ({selector})")
        }
        assert values - {None}, f"{var['name']}: {q}"
        if var["name"] == "node":
            assert values == {NODE_A, NODE_B}


@pytest.mark.parametrize(("path", "title", "expr"), PANEL_QUERIES)
def test_every_dashboard_query_returns_data(
    stack: Stack, path: Path, title: str, expr: str
) -> None:
    # "All" for every variable, as the dashboards open by default.
    q = _substitute(expr, {v["name"]: ".*" for v in _variables(path)})
    wait_for(lambda: stack.query(q), timeout=40, interval=1, what=f"data for {title!r}: {q}")


def test_pod_labels_reach_prometheus_only_on_the_assigned_devices(stack: Stack) -> None:
    def owned(metric: str) -> list[dict[str, str]]:
        return [r["metric"] for r in stack.query(f'{metric}{{pod!=""}}')]

    gpus = wait_for(lambda: owned("gpudaemon_gpu_power_watts"), 20, what="pod-labelled GPU")
    assert [
        (g["node"], g["gpu"], g["uuid"], g["pod"], g["namespace"], g["container"]) for g in gpus
    ] == [(NODE_A, "2", stack.gpu2_uuid, f"job-{NODE_A}", "ml", "main")]
    migs = owned("gpudaemon_mig_memory_total_bytes")
    assert [(m["node"], m["mig_uuid"], m["pod"]) for m in migs] == [
        (NODE_B, stack.mig_uuid, f"job-{NODE_B}")
    ]
    # The MIG pod does not leak onto its parent GPU or any other series of node B.
    assert not stack.query(f'gpudaemon_gpu_healthy{{node="{NODE_B}", pod!=""}}')


def _firing(stack: Stack, name: str, **labels: str) -> dict[str, Any] | None:
    for a in stack.alerts():
        if (
            a["labels"]["alertname"] == name
            and a["state"] == "firing"
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ):
            return a
    return None


def test_injected_xid_fires_the_xid_alert(stack: Stack) -> None:
    alert = wait_for(
        lambda: _firing(stack, "GpudaemonGpuXidError", node=NODE_A, gpu="3", xid="79"),
        timeout=60,
        interval=1,
        what="GpudaemonGpuXidError firing",
    )
    assert alert["labels"]["severity"] == "warning"
    assert alert["annotations"]["summary"] == f"XID 79 on GPU 3 of {NODE_A}"
    # The alert is about GPU 3 only; node B has no XIDs.
    assert not _firing(stack, "GpudaemonGpuXidError", node=NODE_B)


def test_injected_lost_gpu_fires_the_lost_alert_and_not_unhealthy(stack: Stack) -> None:
    alert = wait_for(
        lambda: _firing(stack, "GpudaemonGpuLost", node=NODE_A, gpu="5"),
        timeout=60,
        interval=1,
        what="GpudaemonGpuLost firing",
    )
    assert alert["labels"]["severity"] == "critical"
    series = stack.query('ALERTS{alertname="GpudaemonGpuLost", alertstate="firing"}')
    assert [(s["metric"]["node"], s["metric"]["gpu"]) for s in series] == [(NODE_A, "5")]
    # XID 79 on GPU 3 makes it unhealthy (not lost) with the action reboot_node: the
    # reboot alert's job (issue 30), not the plain Unhealthy one's, nor again for GPU 5.
    wait_for(
        lambda: _firing(stack, "GpudaemonGpuNeedsReboot", node=NODE_A, gpu="3"),
        timeout=60,
        interval=1,
        what="GpudaemonGpuNeedsReboot firing for GPU 3",
    )
    assert not _firing(stack, "GpudaemonGpuNeedsReboot", gpu="5")
    assert not _firing(stack, "GpudaemonGpuUnhealthy")


def test_health_verdicts_fire_their_action_alerts(stack: Stack) -> None:
    """A pending row remap (GPU 6) fires the reset alert; a clock slowdown (GPU 1), the
    degraded one (its hour shortened like every `for:`); each only for its GPU."""
    reset = wait_for(
        lambda: _firing(stack, "GpudaemonGpuNeedsReset", node=NODE_A, gpu="6"),
        timeout=60,
        interval=1,
        what="GpudaemonGpuNeedsReset firing for GPU 6",
    )
    assert (reset["labels"]["action"], reset["labels"]["severity"]) == ("reset_gpu", "critical")
    degraded = wait_for(
        lambda: _firing(stack, "GpudaemonGpuDegraded", node=NODE_A, gpu="1"),
        timeout=60,
        interval=1,
        what="GpudaemonGpuDegraded firing for GPU 1",
    )
    assert degraded["labels"]["severity"] == "warning"
    fired = {
        (a["labels"]["alertname"], a["labels"].get("node"), a["labels"].get("gpu"))
        for a in stack.alerts()
        if a["labels"]["alertname"].startswith(("GpudaemonGpuNeeds", "GpudaemonGpuDegraded"))
    }
    assert fired == {
        ("GpudaemonGpuNeedsReboot", NODE_A, "3"),
        ("GpudaemonGpuNeedsReset", NODE_A, "6"),
        ("GpudaemonGpuDegraded", NODE_A, "1"),
    }


def test_rule_groups_evaluate_without_errors(stack: Stack) -> None:
    status, body = http_get(stack.prom_url + "/api/v1/rules")
    assert status == 200
    groups = json.loads(body)["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    shipped = yaml.safe_load(RULES.read_text())["groups"]
    assert sorted(r["name"] for r in rules) == sorted(
        r["alert"] for g in shipped for r in g["rules"]
    )  # every shipped rule is loaded, none dropped
    assert len(rules) >= 24
    assert {r["name"]: r["health"] for r in rules} == {r["name"]: "ok" for r in rules}


GPM_SERIES = [
    "gpudaemon_gpu_sm_active_ratio",
    "gpudaemon_gpu_sm_occupancy_ratio",
    "gpudaemon_gpu_tensor_active_ratio",
    "gpudaemon_gpu_dram_active_ratio",
    "gpudaemon_gpu_fp64_active_ratio",
    "gpudaemon_gpu_nvlink_bytes_total",
    "gpudaemon_gpu_pcie_bytes_total",
]


def test_the_h100_agent_exports_gpm_and_the_a100_agent_none(stack: Stack) -> None:
    """Issue 33: the simulated H100 node exports every GPM series, consistent with its
    utilization; the A100 (MIG) node exports none of them, not even as 0."""
    for name in GPM_SERIES:
        got = wait_for(lambda n=name: stack.query(f'{n}{{node="{NODE_A}"}}'), 40, what=name)
        assert {r["metric"]["gpu"] for r in got} >= {"0", "1", "2"}, name
        assert not stack.query(f'{name}{{node="{NODE_B}"}}'), f"{name} on the A100 node"
    assert not stack.query(f'{{__name__=~"gpudaemon_mig_.*_ratio", node="{NODE_B}"}}')
    # SM activity never above utilization, tensor within SM activity (same poll).
    assert not stack.query(
        "gpudaemon_gpu_sm_active_ratio > on (node, uuid) gpudaemon_gpu_utilization_ratio"
    )
    assert not stack.query(
        "gpudaemon_gpu_tensor_active_ratio > on (node, uuid) gpudaemon_gpu_sm_active_ratio"
    )
    # The idle GPU a pod holds is the one "idle but allocated" finds.
    idle = stack.query('gpudaemon_gpu_sm_active_ratio{pod!=""} < 0.05')
    assert [(r["metric"]["node"], r["metric"]["gpu"]) for r in idle] == [(NODE_A, "2")]
