"""Only real pods get GPUs booked (issue 17): a pod must exist in the API, be unbound,
name our scheduler, and its requests come from the API, not the body. A flood of
invented UIDs stays bounded in memory and in API lookups."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gpudaemon.errors import KubeNotFoundError, KubeUnavailableError
from gpudaemon.extender.pods import PendingPods, PodVerifier
from tests.clock import FakeClock
from tests.unit.extender.test_api import call, make_api
from tests.unit.extender.test_cluster import pod_obj

SCHED = "gpudaemon-scheduler"


def ours(uid: str, gpus: int = 1, node: str = "") -> dict[str, Any]:
    p = pod_obj(uid, node, gpus)
    p["spec"]["schedulerName"] = SCHED
    return p


class Api:
    """The verifier's single GET, scripted: pods by (namespace, name)."""

    def __init__(self, *pods: dict[str, Any]) -> None:
        self.pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        self.gets = 0
        self.down = False

    def __call__(self, ns: str, name: str) -> dict[str, Any]:
        self.gets += 1
        if self.down:
            raise KubeUnavailableError("connection refused")
        if (ns, name) not in self.pods:
            raise KubeNotFoundError(f"pods {name} not found", 404)
        return self.pods[(ns, name)]


def verifier(api: Api, **kw: Any) -> tuple[PodVerifier, PendingPods, FakeClock]:
    clock = FakeClock()
    pending = PendingPods("gpudaemon.io/gpu.product")
    return PodVerifier(pending, api, SCHED, clock=clock, **kw), pending, clock


def test_a_pod_in_the_pending_cache_is_real_with_the_api_s_requests() -> None:
    v, pending, _ = verifier(Api())
    pending.replace([ours("p1", gpus=2)])
    body = ours("p1", gpus=8)  # the body lies about the requests
    pod, why = v.verify(body)
    assert why == "" and pod is not None and pod.shape.gpus == 2


@pytest.mark.parametrize(
    ("in_api", "body", "reason"),
    [
        (None, ours("ghost"), "unknown_pod"),
        (
            ours("other-uid"),
            {**ours("x"), "metadata": {**ours("x")["metadata"], "name": "other-uid"}},
            "unknown_pod",
        ),
        (ours("p", node="n1"), ours("p"), "bound"),
        (pod_obj("p"), ours("p"), "other_scheduler"),
        (None, {"metadata": {"name": "p", "namespace": "default"}}, "no_uid"),
        (
            None,
            {"metadata": {"uid": "u", "name": "../../nodes/x", "namespace": "default"}},
            "unknown_pod",
        ),
    ],
)
def test_what_is_not_a_real_pending_pod_of_ours(
    in_api: dict[str, Any] | None, body: dict[str, Any], reason: str
) -> None:
    api = Api(*([in_api] if in_api else []))
    v, _, _ = verifier(api)
    assert v.verify(body) == (None, reason)


def test_a_pod_the_watch_has_not_delivered_is_looked_up_once() -> None:
    api = Api(ours("p1"))
    v, pending, _ = verifier(api)
    assert v.verify(ours("p1"))[0] is not None
    assert v.verify(ours("p1"))[0] is not None
    assert api.gets == 1 and pending.get("p1") is not None


def test_an_invented_uid_is_remembered_and_not_looked_up_again() -> None:
    api = Api()
    v, _, clock = verifier(api)
    for _ in range(5):
        assert v.verify(ours("ghost")) == (None, "unknown_pod")
    assert api.gets == 1
    clock.t += 61  # the negative entry expires
    v.verify(ours("ghost"))
    assert api.gets == 2


def test_a_flood_of_invented_uids_is_bounded_in_lookups_and_memory() -> None:
    api = Api()
    v, _, clock = verifier(api, lookups_per_second=20, negative_size=100)
    reasons = [v.verify(ours(f"ghost-{i}"))[1] for i in range(1000)]
    assert api.gets == 20  # the burst; no time has passed
    assert reasons.count("rate_limited") == 980
    clock.t += 1.0
    reasons = [v.verify(ours(f"more-{i}"))[1] for i in range(1000)]
    assert api.gets == 40
    assert v.negative_size_now() <= 100


def test_an_api_error_books_nothing_and_is_not_remembered() -> None:
    api = Api(ours("p1"))
    api.down = True
    v, _, _ = verifier(api)
    assert v.verify(ours("p1")) == (None, "api_error")
    api.down = False
    assert v.verify(ours("p1"))[0] is not None


def args(pod: dict[str, Any], names: list[str]) -> bytes:
    return orjson.dumps({"Pod": pod, "NodeNames": names})


def test_the_api_books_and_learns_only_for_verified_pods() -> None:
    api_calls = Api(ours("real"))
    learned: list[str] = []
    pending = PendingPods("gpudaemon.io/gpu.product")
    v = PodVerifier(pending, api_calls, SCHED)
    ext, cluster, reg = make_api(verifier=v, observe=lambda uid, shape: learned.append(uid))
    names = ["a", "b", "c"]
    for uid in ("ghost-1", "ghost-2"):
        code, _ = call(ext, "/filter", args(ours(uid), names))
        assert code.startswith("200")
        code, _ = call(ext, "/prioritize", args(ours(uid), names))
        assert code.startswith("200")
    assert cluster.sizes()["assumed"] == 0 and learned == []
    v_unknown = reg.get_sample_value(
        "gpudaemon_extender_unverified_pods_total", {"reason": "unknown_pod"}
    )
    assert v_unknown == 4
    call(ext, "/filter", args(ours("real"), names))
    call(ext, "/prioritize", args(ours("real"), names))
    assert cluster.sizes()["assumed"] == 1 and learned == ["real"]
