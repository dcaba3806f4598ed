"""The simulated backend: profiles, reproducible evolving readings, injected faults."""

from pathlib import Path

import pytest

from gpudaemon.backends.simulated import FaultSpec, SimulatedBackend, load_profile, parse_profile
from gpudaemon.errors import ProfileError
from gpudaemon.model import MIB
from tests.clock import FakeClock


@pytest.mark.parametrize(("name", "count"), [("dgx-h100", 8), ("a100-mig", 8), ("mixed", 5)])
def test_builtin_profiles(name: str, count: int) -> None:
    b = SimulatedBackend(load_profile(name))
    inv = b.inventory()
    assert len(inv.gpus) == count
    assert len({g.uuid for g in inv.gpus}) == count
    samples = b.sample()
    assert len(samples) == count and all(s.healthy for s in samples)


def test_dgx_h100_matches_the_hardware() -> None:
    g = SimulatedBackend(load_profile("dgx-h100")).inventory().gpus[0]
    assert (g.name, g.memory_total_mib, g.compute_capability) == (
        "NVIDIA H100 80GB HBM3",
        81559,
        (9, 0),
    )
    assert g.nvlink_links == 18


def test_a100_mig_has_seven_instances_per_gpu() -> None:
    inv = SimulatedBackend(load_profile("a100-mig")).inventory()
    assert len(inv.gpus) == 8
    assert all(g.mig_enabled and len(g.mig_devices) == 7 for g in inv.gpus)


def test_same_seed_same_readings_and_different_seed_differs() -> None:
    a = SimulatedBackend(load_profile("dgx-h100"), seed=7, clock=FakeClock(1000.0))
    b = SimulatedBackend(load_profile("dgx-h100"), seed=7, clock=FakeClock(1000.0))
    c = SimulatedBackend(load_profile("dgx-h100"), seed=8, clock=FakeClock(1000.0))
    ra, rb, rc = a.sample(), b.sample(), c.sample()
    assert ra == rb
    assert [s.gpu_utilization_ratio for s in ra] != [s.gpu_utilization_ratio for s in rc]


def test_readings_evolve_and_energy_accumulates() -> None:
    clock = FakeClock(1000.0)
    b = SimulatedBackend(load_profile("dgx-h100"), seed=1, clock=clock)
    first = b.sample()[0]
    clock.t += 10
    second = b.sample()[0]
    assert first.gpu_utilization_ratio != second.gpu_utilization_ratio
    # The counter is not part of a sample (its own schedule), but reads what the samples
    # integrated: 10 s at the sampled power, within the noise of one reading.
    assert second.energy_joules_total is None and second.power_watts is not None
    energy = b.energy()[0]
    assert energy == pytest.approx(10 * second.power_watts, rel=0.05)


def test_unsupported_readings_are_absent_not_zero() -> None:
    p = parse_profile(
        "gpus: [{name: T4, memory_total_mib: 15360, compute_capability: '7.5', ecc: false}]"
    )
    s = SimulatedBackend(p).sample()[0]
    assert s.ecc_corrected_errors_total is None and s.ecc_uncorrected_errors_total is None


def test_lost_gpu_is_unhealthy_and_others_carry_on() -> None:
    clock = FakeClock(1000.0)
    b = SimulatedBackend(load_profile("dgx-h100"), clock=clock)
    b.inject(3, FaultSpec(kind="lost", after_s=5))
    first = b.sample()
    assert len(first) == 8 and all(s.healthy for s in first)
    clock.t += 6
    samples = b.sample()
    assert samples[3].lost and not samples[3].healthy and samples[3].gpu_utilization_ratio is None
    others = [s for s in samples if s.index != 3]
    assert len(others) == 7
    assert all(s.healthy and s.gpu_utilization_ratio is not None for s in others)


def test_critical_xid_marks_unhealthy_application_xid_does_not() -> None:
    b = SimulatedBackend(load_profile("dgx-h100"))
    b.inject(0, FaultSpec(kind="xid", xid=79))
    b.inject(1, FaultSpec(kind="xid", xid=13, count=2))
    s = b.sample()
    assert s[0].xid_errors_total == {79: 1} and not s[0].healthy and s[0].health_reason == "xid 79"
    assert s[1].xid_errors_total == {13: 2} and s[1].healthy


def test_ecc_fault_counts_and_uncorrected_is_unhealthy() -> None:
    b = SimulatedBackend(load_profile("dgx-h100"))
    b.inject(2, FaultSpec(kind="ecc", corrected=5, uncorrected=1))
    s = b.sample()[2]
    assert (s.ecc_corrected_errors_total, s.ecc_uncorrected_errors_total) == (5, 1)
    assert not s.healthy


