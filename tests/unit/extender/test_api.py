"""The HTTP layer: upstream wire format in both key cases, 400s with reasons, no-GPU
pods passed through and ranked by `gpuless_pods`, assumptions under
concurrency."""

from __future__ import annotations

import io
import json
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.policies import BinPack, Spread
from gpudaemon.cluster.policies.fragmentation import Fragmentation, Workload
from gpudaemon.cluster.scoring import best_nodes, check_node, to_levels
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.extender.api import ExtenderApi
from gpudaemon.extender.gpuless import strands_no_gpu
from tests.clock import FakeClock
from tests.unit.extender.test_cluster import lease_obj, node_obj, pod_obj


def make_api(**kw: Any) -> tuple[ExtenderApi, ClusterState, CollectorRegistry]:
    wall = FakeClock()
    c = ClusterState("gpudaemon.io/", wall=wall)
    c.replace_nodes(
        [
            node_obj("a", uid="a"),
            node_obj("b", uid="b"),
            node_obj("c", uid="c"),
            node_obj("sick", healthy=7, uid="sick"),
            node_obj("old", uid="old"),
        ]
    )
    c.replace_pods([pod_obj("x1", "a", 6), pod_obj("x2", "b", 2)])
    c.replace_leases(
        [lease_obj(n, wall(), 300, owner_uid=n) for n in ("a", "b", "c", "sick")]
        + [lease_obj("old", wall() - 1000, 300, owner_uid="old")]
    )
    reg = CollectorRegistry()
    api = ExtenderApi(
        c, {"binpack": BinPack(), "spread": Spread()}, "binpack", reg, lambda: (True, "ok"), **kw
    )
    return api, c, reg


def call(
    api: ExtenderApi, path: str, body: bytes | None = None, method: str = "POST"
) -> tuple[str, Any]:
    status: list[str] = []
    env = {
        "PATH_INFO": path,
        "REQUEST_METHOD": method,
        "CONTENT_LENGTH": str(len(body or b"")),
        "wsgi.input": io.BytesIO(body or b""),
        "QUERY_STRING": "",
    }
    out = b"".join(api(env, lambda s, h: status.append(s)))
    ctype = "json" if out[:1] in (b"{", b"[") else "text"
    return status[0], json.loads(out) if ctype == "json" else out.decode()


def pod(uid: str, gpus: int, policy: str | None = None) -> dict[str, Any]:
    p = pod_obj(uid, "", gpus)
    if policy:
        p["metadata"]["annotations"] = {"gpudaemon.io/policy": policy}
    return p


NAMES = ["a", "b", "c", "sick", "old", "ghost"]


@pytest.mark.parametrize(
    ("pod_key", "names_key"), [("Pod", "NodeNames"), ("pod", "nodenames"), ("POD", "nodeNames")]
)
def test_filter_reads_either_key_case_and_gives_reasons(pod_key: str, names_key: str) -> None:
    api, _, reg = make_api()
    status, res = call(
        api, "/filter", json.dumps({pod_key: pod("p", 4), names_key: NAMES}).encode()
    )
    assert status.startswith("200")
    assert res["NodeNames"] == ["c", "b"] or sorted(res["NodeNames"]) == ["b", "c"]
    failed = res["FailedNodes"]
    assert set(failed) == {"a", "sick", "old", "ghost"}
    assert "needs 4 GPU(s), 2 healthy free" in failed["a"]
    assert (
        "unhealthy" in failed["sick"]
        and "stale" in failed["old"]
        and "no gpudaemon agent" in failed["ghost"]
    )
    assert reg.get_sample_value("gpudaemon_extender_filter_nodes_total", {"result": "stale"}) == 1
    assert reg.get_sample_value("gpudaemon_extender_filter_nodes_total", {"result": "passed"}) == 2


def test_filter_with_full_node_objects_returns_node_objects() -> None:
    api, _, _ = make_api()
    items = [{"metadata": {"name": n}} for n in ("a", "c")]
    _, res = call(
        api, "/filter", json.dumps({"Pod": pod("p", 4), "Nodes": {"items": items}}).encode()
    )
    assert [n["metadata"]["name"] for n in res["Nodes"]["items"]] == ["c"]


