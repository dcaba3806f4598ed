"""GPM through the NVML backend against a fake pynvml with libnvidia-ml's call sequence
and error codes: probed once, first poll absent, ratios and integrated byte counters,
unsupported devices and metrics, too few samples, lost GPUs, MIG instances, buffers freed."""

from collections import Counter

import pynvml as real
import pytest

import gpudaemon.backends.nvml as nvml_mod
from gpudaemon.backends.base import GPM_CALLS, GPM_MIG_CALLS, SAMPLE_CALLS
from gpudaemon.backends.nvml import NvmlBackend
from gpudaemon.model import MIB
from tests.unit.fake_nvml import FakeGpu, FakeMig, FakeNvml
from tests.unit.test_nvml_backend import H100_1G


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(nvml_mod, "_clock", c)
    return c


def backend(fake: FakeNvml) -> NvmlBackend:
    b = NvmlBackend(nvml=fake, xid_events=False)  # type: ignore[arg-type]
    b.inventory()
    return b


def test_first_poll_has_no_value_then_ratios_and_counters(clock: Clock) -> None:
    fake = FakeNvml([FakeGpu(gpm=True)])
    b = backend(fake)
    assert b.sample()[0].gpm is None  # one sample: no pair yet
    clock.t += 5.0
    r = b.sample()[0].gpm
    assert r is not None
    assert r.sm_active_ratio == pytest.approx(0.8)
    assert r.sm_occupancy_ratio == pytest.approx(0.4)
    assert r.tensor_active_ratio == pytest.approx(0.6)
    assert r.dram_active_ratio == 1.0  # 100.3 % clamped
    assert r.fp64_active_ratio == 0.0  # a real 0, read: present
    # MiB/s x 5 s, as bytes
    assert r.nvlink_bytes_total == {"rx": 500 * MIB * 5, "tx": 1000 * MIB * 5}
    assert r.pcie_bytes_total == {"rx": 20 * MIB * 5, "tx": 10 * MIB * 5}
    clock.t += 10.0
    r2 = b.sample()[0].gpm
    assert r2 is not None and r2.nvlink_bytes_total["tx"] == 1000 * MIB * 15  # monotonic


def test_a_gpu_without_gpm_is_absent_and_never_sampled(clock: Clock) -> None:
    fake = FakeNvml([FakeGpu(name="NVIDIA A100-SXM4-80GB", cc=(8, 0))])
    b = backend(fake)
    for _ in range(3):
        clock.t += 5
        assert b.sample()[0].gpm is None
    assert fake.calls.count("nvmlGpmQueryDeviceSupport") == 1
    assert not any(c.startswith("nvmlGpmSample") for c in fake.calls)
    b.inventory()  # probed once per GPU, not per inventory
    assert fake.calls.count("nvmlGpmQueryDeviceSupport") == 1


def test_a_driver_without_gpm_functions_is_no_gpm() -> None:
    fake = FakeNvml([FakeGpu(gpm=True).unsupported("nvmlGpmQueryDeviceSupport")])
    b = backend(fake)
    b.sample()
    assert b.sample()[0].gpm is None and "nvmlGpmSampleGet" not in fake.calls


def test_not_supported_on_sample_turns_gpm_off_and_frees_the_buffers(clock: Clock) -> None:
    gpu = FakeGpu(gpm=True)
    fake = FakeNvml([gpu])
    b = backend(fake)
    b.sample()
    gpu.missing.add("nvmlGpmSampleGet")
    clock.t += 5
    assert b.sample()[0].gpm is None
    assert fake.gpm_samples == {}  # both buffers freed
    gpu.missing.clear()
    clock.t += 5
    assert b.sample()[0].gpm is None  # not asked again
    assert fake.calls.count("nvmlGpmSampleGet") == 2  # the first poll, the refused one


def test_an_unsupported_metric_is_absent_and_not_asked_again(clock: Clock) -> None:
    gpu = FakeGpu(gpm=True)  # a PCIe H100: no NVLink throughput
    del gpu.gpm_values[real.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC]
    del gpu.gpm_values[real.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC]
    b = backend(FakeNvml([gpu]))
    b.sample()
    clock.t += 5
    r = b.sample()[0].gpm
    assert r is not None and r.nvlink_bytes_total == {} and r.pcie_bytes_total["tx"] > 0
    pair = b._gpm[(0, None)]
    assert real.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC in pair.skip
    assert pair.metrics.numMetrics == 9  # asked once; the next poll asks 7
    clock.t += 5
    b.sample()
    assert pair.metrics.numMetrics == 7


