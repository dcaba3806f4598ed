"""The chart itself: helm lint and template for the default and the everything-enabled
values, the schema rejecting bad values by name, what the rendered pods promise
(placement, downward API, least-privilege security context), and every rendered object
accepted by the real API server's server-side dry run."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import CHART, EVERYTHING, IMAGE, run_helm

pytestmark = pytest.mark.integration

MONITORING_APIS = [
    "--api-versions",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "--api-versions",
    "monitoring.coreos.com/v1/PodMonitor",
    "--api-versions",
    "monitoring.coreos.com/v1/PrometheusRule",
]


def template(helm: str, *args: str, namespace: str = "gpudaemon") -> list[dict[str, Any]]:
    proc = run_helm(
        helm, "template", "gpudaemon", str(CHART), "--namespace", namespace, *IMAGE, *args
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, kinds(docs))
    return found[0]


@pytest.mark.parametrize("values", [[], ["-f", str(EVERYTHING)]], ids=["default", "everything"])
def test_helm_lint_passes(helm: str, values: list[str]) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART), *IMAGE, *values)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


def test_default_values_render_agent_extender_scheduler_and_policy(helm: str) -> None:
    docs = template(helm)
    assert kinds(docs) == [
        "ClusterRole/gpudaemon-agent",
        "ClusterRole/gpudaemon-cleanup",  # the post-delete hook's (helm uninstall)
        "ClusterRole/gpudaemon-extender",
        "ClusterRole/gpudaemon-status-reader",  # bound to nobody by default
        "ClusterRoleBinding/gpudaemon-agent",
        "ClusterRoleBinding/gpudaemon-cleanup",
        "ClusterRoleBinding/gpudaemon-extender",
        "ClusterRoleBinding/gpudaemon-scheduler-as-kube-scheduler",
        "ClusterRoleBinding/gpudaemon-scheduler-as-volume-scheduler",
        "ConfigMap/gpudaemon-agent",
        "ConfigMap/gpudaemon-dashboard-fleet",
        "ConfigMap/gpudaemon-dashboard-node",
        "ConfigMap/gpudaemon-extender",
        "ConfigMap/gpudaemon-scheduler",
        "DaemonSet/gpudaemon",
        "Deployment/gpudaemon-scheduler",  # with the extender as a sidecar (issue 17)
        "Job/gpudaemon-cleanup",
        "NetworkPolicy/gpudaemon-agent",
        "NetworkPolicy/gpudaemon-scheduler",
        "Role/gpudaemon-agent-leases",
        "Role/gpudaemon-cleanup",
        "Role/gpudaemon-extender-leases",
        "Role/gpudaemon-scheduler-leader-election",
        "Role/gpudaemon-status-reader",
        "RoleBinding/gpudaemon-agent-leases",
        "RoleBinding/gpudaemon-cleanup",
        "RoleBinding/gpudaemon-extender-leases",
        "RoleBinding/gpudaemon-scheduler-extension-apiserver-authentication-reader",
        "RoleBinding/gpudaemon-scheduler-leader-election",
        "Service/gpudaemon",
        "ServiceAccount/gpudaemon",
        "ServiceAccount/gpudaemon-cleanup",
        "ServiceAccount/gpudaemon-scheduler",
        "ValidatingAdmissionPolicy/gpudaemon-agent-node-keys",
        "ValidatingAdmissionPolicy/gpudaemon-agent-own-lease",
        "ValidatingAdmissionPolicy/gpudaemon-scheduler-no-rebalancer-lease",
        "ValidatingAdmissionPolicyBinding/gpudaemon-agent-node-keys",
        "ValidatingAdmissionPolicyBinding/gpudaemon-agent-own-lease",
        "ValidatingAdmissionPolicyBinding/gpudaemon-scheduler-no-rebalancer-lease",
    ]


def test_crd_backed_objects_render_only_when_the_api_exists_or_forced(helm: str) -> None:
    def monitoring(*args: str) -> list[str]:
        return [
            d["kind"] for d in template(helm, *args) if "monitoring.coreos.com" in d["apiVersion"]
        ]

    assert monitoring() == []
    assert sorted(monitoring(*MONITORING_APIS)) == [
        "PodMonitor",
        "PrometheusRule",
        "ServiceMonitor",
    ]
    assert monitoring(*MONITORING_APIS, "--set", "monitoring.serviceMonitor.enabled=false") == [
        "PrometheusRule"
    ]
    assert sorted(
        monitoring(
            "--set", "monitoring.serviceMonitor.force=true",
            "--set", "monitoring.prometheusRule.force=true",
        )
    ) == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]  # fmt: skip
    sm = one(template(helm, *MONITORING_APIS), "ServiceMonitor", "gpudaemon")
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True


def test_extender_and_scheduler_can_be_switched_off(helm: str) -> None:
    docs = template(helm, "--set", "extender.enabled=false", "--set", "scheduler.enabled=false")
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in docs}
    assert components == {"agent", "dashboards", "cleanup", "status"}


def test_gang_modes_workload_coscheduling_and_the_older_switch(helm: str) -> None:
    """mode workload: the stock image, GangScheduling, the gate, RBAC for the native
    objects, no CRD; mode coscheduling and the older `enabled: true`: the same
    scheduler-plugins setup; mode wins over `enabled`."""

    def render(*sets: str) -> tuple[str, list[str], list[str], list[str]]:
        docs = template(helm, *[a for kv in sets for a in ("--set", kv)])
        conf = yaml.safe_load(one(docs, "ConfigMap", "gpudaemon-scheduler")["data"]["config.yaml"])
        dep = one(docs, "Deployment", "gpudaemon-scheduler")["spec"]["template"]["spec"]
        sched = next(c for c in dep["containers"] if c["name"] == "kube-scheduler")
        enabled = conf["profiles"][0].get("plugins", {}).get("multiPoint", {}).get("enabled", [])
        return sched["image"], [p["name"] for p in enabled], sched["command"], kinds(docs)

    image, plugins, command, objs = render("scheduler.gang.mode=workload")
    assert image.startswith("registry.k8s.io/kube-scheduler:") and plugins == ["GangScheduling"]
    assert "--feature-gates=GenericWorkload=true" in command
    assert "ClusterRole/gpudaemon-scheduler-gang" in objs
    assert not [o for o in objs if o.startswith("CustomResourceDefinition/")]
    for sets in (["scheduler.gang.mode=coscheduling"], ["scheduler.gang.enabled=true"]):
        image, plugins, command, objs = render(*sets)
        assert "scheduler-plugins" in image and plugins == ["Coscheduling"], sets
        assert not [a for a in command if a.startswith("--feature-gates")]
        assert "CustomResourceDefinition/podgroups.scheduling.x-k8s.io" in objs
    image, plugins, _, _ = render("scheduler.gang.enabled=true", "scheduler.gang.mode=workload")
    assert plugins == ["GangScheduling"]
    for sets in ([], ["scheduler.gang.enabled=true", "scheduler.gang.mode=none"]):
        image, plugins, command, objs = render(*sets)
        assert plugins == [] and "scheduler-plugins" not in image, sets
        assert "ClusterRole/gpudaemon-scheduler-gang" not in objs


def test_agent_pod_placement_identity_mounts_and_lockdown(helm: str) -> None:
    ds = one(template(helm), "DaemonSet", "gpudaemon")
    pod = ds["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in [
        e for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]
    ]
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod["tolerations"]
    assert pod["priorityClassName"] == "system-node-critical"
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "nvidia.com/gpu" not in str(c["resources"])  # it must not take a GPU
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["pod-resources"]["readOnly"] is True
    assert mounts["pod-resources"]["mountPath"] == "/var/lib/kubelet/pod-resources"
    assert mounts["spool"].get("readOnly") is not True
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532


def test_every_container_is_locked_down(helm: str) -> None:
    for d in template(helm, "-f", str(EVERYTHING)):
        if d["kind"] not in ("DaemonSet", "Deployment"):
            continue
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, d["metadata"]["name"]
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]


def test_every_init_container_is_locked_down_but_for_chown(helm: str) -> None:
    pod = one(template(helm, "-f", str(EVERYTHING)), "DaemonSet", "gpudaemon")["spec"]["template"]
    (init,) = pod["spec"]["initContainers"]
    sc = init["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert [m["name"] for m in init["volumeMounts"]] == ["spool"]  # it touches nothing else


def _spool(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    pod = one(docs, "DaemonSet", "gpudaemon")["spec"]["template"]["spec"]
    return {v["name"]: v for v in pod["volumes"]}["spool"], pod.get("initContainers", [])


INFLUX = ["--set", "influxdb.enabled=true", "--set", "influxdb.url=http://i:8086",
          "--set", "influxdb.bucket=b", "--set", "influxdb.tokenSecret.name=t"]  # fmt: skip


def test_the_spool_survives_the_pod_on_a_host_path_by_default(helm: str) -> None:
    vol, init = _spool(template(helm, *INFLUX, namespace="ops"))
    assert vol["hostPath"] == {
        "path": "/var/lib/gpudaemon/ops_gpudaemon",
        "type": "DirectoryOrCreate",
    }
    assert [c["name"] for c in init] == ["spool-owner"]
    assert init[0]["command"][-3:] == ["/var/lib/gpudaemon", "65532", "65532"]
    # Without InfluxDB there is no spool to keep: no host directory, no root container.
    vol, init = _spool(template(helm))
    assert "emptyDir" in vol and init == []
    vol, init = _spool(template(helm, *INFLUX, "--set", "influxdb.spool.hostPath="))
    assert vol["emptyDir"] == {"sizeLimit": "512Mi"} and init == []
    vol, init = _spool(
        template(helm, *INFLUX, "--set", "influxdb.spool.volume.emptyDir.medium=Memory")
    )
    assert vol == {"name": "spool", "emptyDir": {"medium": "Memory"}} and init == []


def test_the_spool_owner_gives_the_directory_to_the_agent_user(helm: str, tmp_path: Path) -> None:
    """The rendered init command itself, on a directory made as the kubelet makes it."""
    if os.geteuid() != 0:
        pytest.fail("needs root, as CI and the kubelet's init container have")
    _, (init,) = _spool(template(helm, *INFLUX))
    host = tmp_path / "gpudaemon"
    host.mkdir(mode=0o755)
    cmd = [sys.executable if c == "python3" else c for c in init["command"]]
    cmd[cmd.index("/var/lib/gpudaemon")] = str(host)
    subprocess.run(cmd, check=True, timeout=30)
    st = host.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65532, 65532, 0o750)


def test_influxdb_token_comes_from_the_secret_as_a_file(helm: str) -> None:
    docs = template(helm, "-f", str(EVERYTHING))
    config = yaml.safe_load(one(docs, "ConfigMap", "gpudaemon-agent")["data"]["config.yaml"])
    assert config["influxdb"]["token_file"] == "/var/run/secrets/gpudaemon/influxdb/token"
    assert config["influxdb"]["url"] == "http://influxdb.monitoring.svc:8086"
    assert "token" not in config["influxdb"]
    pod = one(docs, "DaemonSet", "gpudaemon")["spec"]["template"]["spec"]
    vol = {v["name"]: v for v in pod["volumes"]}["influxdb-token"]
    assert vol["secret"]["secretName"] == "influxdb-token"
    # The user's config is merged in, and the chart's own keys win.
    assert config["schedules"]["telemetry"] == "*/2 * * * * *"
    assert config["labels"]["prefix"] == "gpu.example.com/"
    assert config["kubernetes"]["lease_namespace"] == "gpudaemon"


def test_rebalancer_namespaces_reach_its_config_and_bad_ones_are_refused(helm: str) -> None:
    """rebalancer.namespaces becomes rebalance.namespaces (issue 28); a name that is
    not a DNS-1123 label fails the chart's schema before anything is installed."""
    from gpudaemon.config import load_config

    docs = template(helm, "-f", str(EVERYTHING))
    text = one(docs, "ConfigMap", "gpudaemon-rebalancer")["data"]["config.yaml"]
    config = yaml.safe_load(text)
    assert config["rebalance"]["namespaces"] == ["research", "team-a"]
    assert config["rebalance"]["selector"] == "team=research"  # the user's keys merged in
    cfg = load_config(None, environ={}, overrides={**config, "node_name": "x"})
    assert cfg.rebalance.namespaces == ["research", "team-a"]
    default = template(helm, "--set", "rebalancer.enabled=true")
    plain = yaml.safe_load(one(default, "ConfigMap", "gpudaemon-rebalancer")["data"]["config.yaml"])
    assert "namespaces" not in plain["rebalance"]  # empty: every namespace
    proc = run_helm(helm, "template", "x", str(CHART), *IMAGE, "--set", "rebalancer.enabled=true",
                    "--set", "rebalancer.namespaces={Team_A}")  # fmt: skip
    assert proc.returncode != 0 and "namespaces" in proc.stderr, proc.stderr


