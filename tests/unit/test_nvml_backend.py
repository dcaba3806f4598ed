"""The NVML backend against a fake pynvml: units, absence, lost GPUs, fallbacks, XIDs."""

import pynvml as real
import pytest

from gpudaemon.backends.nvml import NvmlBackend
from gpudaemon.errors import BackendError, NvmlUnavailableError
from tests.support import wait_for
from tests.unit.fake_nvml import FakeGpu, FakeMig, FakeNvml


def backend(fake: FakeNvml) -> NvmlBackend:
    return NvmlBackend(nvml=fake, xid_events=False)  # type: ignore[arg-type]


def test_inventory_and_units() -> None:
    b = backend(FakeNvml([FakeGpu(), FakeGpu(uuid="GPU-2")]))
    inv = b.inventory()
    assert inv.driver_version == "550.54.15" and inv.cuda_driver_version == (12, 4)
    g = inv.gpus[0]
    assert (g.name, g.memory_total_mib, g.compute_capability, g.nvlink_links) == (
        "NVIDIA H100 80GB HBM3",
        81559,
        (9, 0),
        18,
    )
    assert g.pci_bus_id == "00000000:00:00.0" and g.mig_capable and not g.mig_enabled
    s = b.sample()[0]
    assert s.gpu_utilization_ratio == pytest.approx(0.42)
    assert s.memory_utilization_ratio == pytest.approx(0.17)
    assert s.power_watts == pytest.approx(250.0)
    assert s.energy_joules_total is None  # its own schedule: b.energy()
    assert b.energy() == {0: pytest.approx(9000.0), 1: pytest.approx(9000.0)}
    assert s.sm_clock_hertz == pytest.approx(1.98e9)
    assert s.temperature_celsius == 51.0 and s.process_count == 2
    assert (s.ecc_corrected_errors_total, s.ecc_uncorrected_errors_total) == (0, 0)


def test_unsupported_readings_are_none_never_zero() -> None:
    gpu = FakeGpu().unsupported(
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTemperature",
        f"ecc:{real.NVML_MEMORY_ERROR_TYPE_CORRECTED}",
    )
    b = backend(FakeNvml([gpu]))
    b.inventory()
    s = b.sample()[0]
    assert s.power_watts is None and s.temperature_celsius is None
    assert s.ecc_corrected_errors_total is None
    assert s.ecc_uncorrected_errors_total == 0  # still supported
    assert s.gpu_utilization_ratio is not None


def test_lost_gpu_is_isolated() -> None:
    gpus = [FakeGpu(uuid=f"GPU-{i}") for i in range(4)]
    b = backend(FakeNvml(gpus))
    b.inventory()
    gpus[2].lost()
    samples = b.sample()
    assert samples[2].lost and not samples[2].healthy and samples[2].uuid == "GPU-2"
    assert samples[2].gpu_utilization_ratio is None
    assert [s.healthy for s in samples] == [True, True, False, True]
    inv = b.inventory()  # the lost GPU keeps its last known facts
    assert inv.gpus[2].name == "NVIDIA H100 80GB HBM3" and len(inv.gpus) == 4


def test_memory_v2_probed_once_then_v1() -> None:
    fake = FakeNvml([FakeGpu()], memory_v2=False)
    b = backend(fake)
    b.inventory()
    b.sample()
    b.sample()
    assert b._memory_v2 is False
    assert b.sample()[0].memory_used_bytes == 1024 * 2**20


def test_field_values_unavailable_leaves_only_the_nvlink_count_absent() -> None:
    b = backend(FakeNvml([FakeGpu()], field_values=False))
    assert b.inventory().gpus[0].nvlink_links is None
    s = b.sample()[0]
    assert s.ecc_corrected_errors_total == 0 and s.power_watts == pytest.approx(250.0)
    assert b.energy() == {0: pytest.approx(9000.0)}


