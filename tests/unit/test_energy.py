"""The energy counter on its own schedule (issue 19): ~3.9 ms per GPU on an H100, so it
is read by the `energy` job (`schedules.energy`, default every 30 s, `none` = off), never
by the telemetry poll; `gpu_energy_joules_total` still rises monotonically. And the
simulator's per-call latency model charges what NVML would take, and no more."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.agent.app import Agent
from gpudaemon.agent.cache import Cache
from gpudaemon.backends.base import ENERGY_CALLS, GPM_CALLS, SAMPLE_CALLS
from gpudaemon.backends.simulated import SimulatedBackend, load_profile, parse_profile
from gpudaemon.backends.simulated import backend as simulated
from gpudaemon.config import load_config
from gpudaemon.errors import ConfigError, ProfileError
from gpudaemon.labels.outputs import NullSink
from tests.clock import FakeClock

SERIES = "gpudaemon_gpu_energy_joules_total"


def agent(clock: FakeClock, **schedules: str) -> tuple[Agent, CollectorRegistry]:
    cfg = load_config(
        environ={},
        overrides={
            "node_name": "n1",
            "metrics": {"pod_resources_socket": ""},
            "schedules": schedules,
        },
    )
    backend = SimulatedBackend(load_profile("dgx-h100"), seed=2, clock=clock)
    reg = CollectorRegistry()
    return Agent(cfg, backend=backend, registry=reg, label_sink=NullSink(), clock=clock), reg


def energy(reg: CollectorRegistry, gpu: int = 0) -> float | None:
    for fam in reg.collect():
        for s in fam.samples:
            if s.name == SERIES and s.labels["gpu"] == str(gpu):
                return s.value
    return None


def test_the_default_cadence_is_every_30_seconds_and_none_turns_it_off() -> None:
    clock = FakeClock()
    a, _ = agent(clock)
    assert a.cfg.schedules.energy == "*/30 * * * * *"
    assert a.jobs["energy"].cron == "*/30 * * * * *" and a.jobs["energy"].run == a.poller.energy
    off, _ = agent(clock, energy="none")
    assert "energy" not in off.jobs


def test_a_bad_energy_schedule_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"schedules\.energy"):
        load_config(environ={}, overrides={"schedules": {"energy": "every minute"}})


def test_telemetry_never_reads_energy_the_energy_job_does_and_the_counter_only_rises() -> None:
    clock = FakeClock()
    a, reg = agent(clock)
    calls = {"energy": 0}
    read = a.backend.energy

    def counted() -> dict[int, float | None]:
        calls["energy"] += 1
        return read()

    a.backend.energy = counted  # type: ignore[method-assign]
    assert a.poll_inventory() and a.poll_telemetry()
    assert energy(reg) is None and calls["energy"] == 0  # no read yet: absent, not 0
    seen = []
    for step in range(12):  # a minute of 5 s telemetry polls, the energy job every 30 s
        clock.t += 5
        assert a.poll_telemetry()
        if step % 6 == 5:
            assert a.run_job("energy")
        seen.append(energy(reg))
    assert calls["energy"] == 2
    # between energy reads the counter holds its value; each read moves it up
    assert seen[0] is None and seen[4] is None and seen[5] is not None
    assert seen[5] == seen[10] < seen[11]
    values = [v for v in seen if v is not None]
    assert values == sorted(values)


def test_a_failed_read_keeps_the_last_value_so_the_counter_never_goes_back() -> None:
    cache = Cache(FakeClock())
    b = SimulatedBackend(load_profile("dgx-h100"), seed=1)
    cache.put_inventory(b.inventory())
    cache.put_samples(b.sample())
    cache.put_energy({0: 100.0, 1: 50.0})
    snap = cache.put_energy({0: None, 1: 60.0})
    assert [s.energy_joules_total for s in snap.samples[:2]] == [100.0, 60.0]
    snap = cache.put_samples(b.sample())  # new samples carry the newest reads
    assert [s.energy_joules_total for s in snap.samples[:2]] == [100.0, 60.0]


def test_the_simulator_charges_the_calls_the_nvml_backend_makes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spent: list[float] = []
    monkeypatch.setattr(simulated, "_spend", lambda s, start=None: spent.append(s))
    p = load_profile("h100-measured")
    latency = p.gpus[0].nvml_latency_us
    b = SimulatedBackend(p, seed=1)
    b.sample()
    b.energy()
    per_sample = sum(latency[c] for c in SAMPLE_CALLS) / 1e6
    per_gpm = sum(latency[c] for c in GPM_CALLS) / 1e6  # issue 33: H100s have GPM
    per_energy = sum(latency[c] for c in ENERGY_CALLS) / 1e6
    overhead = p.gpus[0].sample_overhead_us / 1e6  # the real backend's own work
    assert spent == [
        pytest.approx(8 * (per_sample + per_gpm + overhead)),
        pytest.approx(8 * per_energy),
    ]
    assert per_gpm == pytest.approx(37.9e-6)  # measured on an H100, 2026-11-26
    # the measured means: a sample is ~35 us of NVML per GPU (+2.8 us measured for the
    # health calls of issue 30), the energy read ~3.9 ms
    assert 35e-6 < per_sample < 40e-6 and per_energy == pytest.approx(3.93e-3)
    b.health_counters()  # the health fields and 18 links x 4 NVLink counters
    per_health = (
        latency["nvmlDeviceGetFieldValues(health)"]
        + 72 * latency["nvmlDeviceGetNvLinkErrorCounter"]
    ) / 1e6
    assert spent[-1] == pytest.approx(8 * per_health)


def test_a_free_simulator_spends_nothing_and_a_lost_gpu_costs_nothing() -> None:
    b = SimulatedBackend(load_profile("dgx-h100"), seed=1)
    assert all(g.sample_cost_s == 0.0 == g.energy_cost_s for g in b._gpus)
    spent: list[float] = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(simulated, "_spend", lambda s, start=None: spent.append(s))
        lossy = parse_profile(
            "gpus: [{name: X, memory_total_mib: 1, compute_capability: '9.0', count: 2,"
            " nvml_latency_us: {nvmlDeviceGetPowerUsage: 100}}]\n"
            "faults: [{kind: lost, gpu: 1}]"
        )
        b = SimulatedBackend(lossy, seed=1)
        b.sample()
    assert spent == [pytest.approx(100e-6)]  # GPU 1 is lost: NVML answers at once


def test_a_latency_profile_naming_an_unknown_call_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ProfileError) as e:
        parse_profile(
            "gpus: [{name: X, memory_total_mib: 1, compute_capability: '9.0',"
            " nvml_latency_us: {nvmlDeviceGetPowr: 3}}]"
        )
    assert "nvmlDeviceGetPowr" in str(e.value) and "nvmlDeviceGetPowerUsage" in str(e.value)
