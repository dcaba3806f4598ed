"""NodeLabelSink logic against a fake client: write-on-change, drift repair, backoff, Lease.

The real API server proves the wire behaviour (tests/integration/kube/); these pin the
decisions (when to read, when to write, when to wait) with an injected clock.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.agent.metrics.selfmetrics import AgentMetrics
from gpudaemon.agent.nodelabels import NodeLabelSink, in_sync
from gpudaemon.config import load_config
from gpudaemon.errors import (
    KubeConflictError,
    KubeError,
    KubeForbiddenError,
    KubeGoneError,
    KubeInvalidError,
    KubeNotFoundError,
    KubeUnavailableError,
    SinkError,
)
from gpudaemon.kube import client as kube
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.lease import lease_is_fresh, micro_time, renew_cron
from gpudaemon.labels import Labels, LabelSet
from tests.clock import FakeClock

P = "gpudaemon.io/"


class FakeClient:
    """Holds one Node like the API server would, with SSA ownership for one manager."""

    def __init__(self) -> None:
        self.labels: dict[str, str] = {"team": "ml"}
        self.annotations: dict[str, str] = {}
        self.owned: tuple[set[str], set[str]] = (set(), set())
        self.calls: list[str] = []
        self.fail: KubeError | None = None
        self.leases: list[dict[str, Any]] = []
        self.conditions: dict[str, dict[str, Any]] = {}  # by type
        self.taints: list[dict[str, Any]] = []
        self.rv = 1

    def _check(self, call: str) -> None:
        self.calls.append(call)
        if self.fail:
            raise self.fail

    def get_node(self, name: str, cached: bool = False) -> dict[str, Any]:
        self._check("uid" if cached else "get")  # cached: the per-reconcile UID check
        fields = {
            "f:metadata": {
                "f:labels": {f"f:{k}": {} for k in self.owned[0]},
                "f:annotations": {f"f:{k}": {} for k in self.owned[1]},
            }
        }
        mf = [{"manager": "gpudaemon", "operation": "Apply", "fieldsV1": fields}]
        return {
            "metadata": {
                "name": name,
                "uid": "u-1",
                "resourceVersion": str(self.rv),
                "labels": dict(self.labels),
                "annotations": dict(self.annotations),
                "managedFields": mf,
            },
            "spec": {"taints": [dict(t) for t in self.taints]},
            "status": {"conditions": [dict(c) for c in self.conditions.values()]},
        }

    def patch_node(self, name: str, patch: dict[str, Any], status: bool = False) -> Any:
        self._check("condition")
        for c in patch["status"]["conditions"]:
            self.conditions[c["type"]] = {**self.conditions.get(c["type"], {}), **c}
        self.rv += 1
        return {}

    def json_patch_node(self, name: str, ops: list[dict[str, Any]]) -> Any:
        self._check("taint")
        assert ops[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": str(self.rv)}
        self.taints = list(ops[1]["value"])
        self.rv += 1
        return {}

    def apply_node(self, name: str, labels: dict[str, str], ann: dict[str, str]) -> Any:
        self._check("apply")
        for k in self.owned[0] - set(labels):
            self.labels.pop(k, None)
        for k in self.owned[1] - set(ann):
            self.annotations.pop(k, None)
        self.labels.update(labels)
        self.annotations.update(ann)
        self.owned = (set(labels), set(ann))
        return {"metadata": {"uid": "u-1"}}

    def apply_lease(self, ns: str, name: str, spec: Any, owner: Any = None) -> Any:
        self._check("lease")
        self.leases.append({"ns": ns, "name": name, "spec": spec, "owner": owner})
        return {}

    def close(self) -> None:
        pass


def make(
    cap: float = 60.0, resync: float = 600.0
) -> tuple[NodeLabelSink, FakeClient, FakeClock, Any]:
    cfg = load_config(
        environ={},
        overrides={
            "node_name": "n1",
            "kubernetes": {"backoff_max_seconds": cap, "resync_seconds": resync},
        },
    )
    reg = CollectorRegistry()
    fake, clock = FakeClient(), FakeClock()
    sink = NodeLabelSink(
        cfg.kubernetes,
        cfg.node_name,
        None,
        AgentMetrics(reg),
        client=fake,  # type: ignore[arg-type]
        clock=clock,
        rng=lambda: 1.0,
    )
    return sink, fake, clock, reg


def ls(count: int = 8, **extra: object) -> LabelSet:
    return LabelSet(Labels(P, {"gpu.count": count, **extra}), {P + "gpus": f"[{count}]"})


def writes(reg: CollectorRegistry, result: str) -> float:
    v = reg.get_sample_value("gpudaemon_node_writes_total", {"result": result})
    return v or 0.0


def test_first_apply_reads_then_writes_and_repeat_sends_nothing() -> None:
    sink, fake, clock, reg = make()
    assert sink.apply(ls()) is True
    # The first write also renews the Lease and writes the GPUHealthy condition (issue 17).
    # fresh-since follows the Lease, so the scheduler retries pods turned away as stale.
    assert fake.calls == ["get", "apply", "lease", "apply", "condition"]
    assert fake.labels == {"team": "ml", P + "gpu.count": "8"}
    for _ in range(20):
        clock.t += 30
        assert sink.apply(ls()) is False
    # 20 x 30 s reaches the 600 s resync: one read, no write; before it, no read at all
    # (a re-created Node is the heartbeat's to notice, with its one read per renewal).
    assert fake.calls == ["get", "apply", "lease", "apply", "condition", "get"]
    assert writes(reg, "success") == 2 and writes(reg, "unchanged") == 20  # + fresh-since
    assert reg.get_sample_value("gpudaemon_last_reconcile_timestamp_seconds") == clock.t


def test_steady_state_reads_the_node_at_most_once_per_lease_renewal() -> None:
    """An hour at the default cadence (kube-retry every second, labels every 30 s, the
    Lease every 120 s of its 360 s): the heartbeat's read is the only Node read, 0.5 a
    node-minute, and it stands in for the 600 s resync (issue 19: was 2.6)."""
    sink, fake, clock, _ = make()
    sink.apply(ls())
    sink.heartbeat()
    fake.calls.clear()
    for second in range(1, 3601):
        clock.t += 1
        sink.retry()
        if second % 30 == 0:
            assert sink.apply(ls()) is False
        if second % 120 == 0:
            assert sink.heartbeat() is True
    reads = fake.calls.count("get") + fake.calls.count("uid")
    assert reads == 30 and reads / 60 <= 0.5
    assert "apply" not in fake.calls  # and not one write to the Node


def test_labels_edited_under_us_are_noticed_by_the_heartbeat_and_written_again() -> None:
    sink, fake, clock, _ = make()
    sink.apply(ls())
    sink.heartbeat()
    fake.labels[P + "gpu.count"] = "1"  # someone's kubectl label --overwrite
    clock.t += 120
    assert sink.heartbeat() is True  # same Node, fresh data: still renewed
    assert fake.labels[P + "gpu.count"] == "1"
    clock.t += 1
    assert sink.retry() is True  # kube-retry, a second later
    assert fake.labels[P + "gpu.count"] == "8"


def test_restarted_agent_rewrites_only_its_fresh_since_annotation() -> None:
    sink, fake, _, _ = make()
    sink.apply(ls())
    labels = dict(fake.labels)
    again, _, _, _ = make()
    again.client = fake
    fake.calls.clear()
    # The labels are right; the one write is `fresh-since`, after the Lease (issue 17).
    again.apply(ls())
    assert fake.calls == ["get", "apply"]
    assert fake.labels == labels and P + "fresh-since" in fake.annotations


def test_a_changed_fact_is_written_and_a_dropped_key_removed() -> None:
    sink, fake, clock, _ = make()
    sink.apply(ls(**{"gpu.mixed": True}))
    clock.t += 30
    assert sink.apply(ls()) is True
    assert fake.calls[-1] == "apply"
    assert P + "gpu.mixed" not in fake.labels and fake.labels["team"] == "ml"


def test_resync_repairs_drift_and_otherwise_only_reads() -> None:
    sink, fake, clock, _ = make(resync=600)
    sink.apply(ls())
    clock.t += 601
    assert sink.apply(ls()) is False
    assert fake.calls[-1] == "get"
    del fake.labels[P + "gpu.count"]  # someone removed our label
    clock.t += 601
    assert sink.apply(ls()) is True
    assert fake.labels[P + "gpu.count"] == "8"


@pytest.mark.parametrize(
    "status,err",
    [
        (401, KubeForbiddenError),
        (403, KubeForbiddenError),
        (404, KubeNotFoundError),
        (409, KubeConflictError),
        (410, KubeGoneError),
        (400, KubeInvalidError),
        (422, KubeInvalidError),
        (429, KubeUnavailableError),
        (503, KubeUnavailableError),
    ],
)
def test_http_status_maps_to_our_error_with_the_servers_message(status: int, err: type) -> None:
    e = kube.error_for(status, "PATCH", "/api/v1/nodes/n1", b'{"message": "nope"}')
    assert type(e) is err and e.status == status and "nope" in str(e)


def test_api_error_arms_backoff_and_retry_converges_after_recovery() -> None:
    sink, fake, clock, reg = make(cap=8)
    fake.fail = KubeUnavailableError("connection refused")
    delays = []
    with pytest.raises(KubeUnavailableError, match=r"retry in 1\.0s"):
        sink.apply(ls())
    for _ in range(6):  # retries come only when due, and the delay doubles to the cap
        before = len(fake.calls)
        clock.t += 0.5
        sink.retry()
        assert len(fake.calls) == before
        delays.append(sink._retry_at - clock.t + 0.5)
        clock.t = sink._retry_at
        with pytest.raises(KubeUnavailableError, match="labels not written"):
            sink.retry()  # due: one request, failed, raised for the job wrapper to count
        assert len(fake.calls) == before + 1
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert writes(reg, "error") == 7
    fake.fail = None
    clock.t = sink._retry_at
    assert sink.retry() is True
    assert fake.labels[P + "gpu.count"] == "8"
    assert sink.backoff.failures == 0


def test_apply_during_backoff_is_skipped_without_a_request() -> None:
    sink, fake, clock, _ = make()
    fake.fail = KubeUnavailableError("down")
    with pytest.raises(KubeError):
        sink.apply(ls())
    n = len(fake.calls)
    clock.t += 0.1
    assert sink.apply(ls()) is False
    assert len(fake.calls) == n


def test_unsanitised_labels_are_refused() -> None:
    sink, _, _, _ = make()
    with pytest.raises(SinkError):
        sink.apply(LabelSet({P + "x": "a b"}))  # type: ignore[arg-type]


def test_backoff_jitter_stays_between_half_and_full_delay_under_the_cap() -> None:
    for r in (0.0, 0.5, 0.999):
        b = Backoff(1.0, 60.0, rng=lambda r=r: r)  # type: ignore[misc]
        ds = [b.next_delay() for _ in range(12)]
        full = [min(60.0, 2.0**i) for i in range(12)]
        assert all(f / 2 <= d <= f for d, f in zip(ds, full, strict=True))


def test_lease_is_renewed_only_when_labels_are_current_and_data_fresh() -> None:
    sink, fake, clock, _ = make()
    assert sink.heartbeat() is False  # nothing applied yet
    sink.apply(ls())
    fresh = [False]
    sink.set_freshness(lambda: fresh[0])
    assert sink.heartbeat() is False
    fresh[0] = True
    assert sink.heartbeat() is True
    lease = fake.leases[-1]
    assert lease["ns"] == "gpudaemon" and lease["name"] == "n1"
    assert lease["spec"]["leaseDurationSeconds"] == 360
    assert lease["spec"]["renewTime"] == micro_time(clock.t)
    assert lease["owner"]["uid"] == "u-1"
    fake.fail = KubeUnavailableError("down")
    with pytest.raises(KubeUnavailableError, match="node n1: lease not renewed: down"):
        sink.heartbeat()


def test_in_sync_requires_our_ownership_of_exactly_the_desired_keys() -> None:
    node = {
        "metadata": {
            "labels": {P + "a": "1", P + "b": "2"},
            "annotations": {},
            "managedFields": [
                {
                    "manager": "gpudaemon",
                    "operation": "Apply",
                    "fieldsV1": {"f:metadata": {"f:labels": {f"f:{P}a": {}, f"f:{P}b": {}}}},
                }
            ],
        }
    }
    assert in_sync(node, {"labels": {P + "a": "1", P + "b": "2"}, "annotations": {}})
    assert not in_sync(node, {"labels": {P + "a": "1"}, "annotations": {}})  # b must go
    assert not in_sync(node, {"labels": {P + "a": "1", P + "b": "3"}, "annotations": {}})


@pytest.mark.parametrize(
    "duration,cron",
    [
        (40, "*/12 * * * * *"),
        (10, "*/3 * * * * *"),
        (360, "0 */2 * * * *"),
        (14400, "0 0 */1 * * *"),
    ],
)
def test_lease_renews_about_every_third_of_its_duration(duration: int, cron: str) -> None:
    assert renew_cron(duration) == cron


def test_every_accepted_lease_duration_gives_a_valid_renew_schedule() -> None:
    from gpudaemon.kube.lease import renew_period_s
    from gpudaemon.schedule import parse_cron

    for duration in [*range(10, 4000), 14400, 86399, 86400]:
        period = renew_period_s(duration)
        assert 1 <= period <= max(1, duration // 3)
        parse_cron(renew_cron(duration))  # raises CronError if invalid


def test_bad_kubeconfig_is_one_config_error(tmp_path: Any) -> None:
    from gpudaemon.errors import ConfigError

    bad = tmp_path / "kc"
    bad.write_text("not: [a kubeconfig")
    with pytest.raises(ConfigError, match="kubeconfig"):
        kube.KubeClient.from_credentials(kube.Credentials(False, str(bad)))


def test_a_hung_api_server_gives_an_unavailable_error_not_a_hang(tmp_path: Any) -> None:
    """A server that accepts the connection and never answers (black hole)."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    kc = tmp_path / "kc"
    kc.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:{srv.getsockname()[1]}',"
        " insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    # Both timeouts injected short: the claim is "an error, not a hang", not a duration.
    client = kube.KubeClient.from_credentials(
        kube.Credentials(False, str(kc)), timeout_s=0.2, connect_timeout_s=0.2
    )
    try:
        with pytest.raises(
            KubeUnavailableError, match=r"GET https://127\.0\.0\.1:\d+/api/v1/nodes/n1: timed out"
        ):
            client.get_node("n1")
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()
        client.close()