def test_too_few_samples_is_absent_this_poll_and_logged_once(
    clock: Clock, lines: list[tuple[str, str]]
) -> None:
    """Two polls in the same instant: the pair spans no interval, which libnvidia-ml
    rejects (INVALID_ARGUMENT); absent this poll, one warning, then back."""
    fake = FakeNvml([FakeGpu(gpm=True)])
    b = backend(fake)
    b.sample()
    original = fake.nvmlGpmMetricsGet

    def refuse(mg: object) -> object:
        raise fake.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)

    fake.nvmlGpmMetricsGet = refuse  # type: ignore[method-assign]
    for _ in range(3):
        clock.t += 5
        assert b.sample()[0].gpm is None
    assert sum("GPM read failed" in m for _, m in lines) == 1
    fake.nvmlGpmMetricsGet = original  # type: ignore[method-assign]
    clock.t += 5
    r = b.sample()[0].gpm
    assert r is not None and r.sm_active_ratio == pytest.approx(0.8)


def test_the_fake_refuses_a_pair_that_does_not_span_an_interval() -> None:
    """The fake's rule itself: the same sample twice, or one never filled, is refused."""
    fake = FakeNvml([FakeGpu(gpm=True)])
    a, c = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
    mg = real.c_nvmlGpmMetricsGet_t()
    mg.version, mg.numMetrics = real.NVML_GPM_METRICS_GET_VERSION, 1
    mg.metrics[0].metricId = real.NVML_GPM_METRIC_SM_UTIL
    fake.nvmlGpmSampleGet(0, a)
    for s1, s2 in ((a, a), (a, c), (c, a)):
        mg.sample1, mg.sample2 = s1, s2
        with pytest.raises(fake.NVMLError) as e:
            fake.nvmlGpmMetricsGet(mg)
        assert e.value.value == real.NVML_ERROR_INVALID_ARGUMENT


def test_a_lost_gpu_has_no_gpm_and_its_buffers_are_freed(clock: Clock) -> None:
    gpus = [FakeGpu(gpm=True), FakeGpu(uuid="GPU-2", gpm=True)]
    fake = FakeNvml(gpus)
    b = backend(fake)
    b.sample()
    gpus[0].lost()
    clock.t += 5
    s = b.sample()
    assert s[0].lost and s[0].gpm is None
    assert s[1].gpm is not None and s[1].gpm.sm_active_ratio == pytest.approx(0.8)
    assert len(fake.gpm_samples) == 2  # only GPU 1's pair is left


def test_close_frees_every_sample_buffer() -> None:
    fake = FakeNvml([FakeGpu(gpm=True), FakeGpu(uuid="GPU-2", gpm=True)])
    b = backend(fake)
    b.sample()
    assert len(fake.gpm_samples) == 4
    b.close()
    assert fake.gpm_samples == {} and fake.shutdowns == 1


def test_one_sample_of_a_gpm_gpu_makes_the_calls_the_simulator_charges(clock: Clock) -> None:
    fake = FakeNvml([FakeGpu(gpm=True), FakeGpu(uuid="GPU-2", gpm=True)])
    b = backend(fake)
    b.sample()
    b.sample()
    fake.calls.clear()
    clock.t += 5
    b.sample()
    assert Counter(fake.calls) == Counter((SAMPLE_CALLS + GPM_CALLS) * 2)


def _mig_gpu(n: int) -> FakeGpu:
    migs = [FakeMig("1g.10gb", f"MIG-{k}", H100_1G, gi=k + 1) for k in range(n)]
    return FakeGpu(gpm=True, migs=migs)


def test_mig_instances_each_get_their_own_reading(clock: Clock) -> None:
    gpu = _mig_gpu(3)
    fake = FakeNvml([gpu])
    b = backend(fake)
    first = b.sample()[0]
    assert all(m.gpm is None for m in first.mig)
    clock.t += 5
    fake.calls.clear()
    s = b.sample()[0]
    assert [m.uuid for m in s.mig] == ["MIG-0", "MIG-1", "MIG-2"]
    assert all(m.gpm is not None and m.gpm.sm_active_ratio == pytest.approx(0.8) for m in s.mig)
    assert s.gpm is not None
    assert Counter(c for c in fake.calls if c.startswith("nvmlGpm")) == Counter(
        GPM_CALLS + GPM_MIG_CALLS * 3
    )
    # A new layout: the gone GPU instance's buffers are freed.
    gpu.migs = gpu.migs[:1] if gpu.migs else None
    b.inventory()
    b.sample()
    assert {k for k in b._gpm} == {(0, None), (0, 1)}
    assert len(fake.gpm_samples) == 4


def test_mig_gpm_not_supported_leaves_the_gpu_reading(clock: Clock) -> None:
    gpu = _mig_gpu(2)
    gpu.gpm_mig = False
    b = backend(FakeNvml([gpu]))
    b.sample()
    clock.t += 5
    s = b.sample()[0]
    assert s.gpm is not None and all(m.gpm is None for m in s.mig)
    assert 0 in b._gpm_no_mig


def test_gpm_calls_are_timed_once(clock: Clock) -> None:
    b = backend(FakeNvml([FakeGpu(gpm=True)]))
    b.sample()
    clock.t += 5
    b.sample()
    assert {(0, "gpm support"), (0, "gpm sample"), (0, "gpm metrics")} <= set(b.first_read_s)