def test_one_prefix_for_agent_and_policy(helm: str) -> None:
    docs = template(helm, "--set", "labelPrefix=gpu.example.com/", namespace="ops")
    config = yaml.safe_load(one(docs, "ConfigMap", "gpudaemon-agent")["data"]["config.yaml"])
    vap = one(docs, "ValidatingAdmissionPolicy", "gpudaemon-agent-node-keys")
    variables = {v["name"]: v["expression"] for v in vap["spec"]["variables"]}
    assert config["labels"]["prefix"] == "gpu.example.com/"
    assert variables["prefix"] == "'gpu.example.com/'"
    assert vap["spec"]["matchConditions"][0]["expression"] == (
        "request.userInfo.username == 'system:serviceaccount:ops:gpudaemon'"
    )


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (
            ["--set-string", "scheduler.percentageOfNodesToScore=all"],
            "at '/scheduler/percentageOfNodesToScore': got string, want integer",
        ),
        (["--set", "extender.policy=random"], "at '/extender/policy': value must be one of"),
        (["--set", "agent.tolerationz=x"], "additional properties 'tolerationz' not allowed"),
        (
            ["--set", "labelPrefix=Bad_Prefix"],
            "labelPrefix: 'Bad_Prefix' is not a DNS subdomain followed by '/', "
            "e.g. 'gpudaemon.io/'",
        ),
        (
            ["--set", "agent.config.schedules.telemtry=x"],
            "at '/agent/config/schedules': additional properties 'telemtry' not allowed",
        ),
        (
            ["--set", "extender.config.extender.policy=best"],
            "at '/extender/config/extender/policy': value must be one of",
        ),
        (
            ["--set", "extender.config.extender.candidates=-1"],
            "at '/extender/config/extender/candidates': minimum: got -1, want 0",
        ),
        (
            ["--set", "agent.config.kubernetes.lease_duration_seconds=5"],
            "at '/agent/config/kubernetes/lease_duration_seconds': minimum: got 5, want 10",
        ),
        (
            ["--set", "scheduler.gang.mode=volcano"],
            "at '/scheduler/gang/mode': value must be one of",
        ),
        (
            ["--set", "agent.resources.requests=64Mi"],
            "at '/agent/resources/requests': got string, want object",
        ),
        (
            [
                "--set",
                "influxdb.enabled=true",
                "--set",
                "influxdb.url=http://i:8086",
                "--set",
                "influxdb.bucket=b",
            ],
            "at '/influxdb/tokenSecret/name': minLength",
        ),
    ],
)
def test_bad_values_are_rejected_naming_the_value(helm: str, args: list[str], named: str) -> None:
    proc = run_helm(helm, "template", "gpudaemon", str(CHART), *IMAGE, *args)
    assert proc.returncode != 0
    assert named in proc.stderr, proc.stderr
    assert "goroutine" not in proc.stderr