# -- the Lease freshness rule (the extender reads nodes by it) -------------------------


def _lease(renew: str | None, duration: object = 40) -> dict[str, Any]:
    spec: dict[str, Any] = {"leaseDurationSeconds": duration}
    if renew is not None:
        spec["renewTime"] = renew
    return {"spec": spec}


@pytest.mark.parametrize(
    "lease,fresh",
    [
        (_lease("2026-01-01T00:00:00.000000Z"), True),  # just renewed
        (_lease("2025-12-31T23:59:20.000001Z"), True),  # just inside
        (_lease("2025-12-31T23:59:20.000000Z"), False),  # exactly expired
        (_lease("2025-12-31T23:00:00.000000Z"), False),
        (_lease("2026-01-01T00:00:00Z", duration="40"), False),  # malformed duration
        (_lease("2026-01-01T00:00:00Z", duration=True), False),
        (_lease(None), False),
        (_lease("yesterday"), False),
        ({}, False),
        (None, False),
    ],
)
def test_lease_is_fresh_until_renew_time_plus_duration(lease: Any, fresh: bool) -> None:
    now = datetime(2026, 1, 1, 0, 0, 0, tzinfo=UTC)
    assert lease_is_fresh(lease, now) is fresh


def test_lease_rule_reads_what_the_renewer_writes() -> None:
    sink, fake, clock, _ = make()
    sink.apply(ls())
    assert sink.heartbeat()
    written = {"spec": fake.leases[-1]["spec"]}
    at = datetime.fromtimestamp(clock.t, UTC)
    assert lease_is_fresh(written, at + timedelta(seconds=359.9))
    assert not lease_is_fresh(written, at + timedelta(seconds=360))
    assert lease_is_fresh(written, (at + timedelta(seconds=1)).replace(tzinfo=None))  # naive=UTC


