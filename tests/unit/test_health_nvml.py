"""The health signals through the NVML backend (fake NVML): converted once, each probed
once, unsupported -> absent (never 0), and the verdict on the sample."""

from __future__ import annotations

import pynvml as real

from gpudaemon.backends.nvml import NvmlBackend
from tests.unit.fake_nvml import FakeGpu, FakeNvml


def _backend(*gpus: FakeGpu) -> tuple[FakeNvml, NvmlBackend]:
    fake = FakeNvml(list(gpus))
    b = NvmlBackend(nvml=fake, xid_events=False)  # type: ignore[arg-type]
    b.inventory()
    return fake, b


def test_a_healthy_h100_reads_zero_remaps_action_none_and_no_clock_events() -> None:
    _, b = _backend(FakeGpu(nvlink_up=18))
    b.health_counters()
    s = b.sample()[0]
    assert (s.remapped_rows_correctable, s.remapped_rows_uncorrectable) == (0, 0)
    assert s.row_remap_pending is False and s.row_remap_failed is False
    assert s.recovery_action == "none"
    assert s.clock_events_active == frozenset()
    assert set(s.nvlink_errors_total) == set(range(18))
    assert s.clock_event_seconds_total == {"sw_thermal": 0, "hw_thermal": 0, "hw_power_brake": 0}
    # Ampere+: no page retirement, so absent, not 0.
    assert s.retired_pages_single_bit is None and s.retired_pages_pending is None
    assert (s.health_state, s.health_action, s.healthy) == ("healthy", "none", True)


def test_signals_are_converted_once_and_judged() -> None:
    g = FakeGpu(
        remapped=(3, 1, 1, 0),
        clock_mask=real.nvmlClocksEventReasonHwSlowdown | real.nvmlClocksEventReasonGpuIdle,
        recovery=real.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P,
        durations_ns={real.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: 2_500_000_000},
        nvlink_up=2,
        nvlink_errors={(1, real.NVML_NVLINK_ERROR_DL_CRC_FLIT): 7},
    )
    _, b = _backend(g)
    b.health_counters()
    s = b.sample()[0]
    assert (s.remapped_rows_correctable, s.remapped_rows_uncorrectable) == (3, 1)
    assert s.row_remap_pending is True
    assert s.clock_events_active == frozenset({"hw_slowdown"})  # idle is not a fault
    assert s.recovery_action == "drain_p2p"
    assert s.clock_event_seconds_total["hw_thermal"] == 2.5  # ns -> s
    assert s.nvlink_errors_total[1]["crc_flit"] == 7 and set(s.nvlink_errors_total) == {0, 1}
    assert (s.health_state, s.health_action, s.health_reason) == (
        "unhealthy",
        "reset_gpu",
        "row remap pending",
    )


def test_unsupported_signals_are_absent_and_asked_once() -> None:
    g = FakeGpu(cc=(7, 0), retired=([1, 2], [3], 1)).unsupported(
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetNvLinkState",
    )
    fake, b = _backend(g)
    b.health_counters()
    b.sample()
    fake.calls.clear()
    b.health_counters()
    s = b.sample()[0]
    assert s.remapped_rows_correctable is None and s.row_remap_pending is None
    assert s.clock_events_active is None and s.nvlink_errors_total == {}
    assert (s.retired_pages_single_bit, s.retired_pages_double_bit) == (2, 1)
    assert s.retired_pages_pending is True and s.health_action == "reset_gpu"
    for fn in (
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetNvLinkState",
    ):
        assert fn not in fake.calls, fn


def test_an_old_driver_gives_clock_events_under_the_throttle_name() -> None:
    g = FakeGpu(clock_mask=real.nvmlClocksThrottleReasonHwPowerBrakeSlowdown).unsupported(
        "nvmlDeviceGetCurrentClocksEventReasons"
    )
    _, b = _backend(g)
    assert b.sample()[0].clock_events_active == frozenset({"hw_power_brake"})
    assert b.sample()[0].health_state == "degraded"


def test_an_unsupported_health_field_is_absent_and_not_asked_again() -> None:
    fid = real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    g = FakeGpu().unsupported(f"field:{fid}")
    fake, b = _backend(g)
    b.health_counters()
    assert b.sample()[0].recovery_action is None
    asked: list[list[int]] = []
    real_fv = fake.nvmlDeviceGetFieldValues
    fake.nvmlDeviceGetFieldValues = lambda h, ids: asked.append(ids) or real_fv(h, ids)  # type: ignore[method-assign]
    b.health_counters()
    assert asked and all(fid not in ids for ids in asked)
    assert real.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION not in asked[0]  # never the ~4 ms field


def test_xid_154_rereads_the_recovery_action_on_the_next_sample() -> None:
    g = FakeGpu()
    _, b = _backend(g)
    b.health_counters()
    assert b.sample()[0].recovery_action == "none"
    g.recovery = real.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    b.record_xid(0, 154)
    s = b.sample()[0]
    assert (s.recovery_action, s.health_action) == ("node_reboot", "reboot_node")