def test_prioritize_binpacks_and_assumes_the_best() -> None:
    api, _c, _ = make_api()
    _, res = call(
        api, "/prioritize", json.dumps({"Pod": pod("p1", 2), "NodeNames": ["a", "b", "c"]}).encode()
    )
    scores = {h["Host"]: h["Score"] for h in res}
    assert scores == {"a": 10, "b": 9, "c": 8}  # a: 0 left, b: 4 left, c: 6 left
    # p1 is now assumed on a: a second pod sees a full, so b is best
    _, res = call(
        api, "/prioritize", json.dumps({"Pod": pod("p2", 2), "NodeNames": ["a", "b", "c"]}).encode()
    )
    scores = {h["Host"]: h["Score"] for h in res}
    assert scores["a"] == 0 and scores["b"] == 10


def test_pod_annotation_picks_the_policy() -> None:
    api, _, _ = make_api()
    _, res = call(
        api,
        "/prioritize",
        json.dumps({"Pod": pod("p", 1, "spread"), "NodeNames": ["a", "b", "c"]}).encode(),
    )
    assert max(res, key=lambda h: h["Score"])["Host"] == "c"


def test_pod_without_gpus_passes_every_filter_and_is_ranked_only_by_free_gpus() -> None:
    api, _, _ = make_api()
    _, f = call(api, "/filter", json.dumps({"Pod": pod("p", 0), "NodeNames": NAMES}).encode())
    assert f["NodeNames"] == NAMES and f["FailedNodes"] == {}
    _, p = call(api, "/prioritize", json.dumps({"Pod": pod("p", 0), "NodeNames": NAMES}).encode())
    # Stale ("old"), unhealthy ("sick") and unknown nodes are not the filter's business
    # for such a pod; only "ghost" (no GPU the caches know) strands none.
    assert {h["Host"]: h["Score"] for h in p} == {
        "a": 0, "b": 0, "c": 0, "sick": 0, "old": 0, "ghost": 10,
    }  # fmt: skip


@pytest.mark.parametrize("mode", ["full_nodes_first", "random", "policy"])
def test_a_pod_without_gpus_scores_by_the_gpus_it_could_strand(mode: str) -> None:
    """Issue 40: the shipped profile sends every pod, and the filter passes a pod asking
    for no GPU everywhere. `full_nodes_first` (the default) scores 10 where its CPU and
    memory strand no GPU (c: every GPU taken; ghost: no GPU the caches know) and 0
    beside free GPUs; `random` scores 0 everywhere (kube-scheduler draws); `policy` lets
    a policy that ranks such pods (fragmentation) pick one node."""
    _, c, _ = make_api()
    c.replace_pods([pod_obj("x1", "a", 6), pod_obj("x2", "b", 2), pod_obj("x3", "c", 8)])
    api = ExtenderApi(
        c, {"fragmentation": Fragmentation()}, "fragmentation", CollectorRegistry(),
        lambda: (True, "ok"), gpuless_pods=mode,
    )  # fmt: skip
    names = ["a", "b", "c", "ghost"]
    _, f = call(api, "/filter", json.dumps({"Pod": pod("p", 0), "NodeNames": names}).encode())
    assert f["NodeNames"] == names
    _, res = call(api, "/prioritize", json.dumps({"Pod": pod("p", 0), "NodeNames": names}).encode())
    scores = {h["Host"]: h["Score"] for h in res}
    # A GPU pod is ranked as before in every mode: c has no free GPU for it.
    _, res = call(api, "/prioritize", json.dumps({"Pod": pod("g", 1), "NodeNames": names}).encode())
    assert {h["Host"]: h["Score"] for h in res}["c"] == 0
    if mode == "full_nodes_first":
        assert scores == {"a": 0, "b": 0, "c": 10, "ghost": 10}
        # Kept between requests, and brought up to date: a's last GPUs taken, c's freed.
        c.replace_pods([pod_obj("x1", "a", 8), pod_obj("x2", "b", 2)])
        body = json.dumps({"Pod": pod("q", 0), "NodeNames": names}).encode()
        _, res = call(api, "/prioritize", body)
        assert {h["Host"]: h["Score"] for h in res} == {"a": 10, "b": 0, "c": 0, "ghost": 10}
    elif mode == "random":
        assert scores == dict.fromkeys(names, 0)
    else:
        assert sorted(scores.values()).count(10) == 1, scores  # the policy's pick


