"""Bad values are refused by the chart before anything reaches the cluster, the same way
the agent refuses them (issue 18): the same cron expressions go to `load_config` and to
`helm template` (the values schema's cron pattern, from gpudaemon/schedule.py, and the
template's backwards-range and step-width checks), and both must agree; `helm install` with a bad value
fails, names it, and leaves nothing behind."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpudaemon.config import load_config
from gpudaemon.errors import ConfigError
from gpudaemon.schedule import parse_cron
from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import CHART, IMAGE, run_helm

pytestmark = pytest.mark.integration

BAD = [
    "*/5 * * *",  # four fields
    "61 * * * * *",  # second 61
    "* * * * * * *",  # seven fields
    "5-3 * * * *",  # a range that runs backwards
    "0 9 * * fri-mon",
    "0 0 L * *",  # APScheduler extras are not the documented crontab form
    "*/0 * * * *",
    "0 0 32 * *",
    "0 0 * 13 *",
    "0 0 * * 8",
    "0 24 * * *",
    "0 9 * * MON",  # names in lower case
    "every minute",
    "",
    "5/15 * * * * *",  # a step needs a range or a star before it
    "0-10/20 * * * *",  # a step wider than its range (APScheduler refuses it)
    "5-5/1 * * * *",
    "0 0 * * 1-5/2",  # no step on weekdays (APScheduler's names take none)
    "0 0 * jan-dec/2 *",  # nor after names
]
GOOD = [
    "*/5 * * * * *",
    "0 */5 * * * *",
    "0 9 * * mon-fri",
    "30 2 * * 0-3",
    "0 0 1 jan-dec sun",
    "0 0,12 1,15 * *",
    "0 0 * * 7",
    "0-30/5 * * * *",  # stepped ranges of numbers, as crontab has them
    "0 8-18/2 * * mon-fri",
    "*/10 0-50/10 * 1-31/7 1-12/3 *",
    "0-10/10 * * * *",
]


def binary_refuses(expr: str) -> bool:
    try:
        load_config(environ={}, overrides={"schedules": {"telemetry": expr}})
    except ConfigError:
        return True
    parse_cron(expr)  # and what it accepts, APScheduler can run
    return False


def values_file(tmp_path: Path, values: dict[str, Any]) -> list[str]:
    """Values go in a file: `--set` would split a cron list such as `0,12` at the comma."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["-f", str(path)]


def chart_refuses(helm: str, expr: str, tmp_path: Path) -> tuple[bool, str]:
    values = {"agent": {"config": {"schedules": {"telemetry": expr}}}}
    proc = run_helm(helm, "template", "t", str(CHART), *IMAGE, *values_file(tmp_path, values))
    return proc.returncode != 0, proc.stderr


@pytest.mark.parametrize("expr", BAD + GOOD)
def test_the_chart_and_the_agent_refuse_the_same_schedules(
    helm: str, expr: str, tmp_path: Path
) -> None:
    refused, why = chart_refuses(helm, expr, tmp_path)
    assert refused == binary_refuses(expr) == (expr in BAD), why
    if refused:
        assert "schedules" in why and "telemetry" in why, why  # the error names the value


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"agent": {"config": {"schedules": {"telemetry": "*/5 * * *"}}}}, "telemetry"),
        ({"agent": {"config": {"schedules": {"labels": "61 * * * * *"}}}}, "labels"),
        ({"agent": {"config": {"schedules": {"history": "5-3 * * * *"}}}}, "history"),
        ({"bogus": 1}, "bogus"),
        ({"service": {"port": 70000}}, "port"),
    ],
    ids=["four-field-cron", "second-61", "backwards-range", "unknown-key", "port-70000"],
)
def test_helm_install_with_a_bad_value_fails_and_creates_nothing(
    helm: str, cluster: Cluster, values: dict[str, Any], named: str, tmp_path: Path
) -> None:
    rel = f"bad-{uuid.uuid4().hex[:6]}"
    proc = run_helm(
        helm, "install", rel, str(CHART), "-n", rel, "--create-namespace", *IMAGE,
        *values_file(tmp_path, values), kubeconfig=cluster.kubeconfig,
    )  # fmt: skip
    assert proc.returncode != 0
    assert named in proc.stderr, proc.stderr
    instance = f"app.kubernetes.io/instance={rel}"
    for path in ("/apis/apps/v1/daemonsets", "/apis/apps/v1/deployments", "/api/v1/configmaps",
                 "/apis/rbac.authorization.k8s.io/v1/clusterroles"):  # fmt: skip
        assert cluster.items(path, instance) == [], path
    assert cluster.items("/api/v1/secrets", f"owner=helm,name={rel}") == []
    assert all(
        ns["metadata"]["name"] != rel for ns in cluster.items("/api/v1/namespaces", "")
    )  # not even the namespace: refused before anything was sent
