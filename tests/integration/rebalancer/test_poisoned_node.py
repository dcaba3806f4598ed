"""Nothing a node writes can stop another program (issue 28, Done-when 3).

Three nodes run by the real agent; then one node's `gpus` annotation is poisoned with
the agent's own identity (which may write it, as designed): deep nesting, a value near
the API server's 256 KiB limit, and wrong types. For each, with real etcd,
kube-apiserver, kube-scheduler and kube-controller-manager:

- a newly started extender becomes ready, and a new kube-scheduler using it places
  8-GPU pods on the two other nodes only; the poisoned node is filtered with a reason
  the pending pod's events show;
- a newly started `gpudaemon rebalance` process becomes ready and still drains a pod
  from a sick GPU on another node (dry run: its planned eviction and Event), counting
  the bad value in its metric;
- `gpudaemon status` exits 0, lists the other nodes fresh and the poisoned one as not
  fresh with the reason.

Before this change a deep value made the extender's and rebalancer's first list fail
with a RecursionError forever (never ready), and `status` exit with a traceback."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from gpudaemon.config import load_config
from gpudaemon.extender.app import Extender
from tests.integration.rebalancer.rig import P, RebalanceRig, metric
from tests.integration.scheduler.rig import GROUP, NS
from tests.support import run_cli, scrape, wait_for

pytestmark = pytest.mark.integration

GPUS = P + "gpus"
# The API server refuses a Node whose annotations total over 256 KiB; this is as near
# as the node's other annotations leave room for.
NEAR_LIMIT = 250 * 1024
POISON = {
    "deep": "[" * 30_000 + "]" * 30_000,  # under the size cap; json: RecursionError
    "huge": json.dumps([{"index": 0, "uuid": "G", "reason": "x" * (NEAR_LIMIT - 80)}]),
    "wrong_types": json.dumps([{"index": "0", "uuid": ["GPU-0"], "memory_total_mib": {}}]),
}

REASON = {"deep": "nested deeper", "huge": "over 65536 bytes", "wrong_types": "field 'index'"}


def patch_as_agent(rig: RebalanceRig, node: str, annotations: dict[str, str]) -> None:
    """As the agent's restricted identity, under the shipped admission policy."""
    agent = rig.cp.as_agent()
    try:
        agent.request(
            "PATCH",
            f"/api/v1/nodes/{node}",
            body={"metadata": {"annotations": annotations}},
            content_type="application/merge-patch+json",
        )
    finally:
        agent.close()


def new_extender(rig: RebalanceRig) -> Extender:
    cfg = load_config(
        None,
        environ={},
        overrides={
            "extender": {"listen": "127.0.0.1:0", "metrics_listen": "", "policy": "binpack"},
            "kubernetes": {"kubeconfig": str(rig.cp.admin_kubeconfig)},
        },
    )
    ext = Extender(cfg)
    ext.start()
    return ext


def pending_events(rig: RebalanceRig, pod: str) -> str:
    return " ".join(rig.events_for(pod))


@pytest.mark.parametrize("case", sorted(POISON))
def test_one_poisoned_node_stops_no_other_program(rig: RebalanceRig, case: str) -> None:
    tag = f"pz-{case.replace('_', '-')}-{uuid.uuid4().hex[:4]}"
    bad, good = f"{tag}-0", [f"{tag}-1", f"{tag}-2"]
    for n in (bad, *good):
        rig.add_node(n, tag)
    rig.run_agents([bad, *good])
    assert len(POISON[case].encode()) < 256 * 1024
    patch_as_agent(rig, bad, {GPUS: POISON[case]})
    assert rig.cp.node(bad)["metadata"]["annotations"][GPUS] == POISON[case]

    # -- a new extender is ready and schedules onto the other nodes ----------------
    ext = new_extender(rig)
    sched = f"sched-{tag}"
    try:
        assert ext.wait_synced(60), ext.ready()
        assert ext.ready() == (True, "ok")
        st = ext.cluster.states([bad])[bad]
        assert st is not None and st.bad_data.startswith(f"gpus: {REASON[case]}"), st
        assert ext.cluster.bad_counts()["gpus"] >= 1  # earlier cases' nodes are there too
        rig.start_scheduler(sched, with_extender=True, url=f"http://127.0.0.1:{ext.server.port}")
        placed = [rig.create_pod(8, tag, scheduler=sched) for _ in range(2)]
        assert sorted(rig.wait_bound(p, timeout=60) for p in placed) == good
        left = rig.create_pod(8, tag, scheduler=sched)
        wait_for(lambda: "agent data unreadable" in pending_events(rig, left), 60,
                 what="the poisoned node filtered with its reason")  # fmt: skip
        assert rig.pod(left)["spec"].get("nodeName") is None
    finally:
        ext.close()

    # -- a new rebalancer is ready and still drains a sick GPU on another node ----
    holder = next(p for p in placed if rig.pod(p)["spec"]["nodeName"] == good[0])
    _make_owned(rig, holder)
    entries = json.loads(rig.cp.node(good[0])["metadata"]["annotations"][GPUS])
    entries[0].update(
        healthy=False,
        state="unhealthy",
        action="reboot_node",
        reason="xid 79",
        pods=[f"{NS}/{holder}"],
    )
    patch_as_agent(rig, good[0], {GPUS: json.dumps(entries, separators=(",", ":"))})
    url = rig.start_rebalancer(f"rb-{tag}", apply=False, grace_s=0)  # waits for /readyz
    try:
        wait_for(lambda: metric(url, "gpudaemon_rebalancer_evictions_total",
                                kind="drain", result="planned") >= 1, 60,
                 what="a drain planned on the healthy-data node")  # fmt: skip
        assert any(e.get("reason") == "RebalanceWouldEvict" for e in rig.events(holder))
        assert scrape(url + "/metrics", "gpudaemon_rebalancer_bad_node_values_total",
                      key="gpus") >= 1  # fmt: skip
        assert "ignoring its gpus" in rig.rebalancer_log(f"rb-{tag}")
        assert "RecursionError" not in rig.rebalancer_log(f"rb-{tag}")
    finally:
        rig.stop_rebalancers()

    # -- status lists the others and the poisoned node as no data ----------------
    p = run_cli("status", "--kubeconfig", str(rig.cp.admin_kubeconfig),
                "-l", f"{GROUP}={tag}", "-o", "json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)["nodes"]}
    assert sorted(rows) == sorted([bad, *good])
    assert all(rows[n]["fresh"] and not rows[n]["bad_data"] for n in good)
    assert not rows[bad]["fresh"] and rows[bad]["bad_data"].startswith("gpus: ")
    table = run_cli("status", "--kubeconfig", str(rig.cp.admin_kubeconfig),
                    "-l", f"{GROUP}={tag}")  # fmt: skip
    assert table.returncode == 0 and "agent data unreadable" in table.stdout, table

    rig.delete_pods([*placed, left])


def _make_owned(rig: RebalanceRig, pod: str) -> None:
    """The drain evicts only pods a controller re-creates: give the bare test pod a
    controller owner (a ConfigMap stands in; nothing here garbage-collects it)."""
    cm = rig.cp.admin.request(
        "POST",
        f"/api/v1/namespaces/{NS}/configmaps",
        body={"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"owner-{pod}"}},
    )
    owner: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "controller": True,
                             "name": cm["metadata"]["name"], "uid": cm["metadata"]["uid"]}  # fmt: skip
    rig.cp.admin.request(
        "PATCH",
        f"/api/v1/namespaces/{NS}/pods/{pod}",
        body={"metadata": {"ownerReferences": [owner]}},
        content_type="application/merge-patch+json",
    )
