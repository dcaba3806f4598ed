"""The generated reference docs (docs/reference/, scripts/gen-docs) and the chart's
values schema match the code: the files are what the generator makes now, and, checked independently of the generator,
every config key, every metric and every label the simulated profiles produce is in
them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from gpudaemon.agent.cache import Cache
from gpudaemon.agent.metrics.collector import ReadingAgeCollector
from gpudaemon.agent.metrics.selfmetrics import AgentMetrics
from gpudaemon.catalogue import CATALOGUE
from gpudaemon.config import ENV_PREFIX, Config
from gpudaemon.extender.metrics import CacheCollector, ExtenderMetrics
from gpudaemon.history.writer import InfluxMetrics
from tests.support import REPO, run_cli

REFERENCE = REPO / "docs" / "reference"


def _gendocs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gendocs", REPO / "scripts" / "gendocs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_files_are_what_the_generator_makes_now() -> None:
    rendered = _gendocs().render()
    stale = [p.name for p, text in rendered.items() if not p.is_file() or p.read_text() != text]
    assert stale == [], f"run scripts/gen-docs: {stale} differ from the code"


def config_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        key = prefix + (f.alias or name)
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out += config_keys(f.annotation, key + ".")
        else:
            out.append(key)
    return out


def test_every_config_key_and_its_variable_is_in_the_reference() -> None:
    doc = (REFERENCE / "configuration.md").read_text()
    keys = config_keys(Config)
    assert {
        "node_name",
        "influxdb.token_file",
        "kubernetes.lease_namespace",
        "extender.policy",
    } <= set(keys)
    missing = [k for k in keys if f"| `{k}` |" not in doc]
    assert missing == []
    env = [ENV_PREFIX + k.upper().replace(".", "__") for k in keys]
    assert [e for e in env if f"`{e}`" not in doc] == []


def registered_metric_names() -> set[str]:
    """Every family the agent's and extender's metric classes register, by their own code."""
    reg = CollectorRegistry()
    AgentMetrics(reg)
    InfluxMetrics(reg)
    ExtenderMetrics(reg)
    reg.register(ReadingAgeCollector(Cache(), lambda: 0.0))
    reg.register(CacheCollector(lambda: {}, lambda: {}))
    return {f.name + ("_total" if f.type == "counter" else "") for f in reg.collect()}


def test_every_metric_is_in_the_reference() -> None:
    doc = (REFERENCE / "metrics.md").read_text()
    names = {r.prometheus_name for r in CATALOGUE} | registered_metric_names()
    brief = {"gpudaemon_gpu_info", "gpudaemon_gpu_xid_errors_total", "gpudaemon_gpu_healthy",
             "gpudaemon_poll_duration_seconds", "gpudaemon_build_info"}  # fmt: skip
    assert brief <= names
    assert sorted(n for n in names if f"| `{n}` |" not in doc) == []


@pytest.mark.parametrize("profile", ["dgx-h100", "a100-mig", "mixed"])
def test_every_label_and_annotation_of_a_profile_is_in_the_reference(profile: str) -> None:
    doc = (REFERENCE / "labels.md").read_text()
    proc = run_cli("probe", "--simulate", profile, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [k for k in out["labels"] if f"| `{k}` |" not in doc] == []
    for key, value in out["annotations"].items():
        assert f"`{key}`" in doc
        fields = {f for gpu in json.loads(value) for f in gpu}
        assert [f for f in sorted(fields) if f"`{f}`" not in doc] == []


def test_generator_check_mode_reports_a_stale_file(tmp_path: Path) -> None:
    mod = _gendocs()
    mod.OUT = tmp_path  # type: ignore[attr-defined]  # empty: every file is missing
    assert mod.main(["--check"]) == 1


def test_the_values_schema_leaves_patterns_to_the_chart_s_checks() -> None:
    """Helm prints a failed `pattern` whole (a cron's is ~1,800 characters): the schema
    has none; files/value-checks.json holds each, with words and a good value that the
    pattern accepts (the chart's test feeds both to Helm: test_image_required.py)."""
    import re

    schema = (REPO / "deploy/helm/gpudaemon/values.schema.json").read_text()
    assert '"pattern"' not in schema
    checks = json.loads((REPO / "deploy/helm/gpudaemon/files/value-checks.json").read_text())
    assert {c["kind"] for c in checks["checks"]} == set(checks["kinds"])
    for kind, words in checks["kinds"].items():
        assert re.search(words["pattern"], words["example"]), kind
        assert not re.search(words["pattern"], "Not A Good Value!"), kind
    paths = {".".join(c["path"]) for c in checks["checks"]}
    assert {"agent.config.schedules.telemetry", "rebalancer.config.rebalance.selector",
            "labelPrefix", "agent.config.labels.nfd_path"} <= paths  # fmt: skip
