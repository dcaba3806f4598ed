"""The verdict tables (extender/verdicts.py): large requests are answered from verdicts
kept per node between requests. Their answers are the general path's, node for node,
through any sequence of node, pod and Lease events, assumptions and time passing; a
change reaches the next answer at once; and an unchanged node is not judged again."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.config import load_config
from gpudaemon.extender.api import ExtenderApi, parse_args
from gpudaemon.extender.app import make_policies
from gpudaemon.kube.lease import micro_time
from tests.clock import FakeClock

P = "gpudaemon.io/"
MODELS = ("NVIDIA-H100", "NVIDIA-A100")


def node_obj(
    name: str, gpus: int = 8, unhealthy: int = 0, util: int = 0, model: str = MODELS[0]
) -> dict[str, Any]:
    labels = {
        P + "gpu.count": str(gpus),
        P + "gpu.healthy": str(gpus - unhealthy),
        P + "gpu.unhealthy": str(unhealthy),
        P + "gpu.product": model,
    }
    gpu_list = ",".join(
        f'{{"index":{i},"uuid":"GPU-{name}-{i}","memory_total_mib":81559,"utilization_pct":{util}}}'
        for i in range(gpus)
    )
    return {
        "metadata": {
            "name": name,
            "uid": "u-" + name,
            "labels": labels,
            "annotations": {P + "gpus": f"[{gpu_list}]"},
        },
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "64", "memory": "512Gi"}},
    }


def lease_obj(name: str, renewed: float, duration: int) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "ownerReferences": [{"kind": "Node", "name": name, "uid": "u-" + name}],
        },
        "spec": {"renewTime": micro_time(renewed), "leaseDurationSeconds": duration},
    }


def pod_obj(uid: str, gpus: int, node: str = "", cpu: int = 1, mem_gib: int = 4) -> dict[str, Any]:
    res = {"nvidia.com/gpu": str(gpus), "cpu": str(cpu), "memory": f"{mem_gib}Gi"}
    return {
        "metadata": {"uid": uid, "name": uid, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "schedulerName": "gpudaemon-scheduler",
            "containers": [{"name": "c", "resources": {"requests": res}}],
        },
        "status": {"phase": "Running" if node else "Pending"},
    }


class World:
    """One extender over its own cluster state, policies and clocks."""

    def __init__(self, tables: bool, policy: str, candidates: int, clock: FakeClock) -> None:
        self.cluster = ClusterState(P, assume_ttl_s=30, clock=clock, wall=clock)
        cfg = load_config(None, environ={})
        self.api = ExtenderApi(
            self.cluster, make_policies(cfg), policy, CollectorRegistry(), lambda: (True, "ok"),
            candidates=candidates,
        )  # fmt: skip
        # The tables for any request (1), or never (the general path).
        self.api.framework.table_min_nodes = 1 if tables else 10**9

    def ask(self, verb: str, pod: dict[str, Any], names: list[str]) -> Any:
        body = json.dumps({"Pod": pod, "NodeNames": names}).encode()
        args = parse_args(body)
        out = self.api.filter(args) if verb == "filter" else self.api.prioritize(args)
        return json.loads(json.dumps(out))  # as the wire carries it


def world_pair(
    policy: str, candidates: int, nodes: list[dict[str, Any]], leases: list[dict[str, Any]]
) -> tuple[FakeClock, list[World]]:
    clock = FakeClock()
    worlds = [World(t, policy, candidates, clock) for t in (False, True)]
    for w in worlds:
        w.cluster.replace_nodes(nodes)
        w.cluster.replace_pods([])
        w.cluster.replace_leases(leases)
    return clock, worlds


@pytest.mark.parametrize("seed", range(12))
def test_answers_from_the_tables_are_the_general_paths_through_any_events(seed: int) -> None:
    rng = random.Random(seed)
    policy = ("fragmentation", "binpack", "spread")[seed % 3]
    candidates = (0, 3, 10)[seed % 3 if seed < 6 else (seed + 1) % 3]
    names = [f"n{i:02d}" for i in range(30)]
    nodes = [
        node_obj(n, gpus=rng.choice([4, 8]), util=rng.choice([0, 40]), model=rng.choice(MODELS))
        for n in names
    ]
    t0 = FakeClock().now
    leases = [lease_obj(n, t0, rng.choice([20, 60, 3600])) for n in names]
    clock, worlds = world_pair(policy, candidates, nodes, leases)
    asked = [*names, "ghost"]  # a name the cluster does not know
    bound: list[tuple[str, str]] = []
    for k in range(160):
        op = rng.random()
        if op < 0.30:
            verb = rng.choice(["filter", "prioritize"])
            uid = rng.choice([f"p{k}", ""])  # "" is never assumed
            pod = pod_obj(uid, rng.choice([1, 1, 2, 4, 8]), cpu=rng.choice([1, 8, 40]))
            request = rng.sample(asked, len(asked)) if rng.random() < 0.2 else asked
            if rng.random() < 0.2:
                request = request[: rng.randint(1, len(request))]  # a subset
            answers = [w.ask(verb, pod, request) for w in worlds]
            assert answers[0] == answers[1], (k, verb)
        elif op < 0.50:
            n, uid = rng.choice(names), f"b{k}"
            bound.append((uid, n))
            obj = pod_obj(uid, rng.choice([1, 2]), node=n)
            for w in worlds:
                w.cluster.pod_event("ADDED", obj)
        elif op < 0.60 and bound:
            uid, n = bound.pop(rng.randrange(len(bound)))
            for w in worlds:
                w.cluster.pod_event("DELETED", pod_obj(uid, 1, node=n))
        elif op < 0.72:
            obj = node_obj(
                rng.choice(names),
                gpus=rng.choice([4, 8]),
                unhealthy=rng.choice([0, 0, 0, 1]),
                util=rng.choice([0, 40, 90]),
                model=rng.choice(MODELS),
            )
            for w in worlds:
                w.cluster.node_event("MODIFIED", obj)
        elif op < 0.76:
            n = rng.choice(names)
            for w in worlds:
                w.cluster.node_event("DELETED", node_obj(n))
            back = node_obj(n)
            for w in worlds:
                w.cluster.node_event("ADDED", back)
        elif op < 0.86:
            obj = lease_obj(rng.choice(names), clock.now, rng.choice([20, 60, 3600]))
            kind = rng.choice(["MODIFIED", "MODIFIED", "DELETED"])
            for w in worlds:
                w.cluster.lease_event(kind, obj)
        elif op < 0.98:
            clock.advance(rng.choice([1, 5, 15]))  # Leases run out, assumptions expire
        else:
            for w in worlds:  # a relist
                w.cluster.replace_leases(
                    [lease_obj(n, clock.now, 3600) for n in names if n != "n00"]
                )
    tables = worlds[1].api.framework._tables._tables.values()
    assert sum(t.judged for t in tables) > 0  # the second world did answer from them


def fast(policy: str = "binpack", candidates: int = 0, n: int = 4) -> tuple[FakeClock, World]:
    clock = FakeClock()
    w = World(True, policy, candidates, clock)
    w.cluster.replace_nodes([node_obj(f"n{i}") for i in range(n)])
    w.cluster.replace_pods([])
    w.cluster.replace_leases([lease_obj(f"n{i}", clock.now, 60) for i in range(n)])
    return clock, w


def pick(scores: list[dict[str, Any]]) -> str:
    return next(s["Host"] for s in scores if s["Score"] == 10)


def test_a_bound_pod_changes_the_next_answer_at_once() -> None:
    _, w = fast()
    names = ["n0", "n1", "n2", "n3"]
    assert pick(w.ask("prioritize", pod_obj("", 2), names)) == "n0"  # all equal: by name
    w.cluster.pod_event("ADDED", pod_obj("b1", 4, node="n2"))
    assert pick(w.ask("prioritize", pod_obj("", 2), names)) == "n2"  # bin-packing
    w.cluster.pod_event("DELETED", pod_obj("b1", 4, node="n2"))
    assert pick(w.ask("prioritize", pod_obj("", 2), names)) == "n0"


def test_an_assumption_counts_in_the_next_answer() -> None:
    _, w = fast()
    names = ["n0", "n1", "n2", "n3"]
    assert pick(w.ask("prioritize", pod_obj("p1", 6), names)) == "n0"  # assumed there
    # n0 has 2 left by the assumption: a 2-GPU pod packs it
    assert pick(w.ask("prioritize", pod_obj("", 2), names)) == "n0"
    assert pick(w.ask("prioritize", pod_obj("", 4), names)) == "n1"


def test_a_node_turning_unhealthy_fails_it_at_once() -> None:
    _, w = fast()
    names = ["n0", "n1"]
    assert w.ask("filter", pod_obj("", 1), names)["NodeNames"] == names
    w.cluster.node_event("MODIFIED", node_obj("n1", unhealthy=1))
    got = w.ask("filter", pod_obj("", 1), names)
    assert got["NodeNames"] == ["n0"] and "unhealthy" in got["FailedNodes"]["n1"]
    w.cluster.node_event("MODIFIED", node_obj("n1"))
    assert w.ask("filter", pod_obj("", 1), names)["NodeNames"] == names


def test_a_lease_running_out_makes_the_node_stale_with_no_event() -> None:
    clock, w = fast()
    names = ["n0", "n1"]
    w.cluster.lease_event("MODIFIED", lease_obj("n1", clock.now, 3600))
    assert w.ask("filter", pod_obj("", 1), names)["NodeNames"] == names
    clock.advance(61)  # n0's 60 s Lease has run out; no event says so
    got = w.ask("filter", pod_obj("", 1), names)
    assert got["NodeNames"] == ["n1"] and "stale" in got["FailedNodes"]["n0"]
    w.cluster.lease_event("MODIFIED", lease_obj("n0", clock.now, 60))  # renewed
    assert w.ask("filter", pod_obj("", 1), names)["NodeNames"] == names


def test_a_deleted_node_has_no_data_at_once_and_a_new_one_is_judged() -> None:
    clock, w = fast()
    names = ["n0", "n1", "n9"]
    got = w.ask("filter", pod_obj("", 1), names)
    assert got["NodeNames"] == ["n0", "n1"] and "no gpudaemon agent" in got["FailedNodes"]["n9"]
    w.cluster.node_event("DELETED", node_obj("n1"))
    w.cluster.node_event("ADDED", node_obj("n9"))
    w.cluster.lease_event("ADDED", lease_obj("n9", clock.now, 60))
    got = w.ask("filter", pod_obj("", 1), names)
    assert got["NodeNames"] == ["n0", "n9"] and "no gpudaemon agent" in got["FailedNodes"]["n1"]


def test_the_policy_learning_rescoring_every_node_matches_the_general_path() -> None:
    _, worlds = world_pair(
        "fragmentation", 2,
        [node_obj(f"n{i}", gpus=8) for i in range(6)],
        [lease_obj(f"n{i}", FakeClock().now, 3600) for i in range(6)],
    )  # fmt: skip
    names = [f"n{i}" for i in range(6)]
    for w in worlds:
        w.cluster.pod_event("ADDED", pod_obj("b0", 5, node="n1"))
        w.cluster.pod_event("ADDED", pod_obj("b1", 2, node="n2"))
    for k in range(120):  # each new UID is an arrival: the typical pods move on
        pod = pod_obj(f"p{k}", (1, 2, 4, 8)[k % 4 if k < 60 else 3])
        answers = [w.ask(v, pod, names) for w in worlds for v in ("filter", "prioritize")]
        assert answers[:2] == answers[2:], k


def test_an_unchanged_node_is_not_judged_again() -> None:
    _, w = fast(n=50)
    names = [f"n{i}" for i in range(50)]
    w.ask("filter", pod_obj("", 1), names)
    table = next(iter(w.api.framework._tables._tables.values()))
    first = table.judged
    assert first == 50
    w.ask("filter", pod_obj("", 1), names)
    assert table.judged == first  # nothing changed: nothing judged
    w.cluster.pod_event("ADDED", pod_obj("b1", 1, node="n7"))
    w.ask("prioritize", pod_obj("", 1), names)
    assert table.judged == first + 1  # the one node that changed


def test_changes_name_the_changed_nodes_and_a_relist_names_all() -> None:
    clock = FakeClock()
    c = ClusterState(P, clock=clock, wall=clock)
    c.replace_nodes([node_obj("a"), node_obj("b")])
    c.replace_pods([])
    first = c.changes(None)
    assert first.changed is None and set(first.states) == {"a", "b"}
    assert c.changes(first.cursor).changed == set()
    c.pod_event("ADDED", pod_obj("p", 1, node="b"))
    c.lease_event("ADDED", lease_obj("a", clock.now, 60))
    ch = c.changes(first.cursor, ["zz"])
    assert ch.changed == {"a", "b"} and set(ch.states) == {"a", "b", "zz"}
    assert ch.until["a"] == clock.now + 60 and ch.until["b"] == float("-inf")
    assert ch.states["b"].gpus_free == 7  # type: ignore[union-attr]
    c.replace_nodes([node_obj("a")])
    assert c.changes(ch.cursor).changed is None
