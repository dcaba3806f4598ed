"""One source of truth: deploy/manifests/, the PrometheusRule and the chart's copies of
the alert rules and dashboards are what scripts/render-manifests makes from their
sources; the chart's scheduler configuration is the documented example's; and the real
kube-scheduler accepts it. The no-Helm install command of docs/install.md, run as
written, gives every gpudaemon container the image it names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import CHART, IMAGE, run_helm
from tests.integration.helm.test_chart import _resources
from tests.support import REPO

pytestmark = pytest.mark.integration

SCRIPT = REPO / "scripts" / "render-manifests"
EXAMPLE = REPO / "deploy" / "scheduler" / "kube-scheduler-config.yaml"
MANIFESTS = REPO / "deploy" / "manifests"
INSTALL = REPO / "docs" / "install.md"


def check(helm: str, root: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(root / "scripts" / "render-manifests"), "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, "HELM": helm},
    )


def test_deploy_files_match_what_the_chart_renders(helm: str) -> None:
    proc = check(helm)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_hand_edit_of_a_rendered_file_is_reported(helm: str, tmp_path: Path) -> None:
    for d in ("deploy", "grafana", "scripts"):
        shutil.copytree(REPO / d, tmp_path / d)
    rbac = tmp_path / "deploy" / "manifests" / "rbac.yaml"
    rbac.write_text(rbac.read_text().replace('"patch"', '"patch", "delete"'))
    (tmp_path / "grafana" / "gpudaemon-node.json").write_text("{}\n")
    proc = check(helm, tmp_path)
    assert proc.returncode == 1
    assert "deploy/helm/gpudaemon/files/dashboards/gpudaemon-node.json" in proc.stdout
    # After the copies are fixed, the rendered manifests are compared too.
    shutil.copy(REPO / "grafana" / "gpudaemon-node.json", tmp_path / "grafana")
    proc = check(helm, tmp_path)
    assert proc.returncode == 1
    assert "deploy/manifests/rbac.yaml (committed)" in proc.stdout
    assert '"delete"' in proc.stdout


def test_tests_apply_the_agent_rbac_and_policy_the_chart_ships() -> None:
    rbac = list(yaml.safe_load_all((REPO / "deploy/manifests/rbac.yaml").read_text()))
    assert [d["kind"] for d in rbac] == [
        "Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
    ]  # fmt: skip
    (role,) = [d for d in rbac if d["kind"] == "ClusterRole"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
    ]


def scheduler_config(helm: str, *args: str) -> dict[str, Any]:
    proc = run_helm(
        helm, "template", "gpudaemon", str(CHART), "-n", "gpudaemon", *IMAGE,
        "--show-only", "templates/scheduler/configmap.yaml", *args,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return dict(yaml.safe_load(yaml.safe_load(proc.stdout)["data"]["config.yaml"]))


def test_chart_scheduler_config_is_the_documented_example(helm: str) -> None:
    """Release "gpudaemon" in namespace "gpudaemon" renders exactly the example (the
    extender's loopback address and the leader-election Lease included)."""
    assert scheduler_config(helm) == yaml.safe_load(EXAMPLE.read_text())


def written_by_kube_scheduler(
    tools_bin: Path, tmp_path: Path, config: dict[str, Any]
) -> dict[str, Any]:
    """The configuration as the real kube-scheduler loads, defaults and validates it
    (--write-config-to)."""
    # Outside a pod there is no in-cluster config; a kubeconfig that is never dialled
    # is enough for the scheduler to load, default and validate the file.
    kc = tmp_path / "kubeconfig"
    kc.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    config["clientConnection"] = {"kubeconfig": str(kc)}
    src, out = tmp_path / "in.yaml", tmp_path / "out.yaml"
    src.write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [str(tools_bin / "kube-scheduler"), f"--config={src}", f"--write-config-to={out}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(yaml.safe_load(out.read_text()))


def test_real_kube_scheduler_accepts_the_chart_config(
    helm: str, tools_bin: Path, tmp_path: Path
) -> None:
    """The default (every pod reaches the extender: no managedResources, issue 40) and
    `scheduler.extenderPods: managed` (the GPU and MIG resource list)."""
    written = written_by_kube_scheduler(
        tools_bin, tmp_path, scheduler_config(helm, "--set", "scheduler.extenderWeight=3")
    )
    (profile,) = written["profiles"]
    assert profile["schedulerName"] == "gpudaemon-scheduler"
    (ext,) = written["extenders"]
    assert ext["urlPrefix"] == "http://127.0.0.1:9446"  # the sidecar (issue 17)
    assert ext["weight"] == 3 and ext["nodeCacheCapable"] is True
    assert not ext.get("managedResources")
    assert written["leaderElection"]["leaderElect"] is True
    assert written["leaderElection"]["resourceName"] == "gpudaemon-scheduler"

    written = written_by_kube_scheduler(
        tools_bin, tmp_path, scheduler_config(helm, "--set", "scheduler.extenderPods=managed")
    )
    (ext,) = written["extenders"]
    # ignoredByScheduler: false is the default, which the scheduler writes out as absent.
    names = [r["name"] for r in ext["managedResources"]]
    assert names[0] == "nvidia.com/gpu" and "nvidia.com/mig-1g.10gb" in names
    assert all(r == {"name": r["name"]} for r in ext["managedResources"])  # + and . accepted


def no_helm_command() -> str:
    """The fenced block of docs/install.md that pipes deploy/manifests into kubectl."""
    blocks = re.findall(r"```sh\n(.*?)```", INSTALL.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "| kubectl apply -f -" in b]
    return str(block)


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = (doc.get("spec") or {}).get("template", {}).get("spec") or {}
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


PLACEHOLDER = "registry.invalid/replace-me/gpudaemon"


def test_the_manifests_name_a_placeholder_image_that_cannot_be_pulled() -> None:
    """No gpudaemon image is published yet: the rendered files name one that says it is
    to be replaced and can never be pulled (`.invalid` never resolves), never an image
    that looks real (`gpudaemon:0.1.0` did, issue 39); docs/install.md says so."""
    images: dict[tuple[str, str], str] = {}
    for f in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            for c in containers(doc or {}):
                images[(doc["metadata"]["name"], c["name"])] = c["image"]
    assert images.pop(("gpudaemon-scheduler", "kube-scheduler")).startswith("registry.k8s.io/")
    assert {("gpudaemon", "agent"), ("gpudaemon-scheduler", "extender")} <= set(images)
    assert {i.rsplit(":", 1)[0] for i in images.values()} == {PLACEHOLDER}, images
    assert PLACEHOLDER.split("/")[0].endswith(".invalid")
    assert PLACEHOLDER in SCRIPT.read_text() and PLACEHOLDER in INSTALL.read_text()
    assert "placeholder" in (MANIFESTS / "agent.yaml").read_text().split("---")[0]


def test_the_documented_no_helm_command_sets_every_gpudaemon_image(
    cluster: Cluster, release: str, tmp_path: Path
) -> None:
    """The command as a reader runs it, from the repository root, with a `kubectl` that
    records its arguments and what it is given; then the API server judges that stream
    (what `kubectl apply --server-side --dry-run=server` would send; the namespace
    `gpudaemon` exists, with the chart's release in it)."""
    block = no_helm_command()
    (image,) = re.findall(r"^IMAGE=(\S+)$", block, flags=re.M)
    shim = tmp_path / "bin" / "kubectl"
    shim.parent.mkdir()
    shim.write_text('#!/bin/sh\necho "$@" > "$RECORD.args"\ncat > "$RECORD"\n')
    shim.chmod(0o755)
    record = tmp_path / "stream.yaml"
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=REPO,
                          env={**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}",
                               "RECORD": str(record)},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert Path(f"{record}.args").read_text().split() == ["apply", "-f", "-"]
    stream = [d for d in yaml.safe_load_all(record.read_text()) if d]

    # Every object of every file, each whole (none merged into its neighbour), the
    # Namespace first; only the monitoring/ files (which need CRDs) are left out.
    def key(d: dict[str, Any]) -> tuple[str, str]:
        return (d["kind"], d["metadata"]["name"])

    files = sorted(MANIFESTS.glob("*.yaml"))
    expected = [key(d) for f in files for d in yaml.safe_load_all(f.read_text()) if d]
    assert sorted(map(key, stream)) == sorted(expected)
    assert key(stream[0]) == ("Namespace", "gpudaemon")

    seen: dict[tuple[str, str], str] = {}
    for doc in stream:
        for c in containers(doc):
            seen[(doc["metadata"]["name"], c["name"])] = c["image"]
    kube_scheduler = ("gpudaemon-scheduler", "kube-scheduler")
    assert seen.pop(kube_scheduler).startswith("registry.k8s.io/kube-scheduler:")
    assert {("gpudaemon", "agent"), ("gpudaemon-scheduler", "extender")} <= set(seen)
    assert set(seen.values()) == {image}, seen
    # Against the committed files: only the image lines changed.
    original = {key(d): d for f in files for d in yaml.safe_load_all(f.read_text()) if d}
    for doc in stream:
        for c in containers(doc):
            c["image"] = "-"
        for c in containers(original[key(doc)]):
            c["image"] = "-"
        assert doc == original[key(doc)], key(doc)

    resources = _resources(cluster)
    for doc in stream:
        base, namespaced, plural = resources[(doc["apiVersion"], doc["kind"])]
        meta = doc["metadata"]
        where = f"/namespaces/{meta['namespace']}" if namespaced else ""
        cluster.request(
            "PATCH",
            f"{base}{where}/{plural}/{meta['name']}",
            body=doc,
            content_type="application/apply-patch+yaml",
            query={"dryRun": "All", "fieldManager": "no-helm-dry-run", "force": "true",
                   "fieldValidation": "Strict"},
        )  # fmt: skip
