"""The model-aware fragmentation policy never places a pod on a GPU model it does not
accept: hypothesis draws clusters of mixed models and sequences of pinned and flexible
pods. Each pod goes through the extender's /filter and /prioritize as kube-scheduler
calls them (its NodeAffinity filter first), to the node they rank first, which is then
bound; and the policy, handed every node, scores each node of a model the pod does not
accept below every node of a model it does accept that can host it."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.podspec import pod_shape
from gpudaemon.config import load_config
from gpudaemon.extender.api import ExtenderApi
from gpudaemon.extender.app import make_policies
from tests.clock import FakeClock
from tests.unit.extender.test_api import call
from tests.unit.extender.test_cluster import lease_obj, node_obj, pod_obj

P = "gpudaemon.io/"
PRODUCT = P + "gpu.product"
MODELS = ["Tesla-T4", "Tesla-V100", "G2"]

model_sets = st.one_of(st.none(), st.sets(st.sampled_from(MODELS), min_size=1, max_size=2))
pods = st.lists(st.tuples(st.integers(1, 4), model_sets), min_size=1, max_size=25)
nodes = st.lists(
    st.tuples(st.sampled_from(MODELS), st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=8
)


def model_node(name: str, model: str, gpus: int) -> dict[str, Any]:
    obj = node_obj(name, gpus=gpus, uid=name)
    obj["metadata"]["labels"][PRODUCT] = model
    return obj


def pinned_pod(uid: str, gpus: int, models: set[str] | None) -> dict[str, Any]:
    p = pod_obj(uid, "", gpus)
    if models is not None:
        term = {"matchExpressions": [{"key": PRODUCT, "operator": "In", "values": sorted(models)}]}
        p["spec"]["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [term]}}
        }  # fmt: skip
    return p


@settings(max_examples=150, deadline=None)
@given(cluster=nodes, arrivals=pods, window=st.integers(1, 50))
def test_no_pod_is_placed_on_a_gpu_model_it_does_not_accept(
    cluster: list[tuple[str, int]], arrivals: list[tuple[int, set[str] | None]], window: int
) -> None:
    cfg = load_config(
        None,
        environ={},
        overrides={"extender": {"policy": "fragmentation-model", "workload_window": window}},
    )
    wall = FakeClock()
    state = ClusterState(P, wall=wall)
    model_of = {f"n{i}": m for i, (m, _) in enumerate(cluster)}
    state.replace_nodes([model_node(f"n{i}", m, g) for i, (m, g) in enumerate(cluster)])
    state.replace_pods([])
    state.replace_leases([lease_obj(n, wall(), 300, owner_uid=n) for n in model_of])
    api = ExtenderApi(
        state, make_policies(cfg), "fragmentation-model", CollectorRegistry(), lambda: (True, "ok")
    )
    policy = api.framework.policies["fragmentation-model"]
    for i, (gpus, models) in enumerate(arrivals):
        p = pinned_pod(f"p{i}", gpus, models)
        shape = pod_shape(p, PRODUCT)
        states = state.states(list(model_of))
        accepted = [s for s in states.values() if s is not None and s.can_host(shape)]
        others = [s for s in states.values() if s is not None and not shape.fits_model(s.gpu_model)]
        policy.observe_pod(f"p{i}", shape)
        if accepted:
            lowest = min(policy.raw_score(s, shape) for s in accepted)
            assert all(policy.raw_score(s, shape) < lowest for s in others)
        # kube-scheduler's NodeAffinity filter runs before the extender is called.
        names = [n for n, m in model_of.items() if models is None or m in models]
        code, res = call(api, "/filter", json.dumps({"Pod": p, "NodeNames": names}).encode())
        assert code.startswith("200"), res
        passed = res["NodeNames"] or []
        if not passed:
            assert not accepted
            continue
        code, res = call(api, "/prioritize", json.dumps({"Pod": p, "NodeNames": passed}).encode())
        assert code.startswith("200"), res
        best = max(res, key=lambda r: (r["Score"], r["Host"]))["Host"]
        assert models is None or model_of[best] in models
        state.pod_event("ADDED", pod_obj(f"p{i}", best, gpus))  # the binding, as watched
