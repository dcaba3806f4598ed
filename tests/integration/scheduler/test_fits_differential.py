"""The rebalancer's `fits` against the real kube-scheduler, case by case: 680 seeded
cases (tests/integration/scheduler/fitcases.py) of resources, nodeSelector, node
affinity, taints and tolerations, cordon and inter-pod (anti-)affinity go through a
plain default kube-scheduler profile (its own filters, no extender) in one run, and
through `fits` as the planner calls it. `fits` may say it cannot judge, or that a pod
does not fit where the scheduler places it; it must never say a pod fits where the
scheduler refuses it."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpudaemon.errors import KubeError
from gpudaemon.rebalancer.fits import (
    PodFit,
    excluded_domains,
    in_domains,
    insufficient,
    node_fit,
    pod_fit,
    static_reason,
    used_by,
)
from tests.integration.kube.controlplane import ControlPlane
from tests.integration.scheduler.fitcases import (
    CASE_LABEL,
    OTHER_NS,
    OVERHEAD,
    ROLE_LABEL,
    ROOMY,
    RUNTIME_CLASS,
    Case,
    generate,
    node_body,
    pod_body,
)
from tests.integration.scheduler.rig import SchedulerRig
from tests.support import wait_for

pytestmark = pytest.mark.integration

SCHEDULER = "default-scheduler"
PROBE = "fc-probe"


@pytest.fixture(scope="module")
def plain(tools_bin: Path) -> Iterator[SchedulerRig]:
    """A control plane of its own (no other test's nodes) and one kube-scheduler with
    the default profile."""
    cp = ControlPlane(tools_bin)
    r = SchedulerRig(cp)
    try:
        cp.start()
        r.start_scheduler(SCHEDULER, with_extender=False)
        yield r
    finally:
        r.stop()
        cp.stop()


def parallel(fn: Callable[[Any], Any], items: Iterable[Any], workers: int = 8) -> list[Any]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


class World:
    """The cases as created in the API server, and the scheduler's verdict on each."""

    def __init__(self, rig: SchedulerRig, cases: list[Case]) -> None:
        self.rig, self.api, self.cases = rig, rig.cp.admin, cases
        self.rejected: dict[int, str] = {}  # case -> the API server's refusal
        self.created: dict[int, dict[str, Any]] = {}  # case -> its pod as stored

    def create_node(self, body: dict[str, Any]) -> None:
        spec = body.get("spec") or {}
        self.api.request("POST", "/api/v1/nodes", body={**body, "spec": {}})
        # TaintNodesByCondition's admission adds the not-ready taint: set the case's own.
        self.api.request(
            "PATCH",
            f"/api/v1/nodes/{body['metadata']['name']}",
            body={"spec": {"taints": spec.get("taints") or None,
                           "unschedulable": spec.get("unschedulable") or None}},
            content_type="application/merge-patch+json",
        )  # fmt: skip

    def create_pod(self, body: dict[str, Any]) -> dict[str, Any]:
        ns = body["metadata"]["namespace"]
        return self.api.request("POST", f"/api/v1/namespaces/{ns}/pods", body=body)

    def setup(self) -> None:
        self.api.request("POST", "/api/v1/namespaces", body={"metadata": {"name": OTHER_NS}})
        self.api.request(
            "POST",
            "/apis/node.k8s.io/v1/runtimeclasses",
            body={"metadata": {"name": RUNTIME_CLASS}, "handler": "runc",
                  "overhead": {"podFixed": OVERHEAD}},
        )  # fmt: skip
        parallel(self.create_node, [b for c in self.cases for b in (c.node, *c.neighbours)])
        existing = [(c.n, p) for c in self.cases for p in c.existing]

        def bound(item: tuple[int, dict[str, Any]]) -> None:
            try:
                self.create_pod(item[1])
            except KubeError as e:
                self.rejected[item[0]] = f"existing pod: {e}"

        parallel(bound, existing)
        # A probe written after every Node and bound Pod: once the scheduler binds it,
        # its informers have seen all of them (each watch is in resourceVersion order).
        self.create_node(node_body(PROBE, {CASE_LABEL: "probe"}, dict(ROOMY), random.Random(0)))
        probe = pod_body(PROBE, {"containers": [{"name": "c", "image": "x.invalid/x"}],
                                 "nodeSelector": {CASE_LABEL: "probe"}}, {})  # fmt: skip
        self.create_pod(probe)
        self.rig.wait_bound(PROBE, timeout=60)

    def create_cases(self) -> None:
        def one(case: Case) -> None:
            if case.n in self.rejected:
                return
            try:
                self.created[case.n] = self.create_pod(case.pod)
            except KubeError as e:
                self.rejected[case.n] = f"pod: {e}"

        parallel(one, self.cases)

    def verdicts(self, timeout: float) -> dict[int, tuple[bool, str]]:
        """Case -> (placed, the scheduler's message), once every case pod is bound or
        marked unschedulable."""
        out: dict[int, tuple[bool, str]] = {}

        def decided() -> bool:
            pods = self.api.request(
                "GET", "/api/v1/namespaces/default/pods",
                query={"labelSelector": f"{ROLE_LABEL}=case"},
            ).get("items") or []  # fmt: skip
            for p in pods:
                n = int(p["metadata"]["name"].removeprefix("fc-"))
                if p["spec"].get("nodeName"):
                    out[n] = (True, p["spec"]["nodeName"])
                    continue
                for cond in (p.get("status") or {}).get("conditions") or []:
                    if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                        out[n] = (False, f"{cond.get('reason')}: {cond.get('message')}")
            return len(out) >= len(self.created)

        wait_for(decided, timeout=timeout, interval=0.5, what="every case pod decided")
        return out


def our_verdict(case: Case, pod: dict[str, Any], nodes: dict[str, dict[str, Any]],
                bound: list[dict[str, Any]]) -> tuple[str, str]:  # fmt: skip
    """("fits" | "no" | "unjudgeable", why), as planner.Placer judges a host."""
    fit = pod_fit(pod)
    if fit.unjudgeable:
        return "unjudgeable", fit.unjudgeable
    facts = {n: node_fit(obj) for n, obj in nodes.items()}
    node = facts[case.node_name]
    reason = static_reason(fit, node)
    if reason:
        return "no", reason
    running: list[tuple[PodFit, str]] = [(pod_fit(p), p["spec"]["nodeName"]) for p in bound]
    repellers = [(f, facts[n]) for f, n in running if f.anti_affinity and n in facts]
    if in_domains(node, excluded_domains(fit, repellers)):
        # Is it only a term with a namespaceSelector (which `fits` takes to select it)?
        plain = [(replace(f, anti_affinity=tuple(t for t in f.anti_affinity
                                                 if t.get("namespaceSelector") is None)), n)
                 for f, n in repellers]  # fmt: skip
        if not in_domains(node, excluded_domains(fit, plain)):
            return "no", "anti-affinity term with a namespaceSelector, taken to select it"
        return "no", "a pod there has required anti-affinity against it"
    used = used_by(f for f, n in running if n == case.node_name)
    short = insufficient(fit.requests, node.allocatable, used)
    if short:
        return "no", f"insufficient {', '.join(short)}"
    return "fits", ""


def reason_class(why: str) -> str:
    for prefix in ("insufficient", "taint", "nodeSelector", "required node affinity",
                   "the node is cordoned", "a pod there", "anti-affinity term",
                   "it has required"):  # fmt: skip
        if why.startswith(prefix):
            return prefix
    return why


def test_fits_never_says_a_pod_fits_where_kube_scheduler_refuses(plain: SchedulerRig) -> None:
    cases = generate()
    assert len(cases) >= 500
    started = time.monotonic()
    world = World(plain, cases)
    world.setup()
    world.create_cases()
    created_s = time.monotonic() - started
    verdicts = world.verdicts(timeout=120)
    scheduled_s = time.monotonic() - started - created_s

    api = plain.cp.admin
    nodes = {n["metadata"]["name"]: n for n in api.request("GET", "/api/v1/nodes")["items"]}
    bound = [
        p
        for ns in ("default", OTHER_NS)
        for p in api.request(
            "GET", f"/api/v1/namespaces/{ns}/pods",
            query={"labelSelector": f"{ROLE_LABEL}=existing"},
        )["items"]
    ]  # fmt: skip

    wrong: list[str] = []  # we say fits, the scheduler refuses
    cautious: Counter[str] = Counter()  # we say no, the scheduler places it
    unjudged: Counter[str] = Counter()
    agree: Counter[str] = Counter()
    by_category: Counter[str] = Counter()
    features: Counter[str] = Counter()
    for case in cases:
        if case.n not in world.created:
            continue
        by_category[case.category] += 1
        features.update(case.features)
        placed, said = verdicts[case.n]
        ours, why = our_verdict(case, world.created[case.n], nodes, bound)
        if placed:
            assert said == case.node_name, f"case {case.n} bound to {said}"
        if ours == "unjudgeable":
            unjudged[f"{reason_class(why)} (scheduler: {'placed' if placed else 'refused'})"] += 1
        elif ours == "fits" and not placed:
            wrong.append(f"case {case.n} ({case.category}): {said}\n  pod: {case.pod}\n"
                         f"  node: {case.node}\n  existing: {case.existing}")  # fmt: skip
        elif ours == "no" and placed:
            cautious[reason_class(why)] += 1
        else:
            agree["fits" if placed else "does not fit"] += 1

    print(
        f"\ncases: {sum(by_category.values())} created, {len(world.rejected)} refused by the "
        f"API server; by category {dict(by_category)}"
    )
    print(f"features: {dict(sorted(features.items()))}")
    print(f"agree: {dict(agree)}; unjudgeable: {dict(unjudged)}")
    print(f"we say no, scheduler places: {dict(cautious)}")
    print(f"we say fits, scheduler refuses: {len(wrong)}")
    print(f"time: created {created_s:.1f}s, decided {scheduled_s:.1f}s")  # fmt: skip
    assert not world.rejected, world.rejected
    assert sum(by_category.values()) >= 500
    assert not wrong, "\n".join(wrong[:10])
    # Most cases are judged, both ways: the test says something about `fits`.
    assert agree["fits"] >= 100 and agree["does not fit"] >= 100, agree
    assert sum(unjudged.values()) < 60, unjudged
