"""The simulation profile: its shape (GPUs, MIG layouts and changes, faults, NVML
latencies), its validation (a field that would be ignored is an error), and loading a
built-in profile or a YAML file."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BeforeValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gpudaemon.backends import migprofiles
from gpudaemon.backends.base import (
    ENERGY_CALLS,
    GPM_CALLS,
    GPM_MIG_CALLS,
    HEALTH_CALLS,
    NVLINK_CALL,
    RETIRED_PAGES_CALLS,
    SAMPLE_CALLS,
)
from gpudaemon.backends.simulated.faults import FaultSpec
from gpudaemon.backends.simulated.fields import Number, _not_bool, _reject_unused, _Strict
from gpudaemon.errors import ProfileError
from gpudaemon.model import MIB
from gpudaemon.textfile import read_text_file

BUILTIN_PROFILES = ("dgx-h100", "a100-mig", "mixed", "h100-measured")
_GPU_UUID = re.compile(r"GPU-[0-9A-Fa-f]{8}(-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}")

# The calls a latency profile may name: the per-sample and energy calls the agent makes
# on its hot paths, and the inventory calls measured on real hardware (not charged).
_NVML_CALLS = (
    frozenset(SAMPLE_CALLS)
    | frozenset(ENERGY_CALLS)
    | frozenset(HEALTH_CALLS)
    | frozenset(RETIRED_PAGES_CALLS)
    | frozenset(GPM_CALLS)
    | frozenset(GPM_MIG_CALLS)
    | {
        "nvmlGpmQueryDeviceSupport",
        NVLINK_CALL,
        "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetPciInfo",
    }
)


class UtilizationSpec(_Strict):
    pattern: Literal["steady", "sine", "idle", "busy", "random-walk"] = "steady"
    mean: Annotated[Number, Field(ge=0.0, le=1.0)] = 0.5
    amplitude: Annotated[Number, Field(ge=0.0, le=1.0)] = 0.2
    period_s: Annotated[Number, Field(gt=0, le=1e9)] = 300.0
    noise: Annotated[Number, Field(ge=0.0, le=1.0)] = 0.05

    @model_validator(mode="after")
    def _no_ignored_fields(self) -> UtilizationSpec:
        """A field the pattern does not use is an error, not silently ignored."""
        unused = self.model_fields_set - _PATTERN_FIELDS[self.pattern] - {"pattern"}
        _reject_unused(unused, f"pattern {self.pattern}")
        return self


# What each utilization pattern reads (busy's mean sets the memory in use).
_PATTERN_FIELDS = {
    "steady": {"mean", "noise"},
    "sine": {"mean", "amplitude", "period_s", "noise"},
    "idle": {"noise"},
    "busy": {"mean", "noise"},
    "random-walk": {"mean", "noise"},
}


class MigSpec(_Strict):
    capable: bool = True
    enabled: bool = False
    instances: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> MigSpec:
        if self.enabled and not self.capable:
            raise ValueError("enabled: true needs capable: true")
        if self.instances and not self.enabled:
            raise ValueError("instances need enabled: true (they would be ignored)")
        return self


def mig_layout_error(name: str, memory_total_mib: int, instances: tuple[str, ...]) -> str | None:
    table = migprofiles.profiles_for(name, memory_total_mib)
    if table is None:
        return f"MIG is simulated only for A100, H100 and H200 GPUs, not {name!r}"
    return migprofiles.layout_error(table, instances)


class MigChangeSpec(_Strict):
    """A MIG layout change at run time, as `nvidia-smi mig -dci/-dgi/-cgi` makes it."""

    gpu: Annotated[int, Field(ge=0), BeforeValidator(_not_bool)]
    after_s: Annotated[Number, Field(ge=0.0, le=1e9)] = 0.0
    instances: tuple[str, ...] = ()  # empty: every instance destroyed


class GpuSpec(_Strict):
    name: Annotated[str, Field(min_length=1)]
    memory_total_mib: Annotated[int, Field(gt=0, le=1 << 30), BeforeValidator(_not_bool)]
    compute_capability: str
    uuid: str | None = None
    count: Annotated[int, Field(ge=1, le=1024)] = 1
    nvlink_links: Annotated[int, Field(ge=0, le=1024), BeforeValidator(_not_bool)] | None = None
    power_max_watts: Annotated[Number, Field(gt=0, le=1e5)] = 300.0
    sm_clock_max_mhz: Annotated[Number, Field(gt=0, le=1e5)] = 1980.0
    memory_clock_mhz: Annotated[Number, Field(gt=0, le=1e5)] = 2619.0
    ecc: bool = True  # False: ECC unsupported, so its fields are absent
    utilization: UtilizationSpec = UtilizationSpec()
    mig: MigSpec = MigSpec(capable=False)
    faults: tuple[FaultSpec, ...] = ()
    # GPM (SM / tensor / DRAM activity, NVLink and PCIe bytes): Hopper (9.0) and later
    # have it; false turns it off (a GPU or driver without it); absent: by the GPU.
    gpm: Annotated[bool, Field(strict=True)] | None = None
    # The real backend's own work per GPU sample around its NVML calls (Python, pynvml's
    # ctypes), in microseconds. The simulator's own computing counts towards it, so a
    # sample costs what a real one costs, however fast or slow the simulator is.
    sample_overhead_us: Annotated[Number, Field(ge=0.0, le=1e6)] = 0.0
    # NVML call name -> its mean latency in microseconds on this GPU (absent: free).
    nvml_latency_us: dict[str, Annotated[Number, Field(ge=0.0, le=1e6)]] = {}  # noqa: RUF012 (pydantic copies it)

    @field_validator("nvml_latency_us")
    @classmethod
    def _known_calls(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(v) - _NVML_CALLS)
        if unknown:
            raise ValueError(
                f"unknown NVML call {', '.join(unknown)}; known: {', '.join(sorted(_NVML_CALLS))}"
            )
        return v

    @field_validator("compute_capability", mode="before")
    @classmethod
    def _cc(cls, v: Any) -> str:
        s = str(v)
        major, sep, minor = s.partition(".")
        if not (sep and major.isdigit() and minor.isdigit()):
            raise ValueError(f"must look like '9.0', got {s!r}")
        return s

    @field_validator("uuid")
    @classmethod
    def _uuid_form(cls, v: str | None) -> str | None:
        if v is not None and not _GPU_UUID.fullmatch(v):
            raise ValueError(f"must look like an NVML UUID 'GPU-<8-4-4-4-12 hex>', got {v!r}")
        return v

    @model_validator(mode="after")
    def _no_ignored_fields(self) -> GpuSpec:
        if self.gpm and int(self.compute_capability.split(".")[0]) < 9:
            raise ValueError(
                f"gpm: true needs compute_capability 9.0 or later (GPM is Hopper+), "
                f"not {self.compute_capability}"
            )
        if self.uuid is not None and self.count != 1:
            raise ValueError(f"uuid: only with count: 1 ({self.count} GPUs cannot share one)")
        for i, f in enumerate(self.faults):
            if f.gpu is not None:
                raise ValueError(
                    f"faults[{i}]: gpu: per-GPU faults apply to every GPU of this entry; "
                    "name a GPU only in the top-level faults list"
                )
            why = _fault_misfit(f, self)
            if why:
                raise ValueError(f"faults[{i}]: {why}")
        if self.mig.enabled:
            why = mig_layout_error(self.name, self.memory_total_mib, self.mig.instances)
            if why:
                raise ValueError(f"mig.instances: {why}")
        return self


class Profile(_Strict):
    driver_version: str = "550.54.15"
    # The simulated node's boot ID: change it to simulate a reboot (every GPU reset),
    # which clears the faults the agent remembers across its restarts.
    boot_id: Annotated[str, Field(min_length=1, max_length=64)] = "simulated-boot-1"
    cuda_version: str = "12.4"
    seed: Annotated[int, Field(ge=0, le=2**64 - 1), BeforeValidator(_not_bool)] | None = None
    gpus: Annotated[tuple[GpuSpec, ...], Field(min_length=1)]
    faults: tuple[FaultSpec, ...] = ()
    mig_changes: tuple[MigChangeSpec, ...] = ()
    source: str = "inline"

    @field_validator("cuda_version", "driver_version", mode="before")
    @classmethod
    def _as_str(cls, v: Any) -> str:
        return str(v)

    @field_validator("cuda_version")
    @classmethod
    def _cuda(cls, v: str) -> str:
        major, _, minor = v.partition(".")
        if not major.isdigit() or not (minor == "" or minor.isdigit()):
            raise ValueError(f"must look like '12.4', got {v!r}")
        return v

    @model_validator(mode="after")
    def _faults_name_a_gpu(self) -> Profile:
        count = sum(g.count for g in self.gpus)
        for i, f in enumerate(self.faults):
            if f.gpu is None or not 0 <= f.gpu < count:
                raise ValueError(
                    f"faults[{i}]: node-level faults need 'gpu' set to an index 0..{count - 1}"
                )
        specs = [g for g in self.gpus for _ in range(g.count)]
        for i, f in enumerate(self.faults):
            why = _fault_misfit(f, specs[f.gpu]) if f.gpu is not None else None
            if why:
                raise ValueError(f"faults[{i}]: {why} on GPU {f.gpu}")
        for i, c in enumerate(self.mig_changes):
            if c.gpu >= count:
                raise ValueError(f"mig_changes[{i}]: gpu {c.gpu} is not one of 0..{count - 1}")
            g = specs[c.gpu]
            if not g.mig.enabled:
                raise ValueError(f"mig_changes[{i}]: GPU {c.gpu} needs mig.enabled: true")
            why = mig_layout_error(g.name, g.memory_total_mib, c.instances)
            if why:
                raise ValueError(f"mig_changes[{i}].instances: {why}")
        seen: set[str] = set()
        for g in self.gpus:
            if g.uuid is not None:
                if g.uuid.lower() in seen:
                    raise ValueError(f"gpus: uuid {g.uuid} appears twice")
                seen.add(g.uuid.lower())
        return self


def has_gpm(spec: GpuSpec) -> bool:
    """GPM as NVML would report it: Hopper and later, unless the profile turns it off."""
    return spec.gpm if spec.gpm is not None else int(spec.compute_capability.split(".")[0]) >= 9


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name, or a YAML profile file by path."""
    if name_or_path in BUILTIN_PROFILES:
        text = (
            resources.files("gpudaemon.backends") / "profiles" / f"{name_or_path}.yaml"
        ).read_text()
        source = name_or_path
    else:
        path = Path(name_or_path)
        if not path.exists():
            raise ProfileError(
                f"unknown simulation profile {name_or_path!r}: not a built-in "
                f"({', '.join(BUILTIN_PROFILES)}) and no such file"
            )
        # Only a regular file of at most 1 MiB (not /dev/zero, a FIFO or a terminal).
        text = read_text_file(str(path), "profile", MIB, ProfileError)
        source = str(path)
    return parse_profile(text, source)


def parse_profile(text: str, source: str = "inline") -> Profile:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ProfileError(f"profile {source}: invalid YAML: {_one_line(str(e))}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"profile {source}: expected a mapping with a 'gpus' list")
    try:
        return Profile.model_validate({**data, "source": source})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise ProfileError(f"profile {source}: {loc + ': ' if loc else ''}{msg}") from None


def _one_line(s: str) -> str:
    return " ".join(s.split())


def _ampere(spec: GpuSpec) -> bool:
    return int(spec.compute_capability.split(".")[0]) >= 8


def _fault_misfit(f: FaultSpec, spec: GpuSpec) -> str | None:
    """Why this GPU cannot give the fault's signal (as a real one would not), or None."""
    if f.kind == "ecc" and not spec.ecc:
        return "an ecc fault needs ecc: true"
    if f.kind == "row_remap" and not (spec.ecc and _ampere(spec)):
        return "a row_remap fault needs ecc: true and compute_capability 8.0 or later"
    if f.kind == "nvlink_errors" and not (spec.nvlink_links and f.link < spec.nvlink_links):
        return f"an nvlink_errors fault on link {f.link} needs nvlink_links above {f.link}"
    return None
