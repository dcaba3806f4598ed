"""Helm refusals a person can read (issue 39), with Helm 4 and Helm 3 as each prints them.

- No gpudaemon image is published yet, so the chart has no default image: without
  `image.repository`, `helm template` and `helm install` stop with one line that names
  the value and says how to build and push one, and install creates nothing.
- A value that must match a pattern (a cron schedule, a name, a path, a duration) is
  refused in one line that names the key and shows a good value, not Helm's schema
  message with the whole regular expression (a bad cron printed ~2,000 characters of
  it). Every pattern of files/value-checks.json is fed a bad value and its own example.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import CHART, IMAGE, run_helm

pytestmark = pytest.mark.integration

CHECKS = json.loads((CHART / "files" / "value-checks.json").read_text())
IMAGE_LINE = (
    "image.repository is required: no gpudaemon image is published yet; build one with "
    "scripts/build-image --tag REGISTRY/gpudaemon:0.1.0, push it to a registry your nodes "
    'pull from (docs/install.md, "The image"), then --set image.repository=REGISTRY/gpudaemon'
)
# Helm's own hint after a template error (`helm template` only); not ours to remove.
HELM_HINT = "Use --debug flag to render out invalid YAML"


def error_line(stderr: str) -> str:
    """The one line Helm prints for the refusal (and its hint, nothing else)."""
    lines = [line for line in stderr.splitlines() if line.strip() and line != HELM_HINT]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("Error: "), stderr
    assert "goroutine" not in stderr
    return lines[0]


def test_helm_template_without_an_image_is_one_line_saying_how_to_make_one(helm: str) -> None:
    proc = run_helm(helm, "template", "gpudaemon", str(CHART))
    assert proc.returncode != 0 and proc.stdout == ""
    line = error_line(proc.stderr)
    assert line.endswith(IMAGE_LINE), line
    assert line.startswith("Error: execution error at (gpudaemon/templates/")


def test_helm_install_without_an_image_fails_and_creates_nothing(
    helm: str, cluster: Cluster
) -> None:
    rel = f"noimage-{uuid.uuid4().hex[:6]}"
    proc = run_helm(
        helm, "install", rel, str(CHART), "-n", rel, "--create-namespace",
        kubeconfig=cluster.kubeconfig,
    )  # fmt: skip
    assert proc.returncode != 0
    assert error_line(proc.stderr).endswith(IMAGE_LINE), proc.stderr
    assert cluster.items("/apis/apps/v1/daemonsets", f"app.kubernetes.io/instance={rel}") == []
    assert cluster.items("/api/v1/secrets", f"owner=helm,name={rel}") == []
    assert all(ns["metadata"]["name"] != rel for ns in cluster.items("/api/v1/namespaces", ""))


def test_an_image_is_all_the_default_values_need(helm: str) -> None:
    proc = run_helm(helm, "template", "gpudaemon", str(CHART), *IMAGE)
    assert proc.returncode == 0, proc.stderr
    images = {
        c["image"]
        for d in yaml.safe_load_all(proc.stdout)
        if d and d["kind"] in ("DaemonSet", "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] != "kube-scheduler"
    }
    assert images == {"registry.example.com/gpudaemon:0.1.0"}


# -- patterns: the key and a good value, never the regular expression ---------------------


def first_check(kind: str) -> list[str]:
    """A values path the pattern `kind` applies to (the shortest, the chart's own
    before the config model's)."""
    paths = [c["path"] for c in CHECKS["checks"] if c["kind"] == kind]
    return min(paths, key=len)


def values_at(path: list[str], value: str) -> dict[str, Any]:
    """{"a": {"b": [value]}} for a.b.*; a list stands for `*` (all check paths end in a
    key or in a list of strings)."""
    out: Any = value
    for key in reversed(path):
        out = [out] if key == "*" else {key: out}
    assert isinstance(out, dict)
    return out


def shown(path: list[str]) -> str:
    return ".".join(path).replace(".*", "[0]")


def render(helm: str, tmp_path: Path, values: dict[str, Any]) -> Any:
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    return run_helm(helm, "template", "gpudaemon", str(CHART), *IMAGE, "-f", str(f))


BAD = "Not A Good Value!"


@pytest.mark.parametrize("kind", sorted(CHECKS["kinds"]))
def test_a_value_that_misses_its_pattern_is_one_line_naming_the_key_and_a_good_value(
    helm: str, kind: str, tmp_path: Path
) -> None:
    path, words = first_check(kind), CHECKS["kinds"][kind]
    proc = render(helm, tmp_path, values_at(path, BAD))
    assert proc.returncode != 0
    line = error_line(proc.stderr)
    assert line.endswith(
        f"{shown(path)}: '{BAD}' is not {words['what']}, e.g. '{words['example']}'"
    ), line
    assert words["pattern"] not in proc.stderr and len(line) < 400, line


def test_every_patterns_example_is_accepted_where_it_applies(helm: str, tmp_path: Path) -> None:
    values: dict[str, Any] = {}
    for kind, words in CHECKS["kinds"].items():
        for key, sub in values_at(first_check(kind), words["example"]).items():
            values[key] = _merge(values.get(key), sub)
    proc = render(helm, tmp_path, values)
    assert proc.returncode == 0, proc.stderr


def _merge(a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        return {**a, **{k: _merge(a.get(k), v) for k, v in b.items()}}
    return b


def test_a_bad_cron_deep_in_the_config_is_a_short_line(helm: str, tmp_path: Path) -> None:
    """The case of the issue: ~2,000 characters of pattern before; now the key, the value
    and an example, for any of the three programs' configs."""
    for program in ("agent", "extender", "rebalancer"):
        values = {program: {"config": {"schedules": {"labels": "*/5 * * *"}}}}
        proc = render(helm, tmp_path, values)
        line = error_line(proc.stderr)
        assert f"{program}.config.schedules.labels: '*/5 * * *' is not a cron expression" in line
        assert "e.g. '*/5 * * * * *'" in line and len(proc.stderr) < 500, proc.stderr
