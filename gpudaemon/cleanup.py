"""`gpudaemon cleanup`: remove from the cluster what gpudaemon's programs wrote at run
time, which no Helm release or manifest owns: what an uninstall must take away.

- On every Node: the labels and annotations our field manager (`gpudaemon`) owns under
  the prefix (server-side apply of the rest: a key another manager also set stays, with
  that manager's value), the `GPUHealthy` condition and the `<prefix>gpu-unhealthy`
  taint.
- The DeviceTaintRules the agents made (our labels), cluster-wide.
- In the release namespace: the agents' node Leases (their label) and the
  rebalancer's leader Lease.
- On pods: the rebalancer's reservation notes (`gpudaemon.io/reserved-node`, `-until`).

It is what the chart's post-delete hook Job runs (after Helm has removed the agents,
their RBAC first, so no agent writes again), and the one command for the raw
manifests (docs/operations.md). Nothing else runs it: a restart or an upgrade never
lifts a quarantine. Every step is idempotent; a failed step is reported and the others
still run (exit 1 names each failure).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpudaemon.agent.devicetaints import NAME_LABEL, RULES_PATH
from gpudaemon.agent.nodehealth import CONDITION_TYPE, TAINT_SUFFIX, has_taint
from gpudaemon.agent.nodesync import owned_keys
from gpudaemon.cluster.reservations import (
    REBALANCER_LEASE,
    RESERVED_NODE_ANNOTATION,
    RESERVED_UNTIL_ANNOTATION,
)
from gpudaemon.errors import KubeConflictError, KubeError, KubeInvalidError, KubeNotFoundError
from gpudaemon.kube.client import MANAGER_QUERY, NODE_LEASE_SELECTOR, KubeClient
from gpudaemon.kube.lease import lease_path

RULE_SELECTOR = ",".join(f"{k}={v}" for k, v in NAME_LABEL.items())
RESERVATION_KEYS = (RESERVED_NODE_ANNOTATION, RESERVED_UNTIL_ANNOTATION)
MERGE_PATCH = "application/merge-patch+json"
_ATTEMPTS = 5  # a Node changed between our read and our guarded write: read again


@dataclass
class Report:
    """What was removed (or, with dry_run, would be), one line each, and what failed."""

    removed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def cleanup(client: KubeClient, *, prefix: str, namespace: str, dry_run: bool = False) -> Report:
    """Remove everything gpudaemon wrote (see the module docstring)."""
    report = Report()
    steps: list[tuple[str, Callable[[], None]]] = [
        ("nodes", lambda: _nodes(client, prefix, dry_run, report)),
        ("DeviceTaintRules", lambda: _rules(client, dry_run, report)),
        (f"Leases in {namespace}", lambda: _leases(client, namespace, dry_run, report)),
        ("pod reservation notes", lambda: _pods(client, dry_run, report)),
    ]
    for what, step in steps:
        try:
            step()
        except KubeError as e:
            report.failed.append(f"{what}: {e}")
    return report


# -- Nodes ----------------------------------------------------------------------------


def _nodes(client: KubeClient, prefix: str, dry_run: bool, report: Report) -> None:
    nodes, _ = client.list_items("/api/v1/nodes")
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name", ""))
        try:
            for line in _clean_node(client, node, prefix, dry_run):
                report.removed.append(f"node {name}: {line}")
        except KubeNotFoundError:
            continue  # deleted meanwhile: nothing of ours left on it
        except KubeError as e:
            report.failed.append(f"node {name}: {e}")


def _clean_node(
    client: KubeClient, node: Mapping[str, Any], prefix: str, dry_run: bool
) -> list[str]:
    meta = node.get("metadata") or {}
    name = str(meta.get("name", ""))
    done: list[str] = []
    own_l, own_a = owned_keys(node)
    drop_l = sorted(k for k in own_l if k.startswith(prefix))
    drop_a = sorted(k for k in own_a if k.startswith(prefix))
    if drop_l or drop_a:
        if not dry_run:
            # Apply what we own minus our keys: server-side apply removes the keys we
            # no longer set, unless another manager set them too (theirs stay).
            labels, ann = meta.get("labels") or {}, meta.get("annotations") or {}
            keep_l = {k: labels[k] for k in own_l - set(drop_l) if k in labels}
            keep_a = {k: ann[k] for k in own_a - set(drop_a) if k in ann}
            client.apply_node(name, keep_l, keep_a)
        if drop_l:
            done.append(f"{len(drop_l)} label(s) ({', '.join(drop_l)})")
        if drop_a:
            done.append(f"{len(drop_a)} annotation(s) ({', '.join(drop_a)})")
    conditions = (node.get("status") or {}).get("conditions") or []
    if any(isinstance(c, Mapping) and c.get("type") == CONDITION_TYPE for c in conditions):
        if not dry_run:
            patch = {"status": {"conditions": [{"type": CONDITION_TYPE, "$patch": "delete"}]}}
            client.patch_node(name, patch, status=True)
        done.append(f"condition {CONDITION_TYPE}")
    key = prefix + TAINT_SUFFIX
    if has_taint(node, key):
        if not dry_run:
            _untaint(client, name, key)
        done.append(f"taint {key}")
    return done


def _untaint(client: KubeClient, name: str, key: str) -> None:
    """Remove our taint with a JSON patch guarded by the resourceVersion, so a taint
    another writer adds meanwhile is not lost; read again on a conflict."""
    for attempt in range(_ATTEMPTS):
        node = client.get_node(name)
        if not has_taint(node, key):
            return
        rv = str((node.get("metadata") or {}).get("resourceVersion", ""))
        taints = [
            t
            for t in (node.get("spec") or {}).get("taints") or []
            if not (isinstance(t, Mapping) and t.get("key") == key)
        ]
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "add", "path": "/spec/taints", "value": taints},
        ]
        try:
            client.json_patch_node(name, ops)
            return
        except (KubeConflictError, KubeInvalidError):  # the test failed: changed meanwhile
            if attempt == _ATTEMPTS - 1:
                raise


# -- DeviceTaintRules, Leases, pods -------------------------------------------------------


def _rules(client: KubeClient, dry_run: bool, report: Report) -> None:
    try:
        rules, _ = client.list_items(RULES_PATH, {"labelSelector": RULE_SELECTOR})
    except KubeNotFoundError:
        return  # resource.k8s.io/v1 not served (DRA off): none can exist
    for rule in rules:
        name = str((rule.get("metadata") or {}).get("name", ""))
        _delete(client, f"{RULES_PATH}/{name}", f"DeviceTaintRule {name}", dry_run, report)


def _leases(client: KubeClient, namespace: str, dry_run: bool, report: Report) -> None:
    items, _ = client.list_items(lease_path(namespace), {"labelSelector": NODE_LEASE_SELECTOR})
    names = sorted(str((i.get("metadata") or {}).get("name", "")) for i in items)
    for name in names:
        _delete(client, lease_path(namespace, name), f"Lease {namespace}/{name}", dry_run, report)
    leader = lease_path(namespace, REBALANCER_LEASE)
    try:
        client.request("GET", leader)
    except KubeNotFoundError:
        return
    _delete(client, leader, f"Lease {namespace}/{REBALANCER_LEASE}", dry_run, report)


def _pods(client: KubeClient, dry_run: bool, report: Report) -> None:
    for page, _ in client.pages("/api/v1/pods"):
        for pod in page:
            meta = pod.get("metadata") or {}
            ann = meta.get("annotations") or {}
            keys = [k for k in RESERVATION_KEYS if k in ann]
            if not keys:
                continue
            ns, name = meta.get("namespace", ""), meta.get("name", "")
            what = f"pod {ns}/{name}: {', '.join(keys)}"
            if not dry_run:
                body = {"metadata": {"annotations": dict.fromkeys(keys)}}
                try:
                    client.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}", body,
                                   MERGE_PATCH, MANAGER_QUERY)  # fmt: skip
                except KubeNotFoundError:
                    continue
                except KubeError as e:
                    report.failed.append(f"{what}: {e}")
                    continue
            report.removed.append(what)


def _delete(client: KubeClient, path: str, what: str, dry_run: bool, report: Report) -> None:
    if not dry_run:
        try:
            client.request("DELETE", path)
        except KubeNotFoundError:
            return
        except KubeError as e:
            report.failed.append(f"{what}: {e}")
            return
    report.removed.append(what)