def test_one_sample_makes_the_calls_the_simulator_charges_and_no_slow_one() -> None:
    """SAMPLE_CALLS and ENERGY_CALLS are what the NVML backend really calls per GPU: the
    simulator's latency model charges them, so they must not drift apart."""
    from collections import Counter

    from gpudaemon.backends.base import ENERGY_CALLS, SAMPLE_CALLS

    fake = FakeNvml([FakeGpu(), FakeGpu(uuid="GPU-2")])
    b = backend(fake)
    b.inventory()
    b.sample()  # the first sample also probes (memory v2)
    fake.calls.clear()
    b.sample()
    assert Counter(fake.calls) == Counter(SAMPLE_CALLS * 2)
    assert "nvmlDeviceGetTotalEnergyConsumption" not in fake.calls
    fake.calls.clear()
    b.energy()
    assert Counter(fake.calls) == Counter(ENERGY_CALLS * 2)


def test_an_unsupported_reading_is_asked_once_per_gpu() -> None:
    fake = FakeNvml([FakeGpu().unsupported("nvmlDeviceGetPowerUsage"), FakeGpu(uuid="GPU-2")])
    b = backend(fake)
    b.inventory()
    for _ in range(5):
        samples = b.sample()
    assert samples[0].power_watts is None and samples[1].power_watts == pytest.approx(250.0)
    # GPU 0 was asked once; GPU 1 (supported) on every sample
    assert fake.calls.count("nvmlDeviceGetPowerUsage") == 1 + 5


