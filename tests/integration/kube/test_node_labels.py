"""`gpudaemon run --once` against the real API server with the agent's restricted
identity: the brief's labels and annotation appear, foreign keys survive, dropped keys
go, odd GPU names give valid distinct labels, and the agent never creates a Node."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.gfd import GFD_DGX_H100
from tests.integration.kube.controlplane import ControlPlane, annotation
from tests.support import REPO, start_agent, stop, wait_for

pytestmark = pytest.mark.integration

P = "gpudaemon.io/"
VALUE_RE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def run_once(cp: ControlPlane, node: str, simulate: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "GPUDAEMON_KUBERNETES__KUBECONFIG": str(cp.agent_kubeconfig),
        "GPUDAEMON_LABELS__TO": "apiserver",
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "gpudaemon",
            "run",
            "--simulate",
            simulate,
            "--node-name",
            node,
            "--once",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_once_puts_the_briefs_labels_and_a_parseable_annotation(
    control_plane: ControlPlane, node: str
) -> None:
    proc = run_once(control_plane, node, "dgx-h100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meta = control_plane.node(node)["metadata"]
    ours = {k.removeprefix(P): v for k, v in meta["labels"].items() if k.startswith(P)}
    assert ours == {
        "gpu.present": "true",
        "gpu.count": "8",
        "gpu.product": "NVIDIA-H100-80GB-HBM3",
        "gpu.family": "hopper",
        "gpu.memory": "81559",
        "gpu.memory.min": "81559",
        "gpu.compute.major": "9",
        "gpu.compute.minor": "0",
        "cuda.driver.major": "550",  # the driver version, as GFD means it
        "cuda.driver.minor": "54",
        "cuda.driver.rev": "15",
        "cuda.runtime.major": "12",  # the CUDA version, as GFD means it
        "cuda.runtime.minor": "4",
        # GFD's newer spellings of the same versions (internal/lm/nvml.go)
        "cuda.driver-version.full": "550.54.15",
        "cuda.driver-version.major": "550",
        "cuda.driver-version.minor": "54",
        "cuda.driver-version.revision": "15",
        "cuda.runtime-version.full": "12.4",
        "cuda.runtime-version.major": "12",
        "cuda.runtime-version.minor": "4",
        "gpu.replicas": "1",  # no sharing: GFD's resource labeler
        "gpu.sharing-strategy": "none",
        "mps.capable": "false",
        "gpu.healthy": "8",
        "gpu.unhealthy": "0",  # always present (issue 17)
        "mig.capable": "true",  # an H100 can be partitioned
        "mig.enabled": "false",
        "mig.strategy": "none",
    }
    gpus = annotation(control_plane.node(node))
    assert [g["index"] for g in gpus] == list(range(8))
    assert all(g["healthy"] is True and g["memory_total_mib"] == 81559 for g in gpus)
    assert all(g["uuid"].startswith("GPU-") for g in gpus)
    managers = {(m["manager"], m["operation"]) for m in meta["managedFields"]}
    assert ("gpudaemon", "Apply") in managers


def test_foreign_labels_survive_and_dropped_labels_are_removed(
    control_plane: ControlPlane, node: str
) -> None:
    assert run_once(control_plane, node, "mixed").returncode == 0
    labels = control_plane.node(node)["metadata"]["labels"]
    assert labels[P + "gpu.mixed"] == "true"
    # Someone else adds a label and an annotation after the agent's first write.
    control_plane.admin.request(
        "PATCH",
        f"/api/v1/nodes/{node}",
        body={"metadata": {"labels": {"zone": "b"}, "annotations": {"example.com/owner": "sre"}}},
        content_type="application/merge-patch+json",
    )
    proc = run_once(control_plane, node, "dgx-h100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meta = control_plane.node(node)["metadata"]
    assert P + "gpu.mixed" not in meta["labels"]
    assert meta["labels"][P + "gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert {k: meta["labels"][k] for k in ("team", "example.com/rack", "zone")} == {
        "team": "ml",
        "example.com/rack": "r12",
        "zone": "b",
    }
    assert meta["annotations"]["example.com/owner"] == "sre"


LONG = (
    "NVIDIA H100 80GB HBM3 (Engineering Sample) / rev.A1 :: SXM5 <pre-release> "
    "build 2024-03-01 with a very long marketing name"
)


@pytest.mark.parametrize("suffix", [("#1", "#2")])
def test_long_punctuated_names_give_valid_distinct_labels_on_the_node(
    control_plane: ControlPlane, tmp_path: Path, suffix: tuple[str, str]
) -> None:
    values = []
    for i, s in enumerate(suffix):
        profile = tmp_path / f"p{i}.yaml"
        profile.write_text(
            'driver_version: "550.54.15"\ncuda_version: "12.4"\ngpus:\n'
            f'  - {{name: "{LONG} {s}", memory_total_mib: 81559, compute_capability: "9.0"}}\n'
        )
        name = f"odd-{uuid.uuid4().hex[:8]}"
        control_plane.create_node(name)
        proc = run_once(control_plane, name, str(profile))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        values.append(control_plane.node(name)["metadata"]["labels"][P + "gpu.product"])
    assert values[0] != values[1]
    for v in values:
        assert len(v) <= 63 and VALUE_RE.fullmatch(v), v
        assert v.startswith("NVIDIA-H100-80GB-HBM3")


def test_agent_never_creates_a_missing_node_and_says_so_in_one_line(
    control_plane: ControlPlane,
) -> None:
    name = f"absent-{uuid.uuid4().hex[:8]}"
    proc = run_once(control_plane, name, "dgx-h100")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    assert f"/api/v1/nodes/{name}: HTTP 404" in proc.stdout + proc.stderr
    listed = control_plane.admin.request("GET", "/api/v1/nodes")["items"]
    assert name not in {n["metadata"]["name"] for n in listed}


def test_the_chart_s_nvidia_prefix_writes_gfd_s_labels(
    control_plane: ControlPlane, node: str, tools_bin: Path, tmp_path: Path
) -> None:
    """The drop-in of docs/migrate.md: the agent config the chart renders for
    `labelPrefix: nvidia.com/`, run on simulated H100s, puts GFD's keys and values on a
    real Node (as the admin: the test control plane's admission policy is the default
    prefix's)."""
    chart = REPO / "deploy" / "helm" / "gpudaemon"
    proc = subprocess.run(
        [str(tools_bin / "helm"), "template", "g", str(chart), "--set", "labelPrefix=nvidia.com/",
         "--set", "image.repository=registry.example.com/gpudaemon",
         "--show-only", "templates/agent/configmap.yaml"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_load(proc.stdout)["data"]["config.yaml"])
    env = {**os.environ, "GPUDAEMON_KUBERNETES__KUBECONFIG": str(control_plane.admin_kubeconfig)}
    run = subprocess.run(
        [sys.executable, "-m", "gpudaemon", "run", "--config", str(config),
         "--simulate", "dgx-h100", "--node-name", node, "--once"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    labels = control_plane.node(node)["metadata"]["labels"]
    assert {k: labels.get(k) for k in GFD_DGX_H100} == GFD_DGX_H100
    # Not a GFD key (tests/gfd.py BEYOND_GFD), and written under the prefix too.
    assert labels.get("nvidia.com/gpu.present") == "true"
    assert not [k for k in labels if k.startswith(P)]  # nothing under the default prefix


SHARED = {"nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "time-slicing"}


def test_under_gfds_prefix_the_sharing_keys_someone_else_set_stay_theirs(
    control_plane: ControlPlane, node: str, tmp_path: Path
) -> None:
    """Time-slicing: the device plugin's config has GFD write `gpu.replicas=4` and
    `gpu.sharing-strategy=time-slicing` (here as another field manager, before the agent
    starts and again while it runs). A long-running agent with `labelPrefix:
    nvidia.com/` writes its other GFD keys and leaves those two as they were for more
    than a full label cycle (its Node watch sees the change at once)."""
    cp = control_plane

    def set_shared(values: dict[str, str]) -> None:
        cp.admin.request("PATCH", f"/api/v1/nodes/{node}", body={"metadata": {"labels": values}},
                         query={"fieldManager": "nvidia-device-plugin"},
                         content_type="application/merge-patch+json")  # fmt: skip

    def shared() -> dict[str, str | None]:
        labels = cp.node(node)["metadata"]["labels"]
        return {k: labels.get(k) for k in SHARED}

    set_shared(SHARED)
    config = tmp_path / "config.yaml"
    config.write_text(
        "labels: {prefix: nvidia.com/, to: apiserver}\n"
        "metrics: {listen: '127.0.0.1:0'}\n"
        "schedules: {telemetry: '* * * * * *', labels: '*/2 * * * * *'}\n"
    )
    env = {"GPUDAEMON_KUBERNETES__KUBECONFIG": str(cp.admin_kubeconfig)}
    proc = start_agent(
        ["run", "--config", str(config), "--simulate", "dgx-h100", "--node-name", node],
        env=env, log=tmp_path / "agent.log",
    )  # fmt: skip
    try:
        wait_for(lambda: cp.node(node)["metadata"]["labels"].get("nvidia.com/gpu.count") == "8",
                 timeout=60, what="the agent's labels")  # fmt: skip
        # Two label cycles (2 s each) and a resync of its own view: still theirs.
        time.sleep(5)
        assert shared() == SHARED
        # Changed again while it runs (a new sharing config): theirs still.
        set_shared({"nvidia.com/gpu.replicas": "2", "nvidia.com/gpu.sharing-strategy": "mps"})
        time.sleep(5)
        assert shared() == {"nvidia.com/gpu.replicas": "2",
                            "nvidia.com/gpu.sharing-strategy": "mps"}  # fmt: skip
        # Every other GFD key is the agent's, with GFD's value.
        labels = cp.node(node)["metadata"]["labels"]
        others = {k: v for k, v in GFD_DGX_H100.items() if k not in SHARED}
        assert {k: labels.get(k) for k in others} == others
    finally:
        assert stop(proc) == 0
    log = (tmp_path / "agent.log").read_text()
    assert "set by another manager: leaving them to it" in log