# -- watch: the stream a watch-based reader builds on -----------------------------------


class _WatchServer:
    """Answers every GET with `status` and the given newline-delimited events, sent as
    chunks that split events mid-line, then closes (as the API server does at
    timeoutSeconds). Records the query it got."""

    def __init__(self, tmp_path: Any, status: int, events: list[dict[str, Any] | str]) -> None:
        import http.server
        import threading

        body = b"".join((e if isinstance(e, str) else json.dumps(e)).encode() + b"\n"
                        for e in events)  # fmt: skip
        self.queries: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                outer.queries.append(self.path)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(0, len(body), 7):
                    part = body[i : i + 7]
                    self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args: Any) -> None:
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()
        kc = tmp_path / "kc"
        kc.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
            f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{self.srv.server_port}'}}}}]\n"
            "users: [{name: u, user: {token: t}}]\n"
            "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        )
        self.client = kube.KubeClient.from_credentials(kube.Credentials(False, str(kc)))

    def close(self) -> None:
        self.client.close()
        self.srv.shutdown()
        self.srv.server_close()


def test_watch_yields_events_across_chunk_boundaries(tmp_path: Any) -> None:
    node = {"metadata": {"name": "n1", "resourceVersion": "12"}}
    srv = _WatchServer(
        tmp_path,
        200,
        [
            {"type": "ADDED", "object": node},
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "13"}}},
            {"type": "DELETED", "object": node},
        ],
    )
    try:
        got = list(srv.client.watch("/api/v1/nodes", "11", timeout_s=5))
    finally:
        srv.close()
    assert [t for t, _ in got] == ["ADDED", "BOOKMARK", "DELETED"]
    assert got[0][1] == node
    q = srv.queries[0]
    assert "watch=true" in q and "resourceVersion=11" in q and "timeoutSeconds=5" in q


