"""DRA on the agent's side (issue 32), with only what the chart gives it: the session's
release upgraded with `dra.enabled`, its agent run with a token of the chart's
ServiceAccount bound to the agent pod the DaemonSet put on a GPU node, and the chart's
own agent config.

1. RBAC and the admission policy <release>-agent-device-taints: before `dra.enabled`
   the agent may not even list DeviceTaintRules; with it, each agent may write and
   delete only rules for one gpu.nvidia.com device in its own node's pool, with its
   own taint key, never NoExecute, and carrying our labels.
2. Done-when 2 on a real kube-apiserver, kube-scheduler and kube-controller-manager
   (1.37: DeviceTaintRule is resource.k8s.io/v1, on by default): no kubelet and no
   NVIDIA driver run here, so the test publishes the node's ResourceSlice as NVIDIA's
   DRA driver does (its devices carry the simulated GPUs' UUIDs). A simulated XID 79 on
   one GPU gives a DeviceTaintRule for exactly that device within one label reconcile;
   a new claim for 7 GPUs through the default scheduler is allocated the other seven
   (first-fit would take it); after a repair (new boot ID) the rule is gone.
3. The chart's extender and rebalancer, run with their own pod-bound tokens and the
   chart's configs, get ready with their DRA informers synced (RBAC enough), and the
   extender may write none of the DRA objects.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpudaemon.agent.devicetaints import rule_name
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.errors import KubeError, KubeForbiddenError, KubeNotFoundError
from gpudaemon.kube.client import Credentials, KubeClient
from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import CHART, GPU_NODES, agent_pods, run_helm
from tests.integration.helm.test_chart_identities import chart_config, clean_env, component_pod
from tests.integration.helm.test_least_privilege import pod_bound_token
from tests.integration.kube.controlplane import _kubeconfig
from tests.support import free_port, http_get, scrape, start_agent, stop, wait_for

DRIVER = "gpu.nvidia.com"
RULES = "/apis/resource.k8s.io/v1/devicetaintrules"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"
OURS = {"app.kubernetes.io/name": "gpudaemon", "app.kubernetes.io/component": "device-taint"}
TAINT = "gpudaemon.io/unhealthy"
SCHEDULER_PODS = "app.kubernetes.io/instance=gpudaemon,app.kubernetes.io/component=scheduler"
LABELS_PERIOD_S = 30  # the agent's default schedules.labels: one label reconcile


# Helm 4 only: the chart's templates are the same under Helm 3 (test_chart renders both).
pytestmark = [pytest.mark.integration, pytest.mark.parametrize("helm", ["helm"], indirect=True)]


def agent_pod(cluster: Cluster, ns: str, node: str) -> dict[str, Any]:
    """The agent pod on `node` that is not being deleted (after an upgrade the
    DaemonSet replaces them; no kubelet confirms the old one's deletion: done here)."""

    def live() -> dict[str, Any] | None:
        cluster.finish_deletions(ns)
        return next(
            (
                p
                for p in agent_pods(cluster, ns, "gpudaemon")
                if p["spec"].get("nodeName") == node and not p["metadata"].get("deletionTimestamp")
            ),
            None,
        )

    return dict(cluster.wait(live, f"a live agent pod on {node}", timeout=120))


def agent_client(cluster: Cluster, ns: str, node: str, path: Path) -> KubeClient:
    token = pod_bound_token(cluster, ns, agent_pod(cluster, ns, node))
    kc = _kubeconfig(path, cluster.cp.server, "agent", token, cluster.cp.ca)
    return KubeClient.from_credentials(Credentials(False, str(kc)), timeout_s=30)


def rule(pool: str, device: str = "gpu-0", effect: str = "NoSchedule", **labels: str) -> Any:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": f"t-{pool}-{device}-{uuid.uuid4().hex[:6]}",
            "labels": {**OURS, "gpudaemon.io/node": pool, **labels},
        },
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": pool, "device": device},
            "taint": {"key": TAINT, "value": "xid-79", "effect": effect},
        },
    }


