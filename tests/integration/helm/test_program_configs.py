"""Each program's ConfigMap, as the real `helm template` renders it with every value
set, loads for that program's model (issue 29: configuration per program)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpudaemon.config import AgentSettings, ExtenderSettings, RebalancerSettings, load_settings
from tests.integration.helm.conftest import CHART, EVERYTHING, run_helm

pytestmark = pytest.mark.integration

PROGRAMS = {
    "gpudaemon-agent": AgentSettings,
    "gpudaemon-extender": ExtenderSettings,
    "gpudaemon-rebalancer": RebalancerSettings,
}


def test_every_programs_configmap_loads_for_its_program(helm: str, tmp_path: Path) -> None:
    proc = run_helm(
        helm, "template", "gpudaemon", str(CHART), "-n", "gpudaemon", "-f", str(EVERYTHING)
    )
    assert proc.returncode == 0, proc.stderr
    maps = {
        d["metadata"]["name"]: d["data"]["config.yaml"]
        for d in yaml.safe_load_all(proc.stdout)
        if d and d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {})
    }
    assert set(PROGRAMS) <= set(maps), sorted(maps)
    for name, model in PROGRAMS.items():
        f = tmp_path / f"{name}.yaml"
        f.write_text(maps[name])
        cfg = load_settings(model, str(f), environ={"NODE_NAME": "node-1"})
        assert cfg.labels.prefix, name
