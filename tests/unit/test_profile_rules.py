"""Simulated-profile fields that would be silently ignored are load-time errors
(issue 12 item 17): one line naming the field, exit 2 from the CLI."""

from pathlib import Path

import pytest

from gpudaemon.backends.simulated import SimulatedBackend, parse_profile
from gpudaemon.errors import ProfileError
from tests.support import run_cli

GPU = "{name: X, memory_total_mib: 1000, compute_capability: '9.0'"
UUID = "GPU-12345678-abcd-ef01-2345-6789abcdef01"


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        # item 17 as filed: the uuid was dropped, each GPU got a derived one
        (f"gpus: [{GPU}, count: 2, uuid: {UUID}}}]", "uuid: only with count: 1"),
        (f"gpus: [{GPU}, uuid: not-a-uuid}}]", "must look like an NVML UUID"),
        (f"gpus: [{GPU}, uuid: {UUID}}}, {GPU}, uuid: {UUID}}}]", "appears twice"),
        (f"gpus: [{GPU}, mig: {{instances: ['1g.10gb']}}}}]", "instances need enabled: true"),
        (f"gpus: [{GPU}, mig: {{capable: false, enabled: true}}}}]", "needs capable: true"),
        (f"gpus: [{GPU}, utilization: {{pattern: steady, amplitude: 0.3}}}}]", "amplitude"),
        (f"gpus: [{GPU}, utilization: {{pattern: idle, mean: 0.9}}}}]", "mean: not used"),
        (f"gpus: [{GPU}, faults: [{{kind: lost, xid: 43}}]}}]", "xid: not used by kind lost"),
        (f"gpus: [{GPU}, faults: [{{kind: xid, uncorrected: 1}}]}}]", "uncorrected: not used"),
        (f"gpus: [{GPU}, faults: [{{kind: ecc}}]}}]", "needs corrected or uncorrected"),
        (f"gpus: [{GPU}, faults: [{{kind: lost, gpu: 0}}]}}]", "top-level faults list"),
        (f"gpus: [{GPU}, ecc: false, faults: [{{kind: ecc, corrected: 1}}]}}]", "ecc: true"),
        (
            f"gpus: [{GPU}, ecc: false}}]\nfaults: [{{kind: ecc, gpu: 0, uncorrected: 1}}]",
            "ecc: true on GPU 0",
        ),
        (f"gpus: [{GPU}, faults: [{{kind: xid, xid: 0}}]}}]", "xid"),
    ],
)
def test_ignored_or_inconsistent_fields_are_rejected(profile: str, message: str) -> None:
    with pytest.raises(ProfileError) as e:
        parse_profile(profile, "p.yaml")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_the_uuid_given_is_the_uuid_reported() -> None:
    b = SimulatedBackend(parse_profile(f"gpus: [{GPU}, uuid: {UUID}}}, {GPU}, count: 2}}]"))
    uuids = [g.uuid for g in b.inventory().gpus]
    assert uuids[0] == UUID and len(set(uuids)) == 3


@pytest.mark.parametrize("name", ["dgx-h100", "a100-mig", "mixed"])
def test_builtin_profiles_still_load(name: str) -> None:
    from gpudaemon.backends.simulated import load_profile

    assert load_profile(name).gpus


def test_cli_says_one_line_and_exits_2(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(f"gpus: [{GPU}, count: 2, uuid: {UUID}}}]\n")
    p = run_cli("probe", "--simulate", str(f))
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"gpudaemon: error: profile {f}: gpus.0: uuid: only with count: 1 (2 GPUs cannot share one)"
    ]