def test_the_first_read_of_each_reading_is_timed_and_a_slow_one_logged(
    lines: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpudaemon.backends.nvml.library as nvml_mod

    clock = iter([0.0, 0.0039])  # the energy read's probe: 3.9 ms
    monkeypatch.setattr(nvml_mod, "_timer", lambda: 0.0)  # a loaded machine: not slow
    b = backend(FakeNvml([FakeGpu()]))
    b.inventory()
    b.sample()
    monkeypatch.setattr(nvml_mod, "_timer", lambda: next(clock))
    b.energy()
    b.energy()  # probed already: not timed again (the iterator would run dry)
    assert b.first_read_s[(0, "energy")] == pytest.approx(0.0039)
    slow_lines = [m for _, m in lines if "took" in m]
    assert slow_lines == ["GPU 0: reading energy took 3.9 ms (nvmlDeviceGetTotalEnergyConsumption)"]


def test_uncorrected_ecc_makes_gpu_unhealthy() -> None:
    b = backend(FakeNvml([FakeGpu(dbe=3)]))
    b.inventory()
    s = b.sample()[0]
    assert not s.healthy and "ecc" in s.health_reason


def test_xids_are_counted_and_critical_ones_mark_unhealthy() -> None:
    b = backend(FakeNvml([FakeGpu(), FakeGpu(uuid="GPU-2")]))
    b.inventory()
    b.record_xid(0, 13)
    b.record_xid(1, 79)
    b.record_xid(1, 79)
    s = b.sample()
    assert s[0].xid_errors_total == {13: 1} and s[0].healthy
    assert s[1].xid_errors_total == {79: 2} and not s[1].healthy and s[1].health_reason == "xid 79"


@pytest.mark.parametrize(
    "code", [real.NVML_ERROR_LIBRARY_NOT_FOUND, real.NVML_ERROR_DRIVER_NOT_LOADED]
)
def test_missing_driver_is_a_clear_usage_error(code: int) -> None:
    with pytest.raises(NvmlUnavailableError, match="--simulate"):
        backend(FakeNvml([], init_error=code)).inventory()


def test_other_init_failures_are_backend_errors() -> None:
    with pytest.raises(BackendError, match="nvmlInit failed"):
        backend(FakeNvml([], init_error=real.NVML_ERROR_UNKNOWN)).inventory()


def test_close_shuts_nvml_down_once() -> None:
    fake = FakeNvml([FakeGpu()])
    b = backend(fake)
    b.inventory()
    b.close()
    b.close()
    assert fake.shutdowns == 1


def test_a_gpu_without_a_handle_at_start_does_not_hide_the_others() -> None:
    fake = FakeNvml([FakeGpu(uuid=f"GPU-{i}") for i in range(3)])
    fake.no_handle.add(1)
    b = backend(fake)
    inv = b.inventory()
    assert [g.uuid for g in inv.gpus] == ["GPU-0", "unknown-1", "GPU-2"]
    assert [s.healthy for s in b.sample()] == [True, False, True]


def test_an_unreadable_gpu_identity_is_contained_not_raised() -> None:
    fake = FakeNvml([FakeGpu(uuid=f"GPU-{i}") for i in range(2)])
    fake.identity_error.add(0)
    inv = backend(fake).inventory()
    assert inv.gpus[0].name == "unknown" and inv.gpus[1].uuid == "GPU-1"


def test_a_function_missing_from_the_binding_is_unsupported_not_an_error() -> None:
    fake = FakeNvml([FakeGpu()])
    fake.nvmlDeviceGetPowerUsage = None  # type: ignore[assignment,method-assign]
    b = backend(fake)
    b.inventory()
    s = b.sample()[0]
    assert s.power_watts is None and s.temperature_celsius == 51.0


def test_the_xid_thread_counts_driver_events_and_stops_on_close() -> None:
    fake = FakeNvml([FakeGpu(uuid="GPU-0"), FakeGpu(uuid="GPU-1")])
    b = NvmlBackend(nvml=fake, xid_events=True)  # type: ignore[arg-type]
    b.inventory()
    fake.events += [(1, 79), (0, 13)]
    wait_for(lambda: all(s.xid_errors_total for s in b.sample()), 10, what="both events counted")
    s = b.sample()
    assert s[1].xid_errors_total == {79: 1} and not s[1].healthy
    assert s[0].xid_errors_total == {13: 1} and s[0].healthy
    assert "register:0" in fake.calls and "register:1" in fake.calls
    b.close()
    assert "evset-free" in fake.calls and fake.shutdowns == 1


H100_1G = {
    "multiprocessorCount": 16,
    "sharedCopyEngineCount": 1,
    "sharedDecoderCount": 1,
    "sharedEncoderCount": 0,
    "sharedJpegCount": 1,
    "sharedOfaCount": 0,
    "gpuInstanceSliceCount": 1,
    "computeInstanceSliceCount": 1,
    "memorySizeMB": 9984,
}


def test_mig_devices_with_their_attributes_and_attributes_probed_once() -> None:
    migs = [FakeMig("1g.10gb", f"MIG-{k}", H100_1G, gi=k + 7) for k in range(2)]
    fake = FakeNvml([FakeGpu(migs=migs)])
    (g,) = backend(fake).inventory().gpus
    assert g.mig_enabled
    m = g.mig_devices[1]
    assert (m.uuid, m.profile, m.gpu_instance_id, m.memory_total_mib) == (
        "MIG-1",
        "1g.10gb",
        8,
        9984,
    )
    assert (m.multiprocessors, m.gpu_instance_slices, m.compute_instance_slices) == (16, 1, 1)
    assert (m.copy_engines, m.decoders, m.encoders, m.jpeg_engines, m.ofa_engines) == (
        1,
        1,
        0,
        1,
        0,
    )
    # A driver without nvmlDeviceGetAttributes_v2: the devices stay, the facts are None,
    # and the call is not made again.
    fake = FakeNvml([FakeGpu(migs=migs).unsupported("nvmlDeviceGetAttributes_v2")])
    b = backend(fake)
    (g,) = b.inventory().gpus
    assert [m.multiprocessors for m in g.mig_devices] == [None, None]
    assert g.mig_devices[0].memory_total_mib == 9984  # from the memory info instead
    b.inventory()
    assert fake.calls.count("nvmlDeviceGetAttributes_v2") == 1