def put(client: KubeClient, body: dict[str, Any]) -> dict[str, Any]:
    return client.apply(f"{RULES}/{body['metadata']['name']}", body)


def refused(call: Any) -> str:
    with pytest.raises(KubeError) as e:
        call()
    assert e.value.status in (403, 422), e.value
    return str(e.value)


@pytest.fixture(scope="module")
def dra_release(
    helm: str, cluster: Cluster, release: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The session's release with `dra.enabled`, once the device-taint policy is in
    force; off again afterwards. Before the upgrade, the agent may not list rules."""
    tmp = tmp_path_factory.mktemp("dra")
    before = agent_client(cluster, release, "gpu-0", tmp / "before")
    try:
        with pytest.raises(KubeForbiddenError):
            before.list_items(RULES)
    finally:
        before.close()

    def upgrade(value: str) -> None:
        proc = run_helm(helm, "upgrade", "gpudaemon", str(CHART), "--namespace", release,
                        "--reuse-values", "--set", f"dra.enabled={value}",
                        "--set", f"rebalancer.enabled={value}",
                        kubeconfig=cluster.kubeconfig)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr

    upgrade("true")
    try:
        agent = agent_client(cluster, release, "gpu-0", tmp / "probe")

        def in_force() -> bool:
            body = rule("gpu-1")
            try:
                agent.apply(f"{RULES}/{body['metadata']['name']}", body)
            except KubeError as e:
                return "its pod runs on" in str(e)
            cluster.request("DELETE", f"{RULES}/{body['metadata']['name']}")
            return False

        try:
            cluster.wait(in_force, "the agent's device-taint policy in force", timeout=60)
        finally:
            agent.close()
        yield release
    finally:
        upgrade("false")
        # The agent config changed twice, so the DaemonSet replaces its pods: leave one
        # live pod per GPU node (no kubelet confirms the old ones' deletion) for the
        # tests that follow.
        for node in GPU_NODES:
            agent_pod(cluster, release, node)
        cluster.wait(
            lambda: cluster.finish_deletions(release) == 0
            and not [p for p in agent_pods(cluster, release, "gpudaemon")
                     if p["metadata"].get("deletionTimestamp")],
            "no agent pod left terminating",
        )  # fmt: skip
        settle_scheduler(cluster, release)
        rebalancer = "app.kubernetes.io/instance=gpudaemon,app.kubernetes.io/component=rebalancer"
        cluster.wait(
            lambda: (
                cluster.finish_deletions(release) == 0
                and not cluster.items(f"/api/v1/namespaces/{release}/pods", rebalancer)
            ),
            "no rebalancer pod left",
            timeout=120,
        )


def settle_scheduler(cluster: Cluster, ns: str) -> None:
    """dra.enabled changes the extender's config (the scheduler pod's sidecar), so the
    scheduler Deployment rolled out and back. With no kubelet no pod gets ready, and a rollout of
    one replica never scales the other ReplicaSet down (maxUnavailable 0): remove it, as
    its finished rollout would, and leave the one scheduler pod later tests expect."""
    rs_path = f"/apis/apps/v1/namespaces/{ns}/replicasets"
    pods_path = f"/api/v1/namespaces/{ns}/pods"

    def revision(rs: dict[str, Any]) -> int:
        return int((rs["metadata"].get("annotations") or {}).get(
            "deployment.kubernetes.io/revision", "0"))  # fmt: skip

    def settled() -> bool:
        sets = cluster.items(rs_path, SCHEDULER_PODS)
        current = max(sets, key=revision)
        for rs in sets:
            if rs is current:
                continue
            with contextlib.suppress(KubeNotFoundError):
                cluster.request("DELETE", f"{rs_path}/{rs['metadata']['name']}")
            hash_ = rs["metadata"]["labels"].get("pod-template-hash", "")
            for pod in cluster.items(pods_path, f"pod-template-hash={hash_}"):
                with contextlib.suppress(KubeNotFoundError):
                    cluster.request("DELETE", f"{pods_path}/{pod['metadata']['name']}",
                                    query={"gracePeriodSeconds": "0"})  # fmt: skip
        cluster.finish_deletions(ns)
        return len(cluster.items(pods_path, SCHEDULER_PODS)) == 1

    cluster.wait(settled, "one scheduler pod left after the DRA upgrades", timeout=120)


def test_an_agent_writes_only_rules_for_one_device_of_its_own_nodes_pool(
    cluster: Cluster, dra_release: str, tmp_path: Path
) -> None:
    ns = dra_release
    a = agent_client(cluster, ns, "gpu-0", tmp_path / "a")
    b = agent_client(cluster, ns, "gpu-1", tmp_path / "b")
    made: list[str] = []
    try:
        # Its own: allowed (created, listed, updated to None, deleted).
        mine = rule("gpu-0", "gpu-3")
        name = mine["metadata"]["name"]
        made.append(name)
        a.apply(f"{RULES}/{name}", mine)
        assert [r["metadata"]["name"] for r in a.list_items(RULES)[0]] == [name]
        mine["spec"]["taint"]["effect"] = "None"
        a.apply(f"{RULES}/{name}", mine)
        a.request("DELETE", f"{RULES}/{name}")

        # Another node's pool, a whole pool, another driver, NoExecute, another key,
        # no labels of ours, a finalizer: each refused with the policy's message.
        msg = refused(lambda: put(a, rule("gpu-1")))
        assert "pool of the Node its pod runs on" in msg
        whole = rule("gpu-0")
        del whole["spec"]["deviceSelector"]["device"]
        assert "select one gpu.nvidia.com device" in refused(lambda: put(a, whole))
        other = rule("gpu-0")
        other["spec"]["deviceSelector"]["driver"] = "example.com/nic"
        refused(lambda: put(a, other))
        evict = rule("gpu-0", effect="NoExecute")
        assert "may never taint NoExecute" in refused(lambda: put(a, evict))
        key = rule("gpu-0")
        key["spec"]["taint"]["key"] = "example.com/broken"
        refused(lambda: put(a, key))
        bare = rule("gpu-0")
        bare["metadata"]["labels"] = {}
        assert "labelled app.kubernetes.io/name=gpudaemon" in refused(lambda: put(a, bare))
        # Our labels, but naming another node than the pool's (it would be listed as
        # that node's own).
        refused(lambda: put(a, rule("gpu-0", **{"gpudaemon.io/node": "gpu-1"})))
        held = rule("gpu-0")
        held["metadata"]["finalizers"] = ["example.com/hold"]
        refused(lambda: put(a, held))

        # Another agent's rule: agent A may not delete it; its own agent may.
        theirs = rule("gpu-1", "gpu-5")
        tname = theirs["metadata"]["name"]
        made.append(tname)
        b.apply(f"{RULES}/{tname}", theirs)
        msg = refused(lambda: a.request("DELETE", f"{RULES}/{tname}"))
        assert "pool of the Node its pod runs on" in msg
        assert cluster.get(f"{RULES}/{tname}") is not None
        b.request("DELETE", f"{RULES}/{tname}")
        assert cluster.get(f"{RULES}/{tname}") is None
        assert not [r for r in cluster.items(RULES) if r["metadata"]["name"].startswith("t-")]
    finally:
        a.close()
        b.close()
        for n in made:
            with contextlib.suppress(KubeNotFoundError):
                cluster.request("DELETE", f"{RULES}/{n}")


# -- Done-when 2 -------------------------------------------------------------------------

NODE = "gpu-2"


def write_profile(path: Path, boot: str, xid: bool) -> Path:
    """dgx-h100 (the built-in profile's GPUs) with a boot ID, and XID 79 on GPU 3 a few
    seconds after the agent starts."""
    prof = yaml.safe_load(
        (Path(__file__).parents[3] / "gpudaemon/backends/profiles/dgx-h100.yaml").read_text()
    )
    prof["boot_id"] = boot
    prof["faults"] = [{"kind": "xid", "gpu": 3, "xid": 79, "after_s": 3}] if xid else []
    path.write_text(yaml.safe_dump(prof))
    return path


def publish_slice(cluster: Cluster, uuids: list[str]) -> None:
    """The node's ResourceSlice as NVIDIA's DRA driver (0.4) publishes it, and its
    DeviceClass: no driver runs here."""
    devices = [
        {
            "name": f"gpu-{i}",
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": u},
                "productName": {"string": "NVIDIA H100 80GB HBM3"},
                "architecture": {"string": "Hopper"},
                "cudaComputeCapability": {"version": "9.0.0"},
                "driverVersion": {"version": "550.54.15"},
                "resource.kubernetes.io/pciBusID": {"string": f"0000:{0x18 + i:02x}:00.0"},
            },
            "capacity": {"memory": {"value": "81559Mi"}},
        }
        for i, u in enumerate(uuids)
    ]
    cluster.request("POST", SLICES, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": f"{NODE}-{DRIVER}-test"},
        "spec": {"driver": DRIVER, "nodeName": NODE, "devices": devices,
                 "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}},
    })  # fmt: skip
    if cluster.get(f"{CLASSES}/{DRIVER}") is None:
        cel = f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'gpu'"
        cluster.request("POST", CLASSES, body={
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": cel}}]},
        })  # fmt: skip


def claim_pod(cluster: Cluster, name: str, count: int) -> None:
    """A ResourceClaim for `count` GPUs and a pod that uses it, for the default scheduler."""
    ns = "default"
    cluster.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims", body={
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": count}}]}},
    })  # fmt: skip
    cluster.request("POST", f"/api/v1/namespaces/{ns}/pods", body={
        "metadata": {"name": name},
        "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": name}],
                 "containers": [{"name": "c", "image": "example.invalid/train",
                                 "resources": {"claims": [{"name": "gpus"}]}}]},
    })  # fmt: skip


def stamp(rfc3339: str) -> float:
    return datetime.strptime(rfc3339, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def our_rules(cluster: Cluster) -> list[dict[str, Any]]:
    return cluster.items(RULES, f"app.kubernetes.io/name=gpudaemon,gpudaemon.io/node={NODE}")


def test_a_sick_gpu_is_tainted_in_dra_kept_from_new_claims_and_untainted_after_repair(
    cluster: Cluster, dra_release: str, tmp_path: Path
) -> None:
    ns = dra_release
    profile = write_profile(tmp_path / "h100.yaml", "boot-1", xid=True)
    gpus = SimulatedBackend(load_profile(str(profile))).inventory().gpus
    uuids = [g.uuid for g in sorted(gpus, key=lambda g: g.index)]
    publish_slice(cluster, uuids)
    token = pod_bound_token(cluster, ns, agent_pod(cluster, ns, NODE))
    kc = _kubeconfig(tmp_path / "agent.kc", cluster.cp.server, "agent", token, cluster.cp.ca)
    cfg = chart_config(cluster, ns, "gpudaemon-agent", tmp_path / "agent.yaml")
    assert yaml.safe_load(cfg.read_text())["dra"]["enabled"] is True

    def run_agent(log: str) -> Any:
        return start_agent(
            ["run", "--config", str(cfg), "--simulate", str(profile)],
            env=clean_env(NODE_NAME=NODE, GPUDAEMON_KUBERNETES__KUBECONFIG=str(kc),
                          GPUDAEMON_METRICS__LISTEN=f"127.0.0.1:{free_port()}",
                          GPUDAEMON_METRICS__POD_RESOURCES_SOCKET=""),
            log=tmp_path / log,
        )  # fmt: skip

    proc = run_agent("agent-1.log")
    name = f"dra-{uuid.uuid4().hex[:6]}"
    try:
        # XID 79 fires 3 s after the start; the rule follows within one label reconcile.
        t0 = time.monotonic()
        rules = cluster.wait(
            lambda: our_rules(cluster),
            "a DeviceTaintRule for GPU 3",
            timeout=3 + LABELS_PERIOD_S + 60,
        )
        took = time.monotonic() - t0
        assert [r["spec"]["deviceSelector"] for r in rules] == [
            {"driver": DRIVER, "pool": NODE, "device": "gpu-3"}
        ]
        taint = rules[0]["spec"]["taint"]
        assert (taint["key"], taint["effect"]) == (TAINT, "NoSchedule")
        assert rules[0]["metadata"]["name"] == rule_name(NODE, "gpu-3")
        print(f"DeviceTaintRule {took:.1f} s after the agent started (fault at 3 s)")
        # Within one label reconcile: written with the Node's GPUHealthy=False.
        node = cluster.request("GET", f"/api/v1/nodes/{NODE}")
        cond = next(c for c in node["status"]["conditions"] if c["type"] == "GPUHealthy")
        assert cond["status"] == "False" and "GPU 3: xid 79" in cond["message"]
        gap = abs(
            stamp(rules[0]["metadata"]["creationTimestamp"]) - stamp(cond["lastTransitionTime"])
        )
        assert gap < LABELS_PERIOD_S, gap

        # A claim for 7 of the 8 devices: first-fit would take gpu-0..gpu-6; the
        # scheduler's DynamicResources plugin must leave the tainted gpu-3 out.
        claim_pod(cluster, name, 7)
        path = f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{name}"
        alloc = cluster.wait(
            lambda: (cluster.request("GET", path).get("status") or {}).get("allocation"),
            "the claim allocated by kube-scheduler",
            timeout=90,
        )
        got = sorted(r["device"] for r in alloc["devices"]["results"])
        assert got == sorted(f"gpu-{i}" for i in range(8) if i != 3), got
        pod = cluster.request("GET", f"/api/v1/namespaces/default/pods/{name}")
        assert pod["spec"].get("nodeName") in (None, NODE)
    finally:
        stop(proc)

    # Repair: the node rebooted (a new boot ID) and the XID is gone.
    write_profile(profile, "boot-2", xid=False)
    proc = run_agent("agent-2.log")
    try:
        cluster.wait(
            lambda: not our_rules(cluster), "the rule removed after the repair", timeout=90
        )
    finally:
        stop(proc)
        for path in (f"/api/v1/namespaces/default/pods/{name}",
                     f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{name}",
                     f"{SLICES}/{NODE}-{DRIVER}-test"):  # fmt: skip
            with contextlib.suppress(KubeNotFoundError):
                cluster.request("DELETE", path, query={"gracePeriodSeconds": "0"})
    for log in ("agent-1.log", "agent-2.log"):
        text = (tmp_path / log).read_text(errors="replace")
        assert "forbidden" not in text.lower(), text[-3000:]


DRA_KINDS = ("resourceslices", "resourceclaims", "resourceclaimtemplates", "deviceclasses",
             "devicetaintrules")  # fmt: skip


def test_the_extender_reads_dra_objects_with_only_the_charts_identity_and_writes_none(
    cluster: Cluster, dra_release: str, tmp_path: Path
) -> None:
    """With `dra.enabled`, the chart's extender (its config, the token of the scheduler
    pod it is a sidecar of) gets ready: its five DRA informers listed and watch, so the
    chart's RBAC is enough. The same identity may write none of those objects. (In
    sidecar mode, the default, kube-scheduler's own role already grants most of these
    reads; the extender's ClusterRole carries them for `extender.mode: service`, which
    test_dra_chart renders.)"""
    ns = dra_release
    sched_pod = component_pod(cluster, ns, "scheduler")
    token = pod_bound_token(cluster, ns, sched_pod)
    kc = _kubeconfig(tmp_path / "ext.kc", cluster.cp.server, "extender", token, cluster.cp.ca)
    cfg = chart_config(cluster, ns, "gpudaemon-extender", tmp_path / "ext.yaml")
    assert yaml.safe_load(cfg.read_text())["dra"] == {"enabled": True}
    port, metrics = free_port(), free_port()
    log = tmp_path / "extender.log"
    proc = start_agent(
        ["extender", "--config", str(cfg)],
        env=clean_env(GPUDAEMON_KUBERNETES__KUBECONFIG=str(kc),
                      GPUDAEMON_EXTENDER__LISTEN=f"127.0.0.1:{port}",
                      GPUDAEMON_EXTENDER__METRICS_LISTEN=f"127.0.0.1:{metrics}"),
        log=log,
    )  # fmt: skip
    try:
        wait_for(
            lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200,
            timeout=90,
            what="the extender ready with its DRA informers synced",
        )
        text = http_get(f"http://127.0.0.1:{metrics}/metrics")[1].decode()
        assert "gpudaemon_extender_dra_claims_not_understood_total" in text
    finally:
        stop(proc)
    assert "forbidden" not in log.read_text(errors="replace").lower()

    client = KubeClient.from_credentials(Credentials(False, str(kc)), timeout_s=30)
    try:
        for kind in DRA_KINDS:
            assert client.list_items(f"/apis/resource.k8s.io/v1/{kind}")[1]
        body = rule(NODE)
        with pytest.raises(KubeForbiddenError):
            put(client, body)
        with pytest.raises(KubeForbiddenError):
            client.request("DELETE", f"{SLICES}/anything")
    finally:
        client.close()


def test_the_rebalancer_reads_dra_objects_with_only_the_charts_identity(
    cluster: Cluster, dra_release: str, tmp_path: Path
) -> None:
    """With `dra.enabled` the chart's rebalancer (its own ServiceAccount: nothing else
    grants it the DRA reads) gets ready and leads with its five DRA informers synced."""
    ns = dra_release
    pod = component_pod(cluster, ns, "rebalancer")
    assert pod["spec"]["serviceAccountName"] == "gpudaemon-rebalancer"
    token = pod_bound_token(cluster, ns, pod)
    kc = _kubeconfig(tmp_path / "rb.kc", cluster.cp.server, "rebalancer", token, cluster.cp.ca)
    cfg = chart_config(cluster, ns, "gpudaemon-rebalancer", tmp_path / "rb.yaml")
    assert yaml.safe_load(cfg.read_text())["dra"] == {"enabled": True}
    listen = f"127.0.0.1:{free_port()}"
    log = tmp_path / "rebalancer.log"
    proc = start_agent(
        ["rebalance", "--config", str(cfg)],
        env=clean_env(POD_NAME=pod["metadata"]["name"], GPUDAEMON_KUBERNETES__KUBECONFIG=str(kc),
                      GPUDAEMON_REBALANCE__LISTEN=listen),
        log=log,
    )  # fmt: skip
    try:
        url = f"http://{listen}"
        wait_for(lambda: http_get(url + "/readyz")[0] == 200, 90,
                 what="the rebalancer ready with its DRA informers synced")  # fmt: skip
        wait_for(lambda: scrape(url + "/metrics", "gpudaemon_rebalancer_passes_total") >= 1,
                 90, what="a pass")  # fmt: skip
    finally:
        stop(proc)
        # Its leader Lease would outlive the test: later modules expect none.
        with contextlib.suppress(KubeNotFoundError):
            cluster.request(
                "DELETE",
                f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/gpudaemon-rebalancer",
            )
    text = log.read_text(errors="replace")
    assert "forbidden" not in text.lower() and "Traceback" not in text, text[-3000:]