def test_a_free_mig_device_is_a_gpu_a_gpuless_pod_could_strand() -> None:
    full = NodeState("full", gpus_allocatable=8, gpus_requested=8)
    mig = NodeState("mig", mig_allocatable=(("1g.10gb", 7),), mig_requested=(("1g.10gb", 6),))
    mig_taken = NodeState("m2", mig_allocatable=(("1g.10gb", 7),), mig_requested=(("1g.10gb", 7),))
    free = NodeState("free", gpus_allocatable=8, gpus_requested=7)
    sick = NodeState("sick", gpus_allocatable=8, gpus_requested=7, gpus_unhealthy=1)
    assert [strands_no_gpu(n) for n in (full, mig, mig_taken, free, sick, None)] == [
        True, False, True, False, True, True,
    ]  # fmt: skip


def test_one_candidate_returns_the_pick_alone_and_assumes_it() -> None:
    api, c, reg = make_api(candidates=1)
    _, res = call(
        api, "/filter", json.dumps({"Pod": pod("p", 2), "NodeNames": ["a", "b", "c"]}).encode()
    )
    assert res["NodeNames"] == ["a"]
    # Outranked nodes are counted, not listed: the pod fits, so the scheduler would
    # never show those reasons, only decode them.
    assert res["FailedNodes"] == {}
    assert (
        reg.get_sample_value("gpudaemon_extender_filter_nodes_total", {"result": "outranked"}) == 2
    )
    assert c.states(["a"])["a"].gpus_free == 0  # type: ignore[union-attr]


def test_candidates_narrow_to_the_best_in_order_and_prioritize_ranks_them() -> None:
    api, c, _ = make_api(candidates=2)
    body = json.dumps({"Pod": pod("p", 2), "NodeNames": ["c", "b", "a", "sick", "old"]}).encode()
    _, res = call(api, "/filter", body)
    assert res["NodeNames"] == ["a", "b"]  # binpack: a is left with 0 free, b with 4
    assert set(res["FailedNodes"]) == {"sick", "old"}  # real reasons are still listed
    assert c.states(["a"])["a"].gpus_free == 2  # two candidates: /prioritize assumes
    _, scores = call(
        api, "/prioritize", json.dumps({"Pod": pod("p", 2), "NodeNames": ["a", "b"]}).encode()
    )
    assert scores == [{"Host": "a", "Score": 10}, {"Host": "b", "Score": 9}]
    assert c.states(["a"])["a"].gpus_free == 0


def test_candidates_fill_up_with_nodes_only_the_scheduler_thinks_fit() -> None:
    """A node our CPU view rejects but the scheduler's filters accepted is still offered
    when too few scored nodes remain; with none scorable nothing is narrowed: the
    scheduler decides, as without narrowing."""
    api, c, _ = make_api(candidates=2)
    tight = pod("p", 2)
    tight["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "63.5"  # only c is idle
    _, res = call(api, "/filter", json.dumps({"Pod": tight, "NodeNames": ["a", "b", "c"]}).encode())
    assert res["NodeNames"] == ["c", "a"]
    big = pod("q", 2)
    big["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "10000"  # fits nowhere
    _, res = call(api, "/filter", json.dumps({"Pod": big, "NodeNames": ["c", "b", "a"]}).encode())
    assert res["NodeNames"] == ["c", "b", "a"]
    assert c.sizes()["assumed"] == 0  # nothing assumed on a node our view cannot place it


def test_a_single_feasible_node_is_assumed_by_filter_whatever_candidates_is() -> None:
    """The scheduler skips /prioritize when one node is feasible: /filter must assume,
    or the next pods of a burst are judged from a count that misses this one."""
    for candidates in (0, 1, 10):
        api, c, _ = make_api(candidates=candidates)
        body = json.dumps({"Pod": pod("p", 2), "NodeNames": ["a", "sick"]}).encode()
        _, res = call(api, "/filter", body)
        assert res["NodeNames"] == ["a"]
        assert c.states(["a"])["a"].gpus_free == 0, candidates  # type: ignore[union-attr]


def test_candidates_above_the_feasible_count_change_nothing() -> None:
    api, _, reg = make_api(candidates=5)
    _, res = call(
        api, "/filter", json.dumps({"Pod": pod("p", 2), "NodeNames": ["c", "b", "a"]}).encode()
    )
    assert res["NodeNames"] == ["c", "b", "a"]
    assert (
        reg.get_sample_value("gpudaemon_extender_filter_nodes_total", {"result": "outranked"}) == 0
    )


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"[]", "must be a JSON object"),
        (b'{"NodeNames": ["a"]}', "Pod must be an object"),
        (b'{"Pod": 3, "NodeNames": ["a"]}', "Pod must be an object"),
        (b'{"Pod": {}, "NodeNames": "a"}', "NodeNames must be a list of strings"),
        (b'{"Pod": {}, "NodeNames": [1]}', "NodeNames must be a list of strings"),
        (b'{"Pod": {}}', "needs NodeNames"),
        (b'{"Pod": {}, "Nodes": {"items": 3}}', "Items must be a list"),
        (b'{"Pod": {}, "Nodes": {"items": [{"metadata": {}}]}}', "metadata.name"),
        (
            b'{"Pod": {"spec": {"containers": [{"resources": {"requests": {"nvidia.com/gpu": "x"}}}]}}, "NodeNames": []}',
            "bad quantity",
        ),
        (b'{"Pod": {"spec": {"containers": "zz"}}, "NodeNames": []}', "malformed"),
        (
            b'{"Pod": {"spec": {"containers": [{"resources": {"requests": {"cpu": "1e400"}}}]}}, "NodeNames": []}',
            "bad quantity",
        ),
        (b'{"Pod": {"spec": 5}, "NodeNames": []}', "malformed"),
    ],
)
def test_bad_bodies_get_400_with_a_reason(body: bytes, reason: str) -> None:
    api, _, reg = make_api()
    for verb in ("/filter", "/prioritize"):
        status, res = call(api, verb, body)
        assert status.startswith("400"), (verb, res)
        assert reason in res["Error"]
    assert (
        reg.get_sample_value("gpudaemon_extender_requests_total", {"verb": "filter", "code": "400"})
        == 1
    )