def test_profile_file_with_faults_after_polls(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(
        "driver_version: '535.1.2'\ncuda_version: '12.2'\n"
        "gpus: [{name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559, compute_capability: '9.0',"
        " count: 2}]\n"
        "faults: [{kind: lost, gpu: 1, after_polls: 2}]\n"
    )
    b = SimulatedBackend(load_profile(str(f)))
    assert b.inventory().driver_version == "535.1.2"
    assert [s.healthy for s in b.sample()] == [True, True]
    assert [s.healthy for s in b.sample()] == [True, True]
    assert [s.healthy for s in b.sample()] == [True, False]


def test_memory_is_consistent() -> None:
    for s in SimulatedBackend(load_profile("mixed")).sample():
        assert s.memory_used_bytes is not None and s.memory_total_bytes is not None
        assert s.memory_used_bytes + (s.memory_free_bytes or 0) == s.memory_total_bytes
        assert s.memory_used_bytes % MIB == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpus: [", "invalid YAML"),
        ("[1, 2]", "expected a mapping"),
        ("gpus: []", "gpus"),
        (
            "gpus: [{name: X, memory_total_mib: 1, compute_capability: 'nine'}]",
            "compute_capability",
        ),
        ("gpus: [{name: X, memory_total_mib: -1, compute_capability: '9.0'}]", "memory_total_mib"),
        (
            "gpus: [{name: X, memory_total_mib: 1, compute_capability: '9.0', colour: red}]",
            "colour",
        ),
        (
            "gpus: [{name: X, memory_total_mib: 1, compute_capability: '9.0',"
            " mig: {enabled: true, instances: [1g.10gb]}}]",
            "MIG is simulated only for A100, H100 and H200",
        ),
        (
            "gpus: [{name: NVIDIA A100-SXM4-80GB, memory_total_mib: 81920,"
            " compute_capability: '8.0', mig: {enabled: true, instances: [9g.1tb]}}]",
            "unknown MIG profile '9g.1tb'",
        ),
        (
            "gpus: [{name: NVIDIA A100-SXM4-80GB, memory_total_mib: 81920,"
            " compute_capability: '8.0', mig: {enabled: true, instances: [1g.5gb]}}]",
            "unknown MIG profile '1g.5gb' for this GPU",  # an A100-40GB profile
        ),
        (
            "gpus: [{name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559,"
            " compute_capability: '9.0', mig: {enabled: true,"
            " instances: [3g.40gb, 3g.40gb, 1g.10gb]}}]",
            "9 memory slices",  # 7 compute slices, but 4 + 4 + 1 memory slices
        ),
        (
            "gpus: [{name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559,"
            " compute_capability: '9.0', mig: {enabled: true, instances: [4g.40gb, 4g.40gb]}}]",
            "2x 4g.40gb is more than the 1",
        ),
        (
            "gpus: [{name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559,"
            " compute_capability: '9.0', mig: {enabled: true}}]\n"
            "mig_changes: [{gpu: 0, instances: [7g.80gb, 1g.10gb]}]",
            "mig_changes[0].instances",
        ),
        (
            "gpus: [{name: X, memory_total_mib: 1, compute_capability: '9.0',"
            " faults: [{kind: meltdown}]}]",
            "kind",
        ),
    ],
)
def test_bad_profiles_give_one_line_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(ProfileError) as e:
        parse_profile(text, "p.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("name", "mib", "profile", "memory_mib", "sms"),
    [
        ("NVIDIA A100-SXM4-40GB", 40960, "1g.5gb", 4864, 14),
        ("NVIDIA A100-SXM4-40GB", 40960, "1g.10gb", 9856, 14),
        ("NVIDIA A100-SXM4-80GB", 81920, "1g.10gb", 9728, 14),  # not the 40GB's 9856
        ("NVIDIA A100-SXM4-80GB", 81920, "3g.40gb", 40192, 42),
        ("NVIDIA H100 80GB HBM3", 81559, "1g.10gb", 9984, 16),
        ("NVIDIA H100 80GB HBM3", 81559, "7g.80gb", 81152, 132),
        ("NVIDIA H200", 143771, "1g.18gb", 16384, 16),
    ],
)
def test_mig_devices_carry_their_model_s_profile_figures(
    name: str, mib: int, profile: str, memory_mib: int, sms: int
) -> None:
    text = (
        f"gpus: [{{name: {name}, memory_total_mib: {mib}, compute_capability: '8.0',"
        f" mig: {{enabled: true, instances: [{profile}]}}}}]"
    )
    (gpu,) = SimulatedBackend(parse_profile(text)).inventory().gpus
    (m,) = gpu.mig_devices
    assert (m.profile, m.memory_total_mib, m.multiprocessors) == (profile, memory_mib, sms)
    assert m.gpu_instance_slices == m.compute_instance_slices == int(profile[0])


def test_a_layout_per_gpu_and_a_change_at_run_time() -> None:
    clock = FakeClock()
    text = """
gpus:
  - {name: NVIDIA A100-SXM4-80GB, memory_total_mib: 81920, compute_capability: '8.0',
     mig: {enabled: true, instances: [1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb]}}
  - {name: NVIDIA A100-SXM4-80GB, memory_total_mib: 81920, compute_capability: '8.0',
     mig: {enabled: true, instances: [3g.40gb, 3g.40gb]}}
mig_changes: [{gpu: 1, after_s: 30, instances: [4g.40gb, 2g.20gb, 1g.10gb]}]
"""
    sim = SimulatedBackend(parse_profile(text), clock=clock)
    inv = sim.inventory()
    assert [[m.profile for m in g.mig_devices] for g in inv.gpus] == [
        ["1g.10gb"] * 7,
        ["3g.40gb", "3g.40gb"],
    ]
    before = {m.uuid for m in inv.gpus[1].mig_devices}
    clock.t += 31
    after = sim.inventory().gpus[1].mig_devices
    assert [m.profile for m in after] == ["4g.40gb", "2g.20gb", "1g.10gb"]
    assert not before & {m.uuid for m in after}  # re-created instances get new UUIDs
    assert [len(s.mig) for s in sim.sample()] == [7, 3]
    with pytest.raises(ProfileError, match=r"GPU 0: 2x 7g\.80gb"):
        sim.set_mig_layout(0, ("7g.80gb", "7g.80gb"))


def test_unknown_profile_name() -> None:
    with pytest.raises(ProfileError, match="unknown simulation profile"):
        load_profile("dgx-z900")
