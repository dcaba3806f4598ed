"""The GPU collector: names, units and labels of every per-GPU series, absent
readings, pod labels and MIG instances, read from a Snapshot in the cache."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.agent.cache import Cache
from gpudaemon.agent.metrics.collector import GpuCollector, ReadingAgeCollector
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.model import (
    MIB,
    GpmReading,
    GpuInfo,
    GpuSample,
    MigDevice,
    MigSample,
    NodeInventory,
    PodMap,
    PodRef,
)

NODE = "node-a"
H100 = "NVIDIA H100 80GB HBM3"


def _gpu(index: int, **kw: object) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=f"GPU-{index}",
        name=H100,
        memory_total_bytes=81559 * MIB,
        compute_capability=(9, 0),
        pci_bus_id=f"00000000:{index:02X}:00.0",
        **kw,  # type: ignore[arg-type]
    )


def _registry(
    gpus: tuple[GpuInfo, ...],
    samples: tuple[GpuSample, ...],
    pods: PodMap | None = None,
    now: float = 1000.0,
) -> CollectorRegistry:
    t = [now - 3.0]
    cache = Cache(clock=lambda: t[0])
    cache.put_inventory(NodeInventory("550.54.15", (12, 4), gpus, backend="simulated"))
    cache.put_samples(samples)
    reg = CollectorRegistry()
    reg.register(GpuCollector(cache, NODE, pods=(lambda: pods) if pods else None))
    reg.register(ReadingAgeCollector(cache, clock=lambda: now))
    return reg


def _labels(index: int, **extra: str) -> dict[str, str]:
    base = {"gpu": str(index), "uuid": f"GPU-{index}", "model": H100, "node": NODE}
    base.update({"pod": "", "namespace": "", "container": ""})
    base.update(extra)
    return base


FULL = GpuSample(
    index=0,
    uuid="GPU-0",
    gpu_utilization_ratio=0.42,
    memory_utilization_ratio=0.1,
    memory_used_bytes=10 * MIB,
    memory_free_bytes=20 * MIB,
    memory_total_bytes=30 * MIB,
    temperature_celsius=61.0,
    power_watts=350.5,
    energy_joules_total=12345.0,
    sm_clock_hertz=1.98e9,
    memory_clock_hertz=2.619e9,
    ecc_corrected_errors_total=3,
    ecc_uncorrected_errors_total=1,
    process_count=2,
    xid_errors_total={79: 1, 13: 2},
    health_state="degraded",
    health_action="watch",
    remapped_rows_correctable=2,
    remapped_rows_uncorrectable=1,
    row_remap_pending=True,
    row_remap_failed=False,
    recovery_action="gpu_reset",
    retired_pages_single_bit=3,
    retired_pages_double_bit=1,
    retired_pages_pending=False,
    nvlink_errors_total={0: {"crc_flit": 4, "replay": 1}, 3: {"crc_data": 2}},
    clock_events_active=frozenset({"hw_slowdown"}),
    clock_event_seconds_total={"hw_thermal": 1.5, "sw_thermal": 0.25},
    gpm=GpmReading(
        sm_active_ratio=0.4,
        sm_occupancy_ratio=0.2,
        tensor_active_ratio=0.3,
        dram_active_ratio=0.25,
        fp64_active_ratio=0.01,
        nvlink_bytes_total={"tx": 1000, "rx": 900},
        pcie_bytes_total={"tx": 30, "rx": 40},
    ),
)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("gpudaemon_gpu_utilization_ratio", 0.42),
        ("gpudaemon_gpu_memory_utilization_ratio", 0.1),
        ("gpudaemon_gpu_memory_used_bytes", 10 * MIB),
        ("gpudaemon_gpu_memory_free_bytes", 20 * MIB),
        ("gpudaemon_gpu_memory_total_bytes", 30 * MIB),
        ("gpudaemon_gpu_temperature_celsius", 61.0),
        ("gpudaemon_gpu_power_watts", 350.5),
        ("gpudaemon_gpu_energy_joules_total", 12345.0),
        ("gpudaemon_gpu_sm_clock_hertz", 1.98e9),
        ("gpudaemon_gpu_memory_clock_hertz", 2.619e9),
        ("gpudaemon_gpu_processes", 2),
        ("gpudaemon_gpu_healthy", 1),
        ("gpudaemon_gpu_lost", 0),
    ],
)
def test_each_reading_is_exported_in_base_units_with_gpu_labels(name: str, value: float) -> None:
    reg = _registry((_gpu(0),), (FULL,))
    assert reg.get_sample_value(name, _labels(0)) == pytest.approx(value)


def test_ecc_and_xid_counters_carry_their_extra_label() -> None:
    reg = _registry((_gpu(0),), (FULL,))
    ecc = "gpudaemon_gpu_ecc_errors_total"
    assert reg.get_sample_value(ecc, _labels(0, type="corrected")) == 3
    assert reg.get_sample_value(ecc, _labels(0, type="uncorrected")) == 1
    xid = "gpudaemon_gpu_xid_errors_total"
    assert reg.get_sample_value(xid, _labels(0, xid="79")) == 1
    assert reg.get_sample_value(xid, _labels(0, xid="13")) == 2


def test_gpu_info_carries_driver_cuda_and_pci() -> None:
    reg = _registry((_gpu(0),), (FULL,))
    labels = _labels(
        0,
        driver_version="550.54.15",
        cuda_version="12.4",
        pci_bus_id="00000000:00:00.0",
        compute_capability="9.0",
        mig_mode="disabled",
    )
    assert reg.get_sample_value("gpudaemon_gpu_info", labels) == 1


def test_unsupported_readings_are_absent_not_zero() -> None:
    bare = GpuSample(index=0, uuid="GPU-0", temperature_celsius=40.0)
    reg = _registry((_gpu(0),), (bare,))
    assert reg.get_sample_value("gpudaemon_gpu_temperature_celsius", _labels(0)) == 40.0
    for name in (
        "gpudaemon_gpu_power_watts",
        "gpudaemon_gpu_energy_joules_total",
        "gpudaemon_gpu_utilization_ratio",
        "gpudaemon_gpu_processes",
    ):
        assert reg.get_sample_value(name, _labels(0)) is None, name
    for t in ("corrected", "uncorrected"):
        assert reg.get_sample_value("gpudaemon_gpu_ecc_errors_total", _labels(0, type=t)) is None


def test_a_lost_gpu_is_unhealthy_and_lost_while_others_carry_on() -> None:
    lost = GpuSample(index=1, uuid="GPU-1", healthy=False, lost=True, health_reason="gpu lost")
    reg = _registry((_gpu(0), _gpu(1)), (FULL, lost))
    assert reg.get_sample_value("gpudaemon_gpu_healthy", _labels(1)) == 0
    assert reg.get_sample_value("gpudaemon_gpu_lost", _labels(1)) == 1
    assert reg.get_sample_value("gpudaemon_gpu_power_watts", _labels(1)) is None
    assert reg.get_sample_value("gpudaemon_gpu_healthy", _labels(0)) == 1


def test_pod_labels_only_on_the_assigned_gpu() -> None:
    pods = {"GPU-1": PodRef("train-0", "ml", "trainer")}
    s1 = GpuSample(index=1, uuid="GPU-1", power_watts=100.0)
    s0 = GpuSample(index=0, uuid="GPU-0", power_watts=90.0)
    reg = _registry((_gpu(0), _gpu(1)), (s0, s1), pods=pods)
    attributed = _labels(1, pod="train-0", namespace="ml", container="trainer")
    assert reg.get_sample_value("gpudaemon_gpu_power_watts", attributed) == 100.0
    assert reg.get_sample_value("gpudaemon_gpu_power_watts", _labels(0)) == 90.0
    assert reg.get_sample_value("gpudaemon_gpu_power_watts", _labels(1)) is None


def test_mig_instances_get_their_own_series_and_pods() -> None:
    migs = tuple(MigDevice(f"MIG-{i}", "1g.10gb", i, 0, 9856 * MIB) for i in range(2))
    gpu = _gpu(0, mig_capable=True, mig_enabled=True, mig_devices=migs)
    sample = GpuSample(
        index=0, uuid="GPU-0", mig=(MigSample("MIG-0", 5 * MIB), MigSample("MIG-1", None))
    )
    pods = {"MIG-1": PodRef("infer-1", "serving", "server")}
    reg = _registry((gpu,), (sample,), pods=pods)
    mig0 = _labels(0, mig_uuid="MIG-0", mig_profile="1g.10gb", gpu_instance_id="0")
    mig1 = _labels(
        0,
        mig_uuid="MIG-1",
        mig_profile="1g.10gb",
        gpu_instance_id="1",
        pod="infer-1",
        namespace="serving",
        container="server",
    )
    assert reg.get_sample_value("gpudaemon_mig_memory_used_bytes", mig0) == 5 * MIB
    assert reg.get_sample_value("gpudaemon_mig_memory_total_bytes", mig1) == 9856 * MIB
    assert reg.get_sample_value("gpudaemon_mig_memory_used_bytes", mig1) is None  # unsupported
    # The parent GPU is not the pod's: only the MIG instance is.
    assert reg.get_sample_value("gpudaemon_gpu_healthy", _labels(0)) == 1


def test_reading_age_comes_from_the_injected_clock() -> None:
    reg = _registry((_gpu(0),), (FULL,), now=1000.0)
    assert reg.get_sample_value("gpudaemon_last_reading_age_seconds") == pytest.approx(3.0)


def test_before_the_first_poll_only_the_age_family_exists_and_is_empty() -> None:
    reg = CollectorRegistry()
    cache = Cache()
    reg.register(GpuCollector(cache, NODE))
    reg.register(ReadingAgeCollector(cache))
    assert reg.get_sample_value("gpudaemon_last_reading_age_seconds") is None
    assert [m.name for m in reg.collect()] == ["gpudaemon_last_reading_age_seconds"]


def test_a_failing_pod_lookup_does_not_fail_the_scrape() -> None:
    def broken() -> PodMap:
        raise RuntimeError("boom")

    cache = Cache()
    cache.put_inventory(NodeInventory("550", (12, 4), (_gpu(0),)))
    cache.put_samples((FULL,))
    reg = CollectorRegistry()
    reg.register(GpuCollector(cache, NODE, pods=broken))
    assert reg.get_sample_value("gpudaemon_gpu_healthy", _labels(0)) == 1


def test_simulated_mig_node_exports_56_instances() -> None:
    backend = SimulatedBackend(load_profile("a100-mig"), seed=1)
    cache = Cache()
    cache.put_inventory(backend.inventory())
    cache.put_samples(backend.sample())
    reg = CollectorRegistry()
    reg.register(GpuCollector(cache, NODE))
    fams = {m.name: m for m in reg.collect()}
    assert len(fams["gpudaemon_mig_memory_total_bytes"].samples) == 56
    assert len(fams["gpudaemon_gpu_healthy"].samples) == 8


@pytest.mark.parametrize("profile", ["dgx-h100", "a100-mig"])
def test_a_render_reusing_unchanged_rows_is_what_prometheus_client_writes(profile: str) -> None:
    """render_gpus keeps each row's text while its values and labels hold (the slow
    schedules' rows between their reads): every render, after new samples and a new
    pod map, equals prometheus-client's own encoding."""
    from prometheus_client.exposition import generate_latest as text_latest
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest

    from gpudaemon.model import PodRef

    backend = SimulatedBackend(load_profile(profile), seed=3)
    cache = Cache()
    inv = backend.inventory()
    cache.put_inventory(inv)
    pod_maps: list[PodMap] = [{}, {inv.gpus[1].uuid: PodRef("ml", "train-0", "main")}]
    current: dict[str, PodMap] = {"pods": pod_maps[0]}
    col = GpuCollector(cache, NODE, pods=lambda: current["pods"])

    class Fresh:  # prometheus-client's path: the families built anew, no reuse
        def collect(self) -> list:  # type: ignore[type-arg]
            return list(col.gpu_families(cache.get(), current["pods"]))

    for step in range(6):
        cache.put_samples(backend.sample())
        if step == 4:
            current["pods"] = pod_maps[1]
        for om in (False, True):
            want = om_latest(Fresh()) if om else text_latest(Fresh())  # type: ignore[arg-type]
            got = col.render_gpus(om) + (b"# EOF\n" if om else b"")
            assert got == want, (step, om)


def test_xid_codes_outside_the_table_fold_into_other_so_series_stay_bounded() -> None:
    """2,000 distinct codes (a driver's or a forged fault's) give one `other` series
    beside the known ones, not 2,000 series; the total is unchanged."""
    from dataclasses import replace

    from gpudaemon.catalogue.values import KNOWN_XIDS

    codes = {79: 1, 13: 2, **{100_000 + i: 1 for i in range(2000)}}
    reg = _registry((_gpu(0),), (replace(FULL, xid_errors_total=codes),))
    xid = "gpudaemon_gpu_xid_errors_total"
    series = [
        s for m in reg.collect() if m.name == xid.removesuffix("_total")
        for s in m.samples if s.name == xid
    ]  # fmt: skip
    assert {s.labels["xid"] for s in series} == {"79", "13", "other"}
    assert reg.get_sample_value(xid, _labels(0, xid="other")) == 2000
    assert sum(s.value for s in series) == 2003
    assert len(series) <= len(KNOWN_XIDS) + 1
