"""`dra.enabled` in the chart, agent side (issue 32): off by default, nothing of DRA is
rendered; on, the agent's ClusterRole reads ResourceSlices and writes DeviceTaintRules
(no update, no deletecollection), the admission policy that holds those writes to its own
node's pool renders with its binding and the label prefix, and the agent's config says
`dra.enabled`."""

from __future__ import annotations

import pytest
import yaml

from tests.integration.helm.test_chart import one, template

pytestmark = pytest.mark.integration

POLICY = "gpudaemon-agent-device-taints"


def test_dra_is_off_by_default_and_renders_nothing_of_it(helm: str) -> None:
    docs = template(helm)
    role = one(docs, "ClusterRole", "gpudaemon-agent")
    assert all("resource.k8s.io" not in r["apiGroups"] for r in role["rules"])
    assert not [d for d in docs if d["metadata"]["name"] == POLICY]
    config = yaml.safe_load(one(docs, "ConfigMap", "gpudaemon-agent")["data"]["config.yaml"])
    assert config["dra"] == {"enabled": False}


def test_dra_renders_the_agents_rbac_policy_and_config(helm: str) -> None:
    docs = template(
        helm, "--set", "dra.enabled=true", "--set", "labelPrefix=gpu.example.com/",
        "--set", "agent.config.dra.taint_effect=None", namespace="ops",
    )  # fmt: skip
    role = one(docs, "ClusterRole", "gpudaemon-agent")
    dra = [r for r in role["rules"] if r["apiGroups"] == ["resource.k8s.io"]]
    assert dra == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["devicetaintrules"],
         "verbs": ["get", "list", "create", "patch", "delete"]},
    ]  # fmt: skip
    vap = one(docs, "ValidatingAdmissionPolicy", POLICY)
    spec = vap["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"][0]["operations"] == [
        "CREATE",
        "UPDATE",
        "DELETE",
    ]
    assert spec["matchConditions"][0]["expression"] == (
        "request.userInfo.username == 'system:serviceaccount:ops:gpudaemon'"
    )
    text = yaml.safe_dump(spec)
    assert "'gpu.example.com/unhealthy'" in text and "'gpu.example.com/node'" in text
    binding = one(docs, "ValidatingAdmissionPolicyBinding", POLICY)
    assert binding["spec"] == {"policyName": POLICY, "validationActions": ["Deny"]}
    config = yaml.safe_load(one(docs, "ConfigMap", "gpudaemon-agent")["data"]["config.yaml"])
    assert config["dra"] == {"enabled": True, "taint_effect": "None"}


def test_the_policy_follows_the_admission_policy_switch(helm: str) -> None:
    docs = template(
        helm, "--set", "dra.enabled=true", "--set", "agent.admissionPolicy.enabled=false"
    )
    assert not [d for d in docs if d["metadata"]["name"] == POLICY]
    docs = template(
        helm, "--set", "dra.enabled=true",
        "--set", "agent.admissionPolicy.requireNodeBoundToken=true",
    )  # fmt: skip
    exprs = [
        v["expression"]
        for v in one(docs, "ValidatingAdmissionPolicy", POLICY)["spec"]["validations"]
    ]
    assert any(e.startswith("has(request.userInfo.extra) &&") for e in exprs)


READS = {"apiGroups": ["resource.k8s.io"], "verbs": ["get", "list", "watch"],
         "resources": ["resourceslices", "resourceclaims", "resourceclaimtemplates",
                       "deviceclasses", "devicetaintrules"]}  # fmt: skip


@pytest.mark.parametrize("on", [False, True])
def test_dra_gives_the_extender_and_rebalancer_one_switch_and_read_only_rbac(
    helm: str, on: bool
) -> None:
    """Cluster side: with `dra.enabled` both programs' configs carry `dra.enabled` and
    their ClusterRoles read the five DRA kinds, never write them; the gpudaemon-scheduler
    profile drops managedResources even with `scheduler.extenderPods: managed` (a DRA pod
    requests no extended resource, so kube-scheduler would never send it to the
    extender)."""
    docs = template(helm, "--set", f"dra.enabled={str(on).lower()}",
                    "--set", "scheduler.extenderPods=managed",
                    "--set", "rebalancer.enabled=true", "--set", "extender.mode=service",
                    "--set", "extender.tls.secretName=x", "--set", "scheduler.extenderClientTls.secretName=y")  # fmt: skip
    for name in ("gpudaemon-extender", "gpudaemon-rebalancer"):
        rules = one(docs, "ClusterRole", name)["rules"]
        dra = [r for r in rules if "resource.k8s.io" in r["apiGroups"]]
        assert dra == ([READS] if on else []), name
        config = yaml.safe_load(one(docs, "ConfigMap", name)["data"]["config.yaml"])
        assert config["dra"] == {"enabled": on}, name
    sched = yaml.safe_load(one(docs, "ConfigMap", "gpudaemon-scheduler")["data"]["config.yaml"])
    assert ("managedResources" in sched["extenders"][0]) is not on