def test_other_paths() -> None:
    api, _, _ = make_api()
    assert call(api, "/filter", method="GET")[0].startswith("405")
    assert call(api, "/healthz", method="GET") == ("200 OK", "ok\n")
    assert call(api, "/readyz", method="GET")[0].startswith("200")
    assert call(api, "/nope", method="GET")[0].startswith("404")
    status, text = call(api, "/metrics", method="GET")
    assert status.startswith("200") and "gpudaemon_extender_request_duration_seconds" in text


def test_concurrent_prioritize_never_assumes_past_capacity() -> None:
    """50 one-GPU pods ranked at once over 3 nodes: assumptions never exceed free GPUs."""
    api, c, _ = make_api()
    errors: list[str] = []

    def one(i: int) -> None:
        status, _res = call(
            api,
            "/prioritize",
            json.dumps({"Pod": pod(f"q{i}", 1), "NodeNames": ["a", "b", "c"]}).encode(),
        )
        if not status.startswith("200"):
            errors.append(status)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    states = c.states(["a", "b", "c"])
    # 2 + 6 + 8 = 16 free: the first 16 pods are assumed, the rest found nothing free
    assert all(s is not None and s.gpus_requested <= s.gpus_allocatable for s in states.values())
    assert sum(s.gpus_free for s in states.values() if s) == 0