def test_watch_raises_gone_on_an_expired_version_event(tmp_path: Any) -> None:
    too_old = {"kind": "Status", "code": 410, "message": "too old resource version: 1 (5)"}
    srv = _WatchServer(
        tmp_path, 200, [{"type": "ADDED", "object": {}}, {"type": "ERROR", "object": too_old}]
    )
    try:
        events = srv.client.watch("/api/v1/nodes", "1", timeout_s=5)
        assert next(events)[0] == "ADDED"
        with pytest.raises(KubeGoneError, match="too old resource version"):
            next(events)
    finally:
        srv.close()


def test_watch_raises_gone_on_http_410(tmp_path: Any) -> None:
    srv = _WatchServer(tmp_path, 410, [{"message": "gone"}])
    try:
        with pytest.raises(KubeGoneError, match="WATCH /api/v1/nodes: HTTP 410: gone"):
            list(srv.client.watch("/api/v1/nodes", "1", timeout_s=5))
    finally:
        srv.close()


@pytest.mark.parametrize(
    ("message", "err"),
    [
        ('nodes "n1" is forbidden: User "a" cannot create resource "nodes"', KubeNotFoundError),
        ('nodes "n1" is forbidden: User "a" cannot patch resource "nodes"', KubeForbiddenError),
    ],
)
def test_apply_to_a_missing_node_says_not_found_not_forbidden(message: str, err: type) -> None:
    """Server-side apply to a deleted Node is a create; RBAC refuses it with 403, but
    what the operator must hear is that the Node is gone."""
    client = kube.KubeClient.__new__(kube.KubeClient)

    def refuse(path: str, body: Any) -> Any:
        raise KubeForbiddenError(f"PATCH {path}: HTTP 403: {message}", 403)

    client.apply = refuse  # type: ignore[method-assign]
    with pytest.raises(err) as got:
        client.apply_node("n1", {}, {})
    assert type(got.value) is err
    assert ('nodes "n1" not found' in str(got.value)) == (err is KubeNotFoundError)