# -- against the real API server ------------------------------------------------------


def _resources(cluster: Cluster) -> dict[tuple[str, str], tuple[str, bool, str]]:
    """(apiVersion, kind) -> (API path, namespaced, plural), from discovery."""
    out: dict[tuple[str, str], tuple[str, bool, str]] = {}
    group_versions = ["v1"] + [
        v["groupVersion"] for g in cluster.request("GET", "/apis")["groups"] for v in g["versions"]
    ]
    for gv in group_versions:
        base = "/api/v1" if gv == "v1" else f"/apis/{gv}"
        for r in cluster.request("GET", base)["resources"]:
            if "/" not in r["name"]:
                out[(gv, r["kind"])] = (base, bool(r["namespaced"]), r["name"])
    return out


@pytest.mark.parametrize(
    "values",
    [[], ["-f", str(EVERYTHING)], ["--set", "scheduler.gang.mode=workload"]],
    ids=["default", "everything", "gang-workload"],
)
def test_every_rendered_object_passes_server_side_dry_run(
    helm: str, cluster: Cluster, values: list[str], tmp_path: Path
) -> None:
    """What `kubectl apply --server-side --dry-run=server` sends: an apply PATCH with
    dryRun=All, so admission and the CRDs' schemas judge every object."""
    ns = "dryrun"
    if cluster.get(f"/api/v1/namespaces/{ns}") is None:
        cluster.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
    docs = template(helm, *values, *MONITORING_APIS, namespace=ns)
    resources = _resources(cluster)
    for doc in docs:
        base, namespaced, plural = resources[(doc["apiVersion"], doc["kind"])]
        meta = doc["metadata"]
        where = f"/namespaces/{meta['namespace']}" if namespaced else ""
        cluster.request(
            "PATCH",
            f"{base}{where}/{plural}/{meta['name']}",
            body=doc,
            content_type="application/apply-patch+yaml",
            query={"dryRun": "All", "fieldManager": "helm-dry-run", "fieldValidation": "Strict"},
        )
    assert {d["kind"] for d in docs} >= {"DaemonSet", "ValidatingAdmissionPolicy"}


def test_chart_readme_names_every_top_level_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    missing = [k for k in values if f"`{k}`" not in readme]
    assert missing == []


def test_rebalancer_rbac_grants_only_what_its_code_calls(helm: str) -> None:
    """Reads, evictions, a patch of pods (held to its reservation annotations by the
    pod-writes policy), Events created; no update, delete, pod subresource but
    eviction, Event patch or PodDisruptionBudget read (issue 28)."""
    docs = template(helm, "--set", "rebalancer.enabled=true")
    role = one(docs, "ClusterRole", "gpudaemon-rebalancer")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]
    vap = one(docs, "ValidatingAdmissionPolicy", "gpudaemon-rebalancer-pod-writes")
    assert vap["spec"]["failurePolicy"] == "Fail"
    assert vap["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == ["pods", "pods/*"]
    for name in ("gpudaemon-rebalancer-pod-writes", "gpudaemon-rebalancer-own-lease"):
        binding = one(docs, "ValidatingAdmissionPolicyBinding", name)
        assert binding["spec"] == {"policyName": name, "validationActions": ["Deny"]}