def test_a_bug_answers_500_in_the_wire_format_and_logs_once(
    lines: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    api, _, reg = make_api()

    def broken(*_: Any) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(api.cluster, "states", broken)
    body = json.dumps({"Pod": pod("p", 1), "NodeNames": ["a"]}).encode()
    for _ in range(3):
        status, res = call(api, "/filter", body)
        assert status.startswith("500")
        assert res == {"Error": "gpudaemon extender: internal error in filter: KeyError"}
    assert (
        reg.get_sample_value("gpudaemon_extender_requests_total", {"verb": "filter", "code": "500"})
        == 3
    )
    errors = [m for level, m in lines if level == "ERROR"]
    assert len(errors) == 1 and "filter failed" in errors[0]
    # ... and the next good request is served as usual.
    monkeypatch.undo()
    status, _ = call(api, "/filter", body)
    assert status.startswith("200")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["bind", "unbind", "schedule"]),
            st.integers(0, 5),
            st.sampled_from([1, 2, 4, 8]),
            st.sampled_from(["fragmentation", "binpack", "spread"]),
        ),
        max_size=25,
    )
)
def test_memoized_answers_equal_scores_computed_afresh(
    ops: list[tuple[str, int, int, str]],
) -> None:
    """Whatever happens between requests (pods bound and gone, assumptions, the
    fragmentation tables relearned), /prioritize ranks exactly as scoring every node
    from scratch would, and /filter's candidates are the best of those."""
    wall = FakeClock()
    c = ClusterState("gpudaemon.io/", wall=wall)
    names = [f"n{i}" for i in range(6)]
    c.replace_nodes([node_obj(n, uid=n, util=[10 * i]) for i, n in enumerate(names)])
    c.replace_pods([])
    c.replace_leases([lease_obj(n, wall(), 300, owner_uid=n) for n in names])
    frag = Fragmentation(Workload(window=6, refresh_every=2))
    policies = {"fragmentation": frag, "binpack": BinPack(), "spread": Spread()}
    api = ExtenderApi(
        c, policies, "fragmentation", CollectorRegistry(), lambda: (True, "ok"),
        candidates=2,
    )  # fmt: skip
    bound: list[str] = []
    for k, (op, i, gpus, policy) in enumerate(ops):
        if op == "bind":
            bound.append(f"b{k}")
            c.pod_event("ADDED", pod_obj(f"b{k}", names[i], gpus))
        elif op == "unbind" and bound:
            c.pod_event("DELETED", pod_obj(bound.pop(i % len(bound)), "", gpus))
        elif op == "schedule":
            body = json.dumps({"Pod": pod(f"s{k}", gpus, policy), "NodeNames": names}).encode()
            shape = PodShape(gpus, 1000)
            frag.observe_pod(f"s{k}", shape)  # what /filter does first (a repeat is not counted)
            # afresh: every node that fits, scored directly on the current states
            raw = {
                n: policies[policy].raw_score(s, shape)
                for n, s in c.states(names).items()
                if s is not None and s.can_host(shape)
            }
            # The filter judges capacity by bound pods alone (assumptions only rank):
            # every node that passes, scored or not.
            feasible = [
                n for n, s in c.states(names).items() if check_node(s, shape, fresh=True) is None
            ]
            _, filtered = call(api, "/filter", body)
            if len(feasible) > 2 and raw:  # narrowed to the best two, best first
                keep = best_nodes(raw, 2)
                keep += [n for n in feasible if n not in raw][: 2 - len(keep)]
                assert filtered["NodeNames"] == keep
            else:  # nothing to narrow: every node that passes, in the scheduler's order
                assert set(filtered["NodeNames"]) == set(feasible)
            if len(filtered["NodeNames"]) < 2:
                continue  # the scheduler skips /prioritize (and /filter assumed the pod)
            _, scores = call(api, "/prioritize", body)
            assert {h["Host"]: h["Score"] for h in scores} == {
                n: to_levels(raw).get(n, 0) for n in names
            }


def test_until_the_caches_have_listed_verbs_answer_503_not_a_judgement() -> None:
    """Empty caches would filter every node out as "no agent data" and the scheduler
    would park the pod as unschedulable; an error makes it retry with backoff."""
    api, _, reg = make_api()
    api.ready = lambda: (False, "waiting for the first list of: pods")
    body = json.dumps({"Pod": pod("p", 1), "NodeNames": ["a"]}).encode()
    for verb in ("/filter", "/prioritize"):
        status, res = call(api, verb, body)
        assert status.startswith("503")
        assert res == {"Error": "gpudaemon extender not ready: waiting for the first list of: pods"}
    assert (
        reg.get_sample_value("gpudaemon_extender_requests_total", {"verb": "filter", "code": "503"})
        == 1
    )
    api.ready = lambda: (True, "ok")
    assert call(api, "/filter", body)[0].startswith("200")


def test_a_non_finite_score_leaves_the_node_unscored_not_a_500() -> None:
    class Broken(BinPack):
        def raw_score(self, node: Any, pod: Any) -> float:
            return float("nan") if node.name == "b" else super().raw_score(node, pod)

    api, _, _ = make_api()
    api.policies["binpack"] = Broken()
    body = json.dumps({"Pod": pod("p", 1), "NodeNames": ["a", "b", "c"]}).encode()
    status, res = call(api, "/prioritize", body)
    assert status.startswith("200")
    assert {h["Host"]: h["Score"] for h in res}["b"] == 0


def test_gpu_less_pods_pass_through_even_before_the_caches_have_listed() -> None:
    api, _, _ = make_api()
    api.ready = lambda: (False, "waiting")
    status, res = call(
        api, "/filter", json.dumps({"Pod": pod("p", 0), "NodeNames": NAMES}).encode()
    )
    assert status.startswith("200") and res["NodeNames"] == NAMES
    status, _ = call(api, "/filter", json.dumps({"Pod": pod("p", 1), "NodeNames": NAMES}).encode())
    assert status.startswith("503")
