"""The shipped alert rules: promtool check and unit tests, and the PrometheusRule
manifest carrying exactly the same groups as the plain rule file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import REPO

pytestmark = pytest.mark.integration

RULES = REPO / "deploy/prometheus/gpudaemon-rules.yaml"
MANIFEST = REPO / "deploy/prometheus/gpudaemon-prometheusrule.yaml"
OPTIONAL = REPO / "deploy/prometheus/gpudaemon-optional-rules.yaml"
TESTS = sorted((Path(__file__).parent / "rules").glob("*.test.yaml"))


def test_promtool_check_rules_passes(promtool: str, tmp_path: Path) -> None:
    spec = tmp_path / "from-manifest.yaml"
    spec.write_text(yaml.safe_dump(yaml.safe_load(MANIFEST.read_text())["spec"]))
    for f in (RULES, spec):
        proc = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "SUCCESS: 26 rules found" in proc.stdout


@pytest.mark.parametrize("test_file", TESTS, ids=lambda p: p.name)
def test_promtool_test_rules_passes(promtool: str, test_file: Path) -> None:
    proc = subprocess.run(
        [promtool, "test", "rules", test_file.name],
        capture_output=True,
        text=True,
        cwd=test_file.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_prometheusrule_manifest_matches_the_rule_file() -> None:
    manifest = yaml.safe_load(MANIFEST.read_text())
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"] == yaml.safe_load(RULES.read_text())


def test_optional_rules_check_and_stay_out_of_the_default_manifest(promtool: str) -> None:
    proc = subprocess.run(
        [promtool, "check", "rules", str(OPTIONAL)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "SUCCESS: 1 rules found" in proc.stdout, proc.stdout
    optional = {g["name"] for g in yaml.safe_load(OPTIONAL.read_text())["groups"]}
    shipped = {g["name"] for g in yaml.safe_load(MANIFEST.read_text())["spec"]["groups"]}
    assert optional and not optional & shipped  # off by default


def test_every_alert_is_covered_by_a_promtool_test() -> None:
    alerts = {
        r["alert"]
        for f in (RULES, OPTIONAL)
        for g in yaml.safe_load(f.read_text())["groups"]
        for r in g["rules"]
    }
    tested = {
        t["alertname"]
        for f in TESTS
        for case in yaml.safe_load(f.read_text())["tests"]
        for t in case.get("alert_rule_test", [])
    }
    assert alerts == tested
