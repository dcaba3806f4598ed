"""The agent's HTTP endpoints and self-metrics: /metrics content negotiation
(OpenMetrics, gzip), /healthz, /readyz against the staleness bound, the poll
histogram, error counter and build info, and that a scrape never touches the backend."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.agent.app import Agent
from gpudaemon.backends.simulated import FaultSpec, SimulatedBackend, load_profile
from gpudaemon.config import Config, load_config
from gpudaemon.errors import BackendError
from gpudaemon.labels.outputs import NullSink
from gpudaemon.model import GpuSample, NodeInventory
from tests.clock import FakeClock
from tests.support import http_get


class GuardedBackend:
    """A simulated backend that fails the test if it is touched while `armed`."""

    name = "simulated"

    def __init__(self, profile: str = "dgx-h100") -> None:
        self.inner = SimulatedBackend(load_profile(profile), seed=3)
        self.armed = False
        self.fail_sample = False
        self.touched_while_armed = 0

    def _check(self) -> None:
        if self.armed:
            self.touched_while_armed += 1
            raise AssertionError("backend called during a scrape")

    def inventory(self) -> NodeInventory:
        self._check()
        return self.inner.inventory()

    def sample(self) -> tuple[GpuSample, ...]:
        self._check()
        if self.fail_sample:
            raise BackendError("driver gone")
        return self.inner.sample()

    def energy(self) -> dict[int, float | None]:
        self._check()
        return self.inner.energy()

    def close(self) -> None:
        pass


def _cfg(**metrics: Any) -> Config:
    return load_config(
        environ={},
        overrides={
            "node_name": "node-a",
            "metrics": {"listen": "127.0.0.1:0", "pod_resources_socket": "", **metrics},
        },
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_000_000.0)


@pytest.fixture
def backend() -> GuardedBackend:
    return GuardedBackend()


@pytest.fixture
def agent(backend: GuardedBackend, clock: FakeClock) -> Iterator[Agent]:
    a = Agent(
        _cfg(stale_after_seconds=30),
        backend=backend,
        registry=CollectorRegistry(),
        label_sink=NullSink(),
        clock=clock,
    )
    yield a
    a.close()


@pytest.fixture
def url(agent: Agent) -> str:
    return f"http://127.0.0.1:{agent.start_http()}"


def test_healthz_answers_while_the_process_is_alive(url: str) -> None:
    assert http_get(url + "/healthz") == (200, b"ok\n")


def test_readyz_is_not_ready_before_the_first_poll(url: str) -> None:
    status, body = http_get(url + "/readyz")
    assert status == 503
    assert b"no telemetry poll" in body


def test_readyz_turns_ready_after_the_first_poll_and_not_ready_when_stale(
    agent: Agent, url: str, clock: FakeClock
) -> None:
    assert agent.poll_telemetry()
    assert http_get(url + "/readyz")[0] == 200
    clock.now += 29
    assert http_get(url + "/readyz")[0] == 200
    clock.now += 2  # 31 s > stale_after_seconds=30
    status, body = http_get(url + "/readyz")
    assert status == 503
    assert b"31s old" in body


def test_a_scrape_never_calls_the_backend(agent: Agent, url: str, backend: GuardedBackend) -> None:
    agent.run_once()
    backend.armed = True
    status, body = http_get(url + "/metrics")
    assert status == 200
    assert b"gpudaemon_gpu_power_watts{" in body
    assert backend.touched_while_armed == 0


def test_openmetrics_when_the_scraper_asks_for_it(agent: Agent, url: str) -> None:
    agent.run_once()
    status, body = http_get(url + "/metrics", headers={"Accept": "application/openmetrics-text"})
    assert status == 200
    assert body.endswith(b"# EOF\n")
    # OpenMetrics names the counter family without _total; the text format does not.
    assert b"# TYPE gpudaemon_gpu_energy_joules counter" in body
    plain = http_get(url + "/metrics")[1]
    assert b"# EOF" not in plain


def test_gzip_when_the_scraper_accepts_it(agent: Agent, url: str) -> None:
    agent.run_once()
    _, raw = http_get(url + "/metrics", headers={"Accept-Encoding": "gzip"})
    assert raw[:2] == b"\x1f\x8b"
    assert b"gpudaemon_gpu_healthy{" in gzip.decompress(raw)


def test_poll_duration_is_a_histogram_per_job(agent: Agent) -> None:
    agent.run_once()
    agent.poll_telemetry()
    reg = agent.registry
    get = reg.get_sample_value
    assert get("gpudaemon_poll_duration_seconds_count", {"task": "telemetry"}) == 2
    assert get("gpudaemon_poll_duration_seconds_count", {"task": "inventory"}) == 1
    assert get("gpudaemon_poll_duration_seconds_bucket", {"task": "telemetry", "le": "+Inf"}) == 2


def test_a_failed_poll_is_counted_and_keeps_the_last_good_readings(
    agent: Agent, backend: GuardedBackend
) -> None:
    agent.run_once()
    backend.fail_sample = True
    assert not agent.poll_telemetry()
    get = agent.registry.get_sample_value
    assert get("gpudaemon_poll_errors_total", {"task": "telemetry"}) == 1
    assert get("gpudaemon_poll_errors_total", {"task": "inventory"}) == 0
    labels = {"gpu": "0", "node": "node-a", "pod": "", "namespace": "", "container": ""}
    labels |= {"uuid": agent.cache.get().samples[0].uuid, "model": "NVIDIA H100 80GB HBM3"}
    assert get("gpudaemon_gpu_healthy", labels) == 1


def test_build_info_names_version_and_backend(agent: Agent) -> None:
    from gpudaemon import __version__

    labels = {"version": __version__, "backend": "simulated"}
    assert agent.registry.get_sample_value("gpudaemon_build_info", labels) == 1


def _families(text: bytes) -> dict[str, list[str]]:
    """Family -> sorted sample lines (order of families is not part of the format)."""
    out: dict[str, list[str]] = {}
    current = ""
    for line in text.decode().splitlines():
        if line.startswith("# HELP "):
            current = line.split()[2]
        out.setdefault(current, []).append(line)
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text"])
def test_the_cached_scrape_path_serves_what_prometheus_client_would(
    agent: Agent, url: str, accept: str
) -> None:
    from prometheus_client.exposition import choose_encoder

    agent.run_once()
    fast = http_get(url + "/metrics", headers={"Accept": accept})[1]
    encoder, _ = choose_encoder(accept)
    reference = encoder(agent.registry)
    assert _families(fast) == _families(reference)
    assert fast.count(b"# EOF") == (1 if accept else 0)


def test_a_new_poll_invalidates_the_cached_gpu_part(
    agent: Agent, url: str, backend: GuardedBackend
) -> None:
    agent.run_once()
    first = http_get(url + "/metrics")[1]
    assert http_get(url + "/metrics")[1] == first  # same snapshot, same bytes
    hits = []
    real = agent.gpu_collector.gpu_families
    agent.gpu_collector.gpu_families = lambda *a: hits.append(1) or real(*a)  # type: ignore[method-assign]
    http_get(url + "/metrics")
    assert hits == []  # served from the per-snapshot cache, nothing re-encoded
    backend.inner.inject(4, FaultSpec(kind="lost"))
    agent.poll_telemetry()
    after = http_get(url + "/metrics")[1].decode()
    lost = [ln for ln in after.splitlines() if ln.startswith("gpudaemon_gpu_lost{")]
    assert [ln.endswith(" 1.0") for ln in lost].count(True) == 1


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text"])
def test_name_filters_return_exactly_the_named_series_gpu_and_agent_alike(
    agent: Agent, url: str, accept: str
) -> None:
    """Issue 12, item 15: `?name[]=gpudaemon_gpu_power_watts` (docs/metrics.md) was empty,
    because prometheus-client finds collectors by describe() names and the GPU collector
    has none up front."""
    agent.run_once()
    full = http_get(url + "/metrics", headers={"Accept": accept})[1].decode().splitlines()
    names = [
        "gpudaemon_gpu_power_watts",
        "gpudaemon_gpu_energy_joules_total",
        "gpudaemon_build_info",
    ]
    query = "&".join(f"name[]={n}" for n in names)
    status, body = http_get(f"{url}/metrics?{query}", headers={"Accept": accept})
    got = body.decode().splitlines()
    samples = [ln for ln in got if not ln.startswith("#")]
    assert status == 200
    for n in names:
        expected = [ln for ln in full if ln.startswith(n + "{")]
        assert expected and [ln for ln in samples if ln.startswith(n + "{")] == expected
    assert all(ln.split("{")[0] in names for ln in samples)  # nothing else came along
    assert (got[-1] == "# EOF") == bool(accept)
    status, zipped = http_get(
        f"{url}/metrics?name[]=gpudaemon_gpu_power_watts", headers={"Accept-Encoding": "gzip"}
    )
    power = [ln for ln in full if ln.startswith("gpudaemon_gpu_power_watts{")]
    assert status == 200 and len(power) == 8
    assert [
        ln for ln in gzip.decompress(zipped).decode().splitlines() if not ln.startswith("#")
    ] == power
